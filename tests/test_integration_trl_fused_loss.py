"""``install(trainer, fused_loss=True)``: TRL's GRPOTrainer computing its loss with
``ak.linear_grpo_loss``, against TRL's own loss and head.

Trainer cases run two SGD steps as ``tests/test_integration_trl.py`` does (TRL in float64 the
expected values, TRL in float32 the yardstick, ours in float32): the loss, every logged metric
(same names) and every gradient must pass the shared per-element tolerance model. They are
on-policy (one iteration per generation): off-policy, the tiny models' confident heads make the
second step so sensitive that TRL's own float32 run lands up to 60x further from float64 than
on the first, and a token near a clip edge may fall either way. The off-policy formulas are
checked on one ``_compute_loss`` call instead, against TRL's ``GRPOTrainer._compute_loss`` on
given inputs: old and reference log-probs away from the current ones (so ratios clip), vLLM's
importance-sampling ratios, tool masks, padded completions, several accumulation steps.
"""

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")

from test_integration_trl import (  # noqa: E402
    COMMON_ARGS,
    _case,
    _check_against_trl,
    _model_dir,
    _tokenizer,
    _yardstick,
)

import astrai_kernels as ak  # noqa: E402
import astrai_kernels.ops.grpo as grpo_ops  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.testing import compare_elementwise, compare_model_gradient  # noqa: E402

from cases import scale_a_logits_gradient_entry, subprocess_env  # noqa: E402

#: a smaller first step than the other trainers' tests: the second step's completions are
#: sampled from the updated policy, and a larger step lets a last-bit difference of the first
#: step's gradient flip a sampled token (seen once in 12 cases at 0.5)
STEP = (("learning_rate", 0.05),)

GRPO_CASES = [
    ("llama", "dapo", (("beta", 0.05),)),  # TRL's default loss; bias-corrected KL
    ("llama", "grpo", (("beta", 0.0),)),
    ("llama", "bnpo", (("delta", 1.01), ("use_bias_correction_kl", False))),
    ("llama", "dr_grpo", ()),
    ("llama", "luspo", ()),
    ("llama", "luspo", (("importance_sampling_level", "sequence"),)),
    ("llama", "grpo", (("importance_sampling_level", "sequence"),)),
    ("llama", "cispo", (("epsilon_high", 1.01),)),
    ("llama", "sapo", ()),
    ("llama", "vespo", ()),
    ("llama", "dapo", (("top_entropy_quantile", 0.5), ("off_policy_mask_threshold", 0.001))),
    ("gemma2", "grpo", ()),
    # no KL term: on-policy its step-1 value (4e-6, a difference of log-probs ~3e-3 squared)
    # moves 0.4% with the first step's last-bit differences and dominates the loss
    ("cohere", "dapo", (("beta", 0.0),)),
]
#: loss types whose calls the single-pass kernel covers (token ratios, no extra mask)
SINGLE_PASS = {"dapo", "grpo", "bnpo", "dr_grpo", "luspo"}


def _case_id(case):
    model_kind, loss_type, overrides = case
    return "-".join([model_kind, loss_type] + [f"{k}={v}" for k, v in overrides])


class _Counts:
    def __init__(self, monkeypatch):
        self.loss = self.walk = 0
        loss_op, walk = ak.linear_grpo_loss, grpo_ops._HEAD_WALK

        def counted_loss(*args, **kwargs):
            self.loss += 1
            return loss_op(*args, **kwargs)

        def counted_walk(*args, **kwargs):
            self.walk += 1
            return walk(*args, **kwargs)

        monkeypatch.setattr(ak, "linear_grpo_loss", counted_loss)
        monkeypatch.setattr(grpo_ops, "_HEAD_WALK", counted_walk)


