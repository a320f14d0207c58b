"""GRPO clipped surrogate (and DAPO, Dr.GRPO, GSPO, LUSPO, CISPO, SAPO, VESPO) fused with the
log-softmax-gather.

Contract: ``grpo_loss(logits [B, T, V], target [B, T], advantages [B] or [B, T])``
-> ``(loss, metrics)``. With token-level importance sampling and the clipped surrogate one
kernel computes per token ``lse``, ``logp``, the ratio, the clip, the k3 KL (times the ratio
with ``kl_ratio_correction``) and ``dL/dlogp`` (the aggregation weight of each token is known
up front), and writes the gradient in the same pass. Every other objective (GSPO's sequence
ratio, CISPO, SAPO, VESPO, the off-policy and entropy masks, the entropy bonus) is O(B*T)
torch math (``ops/grpo_objective.py``) on the differentiable token log-probs (and entropies)
of ``token_logprobs``: a forward pass, then the gradient pass. Log-ratios are clamped to +-20
before ``exp`` (as verl does) so no ratio overflows.

Masked tokens are selected away (``torch.where``), never multiplied by 0: their targets,
logits, advantages and old/reference log-probs may hold anything, inf and NaN included.

``linear_grpo_loss``: the same from the hidden states and the LM head, never the logits
(``ops/head.py``'s walk of the ``grpo_forward`` primitive, or ``linear_token_logprobs``). Both
forms check their call with ``ops/grpo_plan.py``'s ``plan``.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..distributed import agreement, dtensor, vocab_parallel
from ..options.grpo import GRPOOptions, options_from, options_or_keywords
from ..options.scalars import checked_transform
from ._common import (
    LogitsShape,
    check_logits,
    flat_target,
)
from .door import Door
from .grpo_objective import (
    from_logprobs,
    reference_loss,
    sampled_logprobs_of,
    token_level,
    token_level_result,
)
from .grpo_plan import (
    GRPOPlan,
    check_sampling,
    plan,
)
from .head import (
    AttachHeadGrads,
    check_head,
    head_needs,
    head_walk,
    reference_logits,
    reference_on_logits,
)
from .linear_logprobs import linear_token_logprobs, refuse_transform_with_process_group
from .logprobs import token_logprobs
from .sampling import SamplingParams

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GRPOLossCall(NamedTuple):
    """``grpo_loss``'s arguments, its option keywords folded into ``options``, as its door
    hands them to the routes."""
    logits: Tensor
    target: Tensor
    advantages: Tensor
    mask: Optional[Tensor]
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    normalizer: Union[None, float, Tensor]
    importance_weights: Optional[Tensor]
    sampling_logprobs: Optional[Tensor]
    options: GRPOOptions
    sampling: Optional[SamplingParams]
    return_token_values: bool
    backend: str
    process_group: Optional["ProcessGroup"]
    check_consistency: bool


@options_or_keywords
def grpo_loss(logits: Tensor, target: Tensor, advantages: Tensor, *,
              mask: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
              ref_logprobs: Optional[Tensor] = None, beta: float = 0.0,
              clip_eps_low: float = 0.2, clip_eps_high: Optional[float] = None,
              delta: Optional[float] = None, loss_type: str = "bnpo",
              importance_sampling: str = "token", temperature: float = 1.0,
              max_completion_length: Optional[int] = None,
              normalizer: Union[None, float, Tensor] = None,
              sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
              vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
              kl_ratio_correction: bool = False, importance_weights: Optional[Tensor] = None,
              off_policy_threshold: Optional[float] = None,
              sampling_logprobs: Optional[Tensor] = None, top_entropy_quantile: float = 1.0,
              entropy_coef: float = 0.0, rollout_is: Optional[str] = None,
              rollout_is_min: Optional[float] = None, rollout_is_max: Optional[float] = 3.0,
              rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
              rollout_rs_threshold: Optional[float] = None,
              rollout_rs_threshold_lower: Optional[float] = None,
              options: Optional[GRPOOptions] = None,
              sampling: Optional[SamplingParams] = None,
              return_token_values: bool = False, backend: str = "auto",
              process_group: Optional["ProcessGroup"] = None,
              check_consistency: bool = True) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO-family policy loss and detached float32 metrics (means over the unmasked tokens).

    ``mask`` holds 0s and 1s (or is bool); ``normalizer`` (the loss types aggregated as sum /
    normalizer: ``"dapo"``, ... in docs/objectives.md) is the global count of unmasked tokens, a
    number or a one-element tensor; 0 is allowed when every token is masked, and the loss is
    then 0.0 with a zero gradient. The objectives and options follow TRL's
    ``GRPOTrainer._compute_loss``; README's "Supported objectives" lists their formulas.

    ``process_group`` (vocabulary parallel): ``logits`` hold this rank's contiguous vocabulary
    shard, ``target`` global ids (``ops/vocab_parallel.py``); ``check_consistency`` as in
    ``cross_entropy`` (the fingerprint is of the unmasked targets; advantages, mask and
    log-probs must agree too but are not compared).

    ``options``: a :class:`GRPOOptions` holding every scalar keyword above at once; passing any
    of those keywords beside it raises ``ValueError``, whatever its value.

    ``return_token_values=True`` returns ``(loss, metrics, values)``: ``values["logprobs"]``
    and ``values["entropy"]`` are each token's log-prob and entropy at ``temperature``,
    detached float32 ``[B, T]``, 0 at masked tokens, from the same pass over the logits (what a
    trainer logs or keeps as the next step's old log-probs). ``metrics`` then also hold
    ``entropy``.

    Rollout correction from ``sampling_logprobs`` (the sampler's log-probs of the sampled
    tokens) and the old log-probs (``logp`` detached when None): ``rollout_is`` (TRL's
    ``vllm_importance_sampling_mode``: ``"token_truncate"``, ``"token_mask"``,
    ``"sequence_truncate"``, ``"sequence_mask"``) weighs each token's policy term by
    ``exp(old - sampling)`` (per token, or of its sum per sequence) clamped to, or zeroed
    outside, ``[rollout_is_min, rollout_is_max]``; ``rollout_is_batch_normalize`` divides the
    weights by their batch mean (verl). ``rollout_rs`` (verl's rejection: ``"token_k1"``,
    ``"seq_mean_k3"``, ...) drops the tokens or sequences whose k1/k2/k3 divergence is out of
    ``rollout_rs_threshold`` (and ``rollout_rs_threshold_lower`` for k1) from the mask.
    docs/objectives.md, "Rollout correction", has the formulas and metrics.

    ``sampling`` (an ``ak.SamplingParams``): score each token under the sampler's processed
    distribution (``token_logprobs(sampling=...)``: temperature, min_p, top_k, top_p; the
    temperature is ``sampling.temperature``, ``temperature`` stays 1.0). A token outside that
    support is masked (it leaves the mask as a rejected token does: no policy or KL term, not
    counted by the aggregation; with ``normalizer`` the caller's count should leave it out) and
    counted in ``metrics["mask/out_of_support"]``, the share of the unmasked tokens. Not with
    the options that need the entropy (``top_entropy_quantile < 1``, ``entropy_coef``,
    ``return_token_values``), ``process_group`` or DTensors.
    """
    options = options_from(options, dict(
        beta=beta, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, delta=delta,
        loss_type=loss_type, importance_sampling=importance_sampling, temperature=temperature,
        max_completion_length=max_completion_length, sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
        kl_ratio_correction=kl_ratio_correction, off_policy_threshold=off_policy_threshold,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
        rollout_is=rollout_is, rollout_is_min=rollout_is_min, rollout_is_max=rollout_is_max,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        rollout_rs_threshold_lower=rollout_rs_threshold_lower))
    return GRPO_LOSS.enter(GRPOLossCall(
        logits=logits, target=target, advantages=advantages, mask=mask, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, normalizer=normalizer, importance_weights=importance_weights,
        sampling_logprobs=sampling_logprobs, options=options, sampling=sampling,
        return_token_values=return_token_values, backend=backend, process_group=process_group,
        check_consistency=check_consistency))


