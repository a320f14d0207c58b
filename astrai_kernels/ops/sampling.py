"""Targets scored under a sampler's processed distribution: vLLM v1's temperature, min_p, top_k
and top_p, found without sorting a row and without an [N, V] float32 copy.

Contract (docs/objectives.md, "RL with a separate sampler"): with ``sampling=SamplingParams(...)``
the log-prob ops score each target under the distribution vLLM's sampler draws from. In its order,
on ``s = float32(z) / temperature``:

* ``min_p`` keeps ``p_j >= min_p * p_max``, i.e. ``s_j >= max(s) + log(min_p)``;
* ``top_k`` keeps every token whose ``s`` is ``>=`` the k-th largest (ties at the boundary kept;
  ``top_k >= V`` keeps all);
* ``top_p``, on the distribution renormalised over what min_p and top_k kept, keeps a token iff
  the mass of the tokens with a strictly larger ``s`` is ``< top_p``: the token that crosses
  ``top_p`` is kept, and so is every token tied with it (a sorting sampler keeps an arbitrary
  part of such a tie: the one place the supports can differ).

Every filter keeps the tokens at or above a value, so the support is ``K = {j : s_j >= tau}`` for
one threshold ``tau`` per row (the largest of the three), and ``logp = s_y - logsumexp_K(s)``,
``-inf`` for a target outside ``K``. The gradient of ``logp`` is
``g * ([j == y] - p'_j [j in K]) / T`` with ``p' = softmax`` over ``K``; a row whose target is
outside ``K`` (or ignored) gets a zero gradient, and ``in_support`` says which rows those are.

The thresholds are found by radix selection over passes on the row: ``s`` maps to int keys that
order like the floats (``-0.0`` and ``0.0`` share one), and each pass histograms the next
``RADIX_BITS`` bits of the keys in the range still open (``scatter_add`` of a count for top_k,
of ``exp(s - max)`` for top_p) and keeps the bin where the count (mass) at or above reaches
``k`` (``top_p`` times the kept mass); three passes end on the exact key of a row value, so ties
are exact. Rows are processed in blocks of at most ``BLOCK_ELEMENTS`` entries, each upcast to
float32 on its own; nothing here reads a tensor back to the host. This is the portable path: a
backend whose kernels have the optional primitives ``sampled_logprobs_forward`` /
``sampled_logprobs_backward`` (``kernels/primitives.py``) runs those instead: the cpp backend
a selection on a few candidates per row (``csrc/sampling.cpp``), the triton backend a
bisection over integer keys, 32 passes per filter (``kernels/triton/sampling.py``); the torch
backend runs this path on its device. ``backend="reference"`` runs
``reference.sampled_token_logprobs``.
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from .. import reference
from ..kernels.library import optional_primitive_op
from ..kernels.primitives import SAMPLING_PRIMITIVES, SamplingArgs
from ..kernels.registry import backend_module, resolve_backend
from ..options.scalars import check_bool, check_in_range, check_index, check_positive, check_real
from ._common import (
    LogitsShape,
    check_logits,
    check_target,
    dense_grad,
    flat_target,
    refuse_double_backward,
    rows_view,
)
from .head import (
    check_head,
    grad_or_none,
    head_any_grad,
    head_walk,
    reference_logits,
)

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

LOGPROBS_EQUIVALENT = ("log_softmax over the kept tokens of a sort-based top-k/top-p mask "
                       "(astrai_kernels.reference.sampled_token_logprobs)")


@dataclass(frozen=True)
class SamplingParams:
    """The sampler's settings, in vLLM's names: ``top_k=0``, ``top_p=1.0`` and ``min_p=0.0``
    each mean off. Checked on construction."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "temperature", check_positive(self.temperature, "temperature"))
        top_k = check_index(self.top_k, "top_k")
        if top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k}")
        object.__setattr__(self, "top_k", top_k)
        top_p = check_real(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {top_p}")
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", check_in_range(self.min_p, "min_p", 0.0, 1.0))

    def args(self, ignore_index: int) -> SamplingArgs:
        """The primitives' arguments (``kernels/primitives.py``)."""
        return SamplingArgs(self.temperature, self.top_k, self.top_p, self.min_p, ignore_index)

    def filters(self, vocab: int) -> bool:
        """Whether min_p, top_k or top_p can drop a token of a ``vocab``-token row."""
        return self.min_p > 0.0 or 0 < self.top_k < vocab or self.top_p < 1.0


def checked_sampling(sampling, temperature, **refused) -> SamplingParams:
    """The ``SamplingParams`` a call scores under: ``sampling``, or the plain tempered softmax's
    (no filter) when only ``return_support`` was asked. ``refused``: the op's options that
    cannot go with it (name -> whether the call set it)."""
    for name, given in refused.items():
        if given:
            raise ValueError(f"{name} is not supported with sampling= or return_support=True")
    if sampling is None:
        return SamplingParams(temperature=temperature)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be an astrai_kernels.SamplingParams or None, got "
                        f"{type(sampling).__name__}")
    if check_real(temperature, "temperature") != 1.0:
        raise ValueError("temperature must be left at 1.0 with sampling=: the sampler's "
                         "temperature is SamplingParams(temperature=...)")
    return sampling


