"""Hugging Face transformers causal LMs on the fused LM head (the optional extra ``transformers``).

``patch(model, **loss_options)`` replaces one model instance's ``forward``: while the model
is training and ``labels`` are given, it runs the decoder (``model.<base_model_prefix>``), takes
the final hidden states and ``model.get_output_embeddings()``, and computes the loss with
``ak.linear_cross_entropy`` as transformers' ``ForCausalLMLoss`` does (labels shifted by one,
``ignore_index=-100``, ``num_items_in_batch`` as the normalizer, ``shift_labels``,
``logits_to_keep``), without ever forming the ``[N, V]`` logits: the output has ``logits=None``.
Without labels, or in eval mode, the model's own forward runs unchanged. ``unpatch(model)``
restores it.

One forward serves every decoder-only model whose own forward follows transformers' pattern
``hidden = self.<base_model_prefix>(...)[0]``, ``logits = self.<head>(hidden)``,
``loss = self.loss_function(logits, labels, ...)``. The transforms of the logits that forward may
apply are recognised in its source and reproduced: Gemma-style ``final_logit_softcapping`` (the
ops' ``softcap``), ``logits * self.logit_scale`` (Cohere) and ``logits / config.logits_scaling``
(Granite), both a scale of the hidden states and the bias. A model whose forward does anything
else to its logits or its loss (a MoE router loss, a custom ``loss_function``, an
encoder-decoder) is refused at ``patch`` with the reason.

``token_logprobs(model, input_ids, attention_mask=None, ...)``: the per-token log-probs of
``input_ids[:, 1:]`` through the fused head, what RL trainers compute for the policy (with grad)
and the old and reference models (under ``torch.no_grad()``).

transformers is imported only inside the functions that need it; ``import astrai_kernels`` never
imports it.
"""

import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import astrai_kernels as ak

#: The keywords ``patch`` passes on to ``ak.linear_cross_entropy``.
LOSS_OPTIONS = ("z_loss", "label_smoothing", "backend", "chunk_size")
#: Keywords transformers' loss function reads from the forward's ``**kwargs``.
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
_STATE_ATTR = "_astrai_kernels_patch"

_HEAD_CALL = "self.{head}("
_SOFTCAP_LINES = (r"logits / self\.config\.final_logit_softcapping", r"torch\.tanh\(logits\)",
                  r"logits \* self\.config\.final_logit_softcapping")
_SCALE_LINES = {r"logits \* self\.logit_scale": "logit_scale",
                r"logits / self\.config\.logits_scaling": "logits_scaling"}
_HARMLESS_LINES = (r"logits\.float\(\)",)


@dataclass(frozen=True)
class _ClassPlan:
    """What the source of a model class's forward does between its decoder and its loss."""
    head_name: str
    softcap: bool
    scales: Tuple[str, ...]