def call_inputs(call: Union[GRPOLossCall, "LinearGRPOLossCall"]) -> Dict[str, object]:
    """The per-token inputs and flags of a GRPO call, as ``plan`` takes them."""
    return dict(mask=call.mask, old_logprobs=call.old_logprobs, ref_logprobs=call.ref_logprobs,
                normalizer=call.normalizer, importance_weights=call.importance_weights,
                sampling_logprobs=call.sampling_logprobs,
                return_token_values=call.return_token_values, sampling=call.sampling)


def _check_call(call: GRPOLossCall) -> GRPOPlan:
    logits = call.logits
    check_logits(logits)
    return plan(LogitsShape.of(logits), call.target, call.advantages, call.options,
                backend=call.backend, **call_inputs(call))


def _reference(call: GRPOLossCall, checked: GRPOPlan):
    if checked.sampling is not None:
        return _local(call, checked)
    return reference_loss(call.logits, call.target, checked)


def _local(call: GRPOLossCall, checked: GRPOPlan):
    logits, target, params = call.logits, call.target, checked.params
    if checked.sampling is not None:
        return from_logprobs(sampled_logprobs_of(lambda masked_target: token_logprobs(
            logits, masked_target, ignore_index=-100, sampling=checked.sampling,
            backend=params.backend)), target, checked)
    if not checked.fused:
        def logprobs_of(masked_target: Tensor, with_entropy: bool):
            out = token_logprobs(logits, masked_target, temperature=params.temperature,
                                 return_entropy=with_entropy, backend=params.backend)
            return out if with_entropy else (out, None)

        return from_logprobs(logprobs_of, target, checked)
    return token_level(logits, target, checked)