def full_support(target: Tensor, ignore_index: int, vocab: int) -> Dict[str, Tensor]:
    """``return_support``'s dict when no filter is on: every token kept."""
    valid = target != ignore_index
    return {"log_kept_mass": torch.zeros(target.shape, dtype=torch.float32,
                                         device=target.device),
            "support_size": torch.where(valid, vocab, 0).to(torch.int64),
            "in_support": valid}


def _support_dict(log_kept_mass, support_size, in_support, shape):
    return {"log_kept_mass": log_kept_mass.view(shape), "support_size": support_size.view(shape),
            "in_support": in_support.view(shape)}


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


class _ChunkedTorchSampling:
    """The sampled-logprobs primitives (``kernels/primitives.py``) in chunked torch, on any
    device: blocks of at most ``BLOCK_ELEMENTS`` logits, with their buffers reused from block
    to block."""

    @staticmethod
    def sampled_logprobs_forward(logits, target, params):
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

    @staticmethod
    def sampled_logprobs_backward(logits, target, lse_kept, threshold, coef, params, grad):
        work = _workspace(logits, BACKWARD_BUFFERS)
        for (n0, n1, block), (_, _, grad_block) in zip(_blocks(logits), _blocks(grad)):
            _block_backward(block, target[n0:n1], lse_kept[n0:n1], threshold[n0:n1],
                            coef[n0:n1], params.temperature, grad_block, work.take(n1 - n0))


CHUNKED_TORCH_SAMPLING = _ChunkedTorchSampling()


def sampling_kernels(backend: str):
    """The kernel module of ``backend`` when it has the sampled-logprobs primitives (optional
    ones), else this module's chunked torch (which serves every device)."""
    module = backend_module(backend)
    return module if hasattr(module, "sampled_logprobs_forward") else CHUNKED_TORCH_SAMPLING


#: ``(logits_rows [A, B, V], target, args: SamplingArgs, backend)`` -> ``(logp, lse_kept,
#: threshold, log_kept_mass, support_size, in_support)`` per row (``threshold`` in the encoding
#: of the path that made it, read back by the backward with the same ``backend``)
sampled_logprobs_forward = optional_primitive_op("sampled_logprobs_forward", sampling_kernels)
#: ``(logits_rows, target, lse_kept, threshold, coef, args, backend)`` -> the logits' gradient
#: for the per-row ``coef = g / T`` (0 outside K)
sampled_logprobs_backward = optional_primitive_op("sampled_logprobs_backward",
                                                  sampling_kernels)


def _backward_coef(grad_logp, lse_kept, in_support, temperature):
    """``g / T`` per row, 0 where the target is outside the support or ignored."""
    return torch.where(in_support, dense_grad(grad_logp, lse_kept) / temperature, 0.0)


class _SampledTokenLogprobs(torch.autograd.Function):
    """``(logp, log_kept_mass, support_size, in_support)``; only ``logp`` is differentiable."""

    @staticmethod
    def forward(ctx, logits, target_flat, args, backend):
        logp, lse_kept, threshold, log_kept_mass, support_size, in_support = (
            sampled_logprobs_forward(rows_view(logits), target_flat, args, backend))
        ctx.save_for_backward(logits, target_flat, lse_kept, threshold, in_support)
        ctx.args, ctx.backend = args, backend
        ctx.mark_non_differentiable(log_kept_mass, support_size, in_support)
        return logp, log_kept_mass, support_size, in_support

    @staticmethod
    def backward(ctx, grad_logp, *_):
        refuse_double_backward("token_logprobs", LOGPROBS_EQUIVALENT)
        logits, target_flat, lse_kept, threshold, in_support = ctx.saved_tensors
        coef = _backward_coef(grad_logp, lse_kept, in_support, ctx.args.temperature)
        grad = sampled_logprobs_backward(rows_view(logits), target_flat, lse_kept, threshold,
                                         coef, ctx.args, ctx.backend)
        return grad.view(logits.shape), None, None, None


