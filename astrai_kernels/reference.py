"""The spec: one short, naive, materializing function per op.

Every backend is tested against these in float64 (call them with ``logits.double()``); with
``backend="reference"`` the public ops call them on ``logits.float()``. No production path
calls them otherwise: the ops implement their own math, so a test against this module checks
one implementation against another. Inputs are the public ops' inputs after validation;
outputs keep the input's float dtype.

Rows that are ignored or masked are *selected* away (``torch.where``), never multiplied by 0:
an ignored row holding inf or NaN gives 0 and a zero gradient, as the kernels do.
"""

import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels.primitives import LOG_RATIO_CLAMP
from .options.grpo import LOSS_TYPE_RECORDS, GRPOOptions
from .options.keywords import spread_options


def token_logprobs(logits: Tensor, target: Tensor, temperature: float = 1.0,
                   ignore_index: int = -100) -> Tuple[Tensor, Tensor]:
    """``(logp, entropy)`` of ``softmax(logits / T)`` at ``target``; ignored rows give 0.

    ``target [...]`` holds one target a row; ``target [..., K]`` (``logits``' rank) K of them:
    ``logp [..., K]`` (ignored entries 0) and ``entropy [...]`` (0 where all K are ignored)."""
    columns = target.dim() == logits.dim()
    valid = target != ignore_index
    row_valid = valid.any(-1) if columns else valid
    # Ignored rows are replaced by zeros before the softmax: their values (inf, NaN) never
    # reach the result or the gradient.
    logits = torch.where(row_valid.unsqueeze(-1), logits, 0.0)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    safe = torch.where(valid, target, 0).long()
    logp = logp_all.gather(-1, safe if columns else safe.unsqueeze(-1))
    logp = logp if columns else logp.squeeze(-1)
    p = logp_all.exp()
    # Terms with p = 0 (logits of -inf) contribute 0, not 0 * -inf, and no NaN gradient.
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(row_valid, entropy, 0.0)


def transform_logits(logits: Tensor, logit_scale: float = 1.0,
                     softcap: Optional[float] = None) -> Tensor:
    """``softcap * tanh(logit_scale * logits / softcap)`` (no cap when ``softcap`` is None):
    the final logit scale and soft-cap of transformers' models, in TRL's order."""
    logits = logits * logit_scale if logit_scale != 1.0 else logits
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def token_statistics(logits: Tensor, target: Tensor, temperature: float = 1.0,
                     ignore_index: int = -100) -> Dict[str, Tensor]:
    """TRL's forward-only per-token statistics of ``s = logits / temperature``:
    ``log_sum_sq_probs = log sum_v softmax(s)_v**2``, ``mean_logits = mean_v s_v`` and
    ``is_top1`` (``target`` is ``argmax(s)``, its first maximum); 0 / False on ignored rows."""
    valid = target != ignore_index
    s = logits * (1.0 / temperature)
    log_p = torch.log_softmax(s, dim=-1)
    log_sum_sq = torch.logsumexp(2.0 * log_p, dim=-1)
    top1 = s.argmax(-1) == torch.where(valid, target, 0)
    return {"log_sum_sq_probs": torch.where(valid, log_sum_sq, 0.0),
            "mean_logits": torch.where(valid, s.mean(-1), 0.0),
            "is_top1": top1 & valid}


def sequence_logprobs(logits: Tensor, target: Tensor, mask: Tensor, average: bool = False,
                      temperature: float = 1.0) -> Tensor:
    """Sum (or mean over ``mask``) of token log-probs per sequence, ``[B]``."""
    logp, _ = token_logprobs(logits, target, temperature, ignore_index=-100)
    weight = mask.to(logp.dtype)
    total = torch.where(weight != 0, logp * weight, 0.0).sum(-1)
    return total / weight.sum(-1).clamp(min=1.0) if average else total