def _dtensor(op, *, sampling, options, return_token_values, **arguments):
    if sampling is not None:
        check_sampling(sampling, options, return_token_values, sharded=True)
    return dtensor.grpo_loss(op, sampling=sampling, options=options,
                             return_token_values=return_token_values, **arguments)


def _vocab_parallel(call: GRPOLossCall):
    """``grpo_loss`` of a vocabulary shard: the differentiable token log-probs of the group,
    then the per-token objective in torch (``ops/vocab_parallel.py``)."""
    logits, target = call.logits, call.target
    if call.sampling is not None:
        check_sampling(call.sampling, call.options, call.return_token_values, sharded=True)
    check_consistency = vocab_parallel.check_consistency_flag(call.check_consistency)

    def checks(layout):
        check_logits(logits, allow_empty_vocab=True)
        return plan(
            vocab_parallel.whole_logits(logits, layout), target, call.advantages,
            call.options, backend=call.backend, **call_inputs(call))

    # the row count here; the targets' fingerprint (masked ones ignored) in token_logprobs
    layout, checked = vocab_parallel.agreed_layout(
        "grpo_loss", call.process_group, vocab_parallel.vocab_size(logits), (logits,), target,
        -100, False, checks)
    if checked.params.backend == "reference":
        return vocab_parallel.on_gathered_logits(grpo_loss, call,
                                                 layout)

    def logprobs_of(masked_target, with_entropy):
        with agreement.settled():  # its inputs are the checked ones
            out = token_logprobs(logits, masked_target, process_group=call.process_group,
                                 temperature=checked.params.temperature, ignore_index=-100,
                                 return_entropy=with_entropy, backend=call.backend,
                                 check_consistency=check_consistency)
        return out if with_entropy else (out, None)

    return from_logprobs(logprobs_of, target, checked)


GRPO_LOSS = Door(grpo_loss, ("logits", "target", "advantages", "mask", "old_logprobs",
                             "ref_logprobs", "normalizer", "importance_weights",
                             "sampling_logprobs"),
                 _check_call, _local, _reference, _vocab_parallel, _dtensor)


_HEAD_WALK = head_walk("grpo_forward")


class LinearGRPOLossCall(NamedTuple):
    """``linear_grpo_loss``'s arguments, its option keywords folded into ``options``, as its
    door hands them to the routes."""
    hidden: Tensor
    weight: Tensor
    target: Tensor
    advantages: Tensor
    bias: Optional[Tensor]
    mask: Optional[Tensor]
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    normalizer: Union[None, float, Tensor]
    importance_weights: Optional[Tensor]
    sampling_logprobs: Optional[Tensor]
    options: GRPOOptions
    softcap: Optional[float]
    logit_scale: float
    sampling: Optional[SamplingParams]
    return_token_values: bool
    chunk_size: Optional[int]
    backend: str
    process_group: Optional["ProcessGroup"]
    check_consistency: bool


