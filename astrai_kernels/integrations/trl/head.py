"""The fused-head adapter: every model of the trainer carrying TRL's fused head (policy, or its
PEFT base; ``ref_model``; ``teacher_model``) gets a forward with TRL's contract that computes
the per-token fields with ``ak.linear_token_logprobs`` (the package docstring lists it).

Also the forward plumbing the loss adapters share: :func:`hidden_forward` (a forward that, called
with ``astrai_hidden_states=True``, returns the backbone's output, with ``astrai_loss=fn`` the
loss ``fn`` computes from it inside the forward), :func:`serve` and
:func:`give_back` (a model's forward replaced and restored, its state under ``MODEL_STATE``).
"""

import functools
import types
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from . import contract, sampler
from .contract import MODEL_STATE, STATISTICS, TRLHead


def _served_models(trainer) -> List[nn.Module]:
    """Every module of the trainer's models (policy, reference, teacher) carrying TRL's head."""
    found, seen = [], set()
    for name in ("model", "ref_model", "teacher_model"):
        root = getattr(trainer, name, None)
        if not isinstance(root, nn.Module):
            continue
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if MODEL_STATE in module.__dict__ or contract.trl_head_settings(module) is not None:
                found.append(module)
    return found


class HeadAdapter(contract.Adapter):
    """TRL's fused head on each model that carries it, served by ``ak.linear_token_logprobs``."""

    def applies(self, trainer, request: contract.Request) -> bool:
        return contract.trainer_family(trainer) not in contract.HEADLESS_FAMILIES

    def check(self, trainer, request: contract.Request) -> None:
        models = _served_models(trainer)
        if not models:
            raise contract.refuse(
                trainer, "none of its models (model, ref_model, teacher_model) carries TRL's "
                         "fused LM head (add_fused_lm_head): the trainer scores full logits, "
                         "so there is nothing to serve")
        for model in models:
            if MODEL_STATE in model.__dict__:
                raise contract.refuse(trainer, f"its {type(model).__name__} is already served "
                                               f"by another trainer's install")
            contract.check_head(trainer, model, TRLHead.of(model))
            contract.resolve_backend(request.backend,
                                     model.get_output_embeddings().weight.device)

    def apply(self, trainer, request: contract.Request) -> List[nn.Module]:
        models = _served_models(trainer)
        policy = contract.policy_model(trainer)
        # score_support="sampler": the policy's completions (the old log-probs TRL computes at
        # generation) under the sampler's processed distribution; the reference's stay plain
        sampling = (sampler.sampling_params(trainer) if request.score_support is not None
                    else None)
        for model in models:
            head = TRLHead.of(model)
            trl_forward, wrapped = contract.trl_forward(model)
            forward = types.MethodType(
                make_forward(trl_forward, head, request.backend, request.chunk_size,
                             sampling if model is policy else None), model)
            if model is policy and request.policy_hidden_states:
                forward = types.MethodType(hidden_forward(forward, head.backbone_attr), model)
            serve(trainer, model, forward, wrapped, settings=head.settings)
        return models

    def undo(self, trainer, models: List[nn.Module]) -> None:
        for model in models:
            give_back(model)


ADAPTER = HeadAdapter()


def serve(trainer, model: nn.Module, forward, wrapped: bool, **state: Any) -> None:
    """Give ``model`` the bound ``forward``, keeping what it replaces (and ``state``) under
    ``MODEL_STATE``; ``wrapped``: inside accelerate's mixed-precision wrapper, as TRL's was."""
    model.__dict__[MODEL_STATE] = {
        "trl_forward": model.__dict__.get("forward"),
        "original_forward": model.__dict__.get("_original_forward"), **state}
    if wrapped:
        model._original_forward = forward
        forward = _mixed_precision_forward(trainer, forward)
    model.forward = forward


def give_back(model: nn.Module) -> None:
    """The forward (and ``_original_forward``) :func:`serve` replaced."""
    state = model.__dict__.pop(MODEL_STATE)
    if state["trl_forward"] is None:
        del model.__dict__["forward"]
    else:
        model.forward = state["trl_forward"]
    if state.get("original_forward") is not None:
        model._original_forward = state["original_forward"]


def _mixed_precision_forward(trainer, forward):
    """``forward`` wrapped as accelerate's ``prepare_model`` wraps a forward under mixed
    precision: autocast, outputs converted to float32."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    accelerator = trainer.accelerator
    context = get_mixed_precision_context_manager(accelerator.native_amp,
                                                  accelerator.autocast_handler)
    return types.MethodType(convert_outputs_to_fp32(context(forward.__func__)),
                            forward.__self__)


def hidden_forward(inner, backbone_attr: str):
    """``inner`` (a bound forward) that, called with ``astrai_hidden_states=True``, runs only
    the backbone and returns its output (``last_hidden_state``), still through ``__call__``;
    called with ``astrai_loss=fn``, returns ``fn(that output)`` computed inside the forward,
    where FSDP2 has gathered the LM head's weight."""
    def forward(self, *args, astrai_hidden_states=False, astrai_loss=None, **kwargs):
        if astrai_hidden_states or astrai_loss is not None:
            kwargs["use_cache"] = False
            output = getattr(self, backbone_attr)(*args, **kwargs)
            return output if astrai_loss is None else astrai_loss(output)
        return inner(*args, **kwargs)

    return functools.update_wrapper(forward, getattr(inner, "__func__", inner))