@pytest.mark.parametrize("case", GRPO_CASES, ids=_case_id)
def test_fused_loss_matches_trl(case, monkeypatch, tmp_path):
    model_kind, loss_type, overrides = case
    config = (("loss_type", loss_type),) + STEP + overrides
    counts = _Counts(monkeypatch)
    actual, expected, naive, results = _check_against_trl(
        "grpo", model_kind, monkeypatch, tmp_path, config_overrides=config,
        install_kwargs=dict(fused_loss=True))
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    # every head call ours (on-policy without KL, the loss is the policy's only one)
    assert actual["calls"]["trl"] == 0
    assert counts.loss == 2  # one loss per optimizer step, on our op
    assert counts.walk == (2 if loss_type in SINGLE_PASS and not dict(overrides).get(
        "top_entropy_quantile") and dict(overrides).get("importance_sampling_level",
                                                         "token") == "token" else 0)
    # the metrics TRL logs, by name, are all there
    assert set(actual["logs"][1]) == set(expected["logs"][1])


def test_fused_loss_lora_and_gradient_checkpointing(monkeypatch, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (the LoRA case needs it)")
    for variant in ("lora", "gradient checkpointing"):
        counts = _Counts(monkeypatch)
        actual, _, _, results = _check_against_trl(
            "grpo", "llama", monkeypatch, tmp_path / variant.replace(" ", "-"), variant=variant,
            install_kwargs=dict(fused_loss=True))
        failed = [result.message() for _, result in results if not result.ok]
        assert not failed, f"{variant}: " + "\n".join(failed[:5])
        assert counts.loss == 2 and actual["calls"]["trl"] == 0


def test_fused_loss_broken_variant_fails(monkeypatch, tmp_path):
    """A loss that drops TRL's KL bias correction is seen failing."""
    original = ak.linear_grpo_loss

    def broken(*args, options, **kwargs):
        import dataclasses

        return original(*args, options=dataclasses.replace(options, kl_ratio_correction=False),
                        **kwargs)

    monkeypatch.setattr(ak_trl.ak, "linear_grpo_loss", broken)
    _, _, _, results = _check_against_trl(
        "grpo", "llama", monkeypatch, tmp_path,
        config_overrides=(("loss_type", "dapo"), ("beta", 0.05)),
        install_kwargs=dict(fused_loss=True))
    assert any(not result.ok for _, result in results)


def _grpo_trainer(tmp_path, dtype=torch.float32, **overrides):
    cls, config_cls, config_kwargs, trainer_kwargs = _case("grpo")
    args = config_cls(output_dir=str(tmp_path), **COMMON_ARGS, model_init_kwargs={"dtype": dtype},
                      **{**config_kwargs, **overrides})
    torch.manual_seed(0)
    return cls(model=_model_dir("llama"), args=args, processing_class=_tokenizer(),
               **trainer_kwargs)


def _trl_importance_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's ``importance_sampling_ratio``, transcribed from
    ``GRPOTrainer._generate_and_score_completions`` (grpo_trainer.py, lines 2660-2706): the
    masked gap ``old - sampling`` (NaN: 0), per token or summed per sequence, exponentiated,
    then clamped (``*_truncate``) or zeroed outside ``[clip_min, clip_max]`` (``*_mask``)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _inputs(policy, vllm=None, batch=4, prompt=3, completion=6, seed=0):
    """What ``_generate_and_score_completions`` hands ``_compute_loss``, with a tool mask and
    padded completions (float64); with ``vllm = (mode, clip_min, clip_max)``, vLLM's sampling
    log-probs (one token it could not score: NaN; 0 on padding, as TRL pads them) and TRL's
    importance-sampling ratios formed from them."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 1:] = 0
    tool_mask = torch.ones(batch, completion, dtype=torch.long)
    tool_mask[1, 2:4] = 0
    input_ids = torch.randint(3, 30, (batch, prompt + completion), generator=g)
    with torch.no_grad():
        current = policy(input_ids=input_ids, labels=input_ids,
                         fused_lm_head=True).log_probs[:, -completion:].double()

    def noise(scale):
        return scale * torch.randn(batch, completion, generator=g, dtype=torch.float64)

    mask = completion_mask * tool_mask
    gap = noise(0.1) * mask
    old = current + noise(0.05)
    inputs = dict(
        prompt_ids=input_ids[:, :prompt], prompt_mask=torch.ones(batch, prompt, dtype=torch.long),
        completion_ids=input_ids[:, prompt:], completion_mask=completion_mask,
        tool_mask=tool_mask, advantages=torch.randn(batch, generator=g, dtype=torch.float64),
        old_per_token_logps=old, ref_per_token_logps=current + noise(0.1),
        num_items_in_batch=completion_mask.sum().double())
    if vllm is not None:
        sampling = torch.where(mask > 0, old - gap, 0.0)
        sampling[1, 0] = float("nan")
        mode, low, high = vllm
        # no ratio within float32's reach of a mask bound (a token there may fall either way)
        raw = _trl_importance_ratio(old, sampling, mask, mode.replace("truncate", "mask"),
                                    None, None)
        for bound in (low, high):
            assert bound is None or mode.endswith("truncate") or bool(
                ((raw - bound).abs() > 1e-4 * bound).all())
        inputs.update(sampling_per_token_logps=sampling,
                      importance_sampling_ratio=_trl_importance_ratio(old, sampling, mask,
                                                                      *vllm))
    return inputs


#: TRL's defaults: bounds (None, 3.0) (and sequence_mask)
TOKEN, SEQUENCE = ("token_truncate", None, 3.0), ("sequence_mask", None, 3.0)
COMPUTE_CASES = [  # (loss type, config, vLLM: None or (mode, clip_min, clip_max))
    ("dapo", {}, TOKEN),
    ("grpo", {}, SEQUENCE),
    ("grpo", {"use_bias_correction_kl": False}, None),
    ("bnpo", {"delta": 1.05}, TOKEN),
    ("dr_grpo", {}, None),
    ("luspo", {"importance_sampling_level": "sequence"}, SEQUENCE),
    ("grpo", {"importance_sampling_level": "sequence"}, None),
    ("cispo", {"epsilon_high": 1.05}, TOKEN),
    ("sapo", {}, TOKEN),
    ("vespo", {}, TOKEN),
    ("dapo", {"off_policy_mask_threshold": 0.01, "top_entropy_quantile": 0.5}, None),
    # each of TRL's vllm_importance_sampling_mode values, with bounds that the ratios cross
    ("dapo", {}, ("token_truncate", 0.9, 1.1)),
    ("grpo", {}, ("token_mask", 0.9, 1.1)),
    ("bnpo", {}, ("sequence_truncate", 0.8, 1.25)),
    ("dapo", {}, ("sequence_mask", 0.8, 1.25)),
    ("cispo", {"epsilon_high": 1.05}, ("token_truncate", 0.95, None)),
    ("luspo", {"importance_sampling_level": "sequence"}, ("sequence_mask", 0.8, None)),
    ("vespo", {}, ("token_mask", 0.9, 1.1)),
    ("vespo", {}, ("token_truncate", 0.9, 1.1)),
]


@pytest.mark.parametrize("loss_type, overrides, vllm", COMPUTE_CASES,
                         ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "defaults"
                         if isinstance(v, dict) else "-".join(map(str, v))
                         if isinstance(v, tuple) else str(v))
def test_fused_loss_compute_loss_off_policy(loss_type, overrides, vllm, tmp_path):
    """One ``_compute_loss`` of ours against TRL's on the same inputs (TRL's on the float64
    model the expected values, on the float32 one the yardstick): loss, TRL's metrics and every
    gradient, off-policy, with a tool mask, padded completions and 3 accumulation steps; with
    vLLM's importance-sampling correction where given (each of TRL's modes and bounds; ours
    forms the ratios in the loss from the sampler's log-probs)."""
    failed = _like_trl_failures(*_compute_loss_runs(loss_type, overrides, vllm, tmp_path))
    assert not failed, "\n".join(failed[:5])


