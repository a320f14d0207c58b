"""Token log-probs ``logp = z_y / T - logsumexp(z / T)`` (and entropy) without an [N, V] copy.

Contract (DESIGN.md): ``token_logprobs(logits [..., V], target [...])`` -> float32 ``[...]``,
or ``(logprobs, entropy)``; rows whose target is ``ignore_index`` give 0 and zero gradient.
The forward keeps one float32 ``lse`` (and entropy) per row; the backward recomputes
``p`` tile by tile and writes the gradient once, into the logits' buffer when
``inplace_backward=True`` (which destroys the logits: use it when nothing else needs them).
"""

from dataclasses import dataclass

import torch

from .. import reference
from . import _library
from ._backend import backend_module, resolve_backend
from ._common import check_index, check_logits, check_positive, check_target, flat_target, rows_view


@dataclass(frozen=True)
class LogprobsParams:
    temperature: float
    ignore_index: int
    with_entropy: bool
    inplace_backward: bool
    backend: str


def checked_params(logits, target, temperature, ignore_index, return_entropy,
                    inplace_backward, backend):
    check_logits(logits)
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, logits, ignore_index)
    return LogprobsParams(check_positive(temperature, "temperature"), ignore_index,
                          bool(return_entropy), bool(inplace_backward),
                          resolve_backend(backend, logits.device))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_rows, target_flat, params):
        logp, entropy, lse = _library.logprobs_forward(
            logits_rows, target_flat, params.temperature, params.ignore_index,
            params.with_entropy, params.backend)
        ctx.save_for_backward(logits_rows, target_flat, lse, entropy)
        ctx.params = params
        if params.with_entropy:
            return logp, entropy
        return logp, entropy.new_zeros(logp.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits_rows, target_flat, lse, entropy = ctx.saved_tensors
        params = ctx.params
        grad_logp = _dense(grad_logp, lse)
        grad_entropy = _dense(grad_entropy, lse) if params.with_entropy else lse.new_empty(0)
        args = (target_flat, lse, entropy, grad_logp, grad_entropy, params.temperature,
                params.ignore_index)
        if params.inplace_backward:
            backend_module(params.backend).logprobs_backward(logits_rows, *args, logits_rows)
            return logits_rows, None, None
        return _library.logprobs_backward(logits_rows, *args, params.backend), None, None


def _dense(grad, like):
    """Upstream gradient as a contiguous float32 vector (autograd may pass None)."""
    if grad is None:
        return torch.zeros_like(like)
    return grad.reshape(-1).float().contiguous()


def _forward_only(logits_rows, target_flat, params):
    logp, entropy, _ = _library.logprobs_forward(logits_rows, target_flat, params.temperature,
                                                 params.ignore_index, params.with_entropy,
                                                 params.backend)
    return logp, entropy


def token_logprobs(logits, target, *, temperature=1.0, ignore_index=-100, return_entropy=False,
                   inplace_backward=False, backend="auto"):
    """Log-probability of ``target`` under ``softmax(logits / temperature)``, float32 ``[...]``.

    ``return_entropy=True`` also returns the entropy of that softmax (differentiable).
    A call without autograd (``torch.no_grad()`` or logits not requiring grad) runs the
    forward only and saves nothing: the way to compute old/reference-policy log-probs.
    """
    params = checked_params(logits, target, temperature, ignore_index, return_entropy,
                             inplace_backward, backend)
    lead_shape = target.shape
    if params.backend == "reference":
        logp, entropy = reference.token_logprobs(logits.float(), target, params.temperature,
                                                 params.ignore_index)
    else:
        logits_rows, target_flat = rows_view(logits), flat_target(target)
        if torch.is_grad_enabled() and logits.requires_grad:
            logp, entropy = _TokenLogprobs.apply(logits_rows, target_flat, params)
        else:
            logp, entropy = _forward_only(logits_rows, target_flat, params)
        logp, entropy = logp.view(lead_shape), entropy.view(lead_shape) if return_entropy else None
    return (logp, entropy) if return_entropy else logp


def sequence_logprobs(logits, target, mask, *, average=False, temperature=1.0, backend="auto"):
    """Per-sequence sum (or mean over ``mask``) of token log-probs; logits ``[B, T, V]``."""
    keep = checked_sequence_mask(logits, target, mask)
    backend = resolve_backend(backend, logits.device)
    if backend == "reference":
        return reference.sequence_logprobs(logits.float(), torch.where(keep, target, -100), mask,
                                           average, check_positive(temperature, "temperature"))
    masked_target = torch.where(keep, target, torch.full_like(target, -100))
    logp = token_logprobs(logits, masked_target, temperature=temperature, ignore_index=-100,
                          backend=backend)
    return reduce_sequence(logp, mask, average)


def checked_sequence_mask(logits, target, mask):
    """Check ``[B, T, V]`` logits, ``mask`` and the targets it keeps; the mask as bool."""
    check_logits(logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(target.shape):
        raise ValueError(f"mask must be a tensor of target's shape {tuple(target.shape)}, got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}")
    if mask.device != logits.device:
        raise ValueError(f"mask is on {mask.device} but logits are on {logits.device}")
    keep = mask.bool()
    check_target(target, logits, where=keep)
    return keep


def reduce_sequence(logp, mask, average):
    """Sum (or mean over ``mask``) of token log-probs ``[B, T]`` per sequence."""
    weight = mask.to(torch.float32)
    total = (logp * weight).sum(-1)
    return total / weight.sum(-1).clamp(min=1.0) if average else total
