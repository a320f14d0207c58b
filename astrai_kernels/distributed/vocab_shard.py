"""The vocabulary shard's math: each rank's statistics of its shard, combined over the group.

How: each rank runs its backend's existing forward primitive on its shard with local targets
(a row whose target lies in another shard points at column 0, its value unused), giving per row
the shard's ``lse_r``, the owner's ``log p_r(y)`` and the shard entropy ``H_r``. Two all-reduces
combine them, a max then one sum of a few floats per row::

    M = max_r lse_r;   w_r = exp(lse_r - M);   W = sum_r w_r;   lse = M + log W
    logp = (logp_owner + lse_owner - M) - log W
    H = sum_r c_r (H_r - log c_r),  c_r = w_r / W      (the entropy of a mixture of softmaxes)

so a row costs 4 bytes (the max) plus 8 to 16 (a sum of 2 floats; 3 with label smoothing, 4
with entropy) on the wire, never a logits row; the ``linear_*`` backward adds the all-reduce of
the hidden states' gradient (``H`` floats per row, as in Megatron). The gradient needs the
group's ``lse`` and no collective: the backend primitive ``vocab_shard_backward``
(``kernels/primitives.py``) writes ``p_j (alpha + beta log p_j) + gamma d_jy + delta`` per row,
times the chain rule of the temperature and the softcap. GRPO is the token log-probs followed by
its per-token surrogate in torch (O(B*T)); the fused single-pass GRPO kernel cannot be used,
since ``dL/dlogp`` needs the group's ``logp`` before the gradient pass.

A shard whose row is all -inf (a padded vocabulary masked on the last rank, a -inf bias) has
``lse_r = -inf`` and ``w_r = 0``; its other statistics are NaN (``-inf - -inf``), so its terms
are selected out, never multiplied by the 0 weight: it adds nothing to ``W`` or ``H`` and, as
the target's owner, gives ``logp = -inf`` (a +inf loss, as unsharded).

A rank may hold no vocabulary at all (``V_r = 0``): its row statistics are those of an all
-inf shard without running a kernel (``lse_r = -inf``, no targets, nothing in the
label-smoothing mean), its gradients are zero (empty for its own logits, weight and bias), and
it still takes part in every collective.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.matmul import compute_dtype
from ..kernels.memory import cached_empty
from ..kernels.primitives import CrossEntropyArgs, LogprobsArgs, ShardGradArgs
from ..kernels.registry import backend_module
from ..ops._common import (
    dense_grad,
    finish_inplace_grad,
    graph_is_retained,
    refuse_double_backward,
    rows_view,
)
from ..ops.head import ChunkedHead, absent_grad, chunk_rows, row_floats
from .agreement import all_reduced
from .vocab_parallel import VocabShard

# Local targets handed to the primitives: a row ignored by the caller, and (backward only) a
# counted row whose target lies in another rank's shard. Local ids are >= 0, so neither can
# collide with a real target, whatever the caller's ignore_index is.
LOCAL_IGNORE = -1
NOT_IN_SHARD = -2


class LocalTargets(NamedTuple):
    valid: Tensor  # the caller's counted rows
    owned: Tensor  # counted rows whose target lies in this shard
    forward: Tensor  # every counted row in range (the forward primitives read a target)
    backward: Tensor  # NOT_IN_SHARD where the target lies elsewhere


def local_targets(target_flat: Tensor, ignore_index: int, layout: VocabShard) -> LocalTargets:
    valid = target_flat != ignore_index
    local = target_flat.long() - layout.start
    owned = valid & (local >= 0) & (local < layout.size)
    ignored = torch.full_like(local, LOCAL_IGNORE)
    forward = torch.where(owned, local, torch.where(valid, torch.zeros_like(local), ignored))
    elsewhere = torch.full_like(local, NOT_IN_SHARD)
    backward = torch.where(owned, local, torch.where(valid, elsewhere, ignored))
    return LocalTargets(valid, owned, forward.contiguous(), backward.contiguous())


def shard_backend(backend: str, resolved: str, needs_grad: bool) -> str:
    """The backend serving a vocab-parallel call: the gradient needs ``vocab_shard_backward``,
    which ``auto`` finds in ``torch`` when the backend it resolved to lacks it."""
    if resolved == "reference" or not needs_grad:
        return resolved
    if hasattr(backend_module(resolved), "vocab_shard_backward"):
        return resolved
    if backend == "auto":
        return "torch"
    raise NotImplementedError(
        f"backend {resolved!r} has no vocab_shard_backward primitive, so it cannot compute a "
        f"vocabulary-parallel gradient (process_group=) yet; pass backend='torch' or 'auto'")


def _group_weights(lse_r: Tensor, group) -> Tuple[Tensor, Tensor, Tensor]:
    """``(M, log w_r, w_r)`` with ``M = max_r lse_r`` over the group (one all-reduce)."""
    top = all_reduced(lse_r.clone(), dist.ReduceOp.MAX, group)
    shifted = lse_r - top
    return top, shifted, torch.exp(shifted)


def combine_logprobs(logp_r, entropy_r, lse_r, targets: LocalTargets, layout: VocabShard,
                     params) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse)`` of the full vocabulary from each shard's (see module doc)."""
    with_entropy = params.with_entropy
    top, shifted, weight = _group_weights(lse_r, layout.group)
    empty = lse_r == -math.inf  # no mass in this shard: its other statistics are NaN
    owner_logp = torch.where(empty, -math.inf, logp_r + shifted)
    parts = [weight, torch.where(targets.owned, owner_logp, 0.0)]
    if with_entropy:
        parts += [torch.where(empty, 0.0, weight * entropy_r),
                  torch.where(empty, 0.0, weight * shifted)]
    sums = all_reduced(torch.stack(parts), dist.ReduceOp.SUM, layout.group)
    log_total = torch.log(sums[0])
    valid = targets.valid
    logp = torch.where(valid, sums[1] - log_total, 0.0)
    lse = torch.where(valid, top + log_total, 0.0)
    entropy = logp.new_empty(0)
    if with_entropy:
        entropy = torch.where(valid, (sums[2] - sums[3]) / sums[0] + log_total, 0.0)
    return logp, entropy, lse


