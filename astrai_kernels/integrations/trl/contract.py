"""What ``install`` relies on in TRL 1.16, stated once: the versions it serves, how TRL's fused
head is recognised and read (its forward's closure: temperature, logit scale, final soft-cap,
backbone, compute dtype, outputs), how TRL's trainer families are recognised, and the refusals
shared by the adapters (sharded heads, FSDP1/DeepSpeed, temperature and beta out of range).

Each adapter (``head``, ``gkd``, ``grpo``, ``distillation``, ``server_distillation``) is an
:class:`Adapter`: ``applies``, ``check`` (raises :class:`TRLHeadError`, changes nothing),
``apply`` (returns the models whose forward it replaced) and ``undo``.

TRL is imported only when these functions run.
"""

import math
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

#: The TRL versions whose fused-head contract this package reproduces.
TESTED_TRL = ("1.16.",)
#: The names TRL 1.16's ``_fused_forward`` closes over (its settings).
TRL_CLOSURE = frozenset({"original_forward", "text_config", "backbone_attr",
                         "cast_lm_head_to_fp32", "temperature", "outputs",
                         "final_logit_softcapping", "logit_scale"})
TRL_OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits",
                     "is_top1", "label_mask", "aux_loss")
STATISTICS = ("log_sum_sq_probs", "mean_logits", "is_top1")
OUTPUTS = ("log_probs", "entropy") + STATISTICS
#: a served model's state (``integrations.transformers`` refuses to patch a model carrying it)
MODEL_STATE = "_astrai_kernels_trl"
#: the trainers whose loss reads the LM heads itself: no TRL fused head to serve
HEADLESS_FAMILIES = ("distillation", "server_distillation")


class TRLHeadError(ValueError):
    """``install`` cannot serve this trainer exactly; the message says why."""


def refuse(trainer, reason: str) -> TRLHeadError:
    return TRLHeadError(f"astrai_kernels.integrations.trl cannot serve "
                        f"{type(trainer).__name__}: {reason}")


@dataclass(frozen=True)
class Request:
    """What ``install`` was asked for; ``policy_hidden_states``: an applied adapter's loss
    reads the policy's final hidden states (its forward answers ``astrai_hidden_states``);
    ``score_support``: None, or ``"sampler"`` (the policy scored under the trainer's sampling
    settings, ``sampler.py``)."""
    backend: str = "auto"
    chunk_size: Optional[int] = None
    fused_loss: bool = False
    policy_hidden_states: bool = False
    score_support: Optional[str] = None


class Adapter:
    """One trainer family's part of ``install``."""
    #: the adapter's loss calls the policy with ``astrai_hidden_states=True`` (or ``astrai_loss``)
    reads_hidden_states = False

    def applies(self, trainer, request: Request) -> bool:
        raise NotImplementedError

    def check(self, trainer, request: Request) -> None:
        """Raise :class:`TRLHeadError` when the trainer cannot be served exactly."""

    def apply(self, trainer, request: Request) -> List[nn.Module]:
        """Serve the trainer; the models whose forward this replaced."""
        raise NotImplementedError

    def undo(self, trainer, models: List[nn.Module]) -> None:
        """Give back what ``apply`` replaced (``models``: what it returned)."""
        raise NotImplementedError


class LossAdapter(Adapter):
    """An adapter that gives the trainer its own ``method`` (a loss method of TRL's class),
    built by ``loss``; ``undo`` lets the class's show through again."""
    method = "_compute_loss"

    def loss(self, trainer, request: Request):
        raise NotImplementedError

    def apply(self, trainer, request: Request) -> List[nn.Module]:
        setattr(trainer, self.method, self.loss(trainer, request))
        return []  # no model's forward is replaced

    def undo(self, trainer, models: List[nn.Module]) -> None:
        trainer.__dict__.pop(self.method, None)


# -- TRL and its trainers --------------------------------------------------------------------

def trl_version() -> str:
    import trl

    return trl.__version__


def check_trl(trainer) -> None:
    """The TRL version, its ``FusedCausalLMOutput`` and no sharded training but FSDP2's (no
    DeepSpeed, no FSDP1)."""
    version = trl_version()
    if not version.startswith(TESTED_TRL):
        raise refuse(trainer, f"TRL {version} is installed; the fused-head contract served "
                              f"here is TRL {', '.join(v + 'x' for v in TESTED_TRL)}'s")
    from trl.trainer.utils import FusedCausalLMOutput

    fields = tuple(FusedCausalLMOutput.__dataclass_fields__)
    if fields != TRL_OUTPUT_FIELDS:
        raise refuse(trainer, f"TRL's FusedCausalLMOutput has fields {fields}, not "
                              f"{TRL_OUTPUT_FIELDS}")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise refuse(trainer, "it runs under DeepSpeed; its sharded LM heads are not gathered "
                              "by this integration")
    if getattr(trainer, "is_fsdp_enabled", False):
        check_fsdp2(trainer)


