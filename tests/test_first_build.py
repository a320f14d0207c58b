"""The first use of the cpp backend: a build that says what it is doing, on stderr.

``test_cold_build_reports_then_warm_runs_are_silent`` is the suite's one real build in a fresh
directory (minutes; ``make setup`` builds the shared cache so that no other test pays for one).
The other tests fake the compiler or ``cpp_extension.load`` and take seconds.
"""

import fcntl
import json
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

import astrai_kernels.kernels.cpp.backend as cb

from cases import subprocess_env

CPP_SOURCES = [name for name in cb.SOURCES if name.endswith(".cpp")]
STEPS = len(CPP_SOURCES) + 1  # each source compiled, then the library linked
PREFIX = "astrai_kernels: "
PROGRESS = re.compile(r"\[(\d+)/(\d+)\] (compiled|linked) (\S+) \((\d+) s\)")
STILL = re.compile(r"still compiling: \d+ of \d+ steps done after \d+ s")

_OP_CALL = r"""
import json, warnings
import torch
import torch.nn.functional as F
import astrai_kernels as ak
from astrai_kernels.kernels.registry import resolve_backend

gen = torch.Generator().manual_seed(0)
logits = torch.randn(5, 37, generator=gen)
target = torch.randint(0, 37, (5,), generator=gen)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    losses = [ak.cross_entropy(logits, target).item() for _ in range(2)]
    backend = resolve_backend("auto", "cpu")
print(json.dumps({"losses": losses, "want": F.cross_entropy(logits, target).item(),
                  "backend": backend,
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}))
"""


def _run(args, build_dir, **env):
    child_env = subprocess_env(ASTRAI_KERNELS_BUILD_DIR=str(build_dir), OMP_NUM_THREADS="1",
                               **env)
    child_env.pop("ASTRAI_KERNELS_BACKEND", None)
    return subprocess.run([sys.executable, *args], env=child_env, capture_output=True, text=True,
                          timeout=1800)


def _build_lines(stderr):
    """The loader's lines on stderr, without their prefix."""
    return [line[len(PREFIX):] for line in stderr.splitlines() if line.startswith(PREFIX)]


def _assert_start_line(line, build_dir):
    assert line.startswith("compiling the cpp backend's C++ kernels once (a few minutes"), line
    assert f"in {build_dir};" in line and "ASTRAI_KERNELS_BACKEND=torch" in line, line


def test_cold_build_reports_then_warm_runs_are_silent(tmp_path):
    build_dir = tmp_path / "build"
    cold = _run(["-m", "astrai_kernels", "build"], build_dir)
    assert cold.returncode == 0, cold.stderr
    lines = _build_lines(cold.stderr)
    _assert_start_line(lines[0], build_dir)
    progress = [PROGRESS.fullmatch(line) for line in lines[1:-1] if not STILL.fullmatch(line)]
    assert all(progress), lines
    assert [int(m[1]) for m in progress] == list(range(1, STEPS + 1)), lines
    assert {int(m[2]) for m in progress} == {STEPS}
    assert sorted(m[4] for m in progress if m[3] == "compiled") == sorted(CPP_SOURCES)
    library = build_dir / progress[-1][4]
    assert progress[-1][3] == "linked" and library.suffix == ".so", lines
    built = re.fullmatch(r"built the C\+\+ kernels in ([\d.]+) s: (\S+)", lines[-1])
    assert built and Path(built[2]) == library, lines
    assert library.is_file() and library.with_suffix(".complete").is_file()
    stdout = re.fullmatch(r"cpp backend: (\S+) \(built in \d+ s; kernels use "
                          r"(generic|avx2|avx512)\)\n", cold.stdout)
    assert stdout and Path(stdout[1]) == library, cold.stdout

    warm_build = _run(["-m", "astrai_kernels", "build"], build_dir)
    assert warm_build.returncode == 0, warm_build.stderr
    assert _build_lines(warm_build.stderr) == [] and "compil" not in warm_build.stderr
    assert re.fullmatch(rf"cpp backend: {re.escape(str(library))} \(already built, loaded in "
                        r"[\d.]+ s; kernels use \w+\)\n", warm_build.stdout), warm_build.stdout

    warm_call = _run(["-c", _OP_CALL], build_dir)
    assert warm_call.returncode == 0, warm_call.stderr
    assert _build_lines(warm_call.stderr) == [] and "compil" not in warm_call.stderr
    result = json.loads(warm_call.stdout)
    assert result["backend"] == "cpp" and result["warnings"] == []
    assert all(abs(loss - result["want"]) < 1e-5 for loss in result["losses"])


