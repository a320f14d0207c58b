"""astrai_kernels.integrations.verl: the fused head verl's forwards call, and its top-K
distillation, against float64 and verl's own ``torch`` fused backend, on tiny models built
from configs (no download). The engine end to end: test_integration_verl_engine.py."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("verl")

import verl_cpu  # noqa: E402,F401  (the CPU platform, before verl's engine is imported)
from verl.models.transformers import dense_common, monkey_patch  # noqa: E402
from verl.trainer.distillation.fsdp import losses as verl_distillation  # noqa: E402
from verl.utils.experimental import torch_functional  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

from astrai_kernels.integrations import verl as akv  # noqa: E402
from astrai_kernels.integrations.verl import distillation, forward  # noqa: E402
from astrai_kernels.testing import compare_elementwise, compare_model_gradient  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
CHUNK = 5  # rows per chunk: every call below walks several chunks
ORIGINALS = {(owner, name): owner.__dict__[name] for owner, name in (
    (monkey_patch, "patch_forward_with_backends"), (torch_functional, "FusedLinearForPPO"),
    (FSDPEngineWithLMHead, "prepare_model_inputs"),
    (FSDPEngineWithLMHead, "prepare_model_outputs"),
    (verl_distillation, "compute_forward_kl_topk"))}


@pytest.fixture
def installed():
    akv.install(chunk_size=CHUNK)
    yield
    akv.uninstall()


def make_model(arch, dtype=torch.float32, seed=0):
    """A tiny causal LM: qwen2 (untied), gemma2 (final logit soft-cap), cohere (logit scale),
    granite (logits scaling)."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    configs = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(vocab_size=131)),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config,
                   dict(vocab_size=103, head_dim=8, final_logit_softcapping=3.0)),
        "cohere": (CohereForCausalLM, CohereConfig,
                   dict(vocab_size=89, logit_scale=0.5, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)),
        "granite": (GraniteForCausalLM, GraniteConfig, dict(vocab_size=83, logits_scaling=2.0)),
    }
    model_class, config_class, extra = configs[arch]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SMALL, **extra}, attn_implementation="eager"))
    if arch == "gemma2":
        with torch.no_grad():  # logits as large as the cap, so the cap is active
            model.get_output_embeddings().weight.mul_(40.0)
    return model.to(dtype).train()


def yardstick(naive, expected):
    """The naive values of the tolerance model through a whole network (as
    tests/test_integration_trl.py): float64 plus the naive path's largest error on the tensor,
    on every entry; its error on one entry can vanish by chance where ours need not."""
    naive, expected = naive.double(), expected.double()
    return expected + (naive - expected).abs().max()


def batch(vocab, layout, seed=1):
    """``(model inputs, shift_labels or None, temperature)``: ``padded`` is two sequences of
    11 (the forward rolls the labels, one temperature per sequence); ``packed`` the engine's
    remove-padding layout ``[1, total_nnz]`` with its rolled labels and one temperature per
    token."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "padded":
        input_ids = torch.randint(0, vocab, (2, 11), generator=generator)
        return dict(input_ids=input_ids), None, torch.tensor([0.7, 1.3])
    lengths = (7, 9, 6)
    input_ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    temperature = torch.cat([torch.full((n,), t) for n, t in zip(lengths, (0.6, 1.0, 1.4))])
    return (dict(input_ids=input_ids, position_ids=position_ids),
            torch.roll(input_ids, -1, -1), temperature.unsqueeze(0))


def fields_from_logits(logits, labels, temperature):
    """log-probs, entropy and sum of squared probabilities of ``labels`` under
    ``softmax(logits / temperature)``, in the logits' precision (float32 at least)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    temperature = torch.as_tensor(temperature, dtype=logits.dtype)
    if temperature.dim() == 1:
        temperature = temperature.unsqueeze(-1)
    log_p = torch.log_softmax(logits / temperature.unsqueeze(-1), -1)
    return {"log_probs": log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
            "entropy": -(log_p.exp() * log_p).sum(-1),
            "sum_pi_squared": (2 * log_p).exp().sum(-1).detach()}