@pytest.mark.parametrize("loss_type, overrides, vllm", [
    ("grpo", {}, "sequence_mask"),
    ("luspo", {"importance_sampling_level": "sequence"}, "sequence_mask")])
def test_a_wrong_logits_gradient_entry_fails(loss_type, overrides, vllm, monkeypatch, tmp_path):
    """The bound of the gradients (the model row) still sees one entry of the loss's logit
    gradient scaled by 1.01 (the two cases whose bound was one noise sample on an Intel Xeon)."""
    scale_a_logits_gradient_entry(monkeypatch)
    failed = _like_trl_failures(*_compute_loss_runs(loss_type, overrides,
                                                    (vllm, None, 3.0), tmp_path))
    assert any(message.startswith("grad ") for message in failed), failed


@pytest.mark.parametrize("gemm_setting", ["MKL_CBWR=COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS=AVX2"])
def test_the_gradients_bound_holds_under_other_gemm_orders(gemm_setting):
    """The cases whose bound was one noise sample (on an Intel Xeon, MKL's AVX-512 GEMMs) pass
    with MKL's GEMMs made to sum in other orders (a child process: MKL reads these at start)."""
    name, value = gemm_setting.split("=")
    cases = [f"{__file__}::test_fused_loss_compute_loss_off_policy[{case}]" for case in (
        "grpo-defaults-sequence_mask-None-3.0",
        "luspo-importance_sampling_level=sequence-sequence_mask-None-3.0")]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *cases], env=subprocess_env(**{name: value}), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr


