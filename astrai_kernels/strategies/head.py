"""The fused LM head for the strategies: a model's final hidden states and output embedding.

A model serves the fused path when it exposes both:

* :class:`~astrai_kernels.testing.tiny_lm.TinyCausalLM`-style: ``model.forward_hidden(input_ids,
  input_mask=None, position_ids=None)`` returning ``{"hidden_states": [B, T, H]}`` (plus
  ``"aux_loss"``) and ``model.get_output_embeddings()`` an ``nn.Linear`` (the head is
  ``logits = hidden @ weight.T + bias``);
* a transformers causal LM that :mod:`astrai_kernels.integrations.transformers` can serve (its
  decoder gives the hidden states; the strategies' 4-D boolean mask is passed to it as an additive
  float mask; its logit scale is folded into the hidden states). A transformers model is always
  served this way or refused with the reason (soft-capped logits, a MoE router loss, ...): its
  own forward takes ``attention_mask``, not the strategies' ``input_mask``, so the logits path
  would drop the mask.

Then the strategies call the ``linear_*`` ops and no ``[B, T, V]`` logits ever exist. A model that
returns only logits keeps the logits path.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch import Tensor

from .types import Model


@dataclass(frozen=True)
class ModelHead:
    """``hidden_fn(input_ids=, input_mask=, position_ids=) -> {"hidden_states", "aux_loss"?}``
    and the head's ``weight [V, H]`` and ``bias [V]`` (None without one), with the hidden states
    already scaled by the model's logit scale; ``softcap`` the model's final soft-cap (the
    ops' ``softcap=``), None without one."""
    hidden_fn: Callable[..., Dict[str, Tensor]]
    weight: Tensor
    bias: Optional[Tensor]
    softcap: Optional[float] = None

    def hidden(self, owner: str, **inputs: Tensor) -> Dict[str, Tensor]:
        outputs = self.hidden_fn(**inputs)
        hidden = outputs.get("hidden_states") if isinstance(outputs, dict) else None
        input_ids = inputs["input_ids"]
        if not isinstance(hidden, Tensor) or hidden.dim() != 3 or \
                tuple(hidden.shape[:2]) != tuple(input_ids.shape) or \
                hidden.shape[-1] != self.weight.shape[1]:
            shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(f"{owner}: the model's hidden states must be [batch, seq_len, H] = "
                             f"[{input_ids.shape[0]}, {input_ids.shape[1]}, "
                             f"{self.weight.shape[1]}], got {shape}")
        return outputs


def _is_transformers_model(model) -> bool:
    return (isinstance(model, nn.Module) and hasattr(model, "config")
            and hasattr(model, "base_model_prefix") and hasattr(model, "get_output_embeddings")
            and type(model).__module__.startswith("transformers."))


def _additive_mask(input_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean ``[B, 1, S, S]`` mask (True = attend) as transformers' additive float mask."""
    blocked = torch.finfo(dtype).min
    return torch.zeros(input_mask.shape, dtype=dtype, device=input_mask.device).masked_fill(
        ~input_mask, blocked)


def _transformers_head(model, owner: str) -> ModelHead:
    from ..integrations import transformers as hf

    head = hf.fused_head(model)  # a ValueError saying why for a model it cannot serve

    def hidden_fn(input_ids, input_mask=None, position_ids=None):
        mask = input_mask
        if mask is not None and mask.dim() == 4:
            mask = _additive_mask(mask, head.weight.dtype)
        outputs = hf.hidden_states(model, input_ids, mask, position_ids, use_cache=False)
        hidden, _ = head.inputs(outputs[0])
        return {"hidden_states": hidden}

    return ModelHead(hidden_fn, head.weight, None if head.bias is None
                     else head.bias * head.logit_scale, head.softcap)


def model_head(model: Model, enabled: Optional[bool], owner: str) -> Optional[ModelHead]:
    """The fused head of ``model``, or None for the logits path.

    ``enabled=None`` uses it when the model exposes one, ``False`` never, ``True`` requires it.
    """
    if _is_transformers_model(model):
        # Its forward takes attention_mask, not the strategies' input_mask: on the logits path
        # the mask would be dropped without a word, so such a model is served here or refused.
        if enabled is False:
            raise ValueError(f"{owner}: a transformers model runs on the fused head only "
                             f"(its forward would ignore the strategies' input_mask); pass "
                             f"fused_head=None or True, or wrap it to return "
                             f"{{'logits': ...}} from input_ids, input_mask, position_ids")
        return _transformers_head(model, owner)
    if enabled is False:
        return None
    head = None
    forward_hidden = getattr(model, "forward_hidden", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(forward_hidden) and callable(get_head):
        output_head = get_head()
        if isinstance(output_head, nn.Linear):
            head = ModelHead(forward_hidden, output_head.weight, output_head.bias)
    if head is None and enabled:
        raise ValueError(f"{owner}: fused_head=True needs a model that exposes its final hidden "
                         f"states and output embedding (forward_hidden + "
                         f"get_output_embeddings, or a transformers causal LM without logit "
                         f"soft-capping); {type(model).__name__} does not")
    return head