def make_forward(trl_forward, head: TRLHead, backend: str, chunk_size: Optional[int],
                 sampling: Optional["ak.SamplingParams"] = None):
    """TRL's ``_fused_forward`` contract on ``ak.linear_token_logprobs``; calls without
    ``fused_lm_head`` go to TRL's forward (so to the model's own, e.g. for ``generate``).
    ``sampling``: the log-probs under that processed distribution (``-inf`` outside its
    support); the entropy and statistics stay the full tempered distribution's."""
    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                       num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, fused_lm_head=False, labels=labels,
                               shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)
        if kwargs.get("output_router_logits"):
            raise ValueError(f"astrai_kernels.integrations.trl: {type(self).__name__} was "
                             f"called with output_router_logits=True; the MoE load-balancing "
                             f"loss is not served (uninstall to use TRL's head)")
        kwargs["use_cache"] = False
        last = getattr(self, head.backbone_attr)(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = last[:, :-1], labels[:, 1:]
        else:
            hidden, labels = last, shift_labels
        return _head_output(self.get_output_embeddings(), hidden, labels, num_items_in_batch,
                            head, dict(chunk_size=chunk_size, backend=backend), sampling)

    # generate() validates its keywords against the forward's signature: the model's own
    return functools.update_wrapper(_fused_forward, getattr(trl_forward, "__func__", trl_forward))


def _head_output(lm_head: nn.Module, hidden: Tensor, labels: Tensor, num_items_in_batch,
                 head: TRLHead, options: Dict[str, Any],
                 sampling: Optional["ak.SamplingParams"] = None):
    """TRL's ``FusedCausalLMOutput`` of the labelled positions (fields 0 elsewhere)."""
    from trl.trainer.utils import FusedCausalLMOutput

    weight, bias = lm_head.weight, lm_head.bias
    contract.check_gathered(weight)
    labels = labels.to(weight.device)
    mask = labels != -100
    fields = (_token_fields(hidden.to(weight.device), weight, bias, labels, mask, head, options)
              if sampling is None else
              _sampled_token_fields(hidden.to(weight.device), weight, bias, labels, mask, head,
                                    options, sampling))

    def scatter(values):
        # masked_scatter keeps the output connected to the model with no label at all
        return None if values is None else values.new_zeros(mask.shape).masked_scatter(
            mask, values)

    fields = {name: scatter(values) for name, values in fields.items()}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / count
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=None, **fields)


def _token_fields(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                  mask: Tensor, head: TRLHead, options: Dict[str, Any]) -> Dict[str, Tensor]:
    """The per-token fields TRL's head was set up to compute, on the labelled rows."""
    with_entropy = "entropy" in head.outputs
    statistics = tuple(name for name in STATISTICS if name in head.outputs)
    dtype = contract.compute_dtype(hidden, head.cast_lm_head_to_fp32)
    with torch.autocast(hidden.device.type, enabled=False):
        result = ak.linear_token_logprobs(
            hidden[mask].to(dtype), weight.to(dtype), labels[mask],
            bias=None if bias is None else bias.to(dtype), temperature=head.temperature,
            return_entropy=with_entropy, softcap=head.softcap, logit_scale=head.logit_scale,
            statistics=statistics, **options)
    if not isinstance(result, tuple):
        result = (result,)
    stats = result[-1] if statistics else {}
    return {"log_probs": result[0], "entropy": result[1] if with_entropy else None,
            **{name: stats.get(name) for name in STATISTICS}}


def _sampled_token_fields(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                          mask: Tensor, head: TRLHead, options: Dict[str, Any],
                          sampling: "ak.SamplingParams") -> Dict[str, Tensor]:
    """The per-token fields with ``log_probs`` under ``sampling`` (``-inf`` outside its
    support, differentiable); the entropy and statistics TRL's head computes are the full
    tempered distribution's, from a second walk without gradient (``sampling=`` returns
    neither)."""
    dtype = contract.compute_dtype(hidden, head.cast_lm_head_to_fp32)
    rows, target = hidden[mask].to(dtype), labels[mask]
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    transform = dict(bias=bias, softcap=head.softcap, logit_scale=head.logit_scale, **options)
    with torch.autocast(hidden.device.type, enabled=False):
        logp = ak.linear_token_logprobs(rows, weight, target, sampling=sampling, **transform)
        fields = {"log_probs": logp, "entropy": None, **dict.fromkeys(STATISTICS)}
        with_entropy = "entropy" in head.outputs
        statistics = tuple(name for name in STATISTICS if name in head.outputs)
        if with_entropy or statistics:
            with torch.no_grad():
                result = ak.linear_token_logprobs(
                    rows, weight, target, temperature=head.temperature,
                    return_entropy=with_entropy, statistics=statistics, **transform)
            stats = result[-1] if statistics else {}
            fields.update(entropy=result[1] if with_entropy else None,
                          **{name: stats.get(name) for name in statistics})
    return fields
