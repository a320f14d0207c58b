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

The op runs down one path: its door (``ops/logprobs.py``) checks the call once and, when a
filter can drop a token, calls :func:`sampled_token_logprobs` (or the fused head's
:func:`linear_sampled_token_logprobs`) here with the checked arguments; those call the
``sampled_logprobs_*`` primitives' custom ops (``kernels/library.py``), whose kernel module
``kernels/portable_sampling.py``'s ``sampling_kernels`` picks: the cpp backend's selection on a
few candidates per row (``csrc/sampling.cpp``), the triton backend's bisection over integer
keys, 32 passes per filter (``kernels/triton/sampling.py``), or, on a backend without the
primitives (``torch``), the chunked-torch radix selection of ``kernels/portable_sampling.py``
on its device. ``backend="reference"`` runs ``reference.sampled_token_logprobs``.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from .. import reference
from ..kernels.library import optional_primitive_op
from ..kernels.portable_sampling import sampling_kernels
from ..kernels.primitives import SamplingArgs
from ..options.scalars import check_in_range, check_index, check_positive, check_real
from ._common import dense_grad, flat_target, refuse_double_backward, rows_view
from .head import grad_or_none, head_any_grad, head_walk, reference_logits

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
    """``token_logprobs(logits, target, sampling=...)`` once its door has checked every
    argument (``backend`` resolved): float32 ``logp [...]``, and the support dict with
    ``return_support``."""
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
    """``linear_token_logprobs(..., sampling=...)`` once its door has checked every argument
    (``backend`` resolved): float32 ``logp [...]``, and the support dict with
    ``return_support``."""
    if backend == "reference":
        logits = reference_logits(hidden, weight, bias, logit_scale, softcap)
        return sampled_token_logprobs(logits, target, sampling, ignore_index, return_support,
                                      "reference")
    hidden_rows, target_flat = hidden.reshape(-1, hidden.shape[-1]), flat_target(target)
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
