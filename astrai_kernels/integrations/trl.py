"""TRL's trainers on the fused LM head (the optional extra ``trl``; tested with TRL 1.16.0).

TRL 1.16 gives every model its trainers score (the policy, or its PEFT base; ``ref_model``) a
fused LM head of its own, ``trl.trainer.utils.add_fused_lm_head``: the model's ``forward``
becomes one that, called with ``fused_lm_head=True`` and ``labels``, runs the backbone and
``ChunkedLogProbFunction`` on the labelled positions and returns a ``FusedCausalLMOutput``.

``install(trainer)`` replaces, on each of those models, TRL's forward by one with the same
contract that computes the per-token fields with ``ak.linear_token_logprobs``:

* keywords ``fused_lm_head``, ``labels``, ``shift_labels``, ``num_items_in_batch``; labels
  shifted by one unless ``shift_labels`` is given; only positions whose label is not -100 reach
  the head (``hidden[mask]``), the fields are 0 elsewhere;
* the fields TRL's head was set up to compute (its ``outputs``: ``entropy``,
  ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), ``log_probs``, ``label_mask`` and
  ``loss = -sum(log_probs) / (num_items_in_batch or the label count)``;
* the temperature TRL's head was given, the model's logit scale and final soft-cap as TRL
  read them (``logit_scale`` / ``output_multiplier`` / ``lm_head_multiplier`` /
  ``logits_scaling``, ``final_logit_softcapping``), in TRL's order (scale, cap, temperature);
* TRL's compute dtype: the autocast dtype under autocast, float32 with
  ``cast_lm_head_to_fp32``, else the hidden states'.

On a ``GKDTrainer`` (``trl.experimental.gkd``), whose loss reads full logits, ``install``
also replaces that trainer's ``compute_loss`` by ``ak.linear_distill_loss`` on the student's
and the teacher's final hidden states (``_gkd_compute_loss``: the trainer's ``beta``,
temperature 1 and ``batchmean`` or ``num_items_in_batch`` as TRL's ``generalized_jsd_loss``
there, each model's logit scale and soft-cap); the models are called through ``__call__`` with
``astrai_hidden_states=True``, which their installed forward answers with the backbone's output.

On a ``DistillationTrainer`` (``trl.DistillationTrainer``), whose models carry no TRL head,
``install`` gives the trainer TRL's own ``_compute_loss`` (its inputs, backbone calls, logit
scales and soft-caps) with the one global name ``_chunked_divergence_loss`` resolved to
``_distillation_divergence_loss``: ``ak.linear_distill_loss`` on the completion positions with
the trainer's ``beta`` and ``temperature``, divided by ``num_items_in_batch`` or the position
count, each head in its hidden states' (or the autocast) dtype, and the logged student entropy
from ``ak.linear_token_logprobs`` (one more walk of the student head, no gradient). Refused:
no local ``teacher_model`` (``ServerDistillationTrainer``: a vLLM teacher's top-k log-probs, a
sparse divergence), a subclass overriding ``compute_loss`` or ``_compute_loss``, a TRL whose
``_compute_loss`` does not call ``_chunked_divergence_loss`` with 1.16's arguments, ``beta``
outside [0, 1], ``temperature <= 0``, heads of different vocabularies or DTensor heads.

Calls without ``fused_lm_head`` go to TRL's forward (so to the model's own, e.g. for
``generate``). The models are still called through ``model(...)``, so hooks run. TRL's
settings are read from its forward's closure, which is why ``install`` checks TRL's version
and the closure's names and refuses anything else. Refused at ``install``, with the reason:
a TRL other than 1.16, a trainer whose models carry no TRL fused head, a GKD trainer whose
``compute_loss`` is overridden or whose models ``integrations.transformers.fused_head``
cannot serve, a MoE model whose config asks for router logits (the aux loss is not reproduced),
an output embedding that is not a plain ``nn.Linear`` (e.g. a LoRA-adapted ``lm_head``),
FSDP and DeepSpeed (sharded heads are not gathered here). A model that asks for router logits
at call time gets an error, never TRL's head silently.

TRL is imported only when these functions run; ``import astrai_kernels`` never imports it.
"""

