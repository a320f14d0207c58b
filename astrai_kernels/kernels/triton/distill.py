"""Distillation (TRL's generalized JSD between student and teacher softmaxes): forward and
backward kernels; the math is ``kernels/primitives.py``'s ``distill_forward`` /
``distill_backward``.

One program walks rows (grid-stride). Forward, per row: ``helpers.row_stats`` over the student
and over the teacher (their maxes and base-2 log-sums), then a pass over both tiles by tile for
the loss and the student's KL to the mixture (the mixture needs both log-sums first), and with
the hard term at ``T != 1`` one more ``row_stats`` of the student at temperature 1. Backward:
one pass over both rows writing the student's gradient. Log-probs are kept in base 2
(``l2 = log2 p``) and formed relative to the row max; losses are converted to natural units once
per row.
"""

import triton
import triton.language as tl

from .helpers import (
    DIRECT_LSE_LIMIT,
    LN2,
    LOG2E,
    NEG_INF,
    POS_INF,
    load_tile,
    row_parts,
    row_stats,
    store_tile,
    zero_row,
)


@triton.jit
def mixture_log2(la2, lb2, log2_w_s, log2_w_t):
    """``log2(w_s 2^la2 + w_t 2^lb2)``: the larger exponent plus ``log2(1 + 2^(lo - hi))``, the
    latter corrected by the rounding of ``1 + e``; -inf where both are -inf (at beta = 1 a
    teacher's -inf id then gives the student's term ``p_s (a - m) = +inf``, the reverse KL's
    value, where ``-inf - -inf`` inside would give NaN)."""
    u = la2 + log2_w_s
    v = lb2 + log2_w_t
    hi = tl.maximum(u, v)
    lo = tl.minimum(u, v)
    e = tl.exp2(lo - hi)
    one_plus = 1.0 + e
    # the correction is below 2^-24: an approximate division (no slow-path call) serves
    mixed = hi + tl.log2(one_plus) - tl.fdiv((one_plus - 1.0) - e, one_plus) * LOG2E
    return tl.where(hi == NEG_INF, hi, mixed)


@triton.jit
def log2_probs(x, ref, scale, log2_s):
    """``log2 p = (x - ref) * scale - log2_s``, clamped at ``<= 0`` (NaN kept)."""
    l2 = (x - ref) * scale - log2_s
    return tl.where(l2 > 0.0, 0.0, l2)


