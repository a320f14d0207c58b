"""``install(trainer, fused_loss=True, score_support="sampler")``: a GRPOTrainer scoring the
policy's and the old policy's completion tokens under its own sampling settings (vLLM's
processed distribution), so that the importance ratio against the sampler's log-probs has no
kept-mass factor.

The sampler is emulated by the float64 spec ``reference.sampled_token_logprobs`` (vLLM's
``processed_logprobs``) on the same model's logits. The loss's oracle is TRL's own
``GRPOTrainer._compute_loss`` with its log-probs taken from that spec (differentiable: the
log-softmax over the spec's kept set) and its entropy from the full tempered softmax, run on
the float64 model (expected) and the float32 one (yardstick).
"""

import types

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")

from test_grpo_sampling import _kept  # noqa: E402
from test_integration_trl import COMMON_ARGS, _case, _model_dir, _tokenizer  # noqa: E402
from test_integration_trl_fused_loss import _like_trl_failures, _trl_importance_ratio  # noqa: E402

import astrai_kernels as ak  # noqa: E402
from astrai_kernels import reference  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.integrations.trl import sampler  # noqa: E402
from astrai_kernels.testing import assert_close  # noqa: E402

#: truncation on: top_k 5 of a 30-token vocabulary, top_p 0.8 of what it keeps
SAMPLER = dict(temperature=0.9, top_k=5, top_p=0.8)
SAMPLING = ak.SamplingParams(**SAMPLER)
PROMPTS = [{"prompt": p} for p in ("count a", "count a", "count b", "count b")]


def _trainer(tmp_path, dtype=torch.float32, **overrides):
    """A tiny GRPOTrainer sampling with transformers' generate (top_k, top_p, temperature on);
    two iterations per generation, so TRL computes the old log-probs at generation."""
    cls, config_cls, config_kwargs, trainer_kwargs = _case("grpo")
    config = {**config_kwargs, **SAMPLER, "num_iterations": 2, "max_completion_length": 8,
              **overrides}
    args = config_cls(output_dir=str(tmp_path), **{**COMMON_ARGS, **config},
                      model_init_kwargs={"dtype": dtype})
    torch.manual_seed(0)
    return cls(model=_model_dir("llama"), args=args, processing_class=_tokenizer(),
               **trainer_kwargs)


