"""The GKD adapter (``trl.experimental.gkd.GKDTrainer``, whose loss reads full logits): its
``compute_loss`` becomes ``ak.linear_distill_loss`` on the student's and the teacher's final
hidden states (the trainer's ``beta``, temperature 1 and ``batchmean`` or
``num_items_in_batch`` as TRL's ``generalized_jsd_loss`` there, each model's logit scale and
soft-cap). The models are called through ``__call__``: the teacher with
``astrai_hidden_states=True`` (its forward, given here, answers with the backbone's output),
the student with ``astrai_loss=`` (its served forward, ``head``, computes the loss from the
backbone's output inside the forward, where FSDP2 has gathered the student's LM head).
"""

import types
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from . import contract, head


class GKDAdapter(contract.LossAdapter):
    method = "compute_loss"
    reads_hidden_states = True

    def applies(self, trainer, request: contract.Request) -> bool:
        return contract.trainer_family(trainer) == "gkd"

    def check(self, trainer, request: contract.Request) -> None:
        if contract.overridden(trainer, contract.trainer_class("gkd"), ("compute_loss",)):
            raise contract.refuse(trainer, "it overrides GKDTrainer.compute_loss, whose loss is "
                                           "not known here")
        if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
            raise contract.refuse(trainer, "its teacher_model is not an nn.Module")
        from .. import transformers as hf

        for role, model in (("student", contract.policy_model(trainer)),
                            ("teacher", trainer.teacher_model)):
            try:
                fused = hf.fused_head(model)
            except (TypeError, ValueError) as error:
                raise contract.refuse(trainer, f"its {role}: {error}") from None
            contract.resolve_backend(request.backend, fused.weight.device)
        if (contract.policy_model(trainer).get_output_embeddings().weight.shape[0]
                != trainer.teacher_model.get_output_embeddings().weight.shape[0]):
            raise contract.refuse(trainer, "the student's and the teacher's vocabularies differ")

    def loss(self, trainer, request: contract.Request):
        return _compute_loss(trainer, trainer.compute_loss, request)

    def apply(self, trainer, request: contract.Request) -> List[nn.Module]:
        """The loss, and the teacher's forward answering the hidden-state call."""
        super().apply(trainer, request)
        teacher = trainer.teacher_model
        head.serve(trainer, teacher,
                   types.MethodType(head.hidden_forward(teacher.forward, "base_model"), teacher),
                   wrapped=False)
        return [teacher]

    def undo(self, trainer, models: List[nn.Module]) -> None:
        super().undo(trainer, models)
        for model in models:
            head.give_back(model)


ADAPTER = GKDAdapter()


def _head_args(weight: Tensor, bias: Optional[Tensor], hidden: Tensor, mask: Tensor,
               dtype: torch.dtype):
    bias = None if bias is None else bias.to(dtype)
    return hidden.to(weight.device)[mask].to(dtype), weight.to(dtype), bias


def _teacher_hidden_states(trainer, inputs: Dict[str, Tensor]) -> Tensor:
    """The teacher's final hidden states, but the last position."""
    trainer.teacher_model.eval()
    # accelerate's mixed-precision wrapper of the teacher (prepared when the trainer was
    # built) is skipped by the hidden-state call: its autocast is entered here
    with torch.no_grad(), trainer.accelerator.autocast():
        return trainer.teacher_model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
            astrai_hidden_states=True).last_hidden_state[:, :-1]


def _returned_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype ``hidden`` leaves the student's forward in (the loss's dtype when it ran after
    the forward): under autocast (accelerate's mixed-precision wrapper) float32, as that wrapper
    converts its outputs."""
    return torch.float32 if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype


def _compute_loss(trainer, original, request: contract.Request):
    """GKDTrainer.compute_loss (TRL 1.16) on ``ak.linear_distill_loss``: the student's and
    the teacher's final hidden states, both models' logit scale and soft-cap, TRL's
    ``generalized_jsd_loss`` with the trainer's ``beta``, temperature 1 (compute_loss passes
    none), ``batchmean`` over labelled positions or ``num_items_in_batch``. The loss runs inside
    the student's forward (``astrai_loss``), where FSDP2 has gathered the student's LM head
    (its hooks then see the loss as the forward's output); the teacher's head, which no forward
    of the loss gathers, goes through ``contract.teacher_head``."""
    from .. import transformers as hf

    student_model = contract.policy_model(trainer)

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation wants the student's logits: TRL's own
            return original(model, inputs, return_outputs=True,
                            num_items_in_batch=num_items_in_batch)
        contract.check_called_model(trainer, model, student_model)
        # TRL's generalized_jsd_loss as compute_loss calls it (temperature 1, batchmean), with
        # the trainer's beta of this step
        options = ak.DistillOptions(beta=float(trainer.beta), temperature=1.0,
                                    reduction="batchmean")
        teacher = _teacher_hidden_states(trainer, inputs)
        teacher_dtype = contract.compute_dtype(teacher, False)
        teacher_head = hf.fused_head(trainer.teacher_model)
        teacher_weight, teacher_bias = contract.teacher_head(teacher_head.weight,
                                                             teacher_head.bias)

        def loss_in_forward(output):
            student = output.last_hidden_state[:, :-1]
            student_head = hf.fused_head(student_model)
            contract.check_gathered(student_head.weight)
            mask = inputs["labels"][:, 1:].to(student_head.weight.device) != -100
            dtype = _returned_dtype(student)
            with torch.autocast(student.device.type, enabled=False):
                s_hidden, s_weight, s_bias = _head_args(student_head.weight, student_head.bias,
                                                        student, mask, dtype)
                t_hidden, t_weight, t_bias = _head_args(teacher_weight, teacher_bias, teacher,
                                                        mask, teacher_dtype)
                return ak.linear_distill_loss(
                    s_hidden, s_weight, t_hidden, t_weight, student_bias=s_bias,
                    teacher_bias=t_bias, options=options,
                    normalizer=_on(num_items_in_batch, s_hidden.device),
                    softcap=student_head.softcap, logit_scale=student_head.logit_scale,
                    teacher_softcap=teacher_head.softcap,
                    teacher_logit_scale=teacher_head.logit_scale,
                    chunk_size=request.chunk_size, backend=request.backend)

        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     astrai_loss=loss_in_forward)

    return compute_loss


def _on(value: Optional[object], device):
    """``value`` on ``device`` when it is a tensor."""
    return value.to(device) if isinstance(value, Tensor) else value
