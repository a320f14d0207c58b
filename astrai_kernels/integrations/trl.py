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

``install(trainer, fused_loss=True)`` on a ``GRPOTrainer`` also replaces its ``_compute_loss``
(``_grpo_compute_loss``): the policy's final hidden states at the completion positions and its
LM head go into ``ak.linear_grpo_loss`` with TRL's settings as ``ak.GRPOOptions``
(``_grpo_options``), TRL's masks, old/reference log-probs, vLLM importance ratios and
normalisation; the gradient comes out of the loss's own walk (the single-pass kernel for the
clipped surrogate on token ratios), and TRL's metrics are logged under TRL's names from the
same walk's token values (``return_token_values``). What does not map exactly is refused
(``_check_fused_loss``, ``_check_grpo_options``): other trainers (RLOO's ratio is a summed
sequence log-ratio), an overridden loss, multimodal inputs, the entropy bonus, a multi-process
entropy quantile, the off-policy mask with vLLM, VESPO with vLLM bounds excluding 1.

On a ``DistillationTrainer`` (``trl.DistillationTrainer``), whose models carry no TRL head,
``install`` gives the trainer TRL's own ``_compute_loss`` (its inputs, backbone calls, logit
scales and soft-caps) with the one global name ``_chunked_divergence_loss`` resolved to
``_distillation_divergence_loss``: ``ak.linear_distill_loss`` on the completion positions with
the trainer's ``beta`` and ``temperature``, divided by ``num_items_in_batch`` or the position
count, each head in its hidden states' (or the autocast) dtype, and the logged student entropy
from ``ak.linear_token_logprobs`` (one more walk of the student head, no gradient). Refused:
no local ``teacher_model``, a subclass overriding ``compute_loss`` or ``_compute_loss``, a TRL
whose ``_compute_loss`` does not call ``_chunked_divergence_loss`` with 1.16's arguments,
``beta`` outside [0, 1], ``temperature <= 0``, heads of different vocabularies or DTensor heads.

On a ``ServerDistillationTrainer`` (``trl.experimental.server_distillation``: the teacher is a
vLLM server returning top-k log-probs), ``install`` replaces its ``compute_loss``
(``_server_distillation_compute_loss``) by one that keeps TRL's inputs, prompt length, teacher
request (``_get_teacher_token_logprobs_from_server``), slicing, trimming to the teacher's window,
ValueErrors for missing teacher log-probs and division by the gradient-accumulation steps, and
computes the loss with ``ak.linear_topk_distill_loss`` (TRL's top-k support at ``beta == 0``
with ``loss_add_tail`` as ``tail``, ``server_top1_support`` at ``beta > 0``; ``batchmean`` over
the labelled positions) on the student's final hidden states from TRL's own
``_get_last_hidden_state`` through ``_forward_redirection``, only the labelled positions
reaching the head (the logit scale folded into the hidden states). A soft-capped student (that
op has no soft-cap) or one ``integrations.transformers.fused_head`` does not read keeps TRL's
``model(...)`` call and gets ``ak.topk_distill_loss`` on its logits. ``return_outputs=True``
on the hidden-state form runs TRL's own ``compute_loss`` (the caller wants the logits). Refused:
a subclass overriding the loss methods, ``beta`` outside [0, 1], ``temperature <= 0``,
``loss_top_k`` other than TRL's config allows, ``reverse_kl_top_1_mode`` other than
``"sampled"``, a DTensor head.

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
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from ..ops.grpo import CLIPPED_LOSS_TYPES, GLOBAL_COUNT_LOSS_TYPES, LOSS_TYPES
from ..ops.head import check_chunk_size

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


def _is_trl_forward(forward) -> bool:
    function = getattr(forward, "__func__", None)
    return getattr(function, "__code__", None) is _trl_forward_code()


def _trl_forward(model) -> Tuple[Any, bool]:
    """``(TRL's bound forward or None, wrapped)``: ``wrapped`` when accelerate's mixed
    precision wraps it (``prepare_model`` keeps the wrapped forward as ``_original_forward``,
    as TRL's trainers do to ``ref_model`` when they are built)."""
    if not isinstance(model, nn.Module):
        return None, False
    forward = model.__dict__.get("forward")
    if _is_trl_forward(forward):
        return forward, False
    original = model.__dict__.get("_original_forward")
    if forward is not None and _is_trl_forward(original):
        return original, True
    return None, False


