"""Distillation over the whole vocabulary: TRL's generalized JSD (forward / reverse KL at the
ends) between the student's and the teacher's softmaxes, without an ``[N, V]`` copy.

Semantics: ``GKDTrainer.generalized_jsd_loss`` (``trl/experimental/gkd/gkd_trainer.py``), see
``reference.distill_loss``. Passes: the forward reads both rows once for their log-sum-exps (the
online reduction) and once more for the row loss (the mixture ``log((1 - beta) p_s + beta p_t)``
of JSD needs both lses before its first term); it keeps four floats per row (both lses, the
student's KL to the mixture, the hard term's lse). The student's gradient is the only
``[N, V]`` tensor; the teacher gets none. With a scalar reduction the gradient's factor is known
up front, so the forward writes the gradient as well (the cpp kernel from per-element values its
loss pass keeps: no exp or log more) and the backward only rescales it, as ``cross_entropy``'s;
with ``reduction="none"`` the backward reads both rows once more and writes it.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import reference
from ..distributed import dtensor
from ..kernels import library
from ..kernels.primitives import DistillArgs
from ..kernels.registry import resolve_backend
from ..options.distill import DistillOptions, distill_options_or_keywords
from ..options.keywords import options_from
from ..options.scalars import checked_transform
from ._common import (
    AttachGrad,
    LogitsShape,
    check_logits,
    check_target,
    flat_target,
    refuse_double_backward,
    rows_view,
)
from .door import Checked, Door
from .head import (
    AttachHeadGrads,
    check_head,
    grad_or_none,
    head_needs,
    head_walk,
    reference_logits,
)
from .reduction import check_zero_normalizer, checked_normalizer, inverse_or_zero


@dataclass(frozen=True)
class DistillParams(DistillArgs):
    """The kernel's parameters (``kernels/primitives.py``) and the op's own."""
    reduction: str
    has_target: bool
    backend: str


def checked_params(student: LogitsShape, teacher: LogitsShape, target,
                   options: DistillOptions, normalizer, backend):
    """Validate every argument but the logits tensors themselves (the fused head has none):
    ``options.checked()``, then what needs the tensors; ``(params, normalizer as a device
    tensor or None)``."""
    if teacher.lead + (teacher.vocab,) != student.lead + (student.vocab,):
        raise ValueError(f"teacher_logits must have student_logits' shape "
                         f"{student.lead + (student.vocab,)}, got "
                         f"{teacher.lead + (teacher.vocab,)}")
    if teacher.device != student.device:
        raise ValueError(f"teacher_logits are on {teacher.device} but student_logits are on "
                         f"{student.device}")
    options = options.checked()
    ignore_index, reduction = options.ignore_index, options.reduction
    if target is not None:
        check_target(target, student, ignore_index)
    if options.hard_weight and target is None:
        raise ValueError("hard_weight > 0 needs target (the hard labels)")
    if normalizer is not None and reduction not in ("batchmean", "mean"):
        raise ValueError(f"normalizer applies to reduction='batchmean' or 'mean' only, got "
                         f"reduction={reduction!r}")
    normalizer_t = checked_normalizer(normalizer, "mean", student.device)
    if normalizer_t is not None:
        counted = (target != ignore_index if target is not None
                   else torch.tensor(math.prod(student.lead) > 0, device=student.device))
        check_zero_normalizer(normalizer_t, counted)
    if target is None:
        ignore_index = -1  # the primitives then read zeros as targets: every row counts
    params = DistillParams(beta=options.beta, temperature=options.temperature,
                           ignore_index=ignore_index, hard_weight=options.hard_weight,
                           reduction=reduction,
                           has_target=target is not None,
                           backend=resolve_backend(backend, student.device))
    return params, normalizer_t


def matching_rows(student, teacher):
    """``[A, B, V]`` views of both with the same ``A, B`` (one of them copied only when both
    have non-uniform row strides that group differently)."""
    student_rows, teacher_rows = rows_view(student), rows_view(teacher)
    if student_rows.shape == teacher_rows.shape:
        return student_rows, teacher_rows
    if teacher_rows.shape[0] == 1:  # uniform row stride: any [A, B] split is a view
        return student_rows, teacher_rows.view(student_rows.shape)
    if student_rows.shape[0] == 1:
        return student_rows.view(teacher_rows.shape), teacher_rows
    return student_rows, teacher_rows.reshape(student_rows.shape)


class _DistillRows(torch.autograd.Function):
    """Per-row losses; the backward writes the student's gradient from the saved row stats."""

    @staticmethod
    def forward(ctx, student, teacher, target_flat, params):
        student_rows, teacher_rows = matching_rows(student, teacher)
        loss, *stats, _ = library.distill_forward(student_rows, teacher_rows, target_flat,
                                                   None, params, False, params.backend)
        ctx.save_for_backward(student, teacher, target_flat, *stats)
        ctx.params = params
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("distill_loss", None)
        student, teacher, target_flat, *stats = ctx.saved_tensors
        params = ctx.params
        student_rows, teacher_rows = matching_rows(student, teacher)
        grad = library.distill_backward(
            student_rows, teacher_rows, target_flat, *stats,
            grad_loss.reshape(-1).float().contiguous(), params, params.backend)
        return grad.view(student.shape), None, None, None


