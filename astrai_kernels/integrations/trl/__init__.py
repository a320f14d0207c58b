"""TRL's trainers on the fused LM head (the optional extra ``trl``; tested with TRL 1.16.0).

TRL 1.16 gives every model its trainers score (the policy, or its PEFT base; ``ref_model``) a
fused LM head of its own, ``trl.trainer.utils.add_fused_lm_head``: the model's ``forward``
becomes one that, called with ``fused_lm_head=True`` and ``labels``, runs the backbone and
``ChunkedLogProbFunction`` on the labelled positions and returns a ``FusedCausalLMOutput``.

``install(trainer)`` replaces, on each of those models, TRL's forward by one with the same
contract that computes the per-token fields with ``ak.linear_token_logprobs``:

* keywords ``fused_lm_head``, ``labels``, ``shift_labels``, ``num_items_in_batch``; labels
  shifted by one unless ``shift_labels`` is given; only positions whose label is not -100 reach
  the head (``hidden[mask]``), the fields are 0 elsewhere;
* the fields TRL's head was set up to compute (its ``outputs``: ``entropy``,
  ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), ``log_probs``, ``label_mask`` and
  ``loss = -sum(log_probs) / (num_items_in_batch or the label count)``;
* the temperature TRL's head was given, the model's logit scale and final soft-cap as TRL
  read them (``logit_scale`` / ``output_multiplier`` / ``lm_head_multiplier`` /
  ``logits_scaling``, ``final_logit_softcapping``), in TRL's order (scale, cap, temperature);
* TRL's compute dtype: the autocast dtype under autocast, float32 with
  ``cast_lm_head_to_fp32``, else the hidden states'.

On a ``GKDTrainer`` (``trl.experimental.gkd``), whose loss reads full logits, ``install``
also replaces that trainer's ``compute_loss`` by ``ak.linear_distill_loss`` on the student's
and the teacher's final hidden states (``gkd.py``: the trainer's ``beta``,
temperature 1 and ``batchmean`` or ``num_items_in_batch`` as TRL's ``generalized_jsd_loss``
there, each model's logit scale and soft-cap); the models are called through ``__call__`` with
``astrai_hidden_states=True``, which their installed forward answers with the backbone's output.

``install(trainer, fused_loss=True)`` on a ``GRPOTrainer`` also replaces its ``_compute_loss``
(``grpo.py``): the policy's final hidden states at the completion positions and its LM head go
into ``ak.linear_grpo_loss`` with TRL's settings as ``ak.GRPOOptions`` (``grpo.grpo_options``),
TRL's masks, old/reference log-probs and normalisation; vLLM's importance sampling is the op's
rollout correction (``rollout_is`` = TRL's ``vllm_importance_sampling_mode``, ``rollout_is_min``
/ ``rollout_is_max`` = its ``clip_min`` / ``clip_max``) from ``sampling_per_token_logps`` and
``old_per_token_logps``, as TRL forms its ratio. The gradient comes out of the loss's own walk
(the single-pass kernel for the clipped surrogate on token ratios), and TRL's metrics are logged
under TRL's names from the same walk's token values (``return_token_values``). What does not map
exactly is refused (``grpo.GRPOAdapter.check``, ``GRPOOptions.checked``): other trainers (RLOO's
ratio is a summed sequence log-ratio), an overridden loss (with vLLM's correction, an overridden
``_generate_and_score_completions``, which forms TRL's ratio), multimodal inputs, the entropy
bonus, a multi-process entropy quantile, the off-policy mask with vLLM, VESPO with vLLM bounds
excluding 1.

``install(trainer, fused_loss=True, score_support="sampler")`` on a ``GRPOTrainer`` scores the
policy's and the old policy's completion tokens under the trainer's own sampling settings
(``sampler.sampling_params``: ``temperature``, ``top_k``, ``top_p``, ``min_p`` in vLLM's names)
instead of the full tempered softmax, as vLLM's ``processed_logprobs`` are: the policy's head
passes ``sampling=`` to ``ak.linear_token_logprobs`` (the old log-probs at generation; its
entropy, when TRL's head computes one, still the full tempered distribution's, from a second
walk without gradient), and the loss is ``ak.linear_grpo_loss(..., sampling=...)``. A token
outside the current or old policy's support is masked and counted in TRL's metrics as
``sampling/out_of_support``; the logged entropy is the full distribution's (one more walk
without gradient, and one for the token log-probs of TRL's other metrics, since ``sampling=``
returns neither). The reference model's log-probs for the KL stay under the full softmax: the
reference's own support need not hold the sampled token (an infinite KL), and the k3 term then
compares the policy's sampled distribution with the full reference, as NeMo-RL does. Refused
(``sampler.check``): everything whose sampler distribution is not the one scored.

On a ``DistillationTrainer`` (``trl.DistillationTrainer``), whose models carry no TRL head,
``install`` gives the trainer TRL's own ``_compute_loss`` (its inputs, backbone calls, logit
scales and soft-caps) with the one global name ``_chunked_divergence_loss`` resolved to
``distillation.divergence_loss``: ``ak.linear_distill_loss`` on the completion positions with
the trainer's ``beta`` and ``temperature``, divided by ``num_items_in_batch`` or the position
count, each head in its hidden states' (or the autocast) dtype, and the logged student entropy
from ``ak.linear_token_logprobs`` (one more walk of the student head, no gradient). Refused:
no local ``teacher_model``, a subclass overriding ``compute_loss`` or ``_compute_loss``, a TRL
whose ``_compute_loss`` does not call ``_chunked_divergence_loss`` with 1.16's arguments,
``beta`` outside [0, 1], ``temperature <= 0``, heads of different vocabularies, or a DTensor
head other than FSDP2's (under FSDP2 the student's head is read inside its forward and a
sharded teacher head is gathered for the loss).

On a ``ServerDistillationTrainer`` (``trl.experimental.server_distillation``: the teacher is a
vLLM server returning top-k log-probs), ``install`` replaces its ``compute_loss``
(``server_distillation.py``) by one that keeps TRL's inputs, prompt length, teacher
request (``_get_teacher_token_logprobs_from_server``), slicing, trimming to the teacher's window,
ValueErrors for missing teacher log-probs and division by the gradient-accumulation steps, and
computes the loss with ``ak.linear_topk_distill_loss`` (TRL's top-k support at ``beta == 0``
with ``loss_add_tail`` as ``tail``, ``server_top1_support`` at ``beta > 0``; ``batchmean`` over
the labelled positions) on the student's final hidden states from TRL's own
``_get_last_hidden_state`` through ``_forward_redirection``, only the labelled positions
reaching the head (the logit scale folded into the hidden states). A soft-capped student (that
op has no soft-cap) or one ``integrations.transformers.fused_head`` does not read keeps TRL's
``model(...)`` call and gets ``ak.topk_distill_loss`` on its logits. ``return_outputs=True``
on the hidden-state form runs TRL's own ``compute_loss`` (the caller wants the logits). Refused:
a subclass overriding the loss methods, ``beta`` outside [0, 1], ``temperature <= 0``,
``loss_top_k`` other than TRL's config allows, ``reverse_kl_top_1_mode`` other than
``"sampled"``, a DTensor head other than FSDP2's (read inside the student's forward).

Calls without ``fused_lm_head`` go to TRL's forward (so to the model's own, e.g. for
``generate``). The models are still called through ``model(...)``, so hooks run. TRL's
settings are read from its forward's closure, which is why ``install`` checks TRL's version
and the closure's names and refuses anything else. Refused at ``install``, with the reason:
a TRL other than 1.16, a trainer whose models carry no TRL fused head, a GKD trainer whose
``compute_loss`` is overridden or whose models ``integrations.transformers.fused_head``
cannot serve, a MoE model whose config asks for router logits (the aux loss is not reproduced),
an output embedding that is not a plain ``nn.Linear`` (e.g. a LoRA-adapted ``lm_head``),
FSDP1 and DeepSpeed (sharded heads are not gathered here). Under accelerate's FSDP2 every
served head reads its weight inside the model's forward, where the root ``fully_shard`` has
gathered it (``fused_loss``' GRPO loss too: the policy is called with ``astrai_loss=``); the
GKD and distillation losses, which read heads outside the forwards, are refused there. A model
that asks for router logits at call time gets an error, never TRL's head silently.

The package: ``contract.py`` (what is relied on in TRL, read and refused once) and one adapter
per trainer family (``head``, ``gkd``, ``grpo``, ``distillation``, ``server_distillation``),
each with ``applies``, ``check``, ``apply`` and ``undo``. ``install`` checks every adapter that
applies, then applies them all (a refusal leaves the trainer untouched); ``uninstall`` undoes
them in reverse order.

TRL is imported only when these functions run; ``import astrai_kernels`` never imports it.
"""
import dataclasses
from typing import List, Optional

