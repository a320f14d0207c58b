"""The ``astrai-kernels`` CLI: each subcommand on tiny sizes, and the fields of its JSON."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai_kernels import cli
from astrai_kernels.bench import cases as bc
from astrai_kernels.bench import plot as bench_plot
from astrai_kernels.bench import suite
from astrai_kernels.bench.runner import CaseRunner
from astrai_kernels.testing import Comparison, verify

from cases import subprocess_env

ROOT = Path(__file__).resolve().parents[1]

MACHINE_FIELDS = {"cpu", "cores", "platform", "python", "torch", "triton", "gpu"}
RESULT_FIELDS = {"op", "method", "rows", "vocab", "dtype", "device", "median_s", "repeats",
                 "times_s", "peak_extra_bytes", "peak_method", "logits_bytes", "floor_bytes",
                 "copy_s", "floor_s", "ratio_vs_copy", "ratio_vs_naive", "ratio_vs_compile",
                 "peak_extra_over_logits", "effective_bandwidth_GBps"}


def test_parse_size():
    assert cli.parse_size("4096") == 4096
    assert cli.parse_size("32k") == 32768
    assert cli.parse_size("128K") == 131072
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size("lots")


def test_bench_tiny_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--rows", "64", "--vocab", "128", "--backends", "torch,torch:inplace",
                   "--no-compile", "--ops", "token_logprobs,cross_entropy,grpo", "--dtype", "fp32",
                   "--repeats", "2", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert MACHINE_FIELDS <= set(payload["machine"])
    assert payload["machine"]["cores"] == os.cpu_count()
    config = payload["config"]
    assert config["rows"] == [64] and config["dtypes"] == ["fp32"]
    assert config["methods"] == ["naive", "torch", "torch:inplace"]
    assert payload["complete"] is True and payload["skipped"] == []
    results = payload["results"]
    assert {(r["op"], r["method"]) for r in results} == {
        (op, m) for op in ("token_logprobs", "cross_entropy", "grpo") for m in ("naive", "torch")
    } | {("token_logprobs", "torch:inplace"), ("cross_entropy", "torch:inplace")}
    for r in results:
        assert "error" not in r, r.get("error")
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        assert r["rows"] == 64 and r["vocab"] == 128 and r["dtype"] == "fp32"
        assert r["median_s"] > 0 and r["copy_s"] > 0 and 1 <= r["repeats"] <= 2
        assert r["logits_bytes"] == 64 * 128 * 4
        assert r["floor_bytes"] == bc.FLOOR_FACTOR[r["op"]] * r["logits_bytes"]
        per_copy = r["floor_bytes"] / (2 * r["copy_bytes"])  # the op's bytes per copy
        paired = [t / (c * per_copy) for t, c in zip(r["times_s"], r["paired_copy_s"])]
        assert len(paired) == r["repeats"]
        assert r["ratio_vs_copy"] == pytest.approx(statistics.median(paired))
        assert r["ratio_vs_compile"] is None  # --no-compile
        assert isinstance(r["peak_extra_bytes"], int)
        if r["method"] == "naive":
            assert r["ratio_vs_naive"] == pytest.approx(1.0)
            assert r["baseline"] == "naive"
        else:
            assert r["backend"] == "torch"
            assert r["inplace_backward"] is (r["method"] == "torch:inplace")
    grpo = [r for r in results if r["op"] == "grpo"]
    assert all(r["grpo_shape"] == [bc.GRPO_BATCH, 64 // bc.GRPO_BATCH] for r in grpo)
    assert png.stat().st_size > 10_000


def test_bench_deadline_skips_and_strategies_unavailable(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "load_strategy_bench", lambda: (None, "not here (test)"))
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--rows", "64", "--vocab", "128", "--backends", "none",
                   "--baselines", "naive", "--ops", "token_logprobs,strategies", "--dtype", "bf16",
                   "--repeats", "1", "--min-repeats", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert [r["method"] for r in payload["results"]] == ["naive"]
    assert any("strategies: not available: not here (test)" in n for n in payload["notes"])
    assert "strategies: not available" in capsys.readouterr().out
    rc = cli.main(["bench", "--rows", "64", "--vocab", "128", "--backends", "none",
                   "--baselines", "naive", "--ops", "token_logprobs", "--deadline", "0",
                   "--json", str(out), "--no-progress"])
    payload = json.loads(out.read_text())
    assert rc == 0 and payload["results"] == [] and len(payload["skipped"]) == 2


def test_default_cpu_plan_adds_the_large_vocabulary(monkeypatch):
    """`make bench` (no --rows, no --vocab) adds V = 262144 after the defaults: the logits ops
    at N = 512, the fused head in bf16 only where the CPU multiplies bf16 natively; an explicit
    --vocab or --rows leaves it out."""
    flags = {"native": ["avx512f", "amx_bf16"], "avx2": ["avx2", "fma"]}
    for machine, cpu_flags in flags.items():
        cases = bc.plan_large_vocab_cases(bc.OPS, "cpp", 5, dict(bc.DEFAULT_MIN_REPEATS), 4.0,
                                          cpu_flags=cpu_flags)
        linear = {(c.op, c.method, c.dtype) for c in cases if c.op in bc.LINEAR_OPS}
        logits = {(c.op, c.rows, c.dtype) for c in cases if c.op not in bc.LINEAR_OPS}
        assert all(c.vocab == bc.CPU_LARGE_VOCAB for c in cases)
        assert logits == {(op, 512, dtype) for op in ("token_logprobs", "cross_entropy")
                          for dtype in ("fp32", "bf16")}
        expected = {(op, method, "bf16") for op in ("linear_cross_entropy",
                                                     "linear_token_logprobs_entropy")
                    for method in ("cpp", "gemm")}
        assert linear == (expected if machine == "native" else set())
    assert bc.plan_large_vocab_cases(("grpo",), "cpp", 5, 2, 4.0) == []
    monkeypatch.setattr(bc, "native_bf16_matmul", lambda cpu_flags=None: True)
    for argv, expect_large in ((["bench", "--no-progress"], True),
                               (["bench", "--vocab", "128", "--no-progress"], False),
                               (["bench", "--rows", "64", "--no-progress"], False)):
        args = cli.build_parser().parse_args(argv)
        _, plan = cli.bench_plan(args)
        large = plan["large_vocab_cases"]
        assert bool(large) == expect_large, argv
        if expect_large:
            assert {c.method for c in large} == {"cpp", "gemm"}


def test_peak_memory_sees_the_naive_buffers():
    """The naive fp32 path holds three [N, V] fp32 buffers at its peak (log-softmax output, its
    gradient, the logits' gradient); the measured extra peak must show them."""
    case = bc.Case("token_logprobs", "naive", 512, 4096, "fp32", repeats=1, min_repeats=1)
    with CaseRunner("forkserver", timeout=120) as runner:
        result = runner.run(case)
    assert "error" not in result, result.get("error")
    logits_bytes = 512 * 4096 * 4
    assert result["logits_bytes"] == logits_bytes
    if result["peak_method"].startswith("VmHWM"):
        assert 2.5 * logits_bytes <= result["peak_extra_bytes"] <= 4.5 * logits_bytes


def test_strategy_bench_is_found():
    # a module of the package now (astrai_kernels.bench.strategy_steps), not a file of bench/
    fn, why = suite.load_strategy_bench()
    assert callable(fn), why


@pytest.mark.parametrize("argv", [
    ["bench", "--ops", "nope"], ["bench", "--dtype", "fp8"],
    ["bench", "--ops", "grpo", "--rows", "63"], ["bench", "--ops", "linear_grpo", "--rows", "12"],
    ["bench", "--backends", "nope"], ["bench", "--baselines", "nope"],
    ["bench", "--ops", ""], ["bench", "--ops", " , "], ["bench", "--dtype", ""],
    ["bench", "--vocab", ""], ["bench", "--hidden", "0"], ["bench", "--deadline", "-5"],
    ["bench", "--deadline", "nan"], ["bench", "--repeats", "0"], ["bench", "--repeats", "-3"],
    ["bench", "--min-repeats", "0"], ["bench", "--case-budget", "0"],
    ["bench", "--case-timeout", "-1"], ["bench", "--threads", "-1"],
    ["bench", "--strategy-repeats", "0"], ["bench", "--device", "tpu"],
    ["bench", "--device", "meta"],
    ["verify", "--ops", "nope"], ["verify", "--ops", ""], ["verify", "--dtypes", "fp8"],
    ["verify", "--dtypes", ""], ["verify", "--shapes", "2x3"],
    ["verify", "--backends", "nonsense"], ["verify", "--backends", "torch,nonsense"],
    ["verify", "--device", "tpu"]])
def test_bad_arguments_exit_2(argv, monkeypatch, capsys):
    """Each is a one-line error on stderr and status 2, before anything runs."""
    def no_run(*args, **kwargs):
        raise AssertionError("ran despite bad arguments")

    monkeypatch.setattr(suite, "run_benchmarks", no_run)
    monkeypatch.setattr(verify, "run", no_run)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(argv[0] + ":"), err


def _unwritable_paths(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {"a directory": str(tmp_path), "below a file": str(a_file / "out.json"),
            "in /sys": "/sys/astrai-kernels-test.json"}


@pytest.mark.parametrize("what", ["a directory", "below a file", "in /sys"])
@pytest.mark.parametrize("command,flag", [("bench", "--json"), ("bench", "--plot"),
                                          ("verify", "--json")])
def test_unwritable_output_is_a_one_line_error(tmp_path, monkeypatch, capsys, command, flag,
                                                what):
    def no_run(*args, **kwargs):
        raise AssertionError("ran despite an unwritable output path")

    monkeypatch.setattr(suite, "run_benchmarks", no_run)
    monkeypatch.setattr(verify, "run", no_run)
    monkeypatch.setattr(bench_plot, "have_matplotlib", lambda: True)
    path = _unwritable_paths(tmp_path)[what]
    assert cli.main([command, flag, path]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{command}: {flag} {path}"), err


def test_plot_without_matplotlib_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_plot, "have_matplotlib", lambda: False)
    monkeypatch.setattr(suite, "run_benchmarks", lambda **kw: pytest.fail("ran without a plot"))
    assert cli.main(["bench", "--plot", str(tmp_path / "b.png")]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_json_write_failure_during_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    """A JSON path that stops being writable mid-run: status 2 and one line, no traceback."""
    from astrai_kernels.bench.report import write_json

    # the checked path turns into a directory after the checks: the real write fails
    monkeypatch.setattr(suite, "write_json", lambda path, payload: write_json(
        str(tmp_path), payload))
    rc = cli.main(["bench", "--rows", "16", "--vocab", "32", "--backends", "none",
                   "--baselines", "naive", "--ops", "cross_entropy", "--dtype", "fp32",
                   "--repeats", "1", "--min-repeats", "1", "--json", str(tmp_path / "b.json"),
                   "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines()[-1].startswith("bench: cannot write"), err


def test_bad_arguments_subprocess_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "astrai_kernels.cli", "bench", "--repeats", "0"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bench: --repeats must be at least 1, got 0"


def test_verify_tiny_json(tmp_path, capsys):
    out = tmp_path / "verify.json"
    rc = cli.main(["verify", "--ops", "token_logprobs", "--dtypes", "fp32", "--shapes",
                   "2x3x37,1x2x3000:shifted", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "0 failed" in text
    payload = json.loads(out.read_text())
    assert payload["ok"] is True and payload["ops"] == ["token_logprobs"]
    assert "reference" not in payload["backends"] and "torch" in payload["backends"]
    rows = payload["rows"]
    assert {r["what"] for r in rows} == {"logp", "entropy", "grad"}
    assert {r["shape"] for r in rows} == {"2x3x37", "1x2x3000:shifted"}
    for r in rows:
        assert {"op", "backend", "dtype", "shape", "what", "max_abs", "max_ratio",
                "naive_factor", "term_factor", "ok"} <= set(r)
        assert r["ok"] and r["max_abs"] >= 0 and r["dtype"] == "fp32"


def test_verify_reports_failure(monkeypatch, capsys):
    failed = Comparison(False, "forced", torch.float32, (), max_abs=1.0, max_ratio=2.0,
                        reason="forced failure")
    monkeypatch.setattr(verify, "compare", lambda *a, **k: failed)
    rc = cli.main(["verify", "--ops", "cross_entropy", "--backends", "torch", "--dtypes", "bf16",
                   "--shapes", "2x3x37"])
    assert rc == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_default_shapes_cover_tiles():
    shapes = [verify.Shape.parse(s) for s in verify.DEFAULT_SHAPES]
    assert any(s.vocab & (s.vocab - 1) for s in shapes)  # a V that is not a power of two
    assert max(s.vocab for s in shapes) > 4096  # larger than one tile of any dtype
    assert any(s.shifted for s in shapes)


def test_compile_check_refuses_the_interpreter(capsys):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the test process runs without the interpreter")
    assert cli.main(["compile-check", "--arch", "sm_90"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err


def test_compile_check_json_subprocess():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "astrai_kernels.cli", "compile-check", "--json",
                           "--quick", "--arch", "sm_90"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows and {"kernel", "arch", "registers", "spills", "shared", "ok", "error"} <= set(
        rows[0])
    assert {r["arch"] for r in rows} == {"sm_90"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_script_is_valid_bash():
    script = ROOT / "bench" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text and "OUT_DIR=${OUT:-bench/results/gpu}" in text