def trl_head_settings(model: nn.Module) -> Optional[Dict[str, Any]]:
    """The settings of TRL's fused head on ``model`` (its forward's closure), or None when
    ``model``'s forward is not TRL's ``add_fused_lm_head`` forward (or accelerate's mixed
    precision wrapper of it)."""
    forward, _ = _trl_forward(model)
    if forward is None:
        return None
    function = forward.__func__
    names = function.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, function.__closure__ or ())}


def _mixed_precision_forward(trainer, forward):
    """``forward`` wrapped as accelerate's ``prepare_model`` wraps a forward under mixed
    precision: autocast, outputs converted to float32."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    accelerator = trainer.accelerator
    context = get_mixed_precision_context_manager(accelerator.native_amp,
                                                  accelerator.autocast_handler)
    return types.MethodType(convert_outputs_to_fp32(context(forward.__func__)),
                            forward.__self__)


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


def _policy_model(trainer) -> nn.Module:
    """The trainer's policy: its model, or the PEFT model's base."""
    return _base_model(trainer.model)


def _base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_called_model(trainer, model: nn.Module, served: nn.Module) -> None:
    """Refuse a loss call on a model other than the policy ``install`` served (the trainer's
    model replaced since): that model's forward is TRL's, which knows no hidden-state call."""
    called = _base_model(trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=True))
    if called is not served:
        raise ValueError(f"astrai_kernels.integrations.trl: {type(trainer).__name__}'s loss "
                         f"was called on a {type(called).__name__} that install did not serve "
                         f"(the trainer's model was replaced after install); call "
                         f"uninstall(trainer), then install(trainer, ...) to serve the new model")


def _check_gkd(trainer, backend: str) -> None:
    gkd = _gkd_trainer_class()
    if type(trainer).compute_loss is not gkd.compute_loss:
        raise _refuse(trainer, "it overrides GKDTrainer.compute_loss, whose loss is not known here")
    if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
        raise _refuse(trainer, "its teacher_model is not an nn.Module")
    from . import transformers as hf

    for role, model in (("student", _policy_model(trainer)), ("teacher", trainer.teacher_model)):
        try:
            head = hf.fused_head(model)
        except (TypeError, ValueError) as error:
            raise _refuse(trainer, f"its {role}: {error}") from None
        _resolve_backend(backend, head.weight.device)
    if (_policy_model(trainer).get_output_embeddings().weight.shape[0]
            != trainer.teacher_model.get_output_embeddings().weight.shape[0]):
        raise _refuse(trainer, "the student's and the teacher's vocabularies differ")


def _gkd_compute_loss(trainer, original, backend: str, chunk_size: Optional[int]):
    """GKDTrainer.compute_loss (TRL 1.16) on ``ak.linear_distill_loss``: the student's and
    the teacher's final hidden states, both models' logit scale and soft-cap, TRL's
    ``generalized_jsd_loss`` with the trainer's ``beta``, temperature 1 (compute_loss passes
    none), ``batchmean`` over labelled positions or ``num_items_in_batch``."""
    from . import transformers as hf

    student_model = _policy_model(trainer)

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # evaluation wants the student's logits: TRL's own
            return original(model, inputs, return_outputs=True,
                            num_items_in_batch=num_items_in_batch)
        _check_called_model(trainer, model, student_model)
        student = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        astrai_hidden_states=True).last_hidden_state[:, :-1]
        trainer.teacher_model.eval()
        # accelerate's mixed-precision wrapper of the teacher (prepared when the trainer was
        # built) is skipped by the hidden-state call: its autocast is entered here
        with torch.no_grad(), trainer.accelerator.autocast():
            teacher = trainer.teacher_model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                astrai_hidden_states=True).last_hidden_state[:, :-1]
        labels = inputs["labels"][:, 1:]
        student_head = hf.fused_head(student_model)
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


_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                      "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                      "mm_token_type_ids", "image_position_ids")


def _grpo_trainer_class():
    from trl import GRPOTrainer

    return GRPOTrainer


def _check_fused_loss(trainer) -> None:
    """Refuse every GRPOTrainer configuration whose loss ``ak.linear_grpo_loss`` does not
    reproduce exactly (TRL 1.16's ``GRPOTrainer._compute_loss``)."""
    grpo = _grpo_trainer_class()
    if not isinstance(trainer, grpo):
        reason = ("RLOO's ratio is exp of the summed sequence log-ratio, ak.grpo_loss's "
                  "sequence level (GSPO) the mean" if type(trainer).__name__ == "RLOOTrainer"
                  else "fused_loss serves GRPOTrainer only")
        raise _refuse(trainer, f"fused_loss=True: {reason}")
    cls = type(trainer)
    if (cls._compute_loss is not grpo._compute_loss or cls.compute_loss is not grpo.compute_loss
            or cls._get_per_token_logps_and_entropies
            is not grpo._get_per_token_logps_and_entropies):
        raise _refuse(trainer, "fused_loss=True: it overrides GRPOTrainer's loss, whose "
                               "semantics are not known here")
    from transformers import ProcessorMixin

    refusals = [
        (isinstance(trainer.processing_class, ProcessorMixin),
         "a multimodal processor: the image inputs of the loss are not served"),
        (trainer.loss_type not in LOSS_TYPES,
         f"loss_type {trainer.loss_type!r} is not one of ak.grpo_loss's"),
        (trainer.importance_sampling_level not in ("token", "sequence"),
         f"importance_sampling_level {trainer.importance_sampling_level!r}"),
        (trainer._entropy_bonus_enabled,
         "the entropy bonus (entropy_coef, adaptive entropy) and its policy_loss metric are "
         "not reproduced"),
        (trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1,
         "top_entropy_quantile < 1 over several processes: TRL's quantile is over every "
         "process's tokens, ak.grpo_loss's over the local ones"),
        (trainer.loss_type == "vespo" and trainer.use_vllm
         and trainer.vllm_importance_sampling_correction
         and not ((trainer.vllm_importance_sampling_clip_min or 0.0) <= 1.0
                  <= (trainer.vllm_importance_sampling_clip_max or math.inf)),
         "VESPO with vLLM ratio bounds that exclude 1: TRL sums the log of the masked tokens' "
         "bounded ratios into the sequence weight, ak.grpo_loss sums the unmasked tokens'"),
        (trainer.off_policy_mask_threshold is not None and trainer.use_vllm,
         "the off-policy mask with vLLM: TRL zeroes the KL of tokens vLLM could not score "
         "(NaN sampling log-probs), ak.grpo_loss does not"),
    ]
    for refused, reason in refusals:
        if refused:
            raise _refuse(trainer, f"fused_loss=True: {reason}")


def _grpo_options(trainer, temperature: float) -> "ak.GRPOOptions":
    """TRL 1.16's GRPO settings as ``ak.GRPOOptions``, each set only where its loss type reads
    it (the op refuses the others); ``temperature``: the one TRL's head uses."""
    args, loss_type = trainer.args, trainer.loss_type
    clipped = loss_type in CLIPPED_LOSS_TYPES
    keywords = dict(
        beta=float(trainer.beta), clip_eps_low=float(trainer.epsilon_low),
        loss_type=loss_type, importance_sampling=trainer.importance_sampling_level,
        temperature=float(temperature),
        kl_ratio_correction=bool(args.use_bias_correction_kl) and trainer.beta != 0.0,
        top_entropy_quantile=float(trainer.top_entropy_quantile))
    if clipped or loss_type == "cispo":
        keywords["clip_eps_high"] = float(trainer.epsilon_high)
    if clipped and args.delta is not None:
        keywords["delta"] = float(args.delta)
    if loss_type == "dr_grpo":
        keywords["max_completion_length"] = int(trainer.max_completion_length)
    if loss_type == "sapo":
        keywords.update(sapo_tau_pos=float(args.sapo_temperature_pos),
                        sapo_tau_neg=float(args.sapo_temperature_neg))
    if loss_type == "vespo":
        keywords.update(vespo_k_pos=float(args.vespo_k_pos),
                        vespo_lambda_pos=float(args.vespo_lambda_pos),
                        vespo_k_neg=float(args.vespo_k_neg),
                        vespo_lambda_neg=float(args.vespo_lambda_neg))
    if trainer.off_policy_mask_threshold is not None:
        keywords["off_policy_threshold"] = float(trainer.off_policy_mask_threshold)
    return ak.GRPOOptions(**keywords)


def _check_grpo_options(trainer, options: "ak.GRPOOptions") -> None:
    """The op's own checks of ``options`` on a one-token stand-in call, as a refusal."""
    one = torch.zeros(1, 1)
    try:
        ak.grpo_loss(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), one[0],
                     ref_logprobs=one if options.beta > 0 else None,
                     normalizer=1.0 if options.loss_type in GLOBAL_COUNT_LOSS_TYPES else None,
                     options=options, backend="torch")
    except (TypeError, ValueError) as error:
        raise _refuse(trainer, f"fused_loss=True: its GRPO settings are outside "
                               f"ak.grpo_loss's: {error}") from None


