"""The training strategies: fused losses against the seed's own math, training, rollouts, errors."""

import copy
import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels.strategies import (
    BaseFactory,
    BaseStrategy,
    DPOStrategy,
    Executor,
    GRPOStrategy,
    RolloutResult,
    RolloutRunner,
    SEQStrategy,
    SFTStrategy,
    StrategyFactory,
    broadcast_state_dict,
    left_align,
    make_doc_boundary_mask,
)
from astrai_kernels.testing import assert_close
from astrai_kernels.testing.tiny_lm import TinyCausalLM, ToyRolloutRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


# Every fused backend this machine can run, decided at collection time (no silent skips).
BACKENDS = [name for name in ak.available_backends("cpu") if name != "reference"]
VOCAB = 67


def make_model(seed=0, n_experts=0, vocab=VOCAB):
    return TinyCausalLM(vocab_size=vocab, d_model=16, n_layers=2, n_heads=2, max_seq_len=64,
                        n_experts=n_experts, seed=seed)


def perturbed(model, scale, seed):
    """A copy of ``model`` with every parameter moved by ``scale * N(0, 1)``: an old policy whose
    ratios to the policy straddle the clip range."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return other


# ------------------------------------------------------------------ batches (token 0 is real)


def seq_batch(seed=1, batch=3, length=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    ids[:, 2] = 0
    target = ids.roll(-1, dims=1)
    target[:, -1] = -100
    return {"input_ids": ids, "target_ids": target}


def sft_batch(seed=2, mask_dtype=torch.bool):
    out = seq_batch(seed)
    gen = torch.Generator().manual_seed(seed)
    out["loss_mask"] = (torch.rand(out["input_ids"].shape, generator=gen) > 0.3).to(mask_dtype)
    # Two packed documents per row (positions restart), the second of different lengths.
    out["position_ids"] = torch.tensor([list(range(5)) + list(range(7)),
                                        list(range(8)) + list(range(4)),
                                        list(range(12))])
    return out


def dpo_batch(seed=3, attention=False):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randint(0, VOCAB, (3, 12), generator=gen)
    rejected = torch.randint(0, VOCAB, (3, 10), generator=gen)
    chosen[:, 1] = 0
    rejected[:, 6] = 0
    chosen_mask = torch.zeros(3, 12)
    chosen_mask[:, 5:] = 1
    chosen_mask[2, 10:] = 0  # right padding
    rejected_mask = torch.zeros(3, 10)
    rejected_mask[:, 5:] = 1
    out = {"chosen": chosen, "rejected": rejected, "chosen_mask": chosen_mask,
           "rejected_mask": rejected_mask}
    if attention:  # left padding on some rows
        out["chosen_attention_mask"] = torch.ones(3, 12, dtype=torch.bool)
        out["chosen_attention_mask"][0, :2] = False
        out["rejected_attention_mask"] = torch.ones(3, 10, dtype=torch.bool)
        out["rejected_attention_mask"][1, :3] = False
    return out


def grpo_batch(seed=4, batch=3, group=4, prompt_len=5, response_len=6):
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (batch, prompt_len), generator=gen)
    prompts[:, -2] = 0
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)
    prompt_mask[0, :2] = False  # left padded
    prompt_mask[1, -1] = False  # right padded
    responses = torch.randint(0, VOCAB, (batch, group, response_len), generator=gen)
    responses[..., 1] = 0
    masks = torch.ones(batch, group, response_len)
    lengths = torch.randint(2, response_len + 1, (batch, group), generator=gen)
    masks *= (torch.arange(response_len) < lengths[..., None]).float()
    rewards = torch.rand(batch, group, generator=gen)
    rewards[2] = 0.5  # a group whose rewards all tie: zero advantages
    rewards[1, 1] = rewards[1, 2]
    return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
            "masks": masks, "rewards": rewards}


# ------------------------------------------------------------------ parity with the seed's math

PARITY_CASES = {
    "seq": dict(batch=seq_batch, kwargs=dict(label_smoothing=0.1)),
    "sft": dict(batch=sft_batch, kwargs=dict()),
    "sft_int_mask": dict(strategy="sft", batch=lambda: sft_batch(mask_dtype=torch.long)),
    "dpo": dict(batch=dpo_batch, kwargs=dict(beta=0.3)),
    "dpo_mean_padded": dict(strategy="dpo", batch=lambda: dpo_batch(attention=True),
                            kwargs=dict(beta=0.5, reduction="mean")),
    "dpo_no_ref": dict(strategy="dpo", batch=dpo_batch, kwargs=dict(beta=0.2), no_ref=True),
    "grpo": dict(batch=grpo_batch, kwargs=dict(clip_eps=0.2, kl_coef=0.3)),
    "grpo_on_policy_no_kl": dict(strategy="grpo", batch=grpo_batch,
                                 kwargs=dict(kl_coef=0.0), on_policy=True),
}


def build(name, backend, n_experts=0, **case):
    strategy = case.get("strategy", name)
    model = make_model(0, n_experts)
    kwargs = dict(case.get("kwargs", {}))
    if strategy == "dpo":
        kwargs["ref_model"] = None if case.get("no_ref") else perturbed(model, 0.05, 11)
    if strategy == "grpo":
        kwargs["old_model"] = None if case.get("on_policy") else perturbed(model, 0.02, 12)
        kwargs["ref_model"] = perturbed(model, 0.05, 13)
    return model, StrategyFactory.create(strategy, model, "cpu", loss_backend=backend, **kwargs)


def param_grad_terms(grad):
    """A parameter's gradient sums the logits' gradient entries (checked per element against
    float64 in the op tests) over tokens through the model, and is compared here with another
    float32 path: an entry's terms are at least the tensor's RMS, and 4x for the two paths."""
    grad = grad.detach().double()
    return 4 * grad.abs().clamp(min=float(grad.pow(2).mean().sqrt()))


def loss_metrics_grads(name, backend, n_experts=0):
    case = PARITY_CASES[name]
    model, strategy = build(name, backend, n_experts, **case)
    out = strategy(case["batch"]())
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads


# Every case on every backend with a dense model; with a MoE model (the aux loss path, which
# no kernel touches) each strategy once, on the default backend.
PARITY_PARAMS = [pytest.param(name, 0, backend, id=f"{name}-{backend}")
                 for name in PARITY_CASES for backend in BACKENDS]
PARITY_PARAMS += [pytest.param(name, 2, "auto", id=f"{name}-moe-auto")
                  for name in ("seq", "sft", "dpo", "grpo")]


@pytest.mark.parametrize("name, n_experts, backend", PARITY_PARAMS)
def test_fused_matches_seed_math(name, n_experts, backend):
    fused, fused_grads = loss_metrics_grads(name, backend, n_experts)
    seed, seed_grads = loss_metrics_grads(name, "reference", n_experts)
    assert_close(fused["loss"], seed["loss"], what=f"{name} loss")
    assert set(fused["metrics"]) >= set(seed["metrics"]), set(seed["metrics"]) - set(
        fused["metrics"])
    for key, value in seed["metrics"].items():
        assert fused["metrics"][key].dtype == torch.float32, key
        assert_close(fused["metrics"][key], value, what=f"{name} metric {key}")
    assert ("moe_aux_loss" in seed["metrics"]) == bool(n_experts)
    for param, grad in seed_grads.items():
        assert float(grad.abs().max()) > 0 or "pos" in param, f"{param}: no gradient"
        assert_close(fused_grads[param], grad, kind="grad", what=f"{name} grad of {param}",
                     scale=param_grad_terms(grad))


def test_parity_cases_are_not_trivial():
    """The GRPO parity batch exercises clipping on both sides, the KL and tied groups."""
    out, _ = loss_metrics_grads("grpo", "reference")
    metrics = out["metrics"]
    assert 0.0 < float(metrics["clip_ratio/low"]) < 0.5
    assert 0.0 < float(metrics["clip_ratio/high"]) < 0.5
    assert float(metrics["kl"]) > 1e-3
    dpo, _ = loss_metrics_grads("dpo", "reference")
    assert abs(float(dpo["metrics"]["rewards/margin"])) > 1e-3
    assert abs(float(dpo["metrics"]["rewards/chosen"])) > 1e-4


def test_seed_kl_math_is_k3():
    """``kl_loss`` is ``kl_coef`` times the masked mean of ``exp(d) - d - 1``, d = ref - logp."""
    model = make_model()
    ref = perturbed(model, 0.05, 13)
    batch = grpo_batch()
    strategy = GRPOStrategy(model, "cpu", old_model=None, ref_model=ref, kl_coef=0.5,
                            loss_backend="reference")
    metrics = strategy(batch)["metrics"]
    # Direct computation from two forwards of the same inputs the strategy builds.
    lp = {}
    prompts, prompt_mask = left_align(batch["prompts"], batch["prompt_mask"])
    group = batch["responses"].shape[1]
    seqs = torch.cat([prompts.repeat_interleave(group, 0), batch["responses"].flatten(0, 1)], 1)
    key = torch.cat([prompt_mask.repeat_interleave(group, 0),
                     batch["masks"].flatten(0, 1).bool()], 1)[:, :-1]
    from astrai_kernels.strategies.masks import model_inputs

    input_mask, position_ids = model_inputs(key, seqs[:, :-1])
    for tag, m in (("pi", model), ("ref", ref)):
        logits = m(seqs[:, :-1], input_mask=input_mask, position_ids=position_ids)["logits"]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, seqs[:, 1:, None])[..., 0]
        lp[tag] = logp[:, prompts.shape[1] - 1:]
    mask = batch["masks"].flatten(0, 1).double()
    d = lp["ref"] - lp["pi"]
    k3 = ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()
    torch.testing.assert_close(metrics["kl"].double(), k3, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics["kl_loss"].double(), 0.5 * k3, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_matches(backend):
    _, grads = loss_metrics_grads("seq", backend)
    model = make_model()
    strategy = SEQStrategy(model, "cpu", label_smoothing=0.1, inplace_backward=True,
                           loss_backend=backend)
    strategy(seq_batch())["loss"].backward()
    for name, param in model.named_parameters():
        assert_close(param.grad, grads[name], kind="grad", what=name,
                     scale=param_grad_terms(grads[name]))


# ------------------------------------------------------------------ fixes to the seed


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_grpo_padding_side_and_pad_values_do_not_matter(backend):
    """The same prompts padded on the left, on the right, or with other pad token ids give the
    same loss and gradients: only ``prompt_mask`` says what padding is."""
    base = grpo_batch()
    real = [row[m] for row, m in zip(base["prompts"], base["prompt_mask"])]
    width = base["prompts"].shape[1]

    def padded(side, pad_id):
        prompts = torch.full((len(real), width), pad_id)
        mask = torch.zeros(len(real), width, dtype=torch.bool)
        for i, row in enumerate(real):
            sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
            prompts[i, sl], mask[i, sl] = row, True
        return {**base, "prompts": prompts, "prompt_mask": mask}

    results = []
    for side, pad_id in (("left", 0), ("right", 0), ("right", 9)):
        model = make_model()
        strategy = GRPOStrategy(model, "cpu", old_model=perturbed(model, 0.02, 12),
                                ref_model=perturbed(model, 0.05, 13), kl_coef=0.3,
                                loss_backend=backend)
        loss = strategy(padded(side, pad_id))["loss"]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for grad, expected in zip(grads, results[0][1]):
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_grpo_without_prompt_mask_treats_token_zero_as_real():
    batch = grpo_batch()
    del batch["prompt_mask"]
    model = make_model()
    strategy = GRPOStrategy(model, "cpu", old_model=perturbed(model, 0.02, 12), ref_model=None,
                            kl_coef=0.0)
    with_default = float(strategy(batch)["loss"].detach())
    explicit = strategy({**batch, "prompt_mask": torch.ones_like(batch["prompts"]).bool()})
    assert with_default == float(explicit["loss"].detach())
    seed_guess = strategy({**batch, "prompt_mask": batch["prompts"] != 0})["loss"]
    assert float(seed_guess.detach()) != with_default  # the seed's guess changes the answer


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_dpo_attends_to_token_zero(backend):
    """DPO's policy log-probs are those of a plain causal forward over every token, 0 included
    (the seed hid token 0 from attention)."""
    batch = dpo_batch()
    model = make_model()
    strategy = DPOStrategy(model, "cpu", ref_model=None, beta=0.4, loss_backend=backend)
    loss = strategy(batch)["loss"]

    def seq_logp(ids, mask):
        logits = model(ids[:, :-1])["logits"]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        return (logp * mask[:, 1:]).sum(-1)

    margin = (seq_logp(batch["chosen"], batch["chosen_mask"])
              - seq_logp(batch["rejected"], batch["rejected_mask"]))
    expected = -F.logsigmoid(0.4 * margin).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_dpo_left_padding_matches_unpadded(backend):
    """Left padding declared by ``*_attention_mask`` changes nothing (positions and attention
    skip the pads)."""
    batch = dpo_batch()
    model = make_model()
    strategy = DPOStrategy(model, "cpu", ref_model=perturbed(model, 0.05, 11),
                           loss_backend=backend)
    plain = strategy(batch)["loss"]
    pad = 3
    padded = {}
    for side in ("chosen", "rejected"):
        ids = batch[side]
        padded[side] = torch.cat([torch.full((3, pad), 5), ids], 1)
        padded[f"{side}_mask"] = torch.cat([torch.zeros(3, pad), batch[f"{side}_mask"]], 1)
        padded[f"{side}_attention_mask"] = torch.cat(
            [torch.zeros(3, pad, dtype=torch.bool), torch.ones_like(ids, dtype=torch.bool)], 1)
    torch.testing.assert_close(strategy(padded)["loss"], plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name", ["seq", "sft"])
def test_all_ignored_batch_gives_zero_not_nan(name, backend):
    model = make_model()
    batch = sft_batch()
    batch["target_ids"] = torch.full_like(batch["target_ids"], -100)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    strategy = StrategyFactory.create(name, model, "cpu", loss_backend=backend)
    loss = strategy(batch)["loss"]
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters())


def test_sft_integer_and_float_masks_equal_bool_mask():
    losses = []
    for dtype in (torch.bool, torch.long, torch.float32):
        strategy = SFTStrategy(make_model(), "cpu")
        losses.append(float(strategy(sft_batch(mask_dtype=dtype))["loss"].detach()))
    assert losses[0] == losses[1] == losses[2]


def test_make_doc_boundary_mask():
    mask = make_doc_boundary_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    docs = [0, 0, 0, 1, 1, 2]
    expected = torch.tensor([[k <= q and docs[k] == docs[q] for k in range(6)] for q in range(6)])
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)


def test_sft_packed_documents_are_independent():
    """With packing, each document's loss is that of the document alone."""
    model = make_model()
    strategy = SFTStrategy(model, "cpu")
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, VOCAB, (5,), generator=gen)
    b = torch.randint(0, VOCAB, (7,), generator=gen)

    def batch(ids, positions):
        target = ids.roll(-1)
        mask = torch.ones_like(ids, dtype=torch.bool)
        return {"input_ids": ids[None], "target_ids": target[None], "loss_mask": mask[None],
                "position_ids": positions[None]}

    packed = batch(torch.cat([a, b]), torch.cat([torch.arange(5), torch.arange(7)]))
    packed["loss_mask"][0, 4] = False  # the cross-document target
    packed["loss_mask"][0, 11] = False
    alone_a, alone_b = batch(a, torch.arange(5)), batch(b, torch.arange(7))
    alone_a["loss_mask"][0, -1] = False
    alone_b["loss_mask"][0, -1] = False
    total = float(strategy(packed)["metrics"]["loss"]) * 10
    parts = (float(strategy(alone_a)["metrics"]["loss"]) * 4
             + float(strategy(alone_b)["metrics"]["loss"]) * 6)
    assert abs(total - parts) < 1e-4


