"""The GRPO family's objective in torch on the token log-probs (and entropies): the clipped
surrogate and its metrics, GSPO's sequence ratio, CISPO, SAPO and VESPO's policy terms, the
off-policy and top-entropy masks, the entropy bonus (``from_logprobs``), the float64 spec's
route (``reference_loss``) and the result of the fused token-level kernel
(``token_level_result``). ``ops/grpo.py`` holds the ops, their checks and their routes; its
module docstring gives the contract."""

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import library
from ..kernels.primitives import LOG_RATIO_CLAMP
from ..options.grpo import GRPOOptions
from ._common import AttachGrad, flat_target, rows_view
from .grpo_plan import GRPOParams, GRPOPlan, TokenInputs, corrected, token_weights

VESPO_LOG_FLOOR = math.log(1e-8)  # TRL's lower clamp of VESPO's log-ratios


def token_values(logp: Tensor, entropy: Tensor, valid: Tensor) -> Dict[str, Tensor]:
    """``return_token_values``' dict: each token's log-prob and entropy at the call's
    temperature, detached float32 ``[B, T]``, 0 at masked tokens."""
    return {"logprobs": torch.where(valid, logp.detach().float().view(valid.shape), 0.0),
            "entropy": torch.where(valid, entropy.detach().float().view(valid.shape), 0.0)}


def with_token_values(result: Tuple[Tensor, Dict[str, Tensor]], checked: GRPOPlan,
                      logp: Tensor, entropy: Optional[Tensor]):
    """``result``, and the token values when the call asked for them."""
    if not checked.token_values:
        return result
    return result + (token_values(logp, entropy, checked.inputs.scored),)


def sampled_logprobs_of(score: Callable[[Tensor], Tensor]):
    """``from_logprobs``' ``logprobs_of`` for a call under ``sampling``: ``score(target)`` gives
    the token log-probs under the processed distribution (``-inf`` outside its support)."""
    def logprobs_of(masked_target: Tensor, with_entropy: bool):
        return score(masked_target), None
    return logprobs_of


def with_support(checked: GRPOPlan, logp: Tensor) -> Tuple[GRPOPlan, Tensor]:
    """``checked`` with the tokens outside the sampler's support (``logp == -inf``) masked, its
    token weights following the new mask, and ``logp`` with 0 there (no ``-inf`` reaches any
    arithmetic; the sampled op's gradient is 0 on those rows)."""
    inputs = checked.inputs
    in_support = torch.isfinite(logp.detach())
    valid = inputs.valid & in_support
    metrics = dict(checked.correction_metrics or {})
    metrics["mask/out_of_support"] = _masked_mean(~in_support, inputs.scored)
    inputs = dataclasses.replace(inputs, valid=valid, scored=inputs.scored & in_support)
    weight = token_weights(valid, checked.params.options, inputs.normalizer)
    checked = dataclasses.replace(checked, inputs=inputs, weight=weight, support_pending=False,
                                  correction_metrics=metrics)
    return checked, torch.where(in_support, logp, 0.0)


def reference_loss(logits: Tensor, target: Tensor, checked: GRPOPlan):
    """``backend="reference"``: the spec on the checked inputs, in the logits' float32."""
    from .. import reference

    inputs, params = checked.inputs, checked.params
    options = params.options
    # the spec computes its own rollout correction from the mask as given (rollout_is and the
    # caller's importance_weights never come together)
    weights = None if options.rollout_is is not None else inputs.importance_weights
    result = reference.grpo_loss(
        logits.float(), target, inputs.advantages, inputs.scored, inputs.old, inputs.ref,
        normalizer=inputs.normalizer, importance_weights=weights,
        sampling_logprobs=inputs.sampling, options=options)
    if not checked.token_values:
        return result
    with torch.no_grad():
        masked_target = torch.where(inputs.scored, target, torch.full_like(target, -100))
        logp, entropy = reference.token_logprobs(logits.float(), masked_target,
                                                 params.temperature, -100)
    if checked.correction_pending:
        checked = corrected(checked, logp)
    result[1]["entropy"] = _masked_mean(entropy, checked.inputs.valid)
    return with_token_values(result, checked, logp, entropy)


