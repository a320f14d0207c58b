"""``astrai_kernels.integrations.trl`` on TRL 1.16's ``DistillationTrainer`` (tiny random
models from configs, the helpers of ``test_integration_trl.py``).

Each case trains two SGD steps of on-policy distillation three times from the same seed: TRL's
trainer on float64 models (the expected values; its ``_chunked_divergence_loss`` computed by
``reference.py`` in float64, as TRL's ``ChunkedDivergenceFunction`` works in float32 tiles
whatever the models' dtype), TRL's own trainer and loss in float32 (the naive path), and
``install`` in float32 (the result); the loss, every logged metric (the student's entropy among
them) and every gradient pass the shared per-element tolerance model (TRL's own float32 error
as yardstick). The calls of ``ak.linear_distill_loss``,
``ak.linear_token_logprobs`` and TRL's ``ChunkedDivergenceFunction`` are counted: installed,
only ours run. The loss function alone is checked against ``reference.distill_loss`` in
float64 (every beta, masks, ``num_items_in_batch`` or none, biases, scales, soft-caps, bf16
autocast); a wrong beta and a dropped teacher logit scale are seen failing; each refusal is
raised with its reason.
"""

import dataclasses
import functools
import os

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")

from test_integration_trl import (  # noqa: E402
    COMMON_ARGS,
    _comparisons,
    _count_calls,
    _model_dir,
    _prompt_data,
    _Recorder,
    _tokenizer,
    _yardstick,
    counted_autograd_function,
)

import astrai_kernels as ak  # noqa: E402
from astrai_kernels import reference  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.testing import compare_elementwise  # noqa: E402

from cases import scale_a_logits_gradient_entry  # noqa: E402

# student, teacher, and the config: JSD from a tied teacher head to a soft-capped student,
# forward KL from a teacher with a logit scale, reverse KL from a soft-capped teacher to a
# scaled student at T > 1, LoRA on the student
CASES = {
    "jsd": ("gemma2", "qwen2", dict(beta=0.3, temperature=0.7)),
    "forward kl": ("llama", "cohere", dict(beta=0.0, temperature=1.0)),
    "reverse kl": ("cohere", "gemma2", dict(beta=1.0, temperature=1.3)),
    "lora": ("llama", "qwen2", dict(beta=0.5, temperature=0.9)),
}


def _trainer(case, dtype, tmp, callbacks=(), cls=None):
    import trl
    from transformers import AutoModelForCausalLM

    student, teacher, config = CASES[case]
    peft_config = None
    if case == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"])
    args = trl.DistillationConfig(output_dir=os.path.join(tmp, "out"), **COMMON_ARGS,
                                  per_device_train_batch_size=2, max_completion_length=5,
                                  model_init_kwargs={"dtype": dtype}, **config)
    teacher_model = AutoModelForCausalLM.from_pretrained(_model_dir(teacher), dtype=dtype)
    torch.manual_seed(0)
    return (cls or trl.DistillationTrainer)(
        model=_model_dir(student), teacher_model=teacher_model, args=args,
        train_dataset=_prompt_data(), processing_class=_tokenizer(), callbacks=list(callbacks),
        peft_config=peft_config)


def _count_trl_divergence(patches, recorder):
    from trl.trainer import distillation_trainer as trl_distillation

    patches.setattr(trl_distillation, "ChunkedDivergenceFunction", counted_autograd_function(
        trl_distillation.ChunkedDivergenceFunction, recorder, "trl_divergence"))


def _train(case, dtype, installed, monkeypatch, tmp, distill_op=None):
    from trl.trainer import distillation_trainer as trl_distillation

    recorder = _Recorder()
    with monkeypatch.context() as patches:
        if distill_op is not None:  # a broken variant: _count_calls counts it as ours
            patches.setattr(ak, "linear_distill_loss", distill_op)
        _count_calls(patches, recorder)
        _count_trl_divergence(patches, recorder)
        if dtype == torch.float64:  # the expected run: TRL's trainer, the loss in float64
            patches.setattr(trl_distillation, "_chunked_divergence_loss",
                            _reference_divergence_loss)
        trainer = _trainer(case, dtype, tmp, callbacks=[recorder.callback])
        if installed:
            ak_trl.install(trainer, chunk_size=8)
        torch.manual_seed(1)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return dict(logs=logs, grads=recorder.grads, calls=recorder.calls, trainer=trainer)


