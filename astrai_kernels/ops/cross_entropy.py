"""Masked cross-entropy with the gradient produced in the forward pass.

Contract (docs/architecture.md, "Ops"): equals ``F.cross_entropy(z.float(), y, ignore_index,
reduction, label_smoothing)`` over the flattened rows, ``z = softcap * tanh(logit_scale * logits /
softcap)`` when ``softcap`` is set, else ``z = logit_scale * logits``, plus ``z_loss * lse**2`` per
counted row. With ``reduction`` ``mean`` or
``sum`` and logits requiring grad, the forward reads the logits once and writes the gradient
once; backward only rescales it. ``inplace_backward=True`` writes that gradient over the
logits during the forward (their values are destroyed). ``reduction="none"`` recomputes in
the backward with the per-row upstream gradient.

``linear_cross_entropy``: the same from the hidden states and the LM head, never the logits:
``ops/head.py``'s walk of the ``cross_entropy_forward`` primitive over row chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .. import reference

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
from ..distributed import dtensor, vocab_parallel, vocab_shard
from ..kernels import library
from ..kernels.primitives import CrossEntropyArgs, args_of
from ..kernels.registry import backend_module, resolve_backend
from ..options.scalars import check_choice, check_in_range, check_index, check_positive
from ._common import (
    AttachGrad,
    LogitsShape,
    check_inplace,
    check_logits,
    check_target,
    finish_inplace_grad,
    flat_target,
    grad_for_owner,
    graph_is_retained,
    inplace_grad_owner,
    refuse_double_backward,
    rows_view,
)
from .door import Checked, Door
from .head import (
    AttachHeadGrads,
    KeptChunk,
    check_head,
    grad_or_none,
    head_any_grad,
    head_needs,
    head_walk,
    keeping_last_chunk,
    reference_on_logits,
)
from .reduction import (
    check_zero_normalizer,
    checked_normalizer,
    inverse_or_zero,
    loss_grad_scale,
    reduce_loss,
)

REDUCTIONS = ("mean", "sum", "none")
# named by the error of a double backward (refuse_double_backward)
TORCH_EQUIVALENT = "torch.nn.functional.cross_entropy(logits.float(), target, ...)"


@dataclass(frozen=True)
class CrossEntropyParams(CrossEntropyArgs):
    """The kernel's parameters (``kernels/primitives.py``) and the op's own."""
    reduction: str
    inplace_backward: bool
    backend: str


class _CrossEntropyRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses, gradient recomputed with per-row upstream grads.

    ``base`` is None, or (``inplace_backward``) the tensor ``logits`` slice that autograd is
    given the gradient of instead (``inplace_grad_owner``); ``logits`` are read in the backward.
    """

    @staticmethod
    def forward(ctx, logits, base, target_flat, params, starts):
        loss, _, _ = _call(rows_view(logits), target_flat, params, None)
        ctx.save_for_backward(logits, target_flat)
        ctx.params, ctx.starts = params, starts
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("cross_entropy", TORCH_EQUIVALENT)
        logits, target_flat = ctx.saved_tensors
        params = ctx.params
        row_scale = grad_rows.reshape(-1).float().contiguous()
        logits_rows = rows_view(logits)
        # a retained graph may run this again: then the logits must survive
        if params.inplace_backward and not graph_is_retained():
            _call(logits_rows, target_flat, params, row_scale, logits_rows)
            if ctx.starts is None:
                return finish_inplace_grad(logits, None, logits.shape), None, None, None, None
            grad_base = finish_inplace_grad(logits._base, ctx.starts, logits.shape)
            return None, grad_base, None, None, None
        _, _, grad = _call(logits_rows, target_flat, params, row_scale)
        grad = grad.view(logits.shape)
        if ctx.starts is None:
            return grad, None, None, None, None
        return None, grad_for_owner(grad, logits._base, ctx.starts), None, None, None


