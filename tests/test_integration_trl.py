"""``astrai_kernels.integrations.trl`` on TRL's own trainers (tiny random models from configs).

Each case trains two SGD steps three times from the same seed: TRL's own fused head on a
float64 copy of the model (the expected values), TRL's head in float32 (the naive path) and
``install`` in float32 (the result). Per step, the loss and every logged metric must pass the
shared per-element tolerance model (``astrai_kernels/testing/tolerances.py``): within twice
TRL's own float32 error (its largest on that tensor, ``_yardstick``) plus 32 float32 ulps of the
entry; every parameter's gradient the model row of that table (``compare_model_gradient``: the
same, plus a share of the tensor's largest entry for the GEMMs' summation order). The calls of
``ak.linear_token_logprobs`` and of TRL's ``_ChunkedLogProbFunction`` are counted: installed,
only ours run. Broken heads (a dropped soft-cap, a wrong temperature) are seen failing.
"""

import functools
import importlib.util
import os
import tempfile

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")

import astrai_kernels as ak  # noqa: E402
from astrai_kernels.integrations import transformers as ak_hf  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.testing import compare_elementwise, compare_model_gradient  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# timing and bookkeeping entries of the logs, not results of the head
_UNCOMPARED = ("time", "runtime", "per_second", "learning_rate", "epoch", "step", "total_flos")
_CHARS = "abcdefghijklmnopqrstuvwxyz "


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(_CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                        eos_token="<eos>", bos_token="<bos>")
    # GKD's ChatML collator renders conversations with it
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %} {% endif %}")
    return tokenizer


def _model(kind, dtype):
    """A one-layer random causal LM: llama, qwen2 (tied embeddings), gemma2 (final soft-cap
    small enough to matter), cohere (logit scale)."""
    import transformers as tf

    common = dict(vocab_size=len(_CHARS) + 3, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if kind == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = tf.Qwen2Config(tie_word_embeddings=True, **common), tf.Qwen2ForCausalLM
    elif kind == "gemma2":
        config = tf.Gemma2Config(head_dim=8, final_logit_softcapping=0.8,
                                 attn_logit_softcapping=None, **common)
        cls = tf.Gemma2ForCausalLM
    elif kind == "cohere":
        config, cls = tf.CohereConfig(logit_scale=0.5, **common), tf.CohereForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # logits large enough for the cap, the scale, the temperature to show
        model.get_output_embeddings().weight.mul_(20.0)
    return model.to(dtype)


@functools.lru_cache(maxsize=None)
def _model_dir(kind):
    """The model saved once: the trainers load it (and their reference model) from there."""
    path = os.path.join(tempfile.mkdtemp(prefix="ak-trl-"), kind)
    _model(kind, torch.float32).save_pretrained(path)
    return path


def _text_data():
    from datasets import Dataset

    return Dataset.from_dict({"text": ["hello world", "abc def ghi", "the quick brown fox",
                                       "lorem ipsum dolor"]})


def _preference_data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["say a", "say b", "say c", "say d"],
                              "chosen": [" aaa", " bb", " cccc", " d"],
                              "rejected": [" xyz", " q", " zz", " rst"]})


def _kto_data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["say a", "say b", "say c", "say d"],
                              "completion": [" aaa", " q", " cccc", " rst"],
                              "label": [True, False, True, False]})


def _prompt_data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["count a", "count b", "count c", "count d"]})


def _reward_vowels(completions, **kwargs):
    return [float(sum(map(ord, text)) % 7) for text in completions]


COMMON_ARGS = dict(max_steps=2, learning_rate=0.5, optim="sgd", bf16=False, fp16=False,
                   logging_steps=1, report_to=[], save_strategy="no", max_grad_norm=0.0, seed=0,
                   use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)


