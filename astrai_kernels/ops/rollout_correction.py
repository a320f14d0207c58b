"""Rollout correction for the GRPO family: per-token importance weights and a rejection mask
from the trainer's log-probs of the rollout (``old``) and the sampler's (``sampling_logprobs``,
what vLLM reported for the sampled tokens), computed in ``grpo_loss``'s pass.

* ``rollout_is`` (TRL 1.16 ``GRPOTrainer._generate_and_score_completions``,
  ``vllm_importance_sampling_mode``): ``d = nan_to_num(old - sampling)`` on unmasked tokens (0
  elsewhere), ``rho = exp(d)`` per token or ``exp(sum_t d)`` per sequence; ``*_truncate``
  clamps ``rho`` to ``[rollout_is_min, rollout_is_max]``, ``*_mask`` sets it to 0 outside.
  ``rollout_is_batch_normalize`` then divides by the batch mean (verl ``rollout_corr_helper.
  compute_rollout_correction_weights``). The weights multiply each token's policy term.
* ``rollout_rs`` (verl ``rollout_corr_helper.compute_rollout_rejection_mask``): k1/k2/k3 of
  ``clamp(d, +-20)`` per token, or their sum, mean or max per sequence, against thresholds;
  rejected tokens leave the mask (verl replaces ``response_mask``).

Nothing here carries a gradient: the weights depend on ``old`` and ``sampling`` only. Float32
throughout; metrics are detached 0-d tensors (no host sync), 0 for an empty batch.

A token whose ``old - sampling`` is infinite (a ``-inf`` log-prob on one side: one policy gives
the sampled token no mass) keeps TRL's arithmetic in the weights and the rejection
(``nan_to_num`` turns the infinity into float32's largest value: truncated, masked or
rejected), but has no finite mismatch to average: the mismatch metrics (``rollout_corr/kl``,
``k3_kl``, ``log_ppl_diff``, ``chi2_*``; ``sampling/sampling_logp_difference/*``) leave it out
and count it (``rollout_corr/infinite_log_ratio_count``,
``sampling/sampling_logp_difference/non_finite_count``).
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from ..options.grpo import GRPOOptions

SAFETY_BOUND = 20.0  # verl rollout_corr_helper.SAFETY_BOUND: log-ratios clamped before exp
MASKED_MEAN_EPS = 1e-8  # verl utils/torch_functional.masked_mean: sum / (count + 1e-8)


@dataclass(frozen=True)
class RolloutCorrection:
    """``weights`` (float32 ``[B, T]``, or None without ``rollout_is``), ``kept`` (bool
    ``[B, T]``: the unmasked tokens the rejection keeps) and the metrics."""
    weights: Optional[Tensor]
    kept: Tensor
    metrics: Dict[str, Tensor]


def check_inputs(options: GRPOOptions, sampling: Optional[Tensor],
                 importance_weights: Optional[Tensor]) -> None:
    """The call's tensors against the checked options (``GRPOOptions.checked`` checks the
    options themselves): the correction needs the sampler's log-probs, and replaces
    precomputed importance weights."""
    if options.rollout_is is not None and importance_weights is not None:
        raise ValueError("importance_weights are precomputed correction weights: pass them "
                         "or rollout_is, not both")
    if options.rollout_correction_on and sampling is None:
        raise ValueError("rollout_is and rollout_rs need sampling_logprobs, the sampler's "
                         "log-probs of the sampled tokens")


def _masked_mean(values: Tensor, valid: Tensor, dim=None) -> Tensor:
    """verl's ``masked_mean``: the sum over ``valid`` over ``count + 1e-8``."""
    total = torch.where(valid, values, 0.0).sum(dim)
    return total / (valid.sum(dim).to(torch.float32) + MASKED_MEAN_EPS)


def _masked_max(values: Tensor, valid: Tensor, dim=None) -> Tensor:
    masked = torch.where(valid, values, -math.inf)
    return masked.amax() if dim is None else masked.amax(dim)


def _masked_min(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, math.inf).amin()