@options_or_keywords
def linear_grpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, advantages: Tensor, *,
                     bias: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                     old_logprobs: Optional[Tensor] = None,
                     ref_logprobs: Optional[Tensor] = None, beta: float = 0.0,
                     clip_eps_low: float = 0.2, clip_eps_high: Optional[float] = None,
                     delta: Optional[float] = None, loss_type: str = "bnpo",
                     importance_sampling: str = "token", temperature: float = 1.0,
                     max_completion_length: Optional[int] = None,
                     normalizer: Union[None, float, Tensor] = None,
                     sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
                     vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                     vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                     kl_ratio_correction: bool = False,
                     importance_weights: Optional[Tensor] = None,
                     off_policy_threshold: Optional[float] = None,
                     sampling_logprobs: Optional[Tensor] = None,
                     top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0,
                     rollout_is: Optional[str] = None, rollout_is_min: Optional[float] = None,
                     rollout_is_max: Optional[float] = 3.0,
                     rollout_is_batch_normalize: bool = False,
                     rollout_rs: Optional[str] = None,
                     rollout_rs_threshold: Optional[float] = None,
                     rollout_rs_threshold_lower: Optional[float] = None,
                     options: Optional[GRPOOptions] = None, softcap: Optional[float] = None,
                     logit_scale: float = 1.0, sampling: Optional[SamplingParams] = None,
                     return_token_values: bool = False,
                     chunk_size: Optional[int] = None, backend: str = "auto",
                     process_group: Optional["ProcessGroup"] = None,
                     check_consistency: bool = True) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO loss and metrics of ``grpo_loss(F.linear(hidden, weight, bias), ...)``, fused.

    ``hidden [B, T, H]`` aligned with ``target [B, T]`` (the caller shifts); every keyword as in
    ``ak.grpo_loss``. The clipped surrogate on token ratios computes all gradients in the
    forward's single walk over the chunks; every other objective and option (GSPO, CISPO, SAPO,
    VESPO, the masks, the entropy bonus) differentiates through ``linear_token_logprobs``.
    ``softcap`` and ``logit_scale`` transform the logits before the temperature, as in
    ``linear_token_logprobs``. ``process_group``: vocabulary parallel, as in
    ``linear_cross_entropy`` (no softcap or logit scale there). ``return_token_values`` as in
    ``ak.grpo_loss``: the token log-probs and entropies come out of the same walk.
    ``sampling`` as in ``ak.grpo_loss``: the token log-probs under the sampler's processed
    distribution (``linear_token_logprobs(sampling=...)``), a token outside it masked.
    """
    options = options_from(options, dict(
        beta=beta, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, delta=delta,
        loss_type=loss_type, importance_sampling=importance_sampling, temperature=temperature,
        max_completion_length=max_completion_length, sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
        kl_ratio_correction=kl_ratio_correction, off_policy_threshold=off_policy_threshold,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
        rollout_is=rollout_is, rollout_is_min=rollout_is_min, rollout_is_max=rollout_is_max,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        rollout_rs_threshold_lower=rollout_rs_threshold_lower))
    return LINEAR_GRPO_LOSS.enter(LinearGRPOLossCall(
        hidden=hidden, weight=weight, target=target, advantages=advantages, bias=bias, mask=mask,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, normalizer=normalizer,
        importance_weights=importance_weights, sampling_logprobs=sampling_logprobs,
        options=options, softcap=softcap, logit_scale=logit_scale, sampling=sampling,
        return_token_values=return_token_values, chunk_size=chunk_size, backend=backend,
        process_group=process_group, check_consistency=check_consistency))


@dataclass(frozen=True)
class _HeadGRPO:
    """A checked ``linear_grpo_loss`` call: the GRPO plan and the logits' transform."""
    plan: GRPOPlan
    transform: Tuple[float, float]

    @property
    def backend(self) -> str:
        return self.plan.backend


