"""The GRPO family's scalar options, one object carried from the public ops (``grpo_loss``,
``linear_grpo_loss``, their vocabulary-parallel forms) through the checks to the spec
(``reference.grpo_loss``) and the strategies; and the loss types, one record each. Below both
the spec and the ops, which import it; it imports neither.

``GRPOOptions.checked()`` is the one check of the options on their own (each in its range, none
set where its loss type does not read it); what needs the call's tensors (``beta > 0`` needs
``ref_logprobs``, ...) is checked by the op. The kernel's arguments come from the checked object
(:meth:`GRPOOptions.surrogate_args`), where ``clip_eps_high`` and ``delta`` are resolved.

The defaults are ``ak.grpo_loss``'s (TRL's). The per-token tensors (mask, old and reference
log-probs, importance weights, sampling log-probs) and the ``normalizer`` are inputs, not options.
"""

import dataclasses
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

from ..kernels.primitives import SurrogateArgs
from . import keywords
from .scalars import check_bool, check_choice, check_in_range, check_index, check_positive


@dataclass(frozen=True)
class LossType:
    """One GRPO loss type: what its tokens' policy term is, how the tokens are weighed in the
    loss, which clip bound it reads, the metrics it adds, and where it comes from. The spec
    (``reference.grpo_loss``: one formula per policy term and per token weight), the ops
    (``ops/grpo.py``), the DTensor route, the strategy and the TRL adapter read these
    attributes; none of them names a loss type."""
    name: str
    #: ``"clipped"`` (PPO's clipped surrogate), ``"cispo"`` (REINFORCE on the capped ratio),
    #: ``"sapo"`` (sigmoid gate), ``"vespo"`` (sequence gamma weight)
    policy: str
    #: ``"sequence_mean"`` (mean per sequence, then over sequences), ``"token_mean"`` (over the
    #: batch's tokens), ``"max_length"`` (sum / (B * max_completion_length)), ``"sequence_sum"``
    #: (sum / B), ``"global_count"`` (sum / normalizer, the global token count)
    token_weight: str
    #: ``clip_eps_high``: ``"optional"`` (default ``clip_eps_low``), ``"required"``, ``"none"``
    clip_high: str
    #: the loss type's own metrics, beside ``kl`` and ``ratio/mean``
    metrics: Tuple[str, ...]
    citation: str
    #: TRL's ``GRPOTrainer`` has it (``GRPOConfig.loss_type``), with the same formula
    trl: bool = True

    @property
    def clipped(self) -> bool:
        """The clipped surrogate: reads ``clip_eps_high`` and ``delta``."""
        return self.policy == "clipped"

    @property
    def global_count(self) -> bool:
        """The loss is the sum over tokens divided by ``normalizer``."""
        return self.token_weight == "global_count"

    @property
    def mean_over_tokens(self) -> bool:
        """The loss is its tokens' sum divided by a count of tokens (the batch's unmasked
        tokens, or ``normalizer``), not a sum over sequences."""
        return self.token_weight in ("token_mean", "global_count")

    @property
    def global_count_form(self) -> "LossType":
        """The loss type of the same policy term over ``normalizer`` (``"global_count"``):
        the batch's token mean is that with the batch's count as ``normalizer``."""
        if self.token_weight == "global_count":
            return self
        return next(record for record in LOSS_TYPE_RECORDS.values()
                    if record.policy == self.policy and record.global_count
                    and record.clip_high == self.clip_high and record.metrics == self.metrics)

    @property
    def single_pass(self) -> bool:
        """The fused single-pass kernel serves it (at token level, extras at defaults)."""
        return self.clipped


_CLIP_METRICS = ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region")
LOSS_TYPE_RECORDS: Dict[str, LossType] = {record.name: record for record in (
    LossType("grpo", "clipped", "sequence_mean", "optional", _CLIP_METRICS,
             "DeepSeekMath (arXiv 2402.03300)"),
    LossType("bnpo", "clipped", "token_mean", "optional", _CLIP_METRICS,
             "TRL GRPOTrainer, loss_type='bnpo'"),
    LossType("dr_grpo", "clipped", "max_length", "optional", _CLIP_METRICS,
             "Dr. GRPO (arXiv 2503.20783)"),
    LossType("dapo", "clipped", "global_count", "optional", _CLIP_METRICS,
             "DAPO (arXiv 2503.14476)"),
    LossType("luspo", "clipped", "sequence_sum", "optional", _CLIP_METRICS,
             "LUSPO (arXiv 2602.05261)"),
    LossType("cispo", "cispo", "global_count", "required", ("clip_ratio/cispo",),
             "MiniMax-M1 (arXiv 2506.13585), ScaleRL"),
    LossType("sapo", "sapo", "sequence_mean", "none", (),
             "SAPO (arXiv 2511.20347)"),
    LossType("vespo", "vespo", "global_count", "none", ("vespo/phi_mean",),
             "VESPO (arXiv 2602.10693)"),
    LossType("sapo_token_mean", "sapo", "global_count", "none", (),
             "SAPO (arXiv 2511.20347) under verl's default loss_agg_mode='token-mean'",
             trl=False),
)}
LOSS_TYPES = tuple(LOSS_TYPE_RECORDS)
CLIPPED_LOSS_TYPES = tuple(name for name, record in LOSS_TYPE_RECORDS.items() if record.clipped)
GLOBAL_COUNT_LOSS_TYPES = tuple(name for name, record in LOSS_TYPE_RECORDS.items()
                                if record.global_count)