def _case(trainer_name):
    """``(trainer class, config class, config kwargs, trainer kwargs)`` of a trainer."""
    import trl

    if trainer_name == "sft":
        return trl.SFTTrainer, trl.SFTConfig, dict(per_device_train_batch_size=2), dict(
            train_dataset=_text_data())
    if trainer_name == "dpo":
        return trl.DPOTrainer, trl.DPOConfig, dict(per_device_train_batch_size=2, beta=0.5,
                                                   max_length=32), dict(
            train_dataset=_preference_data())
    if trainer_name == "kto":
        from trl.experimental.kto import KTOConfig, KTOTrainer

        return KTOTrainer, KTOConfig, dict(per_device_train_batch_size=4, beta=0.5,
                                           max_length=32), dict(train_dataset=_kto_data())
    if trainer_name in ("grpo", "rloo"):
        config = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=5,
                      temperature=0.7, beta=0.05)
        cls, config_cls = ((trl.GRPOTrainer, trl.GRPOConfig) if trainer_name == "grpo"
                           else (trl.RLOOTrainer, trl.RLOOConfig))
        return cls, config_cls, config, dict(train_dataset=_prompt_data(),
                                             reward_funcs=_reward_vowels)
    if trainer_name == "gkd":
        from datasets import Dataset
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        conversations = [[{"role": "user", "content": f"say {c}"},
                          {"role": "assistant", "content": f" {c * (i + 1)}"}]
                         for i, c in enumerate("abcd")]
        return GKDTrainer, GKDConfig, dict(per_device_train_batch_size=2, beta=0.3, lmbda=0.0,
                                           max_length=32), dict(
            train_dataset=Dataset.from_dict({"messages": conversations}),
            teacher_model="qwen2")
    raise ValueError(trainer_name)


class _Recorder:
    """Per optimizer step: the gradients; the logs; the head calls."""

    def __init__(self):
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                recorder.grads.append({name: p.grad.detach().clone()
                                       for name, p in model.named_parameters()
                                       if p.grad is not None})

        self.callback = Callback()
        self.grads, self.calls = [], {"ak": 0, "trl": 0, "ak_distill": 0}


def counted_autograd_function(function, recorder, key):
    """A stand-in for the autograd Function ``function`` whose ``apply`` counts its calls in
    ``recorder.calls[key]``."""
    recorder.calls.setdefault(key, 0)

    class CountedFunction:
        @staticmethod
        def apply(*args):
            recorder.calls[key] += 1
            return function.apply(*args)

    return CountedFunction


def _count_calls(monkeypatch, recorder, op=None):
    """Count ``ak.linear_token_logprobs`` (``op`` replaces it, for the broken variants),
    ``ak.linear_distill_loss`` and TRL's ``_ChunkedLogProbFunction.apply``."""
    from trl.trainer import utils as trl_utils

    original_op = op or ak.linear_token_logprobs
    original_distill = ak.linear_distill_loss

    def counted_op(*args, **kwargs):
        recorder.calls["ak"] += 1
        return original_op(*args, **kwargs)

    def counted_distill(*args, **kwargs):
        recorder.calls["ak_distill"] += 1
        return original_distill(*args, **kwargs)

    monkeypatch.setattr(ak, "linear_distill_loss", counted_distill)

    monkeypatch.setattr(ak, "linear_token_logprobs", counted_op)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", counted_autograd_function(
        trl_utils._ChunkedLogProbFunction, recorder, "trl"))


VARIANTS = {
    "": ({}, {}),
    "gradient checkpointing": ({"gradient_checkpointing": True}, {}),
    "lora": ({}, {"peft_config": "lora"}),
}