def _compute_loss_runs(loss_type, overrides, vllm, tmp_path):
    """``(actual, expected, naive)``: ``(loss, grads, metrics)`` of one ``_compute_loss`` each."""
    config = dict(loss_type=loss_type, beta=0.05, gradient_accumulation_steps=3, epsilon=0.02,
                  **overrides)
    trainers = [_grpo_trainer(tmp_path / str(i), dtype, **config)
                for i, dtype in enumerate((torch.float64, torch.float32, torch.float32))]
    inputs = _inputs(trainers[0].model, vllm)
    for trainer in trainers:
        # what the correction needs; no generation runs here
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = vllm is not None
        if vllm is not None:
            (trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
             trainer.vllm_importance_sampling_clip_max) = vllm
        trainer.current_gradient_accumulation_steps = 3
        trainer.model.train()
    expected_trainer, naive_trainer, ours = trainers
    ak_trl.install(ours, fused_loss=True, chunk_size=4)

    def run(trainer, dtype):
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}

    expected = run(expected_trainer, torch.float64)
    naive, actual = run(naive_trainer, torch.float32), run(ours, torch.float32)
    assert set(actual[2]) == set(expected[2])
    return actual, expected, naive


def _like_trl_failures(actual, expected, naive):
    """The failed comparisons of ``(loss, grads, metrics)`` of a step: the loss, TRL's metrics
    (``expected``'s names) and every gradient per element against the float64 run, allowed the
    float32 run's error (the gradients on the table's model row)."""
    keys = sorted(expected[2])

    def vec(metrics):
        return torch.tensor([metrics[k] for k in keys], dtype=torch.float64)

    checks = [("loss", actual[0], expected[0], naive[0]),
              ("metrics", vec(actual[2]), vec(expected[2]), vec(naive[2]))]
    results = [compare_elementwise(got, want, _yardstick(base, want), dtype=torch.float32,
                                   name=name) for name, got, want, base in checks]
    results += [compare_model_gradient(actual[1][n], expected[1][n], naive[1][n],
                                       dtype=torch.float32, name=f"grad {n}")
                for n in expected[1]]
    return [result.message() for result in results if not result.ok]