def rollout_correction(old: Tensor, sampling: Tensor, valid: Tensor,
                       options: GRPOOptions) -> RolloutCorrection:
    """The correction of one call: ``old`` and ``sampling`` float32 ``[B, T]`` (detached),
    ``valid`` the call's mask; ``options`` checked."""
    with torch.no_grad():
        old, sampling = old.detach().float(), sampling.detach().float()
        # TRL: NaN (a token vLLM could not score) gives d = 0, a ratio of exactly 1
        log_ratio = torch.where(valid, torch.nan_to_num(old - sampling, nan=0.0), 0.0)
        metrics = _mismatch_metrics(log_ratio, valid, valid & ~torch.isinf(old - sampling))
        weights = None
        if options.rollout_is is not None:
            weights, is_metrics = _importance_weights(old, sampling, log_ratio, valid, options)
            metrics.update(is_metrics)
        kept = valid
        if options.rollout_rs is not None:
            kept, rs_metrics = _rejection(log_ratio, valid, options)
            metrics.update(rs_metrics)
        empty = ~valid.any()
        metrics = {key: torch.where(empty, 0.0, value) for key, value in metrics.items()}
    return RolloutCorrection(weights, kept, metrics)


def _importance_weights(old: Tensor, sampling: Tensor, log_ratio: Tensor, valid: Tensor,
                        options: GRPOOptions):
    """TRL's ``vllm_importance_sampling_ratio`` ``[B, T]`` (sequence modes broadcast), then
    verl's batch normalisation; TRL's ``sampling/*`` and verl's ``rollout_is_*`` metrics."""
    mode, low, high = options.rollout_is, options.rollout_is_min, options.rollout_is_max
    token_level = mode.startswith("token_")
    # TRL: exp(d) per token, exp(sum_t d) per sequence (no clamp before exp)
    log_ratio_seq = log_ratio.sum(-1, keepdim=True)
    raw = torch.exp(log_ratio if token_level else log_ratio_seq)
    if mode.endswith("_truncate"):
        ratio = raw.clamp(min=low, max=high)
    else:
        low_value = -math.inf if low is None else low
        high_value = math.inf if high is None else high
        ratio = torch.where((raw < low_value) | (raw > high_value), 0.0, raw)
    # TRL's metrics: |old - sampling| over unmasked, finite ones (TRL leaves NaN out; an
    # infinity is left out and counted); the ratio over unmasked tokens (token modes) or over
    # every sequence (sequence modes)
    delta = (old - sampling).abs()
    scored = valid & torch.isfinite(delta)
    ratios = (ratio, valid) if token_level else (ratio, torch.ones_like(ratio, dtype=torch.bool))
    metrics = {
        "sampling/sampling_logp_difference/mean": _masked_mean(delta, scored).where(
            scored.any(), 0.0),
        "sampling/sampling_logp_difference/max": _masked_max(delta, scored).where(
            scored.any(), 0.0),
        "sampling/sampling_logp_difference/non_finite_count": (valid & ~scored).sum().to(
            torch.float32),
        "sampling/importance_sampling_ratio/min": _masked_min(*ratios).where(
            ratios[1].any(), 0.0),
        "sampling/importance_sampling_ratio/mean": (
            torch.where(ratios[1], ratio, 0.0).sum()
            / ratios[1].sum().clamp(min=1).to(torch.float32)),
        "sampling/importance_sampling_ratio/max": _masked_max(*ratios).where(
            ratios[1].any(), 0.0),
    }
    weights = ratio.expand_as(log_ratio)
    metrics.update(_verl_is_metrics(weights, log_ratio_seq, valid, token_level, high))
    if options.rollout_is_batch_normalize:
        weights, factor = _batch_normalized(weights, valid, token_level)
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    return torch.where(valid, weights, 0.0), metrics


def _verl_is_metrics(weights: Tensor, log_ratio_seq: Tensor, valid: Tensor, token_level: bool,
                     high: Optional[float]) -> Dict[str, Tensor]:
    """verl ``compute_is_metrics`` on the applied weights (before batch normalisation): mean,
    max, min (per sequence: of the unclamped ``exp(sum_t d)``, max capped at ``e^20``), std
    and effective sample size of the weights clamped to ``[0, upper]``."""
    if token_level:
        largest, smallest = _masked_max(weights, valid), _masked_min(weights, valid)
    else:
        largest = torch.exp(log_ratio_seq.amax().clamp(max=SAFETY_BOUND))
        smallest = torch.exp(log_ratio_seq.amin())
    clamped = weights.clamp(min=0.0, max=high)
    mean_clamped = _masked_mean(clamped, valid)
    variance = _masked_mean(clamped.square(), valid) - mean_clamped.square()
    std = torch.where(valid.sum() > 1, variance.clamp(min=0.0).sqrt(), 0.0)
    normalized = clamped / (mean_clamped + MASKED_MEAN_EPS)
    return {"rollout_corr/rollout_is_mean": _masked_mean(weights, valid),
            "rollout_corr/rollout_is_max": largest,
            "rollout_corr/rollout_is_min": smallest,
            "rollout_corr/rollout_is_std": std,
            "rollout_corr/rollout_is_eff_sample_size": 1.0 / _masked_mean(normalized.square(),
                                                                           valid)}


