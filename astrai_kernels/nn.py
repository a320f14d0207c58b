"""``nn.Module`` wrappers of the losses."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict, Optional, Tuple

import torch

from .ops.cross_entropy import cross_entropy, linear_cross_entropy


class _FusedLoss(torch.nn.Module):
    """A loss module of one op (``op``): each constructor argument that is a keyword of the op
    is kept once, as an attribute (as torch's losses keep ``reduction``), and handed to the op
    and shown by ``repr`` from there; which ones is read from the two signatures."""
    op: Callable
    #: the constructor's parameters that are keywords of ``op``, in the op's order
    op_keywords: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = inspect.signature(cls.__init__).parameters
        cls.op_keywords = tuple(name for name in inspect.signature(cls.op).parameters
                                if name in own)

    def keywords(self) -> Dict[str, object]:
        return {name: getattr(self, name) for name in self.op_keywords}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.keywords().items())


def _keeps_op_keywords(init: Callable) -> Callable:
    """A ``_FusedLoss`` constructor that, once ``init`` has accepted its arguments, keeps the
    op's keywords among them as attributes."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def keeping(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        init(self, *args, **kwargs)
        for name in self.op_keywords:
            setattr(self, name, arguments.arguments[name])

    return keeping


class CrossEntropyLoss(_FusedLoss):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` on class-index targets, fused.

    Supports ``ignore_index``, ``reduction`` and ``label_smoothing`` from torch, plus
    ``z_loss``, ``softcap``, ``logit_scale``, ``inplace_backward`` and ``backend``. Not supported (a
    ``ValueError`` says so): ``weight``, probability (soft) targets, and the deprecated
    ``size_average``/``reduce``. Logits are ``[..., V]`` with the classes last, not ``[N, C, d]``.
    """
    op = staticmethod(cross_entropy)

    @_keeps_op_keywords
    def __init__(self, weight: Optional[torch.Tensor] = None, size_average: None = None,
                 ignore_index: int = -100, reduce: None = None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: Optional[float] = None, logit_scale: float = 1.0,
                 inplace_backward: bool = False, backend: str = "auto") -> None:
        super().__init__()
        if weight is not None:
            raise ValueError("weight (per-class weights) is not supported by "
                             "astrai_kernels.nn.CrossEntropyLoss")
        if size_average is not None or reduce is not None:
            raise ValueError("size_average and reduce are deprecated in torch and not supported;"
                             " use reduction")

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(target, torch.Tensor) and target.is_floating_point():
            raise ValueError("probability (soft) targets are not supported: target must hold "
                             "class indices (int32 or int64)")
        return cross_entropy(input, target, **self.keywords())


class LinearCrossEntropyLoss(_FusedLoss):
    """Cross-entropy of an LM head's output, fused: ``forward(hidden, weight, target, bias=None)``.

    Same keywords as ``ak.linear_cross_entropy``; never holds the ``[N, V]`` logits.
    """
    op = staticmethod(linear_cross_entropy)

    @_keeps_op_keywords
    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, *, z_loss=0.0,
                 softcap=None, logit_scale=1.0, chunk_size=None, backend="auto"):
        super().__init__()

    def forward(self, hidden, weight, target, bias=None, normalizer=None):
        return linear_cross_entropy(hidden, weight, target, bias=bias, normalizer=normalizer,
                                    **self.keywords())
