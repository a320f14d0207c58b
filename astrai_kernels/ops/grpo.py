"""GRPO clipped surrogate (and DAPO, Dr.GRPO, GSPO) fused with the log-softmax-gather.

Contract: ``grpo_loss(logits [B, T, V], target [B, T], advantages [B] or [B, T])``
-> ``(loss, metrics)``. With token-level importance sampling one kernel computes per token
``lse``, ``logp``, the ratio, the clip, the k3 KL and ``dL/dlogp`` (the aggregation weight of
each token is known up front), and writes the gradient in the same pass. GSPO needs the
sequence ratio first: a forward-only log-prob pass, O(B*T) math here, then the gradient pass.
Log-ratios are clamped to +-20 before ``exp`` (as verl does) so no ratio overflows.

Masked tokens are selected away (``torch.where``), never multiplied by 0: their targets,
logits, advantages and old/reference log-probs may hold anything, inf and NaN included.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _library
from ._backend import resolve_backend
from ._common import (
    AttachGrad,
    check_choice,
    check_in_range,
    check_index,
    check_logits,
    check_per_row,
    check_positive,
    check_target,
    flat_target,
    rows_view,
)
from .logprobs import token_logprobs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class GRPOParams:
    beta: float
    clip_eps_low: float
    clip_eps_high: float
    delta: float  # 0.0: off
    loss_type: str
    importance_sampling: str
    temperature: float
    backend: str


@dataclass
class _Inputs:
    """Validated per-token inputs: ``valid`` marks the counted tokens; the float32 tensors hold
    0 at masked tokens whatever the caller passed there."""
    valid: Tensor
    advantages: Tensor
    old: Optional[Tensor]
    ref: Optional[Tensor]
    normalizer: Optional[Tensor]


def _check_finite_in_range(value, name: str, low: float, high: float) -> float:
    value = check_in_range(value, name, low, high)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_logprobs_input(tensor: Optional[Tensor], name: str, shape, device) -> Optional[Tensor]:
    tensor = check_per_row(tensor, name, shape, device, allow_none=True)
    if tensor is not None and not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor of token log-probs, got {tensor.dtype}")
    return tensor


def _check_normalizer(normalizer, loss_type: str, device) -> Optional[Tensor]:
    """``None`` or a float32 0-d tensor on ``device``; its value is checked in
    :func:`_check_values`."""
    if normalizer is None:
        return None
    if loss_type != "dapo":
        raise ValueError(f"normalizer applies to loss_type='dapo' only (the global token "
                         f"count); loss_type={loss_type!r} normalizes by itself")
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1 or normalizer.is_complex() or normalizer.dtype == torch.bool:
            raise ValueError(f"normalizer must be a number or a one-element real tensor, got "
                             f"{normalizer.dtype} of shape {tuple(normalizer.shape)}")
        return normalizer.detach().reshape(()).to(device=device, dtype=torch.float32)
    value = check_in_range(normalizer, "normalizer", 0.0, float("inf"))
    return torch.tensor(value, dtype=torch.float32, device=device)


def _check_values(mask: Optional[Tensor], valid: Tensor, normalizer: Optional[Tensor]) -> None:
    """A mask of 0s and 1s, and a normalizer that is finite and > 0 (0 only when no token is
    counted, an empty batch).

    Documented validation: one host sync when there is something to check (a mask that is not
    bool, a normalizer), like the target check; under ``torch.compile`` an on-device assert.
    """
    flags, messages = [], []
    if mask is not None and mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
        messages.append("mask must hold only 0 and 1 (or be a bool tensor)")
    if normalizer is not None:
        empty = ~valid.any()
        usable = torch.isfinite(normalizer) & ((normalizer > 0) | ((normalizer == 0) & empty))
        flags.append(~usable)
        messages.append("normalizer must be finite and > 0 (0 only when every token is masked)")
    if not flags or valid.device.type == "meta":
        return
    if torch.compiler.is_compiling():
        for flag, message in zip(flags, messages):
            torch._assert_async(~flag, message)
        return
    for bad, message in zip(torch.stack(flags).tolist(), messages):
        if bad:
            detail = f", got {normalizer.item()}" if message.startswith("normalizer") else ""
            raise ValueError(message + detail)


def _check(logits, target, advantages, mask, old_logprobs, ref_logprobs, beta, clip_eps_low,
           clip_eps_high, delta, loss_type, importance_sampling, temperature,
           max_completion_length, normalizer, backend) -> Tuple[_Inputs, GRPOParams]:
    check_logits(logits)
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    shape, device = tuple(logits.shape[:2]), logits.device
    if mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=device)
    else:
        valid = check_per_row(mask, "mask", shape, device) != 0
    check_target(target, logits, where=valid)
    if not isinstance(advantages, Tensor) or advantages.dim() not in (1, 2):
        raise ValueError("advantages must be a tensor of shape [B] or [B, T]")
    check_per_row(advantages, "advantages", shape[:advantages.dim()], device)
    if advantages.is_complex() or advantages.dtype == torch.bool:
        raise TypeError(f"advantages must be a real tensor, got {advantages.dtype}")
    advantages = advantages.detach().float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(shape)
    old = _check_logprobs_input(old_logprobs, "old_logprobs", shape, device)
    ref = _check_logprobs_input(ref_logprobs, "ref_logprobs", shape, device)
    beta = _check_finite_in_range(beta, "beta", 0.0, float("inf"))
    if beta > 0 and ref is None:
        raise ValueError("beta > 0 needs ref_logprobs (the reference policy's token log-probs)")
    clip_eps_low = check_in_range(clip_eps_low, "clip_eps_low", 0.0, 1.0)
    clip_eps_high = (clip_eps_low if clip_eps_high is None
                     else check_in_range(clip_eps_high, "clip_eps_high", 0.0, float("inf")))
    delta = 0.0 if delta is None else check_positive(delta, "delta")
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_choice(importance_sampling, "importance_sampling", IMPORTANCE_SAMPLING)
    if max_completion_length is not None:
        check_index(max_completion_length, "max_completion_length")
        if max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be > 0, got {max_completion_length}")
    normalizer = _check_normalizer(normalizer, loss_type, device)
    _check_values(mask, valid, normalizer)
    params = GRPOParams(beta, clip_eps_low, clip_eps_high, delta, loss_type, importance_sampling,
                        check_positive(temperature, "temperature"),
                        resolve_backend(backend, device))

    def select(values: Optional[Tensor]) -> Optional[Tensor]:
        if values is None:
            return None
        return torch.where(valid, values.detach().float(), 0.0)

    return _Inputs(valid, select(advantages), select(old), select(ref), normalizer), params


class FlatRows(NamedTuple):
    """The fused kernels' per-token inputs: contiguous float32 vectors of B*T (or None)."""
    advantages: Tensor
    old: Optional[Tensor]
    ref: Optional[Tensor]
    weight: Tensor