import functools
import inspect
import math
import types
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

#: The TRL versions whose fused-head contract this module reproduces.
TESTED_TRL = ("1.16.",)
#: The names TRL 1.16's ``_fused_forward`` closes over (its settings).
_TRL_CLOSURE = frozenset({"original_forward", "text_config", "backbone_attr",
                          "cast_lm_head_to_fp32", "temperature", "outputs",
                          "final_logit_softcapping", "logit_scale"})
_TRL_OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits",
                      "is_top1", "label_mask", "aux_loss")
_STATISTICS = ("log_sum_sq_probs", "mean_logits", "is_top1")
_OUTPUTS = ("log_probs", "entropy") + _STATISTICS
_MODEL_STATE = "_astrai_kernels_trl"
_TRAINER_STATE = "_astrai_kernels_trl_models"


class TRLHeadError(ValueError):
    """``install`` cannot serve this trainer exactly; the message says why."""


def _refuse(trainer, reason: str) -> TRLHeadError:
    return TRLHeadError(f"astrai_kernels.integrations.trl cannot serve "
                        f"{type(trainer).__name__}: {reason}")


def _trl_version() -> str:
    import trl

    return trl.__version__


def trl_head_settings(model: nn.Module) -> Optional[Dict[str, Any]]:
    """The settings of TRL's fused head on ``model`` (its forward's closure), or None when
    ``model``'s forward is not TRL's ``add_fused_lm_head`` forward."""
    forward = model.__dict__.get("forward") if isinstance(model, nn.Module) else None
    function = getattr(forward, "__func__", None)
    if getattr(function, "__code__", None) is not _trl_forward_code():
        return None
    names = function.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, function.__closure__ or ())}


def _trl_forward_code():
    """The code object of the forward ``add_fused_lm_head`` defines (functools.wraps gives
    that forward the model's name, so it is recognised by its code)."""
    from trl.trainer import utils

    return next((const for const in utils.add_fused_lm_head.__code__.co_consts
                 if isinstance(const, types.CodeType) and const.co_name == "_fused_forward"),
                None)


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
            if _MODEL_STATE in module.__dict__ or trl_head_settings(module) is not None:
                found.append(module)
    return found


def _check_contract(trainer) -> None:
    version = _trl_version()
    if not version.startswith(TESTED_TRL):
        raise _refuse(trainer, f"TRL {version} is installed; the fused-head contract served "
                               f"here is TRL {', '.join(v + 'x' for v in TESTED_TRL)}'s")
    from trl.trainer.utils import FusedCausalLMOutput

    fields = tuple(FusedCausalLMOutput.__dataclass_fields__)
    if fields != _TRL_OUTPUT_FIELDS:
        raise _refuse(trainer, f"TRL's FusedCausalLMOutput has fields {fields}, not "
                               f"{_TRL_OUTPUT_FIELDS}")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled",
                                                             False):
        raise _refuse(trainer, "it runs under FSDP or DeepSpeed; their sharded LM heads are not "
                               "gathered by this integration")


