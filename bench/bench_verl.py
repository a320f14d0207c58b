"""verl's actor head and its top-K distillation: astrai-kernels against verl's own paths.

Run it in the venv holding verl (``make test-verl`` builds ``.venv-verl``)::

    .venv-verl/bin/python bench/bench_verl.py [--rows 2048 --hidden 1024 --vocab 32768 151936
                                              --dtype float32 bfloat16 --k 64]

Every case runs in a fresh Python interpreter (``astrai_kernels.bench.step_cases``): one
warm-up call, then the fastest of ``--repeats`` calls and the resident-set high-water mark
above the resident set before the call.

* ``head``: one actor log-prob + entropy forward and backward where the head dominates (the
  hidden states ``[1, rows, H]`` and the LM head ``[V, H]`` as inputs, the backward of
  ``sum(log_probs) + 0.01 * sum(entropy)`` to both): ``astrai`` (verl's ``FusedLinearForPPO``
  with ``impl_backend="astrai"`` after ``install()``), ``verl_torch`` (verl's own ``torch``
  fused backend), ``unfused`` (the logits, then verl's ``logprobs_from_logits`` and
  ``entropy_from_logits``, as its engine's unfused path).
* ``distill``: verl's ``compute_forward_kl_topk`` on the student's logits ``[1, rows, V]``
  with a teacher's top ``k``, forward and the backward of ``sum(distillation_losses)``:
  ``astrai`` (after ``install()``) against ``verl`` (its default ``log_softmax`` path).

``x floor`` is a case's time over a floor measured in the ``astrai`` case's process (fastest
of ``--repeats``): for ``head`` the four matmuls of the shape in its dtype that a fused
forward and backward which recomputes the logits must run (the logits, their recompute in
the backward, ``dlogits @ W``, ``dlogits.T @ h``; verl's ``torch`` backend runs the same
four), in the op's row chunks into buffers allocated before (no first touch); ours skips the
last chunk's recompute (``ops/head.py``'s ``KeptChunk``), so it can run under 1.0. For
``distill`` the floor is a copy of the student's logits into a buffer allocated before (one
read and one write of ``[rows, V]``; both paths read the logits more than once and write
their gradient). ``load`` is the 1-minute load average at each case's start.
"""

import argparse
import json
import os
import sys

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

HEAD_IMPLS = ("unfused", "verl_torch", "astrai")
DISTILL_IMPLS = ("verl", "astrai")
TEMPERATURE = 0.9


def _head_step(impl, rows, hidden_size, vocab, dtype, backend):
    import torch

    from astrai_kernels.integrations import verl as akv

    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, rows, hidden_size, generator=generator) / hidden_size ** 0.5)
    weight = torch.randn(vocab, hidden_size, generator=generator)
    hidden = hidden.to(dtype).requires_grad_(True)
    weight = weight.to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, rows), generator=generator)
    if impl == "unfused":
        from verl.utils import torch_functional as verl_F

        def forward():
            logits = (hidden @ weight.t()) / TEMPERATURE
            return (verl_F.logprobs_from_logits(logits, labels, inplace_backward=False),
                    verl_F.entropy_from_logits(logits))
    else:
        if impl == "astrai":
            akv.install(backend=backend)
        from verl.utils.experimental import torch_functional

        layer = torch_functional.FusedLinearForPPO(
            impl_backend="astrai" if impl == "astrai" else "torch")

        def forward():
            return layer(hidden, weight, labels, TEMPERATURE)

    def step():
        hidden.grad = weight.grad = None
        log_probs, entropy = forward()
        (log_probs.sum() + 0.01 * entropy.float().sum()).backward()

    return step


def _distill_step(impl, rows, vocab, k, dtype, backend):
    import types

    import torch

    from astrai_kernels.integrations import verl as akv

    if impl == "astrai":
        akv.install(backend=backend)
    from verl.trainer.distillation.fsdp import losses

    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(1, rows, vocab, generator=generator) * 3).to(dtype)
    student.requires_grad_(True)
    teacher_log_probs, teacher_ids = torch.log_softmax(
        torch.randn(rows, vocab, generator=generator) * 3, -1).topk(k)
    offsets = torch.tensor([0, rows // 2, rows])
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets)
              for t in (teacher_log_probs, teacher_ids)]
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
        log_prob_min_clamp=-10.0, use_chunked_topk=False))

    def step():
        student.grad = None
        result = losses.compute_forward_kl_topk(student, *nested, config, "thd")
        result["distillation_losses"].sum().backward()

    return step


def _floor_call(kind, rows, hidden, vocab, k, dtype):
    """The floor of the module doc for one case: a function to time."""
    import torch

    from astrai_kernels.ops.head import chunk_rows

    generator = torch.Generator().manual_seed(1)
    if kind == "head":
        hidden_states = (torch.randn(rows, hidden, generator=generator) / hidden ** 0.5).to(dtype)
        weight = torch.randn(vocab, hidden, generator=generator).to(dtype)
        chunk = chunk_rows(rows, vocab, "cpu", hidden=hidden)
        logits = torch.empty(chunk, vocab, dtype=dtype)
        grad_hidden = torch.empty_like(hidden_states)
        grad_weight = torch.zeros_like(weight)

        def matmuls():  # the op's chunks, into buffers written once before: arithmetic alone
            for start in range(0, rows, chunk):
                rows_in = hidden_states[start:start + chunk]
                out = logits[:rows_in.shape[0]]
                torch.mm(rows_in, weight.t(), out=out)
                torch.mm(rows_in, weight.t(), out=out)
                torch.mm(out, weight, out=grad_hidden[start:start + chunk])
                grad_weight.addmm_(out.t(), rows_in)

        matmuls()
        return matmuls
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    copy = torch.empty_like(logits).copy_(logits)
    return lambda: copy.copy_(logits)


