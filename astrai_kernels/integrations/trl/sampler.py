"""``install(trainer, score_support="sampler")`` on a ``GRPOTrainer``: the policy's and the old
policy's completion tokens scored under the trainer's own sampling settings, as
``ak.SamplingParams`` (:func:`sampling_params`), so that the importance ratio against the
sampler's processed log-probs (vLLM's ``processed_logprobs``) carries no kept-mass factor ``S``.

Where TRL 1.16 holds the settings (``trl/trainer/grpo_trainer.py``): ``GRPOTrainer.__init__``
copies ``args.temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` onto the
trainer (lines 789-793), gives the policy's fused head ``temperature=self.temperature``
(1068-1073) and hands the same five to ``VLLMGeneration`` (1130-1135) or to the transformers
``GenerationConfig`` (1154-1173), in both cases updated by ``args.generation_kwargs``.
``GRPOConfig`` (``grpo_config.py`` 532-580): ``temperature=1.0``, ``top_p=1.0``, ``top_k=0``
(off), ``min_p=None``, ``repetition_penalty=1.0``. ``VLLMGeneration`` sends ``min_p`` as
``0.0 if min_p is None`` (``generation/vllm_generation.py`` 623, 668) and asks vLLM for
``logprobs_mode="processed_logprobs"`` (361). The map to vLLM's names: ``top_k`` None, 0 or -1
(vLLM's off) -> 0; ``top_p`` None -> 1.0; ``min_p`` None -> 0.0; the temperature as is.

Refused (``check``), each a ``TRLHeadError`` saying why: another trainer; no ``fused_loss``
(TRL's own loss forms ``exp(logp - old)`` and the KL on every completion token, so a token
outside the current or old support, ``-inf`` there, turns it into NaN or inf; the fused loss
masks and counts it); a ``repetition_penalty`` (penalties change the sampler's distribution
with the token history, which the head does not see); ``generation_kwargs`` beyond the keys
that do not touch the distribution (stop criteria, seeds, lengths); vLLM's structured outputs;
a ``rollout_func`` or an overridden generation or old-log-prob method (the sampler is not
TRL's); a temperature below vLLM's greedy threshold or other than the head's; a reference
scored by the policy's own head (PEFT with ``beta != 0`` and no ``ref_model``: the head cannot
tell the reference's call, kept under the full softmax, from the policy's); the entropy options
(``top_entropy_quantile < 1``, the entropy bonus: ``sampling=`` returns no entropy). Without
vLLM, transformers' ``generate`` is the sampler: its warpers run temperature, top_k, top_p,
then min_p (``transformers/generation/utils.py``, ``_get_logits_processor``), so ``min_p``
together with ``top_p`` (vLLM applies min_p first, and top_p's mass depends on it) is refused,
as are transformers' continuous batching and any logits processor its generation config turns
on (the trainer's, or the policy's own for a field TRL does not set).
"""

import math
from typing import Optional

import astrai_kernels as ak

from . import contract
from .contract import TRLHead

#: the values of ``score_support``
SCORE_SUPPORT = (None, "sampler")
#: vLLM samples greedily below this temperature (``vllm.sampling_params._SAMPLING_EPS``)
GREEDY_TEMPERATURE = 1e-5
#: ``generation_kwargs`` keys that leave the sampled distribution alone (vLLM's
#: ``SamplingParams``, transformers' ``GenerationConfig``: stopping, lengths, seeds, outputs)
NEUTRAL_GENERATION_KWARGS = frozenset({
    "seed", "max_tokens", "max_new_tokens", "max_length", "stop", "stop_token_ids",
    "stop_strings", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "detokenize", "logprobs", "eos_token_id", "pad_token_id",
    "bos_token_id", "cache_implementation", "use_cache", "disable_compile"})
#: transformers ``GenerationConfig`` fields that add a logits processor, and their off values
_GENERATION_CONFIG_OFF = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,), "sequence_bias": (None,), "min_length": (None, 0),
    "min_new_tokens": (None, 0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "guidance_scale": (None, 1.0), "top_h": (None,),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "watermarking_config": (None,), "num_beams": (None, 1), "penalty_alpha": (None,),
    "dola_layers": (None,)}
#: GRPOTrainer's methods that sample or compute the old log-probs
_SAMPLER_METHODS = ("_generate", "_generate_single_turn", "_generate_and_score_completions",
                    "_get_per_token_logps_and_entropies")


def check_score_support(score_support) -> Optional[str]:
    if score_support not in SCORE_SUPPORT:
        raise ValueError(f"score_support must be None or 'sampler', got {score_support!r}")
    return score_support


def sampling_params(trainer) -> "ak.SamplingParams":
    """The trainer's sampling settings in vLLM's names (module docstring)."""
    top_k, top_p, min_p = trainer.top_k, trainer.top_p, trainer.min_p
    return ak.SamplingParams(
        temperature=float(trainer.temperature),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        top_p=1.0 if top_p is None else float(top_p),
        min_p=0.0 if min_p is None else float(min_p))


def _refused(trainer, reason: str) -> contract.TRLHeadError:
    return contract.refuse(trainer, f"score_support='sampler': {reason}")