@dataclass(frozen=True)
class FusedHead:
    """A model's output embedding as the ``linear_*`` ops take it.

    ``logits = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)``; ``softcap``
    and ``bias`` may be None, ``logit_scale`` is 1.0 when the model has none.
    """
    weight: Tensor
    bias: Optional[Tensor]
    logit_scale: float
    softcap: Optional[float]

    def inputs(self, hidden: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """``(hidden, bias)`` with the logit scale folded in, in the weight's dtype."""
        bias = self.bias
        if self.logit_scale != 1.0:
            hidden = hidden * self.logit_scale
            bias = None if bias is None else bias * self.logit_scale
        # Under autocast the decoder may hand back another dtype than the head's; the head
        # computes in its own dtype, as nn.Linear does outside autocast.
        return hidden.to(self.weight.dtype), bias


def _refuse(model: nn.Module, reason: str) -> ValueError:
    return ValueError(f"astrai_kernels.integrations.transformers cannot serve "
                      f"{type(model).__name__}: {reason}")


@functools.lru_cache(maxsize=None)
def _class_plan(model_class: type, head_name: str) -> Union[_ClassPlan, str]:
    """Read ``model_class.forward``'s source; the plan, or why the fused head cannot serve it."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError) as error:
        return f"the source of its forward is not available to check ({error})"
    if "loss_function(" not in source:
        return "its forward does not compute the loss with self.loss_function"
    if "aux_loss" in source:
        return ("its forward adds an auxiliary (router) loss to the language-model loss, which "
                "the patched forward would drop")
    head_call = _HEAD_CALL.format(head=head_name)
    if head_call not in source:
        return f"its forward does not call its output embedding as {head_call}...)"
    softcap, scales = False, []
    for match in re.finditer(r"^\s*logits\s*=\s*(.+?)\s*$", source, flags=re.MULTILINE):
        rhs = match.group(1).split("#", 1)[0].rstrip()
        if rhs.endswith(","):
            continue  # a keyword argument (``CausalLMOutputWithPast(logits=logits, ...)``)
        if head_call in rhs or any(re.fullmatch(p, rhs) for p in _HARMLESS_LINES):
            continue
        if any(re.fullmatch(p, rhs) for p in _SOFTCAP_LINES):
            softcap = True
            continue
        scale = next((name for p, name in _SCALE_LINES.items() if re.fullmatch(p, rhs)), None)
        if scale is None:
            return (f"its forward transforms the logits with `logits = {rhs}`, which the fused "
                    f"head does not reproduce")
        scales.append(scale)
    return _ClassPlan(head_name, softcap, tuple(scales))


def _plan(model: nn.Module) -> _ClassPlan:
    """Check that ``model`` is a decoder-only causal LM the generic forward serves."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers PreTrainedModel (an nn.Module), got "
                        f"{type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise _refuse(model, "it is not a transformers model (no config / "
                             "get_output_embeddings)")
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model, "it is an encoder-decoder model; only decoder-only causal LMs "
                             "are supported")
    decoder = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise _refuse(model, f"it has no decoder at model.{model.base_model_prefix}")
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or type(head).forward is not \
            nn.Linear.forward:
        raise _refuse(model, f"its output embedding is {type(head).__name__}, not an "
                             f"nn.Linear-like [vocab, hidden] projection")
    head_name = next((name for name, child in model.named_children() if child is head), None)
    if head_name is None:
        raise _refuse(model, "its output embedding is not a direct submodule")
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        raise _refuse(model, f"its loss_function is "
                             f"{getattr(loss_function, '__name__', loss_function)!r}, not "
                             f"transformers' ForCausalLMLoss")
    parameters = inspect.signature(type(model).forward).parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in parameters]
    if missing:
        raise _refuse(model, f"its forward has no {missing} parameter(s)")
    plan = _class_plan(type(model), head_name)
    if isinstance(plan, str):
        raise _refuse(model, plan)
    return plan


def fused_head(model: nn.Module) -> FusedHead:
    """The output embedding of a transformers causal LM, with its logit scale and softcap."""
    plan = _plan(model)
    head = getattr(model, plan.head_name)
    config = model.config
    scale = 1.0
    for name in plan.scales:
        if name == "logit_scale":
            scale *= float(model.logit_scale)
        else:
            scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None) if plan.softcap else None
    return FusedHead(head.weight, head.bias, scale, None if softcap is None else float(softcap))