def test_moe_aux_loss_is_added_with_its_coefficient():
    model = make_model(n_experts=2)
    strategy = SEQStrategy(model, "cpu", moe_aux_loss_coef=0.25)
    out = strategy(seq_batch())
    metrics = out["metrics"]
    aux = model(seq_batch()["input_ids"])["aux_loss"]
    torch.testing.assert_close(metrics["moe_aux_loss"], aux.detach())
    torch.testing.assert_close(metrics["moe_aux_loss_weighted"], 0.25 * aux.detach())
    torch.testing.assert_close(out["loss"], metrics["task_loss"] + 0.25 * aux)
    assert all(not value.requires_grad for value in metrics.values())


# ------------------------------------------------------------------ training


def test_sft_training_lowers_the_loss():
    """Learn ``next = (token + 1) mod V`` on the response half of each sequence."""
    torch.manual_seed(0)
    model = make_model(vocab=32)
    strategy = SFTStrategy(model, "cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        start = torch.randint(0, 32, (8, 1), generator=gen)
        ids = (start + torch.arange(16)) % 32
        ids[:, :4] = torch.randint(0, 32, (8, 4), generator=gen)  # a random "prompt"
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, 4:-1] = True
        batch = {"input_ids": ids, "target_ids": ids.roll(-1, 1), "loss_mask": mask,
                 "position_ids": torch.arange(16).expand(8, 16)}
        loss = strategy(batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.25 * losses[0], losses


def _count_token_reward(target_token):
    def reward(prompts, responses, response_mask):
        hits = ((responses == target_token) & response_mask.bool()).float().sum(-1)
        return hits / response_mask.float().sum(-1).clamp(min=1.0)

    return reward


@pytest.mark.parametrize("name", ["online_grpo"])
def test_online_grpo_raises_the_reward(name):
    torch.manual_seed(0)
    vocab, target_token = 16, 5
    model = make_model(vocab=vocab)
    runner = ToyRolloutRunner(model, _count_token_reward(target_token), group_size=8,
                              max_new_tokens=4, rollout_interval=1, seed=0)
    assert isinstance(runner, RolloutRunner)
    strategy = StrategyFactory.create(name, model, "cpu", old_model=copy.deepcopy(model),
                                      ref_model=copy.deepcopy(model), kl_coef=0.01)
    strategy.set_rollout_runner(runner)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (4, 3), generator=gen)
    rewards = []
    for _ in range(15):
        out = strategy({"prompts": prompts})
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        strategy.on_optimizer_step()
        rewards.append(float(out["metrics"]["reward/mean"]))
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.4, rewards