def check_fsdp2(trainer) -> None:
    """Under accelerate's FSDP, only FSDP2 (``fsdp_version: 2``), which gathers the LM head's
    weight inside the model's forward, where every served loss reads the trained model's head
    (a teacher's frozen head is gathered for the loss, :func:`teacher_head`)."""
    version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
    if version != 2:
        raise refuse(trainer, f"it runs under FSDP{version}, whose flat parameters are not "
                              f"read by this integration; FSDP2 (fsdp_version: 2) is served")


def trainer_class(family: str):
    """TRL 1.16's class of a trainer family (None for a GKD that TRL lacks)."""
    if family == "grpo":
        from trl import GRPOTrainer

        return GRPOTrainer
    if family == "distillation":
        from trl.trainer.distillation_trainer import DistillationTrainer

        return DistillationTrainer
    if family == "server_distillation":
        from trl.experimental.server_distillation import ServerDistillationTrainer

        return ServerDistillationTrainer
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        return None
    return GKDTrainer


_FAMILY_CLASS_NAMES = (("server_distillation", "ServerDistillationTrainer"),
                       ("distillation", "DistillationTrainer"), ("gkd", "GKDTrainer"))


def trainer_family(trainer) -> Optional[str]:
    """``"server_distillation"``, ``"distillation"``, ``"gkd"`` or None (any other trainer).
    ``trl.experimental`` warns on import: only a trainer whose classes carry the name imports
    it. (ServerDistillationTrainer is a DistillationTrainer: it is asked first.)"""
    names = {klass.__name__ for klass in type(trainer).__mro__}
    for family, class_name in _FAMILY_CLASS_NAMES:
        if class_name in names:
            klass = trainer_class(family)
            if klass is not None and isinstance(trainer, klass):
                return family
    return None


def overridden(trainer, base, names) -> Optional[str]:
    """The first of ``names`` (methods) whose ``type(trainer)`` attribute is not ``base``'s."""
    return next((name for name in names
                 if getattr(type(trainer), name) is not getattr(base, name)), None)


# -- TRL's fused head ------------------------------------------------------------------------

def _trl_forward_code():
    """The code object of the forward ``add_fused_lm_head`` defines (functools.wraps gives
    that forward the model's name, so it is recognised by its code)."""
    from trl.trainer import utils

    return next((const for const in utils.add_fused_lm_head.__code__.co_consts
                 if isinstance(const, types.CodeType) and const.co_name == "_fused_forward"),
                None)


def _is_trl_forward(forward) -> bool:
    function = getattr(forward, "__func__", None)
    return getattr(function, "__code__", None) is _trl_forward_code()


def trl_forward(model) -> Tuple[Any, bool]:
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
    forward, _ = trl_forward(model)
    if forward is None:
        return None
    function = forward.__func__
    names = function.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, function.__closure__ or ())}


@dataclass(frozen=True)
class TRLHead:
    """TRL's fused head on one model, as its forward's closure holds it (``settings``): the
    one place its temperature, logit scale and final soft-cap are read (TRL applies them in
    that order: scale, cap, temperature)."""
    settings: Dict[str, Any]

    @staticmethod
    def of(model: nn.Module) -> Optional["TRLHead"]:
        """The head TRL gave ``model`` (also once served: the settings install kept)."""
        state = model.__dict__.get(MODEL_STATE, {}) if isinstance(model, nn.Module) else {}
        settings = state.get("settings") or trl_head_settings(model)
        return None if settings is None else TRLHead(settings)

    @property
    def temperature(self) -> float:
        return float(self.settings["temperature"])

    @property
    def logit_scale(self) -> float:
        return float(self.settings["logit_scale"])

    @property
    def softcap(self) -> Optional[float]:
        softcap = self.settings["final_logit_softcapping"]
        return None if softcap is None else float(softcap)

    @property
    def backbone_attr(self) -> str:
        return self.settings["backbone_attr"]

    @property
    def cast_lm_head_to_fp32(self) -> bool:
        return bool(self.settings["cast_lm_head_to_fp32"])

    @property
    def outputs(self) -> Tuple[str, ...]:
        return tuple(self.settings["outputs"])


def check_head(trainer, model: nn.Module, head: TRLHead) -> None:
    """Refuse a TRL head whose settings or LM head are not served exactly."""
    settings, name = head.settings, type(model).__name__
    if set(settings) != TRL_CLOSURE:
        raise refuse(trainer, f"TRL's fused head on {name} has the settings "
                              f"{sorted(settings)}, not TRL 1.16's {sorted(TRL_CLOSURE)}")
    if getattr(settings["text_config"], "output_router_logits", False):
        raise refuse(trainer, f"{name}'s config asks for router logits (a MoE load-balancing "
                              f"loss), which this head does not return")
    unknown = set(settings["outputs"]) - set(OUTPUTS)
    if unknown:
        raise refuse(trainer, f"TRL's head on {name} asks for outputs {sorted(unknown)}")
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, nn.Module) or type(lm_head).forward is not nn.Linear.forward:
        raise refuse(trainer, f"{name}'s output embedding is {type(lm_head).__name__}, not a "
                              f"plain nn.Linear (a LoRA-adapted lm_head is not served)")
    check_head_weight(trainer, name, model)
    check_temperature(trainer, settings["temperature"])
    scale = settings["logit_scale"]
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise refuse(trainer, f"{name}'s logit scale {scale!r} is not a finite number")
    softcap = settings["final_logit_softcapping"]
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise refuse(trainer, f"{name}'s final_logit_softcapping {softcap!r} is not positive")