def sampled_token_logprobs(logits: Tensor, target: Tensor, sampling: SamplingParams,
                           ignore_index: int, return_support: bool, backend: str):
    """``token_logprobs(logits, target, sampling=...)`` once the sampling arguments are
    checked: float32 ``logp [...]``, and the support dict with ``return_support``."""
    check_logits(logits)
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, LogitsShape.of(logits), ignore_index)
    check_bool(return_support, "return_support")
    backend = resolve_backend(backend, logits.device)
    if backend == "reference":
        logp, log_kept_mass, support_size, in_support = reference.sampled_token_logprobs(
            logits.float(), target, sampling.temperature, sampling.top_k, sampling.top_p,
            sampling.min_p, ignore_index)
    else:
        target_flat = flat_target(target)
        if torch.is_grad_enabled() and logits.requires_grad:
            logp, log_kept_mass, support_size, in_support = _SampledTokenLogprobs.apply(
                logits, target_flat, sampling.args(ignore_index), backend)
        else:
            logp, _, _, log_kept_mass, support_size, in_support = sampled_logprobs_forward(
                rows_view(logits), target_flat, sampling.args(ignore_index), backend)
        logp = logp.view(target.shape)
    if not return_support:
        return logp
    return logp, _support_dict(log_kept_mass, support_size, in_support, target.shape)


_HEAD_FORWARD = head_walk("sampled_logprobs_forward", kernels=sampling_kernels)
_HEAD_BACKWARD = head_walk("sampled_logprobs_backward", kernels=sampling_kernels)


class _LinearSampledTokenLogprobs(torch.autograd.Function):
    """As :class:`_SampledTokenLogprobs`, from the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_flat, args, chunk_size, transform, backend):
        logp, lse_kept, threshold, log_kept_mass, support_size, in_support, *_ = _HEAD_FORWARD(
            hidden, weight, bias, target_flat, args, False, False, False, chunk_size, backend,
            *transform)
        ctx.save_for_backward(hidden, weight, bias, target_flat, lse_kept, threshold, in_support)
        ctx.args, ctx.backend, ctx.chunk_size, ctx.transform = args, backend, chunk_size, transform
        ctx.mark_non_differentiable(log_kept_mass, support_size, in_support)
        return logp, log_kept_mass, support_size, in_support

    @staticmethod
    def backward(ctx, grad_logp, *_):
        refuse_double_backward("linear_token_logprobs", LOGPROBS_EQUIVALENT)
        hidden, weight, bias, target_flat, lse_kept, threshold, in_support = ctx.saved_tensors
        coef = _backward_coef(grad_logp, lse_kept, in_support, ctx.args.temperature)
        grads = _HEAD_BACKWARD(hidden, weight, bias, target_flat, lse_kept, threshold, coef,
                               ctx.args, *ctx.needs_input_grad[:3], ctx.chunk_size, ctx.backend,
                               *ctx.transform)
        return (*(grad_or_none(g) for g in grads), None, None, None, None, None)


def linear_sampled_token_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                  target: Tensor, sampling: SamplingParams, ignore_index: int,
                                  return_support: bool, logit_scale: float,
                                  softcap: Optional[float], chunk_size: Optional[int],
                                  backend: str):
    """``linear_token_logprobs(..., sampling=...)`` once the sampling arguments and the
    transform (``logit_scale`` checked) are: float32 ``logp [...]``, and the support dict
    with ``return_support``."""
    hidden_rows = check_head(hidden, weight, bias, chunk_size)
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, LogitsShape.of_head(hidden, weight), ignore_index)
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        logits = reference_logits(hidden, weight, bias, logit_scale, softcap)
        return sampled_token_logprobs(logits, target, sampling, ignore_index, return_support,
                                      "reference")
    target_flat = flat_target(target)
    transform = (logit_scale, 0.0 if softcap is None else softcap)
    if head_any_grad(hidden, weight, bias):
        logp, log_kept_mass, support_size, in_support = _LinearSampledTokenLogprobs.apply(
            hidden_rows, weight, bias, target_flat, sampling.args(ignore_index), chunk_size,
            transform, backend)
    else:
        logp, _, _, log_kept_mass, support_size, in_support, *_ = _HEAD_FORWARD(
            hidden_rows, weight, bias, target_flat, sampling.args(ignore_index), False, False,
            False, chunk_size, backend, *transform)
    logp = logp.view(target.shape)
    if not return_support:
        return logp
    return logp, _support_dict(log_kept_mass, support_size, in_support, target.shape)