def _check_model(trainer, model: nn.Module, settings: Dict[str, Any]) -> None:
    missing = _TRL_CLOSURE - set(settings)
    extra = set(settings) - _TRL_CLOSURE
    if missing or extra:
        raise _refuse(trainer, f"TRL's fused head on {type(model).__name__} has the settings "
                               f"{sorted(settings)}, not TRL 1.16's {sorted(_TRL_CLOSURE)}")
    name = type(model).__name__
    if getattr(settings["text_config"], "output_router_logits", False):
        raise _refuse(trainer, f"{name}'s config asks for router logits (a MoE load-balancing "
                               f"loss), which this head does not return")
    unknown = set(settings["outputs"]) - set(_OUTPUTS)
    if unknown:
        raise _refuse(trainer, f"TRL's head on {name} asks for outputs {sorted(unknown)}")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module) or type(head).forward is not nn.Linear.forward:
        raise _refuse(trainer, f"{name}'s output embedding is {type(head).__name__}, not a plain "
                               f"nn.Linear (a LoRA-adapted lm_head is not served)")
    from torch.distributed.tensor import DTensor

    if isinstance(head.weight, DTensor):
        raise _refuse(trainer, f"{name}'s LM head weight is a DTensor (sharded)")
    temperature = settings["temperature"]
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise _refuse(trainer, f"temperature {temperature!r} is not a positive number")
    scale = settings["logit_scale"]
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise _refuse(trainer, f"{name}'s logit scale {scale!r} is not a finite number")
    softcap = settings["final_logit_softcapping"]
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise _refuse(trainer, f"{name}'s final_logit_softcapping {softcap!r} is not positive")


def _compute_dtype(hidden: Tensor, cast_lm_head_to_fp32: bool) -> torch.dtype:
    """TRL's: float32 with ``cast_lm_head_to_fp32``, the autocast dtype under autocast, else
    the hidden states'."""
    device_type = hidden.device.type
    if cast_lm_head_to_fp32:
        return torch.float32
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _make_forward(trl_forward, settings: Dict[str, Any], backend: str,
                  chunk_size: Optional[int]):
    outputs = tuple(settings["outputs"])
    with_entropy = "entropy" in outputs
    statistics = tuple(name for name in _STATISTICS if name in outputs)
    temperature = float(settings["temperature"])
    logit_scale = float(settings["logit_scale"])
    softcap = settings["final_logit_softcapping"]
    softcap = None if softcap is None else float(softcap)
    backbone_attr = settings["backbone_attr"]
    cast_lm_head_to_fp32 = bool(settings["cast_lm_head_to_fp32"])

    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                       num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, fused_lm_head=False, labels=labels,
                               shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)
        from trl.trainer.utils import FusedCausalLMOutput

        if kwargs.get("output_router_logits"):
            raise ValueError(f"astrai_kernels.integrations.trl: {type(self).__name__} was "
                             f"called with output_router_logits=True; the MoE load-balancing "
                             f"loss is not served (uninstall to use TRL's head)")
        kwargs["use_cache"] = False
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:
            hidden = backbone_outputs.last_hidden_state[:, :-1]
            labels = labels[:, 1:]
        else:
            hidden = backbone_outputs.last_hidden_state
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        hidden = hidden.to(weight.device)
        labels = labels.to(weight.device)
        mask = labels != -100
        dtype = _compute_dtype(hidden, cast_lm_head_to_fp32)
        with torch.autocast(hidden.device.type, enabled=False):
            rows = hidden[mask].to(dtype)
            result = ak.linear_token_logprobs(
                rows, weight.to(dtype), labels[mask], bias=None if bias is None else
                bias.to(dtype), temperature=temperature, return_entropy=with_entropy,
                softcap=softcap, logit_scale=logit_scale, statistics=statistics,
                chunk_size=chunk_size, backend=backend)
        if not isinstance(result, tuple):
            result = (result,)
        stats = result[-1] if statistics else {}
        log_probs = result[0]
        entropy = result[1] if with_entropy else None

        def scatter(values):
            # masked_scatter keeps the output connected to the model with no label at all
            return None if values is None else values.new_zeros(mask.shape).masked_scatter(
                mask, values)

        log_probs = scatter(log_probs)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=scatter(entropy),
            log_sum_sq_probs=scatter(stats.get("log_sum_sq_probs")),
            mean_logits=scatter(stats.get("mean_logits")), is_top1=scatter(stats.get("is_top1")),
            label_mask=mask, aux_loss=None)

    # generate() validates its keywords against the forward's signature: the model's own
    return functools.update_wrapper(_fused_forward, getattr(trl_forward, "__func__", trl_forward))


