"""How per-row losses become a reduced loss, shared by the ops with ``reduction`` and
``normalizer`` (cross-entropy, the fused head, distillation, vocabulary parallel).

``mean`` divides the sum of the counted rows' losses by their count, or by a given
``normalizer`` (a global token count); each row's gradient factor is that same scale
(:func:`loss_grad_scale`), known before the forward pass, which is what lets the forward write
the gradient.
"""

import torch

from ..options.scalars import FLOAT32_MAX, check_positive, check_real


def checked_normalizer(normalizer, reduction, device):
    """``normalizer`` as a float32 0-d tensor on ``device``, or None.

    A number must be finite and > 0 (with a finite float32 reciprocal) or exactly 0. A
    1-element tensor is checked on its own device: on CPU a negative, non-finite or too small
    value raises here; elsewhere (CUDA) that check is an asynchronous device assert, so no
    host sync is added (a failure surfaces at the next synchronization). Whether 0 is allowed
    depends on the rows counted: :func:`check_zero_normalizer`.
    """
    if normalizer is None:
        return None
    if reduction != "mean":
        raise ValueError(f"normalizer applies to reduction='mean' only, got reduction="
                         f"{reduction!r}")
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a number or a 1-element tensor, got shape "
                             f"{tuple(normalizer.shape)}")
        if normalizer.dtype == torch.bool or normalizer.is_complex():
            raise TypeError(f"normalizer must be a real tensor, got {normalizer.dtype}")
        value = normalizer.detach().reshape(()).to(torch.float32)
        ok = (value == 0) | ((value > 0) & (value.reciprocal() <= FLOAT32_MAX)
                             & (value <= FLOAT32_MAX))
        message = "normalizer must be 0 or a finite number > 0 (with a finite float32 inverse)"
        if value.device.type != "cpu" or torch.compiler.is_compiling():
            torch._assert_async(ok, message)
        elif not bool(ok):
            raise ValueError(f"{message}, got {value.item()}")
        return value.to(device)
    value = check_real(normalizer, "normalizer")
    if value != 0:
        value = check_positive(value, "normalizer")
    return torch.full((), value, dtype=torch.float32, device=device)


def check_zero_normalizer(normalizer, counted):
    """The rule of every op's ``normalizer`` (GRPO's): 0 only when nothing is counted (an
    empty micro-batch: loss 0.0, zero gradient); a 0 with counted rows would silently drop
    them. ``counted`` is a bool tensor of the counted rows. On CPU this raises; on other
    devices (CUDA) and under ``torch.compile`` it is an asynchronous device assert (no host
    sync; a failure surfaces at the next synchronization)."""
    bad = (normalizer == 0) & counted.any()
    message = ("normalizer must be > 0 when a row is counted (0 only when every row is "
               "ignored)")
    if normalizer.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(~bad, message)
    elif bool(bad):
        raise ValueError(f"{message}, got 0 with {int(counted.sum())} counted")


def loss_grad_scale(target_flat, params, normalizer):
    """Per-loss gradient factor: 1 for ``sum``, ``1 / count`` for ``mean`` (on device); 0
    when a given normalizer is 0."""
    if params.reduction == "sum":
        return torch.ones(1, dtype=torch.float32, device=target_flat.device)
    if normalizer is None:
        count = (target_flat != params.ignore_index).sum().clamp(min=1).to(torch.float32)
        return count.reciprocal().reshape(1)
    return inverse_or_zero(normalizer).reshape(1)


def inverse_or_zero(count):
    return torch.where(count > 0, count.reciprocal(), torch.zeros_like(count))


def reduce_loss(rows_loss, grad_scale, params):
    if params.reduction == "sum":
        return rows_loss.sum()
    return rows_loss.sum() * grad_scale.reshape(())
