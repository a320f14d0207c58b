"""A tiny deterministic decoder-only LM for tests and demos, and a toy rollout runner.

:class:`TinyCausalLM` follows the model contract of the strategies: ``model(input_ids,
input_mask=None, position_ids=None)`` returns ``{"logits": [B, T, V]}`` (plus ``"aux_loss"``, a
differentiable scalar, when built with ``n_experts > 0``); ``forward_hidden`` (same arguments)
returns the final hidden states instead of the logits, and ``get_output_embeddings()`` the LM
head, so the strategies can use the fused head. ``input_mask`` may be a 4-D boolean
attention mask ``[B, 1 or H, T, T]`` (``True`` = attend, used as given: compose causality into
it), or a 2-D ``[B, T]`` key-padding mask (combined with the causal mask); ``None`` is causal.
Weights come from ``seed`` alone, so two models built with the same arguments are identical and
the global RNG is left untouched.
"""

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        # A query with no allowed key gets a zero output (not NaN, not a uniform average).
        weights = torch.softmax(scores, dim=-1) * mask.any(dim=-1, keepdim=True)
        y = (weights @ v).transpose(1, 2).reshape(batch, length, d_model)
        return self.out(y)


class _MoE(nn.Module):
    """A dense soft mixture of experts with a switch-style load-balancing auxiliary loss."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int):
        super().__init__()
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
            for _ in range(n_experts))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        probs = torch.softmax(self.router(x), dim=-1)
        y = sum(probs[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        mean_prob = probs.flatten(0, -2).mean(0)
        aux = len(self.experts) * (mean_prob * mean_prob).sum()
        return y, aux


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, n_experts: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        if n_experts:
            self.mlp = _MoE(d_model, d_ff, n_experts)
        else:
            self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(),
                                     nn.Linear(d_ff, d_model))
        self.moe = bool(n_experts)

    def forward(self, x: Tensor, mask: Tensor):
        x = x + self.attn(self.ln1(x), mask)
        h = self.mlp(self.ln2(x))
        aux = None
        if self.moe:
            h, aux = h
        return x + h, aux


class TinyCausalLM(nn.Module):
    """Embedding + learned positions, ``n_layers`` pre-LN blocks (causal multi-head attention,
    an MLP or a soft MoE), a final LayerNorm and an untied LM head."""

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 32,
        n_layers: int = 2,
        n_heads: int = 2,
        d_ff: Optional[int] = None,
        max_seq_len: int = 256,
        n_experts: int = 0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        d_ff = 4 * d_model if d_ff is None else d_ff
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, d_model)
            self.pos = nn.Embedding(max_seq_len, d_model)
            self.blocks = nn.ModuleList(
                _Block(d_model, n_heads, d_ff, n_experts) for _ in range(n_layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02 if module is not self.lm_head
                                    else 1.0 / math.sqrt(d_model))
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
        self.to(dtype)

    def _attention_mask(self, input_mask: Optional[Tensor], batch: int, length: int,
                        device) -> Tensor:
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))
        if input_mask is None:
            return causal.expand(batch, 1, length, length)
        if input_mask.dtype != torch.bool:
            raise TypeError(f"TinyCausalLM: input_mask must be boolean, got {input_mask.dtype}")
        if input_mask.dim() == 2:
            if tuple(input_mask.shape) != (batch, length):
                raise ValueError(f"TinyCausalLM: a 2-D input_mask must be [B, T] = "
                                 f"{(batch, length)}, got {tuple(input_mask.shape)}")
            return input_mask[:, None, None, :] & causal
        if input_mask.dim() == 4 and tuple(input_mask.shape[-2:]) == (length, length):
            return input_mask
        raise ValueError(f"TinyCausalLM: input_mask must be [B, T] or [B, 1|H, T, T] with "
                         f"T = {length}, got {tuple(input_mask.shape)}")

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head (``logits = hidden @ weight.T``), as transformers models name it."""
        return self.lm_head

    def forward(self, input_ids: Tensor, input_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None) -> Dict[str, Tensor]:
        out = self.forward_hidden(input_ids, input_mask, position_ids)
        out["logits"] = self.lm_head(out.pop("hidden_states"))
        return out

    def forward_hidden(self, input_ids: Tensor, input_mask: Optional[Tensor] = None,
                       position_ids: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """The final hidden states ``{"hidden_states": [B, T, d_model]}`` (after ``ln_f``, what
        the LM head takes; plus ``"aux_loss"``): what the fused-head strategies use."""
        if input_ids.dim() != 2:
            raise ValueError(f"TinyCausalLM: input_ids must be [B, T], got "
                             f"{tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        elif tuple(position_ids.shape) != (batch, length):
            raise ValueError(f"TinyCausalLM: position_ids must be {(batch, length)}, got "
                             f"{tuple(position_ids.shape)}")
        if length > self.max_seq_len or int(position_ids.max()) >= self.max_seq_len:
            raise ValueError(f"TinyCausalLM: positions up to {self.max_seq_len - 1} only")
        mask = self._attention_mask(input_mask, batch, length, input_ids.device)
        x = self.embed(input_ids) + self.pos(position_ids)
        aux_losses = []
        for block in self.blocks:
            x, aux = block(x, mask)
            if aux is not None:
                aux_losses.append(aux)
        out = {"hidden_states": self.ln_f(x)}
        if aux_losses:
            out["aux_loss"] = torch.stack(aux_losses).mean()
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: Tensor,
        prompt_mask: Optional[Tensor] = None,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        eos_token_id: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> Tuple[Tensor, Tensor]:
        """Sample ``max_new_tokens`` after each prompt; ``(responses [N, L], response_mask)``.

        Uses the strategies' input convention (prompts left-aligned by their mask, positions
        counting real tokens, padding keys hidden), so the log-probs a strategy computes are
        those of the sampling distribution. Tokens after an ``eos_token_id`` are masked out.
        """
        from ..strategies.masks import left_align, model_inputs

        if prompt_mask is None:
            prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
        tokens, key_mask = left_align(prompts, prompt_mask.bool())
        n_rows = tokens.shape[0]
        alive = torch.ones(n_rows, dtype=torch.bool, device=tokens.device)
        responses, response_mask = [], []
        for _ in range(max_new_tokens):
            input_mask, position_ids = model_inputs(key_mask, tokens)
            logits = self(tokens, input_mask=input_mask, position_ids=position_ids)["logits"]
            probs = torch.softmax(logits[:, -1].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            responses.append(nxt)
            response_mask.append(alive.clone())
            if eos_token_id is not None:
                alive = alive & (nxt != eos_token_id)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            key_mask = torch.cat([key_mask, response_mask[-1][:, None]], dim=1)
        return torch.stack(responses, 1), torch.stack(response_mask, 1)


class ToyRolloutRunner:
    """A rollout runner (the protocol of :mod:`astrai_kernels.strategies.rollout`) for tests and
    demos: samples ``group_size`` responses per prompt from ``model`` and scores them with
    ``reward_fn(prompts [B, P], responses [B, G, L], response_mask [B, G, L]) -> [B, G]``.

    ``runner(batch)`` reads ``batch["prompts"]`` (and ``batch.get("prompt_mask")``) and samples
    again every ``rollout_interval`` optimizer steps (``runner.step()``); in between it returns
    the cached rollout with ``is_fresh=False``.
    """

    def __init__(self, model: nn.Module, reward_fn: Callable[[Tensor, Tensor, Tensor], Tensor],
                 group_size: int = 4, max_new_tokens: int = 8, temperature: float = 1.0,
                 eos_token_id: Optional[int] = None, rollout_interval: int = 1, seed: int = 0):
        self.model = model
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.eos_token_id = eos_token_id
        self.rollout_interval = rollout_interval
        self.generator = torch.Generator().manual_seed(seed)
        self._cache = None
        self._steps_since_rollout = 0

    def step(self) -> None:
        self._steps_since_rollout += 1

    def __call__(self, batch: Dict[str, Tensor]):
        from ..strategies.rollout import RolloutResult

        if self._cache is not None and self._steps_since_rollout < self.rollout_interval:
            return self._cache, False
        prompts = batch["prompts"]
        prompt_mask = batch.get("prompt_mask")
        if prompt_mask is None:
            prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
        n_prompts, group = prompts.shape[0], self.group_size
        device = next(self.model.parameters()).device
        generator = self.generator if device.type == "cpu" else None
        responses, response_mask = self.model.generate(
            prompts.repeat_interleave(group, 0).to(device),
            prompt_mask.repeat_interleave(group, 0).to(device),
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            eos_token_id=self.eos_token_id, generator=generator)
        responses = responses.view(n_prompts, group, -1)
        response_mask = response_mask.view(n_prompts, group, -1)
        rewards = self.reward_fn(prompts, responses, response_mask).float()
        self._cache = RolloutResult(prompts=prompts, prompt_mask=prompt_mask.bool(),
                                    responses=responses, response_mask=response_mask,
                                    rewards=rewards)
        self._steps_since_rollout = 0
        return self._cache, True
