"""Token log-probs (and entropy) of ``softmax(z / T)``: forward and backward kernels.

One program walks rows (grid-stride); per row, pass 1 is the online tile reduction of
``helpers.row_stats``; the backward is a single pass writing every gradient element once.
"""

import triton
import triton.language as tl

from .helpers import (
    DIRECT_LSE_LIMIT,
    LN2,
    LOG2E,
    POS_INF,
    load_tile,
    row_offset,
    row_stats,
    tile_stats,
    write_grad_row,
    zero_row,
)


@triton.jit
def logprobs_fwd_kernel(
    logits_ptr, target_ptr, logp_ptr, entropy_ptr, lse_ptr,
    n_rows, inner, V, stride0, stride1, stride_v,
    temperature, ignore_index,
    BLOCK_V: tl.constexpr, ONE_TILE: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    scale = LOG2E / temperature
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        if target != ignore_index:
            row_ptr = logits_ptr + row_offset(row, inner, stride0, stride1)
            if ONE_TILE:
                x, cols, mask = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
                m, log2_s, h2, _ = tile_stats(x.to(tl.float32), mask, scale, 0.0, WITH_ENTROPY,
                                              False)
            else:
                m, log2_s, h2, _ = row_stats(row_ptr, V, stride_v, scale, 1.0, 0.0, BLOCK_V,
                                             False, WITH_ENTROPY, False)
            x_target = tl.load(row_ptr + target * stride_v).to(tl.float32)
            # relative to the row max: exact however large the logits are; in natural units
            # (log2 e * (x - m) / T could overflow where (x - m) / T does not)
            tl.store(logp_ptr + row, (x_target - m) * inv_t - log2_s * LN2)
            # natural units, with m / T formed as the backward forms z / T; +inf on a row
            # holding +inf (as torch.logsumexp)
            tl.store(lse_ptr + row, tl.where(m == POS_INF, m, m * inv_t + log2_s * LN2))
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, h2 * LN2)
        else:
            tl.store(logp_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if WITH_ENTROPY:
                tl.store(entropy_ptr + row, 0.0)


@triton.jit
def logprobs_bwd_kernel(
    logits_ptr, target_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, grad_ptr,
    n_rows, inner, V, stride0, stride1, stride_v, g_stride0, g_stride1, g_stride_v,
    grad_logp_stride, grad_entropy_stride,
    temperature, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    """``grad_j = (1/T) (g_lp (d_jy - p_j) - g_H p_j (s_j - lse + H))`` in one pass."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        grad_row_ptr = grad_ptr + row_offset(row, inner, g_stride0, g_stride1)
        if target != ignore_index:
            row_ptr = logits_ptr + row_offset(row, inner, stride0, stride1)
            lse = tl.load(lse_ptr + row)
            row64 = tl.cast(row, tl.int64)
            g_lp = tl.load(grad_logp_ptr + row64 * grad_logp_stride)
            # (1/T) (p (-g_lp - g_H H) + p u (-g_H) + [j == y] g_lp), u = log p
            if WITH_ENTROPY:
                entropy = tl.load(entropy_ptr + row)
                g_h = tl.load(grad_entropy_ptr + row64 * grad_entropy_stride)
                c_p = -(g_lp + g_h * entropy)
                c_u = -g_h
            else:
                c_p = -g_lp
                c_u = g_lp * 0.0
            # log p = z / T - lse: z / T and lse formed as in the forward, so a V = 1 row gets
            # p == 1 exactly. A large or non-finite lse has lost the precision p needs: then
            # log p = (z - m) / T - log_sum from the row's recomputed max and log-sum.
            ref = lse * 0.0
            log_sum = lse
            if not (tl.abs(lse) <= DIRECT_LSE_LIMIT):
                m, log2_s, _, _ = row_stats(row_ptr, V, stride_v, inv_t * LOG2E, 1.0, 0.0,
                                            BLOCK_V, False, False, False)
                ref = m
                log_sum = log2_s * LN2
            write_grad_row(row_ptr, grad_row_ptr, V, stride_v, g_stride_v, target, ref, log_sum,
                           inv_t, g_lp, c_p, c_u, 0.0, inv_t, 1.0, BLOCK_V, WITH_ENTROPY, False,
                           True)
        else:
            zero_row(grad_row_ptr, V, g_stride_v, BLOCK_V)