def test_online_rollout_cache_and_old_policy_sync():
    model = make_model(vocab=16)
    old = perturbed(model, 0.1, 3)
    runner = ToyRolloutRunner(model, _count_token_reward(5), group_size=2, max_new_tokens=3,
                              rollout_interval=2)
    strategy = GRPOStrategy(model, "cpu", old_model=old, ref_model=None, kl_coef=0.0)
    strategy.set_rollout_runner(runner)
    batch = {"prompts": torch.randint(0, 16, (2, 3))}
    first = strategy(batch)
    # A fresh rollout synced the old policy: ratio 1 everywhere.
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), model.parameters()))
    assert float(first["metrics"]["ratio/mean"]) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    strategy.on_optimizer_step()
    second = strategy(batch)  # cached rollout (interval 2): no sync, the ratio moves
    assert float(second["metrics"]["ratio/mean"]) != pytest.approx(1.0, abs=1e-6)
    assert not torch.equal(old.lm_head.weight, model.lm_head.weight)
    strategy.on_optimizer_step()
    strategy(batch)  # fresh again
    assert torch.equal(old.lm_head.weight, model.lm_head.weight)


def test_online_dpo_uses_prompt_and_best_worst_responses():
    prompts = torch.tensor([[0, 0, 7, 8], [3, 4, 5, 0]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    responses = torch.arange(2 * 3 * 2).view(2, 3, 2)
    response_mask = torch.ones(2, 3, 2, dtype=torch.bool)
    response_mask[1, 0, 1] = False
    rewards = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]])
    result = RolloutResult(prompts=prompts, responses=responses, response_mask=response_mask,
                           rewards=rewards, prompt_mask=prompt_mask)
    strategy = StrategyFactory.create("online_dpo", make_model(), "cpu", ref_model=None)
    batch = strategy.prepare_from_rollout(result)
    assert batch["chosen"].tolist() == [[0, 0, 7, 8, 2, 3], [0, 3, 4, 5, 6, 7]]
    assert batch["rejected"].tolist() == [[0, 0, 7, 8, 0, 1], [0, 3, 4, 5, 8, 9]]
    assert batch["chosen_mask"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0]]
    assert batch["chosen_attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    out = strategy.compute_loss_output(batch)
    assert torch.isfinite(out["loss"])


# ------------------------------------------------------------------ old policy sync, broadcast


def test_sync_old_model_without_executor():
    model, old = make_model(0), make_model(1)
    strategy = GRPOStrategy(model, "cpu", old_model=old, ref_model=None, kl_coef=0.0)
    assert strategy.executor is None
    strategy.sync_old_model()
    for (name, a), b in zip(model.state_dict().items(), old.state_dict().values()):
        assert torch.equal(a, b), name
    assert old.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_sync_old_model_with_executor_and_compiled_wrapper_prefixes():
    model, old = make_model(0), make_model(1)

    class Wrapped(torch.nn.Module):  # stands for torch.compile's OptimizedModule
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, *args, **kwargs):
            return self._orig_mod(*args, **kwargs)

    strategy = GRPOStrategy(Wrapped(model), "cpu", old_model=old, ref_model=None, kl_coef=0.0,
                            executor=Executor())
    strategy.sync_old_model()
    assert torch.equal(old.lm_head.weight, model.lm_head.weight)


