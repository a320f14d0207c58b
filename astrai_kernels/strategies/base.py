"""The strategy base class, its factory, and the output types."""

import inspect
from abc import ABC, abstractmethod
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    Optional,
    Sequence,
    Type,
    TypeVar,
    Union,
)

import torch
from torch import Tensor

from .head import ModelHead, model_head
from .rollout import RolloutResult, RolloutRunner
from .types import Device, Model

try:
    from typing import TypedDict
except ImportError:  # pragma: no cover
    from typing_extensions import TypedDict

T = TypeVar("T")

#: Values accepted for ``loss_backend``: ``"reference"`` is the seed's own naive math, every other
#: value is passed as ``backend=`` to the ops of ``astrai_kernels``.
LOSS_BACKENDS = ("auto", "triton", "cpp", "torch", "reference")


class BaseFactory(Generic[T]):
    """A registry of named classes, with a ``@Factory.register(name)`` decorator.

    Each subclass ``class MyFactory(BaseFactory[MyBase])`` gets its own registry; registered classes
    must derive from ``MyBase``. ``MyFactory.create(name, *args, **kwargs)`` instantiates one;
    when its ``__init__`` takes no ``**kwargs``, keywords it does not accept are dropped.
    """

    _entries: Dict[str, type] = {}
    _component_base: Optional[type] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            args = getattr(base, "__args__", ())
            if getattr(base, "__origin__", None) is BaseFactory and args:
                # A direct ``BaseFactory[Base]`` subclass owns a registry; its subclasses share it.
                cls._entries = {}
                arg = args[0]
                cls._component_base = arg if isinstance(arg, type) else None
                cls._component_base_name = getattr(arg, "__forward_arg__", arg)

    @classmethod
    def _base(cls) -> Optional[type]:
        if cls._component_base is None:
            name = getattr(cls, "_component_base_name", None)
            if isinstance(name, str):
                module = inspect.getmodule(cls)
                found = getattr(module, name, None)
                if isinstance(found, type):
                    cls._component_base = found
        return cls._component_base

    @classmethod
    def register(cls, name: str) -> Callable[[Type[T]], Type[T]]:
        """Class decorator registering the class under ``name`` (aliases: register it again)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__}.register: name must be a non-empty string")

        def decorator(component: Type[T]) -> Type[T]:
            base = cls._base()
            if not isinstance(component, type) or (base is not None
                                                   and not issubclass(component, base)):
                raise TypeError(f"{cls.__name__}.register({name!r}): {component!r} must be a "
                                f"subclass of {getattr(base, '__name__', base)}")
            if name in cls._entries:
                raise ValueError(f"{cls.__name__}: {name!r} is already registered "
                                 f"(to {cls._entries[name].__name__})")
            cls._entries[name] = component
            return component

        return decorator

    @classmethod
    def get_component_class(cls, name: str) -> type:
        try:
            return cls._entries[name]
        except KeyError:
            raise ValueError(f"{cls.__name__}: unknown name {name!r}; registered: "
                             f"{sorted(cls._entries)}") from None

    @classmethod
    def create(cls, name: str, *args, **kwargs) -> T:
        component = cls.get_component_class(name)
        params = inspect.signature(component.__init__).parameters.values()
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
            accepted = {p.name for p in params}
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return component(*args, **kwargs)

    @classmethod
    def list_registered(cls) -> List[str]:
        return sorted(cls._entries)

    @classmethod
    def is_registered(cls, name: str) -> bool:
        return name in cls._entries


class LossOutput(TypedDict):
    loss: Tensor
    metrics: Dict[str, Tensor]


class LogprobsOutput(TypedDict):
    logprobs: Tensor
    aux_loss: Optional[Tensor]


def move_to_device(batch: Dict[str, Any], device: Device) -> Dict[str, Any]:
    """Move the tensors of a batch to ``device`` (non-blocking); other values pass through."""
    return {key: value.to(device, non_blocking=True) if isinstance(value, Tensor) else value
            for key, value in batch.items()}


# ---------------------------------------------------------------- batch checks


def require_keys(batch: Dict[str, Any], keys: Sequence[str], owner: str) -> None:
    if not isinstance(batch, dict):
        raise TypeError(f"{owner}: the batch must be a dict of tensors, got {type(batch).__name__}")
    missing = [key for key in keys if key not in batch]
    if missing:
        raise ValueError(f"{owner}: the batch is missing key(s) {missing}; it has "
                         f"{sorted(batch)}, and needs {list(keys)}")
    for key in keys:
        if not isinstance(batch[key], Tensor):
            raise TypeError(f"{owner}: batch[{key!r}] must be a tensor, "
                            f"got {type(batch[key]).__name__}")


def check_ids(tensor: Tensor, name: str, owner: str, dim: int) -> None:
    if tensor.dim() != dim:
        raise ValueError(f"{owner}: {name} must have {dim} dimensions, got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{owner}: {name} must be integer token ids, got {tensor.dtype}")


def check_same_shape(tensor: Tensor, name: str, like: Tensor, like_name: str, owner: str) -> None:
    if tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{owner}: {name} has shape {tuple(tensor.shape)} but {like_name} has "
                         f"{tuple(like.shape)}; they must match")


def check_logits(logits: Tensor, input_ids: Tensor, owner: str) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 3 or \
            tuple(logits.shape[:2]) != tuple(input_ids.shape):
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"{owner}: the model must return logits [batch, seq_len, vocab] = "
                         f"[{input_ids.shape[0]}, {input_ids.shape[1]}, V], got {shape}")


def model_outputs(model: Model, owner: str, **inputs: Tensor) -> Dict[str, Tensor]:
    outputs = model(**inputs)
    if not isinstance(outputs, dict) or "logits" not in outputs:
        raise TypeError(f"{owner}: the model must return a dict with 'logits' (and optionally "
                        f"'aux_loss'), got {type(outputs).__name__}")
    check_logits(outputs["logits"], inputs["input_ids"], owner)
    return outputs


# ---------------------------------------------------------------- strategies


class BaseStrategy(ABC):
    """Abstract base class for training strategies.

    When a :class:`~astrai_kernels.strategies.RolloutRunner` is injected via
    :meth:`set_rollout_runner`, the strategy transparently switches to online mode: each
    ``__call__`` produces a :class:`RolloutResult`, converts it to a training batch via
    :meth:`prepare_from_rollout`, and then computes the loss. Without a runner the strategy runs in
    offline mode and consumes the batch directly.

    Keywords every strategy takes:

    * ``loss_backend`` (default ``"auto"``): ``"reference"`` computes the losses with the seed's own
      naive math (``log_softmax(logits.float())`` + ``gather``, ``F.cross_entropy``), through no op
      of this package; any other value is the ``backend=`` of the fused ops of ``astrai_kernels``.
    * ``executor``: an object with ``unwrap_model(model) -> state_dict`` and ``use_distributed``
      (see :class:`~astrai_kernels.strategies.executor.Executor`); optional.
    * ``moe_aux_loss_coef`` (0.01): weight of the model's ``aux_loss`` output, when it has one.
    * ``fused_head`` (None): with a fused ``loss_backend`` and a model that exposes its final
      hidden states and output embedding (:mod:`astrai_kernels.strategies.head`), the losses are
      computed with the ``linear_*`` ops and no logits exist; ``False`` keeps the logits path,
      ``True`` requires the fused one.

    Other keywords are kept in ``self.extra_kwargs`` for subclasses.
    """

    def __init__(
        self,
        model: Model,
        device: Device,
        **kwargs: Any,
    ):
        self.model = model
        self.device = device
        self.loss_backend = kwargs.pop("loss_backend", "auto")
        if self.loss_backend not in LOSS_BACKENDS:
            raise ValueError(f"{type(self).__name__}: loss_backend must be one of "
                             f"{LOSS_BACKENDS}, got {self.loss_backend!r}")
        self.fused_head = kwargs.pop("fused_head", None)
        if self.fused_head not in (None, True, False):
            raise ValueError(f"{type(self).__name__}: fused_head must be None (auto), True or "
                             f"False, got {self.fused_head!r}")
        self.executor = kwargs.pop("executor", None)
        self.moe_aux_loss_coef = kwargs.pop("moe_aux_loss_coef", 0.01)
        self.extra_kwargs = kwargs
        self._rollout_runner = None

    @property
    def uses_reference(self) -> bool:
        """True when the losses are computed with the seed's naive math."""
        return self.loss_backend == "reference"

    def model_head(self, model: Model) -> Optional[ModelHead]:
        """``model``'s fused head (:mod:`.head`), or None for the logits path (always None with
        ``loss_backend="reference"``, the seed's math on the logits)."""
        if self.uses_reference:
            return None
        return model_head(model, self.fused_head, type(self).__name__)

    def _reference_only(self, **options) -> None:
        """Reject options the seed's math (``loss_backend="reference"``) does not have."""
        if not self.uses_reference:
            return
        for name, (value, seed_value) in options.items():
            if value != seed_value:
                raise ValueError(f"{type(self).__name__}: {name}={value!r} needs a fused "
                                 f"loss_backend; loss_backend='reference' reproduces the seed, "
                                 f"which only has {name}={seed_value!r}")

    @abstractmethod
    def compute_loss(self, batch: Dict[str, Tensor]) -> Tensor:
        """Compute the loss for the given batch."""
        raise NotImplementedError

    def compute_loss_output(self, batch: Dict[str, Tensor]) -> LossOutput:
        return self._normalize_output(self.compute_loss(batch))

    def _loss_output(
        self,
        task_loss: Tensor,
        metrics: Dict[str, Tensor],
        aux_loss: Optional[Tensor] = None,
    ) -> LossOutput:
        total_loss = task_loss
        if aux_loss is not None:
            weighted_aux_loss = self.moe_aux_loss_coef * aux_loss
            total_loss = total_loss + weighted_aux_loss
            metrics["moe_aux_loss"] = aux_loss
            metrics["moe_aux_loss_weighted"] = weighted_aux_loss
        metrics["loss"] = total_loss
        return {
            "loss": total_loss,
            "metrics": {name: torch.as_tensor(value).detach() for name, value in metrics.items()},
        }

    @staticmethod
    def _normalize_output(output: Union[LossOutput, Tensor]) -> LossOutput:
        if isinstance(output, dict):
            return output
        return {"loss": output, "metrics": {"loss": output.detach()}}

    def supports_online(self) -> bool:
        """Whether this strategy can run with a rollout runner (override with
        :meth:`prepare_from_rollout`)."""
        return False

    def set_rollout_runner(self, runner: Optional[RolloutRunner]) -> None:
        """Inject a rollout runner to enable online mode (``None`` goes back to offline)."""
        if runner is not None and not self.supports_online():
            raise ValueError(f"{type(self).__name__} does not support online rollout")
        self._rollout_runner = runner

    def prepare_from_rollout(self, result: RolloutResult) -> Dict[str, Tensor]:
        """Map a :class:`RolloutResult` to the batch layout :meth:`compute_loss` expects."""
        raise NotImplementedError(f"{type(self).__name__} does not support online rollout")

    def _on_rollout_refresh(self) -> None:  # noqa: B027 (an optional hook, no-op by default)
        """Hook fired when a fresh rollout is produced (e.g. to sync the behaviour policy)."""

    def on_optimizer_step(self) -> None:
        """Advance the online rollout state after a successful optimizer step."""
        if self._rollout_runner is not None:
            self._rollout_runner.step()

    def __call__(self, batch: Dict[str, Tensor]) -> LossOutput:
        """Run offline or online depending on whether a runner was injected."""
        if self._rollout_runner is None:
            return self.compute_loss_output(batch)
        result, is_fresh = self._rollout_runner(batch)
        if is_fresh:
            self._on_rollout_refresh()
        return self.compute_loss_output(self.prepare_from_rollout(result))


class StrategyFactory(BaseFactory["BaseStrategy"]):
    """Factory of training strategies.

    All default strategies (``seq``, ``sft``, ``dpo``, ``grpo`` and the ``online_*`` aliases) are
    registered when :mod:`astrai_kernels.strategies` is imported. Example::

        @StrategyFactory.register("custom")
        class CustomStrategy(BaseStrategy):
            ...

        strategy = StrategyFactory.create("custom", model, device)
    """