def _grpo_compute_loss(trainer, policy: nn.Module, settings: Dict[str, Any], backend: str,
                       chunk_size: Optional[int]):
    """GRPOTrainer._compute_loss (TRL 1.16) on ``ak.linear_grpo_loss``: the policy's final
    hidden states at the completion positions, its LM head, TRL's options, masks, importance
    ratios and normalisation; the gradient comes out of the loss's own walk. Logs TRL's
    metrics under TRL's names, from the token log-probs and entropies of that walk."""
    options = _grpo_options(trainer, settings["temperature"])
    cast_lm_head_to_fp32 = bool(settings["cast_lm_head_to_fp32"])
    logit_scale = float(settings["logit_scale"])
    softcap = settings["final_logit_softcapping"]
    softcap = None if softcap is None else float(softcap)

    def compute_loss(model, inputs):
        _check_called_model(trainer, model, policy)
        present = [name for name in _MULTIMODAL_INPUTS if inputs.get(name) is not None]
        if present:
            raise ValueError(f"astrai_kernels.integrations.trl: fused_loss got the multimodal "
                             f"inputs {present}, which it does not serve")
        completion_ids = inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        keep = completion_ids.size(1)
        mask = (completion_mask if "tool_mask" not in inputs
                else completion_mask * inputs["tool_mask"])
        with trainer.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask,
                           astrai_hidden_states=True).last_hidden_state[:, -keep - 1:-1]
            head = policy.get_output_embeddings()
            weight, bias = head.weight, head.bias
            dtype = _compute_dtype(hidden, cast_lm_head_to_fp32)
        mode = "train" if trainer.model.training else "eval"
        accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        normalizer = None
        if trainer.loss_type in GLOBAL_COUNT_LOSS_TYPES:
            normalizer = (inputs["num_items_in_batch"].clamp(min=1.0)
                          / trainer.accelerator.num_processes)
            if mode == "train":
                normalizer = (normalizer * trainer.current_gradient_accumulation_steps
                              / trainer.args.steps_per_generation)
        importance_weights = None
        if trainer.loss_type == "vespo" or (trainer.use_vllm
                                            and trainer.vllm_importance_sampling_correction):
            importance_weights = inputs.get("importance_sampling_ratio")
            if importance_weights is not None:
                importance_weights = importance_weights.expand_as(mask)
        advantages = inputs["advantages"]
        device = weight.device
        with torch.autocast(hidden.device.type, enabled=False):
            loss, _, values = ak.linear_grpo_loss(
                hidden.to(device).to(dtype), weight.to(dtype), completion_ids.to(device),
                advantages.to(device), bias=None if bias is None else bias.to(dtype),
                mask=mask.to(device), old_logprobs=inputs.get("old_per_token_logps"),
                ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None,
                normalizer=normalizer, importance_weights=importance_weights, options=options,
                softcap=softcap, logit_scale=logit_scale, return_token_values=True,
                chunk_size=chunk_size, backend=backend)
        if trainer.loss_type not in GLOBAL_COUNT_LOSS_TYPES:
            loss = loss / accumulation
        _log_grpo_metrics(trainer, mode, values, inputs, mask.to(device), advantages.to(device))
        return loss

    return compute_loss