def _call(logits_rows, target_flat, params, grad_scale, grad_out=None):
    """Run the primitive; ``grad_out`` set means write the gradient there (in-place path)."""
    if grad_out is not None:
        loss, lse = backend_module(params.backend).cross_entropy_forward(
            logits_rows, target_flat, grad_scale, args_of(params, CrossEntropyArgs), grad_out)
        return loss, lse, grad_out
    return library.cross_entropy_forward(logits_rows, target_flat, grad_scale, params,
                                          grad_scale is not None, params.backend)


def checked_params(logits: LogitsShape, target, ignore_index, reduction, label_smoothing, z_loss,
                   softcap, normalizer, inplace_backward, backend, logit_scale=1.0):
    """Validate every argument but the logits tensor itself (the fused head and a vocabulary
    shard have none); ``(params, normalizer as a device tensor or None)``."""
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, logits, ignore_index)
    check_choice(reduction, "reduction", REDUCTIONS)
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, 1.0)
    z_loss = check_in_range(z_loss, "z_loss", 0.0, float("inf"))
    softcap_value = 0.0 if softcap is None else check_positive(softcap, "softcap")
    logit_scale = check_in_range(logit_scale, "logit_scale", -math.inf, math.inf)
    normalizer_t = checked_normalizer(normalizer, reduction, logits.device)
    if normalizer_t is not None:
        check_zero_normalizer(normalizer_t, target != ignore_index)
    params = CrossEntropyParams(
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap_value, logit_scale=logit_scale, reduction=reduction,
        inplace_backward=inplace_backward, backend=resolve_backend(backend, logits.device))
    return params, normalizer_t