def _check_linear(call: LinearGRPOLossCall) -> _HeadGRPO:
    hidden, weight = call.hidden, call.weight
    transform = checked_transform(call.logit_scale, call.softcap)
    check_head(hidden, weight, call.bias, call.chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    checked = plan(LogitsShape.of_head(hidden, weight), call.target, call.advantages,
                   call.options, backend=call.backend, **call_inputs(call))
    return _HeadGRPO(checked, transform)


def _reference_linear(call: LinearGRPOLossCall, checked: _HeadGRPO):
    logits = reference_logits(call.hidden, call.weight, call.bias, call.logit_scale,
                              call.softcap)
    return reference_on_logits(grpo_loss, call, logits)


def _local_linear(call: LinearGRPOLossCall, checked: _HeadGRPO):
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    grpo_plan, chunk_size = checked.plan, call.chunk_size
    params = grpo_plan.params

    def head_logprobs(masked_target, **keywords):
        return linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                     softcap=call.softcap, logit_scale=call.logit_scale,
                                     chunk_size=chunk_size, backend=params.backend, **keywords)

    if grpo_plan.sampling is not None:
        return from_logprobs(sampled_logprobs_of(
            lambda masked_target: head_logprobs(masked_target, ignore_index=-100,
                                                sampling=grpo_plan.sampling)), target, grpo_plan)
    if not grpo_plan.fused:
        def logprobs_of(masked_target, with_entropy):
            out = head_logprobs(masked_target, temperature=params.temperature,
                                return_entropy=with_entropy)
            return out if with_entropy else (out, None)
        return from_logprobs(logprobs_of, target, grpo_plan)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    flat = grpo_plan.flat_rows()
    with torch.no_grad():
        logp, token_loss, entropy, grad_hidden, grad_weight, grad_bias = _HEAD_WALK(
            hidden_rows, weight, bias, flat_target(target), flat.advantages, flat.old,
            flat.ref, flat.weight, replace(params, with_entropy=grpo_plan.token_values),
            *needs, chunk_size, params.backend, *checked.transform)
        value, metrics, *values = token_level_result(logp, token_loss, entropy, grpo_plan)
    if not any(needs):
        return (value, metrics, *values)
    loss = AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_grpo_loss", None)
    return (loss, metrics, *values)


def _dtensor_linear(op, *, sampling, options, return_token_values, **arguments):
    if sampling is not None:
        check_sampling(sampling, options, return_token_values, sharded=True)
    return dtensor.linear_grpo_loss(op, sampling=sampling, options=options,
                             return_token_values=return_token_values, **arguments)


def _vocab_parallel_linear(call: LinearGRPOLossCall):
    """``linear_grpo_loss`` with this rank's vocabulary shard of the head: its token log-probs,
    then the per-token objective in torch."""
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    chunk_size, process_group = call.chunk_size, call.process_group
    if call.sampling is not None:
        check_sampling(call.sampling, call.options, call.return_token_values, sharded=True)
    logit_scale, softcap = checked_transform(call.logit_scale, call.softcap)
    refuse_transform_with_process_group(logit_scale, softcap, 0)
    check_consistency = vocab_parallel.check_consistency_flag(call.check_consistency)

    def checks(layout):
        vocab_parallel.check_shard_head(hidden, weight, bias, chunk_size)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
        return plan(
            vocab_parallel.whole_logits(hidden, layout), target, call.advantages,
            call.options, backend=call.backend, **call_inputs(call))

    # the row count here; the targets' fingerprint (masked ones ignored) in the log-probs call
    layout, checked = vocab_parallel.agreed_layout(
        "linear_grpo_loss", process_group, vocab_parallel.vocab_size(weight, 0), (hidden, weight),
        target, -100, False, checks)
    if checked.params.backend == "reference":
        return vocab_parallel.on_head_logits(grpo_loss, call)

    def logprobs_of(masked_target, with_entropy):
        with agreement.settled():  # its inputs are the checked ones
            out = linear_token_logprobs(
                hidden, weight, masked_target, process_group=process_group, bias=bias,
                temperature=checked.params.temperature, ignore_index=-100,
                return_entropy=with_entropy, chunk_size=chunk_size, backend=call.backend,
                check_consistency=check_consistency)
        return out if with_entropy else (out, None)

    return from_logprobs(logprobs_of, target, checked)


LINEAR_GRPO_LOSS = Door(linear_grpo_loss, ("hidden", "weight", "target", "advantages", "bias",
                                           "mask", "old_logprobs", "ref_logprobs", "normalizer",
                                           "importance_weights", "sampling_logprobs"),
                        _check_linear, _local_linear, _reference_linear, _vocab_parallel_linear,
                        _dtensor_linear)