def sampled_token_logprobs(logits: Tensor, target: Tensor, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                           ignore_index: int = -100
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, log_kept_mass, support_size, in_support)`` of ``target`` under vLLM's processed
    distribution of ``s = logits / temperature`` (``ops/sampling.py``): ``min_p`` keeps
    ``p >= min_p * max p``; ``top_k`` every ``s`` at or above the k-th largest; ``top_p``, on
    the renormalised kept tokens, a token iff the mass of strictly larger ``s`` is below
    ``top_p``. ``logp = s_y - logsumexp`` over the kept tokens, ``-inf`` outside them;
    ``log_kept_mass`` is the log of their mass under ``softmax(s)``. Ignored rows give 0, 0,
    0 and False; a row holding NaN or +inf (or only -inf) gives NaN, NaN, ``V`` and True."""
    valid = target != ignore_index
    s = torch.where(valid.unsqueeze(-1), logits, 0.0) / temperature
    vocab = s.shape[-1]
    kept = torch.ones_like(s, dtype=torch.bool)
    if min_p > 0:
        probs = torch.softmax(s, -1)
        kept &= probs >= min_p * probs.amax(-1, keepdim=True)
    if 0 < top_k < vocab:
        kth_largest = torch.where(kept, s, -math.inf).topk(top_k, -1).values[..., -1:]
        kept &= s >= kth_largest
    if top_p < 1:
        masked = torch.where(kept, s, -math.inf)
        descending = masked.sort(-1, descending=True).values
        probs = torch.softmax(descending, -1)
        # leading_mass[..., n]: the mass of the n largest kept logits
        leading_mass = torch.cat([torch.zeros_like(probs[..., :1]), probs.cumsum(-1)], -1)
        ascending = descending.flip(-1).contiguous()
        larger = vocab - torch.searchsorted(ascending, masked.contiguous(), right=True)
        kept &= leading_mass.gather(-1, larger) < top_p
    lse_kept = torch.logsumexp(torch.where(kept, s, -math.inf), -1)
    safe = torch.where(valid, target, 0).long().unsqueeze(-1)
    in_support = valid & kept.gather(-1, safe).squeeze(-1)
    logp = torch.where(in_support, s.gather(-1, safe).squeeze(-1) - lse_kept,
                       torch.where(valid, -math.inf, 0.0))
    log_kept_mass = torch.where(valid, lse_kept - torch.logsumexp(s, -1), 0.0).detach()
    support_size = torch.where(valid, kept.sum(-1), 0)
    # a row holding NaN or +inf (or only -inf) has no distribution: the plain log-softmax's NaN,
    # every token counted, never a filter's -inf that would hide it
    undefined = valid & ~torch.isfinite(s.amax(-1))
    plain = torch.log_softmax(s, -1).gather(-1, safe).squeeze(-1)
    return (torch.where(undefined, plain, logp),
            torch.where(undefined, math.nan, log_kept_mass),
            torch.where(undefined, vocab, support_size), in_support | undefined)


def _divide_or_zero(total: Tensor, count: Tensor) -> Tensor:
    """``total / count``, and 0 (with a zero gradient) where ``count`` is 0."""
    return torch.where(count > 0, total / torch.where(count > 0, count, 1), 0.0)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: Optional[float] = None,
                  normalizer: Union[None, float, Tensor] = None,
                  logit_scale: float = 1.0) -> Tensor:
    """``F.cross_entropy`` on the logits transformed by :func:`transform_logits` (scaled by
    ``logit_scale``, then softcapped) plus ``z_loss * lse**2`` per counted row.

    ``mean`` divides by the count of counted rows (or ``normalizer``); a count of 0 gives 0.
    """
    z = logits.reshape(-1, logits.shape[-1])
    y = target.reshape(-1)
    valid = y != ignore_index
    z = transform_logits(torch.where(valid.unsqueeze(-1), z, 0.0), logit_scale, softcap)
    rows = F.cross_entropy(z, torch.where(valid, y, 0).long(), reduction="none",
                           label_smoothing=label_smoothing)
    if z_loss > 0:
        # Only formed when on: 0 * lse**2 is NaN once lse**2 overflows (|lse| > 1.8e19 in fp32).
        rows = rows + z_loss * torch.logsumexp(z, dim=-1) ** 2
    rows = torch.where(valid, rows, 0.0)
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    count = valid.sum().to(rows.dtype) if normalizer is None else normalizer
    return _divide_or_zero(rows.sum(), torch.as_tensor(count, dtype=rows.dtype,
                                                      device=rows.device))


def grpo_token_loss(logp: Tensor, old_logprobs: Optional[Tensor],
                    ref_logprobs: Optional[Tensor], advantages: Tensor,
                    clip_eps_low: float = 0.2, clip_eps_high: Optional[float] = None,
                    delta: Optional[float] = None,
                    beta: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate plus ``beta * k3``; ``(loss, ratio, k3)``.

    Where both branches of the min agree the unclipped one is taken (it carries the gradient).
    Log-ratios are clamped to +-20 before ``exp`` so ratios never overflow.
    """
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    old = logp.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio_unclipped = ratio if delta is None else ratio.clamp(max=delta)
    unclipped = ratio_unclipped * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.where(unclipped <= clipped, unclipped, clipped)
    k3 = torch.zeros_like(logp)
    if ref_logprobs is not None:
        ref_log_ratio = (ref_logprobs - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        loss = loss + beta * k3
    return loss, ratio, k3


@spread_options(GRPOOptions, "GRPO", positional=8, positional_after="ref_logprobs")
def grpo_loss(logits: Tensor, target: Tensor, advantages: Tensor, mask: Optional[Tensor] = None,
              old_logprobs: Optional[Tensor] = None, ref_logprobs: Optional[Tensor] = None,
              normalizer: Union[None, float, Tensor] = None, *,
              importance_weights: Optional[Tensor] = None,
              sampling_logprobs: Optional[Tensor] = None,
              options: GRPOOptions) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The GRPO family on ``[B, T, V]`` logits aligned with ``target [B, T]`` (TRL's
    ``GRPOTrainer._compute_loss``). A loss type is its record (``options/grpo.py``): a policy
    term and a token weight. With ``w`` the token log-ratio ``logp - old`` (or its masked mean
    per sequence, GSPO) and ``r = exp(w)``, each token's policy term is:

    * ``clipped`` (grpo, bnpo, dr_grpo, dapo, luspo): ``-min(r_u A, clip(r) A)``;
    * ``cispo`` (cispo): ``-min(r, clip_eps_high).detach() * A * logp``;
    * ``sapo`` (sapo, sapo_token_mean): ``-sigmoid(tau (r - 1)) * 4 / tau * A``,
      ``tau = sapo_tau_pos if A > 0 else sapo_tau_neg``;
    * ``vespo`` (vespo): ``-phi * A * logp``, ``phi = exp(lam + k log W - lam W)`` detached,
      ``W`` the sequence's product of token ratios (and importance weights), ``k, lam`` by
      ``A >= 0``.

    With ``rollout_is`` or ``rollout_rs`` the rollout correction (:func:`rollout_correction`)
    replaces ``importance_weights`` by its weights and drops its rejected tokens from ``mask``
    first. The term is multiplied by ``importance_weights`` (not for vespo), zeroed by the
    off-policy and top-entropy masks, then ``beta * k3`` (``* r`` with ``kl_ratio_correction``)
    is added. The token weight aggregates the terms:

    * ``sequence_mean`` (grpo, sapo): mean per sequence, then over sequences;
    * ``token_mean`` (bnpo): mean over the batch's tokens;
    * ``max_length`` (dr_grpo): sum / (B * max_completion_length, or T);
    * ``global_count`` (dapo, cispo, vespo, sapo_token_mean): sum / normalizer (default the
      token count);
    * ``sequence_sum`` (luspo): sum / B.

    ``entropy_coef`` subtracts ``entropy_coef`` times the mean entropy over the entropy-kept
    tokens (for ``global_count``: their entropy sum / normalizer).

    Masked tokens are selected away before any arithmetic: their logits, targets, advantages
    and old/reference log-probs may hold anything (inf, NaN, out-of-range ids).

    The scalar options are ``GRPOOptions``' fields, taken as keywords (the first eight also by
    position, after ``ref_logprobs``) or at once as ``options=``, as ``ak.grpo_loss`` takes
    them; the signature lists them from the dataclass (``options/keywords.spread_options``).
    """
    return _grpo_loss(logits, target, advantages, mask, old_logprobs, ref_logprobs, normalizer,
                      importance_weights, sampling_logprobs, options)


def _grpo_loss(logits, target, advantages, mask, old_logprobs, ref_logprobs, normalizer,
               importance_weights, sampling_logprobs, options: GRPOOptions):
    o = options
    beta, clip_eps_low, clip_eps_high, delta = o.beta, o.clip_eps_low, o.clip_eps_high, o.delta
    loss_type, importance_sampling, temperature = (o.loss_type, o.importance_sampling,
                                                   o.temperature)
    max_completion_length = o.max_completion_length
    if loss_type not in LOSS_TYPE_RECORDS:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    policy, token_weight = o.record.policy, o.record.token_weight
    batch, length = target.shape
    dtype = logits.dtype
    valid = (torch.ones_like(target, dtype=torch.bool) if mask is None else mask != 0)
    mask = valid.to(dtype)

    def select(values: Tensor) -> Tensor:
        return torch.where(valid, values.to(dtype), 0.0)

    logp, entropy = token_logprobs(logits, torch.where(valid, target, -100), temperature, -100)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(batch, length)
    advantages = select(advantages)
    old = logp.detach() if old_logprobs is None else select(old_logprobs)
    ref = None if ref_logprobs is None else select(ref_logprobs)
    correction_metrics = {}
    if o.rollout_is is not None or o.rollout_rs is not None:
        weights, valid, correction_metrics = rollout_correction(
            old, select(sampling_logprobs), valid, o)
        mask = valid.to(dtype)
        if weights is not None:
            importance_weights = weights
    lengths = mask.sum(-1).clamp(min=1.0)
    token_log_ratio = ((logp - old) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if importance_sampling == "sequence":
        seq_log_ratio = ((logp - old) * mask).sum(-1, keepdim=True) / lengths.unsqueeze(1)
        # GSPO: one ratio per sequence; old absorbs everything but the per-sequence log-ratio.
        old = logp - seq_log_ratio.expand(batch, length)
    loss, ratio, k3 = grpo_token_loss(logp, old, ref, advantages, clip_eps_low, clip_eps_high,
                                      delta, 0.0)
    if policy == "cispo":
        loss = -ratio.clamp(max=clip_eps_high).detach() * advantages * logp
    elif policy == "sapo":
        tau = torch.where(advantages > 0, o.sapo_tau_pos, o.sapo_tau_neg).to(dtype)
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
    elif policy == "vespo":
        log_floor = math.log(1e-8)
        log_w = token_log_ratio.detach().sum(-1, keepdim=True)
        if importance_weights is not None:
            log_is = torch.log(select(importance_weights)).clamp(log_floor, LOG_RATIO_CLAMP)
            log_w = log_w + torch.where(valid, log_is, 0.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(log_floor, LOG_RATIO_CLAMP)
        k = torch.where(advantages >= 0, o.vespo_k_pos, o.vespo_k_neg).to(dtype)
        lam = torch.where(advantages >= 0, o.vespo_lambda_pos, o.vespo_lambda_neg).to(dtype)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)
        loss = -phi * advantages * logp
    extra = {}
    keep = valid
    if o.off_policy_threshold is not None:
        # TRL's fallbacks: the old log-probs, then the current ones.
        if sampling_logprobs is not None:
            sampling = select(sampling_logprobs)
        elif old_logprobs is not None:
            sampling = select(old_logprobs)
        else:
            sampling = logp.detach()
        # TRL get_off_policy_mask: a NaN (unscored) sampling log-prob counts as no KL
        kl = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        gap = (kl * mask).sum(-1, keepdim=True) / lengths.unsqueeze(1)
        kept = (advantages >= 0) | (gap <= o.off_policy_threshold)
        keep = keep & kept
        extra["mask/off_policy"] = kept
    entropy_keep = valid
    if o.top_entropy_quantile < 1.0:
        if valid.any():
            kept = entropy.detach()[valid]  # quantile takes float32/float64 only
            kept = kept.to(torch.promote_types(kept.dtype, torch.float32))
            threshold = torch.quantile(kept, 1.0 - o.top_entropy_quantile)
            entropy_keep = valid & (entropy.detach() >= threshold)
        else:
            entropy_keep = torch.zeros_like(valid)
        keep = keep & entropy_keep
        extra["mask/entropy"] = entropy_keep
    if importance_weights is not None and policy != "vespo":
        loss = loss * select(importance_weights)
    loss = torch.where(keep, loss, 0.0)
    if o.kl_ratio_correction:
        k3 = k3 * ratio
    if beta > 0:
        loss = loss + beta * k3
    loss = torch.where(valid, loss, 0.0)
    global_count = mask.sum() if normalizer is None else normalizer
    global_count = torch.as_tensor(global_count, dtype=dtype, device=loss.device)
    if token_weight == "sequence_mean":
        total = (loss.sum(-1) / lengths).mean()
    elif token_weight == "token_mean":
        total = loss.sum() / mask.sum().clamp(min=1.0)
    elif token_weight == "max_length":
        total = loss.sum() / (batch * (max_completion_length or length))
    elif token_weight == "global_count":
        total = _divide_or_zero(loss.sum(), global_count)
    elif token_weight == "sequence_sum":
        total = loss.sum(-1).mean()
    else:
        raise ValueError(f"no formula for the token weight {token_weight!r}")
    if o.entropy_coef != 0.0:
        kept_entropy = torch.where(entropy_keep, entropy, 0.0).sum()
        if token_weight == "global_count":
            bonus = _divide_or_zero(kept_entropy, global_count)
        else:
            bonus = kept_entropy / entropy_keep.sum().clamp(min=1).to(dtype)
        total = total - o.entropy_coef * bonus
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    count = mask.sum().clamp(min=1.0)

    def masked_mean(x: Tensor) -> Tensor:
        return (torch.where(valid, x.to(dtype), 0.0).sum() / count).detach()

    metrics = {"kl": masked_mean(k3), "ratio/mean": masked_mean(ratio)}
    if policy == "clipped":
        low = (ratio < 1.0 - clip_eps_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_high) & (advantages > 0)
        metrics.update({"clip_ratio/low": masked_mean(low), "clip_ratio/high": masked_mean(high),
                        "clip_ratio/region": masked_mean(low | high)})
    elif policy == "cispo":
        metrics["clip_ratio/cispo"] = masked_mean((ratio > eps_high) & (advantages > 0))
    elif policy == "vespo":
        metrics["vespo/phi_mean"] = masked_mean(phi)
    metrics.update({key: masked_mean(kept) for key, kept in extra.items()})
    if o.entropy_coef != 0.0 or o.top_entropy_quantile < 1.0:
        metrics["entropy"] = masked_mean(entropy)
    metrics.update(correction_metrics)
    return total, metrics


def rollout_correction(old: Tensor, sampling: Tensor, valid: Tensor, options: GRPOOptions
                       ) -> Tuple[Optional[Tensor], Tensor, Dict[str, Tensor]]:
    """``(weights, kept, metrics)`` of the rollout correction, in ``old``'s dtype, with
    ``d = old - sampling`` on the unmasked tokens (0 elsewhere; NaN counts as 0, as TRL).

    ``rollout_is`` (TRL 1.16 ``GRPOTrainer._generate_and_score_completions``): ``rho = exp(d)``
    (``token_*``) or ``exp(sum_t d)`` (``sequence_*``); ``*_truncate`` clamps it to
    ``[rollout_is_min, rollout_is_max]``, ``*_mask`` zeroes it outside;
    ``rollout_is_batch_normalize`` divides by the masked mean (of the sequences' weights for
    ``sequence_*``) when above 1e-8 (verl ``compute_rollout_correction_weights``).
    ``rollout_rs`` (verl ``compute_rollout_rejection_mask``): with ``s = clamp(d, +-20)``,
    k1 = ``-s`` kept in ``[log lower, log upper]`` (lower = ``1/upper`` by default), k2 =
    ``s^2/2``, k3 = ``e^s - 1 - s`` kept ``<= upper``; per token or the sequence's sum, mean or
    max. verl's masked means divide by ``count + 1e-8``. Metrics: TRL's ``sampling/*``,
    verl's ``rollout_corr/*``; all 0 when no token is unmasked. A token whose ``old -
    sampling`` is infinite enters the weights and the rejection as TRL's ``nan_to_num`` makes
    it (float's largest value), but is left out of the mismatch metrics (verl's
    ``compute_offpolicy_metrics``, TRL's ``sampling_logp_difference``) and counted in
    ``rollout_corr/infinite_log_ratio_count`` and ``sampling/sampling_logp_difference/
    non_finite_count`` (the latter with the NaN ones TRL leaves out).
    """
    o = options
    dtype = old.dtype
    m = valid.to(dtype)

    def masked_mean(x: Tensor, dim=None) -> Tensor:
        return torch.where(valid, x, 0.0).sum(dim) / (m.sum(dim) + 1e-8)

    def stats(x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if x.numel() == 0:
            return (torch.zeros((), dtype=dtype),) * 3
        return x.min(), x.mean(), x.max()

    d = torch.where(valid, torch.nan_to_num(old - sampling, nan=0.0), 0.0)
    d_seq = d.sum(-1, keepdim=True)
    finite = valid & ~torch.isinf(old - sampling)
    f = finite.to(dtype)

    def finite_mean(x: Tensor) -> Tensor:
        return torch.where(finite, x, 0.0).sum() / (f.sum() + 1e-8)

    d_finite = torch.where(finite, d, 0.0)
    d_finite_seq = d_finite.sum(-1)
    metrics = {
        "rollout_corr/kl": finite_mean(-d),
        "rollout_corr/k3_kl": finite_mean(torch.exp(d_finite) - d_finite - 1),
        "rollout_corr/log_ppl_diff": (-d_finite_seq / (f.sum(-1) + 1e-8)).mean(),
        "rollout_corr/chi2_token": finite_mean(torch.exp(d.clamp(-20, 20)) ** 2) - 1,
        "rollout_corr/chi2_seq": torch.exp(2 * d_finite_seq.clamp(-20, 20)).mean() - 1,
        "rollout_corr/infinite_log_ratio_count": (valid & ~finite).sum().to(dtype),
    }
    weights = None
    if o.rollout_is is not None:
        token_level = o.rollout_is.startswith("token")
        rho = torch.exp(d) if token_level else torch.exp(d_seq).expand_as(d)
        if o.rollout_is.endswith("truncate"):
            rho = torch.clamp(rho, min=o.rollout_is_min, max=o.rollout_is_max)
        else:
            low = -math.inf if o.rollout_is_min is None else o.rollout_is_min
            high = math.inf if o.rollout_is_max is None else o.rollout_is_max
            rho = rho.masked_fill((rho < low) | (rho > high), 0.0)
        delta = (old - sampling).abs()
        unscored = (valid & ~torch.isfinite(delta)).sum().to(dtype)
        delta = delta[valid & torch.isfinite(delta)]
        low_ratio, mean_ratio, high_ratio = stats(rho[valid] if token_level else rho[:, 0])
        metrics.update({
            "sampling/sampling_logp_difference/mean": stats(delta)[1],
            "sampling/sampling_logp_difference/max": stats(delta)[2],
            "sampling/sampling_logp_difference/non_finite_count": unscored,
            "sampling/importance_sampling_ratio/min": low_ratio,
            "sampling/importance_sampling_ratio/mean": mean_ratio,
            "sampling/importance_sampling_ratio/max": high_ratio,
        })
        clamped = rho.clamp(min=0.0, max=o.rollout_is_max)
        variance = masked_mean(clamped ** 2) - masked_mean(clamped) ** 2
        metrics.update({
            "rollout_corr/rollout_is_mean": masked_mean(rho),
            "rollout_corr/rollout_is_max": (stats(rho[valid])[2] if token_level
                                            else torch.exp(d_seq.max().clamp(max=20))),
            "rollout_corr/rollout_is_min": (stats(rho[valid])[0] if token_level
                                            else torch.exp(d_seq.min())),
            "rollout_corr/rollout_is_std": (variance.clamp(min=0).sqrt() if m.sum() > 1
                                            else torch.zeros((), dtype=dtype)),
            "rollout_corr/rollout_is_eff_sample_size": 1 / masked_mean(
                (clamped / (masked_mean(clamped) + 1e-8)) ** 2),
        })
        if o.rollout_is_batch_normalize:
            if token_level:
                mean = masked_mean(rho)
            else:
                has_tokens = (m.sum(-1) > 0).to(dtype)
                mean = ((masked_mean(rho, -1) * has_tokens).sum()
                        / has_tokens.sum().clamp(min=1e-8))
            factor = mean if mean > 1e-8 else torch.ones((), dtype=dtype)
            rho = rho / factor
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
        weights = rho
    kept = valid
    if o.rollout_rs is not None:
        s = d.clamp(-20, 20)
        statistic = {"k1": -s, "k2": s ** 2 / 2, "k3": torch.exp(s) - 1 - s}[o.rollout_rs[-2:]]
        if o.rollout_rs.startswith("seq_sum"):
            statistic = torch.where(valid, statistic, 0.0).sum(-1, keepdim=True)
        elif o.rollout_rs.startswith("seq_mean"):
            statistic = masked_mean(statistic, -1).unsqueeze(-1)
        elif o.rollout_rs.startswith("seq_max"):
            largest = torch.where(valid, statistic, -math.inf).max(-1).values
            statistic = torch.where(valid.any(-1), largest, 0.0).unsqueeze(-1)
        upper = o.rollout_rs_threshold
        if o.rollout_rs.endswith("k1"):
            lower = (1 / upper if o.rollout_rs_threshold_lower is None
                     else o.rollout_rs_threshold_lower)
            keep = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
        else:
            keep = statistic <= upper
        kept = valid & keep
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(
            (valid & ~kept).to(dtype))
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (
            (valid & ~kept).any(-1).to(dtype).mean())
    if not valid.any():
        metrics = {key: torch.zeros((), dtype=dtype) for key in metrics}
    return weights, kept, {key: value.detach() for key, value in metrics.items()}


def _cdpo(logits: Tensor, label_smoothing: float) -> Tensor:
    return (-(1 - label_smoothing) * F.logsigmoid(logits)
            - label_smoothing * F.logsigmoid(-logits))


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Optional[Tensor] = None,
             ref_rejected: Optional[Tensor] = None, beta: float = 0.1,
             loss_type: Union[str, Sequence[str]] = "sigmoid", label_smoothing: float = 0.0,
             loss_weights: Optional[Sequence[float]] = None, discopop_tau: float = 0.05,
             bco_delta: float = 0.0, chosen_lengths: Optional[Tensor] = None,
             rejected_lengths: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """TRL's DPO loss types on summed sequence log-probs ``[B]``; a list of types is summed
    with ``loss_weights`` (MPO). No reference means reference-free (reference log-ratios 0)."""
    ref_c = torch.zeros_like(policy_chosen) if ref_chosen is None else ref_chosen
    ref_r = torch.zeros_like(policy_rejected) if ref_rejected is None else ref_rejected
    chosen_reward = policy_chosen - ref_c
    rejected_reward = policy_rejected - ref_r
    margin = chosen_reward - rejected_reward
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    eps = label_smoothing
    total = 0.0
    for name, weight in zip(types, weights):
        if name == "sigmoid":
            losses = _cdpo(beta * margin, eps)
        elif name == "ipo":
            losses = (margin - 1.0 / (2.0 * beta)) ** 2
        elif name == "hinge":
            losses = torch.relu(1.0 - beta * margin)
        elif name == "robust":
            losses = ((-(1 - eps) * F.logsigmoid(beta * margin)
                       + eps * F.logsigmoid(-beta * margin)) / (1.0 - 2.0 * eps))
        elif name == "exo_pair":
            qw, ql = torch.sigmoid(beta * margin), torch.sigmoid(-beta * margin)
            losses = (qw * (F.logsigmoid(beta * margin) - math.log1p(-eps))
                      + ql * (F.logsigmoid(-beta * margin) - math.log(eps)))
        elif name == "nca_pair":
            losses = (-F.logsigmoid(beta * chosen_reward)
                      - 0.5 * F.logsigmoid(-beta * chosen_reward)
                      - 0.5 * F.logsigmoid(-beta * rejected_reward))
        elif name == "bco_pair":
            losses = (-F.logsigmoid(beta * chosen_reward - bco_delta)
                      - F.logsigmoid(-(beta * rejected_reward - bco_delta)))
        elif name == "sppo_hard":
            losses = (chosen_reward - 0.5 / beta) ** 2 + (rejected_reward + 0.5 / beta) ** 2
        elif name == "aot":
            delta = (torch.sort(policy_chosen - policy_rejected).values
                     - torch.sort(ref_c - ref_r).values)
            losses = _cdpo(beta * delta, eps)
        elif name == "aot_unpaired":
            delta = torch.sort(chosen_reward).values - torch.sort(rejected_reward).values
            losses = _cdpo(beta * delta, eps)
        elif name == "apo_zero":
            losses = 1 - torch.sigmoid(beta * chosen_reward) + torch.sigmoid(beta * rejected_reward)
        elif name == "apo_down":
            losses = torch.sigmoid(beta * chosen_reward) + 1 - torch.sigmoid(beta * margin)
        elif name == "discopop":
            logits = beta * margin
            modulation = torch.sigmoid(logits / discopop_tau)
            losses = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        elif name == "sigmoid_norm":
            losses = -F.logsigmoid(beta * (chosen_reward / chosen_lengths.clamp(min=1)
                                           - rejected_reward / rejected_lengths.clamp(min=1)))
        else:
            raise ValueError(f"unknown loss_type {name!r}")
        total = total + weight * losses.mean()
    metrics = {
        "rewards/chosen": (beta * chosen_reward).mean().detach(),
        "rewards/rejected": (beta * rejected_reward).mean().detach(),
        "rewards/accuracy": (chosen_reward > rejected_reward).to(margin.dtype).mean().detach(),
        "rewards/margin": (beta * margin).mean().detach(),
    }
    return total, metrics


def orpo_loss(chosen: Tensor, rejected: Tensor, beta: float = 0.1) -> Tensor:
    """ORPO's odds-ratio term on averaged log-probs, clamped at ``log(1 - 2**-24)``."""
    top = math.log1p(-2.0 ** -24)
    c, r = chosen.clamp(max=top), rejected.clamp(max=top)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    return -beta * F.logsigmoid(log_odds).mean()


def simpo_loss(chosen: Tensor, rejected: Tensor, beta: float = 2.0, gamma: float = 0.5,
               label_smoothing: float = 0.0) -> Tensor:
    """SimPO on averaged log-probs: cDPO on ``beta * (c - r) - gamma``."""
    return _cdpo(beta * (chosen - rejected) - gamma, label_smoothing).mean()


def cpo_loss(chosen: Tensor, rejected: Tensor, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid", simpo_gamma: float = 0.5,
             alpha: float = 0.0) -> Tensor:
    """TRL's CPO preference term; ``alpha != 0`` maps log-probs to AlphaPO rewards first."""
    if alpha != 0.0:
        chosen = (1 - torch.exp(chosen).pow(-alpha)) / alpha
        rejected = (1 - torch.exp(rejected).pow(-alpha)) / alpha
    logits = chosen - rejected
    if loss_type == "sigmoid":
        losses = _cdpo(beta * logits, label_smoothing)
    elif loss_type == "simpo":
        losses = _cdpo(beta * (logits - simpo_gamma / beta), label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    return losses.mean()


def kto_loss(policy_logps: Tensor, ref_logps: Optional[Tensor], labels: Tensor,
             kl: float = 0.0, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, loss_type: str = "kto") -> Tensor:
    """TRL's unpaired KTO / APO-zero: weighted per-completion losses, mean over the batch."""
    x = policy_logps - (0.0 if ref_logps is None else ref_logps)
    z = max(float(kl), 0.0) if loss_type == "kto" else 0.0
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (x - z)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z - x)))
    return torch.where(labels, desirable, undesirable).mean()


def group_advantages(rewards: Tensor, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """Each reward of ``rewards [B, G]`` minus its group's mean, divided by ``sigma + eps``:
    ``sigma`` the root of the mean squared deviation from the mean (the population std) of its
    group (``scale="group"``) or of all ``B * G`` rewards (``"batch"``); ``"none"`` does not
    divide. A group whose largest and smallest rewards are equal (a group of one included)
    gives 0. Call it with float64 rewards: the op computes in float32."""
    def mean(x: Tensor, dims) -> Tensor:
        count = math.prod(x.shape[d] for d in dims)
        return x.sum(dim=dims, keepdim=True) / count

    deviation = rewards - mean(rewards, (-1,))
    tied = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    if scale == "none":
        return torch.where(tied, 0.0, deviation)
    if scale == "group":
        sigma = mean(deviation ** 2, (-1,)).sqrt()
    else:
        sigma = mean((rewards - mean(rewards, (0, 1))) ** 2, (0, 1)).sqrt()
    return torch.where(tied, 0.0, deviation / (sigma + eps))


def _kl_terms(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``p * (log p - log q)`` per element (``F.kl_div(log_q, log_p, log_target=True)``), 0
    where ``p = 0``: the convention 0 log 0 = 0 (kl_div itself gives NaN for ``log p = -inf``).
    The difference is selected too, so those elements get a zero gradient, not ``0 * inf``."""
    p = log_p.exp()
    diff = torch.where(p == 0, 0.0, log_p - log_q)
    return torch.where(p == 0, 0.0, p * diff)


def distill_loss(student: Tensor, teacher: Tensor, target: Optional[Tensor] = None,
                 beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "batchmean", normalizer: Union[None, float, Tensor] = None,
                 hard_weight: float = 0.0) -> Tensor:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` over ``[..., V]`` logits, plus an optional
    hard-label term ``hard_weight * cross_entropy(student, target)`` (at temperature 1).

    ``a = log_softmax(student / T)``, ``b = log_softmax(teacher / T)``; per row,
    ``beta = 0``: KL(teacher || student) = ``sum p_t (b - a)``; ``beta = 1``: KL(student ||
    teacher); else, with ``m = log((1 - beta) p_s + beta p_t)``,
    ``beta * sum p_t (b - m) + (1 - beta) * sum p_s (a - m)``. Rows whose target is
    ``ignore_index`` do not count. ``batchmean``: sum over counted rows / their number (at least
    1); ``sum``; ``mean``: sum / (counted rows * V), 0 with none; ``none``: per-row losses
    ``[...]`` (0 on ignored rows). Without ``target``, ``batchmean`` divides by the first dim
    (TRL's ``jsd.size(0)``: B of ``[B, T, V]``; 1 for a single ``[V]`` row). ``normalizer``
    (``batchmean``/``mean``): sum / normalizer, 0 when it is 0. The teacher is computed in the
    student's dtype. -inf logits are ids with probability 0 (``0 log 0 = 0``; their terms have
    a zero gradient): finite for ``0 < beta < 1``, +inf at ``beta = 0`` where the student
    excludes an id the teacher keeps, at ``beta = 1`` where the teacher excludes one the
    student keeps."""
    vocab = student.shape[-1]
    s = student.reshape(-1, vocab)
    t = teacher.reshape(-1, vocab).to(s.dtype)
    if target is None:
        valid = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
        y = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
    else:
        valid = target.reshape(-1) != ignore_index
        y = torch.where(valid, target.reshape(-1), 0).long()
    s = torch.where(valid.unsqueeze(-1), s, 0.0)
    t = torch.where(valid.unsqueeze(-1), t, 0.0)
    a = torch.log_softmax(s / temperature, dim=-1)
    b = torch.log_softmax(t / temperature, dim=-1)
    if beta == 0:
        elements = _kl_terms(b, a)
    elif beta == 1:
        elements = _kl_terms(a, b)
    else:
        beta_t = torch.tensor(beta, dtype=a.dtype, device=a.device)
        parts = torch.stack([a + torch.log1p(-beta_t), b + torch.log(beta_t)])
        # an id -inf on both sides has m = -inf (its terms are 0); logsumexp's gradient there
        # would be NaN, so it sees zeros instead
        neither = (parts == -math.inf).all(0)
        m = torch.where(neither, -math.inf, torch.logsumexp(torch.where(neither, 0.0, parts), 0))
        elements = beta * _kl_terms(b, m) + (1 - beta) * _kl_terms(a, m)
    rows = elements.sum(-1)
    if hard_weight:
        rows = rows + hard_weight * F.cross_entropy(s, y, reduction="none")
    rows = torch.where(valid, rows, 0.0)
    if reduction == "none":
        return rows.reshape(student.shape[:-1])
    total = rows.sum()
    if reduction == "sum":
        return total
    if normalizer is not None:
        count = normalizer
    elif reduction == "batchmean" and target is None:
        count = student.shape[0] if student.dim() > 1 else 1
    elif reduction == "batchmean":
        count = valid.sum().clamp(min=1)
    else:
        count = valid.sum() * vocab
    return _divide_or_zero(total, torch.as_tensor(count, dtype=total.dtype, device=total.device))


TOPK_TAIL_LOG_SUM_MAX = -1e-7  # TRL's clamp of log(sum p) over the support: the tail keeps >= 1e-7


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate in value and gradient on both sides of
    ``-log 2``: ``log(-expm1(x))`` alone (TRL's) has the gradient ``exp(x)`` formed as
    ``expm1(x) + 1``, 0 in float32 below ``x ~ -17``."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _with_tail_bucket(log_probs: Tensor) -> Tensor:
    """TRL's ``_add_tail_bucket``: ``[..., K]`` log-probs and ``log(1 - sum exp)`` after them."""
    log_sum = torch.logsumexp(log_probs, -1, keepdim=True).clamp(max=TOPK_TAIL_LOG_SUM_MAX)
    return torch.cat([log_probs, _log1mexp(log_sum)], -1)


def _verl_forward_kl_topk_rows(log_q: Tensor, log_p: Tensor, live: Tensor,
                               log_prob_min_clamp: Optional[float],
                               loss_max_clamp: Optional[float]) -> Tensor:
    """verl's ``forward_kl_topk`` per row, as verl writes it (``fsdp/losses.py``
    ``compute_forward_kl_topk`` and ``kl_divergence``, ``losses.py`` ``compute_forward_kl_topk``
    and ``distillation_loss``): student ``log_q`` and teacher ``log_p`` at the support, both
    ``clamp_min(log_prob_min_clamp)``; ``sum(exp(log_p) * (log_p - log_q))`` over the live
    entries; ``clamp_min(0)``; ``clamp(-loss_max_clamp, loss_max_clamp)``."""
    if log_prob_min_clamp is not None:
        log_q = log_q.clamp_min(log_prob_min_clamp)
        log_p = log_p.clamp_min(log_prob_min_clamp)
    p = log_p.exp()
    kld = torch.where(live, p * (log_p - log_q), 0.0).sum(-1)
    kld = kld.clamp_min(0.0)
    if loss_max_clamp is not None:
        kld = kld.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return kld


def _axolotl_kd_topk_rows(student_logprobs: Tensor, teacher_logprobs: Tensor, live: Tensor,
                          beta: float, normalize_topk: bool, temperature: float) -> Tensor:
    """Axolotl's KD top-k loss per row, as ``kernels/liger.py``'s ``distillation_loss_fn``
    writes it (summed per row instead of over the chunk), times ``T**2`` (its ``forward``):
    with ``normalize_topk`` the student's log-probs go through ``utils.normalize_logprobs``
    (``exp(x - logsumexp x)``, divided by its sum, log) over the live entries."""
    neg_inf = torch.full((), -math.inf, dtype=student_logprobs.dtype,
                         device=student_logprobs.device)
    s = torch.where(live, student_logprobs, neg_inf)
    if normalize_topk:
        s = torch.where(live.any(-1, keepdim=True), s, 0.0)  # no live entry: no NaN gradient
        probs = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        s = torch.log(torch.where(live, probs, 1.0))  # log(0) off the support: a NaN gradient
    s = torch.where(live, s, 0.0)
    t = torch.where(live, teacher_logprobs, 0.0)
    teacher_probs, student_probs = t.exp(), s.exp()
    if beta == 0.0:
        elements = teacher_probs * (t - s)
    elif beta == 1.0:
        elements = student_probs * (s - t)
    else:
        log_mean_probs = ((1 - beta) * student_probs + beta * teacher_probs).log()
        student_kl = student_probs * (s - log_mean_probs)  # F.kl_div(log_m, s, log_target)
        teacher_kl = teacher_probs * (t - log_mean_probs)
        elements = beta * teacher_kl + (1 - beta) * student_kl
    return torch.where(live, elements, 0.0).sum(-1) * temperature ** 2


TOPK_OBJECTIVES = ("trl_jsd", "verl_forward_kl", "axolotl_kd")


def _with_nan_rows(rows: Tensor, nan_rows: Tensor) -> Tensor:
    """``rows`` times NaN where ``nan_rows``, times 1 elsewhere (a ``where`` of ``rows * nan``
    would send ``0 * nan`` into the other rows' gradients)."""
    return rows * torch.where(nan_rows, math.nan, 1.0).to(rows.dtype)


def topk_distill_loss(student: Tensor, support_ids: Tensor, teacher_logprobs: Tensor,
                      labels: Optional[Tensor] = None, beta: float = 0.0,
                      temperature: float = 1.0, tail: bool = True,
                      support_mask: Optional[Tensor] = None,
                      reduction: str = "batchmean", *, objective: str = "trl_jsd",
                      normalize_topk: bool = False,
                      log_prob_min_clamp: Optional[float] = -10.0,
                      loss_max_clamp: Optional[float] = 10.0) -> Tensor:
    """The loss over a teacher's top-k support of TRL's ``ServerDistillationTrainer``
    (``objective="trl_jsd"``), verl's ``forward_kl_topk`` (``"verl_forward_kl"``: ``tail``
    and ``beta`` unused, :func:`_verl_forward_kl_topk_rows`) or Axolotl's KD plugin
    (``"axolotl_kd"``: ``tail`` unused, :func:`_axolotl_kd_topk_rows`). The student's
    log-probs are ``log_softmax(student / T)`` at ``support_ids`` for all three. verl's live
    entries include the teacher's -inf ones when it clamps (they count at the clamp).

    ``a_k = log_softmax(student / T)`` at ``support_ids``, ``b_k = teacher_logprobs``; an entry
    is live where ``support_mask`` (all True when None) holds and ``b_k != -inf``. A live ``b_k``
    that is NaN makes its row's loss NaN (times NaN: its gradient NaN too), whatever the
    objective's ``nan_to_num`` would have made of it. ``tail``: both
    get a (K+1)-th bucket ``log(1 - sum_live exp)`` (``log(sum)`` clamped at -1e-7); else both
    are renormalised over the live entries. Then TRL's masked ``_jsd_divergence`` per entry:
    ``beta = 0``: ``q (b - a)``; ``beta = 1``: ``p (a - b)``; else, with ``m = log(max((1 -
    beta) p + beta q, tiny))``, ``beta q (b - m) + (1 - beta) p (a - m)`` (NaN terms as 0),
    summed per row. Rows whose label is -100 do not count. ``batchmean``: sum / counted rows (at
    least 1; without labels, the first dim, 1 for a single row); ``sum``; ``none``: per-row
    losses ``[...]``, 0 on rows not counted."""
    vocab, k = student.shape[-1], support_ids.shape[-1]
    s = student.reshape(-1, vocab)
    teacher = teacher_logprobs.reshape(-1, k).to(s.dtype)
    counted = (torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if labels is None
               else labels.reshape(-1) != -100)
    if objective not in TOPK_OBJECTIVES:
        raise ValueError(f"objective must be one of {TOPK_OBJECTIVES}, got {objective!r}")
    clamped = objective == "verl_forward_kl" and log_prob_min_clamp is not None
    live = ((teacher != -math.inf) | clamped) & counted.unsqueeze(-1)
    if support_mask is not None:
        live = live & support_mask.reshape(-1, k)
    nan_rows = (live & teacher.isnan()).any(-1)
    ids = torch.where(live, support_ids.reshape(-1, k), 0).long()
    s = torch.where(counted.unsqueeze(-1), s, 0.0)
    a = torch.where(live, torch.log_softmax(s / temperature, -1).gather(-1, ids), -math.inf)
    b = torch.where(live, teacher, -math.inf)
    if objective == "verl_forward_kl":
        rows = _verl_forward_kl_topk_rows(torch.where(live, a, 0.0), torch.where(live, b, 0.0),
                                          live, log_prob_min_clamp, loss_max_clamp)
        rows = torch.where(counted, rows, 0.0)
        return _reduce_topk_rows(_with_nan_rows(rows, nan_rows), counted, labels,
                                 student, reduction)
    if objective == "axolotl_kd":
        rows = _axolotl_kd_topk_rows(a, teacher, live, beta, normalize_topk, temperature)
        rows = torch.where(counted, rows, 0.0)
        return _reduce_topk_rows(_with_nan_rows(rows, nan_rows), counted, labels,
                                 student, reduction)
    if tail:
        a, b = _with_tail_bucket(a), _with_tail_bucket(b)
        live = torch.cat([live, torch.ones_like(live[:, :1])], -1)
    else:
        a = a - torch.logsumexp(a, -1, keepdim=True)
        b = b - torch.logsumexp(b, -1, keepdim=True)
    p = torch.where(live, a.exp(), 0.0)
    q = torch.where(live, b.exp(), 0.0)
    a, b = torch.where(live, a, 0.0), torch.where(live, b, 0.0)
    if beta == 0:
        elements = (q * (b - a)).nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
    elif beta == 1:
        elements = (p * (a - b)).nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
    else:
        tiny = torch.finfo(p.dtype).tiny
        m = torch.where(live, torch.log(((1 - beta) * p + beta * q).clamp_min(tiny)), 0.0)
        elements = (beta * (q * (b - m)).nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
                    + (1 - beta) * (p * (a - m)).nan_to_num(nan=0.0, posinf=math.inf,
                                                            neginf=-math.inf))
    rows = torch.where(counted, elements.sum(-1), 0.0)
    return _reduce_topk_rows(_with_nan_rows(rows, nan_rows), counted, labels,
                             student, reduction)


def _reduce_topk_rows(rows: Tensor, counted: Tensor, labels: Optional[Tensor], student: Tensor,
                      reduction: str) -> Tensor:
    if reduction == "none":
        return rows.reshape(student.shape[:-1])
    total = rows.sum()
    if reduction == "sum":
        return total
    if labels is not None:
        count = counted.sum().clamp(min=1)
    else:
        count = max(student.shape[0], 1) if student.dim() > 1 else 1
    return total / count