def run(model, inputs, shift_labels, temperature, how):
    """The fields and every parameter's gradient of ``sum(w1 * log_probs + w2 * entropy)``:
    ``how`` is ``"ours"`` (the forward install gives), ``"verl_torch"`` (verl's own) or
    ``"logits"`` (the model's own forward, then the softmax of its logits)."""
    model.zero_grad(set_to_none=True)
    labels = torch.roll(inputs["input_ids"], -1, -1) if shift_labels is None else shift_labels
    if how == "logits":
        fields = fields_from_logits(model(**inputs).logits, labels, temperature)
    else:
        verl_forward = dense_common.forward_with_torch_backend
        model._verl_fused_kernels_backend = "astrai" if how == "ours" else "torch"
        call = (forward.make_forward(verl_forward, {"backend": "auto", "chunk_size": CHUNK})
                if how == "ours" else verl_forward)
        extra = {"calculate_sum_pi_squared": True} if how == "ours" else {}
        output = call(model, **inputs, shift_labels=shift_labels, temperature=temperature,
                      return_dict=True, **extra)
        fields = {"log_probs": output.log_probs, "entropy": output.entropy.float()}
        if how == "ours":
            fields["sum_pi_squared"] = output.sum_pi_squared
    generator = torch.Generator().manual_seed(7)
    weights = [torch.rand(labels.shape, generator=generator, dtype=torch.float64)
               for _ in range(2)]
    objective = sum((w.to(fields[name].dtype) * fields[name]).sum()
                    for w, name in zip(weights, ("log_probs", "entropy")))
    objective.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return {name: value.detach() for name, value in fields.items()}, grads


def check(actual, expected, naive, dtype, what):
    result = compare_elementwise(actual, expected, yardstick(naive, expected), dtype=dtype,
                                 name=what)
    assert result.ok, result.message()


@pytest.mark.parametrize("arch, layout, dtype", [
    *[("qwen2", layout, dtype) for layout in ("padded", "packed")
      for dtype in (torch.float32, torch.bfloat16)],
    *[(arch, "padded", torch.float32) for arch in ("gemma2", "cohere", "granite")]],
    ids=lambda value: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(value, value))
def test_fields_and_every_gradient_against_float64(arch, layout, dtype, installed):
    """log_probs, entropy, sum_pi_squared and every parameter's gradient of our forward
    against the model's own float64 run, within the naive path's error in the model's dtype
    (its own logits, then the softmax); temperatures per sequence and per token, several
    chunks."""
    model = make_model(arch, dtype)
    model64 = copy.deepcopy(model).double()
    inputs, shift_labels, temperature = batch(model.config.vocab_size, layout)
    expected, expected_grads = run(model64, inputs, shift_labels, temperature, "logits")
    naive, naive_grads = run(copy.deepcopy(model), inputs, shift_labels, temperature, "logits")
    ours, grads = run(model, inputs, shift_labels, temperature, "ours")
    for name in expected:
        assert ours[name].dtype == torch.float32, name
        check(ours[name], expected[name], naive[name], dtype, name)
    assert set(grads) == set(expected_grads)
    for name in expected_grads:
        result = compare_model_gradient(grads[name], expected_grads[name], naive_grads[name],
                                        dtype=dtype, name=f"grad {name}")
        assert result.ok, result.message()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_agrees_with_verls_torch_backend(layout, installed):
    """Where verl's ``torch`` backend serves the call (one float temperature, no logit
    transform): ours within its float32 error of float64, on every field and gradient."""
    model = make_model("qwen2")
    inputs, shift_labels, _ = batch(model.config.vocab_size, layout)
    expected, expected_grads = run(copy.deepcopy(model).double(), inputs, shift_labels, 0.8,
                                   "logits")
    theirs, their_grads = run(copy.deepcopy(model), inputs, shift_labels, 0.8, "verl_torch")
    ours, grads = run(model, inputs, shift_labels, 0.8, "ours")
    for name in theirs:
        check(ours[name], expected[name], theirs[name], torch.float32, name)
    for name in expected_grads:
        check(grads[name], expected_grads[name], their_grads[name], torch.float32, name)