def _logits(model, batch):
    """The policy's logits at the completion positions (the model's own forward)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    keep = batch["completion_ids"].shape[1]
    return model(input_ids=ids, attention_mask=attention).logits[:, -keep - 1:-1]


def _generate(trainer):
    torch.manual_seed(1)
    return trainer._generate_and_score_completions(PROMPTS)


def _sampler_logprobs(trainer, batch, dtype=torch.float64):
    """The sampler's processed log-probs of the sampled tokens (the spec, vLLM's
    ``processed_logprobs``), and the kept mass ``S``."""
    with torch.no_grad():
        logits = _logits(trainer.model, batch).to(dtype)
    logp, log_kept_mass, _, in_support = reference.sampled_token_logprobs(
        logits, batch["completion_ids"], **SAMPLER)
    return logp, log_kept_mass.exp(), in_support


def _mean_ratio(batch, sampling_logp):
    """``exp(old - sampling)`` averaged over the completion tokens (TRL's vLLM ratio)."""
    mask = batch["completion_mask"].bool()
    return torch.exp(batch["old_per_token_logps"].double() - sampling_logp)[mask].mean().item()


def test_mean_importance_ratio_is_one_with_score_support(tmp_path):
    """On-policy completions: with score_support the old log-probs TRL computes at generation
    (our head, ``sampling=``) equal the sampler's per element, and the mean ratio is 1 within
    float32 rounding; without it (full softmax) the mean ratio is the kept mass ``S``."""
    ratios = {}
    for score_support in ("sampler", None):
        trainer = _trainer(tmp_path / str(score_support))
        ak_trl.install(trainer, fused_loss=True, score_support=score_support)
        batch = _generate(trainer)
        sampling_logp, kept_mass, in_support = _sampler_logprobs(trainer, batch)
        mask = batch["completion_mask"].bool()
        assert mask.sum() >= 20 and in_support[mask].all()  # drawn from the support
        ratios[score_support] = _mean_ratio(batch, sampling_logp)
        old = batch["old_per_token_logps"]
        if score_support == "sampler":
            naive, _, _ = _sampler_logprobs(trainer, batch, torch.float32)
            assert_close(old[mask], sampling_logp[mask], "value", torch.float32,
                         "old log-probs vs the sampler's", naive=naive[mask])
            assert abs(ratios["sampler"] - 1.0) < 1e-6
        else:
            mean_kept_mass = kept_mass[mask].mean().item()
            assert mean_kept_mass < 0.9  # the truncation is visible
            assert abs(ratios[None] - mean_kept_mass) < 1e-5
    print(f"mean exp(old - sampling): {ratios}")


def test_broken_sampling_map_fails(monkeypatch, tmp_path):
    """A map that drops top_p (top_k and the temperature kept) is seen failing."""
    def broken(trainer):
        return ak.SamplingParams(temperature=trainer.temperature, top_k=trainer.top_k)

    monkeypatch.setattr(sampler, "sampling_params", broken)
    trainer = _trainer(tmp_path)
    ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    batch = _generate(trainer)
    sampling_logp, _, _ = _sampler_logprobs(trainer, batch)
    mask = batch["completion_mask"].bool()
    with pytest.raises(AssertionError):
        assert_close(batch["old_per_token_logps"][mask], sampling_logp[mask], "value",
                     torch.float32)
    assert abs(_mean_ratio(batch, sampling_logp) - 1.0) > 1e-3


def _spec_logps(trainer):
    """``_get_per_token_logps_and_entropies`` on the spec: the log-softmax over the sampler's
    kept set (0 outside it: those tokens are masked in the oracle's inputs) and the full
    tempered entropy, from the model's own logits."""
    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                            batch_size=None, compute_entropy=False, compute_aux_loss=False,
                            **multimodal):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1:-1]
        target = input_ids[:, -logits_to_keep:]
        kept = _kept(logits.detach().double(), SAMPLING)
        scaled = logits / SAMPLING.temperature
        kept_lse = torch.logsumexp(torch.where(kept, scaled, float("-inf")), -1)
        logp = scaled.gather(-1, target.unsqueeze(-1)).squeeze(-1) - kept_lse
        logp = torch.where(kept.gather(-1, target.unsqueeze(-1)).squeeze(-1), logp, 0.0)
        full = torch.log_softmax(scaled, -1)
        entropy = -(full.exp() * full).sum(-1)
        return logp, entropy if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = types.MethodType(logps_and_entropies, trainer)


@pytest.mark.parametrize("vllm", [None, ("token_truncate", None, 3.0),
                                  ("sequence_truncate", 0.5, 2.0), ("sequence_mask", 0.2, 5.0)],
                         ids=["transformers", "vllm-token_truncate", "vllm-sequence_truncate",
                              "vllm-sequence_mask"])
