"""``astrai_kernels.integrations.trl`` on TRL 1.16's ``ServerDistillationTrainer``
(``trl.experimental.server_distillation``; tiny random models, the helpers of
``test_integration_trl.py``).

The trainer asks a vLLM server for its teacher's log-probs through
``trl.generation.vllm_client.VLLMClient``, whose constructor needs vLLM installed and a live
server. The trainers here are built with that one class replaced by ``LocalTeacherServer``: a
``VLLMClient`` whose HTTP post of ``/v1/completions`` is answered by a local teacher model with
vLLM's ``prompt_logprobs`` (``log_softmax(logits / temperature)``: the top-k by rank and the
scored token), so TRL's own ``get_sequence_logprobs``, its formatting and the trainer's
``_get_teacher_token_logprobs_from_server`` run unchanged on real top-k log-probs.

Each case trains two SGD steps of on-policy distillation three times from the same seed: TRL's
trainer on float64 students (the expected values), TRL's trainer in float32 (the naive path) and
``install`` in float32 (the result); every logged value, every gradient and every parameter's
change in the steps pass the shared per-element tolerance model (gradients and changes on its
model row). Counts show that installed only
our op computes the loss and that the teacher was asked in every run. One ``compute_loss`` call
on padded inputs with three accumulation steps is compared with TRL's, and TRL's ValueErrors for
log-probs the server left out are raised as TRL raises them.
"""

import math
import os

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from test_integration_trl import (  # noqa: E402
    COMMON_ARGS,
    _comparisons,
    _model_dir,
    _prompt_data,
    _Recorder,
    _tokenizer,
    _yardstick,
)

import astrai_kernels as ak  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.testing import compare_elementwise, compare_model_gradient  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEACHER = "qwen2"
# student, the op the installed loss runs, and the config: the forward KL over the teacher's
# top-3 with the tail bucket and two accumulation steps; the top-1 JSD renormalised over its
# support from a student with a logit scale at T < 1; the reverse KL with the tail from a
# soft-capped student (its logits from its own forward) at T > 1; the renormalised top-2 forward
# KL through a LoRA adapter (the teacher: Qwen2, tied embeddings)
CASES = {
    "forward kl top-3": ("llama", "linear", dict(beta=0.0, loss_top_k=3, loss_add_tail=True,
                                                 temperature=1.0,
                                                 gradient_accumulation_steps=2)),
    "jsd top-1": ("cohere", "linear", dict(beta=0.4, loss_top_k=1, loss_add_tail=False,
                                           temperature=0.8)),
    "reverse kl softcap": ("gemma2", "logits", dict(beta=1.0, loss_top_k=1, loss_add_tail=True,
                                                    temperature=1.3)),
    "lora": ("llama", "linear", dict(beta=0.0, loss_top_k=2, loss_add_tail=False,
                                     temperature=0.9)),
}


def _local_teacher_server(teacher, missing=None):
    """A ``VLLMClient`` class whose server is ``teacher`` in this process; ``missing``:
    ``"actual"`` or ``"top-1"``, the log-prob it leaves out (NaN, as vLLM) at the last
    position of each sequence (a completion token)."""
    from trl.generation.vllm_client import VLLMClient

    class LocalTeacherServer(VLLMClient):
        requests = 0

        def __init__(self, base_url=None, connection_timeout=0.0):
            self.base_url, self.model = base_url, "local-teacher"

        def _post(self, url, json):
            assert url == f"{self.base_url}/v1/completions" and json["max_tokens"] == 1
            type(self).requests += 1
            return {"choices": [self._prompt_logprobs(sequence, json["prompt_logprobs"],
                                                      json["temperature"])
                                for sequence in json["prompt"]]}

        def _prompt_logprobs(self, sequence, top_k, temperature):
            with torch.no_grad():
                logits = teacher(input_ids=torch.tensor([sequence])).logits[0]
            logprobs = torch.log_softmax(logits.double() / temperature, -1)
            positions = [None]
            for position in range(1, len(sequence)):
                row, token = logprobs[position - 1], sequence[position]
                values, ids = row.topk(top_k)
                entries = {str(int(i)): {"logprob": float(v), "rank": rank + 1}
                           for rank, (i, v) in enumerate(zip(ids, values))}
                entries.setdefault(str(token), {"logprob": float(row[token]),
                                                "rank": int((row > row[token]).sum()) + 1})
                positions.append(entries)
            if missing == "actual":
                positions[-1][str(sequence[-1])]["logprob"] = math.nan
            elif missing == "top-1":
                next(e for e in positions[-1].values() if e["rank"] == 1)["logprob"] = math.nan
            return {"prompt_logprobs": positions}

    return LocalTeacherServer


