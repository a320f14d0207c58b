"""Distillation over the whole vocabulary: TRL's generalized JSD (forward / reverse KL at the
ends) between the student's and the teacher's softmaxes, without an ``[N, V]`` copy.

Semantics: ``GKDTrainer.generalized_jsd_loss`` (``trl/experimental/gkd/gkd_trainer.py``), see
``reference.distill_loss``. Passes: the forward reads both rows once for their log-sum-exps (the
online reduction) and once more for the row loss (the mixture ``log((1 - beta) p_s + beta p_t)``
of JSD needs both lses before its first term); it keeps four floats per row (both lses, the
student's KL to the mixture, the hard term's lse). The backward reads both rows once and
writes the student's gradient: the only ``[N, V]`` tensor. The teacher gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .. import reference
from . import _library
from . import cross_entropy as ce_op
from ._backend import resolve_backend
from ._common import (
    check_choice,
    check_in_range,
    check_index,
    check_logits,
    check_positive,
    check_target,
    flat_target,
    rows_view,
)

REDUCTIONS = ("batchmean", "sum", "mean", "none")


@dataclass(frozen=True)
class DistillParams:
    beta: float
    temperature: float
    ignore_index: int
    reduction: str
    hard_weight: float
    has_target: bool
    backend: str


def checked_params(student, teacher, target, beta, temperature, ignore_index, reduction,
                   normalizer, hard_weight, backend):
    """Validate every argument; ``(params, normalizer as a device tensor or None)``.

    ``student`` and ``teacher`` may be zero-byte stand-ins of the logits (the fused head)."""
    check_logits(student, "student_logits")
    check_logits(teacher, "teacher_logits")
    if tuple(teacher.shape) != tuple(student.shape):
        raise ValueError(f"teacher_logits must have student_logits' shape "
                         f"{tuple(student.shape)}, got {tuple(teacher.shape)}")
    if teacher.device != student.device:
        raise ValueError(f"teacher_logits are on {teacher.device} but student_logits are on "
                         f"{student.device}")
    ignore_index = check_index(ignore_index, "ignore_index")
    if target is not None:
        check_target(target, student, ignore_index)
    beta = check_in_range(beta, "beta", 0.0, 1.0)
    temperature = check_positive(temperature, "temperature")
    check_choice(reduction, "reduction", REDUCTIONS)
    hard_weight = check_in_range(hard_weight, "hard_weight", 0.0, float("inf"))
    if hard_weight and target is None:
        raise ValueError("hard_weight > 0 needs target (the hard labels)")
    if normalizer is not None and reduction not in ("batchmean", "mean"):
        raise ValueError(f"normalizer applies to reduction='batchmean' or 'mean' only, got "
                         f"reduction={reduction!r}")
    normalizer_t = ce_op._check_normalizer(normalizer, "mean", student.device)
    if target is None:
        ignore_index = -1  # the primitives then read zeros as targets: every row counts
    params = DistillParams(beta, temperature, ignore_index, reduction, hard_weight,
                           target is not None, resolve_backend(backend, student.device))
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
        loss, *stats = _library.distill_forward(
            student_rows, teacher_rows, target_flat, params.ignore_index, params.beta,
            params.temperature, params.hard_weight, params.backend)
        ctx.save_for_backward(student, teacher, target_flat, *stats)
        ctx.params = params
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        student, teacher, target_flat, *stats = ctx.saved_tensors
        params = ctx.params
        student_rows, teacher_rows = matching_rows(student, teacher)
        grad = _library.distill_backward(
            student_rows, teacher_rows, target_flat, params.ignore_index, params.beta,
            params.temperature, params.hard_weight, *stats,
            grad_loss.reshape(-1).float().contiguous(), params.backend)
        return grad.view(student.shape), None, None, None


def row_targets(target, n_rows, device):
    """The flat targets the primitives read: ``target``, or zeros when there is none (then
    ``params.ignore_index`` is -1: every row counts)."""
    if target is not None:
        return flat_target(target)
    return torch.zeros(n_rows, dtype=torch.int64, device=device)


def reduce_rows(rows_loss, target_flat, params, normalizer, vocab, lead_shape):
    """TRL's reductions of the per-row losses (see ``reference.distill_loss``)."""
    if params.reduction == "none":
        return rows_loss.view(lead_shape)
    total = rows_loss.sum()
    if params.reduction == "sum":
        return total
    if normalizer is not None:
        return total * ce_op._inverse_or_zero(normalizer)
    if params.has_target:
        count = (target_flat != params.ignore_index).sum().to(torch.float32)
    else:
        count = torch.tensor(float(target_flat.numel()), device=rows_loss.device)
    if params.reduction == "batchmean":
        count = count.clamp(min=1.0)
    else:
        count = count * vocab
    return total * ce_op._inverse_or_zero(count)


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
    backend: str = "auto",
) -> Tensor:
    """TRL's generalized JSD between ``softmax(student / T)`` and ``softmax(teacher / T)``.

    ``beta = 0``: KL(teacher || student); ``beta = 1``: KL(student || teacher); between them
    the JSD with mixture ``(1 - beta) p_s + beta p_t``. Rows whose ``target`` is
    ``ignore_index`` do not count. ``reduction``: ``batchmean`` (sum over counted rows divided
    by their number, at least 1), ``sum``, ``mean`` (divided by counted rows * V, as TRL's
    element mean), ``none`` (per-row losses ``[...]``, 0 on ignored rows; TRL would return the
    ``[rows, V]`` elements). ``normalizer`` (TRL's ``num_items_in_batch``; ``batchmean`` or
    ``mean``): the sum divided by it (0 gives 0). ``hard_weight`` adds
    ``hard_weight * cross_entropy(student_logits, target)`` per row (temperature 1). Only the
    student gets a gradient; the teacher may have another float dtype. float32 result.
    """
    params, normalizer_t = checked_params(student_logits, teacher_logits, target, beta,
                                          temperature, ignore_index, reduction, normalizer,
                                          hard_weight, backend)
    teacher_logits = teacher_logits.detach()
    if params.backend == "reference":
        return reference.distill_loss(
            student_logits.float(), teacher_logits.float(), target, params.beta,
            params.temperature, params.ignore_index, reduction,
            normalizer_t, params.hard_weight)
    lead_shape = student_logits.shape[:-1]
    target_flat = row_targets(target, lead_shape.numel(), student_logits.device)
    if torch.is_grad_enabled() and student_logits.requires_grad:
        rows_loss = _DistillRows.apply(student_logits, teacher_logits, target_flat, params)
    else:
        student_rows, teacher_rows = matching_rows(student_logits, teacher_logits)
        rows_loss = _library.distill_forward(
            student_rows, teacher_rows, target_flat, params.ignore_index, params.beta,
            params.temperature, params.hard_weight, params.backend)[0]
    return reduce_rows(rows_loss, target_flat, params, normalizer_t, student_logits.shape[-1],
                       lead_shape)