class CrossEntropyCall(NamedTuple):
    """``cross_entropy``'s arguments, as its door hands them to the routes."""
    logits: Tensor
    target: Tensor
    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    logit_scale: float
    normalizer: Union[float, Tensor, None]
    inplace_backward: bool
    backend: str
    process_group: Optional["ProcessGroup"]
    check_consistency: bool


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    normalizer: Union[float, torch.Tensor, None] = None,
    inplace_backward: bool = False,
    backend: str = "auto",
    process_group: Optional["ProcessGroup"] = None,
    check_consistency: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``logits [..., V]`` against ``target [...]``, float32.

    ``logit_scale`` (any finite number; 1.0 is off) multiplies the logits before the soft cap
    and the loss, as the fused head's ``logit_scale`` does: ``z = softcap * tanh(logit_scale *
    logits / softcap)``, else ``z = logit_scale * logits``; the gradient carries the factor.

    ``normalizer`` (``reduction="mean"`` only: a number or 1-element tensor, e.g. the global
    count of target tokens across micro-batches) replaces the local count of non-ignored
    rows. It must be a finite number > 0, or 0 when every row is ignored (an empty
    micro-batch: a loss of 0.0 and a zero gradient, never NaN); the same rule holds for every
    op's ``normalizer``. A bad tensor normalizer raises on CPU; on CUDA it trips an
    asynchronous device assert (no host sync). Every row ignored gives 0.0 and a zero
    gradient.

    ``inplace_backward=True`` writes the gradient over the logits (their values are
    destroyed) so the peak memory is the logits alone: for ``mean``/``sum`` in the forward,
    for ``none`` in the backward. When ``logits`` is a slice of a contiguous tensor that
    requires grad (``x[:, :-1]``), the whole of that tensor's buffer becomes its gradient
    (the rest of it zeroed), so no ``x``-sized zero-filled gradient is allocated. Logits whose
    elements overlap in memory (``expand``) are refused. It saves nothing (the gradient is a
    new buffer, the logits are kept) under ``torch.compile``, when the graph is retained
    (``retain_graph=True``: a later backward needs the logits), and for leading dims that
    cannot be viewed as ``[A, B, V]`` without a copy.

    ``process_group`` (vocabulary parallel): ``logits`` hold this rank's contiguous shard of the
    vocabulary (shards in rank order), ``target`` global ids; every rank gets the
    full-vocabulary loss and its shard's gradient (``distributed/vocab_parallel.py``).
    ``check_consistency`` (with ``process_group``): every rank must pass the same rows and targets
    (only the vocabulary shard differs); the shard sizes' all-gather also carries each rank's row
    count (always compared: a mismatch would hang) and, when True (the default), the sum and
    count of its counted targets, so ranks that disagree raise ``ValueError`` on every rank.
    """
    return CROSS_ENTROPY.enter(CrossEntropyCall(
        logits=logits, target=target, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, logit_scale=logit_scale,
        normalizer=normalizer, inplace_backward=inplace_backward, backend=backend,
        process_group=process_group, check_consistency=check_consistency))


def _check(call: CrossEntropyCall) -> Checked:
    logits = call.logits
    check_logits(logits)
    check_inplace(logits, call.inplace_backward)
    return Checked(*checked_params(
        LogitsShape.of(logits), call.target, call.ignore_index, call.reduction,
        call.label_smoothing, call.z_loss, call.softcap, call.normalizer,
        call.inplace_backward, call.backend, call.logit_scale))


def _reference(call: CrossEntropyCall, checked: Checked):
    params, normalizer_t = checked
    logits, target = call.logits.float(), call.target
    reduction = params.reduction if normalizer_t is None else "sum"
    loss = reference.cross_entropy(logits, target, params.ignore_index, reduction,
                                   params.label_smoothing, params.z_loss, call.softcap,
                                   logit_scale=params.logit_scale)
    return loss if normalizer_t is None else loss * inverse_or_zero(normalizer_t)


def _local(call: CrossEntropyCall, checked: Checked):
    logits, target = call.logits, call.target
    params, normalizer_t = checked
    reduction = params.reduction
    logits_rows, target_flat = rows_view(logits), flat_target(target)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if reduction == "none":
        if not needs_grad:
            loss, _, _ = _call(logits_rows, target_flat, params, None)
            return loss.view(target.shape)
        inplace = inplace_grad_owner(logits, logits_rows) if params.inplace_backward else None
        if inplace is None:
            params = replace(params, inplace_backward=False)
            inplace = (logits, None)
        base, starts = inplace
        return _CrossEntropyRows.apply(logits, None if starts is None else base, target_flat,
                                       params, starts).view(target.shape)
    grad_scale = loss_grad_scale(target_flat, params, normalizer_t)
    if not needs_grad:
        loss, _, _ = _call(logits_rows, target_flat, params, None)
        return reduce_loss(loss, grad_scale, params)
    inplace = inplace_grad_owner(logits, logits_rows) if params.inplace_backward else None
    with torch.no_grad():
        if inplace is None:
            loss, _, grad = _call(logits_rows, target_flat, params, grad_scale)
            owner, grad = logits, grad.view(logits.shape)
        else:
            owner, starts = inplace
            loss, _, _ = _call(logits_rows, target_flat, params, grad_scale, logits_rows)
            grad = finish_inplace_grad(owner, starts, logits.shape)
        value = reduce_loss(loss, grad_scale, params)
    return AttachGrad.apply(owner, value, grad, "cross_entropy", TORCH_EQUIVALENT)


def _vocab_parallel(call: CrossEntropyCall):
    """``cross_entropy`` of a vocabulary shard (``distributed/vocab_parallel.py``)."""
    logits, target = call.logits, call.target
    if check_in_range(call.logit_scale, "logit_scale", -math.inf, math.inf) != 1.0:
        raise ValueError("logit_scale is not supported with process_group")

    def checks(layout):
        check_logits(logits, allow_empty_vocab=True)
        checked = checked_params(
            vocab_parallel.whole_logits(logits, layout), target, call.ignore_index,
            call.reduction, call.label_smoothing, call.z_loss, call.softcap,
            call.normalizer, call.inplace_backward, call.backend)
        check_inplace(logits, checked[0].inplace_backward)
        return checked

    layout, (params, normalizer_t) = vocab_parallel.agreed_layout(
        "cross_entropy", call.process_group, vocab_parallel.vocab_size(logits), (logits,),
        target, call.ignore_index, call.check_consistency, checks)
    if params.backend == "reference":
        return vocab_parallel.on_gathered_logits(cross_entropy, call, layout)
    target_flat = flat_target(target)
    (rows_loss,) = vocab_shard.shard_rows(vocab_shard.CrossEntropyShard, logits, target_flat,
                                          params, layout, call.backend)
    if params.reduction == "none":
        return rows_loss.view(target.shape)
    return reduce_loss(rows_loss, loss_grad_scale(target_flat, params, normalizer_t), params)


CROSS_ENTROPY = Door(cross_entropy, ("logits", "target", "normalizer"), _check, _local,
                     _reference, _vocab_parallel, dtensor.cross_entropy)


# named by the error of a double backward (refuse_double_backward)
CE_EQUIVALENT = ("torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, "
                 "bias).float(), target, ...)")

_HEAD_WALK = head_walk("cross_entropy_forward")


def _walk(hidden_rows, weight, bias, target_flat, params, chunk_size, grad_scale=None,
          needs=(False, False, False), kept=None):
    """``(loss, grad_hidden, grad_weight, grad_bias)`` from one walk: the rows' losses and,
    with ``grad_scale``, the gradients of their scaled sum (the kernels apply the transform).
    ``kept``: the forward's last chunk, kept for the backward (``head.keeping_last_chunk``)."""
    loss, _, *grads = keeping_last_chunk(
        kept, _HEAD_WALK, hidden_rows, weight, bias, target_flat, grad_scale, params, *needs,
        chunk_size, params.backend, 1.0, 0.0)
    return (loss, *grads)