def _train(trainer_name, model_kind, dtype, installed, monkeypatch, op=None, tmp="/tmp",
           variant="", config_overrides=(), install_kwargs=None):
    """Two steps of a trainer; ``config_overrides``: ``(name, value)`` pairs of its config;
    ``install_kwargs``: ``install``'s keywords."""
    cls, config_cls, config_kwargs, trainer_kwargs = _case(trainer_name)
    config_kwargs = {**config_kwargs, **dict(config_overrides)}
    config_extra, trainer_extra = VARIANTS[variant]
    if trainer_extra.get("peft_config") == "lora":
        from peft import LoraConfig

        trainer_extra = dict(peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj"]))
    args = config_cls(output_dir=os.path.join(tmp, "out"), **{**COMMON_ARGS, **config_kwargs},
                      model_init_kwargs={"dtype": dtype}, **config_extra)
    if isinstance(trainer_kwargs.get("teacher_model"), str):  # a model kind: load it
        from transformers import AutoModelForCausalLM

        trainer_kwargs["teacher_model"] = AutoModelForCausalLM.from_pretrained(
            _model_dir(trainer_kwargs["teacher_model"]), dtype=dtype)
    recorder = _Recorder()
    with monkeypatch.context() as patches:
        _count_calls(patches, recorder, op)
        torch.manual_seed(0)
        trainer = cls(model=_model_dir(model_kind), args=args, processing_class=_tokenizer(),
                      callbacks=[recorder.callback], **trainer_kwargs, **trainer_extra)
        if installed:
            ak_trl.install(trainer, chunk_size=8, **(install_kwargs or {}))
        torch.manual_seed(1)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return dict(logs=logs, grads=recorder.grads, calls=recorder.calls, trainer=trainer)


_RUNS = {}


def _reference_runs(trainer_name, model_kind, monkeypatch, tmp, variant="", config_overrides=()):
    """TRL's own head in float64 and float32 (cached per case: the broken variants reuse it)."""
    key = (trainer_name, model_kind, variant, tuple(config_overrides))
    if key not in _RUNS:
        _RUNS[key] = tuple(_train(trainer_name, model_kind, dtype, False, monkeypatch, tmp=tmp,
                                  variant=variant, config_overrides=config_overrides)
                           for dtype in (torch.float64, torch.float32))
    return _RUNS[key]


def _yardstick(naive, expected):
    """The ``naive`` values of the tolerance model: float64 plus TRL's own largest float32
    error on the tensor, on every entry. Through a whole network both float32 runs land at
    the same distance from float64 (per tensor, our largest and mean errors are within 1-2x
    of TRL's), but on one entry TRL's error can vanish by chance where ours need not."""
    naive, expected = naive.double(), expected.double()
    return expected + (naive - expected).abs().max()


def _comparisons(actual, expected, naive, dtype=torch.float32):
    """Every comparison of a run against the float64 run (``naive``: TRL's float32 run;
    ``dtype``: the row of the tolerance table)."""
    results = []
    assert len(actual["logs"]) == len(expected["logs"]) == 2
    assert len(actual["grads"]) == len(expected["grads"]) == 2
    for step, (got, want, base) in enumerate(zip(actual["logs"], expected["logs"],
                                                 naive["logs"])):
        keys = sorted(k for k in want if isinstance(want[k], (int, float))
                      and not any(word in k for word in _UNCOMPARED))
        assert sorted(k for k in got if k in keys) == keys, (set(want) ^ set(got))
        def vector(log, keys=keys):
            return torch.tensor([float(log[k]) for k in keys], dtype=torch.float64)

        results.append((f"step {step} logs {keys}",
                        compare_elementwise(vector(got), vector(want),
                                            _yardstick(vector(base), vector(want)),
                                            dtype=dtype, name=f"step {step} logs")))
    for step, (got, want, base) in enumerate(zip(actual["grads"], expected["grads"],
                                                 naive["grads"])):
        assert set(got) == set(want), set(got) ^ set(want)
        for name in want:
            results.append((f"step {step} grad {name}",
                            compare_model_gradient(got[name], want[name], base[name],
                                                   dtype=dtype,
                                                   name=f"step {step} grad {name}")))
    return results


def _check_against_trl(trainer_name, model_kind, monkeypatch, tmp_path, variant="",
                       config_overrides=(), **kwargs):
    expected, naive = _reference_runs(trainer_name, model_kind, monkeypatch, str(tmp_path),
                                      variant, config_overrides)
    actual = _train(trainer_name, model_kind, torch.float32, True, monkeypatch,
                    tmp=str(tmp_path), variant=variant, config_overrides=config_overrides,
                    **kwargs)
    return actual, expected, naive, _comparisons(actual, expected, naive)


CASES = [("sft", "llama", ""), ("sft", "gemma2", ""), ("dpo", "qwen2", ""),
         ("grpo", "llama", ""), ("kto", "llama", ""),
         ("rloo", "cohere", ""), ("sft", "qwen2", "gradient checkpointing"),
         ("dpo", "llama", "lora"), ("gkd", "llama", "")]


@pytest.mark.parametrize("trainer_name, model_kind, variant", CASES)
def test_trainer_matches_trl_head(trainer_name, model_kind, variant, monkeypatch, tmp_path):
    if variant == "lora":
        pytest.importorskip("peft", reason="peft is not installed (the LoRA case needs it)")
    actual, expected, naive, results = _check_against_trl(trainer_name, model_kind, monkeypatch,
                                                          tmp_path, variant)
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    assert ak_trl.is_installed(actual["trainer"])
    # installed, every fused call ran our op and none TRL's; TRL's runs never ran ours
    assert actual["calls"]["trl"] == 0
    assert actual["calls"]["ak"] == naive["calls"]["trl"]
    for run in (naive, expected):
        assert run["calls"]["ak"] == run["calls"]["ak_distill"] == 0
    if trainer_name == "gkd":  # its loss (one per step) on linear_distill_loss
        assert actual["calls"]["ak_distill"] == 2
        trainer = actual["trainer"]
        ak_trl.uninstall(trainer)
        assert "compute_loss" not in trainer.__dict__
        assert "forward" not in trainer.teacher_model.__dict__
    else:
        assert actual["calls"]["ak"] > 0


@pytest.mark.parametrize("trainer_name, model_kind, broken", [
    ("sft", "gemma2", "dropped softcap"), ("grpo", "llama", "wrong temperature")])
def test_broken_head_fails_the_comparison(trainer_name, model_kind, broken, monkeypatch,
                                          tmp_path):
    """The comparison sees a head that drops the soft-cap or scales by another temperature."""
    original = ak.linear_token_logprobs
    change = {"dropped softcap": ("softcap", None),
              "wrong temperature": ("temperature", lambda t: t * 1.1)}[broken]

    def broken_op(*args, **kwargs):
        name, value = change
        assert kwargs[name] is not None  # the case has a cap
        kwargs[name] = value(kwargs[name]) if callable(value) else value
        return original(*args, **kwargs)

    _, _, _, results = _check_against_trl(trainer_name, model_kind, monkeypatch, tmp_path,
                                          op=broken_op)
    assert any(not result.ok for _, result in results)


def test_install_uninstall_and_refusals(monkeypatch, tmp_path):
    import trl

    cls, config_cls, config_kwargs, trainer_kwargs = _case("dpo")
    args = config_cls(output_dir=str(tmp_path), **COMMON_ARGS, **config_kwargs)
    trainer = cls(model=_model_dir("llama"), args=args,
                  processing_class=_tokenizer(), **trainer_kwargs)
    trl_forwards = [model.__dict__["forward"] for model in (trainer.model, trainer.ref_model)]
    ak_trl.install(trainer)
    assert ak_trl.served_models(trainer) == [trainer.model, trainer.ref_model]
    with pytest.raises(ak_trl.TRLHeadError, match="already"):
        ak_trl.install(trainer)
    # a model carrying a fused head (TRL's or ours) is not patched by integrations.transformers
    with pytest.raises(ValueError, match="integrations.trl"):
        ak_hf.patch(trainer.model)
    ak_trl.uninstall(trainer)
    assert not ak_trl.is_installed(trainer)
    assert [m.__dict__["forward"] for m in (trainer.model, trainer.ref_model)] == trl_forwards
    with pytest.raises(ValueError, match="integrations.trl"):
        ak_hf.patch(trainer.model)
    # another TRL version: refused with the reason
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ak_trl.TRLHeadError, match="TRL 1.17.0"):
        ak_trl.install(trainer)
    monkeypatch.undo()
    # a MoE config asking for router logits
    trainer.model.config.output_router_logits = True
    with pytest.raises(ak_trl.TRLHeadError, match="router logits"):
        ak_trl.install(trainer)
    trainer.model.config.output_router_logits = False
    with pytest.raises(ValueError, match="backend"):
        ak_trl.install(trainer, backend="nonexistent")
    assert not ak_trl.is_installed(trainer)
    # an output embedding that is not a plain nn.Linear (as LoRA on lm_head makes it)
    class ScaledHead(torch.nn.Linear):
        def forward(self, hidden):
            return 2 * super().forward(hidden)

    plain_head = trainer.model.lm_head
    trainer.model.lm_head = ScaledHead(16, plain_head.out_features, bias=False)
    with pytest.raises(ak_trl.TRLHeadError, match="not a plain nn.Linear"):
        ak_trl.install(trainer)
    trainer.model.lm_head = plain_head
    # a trainer whose models carry no TRL head
    trainer.model.__dict__.pop("forward")
    trainer.ref_model.__dict__.pop("forward")
    with pytest.raises(ak_trl.TRLHeadError, match="nothing to serve"):
        ak_trl.install(trainer)


