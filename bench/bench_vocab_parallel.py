"""Vocabulary-parallel forward+backward at 2 gloo CPU ranks against one process.

    python bench/bench_vocab_parallel.py [--rows 512] [--vocab 32000] [--hidden 256] [--repeats 3]
    python bench/bench_vocab_parallel.py --rows 2048 --vocab 32768 --hidden 1024  # issue 23
    python bench/bench_vocab_parallel.py --bounds bench/bounds.toml  # make bench-check

Each op (``cross_entropy``, ``token_logprobs`` with entropy, the fused head
``linear_cross_entropy``) runs forward+backward on ``[rows, V]`` logits (``[rows, H]`` hidden
states and a ``[V, H]`` weight) in one process, then with ``process_group=`` on 2 ranks that
each hold half of the vocabulary, one torch thread per process. Reported per op: the fastest
step of ``repeats`` (rank 0; ranks are in lock-step through the collectives), and the bytes
each rank hands to ``all_reduce`` per row, counted by wrapping ``torch.distributed.all_reduce``
(a ring all-reduce of ``b`` bytes sends about ``2 (W - 1) / W * b`` per rank: ``b`` at W = 2).
On logits the sharded op needs two passes (statistics, then the gradient with the group's
log-sum-exp) where the single-process fused op needs one; the fused head with ``reduction``
mean or sum walks its chunks once, combining each chunk's statistics over the group before
writing its gradient. A row costs a few floats on the wire, not a logits row. The DTensor
column is the same step with the shards as DTensors (logits ``Shard(-1)``, the weight
``Shard(0)`` as ColwiseParallel makes it) on a 1-D mesh and no ``process_group=``: what the
front door (``distributed/dtensor.py``) adds over the ``process_group=`` path.

``--bounds`` measures the shape of each ``[[vocab_parallel]]`` entry of the bounds file and
checks, per op, 2 ranks over one process against ``max_ratio``, the DTensor step over the
``process_group=`` step against ``max_dtensor_ratio``, and that a rank's peak resident memory
(what one step adds, ``astrai_kernels/bench/peak.py``) is below one process's; it exits 1 when
one is over.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import astrai_kernels as ak  # noqa: E402
from astrai_kernels.kernels.memory import release_gradient_cache  # noqa: E402
from astrai_kernels.testing.multiprocess import spawn_ranks  # noqa: E402

OPS = ("cross_entropy", "token_logprobs", "linear_cross_entropy")
HIDDEN = 256


def _inputs(rows, vocab, hidden_size=HIDDEN, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    target = torch.randint(0, vocab, (rows,), generator=g)
    hidden = torch.randn(rows, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * hidden_size ** -0.5
    return logits, target, hidden, weight


def _leaf(tensor, mesh, placements):
    """``tensor`` as a leaf requiring grad: a plain tensor, or this rank's shard as a DTensor."""
    if mesh is None:
        return tensor.detach().requires_grad_(True)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(tensor.detach(), mesh, placements,
                              run_check=False).requires_grad_(True)


def _step(op, logits, target, hidden, weight, group, backend, mesh=None):
    from torch.distributed.tensor import Shard

    kwargs = dict(process_group=group if mesh is None else None, backend=backend)
    if op == "cross_entropy":
        x = _leaf(logits, mesh, (Shard(1),))
        ak.cross_entropy(x, target, **kwargs).backward()
    elif op == "token_logprobs":
        x = _leaf(logits, mesh, (Shard(1),))
        logp, entropy = ak.token_logprobs(x, target, return_entropy=True, **kwargs)
        (logp.sum() + entropy.sum()).backward()
    else:
        h, w = hidden.detach().requires_grad_(True), _leaf(weight, mesh, (Shard(0),))
        ak.linear_cross_entropy(h, w, target, **kwargs).backward()


def _time(op, tensors, group, backend, repeats, mesh=None):
    _step(op, *tensors, group, backend, mesh)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        _step(op, *tensors, group, backend, mesh)
        best = min(best, time.perf_counter() - start)
    return best


def _peak_bytes(op, tensors, group, backend, mesh=None):
    """The resident memory one step adds at its peak (after ``_time``'s steps warmed the
    gradient cache; a gradient it serves counts as a fresh one, ``bench/peak.py``). The caller
    releases the cache before each op's steps: blocks another op left there would count."""
    from astrai_kernels.bench.peak import PeakRss

    peak = PeakRss()
    peak.start()
    _step(op, *tensors, group, backend, mesh)
    return peak.extra()


