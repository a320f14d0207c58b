"""The strategies on the fused LM head: models that expose their final hidden states and output
embedding (TinyCausalLM, transformers causal LMs) never form logits; logits-only models keep the
logits path. Parity with the seed's math (``loss_backend="reference"``) as in
tests/test_strategies.py, whose batches and cases these reuse."""

import copy

import pytest
import torch
import torch.nn as nn
from test_strategies import (
    PARITY_CASES,
    build,
    dpo_batch,
    grpo_batch,
    make_model,
    param_grad_terms,
    perturbed,
    sft_batch,
)

from astrai_kernels.strategies import GRPOStrategy, SFTStrategy, StrategyFactory
from astrai_kernels.testing import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = ("seq", "sft", "dpo", "dpo_mean_padded", "grpo", "grpo_on_policy_no_kl")


def forbid_logits(*models):
    """Make every model's LM head raise when called: the fused path must never form logits."""
    def refuse(*args, **kwargs):
        raise AssertionError("the LM head was called: logits were formed")

    for model in models:
        if model is not None:
            model.get_output_embeddings().forward = refuse


def run(name, backend, fused_head, no_logits=False):
    case = PARITY_CASES[name]
    model, strategy = build(name, backend, **case)
    strategy.fused_head = fused_head
    if no_logits:
        forbid_logits(model, getattr(strategy, "ref_model", None),
                      getattr(strategy, "old_model", None))
    out = strategy(case["batch"]())
    out["loss"].backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(actual, actual_grads, expected, expected_grads, what):
    assert_close(actual["loss"], expected["loss"], what=f"{what} loss")
    for key, value in expected["metrics"].items():
        assert_close(actual["metrics"][key], value, what=f"{what} metric {key}")
    for param, grad in expected_grads.items():
        assert float(grad.abs().max()) > 0 or "pos" in param, f"{param}: no gradient"
        assert_close(actual_grads[param], grad, kind="grad", what=f"{what} grad of {param}",
                     scale=param_grad_terms(grad))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", CASES)
def test_fused_head_never_forms_logits_and_matches_seed_math(name, backend):
    fused, fused_grads = run(name, backend, fused_head=True, no_logits=True)
    seed, seed_grads = run(name, "reference", fused_head=None)
    assert_same(fused, fused_grads, seed, seed_grads, f"{name} fused head ({backend})")


@pytest.mark.parametrize("name", ["seq", "dpo", "grpo"])
def test_fused_head_false_keeps_the_logits_path(name):
    case = PARITY_CASES[name]
    model, strategy = build(name, "auto", **case)
    strategy.fused_head = False
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
    out = strategy(case["batch"]())
    assert calls, "the logits path did not call the LM head"
    head_out, _ = run(name, "auto", fused_head=None, no_logits=True)
    assert_close(out["loss"], head_out["loss"], what=f"{name} logits path vs fused head")


class LogitsOnly(nn.Module):
    """A model that returns only logits (no hidden states, no output embedding)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, input_mask=None, position_ids=None):
        return {"logits": self.inner(input_ids, input_mask, position_ids)["logits"]}


def test_logits_only_models_keep_todays_path():
    model = make_model()
    wrapped = LogitsOnly(model)
    batch = sft_batch()
    out = SFTStrategy(wrapped, "cpu")(batch)
    expected = SFTStrategy(model, "cpu", fused_head=False)(batch)
    assert_close(out["loss"], expected["loss"], what="logits-only model")
    with pytest.raises(ValueError, match="fused_head=True needs a model"):
        SFTStrategy(wrapped, "cpu", fused_head=True)(batch)
    with pytest.raises(ValueError, match="fused_head must be"):
        SFTStrategy(model, "cpu", fused_head="yes")
    # A GRPO policy with a fused head next to logits-only old and reference models.
    old, ref = perturbed(model, 0.02, 12), perturbed(model, 0.05, 13)
    mixed = GRPOStrategy(model, "cpu", old_model=LogitsOnly(old), ref_model=LogitsOnly(ref),
                         kl_coef=0.3)
    forbid_logits(model)
    seed = GRPOStrategy(copy.deepcopy(make_model()), "cpu", old_model=old, ref_model=ref,
                        kl_coef=0.3, loss_backend="reference")
    assert_close(mixed(grpo_batch())["loss"], seed(grpo_batch())["loss"], what="mixed GRPO")


# ------------------------------------------------------------------ a transformers model


class HFLogitsOnly(nn.Module):
    """A transformers causal LM called the strategies' way on its logits (the seed's path):
    the strategies' boolean 4-D mask as transformers' additive float mask."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, input_mask=None, position_ids=None):
        from astrai_kernels.strategies.head import _additive_mask

        mask = None if input_mask is None else _additive_mask(input_mask, torch.float32)
        return {"logits": self.inner(input_ids=input_ids, attention_mask=mask,
                                     position_ids=position_ids).logits}


def tiny_llama(seed):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().train()


@pytest.mark.parametrize("name, arch", [("sft", "llama"), ("dpo", "llama"), ("grpo", "llama"),
                                        ("sft", "gemma2"), ("dpo", "gemma2"),
                                        ("grpo", "gemma2")])
def test_strategies_on_a_transformers_model(name, arch):
    model = {"llama": tiny_llama, "gemma2": tiny_gemma2}[arch]
    policy = model(0)
    others = {"dpo": dict(ref_model=model(1)),
              "grpo": dict(old_model=model(2), ref_model=model(3), kl_coef=0.3),
              "sft": {}}[name]
    batch = {"sft": sft_batch, "dpo": lambda: dpo_batch(attention=True), "grpo": grpo_batch}[name]
    fused = StrategyFactory.create(name, policy, "cpu", fused_head=True, **others)
    forbid_logits(policy, *[m for m in others.values() if isinstance(m, nn.Module)])
    out = fused(batch())
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}

    seed_policy = model(0)
    seed_others = {key: HFLogitsOnly(model({"ref_model": 1 if name == "dpo" else 3,
                                            "old_model": 2}[key]))
                   if isinstance(value, nn.Module) else value for key, value in others.items()}
    seed = StrategyFactory.create(name, HFLogitsOnly(seed_policy), "cpu",
                                  loss_backend="reference", **seed_others)
    expected = seed(batch())
    expected["loss"].backward()
    expected_grads = {n: p.grad.clone() for n, p in seed_policy.named_parameters()}
    assert_same(out, grads, expected, expected_grads, f"transformers {arch} {name}")


def tiny_gemma2(seed):
    """Gemma 2 with a final soft-cap its logits reach (the head's weights scaled up)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(vocab_size=67, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=3.0, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config).float().train()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


def test_transformers_models_it_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="fused head only"):
        SFTStrategy(tiny_llama(0), "cpu", fused_head=False)(sft_batch())
