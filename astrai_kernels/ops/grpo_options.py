"""The GRPO family's scalar options, one object carried from the public ops (``grpo_loss``,
``linear_grpo_loss``, their vocabulary-parallel forms) through the checks to the spec
(``reference.grpo_loss``) and the strategies. A leaf module: the spec imports it too.

The defaults are ``ak.grpo_loss``'s (TRL's). The per-token tensors (mask, old and reference
log-probs, importance weights, sampling log-probs) and the ``normalizer`` are inputs, not options.
"""

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Callable, Optional

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped surrogate
GLOBAL_COUNT_LOSS_TYPES = ("dapo", "cispo", "vespo")  # sum / normalizer (the global count)
#: options beyond the clipped surrogate on token ratios: the fused single-pass kernel covers a
#: call only when every one of them is at its default
POLICY_EXTRAS = ("sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos", "vespo_lambda_pos",
                 "vespo_k_neg", "vespo_lambda_neg", "off_policy_threshold",
                 "top_entropy_quantile", "entropy_coef")
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


def options_from(given: Optional[GRPOOptions], keywords: dict) -> GRPOOptions:
    """``given`` (the ``options=`` keyword) or the object of the individual ``keywords``. The
    caller is wrapped in :func:`options_or_keywords`, which refuses a call giving both."""
    if given is None:
        return GRPOOptions(**keywords)
    if not isinstance(given, GRPOOptions):
        raise TypeError(f"options must be a GRPOOptions or None, got {type(given).__name__}")
    return given


def options_or_keywords(function: Callable) -> Callable:
    """``function`` (which takes ``options`` and ``GRPOOptions``' fields as parameters) refusing
    a call that passes ``options`` and any field, by name or by position, whatever the field's
    value: one equal to its default would otherwise be dropped without a word. The signature,
    defaults included, stays ``function``'s."""
    positional = [parameter.name for parameter in inspect.signature(function).parameters.values()
                  if parameter.kind in (parameter.POSITIONAL_ONLY,
                                        parameter.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(function)
    def refusing_both(*args, **kwargs):
        passed = dict(zip(positional, args), **kwargs)
        if passed.get("options") is not None:
            both = sorted(name for name in OPTION_NAMES if name in passed)
            if both:
                raise ValueError(f"pass the GRPO options either as options= or as keywords, "
                                 f"not both: {both} given beside options")
        return function(*args, **kwargs)

    return refusing_both
