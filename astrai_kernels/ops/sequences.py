"""Per-sequence log-probs: the token log-probs of ``ops/logprobs.py`` summed (or averaged)
over a mask, from the logits (``sequence_logprobs``) or the fused head
(``linear_sequence_logprobs``); the preference losses (``ops/preference.py``) take these.

Contract: ``sequence_logprobs(logits [B, T, V], target [B, T], mask [B, T]) -> [B]`` float32,
``sum_t mask * logp_t`` (or its mean over the mask with ``average=True``). The masked targets
are not read.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import reference
from ..distributed import dtensor
from ..kernels.registry import resolve_backend
from ..options.scalars import check_bool, check_positive
from ._common import LogitsShape, check_logits, check_target
from .door import Door
from .head import check_head
from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs
from .sampling import SamplingParams


class SequenceLogprobsCall(NamedTuple):
    """``sequence_logprobs``'s arguments, as its door hands them to the routes."""
    logits: Tensor
    target: Tensor
    mask: Tensor
    average: bool
    temperature: float
    backend: str
    sampling: Optional[SamplingParams]


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
    return SEQUENCE_LOGPROBS.enter(SequenceLogprobsCall(
        logits=logits, target=target, mask=mask, average=average, temperature=temperature,
        backend=backend, sampling=sampling))


class SequenceCall(NamedTuple):
    """A checked ``sequence_logprobs`` call: the mask as bool, the resolved backend."""
    keep: Tensor
    backend: str


def _check_sequence(call: SequenceLogprobsCall) -> SequenceCall:
    logits = call.logits
    check_logits(logits)
    keep = checked_sequence_mask(LogitsShape.of(logits), call.target, call.mask,
                                 call.average)
    return SequenceCall(keep, resolve_backend(call.backend, logits.device))


def _sequence_reference(call: SequenceLogprobsCall, checked: SequenceCall):
    if call.sampling is not None:
        return _sequence_local(call, checked)
    return reference.sequence_logprobs(
        call.logits.float(), torch.where(checked.keep, call.target, -100), call.mask,
        call.average, check_positive(call.temperature, "temperature"))


def _sequence_local(call: SequenceLogprobsCall, checked: SequenceCall):
    target = call.target
    masked_target = torch.where(checked.keep, target, torch.full_like(target, -100))
    logp = token_logprobs(call.logits, masked_target, temperature=call.temperature,
                          ignore_index=-100, backend=checked.backend, sampling=call.sampling)
    return reduce_sequence(logp, call.mask, call.average)


def _sequence_dtensor(op, **call):
    return dtensor.sequence_logprobs(op, token_logprobs, reduce_sequence, **call)


def checked_sequence_mask(logits: LogitsShape, target: torch.Tensor, mask: torch.Tensor,
                          average: bool) -> torch.Tensor:
    """Check ``mask``, ``average`` and the targets the mask keeps against ``[B, T, V]``
    logits; the mask as bool."""
    if len(logits.lead) != 2:
        raise ValueError(f"logits must have shape [B, T, V], got {logits.lead + (logits.vocab,)}")
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


SEQUENCE_LOGPROBS = Door(sequence_logprobs, ("logits", "target", "mask"), _check_sequence,
                         _sequence_local, _sequence_reference, dtensor=_sequence_dtensor)


class LinearSequenceLogprobsCall(NamedTuple):
    """``linear_sequence_logprobs``'s arguments, as its door hands them to the routes."""
    hidden: Tensor
    weight: Tensor
    target: Tensor
    mask: Tensor
    bias: Optional[Tensor]
    average: bool
    temperature: float
    softcap: Optional[float]
    logit_scale: float
    chunk_size: Optional[int]
    backend: str
    sampling: Optional[SamplingParams]


def linear_sequence_logprobs(hidden: Tensor, weight: Tensor, target: Tensor, mask: Tensor, *,
                             bias: Optional[Tensor] = None, average: bool = False,
                             temperature: float = 1.0, softcap: Optional[float] = None,
                             logit_scale: float = 1.0, chunk_size: Optional[int] = None,
                             backend: str = "auto",
                             sampling: Optional[SamplingParams] = None) -> Tensor:
    """Per-sequence sum (or mean over ``mask``) of token log-probs; hidden ``[B, T, H]``;
    ``softcap`` and ``logit_scale`` as in ``linear_token_logprobs``; ``sampling`` as in
    ``sequence_logprobs`` (a sequence with a token outside the support gets ``-inf``)."""
    return LINEAR_SEQUENCE_LOGPROBS.enter(LinearSequenceLogprobsCall(
        hidden=hidden, weight=weight, target=target, mask=mask, bias=bias, average=average,
        temperature=temperature, softcap=softcap, logit_scale=logit_scale, chunk_size=chunk_size,
        backend=backend, sampling=sampling))


def _check_linear_sequence(call: LinearSequenceLogprobsCall) -> SequenceCall:
    hidden, weight = call.hidden, call.weight
    check_head(hidden, weight, call.bias, call.chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    keep = checked_sequence_mask(LogitsShape.of_head(hidden, weight), call.target,
                                       call.mask, call.average)
    return SequenceCall(keep, resolve_backend(call.backend, hidden.device))


def _linear_sequence_logprobs(call: LinearSequenceLogprobsCall, checked: SequenceCall):
    """Both routes: the token log-probs (the reference's on the reference backend) reduced."""
    target = call.target
    masked_target = torch.where(checked.keep, target, torch.full_like(target, -100))
    logp = linear_token_logprobs(call.hidden, call.weight, masked_target, bias=call.bias,
                                 temperature=call.temperature, ignore_index=-100,
                                 softcap=call.softcap, logit_scale=call.logit_scale,
                                 chunk_size=call.chunk_size, backend=checked.backend,
                                 sampling=call.sampling)
    return reduce_sequence(logp, call.mask, call.average)


def _linear_sequence_dtensor(op, **call):
    return dtensor.linear_sequence_logprobs(op, linear_token_logprobs, reduce_sequence,
                                            **call)


LINEAR_SEQUENCE_LOGPROBS = Door(linear_sequence_logprobs,
                                ("hidden", "weight", "target", "mask", "bias"),
                                _check_linear_sequence, _linear_sequence_logprobs,
                                _linear_sequence_logprobs, dtensor=_linear_sequence_dtensor)
