"""The fused-LM-head benchmark cases (``astrai-kernels bench --ops linear_*``): every method's
workload computes the op it claims (losses and gradients against float64 PyTorch at a tiny
shape), the GEMM floor computes the three products, and the ratios and the CLI run. No timing
is asserted."""

import json

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import cli
from astrai_kernels.bench import cases as bc
from astrai_kernels.bench import linear, suite
from astrai_kernels.bench.measure import build_workload
from astrai_kernels.bench.report import add_ratios, format_table
from astrai_kernels.bench.workloads import naive_grpo_step, seed_grpo_loss

ROWS, HIDDEN, VOCAB = 16, 8, 40  # 16 rows = B=8 x T=2 for linear_grpo
BACKENDS = [b for b in ak.available_backends("cpu") if b != "triton"] + ["reference"]
# torch.nn.functional.linear_cross_entropy is newer than the oldest torch supported: where it is
# missing, its baselines are left out here and the bench notes and drops them (tested below)
MISSING_BASELINES = bc.unavailable_baselines()
BASELINE_METHODS = ["naive"] + [m for m in bc.TORCH_LCE_BASELINES if m not in MISSING_BASELINES]


def _case(op, method, dtype="fp32", seed=0):
    return bc.Case(op, method, ROWS, VOCAB, dtype, repeats=1, min_repeats=1, hidden=HIDDEN,
                   seed=seed)


