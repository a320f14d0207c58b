"""Distillation over a teacher's top-k support, where the teacher (a vLLM server) returns only
its top-k log-probs per token: TRL's ``ServerDistillationTrainer`` loss, verl's
``forward_kl_topk`` and Axolotl's KD plugin top-k loss (``objective=``).

Semantics: ``reference.topk_distill_loss``. ``objective="trl_jsd"`` (TRL 1.16,
``trl/experimental/server_distillation/server_distillation_trainer.py``: the generalized JSD of
``_jsd_divergence`` with a support mask, after ``_add_tail_bucket`` or a renormalisation over
the support, reduced by ``_reduce_divergence_loss``'s ``batchmean``); ``"verl_forward_kl"``
(verl ``verl/trainer/distillation/fsdp/losses.py`` ``compute_forward_kl_topk`` and
``verl/trainer/distillation/losses.py``: the forward KL of the teacher's top-k against the
student's full-softmax log-probs there, both clamped below at ``log_prob_min_clamp``, the row
clamped to ``[0, loss_max_clamp]``); ``"axolotl_kd"`` (Axolotl
``src/axolotl/integrations/kd/kernels/liger.py``: TRL's divergence terms on the student's
full-softmax log-probs at the support, renormalised over it with ``normalize_topk``, the
teacher's as given, times ``T**2``). docs/objectives.md cites the lines.

Per chunk of rows (torch ops in ``ops/topk_support.py``, any device; the cpp backend runs the
same math in one kernel,
``csrc/topk_distill.cpp``, the optional primitive ``topk_distill_forward``):
with ``tail`` one pass over the row gives its tempered log-sum-exp (shifted by the row max, in
float32) and the K support logits; without it the row's log-sum-exp cancels in the
renormalisation, so only the K logits are read (likewise ``axolotl_kd`` with
``normalize_topk``; ``verl_forward_kl`` and ``axolotl_kd`` without it read the row as the tail
does). The loss is a function of the K student
log-probs ``s_k``; its derivatives ``c_k = d loss / d s_k`` (the tail's ``log(1 - sum exp s)``
included) give the logit gradient of the row, since ``d s_k / d z_j = ([j == id_k] - p_j) / T``:
``(sum_k c_k [j == id_k] - (sum_k c_k) p_j) / T``. Renormalised, ``sum_k c_k = 0``, so that
gradient lives on the support only. With a scalar reduction the forward writes the gradient
(the backward only rescales it); with ``reduction="none"`` it keeps two floats per row and the
``c_k``, and the backward reads the rows once more.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import reference
from ..distributed import dtensor
from ..kernels.registry import (
    BACKENDS,
    ENV_VAR,
)
from ..options.scalars import check_bool, check_choice, check_in_range, check_positive
from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    AttachGrad,
    LogitsShape,
    check_logits,
    refuse_double_backward,
)
from .door import Door
from .head import (
    AttachHeadGrads,
    ChunkedHead,
    check_head,
    grad_or_none,
    head_needs,
    reference_logits,
)
from .topk_support import (
    SupportRows,
    TopkDistillParams,
    logits_backward_walk,
    logits_walk,
    primitive_backend,
    support_head_walk,
)

REDUCTIONS = ("batchmean", "sum", "none")
OBJECTIVES = ("trl_jsd", "verl_forward_kl", "axolotl_kd")
# verl's DistillationLossConfig defaults (verl/workers/config/distillation.py)
VERL_LOG_PROB_MIN_CLAMP = -10.0
VERL_LOSS_MAX_CLAMP = 10.0
IGNORE_INDEX = -100  # TRL selects the counted positions by labels != -100
TEACHER_DTYPES = FLOAT_DTYPES + (torch.float64,)


def topk_backend(backend):
    """``"reference"``, or ``"torch"`` for every kernel backend: the op's own routes (a backend
    with the optional kernel, ``topk_support.primitive_backend``, serves the rows inside them)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto") or "auto"
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"the environment variable {ENV_VAR} must be 'auto' or one of "
                             f"{BACKENDS}, got {backend!r}")
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    return "reference" if backend == "reference" else "torch"


