"""A GRPO call, checked: its inputs, the kernel's arguments and each token's weight.

``plan`` checks every argument of ``grpo_loss`` or ``linear_grpo_loss`` but the logits (the
fused head and a vocabulary shard have none; they pass a ``LogitsShape``) and returns a
:class:`GRPOPlan`: the per-token inputs selected to the mask (:class:`TokenInputs`), the
kernel's :class:`GRPOParams`, and each token's factor in the aggregated loss by the loss type's
record (``options.grpo.LossType.token_weight``). The rollout correction
(``ops/rollout_correction.py``) is applied here once the old log-probs are known.
``ops/grpo.py`` computes the loss from a plan.
"""

import dataclasses
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.primitives import SurrogateArgs
from ..kernels.registry import resolve_backend
from ..options.grpo import (
    DEFAULT_OPTIONS,
    GLOBAL_COUNT_LOSS_TYPES,
    LOSS_TYPE_RECORDS,
    OPTION_NAMES,
    GRPOOptions,
    LossType,
    options_from,
    options_or_keywords,
)
from ..options.scalars import check_bool, check_in_range
from . import rollout_correction
from ._common import LogitsShape, check_per_row, check_target
from .sampling import SamplingParams, checked_sampling


@dataclass(frozen=True)
class GRPOParams(SurrogateArgs):
    """The surrogate kernel's arguments (``GRPOOptions.surrogate_args``), the backend, and the
    checked options they come from (every other option is read from ``options``)."""
    backend: str
    # no default: torch <= 2.11's Dynamo cannot wrap a dataclass instance as a default argument
    options: GRPOOptions  # as checked

    @classmethod
    def of(cls, options: GRPOOptions, backend: str) -> "GRPOParams":
        args = options.surrogate_args()
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)},
                   backend=backend, options=options)

    @property
    def record(self) -> LossType:
        return self.options.record


@dataclass
class TokenInputs:
    """Validated per-token inputs: ``valid`` marks the counted tokens (the mask, less the tokens
    the rollout rejection drops), ``scored`` the mask as given (the tokens whose log-probs the
    call returns); the float32 tensors hold 0 at masked tokens whatever the caller passed."""
    valid: Tensor
    advantages: Tensor
    old: Optional[Tensor]
    ref: Optional[Tensor]
    normalizer: Optional[Tensor]
    importance_weights: Optional[Tensor] = None
    sampling: Optional[Tensor] = None
    scored: Optional[Tensor] = None
    #: ``importance_weights`` are known to be > 0 on every unmasked token
    weights_positive: bool = False


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
    if not LOSS_TYPE_RECORDS[loss_type].global_count:
        raise ValueError(f"normalizer applies to loss_type in {GLOBAL_COUNT_LOSS_TYPES} only "
                         f"(the global token count); loss_type={loss_type!r} normalizes by "
                         f"itself")
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1 or normalizer.is_complex() or normalizer.dtype == torch.bool:
            raise ValueError(f"normalizer must be a number or a one-element real tensor, got "
                             f"{normalizer.dtype} of shape {tuple(normalizer.shape)}")
        return normalizer.detach().reshape(()).to(device=device, dtype=torch.float32)
    value = check_in_range(normalizer, "normalizer", 0.0, float("inf"))
    return torch.tensor(value, dtype=torch.float32, device=device)


def _check_values(mask: Optional[Tensor], valid: Tensor, normalizer: Optional[Tensor],
                  importance_weights: Optional[Tensor] = None) -> bool:
    """A mask of 0s and 1s, a normalizer that is finite and > 0 (0 only when no token is
    counted, an empty batch), importance weights finite and >= 0 on the unmasked tokens.
    Returns whether the importance weights are known to be > 0 on every unmasked token (read
    in the same sync; False under ``torch.compile``): only then may they fold into the fused
    kernel, whose rows of weight 0 are masked ones (no log-prob for the metrics).

    Documented validation: one host sync when there is something to check (a mask that is not
    bool, importance weights, a normalizer on CPU), like the target check; under
    ``torch.compile`` an on-device assert, and for a normalizer on CUDA too (no host sync).
    """
    flags, messages, zero_weight = [], [], None
    if mask is not None and mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
        messages.append("mask must hold only 0 and 1 (or be a bool tensor)")
    if importance_weights is not None:
        usable = torch.isfinite(importance_weights) & (importance_weights >= 0)
        flags.append((valid & ~usable).any())
        messages.append("importance_weights must be finite and >= 0 on the unmasked tokens")
        zero_weight = (valid & (importance_weights == 0)).any()
    if normalizer is not None:
        empty = ~valid.any()
        usable = torch.isfinite(normalizer) & ((normalizer > 0) | ((normalizer == 0) & empty))
        message = "normalizer must be finite and > 0 (0 only when every token is masked)"
        if normalizer.device.type not in ("cpu", "meta") and not torch.compiler.is_compiling():
            torch._assert_async(usable, message)
        else:
            flags.append(~usable)
            messages.append(message)
    if not flags or valid.device.type == "meta":
        return False
    if torch.compiler.is_compiling():
        for flag, message in zip(flags, messages):
            torch._assert_async(~flag, message)
        return False
    read = torch.stack(flags + ([] if zero_weight is None else [zero_weight])).tolist()
    for bad, message in zip(read, messages):
        if bad:
            detail = f", got {normalizer.item()}" if message.startswith("normalizer") else ""
            raise ValueError(message + detail)
    return zero_weight is not None and not read[-1]