def test_broadcast_state_dict_single_process_is_identity():
    state = {"w": torch.ones(2)}
    assert broadcast_state_dict(state) is state


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broadcast_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        if rank == 0:
            state = {"w": torch.arange(6.0).view(2, 3).t(),  # non-contiguous
                     "b": torch.full((4,), 3, dtype=torch.bfloat16),
                     "step": torch.tensor(7), "_extra_state": {"note": "hi"}}
        else:
            state = {"w": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.bfloat16),
                     "step": torch.tensor(0), "_extra_state": None}
        received = broadcast_state_dict(state)
        untouched = bool(rank == 0 or (not state["w"].any() and int(state["step"]) == 0))
        received_from_none = broadcast_state_dict(state if rank == 0 else None)
        # End to end: each rank's policy differs; after sync_old_model every rank's old policy
        # holds rank 0's weights, and no rank's policy changed.
        model, old = make_model(seed=rank), make_model(seed=10 + rank)
        before = copy.deepcopy(model.state_dict())
        strategy = GRPOStrategy(model, "cpu", old_model=old, ref_model=None, kl_coef=0.0)
        strategy.sync_old_model()
        policy_kept = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        torch.save({"received": received, "from_none": received_from_none,
                    "untouched": untouched, "old": old.state_dict(),
                    "policy_kept": policy_kept}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_broadcast_state_dict_two_gloo_processes():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_broadcast_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                   for r in range(2)]
    expected_w = torch.arange(6.0).view(2, 3).t()
    for res in results:
        for received in (res["received"], res["from_none"]):
            assert torch.equal(received["w"], expected_w)
            assert received["b"].dtype == torch.bfloat16 and torch.equal(
                received["b"], torch.full((4,), 3, dtype=torch.bfloat16))
            assert int(received["step"]) == 7
            assert received["_extra_state"] == {"note": "hi"}
        assert res["untouched"] and res["policy_kept"]
    rank0_policy = make_model(seed=0).state_dict()
    for res in results:
        for key, value in rank0_policy.items():
            assert torch.equal(res["old"][key], value), key