def test_apply_monkey_patch_serves_astrai_and_leaves_other_backends(installed, monkeypatch):
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)
    model = make_model("qwen2")
    monkey_patch.apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                                    fused_kernels_backend="astrai")
    assert forward.is_astrai_forward(type(model).forward)
    assert model._verl_fused_kernels_backend == "astrai"
    inputs, _, _ = batch(model.config.vocab_size, "padded")
    output = model(**inputs, temperature=0.9, return_dict=True, calculate_sum_pi_squared=True)
    assert type(output).__name__ == "CausalLMOutputForPPO"
    assert isinstance(output, dense_common.CausalLMOutputForPPO)
    assert output.sum_pi_squared.shape == output.log_probs.shape == (2, 11)
    monkey_patch.apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                                    fused_kernels_backend="torch")
    assert type(model).forward is dense_common.forward_with_torch_backend
    layer = torch_functional.FusedLinearForPPO(impl_backend="torch")
    assert isinstance(layer, ORIGINALS[(torch_functional, "FusedLinearForPPO")])
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
        torch_functional.FusedLinearForPPO(impl_backend="tritonx")


def test_install_and_uninstall_are_idempotent():
    for _ in range(2):
        akv.install()
    assert akv.is_installed()
    for (owner, name), original in ORIGINALS.items():
        assert owner.__dict__[name] is not original, name
    akv.install(chunk_size=3)  # other options: replaced, not stacked
    for _ in range(2):
        akv.uninstall()
    assert not akv.is_installed()
    for (owner, name), original in ORIGINALS.items():
        assert owner.__dict__[name] is original, name
    with pytest.raises(ValueError, match="backend"):
        akv.install(backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        akv.install(chunk_size=0)
    assert not akv.is_installed()


def test_temperature_shapes_are_checked(installed):
    model = make_model("qwen2")
    inputs, _, _ = batch(model.config.vocab_size, "padded")
    for bad, error in ((torch.ones(3), ValueError), (torch.tensor([1.0, -1.0]), ValueError),
                       (torch.ones(2, dtype=torch.long), TypeError)):
        with pytest.raises(error, match="temperature"):
            run(model, inputs, None, bad, "ours")


def _teacher(vocab, rows, k, generator):
    """A teacher's top-k log-probs and ids ``[rows, k]``, some below verl's clamp."""
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 4
    log_p = torch.log_softmax(logits, -1)
    values, ids = log_p.topk(k, -1)
    return values.float(), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_distillation_matches_verls_per_token(dtype, installed):
    """verl's ``compute_forward_kl_topk`` (now ours) against verl's own function in float64,
    every per-token output and the student logits' gradient, within verl's own error in the
    logits' dtype; the overlap counts equal."""
    generator = torch.Generator().manual_seed(3)
    lengths, vocab, k = (5, 8, 4), 67, 6
    rows = sum(lengths)
    logits = (torch.randn(1, rows, vocab, generator=generator) * 5).to(dtype)
    teacher_log_probs, teacher_ids = _teacher(vocab, rows, k, generator)
    # a few tokens where the student's top k is the teacher's, so the overlap is full there
    logits[0, :3].scatter_(-1, teacher_ids[:3], 40.0)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets)
              for t in (teacher_log_probs, teacher_ids)]
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
        log_prob_min_clamp=-10.0, use_chunked_topk=False))
    weights = torch.rand(1, rows, generator=generator, dtype=torch.float64)

    def outputs(function, student):
        student = student.detach().requires_grad_(True)
        result = function(student, *nested, config, "thd")
        (weights.to(result["distillation_losses"].dtype)
         * result["distillation_losses"]).sum().backward()
        return {name: value.detach() for name, value in result.items()}, student.grad

    original = ORIGINALS[(verl_distillation, "compute_forward_kl_topk")]
    assert distillation.is_astrai_topk(verl_distillation.compute_forward_kl_topk)
    expected, expected_grad = outputs(original, logits.double())
    naive, naive_grad = outputs(original, logits)
    ours, grad = outputs(verl_distillation.compute_forward_kl_topk, logits)
    assert bool((expected["student_mass"] < 1).all())
    student_at_ids = torch.log_softmax(logits.double(), -1)[0].gather(-1, teacher_ids)
    assert bool((student_at_ids < -10).any() and (student_at_ids > -10).any())  # the clamp acts
    assert torch.equal(ours["overlap_count"], expected["overlap_count"])
    assert bool((ours["overlap_count"] == k).any() and (ours["overlap_count"] < k).any())
    for name in ("distillation_losses", "student_mass", "teacher_mass",
                 "overlap_token_advantage"):
        assert ours[name].shape == (1, rows), name
        check(ours[name], expected[name], naive[name], dtype, name)
    check(grad, expected_grad, naive_grad, dtype, "grad student_logits")
    assert grad.dtype == dtype


