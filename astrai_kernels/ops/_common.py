"""Argument checks, the ``[A, B, V]`` row view, and the autograd node shared by the losses."""

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_logits(logits, name="logits"):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")


def check_target(target, logits, ignore_index=None, name="target", where=None):
    """Type, shape and device of ``target``, and (one host sync) that its entries are in range.

    ``where`` (a bool tensor of target's shape) limits the range check to the rows it selects.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{name} must have shape {tuple(logits.shape[:-1])} (logits' shape "
                         f"without V), got {tuple(target.shape)}")
    if target.device != logits.device:
        raise ValueError(f"{name} is on {target.device} but logits are on {logits.device}")
    vocab = logits.shape[-1]
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


def check_positive(value, name):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_in_range(value, name, low, high):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (low <= value <= high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return float(value)


def check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_index(value, name):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


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


def flat_target(target):
    return target.reshape(-1).contiguous()


def scale_grad_inplace(grad, grad_output):
    """``grad *= grad_output`` for a forward-computed gradient of a scalar loss.

    Skipped when the upstream gradient is exactly 1: on CUDA a Triton kernel reads it on the
    device (no host sync); on CPU it is one scalar read.
    """
    if grad.is_cuda:
        from ._backend import backend_module

        backend_module("triton").scale_grad_(grad, grad_output)
    elif grad_output.item() != 1.0:
        grad.mul_(grad_output.to(grad.dtype))


class AttachGrad(torch.autograd.Function):
    """Give ``value`` (computed without autograd) the gradient ``grad`` w.r.t. ``logits``.

    ``grad`` was computed in the forward for an upstream gradient of 1; backward only rescales
    it in place, so ``loss.backward()`` costs no extra pass over it. A second backward through
    the same graph after a rescale fails autograd's saved-tensor version check (as it should).
    """

    @staticmethod
    def forward(ctx, logits, value, grad):
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        if torch.compiler.is_compiling():
            return grad * grad_output.to(grad.dtype), None, None
        scale_grad_inplace(grad, grad_output)
        return grad, None, None