def _check_option_inputs(options: GRPOOptions, ref: Optional[Tensor],
                         sampling: Optional[Tensor], importance_weights: Optional[Tensor]):
    """The checked options against the call's tensors: each tensor an option needs is given,
    and none is given that no option reads."""
    if options.beta > 0 and ref is None:
        raise ValueError("beta > 0 needs ref_logprobs (the reference policy's token log-probs)")
    if options.kl_ratio_correction and ref is None:
        raise ValueError("kl_ratio_correction=True needs ref_logprobs (it scales the k3 KL "
                         "term by the importance ratio)")
    rollout_correction.check_inputs(options, sampling, importance_weights)
    if (sampling is not None and options.off_policy_threshold is None
            and not options.rollout_correction_on):
        raise ValueError("sampling_logprobs is used by the off-policy sequence mask and the "
                         "rollout correction only: pass off_policy_threshold, rollout_is or "
                         "rollout_rs too")


def _check(logits: LogitsShape, target, advantages, options: GRPOOptions, mask, old_logprobs,
           ref_logprobs, normalizer, backend, importance_weights=None,
           sampling_logprobs=None) -> Tuple[TokenInputs, GRPOParams]:
    if not isinstance(options, GRPOOptions):
        raise TypeError(f"options must be a GRPOOptions, got {type(options).__name__}")
    if len(logits.lead) != 2:
        raise ValueError(f"logits must have shape [B, T, V], got {logits.lead + (logits.vocab,)}")
    shape, device = logits.lead, logits.device
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
    options = options.checked()
    normalizer = _check_normalizer(normalizer, options.loss_type, device)
    weights = check_per_row(importance_weights, "importance_weights", shape, device,
                            allow_none=True)
    if weights is not None and not weights.is_floating_point():
        raise TypeError(f"importance_weights must be a floating tensor, got {weights.dtype}")
    sampling = _check_logprobs_input(sampling_logprobs, "sampling_logprobs", shape, device)
    _check_option_inputs(options, ref, sampling, weights)
    weights_positive = _check_values(mask, valid, normalizer, weights)
    params = GRPOParams.of(options, resolve_backend(backend, device))

    def select(values: Optional[Tensor]) -> Optional[Tensor]:
        if values is None:
            return None
        return torch.where(valid, values.detach().float(), 0.0)

    return TokenInputs(valid, select(advantages), select(old), select(ref), normalizer,
                   select(weights), select(sampling), scored=valid,
                   weights_positive=weights_positive), params


class FlatRows(NamedTuple):
    """The fused kernels' per-token inputs: contiguous float32 vectors of B*T (or None)."""
    advantages: Tensor
    old: Optional[Tensor]
    ref: Optional[Tensor]
    weight: Tensor