_RUNS = {}


def _check_against_trl(case, monkeypatch, tmp, distill_op=None):
    if case not in _RUNS:  # TRL's float64 and float32 runs, reused by the broken variants
        _RUNS[case] = tuple(_train(case, dtype, False, monkeypatch, tmp)
                            for dtype in (torch.float64, torch.float32))
    expected, naive = _RUNS[case]
    actual = _train(case, torch.float32, True, monkeypatch, tmp, distill_op)
    return actual, expected, naive, _comparisons(actual, expected, naive)


@pytest.mark.parametrize("case", list(CASES))
def test_distillation_trainer_matches_trl(case, monkeypatch, tmp_path):
    if case == "lora":
        pytest.importorskip("peft", reason="peft is not installed (the LoRA case needs it)")
    actual, expected, naive, results = _check_against_trl(case, monkeypatch, str(tmp_path))
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    assert "entropy" in actual["logs"][0] and all(grads for grads in actual["grads"])
    # one loss per step: ours (and one entropy walk) installed, TRL's otherwise
    assert actual["calls"]["trl_divergence"] == 0
    assert actual["calls"]["ak_distill"] == actual["calls"]["ak"] == 2
    assert naive["calls"]["trl_divergence"] == 2 and expected["calls"]["trl_divergence"] == 0
    for run in (expected, naive):
        assert run["calls"]["ak_distill"] == run["calls"]["ak"] == run["calls"]["trl"] == 0
    trainer = actual["trainer"]
    assert ak_trl.is_installed(trainer) and ak_trl.served_models(trainer) == []
    ak_trl.uninstall(trainer)
    assert "_compute_loss" not in trainer.__dict__ and not ak_trl.is_installed(trainer)


def test_a_wrong_logits_gradient_entry_fails(monkeypatch, tmp_path):
    """The gradients' bound (the model row of the table) still sees one entry of the loss's
    logit gradient scaled by 1.01 (the case whose bound was one noise sample on an Intel Xeon)."""
    scale_a_logits_gradient_entry(monkeypatch)
    _, _, _, results = _check_against_trl("forward kl", monkeypatch, str(tmp_path))
    assert any(not result.ok for name, result in results if " grad " in name), \
        [result.message() for _, result in results if not result.ok]


@pytest.mark.parametrize("case, broken", [("jsd", "wrong beta"),
                                          ("forward kl", "dropped teacher logit scale")])
def test_broken_distillation_fails_the_comparison(case, broken, monkeypatch, tmp_path):
    original = ak.linear_distill_loss

    def broken_op(*args, **kwargs):
        if broken == "wrong beta":  # the adapter passes its settings as options=
            options = kwargs["options"]
            kwargs["options"] = dataclasses.replace(options, beta=options.beta + 0.2)
        else:
            assert kwargs["teacher_logit_scale"] != 1.0  # the case's teacher scales
            kwargs["teacher_logit_scale"] = 1.0
        return original(*args, **kwargs)

    actual, _, _, results = _check_against_trl(case, monkeypatch, str(tmp_path), broken_op)
    assert actual["calls"]["ak_distill"] == 2
    assert any(not result.ok for _, result in results)


def _reference_divergence_loss(student_hidden_states, teacher_hidden_states,
                               student_lm_head_weight, teacher_lm_head_weight, completion_mask,
                               beta, num_items_in_batch=None, student_lm_head_bias=None,
                               teacher_lm_head_bias=None, student_logit_scale=1.0,
                               teacher_logit_scale=1.0, student_final_logit_softcapping=None,
                               teacher_final_logit_softcapping=None, temperature=1.0, *,
                               logits_dtype=torch.float64):
    """TRL's ``_chunked_divergence_loss`` on ``reference.py``, in float64: the expected values
    (TRL's ``ChunkedDivergenceFunction`` projects into float32 tiles even on float64 models);
    with ``logits_dtype``, on logits rounded to it (the naive path of a bf16 result)."""
    valid = completion_mask.reshape(-1) != 0

    def logits(hidden, weight, bias):
        rows = hidden.reshape(-1, hidden.shape[-1])[valid].to(logits_dtype)
        return torch.nn.functional.linear(
            rows, weight.to(logits_dtype),
            None if bias is None else bias.to(logits_dtype)).double()

    student = logits(student_hidden_states, student_lm_head_weight, student_lm_head_bias)
    teacher = logits(teacher_hidden_states, teacher_lm_head_weight, teacher_lm_head_bias)
    n_valid = valid.sum()
    normalizer = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss, entropy_sum = _reference_on_logits(
        student, teacher.detach(), beta, normalizer, temperature,
        (student_logit_scale, student_final_logit_softcapping),
        (teacher_logit_scale, teacher_final_logit_softcapping))
    return loss, entropy_sum, n_valid


