"""pytest-benchmark cases: each op's forward+backward for every backend and baseline, and the
same-run ``copy_`` of the logits (the 2 S floor of the logits ops, by the rule of
``astrai_kernels.bench.measure.CopyFloor``; the linear ops' floor is their ``gemm`` case).

Run ``make bench-pytest`` (``pytest bench --benchmark-only``); compare runs with
pytest-benchmark's own tools (``--benchmark-save``, ``--benchmark-compare``,
``pytest-benchmark compare``). Sizes and methods: see ``bench/conftest.py``. The case
definitions (inputs, the naive and fused calls) are ``astrai_kernels.bench``'s, the same
as ``astrai-kernels bench``; this file only times them with pytest-benchmark, in this process,
and adds the peak memory measured in a process of its own per case.
"""

import os

import torch

from astrai_kernels.bench import cases as bc
from astrai_kernels.bench.measure import COPIES_PER_CALL, MIN_COPIES, CopyFloor, build_workload


def _sync(device):
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def _group(op, dtype, rows, vocab):
    return f"{op} {dtype} N={rows} V={vocab}"


def test_copy_floor(benchmark, copy_case, settings):
    """``dst.copy_(logits)`` of one logits tensor into a buffer allocated and first touched as
    an op's gradient (``CopyFloor``): 2 S bytes moved."""
    dtype, vocab = copy_case
    device, rows = settings["device"], settings["rows"]
    src = torch.randn(rows, vocab, device=device).to(bc.torch_dtype(dtype))
    floor = CopyFloor(src, str(device).startswith("cuda"))
    benchmark.group = f"copy {dtype} N={rows} V={vocab}"
    benchmark.extra_info.update({"logits_bytes": src.numel() * src.element_size(),
                                 "bytes_moved": 2 * src.numel() * src.element_size()})
    benchmark.pedantic(floor.sample, args=(1,), rounds=max(MIN_COPIES, settings["rounds"]),
                       warmup_rounds=0, iterations=1)


def test_op(benchmark, bench_case, settings, medians, case_runner):
    """One op x method: forward+backward (GRPO: one step), peak memory in its own process."""
    op, method, dtype, vocab = bench_case
    rows, device = settings["rows"], settings["device"]
    hidden = settings["hidden"] if op in bc.LINEAR_OPS else 0
    case = bc.Case(op, method, rows, vocab, dtype, device, repeats=1, min_repeats=1,
                   hidden=hidden)
    extra = {"op": op, "method": method, "rows": rows, "vocab": vocab, "dtype": dtype,
             "device": device, "hidden": hidden}
    if settings["memory"]:
        measured = case_runner.run(case, with_copy=False)
        if "error" in measured:
            raise RuntimeError(f"peak-memory process for {case.label()} failed: "
                               f"{measured['error']}")
        extra.update({"peak_extra_bytes": measured["peak_extra_bytes"],
                      "peak_extra_over_logits": measured["peak_extra_bytes"]
                      / measured["logits_bytes"],
                      "peak_method": measured["peak_method"]})
    torch.set_num_threads(os.cpu_count() or 1)
    workload = build_workload(case)
    sync = _sync(device)
    floor = (CopyFloor(workload.copy_source, str(device).startswith("cuda"))
             if workload.copy_source is not None else None)

    def run():
        workload.run()
        sync()

    def between_rounds():
        workload.reset()
        if floor is not None:  # the floor's copies between the op's calls, as `bench` times them
            floor.sample(COPIES_PER_CALL)

    run()  # warm-up: kernel build/load, torch.compile
    workload.reset()
    benchmark.group = _group(op, dtype, rows, vocab)
    benchmark.pedantic(run, setup=between_rounds, rounds=settings["rounds"], warmup_rounds=0,
                       iterations=1)
    workload.reset()
    median = benchmark.stats.stats.median
    same = medians.setdefault((op, dtype, rows, vocab), {})
    same[method] = median
    extra.update({"logits_bytes": workload.logits_bytes, **workload.info})
    if floor is not None:  # logits ops: the same-run copy floor
        floor.sample(MIN_COPIES - len(floor.times))
        copy = floor.result()
        floor_s = copy["copy_s"] * workload.floor_bytes / (2 * workload.logits_bytes)
        extra.update({"floor_bytes": workload.floor_bytes, "copy_s": copy["copy_s"],
                      "copy_kind": copy["copy_kind"], "floor_s": floor_s,
                      "ratio_vs_copy": median / floor_s,
                      "effective_bandwidth_GBps": workload.floor_bytes / median / 1e9})
    for base in bc.BASELINES:
        if base in same:
            extra[f"ratio_vs_{base}"] = median / same[base]
    plain = medians.get((bc.PLAIN_OP.get(op), dtype, rows, vocab), {}).get(method)
    if plain:  # the op without its option, same method, timed earlier in this session
        extra["ratio_vs_plain"] = median / plain
    benchmark.extra_info.update(extra)

