"""GRPO per-token loss with the gradient written in the same kernel.

Per row (token): pass 1 gives ``logp`` (and with ``WITH_ENTROPY`` the entropy, from the same
online sums); the clipped-ratio (+ k3 KL) loss and its derivative ``dl/dlogp`` are scalar math on
the row; pass 2 (``HAS_GRAD``) writes ``grad_j = w * dl/dlogp * (d_jy - p_j) / T``.
``HAS_OLD = False`` is on-policy (ratio 1, the gradient still flows through it); ``HAS_REF`` adds
``beta * k3``, times the uncapped ratio with ``KL_RATIO_CORRECTION``.
"""

import triton
import triton.language as tl

from .helpers import (
    LN2,
    LOG2E,
    LOG_RATIO_CLAMP,
    grad_tile,
    load_tile,
    row_offset,
    row_stats,
    store_tile,
    tile_stats,
    write_grad_row,
    zero_row,
)


@triton.jit
def grpo_token_terms(logp, old, ref, advantage, clip_low, clip_high, delta, beta,
                     HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
                     KL_RATIO_CORRECTION: tl.constexpr):
    """``(loss, dloss/dlogp)`` of one token (scalars), as ``grpo_token_terms`` of the torch backend.

    clamp's gradient is zero outside its range; on a tie of the min, the unclipped branch.
    """
    if HAS_OLD:
        raw_log_ratio = logp - old
    else:
        raw_log_ratio = logp * 0.0
    log_ratio = tl.minimum(tl.maximum(raw_log_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    ratio = tl.exp(log_ratio)
    dratio = tl.where(tl.abs(raw_log_ratio) <= LOG_RATIO_CLAMP, ratio, 0.0)
    has_delta = delta > 0.0
    ratio_unclipped = tl.where(has_delta, tl.minimum(ratio, delta), ratio)
    dratio_unclipped = tl.where(has_delta & (ratio > delta), 0.0, dratio)
    low = 1.0 - clip_low
    high = 1.0 + clip_high
    ratio_clipped = tl.minimum(tl.maximum(ratio, low), high)
    dratio_clipped = tl.where((ratio >= low) & (ratio <= high), dratio, 0.0)
    unclipped = ratio_unclipped * advantage
    clipped = ratio_clipped * advantage
    take_unclipped = unclipped <= clipped
    loss = -tl.where(take_unclipped, unclipped, clipped)
    dloss = -advantage * tl.where(take_unclipped, dratio_unclipped, dratio_clipped)
    if HAS_REF:
        raw_ref_ratio = ref - logp
        ref_ratio = tl.minimum(tl.maximum(raw_ref_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
        exp_ref = tl.exp(ref_ratio)
        ref_inside = tl.abs(raw_ref_ratio) <= LOG_RATIO_CLAMP
        k3 = exp_ref - ref_ratio - 1.0
        dk3 = tl.where(ref_inside, 1.0 - exp_ref, 0.0)
        if KL_RATIO_CORRECTION:
            # k3 * r, r the uncapped ratio (not delta's). Its derivative dk3 * r + k3 * dr is
            # r * (1 - e + k3) = -r * dr inside both clamps, formed so: the sum cancels
            ratio_inside = tl.abs(raw_log_ratio) <= LOG_RATIO_CLAMP
            inner = tl.where(ref_inside, tl.where(ratio_inside, -ref_ratio, dk3),
                             tl.where(ratio_inside, k3, 0.0))
            dk3 = ratio * inner
            k3 = k3 * ratio
        loss += beta * k3
        dloss += beta * dk3
    return loss, dloss


@triton.jit
def grpo_fwd_kernel(
    logits_ptr, target_ptr, advantages_ptr, old_ptr, ref_ptr, weight_ptr, logp_ptr, loss_ptr,
    entropy_ptr, grad_ptr,
    n_rows, inner, V, stride0, stride1, stride_v, g_stride0, g_stride1, g_stride_v,
    temperature, clip_low, clip_high, delta, beta,
    BLOCK_V: tl.constexpr, ONE_TILE: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
    KL_RATIO_CORRECTION: tl.constexpr, WITH_ENTROPY: tl.constexpr, HAS_GRAD: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    scale = LOG2E / temperature
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        weight = tl.load(weight_ptr + row)
        if weight != 0.0:
            target = tl.load(target_ptr + row).to(tl.int64)
            row_ptr = logits_ptr + row_offset(row, inner, stride0, stride1)
            if ONE_TILE:
                x, cols, mask = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
                z = x.to(tl.float32)
                m, log2_s, h2, _ = tile_stats(z, mask, scale, 0.0, WITH_ENTROPY, False)
            else:
                m, log2_s, h2, _ = row_stats(row_ptr, V, stride_v, scale, 1.0, 0.0, BLOCK_V,
                                             False, WITH_ENTROPY, False)
            x_target = tl.load(row_ptr + target * stride_v).to(tl.float32)
            # relative to the row max, in natural units (log2 e * (x - m) / T may overflow)
            logp = (x_target - m) * inv_t - log2_s * LN2
            advantage = tl.load(advantages_ptr + row)
            if HAS_OLD:
                old = tl.load(old_ptr + row)
            else:
                old = 0.0
            if HAS_REF:
                ref = tl.load(ref_ptr + row)
            else:
                ref = 0.0
            loss, dloss = grpo_token_terms(logp, old, ref, advantage, clip_low, clip_high, delta,
                                           beta, HAS_OLD, HAS_REF, KL_RATIO_CORRECTION)
            tl.store(logp_ptr + row, logp)
            tl.store(loss_ptr + row, loss)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, h2 * LN2)
            if HAS_GRAD:
                coef = dloss * weight
                grad_row_ptr = grad_ptr + row_offset(row, inner, g_stride0, g_stride1)
                if ONE_TILE:
                    g = grad_tile(z, cols, target, m, log2_s, scale, coef, -coef, 0.0, 0.0, inv_t,
                                  1.0, False, False, False)
                    store_tile(grad_row_ptr, cols, mask, g_stride_v, g)
                else:
                    write_grad_row(row_ptr, grad_row_ptr, V, stride_v, g_stride_v, target, m,
                                   log2_s, scale, coef, -coef, 0.0, 0.0, inv_t, 1.0, BLOCK_V,
                                   False, False, False)
        else:
            tl.store(logp_ptr + row, 0.0)
            tl.store(loss_ptr + row, 0.0)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, 0.0)
            if HAS_GRAD:
                zero_row(grad_ptr + row_offset(row, inner, g_stride0, g_stride1), V, g_stride_v,
                         BLOCK_V)