def test_fused_loss_with_score_support_matches_trl_on_the_spec(vllm, tmp_path):
    """One ``_compute_loss`` with score_support against TRL's on the spec's log-probs: loss,
    TRL's metrics and every gradient, off-policy (old log-probs moved so ratios clip), with a
    KL term, a tool mask, one sampled token outside the current support and one outside the
    old one (ours masks both and counts them in ``sampling/out_of_support``; the oracle's
    inputs mask them). vLLM's sequence-level correction reads the mask without them too (the
    oracle's ratio is TRL's on its mask; issue 45 item 1)."""
    config = dict(loss_type="dapo", beta=0.05, epsilon=0.02, gradient_accumulation_steps=2)
    trainers = [_trainer(tmp_path / str(i), dtype, **config)
                for i, dtype in enumerate((torch.float64, torch.float32, torch.float32))]
    expected_trainer, naive_trainer, ours = trainers
    ak_trl.install(ours, fused_loss=True, score_support="sampler", chunk_size=4)
    batch = _generate(ours)
    g = torch.Generator().manual_seed(3)
    mask = batch["completion_mask"]
    assert (mask.sum(1) >= 3).all()
    with torch.no_grad():
        logits = _logits(ours.model, batch).double()
    kept = _kept(logits, SAMPLING)
    # a token outside the current support (row 0's last, so no later token's context moves),
    # an old log-prob -inf (row 1), a tool span (row 2)
    last = int(mask[0].sum()) - 1
    completion_ids = batch["completion_ids"].clone()
    completion_ids[0, last] = int(torch.where(kept[0, last], 1e9, logits[0, last]).argmin())
    old = batch["old_per_token_logps"].double()
    old = old + 0.05 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    old[1, 2] = float("-inf")
    tool_mask = torch.ones_like(mask)
    tool_mask[2, 1:3] = 0
    inputs = {**batch, "completion_ids": completion_ids, "old_per_token_logps": old,
              "tool_mask": tool_mask,
              "advantages": torch.randn(mask.shape[0], generator=g, dtype=torch.float64)}
    masked = {(0, last), (1, 2)}
    oracle_tool_mask = tool_mask.clone()
    for position in masked:
        oracle_tool_mask[position] = 0
    oracle = {**inputs, "tool_mask": oracle_tool_mask,
              "old_per_token_logps": torch.where(torch.isfinite(old), old, 0.0)}
    if vllm is not None:
        sampling_logp, _, _ = _sampler_logprobs(ours, batch)
        gap = 0.1 * torch.randn(old.shape, generator=g, dtype=torch.float64)
        # finite where the oracle masks: vLLM's own sampler drew those tokens
        sampling_logp = torch.where(mask * oracle_tool_mask > 0, sampling_logp - gap, 0.0)
        inputs["sampling_per_token_logps"] = oracle["sampling_per_token_logps"] = sampling_logp
        oracle["importance_sampling_ratio"] = _trl_importance_ratio(
            oracle["old_per_token_logps"], sampling_logp, mask * oracle_tool_mask, *vllm)
    for trainer in trainers:
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm is not None
        if vllm is not None:
            (trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
             trainer.vllm_importance_sampling_clip_max) = vllm
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.train()
    for trainer in (expected_trainer, naive_trainer):
        _spec_logps(trainer)
    # the loss's options (vLLM's correction) are read at install
    ak_trl.uninstall(ours)
    ak_trl.install(ours, fused_loss=True, score_support="sampler", chunk_size=4)

    def run(trainer, batch, dtype):
        batch = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                 for k, v in batch.items()}
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}

    expected = run(expected_trainer, oracle, torch.float64)
    naive = run(naive_trainer, oracle, torch.float32)
    actual = run(ours, inputs, torch.float32)
    assert set(actual[2]) == set(expected[2]) | {"sampling/out_of_support"}
    scored = int((mask * tool_mask).sum())
    assert actual[2]["sampling/out_of_support"] == pytest.approx(len(masked) / scored)
    failed = _like_trl_failures(actual, expected, naive)
    assert not failed, "\n".join(failed[:5])
    # the loss is ak.grpo_loss(sampling=...) on the model's logits, given the old-support mask
    op_mask = mask * tool_mask
    op_mask[1, 2] = 0
    op_loss, op_metrics = ak.grpo_loss(
        _logits(ours.model, batch), completion_ids, inputs["advantages"].float(), mask=op_mask,
        old_logprobs=oracle["old_per_token_logps"].float(),
        ref_logprobs=batch["ref_per_token_logps"].float(),
        normalizer=ak_trl.grpo._normalizer(ours, batch, "train"),
        sampling_logprobs=(inputs["sampling_per_token_logps"].float()
                           if vllm is not None else None),
        options=ak_trl.grpo.grpo_options(ours, 1.0), sampling=SAMPLING)
    torch.testing.assert_close(op_loss.detach(), actual[0], rtol=1e-5, atol=1e-7)
    assert float(op_metrics["mask/out_of_support"]) == pytest.approx(1 / float(op_mask.sum()))