def _gkd_trainer_class():
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        return None
    return GKDTrainer


def _hidden_forward(inner, backbone_attr: str):
    """``inner`` (a bound forward) that, called with ``astrai_hidden_states=True``, runs only
    the backbone and returns its output (``last_hidden_state``), still through ``__call__``."""
    def forward(self, *args, astrai_hidden_states=False, **kwargs):
        if astrai_hidden_states:
            kwargs["use_cache"] = False
            return getattr(self, backbone_attr)(*args, **kwargs)
        return inner(*args, **kwargs)

    return functools.update_wrapper(forward, getattr(inner, "__func__", inner))


def _gkd_base(trainer) -> nn.Module:
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_gkd(trainer, backend: str) -> None:
    gkd = _gkd_trainer_class()
    if type(trainer).compute_loss is not gkd.compute_loss:
        raise _refuse(trainer, "it overrides GKDTrainer.compute_loss, whose loss is not known here")
    if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
        raise _refuse(trainer, "its teacher_model is not an nn.Module")
    from . import transformers as hf

    for role, model in (("student", _gkd_base(trainer)), ("teacher", trainer.teacher_model)):
        try:
            head = hf.fused_head(model)
        except (TypeError, ValueError) as error:
            raise _refuse(trainer, f"its {role}: {error}") from None
        _resolve_backend(backend, head.weight.device)
    if (_gkd_base(trainer).get_output_embeddings().weight.shape[0]
            != trainer.teacher_model.get_output_embeddings().weight.shape[0]):
        raise _refuse(trainer, "the student's and the teacher's vocabularies differ")


def _gkd_compute_loss(trainer, original, backend: str, chunk_size: Optional[int]):
    """GKDTrainer.compute_loss (TRL 1.16) on ``ak.linear_distill_loss``: the student's and
    the teacher's final hidden states, both models' logit scale and soft-cap, TRL's
    ``generalized_jsd_loss`` with the trainer's ``beta``, temperature 1 (compute_loss passes
    none), ``batchmean`` over labelled positions or ``num_items_in_batch``."""
    from . import transformers as hf

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation wants the student's logits: TRL's own
            return original(model, inputs, return_outputs=True,
                            num_items_in_batch=num_items_in_batch)
        student = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        astrai_hidden_states=True).last_hidden_state[:, :-1]
        trainer.teacher_model.eval()
        with torch.no_grad():
            teacher = trainer.teacher_model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                astrai_hidden_states=True).last_hidden_state[:, :-1]
        labels = inputs["labels"][:, 1:]
        student_head = hf.fused_head(_gkd_base(trainer))
        teacher_head = hf.fused_head(trainer.teacher_model)
        dtype = _compute_dtype(student, False)
        teacher_dtype = _compute_dtype(teacher, False)
        mask = labels.to(student_head.weight.device) != -100
        with torch.autocast(student.device.type, enabled=False):
            def head_args(head, hidden, dtype):
                bias = None if head.bias is None else head.bias.to(dtype)
                return hidden.to(head.weight.device)[mask].to(dtype), head.weight.to(dtype), bias

            s_hidden, s_weight, s_bias = head_args(student_head, student, dtype)
            t_hidden, t_weight, t_bias = head_args(teacher_head, teacher, teacher_dtype)
            normalizer = num_items_in_batch
            if isinstance(normalizer, Tensor):
                normalizer = normalizer.to(s_hidden.device)
            return ak.linear_distill_loss(
                s_hidden, s_weight, t_hidden, t_weight, student_bias=s_bias,
                teacher_bias=t_bias, beta=float(trainer.beta), temperature=1.0,
                reduction="batchmean", normalizer=normalizer,
                softcap=student_head.softcap, logit_scale=student_head.logit_scale,
                teacher_softcap=teacher_head.softcap,
                teacher_logit_scale=teacher_head.logit_scale, chunk_size=chunk_size,
                backend=backend)

    return compute_loss


