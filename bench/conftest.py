"""pytest-benchmark suite options: the same cases as ``astrai-kernels bench``.

Options (or the environment variables in brackets, handy with ``make bench-pytest``):

  --bench-rows N          token rows (default 4096) [ASTRAI_BENCH_ROWS]
  --bench-vocab V[,V..]   vocabulary sizes, k = 1024 (default 32768) [ASTRAI_BENCH_VOCAB]
  --bench-dtypes D[,D..]  fp32, bf16, fp16 (default fp32,bf16) [ASTRAI_BENCH_DTYPES]
  --bench-backends B,..   kernel backends, NAME:inplace for inplace_backward=True (default: the
                          available ones except reference, triton only on CUDA, and the first
                          again as NAME:inplace) [ASTRAI_BENCH_BACKENDS]
  --bench-ops OP,..       token_logprobs, cross_entropy, grpo (default), linear_cross_entropy,
                          linear_token_logprobs, linear_grpo [ASTRAI_BENCH_OPS]
  --bench-hidden H        the linear ops' hidden size (default 1024) [ASTRAI_BENCH_HIDDEN]
  --bench-no-compile      skip the torch.compile baseline [ASTRAI_BENCH_NO_COMPILE=1]
  --bench-no-memory       skip the per-case peak-memory subprocess [ASTRAI_BENCH_NO_MEMORY=1]
  --bench-rounds K        timed rounds per case after one warm-up (default 3)
                          [ASTRAI_BENCH_ROUNDS]
  --bench-device DEV      cpu or cuda (default: cuda if available) [ASTRAI_BENCH_DEVICE]

Each case's ``extra_info`` (kept in ``--benchmark-json`` and ``--benchmark-save``) holds the same
figures as the CLI's JSON: the same-run copy time and floor, the ratios against the copy floor
(linear ops: against the GEMM floor case) and against the baselines of the same session, and
the peak extra memory measured in a process of its own (``astrai_kernels.bench``).
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPTIONS = {
    # option: (env var, default, help)
    "rows": ("ASTRAI_BENCH_ROWS", "4096", "token rows N"),
    "vocab": ("ASTRAI_BENCH_VOCAB", "32768", "vocabulary sizes, comma-separated"),
    "dtypes": ("ASTRAI_BENCH_DTYPES", "fp32,bf16", "dtypes, comma-separated"),
    "backends": ("ASTRAI_BENCH_BACKENDS", "", "kernel backends (default: the available ones)"),
    "ops": ("ASTRAI_BENCH_OPS", "token_logprobs,cross_entropy,grpo", "ops, comma-separated"),
    "hidden": ("ASTRAI_BENCH_HIDDEN", "1024", "hidden size H of the linear ops"),
    "rounds": ("ASTRAI_BENCH_ROUNDS", "3", "timed rounds per case"),
    "device": ("ASTRAI_BENCH_DEVICE", "", "cpu or cuda"),
}
FLAGS = {
    "no-compile": ("ASTRAI_BENCH_NO_COMPILE", "skip the torch.compile baseline"),
    "no-memory": ("ASTRAI_BENCH_NO_MEMORY", "skip the peak-memory subprocess per case"),
}


def pytest_addoption(parser):
    group = parser.getgroup("astrai-kernels benchmarks")
    for name, (env, default, text) in OPTIONS.items():
        group.addoption(f"--bench-{name}", default=None,
                        help=f"{text} (env {env}; default {default or 'auto'})")
    for name, (env, text) in FLAGS.items():
        group.addoption(f"--bench-{name}", action="store_true", default=False,
                        help=f"{text} (env {env}=1)")


def bench_settings(config):
    """The suite's settings from the options and environment."""
    import torch

    from astrai_kernels.bench import cases as bc
    from astrai_kernels.cli import _split, parse_size
    from astrai_kernels.kernels.registry import available_backends

    def value(name):
        env, default, _ = OPTIONS[name]
        given = config.getoption(f"--bench-{name}")
        return given if given is not None else os.environ.get(env, default)

    def flag(name):
        return bool(config.getoption(f"--bench-{name}")) or os.environ.get(
            FLAGS[name][0], "") not in ("", "0")

    device = value("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    backends = _split(value("backends"))
    if not backends:
        backends = [b for b in available_backends(device) if b != "reference"]
        if not cuda:
            backends = [b for b in backends if b != "triton"]  # never time the interpreter
        if backends:  # the preferred backend also with inplace_backward=True
            backends.append(backends[0] + bc.INPLACE_SUFFIX)
    missing = bc.unavailable_baselines()
    baselines = [b for b in bc.BASELINES
                 if not (b == "compile" and flag("no-compile")) and b not in missing]
    return {
        "device": device,
        "rows": parse_size(value("rows")),
        "vocabs": [parse_size(v) for v in _split(value("vocab"))],
        "hidden": parse_size(value("hidden")),
        "dtypes": [bc.normalize_dtype(d) for d in _split(value("dtypes"))],
        "ops": [op for op in _split(value("ops")) if op in bc.TENSOR_OPS],
        "methods": baselines + backends,
        "rounds": int(value("rounds")),
        "memory": not flag("no-memory"),
    }


def pytest_generate_tests(metafunc):
    if "bench_case" not in metafunc.fixturenames and "copy_case" not in metafunc.fixturenames:
        return
    settings = bench_settings(metafunc.config)
    if "bench_case" in metafunc.fixturenames:
        from astrai_kernels.bench import cases as bc

        cases = [(op, method, dtype, vocab) for op in settings["ops"]
                 for dtype in settings["dtypes"] for vocab in settings["vocabs"]
                 for method in settings["methods"] if bc.method_applies(op, method)]
        ids = [f"{op}-{method}-{dtype}-N{settings['rows']}-V{vocab}"
               for op, method, dtype, vocab in cases]
        metafunc.parametrize("bench_case", cases, ids=ids)
    else:
        cases = [(dtype, vocab) for dtype in settings["dtypes"] for vocab in settings["vocabs"]]
        ids = [f"{dtype}-N{settings['rows']}-V{vocab}" for dtype, vocab in cases]
        metafunc.parametrize("copy_case", cases, ids=ids)


@pytest.fixture(scope="session")
def settings(pytestconfig):
    return bench_settings(pytestconfig)


@pytest.fixture(scope="session")
def medians():
    """Median seconds of the cases run so far: ``{(op, dtype, rows, vocab): {method: s}}``."""
    return {}


@pytest.fixture(scope="session")
def case_runner():
    from astrai_kernels.bench.runner import CaseRunner

    with CaseRunner("forkserver", timeout=600) as runner:
        yield runner


def pytest_configure(config):
    # torch.compile imports torch.jit pieces that warn on import; not this suite's concern.
    config.addinivalue_line("filterwarnings",
                            "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
