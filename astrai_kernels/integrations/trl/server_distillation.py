"""The ServerDistillationTrainer adapter (``trl.experimental.server_distillation``: the teacher is
a vLLM server returning top-k log-probs). Its ``compute_loss`` keeps TRL's inputs, prompt
length, teacher request (``_get_teacher_token_logprobs_from_server``), slicing, trimming to the
teacher's window, ValueErrors for missing teacher log-probs and division by the
gradient-accumulation steps, and computes the loss with ``ak.linear_topk_distill_loss`` (TRL's
top-k support at ``beta == 0`` with ``loss_add_tail`` as ``tail``, ``server_top1_support`` at
``beta > 0``; ``batchmean`` over the labelled positions) on the student's final hidden states
from TRL's own ``_get_last_hidden_state`` through ``_forward_redirection``, only the labelled
positions reaching the head (the logit scale folded into the hidden states). A soft-capped
student (that op has no soft-cap) or one ``integrations.transformers.fused_head`` does not read
keeps TRL's ``model(...)`` call and gets ``ak.topk_distill_loss`` on its logits.
``return_outputs=True`` on the hidden-state form runs TRL's own ``compute_loss``.
"""

import inspect
import types
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from . import contract

#: TRL 1.16's ``ServerDistillationTrainer`` methods whose loss the installed ``compute_loss``
#: reproduces (``_get_last_hidden_state``: the student's backbone call of the linear form).
_LOSS_METHODS = ("compute_loss", "_compute_server_forward_kl_loss",
                 "_compute_server_sparse_top_1_divergence_loss",
                 "_compute_sparse_top_1_divergence_loss", "_get_reverse_kl_top_1_tokens",
                 "_reduce_divergence_loss", "_get_last_hidden_state")
#: The names TRL 1.16's ``ServerDistillationTrainer.compute_loss`` reads.
_LOSS_NAMES = frozenset({"_compute_prompt_length", "_get_teacher_token_logprobs_from_server",
                         "_compute_server_sparse_top_1_divergence_loss",
                         "_compute_server_forward_kl_loss",
                         "current_gradient_accumulation_steps", "temperature", "beta"})


class ServerDistillationAdapter(contract.LossAdapter):
    method = "compute_loss"

    def applies(self, trainer, request: contract.Request) -> bool:
        return contract.trainer_family(trainer) == "server_distillation"

    def check(self, trainer, request: contract.Request) -> None:
        server = contract.trainer_class("server_distillation")
        name = contract.overridden(trainer, server, _LOSS_METHODS)
        if name:
            raise contract.refuse(trainer, f"it overrides ServerDistillationTrainer.{name}, "
                                           f"whose loss is not known here")
        missing = _LOSS_NAMES - set(inspect.unwrap(server.compute_loss).__code__.co_names)
        if missing:
            raise contract.refuse(trainer, f"TRL's ServerDistillationTrainer.compute_loss does "
                                           f"not read {sorted(missing)} as TRL 1.16's does")
        _check_settings(trainer)
        weight = contract.check_head_weight(trainer, "student", contract.policy_model(trainer))
        contract.resolve_backend(request.backend, weight.device)

    def loss(self, trainer, request: contract.Request):
        return _compute_loss(trainer, request)


ADAPTER = ServerDistillationAdapter()


def _check_settings(trainer) -> None:
    beta, top_k = trainer.beta, trainer.loss_top_k
    contract.check_beta(trainer, beta)
    contract.check_temperature(trainer, trainer.temperature)
    if not (isinstance(top_k, int) and top_k >= 1 and (beta == 0 or top_k == 1)):
        raise contract.refuse(trainer, f"loss_top_k {top_k!r} with beta {beta}: TRL's server "
                                       f"path takes a top-k support of k >= 1 at beta 0, the "
                                       f"top-1 support otherwise")
    if trainer.reverse_kl_top_1_mode != "sampled":
        raise contract.refuse(trainer, f"reverse_kl_top_1_mode "
                                       f"{trainer.reverse_kl_top_1_mode!r}: the server path "
                                       f"scores the sampled token only")
    if not isinstance(trainer.loss_add_tail, bool):
        raise contract.refuse(trainer, f"loss_add_tail {trainer.loss_add_tail!r} is not a bool")


def _student_head(student: nn.Module):
    """The student's head for ``ak.linear_topk_distill_loss``, or None where only the model's
    own forward gives its logits: a soft-cap (that op applies none), or a forward that
    ``integrations.transformers.fused_head`` does not read."""
    from .. import transformers as hf

    try:
        head = hf.fused_head(student)
    except (TypeError, ValueError):
        return None
    return head if head.softcap is None else None


def _check_teacher(teacher: Dict[str, Tensor], required: Tensor, beta: float) -> None:
    """TRL's ValueErrors for log-probs the server left out where labels count."""
    missing_actual = required & ~torch.isfinite(teacher["actual_logprobs"])
    if missing_actual.any():
        raise ValueError(
            "Teacher server is missing actual-token logprobs for required reverse-KL positions: "
            f"{int(missing_actual.sum().item())}/{int(required.sum().item())}.")
    if beta < 1:
        missing_top1 = required & ~torch.isfinite(teacher["topk_logprobs"].squeeze(-1))
        if missing_top1.any():
            raise ValueError(
                "Teacher server is missing top-1 logprobs for required forward-KL positions: "
                f"{int(missing_top1.sum().item())}/{int(required.sum().item())}.")


