"""Targets scored under vLLM v1's sampler: ``sampled_logprobs_forward`` / ``_backward`` of
``kernels/primitives.py`` (the contract: ``ops/sampling.py``'s docstring).

The kernels work in the logits' own units, as ``csrc/sampling.cpp`` does: ``s = x / T`` (a
float32 division, rounded to nearest) is non-decreasing in ``x``, so the support
``K = {j : s_j >= tau}`` is ``{j : x_j >= theta}`` with ``theta`` the smallest float whose
quotient reaches ``tau`` (:func:`unscaled_lower`); logits whose quotients round to one ``s``
stay tied. ``theta`` is the ``threshold`` output, read back by the backward (the cpp backend's
encoding), which then needs no division.

Forward, one program per row (grid-stride), over the row in ``BLOCK_V`` tiles:

1. the online max ``m`` and ``S = sum exp((x - m) / T)`` (``helpers.row_stats``);
2. min_p: ``theta = unscaled_lower(m / T + log(min_p))``;
3. top_k: a bisection on int keys ordered as the floats (:func:`order_key`) for the largest key
   ``t`` with ``count(x >= t) >= k``, one pass over the row per step, from ``[key(theta),
   key(m)]``; it ends on the key of a row value, the k-th largest, so the tokens tied with it are
   kept; then ``theta = max(theta, unscaled_lower(value(t) / T))``;
4. top_p: the same bisection on the mass ``sum_{x_j >= t} exp((x_j - m) / T)`` reaching
   ``top_p`` times the mass min_p and top_k kept: the crossing token, and its ties, are kept;
5. a last pass for ``|K|`` and the kept mass.

A bisection halves ``[lo, hi]`` per pass; it takes a fixed ``KEY_BITS = 32`` passes (the bits of
a key), so top_k and top_p together read the row about 67 times. A row that fits one tile
(``ONE_TILE``) stays in registers across every pass; a longer row is re-read, from L2 when few
enough rows are in flight (``config.row_programs(rereads=True)``).
The backward writes ``coef * ([j == y] - p'_j [x_j >= theta])`` in one pass (two when
``|lse_kept|`` is too large to form ``p'`` from it, as in ``logprobs.py``).
"""

import triton
import triton.language as tl

from .helpers import (
    DIRECT_LSE_LIMIT,
    LN2,
    LOG2E,
    NEG_INF,
    POS_INF,
    finalize,
    grad_tile,
    load_tile,
    online_update,
    row_offset,
    row_parts,
    row_stats,
    store_tile,
    tile_stats,
    zero_row,
)

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
SIGN_BIT = tl.constexpr(-2147483648)
KEY_BITS = tl.constexpr(32)