class _LinearCrossEntropyRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; backward walks the chunks with per-row grads."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, params, chunk_size):
        kept = KeptChunk.for_forward()
        loss = _walk(hidden, weight, bias, target, params, chunk_size, kept=kept)[0]
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.params, ctx.chunk_size, ctx.kept = params, chunk_size, kept
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("linear_cross_entropy", CE_EQUIVALENT)
        hidden, weight, bias, target = ctx.saved_tensors
        _, grad_hidden, grad_weight, grad_bias = _walk(
            hidden, weight, bias, target, ctx.params, ctx.chunk_size,
            grad_rows.float().contiguous(), tuple(ctx.needs_input_grad[:3]), ctx.kept)
        return (grad_or_none(grad_hidden), grad_or_none(grad_weight), grad_or_none(grad_bias),
                None, None, None)


class LinearCrossEntropyCall(NamedTuple):
    """``linear_cross_entropy``'s arguments, as its door hands them to the routes."""
    hidden: Tensor
    weight: Tensor
    target: Tensor
    bias: Optional[Tensor]
    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    logit_scale: float
    normalizer: Union[None, float, Tensor]
    chunk_size: Optional[int]
    backend: str
    process_group: Optional["ProcessGroup"]
    check_consistency: bool


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         logit_scale: float = 1.0,
                         normalizer: Union[None, float, Tensor] = None,
                         chunk_size: Optional[int] = None, backend: str = "auto",
                         process_group: Optional["ProcessGroup"] = None,
                         check_consistency: bool = True) -> Tensor:
    """Cross-entropy of ``hidden [..., H] @ weight[V, H].T + bias`` against ``target [...]``.

    Equals ``ak.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (every keyword
    means the same, ``logit_scale`` and ``softcap`` included) without holding the ``[N, V]``
    logits; float32 result. With ``process_group`` the weight (and bias) hold this rank's
    vocabulary shard and the hidden states' gradient is summed over the group
    (``distributed/vocab_parallel.py``; ``check_consistency`` as in ``cross_entropy``; no
    ``logit_scale`` there).
    """
    return LINEAR_CROSS_ENTROPY.enter(LinearCrossEntropyCall(
        hidden=hidden, weight=weight, target=target, bias=bias, ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        logit_scale=logit_scale, normalizer=normalizer, chunk_size=chunk_size, backend=backend,
        process_group=process_group, check_consistency=check_consistency))