def row_targets(target, n_rows, device):
    """The flat targets the primitives read: ``target``, or zeros when there is none (then
    ``params.ignore_index`` is -1: every row counts)."""
    if target is not None:
        return flat_target(target)
    return torch.zeros(n_rows, dtype=torch.int64, device=device)


def row_grad_scale(target_flat, params, normalizer, vocab, lead_shape):
    """``d loss / d row_loss`` of the scalar reductions, a 1-element float32 tensor: 1 for
    ``sum``; else the inverse of the normalizer, or for ``batchmean`` of the counted rows (at
    least 1) with a target, of the first dim without one (TRL's ``jsd.size(0)``: B of
    ``[B, T, V]``; 1 for a single ``[V]`` row), for ``mean`` of counted rows * V (0 for a
    count of 0)."""
    if params.reduction == "sum":
        return torch.ones(1, dtype=torch.float32, device=target_flat.device)
    if normalizer is not None:
        return inverse_or_zero(normalizer).reshape(1)
    if params.reduction == "batchmean" and not params.has_target:
        batch = lead_shape[0] if len(lead_shape) else 1
        count = torch.full((), float(batch), device=target_flat.device)
    elif params.has_target:
        count = (target_flat != params.ignore_index).sum().to(torch.float32)
    else:
        count = torch.full((), float(target_flat.numel()), device=target_flat.device)
    count = count.clamp(min=1.0) if params.reduction == "batchmean" else count * vocab
    return inverse_or_zero(count).reshape(1)


def reduce_rows(rows_loss, target_flat, params, normalizer, vocab, lead_shape):
    """TRL's reductions of the per-row losses (see ``reference.distill_loss``)."""
    if params.reduction == "none":
        return rows_loss.view(lead_shape)
    total = rows_loss.sum()
    if params.reduction == "sum":
        return total
    return total * row_grad_scale(target_flat, params, normalizer, vocab,
                                  lead_shape).reshape(())


class DistillLossCall(NamedTuple):
    """``distill_loss``'s arguments, its option keywords folded into ``options``, as its door
    hands them to the routes."""
    student_logits: Tensor
    teacher_logits: Tensor
    target: Optional[Tensor]
    normalizer: Union[None, float, Tensor]
    options: DistillOptions
    backend: str