def _log_grpo_metrics(trainer, mode: str, values: Dict[str, Tensor], inputs,
                      mask: Tensor, advantages: Tensor) -> None:
    """The metrics GRPOTrainer._compute_loss logs, with its formulas and names, on the
    detached token log-probs and entropies of ``ak.linear_grpo_loss``."""
    from trl.trainer.utils import nanmax, nanmin

    # float64: TRL's formulas on float32 inputs, without their float32 roundings (k3 near 0
    # is exp(d) - d - 1, a cancellation whose float32 error exceeds the value it logs)
    logp, entropies = values["logprobs"].double(), values["entropy"].double()
    mask = mask.double()
    advantages = advantages.double()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    old = logp if old is None else old.to(logp.dtype)
    log_ratio = logp - old
    if trainer.importance_sampling_level == "sequence":
        log_ratio_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
                             ).unsqueeze(-1)
    else:
        log_ratio_weights = log_ratio
    coef_1 = torch.exp(log_ratio_weights)
    accelerator, metrics = trainer.accelerator, trainer._metrics[mode]

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        ref = inputs["ref_per_token_logps"].to(logp.dtype)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        metrics["kl"].append(global_masked_mean(per_token_kl))
    metrics["entropy"].append(global_masked_mean(entropies))
    if trainer.loss_type in CLIPPED_LOSS_TYPES:
        is_low = (coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)
        is_high = (coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"].append(global_masked_mean(is_low.float()))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(is_high.float()))
        metrics["clip_ratio/region_mean"].append(global_masked_mean((is_low | is_high).float()))
        metrics["clip_ratio/low_min"].append(
            nanmin(accelerator.gather(masked_seq_mean(is_low.float()))).item())
        metrics["clip_ratio/high_max"].append(
            nanmax(accelerator.gather(masked_seq_mean(is_high.float()))).item())
    elif trainer.loss_type == "cispo":
        is_capped = (coef_1 > trainer.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"].append(global_masked_mean(is_capped.float()))
    elif trainer.loss_type == "vespo":
        args = trainer.args
        phi_seq = trainer.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
            lambda_neg=args.vespo_lambda_neg)
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi_seq))


