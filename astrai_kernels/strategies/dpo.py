"""Direct Preference Optimization (``dpo``, ``online_dpo``)."""

from dataclasses import fields
from typing import Dict, Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from ..baselines import original
from ..ops.preference import DPOOptions
from ..options.keywords import spread_options
from .base import (
    BaseStrategy,
    Device,
    LossOutput,
    StrategyFactory,
    check_ids,
    check_same_shape,
    model_outputs,
    move_to_device,
    require_keys,
)
from .logprobs import masked_token_logprobs, reduce_logprobs
from .masks import left_align, model_inputs
from .rollout import RolloutResult

DPO_REDUCTIONS = ("sum", "mean")


def _pad_right(tensor: Tensor, length: int) -> Tensor:
    if tensor.shape[1] == length:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:])
    return torch.cat([tensor, pad], dim=1)


@StrategyFactory.register("dpo")
class DPOStrategy(BaseStrategy):
    """Direct Preference Optimization (Rafailov et al., 2023).

    Batch: ``chosen``/``rejected`` token ids ``[B, T_c]``/``[B, T_r]`` (prompt + response) and
    ``chosen_mask``/``rejected_mask`` of the same shapes marking the scored (response) tokens.
    Optional ``chosen_attention_mask``/``rejected_attention_mask`` mark the real tokens when a
    sequence is left-padded; without them there is no padding, or only right padding, which the
    causal mask hides from every real token. Chosen and rejected of different lengths are
    right-padded to a common length.

    The sequence log-prob of each side is the sum (``reduction="sum"``, the seed's default) or the
    mean (``"mean"``) of its masked token log-probs. ``ref_model=None`` is reference-free DPO.
    ``loss_type`` (one of ``ak.dpo_loss``'s types, or a list of them with ``loss_weights``:
    MPO), ``label_smoothing``, ``discopop_tau`` and ``bco_delta`` are those of ``ak.dpo_loss``
    (``"sigmoid"`` and 0 are the seed's loss; the others need a fused ``loss_backend``) and are
    checked at construction (``bco_delta`` a number here). ``sigmoid_norm`` divides each side's
    summed log-ratio by its count of scored tokens, so it needs ``reduction="sum"``.

    Metrics: ``dpo_loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracy``,
    ``rewards/margin`` (rewards are ``beta * (log pi - log ref)``, batch means), ``loss``, and
    with a list of loss types ``loss/<type>`` (each type's unweighted mean).
    """

    @spread_options(DPOOptions, "DPO")
    def __init__(self, model: nn.Module, device: Device, ref_model: Optional[nn.Module],
                 reduction: str = "sum", bco_delta: Optional[float] = None, *,
                 options: DPOOptions, **kwargs):
        super().__init__(model, device, **kwargs)
        if reduction not in DPO_REDUCTIONS:
            raise ValueError(f"DPOStrategy: reduction must be one of {list(DPO_REDUCTIONS)} (a "
                             f"sequence log-prob per response), got {reduction!r}")
        self.ref_model = ref_model
        self.reduction = reduction
        self._reference_only(**{field.name: (getattr(options, field.name), field.default)
                                for field in fields(DPOOptions) if field.name != "beta"},
                             bco_delta=(bco_delta, None))
        # every scalar option of ak.dpo_loss, as one object checked now: the keywords are its
        # fields (the signature lists them from the dataclass)
        self.options = options.checked()
        self.bco_delta = bco_delta  # an input of the op, not an option
        self.needs_lengths = "sigmoid_norm" in self.options.loss_types
        if self.needs_lengths and reduction != "sum":
            raise ValueError("DPOStrategy: loss_type 'sigmoid_norm' divides summed log-ratios by "
                             "the token counts; it needs reduction='sum'")
        if bco_delta is not None:  # its rules are the op's: checked on a one-pair stand-in
            one = torch.zeros(1)
            lengths = dict(chosen_lengths=torch.ones(1), rejected_lengths=torch.ones(1))
            ak.dpo_loss(one, one, one, one, options=self.options, bco_delta=bco_delta,
                        **(lengths if self.needs_lengths else {}))

    def compute_loss(self, batch: Dict[str, Tensor]) -> Tensor:
        return self.compute_loss_output(batch)["loss"]

    # ------------------------------------------------------------ batch

    def _concat_batch(self, batch: Dict[str, Tensor]):
        owner = type(self).__name__
        require_keys(batch, ("chosen", "rejected", "chosen_mask", "rejected_mask"), owner)
        batch = move_to_device(batch, self.device)
        chosen, rejected = batch["chosen"], batch["rejected"]
        check_ids(chosen, "chosen", owner, 2)
        check_ids(rejected, "rejected", owner, 2)
        if chosen.shape[0] != rejected.shape[0]:
            raise ValueError(f"{owner}: chosen has {chosen.shape[0]} sequences but rejected has "
                             f"{rejected.shape[0]}; they come in pairs")
        if min(chosen.shape[1], rejected.shape[1]) < 2:
            raise ValueError(f"{owner}: sequences need at least 2 tokens (a prefix and a scored "
                             f"token), got lengths {chosen.shape[1]} and {rejected.shape[1]}")
        masks, attn = {}, {}
        for side in ("chosen", "rejected"):
            masks[side] = batch[f"{side}_mask"]
            check_same_shape(masks[side], f"{side}_mask", batch[side], side, owner)
            attn[side] = batch.get(f"{side}_attention_mask")
            if attn[side] is not None:
                check_same_shape(attn[side], f"{side}_attention_mask", batch[side], side, owner)
        length = max(chosen.shape[1], rejected.shape[1])
        ids = torch.cat([_pad_right(chosen, length), _pad_right(rejected, length)], dim=0)
        loss_mask = torch.cat([_pad_right(masks["chosen"].float(), length),
                               _pad_right(masks["rejected"].float(), length)], dim=0)
        key_mask = None
        if attn["chosen"] is not None or attn["rejected"] is not None:
            sides = [attn[s].bool() if attn[s] is not None
                     else torch.ones_like(batch[s], dtype=torch.bool)
                     for s in ("chosen", "rejected")]
            key_mask = torch.cat([_pad_right(m, length) for m in sides], dim=0)
        return ids, loss_mask, key_mask, chosen.shape[0]

    def _sequence_logprobs(self, model, ids: Tensor, loss_mask: Tensor,
                           key_mask: Optional[Tensor]):
        """Sequence log-probs ``[2B]`` of ``ids[:, 1:]`` under ``model`` and its aux loss."""
        inputs = ids[:, :-1]
        input_mask, position_ids = model_inputs(
            None if key_mask is None else key_mask[:, :-1], inputs)
        head = self.model_head(model)
        if head is not None:
            outputs = head.hidden(type(self).__name__, input_ids=inputs, input_mask=input_mask,
                                  position_ids=position_ids)
            logprobs = ak.linear_sequence_logprobs(
                outputs["hidden_states"], head.weight, ids[:, 1:], loss_mask[:, 1:],
                bias=head.bias, average=self.reduction == "mean", softcap=head.softcap,
                backend=self.loss_backend)
            return logprobs, outputs.get("aux_loss")
        outputs = model_outputs(model, type(self).__name__, input_ids=inputs,
                                input_mask=input_mask, position_ids=position_ids)
        logits, target, mask = outputs["logits"], ids[:, 1:], loss_mask[:, 1:]
        if self.uses_reference:
            token_lp = masked_token_logprobs(logits, target, mask, "reference")
            logprobs = reduce_logprobs(token_lp, mask, self.reduction)
        else:
            logprobs = ak.sequence_logprobs(logits, target, mask,
                                            average=self.reduction == "mean",
                                            backend=self.loss_backend)
        return logprobs, outputs.get("aux_loss")

    # ------------------------------------------------------------ loss

    def compute_loss_output(self, batch: Dict[str, Tensor]) -> LossOutput:
        ids, loss_mask, key_mask, n_pairs = self._concat_batch(batch)
        log_ref = None
        if self.ref_model is not None:
            # The no-grad reference forward first: its logits are gone before the policy's exist.
            with torch.no_grad():
                log_ref, _ = self._sequence_logprobs(self.ref_model, ids, loss_mask, key_mask)
        log_pi, aux_loss = self._sequence_logprobs(self.model, ids, loss_mask, key_mask)
        pi_chosen, pi_rejected = log_pi[:n_pairs], log_pi[n_pairs:]
        ref_chosen = None if log_ref is None else log_ref[:n_pairs]
        ref_rejected = None if log_ref is None else log_ref[n_pairs:]

        if self.uses_reference:
            dpo_loss, metrics = original.dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected,
                                               self.options.beta)
        else:
            lengths = {}
            if self.needs_lengths:
                counts = loss_mask[:, 1:].sum(-1)
                lengths = dict(chosen_lengths=counts[:n_pairs], rejected_lengths=counts[n_pairs:])
            dpo_loss, metrics = ak.dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected,
                                            options=self.options, bco_delta=self.bco_delta,
                                            **lengths)
        metrics = {"dpo_loss": dpo_loss, **metrics}  # a new dict: the ops' own is not changed
        return self._loss_output(dpo_loss, metrics, aux_loss)

    # ------------------------------------------------------------ online

    def supports_online(self) -> bool:
        return True

    def prepare_from_rollout(self, result: RolloutResult) -> Dict[str, Tensor]:
        """Best/worst response of each prompt by reward become chosen/rejected.

        Each side is ``prompt + response`` (the seed scored the responses without their prompt,
        i.e. ``log pi(y)`` instead of ``log pi(y | x)``), with the prompt left-aligned so the
        response follows the last real prompt token, and only response tokens in the loss mask.
        Prompts whose responses all score the same give chosen == rejected: a constant loss
        with zero gradient, as in the seed.
        """
        prompts, responses, masks = result.prompts, result.responses, result.response_mask
        rewards = result.rewards
        if responses.dim() != 3 or tuple(rewards.shape) != tuple(responses.shape[:2]):
            raise ValueError(f"DPOStrategy: rollout responses must be [B, G, L] with rewards "
                             f"[B, G], got {tuple(responses.shape)} and {tuple(rewards.shape)}")
        prompt_mask = result.prompt_mask
        if prompt_mask is None:
            prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
        prompts, prompt_mask = left_align(prompts, prompt_mask)
        best, worst = rewards.argmax(dim=-1), rewards.argmin(dim=-1)
        idx = torch.arange(responses.shape[0], device=responses.device)
        out = {}
        for side, pick in (("chosen", best), ("rejected", worst)):
            response, response_mask = responses[idx, pick], masks[idx, pick].bool()
            out[side] = torch.cat([prompts, response], dim=-1)
            out[f"{side}_mask"] = torch.cat(
                [torch.zeros_like(prompt_mask), response_mask], dim=-1).float()
            out[f"{side}_attention_mask"] = torch.cat(
                [prompt_mask, torch.ones_like(response_mask)], dim=-1)
        return out


# Online DPO is the same class; the rollout runner injected with ``set_rollout_runner`` switches
# it to online mode.
StrategyFactory.register("online_dpo")(DPOStrategy)
