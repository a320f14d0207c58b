"""The GRPO fused-loss adapter (``install(trainer, fused_loss=True)`` on a ``GRPOTrainer``): its
``_compute_loss`` becomes ``ak.linear_grpo_loss`` on the policy's final hidden states at the
completion positions and its LM head, with TRL's settings as ``ak.GRPOOptions``
(:func:`grpo_options`), TRL's masks, old/reference log-probs and normalisation. The gradient
comes out of the loss's own walk, and TRL's metrics are logged under TRL's names from the same
walk's token values (``return_token_values``).

vLLM's importance sampling (``use_vllm`` with ``vllm_importance_sampling_correction``) is the
op's rollout correction: ``rollout_is`` = TRL's ``vllm_importance_sampling_mode``,
``rollout_is_min`` / ``rollout_is_max`` = its ``clip_min`` / ``clip_max``, from the sampler's
log-probs (``sampling_per_token_logps``) and ``old_per_token_logps``, as TRL's
``_generate_and_score_completions`` forms ``importance_sampling_ratio`` (TRL logs its
``sampling/*`` metrics there, at generation, so they are not logged again here).

With ``score_support="sampler"`` (``sampler.py``) the loss is ``ak.linear_grpo_loss(...,
sampling=...)`` (:func:`_sampled_loss`): the options' temperature is 1.0 (the sampler's is the
``SamplingParams``'), a token outside the current or old support is masked, and TRL's metrics
plus ``sampling/out_of_support`` come from two walks without gradient.
"""

import math
from typing import Any, Dict

import torch
from torch import Tensor

import astrai_kernels as ak

from ...options.grpo import LOSS_TYPE_RECORDS
from . import contract, sampler
from .contract import TRLHead

_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                      "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                      "mm_token_type_ids", "image_position_ids")
#: GRPOTrainer's methods whose semantics the installed loss reproduces
_LOSS_METHODS = ("_compute_loss", "compute_loss", "_get_per_token_logps_and_entropies")


class GRPOAdapter(contract.LossAdapter):
    method = "_compute_loss"
    reads_hidden_states = True

    def applies(self, trainer, request: contract.Request) -> bool:
        return request.fused_loss

    def check(self, trainer, request: contract.Request) -> None:
        """Refuse every GRPOTrainer configuration whose loss ``ak.linear_grpo_loss`` does not
        reproduce exactly (TRL 1.16's ``GRPOTrainer._compute_loss``)."""
        _check_trainer(trainer)
        for refused, reason in _refusals(trainer):
            if refused:
                raise contract.refuse(trainer, f"fused_loss=True: {reason}")
        head = TRLHead.of(contract.policy_model(trainer))
        if head is None:
            raise contract.refuse(trainer, "fused_loss=True: its policy model carries no TRL "
                                           "fused head")
        try:
            grpo_options(trainer, 1.0 if request.score_support else head.temperature).checked()
        except (TypeError, ValueError) as error:
            raise contract.refuse(trainer, f"fused_loss=True: its GRPO settings are outside "
                                           f"ak.grpo_loss's: {error}") from None

    def loss(self, trainer, request: contract.Request):
        return _compute_loss(trainer, request)


ADAPTER = GRPOAdapter()


def _check_trainer(trainer) -> None:
    grpo = contract.trainer_class("grpo")
    if not isinstance(trainer, grpo):
        reason = ("RLOO's ratio is exp of the summed sequence log-ratio, ak.grpo_loss's "
                  "sequence level (GSPO) the mean" if type(trainer).__name__ == "RLOOTrainer"
                  else "fused_loss serves GRPOTrainer only")
        raise contract.refuse(trainer, f"fused_loss=True: {reason}")
    if contract.overridden(trainer, grpo, _LOSS_METHODS):
        raise contract.refuse(trainer, "fused_loss=True: it overrides GRPOTrainer's loss, whose "
                                       "semantics are not known here")
    if vllm_correction(trainer) and contract.overridden(
            trainer, grpo, ("_generate_and_score_completions",)):
        raise contract.refuse(trainer, "fused_loss=True: it overrides "
                                       "_generate_and_score_completions, and the vLLM "
                                       "importance-sampling ratio is formed here from the "
                                       "sampler's log-probs as TRL 1.16's forms it there")