@dataclass(frozen=True)
class GRPOPlan:
    """One call's checked inputs and each token's weight in the aggregated loss ``[B, T]``."""
    inputs: _Inputs
    params: GRPOParams
    weight: Tensor

    def flat_rows(self) -> FlatRows:
        def flat(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x.reshape(-1).contiguous()

        return FlatRows(flat(self.inputs.advantages), flat(self.inputs.old),
                        flat(self.inputs.ref), flat(self.weight))


def plan(logits: Tensor, target: Tensor, advantages: Tensor, *, mask=None, old_logprobs=None,
         ref_logprobs=None, beta=0.0, clip_eps_low=0.2, clip_eps_high=None, delta=None,
         loss_type="bnpo", importance_sampling="token", temperature=1.0,
         max_completion_length=None, normalizer=None, backend="auto") -> GRPOPlan:
    """Check a call's arguments and weigh its tokens. ``logits`` may be a zero-byte stand-in of
    the logits' shape, dtype and device (the fused LM head's checks)."""
    inputs, params = _check(
        logits, target, advantages, mask, old_logprobs, ref_logprobs, beta, clip_eps_low,
        clip_eps_high, delta, loss_type, importance_sampling, temperature,
        max_completion_length, normalizer, backend)
    weight = _token_weight(inputs.valid, loss_type, max_completion_length, inputs.normalizer)
    return GRPOPlan(inputs, params, weight)


def grpo_loss(logits: Tensor, target: Tensor, advantages: Tensor, *,
              mask: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
              ref_logprobs: Optional[Tensor] = None, beta: float = 0.0,
              clip_eps_low: float = 0.2, clip_eps_high: Optional[float] = None,
              delta: Optional[float] = None, loss_type: str = "bnpo",
              importance_sampling: str = "token", temperature: float = 1.0,
              max_completion_length: Optional[int] = None,
              normalizer: Union[None, float, Tensor] = None,
              backend: str = "auto", process_group: Optional["ProcessGroup"] = None
              ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO policy loss and detached float32 metrics (means over the unmasked tokens).

    ``mask`` holds 0s and 1s (or is bool); ``normalizer`` (``loss_type="dapo"`` only) is the
    global count of unmasked tokens, a number or a one-element tensor; 0 is allowed when every
    token is masked, and the loss is then 0.0 with a zero gradient.

    ``process_group`` (vocabulary parallel): ``logits`` hold this rank's contiguous vocabulary
    shard, ``target`` global ids (``ops/vocab_parallel.py``).
    """
    if process_group is not None:
        from . import vocab_parallel

        return vocab_parallel.grpo_loss(
            logits, target, advantages, process_group=process_group, backend=backend, mask=mask,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, beta=beta,
            clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, delta=delta,
            loss_type=loss_type, importance_sampling=importance_sampling,
            temperature=temperature, max_completion_length=max_completion_length,
            normalizer=normalizer)
    checked = plan(logits, target, advantages, mask=mask, old_logprobs=old_logprobs,
                   ref_logprobs=ref_logprobs, beta=beta, clip_eps_low=clip_eps_low,
                   clip_eps_high=clip_eps_high, delta=delta, loss_type=loss_type,
                   importance_sampling=importance_sampling, temperature=temperature,
                   max_completion_length=max_completion_length, normalizer=normalizer,
                   backend=backend)
    inputs, params = checked.inputs, checked.params
    if params.backend == "reference":
        from .. import reference

        return reference.grpo_loss(
            logits.float(), target, inputs.advantages, inputs.valid, inputs.old, inputs.ref,
            params.beta, params.clip_eps_low, params.clip_eps_high, params.delta or None,
            loss_type, importance_sampling, params.temperature, max_completion_length,
            inputs.normalizer)
    if importance_sampling == "sequence":
        def logprobs_of(masked_target: Tensor) -> Tensor:
            return token_logprobs(logits, masked_target, temperature=params.temperature,
                                  backend=params.backend)

        return sequence_level(logprobs_of, target, checked)
    return _token_level(logits, target, checked)


def _token_weight(valid: Tensor, loss_type: str, max_completion_length: Optional[int],
                  normalizer: Optional[Tensor]) -> Tensor:
    """Each token's factor in the aggregated loss (0 on masked tokens), float32 ``[B, T]``."""
    batch, length = valid.shape
    mask = valid.to(torch.float32)
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * batch)
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / float(batch * (max_completion_length or length))
    if normalizer is None:
        return mask / mask.sum().clamp(min=1.0)
    # A normalizer of 0 is valid only when every token is masked: divide by 1, on the device.
    return mask / torch.where(normalizer > 0, normalizer, 1.0)


def _surrogate(ratio: Tensor, advantages: Tensor, params: GRPOParams) -> Tensor:
    """``-min(r_u * A, clip(r) * A)``; where both agree the unclipped branch carries the
    gradient. ``r_u = min(r, delta)`` when ``delta`` is on."""
    ratio_unclipped = ratio.clamp(max=params.delta) if params.delta > 0 else ratio
    unclipped = ratio_unclipped * advantages
    clipped = ratio.clamp(1.0 - params.clip_eps_low, 1.0 + params.clip_eps_high) * advantages
    return -torch.where(unclipped <= clipped, unclipped, clipped)


def _k3(logp: Tensor, ref: Optional[Tensor]) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref): ``exp(d) - d - 1`` with ``d = ref - logp``."""
    if ref is None:
        return torch.zeros_like(logp)
    log_ratio = (ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _metrics(ratio: Tensor, k3: Tensor, inputs: _Inputs,
             params: GRPOParams) -> Dict[str, Tensor]:
    valid, advantages = inputs.valid, inputs.advantages
    count = valid.sum().clamp(min=1).to(torch.float32)
    low = (ratio < 1.0 - params.clip_eps_low) & (advantages < 0)
    high = (ratio > 1.0 + params.clip_eps_high) & (advantages > 0)

    def masked_mean(x: Tensor) -> Tensor:
        return (torch.where(valid, x.float(), 0.0).sum() / count).detach()

    return {"kl": masked_mean(k3), "ratio/mean": masked_mean(ratio),
            "clip_ratio/low": masked_mean(low), "clip_ratio/high": masked_mean(high),
            "clip_ratio/region": masked_mean(low | high)}


def _token_level(logits: Tensor, target: Tensor,
                 checked: GRPOPlan) -> Tuple[Tensor, Dict[str, Tensor]]:
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    params, flat = checked.params, checked.flat_rows()
    with torch.no_grad():
        logp, token_loss, grad = _library.grpo_forward(
            rows_view(logits), flat_target(target), params.temperature, flat.advantages,
            flat.old, flat.ref, flat.weight, params.clip_eps_low, params.clip_eps_high,
            params.delta, params.beta, needs_grad, params.backend)
        value, metrics = token_level_result(logp, token_loss, checked)
    loss = AttachGrad.apply(rows_view(logits), value, grad) if needs_grad else value
    return loss, metrics


def token_level_result(logp: Tensor, token_loss: Tensor,
                       checked: GRPOPlan) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The loss (weighted sum of the fused kernel's per-token losses) and the metrics."""
    inputs, params = checked.inputs, checked.params
    valid = inputs.valid.reshape(-1)
    value = torch.where(valid, token_loss * checked.flat_rows().weight, 0.0).sum()
    logp = torch.where(inputs.valid, logp.view(inputs.valid.shape), 0.0)
    old = logp if inputs.old is None else inputs.old
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return value, _metrics(ratio, _k3(logp, inputs.ref), inputs, params)


def sequence_level(logprobs_of: Callable[[Tensor], Tensor], target: Tensor,
                   checked: GRPOPlan) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GSPO: ``r_b = exp(mean over unmasked tokens of logp - old)``, one ratio per sequence,
    its gradient reaching every unmasked token of the sequence. ``logprobs_of(masked_target)``
    gives the differentiable token log-probs ``[B, T]`` (from logits or the fused head)."""
    inputs, params, weight = checked.inputs, checked.params, checked.weight
    valid = inputs.valid
    masked_target = torch.where(valid, target, torch.full_like(target, -100))
    logp = logprobs_of(masked_target)
    old = logp.detach() if inputs.old is None else inputs.old
    lengths = valid.sum(-1, keepdim=True).clamp(min=1).to(torch.float32)
    seq_log_ratio = torch.where(valid, logp - old, 0.0).sum(-1, keepdim=True) / lengths
    ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(logp)
    token_loss = _surrogate(ratio, inputs.advantages, params)
    k3 = _k3(logp, inputs.ref)
    if params.beta > 0:
        token_loss = token_loss + params.beta * k3
    loss = torch.where(valid, token_loss * weight, 0.0).sum()
    return loss, _metrics(ratio.detach(), k3.detach(), inputs, params)