def _reference_on_logits(student, teacher, beta, normalizer, temperature, student_transform,
                         teacher_transform):
    student = reference.transform_logits(student, *student_transform)
    teacher = reference.transform_logits(teacher, *teacher_transform)
    loss = reference.distill_loss(student, teacher, beta=beta, temperature=temperature,
                                  reduction="sum") / normalizer
    _, entropy = reference.token_logprobs(
        student.detach(), torch.zeros(student.shape[0], dtype=torch.long),
        temperature=temperature)
    return loss, entropy.sum()


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("variant", ["plain", "bias scale softcap", "num_items", "no rows",
                                     "bf16 autocast"])
def test_divergence_loss_matches_reference(beta, variant):
    """``_distillation_divergence_loss`` (what TRL's ``_chunked_divergence_loss`` becomes)
    against ``reference.py`` in float64, TRL's own function as the naive path; a gradient's
    entries also get the scale of their terms, ``|d loss / d logits| @ |other factor|``. Under
    bf16 autocast every result is held to bfloat16's row, as ``test_integration_trl`` holds
    the fused head (the logits may be rounded to bf16, TRL keeps them in float32)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    generator = torch.Generator().manual_seed(7)

    def tensor(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).float()

    vocab, with_bias = 37, variant == "bias scale softcap"
    student = dict(hidden=tensor(3, 6, 8), weight=tensor(vocab, 8, scale=3.0),
                   bias=tensor(vocab) if with_bias else None)
    teacher = (tensor(3, 6, 12), tensor(vocab, 12, scale=3.0),
               tensor(vocab) if with_bias else None)
    mask = torch.rand(3, 6, generator=generator) < 0.6
    if variant == "no rows":
        mask[:] = False
    transforms = dict(student_logit_scale=1.0, teacher_logit_scale=1.0,
                      student_final_logit_softcapping=None, teacher_final_logit_softcapping=None)
    if with_bias:
        transforms = dict(student_logit_scale=0.7, teacher_logit_scale=1.5,
                          student_final_logit_softcapping=4.0,
                          teacher_final_logit_softcapping=6.0)
    num_items = torch.tensor(11.0) if variant == "num_items" else None
    autocast = variant == "bf16 autocast"
    dtype = torch.bfloat16 if autocast else torch.float32
    # the naive path: TRL's function; of a bf16 result, reference.py on bf16 logits
    naive = (functools.partial(_reference_divergence_loss, logits_dtype=torch.bfloat16)
             if autocast else _chunked_divergence_loss)
    results = {}
    for name, function in (("ours", ak_trl._distillation_divergence_loss), ("naive", naive),
                           ("expected", _reference_divergence_loss)):
        # ours (and TRL's) get the float32 tensors; the others what the heads compute with
        cast = {"naive": dtype, "expected": torch.float64}.get(name)

        def given(value, cast=cast):
            if value is None:
                return None
            return value.clone() if cast is None else value.to(dtype).to(cast).clone()

        leaves = {key: given(value).requires_grad_() for key, value in student.items()
                  if value is not None}
        teacher_args = [given(value) for value in teacher]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and name == "ours"):
            loss, entropy_sum, n_valid = function(
                leaves["hidden"], teacher_args[0], leaves["weight"], teacher_args[1],
                mask.long(), beta, num_items_in_batch=num_items,
                student_lm_head_bias=leaves.get("bias"), teacher_lm_head_bias=teacher_args[2],
                temperature=0.8, **transforms)
        loss.backward()
        assert int(n_valid) == int(mask.sum())
        results[name] = dict(loss=loss.detach(), entropy_sum=entropy_sum,
                             **{f"grad {key}": value.grad for key, value in leaves.items()})
    assert results["ours"]["loss"].dtype == results["ours"]["entropy_sum"].dtype == torch.float32
    # d loss / d logits in float64, for the scales of the gradients' terms
    rows = {"hidden": student["hidden"].reshape(-1, 8)[mask.reshape(-1)].to(dtype).double(),
            "weight": student["weight"].to(dtype).double()}
    logits = torch.nn.functional.linear(rows["hidden"], rows["weight"], None if not with_bias
                                        else student["bias"].to(dtype).double())
    logits.requires_grad_()
    teacher_logits = torch.nn.functional.linear(
        teacher[0].to(dtype).double().reshape(-1, 12)[mask.reshape(-1)],
        teacher[1].to(dtype).double(), None if not with_bias else teacher[2].to(dtype).double())
    normalizer = mask.sum().clamp(min=1) if num_items is None else num_items
    _reference_on_logits(logits, teacher_logits, beta, normalizer, 0.8,
                         (transforms["student_logit_scale"],
                          transforms["student_final_logit_softcapping"]),
                         (transforms["teacher_logit_scale"],
                          transforms["teacher_final_logit_softcapping"]))[0].backward()
    terms = logits.grad.abs()
    hidden_scale = torch.zeros(mask.numel(), 8, dtype=torch.float64)
    hidden_scale[mask.reshape(-1)] = terms @ rows["weight"].abs()
    scales = {"grad hidden": hidden_scale.reshape(3, 6, 8),
              "grad weight": terms.t() @ rows["hidden"].abs(), "grad bias": terms.sum(0)}
    for key, expected in results["expected"].items():
        scale = scales.get(key)
        if scale is not None:
            scale = scale + expected.abs()
        result = compare_elementwise(results["ours"][key], expected,
                                     _yardstick(results["naive"][key], expected), scale=scale,
                                     dtype=dtype, name=key)
        assert result.ok, result.message()


def test_install_uninstall_and_refusals(monkeypatch, tmp_path):
    import trl
    from trl.trainer import distillation_trainer as trl_distillation

    trainer = _trainer("jsd", torch.float32, str(tmp_path))
    ak_trl.install(trainer)
    assert ak_trl.is_installed(trainer) and "_compute_loss" in trainer.__dict__
    with pytest.raises(ak_trl.TRLHeadError, match="already"):
        ak_trl.install(trainer)
    ak_trl.uninstall(trainer)
    assert not ak_trl.is_installed(trainer) and "_compute_loss" not in trainer.__dict__

    def refused(match, **kwargs):
        with pytest.raises(ak_trl.TRLHeadError, match=match):
            ak_trl.install(trainer, **kwargs)
        assert not ak_trl.is_installed(trainer) and "_compute_loss" not in trainer.__dict__

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    refused("TRL 1.17.0")
    monkeypatch.undo()
    # a teacher served elsewhere (ServerDistillationTrainer: top-k log-probs from vLLM)
    teacher = trainer.teacher_model
    trainer.teacher_model = None
    refused("no local teacher_model")
    trainer.teacher_model = teacher
    # TRL's loss function no longer the one served here
    monkeypatch.setattr(trl_distillation, "_chunked_divergence_loss",
                        lambda student_hidden_states, teacher_hidden_states, beta: None)
    refused("_chunked_divergence_loss")
    monkeypatch.undo()
    # beta and temperature as TRL's config would not check them after construction
    trainer.temperature = 0.0
    refused("temperature 0.0")
    trainer.temperature, trainer.beta = 0.7, 1.5
    refused("beta 1.5")
    trainer.beta = 0.3
    with pytest.raises(ValueError, match="backend"):
        ak_trl.install(trainer, backend="nonexistent")
    with pytest.raises(ValueError, match="chunk_size"):
        ak_trl.install(trainer, chunk_size=0)
    # heads of different vocabularies
    weight = trainer.teacher_model.get_output_embeddings().weight
    trainer.teacher_model.get_output_embeddings().weight = torch.nn.Parameter(weight[:-1])
    refused("vocabularies")
    trainer.teacher_model.get_output_embeddings().weight = weight
    # a subclass with its own loss
    for method in ("compute_loss", "_compute_loss"):
        subclass = type("CustomDistillation", (trl.DistillationTrainer,),
                        {method: lambda self, *args, **kwargs: 0.0})
        trainer.__class__ = subclass
        refused(f"overrides DistillationTrainer.{method}")
    trainer.__class__ = trl.DistillationTrainer
    ak_trl.install(trainer)
    assert ak_trl.is_installed(trainer)