#: TRL 1.16's ``distillation_trainer._chunked_divergence_loss`` parameters, in order.
_DISTILLATION_LOSS_PARAMETERS = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight",
    "teacher_lm_head_weight", "completion_mask", "beta", "num_items_in_batch",
    "student_lm_head_bias", "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale",
    "student_final_logit_softcapping", "teacher_final_logit_softcapping", "temperature")


def _distillation_trainer(trainer) -> bool:
    """Whether ``trainer`` is a TRL ``DistillationTrainer`` (or a subclass, e.g. the deprecated
    ``trl.experimental.distillation`` alias)."""
    if not any(klass.__name__ == "DistillationTrainer" for klass in type(trainer).__mro__):
        return False
    from trl.trainer.distillation_trainer import DistillationTrainer

    return isinstance(trainer, DistillationTrainer)


def _distillation_check(trainer, backend: str, chunk_size: Optional[int]) -> None:
    from torch.distributed.tensor import DTensor
    from trl.trainer import distillation_trainer as trl_distillation

    base = trl_distillation.DistillationTrainer
    if not isinstance(getattr(trainer, "teacher_model", None), nn.Module):
        raise _refuse(trainer, "it has no local teacher_model, whose LM head its "
                               "full-vocabulary divergence reads")
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


#: TRL 1.16's ``ServerDistillationTrainer`` methods whose loss the installed ``compute_loss``
#: reproduces (``_get_last_hidden_state``: the student's backbone call of the linear form).
_SERVER_LOSS_METHODS = ("compute_loss", "_compute_server_forward_kl_loss",
                        "_compute_server_sparse_top_1_divergence_loss",
                        "_compute_sparse_top_1_divergence_loss", "_get_reverse_kl_top_1_tokens",
                        "_reduce_divergence_loss", "_get_last_hidden_state")