#: TRL 1.16's ``distillation_trainer._chunked_divergence_loss`` parameters, in order.
_DISTILLATION_LOSS_PARAMETERS = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight",
    "teacher_lm_head_weight", "completion_mask", "beta", "num_items_in_batch",
    "student_lm_head_bias", "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale",
    "student_final_logit_softcapping", "teacher_final_logit_softcapping", "temperature")


def _distillation_trainer(trainer) -> bool:
    """Whether ``trainer`` is a TRL ``DistillationTrainer`` (or a subclass: the deprecated
    ``trl.experimental.distillation`` alias, ``ServerDistillationTrainer``)."""
    if not any(klass.__name__ == "DistillationTrainer" for klass in type(trainer).__mro__):
        return False
    from trl.trainer.distillation_trainer import DistillationTrainer

    return isinstance(trainer, DistillationTrainer)


def _distillation_check(trainer, backend: str, chunk_size: Optional[int]) -> None:
    from torch.distributed.tensor import DTensor
    from trl.trainer import distillation_trainer as trl_distillation

    base = trl_distillation.DistillationTrainer
    if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
        raise _refuse(trainer, "it has no local teacher_model (ServerDistillationTrainer's teacher "
                               "is a vLLM server returning top-k log-probs: a sparse divergence, "
                               "not the full-vocabulary one of linear_distill_loss)")
    for name in ("compute_loss", "_compute_loss"):
        if getattr(type(trainer), name) is not getattr(base, name):
            raise _refuse(trainer, f"it overrides DistillationTrainer.{name}, whose loss is not "
                                   f"known here")
    loss_function = getattr(trl_distillation, "_chunked_divergence_loss", None)
    code = base._compute_loss.__code__
    try:
        parameters = tuple(inspect.signature(loss_function).parameters)
    except TypeError:
        parameters = None
    if (parameters != _DISTILLATION_LOSS_PARAMETERS or code.co_freevars
            or "_chunked_divergence_loss" not in code.co_names):
        raise _refuse(trainer, "TRL's DistillationTrainer._compute_loss does not call "
                               "_chunked_divergence_loss(" + ", ".join(
                                   _DISTILLATION_LOSS_PARAMETERS) + ") as TRL 1.16's does")
    beta, temperature = trainer.beta, trainer.temperature
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise _refuse(trainer, f"beta {beta!r} is not a number in [0, 1]")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise _refuse(trainer, f"temperature {temperature!r} is not a positive number")
    if chunk_size is not None and (not isinstance(chunk_size, int)
                                   or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    vocabularies = []
    for role, model in (("student", trainer.model), ("teacher", trainer.teacher_model)):
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise _refuse(trainer, f"its {role}'s output embedding {type(head).__name__} has no "
                                   f"[V, H] weight")
        if isinstance(weight, DTensor):
            raise _refuse(trainer, f"its {role}'s LM head weight is a DTensor (sharded)")
        _resolve_backend(backend, weight.device)  # an unknown backend fails here
        vocabularies.append(weight.shape[0])
    if vocabularies[0] != vocabularies[1]:
        raise _refuse(trainer, f"the student's and the teacher's LM heads have vocabularies "
                               f"{vocabularies[0]} and {vocabularies[1]}")


def _distillation_divergence_loss(student_hidden_states, teacher_hidden_states,
                                  student_lm_head_weight, teacher_lm_head_weight, completion_mask,
                                  beta, num_items_in_batch=None, student_lm_head_bias=None,
                                  teacher_lm_head_bias=None, student_logit_scale=1.0,
                                  teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                                  teacher_final_logit_softcapping=None, temperature=1.0, *,
                                  backend: str = "auto", chunk_size: Optional[int] = None):
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments, same ``(loss, entropy_sum,
    n_valid)``) on ``ak.linear_distill_loss``: the generalized JSD of ``beta`` at
    ``temperature`` over the positions where ``completion_mask`` is not 0, summed and divided by
    ``num_items_in_batch``, else by their count (at least 1); ``entropy_sum`` is the student's
    entropy at ``temperature`` summed over them (``ak.linear_token_logprobs``, no gradient).
    Each head computes in its hidden states' dtype, or the autocast dtype, as TRL's does."""
    from torch.distributed.tensor import DTensor

    if isinstance(student_lm_head_weight, DTensor) or isinstance(teacher_lm_head_weight, DTensor):
        raise ValueError("astrai_kernels.integrations.trl: a DTensor (sharded) LM head is not "
                         "served (uninstall to use TRL's loss)")
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    normalizer = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(normalizer, Tensor):
        normalizer = normalizer.to(student_hidden_states.device)

    def head_args(hidden, weight, bias):
        dtype = _compute_dtype(hidden, False)
        rows = hidden.reshape(-1, hidden.shape[-1])[valid.to(hidden.device)].to(dtype)
        return rows, weight.to(dtype), None if bias is None else bias.to(dtype)

    with torch.autocast(student_hidden_states.device.type, enabled=False):
        s_rows, s_weight, s_bias = head_args(student_hidden_states, student_lm_head_weight,
                                             student_lm_head_bias)
        t_rows, t_weight, t_bias = head_args(teacher_hidden_states, teacher_lm_head_weight,
                                             teacher_lm_head_bias)
        student = dict(temperature=float(temperature), softcap=student_final_logit_softcapping,
                       logit_scale=float(student_logit_scale), chunk_size=chunk_size,
                       backend=backend)
        loss = ak.linear_distill_loss(
            s_rows, s_weight, t_rows, t_weight, student_bias=s_bias, teacher_bias=t_bias,
            beta=float(beta), reduction="batchmean", normalizer=normalizer,
            teacher_softcap=teacher_final_logit_softcapping,
            teacher_logit_scale=float(teacher_logit_scale), **student)
        with torch.no_grad():  # the logged entropy; any in-range target serves
            _, entropy = ak.linear_token_logprobs(
                s_rows, s_weight, s_rows.new_zeros(s_rows.shape[0], dtype=torch.long),
                bias=s_bias, return_entropy=True, **student)
    return loss, entropy.sum(), n_valid


def _distillation_compute_loss(trainer, backend: str, chunk_size: Optional[int]):
    """TRL's own ``DistillationTrainer._compute_loss`` (its inputs, backbone calls, heads,
    logit scales and soft-caps, ``beta``, ``temperature``), bound to ``trainer``, whose
    ``_chunked_divergence_loss`` is ``_distillation_divergence_loss``: TRL's function body run
    with that one global name resolved to ours, nothing of TRL's module changed."""
    from trl.trainer.distillation_trainer import DistillationTrainer

    original = DistillationTrainer._compute_loss
    namespace = dict(original.__globals__)
    namespace["_chunked_divergence_loss"] = functools.partial(
        _distillation_divergence_loss, backend=backend, chunk_size=chunk_size)
    function = types.FunctionType(original.__code__, namespace, original.__name__,
                                  original.__defaults__)
    function.__kwdefaults__ = original.__kwdefaults__
    return types.MethodType(functools.update_wrapper(function, original), trainer)