def _check_index_tensor(tensor, name, shape, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but student_logits are on {device}")


def _objective_params(objective, beta, tail, normalize_topk, log_prob_min_clamp,
                      loss_max_clamp):
    """The objective and its options checked: ``(objective, beta, tail, normalize_topk,
    log_prob_min_clamp, loss_max_clamp)``; an option of another objective is refused."""
    objective = check_choice(objective, "objective", OBJECTIVES)
    beta = check_in_range(beta, "beta", 0.0, 1.0)
    if tail is None:
        tail = objective == "trl_jsd"
    else:
        check_bool(tail, "tail")
        if objective != "trl_jsd":
            raise ValueError(f"tail applies only to objective='trl_jsd' (the tail bucket of "
                             f"TRL's loss), got tail={tail} with objective={objective!r}")
    if normalize_topk is None:
        normalize_topk = False
    else:
        check_bool(normalize_topk, "normalize_topk")
        if objective != "axolotl_kd":
            raise ValueError(f"normalize_topk applies only to objective='axolotl_kd' "
                             f"(Axolotl's kd_normalize_topk), got objective={objective!r}")
    clamps = []
    for name, value, default, low in (
            ("log_prob_min_clamp", log_prob_min_clamp, VERL_LOG_PROB_MIN_CLAMP, -math.inf),
            ("loss_max_clamp", loss_max_clamp, VERL_LOSS_MAX_CLAMP, 0.0)):
        if objective != "verl_forward_kl":
            if value != default:
                raise ValueError(f"{name} applies only to objective='verl_forward_kl', got "
                                 f"{name}={value!r} with objective={objective!r}")
            clamps.append(None)
        else:
            clamps.append(None if value is None else check_in_range(value, name, low, math.inf))
    if objective == "verl_forward_kl" and beta != 0:
        raise ValueError(f"beta must be 0 with objective='verl_forward_kl' (verl's "
                         f"forward_kl_topk is the forward KL), got {beta}")
    return (objective, beta, tail, normalize_topk, *clamps)


def checked_inputs(student, support_ids, teacher_logprobs, labels, support_mask, beta,
                   temperature, tail, reduction, objective="trl_jsd", normalize_topk=None,
                   log_prob_min_clamp=VERL_LOG_PROB_MIN_CLAMP,
                   loss_max_clamp=VERL_LOSS_MAX_CLAMP):
    """Validate every argument but the logits tensor itself (the fused head has none);
    ``(params, SupportRows)``."""
    lead, vocab, device = student.lead, student.vocab, student.device
    if not isinstance(support_ids, torch.Tensor):
        raise TypeError(f"support_ids must be a torch.Tensor, got {type(support_ids).__name__}")
    if support_ids.dim() != len(lead) + 1 or support_ids.shape[-1] < 1:
        raise ValueError(f"support_ids must have shape [..., K] with K >= 1 and student_logits' "
                         f"leading shape {lead}, got {tuple(support_ids.shape)}")
    shape = tuple(support_ids.shape)
    _check_index_tensor(support_ids, "support_ids", lead + shape[-1:], device)
    if not isinstance(teacher_logprobs, torch.Tensor):
        raise TypeError(f"teacher_logprobs must be a torch.Tensor, got "
                        f"{type(teacher_logprobs).__name__}")
    if teacher_logprobs.dtype not in TEACHER_DTYPES:
        raise TypeError(f"teacher_logprobs must be a float tensor, got {teacher_logprobs.dtype}")
    if tuple(teacher_logprobs.shape) != shape:
        raise ValueError(f"teacher_logprobs must have support_ids' shape {shape}, got "
                         f"{tuple(teacher_logprobs.shape)}")
    if teacher_logprobs.device != device:
        raise ValueError(f"teacher_logprobs are on {teacher_logprobs.device} but "
                         f"student_logits are on {device}")
    if support_mask is not None:
        if not isinstance(support_mask, torch.Tensor) or support_mask.dtype != torch.bool:
            raise TypeError("support_mask must be None or a bool tensor")
        if tuple(support_mask.shape) != shape or support_mask.device != device:
            raise ValueError(f"support_mask must have support_ids' shape {shape} on {device}, "
                             f"got {tuple(support_mask.shape)} on {support_mask.device}")
    if labels is not None:
        _check_index_tensor(labels, "labels", lead, device)
    objective, beta, tail, normalize_topk, log_prob_min_clamp, loss_max_clamp = (
        _objective_params(objective, beta, tail, normalize_topk, log_prob_min_clamp,
                          loss_max_clamp))
    params = TopkDistillParams(beta=beta,
                               temperature=check_positive(temperature, "temperature"),
                               tail=tail,
                               reduction=check_choice(reduction, "reduction", REDUCTIONS),
                               objective=objective, normalize_topk=normalize_topk,
                               log_prob_min_clamp=log_prob_min_clamp,
                               loss_max_clamp=loss_max_clamp)
    k = shape[-1]
    ids = support_ids.reshape(-1, k)
    teacher = teacher_logprobs.detach().reshape(-1, k).to(torch.float32)
    counted = (torch.ones(ids.shape[0], dtype=torch.bool, device=device) if labels is None
               else labels.reshape(-1) != IGNORE_INDEX)
    # TRL's forward path drops the entries the server did not fill (-inf), as a mask does;
    # verl's clamp turns a -inf teacher entry into one at the clamp, which counts. A NaN
    # counts: it makes its row NaN (``nan_rows``), never vanishes as a -inf does
    clamped = params.objective == "verl_forward_kl" and params.log_prob_min_clamp is not None
    live = ((teacher != -torch.inf) | clamped) & counted.unsqueeze(1)
    if support_mask is not None:
        live &= support_mask.reshape(-1, k)
    nan_rows = (live & teacher.isnan()).any(1)
    bad = live & ((ids < 0) | (ids >= vocab))
    compiling = torch.compiler.is_compiling()
    if compiling:
        # a data-dependent branch would break the graph; assert on the device instead
        torch._assert_async(~bad.any(), f"support_ids holds values outside [0, {vocab}) at "
                                        f"entries that count")
    elif ids.numel() and bool(bad.any()):
        raise ValueError(f"support_ids holds {ids[bad][0].item()}, outside [0, {vocab}), at an "
                         f"entry that counts")
    # traced, the rows that do not count are masked whether or not there are any
    any_ignored = compiling or (bool((~counted).any()) if counted.numel() else False)
    rows = SupportRows(ids=torch.where(live, ids, 0).long(), teacher=teacher, live=live,
                       counted=counted, any_ignored=any_ignored, has_labels=labels is not None,
                       nan_rows=nan_rows)
    return params, rows


def server_top1_support(teacher_top1_ids, teacher_top1_logprobs, sampled_ids,
                        sampled_teacher_logprobs, beta):
    """``(support_ids, teacher_logprobs, support_mask)`` ``[..., 2]`` of TRL's ``beta > 0``
    server path (``_compute_sparse_top_1_divergence_loss``): the teacher's top-1 token and the
    sampled one, the latter dropped where it is the top-1; at ``beta = 1`` the sampled token
    alone (``[..., 1]``). ``sampled_ids`` may hold -100 on rows the labels do not count."""
    sampled = sampled_teacher_logprobs.unsqueeze(-1)
    if beta == 1:
        return (sampled_ids.unsqueeze(-1), sampled,
                torch.ones_like(sampled_ids, dtype=torch.bool).unsqueeze(-1))
    ids = torch.stack([teacher_top1_ids, sampled_ids], -1)
    logprobs = torch.cat([teacher_top1_logprobs.unsqueeze(-1), sampled.to(
        teacher_top1_logprobs.dtype)], -1)
    mask = torch.stack([torch.ones_like(sampled_ids, dtype=torch.bool),
                        sampled_ids != teacher_top1_ids], -1)
    return ids, logprobs, mask


def row_grad_scale(rows, params, lead_shape, device):
    """``d loss / d row loss`` of a scalar reduction, a 1-element float32 tensor: 1 for
    ``sum``; for ``batchmean`` the inverse of the counted rows (at least 1), without labels of
    the first dim (TRL's ``jsd.size(0)``; 1 for a single row)."""
    if params.reduction == "sum":
        return torch.ones(1, dtype=torch.float32, device=device)
    if rows.has_labels:
        count = rows.counted.sum().to(torch.float32).clamp(min=1.0)
    else:
        count = torch.full((), float(max(lead_shape[0], 1) if len(lead_shape) else 1),
                           device=device)
    return count.reciprocal().reshape(1)


def reduce_rows(rows_loss, rows, params, lead_shape):
    if params.reduction == "none":
        return rows_loss.view(lead_shape)
    total = rows_loss.sum()
    if params.reduction == "sum":
        return total
    return total * row_grad_scale(rows, params, lead_shape, rows_loss.device).reshape(())


class _TopkDistillRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; the backward writes the gradient from the row
    stats and coefficients the forward kept."""

    @staticmethod
    def forward(ctx, logits, rows, params, kernel_backend):
        loss, row_max, sums, coef, _ = logits_walk(logits, rows, params,
                                                   kernel_backend=kernel_backend)
        ctx.save_for_backward(logits, row_max, sums, coef)
        ctx.rows, ctx.params = rows, params
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("topk_distill_loss", None)
        logits, row_max, sums, coef = ctx.saved_tensors
        grad = logits_backward_walk(logits, ctx.rows, ctx.params, row_max, sums, coef,
                                    ctx.rows.with_nan(grad_rows.reshape(-1).float()))
        return grad.view(logits.shape), None, None, None


class TopKDistillLossCall(NamedTuple):
    """``topk_distill_loss``'s arguments, as its door hands them to the routes."""
    student_logits: Tensor
    support_ids: Tensor
    teacher_logprobs: Tensor
    labels: Optional[Tensor]
    beta: float
    temperature: float
    tail: Optional[bool]
    support_mask: Optional[Tensor]
    reduction: str
    objective: str
    normalize_topk: Optional[bool]
    log_prob_min_clamp: Optional[float]
    loss_max_clamp: Optional[float]
    backend: str


def topk_distill_loss(
    student_logits: Tensor,
    support_ids: Tensor,
    teacher_logprobs: Tensor,
    labels: Optional[Tensor] = None,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    tail: Optional[bool] = None,
    support_mask: Optional[Tensor] = None,
    reduction: str = "batchmean",
    objective: str = "trl_jsd",
    normalize_topk: Optional[bool] = None,
    log_prob_min_clamp: Optional[float] = VERL_LOG_PROB_MIN_CLAMP,
    loss_max_clamp: Optional[float] = VERL_LOSS_MAX_CLAMP,
    backend: str = "auto",
) -> Tensor:
    """TRL's ``ServerDistillationTrainer`` loss: the generalized JSD between the student's
    ``softmax(student_logits / T)`` and a teacher known only by its log-probs
    ``teacher_logprobs [..., K]`` at ``support_ids [..., K]``.

    Entries where ``support_mask`` is False or the teacher's log-prob is -inf are dropped; a
    NaN teacher log-prob on an entry that counts makes its row's loss (so a reduced loss) and
    its row's gradient NaN, as torch's arithmetic would.
    ``tail=True`` (None: the default, True) adds the bucket ``log(1 - sum p)`` of the mass
    outside the support on both sides (TRL's ``_add_tail_bucket``); ``tail=False``
    renormalises both over the support.
    ``beta = 0``: KL(teacher || student) (TRL's top-k forward path); ``beta = 1``:
    KL(student || teacher); between them the JSD with mixture ``(1 - beta) p_s + beta p_t``.
    TRL's ``beta > 0`` path uses the support of :func:`server_top1_support`. Rows whose
    ``labels`` are -100 do not count. ``reduction``: ``batchmean`` (sum over counted rows
    divided by their number, at least 1; without labels by the first dim), ``sum``, ``none``
    (per-row losses ``[...]``). Only ``student_logits`` gets a gradient; the temperature
    divides the student's logits only (the teacher's log-probs are taken as sampled). float32
    result. Where the student puts under ~1e-7 on the support, the tail's share of the
    gradient is exact (TRL's autograd forms ``exp(log sum p)`` as ``expm1 + 1``: 0 in
    float32). ``backend``: ``reference`` runs ``reference.topk_distill_loss``; ``cpp`` (the
    default on CPU) its kernel; ``torch`` and ``triton`` this op's chunked torch ops.

    ``objective`` picks the loss of another framework on the same inputs (docs/objectives.md):

    * ``"trl_jsd"`` (default): TRL's, above.
    * ``"verl_forward_kl"``: verl's ``forward_kl_topk``: per row ``max(sum_k q_k (t_k - a_k),
      0)``, at most ``loss_max_clamp``, with ``a_k`` the student's full-softmax log-prob at
      ``id_k`` and ``t_k`` the teacher's, both clamped below at ``log_prob_min_clamp`` (a -inf
      teacher entry then counts at the clamp), ``q_k = exp(t_k)`` (not renormalised).
      ``beta`` must be 0; either clamp None turns it off, as in verl's config, whose defaults
      (-10, 10) are these keywords'. verl's ``token-mean`` is ``batchmean`` with labels.
    * ``"axolotl_kd"``: Axolotl's KD plugin top-k loss: TRL's divergence terms (``beta``:
      Axolotl's ``kd_beta``) between the student's full-softmax log-probs at the support,
      renormalised over the live entries when ``normalize_topk`` (``kd_normalize_topk``;
      None: False), and the teacher's as given (Axolotl renormalises them in its data
      pipeline, never in the loss), times ``temperature ** 2``. Its division by
      ``num_items_in_batch`` is ``batchmean`` with labels.

    ``tail`` applies only to ``trl_jsd``, ``normalize_topk`` to ``axolotl_kd``, the two clamps
    to ``verl_forward_kl``; another objective refuses them (a clamp at its default is allowed).
    """
    return TOPK_DISTILL_LOSS.enter(TopKDistillLossCall(
        student_logits=student_logits, support_ids=support_ids, teacher_logprobs=teacher_logprobs,
        labels=labels, beta=beta, temperature=temperature, tail=tail, support_mask=support_mask,
        reduction=reduction, objective=objective, normalize_topk=normalize_topk,
        log_prob_min_clamp=log_prob_min_clamp, loss_max_clamp=loss_max_clamp, backend=backend))


class _Checked(NamedTuple):
    """A checked top-k distillation call: its params and support rows, the backend."""
    params: "TopkDistillParams"
    rows: SupportRows
    backend: str


def _checked(call, student: LogitsShape) -> _Checked:
    params, rows = checked_inputs(
        student, call.support_ids, call.teacher_logprobs, call.labels,
        call.support_mask, call.beta, call.temperature, call.tail, call.reduction,
        call.objective, call.normalize_topk, call.log_prob_min_clamp,
        call.loss_max_clamp)
    return _Checked(params, rows, topk_backend(call.backend))


def _check(call: TopKDistillLossCall) -> _Checked:
    check_logits(call.student_logits, "student_logits")
    return _checked(call, LogitsShape.of(call.student_logits))


def _reference(call: TopKDistillLossCall, checked: _Checked):
    params = checked.params
    return reference.topk_distill_loss(
        call.student_logits.float(), call.support_ids,
        call.teacher_logprobs.detach().float(), call.labels, params.beta,
        params.temperature, params.tail, call.support_mask, params.reduction,
        objective=params.objective, normalize_topk=params.normalize_topk,
        log_prob_min_clamp=params.log_prob_min_clamp, loss_max_clamp=params.loss_max_clamp)


def _local(call: TopKDistillLossCall, checked: _Checked):
    student_logits, (params, rows, _) = call.student_logits, checked
    reduction = params.reduction
    lead_shape = student_logits.shape[:-1]
    needs_grad = torch.is_grad_enabled() and student_logits.requires_grad
    kernel_backend = primitive_backend(call.backend, student_logits.device)
    if needs_grad and reduction == "none":
        return _TopkDistillRows.apply(student_logits, rows, params,
                                      kernel_backend).view(lead_shape)
    if not needs_grad:
        return reduce_rows(logits_walk(student_logits, rows, params,
                                       kernel_backend=kernel_backend)[0],
                           rows, params, lead_shape)
    scale = rows.with_nan(row_grad_scale(rows, params, lead_shape, student_logits.device))
    with torch.no_grad():
        loss, *_, grad = logits_walk(student_logits, rows, params, scale, kernel_backend)
        value = reduce_rows(loss, rows, params, lead_shape)
    return AttachGrad.apply(student_logits, value, grad.view(student_logits.shape),
                            "topk_distill_loss", None)


class _LinearTopkDistillRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; the backward walks the chunks again and writes
    the gradient from the row stats and coefficients the forward kept."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, params, chunk_size):
        head = ChunkedHead(hidden, weight, bias, chunk_size)
        loss, saved, _ = support_head_walk(head, rows, params)
        ctx.save_for_backward(hidden, weight, bias, *saved)
        ctx.rows, ctx.params, ctx.chunk_size = rows, params, chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("linear_topk_distill_loss", None)
        hidden, weight, bias, *saved = ctx.saved_tensors
        head = ChunkedHead(hidden, weight, bias, ctx.chunk_size, ctx.needs_input_grad[:3])
        _, _, (grad_hidden, grad_weight, grad_bias) = support_head_walk(
            head, ctx.rows, ctx.params, ctx.rows.with_nan(grad_rows.reshape(-1).float()), saved)
        return (grad_or_none(grad_hidden), grad_or_none(grad_weight), grad_or_none(grad_bias),
                None, None, None)


class LinearTopKDistillLossCall(NamedTuple):
    """``linear_topk_distill_loss``'s arguments, as its door hands them to the routes."""
    hidden: Tensor
    weight: Tensor
    support_ids: Tensor
    teacher_logprobs: Tensor
    labels: Optional[Tensor]
    bias: Optional[Tensor]
    beta: float
    temperature: float
    tail: Optional[bool]
    support_mask: Optional[Tensor]
    reduction: str
    objective: str
    normalize_topk: Optional[bool]
    log_prob_min_clamp: Optional[float]
    loss_max_clamp: Optional[float]
    chunk_size: Optional[int]
    backend: str


def linear_topk_distill_loss(
    hidden: Tensor,
    weight: Tensor,
    support_ids: Tensor,
    teacher_logprobs: Tensor,
    labels: Optional[Tensor] = None,
    *,
    bias: Optional[Tensor] = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    tail: Optional[bool] = None,
    support_mask: Optional[Tensor] = None,
    reduction: str = "batchmean",
    objective: str = "trl_jsd",
    normalize_topk: Optional[bool] = None,
    log_prob_min_clamp: Optional[float] = VERL_LOG_PROB_MIN_CLAMP,
    loss_max_clamp: Optional[float] = VERL_LOSS_MAX_CLAMP,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
) -> Tensor:
    """``topk_distill_loss(F.linear(hidden, weight, bias), support_ids, teacher_logprobs,
    labels, ...)`` without the ``[N, V]`` logits: the rows are walked in the fused head's chunks
    (``ops/head.py``), each chunk's loss and logit gradient are ``topk_distill_loss``'s, and
    the gradient is folded into those of ``hidden``, ``weight`` and ``bias`` per chunk. With a
    scalar reduction the gradients are produced in the forward's single walk."""
    return LINEAR_TOPK_DISTILL_LOSS.enter(LinearTopKDistillLossCall(
        hidden=hidden, weight=weight, support_ids=support_ids, teacher_logprobs=teacher_logprobs,
        labels=labels, bias=bias, beta=beta, temperature=temperature, tail=tail,
        support_mask=support_mask, reduction=reduction, objective=objective,
        normalize_topk=normalize_topk, log_prob_min_clamp=log_prob_min_clamp,
        loss_max_clamp=loss_max_clamp, chunk_size=chunk_size, backend=backend))


def _check_linear(call: LinearTopKDistillLossCall) -> _Checked:
    check_head(call.hidden, call.weight, call.bias, call.chunk_size)
    return _checked(call, LogitsShape.of_head(call.hidden, call.weight))


def _reference_linear(call: LinearTopKDistillLossCall, checked: _Checked):
    logits = reference_logits(call.hidden, call.weight, call.bias, 1.0, None)
    return topk_distill_loss(
        logits, call.support_ids, call.teacher_logprobs, call.labels, beta=call.beta,
        temperature=call.temperature, tail=call.tail, support_mask=call.support_mask,
        reduction=call.reduction, objective=call.objective, normalize_topk=call.normalize_topk,
        log_prob_min_clamp=call.log_prob_min_clamp, loss_max_clamp=call.loss_max_clamp,
        backend="reference")


def _local_linear(call: LinearTopKDistillLossCall, checked: _Checked):
    hidden, weight, bias = call.hidden, call.weight, call.bias
    chunk_size = call.chunk_size
    params, rows, _ = checked
    reduction = params.reduction
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    lead_shape = hidden.shape[:-1]
    needs = (head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3)
    if reduction == "none":
        if any(needs):
            loss = _LinearTopkDistillRows.apply(hidden_rows, weight, bias, rows, params,
                                                chunk_size)
        else:
            loss = support_head_walk(ChunkedHead(hidden_rows, weight, bias, chunk_size), rows,
                                params)[0]
        return loss.view(lead_shape)
    scale = rows.with_nan(row_grad_scale(rows, params, lead_shape, hidden.device))
    with torch.no_grad():
        head = ChunkedHead(hidden_rows, weight, bias, chunk_size, needs)
        loss, _, (grad_hidden, grad_weight, grad_bias) = support_head_walk(
            head, rows, params, scale if any(needs) else None)
        value = reduce_rows(loss, rows, params, lead_shape)
    if not any(needs):
        return value
    return AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                 grad_bias, "linear_topk_distill_loss", None)


TOPK_DISTILL_LOSS = Door(topk_distill_loss, ("student_logits", "support_ids", "teacher_logprobs",
                                             "labels", "support_mask"), _check, _local,
                         _reference, dtensor=dtensor.topk_distill_loss)
LINEAR_TOPK_DISTILL_LOSS = Door(linear_topk_distill_loss, (
    "hidden", "weight", "support_ids", "teacher_logprobs", "labels", "support_mask", "bias"),
    _check_linear, _local_linear, _reference_linear, dtensor=dtensor.linear_topk_distill_loss)
