"""Training strategies (next-token, SFT, DPO, GRPO, online DPO/GRPO) computing their losses with
the fused ops of :mod:`astrai_kernels` (docs/architecture.md, "Strategies").

They reproduce the interface and behaviour of the original strategy module this package was
built for, called "the seed" below: a ``StrategyFactory`` of strategy classes that each take a
batch dict, run the model (``model(input_ids=..., input_mask=..., position_ids=...)`` returning a
dict with ``logits`` and optionally ``aux_loss``), and compute the loss from
``log_softmax(logits.float())`` + ``gather`` or ``F.cross_entropy`` in plain PyTorch; GRPO with
separate policy, old-policy and reference models, DPO with an optional reference model, online
variants fed by a rollout runner. That math lives on in :mod:`astrai_kernels.baselines.original`.

``StrategyFactory.create(name, model, device, **kwargs)`` builds one of ``seq``, ``sft``, ``dpo``,
``grpo``, ``online_dpo``, ``online_grpo`` (the ``online_*`` names are the same classes: a rollout
runner injected with ``set_rollout_runner`` switches a strategy to online mode), or any class
registered with ``@StrategyFactory.register(name)``. Every strategy returns a
:class:`LossOutput` ``{"loss": ..., "metrics": {...}}``, adds ``moe_aux_loss_coef * aux_loss``
when the model returns an ``aux_loss``, and keeps the seed's extension points
(``compute_loss``/``compute_loss_output``, ``supports_online``, ``prepare_from_rollout``,
``_on_rollout_refresh``, ``on_optimizer_step``, ``extra_kwargs``).

``loss_backend`` (every strategy, default ``"auto"``) chooses the loss math:

* ``"auto"``, ``"cpp"``, ``"torch"``, ``"triton"``: the ops of this package with that
  ``backend=`` (``ak.cross_entropy``, ``ak.token_logprobs``, ``ak.sequence_logprobs``,
  ``ak.grpo_loss``, ``ak.dpo_loss``, ``ak.group_advantages``). No fp32 ``[N, V]`` copy of the
  logits is made; GRPO scores only the response positions (a view of the logits); the old and
  reference log-probs are forward-only and computed before the policy's forward, so their
  logits are freed before the policy's exist. ``SEQStrategy``/``SFTStrategy`` also take
  ``inplace_backward=True`` (the logits' gradient overwrites the logits buffer).
  When a model exposes its final hidden states and output embedding (:mod:`.head`:
  ``TinyCausalLM.forward_hidden``, or a transformers causal LM), each model's part of the loss
  (policy, old and reference log-probs) runs through the ``linear_*`` ops instead
  (``ak.linear_cross_entropy``, ``ak.linear_sequence_logprobs``, ``ak.linear_token_logprobs``,
  ``ak.linear_grpo_loss``) and no logits exist at all; ``fused_head=False`` keeps the logits.
* ``"reference"``: the seed's own math (:mod:`astrai_kernels.baselines.original`), through no
  op of this package: ``log_softmax(logits.float())`` + ``gather`` over the whole sequence,
  ``F.cross_entropy``, the clipped surrogate and the DPO sigmoid in plain torch. It exists for
  parity tests and comparisons, and accepts only the seed's options (``ValueError`` otherwise).

Both paths build the same model inputs, so they differ only in the loss math; the fixes below
apply to both.

Fixes to the seed, and why
--------------------------

1. **Padding was guessed from token ids.** GRPO's default prompt mask was ``prompts.ne(0)`` and
   DPO's attention mask was ``concat_ids.bool()``: every real token 0 (a real token in most
   vocabularies, often ``<unk>``, ``!`` or a byte) was hidden from attention. Now only the masks
   the batch carries are used: GRPO's ``prompt_mask`` (``RolloutResult.prompt_mask``), DPO's
   optional ``chosen_attention_mask``/``rejected_attention_mask``; without them there is no
   padding (right padding needs none: the causal mask hides it from every real token).
2. **The KL comment called k3 "k1".** ``r - log r - 1`` with ``r = pi_ref / pi_theta`` is
   Schulman's k3 estimator (k1 is ``-log r``). Renamed in the comments and docs.
3. **The KL took ``log(r + 1e-8)`` of ``r = exp(ref - logp)``**, not the log-ratio itself: a
   bias that grows as ``r`` shrinks, and once the policy is ``> 18.4`` nats above the reference
   on a token the log term is stuck at ``log(1e-8)``, so the penalty stops growing and its
   gradient vanishes. ``k3 = exp(d) - d - 1`` with ``d = ref - logp`` is used (the fused op clamps
   ``d`` to +-20 before ``exp`` to keep it finite; the reference path does not clamp).
4. **Right-padded prompts broke GRPO.** With ``prompt + response`` concatenated, the first
   response token of a shorter, right-padded prompt was "predicted" from a padding position, and
   the response positions were shifted by the pad count (the seed's own rollout generator pads
   prompts on the right). Prompts are now left-aligned with their mask (padding moved to the
   front, order of real tokens kept), so each sequence is one run of real tokens.
5. **Position ids ignored padding.** GRPO and DPO passed no ``position_ids``, so left-padded
   sequences got positions shifted by the padding, unlike at generation time. Positions now count
   real tokens (``cumsum(mask) - 1``).
6. **Fully masked attention rows.** A padding query whose keys are all padding had an all-masked
   softmax row, NaN in most attention kernels; the seed then multiplied by the loss mask, and
   ``NaN * 0 = NaN``. Every query may now attend to itself (real queries already could).
7. **Online DPO scored responses without their prompts** (``log pi(y)`` instead of
   ``log pi(y | x)``). ``prepare_from_rollout`` now builds ``prompt + response`` with the prompt
   masked out of the loss.
8. **``sync_old_model`` needed an executor**: with the default ``executor=None`` it raised
   ``AttributeError``. It now works in one process without one, broadcasts from rank 0 when a
   process group with several ranks is initialized, and ``broadcast_state_dict`` receives into new
   buffers (never into the caller's tensors, which may be the live parameters) and accepts
   ``None`` on non-source ranks (rank-0-only state dicts).
9. **SFT's ``~loss_mask``** is a bitwise NOT for 0/1 integer masks (``~1 == -2``: every token
   counted) and an error for float masks; the mask is compared with 0 instead. SFT's
   ``position_ids`` is optional (one document per row when absent).
10. **All-ignored batches gave NaN**: ``F.cross_entropy``'s mean is ``0/0`` when every target is
    ignored (e.g. a packed chunk of prompt tokens only), and one NaN step poisons the weights.
    The loss is 0 with zero gradient (the fused op's contract; the reference path matches).
11. **Bad batches failed deep inside torch** (a missing key, chosen/rejected pairs of different
    counts, masks of another shape, rewards not ``[B, G]``, a model without ``logits``): each now
    raises a ``ValueError``/``TypeError`` naming the key and the expected shape. Chosen and
    rejected of different lengths (a ``torch.cat`` error in the seed) are right-padded to a
    common length. DPO's ``reduction="none"`` (a ``[B, T]`` "sequence" log-prob, silently a
    wrong loss) is rejected.
12. **``move_to_device`` crashed on non-tensor batch values** (e.g. texts); they pass through.
13. **Wasted and unchecked reference model in GRPO**: the reference forward ran even with
    ``kl_coef == 0``; it is skipped, and ``kl_coef > 0`` without a ``ref_model`` is an error at
    construction. ``old_model=None`` means on-policy. Integer rewards are cast to float.
14. ``set_rollout_runner`` on a strategy without online support raises at once, not at the first
    step; ``responses.view`` (an error on non-contiguous rollouts) became ``reshape``.
"""

from .base import (
    LOSS_BACKENDS,
    BaseFactory,
    BaseStrategy,
    LogprobsOutput,
    LossOutput,
    StrategyFactory,
    move_to_device,
)
from .dpo import DPOStrategy
from .executor import Executor, broadcast_state_dict, unwrap_module
from .grpo import GRPOStrategy
from .logprobs import get_logprobs
from .masks import left_align, make_doc_boundary_mask, padded_causal_mask, positions_from_mask
from .rollout import RolloutResult, RolloutRunner
from .sft import SEQStrategy, SFTStrategy

__all__ = [
    "BaseFactory",
    "BaseStrategy",
    "DPOStrategy",
    "Executor",
    "GRPOStrategy",
    "LOSS_BACKENDS",
    "LogprobsOutput",
    "LossOutput",
    "RolloutResult",
    "RolloutRunner",
    "SEQStrategy",
    "SFTStrategy",
    "StrategyFactory",
    "broadcast_state_dict",
    "get_logprobs",
    "left_align",
    "make_doc_boundary_mask",
    "move_to_device",
    "padded_causal_mask",
    "positions_from_mask",
    "unwrap_module",
]
