"""Group Relative Policy Optimization (``grpo``, ``online_grpo``)."""

import dataclasses
from typing import Dict, Optional

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

from ..baselines import original
from ..options.grpo import DEFAULT_OPTIONS, OPTION_NAMES, GRPOOptions
from ..options.keywords import spread_options
from .base import (
    BaseStrategy,
    Device,
    LossOutput,
    StrategyFactory,
    check_ids,
    check_same_shape,
    model_outputs,
    move_to_device,
    require_keys,
)
from .executor import Executor, broadcast_state_dict, unwrap_module
from .logprobs import IGNORE_INDEX, masked_token_logprobs
from .masks import left_align, model_inputs
from .rollout import RolloutResult

# the seed's names (and default) of two options: the KL coefficient and the clip range
SEED_NAMES = {"beta": ("kl_coef", 0.01), "clip_eps_low": ("clip_eps", DEFAULT_OPTIONS.clip_eps_low)}
# the rollout correction needs the sampler's log-probs, which the strategy's batch does not hold
ROLLOUT_CORRECTION = tuple(name for name in OPTION_NAMES if name.startswith("rollout_"))


@StrategyFactory.register("grpo")
class GRPOStrategy(BaseStrategy):
    """Group Relative Policy Optimization (DeepSeekMath / DeepSeek-R1), token-level PPO clipping.

    Advantages are group-normalized from one scalar reward per response,
    ``(r - mean_g) / (std_g + eps)`` with the population std, and broadcast over the response
    tokens. The loss is computed **only on response tokens**; prompt tokens are context.

    Three model roles:

    * **Policy** ``self.model``: the model being trained.
    * **Old policy** ``self.old_model``: the behaviour policy that generated the responses, for
      the importance ratio ``r = pi_theta / pi_old``; synced from the policy on every fresh
      rollout (:meth:`sync_old_model`). ``None`` means on-policy (``r = 1`` in value, the
      gradient of ``r * A`` is ``A * grad log pi``).
    * **Reference** ``self.ref_model``: a frozen copy of the initial policy, used **only** for the
      KL penalty ``kl_coef * k3``, ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's
      unbiased, non-negative estimator). Not evaluated when ``kl_coef == 0``.

    Batch: ``prompts [B, P]``, ``prompt_mask [B, P]`` (optional: no padding when absent; prompts
    may be padded on either side), ``responses [B, G, L]``, ``masks [B, G, L]`` (real response
    tokens), ``rewards [B, G]``.

    The loss is ``policy_loss + kl_coef * mean(k3)`` with both means taken over all response
    tokens of the batch (the seed's aggregation, ``loss_type="bnpo"`` of ``ak.grpo_loss``). With a
    fused ``loss_backend``, every option of ``ak.grpo_loss`` but the rollout correction (which
    needs the sampler's log-probs) passes through to the ops, with ``advantage_scale``: the
    keywords are ``ak.GRPOOptions``' fields (``kl_coef`` and ``clip_eps`` are the seed's names
    of ``beta`` and ``clip_eps_low``), or ``options=`` one object; the signature lists them
    from the dataclass. ``temperature`` is the sampler's; ``off_policy_threshold`` compares
    against the old policy's log-probs.

    Metrics: ``policy_loss``, ``kl_loss`` (``kl_coef * kl``), ``kl`` (mean k3), ``ratio/mean``,
    ``clip_ratio/low``, ``clip_ratio/high``, ``clip_ratio/region``, ``reward/mean``,
    ``reward/std``, ``response_length/mean``, ``loss``.
    """

    @spread_options(GRPOOptions, "GRPO", renamed=SEED_NAMES, left_out=ROLLOUT_CORRECTION)
    def __init__(self, model: nn.Module, device: Device, old_model: Optional[nn.Module],
                 ref_model: Optional[nn.Module], group_size: int = 4,
                 advantage_scale: str = "group", advantage_eps: float = 1e-8, *,
                 options: GRPOOptions, **kwargs):
        super().__init__(model, device, **kwargs)
        # every scalar option of ak.grpo_loss, as one object: the keywords are its fields
        # (the seed's kl_coef and clip_eps are beta and clip_eps_low)
        options = dataclasses.replace(options, beta=float(options.beta))
        if options.beta and ref_model is None:
            raise ValueError(f"GRPOStrategy: kl_coef={options.beta} needs a ref_model (pass "
                             f"kl_coef=0.0 to train without the KL penalty)")
        self.old_model = old_model
        self.ref_model = ref_model
        self.group_size = group_size
        self.advantage_scale = advantage_scale
        self.advantage_eps = advantage_eps
        self.options = options
        seed_defaults = {name: (getattr(options, name), getattr(DEFAULT_OPTIONS, name))
                         for name in OPTION_NAMES
                         if name not in (*SEED_NAMES, "max_completion_length")}
        self._reference_only(advantage_scale=(advantage_scale, "group"), **seed_defaults)

    @property
    def kl_coef(self) -> float:
        """The seed's name of ``beta``."""
        return self.options.beta

    @property
    def clip_eps(self) -> float:
        """The seed's name of ``clip_eps_low``."""
        return self.options.clip_eps_low

    # ------------------------------------------------------------ old policy

    def sync_old_model(self) -> None:
        """Copy the current policy weights into ``old_model``.

        With an executor, its ``unwrap_model`` gives the state dict and ``use_distributed`` says
        whether to broadcast it from rank 0; without one, the bare model's state dict is used and
        broadcast only when a multi-process group is initialized (a no-op in one process).
        """
        if self.old_model is None or self.old_model is self.model:
            return
        executor = self.executor if self.executor is not None else Executor()
        state_dict = executor.unwrap_model(self.model)
        if executor.use_distributed:
            state_dict = broadcast_state_dict(state_dict)
        if state_dict is not None:
            unwrap_module(self.old_model).load_state_dict(state_dict)

    # ------------------------------------------------------------ batch

    def _unpack(self, batch: Dict[str, Tensor]):
        owner = type(self).__name__
        require_keys(batch, ("prompts", "responses", "masks", "rewards"), owner)
        batch = move_to_device(batch, self.device)
        prompts, responses = batch["prompts"], batch["responses"]
        masks, rewards = batch["masks"], batch["rewards"]
        check_ids(prompts, "prompts", owner, 2)
        check_ids(responses, "responses", owner, 3)
        check_same_shape(masks, "masks", responses, "responses", owner)
        if tuple(rewards.shape) != tuple(responses.shape[:2]):
            raise ValueError(f"{owner}: rewards must be [B, G] = {tuple(responses.shape[:2])} "
                             f"(one per response), got {tuple(rewards.shape)}")
        if responses.shape[0] != prompts.shape[0]:
            raise ValueError(f"{owner}: {prompts.shape[0]} prompts but responses for "
                             f"{responses.shape[0]}")
        if prompts.shape[1] < 1 or responses.shape[2] < 1:
            raise ValueError(f"{owner}: prompts and responses need at least one token, got "
                             f"shapes {tuple(prompts.shape)} and {tuple(responses.shape)}")
        prompt_mask = batch.get("prompt_mask")
        if prompt_mask is None:
            # No mask means no padding. (The seed guessed ``prompts != 0``, which hides every
            # real token 0 of the vocabulary.)
            prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
        else:
            check_same_shape(prompt_mask, "prompt_mask", prompts, "prompts", owner)
        return prompts, prompt_mask.bool(), responses, masks, rewards

    # ------------------------------------------------------------ loss

    def compute_loss(self, batch: Dict[str, Tensor]) -> Tensor:
        return self.compute_loss_output(batch)["loss"]

    def compute_loss_output(self, batch: Dict[str, Tensor]) -> LossOutput:
        prompts, prompt_mask, responses, masks, rewards = self._unpack(batch)
        batch_size, group_size, response_len = responses.shape
        responses_flat = responses.reshape(-1, response_len)
        masks_flat = masks.reshape(-1, response_len)
        # Left-align the prompts so each sequence is one run of real tokens (prompt, then
        # response) and the first response token is predicted from the last real prompt token.
        prompts, prompt_mask = left_align(prompts, prompt_mask)
        prompt_expanded = prompts.repeat_interleave(group_size, dim=0)
        prompt_mask_expanded = prompt_mask.repeat_interleave(group_size, dim=0)
        prompt_len = prompt_expanded.shape[1]

        full_sequences = torch.cat([prompt_expanded, responses_flat], dim=-1)
        # Key padding: padded prompt tokens and padding after the end of each response.
        key_mask = torch.cat([prompt_mask_expanded, masks_flat.bool()], dim=-1)
        inputs = full_sequences[:, :-1]
        input_mask, position_ids = model_inputs(key_mask[:, :-1], inputs)

        def forward(model, head=None):
            """The model's logits outputs, or with a fused ``head`` its hidden states."""
            if head is not None:
                return head.hidden(type(self).__name__, input_ids=inputs, input_mask=input_mask,
                                   position_ids=position_ids)
            return model_outputs(model, type(self).__name__, input_ids=inputs,
                                 input_mask=input_mask, position_ids=position_ids)

        if self.uses_reference:
            policy_out = forward(self.model)
            task_loss, metrics = self._seed_loss(forward, policy_out["logits"], full_sequences,
                                                 prompt_len, responses_flat, masks_flat, rewards)
        else:
            policy_out, task_loss, metrics = self._fused_loss(forward, prompt_len, responses_flat,
                                                              masks_flat, rewards)
        aux_loss = policy_out.get("aux_loss")
        mask_f = masks_flat.float()
        metrics["reward/mean"] = rewards.float().mean()
        metrics["reward/std"] = rewards.float().std(unbiased=False)
        metrics["response_length/mean"] = mask_f.sum(-1).mean()
        return self._loss_output(task_loss, metrics, aux_loss)

    def _fused_loss(self, forward, prompt_len, responses, masks, rewards):
        """``ak.grpo_loss`` on the response slice of the policy logits (a view: no copy, and
        nothing is computed for the prompt positions), or ``ak.linear_grpo_loss`` on the response
        slice of the hidden states when the model has a fused head (no logits at all). The
        no-grad old and reference forwards run first, so their logits are freed before the
        policy's exist."""
        backend = self.loss_backend
        mask = masks.float()
        old_logprobs = ref_logprobs = None

        def response_logprobs(model):
            head = self.model_head(model)
            if head is None:
                logits = forward(model)["logits"][:, prompt_len - 1:]
                return masked_token_logprobs(logits, responses, mask, backend,
                                             self.options.temperature)
            hidden = forward(model, head)["hidden_states"][:, prompt_len - 1:]
            return ak.linear_token_logprobs(
                hidden, head.weight, responses.masked_fill(mask == 0, IGNORE_INDEX),
                bias=head.bias, temperature=self.options.temperature, ignore_index=IGNORE_INDEX,
                softcap=head.softcap, backend=backend)

        with torch.no_grad():
            if self.old_model is not None and self.old_model is not self.model:
                old_logprobs = response_logprobs(self.old_model)
            if self.kl_coef:
                ref_logprobs = response_logprobs(self.ref_model)
            advantages = ak.group_advantages(rewards.float(), scale=self.advantage_scale,
                                             eps=self.advantage_eps)
        options = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                       options=self.options, backend=backend)
        head = self.model_head(self.model)
        policy_out = forward(self.model, head)
        # Position t predicts token t + 1, so the response (tokens prompt_len..S-1) is
        # predicted by positions prompt_len-1 .. S-2.
        if head is None:
            loss, op_metrics = ak.grpo_loss(policy_out["logits"][:, prompt_len - 1:], responses,
                                            advantages.reshape(-1), **options)
        else:
            loss, op_metrics = ak.linear_grpo_loss(
                policy_out["hidden_states"][:, prompt_len - 1:], head.weight, responses,
                advantages.reshape(-1), bias=head.bias, softcap=head.softcap, **options)
        metrics = dict(op_metrics)
        kl_loss = self.kl_coef * metrics["kl"]
        token_mean = self.options.record.token_weight == "token_mean"
        if (token_mean or not self.kl_coef) and not self.options.entropy_coef:
            # a token mean: loss = mean(pg) + kl_coef * mean(k3), both over all response tokens
            metrics["policy_loss"] = loss.detach() - kl_loss
        metrics["kl_loss"] = kl_loss
        return policy_out, loss, metrics

    def _seed_loss(self, forward, logits, full_sequences, prompt_len, responses, masks,
                   rewards):
        """The seed's math (:mod:`astrai_kernels.baselines.original`): full-sequence ``log_softmax(
        logits.float())`` + ``gather`` for the policy, old and reference models, then the clipped
        surrogate and the k3 penalty in plain torch."""
        batch_size, group_size = rewards.shape
        full_masks = torch.cat(
            [torch.zeros(masks.shape[0], prompt_len, dtype=torch.float32, device=masks.device),
             masks.float()], dim=-1)
        target, shifted_mask = full_sequences[:, 1:], full_masks[:, 1:]

        def seed_logprobs(model_logits):
            token_lp = masked_token_logprobs(model_logits, target, shifted_mask, "reference")
            return token_lp[:, prompt_len - 1:].reshape(batch_size, group_size, -1)

        lp_policy = seed_logprobs(logits)
        with torch.no_grad():
            lp_old = None
            if self.old_model is not None and self.old_model is not self.model:
                lp_old = seed_logprobs(forward(self.old_model)["logits"])
            lp_ref = seed_logprobs(forward(self.ref_model)["logits"]) if self.kl_coef else None
        token_masks = masks.reshape(batch_size, group_size, -1).float()
        advantages = original.group_advantages(rewards, self.advantage_eps).unsqueeze(-1)
        task_loss, metrics = original.grpo_loss(lp_policy, lp_old, lp_ref, advantages, token_masks,
                                             self.clip_eps, self.kl_coef)
        return task_loss, dict(metrics)

    # ------------------------------------------------------------ online

    def supports_online(self) -> bool:
        return True

    def prepare_from_rollout(self, result: RolloutResult) -> Dict[str, Tensor]:
        batch = {
            "prompts": result.prompts,
            "responses": result.responses,
            "masks": result.response_mask,
            "rewards": result.rewards,
        }
        if result.prompt_mask is not None:
            batch["prompt_mask"] = result.prompt_mask
        return batch

    def _on_rollout_refresh(self) -> None:
        """Sync the behaviour policy whenever a fresh rollout arrives."""
        self.sync_old_model()


# Online GRPO is the same class; the rollout runner injected with ``set_rollout_runner`` switches
# it to online mode.
StrategyFactory.register("online_grpo")(GRPOStrategy)
