"""Next-token prediction (``seq``) and supervised fine-tuning with a loss mask (``sft``)."""

from typing import Dict, Tuple

import torch
from torch import Tensor

import astrai_kernels as ak

from ..baselines import original
from .base import (
    BaseStrategy,
    Device,
    LossOutput,
    Model,
    StrategyFactory,
    check_ids,
    check_same_shape,
    model_outputs,
    move_to_device,
    require_keys,
)
from .logprobs import IGNORE_INDEX
from .masks import make_doc_boundary_mask


def _cross_entropy(strategy: "SEQStrategy", logits: Tensor, target: Tensor) -> Tensor:
    """Mean token cross-entropy over the targets that are not ``IGNORE_INDEX`` (0.0 with a zero
    gradient when every target is ignored, on both paths)."""
    if strategy.uses_reference:
        return original.cross_entropy(logits, target, IGNORE_INDEX, strategy.label_smoothing)
    return ak.cross_entropy(
        logits,
        target,
        ignore_index=IGNORE_INDEX,
        label_smoothing=strategy.label_smoothing,
        inplace_backward=strategy.inplace_backward,
        backend=strategy.loss_backend,
    )


@StrategyFactory.register("seq")
class SEQStrategy(BaseStrategy):
    """Standard next-token prediction: cross-entropy of ``logits`` against ``target_ids``.

    Batch: ``input_ids [B, T]`` and ``target_ids [B, T]`` (already shifted by the data pipeline;
    targets equal to -100 are ignored). ``inplace_backward=True`` lets the fused op write the
    logits' gradient into the logits buffer (no second ``[N, V]`` tensor); use it only when
    nothing else reads the logits after the loss (ignored with ``loss_backend="reference"``, and
    on the fused head, where there are no logits).
    """

    def __init__(
        self,
        model: Model,
        device: Device,
        label_smoothing: float = 0.0,
        inplace_backward: bool = False,
        **kwargs,
    ):
        super().__init__(model, device, **kwargs)
        self.label_smoothing = label_smoothing
        self.inplace_backward = inplace_backward

    def compute_loss(self, batch: Dict[str, Tensor]) -> Tensor:
        return self.compute_loss_output(batch)["loss"]

    def compute_loss_output(self, batch: Dict[str, Tensor]) -> LossOutput:
        model_kwargs, target_ids = self._model_inputs(batch)
        head = self.model_head(self.model)
        if head is not None:
            outputs = head.hidden(type(self).__name__, **model_kwargs)
            loss = ak.linear_cross_entropy(
                outputs["hidden_states"], head.weight, target_ids, bias=head.bias,
                ignore_index=IGNORE_INDEX, label_smoothing=self.label_smoothing,
                softcap=head.softcap, backend=self.loss_backend)
            return self._loss_output(loss, {"task_loss": loss}, outputs.get("aux_loss"))
        outputs = model_outputs(self.model, type(self).__name__, **model_kwargs)
        loss = _cross_entropy(self, outputs["logits"], target_ids)
        return self._loss_output(loss, {"task_loss": loss}, outputs.get("aux_loss"))

    def _model_inputs(self, batch: Dict[str, Tensor]) -> Tuple[Dict[str, Tensor], Tensor]:
        """The model's keyword inputs and the targets (``IGNORE_INDEX`` where not scored)."""
        owner = type(self).__name__
        require_keys(batch, ("input_ids", "target_ids"), owner)
        batch = move_to_device(batch, self.device)
        input_ids, target_ids = batch["input_ids"], batch["target_ids"]
        check_ids(input_ids, "input_ids", owner, 2)
        check_ids(target_ids, "target_ids", owner, 2)
        check_same_shape(target_ids, "target_ids", input_ids, "input_ids", owner)
        return {"input_ids": input_ids}, target_ids


@StrategyFactory.register("sft")
class SFTStrategy(SEQStrategy):
    """Supervised fine-tuning: cross-entropy only where ``loss_mask`` is true.

    Batch: ``input_ids``, ``target_ids``, ``loss_mask`` (bool, or 0/1 of any dtype) and
    ``position_ids``, all ``[B, T]``. Packed documents are kept apart by
    :func:`make_doc_boundary_mask` from the position ids; without ``position_ids`` the batch is
    one document per row (``arange`` positions, plain causal mask). Keywords as
    :class:`SEQStrategy`.
    """

    def _model_inputs(self, batch: Dict[str, Tensor]) -> Tuple[Dict[str, Tensor], Tensor]:
        owner = type(self).__name__
        require_keys(batch, ("input_ids", "target_ids", "loss_mask"), owner)
        batch = move_to_device(batch, self.device)
        inputs, target_ids = super()._model_inputs(batch)
        input_ids, loss_mask = inputs["input_ids"], batch["loss_mask"]
        check_same_shape(loss_mask, "loss_mask", input_ids, "input_ids", owner)
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.expand_as(input_ids)
        else:
            check_same_shape(position_ids, "position_ids", input_ids, "input_ids", owner)
        # The seed wrote ``~loss_mask``, which is a bitwise NOT for 0/1 integer masks (~1 = -2,
        # ~0 = -1) and an error for float masks; compare with 0 instead.
        target_ids = target_ids.masked_fill(loss_mask == 0, IGNORE_INDEX)
        inputs.update(position_ids=position_ids, input_mask=make_doc_boundary_mask(position_ids))
        return inputs, target_ids
