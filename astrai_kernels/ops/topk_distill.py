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

Per chunk of rows (torch ops, any device; the cpp backend runs the same math in one kernel,
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
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import reference
from ..distributed import dtensor
from ..kernels.library import optional_primitive_op
from ..kernels.memory import cached_empty
from ..kernels.registry import (
    BACKENDS,
    ENV_VAR,
    backend_module,
    resolve_backend,
    unavailable_reason,
)
from ..options.scalars import check_bool, check_choice, check_in_range, check_positive
from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    AttachGrad,
    LogitsShape,
    check_logits,
    overwrite_columns_,
    refuse_double_backward,
    rows_view,
)
from .door import Door
from .head import (
    AttachHeadGrads,
    ChunkedHead,
    check_head,
    chunk_rows,
    grad_or_none,
    head_needs,
    reference_logits,
)

REDUCTIONS = ("batchmean", "sum", "none")
OBJECTIVES = ("trl_jsd", "verl_forward_kl", "axolotl_kd")
# verl's DistillationLossConfig defaults (verl/workers/config/distillation.py)
VERL_LOG_PROB_MIN_CLAMP = -10.0
VERL_LOSS_MAX_CLAMP = 10.0
IGNORE_INDEX = -100  # TRL selects the counted positions by labels != -100
TINY = torch.finfo(torch.float32).tiny
TEACHER_DTYPES = FLOAT_DTYPES + (torch.float64,)


@dataclass(frozen=True)
class TopkDistillParams:
    beta: float
    temperature: float
    tail: bool
    reduction: str
    objective: str = "trl_jsd"
    normalize_topk: bool = False
    log_prob_min_clamp: Optional[float] = None
    loss_max_clamp: Optional[float] = None

    @property
    def full_softmax(self):
        """Whether the loss needs the student's log-probs under the full softmax (the row's
        log-sum-exp), not only up to a per-row offset (a renormalisation over the support)."""
        if self.objective == "trl_jsd":
            return self.tail
        return not (self.objective == "axolotl_kd" and self.normalize_topk)


class SupportRows(NamedTuple):
    """The flattened per-row inputs: ``ids`` ``[N, K]`` int64 (dropped entries at id 0),
    ``teacher`` ``[N, K]`` float32, ``live`` ``[N, K]`` (entries that count), ``counted``
    ``[N]`` (rows that count), ``any_ignored`` (some row does not count), ``has_labels``,
    ``nan_rows`` ``[N]`` (rows with a NaN teacher log-prob on an entry that counts: their loss
    and gradient are NaN)."""
    ids: Tensor
    teacher: Tensor
    live: Tensor
    counted: Tensor
    any_ignored: bool
    has_labels: bool
    nan_rows: Tensor

    def part(self, start, stop):
        return self._replace(ids=self.ids[start:stop], teacher=self.teacher[start:stop],
                             live=self.live[start:stop], counted=self.counted[start:stop],
                             nan_rows=self.nan_rows[start:stop])

    def with_nan(self, values):
        """``values`` ``[n]`` (row losses or their upstream gradients) with NaN on the rows
        whose teacher holds a NaN that counts, as torch's arithmetic would carry it (the
        divergences' ``nan_to_num`` of ``0 * inf`` would otherwise drop it)."""
        return torch.where(self.nan_rows, math.nan, values)


def topk_backend(backend):
    """``"reference"``, or ``"torch"`` for every kernel backend: the op's own routes (a backend
    with the optional kernel, ``_kernel_backend``, serves the rows inside them)."""
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


def _tail_bucket(log_probs):
    """``(log(1 - sum exp), whether the gradient passes TRL's clamp of log(sum))`` per row."""
    log_sum = torch.logsumexp(log_probs, 1)
    tail = torch.log(-torch.expm1(log_sum.clamp(max=reference.TOPK_TAIL_LOG_SUM_MAX)))
    return tail, log_sum <= reference.TOPK_TAIL_LOG_SUM_MAX


def _nan_as_zero(x):
    """TRL's ``nan_to_num(nan=0.0)`` of a KL term (``0 * inf`` where a probability is 0),
    infinities kept (TRL would turn +inf into float32's max)."""
    return x.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)


