"""Token log-probs from a model: the seed's naive math (:mod:`astrai_kernels.baselines.original`)
and the fused ops, behind one switch."""

from typing import Optional

import torch
from torch import Tensor

import astrai_kernels as ak

from ..baselines import original
from .base import LogprobsOutput, Model, model_outputs

IGNORE_INDEX = -100
REDUCTIONS = ("mean", "sum", "none")


def masked_token_logprobs(logits: Tensor, target: Tensor, mask: Tensor, backend: str,
                          temperature: float = 1.0) -> Tensor:
    """``log p(target)`` per token, zero where ``mask`` is 0; ``[B, T]`` float32.

    ``backend="reference"`` is the seed's math
    (:func:`~astrai_kernels.baselines.original.log_softmax_gather`) with the masked tokens set to
    0; otherwise the fused ``ak.token_logprobs`` with the masked tokens' targets set to
    ``ignore_index`` (they cost nothing and get zero gradient).
    """
    if backend == "reference":
        if temperature != 1.0:
            logits = logits.float() / temperature
        return torch.where(mask != 0, original.log_softmax_gather(logits, target), 0.0)
    target = target.masked_fill(mask == 0, IGNORE_INDEX)
    return ak.token_logprobs(logits, target, temperature=temperature, ignore_index=IGNORE_INDEX,
                             backend=backend)


def reduce_logprobs(token_lp: Tensor, mask: Tensor, reduction: str) -> Tensor:
    """The seed's reductions of masked token log-probs over the sequence."""
    mask = mask.to(torch.float32)
    if reduction == "mean":
        return (token_lp * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    if reduction == "sum":
        return (token_lp * mask).sum(dim=-1)
    return token_lp * mask


def get_logprobs(
    model: Model,
    input_ids: Tensor,
    attn_mask: Tensor,
    loss_mask: Tensor,
    reduction: str,
    position_ids: Optional[Tensor] = None,
    loss_backend: str = "reference",
) -> LogprobsOutput:
    """The seed's ``get_logprobs``: log-probs of ``input_ids[:, 1:]`` given the prefix.

    ``attn_mask`` is the mask of the full sequence (``[B, S]`` or ``[B, 1, S, S]``) and
    ``loss_mask [B, S]`` marks the scored tokens; both are shifted here as in the seed. With
    ``loss_backend="reference"`` this is the seed's math, else the fused ops (``"sum"``/``"mean"``
    via ``ak.sequence_logprobs``).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    target = input_ids[:, 1:]
    mask = loss_mask[:, 1:]
    inputs = {
        "input_ids": input_ids[:, :-1],
        "input_mask": attn_mask[:, :, :-1, :-1] if attn_mask.dim() == 4 else attn_mask[:, :-1],
    }
    if position_ids is not None:
        inputs["position_ids"] = position_ids[:, :-1]
    outputs = model_outputs(model, "get_logprobs", **inputs)
    logits = outputs["logits"]
    if loss_backend == "reference" or reduction == "none":
        token_lp = masked_token_logprobs(logits, target, mask, loss_backend)
        logprobs = reduce_logprobs(token_lp, mask, reduction)
    else:
        logprobs = ak.sequence_logprobs(logits, target, mask, average=reduction == "mean",
                                        backend=loss_backend)
    return {"logprobs": logprobs, "aux_loss": outputs.get("aux_loss")}