# ------------------------------------------------------------------ factory


def test_factory_registers_the_seed_strategies_and_aliases():
    assert {"seq", "sft", "dpo", "grpo", "online_dpo", "online_grpo"} <= set(
        StrategyFactory.list_registered())
    assert StrategyFactory.get_component_class("online_grpo") is GRPOStrategy
    assert StrategyFactory.get_component_class("online_dpo") is DPOStrategy
    strategy = StrategyFactory.create("sft", make_model(), "cpu", label_smoothing=0.1,
                                      loss_backend="reference", something_else=3)
    assert isinstance(strategy, SFTStrategy) and strategy.label_smoothing == 0.1
    assert strategy.extra_kwargs == {"something_else": 3}


def test_factory_custom_registration_and_errors():
    class MyFactory(BaseFactory["BaseStrategy"]):
        pass

    @StrategyFactory.register("test_custom_strategy")
    class Custom(BaseStrategy):
        def __init__(self, model, device, scale=1.0):  # no **kwargs: extra keywords dropped
            super().__init__(model, device)
            self.scale = scale

        def compute_loss(self, batch):
            return batch["x"].sum() * self.scale

    try:
        made = StrategyFactory.create("test_custom_strategy", None, "cpu", scale=2.0, junk=1)
        assert made.scale == 2.0
        out = made({"x": torch.ones(3)})
        assert float(out["loss"]) == 6.0 and float(out["metrics"]["loss"]) == 6.0
        with pytest.raises(ValueError, match="already registered"):
            StrategyFactory.register("test_custom_strategy")(Custom)
        with pytest.raises(TypeError, match="subclass of BaseStrategy"):
            StrategyFactory.register("not_a_strategy")(int)
        with pytest.raises(ValueError, match="unknown name 'nope'"):
            StrategyFactory.create("nope", None, "cpu")
        assert MyFactory.list_registered() == []  # each factory has its own registry
    finally:
        StrategyFactory._entries.pop("test_custom_strategy", None)