def _teacher():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_model_dir(TEACHER)).eval()


def _trainer(student, config, dtype, tmp, monkeypatch, server, callbacks=(), lora=False):
    """A ServerDistillationTrainer whose VLLMClient is ``server`` (built with the class
    replaced; the trainer holds the instance); ``lora``: a LoRA adapter on the student."""
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )
    from trl.generation import vllm_client

    args = ServerDistillationConfig(
        output_dir=os.path.join(tmp, "out"), teacher_model_server_url="http://local-teacher:8000",
        **{**COMMON_ARGS, "per_device_train_batch_size": 2, "max_completion_length": 5,
           "model_init_kwargs": {"dtype": dtype}, **config})
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj"])
    with monkeypatch.context() as patches:
        patches.setattr(vllm_client, "VLLMClient", server)
        torch.manual_seed(0)
        trainer = ServerDistillationTrainer(
            model=_model_dir(student), args=args, train_dataset=_prompt_data(),
            processing_class=_tokenizer(), callbacks=list(callbacks), peft_config=peft_config)
    assert isinstance(trainer.teacher_client, server)
    return trainer


def _count(patches, module, name, calls, key):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[key] += 1
        return original(*args, **kwargs)

    patches.setattr(module, name, counted)


def _train(case, dtype, installed, monkeypatch, tmp, teacher, broken=None, overrides=()):
    """Two steps of the case; ``broken``: keywords that replace the installed op's;
    ``overrides``: ``(name, value)`` pairs of the config."""
    from trl.experimental.server_distillation import server_distillation_trainer as trl_server

    student, form, config = CASES[case]
    server = _local_teacher_server(teacher)
    recorder = _Recorder()
    calls = dict(ak_linear=0, ak_logits=0, trl_divergence=0)
    with monkeypatch.context() as patches:
        if broken is not None:
            name = {"linear": "linear_topk_distill_loss", "logits": "topk_distill_loss"}[form]
            op = getattr(ak, name)
            patches.setattr(ak, name, lambda *args, **kwargs: op(*args, **{**kwargs, **broken}))
        _count(patches, ak, "linear_topk_distill_loss", calls, "ak_linear")
        _count(patches, ak, "topk_distill_loss", calls, "ak_logits")
        _count(patches, trl_server, "_jsd_divergence", calls, "trl_divergence")
        trainer = _trainer(student, {**config, **dict(overrides)}, dtype, tmp, monkeypatch,
                           server, callbacks=[recorder.callback], lora=case == "lora")
        if installed:
            ak_trl.install(trainer, chunk_size=4)
        torch.manual_seed(1)
        initial = {name: p.detach().double() for name, p in trainer.model.named_parameters()}
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # what the steps changed, in float64 (exact for float32 values): the model row of the
    # tolerance table scales by the largest change, not by the parameters themselves
    updates = {name: p.detach().double() - initial[name]
               for name, p in trainer.model.named_parameters()}
    return dict(logs=logs, grads=recorder.grads, calls=calls, requests=server.requests,
                updates=updates, trainer=trainer)


_RUNS = {}


def _check_against_trl(case, monkeypatch, tmp, broken=None, bf16=False):
    """``(actual, expected, naive, comparisons)``: the loss and metrics logged, the gradients
    of each step and the parameters' changes in the steps, ours against TRL's float64 run (with
    ``bf16``: both float32 runs under bf16 autocast, on the bfloat16 row of the table)."""
    teacher = _teacher()
    if case not in _RUNS:  # TRL's float64 run, reused by the variants
        _RUNS[case] = _train(case, torch.float64, False, monkeypatch, os.path.join(tmp, "fp64"),
                             teacher)
    if (case, bf16) not in _RUNS:  # TRL's float32 run, the yardstick
        _RUNS[case, bf16] = _train(case, torch.float32, False, monkeypatch,
                                   os.path.join(tmp, "trl"), teacher, overrides={"bf16": bf16})
    expected, naive = _RUNS[case], _RUNS[case, bf16]
    actual = _train(case, torch.float32, True, monkeypatch, os.path.join(tmp, "ours"), teacher,
                    broken, overrides={"bf16": bf16})
    dtype = torch.bfloat16 if bf16 else torch.float32
    results = _comparisons(actual, expected, naive, dtype=dtype)
    for name, want in expected["updates"].items():
        results.append((f"update {name}", compare_model_gradient(
            actual["updates"][name], want, naive["updates"][name], dtype=dtype,
            name=f"{name}'s change in the steps")))
    return actual, expected, naive, results