def _divergence_terms(a, b, live, beta):
    """TRL's masked ``_jsd_divergence`` per entry of the sparse log-probs ``a`` (student) and
    ``b`` (teacher), and its derivative with respect to ``a``."""
    p = torch.where(live, a.exp(), 0.0)
    q = torch.where(live, b.exp(), 0.0)
    a, b = torch.where(live, a, 0.0), torch.where(live, b, 0.0)
    if beta == 0:
        terms, grad = q * (b - a), -q
    elif beta == 1:
        terms = p * (a - b)
        grad = terms + p
    else:
        log_m = torch.where(live, torch.log(((1 - beta) * p + beta * q).clamp_min(TINY)), 0.0)
        student_kl = p * (a - log_m)
        terms = (beta * _nan_as_zero(q * (b - log_m))
                 + (1 - beta) * _nan_as_zero(student_kl))
        # d/da of beta q (b - log m) + (1 - beta) p (a - log m), with dm/da = (1 - beta) p
        grad = (1 - beta) * student_kl
    return _nan_as_zero(terms), _nan_as_zero(grad)


def _verl_support_loss(student, rows, params):
    """verl's ``forward_kl_topk`` per row: ``sum_k q_k (t_k - a_k)`` with ``a``, ``t`` the
    student's and teacher's log-probs clamped below at ``log_prob_min_clamp`` and ``q =
    exp(t)``, then ``clamp_min(0)`` and ``clamp(max=loss_max_clamp)``; ``c_k = -q_k`` where
    the student's log-prob passes its clamp (``>=``, as autograd's) and the row its clamps."""
    low, high = params.log_prob_min_clamp, params.loss_max_clamp
    s, t = student, rows.teacher
    coef_mask = rows.live
    if low is not None:
        coef_mask = coef_mask & (s >= low)
        s, t = s.clamp_min(low), t.clamp_min(low)
    q = torch.where(rows.live, t.exp(), 0.0)
    kl = torch.where(rows.live, q * (t - s), 0.0).sum(1)
    passes = kl >= 0
    loss = kl.clamp_min(0.0)
    if high is not None:
        passes &= loss <= high
        loss = loss.clamp_max(high)
    coef = torch.where(coef_mask & passes.unsqueeze(1), -q, 0.0)
    return torch.where(rows.counted, loss, 0.0), coef


def _axolotl_support_loss(student, rows, params):
    """Axolotl's KD top-k loss per row: TRL's divergence terms between the student's log-probs
    (renormalised over the support with ``normalize_topk``) and the teacher's as given, times
    ``T**2``."""
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float32, device=student.device)
    a = torch.where(rows.live, student, neg_inf)
    if params.normalize_topk:
        a = a - torch.logsumexp(a, 1, keepdim=True)
    terms, grad = _divergence_terms(a, rows.teacher, rows.live, params.beta)
    if params.normalize_topk:
        grad = grad - torch.where(rows.live, a.exp(), 0.0) * grad.sum(1, keepdim=True)
    scale = params.temperature ** 2
    loss = torch.where(rows.counted, terms.sum(1), 0.0) * scale
    return loss, torch.where(rows.live, grad, 0.0) * scale


def support_loss(student, rows, params):
    """Per-row losses ``[n]`` and ``c = d loss / d student`` ``[n, K]`` (0 on dropped entries)
    from the student's log-probs at the support (where ``params.full_softmax`` is False, any
    per-row offset of them)."""
    if params.objective == "verl_forward_kl":
        return _verl_support_loss(student, rows, params)
    if params.objective == "axolotl_kd":
        return _axolotl_support_loss(student, rows, params)
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float32, device=student.device)
    s = torch.where(rows.live, student, neg_inf)
    t = torch.where(rows.live, rows.teacher, neg_inf)
    if params.tail:
        s_tail, tail_passes = _tail_bucket(s)
        t_tail, _ = _tail_bucket(t)
        live = torch.cat([rows.live, torch.ones_like(rows.live[:, :1])], 1)
        terms, grad = _divergence_terms(torch.cat([s, s_tail.unsqueeze(1)], 1),
                                        torch.cat([t, t_tail.unsqueeze(1)], 1), live, params.beta)
        # d log(1 - sum_j exp s_j) / d s_k = -exp(s_k) / (1 - sum_j exp s_j) = -exp(s_k - tail)
        tail_grad = torch.where(tail_passes, grad[:, -1], 0.0).unsqueeze(1)
        coef = grad[:, :-1] - tail_grad * torch.exp(s - s_tail.unsqueeze(1))
    else:
        a = s - torch.logsumexp(s, 1, keepdim=True)
        b = t - torch.logsumexp(t, 1, keepdim=True)
        terms, grad = _divergence_terms(a, b, rows.live, params.beta)
        # a_k = s_k - logsumexp(s): d a_j / d s_k = [j == k] - exp(a_k)
        coef = grad - torch.where(rows.live, a.exp(), 0.0) * grad.sum(1, keepdim=True)
    loss = torch.where(rows.counted, terms.sum(1), 0.0)
    return loss, torch.where(rows.live, coef, 0.0)


