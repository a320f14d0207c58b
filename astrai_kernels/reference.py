"""The spec: one short, naive, materializing function per op.

Every backend is tested against these in float64 (call them with ``logits.double()``); with
``backend="reference"`` the public ops call them on ``logits.float()``, as the seed did.
Inputs are the public ops' inputs after validation; outputs keep the input's float dtype.
"""

import torch
import torch.nn.functional as F

LOG_RATIO_CLAMP = 20.0


def token_logprobs(logits, target, temperature=1.0, ignore_index=-100):
    """``(logp, entropy)`` of ``softmax(logits / T)`` at ``target``; ignored rows give 0."""
    valid = target != ignore_index
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    safe = torch.where(valid, target, 0).long().unsqueeze(-1)
    logp = logp_all.gather(-1, safe).squeeze(-1)
    p = logp_all.exp()
    # Terms with p = 0 (logits of -inf) contribute 0, not 0 * -inf, and no NaN gradient.
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    return logp * valid, entropy * valid


def sequence_logprobs(logits, target, mask, average=False, temperature=1.0):
    """Sum (or mean over ``mask``) of token log-probs per sequence, ``[B]``."""
    logp, _ = token_logprobs(logits, target, temperature, ignore_index=-100)
    mask = mask.to(logp.dtype)
    total = (logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, softcap=None, normalizer=None):
    """``F.cross_entropy`` on softcapped logits plus ``z_loss * lse**2`` per counted row."""
    z = logits.reshape(-1, logits.shape[-1])
    y = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = y != ignore_index
    rows = F.cross_entropy(z, y.long(), ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    rows = rows + z_loss * torch.logsumexp(z, dim=-1) ** 2 * valid
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    count = valid.sum().clamp(min=1) if normalizer is None else normalizer
    return rows.sum() / count


def grpo_token_loss(logp, old_logprobs, ref_logprobs, advantages, clip_eps_low=0.2,
                    clip_eps_high=None, delta=None, beta=0.0):
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


def grpo_loss(logits, target, advantages, mask=None, old_logprobs=None, ref_logprobs=None,
              beta=0.0, clip_eps_low=0.2, clip_eps_high=None, delta=None, loss_type="bnpo",
              importance_sampling="token", temperature=1.0, max_completion_length=None,
              normalizer=None):
    """GRPO/DAPO/Dr.GRPO/GSPO loss on ``[B, T, V]`` logits aligned with ``target [B, T]``."""
    batch, length = target.shape
    mask = torch.ones_like(target, dtype=logits.dtype) if mask is None else mask.to(logits.dtype)
    target = torch.where(mask > 0, target, -100)
    logp, _ = token_logprobs(logits, target, temperature, ignore_index=-100)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(batch, length)
    advantages = advantages.to(logits.dtype)
    old = logp.detach() if old_logprobs is None else old_logprobs.to(logits.dtype) * mask
    ref = None if ref_logprobs is None else ref_logprobs.to(logits.dtype) * mask
    lengths = mask.sum(-1).clamp(min=1.0)
    if importance_sampling == "sequence":
        seq_log_ratio = ((logp - old) * mask).sum(-1, keepdim=True) / lengths.unsqueeze(1)
        # GSPO: one ratio per sequence; old absorbs everything but the per-sequence log-ratio.
        old = logp - seq_log_ratio.expand(batch, length)
    loss, ratio, k3 = grpo_token_loss(logp, old, ref, advantages, clip_eps_low, clip_eps_high,
                                      delta, beta)
    loss = loss * mask
    if loss_type == "grpo":
        total = ((loss.sum(-1) / lengths)).mean()
    elif loss_type == "bnpo":
        total = loss.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        total = loss.sum() / (batch * (max_completion_length or length))
    elif loss_type == "dapo":
        total = loss.sum() / (mask.sum().clamp(min=1.0) if normalizer is None else normalizer)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    count = mask.sum().clamp(min=1.0)
    low = (ratio < 1.0 - clip_eps_low) & (advantages < 0)
    high = (ratio > 1.0 + eps_high) & (advantages > 0)

    def masked_mean(x):
        return ((x.to(logits.dtype) * mask).sum() / count).detach()

    metrics = {
        "kl": masked_mean(k3),
        "ratio/mean": masked_mean(ratio),
        "clip_ratio/low": masked_mean(low),
        "clip_ratio/high": masked_mean(high),
        "clip_ratio/region": masked_mean(low | high),
    }
    return total, metrics


def dpo_loss(policy_chosen, policy_rejected, ref_chosen=None, ref_rejected=None, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0):
    """DPO family on sequence log-probs ``[B]``; no reference means reference-free."""
    chosen_reward = policy_chosen - (0.0 if ref_chosen is None else ref_chosen)
    rejected_reward = policy_rejected - (0.0 if ref_rejected is None else ref_rejected)
    margin = chosen_reward - rejected_reward
    if loss_type == "sigmoid":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * margin)
                  - label_smoothing * F.logsigmoid(-beta * margin))
    elif loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * margin)
    elif loss_type == "robust":
        losses = ((-(1 - label_smoothing) * F.logsigmoid(beta * margin)
                   + label_smoothing * F.logsigmoid(-beta * margin))
                  / (1.0 - 2.0 * label_smoothing))
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    metrics = {
        "rewards/chosen": (beta * chosen_reward).mean().detach(),
        "rewards/rejected": (beta * rejected_reward).mean().detach(),
        "rewards/accuracy": (chosen_reward > rejected_reward).to(margin.dtype).mean().detach(),
        "rewards/margin": (beta * margin).mean().detach(),
    }
    return losses.mean(), metrics


def group_advantages(rewards, scale="group", eps=1e-6):
    """``(r - mean_g) / (std_g + eps)`` with the population std; a group of one gives 0."""
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    else:
        std = rewards.std(unbiased=False)
    return centred / (std + eps)