import torch.nn as nn

import astrai_kernels as ak  # noqa: F401  (the ops' module, as the adapters call them)

from ...ops.head import check_chunk_size
from . import contract, distillation, gkd, grpo, head, sampler, server_distillation
from .contract import TESTED_TRL, Request, TRLHeadError, refuse, trl_head_settings
from .distillation import divergence_loss as _distillation_divergence_loss  # noqa: F401

__all__ = ["TESTED_TRL", "TRLHeadError", "install", "is_installed", "served_models",
           "trl_head_settings", "uninstall"]

#: every adapter, in the order ``install`` checks and applies them (``uninstall``: reversed)
ADAPTERS = (head.ADAPTER, gkd.ADAPTER, grpo.ADAPTER, distillation.ADAPTER,
            server_distillation.ADAPTER)
_TRAINER_STATE = "_astrai_kernels_trl_models"


def install(trainer, *, backend: str = "auto", chunk_size: Optional[int] = None,
            fused_loss: bool = False, score_support: Optional[str] = None):
    """Serve every fused-head call of ``trainer`` (a built TRL 1.16 trainer) with
    ``ak.linear_token_logprobs`` (a GKDTrainer's or DistillationTrainer's loss with
    ``ak.linear_distill_loss``, a ServerDistillationTrainer's with
    ``ak.linear_topk_distill_loss``); returns the trainer. ``fused_loss=True`` (a GRPOTrainer)
    also computes its loss with ``ak.linear_grpo_loss``. ``score_support="sampler"`` (a
    GRPOTrainer, with ``fused_loss=True``) scores the policy's and the old policy's completion
    tokens under the trainer's ``temperature``/``top_k``/``top_p``/``min_p`` (``sampler.py``).
    Raises ``TRLHeadError`` (a ``ValueError``) saying why when it cannot serve the trainer
    exactly (module docstring); every adapter is checked before any is applied."""
    if not isinstance(fused_loss, bool):
        raise TypeError(f"fused_loss must be a bool, got {type(fused_loss).__name__}")
    sampler.check_score_support(score_support)
    check_chunk_size(chunk_size)
    if is_installed(trainer):
        raise refuse(trainer, "install was already called on it; uninstall first")
    contract.check_trl(trainer)
    request = Request(backend, chunk_size, fused_loss, score_support=score_support)
    if score_support is not None:
        sampler.check(trainer, request)
    adapters = [adapter for adapter in ADAPTERS if adapter.applies(trainer, request)]
    request = dataclasses.replace(request, policy_hidden_states=any(
        adapter.reads_hidden_states for adapter in adapters))
    for adapter in adapters:
        adapter.check(trainer, request)
    trainer.__dict__[_TRAINER_STATE] = [(adapter, adapter.apply(trainer, request))
                                        for adapter in adapters]
    return trainer


def uninstall(trainer):
    """Give the trainer its own (TRL's) heads and losses back; returns the trainer."""
    applied = trainer.__dict__.get(_TRAINER_STATE)
    if applied is None:
        raise ValueError(f"uninstall: {type(trainer).__name__} is not installed")
    for adapter, models in reversed(applied):
        adapter.undo(trainer, models)
    del trainer.__dict__[_TRAINER_STATE]
    return trainer


def is_installed(trainer) -> bool:
    return _TRAINER_STATE in getattr(trainer, "__dict__", {})


def served_models(trainer) -> List[nn.Module]:
    """The models ``install`` serves on ``trainer`` (empty when not installed)."""
    return [model for _, models in trainer.__dict__.get(_TRAINER_STATE, ())
            for model in models]
