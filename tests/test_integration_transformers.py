"""astrai_kernels.integrations.transformers on tiny models built from configs (no download)."""

import copy
import importlib.util
import inspect
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from astrai_kernels.integrations import transformers as akt  # noqa: E402
from astrai_kernels.testing import (  # noqa: E402
    assert_close_elementwise,
    assert_model_gradient_close,
    compare_model_gradient,
)

from cases import scale_a_logits_gradient_entry  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def make_model(arch, seed=0, **overrides):
    """A tiny float32 causal LM: llama (untied), qwen2 (tied embeddings), gemma2 (final logit
    softcapping), cohere (logit_scale), granite (logits_scaling)."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    configs = {
        "llama": (LlamaForCausalLM, LlamaConfig, dict(vocab_size=97)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(vocab_size=101, tie_word_embeddings=True)),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config,
                   dict(vocab_size=103, head_dim=8, final_logit_softcapping=3.0)),
        "cohere": (CohereForCausalLM, CohereConfig,
                   dict(vocab_size=89, logit_scale=0.5, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)),
        "granite": (GraniteForCausalLM, GraniteConfig, dict(vocab_size=83, logits_scaling=2.0)),
    }
    model_class, config_class, extra = configs[arch]
    config = config_class(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).float().train()
    if arch in ("gemma2",):
        # Larger head weights so the softcap is active (|logits| comparable to the cap).
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(40.0)
    return model


def batch(vocab, seed=1, size=3, length=11):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (size, length), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[1, :4] = -100  # an unscored prompt
    return input_ids, attention_mask, labels


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "cohere"])
def test_patched_loss_and_every_gradient_match_the_model(arch):
    model = make_model(arch)
    vocab = model.config.vocab_size
    input_ids, attention_mask, labels = batch(vocab)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    expected_out, expected = loss_and_grads(copy.deepcopy(model).double(), inputs)
    naive_out, naive = loss_and_grads(model, inputs)
    akt.patch(model)
    out, grads = loss_and_grads(model, inputs)
    assert out.logits is None and naive_out.logits is not None
    assert_close_elementwise(out.loss, expected_out.loss, naive=naive_out.loss, name="loss")
    assert set(grads) == set(expected) == set(naive)
    for name in expected:
        assert_model_gradient_close(grads[name], expected[name], naive[name], name=name)
    if arch == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_softcap_and_scales_are_read_from_the_model():
    assert akt.fused_head(make_model("gemma2")).softcap == 3.0
    assert akt.fused_head(make_model("llama")).softcap is None
    assert akt.fused_head(make_model("cohere")).logit_scale == 0.5
    assert akt.fused_head(make_model("granite")).logit_scale == 0.5
    assert akt.fused_head(make_model("gemma2", final_logit_softcapping=None)).softcap is None


def test_num_items_in_batch_shift_labels_and_logits_to_keep():
    model = make_model("llama")
    reference = copy.deepcopy(model)
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    akt.patch(model, backend="torch")
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits.double()

    def expected(rows_logits, rows_target, normalizer=None):
        total = F.cross_entropy(rows_logits.reshape(-1, rows_logits.shape[-1]),
                                rows_target.reshape(-1), ignore_index=-100, reduction="sum")
        count = (rows_target != -100).sum() if normalizer is None else normalizer
        return total / count

    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 num_items_in_batch=torch.tensor(50)).loss
    torch.testing.assert_close(loss.double(), expected(logits, shifted, 50), rtol=1e-5, atol=0)
    target = torch.randint(0, model.config.vocab_size, labels.shape,
                           generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 shift_labels=target).loss
    torch.testing.assert_close(loss.double(), expected(logits, target), rtol=1e-5, atol=0)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 logits_to_keep=4).loss
    torch.testing.assert_close(loss.double(), expected(logits[:, -4:], shifted[:, -4:]),
                               rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="shift_labels must have the shape"):
        model(input_ids=input_ids, labels=labels, shift_labels=target[:, :3])


def test_loss_options_reach_the_op():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    logits = copy.deepcopy(model)(input_ids=input_ids, attention_mask=attention_mask).logits
    akt.patch(model, label_smoothing=0.1, z_loss=1e-3, backend="torch", chunk_size=5)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    rows = logits.double().reshape(-1, logits.shape[-1])
    keep = shifted != -100
    expected = F.cross_entropy(rows[keep], shifted[keep], label_smoothing=0.1) + \
        1e-3 * (torch.logsumexp(rows[keep], -1) ** 2).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)


def test_eval_and_no_labels_run_the_model_unchanged():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    before_train = model(input_ids=input_ids, attention_mask=attention_mask).logits
    model.eval()
    before_eval = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    akt.patch(model)
    assert akt.is_patched(model)
    after_eval = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert after_eval.logits is not None
    torch.testing.assert_close(after_eval.logits, before_eval.logits, rtol=0, atol=0)
    torch.testing.assert_close(after_eval.loss, before_eval.loss, rtol=0, atol=0)
    model.train()
    after_train = model(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(after_train, before_train, rtol=0, atol=0)
    # Trainer reads the signature: the model's own, with **kwargs for num_items_in_batch.
    assert inspect.signature(model.forward) == inspect.signature(
        type(model).forward.__get__(model))
    as_tuple = model(input_ids=input_ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].dim() == 0
    akt.unpatch(model)
    assert not akt.is_patched(model) and "forward" not in model.__dict__
    assert model(input_ids=input_ids, labels=labels).logits is not None


def test_patch_refuses_what_it_cannot_serve():
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = MixtralForCausalLM(MixtralConfig(**SMALL, vocab_size=67, num_local_experts=2,
                                           num_experts_per_tok=1))
    with pytest.raises(ValueError, match="auxiliary"):
        akt.patch(moe)
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        akt.patch(object())
    with pytest.raises(ValueError, match="not a transformers model"):
        akt.patch(torch.nn.Linear(2, 2))
    custom = make_model("llama")
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        akt.patch(custom)
    model = make_model("llama")
    with pytest.raises(TypeError, match="unknown loss option"):
        akt.patch(model, reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        akt.patch(model, label_smoothing=2.0)
    assert not akt.is_patched(model)
    akt.patch(model)
    with pytest.raises(ValueError, match="already patched"):
        akt.patch(model)
    akt.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        akt.unpatch(model)


def test_a_wrong_logits_gradient_entry_fails(monkeypatch):
    """The gradients' bound (the model row of the table) still sees one entry of the loss's
    logit gradient scaled by 1.01."""
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(model.config.vocab_size)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    _, expected = loss_and_grads(copy.deepcopy(model).double(), inputs)
    _, naive = loss_and_grads(model, inputs)
    scale_a_logits_gradient_entry(monkeypatch)
    _, grads = loss_and_grads(akt.patch(model), inputs)
    failed = [name for name in expected
              if not compare_model_gradient(grads[name], expected[name], naive[name]).ok]
    assert "lm_head.weight" in failed, failed


def test_adamw_run_gives_the_same_loss_curve():
    def curve(model, steps=6):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            # Two batches in turn: the model fits them, so the curve falls.
            input_ids, attention_mask, labels = batch(model.config.vocab_size, seed=step % 2)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return torch.stack(losses)

    model = make_model("qwen2")
    expected = curve(copy.deepcopy(model).double())
    naive = curve(copy.deepcopy(model))
    patched = curve(akt.patch(model))
    assert patched[-2:].mean() < patched[:2].mean() - 0.1  # it learns
    assert_close_elementwise(patched, expected, naive=naive, name="AdamW loss curve")


def _trainer_run(model, tmp_path, name):
    from transformers import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(5)
    rows = []
    for i in range(8):  # sequences of different lengths: num_items_in_batch matters
        length = 6 + (i % 3) * 3
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen)
        labels = ids.clone()
        labels[: 1 + i % 4] = -100
        rows.append({"input_ids": ids, "labels": labels})

    def collate(features):
        length = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            pad = length - len(f["input_ids"])
            out["input_ids"].append(F.pad(f["input_ids"], (0, pad)))
            out["attention_mask"].append(F.pad(torch.ones_like(f["input_ids"]), (0, pad)))
            out["labels"].append(F.pad(f["labels"], (0, pad), value=-100))
        return {key: torch.stack(value) for key, value in out.items()}

    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2,
                             logging_steps=1, report_to="none", save_strategy="no",
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    # The patched forward keeps **kwargs, so Trainer passes num_items_in_batch to it.
    assert trainer.model_accepts_loss_kwargs
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_with_gradient_accumulation_trains_a_patched_model(tmp_path):
    model = make_model("llama")
    expected_losses, expected_params = _trainer_run(copy.deepcopy(model), tmp_path, "plain")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses, params = _trainer_run(akt.patch(model), tmp_path, "patched")
    assert len(losses) == len(expected_losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses),
                               rtol=1e-5, atol=0)
    for name, value in params.items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"
        # AdamW moves an entry by up to lr whatever its gradient's size, so rounding-level
        # gradient differences on near-zero entries show up as up to ~lr * 1e-3 here.
        torch.testing.assert_close(value, expected_params[name], rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_token_logprobs_match_the_model_logits(arch):
    model = make_model(arch)
    input_ids, attention_mask, _ = batch(model.config.vocab_size)
    temperature = 0.7

    def from_logits(m):
        logits = m(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logp = torch.log_softmax(logits / temperature, -1)
        token = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        keep = attention_mask[:, 1:] != 0
        return token * keep, entropy * keep

    model64 = copy.deepcopy(model).double()
    expected, expected_entropy = from_logits(model64)
    naive, naive_entropy = from_logits(model)
    logp, entropy = akt.token_logprobs(model, input_ids, attention_mask,
                                       temperature=temperature, return_entropy=True)
    assert logp.dtype == torch.float32 and tuple(logp.shape) == (3, 10)
    assert_close_elementwise(logp, expected, naive=naive, name="logprobs")
    assert_close_elementwise(entropy, expected_entropy, naive=naive_entropy, name="entropy")
    # The policy's gradient: every parameter's equals the one through the model's logits.
    def grads_of(m, value):
        m.zero_grad(set_to_none=True)
        value.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    grads = grads_of(model, logp.sum() + entropy.sum())
    expected_grads = grads_of(model64, expected.sum() + expected_entropy.sum())
    naive_grads = grads_of(model, naive.sum() + naive_entropy.sum())
    assert set(grads) == set(expected_grads)
    for name in expected_grads:
        assert_model_gradient_close(grads[name], expected_grads[name], naive_grads[name],
                                    name=name)
    with torch.no_grad():  # old / reference models: forward only
        again = akt.token_logprobs(model, input_ids, attention_mask, temperature=temperature)
    assert not again.requires_grad
    torch.testing.assert_close(again, logp.detach(), rtol=0, atol=0)


def test_token_logprobs_bad_input():
    model = make_model("llama")
    with pytest.raises(ValueError, match="input_ids must be"):
        akt.token_logprobs(model, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        akt.token_logprobs(model, torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3))


def test_patched_step_peak_memory_is_lower_where_logits_dominate():
    from astrai_kernels.bench.peak import fix_mmap_threshold

    spec = importlib.util.spec_from_file_location(
        "bench_transformers", os.path.join(ROOT, "bench", "bench_transformers.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fix_mmap_threshold()  # large buffers are their own mmaps: RSS follows the live tensors
    # V = 8192 and 512 rows: 16 MiB of float32 logits against ~2 MiB of weights. In this
    # process (bench.run_steps runs each case in a fresh one, as the README's figures were).
    shape = dict(vocab=8192, hidden=32, batch=2, seq_len=256, repeats=1, threads=0)
    plain = bench.run_case(False, **shape)
    patched = bench.run_case(True, **shape)
    table = bench.format_table([plain, patched])
    assert patched["peak_bytes"] < 0.6 * plain["peak_bytes"], table
    assert "patched" in table


def test_docs_section_runs():
    """The ```py blocks of docs/transformers.md's "Hugging Face transformers" run as shown, in
    order (they need transformers, so tests/test_readme.py, which runs the ```python blocks,
    leaves them out)."""
    import re

    text = open(os.path.join(ROOT, "docs", "transformers.md")).read()
    section = text.split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    namespace = {}
    for block in blocks:
        exec(compile(block, "docs/transformers.md", "exec"), namespace)
    assert namespace["out"].logits is None
    assert namespace["policy_logp"].shape == (2, 15)
    assert not akt.is_patched(namespace["model"])
