"""The sampled-logprobs primitives (``kernels/primitives.py``, optional) in chunked torch, on
any device: what a backend without them (``torch``) runs for ``sampling=``; and
:func:`sampling_kernels`, which module serves a backend's sampled primitives.

The support is ``K = {j : s_j >= tau}`` of ``s = float32(z) / T`` for one threshold ``tau`` per
row, the largest of min_p's, top_k's and top_p's (the contract: ``ops/sampling.py``'s
docstring). The thresholds are found by radix selection over passes on the row: ``s`` maps to
int keys that order like the floats (``-0.0`` and ``0.0`` share one), and each pass histograms
the next ``RADIX_BITS`` bits of the keys in the range still open (``scatter_add`` of a count for
top_k, of ``exp(s - max)`` for top_p) and keeps the bin where the count (mass) at or above
reaches ``k`` (``top_p`` times the kept mass); three passes end on the exact key of a row
value, so ties are exact. Rows are processed in blocks of at most ``BLOCK_ELEMENTS`` entries,
each upcast to float32 on its own; nothing here reads a tensor back to the host.
"""

import math
import sys
from typing import Optional

import torch
from torch import Tensor

from .primitives import SAMPLING_PRIMITIVES
from .registry import backend_module

BLOCK_ELEMENTS = 1 << 19
RADIX_BITS = 11
KEY_BITS = 32
# Interleaved copies of each histogram (entry j adds to copy j % HISTOGRAM_LANES): a late pass
# sends most keys to one bin, and a single histogram would chain those adds on one address
# (3-4x slower on CPU).
HISTOGRAM_LANES = 8
# float32 counts are exact up to 2**24 tokens a row
EXACT_FLOAT32_COUNT = 1 << 24
# the key of -inf: a threshold that keeps every token
KEEP_ALL_KEY = -0x7F800000


def order_keys(values: Tensor, out: Optional[Tensor] = None,
               sign: Optional[Tensor] = None) -> Tensor:
    """int64 keys ordered as the float32 ``values`` (sign and magnitude read from the bits, so
    ``-0.0`` and ``0.0`` share the key 0; NaN gets some key), into ``out`` with ``sign`` as
    scratch when given (int64, ``values``' shape)."""
    if out is None:
        out = torch.empty(values.shape, dtype=torch.int64, device=values.device)
    if sign is None:
        sign = torch.empty_like(out)
    out.copy_(values.contiguous().view(torch.int32))  # sign-extended bits
    torch.bitwise_right_shift(out, 63, out=sign)  # 0 or -1: (m ^ sign) - sign negates m
    return out.bitwise_and_(0x7FFFFFFF).bitwise_xor_(sign).sub_(sign)


def key_values(keys: Tensor) -> Tensor:
    """The float32 values of :func:`order_keys` keys."""
    magnitude = keys.abs().to(torch.int32)
    return torch.where(keys < 0, magnitude | -(1 << 31), magnitude).view(torch.float32)


def radix_threshold(keys: Tensor, weights: Tensor, target, bins: Tensor) -> Tensor:
    """Per row of ``keys [r, V]``, the largest key ``t`` with ``sum(weights[keys >= t]) >=
    target`` (``[r, 1]``): with positive weights, the key of the row value where the weight
    ranked at or above it first reaches ``target``. ``RADIX_BITS`` bits a pass, no sort;
    ``bins`` is int64 scratch of ``keys``' shape."""
    rows, vocab = keys.shape
    low = keys.new_full((rows, 1), -(1 << (KEY_BITS - 1)))
    lane_bins = (1 << RADIX_BITS) + 2
    lane_start = torch.arange(vocab, device=keys.device) % HISTOGRAM_LANES * lane_bins + 1
    bits_left = KEY_BITS
    while bits_left:
        width = min(RADIX_BITS, bits_left)
        shift = bits_left - width
        # bin 0: keys below the open range; 1..2**width: its digits; 2**width + 1: above it
        torch.sub(keys, low, out=bins).bitwise_right_shift_(shift).clamp_(-1, 1 << width)
        bins.add_(lane_start)
        lanes = weights.new_zeros(rows, HISTOGRAM_LANES * lane_bins)
        lanes.scatter_add_(1, bins, weights.expand(bins.shape))
        histogram = lanes.view(rows, HISTOGRAM_LANES, lane_bins).sum(1)[:, :(1 << width) + 2]
        at_or_above = histogram.flip(-1).cumsum(-1).flip(-1)[:, 1:-1]
        # at_or_above falls with the digit; rounding of a mass can leave no bin reaching target
        digit = ((at_or_above >= target).sum(-1, keepdim=True) - 1).clamp_(min=0)
        low = low + (digit << shift)
        bits_left = shift
    return low