def _decoder(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def hidden_states(model: nn.Module, input_ids: Optional[Tensor] = None,
                  attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                  **decoder_kwargs: Any):
    """The decoder's output (``[0]`` is the final hidden states ``[B, T, H]``), no logits."""
    return _decoder(model)(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **decoder_kwargs)


def _keep(tensor: Tensor, logits_to_keep) -> Tensor:
    """``tensor [B, T, ...]`` at the positions transformers keeps for ``logits_to_keep``."""
    from transformers import modeling_utils

    slicer = getattr(modeling_utils, "slice_logits_to_keep", None)
    if slicer is not None:
        return slicer(tensor, logits_to_keep)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return tensor[:, logits_to_keep]


def _fused_loss(head: FusedHead, hidden: Tensor, target: Tensor, ignore_index: int,
                num_items_in_batch, options: Dict[str, Any]) -> Tensor:
    hidden, bias = head.inputs(hidden)
    normalizer = num_items_in_batch
    if isinstance(normalizer, Tensor):
        normalizer = normalizer.to(hidden.device)
    return ak.linear_cross_entropy(hidden, head.weight, target.to(hidden.device), bias=bias,
                                   ignore_index=ignore_index, reduction="mean",
                                   softcap=head.softcap, normalizer=normalizer, **options)


def _make_forward(original_function):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, logits_to_keep=0, **kwargs):
        state = self.__dict__[_STATE_ATTR]
        if "fused_lm_head" in kwargs:
            raise ValueError(f"{type(self).__name__} (patched by astrai_kernels.integrations."
                             f"transformers) was called with TRL's fused_lm_head=...; serve TRL's "
                             f"trainers with astrai_kernels.integrations.trl.install(trainer)")
        if labels is None or not self.training:
            return state["original"](input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids, inputs_embeds=inputs_embeds,
                                     labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        return_dict = kwargs.pop("return_dict", None)
        outputs = hidden_states(self, input_ids, attention_mask, position_ids,
                                inputs_embeds=inputs_embeds, **kwargs)
        hidden = _keep(outputs[0], logits_to_keep)
        if shift_labels is None:
            # transformers' ForCausalLMLoss: position t predicts labels[t + 1], the last nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            target = _keep(shift_labels.unsqueeze(-1), logits_to_keep).squeeze(-1)
        else:
            target = shift_labels
        if tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"{type(self).__name__} (patched): shift_labels must have the shape "
                             f"of the kept positions {tuple(hidden.shape[:-1])}, got "
                             f"{tuple(target.shape)}")
        loss = _fused_loss(fused_head(self), hidden, target, ignore_index, num_items_in_batch,
                           state["options"])
        fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
        extra = {key: value for key, value in outputs.items()
                 if key != "last_hidden_state" and key in fields}
        output = CausalLMOutputWithPast(loss=loss, logits=None, **extra)
        if return_dict is False or (return_dict is None
                                    and not getattr(self.config, "return_dict", True)):
            return output.to_tuple()
        return output

    # Callers that inspect the signature (transformers.Trainer looks for **kwargs to pass
    # num_items_in_batch, and for the dataset columns) see the model's own.
    functools.update_wrapper(forward, original_function)
    return forward


def _check_options(head: FusedHead, options: Dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(LOSS_OPTIONS))
    if unknown:
        raise TypeError(f"patch: unknown loss option(s) {unknown}; it takes {list(LOSS_OPTIONS)}")
    # Let the op check the values now, on a one-row problem, rather than at the first step.
    probe_weight = head.weight.new_zeros(2, 1)
    probe_target = torch.zeros(1, dtype=torch.long, device=probe_weight.device)
    with torch.no_grad():
        ak.linear_cross_entropy(probe_weight.new_zeros(1, 1), probe_weight, probe_target,
                                softcap=head.softcap, **options)


def _refuse_trl_head(model: nn.Module) -> None:
    """A model (or a submodule: a PEFT base) carrying TRL's fused LM head, or the one
    ``integrations.trl.install`` put in its place, is served by TRL's trainer calls with
    ``fused_lm_head=True``, which a patched forward would not understand."""
    if not isinstance(model, nn.Module):
        return
    for module in model.modules():
        forward = module.__dict__.get("forward")
        function = getattr(forward, "__func__", None)
        code = getattr(function, "__code__", None)
        if getattr(code, "co_name", None) == "_fused_forward" or \
                "_astrai_kernels_trl" in module.__dict__:
            raise ValueError(
                f"patch: this {type(model).__name__} carries TRL's fused LM head "
                f"(add_fused_lm_head, set up by a TRL trainer); patching it would break the "
                f"trainer's fused_lm_head=True calls. Use "
                f"astrai_kernels.integrations.trl.install(trainer) to serve them instead")