@triton.jit
def distill_fwd_kernel(
    student_ptr, teacher_ptr, target_ptr, loss_ptr, lse_s_ptr, lse_t_ptr, kl_ptr, hard_lse_ptr,
    n_rows, inner, V, s_stride0, s_stride1, s_stride_v, t_stride0, t_stride1, t_stride_v,
    temperature, ignore_index, w_t, w_s, log2_w_s, log2_w_t, hard_weight,
    BLOCK_V: tl.constexpr, FORWARD_KL: tl.constexpr, HARD: tl.constexpr,
    HARD_OWN_STATS: tl.constexpr,
):
    """``HARD_OWN_STATS``: the hard term's temperature-1 log-sum needs its own pass (T != 1)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    scale = LOG2E / temperature
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        if target != ignore_index:
            outer, row_in = row_parts(row, inner)
            s_row = student_ptr + outer * s_stride0 + row_in * s_stride1
            t_row = teacher_ptr + outer * t_stride0 + row_in * t_stride1
            m_s, log2_s_s, _, _ = row_stats(s_row, V, s_stride_v, scale, 1.0, 0.0, BLOCK_V,
                                            False, False, False)
            m_t, log2_s_t, _, _ = row_stats(t_row, V, t_stride_v, scale, 1.0, 0.0, BLOCK_V,
                                            False, False, False)
            acc_t = tl.zeros([BLOCK_V], dtype=tl.float32)
            acc_s = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                xs, cols, mask = load_tile(s_row, start, V, s_stride_v, BLOCK_V)
                xt, t_cols, t_mask = load_tile(t_row, start, V, t_stride_v, BLOCK_V)
                la2 = log2_probs(xs.to(tl.float32), m_s, scale, log2_s_s)
                lb2 = log2_probs(xt.to(tl.float32), m_t, scale, log2_s_t)
                pt = tl.exp2(lb2)
                if FORWARD_KL:
                    acc_t += tl.where(pt != 0.0, pt * (lb2 - la2), 0.0)
                else:
                    ps = tl.exp2(la2)
                    mix2 = mixture_log2(la2, lb2, log2_w_s, log2_w_t)
                    acc_t += tl.where(pt != 0.0, pt * (lb2 - mix2), 0.0)
                    acc_s += tl.where(ps != 0.0, ps * (la2 - mix2), 0.0)
            sum_t = tl.sum(acc_t, 0) * LN2
            sum_s = tl.sum(acc_s, 0) * LN2
            if FORWARD_KL:
                loss = sum_t
            else:
                loss = w_t * sum_t + w_s * sum_s
            lse_s = tl.where(m_s == POS_INF, m_s, m_s * inv_t + log2_s_s * LN2)
            if HARD:
                x_target = tl.load(s_row + target * s_stride_v).to(tl.float32)
                if HARD_OWN_STATS:
                    m_h, log2_s_h, _, _ = row_stats(s_row, V, s_stride_v, LOG2E, 1.0, 0.0,
                                                    BLOCK_V, False, False, False)
                else:
                    m_h = m_s
                    log2_s_h = log2_s_s
                loss += hard_weight * ((m_h - x_target) + log2_s_h * LN2)
                tl.store(hard_lse_ptr + row, tl.where(m_h == POS_INF, m_h,
                                                      m_h + log2_s_h * LN2))
            tl.store(loss_ptr + row, loss)
            tl.store(lse_s_ptr + row, lse_s)
            tl.store(lse_t_ptr + row, tl.where(m_t == POS_INF, m_t, m_t * inv_t + log2_s_t * LN2))
            tl.store(kl_ptr + row, sum_s)
        else:
            tl.store(loss_ptr + row, 0.0)
            tl.store(lse_s_ptr + row, 0.0)
            tl.store(lse_t_ptr + row, 0.0)
            tl.store(kl_ptr + row, 0.0)
            if HARD:
                tl.store(hard_lse_ptr + row, 0.0)


@triton.jit
def saved_or_fresh(row_ptr, V, stride_v, lse, inv_t, BLOCK_V: tl.constexpr):
    """``(ref, log2_s)`` with ``log2 p = (x - ref) * inv_t * log2(e) - log2_s``: from the saved
    natural ``lse`` while ``|lse| <= DIRECT_LSE_LIMIT``, else the row's recomputed max and
    log-sum (a large lse has lost the precision the probabilities need)."""
    ref = lse * 0.0
    log2_s = lse * LOG2E
    if not (tl.abs(lse) <= DIRECT_LSE_LIMIT):
        m, fresh_log2_s, _, _ = row_stats(row_ptr, V, stride_v, inv_t * LOG2E, 1.0, 0.0, BLOCK_V,
                                          False, False, False)
        ref = m
        log2_s = fresh_log2_s
    return ref, log2_s


@triton.jit
def distill_bwd_kernel(
    student_ptr, teacher_ptr, target_ptr, lse_s_ptr, lse_t_ptr, kl_ptr, hard_lse_ptr,
    grad_loss_ptr, grad_ptr,
    n_rows, inner, V, s_stride0, s_stride1, s_stride_v, t_stride0, t_stride1, t_stride_v,
    g_stride0, g_stride1, g_stride_v,
    temperature, ignore_index, w_s, log2_w_s, log2_w_t, hard_weight,
    BLOCK_V: tl.constexpr, FORWARD_KL: tl.constexpr, HARD: tl.constexpr,
    HARD_OWN_STATS: tl.constexpr,
):
    """``HARD_OWN_STATS``: the hard term's temperature-1 probabilities differ from the
    student's (T != 1); at T = 1 they are the student's own."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    scale = LOG2E / temperature
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        outer, row_in = row_parts(row, inner)
        g_row = grad_ptr + outer * g_stride0 + row_in * g_stride1
        if target != ignore_index:
            s_row = student_ptr + outer * s_stride0 + row_in * s_stride1
            t_row = teacher_ptr + outer * t_stride0 + row_in * t_stride1
            ref_s, log2_s_s = saved_or_fresh(s_row, V, s_stride_v, tl.load(lse_s_ptr + row),
                                             inv_t, BLOCK_V)
            ref_t, log2_s_t = saved_or_fresh(t_row, V, t_stride_v, tl.load(lse_t_ptr + row),
                                             inv_t, BLOCK_V)
            upstream = tl.load(grad_loss_ptr + row)
            if FORWARD_KL:
                coef = upstream * inv_t
                kl = upstream * 0.0
            else:
                coef = upstream * inv_t * w_s
                kl = tl.load(kl_ptr + row)
            if HARD:
                hard_coef = upstream * hard_weight
                if HARD_OWN_STATS:
                    ref_h, log2_s_h = saved_or_fresh(s_row, V, s_stride_v,
                                                     tl.load(hard_lse_ptr + row), 1.0, BLOCK_V)
            for start in range(0, V, BLOCK_V):
                xs, cols, mask = load_tile(s_row, start, V, s_stride_v, BLOCK_V)
                xt, t_cols, t_mask = load_tile(t_row, start, V, t_stride_v, BLOCK_V)
                xs = xs.to(tl.float32)
                la2 = log2_probs(xs, ref_s, scale, log2_s_s)
                lb2 = log2_probs(xt.to(tl.float32), ref_t, scale, log2_s_t)
                ps = tl.exp2(la2)
                if FORWARD_KL:
                    g = (ps - tl.exp2(lb2)) * coef
                else:
                    mix2 = mixture_log2(la2, lb2, log2_w_s, log2_w_t)
                    g = tl.where(ps != 0.0, ps * ((la2 - mix2) * LN2 - kl), 0.0) * coef
                if HARD:
                    if HARD_OWN_STATS:
                        g += tl.exp2(log2_probs(xs, ref_h, LOG2E, log2_s_h)) * hard_coef
                    else:
                        g += ps * hard_coef
                    g -= tl.where(cols == target, hard_coef, 0.0)
                store_tile(g_row, cols, mask, g_stride_v, g)
        else:
            zero_row(g_row, V, g_stride_v, BLOCK_V)