class _Workspace:
    """``[rows, V]`` buffers reused from block to block: a fresh buffer per block would cost
    a page fault per 4 KiB each time. ``take(n)`` gives views of the first ``n`` rows."""

    DTYPES = {"scaled": torch.float32, "shifted_exp": torch.float32, "mass": torch.float32,
              "keys": torch.int64, "bins": torch.int64, "mask": torch.bool}

    def __init__(self, rows, vocab, device, names):
        self.buffers = {name: torch.empty(rows, vocab, dtype=self.DTYPES[name], device=device)
                        for name in names}

    def take(self, n):
        return {name: buffer[:n] for name, buffer in self.buffers.items()}


def _scaled_block(block: Tensor, temperature: float, out: Tensor) -> Tensor:
    """``float32(block) / T`` into ``out``: upcast first, as vLLM does."""
    out.copy_(block)
    return out if temperature == 1.0 else out.div_(temperature)


def _block_forward(block, target, temperature, top_k, top_p, min_p, ignore_index, work):
    """``(logp, lse_kept, threshold, log_kept_mass, support_size, in_support)`` of the rows of
    ``block [r, V]`` (see the module docstring); ``work`` from ``_Workspace.take``."""
    vocab = block.shape[1]
    scaled = _scaled_block(block, temperature, work["scaled"])
    row_max = scaled.amax(-1, keepdim=True)
    shifted_exp = torch.sub(scaled, row_max, out=work["shifted_exp"]).exp_()
    keys = order_keys(scaled, work["keys"], work["bins"])
    if min_p > 0.0:
        threshold = order_keys(row_max + math.log(min_p))
    else:
        threshold = keys.new_full((block.shape[0], 1), KEEP_ALL_KEY)
    if 0 < top_k < vocab:
        count_dtype = torch.float32 if vocab <= EXACT_FLOAT32_COUNT else torch.float64
        ones = torch.ones((1, 1), dtype=count_dtype, device=block.device)
        threshold = torch.maximum(threshold,
                                  radix_threshold(keys, ones, float(top_k), work["bins"]))
    # masks multiply (a CPU torch.where is several times slower); a NaN only meets a row
    # whose results are NaN (or ignored) anyway
    kept, mass = work["mask"], work["mass"]
    if top_p < 1.0:
        torch.mul(shifted_exp, torch.ge(keys, threshold, out=kept), out=mass)
        target_mass = top_p * mass.sum(-1, keepdim=True)
        threshold = torch.maximum(threshold,
                                  radix_threshold(keys, mass, target_mass, work["bins"]))
    torch.ge(keys, threshold, out=kept)
    total = shifted_exp.sum(-1)
    # the same reduction over the same layout: equal to ``total`` when every token is kept
    log_kept = torch.log(torch.mul(shifted_exp, kept, out=mass).sum(-1))
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0).long().unsqueeze(1)
    in_support = valid & kept.gather(1, safe_target).squeeze(1)
    row_max = row_max.squeeze(1)
    target_logit = scaled.gather(1, safe_target).squeeze(1)
    logp = torch.where(in_support, (target_logit - row_max) - log_kept,
                       torch.where(valid, -math.inf, 0.0))
    log_kept_mass = torch.where(valid, log_kept - torch.log(total), 0.0)
    support_size = torch.where(valid, kept.sum(-1), 0)
    # a row holding NaN or +inf (or only -inf) has no distribution: NaN, every token counted,
    # as the plain op and the kernels give (never a masked -inf that hides it)
    undefined = valid & ~torch.isfinite(row_max)
    logp = torch.where(undefined, math.nan, logp)
    log_kept_mass = torch.where(undefined, math.nan, log_kept_mass)
    lse_kept = torch.where(undefined, math.nan, row_max + log_kept)
    support_size = torch.where(undefined, vocab, support_size)
    return (logp, lse_kept, key_values(threshold).squeeze(1), log_kept_mass, support_size,
            in_support | undefined)


