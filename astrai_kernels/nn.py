"""``nn.Module`` wrappers of the losses."""

from __future__ import annotations

from typing import Optional

import torch

from .ops.cross_entropy import cross_entropy, linear_cross_entropy


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` on class-index targets, fused.

    Supports ``ignore_index``, ``reduction`` and ``label_smoothing`` from torch, plus
    ``z_loss``, ``softcap``, ``logit_scale``, ``inplace_backward`` and ``backend``. Not supported (a
    ``ValueError`` says so): ``weight``, probability (soft) targets, and the deprecated
    ``size_average``/``reduce``. Logits are ``[..., V]`` with the classes last, not ``[N, C, d]``.
    """

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
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.inplace_backward = inplace_backward
        self.backend = backend

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(target, torch.Tensor) and target.is_floating_point():
            raise ValueError("probability (soft) targets are not supported: target must hold "
                             "class indices (int32 or int64)")
        return cross_entropy(input, target, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap,
                             logit_scale=self.logit_scale,
                             inplace_backward=self.inplace_backward, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, logit_scale={self.logit_scale}, "
                f"backend={self.backend!r}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """Cross-entropy of an LM head's output, fused: ``forward(hidden, weight, target, bias=None)``.

    Same keywords as ``ak.linear_cross_entropy``; never holds the ``[N, V]`` logits.
    """

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, *, z_loss=0.0,
                 softcap=None, logit_scale=1.0, chunk_size=None, backend="auto"):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.chunk_size = chunk_size
        self.backend = backend

    def forward(self, hidden, weight, target, bias=None, normalizer=None):
        return linear_cross_entropy(hidden, weight, target, bias=bias,
                                    ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    softcap=self.softcap, logit_scale=self.logit_scale,
                                    normalizer=normalizer,
                                    chunk_size=self.chunk_size, backend=self.backend)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, logit_scale={self.logit_scale}, "
                f"chunk_size={self.chunk_size}, backend={self.backend!r}")
