"""Masked cross-entropy with the gradient produced in the forward pass.

Contract (DESIGN.md): equals ``F.cross_entropy(z.float(), y, ignore_index, reduction,
label_smoothing)`` over the flattened rows, ``z = softcap * tanh(logits / softcap)`` when
``softcap`` is set, plus ``z_loss * lse**2`` per counted row. With ``reduction`` ``mean`` or
``sum`` and logits requiring grad, the forward reads the logits once and writes the gradient
once; backward only rescales it. ``inplace_backward=True`` writes that gradient over the
logits during the forward (their values are destroyed). ``reduction="none"`` recomputes in
the backward with the per-row upstream gradient.
"""

from dataclasses import dataclass

import torch

from .. import reference
from . import _library
from ._backend import backend_module, resolve_backend
from ._common import (
    AttachGrad,
    check_choice,
    check_in_range,
    check_index,
    check_logits,
    check_positive,
    check_target,
    flat_target,
    rows_view,
)

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class CrossEntropyParams:
    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    softcap: float
    inplace_backward: bool
    backend: str


def _check_normalizer(normalizer, device):
    """``normalizer`` as a float32 0-d tensor on ``device`` (a number or a 1-element tensor)."""
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a number or a 1-element tensor, got shape "
                             f"{tuple(normalizer.shape)}")
        return normalizer.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(check_positive(normalizer, "normalizer"), dtype=torch.float32,
                        device=device)


def _grad_scale(target_flat, params, normalizer):
    """Per-loss gradient factor: 1 for ``sum``, ``1 / count`` for ``mean`` (on device)."""
    if params.reduction == "sum":
        return torch.ones(1, dtype=torch.float32, device=target_flat.device)
    count = normalizer
    if count is None:
        count = (target_flat != params.ignore_index).sum().clamp(min=1).to(torch.float32)
    return (1.0 / count).reshape(1)


def _reduce(rows_loss, grad_scale, params):
    if params.reduction == "sum":
        return rows_loss.sum()
    return rows_loss.sum() * grad_scale.reshape(())


class _CrossEntropyRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses, gradient recomputed with per-row upstream grads."""

    @staticmethod
    def forward(ctx, logits_rows, target_flat, params):
        loss, _, _ = _call(logits_rows, target_flat, params, None)
        ctx.save_for_backward(logits_rows, target_flat)
        ctx.params = params
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        logits_rows, target_flat = ctx.saved_tensors
        row_scale = grad_rows.reshape(-1).float().contiguous()
        _, _, grad = _call(logits_rows, target_flat, ctx.params, row_scale)
        return grad, None, None


def _call(logits_rows, target_flat, params, grad_scale, grad_out=None):
    """Run the primitive; ``grad_out`` set means write the gradient there (in-place path)."""
    args = (params.ignore_index, params.label_smoothing, params.z_loss, params.softcap)
    if grad_out is not None:
        loss, lse = backend_module(params.backend).cross_entropy_forward(
            logits_rows, target_flat, *args, grad_scale, grad_out)
        return loss, lse, grad_out
    return _library.cross_entropy_forward(logits_rows, target_flat, *args, grad_scale,
                                          params.backend)


def checked_params(logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap,
                   normalizer, inplace_backward, backend):
    """Validate every argument; ``(params, normalizer as a device tensor or None)``.

    ``logits`` may be a zero-byte stand-in of the logits' shape (the fused LM head's checks).
    """
    check_logits(logits)
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, logits, ignore_index)
    check_choice(reduction, "reduction", REDUCTIONS)
    label_smoothing = check_in_range(label_smoothing, "label_smoothing", 0.0, 1.0)
    z_loss = check_in_range(z_loss, "z_loss", 0.0, float("inf"))
    softcap_value = 0.0 if softcap is None else check_positive(softcap, "softcap")
    normalizer_t = _check_normalizer(normalizer, logits.device)
    params = CrossEntropyParams(ignore_index, reduction, label_smoothing, z_loss, softcap_value,
                                bool(inplace_backward), resolve_backend(backend, logits.device))
    return params, normalizer_t


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, softcap=None, normalizer=None, inplace_backward=False,
                  backend="auto"):
    """Cross-entropy of ``logits [..., V]`` against ``target [...]``, float32.

    ``normalizer`` (a number or 0-d tensor, e.g. the global count of target tokens across
    micro-batches) replaces the local count of non-ignored rows in ``reduction="mean"``.
    Every row ignored gives 0.0 and a zero gradient.
    """
    params, normalizer_t = checked_params(logits, target, ignore_index, reduction,
                                          label_smoothing, z_loss, softcap, normalizer,
                                          inplace_backward, backend)
    if params.backend == "reference":
        return reference.cross_entropy(logits.float(), target, ignore_index, reduction,
                                       label_smoothing, z_loss, softcap, normalizer_t)
    logits_rows, target_flat = rows_view(logits), flat_target(target)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if reduction == "none":
        if needs_grad:
            loss = _CrossEntropyRows.apply(logits_rows, target_flat, params)
        else:
            loss, _, _ = _call(logits_rows, target_flat, params, None)
        return loss.view(target.shape)
    grad_scale = _grad_scale(target_flat, params, normalizer_t)
    if not needs_grad:
        loss, _, _ = _call(logits_rows, target_flat, params, None)
        return _reduce(loss, grad_scale, params)
    with torch.no_grad():
        grad_out = logits_rows if params.inplace_backward else None
        loss, _, grad = _call(logits_rows, target_flat, params, grad_scale, grad_out)
        value = _reduce(loss, grad_scale, params)
    return AttachGrad.apply(logits_rows, value, grad)