def test_topk_distillation_runs_on_installs_backend(monkeypatch):
    """``install(backend=...)`` reaches the distillation's ``ak.token_logprobs`` too."""
    import astrai_kernels as ak

    seen = []
    token_logprobs = ak.token_logprobs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return token_logprobs(*args, **kwargs)

    monkeypatch.setattr(ak, "token_logprobs", spy)
    generator = torch.Generator().manual_seed(5)
    teacher_log_probs, teacher_ids = _teacher(17, 6, 3, generator)
    offsets = torch.tensor([0, 2, 6])
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets)
              for t in (teacher_log_probs, teacher_ids)]
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
        log_prob_min_clamp=-10.0))
    try:
        for backend in ("torch", "auto"):
            akv.install(backend=backend)
            logits = torch.randn(1, 6, 17, generator=generator, requires_grad=True)
            verl_distillation.compute_forward_kl_topk(logits, *nested, config, "thd")
    finally:
        akv.uninstall()
    assert seen == ["torch", "auto"]


def _overlap_batch(dtype, tied, seed):
    """Student logits ``[1, 12, V]`` and a teacher's top-K ids, the teacher's ids drawn around
    the student's K-th largest (ranks K - 8 to K + 8, so membership is decided at the boundary)
    and elsewhere. ``tied``: logits on a coarse grid (eighths in [-4, 4]) so the K-th value is
    tied in every row, every other row's teacher ids avoiding the tied value; else rows whose
    K-th value is unique, also after verl's ``log_softmax``."""
    vocab, k, rows = 3001, 64, 12
    generator = torch.Generator().manual_seed(seed)
    if tied:
        logits = (torch.randint(-32, 33, (1, rows, vocab), generator=generator) / 8).to(dtype)
    else:
        logits = torch.empty(1, 0, vocab, dtype=dtype)
        while logits.shape[1] < rows:
            row = (torch.randn(1, vocab, generator=generator) * 3).to(dtype)
            kth = row.float().topk(k).values[0, -1]
            log_p = torch.log_softmax(row, -1).float()
            kth_log_p = log_p.topk(k).values[0, -1]
            if int((row.float() == kth).sum()) == 1 and int((log_p == kth_log_p).sum()) == 1:
                logits = torch.cat([logits, row[None]], 1)
    order = torch.sort(logits[0].float(), dim=-1, descending=True, stable=True).indices
    others = torch.cat([order[:, :k - 8], order[:, k + 8:]], -1)
    ids = torch.cat([order[:, k - 8:k + 8],
                     others[:, torch.randperm(vocab - 16, generator=generator)[:k - 16]]], -1)
    if tied:  # every other row's teacher ids avoid the tied value
        kth = logits[0].float().gather(-1, order[:, k - 1:k])
        for row in range(1, rows, 2):
            clear = (logits[0, row].float() != kth[row]).nonzero()[:, 0]
            ids[row] = clear[torch.randperm(clear.numel(), generator=generator)[:k]]
    teacher = torch.log_softmax(torch.randn(rows, vocab, generator=generator), -1).gather(-1, ids)
    return logits, teacher, ids, order[:, :k]