def vllm_correction(trainer) -> bool:
    """TRL's vLLM importance-sampling correction is on."""
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def _refusals(trainer):
    from transformers import ProcessorMixin

    low, high = (trainer.vllm_importance_sampling_clip_min,
                 trainer.vllm_importance_sampling_clip_max)
    record = LOSS_TYPE_RECORDS.get(trainer.loss_type)
    return [
        (isinstance(trainer.processing_class, ProcessorMixin),
         "a multimodal processor: the image inputs of the loss are not served"),
        (record is None or not record.trl,
         f"loss_type {trainer.loss_type!r} is not one of ak.grpo_loss's that TRL has"),
        (trainer.importance_sampling_level not in ("token", "sequence"),
         f"importance_sampling_level {trainer.importance_sampling_level!r}"),
        (trainer._entropy_bonus_enabled,
         "the entropy bonus (entropy_coef, adaptive entropy) and its policy_loss metric are "
         "not reproduced"),
        (trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1,
         "top_entropy_quantile < 1 over several processes: TRL's quantile is over every "
         "process's tokens, ak.grpo_loss's over the local ones"),
        (record is not None and record.policy == "vespo" and vllm_correction(trainer)
         and not ((low or 0.0) <= 1.0 <= (math.inf if high is None else high)),
         "VESPO with vLLM ratio bounds that exclude 1: TRL sums the log of the masked tokens' "
         "bounded ratios into the sequence weight, ak.grpo_loss sums the unmasked tokens'"),
        (trainer.off_policy_mask_threshold is not None and trainer.use_vllm,
         "the off-policy mask with vLLM: TRL zeroes the KL of tokens vLLM could not score "
         "(NaN sampling log-probs), ak.grpo_loss does not"),
    ]


def grpo_options(trainer, temperature: float) -> "ak.GRPOOptions":
    """TRL 1.16's GRPO settings as ``ak.GRPOOptions``, each set only where its loss type reads
    it (the options' check refuses the others); ``temperature``: the one TRL's head uses."""
    args, loss_type = trainer.args, trainer.loss_type
    record = LOSS_TYPE_RECORDS.get(loss_type)
    clipped = record is not None and record.clipped
    policy = None if record is None else record.policy
    keywords = dict(
        beta=float(trainer.beta), clip_eps_low=float(trainer.epsilon_low),
        loss_type=loss_type, importance_sampling=trainer.importance_sampling_level,
        temperature=float(temperature),
        kl_ratio_correction=bool(args.use_bias_correction_kl) and trainer.beta != 0.0,
        top_entropy_quantile=float(trainer.top_entropy_quantile))
    if record is not None and record.clip_high != "none":
        keywords["clip_eps_high"] = float(trainer.epsilon_high)
    if clipped and args.delta is not None:
        keywords["delta"] = float(args.delta)
    if record is not None and record.token_weight == "max_length":
        keywords["max_completion_length"] = int(trainer.max_completion_length)
    if policy == "sapo":
        keywords.update(sapo_tau_pos=float(args.sapo_temperature_pos),
                        sapo_tau_neg=float(args.sapo_temperature_neg))
    if policy == "vespo":
        keywords.update(vespo_k_pos=float(args.vespo_k_pos),
                        vespo_lambda_pos=float(args.vespo_lambda_pos),
                        vespo_k_neg=float(args.vespo_k_neg),
                        vespo_lambda_neg=float(args.vespo_lambda_neg))
    if trainer.off_policy_mask_threshold is not None:
        keywords["off_policy_threshold"] = float(trainer.off_policy_mask_threshold)
    if vllm_correction(trainer):
        keywords.update(_rollout_options(trainer))
    return ak.GRPOOptions(**keywords)