def _fake_compiler(tmp_path, refuses):
    """A ``$CXX`` that answers the version probes like g++ unless ``refuses == "probe"``, and
    never compiles; it says so on stderr, as a compiler's error."""
    script = tmp_path / "fake-c++"
    probe = "" if refuses == "probe" else (
        'case "$1" in\n'
        '  -v) echo "gcc version 13.2.0 (fake)" >&2; exit 0;;\n'
        '  --version|-dumpversion|-dumpfullversion) echo 13.2.0; exit 0;;\n'
        'esac\n')
    script.write_text(f"#!/bin/sh\n{probe}"
                      "echo \"fake-c++: error: this compiler refuses to work (the test's)\" >&2\n"
                      "exit 1\n")
    script.chmod(0o755)
    return script


def test_failed_build_exits_1_with_the_compilers_error_and_auto_falls_back(tmp_path):
    for refuses in ("probe", "compile"):  # cpp_extension's -v probe, or ninja's compile steps
        compiler = _fake_compiler(tmp_path, refuses)
        build_dir = tmp_path / f"build-{refuses}"
        failed = _run(["-m", "astrai_kernels", "build"], build_dir, CXX=str(compiler))
        assert failed.returncode == 1, failed.stderr
        assert failed.stdout == ""
        lines = _build_lines(failed.stderr)
        assert len(lines) == 2, failed.stderr
        _assert_start_line(lines[0], build_dir)
        assert re.fullmatch(r"compiling the C\+\+ kernels failed after [\d.]+ s: fake-c\+\+: "
                            r"error: this compiler refuses to work \(the test's\)", lines[1])
        assert f"build: building the cpp backend extension in {build_dir} failed" in failed.stderr
        assert failed.stderr.count("fake-c++: error:") >= 2  # the outcome line and the output
        assert "build: without it, backend='auto' runs CPU tensors on the slower torch backend" \
            in failed.stderr

        fallback = _run(["-c", _OP_CALL], tmp_path / f"call-{refuses}", CXX=str(compiler))
        assert fallback.returncode == 0, fallback.stderr
        result = json.loads(fallback.stdout)
        assert result["backend"] == "torch"
        assert all(abs(loss - result["want"]) < 1e-5 for loss in result["losses"])
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "the cpp backend is unavailable (building the cpp backend extension" \
            in result["warnings"][0] and "'torch' backend" in result["warnings"][0]
        lines = _build_lines(fallback.stderr)  # tried once, not on every call
        assert len(lines) == 2 and "failed after" in lines[1], fallback.stderr
        _assert_start_line(lines[0], tmp_path / f"call-{refuses}")


def test_progress_names_each_output_and_speaks_up_when_quiet(tmp_path, monkeypatch, capsys):
    """The reporter alone, around a stand-in for ``cpp_extension.load`` that writes the outputs
    ninja would, slowly: a line per output, in order, and a "still compiling" line between."""
    monkeypatch.setattr(cb.BuildProgress, "POLL_S", 0.01)
    monkeypatch.setattr(cb.BuildProgress, "QUIET_S", 0.2)
    name = "astrai_kernels_cpp_test"
    (tmp_path / "grpo.o").write_bytes(b"left by a killed build")  # rewritten: counted

    def slow_load(**kwargs):
        build_dir = Path(kwargs["build_directory"])
        time.sleep(0.5)
        for source in kwargs["sources"]:
            (build_dir / f"{Path(source).stem}.o").write_bytes(b"object")
            time.sleep(0.05)
        (build_dir / f"{name}.so").write_bytes(b"library")
        return types.SimpleNamespace(__file__=str(build_dir / f"{name}.so"))

    monkeypatch.setattr(cpp_extension, "load", slow_load)
    module = cb._build(cb.source_dir(), tmp_path, name, verbose=False)
    lines = _build_lines(capsys.readouterr().err)
    _assert_start_line(lines[0], tmp_path)
    assert STILL.fullmatch(lines[1]), lines
    assert lines[1].startswith(f"still compiling: 0 of {STEPS} steps done"), lines
    progress = [PROGRESS.fullmatch(line) for line in lines[2:-1] if not STILL.fullmatch(line)]
    assert [(m[1], m[3], m[4]) for m in progress] == (
        [(str(k), "compiled", s) for k, s in enumerate(CPP_SOURCES, 1)]
        + [(str(STEPS), "linked", f"{name}.so")]), lines
    assert lines[-1].startswith("built the C++ kernels in ") and module.__file__ in lines[-1]
    assert (tmp_path / f"{name}.complete").is_file()


def test_a_build_in_progress_elsewhere_is_waited_for_out_loud(tmp_path, capsys):
    with open(tmp_path / "astrai_build.lock", "a+") as other_process:
        fcntl.flock(other_process.fileno(), fcntl.LOCK_EX)  # a second open file: a second holder
        release = threading.Timer(0.5, fcntl.flock, (other_process.fileno(), fcntl.LOCK_UN))
        release.start()
        started = time.perf_counter()
        with cb.process_lock(tmp_path):
            waited = time.perf_counter() - started
        release.join()
    assert waited >= 0.4
    assert _build_lines(capsys.readouterr().err) == [
        f"another process is compiling the C++ kernels in {tmp_path}; waiting for it"]
