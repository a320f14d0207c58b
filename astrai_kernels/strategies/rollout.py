"""What an online strategy consumes: :class:`RolloutResult` and the rollout-runner protocol."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import Tensor

try:  # Python >= 3.8
    from typing import Protocol, runtime_checkable
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol, runtime_checkable


@dataclass
class RolloutResult:
    """A batch of sampled responses with their rewards (build it with keywords).

    Fields:
        prompts: prompt token ids ``[B, P]``, padded on either side.
        responses: sampled response token ids ``[B, G, L]`` (``G`` responses per prompt),
            right-padded after the end of each response.
        response_mask: ``[B, G, L]``, true on the real response tokens.
        rewards: ``[B, G]``, one scalar reward per response.
        prompt_mask: ``[B, P]``, true on the real prompt tokens. ``None`` means no padding; the
            strategies never guess padding from token ids (token 0 is a real token in most
            vocabularies).
        logprobs_old: optional ``[B, G, L]`` per-token log-probs of the sampling policy, as the
            generator reported them (the strategies here recompute them with ``old_model``).
        prompt_texts, response_texts: optional decoded text, for reward models.
    """

    prompts: Tensor
    responses: Tensor
    response_mask: Tensor
    rewards: Tensor
    prompt_mask: Optional[Tensor] = None
    logprobs_old: Optional[Tensor] = None
    prompt_texts: List[str] = field(default_factory=list)
    response_texts: List[List[str]] = field(default_factory=list)


@runtime_checkable
class RolloutRunner(Protocol):
    """Produces rollouts for an online strategy.

    ``runner(batch)`` returns ``(result, is_fresh)``: the (possibly cached) rollout for the prompt
    batch, and whether it was sampled just now (the strategy then syncs its behaviour policy).
    ``runner.step()`` is called once per optimizer step, so the runner decides when to sample
    again (e.g. every ``rollout_interval`` steps).
    """

    def __call__(self, batch: Dict[str, Tensor]) -> Tuple[RolloutResult, bool]: ...

    def step(self) -> None: ...
