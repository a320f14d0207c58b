"""Token log-probs ``logp = z_y / T - logsumexp(z / T)`` (and entropy) without an [N, V] copy.

Contract (docs/architecture.md, "Ops"): ``token_logprobs(logits [..., V], target [...])`` ->
float32 ``[...]``, or ``(logprobs, entropy)``; rows whose target is ``ignore_index`` give 0
and zero gradient.
The forward keeps one float32 ``lse`` (and entropy) per row; the backward recomputes
``p`` tile by tile and writes the gradient once, into the logits' buffer when
``inplace_backward=True`` (which destroys the logits: use it when nothing else needs them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, Literal, Optional, Tuple, Union, overload

import torch

from .. import reference

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
from ..kernels import library
from ..kernels.primitives import LogprobsArgs, args_of
from ..kernels.registry import backend_module, resolve_backend
from . import dtensor, vocab_parallel
from ._common import (
    check_bool,
    check_index,
    check_inplace,
    check_logits,
    check_positive,
    check_target,
    dense_grad,
    finish_inplace_grad,
    flat_target,
    grad_for_owner,
    graph_is_retained,
    inplace_grad_owner,
    refuse_double_backward,
    rows_view,
)
from .sampling import SamplingParams, checked_sampling, full_support, sampled_token_logprobs

# named by the error of a double backward (refuse_double_backward)
TORCH_EQUIVALENT = ("torch.log_softmax(logits.float() / temperature, -1)"
                    ".gather(-1, target[..., None])")


@dataclass(frozen=True)
class LogprobsParams(LogprobsArgs):
    """The kernel's parameters (``kernels/primitives.py``) and the op's own."""
    inplace_backward: bool
    backend: str


def checked_params(logits, target, temperature, ignore_index, return_entropy,
                    inplace_backward, backend):
    check_logits(logits)
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, logits, ignore_index)
    check_bool(return_entropy, "return_entropy")
    check_inplace(logits, inplace_backward)
    return LogprobsParams(temperature=check_positive(temperature, "temperature"),
                          ignore_index=ignore_index, with_entropy=return_entropy,
                          inplace_backward=inplace_backward,
                          backend=resolve_backend(backend, logits.device))


class _TokenLogprobs(torch.autograd.Function):
    """``base`` is None, or (``inplace_backward``) the tensor ``logits`` slice that autograd is
    given the gradient of instead (``inplace_grad_owner``); ``logits`` are read in the backward."""

    @staticmethod
    def forward(ctx, logits, base, target_flat, params, starts):
        logp, entropy, lse = library.logprobs_forward(rows_view(logits), target_flat, params,
                                                       params.backend)
        ctx.save_for_backward(logits, target_flat, lse, entropy)
        ctx.params, ctx.starts = params, starts
        if params.with_entropy:
            return logp, entropy
        return logp, entropy.new_zeros(logp.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("token_logprobs", TORCH_EQUIVALENT)
        logits, target_flat, lse, entropy = ctx.saved_tensors
        params = ctx.params
        grad_logp = dense_grad(grad_logp, lse)
        grad_entropy = dense_grad(grad_entropy, lse) if params.with_entropy else lse.new_empty(0)
        args = (target_flat, lse, entropy, grad_logp, grad_entropy)
        logits_rows = rows_view(logits)
        # a retained graph may run this again: then the logits must survive
        if params.inplace_backward and not graph_is_retained():
            backend_module(params.backend).logprobs_backward(
                logits_rows, *args, args_of(params, LogprobsArgs), logits_rows)
            if ctx.starts is None:
                return finish_inplace_grad(logits, None, logits.shape), None, None, None, None
            grad_base = finish_inplace_grad(logits._base, ctx.starts, logits.shape)
            return None, grad_base, None, None, None
        grad = library.logprobs_backward(logits_rows, *args, params, params.backend)
        grad = grad.view(logits.shape)
        if ctx.starts is None:
            return grad, None, None, None, None
        return None, grad_for_owner(grad, logits._base, ctx.starts), None, None, None


def _forward_only(logits_rows, target_flat, params):
    logp, entropy, _ = library.logprobs_forward(logits_rows, target_flat, params,
                                                 params.backend)
    return logp, entropy


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., return_entropy: Literal[False] = ...,
                   inplace_backward: bool = ..., backend: str = ...,
                   process_group: Optional[ProcessGroup] = ...,
                   check_consistency: bool = ..., sampling: Optional[SamplingParams] = ...,
                   return_support: Literal[False] = ...) -> torch.Tensor: ...


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., return_entropy: Literal[True],
                   inplace_backward: bool = ..., backend: str = ...,
                   process_group: Optional[ProcessGroup] = ...,
                   check_consistency: bool = ...) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., backend: str = ...,
                   sampling: Optional[SamplingParams] = ..., return_support: Literal[True]
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]: ...


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    process_group: Optional[ProcessGroup] = None,
    check_consistency: bool = True,
    sampling: Optional[SamplingParams] = None,
    return_support: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor],
           Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Log-probability of ``target`` under ``softmax(logits / temperature)``, float32 ``[...]``.

    ``return_entropy=True`` also returns the entropy of that softmax (differentiable).
    A call without autograd (``torch.no_grad()`` or logits not requiring grad) runs the
    forward only and saves nothing: the way to compute old/reference-policy log-probs.

    ``inplace_backward=True`` makes the backward write the gradient over the logits (their
    values are destroyed; overlapping logits such as an ``expand`` are refused). When
    ``logits`` slice a contiguous tensor that requires grad (``x[:, :-1]``), that tensor's
    whole buffer becomes its gradient (the rest zeroed). The logits are kept, and the gradient
    is a new buffer, under ``torch.compile`` and in a backward that retains the graph.

    ``process_group`` (vocabulary parallel): ``logits`` hold this rank's contiguous shard of the
    vocabulary (shards in rank order), ``target`` global ids; every rank gets the
    full-vocabulary result and its shard's gradient (``ops/vocab_parallel.py``).
    ``check_consistency`` (with ``process_group``): every rank must pass the same rows and targets
    (only the vocabulary shard differs); the shard sizes' all-gather also carries each rank's row
    count (always compared: a mismatch would hang) and, when True (the default), the sum and
    count of its counted targets, so ranks that disagree raise ``ValueError`` on every rank.

    ``sampling`` (an ``ak.SamplingParams``): score each target under the distribution vLLM's
    sampler draws from (temperature, min_p, top_k, top_p; ``ops/sampling.py``): ``-inf`` for a
    target outside that support, whose row then gets a zero gradient. The temperature is
    ``sampling.temperature`` (``temperature`` must stay 1.0). ``return_support=True`` also
    returns a dict of ``[...]`` tensors: ``log_kept_mass`` (float32, log of the kept mass
    under the full tempered softmax), ``support_size`` (int64) and ``in_support`` (bool: the
    target is kept); ignored rows give 0, 0 and False. Neither goes with ``return_entropy``,
    ``inplace_backward`` or ``process_group``.
    """
    if dtensor.has_dtensor(logits, target):  # locals(): every argument
        return dtensor.token_logprobs(token_logprobs, **locals())
    if sampling is not None or check_bool(return_support, "return_support"):
        sampling = checked_sampling(sampling, temperature, return_entropy=return_entropy,
                                    inplace_backward=inplace_backward,
                                    process_group=process_group is not None)
        check_logits(logits)
        if sampling.filters(logits.shape[-1]):
            return sampled_token_logprobs(logits, target, sampling, ignore_index,
                                          return_support, backend)
        logp = token_logprobs(logits, target, temperature=sampling.temperature,
                              ignore_index=ignore_index, backend=backend)
        if return_support:
            return logp, full_support(target, ignore_index, logits.shape[-1])
        return logp
    if process_group is not None:
        return _vocab_parallel_token_logprobs(
            logits, target, process_group, temperature, ignore_index, return_entropy,
            inplace_backward, backend, check_consistency)
    params = checked_params(logits, target, temperature, ignore_index, return_entropy,
                             inplace_backward, backend)
    lead_shape = target.shape
    if params.backend == "reference":
        logp, entropy = reference.token_logprobs(logits.float(), target, params.temperature,
                                                 params.ignore_index)
    else:
        logits_rows, target_flat = rows_view(logits), flat_target(target)
        if torch.is_grad_enabled() and logits.requires_grad:
            inplace = inplace_grad_owner(logits, logits_rows) if inplace_backward else None
            if inplace is None:
                params = replace(params, inplace_backward=False)
                inplace = (logits, None)
            base, starts = inplace
            logp, entropy = _TokenLogprobs.apply(logits, None if starts is None else base,
                                                 target_flat, params, starts)
        else:
            logp, entropy = _forward_only(logits_rows, target_flat, params)
        logp, entropy = logp.view(lead_shape), entropy.view(lead_shape) if return_entropy else None
    return (logp, entropy) if return_entropy else logp