def _fields(out):
    return {name: getattr(out, name) for name in ("loss", "log_probs", "entropy",
                                                  "log_sum_sq_probs", "mean_logits", "is_top1",
                                                  "label_mask")}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_head_fields_shift_labels_and_autocast(autocast):
    """One call of each head, every field TRL 1.16 defines, against the float64 model: with
    labels (shifted by the head) and with pre-shifted ``shift_labels`` and
    ``num_items_in_batch``; under bf16 autocast TRL's head computes in bf16, as ours must."""
    import copy
    import types

    from trl.trainer.utils import add_fused_lm_head

    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    model = _model("gemma2", torch.float32)
    model64 = copy.deepcopy(model).double()
    ours = copy.deepcopy(model)
    for m in (model, model64, ours):
        add_fused_lm_head(m, temperature=0.8, outputs=outputs)
    ak_trl.install(types.SimpleNamespace(model=ours))
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 30, (2, 9), generator=g)
    labels = input_ids.masked_fill(torch.rand(2, 9, generator=g) < 0.3, -100)
    calls = [dict(labels=labels), dict(shift_labels=labels, num_items_in_batch=7)]
    dtype = torch.bfloat16 if autocast else torch.float32
    for kwargs in calls:
        expected = _fields(model64(input_ids=input_ids, fused_lm_head=True, **kwargs))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            naive = _fields(model(input_ids=input_ids, fused_lm_head=True, **kwargs))
            got = _fields(ours(input_ids=input_ids, fused_lm_head=True, **kwargs))
        assert torch.equal(got["label_mask"], expected["label_mask"])
        mask = got["label_mask"]
        if not autocast:  # under bf16 a near-tie of the argmax may go either way
            assert torch.equal(got["is_top1"], expected["is_top1"])
        for name in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
            assert got[name].dtype == torch.float32, name
            result = compare_elementwise(got[name], expected[name],
                                         _yardstick(naive[name], expected[name]), dtype=dtype,
                                         name=name)
            assert result.ok, result.message()
            if name != "loss":
                assert bool((got[name][~mask] == 0).all())
        got["loss"].backward()
        naive["loss"].backward()
        expected["loss"].backward()
    named = zip(ours.named_parameters(), model.parameters(), model64.parameters())
    for (name, p), q, q64 in named:
        result = compare_model_gradient(p.grad, q64.grad, q.grad, dtype=dtype,
                                        name=f"grad {name}")
        assert result.ok, result.message()