def _support(trainer, teacher: Dict[str, Tensor], completion_tokens: Tensor,
             labels: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(support_ids, teacher_logprobs, support_mask)`` per position, as TRL's server path
    builds them: the teacher's top-k at beta 0 (its -inf entries dropped by the op, as TRL's
    ``valid``), else ``server_top1_support`` of the teacher's top-1 and the sampled token,
    after TRL's ValueErrors for log-probs the server left out where labels count."""
    from ...ops.topk_distill import server_top1_support

    top_ids, top_logprobs = teacher["topk_token_ids"], teacher["topk_logprobs"]
    if trainer.beta == 0:
        return top_ids, top_logprobs, None
    _check_teacher(teacher, labels != -100, trainer.beta)
    return server_top1_support(top_ids.squeeze(-1), top_logprobs.squeeze(-1), completion_tokens,
                               teacher["actual_logprobs"], trainer.beta)


def _inputs(inputs) -> Dict[str, Any]:
    """TRL's rebuild of the ``input_ids`` / ``attention_mask`` / ``labels`` /
    ``prompt_attention_mask`` layout from the prompt and completion tensors."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    completion_labels = torch.where(completion_mask.bool(), completion_ids,
                                    torch.full_like(completion_ids, -100))
    return {**inputs, "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
            "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
            "labels": torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1),
            "prompt_attention_mask": prompt_mask}


def _student_loss(trainer, unwrapped, input_ids, attention_mask, positions, labels, support,
                  options):
    """``ak.linear_topk_distill_loss`` on the student's labelled hidden states (run through
    ``_forward_redirection``, so the prepared model's hooks see the call). The head is read
    here, inside the forward, where FSDP2 has gathered its weight."""
    # the prepared model's autocast wraps its forward, which the backbone call skips
    with trainer.accelerator.autocast():
        hidden = trainer._get_last_hidden_state(unwrapped, input_ids, attention_mask,
                                                input_ids.shape[1] - 1)
        dtype = contract.compute_dtype(hidden, False)
    head = _student_head(contract.base_model(unwrapped))
    weight, bias = head.weight, head.bias
    contract.check_gathered(weight)
    mask = labels.to(weight.device) != -100
    rows = hidden[:, positions][:, :labels.shape[1]].to(weight.device)[mask]
    if head.logit_scale != 1.0:
        rows = rows * head.logit_scale
        bias = None if bias is None else bias * head.logit_scale
    ids, teacher_logprobs, support_mask = (
        None if value is None else value.to(weight.device)[mask] for value in support)
    with torch.autocast(rows.device.type, enabled=False):
        return ak.linear_topk_distill_loss(
            rows.to(dtype), weight.to(dtype), ids, teacher_logprobs,
            bias=None if bias is None else bias.to(dtype), support_mask=support_mask, **options)


def _compute_loss(trainer, request: contract.Request):
    """ServerDistillationTrainer.compute_loss (TRL 1.16) on ``ak.linear_topk_distill_loss``
    (the module docstring)."""
    original = types.MethodType(contract.trainer_class("server_distillation").compute_loss,
                                trainer)

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        unwrapped = trainer.accelerator.unwrap_model(model)
        head = _student_head(contract.base_model(unwrapped))
        if return_outputs and head is not None:  # the caller wants the student's logits
            return original(model, inputs, return_outputs=True,
                            num_items_in_batch=num_items_in_batch)
        inputs = _inputs(inputs)
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        student_outputs = None
        if head is None:
            student_outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        prompt_length = trainer._compute_prompt_length(inputs)
        teacher = trainer._get_teacher_token_logprobs_from_server(inputs, prompt_length)
        window = teacher["actual_logprobs"].shape[1]
        labels = inputs["labels"][:, prompt_length:][:, :window]
        support = _support(trainer, teacher, input_ids[:, prompt_length:][:, :window], labels)
        # TRL's logits[:, prompt_length - 1:-1], a slice that also indexes hidden[:, :-1]
        positions = slice(*slice(prompt_length - 1, -1).indices(input_ids.shape[1])[:2])
        options = dict(beta=float(trainer.beta), temperature=float(trainer.temperature),
                       tail=trainer.loss_add_tail, backend=request.backend)
        if head is not None:
            loss = trainer._forward_redirection(
                model, unwrapped, _student_loss, trainer, unwrapped, input_ids,
                attention_mask, positions, labels, support,
                dict(options, chunk_size=request.chunk_size))
        else:
            loss = _logits_loss(student_outputs.logits[:, positions][:, :window], labels,
                                support, options)
        if trainer.model.training:
            loss = loss / trainer.current_gradient_accumulation_steps
        return (loss, student_outputs) if return_outputs else loss

    return compute_loss


def _logits_loss(logits: Tensor, labels: Tensor, support, options: Dict[str, Any]) -> Tensor:
    ids, teacher_logprobs, support_mask = support
    with torch.autocast(logits.device.type, enabled=False):
        return ak.topk_distill_loss(logits, ids, teacher_logprobs, labels,
                                    support_mask=support_mask, **options)