#: The names TRL 1.16's ``ServerDistillationTrainer.compute_loss`` reads.
_SERVER_LOSS_NAMES = frozenset({"_compute_prompt_length", "_get_teacher_token_logprobs_from_server",
                                "_compute_server_sparse_top_1_divergence_loss",
                                "_compute_server_forward_kl_loss",
                                "current_gradient_accumulation_steps", "temperature", "beta"})


def _server_distillation_class():
    from trl.experimental.server_distillation import ServerDistillationTrainer

    return ServerDistillationTrainer


def _server_distillation_trainer(trainer) -> bool:
    """Whether ``trainer`` is a TRL ``ServerDistillationTrainer`` (``trl.experimental`` warns on
    import: only a trainer that may be one imports it)."""
    if not any(klass.__name__ == "ServerDistillationTrainer" for klass in type(trainer).__mro__):
        return False
    return isinstance(trainer, _server_distillation_class())


def _server_distillation_check(trainer, backend: str) -> None:
    from torch.distributed.tensor import DTensor

    server = _server_distillation_class()
    for name in _SERVER_LOSS_METHODS:
        if getattr(type(trainer), name) is not getattr(server, name):
            raise _refuse(trainer, f"it overrides ServerDistillationTrainer.{name}, whose loss "
                                   f"is not known here")
    missing = _SERVER_LOSS_NAMES - set(inspect.unwrap(server.compute_loss).__code__.co_names)
    if missing:
        raise _refuse(trainer, f"TRL's ServerDistillationTrainer.compute_loss does not read "
                               f"{sorted(missing)} as TRL 1.16's does")
    beta, temperature, top_k = trainer.beta, trainer.temperature, trainer.loss_top_k
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise _refuse(trainer, f"beta {beta!r} is not a number in [0, 1]")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise _refuse(trainer, f"temperature {temperature!r} is not a positive number")
    if not (isinstance(top_k, int) and top_k >= 1 and (beta == 0 or top_k == 1)):
        raise _refuse(trainer, f"loss_top_k {top_k!r} with beta {beta}: TRL's server path takes "
                               f"a top-k support of k >= 1 at beta 0, the top-1 support otherwise")
    if trainer.reverse_kl_top_1_mode != "sampled":
        raise _refuse(trainer, f"reverse_kl_top_1_mode {trainer.reverse_kl_top_1_mode!r}: the "
                               f"server path scores the sampled token only")
    if not isinstance(trainer.loss_add_tail, bool):
        raise _refuse(trainer, f"loss_add_tail {trainer.loss_add_tail!r} is not a bool")
    head = _policy_model(trainer).get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise _refuse(trainer, f"its student's output embedding {type(head).__name__} has no "
                               f"[V, H] weight")
    if isinstance(weight, DTensor):
        raise _refuse(trainer, "its student's LM head weight is a DTensor (sharded)")
    _resolve_backend(backend, weight.device)  # an unknown backend fails here


def _server_student_head(student: nn.Module):
    """The student's head for ``ak.linear_topk_distill_loss``, or None where only the model's
    own forward gives its logits: a soft-cap (that op applies none), or a forward that
    ``integrations.transformers.fused_head`` does not read."""
    from . import transformers as hf

    try:
        head = hf.fused_head(student)
    except (TypeError, ValueError):
        return None
    return head if head.softcap is None else None


def _server_support(trainer, teacher: Dict[str, Tensor], completion_tokens: Tensor,
                    labels: Tensor) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(support_ids, teacher_logprobs, support_mask)`` per position, as TRL's server path
    builds them: the teacher's top-k at beta 0 (its -inf entries dropped by the op, as TRL's
    ``valid``), else ``server_top1_support`` of the teacher's top-1 and the sampled token,
    after TRL's ValueErrors for log-probs the server left out where labels count."""
    from ..ops.topk_distill import server_top1_support

    top_ids, top_logprobs = teacher["topk_token_ids"], teacher["topk_logprobs"]
    if trainer.beta == 0:
        return top_ids, top_logprobs, None
    required = labels != -100
    actual = teacher["actual_logprobs"]
    missing_actual = required & ~torch.isfinite(actual)
    if missing_actual.any():
        raise ValueError(
            "Teacher server is missing actual-token logprobs for required reverse-KL positions: "
            f"{int(missing_actual.sum().item())}/{int(required.sum().item())}.")
    if trainer.beta < 1:
        missing_top1 = required & ~torch.isfinite(top_logprobs.squeeze(-1))
        if missing_top1.any():
            raise ValueError(
                "Teacher server is missing top-1 logprobs for required forward-KL positions: "
                f"{int(missing_top1.sum().item())}/{int(required.sum().item())}.")
    return server_top1_support(top_ids.squeeze(-1), top_logprobs.squeeze(-1), completion_tokens,
                               actual, trainer.beta)