@triton.jit
def order_key(v):
    """int64 key ordered as the float32 ``v`` (sign and magnitude: ``-0.0`` and ``0.0`` share
    the key 0; ``key(-inf) = -0x7F800000``)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = bits >> 31  # arithmetic: 0 or -1, so (m ^ sign) - sign negates m
    return (((bits & 0x7FFFFFFF) ^ sign) - sign).to(tl.int64)


@triton.jit
def key_value(key):
    """The float32 whose :func:`order_key` is ``key`` (the key of a non-NaN float)."""
    k = key.to(tl.int32)
    magnitude = tl.abs(k)
    return tl.where(k < 0, magnitude | SIGN_BIT, magnitude).to(tl.float32, bitcast=True)


@triton.jit
def step_float(v, steps):
    """The float32 ``steps`` places above ``v`` in the order of the floats (below when < 0)."""
    return key_value(order_key(v) + steps)


@triton.jit
def rounding_boundary(y, side, temperature):
    """``(boundary * T, tie_to_other)`` in float64, exact: ``boundary`` the midpoint between
    ``y`` and its neighbour on ``side`` (+1 or -1), ``tie_to_other`` whether a quotient there
    rounds to the neighbour (``y``'s last bit odd: ties go to even). The midpoint has at most
    26 significant bits and ``T`` 24, so their product is exact in float64."""
    middle = (tl.cast(y, tl.float64) + tl.cast(step_float(y, side), tl.float64)) * 0.5
    odd = (y.to(tl.int32, bitcast=True) & 1) != 0
    return middle * tl.cast(temperature, tl.float64), odd


@triton.jit
def round_quotient(a, y, temperature):
    """``a / T`` rounded to the nearest float32 (ties to even), for finite ``a``, from ``y``
    within a few ulps of it: ``y`` stepped until ``a`` lies in its rounding interval, each test
    exact in float64."""
    a64 = tl.cast(a, tl.float64)
    low, tie_down = rounding_boundary(y, -1, temperature)
    while (a64 < low) | ((a64 == low) & tie_down):
        y = step_float(y, -1)
        low, tie_down = rounding_boundary(y, -1, temperature)
    high, tie_up = rounding_boundary(y, 1, temperature)
    while (a64 > high) | ((a64 == high) & tie_up):
        y = step_float(y, 1)
        high, tie_up = rounding_boundary(y, 1, temperature)
    return y


@triton.jit
def quotient(a, temperature):
    """``a / T`` as the IEEE division rounds it (as ``torch`` and ``csrc/sampling.cpp`` form
    ``s``): the compiled ``/`` is an approximate division (2 ulps), corrected by
    :func:`round_quotient`. ``tl.math.div_rn`` gives the same value, but its slow path is a
    subroutine call that put registers on the stack."""
    return round_quotient(a, a / temperature, temperature)


@triton.jit
def unscaled_lower(s, temperature):
    """The smallest float32 ``x`` with ``quotient(x, T) >= s``, for a finite ``s``; ``-inf``
    for ``s = -inf``. The quotient is non-decreasing in ``x``, so the answer is a few ulps from
    ``s * T``: step down while the quotient still reaches ``s``, then up until it does."""
    x = tl.minimum(tl.maximum(s * temperature, -FLOAT32_MAX), FLOAT32_MAX)
    while (x > NEG_INF) & (quotient(x, temperature) >= s):
        x = step_float(x, -1)
    while quotient(x, temperature) < s:
        x = step_float(x, 1)
    return x


@triton.jit
def tile_weight(x, mask, cut, m, scale, WEIGHTED: tl.constexpr):
    """Per lane of a tile: ``[x >= cut]`` (int32) or, ``WEIGHTED``, ``[x >= cut] exp2((x - m) *
    scale)``; 0 on lanes outside ``mask``."""
    keep = mask & (x >= cut)
    if WEIGHTED:
        weight = tl.where(keep, tl.exp2((x - m) * scale), 0.0)
    else:
        weight = keep.to(tl.int32)
    return weight


@triton.jit
def weight_at_least(row_ptr, x, mask, V, stride_v, cut, m, scale, WEIGHTED: tl.constexpr,
                    ONE_TILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """The count (int32) or, ``WEIGHTED``, the mass (fp32) of the row's tokens ``x >= cut``:
    from the tile ``x`` already in registers with ``ONE_TILE``, else one pass over the row (the
    next tile loaded before the current one is reduced)."""
    if ONE_TILE:
        total = tl.sum(tile_weight(x, mask, cut, m, scale, WEIGHTED), 0)
    else:
        if WEIGHTED:
            lanes = tl.zeros([BLOCK_V], dtype=tl.float32)
        else:
            lanes = tl.zeros([BLOCK_V], dtype=tl.int32)
        x_next, _, mask_next = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            tile = x_next.to(tl.float32)
            tile_mask = mask_next
            x_next, _, mask_next = load_tile(row_ptr, start + BLOCK_V, V, stride_v, BLOCK_V)
            lanes += tile_weight(tile, tile_mask, cut, m, scale, WEIGHTED)
        total = tl.sum(lanes, 0)
    return total


@triton.jit
def largest_key_reaching(row_ptr, x, mask, V, stride_v, lo, hi, target, m, scale,
                         WEIGHTED: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """The largest key ``t`` in ``[lo, hi]`` whose weight at or above (:func:`weight_at_least`
    of ``value(t)``) reaches ``target``, by bisection: the weight only changes at the keys of
    row values, so the answer is one (ties go together), or ``lo`` when no key above ``lo``
    reaches ``target``. ``lo``, ``hi``: int64 keys of non-NaN floats, less than 2**32 apart, so
    ``KEY_BITS`` halvings end on one key. A fixed count, not ``while lo < hi``: a loop on a
    reduced value is divergent to ptxas, which then calls a subroutine for each shuffle of the
    reductions inside it (and spilled registers around the calls)."""
    for _ in range(KEY_BITS):
        mid = lo + (hi - lo + 1) // 2
        reached = weight_at_least(row_ptr, x, mask, V, stride_v, key_value(mid), m, scale,
                                  WEIGHTED, ONE_TILE, BLOCK_V) >= target
        lo = tl.where(reached, mid, lo)
        hi = tl.where(reached, hi, mid - 1)
    return lo


@triton.jit
def support_stats(row_ptr, x, mask, V, stride_v, theta, m, scale, ONE_TILE: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """``(|K|, sum_K exp2((x - m) * scale))`` of ``K = {x >= theta}``, in one pass."""
    if ONE_TILE:
        count = tl.sum(tile_weight(x, mask, theta, m, scale, False), 0)
        mass = tl.sum(tile_weight(x, mask, theta, m, scale, True), 0)
    else:
        counts = tl.zeros([BLOCK_V], dtype=tl.int32)
        masses = tl.zeros([BLOCK_V], dtype=tl.float32)
        x_next, _, mask_next = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            tile = x_next.to(tl.float32)
            tile_mask = mask_next
            x_next, _, mask_next = load_tile(row_ptr, start + BLOCK_V, V, stride_v, BLOCK_V)
            counts += tile_weight(tile, tile_mask, theta, m, scale, False)
            masses += tile_weight(tile, tile_mask, theta, m, scale, True)
        count = tl.sum(counts, 0)
        mass = tl.sum(masses, 0)
    return count, mass


@triton.jit
def sampled_logprobs_fwd_kernel(
    logits_ptr, target_ptr, logp_ptr, lse_kept_ptr, threshold_ptr, log_kept_mass_ptr,
    support_ptr, in_support_ptr,
    n_rows, inner, V, stride0, stride1, stride_v,
    temperature, top_k, top_p, log_min_p, ignore_index,
    BLOCK_V: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """``top_k``: 0 when off (the host maps ``top_k >= V`` to 0); ``top_p``: 1.0 when off;
    ``log_min_p``: ``-inf`` when off. ``in_support_ptr``: the bool output seen as uint8."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    scale = LOG2E / temperature
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        if target != ignore_index:
            # int32 division (row_parts): the int64 one's subroutine call put values on the stack
            outer, row_in = row_parts(row, inner)
            row_ptr = logits_ptr + outer * stride0 + row_in * stride1
            if ONE_TILE:
                x, _, mask = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
                x = x.to(tl.float32)
                m, log2_s, _, _ = tile_stats(x, mask, scale, 0.0, False, False)
            else:
                # unread placeholders: the passes read the row from memory
                x = tl.full([BLOCK_V], NEG_INF, tl.float32)
                mask = x > 0.0
                m, log2_s, _, _ = row_stats(row_ptr, V, stride_v, scale, 1.0, 0.0, BLOCK_V,
                                            False, False, False)
            x_target = tl.load(row_ptr + target * stride_v).to(tl.float32)
            # The filters' branches test kernel arguments only: a branch on a reduced value
            # (the row's sum, theta) is divergent to ptxas (see largest_key_reaching).
            theta = m * 0.0 + NEG_INF
            if log_min_p > NEG_INF:
                theta = unscaled_lower(quotient(m, temperature) + log_min_p, temperature)
            top_key = order_key(m)
            if top_k > 0:
                # from key(theta): when fewer than k tokens reach theta, it stays theta
                kth = largest_key_reaching(row_ptr, x, mask, V, stride_v, order_key(theta),
                                           top_key, top_k, m, scale, False, ONE_TILE, BLOCK_V)
                theta = tl.maximum(theta, unscaled_lower(quotient(key_value(kth), temperature),
                                                         temperature))
            if top_p < 1.0:
                kept_mass = tl.exp2(log2_s)
                if (top_k > 0) | (log_min_p > NEG_INF):
                    kept_mass = weight_at_least(row_ptr, x, mask, V, stride_v, theta, m, scale,
                                                True, ONE_TILE, BLOCK_V)
                crossing = largest_key_reaching(row_ptr, x, mask, V, stride_v, order_key(theta),
                                                top_key, top_p * kept_mass, m, scale, True,
                                                ONE_TILE, BLOCK_V)
                theta = tl.maximum(theta, unscaled_lower(
                    quotient(key_value(crossing), temperature), temperature))
            # theta = -inf keeps all V tokens (the -inf logits count): the same pass serves
            count, mass = support_stats(row_ptr, x, mask, V, stride_v, theta, m, scale, ONE_TILE,
                                        BLOCK_V)
            support = count.to(tl.int64)
            # every token kept: the row's own sum, so log_kept_mass is exactly 0
            log2_kept = tl.where(support == V, log2_s, tl.log2(mass))
            # S >= 1 (the max counts 1) for a finite row; NaN or +inf make it NaN, only -inf 0.
            # Such a row has no distribution: NaN results, every token kept, in the support so
            # that the NaN reaches the loss and the gradient.
            finite = (log2_s >= 0.0) & (log2_s < POS_INF)
            log2_kept = tl.where(finite, log2_kept, float("nan"))
            theta = tl.where(finite, theta, NEG_INF)
            support = tl.where(finite, support, V)
            in_support = (x_target >= theta) | ~finite
            # relative to the row max, as logprobs.py forms its log-probs
            tl.store(logp_ptr + row, tl.where(in_support,
                                              (x_target - m) * inv_t - log2_kept * LN2, NEG_INF))
            tl.store(lse_kept_ptr + row, m * inv_t + log2_kept * LN2)
            tl.store(threshold_ptr + row, theta)
            tl.store(log_kept_mass_ptr + row, (log2_kept - log2_s) * LN2)
            tl.store(support_ptr + row, support)
            tl.store(in_support_ptr + row, in_support.to(tl.uint8))
        else:
            tl.store(logp_ptr + row, 0.0)
            tl.store(lse_kept_ptr + row, 0.0)
            tl.store(threshold_ptr + row, 0.0)
            tl.store(log_kept_mass_ptr + row, 0.0)
            tl.store(support_ptr + row, tl.zeros([], dtype=tl.int64))
            tl.store(in_support_ptr + row, tl.zeros([], dtype=tl.uint8))


@triton.jit
def kept_stats(row_ptr, V, stride_v, theta, scale, BLOCK_V: tl.constexpr):
    """``(m, log2_s)`` of the kept tokens ``x >= theta`` (``helpers.finalize``), one pass."""
    m = tl.max(tl.full([BLOCK_V], NEG_INF, tl.float32), 0)
    s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    x_next, _, _ = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        tile = x_next.to(tl.float32)
        x_next, _, _ = load_tile(row_ptr, start + BLOCK_V, V, stride_v, BLOCK_V)
        # NaN stays (a NaN row's gradient is NaN); masked lanes are already -inf
        z = tl.where(tile < theta, NEG_INF, tile)
        m, s_vec, t_unused = online_update(z, scale, m, s_vec, s_vec, False)
    m, log2_s, h2_unused = finalize(m, s_vec, s_vec, False)
    return m, log2_s


@triton.jit
def sampled_logprobs_bwd_kernel(
    logits_ptr, target_ptr, lse_kept_ptr, threshold_ptr, coef_ptr, grad_ptr,
    n_rows, inner, V, stride0, stride1, stride_v, g_stride0, g_stride1, g_stride_v,
    temperature, ignore_index,
    BLOCK_V: tl.constexpr,
):
    """``grad_j = coef * ([j == y] - p'_j [x_j >= theta])``, ``p'_j = exp(x_j / T -
    lse_kept)``; a row with ``coef == 0`` (or ignored) gets zeros without its logits being read.
    Tiles go from the row's end to its start, each read before it is written (``grad`` may be
    the logits)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        coef = tl.load(coef_ptr + row)
        grad_row_ptr = grad_ptr + row_offset(row, inner, g_stride0, g_stride1)
        if (target != ignore_index) & (coef != 0.0):
            row_ptr = logits_ptr + row_offset(row, inner, stride0, stride1)
            theta = tl.load(threshold_ptr + row)
            lse_kept = tl.load(lse_kept_ptr + row)
            # log p' = x / T - lse_kept while |lse_kept| keeps the precision p' needs; beyond,
            # (x - m) / T - log_sum from the kept tokens' recomputed max and log-sum
            ref = lse_kept * 0.0
            log_sum = lse_kept
            if not (tl.abs(lse_kept) <= DIRECT_LSE_LIMIT):
                m, log2_s = kept_stats(row_ptr, V, stride_v, theta, inv_t * LOG2E, BLOCK_V)
                ref = m
                log_sum = log2_s * LN2
            n_tiles = tl.cdiv(V, BLOCK_V)
            x_next, cols_next, mask_next = load_tile(row_ptr, (n_tiles - 1) * BLOCK_V, V,
                                                     stride_v, BLOCK_V)
            for i in range(0, n_tiles):
                tile = x_next.to(tl.float32)
                cols = cols_next
                tile_mask = mask_next
                # prefetch the tile before this one; past the row's start an all-masked load
                k = n_tiles - 2 - i
                x_next, cols_next, mask_next = load_tile(row_ptr, tl.maximum(k, 0) * BLOCK_V,
                                                         tl.where(k >= 0, V, 0), stride_v,
                                                         BLOCK_V)
                # p' = 0 outside K; a NaN logit stays NaN, so that its row's gradient is NaN
                z = tl.where(tile < theta, NEG_INF, tile)
                g = grad_tile(z, cols, target, ref, log_sum, inv_t, coef, -coef, 0.0, 0.0, 1.0,
                              1.0, False, False, True)
                store_tile(grad_row_ptr, cols, tile_mask, g_stride_v, g)
        else:
            zero_row(grad_row_ptr, V, g_stride_v, BLOCK_V)
