"""The DistillationTrainer adapter (``trl.DistillationTrainer``, whose models carry no TRL head):
the trainer gets TRL's own ``_compute_loss`` (its inputs, backbone calls, logit scales and
soft-caps) with the one global name ``_chunked_divergence_loss`` resolved to
:func:`divergence_loss`: ``ak.linear_distill_loss`` on the completion positions with the
trainer's ``beta`` and ``temperature``, divided by ``num_items_in_batch`` or the position count,
each head in its hidden states' (or the autocast) dtype, and the logged student entropy from
``ak.linear_token_logprobs`` (one more walk of the student head, no gradient). TRL runs that
``_compute_loss`` inside the student's forward (``_forward_redirection``), where FSDP2 has
gathered the student's head; a sharded teacher's is gathered by ``contract.teacher_head``.
"""

import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from . import contract

#: TRL 1.16's ``distillation_trainer._chunked_divergence_loss`` parameters, in order.
_LOSS_PARAMETERS = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight",
    "teacher_lm_head_weight", "completion_mask", "beta", "num_items_in_batch",
    "student_lm_head_bias", "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale",
    "student_final_logit_softcapping", "teacher_final_logit_softcapping", "temperature")


class DistillationAdapter(contract.LossAdapter):
    method = "_compute_loss"

    def applies(self, trainer, request: contract.Request) -> bool:
        return contract.trainer_family(trainer) == "distillation"

    def check(self, trainer, request: contract.Request) -> None:
        if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
            raise contract.refuse(trainer, "it has no local teacher_model, whose LM head its "
                                           "full-vocabulary divergence reads")
        name = contract.overridden(trainer, contract.trainer_class("distillation"),
                                   ("compute_loss", "_compute_loss"))
        if name:
            raise contract.refuse(trainer, f"it overrides DistillationTrainer.{name}, whose loss "
                                           f"is not known here")
        _check_trl_loss(trainer)
        contract.check_beta(trainer, trainer.beta)
        contract.check_temperature(trainer, trainer.temperature)
        vocabularies = []
        for weight in (contract.check_head_weight(trainer, "student", trainer.model),
                       contract.check_teacher_head_weight(trainer, trainer.teacher_model)):
            contract.resolve_backend(request.backend, weight.device)
            vocabularies.append(weight.shape[0])
        if vocabularies[0] != vocabularies[1]:
            raise contract.refuse(trainer, f"the student's and the teacher's LM heads have "
                                           f"vocabularies {vocabularies[0]} and {vocabularies[1]}")

    def loss(self, trainer, request: contract.Request):
        return _compute_loss(trainer, request)


ADAPTER = DistillationAdapter()


def _check_trl_loss(trainer) -> None:
    """TRL's ``_compute_loss`` calls ``_chunked_divergence_loss`` (a global) as 1.16's does."""
    from trl.trainer import distillation_trainer as trl_distillation

    loss_function = getattr(trl_distillation, "_chunked_divergence_loss", None)
    code = trl_distillation.DistillationTrainer._compute_loss.__code__
    try:
        parameters = tuple(inspect.signature(loss_function).parameters)
    except TypeError:
        parameters = None
    if (parameters != _LOSS_PARAMETERS or code.co_freevars
            or "_chunked_divergence_loss" not in code.co_names):
        raise contract.refuse(trainer, "TRL's DistillationTrainer._compute_loss does not call "
                                       "_chunked_divergence_loss(" + ", ".join(_LOSS_PARAMETERS)
                              + ") as TRL 1.16's does")


def _head_args(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], valid: Tensor):
    """The valid rows, the weight and the bias in TRL's compute dtype for this head."""
    dtype = contract.compute_dtype(hidden, False)
    rows = hidden.reshape(-1, hidden.shape[-1])[valid.to(hidden.device)].to(dtype)
    return rows, weight.to(dtype), None if bias is None else bias.to(dtype)


def divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                    teacher_lm_head_weight, completion_mask, beta, num_items_in_batch=None,
                    student_lm_head_bias=None, teacher_lm_head_bias=None,
                    student_logit_scale=1.0, teacher_logit_scale=1.0,
                    student_final_logit_softcapping=None, teacher_final_logit_softcapping=None,
                    temperature=1.0, *, backend: str = "auto", chunk_size: Optional[int] = None):
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments, same ``(loss, entropy_sum,
    n_valid)``) on ``ak.linear_distill_loss``: the generalized JSD of ``beta`` at
    ``temperature`` over the positions where ``completion_mask`` is not 0, summed and divided by
    ``num_items_in_batch``, else by their count (at least 1); ``entropy_sum`` is the student's
    entropy at ``temperature`` summed over them (``ak.linear_token_logprobs``, no gradient).
    Each head computes in its hidden states' dtype, or the autocast dtype, as TRL's does. TRL
    calls it inside the student's forward (``_forward_redirection``), where FSDP2 has gathered
    the student's LM head; the teacher's goes through ``contract.teacher_head``."""
    contract.check_gathered(student_lm_head_weight)
    teacher_lm_head_weight, teacher_lm_head_bias = contract.teacher_head(teacher_lm_head_weight,
                                                                         teacher_lm_head_bias)
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    normalizer = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(normalizer, Tensor):
        normalizer = normalizer.to(student_hidden_states.device)
    with torch.autocast(student_hidden_states.device.type, enabled=False):
        s_rows, s_weight, s_bias = _head_args(student_hidden_states, student_lm_head_weight,
                                              student_lm_head_bias, valid)
        t_rows, t_weight, t_bias = _head_args(teacher_hidden_states, teacher_lm_head_weight,
                                              teacher_lm_head_bias, valid)
        # batchmean with the normalizer: TRL's sum over the positions / num_items_in_batch
        options = ak.DistillOptions(beta=float(beta), temperature=float(temperature),
                                    reduction="batchmean")
        student = dict(softcap=student_final_logit_softcapping,
                       logit_scale=float(student_logit_scale), chunk_size=chunk_size,
                       backend=backend)
        loss = ak.linear_distill_loss(
            s_rows, s_weight, t_rows, t_weight, student_bias=s_bias, teacher_bias=t_bias,
            normalizer=normalizer, options=options,
            teacher_softcap=teacher_final_logit_softcapping,
            teacher_logit_scale=float(teacher_logit_scale), **student)
        with torch.no_grad():  # the logged entropy; any in-range target serves
            _, entropy = ak.linear_token_logprobs(
                s_rows, s_weight, s_rows.new_zeros(s_rows.shape[0], dtype=torch.long),
                bias=s_bias, temperature=options.temperature, return_entropy=True, **student)
    return loss, entropy.sum(), n_valid


def _compute_loss(trainer, request: contract.Request):
    """TRL's own ``DistillationTrainer._compute_loss`` (its inputs, backbone calls, heads,
    logit scales and soft-caps, ``beta``, ``temperature``), bound to ``trainer``, whose
    ``_chunked_divergence_loss`` is :func:`divergence_loss`: TRL's function body run with that
    one global name resolved to ours, nothing of TRL's module changed."""
    original = contract.trainer_class("distillation")._compute_loss
    namespace = dict(original.__globals__)
    namespace["_chunked_divergence_loss"] = functools.partial(
        divergence_loss, backend=request.backend, chunk_size=request.chunk_size)
    function = types.FunctionType(original.__code__, namespace, original.__name__,
                                  original.__defaults__)
    function.__kwdefaults__ = original.__kwdefaults__
    return types.MethodType(functools.update_wrapper(function, original), trainer)