def _server_inputs(inputs) -> Dict[str, Any]:
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


def _server_distillation_compute_loss(trainer, backend: str, chunk_size: Optional[int]):
    """ServerDistillationTrainer.compute_loss (TRL 1.16) on ``ak.linear_topk_distill_loss``:
    TRL's inputs, prompt length, teacher request, slicing and trimming to the teacher's window,
    support and ValueErrors, ``batchmean`` over the labelled positions and the division by the
    gradient-accumulation steps. The student's final hidden states come from TRL's own
    ``_get_last_hidden_state`` (through ``_forward_redirection``, as DistillationTrainer's loss)
    and only its labelled positions reach the head; a soft-capped head (or one ``fused_head``
    does not read) keeps TRL's ``model(...)`` call and ``ak.topk_distill_loss`` on its logits."""
    original = types.MethodType(_server_distillation_class().compute_loss, trainer)

    def student_loss(unwrapped, head, input_ids, attention_mask, positions, labels, support,
                     options):
        # the prepared model's autocast wraps its forward, which the backbone call skips
        with trainer.accelerator.autocast():
            hidden = trainer._get_last_hidden_state(unwrapped, input_ids, attention_mask,
                                                    input_ids.shape[1] - 1)
            dtype = _compute_dtype(hidden, False)
        weight, bias = head.weight, head.bias
        mask = labels.to(weight.device) != -100
        hidden = hidden[:, positions][:, :labels.shape[1]].to(weight.device)
        rows = hidden[mask]
        if head.logit_scale != 1.0:
            rows = rows * head.logit_scale
            bias = None if bias is None else bias * head.logit_scale
        ids, teacher_logprobs, support_mask = (
            None if value is None else value.to(weight.device)[mask] for value in support)
        with torch.autocast(rows.device.type, enabled=False):
            return ak.linear_topk_distill_loss(
                rows.to(dtype), weight.to(dtype), ids, teacher_logprobs,
                bias=None if bias is None else bias.to(dtype), support_mask=support_mask,
                **options)

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        unwrapped = trainer.accelerator.unwrap_model(model)
        head = _server_student_head(_base_model(unwrapped))
        linear = head is not None
        if return_outputs and linear:  # the caller wants the student's logits: TRL's own
            return original(model, inputs, return_outputs=True,
                            num_items_in_batch=num_items_in_batch)
        inputs = _server_inputs(inputs)
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        student_outputs = None
        if not linear:
            student_outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        prompt_length = trainer._compute_prompt_length(inputs)
        teacher = trainer._get_teacher_token_logprobs_from_server(inputs, prompt_length)
        window = teacher["actual_logprobs"].shape[1]
        labels = inputs["labels"][:, prompt_length:][:, :window]
        completion_tokens = input_ids[:, prompt_length:][:, :window]
        support = _server_support(trainer, teacher, completion_tokens, labels)
        # TRL's logits[:, prompt_length - 1:-1], a slice that also indexes hidden[:, :-1]
        positions = slice(*slice(prompt_length - 1, -1).indices(input_ids.shape[1])[:2])
        options = dict(beta=float(trainer.beta), temperature=float(trainer.temperature),
                       tail=trainer.loss_add_tail, backend=backend)
        if linear:
            loss = trainer._forward_redirection(
                model, unwrapped, student_loss, unwrapped, head, input_ids, attention_mask,
                positions, labels, support, dict(options, chunk_size=chunk_size))
        else:
            logits = student_outputs.logits[:, positions][:, :window]
            ids, teacher_logprobs, support_mask = support
            with torch.autocast(logits.device.type, enabled=False):
                loss = ak.topk_distill_loss(logits, ids, teacher_logprobs, labels,
                                            support_mask=support_mask, **options)
        if trainer.model.training:
            loss = loss / trainer.current_gradient_accumulation_steps
        return (loss, student_outputs) if return_outputs else loss

    return compute_loss


