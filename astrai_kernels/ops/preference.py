"""DPO-family losses on sequence log-probs, and group-relative advantages.

Both act on ``[B]`` / ``[B, G]`` tensors, so they are plain PyTorch; the heavy part of DPO,
``sequence_logprobs`` over chosen and rejected, runs on the fused log-prob primitive.
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import check_choice, check_in_range, check_positive

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
ADVANTAGE_SCALES = ("group", "batch", "none")


def _check_sequence_logprobs(tensor, name: str, like: Optional[Tensor] = None) -> None:
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        kind = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a floating tensor of sequence log-probs [B], got {kind}")
    if tensor.dim() != 1 or (like is not None and tensor.shape != like.shape):
        expected = "[B]" if like is None else str(list(like.shape))
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    if like is not None and tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but policy_chosen is on {like.device}")


def _dpo_losses(margin: Tensor, beta: float, loss_type: str, label_smoothing: float) -> Tensor:
    """Per-pair loss from the reward margin ``(pi_c - ref_c) - (pi_r - ref_r)``."""
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * margin)
    agree = F.logsigmoid(beta * margin)  # log P(chosen preferred)
    disagree = F.logsigmoid(-beta * margin)
    if loss_type == "sigmoid":  # cDPO with label_smoothing > 0
        return -(1.0 - label_smoothing) * agree - label_smoothing * disagree
    # robust DPO (Chowdhury et al., 2024): unbiased under label-flip noise of rate eps.
    return ((-(1.0 - label_smoothing) * agree + label_smoothing * disagree)
            / (1.0 - 2.0 * label_smoothing))


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Optional[Tensor] = None,
             ref_rejected: Optional[Tensor] = None, *, beta: float = 0.1,
             loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, metrics)``: DPO (cDPO with ``label_smoothing``), IPO, hinge or robust DPO.

    Inputs are sequence log-probs ``[B]`` on one device. Without ``ref_chosen``/``ref_rejected``
    the loss is reference-free (SimPO-style margins on the policy alone). Metrics (detached,
    float32 batch means): ``rewards/chosen`` and ``rewards/rejected`` (``beta * (log pi -
    log ref)``), ``rewards/accuracy``, ``rewards/margin``.
    """
    _check_sequence_logprobs(policy_chosen, "policy_chosen")
    _check_sequence_logprobs(policy_rejected, "policy_rejected", policy_chosen)
    if (ref_chosen is None) != (ref_rejected is None):
        raise ValueError("give both ref_chosen and ref_rejected, or neither (reference-free)")
    chosen_reward, rejected_reward = policy_chosen.float(), policy_rejected.float()
    if ref_chosen is not None:
        _check_sequence_logprobs(ref_chosen, "ref_chosen", policy_chosen)
        _check_sequence_logprobs(ref_rejected, "ref_rejected", policy_chosen)
        chosen_reward = chosen_reward - ref_chosen.detach().float()
        rejected_reward = rejected_reward - ref_rejected.detach().float()
    check_choice(loss_type, "loss_type", DPO_LOSS_TYPES)
    beta = check_positive(beta, "beta")
    high = 0.5 if loss_type == "robust" else 1.0
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, high)
    if loss_type == "robust" and label_smoothing == 0.5:
        raise ValueError("label_smoothing must be < 0.5 for loss_type='robust'")
    margin = chosen_reward - rejected_reward
    loss = _dpo_losses(margin, beta, loss_type, label_smoothing).mean()
    with torch.no_grad():
        metrics = {
            "rewards/chosen": beta * chosen_reward.mean(),
            "rewards/rejected": beta * rejected_reward.mean(),
            "rewards/accuracy": (chosen_reward > rejected_reward).float().mean(),
            "rewards/margin": beta * margin.mean(),
        }
    return loss, metrics


def group_advantages(rewards: Tensor, *, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` over each row's group (population std), float32.

    ``scale="batch"`` divides by the std of the whole batch, ``"none"`` only centres. A group
    whose rewards are all equal (a group of one included) gives exactly 0, whatever ``eps``
    (with ``eps=0`` it would be ``0 / 0``).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 2:
        raise ValueError(f"rewards must be a tensor of shape [B, G], got "
                         f"{getattr(rewards, 'shape', type(rewards).__name__)}")
    if rewards.is_complex() or rewards.dtype == torch.bool:
        raise TypeError(f"rewards must be a real tensor, got {rewards.dtype}")
    check_choice(scale, "scale", ADVANTAGE_SCALES)
    eps = check_in_range(eps, "eps", 0.0, float("inf"))
    if not math.isfinite(eps):
        raise ValueError(f"eps must be finite, got {eps}")
    rewards = rewards.float()
    # Tied groups are found exactly: their centred values may be rounding noise, not 0.
    tied = (rewards == rewards[:, :1]).all(dim=-1, keepdim=True)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale == "none":
        return torch.where(tied, 0.0, centred)
    if scale == "group":
        std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    else:
        std = rewards.std(unbiased=False)
    denominator = std + eps
    # A zero denominator outside tied groups needs eps = 0 and a std that underflowed.
    usable = ~tied & (denominator > 0)
    return torch.where(usable, centred / torch.where(usable, denominator, 1.0), 0.0)
