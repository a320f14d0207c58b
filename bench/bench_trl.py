"""The LM heads TRL 1.16 trains with, against ours, forward + backward in the same run.

Cases (each in a fresh Python subprocess, so each peak is its own):

* ``trl_logprob``: ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` (log-probs and
  entropy, TRL's default tile), the head ``add_fused_lm_head`` installs;
* ``ak_logprob``: ``ak.linear_token_logprobs(..., return_entropy=True)``, what
  ``astrai_kernels.integrations.trl.install`` runs in its place;
* ``trl_divergence``: ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (generalized
  JSD, DistillationTrainer's head);
* ``ak_distill``: ``ak.linear_distill_loss`` (same divergence, ``reduction="sum"``).

A run is the forward and ``backward()`` of the summed log-probs and entropy (or divergence)
of ``N`` rows, hidden ``H``, vocabulary ``V``, float32; after one warm-up run, ``seconds`` is
the fastest of ``repeats`` runs, ``peak_bytes`` the resident-set high-water mark during a run
above the resident set before it (``astrai_kernels.bench.peak``); ``gemm_floor_seconds`` is
the time of the three ``[N, H] x [H, V]``-sized matmuls of a forward + backward (the
divergence's floor is four of them: both heads' logits, the student's two gradients).
Not a per-trainer-step benchmark: the trainers' steps are not measured here.

    python bench/bench_trl.py                      # N=2048, H=1024, V=32768, 1 thread
    python bench/bench_trl.py --rows 256 --vocab 4096 --hidden 128   # a quick look
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

from astrai_kernels.bench.step_cases import (  # noqa: E402
    add_step_arguments,
    best_of,
    run_in_fresh_processes,
    times,
    write_results,
)

CASES = ("trl_logprob", "ak_logprob", "trl_divergence", "ak_distill")


def _inputs(rows, hidden, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(rows, hidden, generator=g)).requires_grad_(True)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).requires_grad_(True)
    teacher = torch.randn(rows, hidden, generator=g)
    teacher_weight = torch.randn(vocab, hidden, generator=g) * hidden ** -0.5
    target = torch.randint(0, vocab, (rows,), generator=g)
    return student, weight, teacher, teacher_weight, target


def run_case(case, rows=2048, hidden=1024, vocab=32768, repeats=2, threads=1, seed=0):
    """One case in this process; returns its result dict."""
    import torch
    import trl

    import astrai_kernels as ak

    if threads:
        torch.set_num_threads(threads)
    student, weight, teacher, teacher_weight, target = _inputs(rows, hidden, vocab, seed)

    def run():
        if case == "trl_logprob":
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                student, weight, None, target, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                ("log_probs", "entropy"))
            (logp.sum() + entropy.sum()).backward()
        elif case == "ak_logprob":
            logp, entropy = ak.linear_token_logprobs(student, weight, target,
                                                     return_entropy=True)
            (logp.sum() + entropy.sum()).backward()
        elif case == "trl_divergence":
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

            divergence, _ = ChunkedDivergenceFunction.apply(
                student, weight, None, teacher, teacher_weight, None, 0.5, 1.0)
            divergence.sum().backward()
        else:
            ak.linear_distill_loss(student, weight, teacher, teacher_weight, beta=0.5,
                                   reduction="sum").backward()
        student.grad = weight.grad = None

    def gemm_floor():
        with torch.no_grad():
            logits = student @ weight.t()
            logits @ weight
            logits.t() @ student

    measured = best_of(run, repeats)
    floor = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gemm_floor()
        floor = min(floor, time.perf_counter() - start)
    return {"case": case, "rows": rows, "hidden": hidden, "vocab": vocab, **measured,
            "gemm_floor_seconds": floor, "threads": torch.get_num_threads(),
            "trl": trl.__version__}


def run_all(cases=CASES, timeout=1800, **shape):
    """Each case in a fresh subprocess; a list of result dicts."""
    options = [item for name, value in shape.items()
               for item in (f"--{name.replace('_', '-')}", value)]
    return run_in_fresh_processes([os.path.abspath(__file__)],
                                  [["--case", case, *options] for case in cases], timeout)


def format_table(results):
    mib = 1 << 20
    by_case = {r["case"]: r for r in results}
    lines = [f"{'case':<15} {'seconds':>9} {'x floor':>8} {'peak MiB':>9} {'TRL/this time':>13} "
             f"{'TRL/this peak':>13}"]
    for r in results:
        trl_case = {"ak_logprob": "trl_logprob", "ak_distill": "trl_divergence"}.get(r["case"])
        base = by_case.get(trl_case)
        time_ratio = times(base["seconds"], r["seconds"]) if base else ""
        peak_ratio = times(base["peak_bytes"], max(r["peak_bytes"], 1)) if base else ""
        # the divergence has four matmuls (both heads' logits, the student's two gradients)
        floor = r["gemm_floor_seconds"] * (4 / 3 if r["case"] in ("trl_divergence",
                                                                 "ak_distill") else 1)
        lines.append(f"{r['case']:<15} {r['seconds']:>9.3f} {r['seconds'] / floor:>8.2f} "
                     f"{r['peak_bytes'] / mib:>9.1f} {time_ratio:>13} {peak_ratio:>13}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    add_step_arguments(parser, repeats=2)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, repeats=args.repeats,
                 threads=args.threads)
    if args.case is not None:
        print(json.dumps(run_case(args.case, **shape)))
        return
    results = run_all(**shape)
    print(f"TRL {results[0]['trl']} heads vs astrai-kernels, N={args.rows}, H={args.hidden}, "
          f"V={args.vocab}, float32, forward + backward, {args.threads or 'default'} "
          f"thread(s), best of {args.repeats}; peak = RSS high-water above the run's start; "
          f"x floor: time over the matmuls' (4 for the divergence)")
    print(format_table(results))
    write_results(args.json, results)


if __name__ == "__main__":
    main()