def _check_linear(call: LinearCrossEntropyCall) -> Checked:
    hidden, weight = call.hidden, call.weight
    check_head(hidden, weight, call.bias, call.chunk_size)
    return Checked(*checked_params(
        LogitsShape.of_head(hidden, weight), call.target, call.ignore_index,
        call.reduction, call.label_smoothing, call.z_loss, call.softcap,
        call.normalizer, False, call.backend, call.logit_scale))


def _reference_linear(call: LinearCrossEntropyCall, checked: Checked):
    # the logits op applies softcap and logit_scale itself
    logits = torch.nn.functional.linear(call.hidden, call.weight, call.bias)
    return reference_on_logits(cross_entropy, call, logits)


def _local_linear(call: LinearCrossEntropyCall, checked: Checked):
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    params, normalizer_t = checked
    chunk_size = call.chunk_size
    hidden_rows, target_flat = hidden.reshape(-1, hidden.shape[-1]), flat_target(target)
    if params.reduction == "none":
        if head_any_grad(hidden, weight, bias):
            loss = _LinearCrossEntropyRows.apply(hidden_rows, weight, bias, target_flat,
                                                 params, chunk_size)
        else:
            loss = _walk(hidden_rows, weight, bias, target_flat, params, chunk_size)[0]
        return loss.view(target.shape)
    scale = loss_grad_scale(target_flat, params, normalizer_t)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    with torch.no_grad():
        loss, grad_hidden, grad_weight, grad_bias = _walk(
            hidden_rows, weight, bias, target_flat, params, chunk_size,
            scale if any(needs) else None, needs)
        value = reduce_loss(loss, scale, params)
    if not any(needs):
        return value
    return AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_cross_entropy", CE_EQUIVALENT)


def _vocab_parallel_linear(call: LinearCrossEntropyCall):
    """``linear_cross_entropy`` with this rank's vocabulary shard of the head."""
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    chunk_size, backend = call.chunk_size, call.backend
    if check_in_range(call.logit_scale, "logit_scale", -math.inf, math.inf) != 1.0:
        raise ValueError("logit_scale is not supported with process_group")

    def checks(layout):
        return checked_params(
            vocab_parallel.whole_logits(hidden, layout), target, call.ignore_index,
            call.reduction, call.label_smoothing, call.z_loss, call.softcap,
            call.normalizer, False, backend)

    hidden_rows, layout, needs_grad, (params, normalizer_t) = vocab_parallel.head_setup(
        "linear_cross_entropy", call.process_group, hidden, weight, bias, chunk_size, target,
        call.ignore_index, call.check_consistency, checks)
    if params.backend == "reference":
        return vocab_parallel.on_head_logits(cross_entropy, call)
    reduction = params.reduction
    target_flat = flat_target(target)
    if reduction != "none" and needs_grad:  # the gradient factor is known: one walk
        scale = loss_grad_scale(target_flat, params, normalizer_t)
        with torch.no_grad():
            rows_loss, grad_hidden, grad_weight, grad_bias = (
                vocab_shard.head_shard_cross_entropy_walk(
                    hidden_rows, weight, bias, target_flat, params, layout, chunk_size, backend,
                    scale, head_needs(hidden, weight, bias)))
            value = reduce_loss(rows_loss, scale, params)
        return AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                      grad_bias, "linear_cross_entropy", CE_EQUIVALENT)
    (rows_loss,) = vocab_shard.head_shard_rows(
        vocab_shard.CrossEntropyShard, hidden_rows, weight, bias, target_flat, params, layout,
        chunk_size, backend, needs_grad)
    if reduction == "none":
        return rows_loss.view(target.shape)
    return reduce_loss(rows_loss, loss_grad_scale(target_flat, params, normalizer_t), params)


LINEAR_CROSS_ENTROPY = Door(linear_cross_entropy,
                            ("hidden", "weight", "target", "bias", "normalizer"),
                            _check_linear, _local_linear, _reference_linear,
                            _vocab_parallel_linear, dtensor.linear_cross_entropy)