def test_fused_loss_refusals(monkeypatch, tmp_path):
    trainer = _grpo_trainer(tmp_path)
    with pytest.raises(TypeError, match="fused_loss"):
        ak_trl.install(trainer, fused_loss=1)
    trainer._entropy_bonus_enabled = True
    with pytest.raises(ak_trl.TRLHeadError, match="entropy bonus"):
        ak_trl.install(trainer, fused_loss=True)
    trainer._entropy_bonus_enabled = False
    trainer.loss_type = "unknown"
    with pytest.raises(ak_trl.TRLHeadError, match="loss_type 'unknown'"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.loss_type = "dapo"
    trainer.off_policy_mask_threshold, trainer.use_vllm = 0.1, True
    with pytest.raises(ak_trl.TRLHeadError, match="NaN sampling"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.off_policy_mask_threshold, trainer.use_vllm = None, False
    trainer.top_entropy_quantile = 0.5
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    with pytest.raises(ak_trl.TRLHeadError, match="quantile"):
        ak_trl.install(trainer, fused_loss=True)
    monkeypatch.undo()
    trainer.top_entropy_quantile = 1.0

    trainer.loss_type, trainer.use_vllm = "vespo", True
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_clip_min = 2.0
    with pytest.raises(ak_trl.TRLHeadError, match="exclude 1"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.loss_type, trainer.use_vllm = "dapo", False
    trainer.epsilon_low = 1.5  # a clip range ak.grpo_loss refuses (clip_eps_low in [0, 1])
    with pytest.raises(ak_trl.TRLHeadError, match="clip_eps_low"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.epsilon_low = 0.2
    from transformers import ProcessorMixin

    processing_class = trainer.processing_class
    trainer.processing_class = object.__new__(type("Processor", (ProcessorMixin,), {}))
    with pytest.raises(ak_trl.TRLHeadError, match="multimodal"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.processing_class = processing_class

    class Overriding(type(trainer)):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    trainer.__class__ = Overriding
    with pytest.raises(ak_trl.TRLHeadError, match="overrides"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.__class__ = Overriding.__mro__[1]
    assert not ak_trl.is_installed(trainer)
    ak_trl.install(trainer, fused_loss=True)
    assert "_compute_loss" in trainer.__dict__
    ak_trl.uninstall(trainer)
    assert "_compute_loss" not in trainer.__dict__

    # with vLLM's correction the ratio is formed in the loss, as TRL's generation forms it
    class Regenerating(type(trainer)):
        def _generate_and_score_completions(self, inputs):
            return super()._generate_and_score_completions(inputs)

    trainer.__class__ = Regenerating
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    with pytest.raises(ak_trl.TRLHeadError, match="_generate_and_score_completions"):
        ak_trl.install(trainer, fused_loss=True)
    trainer.use_vllm = False
    ak_trl.install(trainer, fused_loss=True)
    ak_trl.uninstall(trainer)
    trainer.__class__ = Regenerating.__mro__[1]

    # RLOO's sequence ratio is a sum; other trainers have no GRPO loss
    cls, config_cls, config_kwargs, trainer_kwargs = _case("rloo")
    rloo = cls(model=_model_dir("llama"), processing_class=_tokenizer(),
               args=config_cls(output_dir=str(tmp_path), **COMMON_ARGS, **config_kwargs),
               **trainer_kwargs)
    with pytest.raises(ak_trl.TRLHeadError, match="summed sequence log-ratio"):
        ak_trl.install(rloo, fused_loss=True)
    assert not ak_trl.is_installed(rloo)
    cls, config_cls, config_kwargs, trainer_kwargs = _case("sft")
    sft = cls(model=_model_dir("llama"), processing_class=_tokenizer(),
              args=config_cls(output_dir=str(tmp_path), **COMMON_ARGS, **config_kwargs),
              **trainer_kwargs)
    with pytest.raises(ak_trl.TRLHeadError, match="GRPOTrainer only"):
        ak_trl.install(sft, fused_loss=True)


def test_fused_loss_after_the_model_is_replaced(tmp_path):
    """``trainer.model`` replaced after ``install``: the loss names uninstall/install instead of
    failing inside the call, and after them serves the new model with TRL's loss."""
    trainer, other = (_grpo_trainer(tmp_path / name) for name in ("trainer", "other"))
    for t in (trainer, other):
        t.current_gradient_accumulation_steps = 1
        t.model.train()
    inputs = _inputs(other.model)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    expected = other._compute_loss(other.model, inputs).detach()  # TRL's, on TRL's head
    old_model = trainer.model
    ak_trl.install(trainer, fused_loss=True)
    trainer.model = other.model
    with pytest.raises(ValueError, match=r"uninstall\(trainer\).*install\(trainer"):
        trainer._compute_loss(trainer.model, inputs)
    ak_trl.uninstall(trainer)
    ak_trl.install(trainer, fused_loss=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in old_model.parameters())
    assert other.model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_fused_loss_vllm_needs_the_sampling_logprobs(tmp_path):
    """With vLLM's correction, inputs without the sampler's log-probs are an error naming them
    (TRL's ratio is formed from them), never a loss without the correction."""
    trainer = _grpo_trainer(tmp_path)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = _inputs(trainer.model, ("sequence_mask", None, 3.0))
    del inputs["sampling_per_token_logps"]
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    ak_trl.install(trainer, fused_loss=True)
    with pytest.raises(ValueError, match="sampling_per_token_logps"):
        trainer._compute_loss(trainer.model, inputs)