def test_trainer_built_on_a_patched_model(monkeypatch, tmp_path):
    """A model patched by integrations.transformers, then given to a TRL trainer: TRL's head
    wraps the patched forward; install serves the fused calls (the patched forward gets the
    rest), bit for bit as on the unpatched model."""
    cls, config_cls, config_kwargs, trainer_kwargs = _case("sft")
    results = []
    for patched in (False, True):
        args = config_cls(output_dir=str(tmp_path), **COMMON_ARGS, **config_kwargs)
        recorder = _Recorder()
        with monkeypatch.context() as patches:
            _count_calls(patches, recorder)
            model = _model("llama", torch.float32)
            if patched:
                ak_hf.patch(model)
            torch.manual_seed(0)
            trainer = cls(model=model, args=args, processing_class=_tokenizer(),
                          callbacks=[recorder.callback], **trainer_kwargs)
            ak_trl.install(trainer)
            torch.manual_seed(1)
            trainer.train()
        results.append(dict(logs=[e for e in trainer.state.log_history if "loss" in e],
                            grads=recorder.grads, calls=recorder.calls))
    plain, patched_run = results
    assert patched_run["calls"] == plain["calls"] and plain["calls"]["ak"] > 0
    assert plain["calls"]["trl"] == 0
    for step in range(2):
        assert patched_run["logs"][step]["loss"] == plain["logs"][step]["loss"]
        for name, grad in plain["grads"][step].items():
            assert torch.equal(patched_run["grads"][step][name], grad), name


@pytest.mark.parametrize("trainer_name, install_kwargs", [
    ("sft", {}), ("dpo", {}), ("grpo", {}), ("grpo", {"fused_loss": True}), ("gkd", {})],
    ids=["sft", "dpo", "grpo", "grpo-fused_loss", "gkd"])