def _verl_outputs(function, logits, teacher, ids, chunked):
    offsets = torch.tensor([0, 5, logits.shape[1]])
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets) for t in (teacher, ids)]
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
        log_prob_min_clamp=-10.0, use_chunked_topk=chunked))
    return function(logits, *nested, config, "thd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_overlap_is_verls_on_rows_without_ties(dtype, installed, monkeypatch):
    """On CPU logits the overlap reads each row's K-th largest from the cpp kernel
    (``row_kth_largest``, not ``torch.topk``): on rows whose K-th value is unique, verl's
    ``overlap_count`` exactly, against both of verl's paths (its default ``log_softmax``
    ranking and ``use_chunked_topk``'s ranking of the logits), and ``overlap_token_advantage``
    against verl's in float64 within verl's own error in the logits' dtype."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend

    calls = []
    row_kth_largest = cpp_backend.row_kth_largest
    monkeypatch.setattr(cpp_backend, "row_kth_largest",
                        lambda *args: calls.append(args) or row_kth_largest(*args))
    logits, teacher, ids, _ = _overlap_batch(dtype, tied=False, seed=7)
    k = ids.shape[-1]
    ours = _verl_outputs(verl_distillation.compute_forward_kl_topk, logits, teacher, ids, False)
    assert len(calls) == 1
    original = ORIGINALS[(verl_distillation, "compute_forward_kl_topk")]
    counts = ours["overlap_count"]
    assert bool((counts >= 8).all() and (counts < k).all())  # the boundary splits the near ids
    for chunked in (False, True):
        assert torch.equal(counts, _verl_outputs(original, logits, teacher, ids,
                                                 chunked)["overlap_count"])
    expected = _verl_outputs(original, logits.double(), teacher, ids, False)
    naive = _verl_outputs(original, logits, teacher, ids, False)
    assert torch.equal(counts, expected["overlap_count"])
    check(ours["overlap_token_advantage"], expected["overlap_token_advantage"],
          naive["overlap_token_advantage"], dtype, "overlap_token_advantage")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_overlap_ties_go_to_the_lower_id(dtype, installed):
    """Rows whose K-th logit is tied (torch.topk leaves unspecified which of the tied ids it
    returns): the overlap counts the teacher's ids among a stable descending sort's top K, the
    documented rule; ``backend="torch"`` ranks with ``torch.topk``, which agrees with the rule
    wherever no teacher id is among the ids tied at the K-th value."""
    logits, teacher, ids, stable_top = _overlap_batch(dtype, tied=True, seed=8)
    k = ids.shape[-1]
    kth = logits[0].float().gather(-1, stable_top[:, -1:])
    assert bool(((logits[0].float() >= kth).sum(-1) > k).all())  # every row ties at the K-th
    ours = _verl_outputs(verl_distillation.compute_forward_kl_topk, logits, teacher, ids, False)
    in_stable_top = (ids[..., None] == stable_top[:, None, :]).any(-1)
    assert torch.equal(ours["overlap_count"][0], in_stable_top.sum(-1))
    akv.install(chunk_size=CHUNK, backend="torch")
    with_topk = _verl_outputs(verl_distillation.compute_forward_kl_topk, logits, teacher, ids,
                              False)
    teacher_tied = (logits[0].float().gather(-1, ids) == kth).any(-1)
    assert bool(teacher_tied.any() and (~teacher_tied).any())
    assert torch.equal(with_topk["overlap_count"][0][~teacher_tied],
                       ours["overlap_count"][0][~teacher_tied])


def test_sum_pi_squared_has_no_gradient(installed):
    """``sum_pi_squared`` is a statistic of the walk (no gradient); the other fields have one."""
    model = make_model("qwen2")
    inputs, _, _ = batch(model.config.vocab_size, "padded")
    out = forward.make_forward(dense_common.forward_with_torch_backend, {"backend": "auto",
                                                                         "chunk_size": None})(
        model, **inputs, return_dict=True, calculate_sum_pi_squared=True)
    assert not out.sum_pi_squared.requires_grad
    assert out.log_probs.requires_grad and out.entropy.requires_grad


def test_docs_recipe_runs(monkeypatch):
    """The ```py blocks of docs/verl.md run as shown, each alone (in a namespace of its own,
    as tests/test_readme.py runs the other pages' blocks)."""
    import os
    import re

    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "verl.md")).read()
    blocks = re.findall(r"```py\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    head, distill = ({"__name__": "__main__"} for _ in blocks)
    for block, namespace in zip(blocks, (head, distill)):
        exec(compile(block, "docs/verl.md", "exec"), namespace)
        assert not akv.is_installed()
    out = head["out"]
    assert out.sum_pi_squared.shape == out.log_probs.shape == (1, 16)
    assert head["model"].lm_head.weight.grad is not None
    assert set(distill["topk"]) == {"distillation_losses", "student_mass", "teacher_mass",
                                    "overlap_count", "overlap_token_advantage"}
    assert distill["student_logits"].grad is not None


def _tiny_qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=151, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                              "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, in_channels=3,
                  patch_size=2, spatial_merge_size=1, temporal_patch_size=1, out_hidden_size=32,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=150, video_token_id=149,
        vision_start_token_id=148)).train()


