"""The original strategy module's loss math (the "seed"), once: the baseline the fused ops replace.

The seed computed every loss from a float32 copy of the logits: ``log_softmax(logits.float())``
then ``gather`` for token log-probs (an fp32 ``[..., V]`` tensor in the forward and another in
the backward), ``F.cross_entropy(logits.float(), y)`` for next-token losses, and plain-torch
GRPO and DPO on top of those log-probs. The strategies' ``loss_backend="reference"`` (their
parity mode) and the benchmark's ``naive``/``compile`` baselines both run these functions, and
nothing else does, so the comparison in the benchmark is against exactly what the strategies'
parity tests check.

Kept from the seed: the materializing math and its costs. Two fixes are applied, because the
seed's versions give wrong training signals (the strategies' docs list them):

* the KL penalty is Schulman's k3 ``exp(d) - d - 1`` of the log-ratio ``d = ref - logp`` (the seed
  took ``r - log(r + 1e-8) - 1`` of ``r = exp(d)``, which saturates once the policy is 18.4 nats
  above the reference; the cost is the same: one ``exp``, one ``log`` fewer);
* a cross-entropy mean over no counted target is 0 with a zero gradient (``F.cross_entropy``'s
  mean is ``0 / 0``), without a host sync.

This module is not the spec (``reference.py`` is): it has no temperature, no clamp of the
log-ratios, and masks and rows are those of the seed.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def log_softmax_gather(logits: Tensor, target: Tensor) -> Tensor:
    """``log_softmax(logits.float())`` then ``gather`` at ``target``, float32 ``[...]``.

    Every target must be a valid id (the seed had no ``ignore_index`` here: callers mask after).
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = IGNORE_INDEX,
                  label_smoothing: float = 0.0) -> Tensor:
    """``F.cross_entropy(logits.float(), target)`` over the flattened rows, mean over the rows
    whose target is not ``ignore_index``; 0 with a zero gradient when there are none."""
    flat_target = target.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_target,
                            ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)
    return total / (flat_target != ignore_index).sum().clamp(min=1)


def group_advantages(rewards: Tensor, eps: float = 1e-8) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` per row of ``rewards [B, G]`` (population std), float32.

    The seed's formula, without the op's rule for tied groups: ``ak.group_advantages`` gives them
    exactly 0, here their centred values (rounding noise, not always 0) are divided by
    ``std + eps``."""
    rewards = rewards.float()
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def grpo_loss(logp: Tensor, old_logp: Optional[Tensor], ref_logp: Optional[Tensor],
              advantages: Tensor, mask: Tensor, clip_eps: float = 0.2,
              kl_coef: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The seed's GRPO loss on token log-probs: ``(policy_loss + kl_coef * kl, metrics)``.

    ``logp`` (with grad), ``old_logp`` (``None``: on-policy, ``logp`` detached) and ``ref_logp``
    (``None``: no KL term) share one shape; ``advantages`` broadcasts to it (``[B, 1]`` for one
    per sequence); ``mask`` (float, 1 on response tokens) too. Token-level ratio
    ``exp(logp - old)``, PPO clip ``[1 - clip_eps, 1 + clip_eps]``, k3 KL to the reference, both
    averaged over all unmasked tokens of the batch. Metrics (detached): ``policy_loss``,
    ``kl_loss``, ``kl``, ``ratio/mean``, ``clip_ratio/low``, ``clip_ratio/high``,
    ``clip_ratio/region``.
    """
    valid = mask != 0
    if old_logp is None:
        old_logp = logp.detach()
    ratio = torch.exp(logp - old_logp)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    per_token_policy_loss = -torch.min(surr1, surr2)
    token_count = mask.sum().clamp(min=1.0)

    def masked_mean(x: Tensor) -> Tensor:
        return torch.where(valid, x.float(), 0.0).sum() / token_count

    policy_loss = masked_mean(per_token_policy_loss)
    if ref_logp is not None:
        log_ref_ratio = ref_logp - logp
        kl = masked_mean(torch.exp(log_ref_ratio) - log_ref_ratio - 1.0)
    else:
        kl = torch.zeros_like(policy_loss)
    kl_penalty = kl_coef * kl
    with torch.no_grad():
        low = (ratio < 1 - clip_eps) & (advantages < 0)
        high = (ratio > 1 + clip_eps) & (advantages > 0)
        metrics = {
            "policy_loss": policy_loss.detach(),
            "kl_loss": kl_penalty.detach(),
            "kl": kl.detach(),
            "ratio/mean": masked_mean(ratio),
            "clip_ratio/low": masked_mean(low),
            "clip_ratio/high": masked_mean(high),
            "clip_ratio/region": masked_mean(low | high),
        }
    return policy_loss + kl_penalty, metrics


def grpo_step(policy_logits: Tensor, old_logits: Tensor, ref_logits: Tensor, target: Tensor,
              advantages: Tensor, mask: Tensor, clip_eps: float = 0.2,
              kl_coef: float = 0.0) -> Tensor:
    """One seed GRPO loss from logits ``[B, T, V]``: three log-softmax-gathers (the old and
    reference ones without grad), zeroed at masked tokens as the seed did, then
    :func:`grpo_loss`. ``advantages [B]``, ``mask [B, T]``.
    Returns the scalar loss (a function of tensors only, for ``torch.compile``)."""
    valid = mask != 0

    def masked_logprobs(logits: Tensor) -> Tensor:
        return torch.where(valid, log_softmax_gather(logits, target), 0.0)

    logp = masked_logprobs(policy_logits)
    with torch.no_grad():
        old = masked_logprobs(old_logits)
        ref = masked_logprobs(ref_logits)
    loss, _ = grpo_loss(logp, old, ref, advantages.unsqueeze(-1), mask, clip_eps, kl_coef)
    return loss


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Optional[Tensor],
             ref_rejected: Optional[Tensor], beta: float = 0.1) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The seed's sigmoid DPO loss on sequence log-probs ``[B]`` (no reference: reference-free)
    and its metrics ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracy``,
    ``rewards/margin`` (rewards are ``beta * (log pi - log ref)``, batch means)."""
    chosen_reward = policy_chosen - (0.0 if ref_chosen is None else ref_chosen)
    rejected_reward = policy_rejected - (0.0 if ref_rejected is None else ref_rejected)
    ratio_diff = chosen_reward - rejected_reward
    loss = -F.logsigmoid(beta * ratio_diff).mean()
    with torch.no_grad():
        metrics = {
            "rewards/chosen": (beta * chosen_reward).mean(),
            "rewards/rejected": (beta * rejected_reward).mean(),
            "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "rewards/margin": (beta * ratio_diff).mean(),
        }
    return loss, metrics
