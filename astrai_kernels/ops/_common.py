"""Argument checks, the ``[A, B, V]`` row view, and the autograd node shared by the losses."""

import math
from typing import NamedTuple, Tuple

import torch

from ..options.scalars import check_bool

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_logits(logits, name="logits", allow_empty_vocab=False):
    """Type, dtype and shape ``[..., V]`` of ``logits``; ``V >= 1`` unless
    ``allow_empty_vocab`` (a rank's vocabulary shard under ``process_group=``, which may be
    empty: the group's vocabulary is checked on the sizes of all shards)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.device.type == "meta":
        raise ValueError(f"{name} are meta tensors (no data): the losses need real tensors; "
                         f"for shapes only, trace them with torch.compile or FakeTensorMode")
    if logits.dim() < 1:
        raise ValueError(f"{name} must have shape [..., V], got a 0-d tensor")
    if logits.shape[-1] < 1 and not allow_empty_vocab:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")


class LogitsShape(NamedTuple):
    """What the checks read of the logits, which the fused head and a vocabulary shard never
    hold whole: the rows' shape, the (whole) vocabulary, the device, and the argument that holds
    the rows (``logits``, or ``hidden`` for the fused head), which an error names."""
    lead: Tuple[int, ...]
    vocab: int
    device: torch.device
    rows_name: str = "logits"

    @classmethod
    def of(cls, logits: torch.Tensor) -> "LogitsShape":
        return cls(tuple(logits.shape[:-1]), logits.shape[-1], logits.device)

    @classmethod
    def of_head(cls, hidden: torch.Tensor, weight: torch.Tensor) -> "LogitsShape":
        """The logits ``hidden @ weight.T`` would have."""
        return cls(tuple(hidden.shape[:-1]), weight.shape[0], hidden.device, "hidden")


def _slice_text(name, dim, piece):
    """``name[:, :-1]``: ``piece`` along ``dim``, every dim before it whole."""
    return f"{name}[{':, ' * dim}{piece}]"


def target_shape_hint(target_shape, logits: LogitsShape, name="target"):
    """How to fix a ``target`` whose shape is not the logits' rows, where the shapes show it:
    torch's class-second layout, or targets one position off along one dim (the next-token
    shift); "" where they show nothing."""
    target_shape, lead = tuple(target_shape), logits.lead
    full = lead + (logits.vocab,)
    if logits.rows_name == "logits" and len(full) >= 3 and full[:1] + full[2:] == target_shape:
        return (": this looks like F.cross_entropy's [N, V, ...] layout: pass "
                "logits.movedim(1, -1) (here the classes are the last dim)")
    if len(target_shape) != len(lead):
        return ""
    differ = [d for d, (a, b) in enumerate(zip(lead, target_shape)) if a != b]
    if len(differ) != 1:
        return ""
    dim = differ[0]
    rows = logits.rows_name
    if lead[dim] == target_shape[dim] + 1:
        return (f": one position more in {rows} than in {name} along dim {dim}; for next-token "
                f"targets drop the last position, shift: {_slice_text(rows, dim, ':-1')}")
    if lead[dim] + 1 == target_shape[dim]:
        return (f": one position more in {name} than in {rows} along dim {dim}; for next-token "
                f"targets drop the first token, shift: {_slice_text(name, dim, '1:')}")
    return ""


def check_target(target, logits: LogitsShape, ignore_index=None, name="target", where=None):
    """Type, shape and device of ``target``, and (one host sync) that its entries are in range.

    ``where`` (a bool tensor of target's shape) limits the range check to the rows it selects.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        if target.is_floating_point() and tuple(target.shape) == logits.lead + (logits.vocab,):
            raise TypeError(f"{name} must be int32 or int64 class indices, got {target.dtype} "
                            f"with the logits' shape [..., V]: probability (soft) targets are "
                            f"not supported")
        raise TypeError(f"{name} must be int32 or int64, got {target.dtype}")
    if tuple(target.shape) != logits.lead:
        raise ValueError(f"{name} must have shape {logits.lead} (logits' shape "
                         f"without V), got {tuple(target.shape)}"
                         f"{target_shape_hint(target.shape, logits, name)}")
    if target.device != logits.device:
        raise ValueError(f"{name} is on {target.device} but logits are on {logits.device}")
    vocab = logits.vocab
    bad = (target < 0) | (target >= vocab)
    if ignore_index is not None:
        bad &= target != ignore_index
    if where is not None:
        bad &= where
    allowed = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
    if torch.compiler.is_compiling():
        # A data-dependent branch would break the graph; assert on the device instead.
        torch._assert_async(~bad.any(), f"{name} holds values outside [0, {vocab}){allowed}")
        return
    if target.numel() and bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise ValueError(f"{name} holds {first}, outside [0, {vocab}){allowed}")


def check_inplace(logits, inplace_backward):
    """``inplace_backward`` is a bool, and with it the logits' elements do not overlap."""
    if check_bool(inplace_backward, "inplace_backward"):
        check_no_overlap(logits)


def check_no_overlap(logits, name="logits"):
    """Raise unless no two elements of ``logits`` share memory (for ``inplace_backward``).

    A gradient written over logits whose elements alias (a stride-0 ``expand``, overlapping
    ``as_strided`` windows) would overwrite values still to be read and sum entries that
    autograd keeps apart. The test is sufficient, not necessary: dims sorted by stride, each
    stride must exceed the span of the smaller ones; exotic interleaved layouts that do not
    overlap but fail it are refused too. Under ``torch.compile`` nothing is written in place
    (:func:`inplace_grad_owner`), so there is nothing to check (and shapes may be symbolic).
    """
    if torch.compiler.is_compiling():
        return
    dims = sorted((stride, size) for size, stride in zip(logits.shape, logits.stride())
                  if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            raise ValueError(
                f"inplace_backward=True needs {name} whose elements do not overlap in memory "
                f"(got shape {tuple(logits.shape)}, strides {tuple(logits.stride())}, e.g. from "
                f"expand or as_strided): the gradient cannot be written over them; pass "
                f"inplace_backward=False or a contiguous copy")
        span += stride * (size - 1)


def check_per_row(tensor, name, shape, device, allow_none=False):
    """A float tensor of exactly ``shape`` on ``device`` (or None when allowed)."""
    if tensor is None:
        if allow_none:
            return None
        raise ValueError(f"{name} is required")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {device}")
    return tensor


def rows_view(logits):
    """A ``[A, B, V]`` view of ``logits [..., V]`` sharing its storage when strides allow.

    Adjacent leading dims merge when ``stride[i] == stride[i + 1] * size[i + 1]``; leading
    dims that form more than two such groups (rare: a slice of a 4-D tensor) are copied once.
    ``logits[:, :-1]`` of a contiguous ``[B, T, V]`` needs no copy.
    """
    vocab = logits.shape[-1]
    dims = [(size, stride) for size, stride in zip(logits.shape[:-1], logits.stride()[:-1])
            if size != 1]
    groups = []
    for size, stride in dims:
        if groups and groups[-1][1] == stride * size:
            groups[-1] = (groups[-1][0] * size, stride)
        else:
            groups.append((size, stride))
    n_rows = math.prod(logits.shape[:-1])
    if len(groups) <= 1:
        return logits.reshape(1, n_rows, vocab) if n_rows else logits.reshape(1, 0, vocab)
    if len(groups) == 2:
        return logits.reshape(groups[0][0], groups[1][0], vocab)
    return logits.reshape(1, n_rows, vocab)


# Backward nodes of the views autograd records between a tensor and its base.
_VIEW_NODES = frozenset({"SliceBackward0", "SelectBackward0", "ViewBackward0", "AliasBackward0",
                         "UnsafeViewBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                         "SqueezeBackward1", "SqueezeBackward2", "AsStridedBackward0"})


def _slice_starts(view, base):
    """Per-dim start indices when ``view`` is ``base[s0:e0, s1:e1, ...]`` of a contiguous
    ``base`` (same rank, same strides), else None."""
    if view.dim() != base.dim() or base.numel() == 0 or not base.is_contiguous():
        return None
    offset = view.storage_offset() - base.storage_offset()
    starts = []
    for size, stride, base_size, base_stride in zip(view.shape, view.stride(), base.shape,
                                                    base.stride()):
        if size != 1 and stride != base_stride:
            return None
        start = (offset // base_stride) % base_size if base_stride else 0
        if start + size > base_size:
            return None
        starts.append(start)
    if sum(start * stride for start, stride in zip(starts, base.stride())) != offset:
        return None
    return tuple(starts)


def _reaches_through_views(view, base):
    """True when autograd's path from ``view`` back to ``base`` is views only."""
    target = torch.autograd.graph.get_gradient_edge(base).node
    node = view.grad_fn
    while node is not None and node is not target:
        if type(node).__name__ not in _VIEW_NODES:
            return False
        node = node.next_functions[0][0]
    return node is target


def inplace_grad_owner(logits, logits_rows):
    """``(owner, starts)`` for writing the gradient over ``logits_rows`` (``rows_view(logits)``),
    or None when that cannot save memory: under ``torch.compile`` (the ops are functional) or
    when ``logits_rows`` is a copy.

    ``owner`` is the tensor autograd is given the gradient of: ``logits`` itself, or, when
    ``logits`` is a slice of a contiguous tensor that requires grad (``x[:, :-1]``) reached
    through views only, that tensor, with ``starts`` the slice's position. Its gradient is the
    kernel's gradient in the slice and zero elsewhere, so handing autograd the whole buffer
    (``finish_inplace_grad``) spares the zero-filled copy the slice's backward would allocate.
    """
    if torch.compiler.is_compiling() or logits_rows.data_ptr() != logits.data_ptr():
        return None
    base = logits._base
    if base is None or not base.requires_grad or logits.grad_fn is None:
        return logits, None
    starts = _slice_starts(logits, base)
    if starts is None or not _reaches_through_views(logits, base):
        return logits, None
    return base, starts


def finish_inplace_grad(owner, starts, shape):
    """The gradient to hand autograd for ``owner`` once the slice at ``starts`` (of
    ``shape``) holds the kernel's gradient: the rest of ``owner`` is zeroed (its values are
    destroyed, as the slice's are)."""
    if starts is not None:
        with torch.no_grad():
            index = []
            for start, size, full in zip(starts, shape, owner.shape):
                for low, high in ((0, start), (start + size, full)):
                    if high > low:
                        owner[(*index, slice(low, high))].zero_()
                index.append(slice(start, start + size))
    # the C++ and Triton kernels write through the data pointer: tell autograd the values
    # changed, so a node that saved them fails its version check instead of reading gradients
    torch.autograd.graph.increment_version(owner)
    return owner.detach()


def grad_for_owner(grad, owner, starts):
    """A new gradient ``grad`` (of the slice at ``starts``) as one of ``owner``'s shape."""
    if starts is None:
        return grad
    full = torch.zeros_like(owner)
    full[tuple(slice(start, start + size) for start, size in zip(starts, grad.shape))] = grad
    return full


def flat_target(target):
    return target.reshape(-1).contiguous()


def dense_grad(grad, like):
    """An upstream per-row gradient as a contiguous float32 vector (autograd may pass None:
    zeros like ``like``)."""
    if grad is None:
        return torch.zeros_like(like)
    return grad.reshape(-1).float().contiguous()


def scale_grad_inplace(grad, grad_output):
    """``grad *= grad_output`` for a forward-computed gradient of a scalar loss.

    Skipped when the upstream gradient is exactly 1: on CUDA a Triton kernel reads it on the
    device (no host sync); on CPU it is one scalar read.
    """
    if grad.is_cuda:
        from ..kernels.registry import backend_module

        backend_module("triton").scale_grad_(grad, grad_output)
    elif grad_output.item() != 1.0:
        grad.mul_(grad_output.to(grad.dtype))


def overwrite_columns_(dst, dim, index, src):
    """``dst.scatter_(dim, index, src)`` with ``src`` cast to ``dst``'s dtype; a 16-bit float
    ``dst`` on CPU through an ``int16`` view of the same bytes (the values are copied, not
    computed on): torch's CPU ``scatter_`` into bfloat16 converts the whole ``dst`` to float32
    and back, 464 ms against 1.3 ms for a [2048, 32768] bf16 gradient and 64 columns a row
    (1 thread, Intel Xeon)."""
    src = src.to(dst.dtype)
    if dst.device.type == "cpu" and dst.dtype in (torch.bfloat16, torch.float16):
        dst.view(torch.int16).scatter_(dim, index, src.view(torch.int16))
        return dst
    return dst.scatter_(dim, index, src)


def graph_is_retained():
    """True inside a backward that keeps the graph (``retain_graph=True`` or
    ``create_graph=True``): the node may run again, so saved buffers must stay unchanged."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


def scale_saved_grad(grad, grad_output):
    """``grad * grad_output`` for a gradient saved by a forward: in place when the node cannot
    run again, a new tensor when the graph is retained or compiled (``grad`` must survive)."""
    if torch.compiler.is_compiling() or graph_is_retained():
        return grad * grad_output.to(grad.dtype)
    scale_grad_inplace(grad, grad_output)
    return grad


def refuse_double_backward(op, alternative):
    """Raise when a custom backward runs under ``create_graph=True`` (the only time grad mode
    is on inside one): its gradient comes from a kernel (or was computed in the forward), so
    autograd would take it as a constant and a second-order gradient through ``op`` (a
    gradient penalty, ``torch.autograd.functional.hessian``) would be silently wrong.
    ``alternative`` (or None) names a twice-differentiable PyTorch equivalent."""
    if torch.is_grad_enabled():
        instead = f"{alternative}, or " if alternative else ""
        raise RuntimeError(
            f"astrai_kernels.{op} has no double backward: its gradient is computed by a fused "
            f"kernel, not by differentiable PyTorch ops, so a gradient taken with "
            f"create_graph=True cannot be differentiated again. For that term use {instead}"
            f"{op}(..., backend='reference') (plain PyTorch, holds the full logits)")


class AttachGrad(torch.autograd.Function):
    """Give ``value`` (computed without autograd) the gradient ``grad`` w.r.t. ``logits``;
    ``op`` and ``alternative`` name the op and a twice-differentiable equivalent for the error
    of a double backward (:func:`refuse_double_backward`).

    ``grad`` was computed in the forward for an upstream gradient of 1. In the usual single
    backward it is rescaled in place and handed to autograd as is (no extra pass over it, no
    allocation; ``x.grad`` becomes that buffer). When the graph is retained (``retain_graph``,
    ``create_graph``) this node may run again and ``grad`` must survive, so that backward
    returns ``grad * grad_output`` as a new tensor instead; a later backward that frees the
    graph takes the in-place path again.
    """

    @staticmethod
    def forward(ctx, logits, value, grad, op, alternative):
        ctx.save_for_backward(grad)
        ctx.op, ctx.alternative = op, alternative
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        refuse_double_backward(ctx.op, ctx.alternative)
        (grad,) = ctx.saved_tensors
        return scale_saved_grad(grad, grad_output), None, None, None, None