@pytest.mark.parametrize("case", list(CASES))
def test_server_distillation_trainer_matches_trl(case, monkeypatch, tmp_path):
    if case == "lora":
        pytest.importorskip("peft", reason="peft is not installed (the LoRA case needs it)")
    actual, expected, naive, results = _check_against_trl(case, monkeypatch, str(tmp_path))
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    assert all(grads for grads in actual["grads"])
    assert all(log["loss"] > 1e-3 for log in actual["logs"])  # the student is not the teacher
    # every micro-batch's loss ran our op of the case's form, TRL's divergence never
    _, form, config = CASES[case]
    losses = 2 * config.get("gradient_accumulation_steps", 1)
    ours = {"linear": "ak_linear", "logits": "ak_logits"}[form]
    assert actual["calls"][ours] == losses and actual["calls"]["trl_divergence"] == 0
    assert sum(actual["calls"].values()) == losses
    for run in (expected, naive):
        assert run["calls"]["trl_divergence"] == losses
        assert run["calls"]["ak_linear"] == run["calls"]["ak_logits"] == 0
    assert actual["requests"] == expected["requests"] == naive["requests"] == losses
    trainer = actual["trainer"]
    assert ak_trl.is_installed(trainer) and ak_trl.served_models(trainer) == []
    ak_trl.uninstall(trainer)
    assert "compute_loss" not in trainer.__dict__ and not ak_trl.is_installed(trainer)


@pytest.mark.parametrize("case", ["forward kl top-3", "reverse kl softcap"])
def test_bf16_autocast_trainer_steps(case, monkeypatch, tmp_path):
    """``bf16=True`` (autocast on CPU): ours and TRL's, both under autocast, against TRL's
    float64 run on the bfloat16 row of the tolerance table (TRL's bf16 run the yardstick)."""
    actual, _, _, results = _check_against_trl(case, monkeypatch, str(tmp_path), bf16=True)
    failed = [result.message() for _, result in results if not result.ok]
    assert not failed, "\n".join(failed[:5])
    assert sum(actual["calls"].values()) > 0 and actual["calls"]["trl_divergence"] == 0


@pytest.mark.parametrize("case, broken", [("forward kl top-3", dict(tail=False)),
                                          ("jsd top-1", dict(beta=0.5)),
                                          ("reverse kl softcap", dict(temperature=1.0))])
def test_broken_loss_fails_the_comparison(case, broken, monkeypatch, tmp_path):
    """The comparison sees a loss without the tail bucket, with another beta or temperature."""
    actual, _, _, results = _check_against_trl(case, monkeypatch, str(tmp_path), broken)
    assert sum(actual["calls"].values()) > 0
    assert any(not result.ok for _, result in results)


def _padded_inputs(left_padding=True):
    """Prompts of lengths 3 and 5 (left-padded; both 5 without ``left_padding``) and
    right-padded completions of lengths 4 and 2."""
    pad = 0
    prompt_ids = torch.tensor([[pad, pad, 5, 6, 7] if left_padding else [3, 4, 5, 6, 7],
                               [8, 9, 10, 11, 12]])
    completion_ids = torch.tensor([[13, 14, 15, 16], [17, 18, pad, pad]])
    return dict(prompt_ids=prompt_ids, prompt_mask=(prompt_ids != pad).long(),
                completion_ids=completion_ids, completion_mask=(completion_ids != pad).long())


def _one_loss(student, config, dtype, installed, inputs, teacher, tmp, monkeypatch, lora):
    """The loss of one ``compute_loss`` call in training under three accumulation steps, and
    the gradients of the student's parameters."""
    trainer = _trainer(student, {**config, "gradient_accumulation_steps": 3}, dtype, tmp,
                       monkeypatch, _local_teacher_server(teacher), lora=lora)
    if installed:
        ak_trl.install(trainer, chunk_size=3)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 3
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return dict(loss=loss.detach(), **{name: p.grad for name, p in trainer.model.named_parameters()
                                       if p.grad is not None})