def _batch_normalized(weights: Tensor, valid: Tensor, token_level: bool):
    """verl: divide by the masked mean of the token weights, or of the sequences' weights
    over the sequences with a token; unchanged (factor 1) when that mean is <= 1e-8."""
    if token_level:
        mean = _masked_mean(weights, valid)
    else:
        per_sequence = _masked_mean(weights, valid, -1)
        has_tokens = valid.any(-1).to(torch.float32)
        mean = (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1e-8)
    usable = mean > MASKED_MEAN_EPS
    return (torch.where(usable, weights / mean, weights),
            torch.where(usable, mean, 1.0))


def _rejection(log_ratio: Tensor, valid: Tensor, options: GRPOOptions):
    """verl's hard trust region on ``clamp(d, +-20)``: k1 = ``-d`` kept in ``[log lower, log
    upper]`` (lower defaults to ``1 / upper``), k2 = ``d^2 / 2`` and k3 = ``e^d - 1 - d`` kept
    ``<= upper``; per token, or their sum / mean / max over each sequence."""
    option, upper = options.rollout_rs, options.rollout_rs_threshold
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    statistic = {"k1": -safe, "k2": 0.5 * safe.square(),
                 "k3": torch.exp(safe) - 1.0 - safe}[option[-2:]]
    if option.startswith("seq_sum_"):
        statistic = torch.where(valid, statistic, 0.0).sum(-1, keepdim=True)
    elif option.startswith("seq_mean_"):
        statistic = _masked_mean(statistic, valid, -1).unsqueeze(-1)
    elif option.startswith("seq_max_"):
        largest = _masked_max(statistic, valid, -1)
        statistic = torch.where(valid.any(-1), largest, 0.0).unsqueeze(-1)
    if option.endswith("k1"):
        lower = options.rollout_rs_threshold_lower
        lower = 1.0 / upper if lower is None else lower
        keep = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
    else:
        keep = statistic <= upper
    kept = valid & keep.expand_as(valid)
    rejected = valid & ~kept
    return kept, {
        "rollout_corr/rollout_rs_masked_fraction": _masked_mean(rejected.float(), valid),
        "rollout_corr/rollout_rs_seq_masked_fraction": rejected.any(-1).float().mean()}


def _mismatch_metrics(log_ratio: Tensor, valid: Tensor, finite: Tensor) -> Dict[str, Tensor]:
    """verl ``compute_offpolicy_metrics`` (``d = log pi_old - log pi_sampler``): ``kl`` =
    mean(-d), ``k3_kl`` = mean(e^d - d - 1), ``log_ppl_diff`` = mean over sequences of
    -(sum_t d) / n, ``chi2_token`` = mean(e^(2 clamp(d))) - 1, ``chi2_seq`` = mean over
    sequences of e^(2 clamp(sum_t d)) - 1 (clamps at +-20), over the ``finite`` tokens (the
    unmasked ones whose ``d`` is not infinite); ``infinite_log_ratio_count``: the others."""
    log_ratio = torch.where(finite, log_ratio, 0.0)
    per_sequence = log_ratio.sum(-1)
    lengths = finite.sum(-1).to(torch.float32)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "rollout_corr/kl": _masked_mean(-log_ratio, finite),
        "rollout_corr/k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, finite),
        "rollout_corr/log_ppl_diff": (-per_sequence / (lengths + MASKED_MEAN_EPS)).mean(),
        "rollout_corr/chi2_token": _masked_mean(torch.exp(safe).square(), finite) - 1.0,
        "rollout_corr/chi2_seq": torch.exp(
            2.0 * per_sequence.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0,
        "rollout_corr/infinite_log_ratio_count": (valid & ~finite).sum().to(torch.float32),
    }
