"""DPO-family losses on sequence log-probs, and group-relative advantages.

Both act on ``[B]`` / ``[B, G]`` tensors, so they are plain PyTorch; the heavy part of DPO,
``sequence_logprobs`` over chosen and rejected, runs on the fused log-prob primitive.
"""

import torch

from .. import reference
from ._common import check_choice, check_in_range, check_positive

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
ADVANTAGE_SCALES = ("group", "batch", "none")


def _check_sequence_logprobs(tensor, name, shape=None):
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor of sequence log-probs [B]")
    if tensor.dim() != 1 or (shape is not None and tuple(tensor.shape) != shape):
        expected = "[B]" if shape is None else str(list(shape))
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen=None, ref_rejected=None, *, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0):
    """``(loss, metrics)``: DPO (cDPO with ``label_smoothing``), IPO, hinge or robust DPO.

    Without ``ref_chosen``/``ref_rejected`` the loss is reference-free (SimPO-style margins on
    the policy alone).
    """
    _check_sequence_logprobs(policy_chosen, "policy_chosen")
    shape = tuple(policy_chosen.shape)
    _check_sequence_logprobs(policy_rejected, "policy_rejected", shape)
    if (ref_chosen is None) != (ref_rejected is None):
        raise ValueError("give both ref_chosen and ref_rejected, or neither (reference-free)")
    if ref_chosen is not None:
        _check_sequence_logprobs(ref_chosen, "ref_chosen", shape)
        _check_sequence_logprobs(ref_rejected, "ref_rejected", shape)
        ref_chosen, ref_rejected = ref_chosen.detach().float(), ref_rejected.detach().float()
    check_choice(loss_type, "loss_type", DPO_LOSS_TYPES)
    beta = check_positive(beta, "beta")
    high = 0.5 if loss_type == "robust" else 1.0
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, high)
    if loss_type == "robust" and label_smoothing == 0.5:
        raise ValueError("label_smoothing must be < 0.5 for loss_type='robust'")
    return reference.dpo_loss(policy_chosen.float(), policy_rejected.float(), ref_chosen,
                              ref_rejected, beta, loss_type, label_smoothing)


def group_advantages(rewards, *, scale="group", eps=1e-6):
    """``(r - mean_g) / (std_g + eps)`` over each row's group (population std), float32."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError(f"rewards must be a tensor of shape [B, G], got "
                         f"{getattr(rewards, 'shape', type(rewards).__name__)}")
    check_choice(scale, "scale", ADVANTAGE_SCALES)
    eps = check_in_range(eps, "eps", 0.0, float("inf"))
    advantages = reference.group_advantages(rewards.float(), scale, eps)
    if rewards.shape[1] == 1:
        return torch.zeros_like(advantages)
    return advantages