def _inputs(seed=0):
    """Hidden states, head and targets drawn the way the workloads draw them."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN ** -0.5
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    return hidden, weight, target


def _grads(workload):
    workload.run()
    grads = [leaf.grad.detach().clone() for leaf in workload.leaves]
    workload.reset()
    assert all(leaf.grad is None for leaf in workload.leaves)
    return grads


def test_plan_gives_each_op_family_its_methods():
    methods = list(bc.BASELINES) + ["cpp", "cpp:inplace", "torch"]
    cases = bc.plan_cases(["cross_entropy", "linear_cross_entropy"],
                          {"cross_entropy": [64], "linear_cross_entropy": [32]}, [256], ["fp32"],
                          methods, "cpu", 1, bc.DEFAULT_MIN_REPEATS, 1.0, hidden=[16, 24])
    logits = {c.method for c in cases if c.op == "cross_entropy"}
    assert logits == {"naive", "compile", "cpp", "cpp:inplace", "torch"}
    linear_cases = [c for c in cases if c.op == "linear_cross_entropy"]
    assert {c.method for c in linear_cases} == {"naive", "gemm", "torch_lce",
                                                 "torch_lce_chunked", "cpp", "torch"}
    assert {c.hidden for c in linear_cases} == {16, 24} and {c.rows for c in linear_cases} == {32}
    assert all(c.hidden == 0 and c.rows == 64 for c in cases if c.op == "cross_entropy")
    assert "H=16" in linear_cases[0].label()
    assert {c.min_repeats for c in linear_cases} == {1}
    assert {c.min_repeats for c in cases if c.op == "cross_entropy"} == {2}
    headline = [c for c in cases if bc.is_headline(c, [64, 256])]
    assert headline == cases and not bc.is_headline(cases[0], [256, 512])
    with pytest.raises(ValueError, match="not a method of linear_cross_entropy"):
        build_workload(_case("linear_cross_entropy", "compile"))
    with pytest.raises(ValueError, match="not a method of cross_entropy"):
        build_workload(bc.Case("cross_entropy", "gemm", 4, 8))
    with pytest.raises(ValueError, match="not a method of linear_grpo"):
        build_workload(_case("linear_grpo", "torch_lce"))
    with pytest.raises(ValueError, match="hidden size"):
        build_workload(bc.Case("linear_cross_entropy", "naive", 4, 8))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemm_floor_computes_the_three_products(dtype):
    workload = build_workload(_case("linear_cross_entropy", "gemm", dtype))
    floor = workload.run
    assert isinstance(floor, linear.GemmFloor) and workload.leaves == []
    floor()
    h, w, g = floor.hidden.double(), floor.weight.double(), floor.dlogits.double()
    assert floor.hidden.dtype == bc.torch_dtype(dtype) == floor.logits.dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bf16" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(floor.logits.double(), h @ w.T, **tol)
    torch.testing.assert_close(floor.grad_hidden.double(), g @ w, **tol)
    torch.testing.assert_close(floor.grad_weight.double(), g.T @ h, **tol)
    n, hs, v = ROWS, HIDDEN, VOCAB
    assert workload.info["floor_flops"] == 3 * 2 * n * hs * v
    assert workload.info["grad_bytes"] == (n + v) * hs * floor.hidden.element_size()
    assert workload.info["peak_bound_bytes"] == (workload.info["grad_bytes"] + 4 * v * hs
                                                 + bc.LINEAR_WORKSPACE_BOUND)


def test_grpo_gemm_floor_adds_the_old_and_ref_forwards():
    workload = build_workload(_case("linear_grpo", "gemm"))
    floor = workload.run
    assert len(floor.forward_only) == 2
    assert workload.info["floor_flops"] == 5 * 2 * ROWS * HIDDEN * VOCAB
    assert workload.info["grpo_shape"] == [bc.GRPO_BATCH, ROWS // bc.GRPO_BATCH]
    floor()
    h, w = floor.forward_only[-1]
    torch.testing.assert_close(floor.logits, h.reshape(ROWS, HIDDEN) @ w.T)


def test_loss_functions_equal_pytorch():
    hidden, weight, target = _inputs()
    logits = (hidden.double() @ weight.double().T)
    expected_ce = F.cross_entropy(logits, target)
    expected_logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
    for method in BASELINE_METHODS + BACKENDS:
        ce = linear.cross_entropy_fn(method)(hidden, weight, target)
        logp = linear.logprobs_fn(method)(hidden, weight, target)
        assert ce.shape == () and logp.shape == (ROWS,) and logp.dtype == torch.float32
        torch.testing.assert_close(ce.double(), expected_ce, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, method=method: f"{method}: {m}")
        torch.testing.assert_close(logp.double(), expected_logp, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, method=method: f"{method}: {m}")


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_token_logprobs",
                                "linear_token_logprobs_entropy"])
def test_workload_gradients_equal_float64(op):
    """Each method's call is the op forward + backward: its gradients of hidden and weight are
    those of float64 PyTorch on the same inputs (drawn by the same seed)."""
    hidden, weight, target = _inputs()
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    logits = h64 @ w64.T
    logp_all = torch.log_softmax(logits, -1)
    if op == "linear_cross_entropy":
        F.cross_entropy(logits, target).backward()
    elif op == "linear_token_logprobs":
        logp_all.gather(-1, target[:, None]).sum().backward()
    else:
        (logp_all.gather(-1, target[:, None]).sum()
         - (logp_all.exp() * logp_all).sum()).backward()
    methods = BASELINE_METHODS if op != "linear_token_logprobs_entropy" else ["naive"]
    for method in methods + BACKENDS:
        workload = build_workload(_case(op, method))
        torch.testing.assert_close(workload.leaves[0].detach(), hidden)
        torch.testing.assert_close(workload.leaves[1].detach(), weight)
        grad_hidden, grad_weight = _grads(workload)
        for got, want in ((grad_hidden, h64.grad), (grad_weight, w64.grad)):
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, method=method: f"{method}: {m}")


def test_distill_workloads_agree_with_the_naive_step():
    """Every backend's distillation step has the student gradients of TRL's generalized JSD on
    materialized float logits (naive), and the floor adds the teacher's forward GEMM."""
    want = _grads(build_workload(_case("linear_distill", "naive")))
    assert all(g.abs().sum() > 0 for g in want)
    for method in BACKENDS:
        got = _grads(build_workload(_case("linear_distill", method)))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, method=method: f"{method}: {m}")
    floor_workload = build_workload(_case("linear_distill", "gemm"))
    assert len(floor_workload.run.forward_only) == 1
    assert floor_workload.info["floor_flops"] == 4 * 2 * ROWS * HIDDEN * VOCAB
    with pytest.raises(ValueError, match="not a method of linear_distill"):
        build_workload(_case("linear_distill", "torch_lce"))


def test_grpo_workloads_agree_with_the_seed_step():
    """The GRPO step of every backend has the gradients of the seed's step on materialized
    logits (naive)."""
    naive = build_workload(_case("linear_grpo", "naive"))
    want = _grads(naive)
    for method in BACKENDS:
        got = _grads(build_workload(_case("linear_grpo", method)))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, method=method: f"{method}: {m}")


def test_seed_grpo_step_on_logits_is_the_seed_loss_on_logprobs():
    gen = torch.Generator().manual_seed(1)
    shape = (bc.GRPO_BATCH, 3)
    policy, old, ref = (torch.randn(*shape, 11, generator=gen, dtype=torch.float64)
                        for _ in range(3))
    target = torch.randint(0, 11, shape, generator=gen)
    advantages = torch.randn(bc.GRPO_BATCH, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.3).double()

    def logp(x):
        return torch.log_softmax(x, -1).gather(-1, target[..., None]).squeeze(-1)

    loss = naive_grpo_step(policy, old, ref, target, advantages, mask)
    torch.testing.assert_close(loss, seed_grpo_loss(logp(policy), logp(old), logp(ref),
                                                    advantages, mask))


