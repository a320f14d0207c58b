"""Cross-entropy (logit scale, label smoothing, z-loss, softcap) with the gradient written in the
same kernel.

The logits are ``z = c * tanh(a x / c)`` with softcap ``c``, else ``z = a x`` (``a`` the logit
scale, applied as each tile is loaded). Per row: pass 1 is the online reduction (``lse`` and, for
label smoothing, ``sum_j z_j``); pass 2 (``HAS_GRAD``) re-reads the row (from registers when it is
one tile, else newest tiles first, from L2) and writes
``grad_j = a gs ((1 + 2 z_loss lse) p_j - (1 - eps) d_jy - eps / V)``, times ``1 - (z_j / c)^2``
with softcap.
"""

import triton
import triton.language as tl

from .helpers import (
    LN2,
    LOG2E,
    POS_INF,
    capped_logits,
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
def cross_entropy_fwd_kernel(
    logits_ptr, target_ptr, loss_ptr, lse_ptr, grad_ptr, grad_scale_ptr,
    n_rows, inner, V, stride0, stride1, stride_v, g_stride0, g_stride1, g_stride_v,
    grad_scale_stride,
    ignore_index, label_smoothing, z_loss, softcap, logit_scale,
    BLOCK_V: tl.constexpr, ONE_TILE: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        if target != ignore_index:
            row_ptr = logits_ptr + row_offset(row, inner, stride0, stride1)
            x_target = tl.load(row_ptr + target * stride_v)
            z_target = capped_logits(x_target, True, softcap, HAS_SOFTCAP, logit_scale,
                                     HAS_LOGIT_SCALE)
            # the label-smoothing sum is taken relative to a finite value of the row
            z_ref = tl.where(tl.abs(z_target) < POS_INF, z_target, 0.0)
            if ONE_TILE:
                x, cols, mask = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
                z = capped_logits(x, mask, softcap, HAS_SOFTCAP, logit_scale, HAS_LOGIT_SCALE)
                m, log2_s, _, zsum = tile_stats(z, mask, LOG2E, z_ref, False, HAS_SMOOTHING)
            else:
                m, log2_s, _, zsum = row_stats(row_ptr, V, stride_v, LOG2E, softcap, z_ref,
                                               BLOCK_V, HAS_SOFTCAP, False, HAS_SMOOTHING,
                                               logit_scale, HAS_LOGIT_SCALE)
            log_sum = log2_s * LN2
            lse = tl.where(m == POS_INF, m, m + log_sum)  # as torch.logsumexp on a +inf row
            # lse - z_y = log_sum - (z_y - m): relative to the row max, exact however large z is
            loss = (1.0 - label_smoothing) * (log_sum - (z_target - m))
            loss += z_loss * lse * lse
            if HAS_SMOOTHING:  # mean_j z_j - m = mean_j (z_j - z_ref) + (z_ref - m)
                loss += label_smoothing * (log_sum - (zsum / V + (z_ref - m)))
            tl.store(loss_ptr + row, loss)
            tl.store(lse_ptr + row, lse)
            if HAS_GRAD:
                gs = tl.load(grad_scale_ptr + tl.cast(row, tl.int64) * grad_scale_stride)
                if HAS_LOGIT_SCALE:  # dz/dx carries the logit scale
                    gs = gs * logit_scale
                # g = gs ((1 + 2 z_loss lse) p - eps / V + [j == y] (eps - 1)), grad_tile's form
                c_target = label_smoothing - 1.0
                c_p = 1.0 + 2.0 * z_loss * lse
                c_const = label_smoothing / V
                grad_row_ptr = grad_ptr + row_offset(row, inner, g_stride0, g_stride1)
                if ONE_TILE:
                    g = grad_tile(z, cols, target, m, log2_s, LOG2E, c_target, c_p, 0.0, c_const,
                                  gs, softcap, False, HAS_SOFTCAP, False)
                    store_tile(grad_row_ptr, cols, mask, g_stride_v, g)
                else:
                    write_grad_row(row_ptr, grad_row_ptr, V, stride_v, g_stride_v, target, m,
                                   log2_s, LOG2E, c_target, c_p, 0.0, c_const, gs, softcap,
                                   BLOCK_V, False, HAS_SOFTCAP, False, logit_scale,
                                   HAS_LOGIT_SCALE)
        else:
            tl.store(loss_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if HAS_GRAD:
                zero_row(grad_ptr + row_offset(row, inner, g_stride0, g_stride1), V, g_stride_v,
                         BLOCK_V)