@dataclass(frozen=True)
class GRPOPlan:
    """One call's checked inputs and each token's weight in the aggregated loss ``[B, T]``."""
    inputs: TokenInputs
    params: GRPOParams
    weight: Tensor
    #: ``return_token_values``: the call also returns each token's log-prob and entropy
    token_values: bool = False
    #: the rollout correction waits for the token log-probs: as ``old`` (``old_logprobs=None``)
    #: or, with ``sampling=``, for the support (the correction reads the mask without it)
    correction_pending: bool = False
    #: ``sampling=``: the support is known once the token log-probs are (``with_support``)
    support_pending: bool = False
    #: ``sampling=``: the sampler's processed distribution the tokens are scored under
    sampling: Optional[SamplingParams] = None
    #: the rollout correction's metrics, once computed
    correction_metrics: Optional[Dict[str, Tensor]] = None

    @property
    def backend(self) -> str:
        return self.params.backend

    @property
    def fused(self) -> bool:
        """Whether the single-pass kernel's formula covers the call: the clipped surrogate on
        token ratios, with no mask or term that needs the log-probs first. Importance weights
        fold into the token weights when there is no KL term for them to leave alone and none
        is 0 (the kernel reads a weight of 0 as a masked token: no log-prob for the metrics)."""
        params, options = self.params, self.params.options
        return (params.record.single_pass and options.importance_sampling == "token"
                and options.extras_at_defaults and not self.correction_pending
                # a token the rejection drops has weight 0 there: no log-prob to return
                and not (options.rollout_rs is not None and self.token_values)
                and (self.inputs.importance_weights is None
                     or (params.beta == 0 and self.inputs.weights_positive)))

    def flat_rows(self) -> FlatRows:
        def flat(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x.reshape(-1).contiguous()

        weight = self.weight
        if self.inputs.importance_weights is not None:
            weight = weight * self.inputs.importance_weights
        return FlatRows(flat(self.inputs.advantages), flat(self.inputs.old),
                        flat(self.inputs.ref), flat(weight))


@options_or_keywords
def plan(logits: LogitsShape, target: Tensor, advantages: Tensor,
         options: Optional[GRPOOptions] = None, *, mask=None, old_logprobs=None,
         ref_logprobs=None, normalizer=None, importance_weights=None, sampling_logprobs=None,
         backend="auto", return_token_values=False, sampling=None, **keywords) -> GRPOPlan:
    """Check a call's arguments (all but the logits tensor, which the fused head and a
    vocabulary shard do not have) and weigh its tokens. The options come as ``options`` or
    as ``GRPOOptions``' fields in ``keywords``."""
    check_bool(return_token_values, "return_token_values")
    unknown = set(keywords) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    options = options_from(options, {**DEFAULT_OPTIONS.keywords(), **keywords})
    inputs, params = _check(logits, target, advantages, options, mask, old_logprobs,
                            ref_logprobs, normalizer, backend, importance_weights,
                            sampling_logprobs)
    weight = token_weights(inputs.valid, params.options, inputs.normalizer)
    if sampling is not None:
        sampling = check_sampling(sampling, params.options, return_token_values)
    checked = GRPOPlan(inputs, params, weight, return_token_values,
                       support_pending=sampling is not None, sampling=sampling)
    if not params.options.rollout_correction_on:
        return checked
    if inputs.old is None or checked.support_pending:
        return dataclasses.replace(checked, correction_pending=True)
    return corrected(checked, inputs.old)


def corrected(checked: GRPOPlan, logp: Tensor) -> GRPOPlan:
    """``checked`` with its rollout correction (``ops/rollout_correction.py``) from the call's
    old log-probs, or from ``logp`` (the token log-probs, detached) when it has none: the
    importance weights become the call's ``importance_weights`` (where TRL multiplies its
    vLLM ratio: each token's policy term; inside phi for VESPO), the rejected tokens leave
    the mask (verl replaces ``response_mask``), and the token weights follow the new mask.
    Under ``sampling=`` it comes after ``with_support``: the mask it reads is without the
    tokens outside the support."""
    inputs, params = checked.inputs, checked.params
    old = logp if inputs.old is None else inputs.old
    correction = rollout_correction.rollout_correction(old, inputs.sampling, inputs.scored,
                                                       params.options)
    positive, options = inputs.weights_positive, params.options
    if correction.weights is not None:
        # > 0 for sure only when truncated from below (exp(d) may underflow to 0 otherwise)
        positive = (options.rollout_is.endswith("_truncate")
                    and (options.rollout_is_min or 0.0) > 0)
    weights = inputs.importance_weights if correction.weights is None else correction.weights
    inputs = dataclasses.replace(inputs, valid=correction.kept, importance_weights=weights,
                                 weights_positive=positive)
    weight = token_weights(inputs.valid, params.options, inputs.normalizer)
    # ``mask/out_of_support`` (``with_support``) stays beside the correction's metrics
    metrics = {**(checked.correction_metrics or {}), **correction.metrics}
    return dataclasses.replace(checked, inputs=inputs, weight=weight, correction_pending=False,
                               correction_metrics=metrics)


def check_sampling(sampling, options: GRPOOptions, token_values: bool,
                   sharded: bool = False) -> SamplingParams:
    """``sampling`` of a GRPO call, and what it cannot go with."""
    return checked_sampling(sampling, options.temperature,
                            top_entropy_quantile=options.top_entropy_quantile < 1.0,
                            entropy_coef=options.entropy_coef != 0.0,
                            return_token_values=token_values,
                            **{"process_group or DTensor arguments": sharded})


def token_weights(valid: Tensor, options: GRPOOptions, normalizer: Optional[Tensor]) -> Tensor:
    """Each token's factor in the aggregated loss (0 on masked tokens), float32 ``[B, T]``, by
    the loss type's ``token_weight`` (``LossType``)."""
    batch, length = valid.shape
    mask = valid.to(torch.float32)
    kind = options.record.token_weight
    if kind == "sequence_mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * batch)
    if kind == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    if kind == "max_length":
        return mask / float(batch * (options.max_completion_length or length))
    if kind == "sequence_sum":
        # mean over sequences of the sum over its tokens: a sequence weighs by its length
        return mask / float(max(batch, 1))
    if normalizer is None:
        return mask / mask.sum().clamp(min=1.0)
    # A normalizer of 0 is valid only when every token is masked: divide by 1, on the device.
    return mask / torch.where(normalizer > 0, normalizer, 1.0)
