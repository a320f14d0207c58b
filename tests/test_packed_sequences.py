"""Packed (padding-free) batches through ``integrations.transformers.patch`` and
``integrations.trl.install`` (issue 32, item 5).

A packed row holds several sequences back to back, ``position_ids`` restarting at 0 for each,
no ``attention_mask``, and the label of each sequence's first token set to -100 (transformers'
``DataCollatorWithFlattening``, TRL's ``DataCollatorForLanguageModeling(padding_free=True)``).
With that -100, the one-position shift of ``ForCausalLMLoss`` (and of TRL's head) never asks a
sequence's last token to predict the next sequence's first: the target there is -100.

What makes the model itself packing-aware: transformers 5.25's ``create_causal_mask`` reads
the sequences off ``position_ids`` (``find_packed_sequence_indices``) for every attention
implementation (eager and sdpa here; flash attention reads ``cu_seq_lens_*``), but only when
``attention_mask`` is None **and there is no cache**. A Llama in training mode with
``config.use_cache=True`` (its default) builds a ``DynamicCache`` and then lets the sequences
attend to each other. ``transformers.Trainer`` sets ``config.use_cache = args.use_cache``
(False by default) and TRL passes ``use_cache=False``; the direct calls here pass
``use_cache=False`` too. So the packed row is compared with the *padded* batch ``[3, Lmax]``:
the patched model on the packed row gives the loss and every parameter gradient of the
unpatched model on the padded batch, judged per element by the package's tolerance model
against a float64 run (twice the float32 naive run's own error, gradients with a row scale as
in ``tests/test_integration_transformers.py``).

Also: ``token_logprobs`` on a packed row (each sequence's last position gives 0), and TRL's
``SFTTrainer`` with ``padding_free=True`` (against TRL's head on the padded batches) and
``packing=True`` (against TRL's head on the same packed batches), ``install``ed.

Seen failing: the packed row with ``use_cache=True`` (cross-sequence attention); a target
taken across the boundary (a sequence's last token scored on the next one's first); in TRL, a
backbone call that drops ``position_ids``. A row without the -100 at each sequence start is
scored by the patch as transformers' own ``ForCausalLMLoss`` scores it (boundary included).
"""

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from test_integration_transformers import loss_and_grads, make_model  # noqa: E402

from astrai_kernels.integrations import transformers as akt  # noqa: E402
from astrai_kernels.testing import (  # noqa: E402
    assert_close_elementwise,
    assert_model_gradient_close,
    compare_elementwise,
    compare_model_gradient,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (5, 9, 7)
PROMPT = 3  # the second sequence's first 3 labels are -100 (an unscored prompt)


def _sequences(vocab, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for length in LENGTHS]


def _labels(sequence, index):
    return [-100] * PROMPT + sequence[PROMPT:] if index == 1 else list(sequence)


def _padded(sequences):
    """``[3, Lmax]`` right-padded, with attention_mask; pad labels -100."""
    width = max(LENGTHS)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, sequence in enumerate(sequences):
        input_ids[i, :len(sequence)] = torch.tensor(sequence)
        attention_mask[i, :len(sequence)] = 1
        labels[i, :len(sequence)] = torch.tensor(_labels(sequence, i))
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                use_cache=False)


def _packed(sequences):
    """``[1, sum L]`` by transformers' own DataCollatorWithFlattening."""
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": s, "labels": _labels(s, i)} for i, s in enumerate(sequences)]
    batch = DataCollatorWithFlattening(return_position_ids=True)(features)
    return dict(batch, use_cache=False)


def _shifted(labels):
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def test_collator_row_is_what_the_tests_assume():
    """One row, position_ids restarting, -100 at each start (so the shifted target at each
    sequence's last token is -100), no attention_mask; the same scored tokens as the padded
    batch."""
    sequences = _sequences(97)
    packed, padded = _packed(sequences), _padded(sequences)
    assert "attention_mask" not in packed
    assert packed["input_ids"].shape == (1, sum(LENGTHS))
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    assert (packed["position_ids"][0, starts] == 0).all()
    assert (packed["labels"][0, starts] == -100).all()
    assert (_shifted(packed["labels"])[0, starts[1:] - 1] == -100).all()
    assert int((_shifted(packed["labels"]) != -100).sum()) == \
        int((_shifted(padded["labels"]) != -100).sum())