def _distillation_install(trainer, backend: str, chunk_size: Optional[int]):
    _distillation_check(trainer, backend, chunk_size)
    trainer._compute_loss = _distillation_compute_loss(trainer, backend, chunk_size)
    trainer.__dict__[_TRAINER_STATE] = []  # no model's forward is replaced
    return trainer


def install(trainer, *, backend: str = "auto", chunk_size: Optional[int] = None):
    """Serve every fused-head call of ``trainer`` (a built TRL 1.16 trainer) with
    ``ak.linear_token_logprobs``; returns the trainer. Raises ``TRLHeadError`` (a
    ``ValueError``) saying why when it cannot serve the trainer exactly (module docstring)."""
    if is_installed(trainer):
        raise _refuse(trainer, "install was already called on it; uninstall first")
    _check_contract(trainer)
    if _distillation_trainer(trainer):  # its loss reads both LM heads directly: no fused head
        return _distillation_install(trainer, backend, chunk_size)
    models = _served_models(trainer)
    if not models:
        raise _refuse(trainer, "none of its models (model, ref_model, teacher_model) carries "
                               "TRL's fused LM head (add_fused_lm_head): the trainer scores "
                               "full logits, so there is nothing to serve")
    plans = []
    for model in models:
        if _MODEL_STATE in model.__dict__:
            raise _refuse(trainer, f"its {type(model).__name__} is already served by another "
                                   f"trainer's install")
        settings = trl_head_settings(model)
        _check_model(trainer, model, settings)
        head = model.get_output_embeddings()
        _resolve_backend(backend, head.weight.device)  # an unknown backend fails here
        if chunk_size is not None and (not isinstance(chunk_size, int)
                                       or isinstance(chunk_size, bool) or chunk_size < 1):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
        plans.append((model, settings))
    # trl.experimental warns on import: only a trainer that may be a GKDTrainer imports it
    maybe_gkd = any(klass.__name__ == "GKDTrainer" for klass in type(trainer).__mro__)
    gkd = _gkd_trainer_class() if maybe_gkd else None
    is_gkd = gkd is not None and isinstance(trainer, gkd)
    if is_gkd:
        _check_gkd(trainer, backend)
    for model, settings in plans:
        trl_forward = model.__dict__["forward"]
        model.__dict__[_MODEL_STATE] = {"trl_forward": trl_forward, "settings": settings}
        forward = types.MethodType(_make_forward(trl_forward, settings, backend, chunk_size),
                                   model)
        if is_gkd and model is _gkd_base(trainer):
            forward = types.MethodType(_hidden_forward(forward, settings["backbone_attr"]),
                                       model)
        model.forward = forward
    served = [model for model, _ in plans]
    if is_gkd:
        teacher = trainer.teacher_model
        teacher.__dict__[_MODEL_STATE] = {"trl_forward": teacher.__dict__.get("forward")}
        teacher.forward = types.MethodType(_hidden_forward(teacher.forward, "base_model"),
                                           teacher)
        trainer.compute_loss = _gkd_compute_loss(trainer, trainer.compute_loss, backend,
                                                 chunk_size)
        served.append(teacher)
    trainer.__dict__[_TRAINER_STATE] = served
    return trainer


def _resolve_backend(backend, device):
    from ..ops._backend import resolve_backend

    return resolve_backend(backend, device)


def uninstall(trainer):
    """Give the trainer's models TRL's own fused head back; returns the trainer."""
    models = trainer.__dict__.get(_TRAINER_STATE)
    if models is None:
        raise ValueError(f"uninstall: {type(trainer).__name__} is not installed")
    for model in models:
        state = model.__dict__.pop(_MODEL_STATE)
        if state["trl_forward"] is None:
            del model.__dict__["forward"]
        else:
            model.forward = state["trl_forward"]
    trainer.__dict__.pop("compute_loss", None)  # GKD's: the class's again
    trainer.__dict__.pop("_compute_loss", None)  # DistillationTrainer's
    del trainer.__dict__[_TRAINER_STATE]
    return trainer


def is_installed(trainer) -> bool:
    return _TRAINER_STATE in getattr(trainer, "__dict__", {})


def served_models(trainer) -> List[nn.Module]:
    """The models ``install`` serves on ``trainer`` (empty when not installed)."""
    return list(trainer.__dict__.get(_TRAINER_STATE, ()))