def combine_cross_entropy(nll_r, smooth_r, lse_r, targets: LocalTargets, layout: VocabShard,
                          params) -> Tuple[Tensor, Tensor]:
    """``(loss, lse)`` per row: ``nll_r = lse_r - z_y`` (owner), ``smooth_r = lse_r - mean z``
    over the shard; ``lse - mean z = sum_r (V_r / V) (smooth_r - log w_r) + log W``."""
    eps = params.label_smoothing
    top, shifted, weight = _group_weights(lse_r, layout.group)
    # a shard with no mass (see the module doc): its owned target's logit is -inf, and so is
    # its mean logit (lse - mean z = +inf: label smoothing's loss is +inf, as unsharded)
    empty = lse_r == -math.inf
    owner_term = torch.where(empty, -math.inf, shifted - nll_r)
    parts = [weight, torch.where(targets.owned, owner_term, 0.0)]
    if eps and layout.size == 0:
        parts.append(torch.zeros_like(weight))  # no logits in this shard's share of the mean
    elif eps:
        parts.append(torch.where(empty, math.inf, (layout.size / layout.vocab_total)
                                 * (smooth_r - shifted)))
    sums = all_reduced(torch.stack(parts), dist.ReduceOp.SUM, layout.group)
    log_total = torch.log(sums[0])
    lse = top + log_total
    loss = (1.0 - eps) * (log_total - sums[1]) + params.z_loss * lse * lse
    if eps:
        loss = loss + eps * (sums[2] + log_total)
    valid = targets.valid
    return torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0)


def _holds_no_vocabulary(logits, target_stat, lse, extra_stat, rows) -> bool:
    """For a chunk of an empty shard (no kernel runs on ``V = 0``), fill its rows' statistics
    as an all -inf shard's: ``lse_r = -inf``, the others 0 (never read: no target is owned)."""
    if logits.shape[-1]:
        return False
    lse[rows] = -math.inf
    target_stat[rows] = 0.0
    if extra_stat.numel():
        extra_stat[rows] = 0.0
    return True