def _fastest(call, repeats):
    import time

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def run_case(kind, impl, rows, hidden, vocab, dtype, k, backend, repeats, threads):
    """One case in this process; returns its result dict."""
    import torch

    from astrai_kernels.kernels.registry import resolve_backend

    if threads:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    torch_dtype = getattr(torch, dtype)
    step = (_head_step(impl, rows, hidden, vocab, torch_dtype, backend) if kind == "head"
            else _distill_step(impl, rows, vocab, k, torch_dtype, backend))
    measured = best_of(step, repeats)
    del step
    floor = (_fastest(_floor_call(kind, rows, hidden, vocab, k, torch_dtype), repeats)
             if impl == "astrai" else None)
    import verl

    return {"kind": kind, "impl": impl, "rows": rows, "hidden": hidden, "vocab": vocab,
            "dtype": dtype, "k": k if kind == "distill" else None,
            "backend": resolve_backend(backend, "cpu") if impl == "astrai" else "torch",
            **measured, "floor_seconds": floor, "load_average": load,
            "logits_bytes": rows * vocab * torch.finfo(torch_dtype).bits // 8,
            "threads": torch.get_num_threads(), "verl": verl.__version__}


def format_table(results):
    mib = 1 << 20
    lines = [f"{'case':<8} {'V':>7} {'dtype':<9} {'impl':<11} {'ms':>9} {'x floor':>8} "
             f"{'peak MiB':>9} {'peak/logits':>11} {'x faster':>9} {'x less peak':>11} "
             f"{'load':>5}"]
    for r in results:
        same_case = [b for b in results if (b["kind"], b["vocab"], b["dtype"]) ==
                     (r["kind"], r["vocab"], r["dtype"])]
        base = next(b for b in same_case if b["impl"] in ("verl_torch", "verl"))
        floor = next((b["floor_seconds"] for b in same_case if b.get("floor_seconds")), None)
        over_floor = f"{r['seconds'] / floor:.2f}" if floor else "-"
        faster = times(base["seconds"], r["seconds"])
        unfused = next((b for b in results if b["impl"] == "unfused" and (
            b["kind"], b["vocab"], b["dtype"]) == (r["kind"], r["vocab"], r["dtype"])), base)
        smaller = times(max(unfused["peak_bytes"], 1), max(r["peak_bytes"], 1))
        lines.append(f"{r['kind']:<8} {r['vocab']:>7} {r['dtype']:<9} {r['impl']:<11} "
                     f"{r['seconds'] * 1e3:>9.1f} {over_floor:>8} {r['peak_bytes'] / mib:>9.1f} "
                     f"{r['peak_bytes'] / r['logits_bytes']:>11.2f} {faster:>9} {smaller:>11} "
                     f"{r['load_average']:>5.2f}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--k", type=int, default=64, help="the teacher's top k (distill)")
    parser.add_argument("--kinds", nargs="+", default=["head", "distill"])
    parser.add_argument("--backend", default="auto", help="the astrai op's backend")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    add_step_arguments(parser, repeats=2)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case is not None:
        kind, impl, vocab, dtype = args.case.split(",")
        print(json.dumps(run_case(kind, impl, args.rows, args.hidden, int(vocab), dtype, args.k,
                                  args.backend, args.repeats, args.threads)))
        return
    cases = [(kind, impl, vocab, dtype) for kind in args.kinds for vocab in args.vocab
             for dtype in args.dtype
             for impl in (HEAD_IMPLS if kind == "head" else DISTILL_IMPLS)]
    common = ["--rows", args.rows, "--hidden", args.hidden, "--k", args.k, "--backend",
              args.backend, "--repeats", args.repeats, "--threads", args.threads]
    results = run_in_fresh_processes(
        [os.path.abspath(__file__)],
        [[*common, "--case", ",".join(str(part) for part in case)] for case in cases],
        args.timeout)
    floors = {(r["kind"], r["vocab"], r["dtype"]): r["floor_seconds"] for r in results
              if r.get("floor_seconds")}
    print(f"verl {results[0]['verl']}: {args.rows} tokens, H={args.hidden}, temperature "
          f"{TEMPERATURE}, distill k={args.k}; {args.threads or 'default'} thread(s), best of "
          f"{args.repeats}; peak = RSS high-water above the call's start; 'x faster' against "
          f"verl's fused torch backend (head) or its compute_forward_kl_topk (distill), "
          f"'x less peak' against the unfused path (head) or verl's (distill); 'x floor' over "
          f"the head's four matmuls or a copy of the student's logits (module doc); 'load': "
          f"1-minute load average at the case's start")
    print(format_table(results))
    print("floors (ms): " + ", ".join(f"{kind} V={vocab} {dtype} {seconds * 1e3:.1f}"
                                      for (kind, vocab, dtype), seconds in floors.items()))
    write_results(args.json, results)


if __name__ == "__main__":
    main()