def _server_distillation_install(trainer, backend: str, chunk_size: Optional[int]):
    _server_distillation_check(trainer, backend)
    trainer.compute_loss = _server_distillation_compute_loss(trainer, backend, chunk_size)
    trainer.__dict__[_TRAINER_STATE] = []  # no model's forward is replaced
    return trainer


def install(trainer, *, backend: str = "auto", chunk_size: Optional[int] = None,
            fused_loss: bool = False):
    """Serve every fused-head call of ``trainer`` (a built TRL 1.16 trainer) with
    ``ak.linear_token_logprobs`` (a GKDTrainer's or DistillationTrainer's loss with
    ``ak.linear_distill_loss``, a ServerDistillationTrainer's with
    ``ak.linear_topk_distill_loss``); returns the trainer. ``fused_loss=True`` (a GRPOTrainer)
    also computes its loss with ``ak.linear_grpo_loss``. Raises ``TRLHeadError`` (a
    ``ValueError``) saying why when it cannot serve the trainer exactly (module docstring)."""
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {type(fused_loss).__name__}")
    check_chunk_size(chunk_size)
    if is_installed(trainer):
        raise _refuse(trainer, "install was already called on it; uninstall first")
    _check_contract(trainer)
    if fused_loss:
        _check_fused_loss(trainer)
    if _server_distillation_trainer(trainer):  # its teacher is a server's top-k log-probs
        return _server_distillation_install(trainer, backend, chunk_size)
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
        plans.append((model, settings))
    # trl.experimental warns on import: only a trainer that may be a GKDTrainer imports it
    maybe_gkd = any(klass.__name__ == "GKDTrainer" for klass in type(trainer).__mro__)
    gkd = _gkd_trainer_class() if maybe_gkd else None
    is_gkd = gkd is not None and isinstance(trainer, gkd)
    if is_gkd:
        _check_gkd(trainer, backend)
    policy = _policy_model(trainer)
    if fused_loss and not any(model is policy for model, _ in plans):
        raise _refuse(trainer, "fused_loss=True: its policy model carries no TRL fused head")
    if fused_loss:
        policy_settings = next(settings for model, settings in plans if model is policy)
        _check_grpo_options(trainer, _grpo_options(trainer, policy_settings["temperature"]))
    for model, settings in plans:
        trl_forward, wrapped = _trl_forward(model)
        model.__dict__[_MODEL_STATE] = {
            "trl_forward": model.__dict__["forward"], "settings": settings,
            "original_forward": model.__dict__.get("_original_forward")}
        forward = types.MethodType(_make_forward(trl_forward, settings, backend, chunk_size),
                                   model)
        if (is_gkd and model is _policy_model(trainer)) or (fused_loss and model is policy):
            forward = types.MethodType(_hidden_forward(forward, settings["backbone_attr"]),
                                       model)
        if wrapped:
            model._original_forward = forward
            forward = _mixed_precision_forward(trainer, forward)
        model.forward = forward
    served = [model for model, _ in plans]
    if fused_loss:
        trainer._compute_loss = _grpo_compute_loss(trainer, policy, policy_settings, backend,
                                                   chunk_size)
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
    from ..kernels.registry import resolve_backend

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
        if state.get("original_forward") is not None:
            model._original_forward = state["original_forward"]
    trainer.__dict__.pop("compute_loss", None)  # GKD's: the class's again
    trainer.__dict__.pop("_compute_loss", None)  # fused_loss's, DistillationTrainer's
    del trainer.__dict__[_TRAINER_STATE]
    return trainer


def is_installed(trainer) -> bool:
    return _TRAINER_STATE in getattr(trainer, "__dict__", {})


def served_models(trainer) -> List[nn.Module]:
    """The models ``install`` serves on ``trainer`` (empty when not installed)."""
    return list(trainer.__dict__.get(_TRAINER_STATE, ()))