@pytest.mark.parametrize("case", list(CASES))
def test_compute_loss_on_padded_inputs(case, monkeypatch, tmp_path):
    """One ``compute_loss`` call on padded, uneven sequences under three accumulation steps:
    the loss (divided by 3 as TRL's) and the student's gradients against TRL's float64 call,
    TRL's float32 call the yardstick."""
    if case == "lora":
        pytest.importorskip("peft", reason="peft is not installed (the LoRA case needs it)")
    student, _, config = CASES[case]
    # Gemma 2's eager attention gives NaN hidden states at left-pad positions in float64 (not
    # in float32), which TRL's float64 backward turns into NaN gradients: no left padding there
    teacher, inputs = _teacher(), _padded_inputs(left_padding=student != "gemma2")
    results, calls = {}, dict(ak_linear=0, ak_logits=0)
    for name, dtype, installed in (("expected", torch.float64, False),
                                   ("naive", torch.float32, False),
                                   ("ours", torch.float32, True)):
        with monkeypatch.context() as patches:
            _count(patches, ak, "linear_topk_distill_loss", calls, "ak_linear")
            _count(patches, ak, "topk_distill_loss", calls, "ak_logits")
            results[name] = _one_loss(student, config, dtype, installed, inputs, teacher,
                                      str(tmp_path / name), monkeypatch, case == "lora")
    form = CASES[case][1]
    assert calls == dict(ak_linear=int(form == "linear"), ak_logits=int(form == "logits"))
    assert results["ours"]["loss"].dtype == torch.float32 and results["ours"]["loss"] > 1e-3
    assert set(results["ours"]) == set(results["expected"])
    for key, want in results["expected"].items():
        compare = compare_elementwise if key == "loss" else compare_model_gradient
        naive = results["naive"][key]
        result = compare(results["ours"][key], want,
                         _yardstick(naive, want) if key == "loss" else naive,
                         dtype=torch.float32, name=key)
        assert result.ok, result.message()


@pytest.mark.parametrize("missing, beta", [("actual", 0.4), ("actual", 1.0), ("top-1", 0.4)])
def test_missing_teacher_logprobs_raise_as_trl(missing, beta, monkeypatch, tmp_path):
    teacher, inputs = _teacher(), _padded_inputs()
    messages = []
    for installed in (False, True):
        trainer = _trainer("llama", dict(beta=beta, loss_top_k=1), torch.float32,
                           str(tmp_path), monkeypatch, _local_teacher_server(teacher, missing))
        if installed:
            ak_trl.install(trainer)
        with pytest.raises(ValueError, match="Teacher server is missing") as error:
            trainer.compute_loss(trainer.model, inputs)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert ("reverse-KL" if missing == "actual" else "forward-KL") in messages[0]


def test_install_uninstall_and_refusals(monkeypatch, tmp_path):
    from trl.experimental.server_distillation import ServerDistillationTrainer

    trainer = _trainer("llama", dict(beta=0.0, loss_top_k=2), torch.float32, str(tmp_path),
                       monkeypatch, _local_teacher_server(_teacher()))
    trl_compute_loss = trainer.compute_loss
    trl_loss, _ = trl_compute_loss(trainer.model, _padded_inputs(), return_outputs=True)
    ak_trl.install(trainer)
    assert ak_trl.is_installed(trainer) and trainer.compute_loss != trl_compute_loss
    # asked for the student's outputs, the hidden-state form gives TRL's call (the logits)
    loss, outputs = trainer.compute_loss(trainer.model, _padded_inputs(), return_outputs=True)
    assert torch.equal(loss, trl_loss) and outputs.logits.shape == (2, 9, 30)
    with pytest.raises(ak_trl.TRLHeadError, match="already"):
        ak_trl.install(trainer)
    ak_trl.uninstall(trainer)
    assert not ak_trl.is_installed(trainer) and "compute_loss" not in trainer.__dict__
    assert trainer.compute_loss == trl_compute_loss

    def refused(match, **kwargs):
        with pytest.raises(ak_trl.TRLHeadError, match=match):
            ak_trl.install(trainer, **kwargs)
        assert not ak_trl.is_installed(trainer) and "compute_loss" not in trainer.__dict__

    refused("fused_loss serves GRPOTrainer only", fused_loss=True)
    trainer.reverse_kl_top_1_mode = "argmax"
    refused("reverse_kl_top_1_mode 'argmax'")
    trainer.reverse_kl_top_1_mode, trainer.beta = "sampled", 0.5
    refused("loss_top_k 2 with beta 0.5")
    trainer.beta, trainer.temperature = 0.0, 0.0
    refused("temperature 0.0")
    trainer.temperature = 1.0
    with pytest.raises(ValueError, match="backend"):
        ak_trl.install(trainer, backend="nonexistent")
    for method in ("compute_loss", "_compute_server_forward_kl_loss", "_reduce_divergence_loss"):
        subclass = type("CustomServerDistillation", (ServerDistillationTrainer,),
                        {method: lambda self, *args, **kwargs: 0.0})
        trainer.__class__ = subclass
        refused(f"overrides ServerDistillationTrainer.{method}")
    trainer.__class__ = ServerDistillationTrainer
    ak_trl.install(trainer)
    assert ak_trl.is_installed(trainer)