def _sharded_worker(rank, world_size, rows, vocab, hidden_size, repeats, backend):
    from astrai_kernels.bench.peak import fix_mmap_threshold

    fix_mmap_threshold()
    torch.set_num_threads(1)
    logits, target, hidden, weight = _inputs(rows, vocab, hidden_size)
    bounds = [vocab * r // world_size for r in range(world_size + 1)]
    shard = slice(bounds[rank], bounds[rank + 1])
    tensors = (logits[:, shard].contiguous(), target, hidden, weight[shard].contiguous())
    sent = {"bytes": 0}
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for op in OPS:
        release_gradient_cache()
        seconds = _time(op, tensors, dist.group.WORLD, backend, repeats)
        peak_bytes = _peak_bytes(op, tensors, dist.group.WORLD, backend)
        dtensor_seconds = _time(op, tensors, dist.group.WORLD, backend, repeats, mesh)
        dist.all_reduce = counting_all_reduce
        sent["bytes"] = 0
        _step(op, *tensors, dist.group.WORLD, backend)
        dist.all_reduce = all_reduce
        # the fused head also all-reduces the hidden states' gradient ([rows, H] floats)
        results[op] = {"seconds": seconds, "dtensor_seconds": dtensor_seconds,
                       "peak_bytes": peak_bytes,
                       "allreduce_bytes_per_row": sent["bytes"] / rows}
    return results


def measure(rows, vocab, hidden, repeats, backend):
    """``(single, sharded)``: per op the one-process seconds and peak bytes a step adds, and rank
    0's results at 2 ranks."""
    from astrai_kernels.bench.peak import fix_mmap_threshold

    fix_mmap_threshold()
    tensors = _inputs(rows, vocab, hidden)
    single = {}
    for op in OPS:
        release_gradient_cache()
        single[op] = {"seconds": _time(op, tensors, None, backend, repeats),
                      "peak_bytes": _peak_bytes(op, tensors, None, backend)}
    sharded = spawn_ranks(_sharded_worker, 2, (rows, vocab, hidden, repeats, backend),
                          timeout=900.0)[0]
    return single, sharded


VOCAB_PARALLEL_KEYS = {"op", "backend", "rows", "vocab", "hidden", "max_ratio",
                       "max_dtensor_ratio"}


def vocab_parallel_bounds(path):
    """The ``[[vocab_parallel]]`` entries of a bounds file, each checked for its keys."""
    from astrai_kernels.bench.check import read_toml

    entries = read_toml(path).get("vocab_parallel", [])
    for index, entry in enumerate(entries, 1):
        if set(entry) != VOCAB_PARALLEL_KEYS or entry["op"] not in OPS:
            raise SystemExit(f"{path}: vocab_parallel {index} must have exactly the keys "
                             f"{sorted(VOCAB_PARALLEL_KEYS)} and op one of {OPS}, got {entry}")
    return entries


def check(path, repeats):
    """Measure every ``[[vocab_parallel]]`` shape once; True when every ratio is in bound."""
    entries, measured, ok = vocab_parallel_bounds(path), {}, True
    for entry in entries:
        shape = (entry["rows"], entry["vocab"], entry["hidden"], entry["backend"])
        if shape not in measured:
            measured[shape] = measure(*shape[:3], repeats, shape[3])
        single, sharded = measured[shape]
        result, one = sharded[entry["op"]], single[entry["op"]]
        ratio = result["seconds"] / one["seconds"]
        dtensor_ratio = result["dtensor_seconds"] / result["seconds"]
        # the rule, no bound to set: a rank's peak must fall below one process's
        memory_ratio = result["peak_bytes"] / one["peak_bytes"]
        over = (ratio > entry["max_ratio"] or dtensor_ratio > entry["max_dtensor_ratio"]
                or memory_ratio >= 1.0)
        ok = ok and not over
        print(f"{'OVER' if over else 'ok':<5}{entry['op']:<22} N={shape[0]} V={shape[1]} "
              f"H={shape[2]} {shape[3]}: 2 ranks / 1 process {ratio:.2f}x "
              f"(max {entry['max_ratio']}), DTensor / process_group {dtensor_ratio:.2f}x "
              f"(max {entry['max_dtensor_ratio']}), peak memory per rank / 1 process "
              f"{memory_ratio:.2f}x ({result['peak_bytes'] / 2**20:.0f} / "
              f"{one['peak_bytes'] / 2**20:.0f} MiB, < 1)")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--bounds", help="check the [[vocab_parallel]] entries of this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.bounds:
        sys.exit(0 if check(args.bounds, args.repeats) else 1)
    single, sharded = measure(args.rows, args.vocab, args.hidden, args.repeats, args.backend)
    print(f"rows={args.rows} V={args.vocab} H={args.hidden} fp32, 1 thread per process, "
          f"backend={args.backend}")
    print(f"{'op':<22}{'1 process s':>13}{'2 ranks s':>11}{'DTensor s':>11}"
          f"{'DTensor/pg':>12}{'peak MiB 1 / rank':>19}{'all_reduce B/row/rank':>24}")
    for op in OPS:
        result = sharded[op]
        peaks = f"{single[op]['peak_bytes'] / 2**20:.0f} / {result['peak_bytes'] / 2**20:.0f}"
        print(f"{op:<22}{single[op]['seconds']:>13.4f}{result['seconds']:>11.4f}"
              f"{result['dtensor_seconds']:>11.4f}"
              f"{result['dtensor_seconds'] / result['seconds']:>11.2f}x{peaks:>19}"
              f"{result['allreduce_bytes_per_row']:>24.0f}")
    print(json.dumps({"single": single, "two_ranks": sharded}))


if __name__ == "__main__":
    main()