def _row_max(chunk, rows):
    row_max = chunk.amax(1).float()
    return torch.where(rows.counted, row_max, 0.0) if rows.any_ignored else row_max


def _shifted(chunk, row_max, rows, temperature, work):
    """``(x - max) / T`` of a chunk in float32, written into ``work`` (may be ``chunk``)."""
    z = work if work is chunk else work.copy_(chunk)  # upcast first: no 16-bit rounding
    z.sub_(row_max.unsqueeze(1))
    if temperature != 1.0:
        z.div_(temperature)
    if rows.any_ignored:  # rows that do not count may hold inf or NaN
        z.masked_fill_(~rows.counted.unsqueeze(1), 0.0)
    return z


def _merged(values, ids):
    """Per entry, the sum of ``values`` over the entries of its row with the same id."""
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(values.dtype)
    return torch.bmm(same, values.unsqueeze(2)).squeeze(2)


def _write_grad(exp_shifted, sums, rows, coef, row_factor, out):
    """``out = sum_k w_k [j == id_k] - (sum_k w_k) p_j`` with ``w = coef * row_factor`` and
    ``p = exp_shifted / sums`` (float32, overwritten); ``exp_shifted`` None: no ``p`` term."""
    weighted = coef * row_factor.unsqueeze(1)
    if exp_shifted is None:
        out.zero_()
        overwrite_columns_(out, 1, rows.ids, _merged(weighted, rows.ids))
        return
    exp_shifted.mul_((-weighted.sum(1) / sums).unsqueeze(1))
    exp_shifted.scatter_add_(1, rows.ids, weighted)
    if exp_shifted is not out:
        out.copy_(exp_shifted)


def chunk_forward(chunk, rows, params, work, grad_rows=None, out=None):
    """One chunk ``[n, V]``: ``(losses [n], row_max [n], sums [n], coef [n, K])``; with
    ``grad_rows`` (``d loss / d row loss``, 1 or n floats) the chunk's logit gradient is
    written into ``out`` (which may be ``chunk`` or ``work``). ``work``: a float32 ``[n, V]``
    buffer (``chunk`` itself when it may be overwritten)."""
    row_max = sums = exp_shifted = None
    if params.full_softmax:
        row_max = _row_max(chunk, rows)
        exp_shifted = _shifted(chunk, row_max, rows, params.temperature, work)
        shifted_support = exp_shifted.gather(1, rows.ids)
        sums = exp_shifted.exp_().sum(1)
        student = shifted_support - sums.log().unsqueeze(1)
    else:
        student = chunk.gather(1, rows.ids).float()
        if params.temperature != 1.0:
            student = student / params.temperature
    loss, coef = support_loss(student, rows, params)
    if grad_rows is not None:
        _write_grad(exp_shifted, sums, rows, coef, grad_rows / params.temperature, out)
    return loss, row_max, sums, coef


def chunk_backward(chunk, rows, params, work, row_max, sums, coef, grad_rows, out):
    """The logit gradient of one chunk from the forward's row stats, into ``out``."""
    exp_shifted = None
    if params.full_softmax:
        exp_shifted = _shifted(chunk, row_max, rows, params.temperature, work).exp_()
    _write_grad(exp_shifted, sums, rows, coef, grad_rows / params.temperature, out)


def _rows_of(grad_rows, start, stop):
    return grad_rows if grad_rows.numel() == 1 else grad_rows[start:stop]


def _logits_chunks(logits_rows):
    """Yield ``(start, stop, a, b0, b1)``: flattened rows ``start:stop`` are
    ``logits_rows[a, b0:b1]`` of the ``[A, B, V]`` view, in chunks of the head's size."""
    outer, inner, vocab = logits_rows.shape
    step = chunk_rows(inner, vocab, logits_rows.device)
    for a in range(outer):
        for b0 in range(0, inner, step):
            b1 = min(inner, b0 + step)
            yield a * inner + b0, a * inner + b1, a, b0, b1


def _work_buffer(logits_rows, grad, tail):
    """A float32 chunk buffer for the tail's pass over the rows, unless the gradient is float32
    (then its chunks serve)."""
    if not tail or (grad is not None and grad.dtype == torch.float32):
        return None
    _, inner, vocab = logits_rows.shape
    step = chunk_rows(inner, vocab, logits_rows.device)
    return torch.empty(step, vocab, dtype=torch.float32, device=logits_rows.device)


