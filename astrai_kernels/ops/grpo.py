"""GRPO clipped surrogate (and DAPO, Dr.GRPO, GSPO) fused with the log-softmax-gather.

Contract (DESIGN.md): ``grpo_loss(logits [B, T, V], target [B, T], advantages [B] or [B, T])``
-> ``(loss, metrics)``. With token-level importance sampling one kernel computes per token
``lse``, ``logp``, the ratio, the clip, the k3 KL and ``dL/dlogp`` (the aggregation weight of
each token is known up front), and writes the gradient in the same pass. GSPO needs the
sequence ratio first: a forward-only log-prob pass, O(B*T) math, then the gradient pass.
Log-ratios are clamped to +-20 before ``exp`` (as verl does) so no ratio overflows.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from .. import reference
from . import _library
from ._backend import resolve_backend
from ._common import (
    AttachGrad,
    check_choice,
    check_in_range,
    check_logits,
    check_per_row,
    check_positive,
    check_target,
    flat_target,
    rows_view,
)
from .logprobs import token_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING = ("token", "sequence")


@dataclass(frozen=True)
class GRPOParams:
    beta: float
    clip_eps_low: float
    clip_eps_high: float
    delta: float
    loss_type: str
    importance_sampling: str
    temperature: float
    backend: str


def _token_weight(mask, loss_type, max_completion_length, normalizer):
    """Each token's factor in the aggregated loss (0 on masked tokens), float32 ``[B, T]``."""
    batch, length = mask.shape
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * batch)
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / float(batch * (max_completion_length or length))
    total = mask.sum().clamp(min=1.0) if normalizer is None else normalizer
    return mask / total


def _metrics(ratio, k3, advantages, mask, params):
    count = mask.sum().clamp(min=1.0)
    low = (ratio < 1.0 - params.clip_eps_low) & (advantages < 0)
    high = (ratio > 1.0 + params.clip_eps_high) & (advantages > 0)

    def masked_mean(x):
        return ((x.float() * mask).sum() / count).detach()

    return {"kl": masked_mean(k3), "ratio/mean": masked_mean(ratio),
            "clip_ratio/low": masked_mean(low), "clip_ratio/high": masked_mean(high),
            "clip_ratio/region": masked_mean(low | high)}