def _rollout_options(trainer) -> Dict[str, Any]:
    """TRL's ``vllm_importance_sampling_mode`` and bounds as the op's rollout correction:
    ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]`` (either may be None), ``*_mask``
    zeroes it outside (None: unbounded on that side)."""
    def bound(value):
        return None if value is None else float(value)

    return dict(rollout_is=trainer.vllm_importance_sampling_mode,
                rollout_is_min=bound(trainer.vllm_importance_sampling_clip_min),
                rollout_is_max=bound(trainer.vllm_importance_sampling_clip_max))


def _compute_loss(trainer, request: contract.Request):
    """GRPOTrainer._compute_loss (TRL 1.16) on ``ak.linear_grpo_loss``: the policy's final
    hidden states at the completion positions, its LM head, TRL's options, masks, rollout
    correction and normalisation; the gradient comes out of the loss's own walk. Logs TRL's
    metrics under TRL's names, from the token log-probs and entropies of that walk."""
    policy = contract.policy_model(trainer)
    head = TRLHead.of(policy)
    # score_support="sampler": the sampler's temperature is the SamplingParams' (the op's 1.0)
    sampling = (sampler.sampling_params(trainer) if request.score_support is not None
                else None)
    options = grpo_options(trainer, head.temperature if sampling is None else 1.0)
    record = LOSS_TYPE_RECORDS[options.loss_type]

    def compute_loss(model, inputs):
        contract.check_called_model(trainer, model, policy)
        _check_inputs(inputs, options)
        mask = (inputs["completion_mask"] if "tool_mask" not in inputs
                else inputs["completion_mask"] * inputs["tool_mask"])

        def loss_of(hidden, dtype):
            if sampling is not None:
                return _sampled_loss(trainer, request, hidden, dtype, inputs, mask, head,
                                     options, sampling)
            return fused_loss(hidden, dtype, inputs, mask)

        return _in_policy_forward(trainer, model, inputs, head, loss_of)

    def fused_loss(hidden, dtype, inputs, mask):
        lm_head = policy.get_output_embeddings()
        weight, bias, device = lm_head.weight, lm_head.bias, lm_head.weight.device
        contract.check_gathered(weight)
        mode = "train" if trainer.model.training else "eval"
        with torch.autocast(hidden.device.type, enabled=False):
            loss, _, values = ak.linear_grpo_loss(
                hidden.to(device).to(dtype), weight.to(dtype),
                inputs["completion_ids"].to(device), inputs["advantages"].to(device),
                bias=None if bias is None else bias.to(dtype), mask=mask.to(device),
                old_logprobs=inputs.get("old_per_token_logps"),
                ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None,
                normalizer=_normalizer(trainer, inputs, mode) if record.global_count else None,
                sampling_logprobs=(inputs["sampling_per_token_logps"]
                                   if options.rollout_is is not None else None),
                options=options, softcap=head.softcap, logit_scale=head.logit_scale,
                return_token_values=True, chunk_size=request.chunk_size,
                backend=request.backend)
        if not record.global_count and mode == "train":
            loss = loss / trainer.current_gradient_accumulation_steps
        _log_metrics(trainer, mode, values, inputs, mask.to(device),
                     inputs["advantages"].to(device))
        return loss

    return compute_loss