def _kernel_backend(backend, device):
    """The name of ``backend`` on ``device`` when its module has the optional primitive
    ``topk_distill_forward`` (``kernels/primitives.py``), else None: this module's torch ops
    serve (the torch and triton backends, or a backend that cannot serve ``device``)."""
    name = resolve_backend(backend, device) if backend == "auto" else backend
    if name not in ("cpp", "triton") or unavailable_reason(name, device) is not None:
        return None
    return name if hasattr(backend_module(name), "topk_distill_forward") else None


#: ``(logits_rows, support_ids, teacher, live, counted, grad_scale, args, compute_grad,
#: backend)`` -> ``(loss, row_max, sums, coef, grad)``: the primitive as a custom op
_KERNEL = optional_primitive_op("topk_distill_forward", backend_module)


def logits_walk(logits, rows, params, grad_rows=None, kernel_backend=None):
    """``(losses, row_max, sums, coef, grad)`` over the rows of ``logits``; the gradient only
    with ``grad_rows``. ``kernel_backend``: a name from :func:`_kernel_backend` (its primitive
    then serves every row in one call), or None."""
    logits_rows = rows_view(logits)
    if kernel_backend is not None:
        loss, row_max, sums, coef, grad = _KERNEL(
            logits_rows, rows.ids, rows.teacher, rows.live, rows.counted, grad_rows, params,
            grad_rows is not None, kernel_backend)
        return rows.with_nan(loss), row_max, sums, coef, None if grad_rows is None else grad
    n_rows, k = rows.ids.shape
    loss = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    row_max, sums = (torch.zeros_like(loss) for _ in range(2))
    coef = torch.zeros(n_rows, k, dtype=torch.float32, device=logits.device)
    grad = (None if grad_rows is None
            else cached_empty(logits_rows.shape, logits.dtype, logits.device))
    work = _work_buffer(logits_rows, grad, params.full_softmax)
    for start, stop, a, b0, b1 in _logits_chunks(logits_rows):
        out = None if grad is None else grad[a, b0:b1]
        chunk_work = out if work is None else work[:b1 - b0]
        upstream = None if grad_rows is None else _rows_of(grad_rows, start, stop)
        loss[start:stop], chunk_max, chunk_sums, coef[start:stop] = chunk_forward(
            logits_rows[a, b0:b1], rows.part(start, stop), params, chunk_work, upstream, out)
        if params.full_softmax:
            row_max[start:stop], sums[start:stop] = chunk_max, chunk_sums
    return rows.with_nan(loss), row_max, sums, coef, grad


def logits_backward_walk(logits, rows, params, row_max, sums, coef, grad_rows):
    logits_rows = rows_view(logits)
    grad = cached_empty(logits_rows.shape, logits.dtype, logits.device)
    work = _work_buffer(logits_rows, grad, params.full_softmax)
    for start, stop, a, b0, b1 in _logits_chunks(logits_rows):
        out = grad[a, b0:b1]
        chunk_backward(logits_rows[a, b0:b1], rows.part(start, stop), params,
                       out if work is None else work[:b1 - b0], row_max[start:stop],
                       sums[start:stop], coef[start:stop], _rows_of(grad_rows, start, stop), out)
    return grad


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
    return TOPK_DISTILL_LOSS.enter(locals())


class _Checked(NamedTuple):
    """A checked top-k distillation call: its params and support rows, the backend."""
    params: "TopkDistillParams"
    rows: SupportRows
    backend: str


def _checked(call, student: LogitsShape) -> _Checked:
    params, rows = checked_inputs(
        student, call["support_ids"], call["teacher_logprobs"], call["labels"],
        call["support_mask"], call["beta"], call["temperature"], call["tail"], call["reduction"],
        call["objective"], call["normalize_topk"], call["log_prob_min_clamp"],
        call["loss_max_clamp"])
    return _Checked(params, rows, topk_backend(call["backend"]))


def _check(call) -> _Checked:
    check_logits(call["student_logits"], "student_logits")
    return _checked(call, LogitsShape.of(call["student_logits"]))


def _reference(call, checked: _Checked):
    params = checked.params
    return reference.topk_distill_loss(
        call["student_logits"].float(), call["support_ids"],
        call["teacher_logprobs"].detach().float(), call["labels"], params.beta,
        params.temperature, params.tail, call["support_mask"], params.reduction,
        objective=params.objective, normalize_topk=params.normalize_topk,
        log_prob_min_clamp=params.log_prob_min_clamp, loss_max_clamp=params.loss_max_clamp)