def _vocab_parallel_token_logprobs(logits, target, process_group, temperature, ignore_index,
                                   return_entropy, inplace_backward, backend, check_consistency):
    """``token_logprobs`` of a vocabulary shard (``ops/vocab_parallel.py``)."""
    check_logits(logits, allow_empty_vocab=True)
    layout = vocab_parallel.shard_layout(process_group, logits.shape[-1], logits.device, target,
                                         ignore_index, check_consistency)
    stand_in = vocab_parallel.global_stand_in(logits, logits.shape[:-1], layout)
    params = checked_params(stand_in, target, temperature, ignore_index, return_entropy, False,
                            backend)
    check_inplace(logits, inplace_backward)
    if params.backend == "reference":
        return token_logprobs(vocab_parallel.gathered_logits(logits, layout), target,
                              temperature=temperature, ignore_index=ignore_index,
                              return_entropy=return_entropy, backend="reference")
    params = replace(params, inplace_backward=inplace_backward)
    logp, entropy = vocab_parallel.shard_token_logprobs(logits, flat_target(target), params,
                                                        layout, backend)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if return_entropy else logp


def sequence_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    *,
    average: bool = False,
    temperature: float = 1.0,
    backend: str = "auto",
    sampling: Optional[SamplingParams] = None,
) -> torch.Tensor:
    """Per-sequence sum (or mean over ``mask``) of token log-probs; logits ``[B, T, V]``.

    ``mask`` (bool, integer or float, of target's shape) selects the tokens counted (nonzero
    entries); masked targets are not read, so they may hold anything. ``sampling`` as in
    ``token_logprobs``: a sequence with a counted token outside the sampler's support gets
    ``-inf`` (its probability under the sampler is 0), never a finite stand-in; its other
    tokens keep their gradients. ``token_logprobs(..., return_support=True)`` says which.
    """
    if dtensor.has_dtensor(logits, target, mask):  # locals(): every argument
        return dtensor.sequence_logprobs(sequence_logprobs, token_logprobs, reduce_sequence,
                                         **locals())
    keep = checked_sequence_mask(logits, target, mask, average)
    backend = resolve_backend(backend, logits.device)
    if backend == "reference" and sampling is None:
        return reference.sequence_logprobs(logits.float(), torch.where(keep, target, -100), mask,
                                           average, check_positive(temperature, "temperature"))
    masked_target = torch.where(keep, target, torch.full_like(target, -100))
    logp = token_logprobs(logits, masked_target, temperature=temperature, ignore_index=-100,
                          backend=backend, sampling=sampling)
    return reduce_sequence(logp, mask, average)


def checked_sequence_mask(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                          average: bool) -> torch.Tensor:
    """Check ``[B, T, V]`` logits (or a zero-byte stand-in), ``mask``, ``average`` and the
    targets the mask keeps; the mask as bool."""
    check_logits(logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(target.shape):
        raise ValueError(f"mask must be a tensor of target's shape {tuple(target.shape)}, got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}")
    if mask.device != logits.device:
        raise ValueError(f"mask is on {mask.device} but logits are on {logits.device}")
    check_bool(average, "average")
    keep = mask.bool()
    check_target(target, logits, where=keep)
    return keep


def reduce_sequence(logp: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Sum (or mean over ``mask``) of token log-probs ``[B, T]`` per sequence."""
    weight = mask.to(torch.float32)
    total = (logp * weight).sum(-1)
    return total / weight.sum(-1).clamp(min=1.0) if average else total