def _check(actual_out, actual_grads, expected_out, expected, naive_out, naive, what):
    assert_close_elementwise(actual_out.loss, expected_out.loss, naive=naive_out.loss,
                             name=f"{what} loss")
    assert set(actual_grads) == set(expected) == set(naive)
    for name in expected:
        assert_model_gradient_close(actual_grads[name], expected[name], naive[name],
                                    name=f"{what} {name}")


def _failures(actual_out, actual_grads, expected_out, expected, naive_out, naive):
    results = [compare_elementwise(actual_out.loss, expected_out.loss, naive_out.loss)]
    results += [compare_model_gradient(actual_grads[name], expected[name], naive[name])
                for name in expected]
    return [result for result in results if not result.ok]


@pytest.mark.parametrize("form", ["labels", "shift_labels", "num_items_in_batch"])
def test_patched_packed_row_matches_the_padded_batch(form):
    """Patched, packed row == unpatched, padded batch: loss and every parameter gradient.
    ``shift_labels``: the shifted labels passed explicitly (as a collator may); ``num_items_in_
    batch``: a normalizer other than the row's count (two accumulated micro-batches)."""
    model = make_model("llama")
    sequences = _sequences(model.config.vocab_size)
    padded, packed = _padded(sequences), _packed(sequences)
    if form == "shift_labels":
        packed["shift_labels"] = _shifted(packed["labels"])
    if form == "num_items_in_batch":
        count = (_shifted(padded["labels"]) != -100).sum()
        padded["num_items_in_batch"] = packed["num_items_in_batch"] = 2 * count
    expected = loss_and_grads(copy.deepcopy(model).double(), padded)
    naive = loss_and_grads(model, padded)
    # the model itself keeps the packed sequences apart (its own loss on the row is the
    # padded batch's): the comparison below is about the head, not the attention
    _check(*loss_and_grads(model, packed), *expected, *naive, "unpatched packed")
    akt.patch(model)
    out, grads = loss_and_grads(model, packed)
    assert out.logits is None
    _check(out, grads, *expected, *naive, "patched packed")


def test_packed_row_with_a_cache_attends_across_sequences():
    """Seen failing: with ``use_cache=True`` transformers does not read the sequences off
    position_ids, so the packed row (patched or not) is no longer the padded batch."""
    model = make_model("llama")
    sequences = _sequences(model.config.vocab_size)
    padded, packed = _padded(sequences), _packed(sequences)
    expected = loss_and_grads(copy.deepcopy(model).double(), padded)
    naive = loss_and_grads(model, padded)
    akt.patch(model)
    assert _failures(*loss_and_grads(model, dict(packed, use_cache=True)), *expected, *naive)


def test_row_without_start_separators_is_scored_as_transformers_does():
    """A packed row whose labels lack the -100 at each sequence start (only position_ids
    restart): transformers' ForCausalLMLoss scores each sequence's last token on the next
    sequence's first. The patch reproduces the model exactly (like ForCausalLMLoss it does not
    read position_ids: labels or shift_labels decide what is scored). Seen failing: a shift
    across the boundary (the collator's row, but each sequence's last token given the next
    sequence's first token as its target) against the padded batch."""
    model = make_model("llama")
    sequences = _sequences(model.config.vocab_size)
    padded, packed = _padded(sequences), _packed(sequences)
    row = dict(packed, labels=packed["input_ids"].clone())  # no separators, no prompt mask
    expected = loss_and_grads(copy.deepcopy(model).double(), row)
    naive = loss_and_grads(model, row)
    expected_padded = loss_and_grads(copy.deepcopy(model).double(), padded)
    naive_padded = loss_and_grads(model, padded)
    akt.patch(model)
    out, grads = loss_and_grads(model, row)
    _check(out, grads, *expected, *naive, "patched, no separators")
    target = _shifted(packed["labels"]).clone()
    ends = torch.tensor(LENGTHS).cumsum(0)[:-1] - 1
    target[0, ends] = packed["input_ids"][0, ends + 1]
    crossing = dict(packed, shift_labels=target)
    assert _failures(*loss_and_grads(model, crossing), *expected_padded, *naive_padded)
    # and the collator's own row passes the same comparison
    assert not _failures(*loss_and_grads(model, packed), *expected_padded, *naive_padded)