def _local(call, checked: _Checked):
    student_logits, (params, rows, _) = call["student_logits"], checked
    reduction = params.reduction
    lead_shape = student_logits.shape[:-1]
    needs_grad = torch.is_grad_enabled() and student_logits.requires_grad
    kernel_backend = _kernel_backend(call["backend"], student_logits.device)
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


def _linear_walk(head, rows, params, grad_rows=None, saved=None):
    """Walk the head's chunks: per-row losses and the row stats (``saved`` None), or, with
    ``grad_rows``, the head's gradients folded per chunk (the chunk's logit gradient written
    over its logits buffer): from the forward's ``saved`` stats in a backward, else written
    in the same pass as the losses."""
    n_rows, k = rows.ids.shape
    device = rows.ids.device
    loss = torch.zeros(n_rows, dtype=torch.float32, device=device)
    row_max, sums = (torch.zeros_like(loss) for _ in range(2))
    coef = torch.zeros(n_rows, k, dtype=torch.float32, device=device)
    work = None
    for start, stop, logits in head.chunks():
        chunk = logits[0]
        if params.full_softmax and chunk.dtype != torch.float32 and work is None:
            work = torch.empty(head.chunk, chunk.shape[1], dtype=torch.float32, device=device)
        chunk_work = chunk if work is None else work[:stop - start]
        part = rows.part(start, stop)
        upstream = None if grad_rows is None else _rows_of(grad_rows, start, stop)
        if saved is not None:
            chunk_backward(chunk, part, params, chunk_work,
                           *(t[start:stop] for t in saved), upstream, chunk)
        else:
            loss[start:stop], chunk_max, chunk_sums, coef[start:stop] = chunk_forward(
                chunk, part, params, chunk_work, upstream, chunk)
            if params.full_softmax:
                row_max[start:stop], sums[start:stop] = chunk_max, chunk_sums
        if grad_rows is not None:
            head.fold(start, stop, chunk)
    return rows.with_nan(loss), (row_max, sums, coef), head.gradients()


class _LinearTopkDistillRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; the backward walks the chunks again and writes
    the gradient from the row stats and coefficients the forward kept."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, params, chunk_size):
        head = ChunkedHead(hidden, weight, bias, chunk_size)
        loss, saved, _ = _linear_walk(head, rows, params)
        ctx.save_for_backward(hidden, weight, bias, *saved)
        ctx.rows, ctx.params, ctx.chunk_size = rows, params, chunk_size
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("linear_topk_distill_loss", None)
        hidden, weight, bias, *saved = ctx.saved_tensors
        head = ChunkedHead(hidden, weight, bias, ctx.chunk_size, ctx.needs_input_grad[:3])
        _, _, (grad_hidden, grad_weight, grad_bias) = _linear_walk(
            head, ctx.rows, ctx.params, ctx.rows.with_nan(grad_rows.reshape(-1).float()), saved)
        return (grad_or_none(grad_hidden), grad_or_none(grad_weight), grad_or_none(grad_bias),
                None, None, None)


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
    return LINEAR_TOPK_DISTILL_LOSS.enter(locals())


def _check_linear(call) -> _Checked:
    check_head(call["hidden"], call["weight"], call["bias"], call["chunk_size"])
    return _checked(call, LogitsShape.of_head(call["hidden"], call["weight"]))


def _reference_linear(call, checked: _Checked):
    keywords = {name: call[name] for name in (
        "support_ids", "teacher_logprobs", "labels", "beta", "temperature", "tail",
        "support_mask", "reduction", "objective", "normalize_topk", "log_prob_min_clamp",
        "loss_max_clamp")}
    logits = reference_logits(call["hidden"], call["weight"], call["bias"], 1.0, None)
    return topk_distill_loss(logits, backend="reference", **keywords)


def _local_linear(call, checked: _Checked):
    hidden, weight, bias = call["hidden"], call["weight"], call["bias"]
    chunk_size = call["chunk_size"]
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
            loss = _linear_walk(ChunkedHead(hidden_rows, weight, bias, chunk_size), rows,
                                params)[0]
        return loss.view(lead_shape)
    scale = rows.with_nan(row_grad_scale(rows, params, lead_shape, hidden.device))
    with torch.no_grad():
        head = ChunkedHead(hidden_rows, weight, bias, chunk_size, needs)
        loss, _, (grad_hidden, grad_weight, grad_bias) = _linear_walk(
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
