"""compile-check: every Triton kernel configuration AOT-compiles for sm_80 and sm_90, no spills.

It runs in a subprocess without TRITON_INTERPRET (this test process has the interpreter on when
there is no GPU, and the interpreter would replace the compiler).
"""

import json
import subprocess
import sys

import pytest

from cases import ROOT, subprocess_env

pytest.importorskip("triton")

FIELDS = {"kernel", "config", "arch", "registers", "spills", "shared", "ok", "error"}
# Triton 3.3.1 to 3.6.0 spill 8 bytes in a few of these builds (ptxas's register choice; 16 in
# grpo_fwd with entropy and gradient, bf16, strided vocabulary, sm_90, since grpo's entropy
# output), 3.8.0 and later in none: an older Triton's spill is a speed note (docs/install.md),
# not a failure.
SPILL_FREE_TRITON = (3, 8)
OLDER_TRITON_SPILL_BYTES = 16


def _triton_version():
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def test_every_kernel_compiles_without_spills():
    cmd = [sys.executable, "-m", "astrai_kernels.kernels.triton.compile_check",
           "--arch", "sm_80,sm_90",
           "--json", "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert rows, "no kernel configurations were compiled"
    for row in rows:
        assert FIELDS <= set(row), row
    spilled = [row for row in rows if row["spills"]]
    if _triton_version() >= SPILL_FREE_TRITON:
        failures = [row for row in rows if not row["ok"] or row["spills"] != 0]
    else:
        failures = [row for row in rows if not (row["ok"] or row in spilled)
                    or (row["spills"] or 0) > OLDER_TRITON_SPILL_BYTES]
    assert not failures, json.dumps(failures, indent=1)[:5000]
    assert all(row["registers"] is not None for row in spilled)  # they compiled
    assert proc.returncode == (1 if spilled else 0), proc.stderr[-3000:]
    assert {row["arch"] for row in rows} == {"sm_80", "sm_90"}
    kernels = {row["kernel"] for row in rows}
    assert {"logprobs_fwd_kernel", "logprobs_bwd_kernel", "cross_entropy_fwd_kernel",
            "grpo_fwd_kernel", "scale_kernel", "distill_fwd_kernel",
            "distill_bwd_kernel", "sampled_logprobs_fwd_kernel",
            "sampled_logprobs_bwd_kernel"} <= kernels
    assert all(isinstance(row["registers"], int) and 0 < row["registers"] <= 255 for row in rows)
    for flag in ("ONE_TILE", "WITH_ENTROPY", "HAS_SMOOTHING", "HAS_SOFTCAP", "HAS_LOGIT_SCALE",
                 "HAS_GRAD", "HAS_OLD", "HAS_REF", "KL_RATIO_CORRECTION", "FORWARD_KL", "HARD",
                 "HARD_OWN_STATS"):
        assert any(row["config"].get(flag) is True for row in rows), flag


def test_refuses_under_the_interpreter():
    cmd = [sys.executable, "-m", "astrai_kernels.kernels.triton.compile_check", "--arch", "sm_90"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=subprocess_env(TRITON_INTERPRET="1"), cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "TRITON_INTERPRET" in proc.stderr


def test_run_raises_in_process_under_the_interpreter(monkeypatch):
    from astrai_kernels.kernels.triton import compile_check

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(compile_check.CompileCheckError, match="TRITON_INTERPRET"):
        compile_check.run(("sm_90",))


def test_bad_arch_is_rejected():
    from astrai_kernels.kernels.triton import compile_check

    with pytest.raises(compile_check.CompileCheckError, match="sm_80"):
        compile_check._capability("ampere")


def test_allow_spills_excuses_a_spill_not_a_failed_compile():
    from astrai_kernels.kernels.triton.compile_check import spilled_only

    assert spilled_only({"registers": 128, "spills": 8, "ok": False,
                         "error": "8 bytes of stack/local memory (register spills)"})
    assert not spilled_only({"registers": None, "spills": None, "ok": False,
                             "error": "CompilationError: out of resources"})
    assert not spilled_only({"registers": 96, "spills": 0, "ok": True, "error": None})