def _unpack(row, fill=0.0):
    """``[1, sum L - 1]`` per-position values of a packed row as the padded ``[3, Lmax - 1]``
    (each sequence's positions that predict a token of its own; ``fill`` elsewhere)."""
    out = row.new_full((len(LENGTHS), max(LENGTHS) - 1), fill)
    start = 0
    for i, length in enumerate(LENGTHS):
        out[i, :length - 1] = row[0, start:start + length - 1]
        start += length
    return out


def test_token_logprobs_on_a_packed_row_match_the_padded_batch():
    """``token_logprobs(model, input_ids, position_ids=...)`` on a packed row: each sequence's
    log-probs and entropies are the padded batch's, and the last position of each sequence
    (whose next token starts another) gives 0 and no gradient -- before the fix it was the
    log-prob of the next sequence's first token."""
    model = make_model("llama")
    sequences = _sequences(model.config.vocab_size)
    padded, packed = _padded(sequences), _packed(sequences)
    ends = torch.tensor(LENGTHS).cumsum(0)[:-1] - 1

    def from_logits(m):
        """The model's own logits on the padded batch (the expected and naive values)."""
        input_ids, attention_mask = padded["input_ids"], padded["attention_mask"]
        logits = m(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logp = torch.log_softmax(logits / 0.7, -1)
        keep = attention_mask[:, 1:] != 0
        token = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return token * keep, -(logp.exp() * logp).sum(-1) * keep

    def grads_of(m, logp, entropy):
        m.zero_grad(set_to_none=True)
        (logp.sum() + entropy.sum()).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    model64 = copy.deepcopy(model).double()
    expected = from_logits(model64)
    expected_grads = grads_of(model64, *expected)
    naive = from_logits(model)
    naive_grads = grads_of(model, *naive)
    logp, entropy = akt.token_logprobs(model, packed["input_ids"],
                                       position_ids=packed["position_ids"], temperature=0.7,
                                       return_entropy=True)
    assert (logp[0, ends] == 0).all() and (entropy[0, ends] == 0).all()
    for i, (name, got) in enumerate((("logprobs", logp), ("entropy", entropy))):
        assert_close_elementwise(_unpack(got.detach()), expected[i], naive=naive[i].detach(),
                                 name=f"packed {name}")
    grads = grads_of(model, logp, entropy)
    for name in expected_grads:
        assert_model_gradient_close(grads[name], expected_grads[name], naive_grads[name],
                                    name=name)


# -- TRL: SFTTrainer with padding_free / packing ----------------------------------------------

def _trl():
    return pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")


TEXTS = ["hello world", "abc def ghi jkl", "the quick brown fox", "lorem ipsum",
         "a b", "jumps over the lazy dog"]


def _sft_run(dtype, installed, monkeypatch, tmp, **config):
    """Two SGD steps of an SFTTrainer on the tiny Llama of tests/test_integration_trl.py
    (TRL's head, or ``install``ed); also records each batch the loss saw."""
    _trl()
    import trl
    from datasets import Dataset
    from test_integration_trl import COMMON_ARGS, _count_calls, _model_dir, _Recorder, _tokenizer

    from astrai_kernels.integrations import trl as ak_trl

    args = trl.SFTConfig(output_dir=os.path.join(tmp, "out"),
                         **{**COMMON_ARGS, "per_device_train_batch_size": 3, **config},
                         model_init_kwargs={"dtype": dtype})
    recorder, batches = _Recorder(), []
    with monkeypatch.context() as patches:
        _count_calls(patches, recorder)
        torch.manual_seed(0)
        trainer = trl.SFTTrainer(model=_model_dir("llama"), args=args,
                                 processing_class=_tokenizer(), callbacks=[recorder.callback],
                                 train_dataset=Dataset.from_dict({"text": TEXTS}))
        if installed:
            ak_trl.install(trainer, chunk_size=8)
        compute_loss = trainer.compute_loss

        def recording_compute_loss(model, inputs, *args, **kwargs):
            batches.append({key: value.clone() for key, value in inputs.items()
                            if isinstance(value, torch.Tensor)})
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = recording_compute_loss
        torch.manual_seed(1)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return dict(logs=logs, grads=recorder.grads, calls=recorder.calls, batches=batches)


def _assert_packed(run, sequences_per_row):
    for batch in run["batches"]:
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
        starts = (batch["position_ids"][0] == 0).nonzero().flatten()
        assert len(starts) == sequences_per_row or sequences_per_row is None
        assert len(starts) > 1 and (batch["labels"][0, starts] == -100).all()


def _assert_matches(actual, expected, naive):
    from test_integration_trl import _comparisons

    failed = [result.message() for _, result in _comparisons(actual, expected, naive)
              if not result.ok]
    assert not failed, "\n".join(failed[:5])


def test_trl_padding_free_sft_matches_the_padded_run(monkeypatch, tmp_path):
    """SFTTrainer(padding_free=True) + install: every logged value and every gradient of both
    steps equal TRL's own head on the *padded* batches (float64 run; TRL's float32 run as the
    naive path), and TRL's own head on the packed batches passes the same comparison."""
    _trl()
    tmp = str(tmp_path)
    expected = _sft_run(torch.float64, False, monkeypatch, tmp)
    naive = _sft_run(torch.float32, False, monkeypatch, tmp)
    assert all("attention_mask" in batch for batch in naive["batches"])
    trl_packed = _sft_run(torch.float32, False, monkeypatch, tmp, padding_free=True,
                          max_length=None)
    ours = _sft_run(torch.float32, True, monkeypatch, tmp, padding_free=True, max_length=None)
    _assert_packed(ours, 3)
    _assert_matches(trl_packed, expected, naive)
    _assert_matches(ours, expected, naive)
    assert ours["calls"]["trl"] == 0 and ours["calls"]["ak"] == trl_packed["calls"]["trl"] > 0

    # Seen failing: a head whose backbone call drops position_ids (the row is then one long
    # sequence, each attending to the ones before it)
    from test_integration_trl import _comparisons

    original = transformers.LlamaModel.forward

    def forward_without_positions(self, *args, position_ids=None, **kwargs):
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patches:
        patches.setattr(transformers.LlamaModel, "forward", forward_without_positions)
        broken = _sft_run(torch.float32, True, monkeypatch, tmp, padding_free=True,
                          max_length=None)
    assert any(not result.ok for _, result in _comparisons(broken, expected, naive))


def test_trl_packing_sft_matches_trl_head(monkeypatch, tmp_path):
    """SFTTrainer(packing=True) (BFD, one packed row per step) + install == TRL's own head on
    the same packed batches (BFD regroups the sequences, so there is no padded twin)."""
    _trl()
    tmp = str(tmp_path)
    config = dict(packing=True, max_length=24, per_device_train_batch_size=1)
    expected = _sft_run(torch.float64, False, monkeypatch, tmp, **config)
    naive = _sft_run(torch.float32, False, monkeypatch, tmp, **config)
    ours = _sft_run(torch.float32, True, monkeypatch, tmp, **config)
    _assert_packed(ours, None)
    _assert_matches(ours, expected, naive)
    assert ours["calls"]["trl"] == 0 and ours["calls"]["ak"] == naive["calls"]["trl"] > 0


def test_docs_packed_section_runs():
    """The ```py block of docs/transformers.md's "Packed sequences" runs as shown."""
    text = open(os.path.join(ROOT, "docs", "transformers.md")).read()
    section = text.split("## Packed sequences", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    namespace = {}
    exec(compile(blocks[0], "docs/transformers.md", "exec"), namespace)
    assert namespace["packed_loss"].logits is None