def logprobs_stats(kernels, chunks, targets: LocalTargets, params, n_rows, device):
    """The shard's ``(logp_r, entropy_r, lse_r)`` over ``chunks`` of ``(start, stop, logits)``."""
    temperature, with_entropy = params.temperature, params.with_entropy
    logp, lse = row_floats(n_rows, device), row_floats(n_rows, device)
    entropy = row_floats(n_rows if with_entropy else 0, device)
    for start, stop, logits in chunks:
        rows = slice(start, stop)
        if _holds_no_vocabulary(logits, logp, lse, entropy, rows):
            continue
        logp[rows], chunk_entropy, lse[rows] = kernels.logprobs_forward(
            logits, targets.forward[rows], LogprobsArgs(temperature, LOCAL_IGNORE, with_entropy))
        if with_entropy:
            entropy[rows] = chunk_entropy
    return logp, entropy, lse


def cross_entropy_stats(kernels, chunks, targets: LocalTargets, params, n_rows, device):
    """The shard's ``(lse_r - z_y, lse_r - mean_j z_j, lse_r)`` of the softcapped logits; the
    second (label smoothing only) costs a second pass of the forward primitive."""
    nll, lse = row_floats(n_rows, device), row_floats(n_rows, device)
    smooth = row_floats(n_rows if params.label_smoothing else 0, device)
    # lse - z_y and (all smoothing) lse - mean z, without the z-loss: combined over the group
    nll_args = CrossEntropyArgs(LOCAL_IGNORE, 0.0, 0.0, params.softcap)
    smooth_args = CrossEntropyArgs(LOCAL_IGNORE, 1.0, 0.0, params.softcap)
    for start, stop, logits in chunks:
        rows = slice(start, stop)
        if _holds_no_vocabulary(logits, nll, lse, smooth, rows):
            continue
        nll[rows], lse[rows] = kernels.cross_entropy_forward(
            logits, targets.forward[rows], None, nll_args, None)
        if params.label_smoothing:
            smooth[rows], _ = kernels.cross_entropy_forward(
                logits, targets.forward[rows], None, smooth_args, None)
    return nll, smooth, lse


class Coefficients(NamedTuple):
    """Per row: ``dL/ds_j = p_j (alpha + beta log p_j) + gamma d_jy + delta`` (None: 0)."""
    alpha: Tensor
    beta: Optional[Tensor]
    gamma: Tensor
    delta: Optional[Tensor]

    def rows(self, rows: slice) -> "Coefficients":
        return Coefficients(*(None if c is None else c[rows] for c in self))


def logprobs_coefficients(grad_logp: Tensor, grad_entropy: Optional[Tensor],
                          entropy: Tensor) -> Coefficients:
    """``dL/ds_j = g_lp (d_jy - p_j) - g_H p_j (log p_j + H)``."""
    if grad_entropy is None:
        return Coefficients(-grad_logp, None, grad_logp, None)
    return Coefficients(-(grad_logp + grad_entropy * entropy), -grad_entropy, grad_logp, None)


def cross_entropy_coefficients(row_scale: Tensor, lse: Tensor, params,
                               vocab_total: int) -> Coefficients:
    """``dL/dz_j = g ((1 + 2 z_loss lse) p_j - (1 - eps) d_jy - eps / V)``."""
    eps = params.label_smoothing
    alpha = row_scale * (1.0 + 2.0 * params.z_loss * lse)
    delta = row_scale * (-eps / vocab_total) if eps else None
    return Coefficients(alpha, None, row_scale * (eps - 1.0), delta)


def shard_grad(kernels, logits_rows, targets: LocalTargets, lse, coefficients: Coefficients,
               temperature, softcap, grad_rows) -> None:
    _shard_backward(kernels, logits_rows, targets.backward, lse, coefficients,
                    ShardGradArgs(temperature, softcap, LOCAL_IGNORE), grad_rows)


def _shard_backward(kernels, logits, target, lse, coefficients: Coefficients, args,
                    grad) -> None:
    """The backend's ``vocab_shard_backward``; an empty shard has no gradient to write."""
    if logits.shape[-1]:
        kernels.vocab_shard_backward(logits, target, lse, *coefficients, args, grad)