def _sampled_loss(trainer, request: contract.Request, hidden: Tensor, dtype: torch.dtype,
                  inputs, mask: Tensor, head: TRLHead, options: "ak.GRPOOptions",
                  sampling: "ak.SamplingParams"):
    """``score_support="sampler"``: ``ak.linear_grpo_loss(..., sampling=...)``. A token whose
    old log-prob is ``-inf`` (outside the old policy's support) leaves the mask before the call,
    as the op drops one outside the current policy's; TRL's metrics come from two walks without
    gradient (the token log-probs under ``sampling``, the full tempered entropy), on the tokens
    the loss kept, plus ``sampling/out_of_support``: the share of the completion tokens outside
    either support."""
    lm_head = contract.policy_model(trainer).get_output_embeddings()
    weight, bias, device = lm_head.weight, lm_head.bias, lm_head.weight.device
    contract.check_gathered(weight)
    mode = "train" if trainer.model.training else "eval"
    record = LOSS_TYPE_RECORDS[options.loss_type]
    mask = mask.to(device)
    target = inputs["completion_ids"].to(device)
    advantages = inputs["advantages"].to(device)
    old = inputs.get("old_per_token_logps")
    scored = mask != 0
    kept = scored
    if old is not None:
        old = old.to(device)
        old_in_support = torch.isfinite(old) | ~scored
        kept = scored & old_in_support
        old = torch.where(old_in_support, old, 0.0)
        inputs = {**inputs, "old_per_token_logps": old}
    loss_mask = mask * kept
    hidden = hidden.to(device).to(dtype)
    weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    head_keywords = dict(bias=bias, softcap=head.softcap, logit_scale=head.logit_scale,
                         chunk_size=request.chunk_size, backend=request.backend)
    with torch.autocast(hidden.device.type, enabled=False):
        loss, _ = ak.linear_grpo_loss(
            hidden, weight, target, advantages, mask=loss_mask, old_logprobs=old,
            ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None,
            normalizer=_normalizer(trainer, inputs, mode) if record.global_count else None,
            sampling_logprobs=(inputs["sampling_per_token_logps"]
                               if options.rollout_is is not None else None),
            options=options, sampling=sampling, **head_keywords)
        with torch.no_grad():
            masked_target = torch.where(kept, target, -100)
            logp = ak.linear_token_logprobs(hidden, weight, masked_target, sampling=sampling,
                                            **head_keywords)
            _, entropy = ak.linear_token_logprobs(hidden, weight, masked_target,
                                                  temperature=head.temperature,
                                                  return_entropy=True, **head_keywords)
    if not record.global_count and mode == "train":
        loss = loss / trainer.current_gradient_accumulation_steps
    in_support = torch.isfinite(logp) | ~kept
    kept = kept & in_support
    values = {"logprobs": torch.where(kept, logp, 0.0).float(),
              "entropy": torch.where(kept, entropy, 0.0).float()}
    _log_metrics(trainer, mode, values, inputs, (mask * kept), advantages)
    outside = (scored & ~kept).double()
    trainer._metrics[mode]["sampling/out_of_support"].append(
        _Reducer(trainer.accelerator, scored.double()).global_masked_mean(outside))
    return loss


def _check_inputs(inputs, options: "ak.GRPOOptions") -> None:
    present = [name for name in _MULTIMODAL_INPUTS if inputs.get(name) is not None]
    if present:
        raise ValueError(f"astrai_kernels.integrations.trl: fused_loss got the multimodal "
                         f"inputs {present}, which it does not serve")
    if options.rollout_is is not None and inputs.get("sampling_per_token_logps") is None:
        raise ValueError("astrai_kernels.integrations.trl: fused_loss with vLLM importance "
                         "sampling needs the inputs' sampling_per_token_logps (the sampler's "
                         "log-probs, from which TRL's importance_sampling_ratio is formed)")


def _in_policy_forward(trainer, model, inputs, head: TRLHead, loss_of):
    """``loss_of(hidden, dtype)`` computed inside the policy's forward (where FSDP2 has gathered
    the LM head's weight; its hooks then see the loss as the forward's output): the final
    hidden states at the completion positions and TRL's compute dtype (under the trainer's
    autocast, as TRL's head runs)."""
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = completion_ids.size(1)

    def loss_in_forward(output):
        hidden = output.last_hidden_state[:, -keep - 1:-1]
        return loss_of(hidden, contract.compute_dtype(hidden, head.cast_lm_head_to_fp32))

    with trainer.accelerator.autocast():
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     astrai_loss=loss_in_forward)