def patch(model: nn.Module, **loss_options: Any) -> nn.Module:
    """Make ``model`` (a transformers causal LM instance) compute its training loss through the
    fused LM head; returns the model.

    ``loss_options``: ``z_loss``, ``label_smoothing``, ``backend``, ``chunk_size`` of
    ``ak.linear_cross_entropy`` (``label_smoothing`` and ``z_loss`` change the loss from the
    model's own; the defaults reproduce it). Raises ``ValueError`` for a model the generic forward
    cannot serve, saying why, and for a model already patched.
    """
    if isinstance(model, nn.Module) and _STATE_ATTR in model.__dict__:
        raise ValueError(f"patch: this {type(model).__name__} is already patched; call "
                         f"unpatch(model) first to change its loss options")
    _refuse_trl_head(model)
    head = fused_head(model)
    _check_options(head, loss_options)
    original_function = type(model).forward
    state = {"original": model.forward, "options": dict(loss_options),
             "instance_forward": model.__dict__.get("forward")}
    model.__dict__[_STATE_ATTR] = state
    model.forward = _make_forward(original_function).__get__(model)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the forward ``model`` had before :func:`patch`; returns the model."""
    state = model.__dict__.get(_STATE_ATTR) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"unpatch: this {type(model).__name__} is not patched")
    if state["instance_forward"] is None:
        del model.__dict__["forward"]
    else:
        model.forward = state["instance_forward"]
    del model.__dict__[_STATE_ATTR]
    return model


def is_patched(model: nn.Module) -> bool:
    return isinstance(model, nn.Module) and _STATE_ATTR in model.__dict__


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                   *, temperature: float = 1.0, return_entropy: bool = False,
                   backend: str = "auto", position_ids: Optional[Tensor] = None,
                   chunk_size: Optional[int] = None):
    """Log-probs ``[B, T-1]`` (float32) of ``input_ids[:, 1:]`` under ``model`` at
    ``temperature``, through the fused head (no logits); with ``return_entropy=True`` also the
    entropy of each position's distribution.

    Positions whose next token is padding (``attention_mask[:, 1:] == 0``) get 0 and no gradient;
    so does, in a packed row (``position_ids`` restarting per sequence, no ``attention_mask``),
    the last position of each sequence, whose next token starts another sequence.
    The model's logit scale and final soft-cap (Gemma 2) apply before the temperature.
    Differentiable (the policy); run it under ``torch.no_grad()`` for old and reference models.
    The model need not be patched.
    """
    head = fused_head(model)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"token_logprobs: input_ids must be [B, T] with T >= 2, got {shape}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"token_logprobs: attention_mask must have input_ids' shape "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    outputs = hidden_states(model, input_ids, attention_mask, position_ids, use_cache=False)
    hidden, bias = head.inputs(outputs[0][:, :-1])
    target = input_ids[:, 1:]
    if attention_mask is not None:
        target = target.masked_fill(attention_mask[:, 1:] == 0, -100)
    elif position_ids is not None:
        # A packed row (no attention_mask; position_ids restart per sequence): transformers
        # keeps the sequences apart where position_ids do not step by 1
        # (masking_utils.find_packed_sequence_indices); a sequence's first token is not
        # predicted from the previous sequence's last.
        positions = position_ids.expand_as(input_ids)
        target = target.masked_fill(positions[:, 1:] - positions[:, :-1] != 1, -100)
    return ak.linear_token_logprobs(hidden, head.weight, target, bias=bias,
                                    temperature=temperature, ignore_index=-100,
                                    return_entropy=return_entropy, softcap=head.softcap,
                                    chunk_size=chunk_size, backend=backend)