@distill_options_or_keywords
def distill_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target: Optional[Tensor] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    normalizer: Union[None, float, Tensor] = None,
    hard_weight: float = 0.0,
    options: Optional[DistillOptions] = None,
    backend: str = "auto",
) -> Tensor:
    """TRL's generalized JSD between ``softmax(student / T)`` and ``softmax(teacher / T)``.

    ``beta = 0``: KL(teacher || student); ``beta = 1``: KL(student || teacher); between them
    the JSD with mixture ``(1 - beta) p_s + beta p_t``. Rows whose ``target`` is
    ``ignore_index`` do not count. ``reduction``: ``batchmean`` (sum over counted rows divided
    by their number, at least 1; without ``target``, TRL's ``jsd.size(0)``: divided by the
    first dim, B of ``[B, T, V]``), ``sum``, ``mean`` (divided by counted rows * V, as TRL's
    element mean), ``none`` (per-row losses ``[...]``, 0 on ignored rows; TRL would return the
    ``[rows, V]`` elements). ``normalizer`` (TRL's ``num_items_in_batch``; ``batchmean`` or
    ``mean``): the sum divided by it; a finite number > 0, 0 only when no row is counted
    (then the loss is 0). ``hard_weight`` adds ``hard_weight * cross_entropy(student_logits,
    target)`` per row (temperature 1). Only the student gets a gradient; the teacher may have
    another float dtype. float32 result.

    -inf logits mark excluded ids (probability 0, ``0 log 0 = 0``), on either side: for
    ``0 < beta < 1`` the loss is finite (the mixture has mass wherever either side has);
    ``beta = 0`` is +inf on a row where the student excludes an id the teacher gives mass and
    finite where only the teacher excludes ids; ``beta = 1`` is +inf on a row where the teacher
    excludes an id the student gives mass, finite where only the student does. The gradient of
    a row whose loss is +inf is not defined (backends may give NaN or inf there); a row whose
    logits are all -inf on either side has no softmax and gives NaN.

    ``options``: a :class:`DistillOptions` holding ``beta``, ``temperature``,
    ``ignore_index``, ``reduction`` and ``hard_weight`` at once; passing any of those keywords
    beside it raises ``ValueError``, whatever its value.
    """
    options = options_from(options, dict(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        hard_weight=hard_weight), DistillOptions)
    return DISTILL_LOSS.enter(DistillLossCall(
        student_logits=student_logits, teacher_logits=teacher_logits, target=target,
        normalizer=normalizer, options=options, backend=backend))


def _check(call: DistillLossCall) -> Checked:
    student, teacher = call.student_logits, call.teacher_logits
    check_logits(student, "student_logits")
    check_logits(teacher, "teacher_logits")
    return Checked(*checked_params(
        LogitsShape.of(student), LogitsShape.of(teacher), call.target,
        call.options, call.normalizer, call.backend))


def _reference(call: DistillLossCall, checked: Checked):
    params, normalizer_t = checked
    return reference.distill_loss(
        call.student_logits.float(), call.teacher_logits.detach().float(), call.target,
        params.beta, params.temperature, params.ignore_index, params.reduction, normalizer_t,
        params.hard_weight)


def _local(call: DistillLossCall, checked: Checked):
    params, normalizer_t = checked
    student_logits, teacher_logits = call.student_logits, call.teacher_logits.detach()
    lead_shape = student_logits.shape[:-1]
    vocab = student_logits.shape[-1]
    target_flat = row_targets(call.target, lead_shape.numel(), student_logits.device)
    needs_grad = torch.is_grad_enabled() and student_logits.requires_grad
    if needs_grad and params.reduction == "none":
        rows_loss = _DistillRows.apply(student_logits, teacher_logits, target_flat, params)
        return reduce_rows(rows_loss, target_flat, params, normalizer_t, vocab, lead_shape)
    student_rows, teacher_rows = matching_rows(student_logits, teacher_logits)
    if not needs_grad:
        rows_loss = library.distill_forward(student_rows, teacher_rows, target_flat, None,
                                             params, False, params.backend)[0]
        return reduce_rows(rows_loss, target_flat, params, normalizer_t, vocab, lead_shape)
    # a scalar reduction: d loss / d row loss is known, so the forward writes the gradient too
    # (the backward only rescales it, as cross_entropy's)
    scale = row_grad_scale(target_flat, params, normalizer_t, vocab, lead_shape)
    with torch.no_grad():
        rows_loss, *_, grad = library.distill_forward(student_rows, teacher_rows, target_flat,
                                                       scale, params, True, params.backend)
        value = reduce_rows(rows_loss, target_flat, params, normalizer_t, vocab, lead_shape)
    return AttachGrad.apply(student_logits, value, grad.view(student_logits.shape),
                            "distill_loss", None)


_HEAD_WALK = head_walk("distill_forward")


def _walk(student, teacher, target_flat, params, transforms, chunk_size, grad_rows=None,
          needs=(False, False, False)):
    """``(loss, grad_hidden, grad_weight, grad_bias)`` per row from one walk of both heads
    (``student``/``teacher`` ``(hidden, weight, bias)``, each with its ``(logit_scale,
    softcap)``) in the same chunks; with ``grad_rows`` (float32, 1 or N elements: d loss / d row
    loss) the student head's gradients too."""
    (scale, softcap), (teacher_scale, teacher_softcap) = transforms
    loss, *_, grad_hidden, grad_weight, grad_bias = _HEAD_WALK(
        *student, *teacher, target_flat, grad_rows, params, *needs, chunk_size, params.backend,
        scale, softcap, teacher_scale, teacher_softcap)
    return loss, grad_hidden, grad_weight, grad_bias


