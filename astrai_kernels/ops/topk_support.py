"""Top-k distillation's math on the student's rows, in torch (any device): the loss of the K
support log-probs and its derivatives ``c_k`` (``support_loss``), one chunk's forward and
backward over the logits (``chunk_forward``, ``chunk_backward``), the walks over a logits
tensor (``logits_walk``: the optional primitive ``topk_distill_forward`` serves every row in one
call where the backend has it) and over the fused head's chunks (``support_head_walk``).
``ops/topk_distill.py`` holds the contract, the checks and the routes; the module docstring
there gives the math."""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import reference
from ..kernels.library import optional_primitive_op
from ..kernels.memory import cached_empty
from ..kernels.registry import backend_module, resolve_backend, unavailable_reason
from ._common import overwrite_columns_, rows_view
from .head import chunk_rows

TINY = torch.finfo(torch.float32).tiny


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


def primitive_backend(backend, device):
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
    with ``grad_rows``. ``kernel_backend``: a name from :func:`primitive_backend` (its primitive
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


def support_head_walk(head, rows, params, grad_rows=None, saved=None):
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