# ------------------------------------------------------------------ bad input


def _without(batch, key):
    return {k: v for k, v in batch.items() if k != key}


BAD_BATCHES = {
    "seq_missing_target": ("seq", lambda: _without(seq_batch(), "target_ids"),
                           ValueError, "missing key.*target_ids"),
    "seq_shape": ("seq", lambda: {**seq_batch(), "target_ids": seq_batch()["target_ids"][:, :5]},
                  ValueError, "target_ids has shape"),
    "seq_float_ids": ("seq", lambda: {**seq_batch(), "input_ids": torch.zeros(3, 12)},
                      TypeError, "input_ids must be integer"),
    "sft_missing_mask": ("sft", lambda: _without(sft_batch(), "loss_mask"),
                         ValueError, "missing key.*loss_mask"),
    "sft_mask_shape": ("sft", lambda: {**sft_batch(), "loss_mask": torch.ones(3, 11).bool()},
                       ValueError, "loss_mask has shape"),
    "sft_not_a_dict": ("sft", lambda: [1, 2], TypeError, "must be a dict"),
    "dpo_missing": ("dpo", lambda: _without(dpo_batch(), "rejected_mask"),
                    ValueError, "missing key.*rejected_mask"),
    "dpo_mask_shape": ("dpo", lambda: {**dpo_batch(), "chosen_mask": torch.ones(3, 10)},
                       ValueError, "chosen_mask has shape"),
    "dpo_pairs": ("dpo", lambda: {**dpo_batch(), "rejected": dpo_batch()["rejected"][:2],
                                  "rejected_mask": dpo_batch()["rejected_mask"][:2]},
                  ValueError, "pairs"),
    "grpo_missing": ("grpo", lambda: _without(grpo_batch(), "rewards"),
                     ValueError, "missing key.*rewards"),
    "grpo_rewards_shape": ("grpo", lambda: {**grpo_batch(), "rewards": torch.rand(3)},
                           ValueError, r"rewards must be \[B, G\]"),
    "grpo_masks_shape": ("grpo", lambda: {**grpo_batch(), "masks": torch.ones(3, 4, 5)},
                         ValueError, "masks has shape"),
    "grpo_prompt_mask_shape": ("grpo", lambda: {**grpo_batch(),
                                                "prompt_mask": torch.ones(3, 4).bool()},
                               ValueError, "prompt_mask has shape"),
    "grpo_responses_2d": ("grpo", lambda: {**grpo_batch(),
                                           "responses": grpo_batch()["responses"][:, 0]},
                          ValueError, "responses must have 3 dimensions"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batches_give_clear_errors(case):
    name, make, error, message = BAD_BATCHES[case]
    model = make_model()
    kwargs = {"dpo": dict(ref_model=None), "grpo": dict(old_model=None, ref_model=None,
                                                       kl_coef=0.0)}.get(name, {})
    strategy = StrategyFactory.create(name, model, "cpu", **kwargs)
    with pytest.raises(error, match=message):
        strategy(make())


def test_bad_configuration_gives_clear_errors():
    model = make_model()
    with pytest.raises(ValueError, match="loss_backend must be one of"):
        SEQStrategy(model, "cpu", loss_backend="fast")
    with pytest.raises(ValueError, match="needs a ref_model"):
        GRPOStrategy(model, "cpu", old_model=None, ref_model=None)
    with pytest.raises(ValueError, match="reduction must be one of"):
        DPOStrategy(model, "cpu", ref_model=None, reduction="none")
    with pytest.raises(ValueError, match="needs a fused loss_backend"):
        GRPOStrategy(model, "cpu", old_model=None, ref_model=None, kl_coef=0.0,
                     loss_type="dapo", loss_backend="reference")
    with pytest.raises(ValueError, match="does not support online"):
        SEQStrategy(model, "cpu").set_rollout_runner(object())

    def no_logits(input_ids, **_):
        return {"scores": input_ids}

    with pytest.raises(TypeError, match="must return a dict with 'logits'"):
        SEQStrategy(no_logits, "cpu")(seq_batch())


# ------------------------------------------------------------------ the seed's helpers, options


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_get_logprobs_fused_matches_seed(reduction):
    from astrai_kernels.strategies import get_logprobs

    batch = dpo_batch(attention=True)
    ids, loss_mask = batch["chosen"], batch["chosen_mask"]
    from astrai_kernels.strategies.masks import model_inputs

    attn, positions = model_inputs(batch["chosen_attention_mask"], ids)
    results = []
    for backend in ["reference"] + BACKENDS:
        model = make_model()
        out = get_logprobs(model, ids, attn, loss_mask, reduction, position_ids=positions,
                           loss_backend=backend)
        out["logprobs"].sum().backward()
        results.append((out["logprobs"].detach(), model.lm_head.weight.grad))
    for logprobs, grad in results[1:]:
        assert_close(logprobs, results[0][0], what=f"get_logprobs {reduction}")
        assert_close(grad, results[0][1], kind="grad", what="lm_head grad",
                     scale=param_grad_terms(results[0][1]))
    with pytest.raises(ValueError, match="reduction must be one of"):
        get_logprobs(make_model(), ids, attn, loss_mask, "max")


@pytest.mark.parametrize("options", [
    dict(loss_type="grpo"), dict(loss_type="dr_grpo", max_completion_length=8),
    dict(loss_type="dapo", clip_eps_high=0.28), dict(importance_sampling="sequence"),
    dict(temperature=0.7), dict(advantage_scale="batch", delta=2.0)],
    ids=["grpo", "dr_grpo", "dapo_clip_higher", "gspo", "temperature", "batch_scale_delta"])
def test_grpo_fused_only_options_pass_through(options):
    model = make_model()
    strategy = GRPOStrategy(model, "cpu", old_model=perturbed(model, 0.02, 12),
                            ref_model=perturbed(model, 0.05, 13), kl_coef=0.1, **options)
    out = strategy(grpo_batch())
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    default = GRPOStrategy(model, "cpu", old_model=perturbed(model, 0.02, 12),
                           ref_model=perturbed(model, 0.05, 13), kl_coef=0.1)
    assert float(out["loss"].detach()) != float(default(grpo_batch())["loss"].detach())


def test_benchmark_runs():
    from astrai_kernels.bench import strategy_steps as bench

    for name in ("seq", "sft", "dpo", "grpo"):
        result = bench.run_case(name, "fused", vocab=256, d_model=16, repeats=1, threads=0)
        assert result["seconds"] > 0 and result["peak_bytes"] >= 0
    (row,) = bench.run_strategy_steps(vocab=256, strategies=("seq",), methods=("reference",),
                                      d_model=16, repeats=1)
    assert set(row) >= {"strategy", "method", "seconds", "peak_bytes"}
    assert row["method"] == "reference" and row["strategy"] == "seq"
    assert "seq" in bench.format_table([row])