# -- the shared refusals ---------------------------------------------------------------------

def sharded(weight) -> bool:
    """A DTensor (a sharded LM head, which this package does not gather)."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def gathered_in_forward(model: nn.Module, weight: Tensor) -> bool:
    """``weight`` is FSDP2's shard of a parameter of ``model``'s own ``fully_shard`` group on a
    1-D mesh: inside ``model``'s forward it is the whole plain tensor. (A submodule sharded on
    its own, e.g. ``fully_shard(model.lm_head)``, gathers it only in that submodule's forward,
    which the fused head never calls.)"""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or weight.device_mesh.ndim != 1:
        return False
    return not any(isinstance(module, FSDPModule)
                   and any(parameter is weight for parameter in module.parameters())
                   for name, module in model.named_modules() if name)


def check_head_weight(trainer, role: str, model: nn.Module) -> Tensor:
    """``model``'s output embedding weight: a local ``[V, H]`` tensor (or FSDP2's shard of one,
    gathered in ``model``'s forward), else refused."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise refuse(trainer, f"its {role}'s output embedding {type(head).__name__} has no "
                              f"[V, H] weight")
    if sharded(weight) and not gathered_in_forward(model, weight):
        raise refuse(trainer, f"its {role}'s LM head weight is a DTensor (sharded) that its "
                              f"forward does not gather (only FSDP2's fully_shard of the whole "
                              f"model on a 1-D mesh is served)")
    return weight


def check_gathered(weight: Tensor) -> None:
    """Inside a served model's forward: the LM head's ``weight`` must be whole (FSDP2 gathers
    only the parameters of the module whose forward runs)."""
    if sharded(weight):
        raise ValueError(f"astrai_kernels.integrations.trl: the LM head weight is still a "
                         f"DTensor inside the model's forward (placements {weight.placements}): "
                         f"a module whose forward the fused head does not call shards it "
                         f"(fully_shard the whole model instead)")


def check_teacher_head_weight(trainer, model: nn.Module) -> Tensor:
    """A teacher's output embedding weight: ``[V, H]``, a local tensor or a DTensor of any
    placement (:func:`teacher_head` gathers it for each loss), else refused."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise refuse(trainer, f"its teacher's output embedding {type(head).__name__} has no "
                              f"[V, H] weight")
    return weight


def teacher_head(weight: Tensor, bias: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """A frozen teacher's LM head as local tensors for a loss outside the teacher's forward. A
    DTensor (a teacher the caller ``fully_shard``ed; accelerate leaves one it prepares with
    ``evaluation_mode=True``, as TRL's trainers do, unsharded) is gathered with
    ``full_tensor()`` without gradient: the values FSDP2's unshard gives the teacher's own
    forward, one ``[V, H]`` all-gather per loss."""
    def local(tensor):
        return tensor.full_tensor() if sharded(tensor) else tensor

    with torch.no_grad():
        return local(weight), None if bias is None else local(bias)


def check_temperature(trainer, temperature) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise refuse(trainer, f"temperature {temperature!r} is not a positive number")


def check_beta(trainer, beta) -> None:
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise refuse(trainer, f"beta {beta!r} is not a number in [0, 1]")


def resolve_backend(backend: str, device) -> str:
    """The backend serving ``device`` (an unknown backend fails here, at ``install``)."""
    from ...kernels.registry import resolve_backend as resolve

    return resolve(backend, device)


# -- the models ------------------------------------------------------------------------------

def compute_dtype(hidden: Tensor, cast_lm_head_to_fp32: bool) -> torch.dtype:
    """TRL's: float32 with ``cast_lm_head_to_fp32``, the autocast dtype under autocast, else
    the hidden states'."""
    device_type = hidden.device.type
    if cast_lm_head_to_fp32:
        return torch.float32
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def policy_model(trainer) -> nn.Module:
    """The trainer's policy: its model, or the PEFT model's base."""
    return base_model(trainer.model)


def check_called_model(trainer, model: nn.Module, served: nn.Module) -> None:
    """Refuse a loss call on a model other than the policy ``install`` served (the trainer's
    model replaced since): that model's forward is TRL's, which knows no hidden-state call."""
    called = base_model(trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=True))
    if called is not served:
        raise ValueError(f"astrai_kernels.integrations.trl: {type(trainer).__name__}'s loss "
                         f"was called on a {type(called).__name__} that install did not serve "
                         f"(the trainer's model was replaced after install); call "
                         f"uninstall(trainer), then install(trainer, ...) to serve the new model")