class _LinearDistillRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; backward walks the chunks with per-row grads."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, teacher_hidden,
                teacher_weight, teacher_bias, target_flat, params, chunk_size, transforms):
        loss = _walk((student_hidden, student_weight, student_bias),
                     (teacher_hidden, teacher_weight, teacher_bias), target_flat, params,
                     transforms, chunk_size)[0]
        ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden,
                              teacher_weight, teacher_bias, target_flat)
        ctx.params, ctx.chunk_size, ctx.transforms = params, chunk_size, transforms
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("linear_distill_loss", None)
        *tensors, target_flat = ctx.saved_tensors
        _, grad_hidden, grad_weight, grad_bias = _walk(
            tensors[:3], tensors[3:], target_flat, ctx.params, ctx.transforms, ctx.chunk_size,
            grad_rows.reshape(-1).float().contiguous(), tuple(ctx.needs_input_grad[:3]))
        return (grad_or_none(grad_hidden), grad_or_none(grad_weight),
                grad_or_none(grad_bias), None, None, None, None, None, None, None)


class LinearDistillLossCall(NamedTuple):
    """``linear_distill_loss``'s arguments, its option keywords folded into ``options``, as
    its door hands them to the routes."""
    student_hidden: Tensor
    student_weight: Tensor
    teacher_hidden: Tensor
    teacher_weight: Tensor
    target: Optional[Tensor]
    student_bias: Optional[Tensor]
    teacher_bias: Optional[Tensor]
    normalizer: Union[None, float, Tensor]
    softcap: Optional[float]
    logit_scale: float
    teacher_softcap: Optional[float]
    teacher_logit_scale: float
    options: DistillOptions
    chunk_size: Optional[int]
    backend: str


@distill_options_or_keywords
def linear_distill_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    normalizer: Union[None, float, Tensor] = None,
    hard_weight: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    teacher_softcap: Optional[float] = None,
    teacher_logit_scale: float = 1.0,
    options: Optional[DistillOptions] = None,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
) -> Tensor:
    """``distill_loss(F.linear(student_hidden, student_weight, student_bias),
    F.linear(teacher_hidden, teacher_weight, teacher_bias), target, ...)`` without either
    ``[N, V]`` logits: the rows are walked in chunks (``ops/head.py``'s chunk rule; both
    heads hold one chunk of logits each). The vocabularies must match; the hidden sizes and
    dtypes of the two heads may differ. Only the student's tensors get gradients; with a
    scalar reduction they are produced in the forward's single walk. ``softcap`` and
    ``logit_scale`` (``teacher_softcap``, ``teacher_logit_scale`` for the teacher's head)
    transform each head's logits before the temperature, as in ``linear_token_logprobs``
    (``hard_weight``'s cross-entropy reads the student's transformed logits). ``options``: a
    :class:`DistillOptions`, as ``distill_loss`` takes it (the heads' transforms are not
    options).
    """
    options = options_from(options, dict(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        hard_weight=hard_weight), DistillOptions)
    return LINEAR_DISTILL_LOSS.enter(LinearDistillLossCall(
        student_hidden=student_hidden, student_weight=student_weight,
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, target=target,
        student_bias=student_bias, teacher_bias=teacher_bias, normalizer=normalizer,
        softcap=softcap, logit_scale=logit_scale, teacher_softcap=teacher_softcap,
        teacher_logit_scale=teacher_logit_scale, options=options, chunk_size=chunk_size,
        backend=backend))


class _HeadDistill(NamedTuple):
    """A checked ``linear_distill_loss`` call: the logits op's checked call and each head's
    transform."""
    checked: Checked
    transforms: Tuple[Tuple[float, float], Tuple[float, float]]

    @property
    def backend(self) -> str:
        return self.checked.backend