def _normalizer(trainer, inputs, mode: str) -> Tensor:
    """TRL's global count for the global-count loss types, rescaled to one accumulation
    window (``num_items_in_batch`` spans the generation batch)."""
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = (normalizer * trainer.current_gradient_accumulation_steps
                      / trainer.args.steps_per_generation)
    return normalizer


def _log_ratio_weights(trainer, log_ratio: Tensor, mask: Tensor) -> Tensor:
    if trainer.importance_sampling_level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return log_ratio


class _Reducer:
    """TRL's reductions of a metric over the unmasked tokens (``[B, 1]`` values: sequences)."""

    def __init__(self, accelerator, mask: Tensor):
        self.accelerator, self.mask = accelerator, mask

    def masked_seq_mean(self, x: Tensor) -> Tensor:
        return x.squeeze(1) if x.shape[1] == 1 else (x * self.mask).sum(-1) / self.mask.sum(-1)

    def global_masked_mean(self, x: Tensor) -> float:
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * self.mask).sum(), self.mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()


def _log_metrics(trainer, mode: str, values: Dict[str, Tensor], inputs, mask: Tensor,
                 advantages: Tensor) -> None:
    """The metrics GRPOTrainer._compute_loss logs, with its formulas and names, on the
    detached token log-probs and entropies of ``ak.linear_grpo_loss``."""
    # float64: TRL's formulas on float32 inputs, without their float32 roundings (k3 near 0
    # is exp(d) - d - 1, a cancellation whose float32 error exceeds the value it logs)
    logp, entropies = values["logprobs"].double(), values["entropy"].double()
    mask, advantages = mask.double(), advantages.double()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = inputs.get("old_per_token_logps")
    log_ratio = logp - (logp if old is None else old.to(logp.dtype))
    coef_1 = torch.exp(_log_ratio_weights(trainer, log_ratio, mask))
    reduce, metrics = _Reducer(trainer.accelerator, mask), trainer._metrics[mode]
    if trainer.beta != 0.0:
        ref = inputs["ref_per_token_logps"].to(logp.dtype)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        if trainer.args.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        metrics["kl"].append(reduce.global_masked_mean(per_token_kl))
    metrics["entropy"].append(reduce.global_masked_mean(entropies))
    policy = LOSS_TYPE_RECORDS[trainer.loss_type].policy
    if policy == "clipped":
        _log_clip_metrics(trainer, metrics, reduce, coef_1, advantages)
    elif policy == "cispo":
        is_capped = (coef_1 > trainer.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"].append(reduce.global_masked_mean(is_capped.float()))
    elif policy == "vespo":
        args = trainer.args
        phi_seq = trainer.get_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
            lambda_neg=args.vespo_lambda_neg)
        metrics["vespo/phi_seq_mean"].append(reduce.global_masked_mean(phi_seq))


def _log_clip_metrics(trainer, metrics, reduce: _Reducer, coef_1: Tensor,
                      advantages: Tensor) -> None:
    from trl.trainer.utils import nanmax, nanmin

    is_low = (coef_1 < 1 - trainer.epsilon_low) & (advantages < 0)
    is_high = (coef_1 > 1 + trainer.epsilon_high) & (advantages > 0)
    metrics["clip_ratio/low_mean"].append(reduce.global_masked_mean(is_low.float()))
    metrics["clip_ratio/high_mean"].append(reduce.global_masked_mean(is_high.float()))
    metrics["clip_ratio/region_mean"].append(reduce.global_masked_mean((is_low | is_high).float()))
    gather = trainer.accelerator.gather
    metrics["clip_ratio/low_min"].append(
        nanmin(gather(reduce.masked_seq_mean(is_low.float()))).item())
    metrics["clip_ratio/high_max"].append(
        nanmax(gather(reduce.masked_seq_mean(is_high.float()))).item())