def _write_grad(logits, kernels, targets, lse, coefficients, temperature, softcap, inplace):
    """The shard's logits gradient: over the logits' own buffer when ``inplace`` allows."""
    logits_rows = rows_view(logits)
    if (inplace and not graph_is_retained() and not torch.compiler.is_compiling()
            and logits_rows.data_ptr() == logits.data_ptr()):
        shard_grad(kernels, logits_rows, targets, lse, coefficients, temperature, softcap,
                   logits_rows)
        return finish_inplace_grad(logits, None, logits.shape)
    # the gradient cache, as the single-process ops: a fresh [N, V_shard] buffer would be
    # first-touched (page faults) every step, several times the kernel's own time on CPU
    grad = cached_empty(logits.shape, logits.dtype, logits.device)
    shard_grad(kernels, logits_rows, targets, lse, coefficients, temperature, softcap,
               rows_view(grad))
    return grad


class LogprobsShard:
    """``token_logprobs``' part of the shard path: per row ``(logp, entropy)`` (zeros unless
    ``params.with_entropy``), ``params`` the op's checked ``LogprobsParams``."""

    op_names = ("token_logprobs", "linear_token_logprobs")
    stats = staticmethod(logprobs_stats)

    @staticmethod
    def combine(stats, targets, layout, params):
        """``(results, saved)``: the rows' results, and what the backward reads (``lse``
        first)."""
        logp, entropy, lse = combine_logprobs(*stats, targets, layout, params)
        results = (logp, entropy if params.with_entropy else torch.zeros_like(logp))
        return results, (lse, entropy)

    @staticmethod
    def coefficients(grads, saved, params, layout) -> Coefficients:
        (grad_logp, grad_entropy), (lse, entropy) = grads, saved
        grad_entropy = dense_grad(grad_entropy, lse) if params.with_entropy else None
        return logprobs_coefficients(dense_grad(grad_logp, lse), grad_entropy, entropy)

    @staticmethod
    def transform(params) -> Tuple[float, float]:
        """The ``(temperature, softcap)`` the gradient's chain rule goes through."""
        return params.temperature, 0.0


class CrossEntropyShard:
    """``cross_entropy``'s part of the shard path: per row ``(loss,)``, ``params`` the op's
    checked ``CrossEntropyParams``."""

    op_names = ("cross_entropy", "linear_cross_entropy")
    stats = staticmethod(cross_entropy_stats)

    @staticmethod
    def combine(stats, targets, layout, params):
        loss, lse = combine_cross_entropy(*stats, targets, layout, params)
        return (loss,), (lse,)

    @staticmethod
    def coefficients(grads, saved, params, layout) -> Coefficients:
        (grad_rows,), (lse,) = grads, saved
        return cross_entropy_coefficients(dense_grad(grad_rows, lse), lse, params,
                                          layout.vocab_total)

    @staticmethod
    def transform(params) -> Tuple[float, float]:
        return 1.0, params.softcap


class ShardRows(torch.autograd.Function):
    """``family``'s per-row results of this shard's logits; the backward writes the shard's
    gradient with the upstream row gradients."""

    @staticmethod
    def forward(ctx, logits, targets, params, layout, family):
        n_rows = targets.valid.numel()
        stats = family.stats(backend_module(params.backend), ((0, n_rows, rows_view(logits)),),
                             targets, params, n_rows, logits.device)
        results, saved = family.combine(stats, targets, layout, params)
        ctx.save_for_backward(logits, *saved)
        ctx.targets, ctx.params, ctx.layout, ctx.family = targets, params, layout, family
        return results

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward(ctx.family.op_names[0], None)
        logits, *saved = ctx.saved_tensors
        params = ctx.params
        coefficients = ctx.family.coefficients(grads, saved, params, ctx.layout)
        grad = _write_grad(logits, backend_module(params.backend), ctx.targets, saved[0],
                           coefficients, *ctx.family.transform(params), params.inplace_backward)
        return grad, None, None, None, None