def _check_linear(call: LinearDistillLossCall) -> _HeadDistill:
    student_hidden, student_weight = call.student_hidden, call.student_weight
    teacher_hidden, teacher_weight = call.teacher_hidden, call.teacher_weight
    transforms = (checked_transform(call.logit_scale, call.softcap),
                  checked_transform(call.teacher_logit_scale, call.teacher_softcap))
    check_head(student_hidden, student_weight, call.student_bias, call.chunk_size)
    try:
        check_head(teacher_hidden, teacher_weight, call.teacher_bias, call.chunk_size)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"teacher head: {exc}") from None
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight must have the student's vocabulary size "
                         f"{student_weight.shape[0]}, got {tuple(teacher_weight.shape)}")
    if tuple(teacher_hidden.shape[:-1]) != tuple(student_hidden.shape[:-1]):
        raise ValueError(f"teacher_hidden must have student_hidden's leading shape "
                         f"{tuple(student_hidden.shape[:-1])}, got "
                         f"{tuple(teacher_hidden.shape[:-1])}")
    checked = Checked(*checked_params(
        LogitsShape.of_head(student_hidden, student_weight),
        LogitsShape.of_head(teacher_hidden, teacher_weight), call.target,
        call.options, call.normalizer, call.backend))
    return _HeadDistill(checked, transforms)


def _reference_linear(call: LinearDistillLossCall, checked: _HeadDistill):
    return distill_loss(
        reference_logits(call.student_hidden, call.student_weight, call.student_bias,
                         call.logit_scale, call.softcap),
        reference_logits(call.teacher_hidden, call.teacher_weight, call.teacher_bias,
                         call.teacher_logit_scale, call.teacher_softcap),
        call.target, normalizer=call.normalizer, options=call.options,
        backend="reference")


def _local_linear(call: LinearDistillLossCall, head: _HeadDistill):
    student_hidden, student_weight = call.student_hidden, call.student_weight
    student_bias, teacher_bias = call.student_bias, call.teacher_bias
    teacher_hidden, teacher_weight = call.teacher_hidden, call.teacher_weight
    (params, normalizer_t), transforms = head.checked, head.transforms
    chunk_size, reduction, target = call.chunk_size, params.reduction, call.target
    student_rows = student_hidden.reshape(-1, student_hidden.shape[-1])
    teacher_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    teacher_args = (teacher_rows.detach(), teacher_weight.detach(),
                    None if teacher_bias is None else teacher_bias.detach())
    lead_shape = student_hidden.shape[:-1]
    target_flat = row_targets(target, lead_shape.numel(), student_hidden.device)
    vocab = student_weight.shape[0]
    needs = (head_needs(student_hidden, student_weight, student_bias)
             if torch.is_grad_enabled() else (False,) * 3)
    student = (student_rows, student_weight, student_bias)
    if reduction == "none":
        if any(needs):
            loss = _LinearDistillRows.apply(*student, *teacher_args, target_flat, params,
                                            chunk_size, transforms)
        else:
            loss = _walk(student, teacher_args, target_flat, params, transforms, chunk_size)[0]
        return loss.view(lead_shape)
    scale = row_grad_scale(target_flat, params, normalizer_t, vocab, lead_shape)
    with torch.no_grad():
        loss, grad_hidden, grad_weight, grad_bias = _walk(
            student, teacher_args, target_flat, params, transforms, chunk_size,
            scale if any(needs) else None, needs)
        value = reduce_rows(loss, target_flat, params, normalizer_t, vocab, lead_shape)
    if not any(needs):
        return value
    return AttachHeadGrads.apply(student_rows, student_weight, student_bias, value,
                                            grad_hidden, grad_weight, grad_bias,
                                            "linear_distill_loss", None)


def _dtensor(op, *, options, **arguments):
    return dtensor.distill_loss(op, **arguments, **options.keywords())


def _dtensor_linear(op, *, options, **arguments):
    return dtensor.linear_distill_loss(op, **arguments, **options.keywords())


DISTILL_LOSS = Door(distill_loss, ("student_logits", "teacher_logits", "target", "normalizer"),
                    _check, _local, _reference, dtensor=_dtensor)
LINEAR_DISTILL_LOSS = Door(linear_distill_loss, (
    "student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "target",
    "student_bias", "teacher_bias", "normalizer"), _check_linear, _local_linear,
    _reference_linear, dtensor=_dtensor_linear)