def test_vision_language_family_qwen3_vl(installed, monkeypatch):
    """A vision-language family (Qwen3-VL, text tokens, verl's 4-row position ids): verl's
    ``apply_monkey_patch`` gives it our forward (verl's ``qwen3_vl`` forward around our head);
    its fields and every gradient against the float64 decoder and head, within verl's own
    ``torch`` backend's float32 error."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLModel
    from verl.models.transformers import qwen3_vl

    for cls in (Qwen3VLForConditionalGeneration, Qwen3VLModel):
        monkeypatch.setattr(cls, "forward", cls.forward)
    model = _tiny_qwen3_vl()
    model64 = copy.deepcopy(model).double()
    monkey_patch.apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                                    fused_kernels_backend="astrai")
    assert forward.is_astrai_forward(type(model).forward)
    input_ids = torch.randint(0, 140, (2, 9), generator=torch.Generator().manual_seed(2))
    inputs = dict(input_ids=input_ids, position_ids=torch.arange(9).expand(4, 2, 9))
    labels = torch.roll(input_ids, -1, -1)

    def fields_and_grads(module, call, **extra):
        module.zero_grad(set_to_none=True)
        output = call(module, **inputs, temperature=0.8, return_dict=True, **extra)
        fields = {"log_probs": output.log_probs, "entropy": output.entropy.float()}
        _objective(fields)
        return fields, output, {n: p.grad.clone() for n, p in module.named_parameters()
                                if p.grad is not None}

    def float64(module, **inputs_and_options):
        hidden = module.model(input_ids, position_ids=inputs["position_ids"])[0]
        fields = fields_from_logits(F.linear(hidden, module.lm_head.weight), labels, 0.8)
        return types.SimpleNamespace(log_probs=fields["log_probs"], entropy=fields["entropy"],
                                     sum_pi_squared=fields["sum_pi_squared"])

    expected, expected_out, expected_grads = fields_and_grads(model64, float64)
    model._verl_fused_kernels_backend = "torch"
    theirs, _, their_grads = fields_and_grads(copy.deepcopy(model),
                                              qwen3_vl.forward_with_torch_backend)
    model._verl_fused_kernels_backend = "astrai"
    ours, output, grads = fields_and_grads(model, type(model).forward,
                                           calculate_sum_pi_squared=True)
    assert type(output).__name__ == "Qwen3VLCausalLMOutputForPPO"
    for name in ours:
        check(ours[name], expected[name], theirs[name], torch.float32, name)
    check(output.sum_pi_squared, expected_out.sum_pi_squared, expected_out.sum_pi_squared,
          torch.float32, "sum_pi_squared")
    assert set(grads) == set(expected_grads)
    for name in expected_grads:
        check(grads[name], expected_grads[name], their_grads[name], torch.float32, name)


def _objective(fields):
    generator = torch.Generator().manual_seed(7)
    sum((torch.rand(value.shape, generator=generator, dtype=torch.float64).to(value.dtype)
         * value).sum() for value in fields.values()).backward()