def _check(logits, target, advantages, mask, old_logprobs, ref_logprobs, beta, clip_eps_low,
           clip_eps_high, delta, loss_type, importance_sampling, temperature,
           max_completion_length, normalizer, backend):
    check_logits(logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    shape, device = tuple(logits.shape[:2]), logits.device
    mask = (torch.ones(shape, dtype=torch.float32, device=device) if mask is None
            else check_per_row(mask, "mask", shape, device).to(torch.float32))
    check_target(target, logits, where=mask > 0)
    if not isinstance(advantages, torch.Tensor) or advantages.dim() not in (1, 2):
        raise ValueError("advantages must be a tensor of shape [B] or [B, T]")
    check_per_row(advantages, "advantages", shape[:advantages.dim()], device)
    advantages = advantages.detach().float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(shape)
    old = check_per_row(old_logprobs, "old_logprobs", shape, device, allow_none=True)
    ref = check_per_row(ref_logprobs, "ref_logprobs", shape, device, allow_none=True)
    beta = check_in_range(beta, "beta", 0.0, float("inf"))
    if beta > 0 and ref is None:
        raise ValueError("beta > 0 needs ref_logprobs (the reference policy's token log-probs)")
    clip_eps_low = check_in_range(clip_eps_low, "clip_eps_low", 0.0, 1.0)
    clip_eps_high = (clip_eps_low if clip_eps_high is None
                     else check_in_range(clip_eps_high, "clip_eps_high", 0.0, float("inf")))
    delta = 0.0 if delta is None else check_positive(delta, "delta")
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_choice(importance_sampling, "importance_sampling", IMPORTANCE_SAMPLING)
    if max_completion_length is not None:
        check_positive(max_completion_length, "max_completion_length")
    if normalizer is not None and not isinstance(normalizer, torch.Tensor):
        check_positive(normalizer, "normalizer")
    params = GRPOParams(beta, clip_eps_low, clip_eps_high, delta, loss_type, importance_sampling,
                        check_positive(temperature, "temperature"),
                        resolve_backend(backend, device))
    return mask, advantages, old, ref, params


@dataclass(frozen=True)
class GRPOPlan:
    """The checked inputs of one GRPO call, shaped ``[B, T]``, and each token's loss weight."""
    params: GRPOParams
    mask: torch.Tensor
    advantages: torch.Tensor
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    weight: torch.Tensor

    def flat_rows(self):
        """The per-token inputs of the fused kernels: contiguous float32 vectors of B*T."""
        def flat(x):
            return None if x is None else x.detach().reshape(-1).float().contiguous()

        return SimpleNamespace(advantages=flat(self.advantages), old=flat(self.old),
                               ref=flat(self.ref), weight=flat(self.weight))


def plan(logits, target, advantages, *, mask=None, old_logprobs=None, ref_logprobs=None,
         beta=0.0, clip_eps_low=0.2, clip_eps_high=None, delta=None, loss_type="bnpo",
         importance_sampling="token", temperature=1.0, max_completion_length=None,
         normalizer=None, backend="auto"):
    """Check a call's arguments and weigh its tokens; ``logits`` may be a zero-byte stand-in."""
    mask, adv, old, ref, params = _check(
        logits, target, advantages, mask, old_logprobs, ref_logprobs, beta, clip_eps_low,
        clip_eps_high, delta, loss_type, importance_sampling, temperature,
        max_completion_length, normalizer, backend)
    if isinstance(normalizer, torch.Tensor):
        normalizer = normalizer.reshape(()).to(device=logits.device, dtype=torch.float32)
    weight = _token_weight(mask, loss_type, max_completion_length, normalizer)
    return GRPOPlan(params, mask, adv, old, ref, weight)


def grpo_loss(logits, target, advantages, *, mask=None, old_logprobs=None, ref_logprobs=None,
              beta=0.0, clip_eps_low=0.2, clip_eps_high=None, delta=None, loss_type="bnpo",
              importance_sampling="token", temperature=1.0, max_completion_length=None,
              normalizer=None, backend="auto"):
    """GRPO policy loss and detached float32 metrics (means over masked tokens)."""
    checked = plan(logits, target, advantages, mask=mask, old_logprobs=old_logprobs,
                   ref_logprobs=ref_logprobs, beta=beta, clip_eps_low=clip_eps_low,
                   clip_eps_high=clip_eps_high, delta=delta, loss_type=loss_type,
                   importance_sampling=importance_sampling, temperature=temperature,
                   max_completion_length=max_completion_length, normalizer=normalizer,
                   backend=backend)
    params = checked.params
    if params.backend == "reference":
        return reference.grpo_loss(
            logits.float(), target, checked.advantages, checked.mask, old_logprobs,
            ref_logprobs, beta, params.clip_eps_low, clip_eps_high, delta, loss_type,
            importance_sampling, params.temperature, max_completion_length, normalizer)
    if importance_sampling == "sequence":
        def logprobs_of(masked_target):
            return token_logprobs(logits, masked_target, temperature=params.temperature,
                                  backend=params.backend)
        return sequence_level(logprobs_of, target, checked)
    return _token_level(logits, target, checked)


def _token_level(logits, target, checked):
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    params, flat = checked.params, checked.flat_rows()
    with torch.no_grad():
        logp, token_loss, grad = _library.grpo_forward(
            rows_view(logits), flat_target(target), params.temperature, flat.advantages,
            flat.old, flat.ref, flat.weight, params.clip_eps_low, params.clip_eps_high,
            params.delta, params.beta, needs_grad, params.backend)
        value, metrics = token_level_result(logp, token_loss, checked)
    loss = AttachGrad.apply(rows_view(logits), value, grad) if needs_grad else value
    return loss, metrics


def token_level_result(logp, token_loss, checked):
    """The loss (weighted sum of per-token losses) and metrics from the fused kernel's rows."""
    value = (token_loss * checked.flat_rows().weight).sum()
    logp = logp.view(checked.mask.shape)
    old_or_logp = logp if checked.old is None else checked.old.float()
    ratio = torch.exp((logp - old_or_logp).clamp(-20.0, 20.0))
    k3 = _k3(logp, checked.ref)
    return value, _metrics(ratio, k3, checked.advantages, checked.mask, checked.params)


def _k3(logp, ref):
    if ref is None:
        return torch.zeros_like(logp)
    log_ratio = (ref.float() - logp).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def sequence_level(logprobs_of, target, checked):
    """GSPO: ``r_b = exp(masked mean of logp - old)``, one per sequence, gradient to every token.

    ``logprobs_of(masked_target)`` returns the differentiable token log-probs ``[B, T]``.
    """
    mask, old, ref, params = checked.mask, checked.old, checked.ref, checked.params
    masked_target = torch.where(mask > 0, target, torch.full_like(target, -100))
    logp = logprobs_of(masked_target)
    old_value = logp.detach() if old is None else old.float() * mask
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio = ((logp - old_value) * mask).sum(-1, keepdim=True) / lengths
    token_loss, ratio, k3 = reference.grpo_token_loss(
        logp, logp - seq_log_ratio, None if ref is None else ref.float() * mask,
        checked.advantages, params.clip_eps_low, params.clip_eps_high, params.delta or None,
        params.beta)
    loss = (token_loss * checked.weight).sum()
    return loss, _metrics(ratio.detach(), k3.detach(), checked.advantages, mask, params)