def _block_backward(block, target, lse_kept, threshold, coef, temperature, grad_block, work):
    """Write ``coef * ([j == y] - p'_j [j in K])`` of the rows of ``block`` into
    ``grad_block`` (float32 math, rounded once); rows with ``coef == 0`` get zeros whatever
    their logits hold."""
    probs = _scaled_block(block, temperature, work["scaled"])
    active = coef != 0
    kept = torch.ge(probs, threshold.unsqueeze(1), out=work["mask"])
    # An inactive row's p' is exp(s - inf) = 0 for every s once NaN and +inf (which an
    # ignored row may hold) are mapped into [-inf, max float]; an active row with one of them
    # has lse_kept NaN and stays NaN.
    shift = torch.where(active, lse_kept, math.inf).unsqueeze(1)
    probs.nan_to_num_(nan=-math.inf, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)
    probs.sub_(shift).exp_().mul_(kept).mul_(-coef.unsqueeze(1))
    safe_target = torch.where(active, target, 0).long().unsqueeze(1)
    probs.scatter_add_(1, safe_target, coef.unsqueeze(1))
    grad_block.copy_(probs)


def _block_rows(rows: Tensor) -> int:
    """Rows per block of ``rows [A, B, V]``: at most ``BLOCK_ELEMENTS`` entries (or one row)."""
    return max(1, min(rows.shape[1], BLOCK_ELEMENTS // rows.shape[2]))


def _blocks(rows: Tensor):
    """Yield ``(n0, n1, block)``: flattened rows ``n0:n1`` of ``rows [A, B, V]`` as a
    ``[n, V]`` view of at most ``_block_rows`` rows."""
    outer, inner, _ = rows.shape
    step = _block_rows(rows)
    for a in range(outer):
        for b0 in range(0, inner, step):
            b1 = min(inner, b0 + step)
            yield a * inner + b0, a * inner + b1, rows[a, b0:b1]


def _workspace(rows: Tensor, names) -> _Workspace:
    return _Workspace(_block_rows(rows), rows.shape[2], rows.device, names)


FORWARD_BUFFERS = ("scaled", "shifted_exp", "mass", "keys", "bins", "mask")
BACKWARD_BUFFERS = ("scaled", "mask")


# (logp, lse_kept, threshold, log_kept_mass) float32, support_size int64, in_support bool
ROW_OUTPUT_DTYPES = SAMPLING_PRIMITIVES["sampled_logprobs_forward"].output_dtypes


def sampled_logprobs_forward(logits, target, params):
    """The primitive (``kernels/primitives.py``), a block of rows at a time."""
    outputs = tuple(torch.empty(target.numel(), dtype=dtype, device=logits.device)
                    for dtype in ROW_OUTPUT_DTYPES)
    work = _workspace(logits, FORWARD_BUFFERS)
    for n0, n1, block in _blocks(logits):
        results = _block_forward(block, target[n0:n1], params.temperature, params.top_k,
                                 params.top_p, params.min_p, params.ignore_index,
                                 work.take(n1 - n0))
        for out, result in zip(outputs, results):
            out[n0:n1] = result
    return outputs


def sampled_logprobs_backward(logits, target, lse_kept, threshold, coef, params, grad):
    """The primitive (``kernels/primitives.py``), a block of rows at a time."""
    work = _workspace(logits, BACKWARD_BUFFERS)
    for (n0, n1, block), (_, _, grad_block) in zip(_blocks(logits), _blocks(grad)):
        _block_backward(block, target[n0:n1], lse_kept[n0:n1], threshold[n0:n1],
                        coef[n0:n1], params.temperature, grad_block, work.take(n1 - n0))


def sampling_kernels(backend: str):
    """The module whose sampled-logprobs primitives serve ``backend``: its own kernel module
    when it has them (``cpp``, ``triton``), else this one (chunked torch, any device)."""
    module = backend_module(backend)
    return module if hasattr(module, "sampled_logprobs_forward") else sys.modules[__name__]