def check(trainer, request: contract.Request) -> None:
    """Refuse every trainer whose sampler's processed distribution ``sampling=`` does not
    reproduce, or whose loss would take ``-inf`` log-probs (module docstring)."""
    grpo = contract.trainer_class("grpo")
    if not isinstance(trainer, grpo):
        raise _refused(trainer, "serves GRPOTrainer only (the old and current policy log-probs "
                                "of its importance ratio)")
    if not request.fused_loss:
        raise _refused(trainer, "needs fused_loss=True: TRL's own _compute_loss would form "
                                "exp(logp - old) and the KL on every completion token, and a "
                                "token outside the sampler's support (the policy moved since "
                                "sampling, or a float32 boundary) has logp -inf there: NaN or "
                                "inf in its loss; ak.linear_grpo_loss masks and counts it")
    method = contract.overridden(trainer, grpo, _SAMPLER_METHODS)
    if method is not None:
        raise _refused(trainer, f"it overrides {method}: the sampler or the old log-probs are "
                                f"not TRL's")
    if getattr(trainer, "rollout_func", None) is not None:
        raise _refused(trainer, "a rollout_func samples the completions, under settings not "
                                "known here")
    temperature = trainer.temperature
    contract.check_temperature(trainer, temperature)
    if temperature < GREEDY_TEMPERATURE:
        raise _refused(trainer, f"temperature {temperature} is below {GREEDY_TEMPERATURE}, where "
                                f"vLLM samples greedily")
    head = TRLHead.of(contract.policy_model(trainer))
    if head is not None and head.temperature != float(temperature):
        raise _refused(trainer, f"its policy's fused head has temperature {head.temperature}, "
                                f"the sampler {temperature}")
    if trainer.top_k is not None and not (isinstance(trainer.top_k, int) and trainer.top_k >= -1):
        raise _refused(trainer, f"top_k {trainer.top_k!r} is not an int >= -1")
    try:
        sampling = sampling_params(trainer)
    except (TypeError, ValueError) as error:
        raise _refused(trainer, f"its sampling settings are outside ak.SamplingParams': "
                                f"{error}") from None
    for refused, reason in _refusals(trainer, sampling):
        if refused:
            raise _refused(trainer, reason)
    if not trainer.use_vllm:
        _check_transformers_sampler(trainer, sampling)


def _refusals(trainer, sampling: "ak.SamplingParams"):
    args = trainer.args
    extra = sorted(set(args.generation_kwargs or {}) - NEUTRAL_GENERATION_KWARGS)
    penalty = trainer.repetition_penalty
    return [
        (penalty is not None and penalty != 1.0,
         f"repetition_penalty {penalty}: a penalty changes the sampler's distribution with the "
         f"token history, which the head does not score"),
        (bool(extra),
         f"generation_kwargs {extra}: keys that change, or may change, the sampled "
         f"distribution (set temperature, top_k, top_p, min_p on GRPOConfig; the served keys "
         f"are {sorted(NEUTRAL_GENERATION_KWARGS)})"),
        (trainer.use_vllm and getattr(args, "vllm_structured_outputs_regex", None) is not None,
         "vLLM's structured outputs mask the logits"),
        (trainer.beta != 0.0 and trainer.ref_model is None,
         "the reference is the policy's own head (PEFT, adapter disabled): its log-probs for "
         "the KL stay under the full softmax, and the policy's head cannot tell that call "
         "from the policy's"),
        (trainer.top_entropy_quantile < 1.0,
         "top_entropy_quantile < 1: the entropy mask needs the entropy from the loss's walk, "
         "which sampling= does not return"),
        (trainer._entropy_bonus_enabled,
         "the entropy bonus needs the entropy from the loss's walk, which sampling= does not "
         "return"),
    ]


def _check_transformers_sampler(trainer, sampling: "ak.SamplingParams") -> None:
    """transformers' ``generate`` as the sampler: its warper order and logits processors."""
    if getattr(trainer, "use_transformers_continuous_batching", False):
        raise _refused(trainer, "transformers' continuous batching samples with its own "
                                "processors, not checked here")
    if sampling.min_p > 0.0 and sampling.top_p < 1.0:
        raise _refused(trainer, "min_p with top_p and transformers' generate: it applies min_p "
                                "after top_p, vLLM (the distribution scored) before it, so "
                                "top_p's mass and the kept tokens differ")
    configs = [("the trainer's generation config", getattr(trainer, "generation_config", None),
                ())]
    model = contract.policy_model(trainer)
    set_by_trl = tuple(getattr(trainer, "generation_kwargs", None) or ())
    configs.append((f"{type(model).__name__}'s generation_config",
                    getattr(model, "generation_config", None), set_by_trl))
    for where, config, skipped in configs:
        if config is None:
            continue
        if where.startswith("the trainer's") and getattr(config, "do_sample", True) is not True:
            raise _refused(trainer, f"{where} has do_sample={config.do_sample}")
        for field, off in _GENERATION_CONFIG_OFF.items():
            if field in skipped:
                continue
            value = getattr(config, field, None)
            if not any(value is v or (v is not None and _equal(value, v)) for v in off):
                raise _refused(trainer, f"{where} sets {field}={value!r}, a logits processor "
                                        f"of transformers' generate that changes the sampled "
                                        f"distribution")


def _equal(value, off) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isclose(
        value, off, rel_tol=0.0, abs_tol=0.0)