class EmptyShardHead:
    """``ChunkedHead``'s walk for a weight with no rows (``[0, H]``): each chunk's logits are
    ``[1, n, 0]`` (no matmul), and the shard adds nothing to any gradient, so they are zeros
    (empty for the weight and the bias)."""

    def __init__(self, hidden, weight, bias, chunk_size, needs_grad=(False, False, False),
                 hidden_grad_float32=False):
        self.hidden, self.weight, self.bias, self.needs = hidden, weight, bias, needs_grad
        self.hidden_grad_dtype = torch.float32 if hidden_grad_float32 else hidden.dtype
        self.chunk = chunk_rows(hidden.shape[0], 0, hidden.device, chunk_size)

    def chunks(self):
        n_rows = self.hidden.shape[0]
        for start in range(0, n_rows, self.chunk):
            stop = min(start + self.chunk, n_rows)
            yield start, stop, self.hidden.new_empty(1, stop - start, 0)

    def fold(self, start, stop, grad_logits):
        pass

    def gradients(self):
        dtypes = (self.hidden_grad_dtype, self.weight.dtype, self.hidden.dtype)
        tensors = (self.hidden, self.weight, self.bias)
        return tuple(torch.zeros_like(tensor, dtype=dtype) if need else absent_grad(self.hidden)
                     for tensor, dtype, need in zip(tensors, dtypes, self.needs))


def shard_head(hidden, weight, bias, chunk_size, needs_grad=(False, False, False)):
    """The chunk walk over this rank's shard of the head (``EmptyShardHead`` for no rows). Its
    hidden-state gradient is float32, a part of the sum over the group that
    :func:`summed_hidden_grad` rounds once."""
    head_class = EmptyShardHead if weight.shape[0] == 0 else ChunkedHead
    return head_class(hidden, weight, bias, chunk_size, needs_grad, hidden_grad_float32=True)


def summed_hidden_grad(grad_part, dtype, group):
    """The hidden states' gradient: the ranks' float32 parts summed over the group, rounded to
    ``dtype`` once (parts rounded before the sum would add a rounding per rank)."""
    return all_reduced(grad_part, dist.ReduceOp.SUM, group).to(dtype)


def _head_gradients(ctx, kernels, lse, coefficients, temperature, softcap):
    """The fused head's backward on this shard: chunk logits, their gradient over the chunk
    buffer, folded into hidden/weight/bias; the hidden states' gradient summed over the group.
    ``ctx`` saved ``(hidden_rows, weight, bias, ...)`` and holds the call's fields."""
    hidden, weight, bias = ctx.saved_tensors[:3]
    needs = tuple(ctx.needs_input_grad[:3])
    head = shard_head(hidden, weight, bias, ctx.chunk_size, needs)
    shard_args = ShardGradArgs(temperature, softcap, LOCAL_IGNORE)
    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        _shard_backward(kernels, logits, ctx.targets.backward[rows], lse[rows],
                        coefficients.rows(rows), shard_args, logits)
        head.fold(start, stop, logits)
    grads = list(head.gradients())
    if needs[0]:
        grads[0] = summed_hidden_grad(grads[0], hidden.dtype, ctx.layout.group)
    return tuple(grad if need else None for grad, need in zip(grads, needs))


def head_chunks(hidden_rows, weight, bias, chunk_size):
    return shard_head(hidden_rows, weight, bias, chunk_size).chunks()


class ShardHeadRows(torch.autograd.Function):
    """``family``'s per-row results of the head whose weight holds this rank's shard."""

    @staticmethod
    def forward(ctx, hidden_rows, weight, bias, targets, params, chunk_size, layout, family):
        stats = family.stats(backend_module(params.backend),
                             head_chunks(hidden_rows, weight, bias, chunk_size), targets, params,
                             hidden_rows.shape[0], hidden_rows.device)
        results, saved = family.combine(stats, targets, layout, params)
        ctx.save_for_backward(hidden_rows, weight, bias, *saved)
        ctx.targets, ctx.params, ctx.chunk_size, ctx.layout = targets, params, chunk_size, layout
        ctx.family = family
        return results

    @staticmethod
    def backward(ctx, *grads):
        refuse_double_backward(ctx.family.op_names[1], None)
        saved = ctx.saved_tensors[3:]
        params = ctx.params
        coefficients = ctx.family.coefficients(grads, saved, params, ctx.layout)
        grads = _head_gradients(ctx, backend_module(params.backend), saved[0], coefficients,
                                *ctx.family.transform(params))
        return (*grads, None, None, None, None, None)


