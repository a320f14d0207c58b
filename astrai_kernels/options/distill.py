"""The scalar options of ``ak.distill_loss`` and ``ak.linear_distill_loss``, one object.

``DistillOptions.checked()`` is the one check of the options on their own (each in its range);
what needs the call's tensors (``hard_weight > 0`` needs ``target``, ``normalizer`` only with a
mean) is checked by ``distill.checked_params``, which calls it. The logits, ``target`` and
``normalizer`` are inputs; the fused head's transforms (``softcap``, ``logit_scale`` and the
teacher's), ``chunk_size`` and ``backend`` describe the head or the run, not the loss: none of
them is an option. The defaults are ``ak.distill_loss``'s (TRL's ``GKDConfig``'s beta).
"""

import dataclasses
from dataclasses import dataclass, fields

from .keywords import options_or_keywords
from .scalars import check_choice, check_in_range, check_index, check_positive

REDUCTIONS = ("batchmean", "sum", "mean", "none")


@dataclass(frozen=True)
class DistillOptions:
    """Every scalar keyword of ``ak.distill_loss`` (its docstring has their meaning)."""
    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "batchmean"
    hard_weight: float = 0.0

    def checked(self) -> "DistillOptions":
        """These options, each checked (``ValueError``/``TypeError`` naming it), with numbers
        as the checks return them. A checked object checks again to itself."""
        return dataclasses.replace(
            self, beta=check_in_range(self.beta, "beta", 0.0, 1.0),
            temperature=check_positive(self.temperature, "temperature"),
            ignore_index=check_index(self.ignore_index, "ignore_index"),
            reduction=check_choice(self.reduction, "reduction", REDUCTIONS),
            hard_weight=check_in_range(self.hard_weight, "hard_weight", 0.0, float("inf")))

    def keywords(self) -> dict:
        """The options as ``ak.distill_loss`` keywords."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


DEFAULT_OPTIONS = DistillOptions()
OPTION_NAMES = tuple(field.name for field in fields(DistillOptions))

#: ``distill_loss`` and ``linear_distill_loss`` refuse ``options=`` beside an option keyword
distill_options_or_keywords = options_or_keywords(DistillOptions, "distillation")