IMPORTANCE_SAMPLING = ("token", "sequence")
#: options beyond the clipped surrogate on token ratios: the fused single-pass kernel covers a
#: call only when every one of them is at its default
POLICY_EXTRAS = ("sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos", "vespo_lambda_pos",
                 "vespo_k_neg", "vespo_lambda_neg", "off_policy_threshold",
                 "top_entropy_quantile", "entropy_coef")
#: the options of one policy term (``LossType.policy``): refused (unless at their default)
#: for the loss types of another
_POLICY_OPTIONS = (("sapo_tau_pos", "sapo"), ("sapo_tau_neg", "sapo"),
                   ("vespo_k_pos", "vespo"), ("vespo_lambda_pos", "vespo"),
                   ("vespo_k_neg", "vespo"), ("vespo_lambda_neg", "vespo"))
#: TRL 1.16's ``vllm_importance_sampling_mode`` values (``GRPOConfig``)
ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: verl's ``rollout_rs`` options (``rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS``, less
#: ``binary_kl``)
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                      "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                      "seq_max_k3")


@dataclass(frozen=True)
class GRPOOptions:
    """Every scalar keyword of ``ak.grpo_loss`` (see its docstring and docs/objectives.md)."""
    beta: float = 0.0
    clip_eps_low: float = 0.2
    clip_eps_high: Optional[float] = None
    delta: Optional[float] = None
    loss_type: str = "bnpo"
    importance_sampling: str = "token"
    temperature: float = 1.0
    max_completion_length: Optional[int] = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_ratio_correction: bool = False
    off_policy_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    rollout_is: Optional[str] = None
    rollout_is_min: Optional[float] = None
    rollout_is_max: Optional[float] = 3.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None
    rollout_rs_threshold_lower: Optional[float] = None

    @property
    def record(self) -> LossType:
        return LOSS_TYPE_RECORDS[self.loss_type]

    @property
    def clip_high(self) -> float:
        """The upper clip bound: ``clip_eps_high``, or ``clip_eps_low`` when it is None."""
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high

    def surrogate_args(self, with_entropy: bool = False) -> SurrogateArgs:
        """The single-pass kernel's arguments (``kernels/primitives.py``), bounds resolved."""
        return SurrogateArgs(temperature=self.temperature, clip_eps_low=self.clip_eps_low,
                             clip_eps_high=self.clip_high, delta=self.delta or 0.0,
                             beta=self.beta, kl_ratio_correction=self.kl_ratio_correction,
                             with_entropy=with_entropy)

    def checked(self) -> "GRPOOptions":
        """These options, each checked (``ValueError``/``TypeError`` naming it), with numbers
        as the checks return them. A checked object checks again to itself."""
        checked = dict(
            beta=check_in_range(self.beta, "beta", 0.0, float("inf")),
            clip_eps_low=check_in_range(self.clip_eps_low, "clip_eps_low", 0.0, 1.0),
            loss_type=check_choice(self.loss_type, "loss_type", LOSS_TYPES))
        record = LOSS_TYPE_RECORDS[self.loss_type]
        if record.clip_high == "required" and self.clip_eps_high is None:
            raise ValueError(f"loss_type={record.name!r} needs clip_eps_high, the cap on the "
                             f"importance ratio (e.g. 5.0); TRL would fall back to clip_eps_low")
        if record.clip_high == "none" and self.clip_eps_high is not None:
            raise ValueError(f"clip_eps_high does not apply to loss_type={record.name!r} "
                             f"(no clip)")
        if self.clip_eps_high is not None:
            checked["clip_eps_high"] = (
                check_positive(self.clip_eps_high, "clip_eps_high")
                if record.clip_high == "required"
                else check_in_range(self.clip_eps_high, "clip_eps_high", 0.0, float("inf")))
        if self.delta is not None:
            checked["delta"] = check_positive(self.delta, "delta")
            if not record.clipped:
                raise ValueError(f"delta caps the clipped surrogate's ratio: it applies to "
                                 f"loss_type in {CLIPPED_LOSS_TYPES}, got "
                                 f"loss_type={record.name!r}")
        checked["importance_sampling"] = check_choice(
            self.importance_sampling, "importance_sampling", IMPORTANCE_SAMPLING)
        if self.max_completion_length is not None:
            check_index(self.max_completion_length, "max_completion_length")
            if self.max_completion_length <= 0:
                raise ValueError(f"max_completion_length must be > 0, got "
                                 f"{self.max_completion_length}")
        checked["temperature"] = check_positive(self.temperature, "temperature")
        for name, policy in _POLICY_OPTIONS:
            value = getattr(self, name)
            checked[name] = (check_in_range(value, name, 0.0, float("inf"))
                             if name.startswith("vespo_k") else check_positive(value, name))
            if record.policy != policy and checked[name] != getattr(DEFAULT_OPTIONS, name):
                readers = " or ".join(f"loss_type={other.name!r}"
                                      for other in LOSS_TYPE_RECORDS.values()
                                      if other.policy == policy)
                raise ValueError(f"{name} applies to {readers} only, got "
                                 f"loss_type={record.name!r}")
        checked["kl_ratio_correction"] = check_bool(self.kl_ratio_correction,
                                                    "kl_ratio_correction")
        checked.update(self._checked_rollout_correction())
        if self.off_policy_threshold is not None:
            checked["off_policy_threshold"] = check_in_range(
                self.off_policy_threshold, "off_policy_threshold", 0.0, float("inf"))
        checked["top_entropy_quantile"] = check_in_range(
            self.top_entropy_quantile, "top_entropy_quantile", 0.0, 1.0)
        checked["entropy_coef"] = check_in_range(self.entropy_coef, "entropy_coef",
                                                 -float("inf"), float("inf"))
        return dataclasses.replace(self, **checked)

    def _checked_rollout_correction(self) -> dict:
        """The rollout-correction options (``ops/rollout_correction.py``): each in its range
        and none set where unused."""
        mode, checked = self.rollout_is, {}
        if mode is not None:
            check_choice(mode, "rollout_is", ROLLOUT_IS_MODES)
        for name in ("rollout_is_min", "rollout_is_max"):
            value = getattr(self, name)
            if value is not None:
                checked[name] = check_in_range(value, name, 0.0, float("inf"))
        checked["rollout_is_batch_normalize"] = check_bool(self.rollout_is_batch_normalize,
                                                           "rollout_is_batch_normalize")
        if mode is None:
            for name in ("rollout_is_min", "rollout_is_max", "rollout_is_batch_normalize"):
                if getattr(self, name) != getattr(DEFAULT_OPTIONS, name):
                    raise ValueError(f"{name} applies with rollout_is only (one of "
                                     f"{ROLLOUT_IS_MODES}), got rollout_is=None")
        else:
            low, high = checked.get("rollout_is_min"), checked.get("rollout_is_max")
            if mode.endswith("_truncate") and low is None and high is None:
                raise ValueError(f"rollout_is={mode!r} needs rollout_is_min or rollout_is_max "
                                 f"(TRL refuses a truncation without bounds)")
            if low is not None and high is not None and not low < high:
                raise ValueError(f"rollout_is_min must be < rollout_is_max, got {low} and "
                                 f"{high}")
            # VESPO's sequence weight takes the importance weights inside (as TRL's)
            vespo = self.record.policy == "vespo"
            if vespo and not mode.startswith("token_"):
                raise ValueError(f"loss_type={self.loss_type!r} takes the token modes of "
                                 f"rollout_is only (as TRL's GRPOTrainer), got "
                                 f"rollout_is={mode!r}")
            if vespo and checked["rollout_is_batch_normalize"]:
                raise ValueError(f"rollout_is_batch_normalize is verl's and does not combine "
                                 f"with loss_type={self.loss_type!r} (TRL's, which has no "
                                 f"batch normalisation)")
        option = self.rollout_rs
        threshold, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if option is None:
            for name, value in (("rollout_rs_threshold", threshold),
                                ("rollout_rs_threshold_lower", lower)):
                if value is not None:
                    raise ValueError(f"{name} applies with rollout_rs only (one of "
                                     f"{ROLLOUT_RS_OPTIONS}), got rollout_rs=None")
            return checked
        check_choice(option, "rollout_rs", ROLLOUT_RS_OPTIONS)
        if threshold is None:
            raise ValueError(f"rollout_rs={option!r} needs rollout_rs_threshold")
        checked["rollout_rs_threshold"] = check_positive(threshold, "rollout_rs_threshold")
        if lower is not None:
            if not option.endswith("k1"):
                raise ValueError(f"rollout_rs_threshold_lower applies to the k1 options only "
                                 f"(a ratio interval), got rollout_rs={option!r}")
            checked["rollout_rs_threshold_lower"] = check_positive(
                lower, "rollout_rs_threshold_lower")
        return checked

    @property
    def rollout_correction_on(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def needs_entropy(self) -> bool:
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    @property
    def extras_at_defaults(self) -> bool:
        return all(getattr(self, name) == getattr(DEFAULT_OPTIONS, name)
                   for name in POLICY_EXTRAS)

    def keywords(self) -> dict:
        """The options as ``ak.grpo_loss`` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_OPTIONS = GRPOOptions()
OPTION_NAMES = tuple(f.name for f in fields(GRPOOptions))


def options_from(given: Optional[GRPOOptions], option_keywords: dict) -> GRPOOptions:
    """``given`` (the ``options=`` keyword) or the object of the individual
    ``option_keywords``. The caller is wrapped in :func:`options_or_keywords`, which refuses a
    call giving both."""
    return keywords.options_from(given, option_keywords, GRPOOptions)


#: ``function`` (taking ``options`` and ``GRPOOptions``' fields) refusing a call that passes both
options_or_keywords = keywords.options_or_keywords(GRPOOptions, "GRPO")