def _result(method, median_s, **extra):
    return {"op": "linear_cross_entropy", "method": method, "rows": 8, "hidden": 4, "vocab": 16,
            "dtype": "fp32", "device": "cpu", "median_s": median_s, "repeats": 2,
            "logits_bytes": 512, "peak_extra_bytes": 1000, "grad_bytes": 384,
            "peak_bound_bytes": 2000, "floor_flops": 3 * 2 * 8 * 4 * 16, **extra}


def test_linear_ratios_are_against_the_gemm_case():
    results = [_result("gemm", 0.5), _result("naive", 2.0), _result("cpp", 0.6),
               _result("torch_lce_chunked", 1.0), dict(_result("cpp", 9.0), hidden=8)]
    add_ratios(results)
    gemm, naive, cpp, chunked, other_shape = results
    assert gemm["floor_s"] == 0.5 and gemm["ratio_vs_gemm"] == 1.0
    assert cpp["ratio_vs_gemm"] == pytest.approx(1.2)
    assert cpp["ratio_vs_naive"] == pytest.approx(0.3)
    assert cpp["ratio_vs_torch_lce_chunked"] == pytest.approx(0.6)
    assert cpp["ratio_vs_torch_lce"] is None and "ratio_vs_compile" not in cpp
    assert "ratio_vs_copy" not in cpp
    assert cpp["effective_GFLOPs"] == pytest.approx(cpp["floor_flops"] / 0.6 / 1e9)
    assert cpp["peak_over_bound"] == 0.5 and cpp["peak_extra_over_logits"] == 1000 / 512
    assert "floor_s" not in other_shape  # another H: no gemm case of its shape
    table = format_table(results)
    assert "x gemm" in table and "linear_cross_entropy" in table and "1.20" in table


def test_missing_torch_baselines_are_reported(monkeypatch):
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions", raising=False)
    if hasattr(F, "linear_cross_entropy"):
        assert set(bc.unavailable_baselines()) == {"torch_lce_chunked"}
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    missing = bc.unavailable_baselines()
    assert set(missing) == {"torch_lce", "torch_lce_chunked"}
    assert "linear_cross_entropy" in missing["torch_lce"]


def test_run_notes_and_drops_a_missing_baseline(monkeypatch):
    monkeypatch.setattr(suite, "unavailable_baselines", lambda: {"torch_lce": "not here (test)"})
    payload = suite.run_benchmarks(["linear_cross_entropy"], [ROWS], {"linear_cross_entropy":
                                   [VOCAB]}, ["fp32"], ["torch_lce", "gemm"], repeats=1,
                                   min_repeats=1, budget_s=1.0, progress=False,
                                   hidden=[HIDDEN])
    assert [r["method"] for r in payload["results"]] == ["gemm"]
    assert "baseline torch_lce skipped: not here (test)" in payload["notes"]


def test_cli_runs_every_linear_op_and_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--ops", ",".join(bc.LINEAR_OPS), "--rows", str(ROWS), "--hidden",
                   str(HIDDEN), "--vocab", str(VOCAB), "--dtype", "fp32", "--backends",
                   "cpp,torch", "--repeats", "1", "--json", str(out),
                   "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    payload = json.loads(out.read_text())
    available = [m for m in bc.LINEAR_BASELINES if m not in MISSING_BASELINES]
    assert payload["config"]["methods"] == available + ["cpp", "torch"]
    assert payload["notes"] == [f"baseline {m} skipped: {why}"
                                for m, why in MISSING_BASELINES.items()], payload["notes"]
    assert payload["config"]["hidden"] == [HIDDEN]
    results = payload["results"]
    assert {(r["op"], r["method"]) for r in results} == {
        (op, m) for op in bc.LINEAR_OPS for m in available + ["cpp", "torch"]
        if bc.method_applies(op, m)}
    assert {op for op, m in {(r["op"], r["method"]) for r in results}
            if m in bc.TORCH_LCE_BASELINES} <= {"linear_cross_entropy", "linear_token_logprobs"}
    assert all(r["repeats"] == 1 for r in results)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["hidden"] == HIDDEN and r["rows"] == ROWS and r["vocab"] == VOCAB
        assert r["logits_bytes"] == ROWS * VOCAB * 4
        assert r["floor_s"] > 0 and r["ratio_vs_gemm"] == pytest.approx(r["median_s"]
                                                                         / r["floor_s"])
        assert isinstance(r["peak_extra_bytes"], int) and r["peak_over_bound"] is not None
        assert r["ratio_vs_naive"] is not None and "copy_s" not in r
    assert "x gemm" in text and "GEMM floor" in text