def _surrogate(ratio: Tensor, advantages: Tensor, params: GRPOParams) -> Tensor:
    """``-min(r_u * A, clip(r) * A)``; where both agree the unclipped branch carries the
    gradient. ``r_u = min(r, delta)`` when ``delta`` is on."""
    ratio_unclipped = ratio.clamp(max=params.delta) if params.delta > 0 else ratio
    unclipped = ratio_unclipped * advantages
    clipped = ratio.clamp(1.0 - params.clip_eps_low, 1.0 + params.clip_eps_high) * advantages
    return -torch.where(unclipped <= clipped, unclipped, clipped)


def _k3(logp: Tensor, ref: Optional[Tensor]) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref): ``exp(d) - d - 1`` with ``d = ref - logp``."""
    if ref is None:
        return torch.zeros_like(logp)
    log_ratio = (ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum().clamp(min=1).to(torch.float32)
    return (torch.where(valid, values.float(), 0.0).sum() / count).detach()


def _metrics(ratio: Tensor, k3: Tensor, inputs: TokenInputs, params: GRPOParams,
             extra: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    """``kl`` and ``ratio/mean``; the clip shares of the loss type (``clip_ratio/low``,
    ``/high``, ``/region`` for the clipped surrogate, ``clip_ratio/cispo`` for CISPO's cap);
    then ``extra`` (already means)."""
    valid, advantages = inputs.valid, inputs.advantages
    metrics = {"kl": _masked_mean(k3, valid), "ratio/mean": _masked_mean(ratio, valid)}
    policy = params.record.policy
    if policy == "clipped":
        low = (ratio < 1.0 - params.clip_eps_low) & (advantages < 0)
        high = (ratio > 1.0 + params.clip_eps_high) & (advantages > 0)
        metrics.update({"clip_ratio/low": _masked_mean(low, valid),
                        "clip_ratio/high": _masked_mean(high, valid),
                        "clip_ratio/region": _masked_mean(low | high, valid)})
    elif policy == "cispo":
        capped = (ratio > params.clip_eps_high) & (advantages > 0)
        metrics["clip_ratio/cispo"] = _masked_mean(capped, valid)
    metrics.update(extra or {})
    return metrics


def token_level(logits: Tensor, target: Tensor,
                 checked: GRPOPlan) -> Tuple[Tensor, Dict[str, Tensor]]:
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    params, flat = checked.params, checked.flat_rows()
    params = dataclasses.replace(params, with_entropy=checked.token_values)
    with torch.no_grad():
        logp, token_loss, entropy, grad = library.grpo_forward(
            rows_view(logits), flat_target(target), flat.advantages, flat.old, flat.ref,
            flat.weight, params, needs_grad, params.backend)
        value, metrics, *values = token_level_result(logp, token_loss, entropy, checked)
    loss = (AttachGrad.apply(rows_view(logits), value, grad, "grpo_loss", None) if needs_grad
            else value)
    return (loss, metrics, *values)


def token_level_result(logp: Tensor, token_loss: Tensor, entropy: Tensor, checked: GRPOPlan):
    """The loss (weighted sum of the fused kernel's per-token losses) and the metrics (and the
    token values when asked: ``entropy`` is then the kernel's, else empty)."""
    inputs, params = checked.inputs, checked.params
    valid = inputs.valid.reshape(-1)
    value = torch.where(valid, token_loss * checked.flat_rows().weight, 0.0).sum()
    token_logp = logp.view(inputs.valid.shape)
    logp = torch.where(inputs.valid, token_logp, 0.0)
    old = logp if inputs.old is None else inputs.old
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    k3 = _k3(logp, inputs.ref)
    if params.kl_ratio_correction:
        k3 = k3 * ratio
    extra = {"entropy": _masked_mean(entropy.view(inputs.valid.shape), inputs.valid)
             } if checked.token_values else {}
    extra.update(checked.correction_metrics or {})
    result = value, _metrics(ratio, k3, inputs, params, extra)
    return with_token_values(result, checked, token_logp, entropy)


def _vespo_weight(token_log_ratio: Tensor, inputs: TokenInputs, options: GRPOOptions) -> Tensor:
    """VESPO's detached gamma weight ``phi(W) = exp(lambda + k log W - lambda W)`` of the
    sequence ratio ``log W = sum_t (logp - old) + sum_t log(importance_weights)`` (each term and
    ``log W`` clamped to ``[log 1e-8, 20]`` as TRL's ``get_gamma_weights``), ``k, lambda`` by
    the sign of ``A``; ``[B, T]``. ``token_log_ratio`` is clamped to +-20 and 0 where masked."""
    valid = inputs.valid
    log_w = token_log_ratio.sum(-1, keepdim=True)
    if inputs.importance_weights is not None:
        log_weights = torch.log(inputs.importance_weights).clamp(VESPO_LOG_FLOOR,
                                                                 LOG_RATIO_CLAMP)
        log_w = log_w + torch.where(valid, log_weights, 0.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
    non_negative = inputs.advantages >= 0
    k = torch.where(non_negative, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(non_negative, options.vespo_lambda_pos, options.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _policy_loss(logp: Tensor, ratio: Tensor, token_log_ratio: Tensor, inputs: TokenInputs,
                 params: GRPOParams) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Each token's policy term ``[B, T]`` of the loss type (before masks and weights), and
    the type's own metrics."""
    advantages, options, policy = inputs.advantages, params.options, params.record.policy
    if policy == "cispo":
        capped = ratio.clamp(max=params.clip_eps_high).detach()
        return -capped * advantages * logp, {}
    if policy == "sapo":
        tau = torch.where(advantages > 0, options.sapo_tau_pos, options.sapo_tau_neg)
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages, {}
    if policy == "vespo":
        phi = _vespo_weight(token_log_ratio.detach(), inputs, options)
        return -phi * advantages * logp, {"vespo/phi_mean": _masked_mean(phi, inputs.valid)}
    return _surrogate(ratio, advantages, params), {}


def _off_policy_keep(logp: Tensor, inputs: TokenInputs, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: keep where ``A >= 0`` or the sequence's masked
    mean of ``sampling - logp`` is at most ``threshold``. Without ``sampling_logprobs`` the old
    log-probs stand in (then the current ones), as in TRL."""
    valid = inputs.valid
    sampling = inputs.sampling if inputs.sampling is not None else inputs.old
    if sampling is None:
        sampling = logp.detach()
    lengths = valid.sum(-1, keepdim=True).clamp(min=1).to(torch.float32)
    # TRL get_off_policy_mask: a token vLLM could not score (NaN) carries no KL evidence
    gap = torch.where(valid, torch.nan_to_num(sampling - logp.detach(), nan=0.0), 0.0)
    gap = gap.sum(-1, keepdim=True) / lengths
    return (inputs.advantages >= 0) | (gap <= threshold)


def _top_entropy_keep(entropy: Tensor, valid: Tensor, quantile: float) -> Tensor:
    """Unmasked tokens whose entropy is at or above the ``1 - quantile`` quantile of the
    unmasked tokens' entropies (``torch.quantile``'s linear interpolation; no host sync)."""
    if valid.numel() == 0:
        return valid
    entropy = entropy.detach()
    ordered = torch.where(valid, entropy, float("inf")).reshape(-1).sort().values
    rank = (1.0 - quantile) * (valid.sum() - 1).clamp(min=0).to(torch.float32)
    # gather, not item indexing: the ranks stay on the device (no sync, traceable)
    below, above = ordered.gather(0, torch.stack([rank.floor(), rank.ceil()]).long()).unbind()
    threshold = torch.lerp(below, above, rank - rank.floor())
    return valid & (entropy >= threshold)


def from_logprobs(logprobs_of: Callable[[Tensor, bool], Tuple[Tensor, Optional[Tensor]]],
                  target: Tensor, checked: GRPOPlan) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Every call the single-pass kernel does not cover, as torch math on ``[B, T]``.
    ``logprobs_of(masked_target, with_entropy)`` gives the differentiable token log-probs (and
    entropies, or None) from logits or the fused head. GSPO's ratio
    ``r_b = exp(masked mean of logp - old)`` is one per sequence, its gradient reaching every
    unmasked token of the sequence. A rollout correction waiting for the token log-probs
    (``old = logp``, or the sampler's support: its tokens leave the mask first) is computed
    here, before anything reads the mask."""
    masked_target = torch.where(checked.inputs.scored, target, torch.full_like(target, -100))
    logp, entropy = logprobs_of(masked_target,
                                checked.params.options.needs_entropy or checked.token_values)
    if checked.support_pending:
        checked, logp = with_support(checked, logp)
    if checked.correction_pending:
        checked = corrected(checked, logp.detach())
    inputs, params, weight = checked.inputs, checked.params, checked.weight
    options, valid = params.options, inputs.valid
    old = logp.detach() if inputs.old is None else inputs.old
    token_log_ratio = torch.where(valid, logp - old, 0.0)
    if options.importance_sampling == "sequence":
        lengths = valid.sum(-1, keepdim=True).clamp(min=1).to(torch.float32)
        log_ratio = (token_log_ratio.sum(-1, keepdim=True) / lengths).expand_as(logp)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    token_loss, extra = _policy_loss(
        logp, ratio, token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), inputs, params)
    keep = valid
    if options.off_policy_threshold is not None:
        kept = _off_policy_keep(logp, inputs, options.off_policy_threshold)
        keep = keep & kept
        extra["mask/off_policy"] = _masked_mean(kept, valid)
    entropy_keep = valid
    if options.top_entropy_quantile < 1.0:
        entropy_keep = _top_entropy_keep(entropy, valid, options.top_entropy_quantile)
        keep = keep & entropy_keep
        extra["mask/entropy"] = _masked_mean(entropy_keep, valid)
    if inputs.importance_weights is not None and params.record.policy != "vespo":
        token_loss = token_loss * inputs.importance_weights  # VESPO has them inside phi
    token_loss = torch.where(keep, token_loss, 0.0)
    k3 = _k3(logp, inputs.ref)
    if options.kl_ratio_correction:
        k3 = k3 * ratio  # TRL's use_bias_correction_kl: k3 under the importance ratio
    if params.beta > 0:
        token_loss = token_loss + params.beta * k3
    loss = torch.where(valid, token_loss * weight, 0.0).sum()
    if entropy is not None:
        extra["entropy"] = _masked_mean(entropy, valid)
    if options.entropy_coef != 0.0:
        loss = loss - options.entropy_coef * _entropy_bonus(entropy, entropy_keep, checked)
    extra.update(checked.correction_metrics or {})
    result = loss, _metrics(ratio.detach(), k3.detach(), inputs, params, extra)
    return with_token_values(result, checked, logp, entropy)


def _entropy_bonus(entropy: Tensor, keep: Tensor, checked: GRPOPlan) -> Tensor:
    """TRL's entropy term: the mean entropy over the kept tokens, or for the global-count loss
    types the sum over them divided by that count (each token's aggregation weight)."""
    if checked.params.record.global_count:
        return torch.where(keep, entropy * checked.weight, 0.0).sum()
    count = keep.sum().clamp(min=1).to(torch.float32)
    return torch.where(keep, entropy, 0.0).sum() / count
