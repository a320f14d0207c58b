"""Shared ``@triton.jit`` helpers: every kernel of the package builds on these, written once.

Conventions (see ``kernels/primitives.py``): a row ``n`` of an ``[A, B, V]`` tensor with arbitrary
strides starts at ``(n // B) * stride0 + (n % B) * stride1``; all offsets are int64. Inside the
kernels the scaled logits are kept in base 2 (``x2 = s * log2(e)``), so each element costs one
``exp2`` (the hardware instruction) and no extra multiply; per-row results are converted back to
natural units.

The pass-1 reduction is online over vocabulary tiles: one tile max (a block reduction) per tile,
while the sums (of ``exp2(r)``, and for the entropy of ``exp2(r) * r``, ``r = (z - m) * scale``)
are kept per lane and rescaled by the scalar ``alpha = exp2((m_old - m_new) * scale)``: one
``exp2`` per element and a single block reduction of the sums per row.

Every log-prob and loss is formed from ``(z - m) * scale`` and ``log2_s = log2 sum exp2((z - m) *
scale)``, ``m`` the row max of the unscaled logits: the error does not grow with the logits'
magnitude (``z * scale - lse`` would lose ``ulp(lse)``), ``z * scale`` cannot overflow for finite
logits, and a contracted ``(z - m) * scale - log2_s`` (an FMA) is still ``<= 0``.
"""

import os

import triton
import triton.language as tl

from .. import primitives

# Triton's interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even); under the
# interpreter the kernels round in software so the tests see the GPU's numerics. Compiled kernels
# never take that branch (a constexpr).
_SOFTWARE_BF16_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
LOG_RATIO_CLAMP = tl.constexpr(primitives.LOG_RATIO_CLAMP)
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
# logprobs' backward forms log p = z / T - lse from the saved lse while |lse| <= this (its
# rounding then moves p by <= 2^-19 relative); beyond, it recomputes the row's max and log-sum.
DIRECT_LSE_LIMIT = tl.constexpr(64.0)


@triton.jit
def row_offset(row, inner, stride0, stride1):
    """int64 element offset of flattened row ``row`` of an ``[A, B, V]`` view (``inner = B``)."""
    row = tl.cast(row, tl.int64)
    return (row // inner) * stride0 + (row % inner) * stride1


@triton.jit
def row_parts(row, inner):
    """``(row // inner, row % inner)`` as int64, divided in ``row``'s own width (int32 for
    fewer than 2**31 rows): one inline division instead of the 64-bit division subroutine,
    whose call made kernels with several row pointers keep a value on the stack. Offsets
    formed from the parts are int64 (``a * stride0 + b * stride1``)."""
    outer = row // inner
    return tl.cast(outer, tl.int64), tl.cast(row - outer * inner, tl.int64)


@triton.jit
def load_tile(row_ptr, start, V, stride_v, BLOCK_V: tl.constexpr):
    """Raw tile ``[start, start + BLOCK_V)`` of a row in the tensor's dtype, ``-inf`` past ``V``.

    Returns ``(x, cols, mask)``. A tile wholly past ``V`` is all-masked (no memory traffic), which
    is what the one-tile-ahead prefetch of the tile loops relies on.
    """
    cols = start + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=mask, other=NEG_INF)
    return x, cols, mask


@triton.jit
def cast_rne(g, dtype: tl.constexpr):
    """``g`` (fp32) cast to ``dtype``, rounding to nearest even."""
    if _SOFTWARE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = g.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return g.to(dtype)