def agreed_chunk_size(hidden_rows, weight, chunk_size, layout: VocabShard) -> int:
    """``chunk_size``, or when None ``chunk_rows``'s rule for the group's largest shard: the
    same on every rank (shards differ in size, an empty one most), and every rank's chunk
    buffer within the rule's budget."""
    if chunk_size is not None:
        return chunk_size
    weight_copy = compute_dtype(hidden_rows.dtype, hidden_rows.device) != weight.dtype
    return chunk_rows(hidden_rows.shape[0], layout.vocab_largest, hidden_rows.device,
                      weight_copy=weight_copy, hidden=weight.shape[1])


def head_shard_cross_entropy_walk(hidden_rows, weight, bias, target_flat, params, layout,
                                  chunk_size, requested_backend, grad_scale, needs):
    """``linear_cross_entropy`` whose gradient factor is known up front (``reduction`` sum or
    mean): one walk over the chunks. Per chunk: the shard's statistics, their combination over
    the group (two all-reduces of a few floats per row), then the gradient with the group's
    ``lse`` written over the chunk's logits and folded. Returns ``(rows_loss, grad_hidden,
    grad_weight, grad_bias)`` of ``sum(grad_scale * rows_loss)``, the hidden states' gradient
    summed over the group. Every chunk makes collectives, so every rank walks the same chunks
    (:func:`agreed_chunk_size`)."""
    params = _shard_params(params, requested_backend, True)
    targets = local_targets(target_flat, params.ignore_index, layout)
    kernels = backend_module(params.backend)
    n_rows = hidden_rows.shape[0]
    rows_loss = row_floats(n_rows, hidden_rows.device)
    row_scale = grad_scale.float().expand(n_rows)
    head = shard_head(hidden_rows, weight, bias,
                      agreed_chunk_size(hidden_rows, weight, chunk_size, layout), needs)
    shard_args = ShardGradArgs(1.0, params.softcap, LOCAL_IGNORE)
    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        chunk_targets = LocalTargets(*(t[rows] for t in targets))
        stats = cross_entropy_stats(kernels, ((0, stop - start, logits),), chunk_targets, params,
                                    stop - start, hidden_rows.device)
        rows_loss[rows], lse = combine_cross_entropy(*stats, chunk_targets, layout, params)
        coefficients = cross_entropy_coefficients(row_scale[rows], lse, params,
                                                  layout.vocab_total)
        _shard_backward(kernels, logits, chunk_targets.backward, lse, coefficients, shard_args,
                        logits)
        head.fold(start, stop, logits)
    grads = list(head.gradients())
    if needs[0]:
        grads[0] = summed_hidden_grad(grads[0], hidden_rows.dtype, layout.group)
    return (rows_loss, *grads)


def _shard_params(params, requested_backend, needs_grad, **changes):
    return replace(params, backend=shard_backend(requested_backend, params.backend, needs_grad),
                   **changes)


def shard_rows(family, logits, target_flat, params, layout, requested_backend):
    """``family``'s per-row results (a tuple: :class:`LogprobsShard`'s ``(logp, entropy)``,
    :class:`CrossEntropyShard`'s ``(loss,)``) of this shard's ``logits``; ``params`` the op's
    checked parameters."""
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    params = _shard_params(params, requested_backend, needs_grad)
    targets = local_targets(target_flat, params.ignore_index, layout)
    if needs_grad:
        return ShardRows.apply(logits, targets, params, layout, family)
    n_rows = target_flat.numel()
    stats = family.stats(backend_module(params.backend), ((0, n_rows, rows_view(logits)),),
                         targets, params, n_rows, logits.device)
    return family.combine(stats, targets, layout, params)[0]


def head_shard_rows(family, hidden_rows, weight, bias, target_flat, params, layout, chunk_size,
                    requested_backend, needs_grad):
    """As :func:`shard_rows`, of the head whose weight holds this rank's shard."""
    params = _shard_params(params, requested_backend, needs_grad)
    targets = local_targets(target_flat, params.ignore_index, layout)
    if needs_grad:
        return ShardHeadRows.apply(hidden_rows, weight, bias, targets, params, chunk_size,
                                   layout, family)
    stats = family.stats(backend_module(params.backend),
                         head_chunks(hidden_rows, weight, bias, chunk_size), targets, params,
                         hidden_rows.shape[0], hidden_rows.device)
    return family.combine(stats, targets, layout, params)[0]