def test_bf16_autocast_trainer_steps(trainer_name, install_kwargs, monkeypatch, tmp_path):
    """``bf16=True`` (autocast on CPU, as TRL 1.16 turns on by default): two steps of ours and
    of TRL's head, both under autocast, against TRL's head in float64 without it, on the
    bfloat16 row of the tolerance table (TRL's own bf16 run the yardstick)."""
    bf16 = (("bf16", True),)
    expected = _train(trainer_name, "llama", torch.float64, False, monkeypatch,
                      tmp=str(tmp_path / "fp64"))
    naive = _train(trainer_name, "llama", torch.float32, False, monkeypatch,
                   tmp=str(tmp_path / "trl"), config_overrides=bf16)
    actual = _train(trainer_name, "llama", torch.float32, True, monkeypatch,
                    tmp=str(tmp_path / "ours"), config_overrides=bf16,
                    install_kwargs=install_kwargs)
    results = _comparisons(actual, expected, naive, dtype=torch.bfloat16)
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    assert actual["calls"]["trl"] == 0
    assert (actual["calls"]["ak_distill"] == 2 if trainer_name == "gkd"
            else actual["calls"]["ak"] > 0)


def _bench_trl():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_trl",
                                                  os.path.join(root, "bench", "bench_trl.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo", "kto", "rloo", "gkd"])
def test_bench_trainer_step_runs_each_head(trainer):
    """bench/bench_trl.py's trainer cases at a tiny shape, in this process (the bench runs each
    in a fresh one): each head runs where its name says, the rows it counts are TRL's (every
    position on the CPU) or fewer for ours, and the tables carry every case. No timing."""
    bench = _bench_trl()
    shape = dict(vocab=64, model_hidden=16, layers=1, batch=2, prompt_len=3, seq_len=4,
                 repeats=1, threads=0)
    results = [bench.run_trainer_case(trainer, head, **shape)
               for head in bench.trainer_heads(trainer)]
    by_head = {r["head"]: r for r in results}
    assert by_head["trl"]["head_calls"]["ak"] == 0 < by_head["trl"]["head_calls"]["trl"]
    assert by_head["ak"]["head_calls"]["trl"] == 0 < by_head["ak"]["head_calls"]["ak"]
    for kind in ("grad", "no_grad"):
        assert by_head["ak"]["head_rows"][kind] <= by_head["trl"]["head_rows"][kind]
    assert by_head["ak"]["head_rows"]["grad"] > 0
    if trainer == "sft":  # every text token is scored: batch x seq_len rows
        assert by_head["ak"]["head_rows"]["grad"] == 2 * 4
    if trainer in ("dpo", "kto", "rloo", "gkd"):  # a reference or teacher model, forward-only
        assert by_head["ak"]["head_rows"]["no_grad"] > 0
    fused = by_head.get("ak_fused")
    if fused is not None and "unavailable" not in fused:
        assert fused["head_calls"]["trl"] == 0 < fused["head_calls"]["ak"]
    for table in (bench.format_trainer_table(results), bench.trainer_markdown(results)):
        for r in results:
            assert r["head"] in table and trainer in table


def test_gkd_loss_after_the_model_is_replaced(tmp_path):
    """``trainer.model`` replaced after ``install``: the loss names uninstall/install instead of
    failing inside the call, and after them serves the new student with TRL's loss."""
    from transformers import AutoModelForCausalLM

    cls, config_cls, config_kwargs, trainer_kwargs = _case("gkd")

    def build(name):
        args = config_cls(output_dir=str(tmp_path / name), **COMMON_ARGS, **config_kwargs)
        teacher = AutoModelForCausalLM.from_pretrained(_model_dir(trainer_kwargs["teacher_model"]))
        return cls(model=_model_dir("llama"), args=args, processing_class=_tokenizer(),
                   **{**trainer_kwargs, "teacher_model": teacher})

    trainer, other = build("trainer"), build("other")
    input_ids = torch.randint(3, 30, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[:, :3] = -100
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
    expected = other.compute_loss(other.model, inputs).detach()  # TRL's, on full logits
    old_model = trainer.model
    ak_trl.install(trainer)
    trainer.model = other.model
    with pytest.raises(ValueError, match=r"uninstall\(trainer\).*install\(trainer"):
        trainer.compute_loss(trainer.model, inputs)
    ak_trl.uninstall(trainer)
    ak_trl.install(trainer)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in old_model.parameters())
    assert other.model.get_output_embeddings().weight.grad.abs().sum() > 0