@triton.jit
def store_tile(row_ptr, cols, mask, stride_v, g):
    """Store the fp32 tile ``g`` into a row, cast to the row's dtype once, masked at the edge."""
    tl.store(row_ptr + cols.to(tl.int64) * stride_v, cast_rne(g, row_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def zero_row(row_ptr, V, stride_v, BLOCK_V: tl.constexpr):
    """Write zeros over a whole row (the gradient of an ignored / masked row)."""
    zeros = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        store_tile(row_ptr, cols, cols < V, stride_v, zeros)


@triton.jit
def tanh_f32(u):
    """tanh in fp32 from one ``exp2``: odd polynomial near 0 (no cancellation), else 1 - 2/(e+1)."""
    a = tl.abs(u)
    e = tl.exp2(a * (2.0 * LOG2E))
    big = 1.0 - 2.0 / (e + 1.0)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(u < 0.0, -t, t)


@triton.jit
def capped_logits(x, mask, cap, HAS_SOFTCAP: tl.constexpr, logit_scale=1.0,
                  HAS_LOGIT_SCALE: tl.constexpr = False):
    """The row's logits ``z`` in fp32: ``cap * tanh(x / cap)`` with softcap on, else ``x``,
    where ``x`` is first multiplied by ``logit_scale`` with ``HAS_LOGIT_SCALE``.

    Lanes outside ``mask`` stay ``-inf`` (tanh would turn them into ``-cap``, a scale <= 0
    into ``+inf`` or NaN).
    """
    x = x.to(tl.float32)
    if HAS_LOGIT_SCALE:
        x = x * logit_scale
    if HAS_SOFTCAP:
        x = tl.where(mask, cap * tanh_f32(x / cap), NEG_INF)
    elif HAS_LOGIT_SCALE:
        x = tl.where(mask, x, NEG_INF)
    return x


@triton.jit
def online_update(z, scale, m, s_vec, t_vec, WITH_T: tl.constexpr):
    """Fold a tile of logits ``z`` (fp32, ``-inf`` on masked lanes) into the running state.

    State: the running max ``m`` of ``z`` itself (scalar, ``-inf`` before any finite value;
    unscaled), per-lane sums ``s_vec = sum exp2(r)`` and, with ``WITH_T``,
    ``t_vec = sum exp2(r) * r`` (relative to the max, so the entropy does not cancel against a
    large ``lse``), where ``r = (z - m) * scale`` (``scale > 0``; ``r <= 0``, and no ``z * scale``
    that could overflow).
    """
    m_new = tl.maximum(m, tl.max(z, 0))
    m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
    shift = (m - m_ref) * scale  # -inf before the first finite value: alpha = 0
    alpha = tl.exp2(shift)
    rel = (z - m_ref) * scale
    e = tl.exp2(rel)
    if WITH_T:
        shift = tl.where(m == NEG_INF, 0.0, shift)
        t_vec = alpha * (t_vec + s_vec * shift) + e * tl.where(e > 0.0, rel, 0.0)
    s_vec = s_vec * alpha + e
    return m_new, s_vec, t_vec


@triton.jit
def finalize(m, s_vec, t_vec, WITH_T: tl.constexpr):
    """``(m, log2_s, h2)`` of a row: its max logit (0 when there is none), ``log2_s = log2 sum
    exp2((z - m) * scale)`` and, with ``WITH_T``, its base-2 entropy. A log-prob is then
    ``(z_y - m) * scale - log2_s``: exactly 0 for a V = 1 row, and without the cancellation of
    ``z_y * scale - lse2`` for a confident or large one. A row holding +inf or NaN gets a NaN
    ``log2_s`` (its softmax is undefined, as in float64 torch); an all ``-inf`` row gets
    ``log2_s = -inf`` and NaN log-probs."""
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    s = tl.sum(s_vec, 0)
    log2_s = tl.where(m == POS_INF, float("nan"), tl.log2(s))
    if WITH_T:
        h2 = log2_s - tl.sum(t_vec, 0) / s
    else:
        h2 = log2_s * 0.0
    return m_safe, log2_s, h2


@triton.jit
def row_stats(row_ptr, V, stride_v, scale, cap, z_ref, BLOCK_V: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, WITH_T: tl.constexpr, WITH_SUM: tl.constexpr,
              logit_scale=1.0, HAS_LOGIT_SCALE: tl.constexpr = False):
    """Pass 1 over a row in tiles: ``(m, log2_s, h2, zsum)`` (see :func:`finalize`).

    ``z`` are the logits as :func:`capped_logits` forms them, ``zsum = sum_j (z_j - z_ref)``
    with ``WITH_SUM`` (label smoothing; ``z_ref`` one of the row's values, so the sum does not
    round away differences of large logits). The next tile is loaded before the current one is
    reduced, so a load is always in flight.
    """
    m = tl.max(tl.full([BLOCK_V], NEG_INF, tl.float32), 0)
    s_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    z_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    x_next, cols, mask = load_tile(row_ptr, 0, V, stride_v, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        x = x_next
        tile_mask = mask
        x_next, cols, mask = load_tile(row_ptr, start + BLOCK_V, V, stride_v, BLOCK_V)
        z = capped_logits(x, tile_mask, cap, HAS_SOFTCAP, logit_scale, HAS_LOGIT_SCALE)
        m, s_vec, t_vec = online_update(z, scale, m, s_vec, t_vec, WITH_T)
        if WITH_SUM:
            z_vec += tl.where(tile_mask, z - z_ref, 0.0)
    m, log2_s, h2 = finalize(m, s_vec, t_vec, WITH_T)
    if WITH_SUM:
        zsum = tl.sum(z_vec, 0)
    else:
        zsum = log2_s * 0.0
    return m, log2_s, h2, zsum


@triton.jit
def tile_stats(z, mask, scale, z_ref, WITH_T: tl.constexpr, WITH_SUM: tl.constexpr):
    """Pass 1 for a row that fits one tile already in registers (``z`` fp32, ``-inf`` masked)."""
    m = tl.max(tl.full(z.shape, NEG_INF, tl.float32), 0)
    zeros = tl.zeros(z.shape, dtype=tl.float32)
    m, s_vec, t_vec = online_update(z, scale, m, zeros, zeros, WITH_T)
    m, log2_s, h2 = finalize(m, s_vec, t_vec, WITH_T)
    if WITH_SUM:
        zsum = tl.sum(tl.where(mask, z - z_ref, 0.0), 0)
    else:
        zsum = log2_s * 0.0
    return m, log2_s, h2, zsum


@triton.jit
def grad_tile(z, cols, target, ref, log_sum, scale, c_target, c_p, c_u, c_const, c_scale, cap,
              WITH_U: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NATURAL: tl.constexpr):
    """The fp32 gradient of one tile, from the row's logits ``z`` (fp32, ``-inf`` masked)::

        g = (p * (c_p + c_u * u) - c_const + [j == target] * c_target) * c_scale

    times ``1 - (z / cap)**2`` with softcap on. ``u = log p = (z - ref) * scale - log_sum``
    (``ref`` the row max, or 0 with ``log_sum = lse``), clamped at ``<= 0`` (a rounding or a
    contracted FMA cannot make ``p > 1``; NaN is kept): natural with ``NATURAL`` (``scale =
    1/T``), else base 2 (``scale = log2(e)/T``). ``c_p = -coef, c_target = coef`` gives
    ``coef * (onehot - p)``. The target's term is folded in fp32 before the cast, in the torch
    backend's order (so a V = 1 row's gradient is exactly 0).
    """
    u = (z - ref) * scale - log_sum
    u = tl.where(u > 0.0, 0.0, u)
    if NATURAL:
        p = tl.exp2(u * LOG2E)
    else:
        p = tl.exp2(u)
    g = p * c_p - c_const
    if WITH_U:
        g += p * tl.where(p > 0.0, u, 0.0) * c_u
    g = (g + tl.where(cols == target, c_target, 0.0)) * c_scale
    if HAS_SOFTCAP:
        zc = tl.where(z == NEG_INF, 0.0, z / cap)  # only masked lanes are -inf after the cap
        g *= 1.0 - zc * zc
    return g


@triton.jit
def write_grad_row(row_ptr, grad_row_ptr, V, stride_v, g_stride_v, target, ref, log_sum, scale,
                   c_target, c_p, c_u, c_const, c_scale, cap, BLOCK_V: tl.constexpr,
                   WITH_U: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NATURAL: tl.constexpr,
                   logit_scale=1.0, HAS_LOGIT_SCALE: tl.constexpr = False):
    """Pass 2 of a row in tiles: recompute ``p`` and write :func:`grad_tile` once per element
    (the logits as :func:`capped_logits` forms them).

    Tiles go from the row's end back to its start, so the most recently read (most likely still
    in L2) tiles are re-read first; the next tile is loaded before the current one is computed.
    Each tile is read before it is written, so ``grad_row_ptr`` may alias ``row_ptr``.
    """
    n_tiles = tl.cdiv(V, BLOCK_V)
    x_next, cols_next, mask_next = load_tile(row_ptr, (n_tiles - 1) * BLOCK_V, V, stride_v,
                                             BLOCK_V)
    for i in range(0, n_tiles):
        x = x_next
        cols = cols_next
        mask = mask_next
        # prefetch the tile before this one; past the row's start: an all-masked load of tile 0
        k = n_tiles - 2 - i
        x_next, cols_next, mask_next = load_tile(row_ptr, tl.maximum(k, 0) * BLOCK_V,
                                                 tl.where(k >= 0, V, 0), stride_v, BLOCK_V)
        z = capped_logits(x, mask, cap, HAS_SOFTCAP, logit_scale, HAS_LOGIT_SCALE)
        g = grad_tile(z, cols, target, ref, log_sum, scale, c_target, c_p, c_u, c_const, c_scale,
                      cap, WITH_U, HAS_SOFTCAP, NATURAL)
        store_tile(grad_row_ptr, cols, mask, g_stride_v, g)


@triton.jit
def scale_kernel(grad_ptr, scalar_ptr, n_items, tiles_per_row, inner, V, stride0, stride1,
                 stride_v, BLOCK_V: tl.constexpr):
    """``grad *= scalar`` in place over an ``[A, B, V]`` view, without a host sync.

    Work item ``i`` is tile ``i % tiles_per_row`` of row ``i // tiles_per_row`` (a contiguous
    tensor is passed as one long row). Every program loads the 0-d ``scalar`` first and does
    nothing more when it is 1.0: the common ``loss.backward()`` costs one small launch.
    """
    s = tl.load(scalar_ptr).to(tl.float32)
    if s != 1.0:
        pid = tl.program_id(0)
        n_programs = tl.num_programs(0)
        for item in range(pid, n_items, n_programs):
            row = item // tiles_per_row
            start = tl.cast(item % tiles_per_row, tl.int64) * BLOCK_V
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < V
            ptrs = grad_ptr + row_offset(row, inner, stride0, stride1) + cols * stride_v
            g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, cast_rne(g * s, grad_ptr.dtype.element_ty), mask=mask)