def test_training_steps_with_score_support(tmp_path):
    """Two SGD steps through ``trainer.train()`` (old log-probs at generation, the fused loss
    on the sampler's distribution): every logged value finite, the support share logged."""
    trainer = _trainer(tmp_path, learning_rate=0.05)
    ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert "sampling/out_of_support" in entry and "entropy" in entry
        assert all(torch.isfinite(torch.tensor(float(v))) for v in entry.values()
                   if isinstance(v, (int, float)))
    ak_trl.uninstall(trainer)


def test_sampling_params_map():
    """TRL's off values map to vLLM's: top_k None/0/-1 -> 0, top_p None -> 1, min_p None -> 0."""
    for top_k in (None, 0, -1):
        trainer = types.SimpleNamespace(temperature=0.7, top_k=top_k, top_p=None, min_p=None)
        assert sampler.sampling_params(trainer) == ak.SamplingParams(temperature=0.7)
    trainer = types.SimpleNamespace(temperature=1.3, top_k=7, top_p=0.9, min_p=0.05)
    assert sampler.sampling_params(trainer) == ak.SamplingParams(1.3, 7, 0.9, 0.05)


def test_score_support_refusals(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="score_support must be"):
        ak_trl.install(trainer, fused_loss=True, score_support="vllm")
    with pytest.raises(ak_trl.TRLHeadError, match="needs fused_loss=True"):
        ak_trl.install(trainer, score_support="sampler")
    cases = [  # (attribute owner, name, value, message)
        (trainer, "repetition_penalty", 1.1, "repetition_penalty"),
        (trainer.args, "generation_kwargs", {"top_k": 3}, r"generation_kwargs \['top_k'\]"),
        (trainer, "min_p", 0.05, "min_p with top_p"),
        (trainer, "top_entropy_quantile", 0.5, "top_entropy_quantile"),
        (trainer, "temperature", 1e-6, "greedily"),
        (trainer, "temperature", 0.5, "fused head has temperature"),
        (trainer, "top_k", -2, "top_k -2"),
        (trainer, "top_p", 1.5, "top_p"),
        (trainer, "rollout_func", lambda prompts, trainer: None, "rollout_func"),
        (trainer, "use_transformers_continuous_batching", True, "continuous batching"),
        (trainer.generation_config, "no_repeat_ngram_size", 2, "no_repeat_ngram_size"),
        (trainer.model.generation_config, "suppress_tokens", [3], "suppress_tokens"),
        (trainer.generation_config, "do_sample", False, "do_sample"),
    ]
    for owner, name, value, message in cases:
        before = getattr(owner, name)
        setattr(owner, name, value)
        try:
            with pytest.raises(ak_trl.TRLHeadError, match=message):
                ak_trl.install(trainer, fused_loss=True, score_support="sampler")
        finally:
            setattr(owner, name, before)
    trainer.ref_model = None  # beta 0.05: the reference is the policy with its adapter off
    with pytest.raises(ak_trl.TRLHeadError, match="reference is the policy's own head"):
        ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    trainer.beta = 0.0
    trainer.use_vllm, trainer.args.vllm_structured_outputs_regex = True, "a+"
    with pytest.raises(ak_trl.TRLHeadError, match="structured outputs"):
        ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    trainer.use_vllm = False

    class Sampling(type(trainer)):
        def _generate(self, prompts):
            return super()._generate(prompts)

    trainer.__class__ = Sampling
    with pytest.raises(ak_trl.TRLHeadError, match="overrides _generate"):
        ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    trainer.__class__ = Sampling.__mro__[1]
    assert not ak_trl.is_installed(trainer)
    ak_trl.install(trainer, fused_loss=True, score_support="sampler")
    ak_trl.uninstall(trainer)

    cls, config_cls, config_kwargs, trainer_kwargs = _case("rloo")
    rloo = cls(model=_model_dir("llama"), processing_class=_tokenizer(),
               args=config_cls(output_dir=str(tmp_path / "rloo"), **COMMON_ARGS,
                               **config_kwargs), **trainer_kwargs)
    with pytest.raises(ak_trl.TRLHeadError, match="GRPOTrainer only"):
        ak_trl.install(rloo, fused_loss=True, score_support="sampler")
    assert not ak_trl.is_installed(rloo)
