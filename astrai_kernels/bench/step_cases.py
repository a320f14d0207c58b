"""What the step benchmarks share: the strategies' steps (:mod:`.strategy_steps`),
``bench/bench_transformers.py`` and ``bench/bench_trl.py``.

Each runs every case in a fresh Python interpreter (:func:`run_in_fresh_processes`), so each peak
is its own; inside it, :func:`best_of` times the case: one warm-up call (kernel build/load,
first-touch allocations), then the fastest of ``repeats`` calls (``time.perf_counter``) and the
resident-set high-water mark above the resident set before each call
(:class:`~astrai_kernels.bench.peak.PeakRss`; where it cannot be reset, the first call, without
warm-up, and ``peak_method`` says so). :func:`add_step_arguments`, :func:`write_results` and
:func:`times` are their common command line and output.
"""

import json
import os
import subprocess
import sys
import time

from .peak import PeakRss, child_env
from .runner import ROOT


def best_of(call, repeats):
    """``{"seconds", "peak_bytes", "peak_method"}`` of ``call()`` as the module doc says."""
    meter = PeakRss()
    if meter.resettable:
        call()  # warm-up: loads/builds kernels, first-touch allocations
    seconds, peak = float("inf"), 0
    for _ in range(repeats if meter.resettable else 1):
        meter.start()
        start = time.perf_counter()
        call()
        seconds = min(seconds, time.perf_counter() - start)
        peak = max(peak, meter.extra())
    return {"seconds": seconds, "peak_bytes": peak, "peak_method": meter.method}


def run_in_fresh_processes(command, case_argvs, timeout):
    """For each argument list of ``case_argvs``, ``command + argv`` in a fresh interpreter (this
    checkout first on ``PYTHONPATH``); the JSON object each prints as its last stdout line."""
    results = []
    for argv in case_argvs:
        argv = [str(arg) for arg in argv]
        proc = subprocess.run([sys.executable, *command, *argv], env=child_env(ROOT), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"case {' '.join(argv)} failed:\n{proc.stderr}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def add_step_arguments(parser, repeats):
    """``--repeats``, ``--threads`` (default 1) and ``--json``."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per case (1: repeatable on a shared machine; "
                             "0: torch's default)")
    parser.add_argument("--json", help="also write the results to this file")


def write_results(path, results):
    """The result dicts as JSON at ``path`` (its folder created); nothing when ``path`` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(results, out, indent=2)


def times(numerator, denominator):
    """``numerator / denominator`` as ``"1.23x"``."""
    return f"{numerator / denominator:.2f}x"
