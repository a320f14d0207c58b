"""Measuring one case in this process: its time, its peak extra memory and, for the logits
ops, the same-run copy floor.

How (:func:`measure`; :mod:`astrai_kernels.bench.runner` gives each case a process of its own,
so each peak is its own):

1. ``torch.set_num_threads(os.cpu_count())`` (or ``threads``); inputs allocated (seeded).
2. One warm-up call (kernel build/load, ``torch.compile``, first-touch allocations).
3. Peak reset (:class:`~astrai_kernels.bench.peak.PeakRss` on CPU;
   ``torch.cuda.reset_peak_memory_stats`` and ``memory_allocated`` as the baseline on CUDA).
4. ``repeats`` timed calls (``time.perf_counter``, CUDA synchronized), gradients dropped between
   calls (outside the timed region; a fresh gradient is allocated, and first touched, by each
   call as in training). Fewer calls when the timed calls would exceed ``budget_s`` (at least
   ``min_repeats``); ``repeats`` in the result says how many ran. ``median_s`` is their median.
5. ``peak_extra_bytes``: the peak over those calls above the baseline: everything the op
   allocates, the gradients included (``peak_method`` says how it was read).
6. Logits ops, the same-run copy (:func:`measure_copy`): ``dst.copy_(logits)`` (CPU;
   ``logits.clone()`` on CUDA) of the same logits tensor, ``2 S`` bytes;
   ``floor_s = copy_s * floor_bytes / (2 S)``. The linear ops' floor is the ``gemm`` case of the
   same shape instead (:mod:`astrai_kernels.bench.linear`; ratios in
   :func:`astrai_kernels.bench.report.add_ratios`).
"""

import functools
import gc
import os
import statistics
import time
from dataclasses import asdict

from .cases import BASELINES, LINEAR_OPS, split_method
from .linear import build_linear_workload
from .logits import build_logits_workload
from .peak import PeakRss, fix_mmap_threshold


def build_workload(case):
    """Inputs and the call of ``case`` (on ``case.device``): a logits op's or a linear op's."""
    if case.op in LINEAR_OPS:
        return build_linear_workload(case)
    return build_logits_workload(case)


def measure(case, with_copy=True):
    """Time and peak memory of one case in this process (see the module doc); a result dict."""
    import torch

    fix_mmap_threshold()
    torch.set_num_threads(case.threads or os.cpu_count() or 1)
    cuda = torch.device(case.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    workload = build_workload(case)
    meter = None if cuda else PeakRss()

    def call():
        start = time.perf_counter()
        workload.run()
        sync()
        elapsed = time.perf_counter() - start
        workload.reset()
        return elapsed

    def start_peak():
        if cuda:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return meter.start()

    if cuda or meter.resettable:  # warm-up, then the peak over the timed calls
        warmup_s = call()
        baseline = start_peak()
    else:  # the high-water mark cannot be reset: the peak of the first call is measured
        start_peak()
        warmup_s = call()
        peak = meter.extra()
    times = []
    for _ in range(max(1, case.repeats)):
        times.append(call())
        if len(times) >= case.min_repeats and sum(times) + times[-1] > case.budget_s:
            break
    if cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    elif meter.resettable:
        peak = meter.extra()
    name, inplace = split_method(case.method)
    result = {
        **asdict(case),
        **({"baseline": name} if name in BASELINES else
           {"backend": name, "inplace_backward": inplace}),
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": times,
        "repeats": len(times),
        "warmup_s": warmup_s,
        "threads": torch.get_num_threads(),
        "logits_bytes": workload.logits_bytes,
        "peak_extra_bytes": int(peak),
        "peak_method": "torch.cuda.max_memory_allocated" if cuda else meter.method,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **workload.info,
    }
    if workload.floor_bytes is not None:
        result["floor_bytes"] = workload.floor_bytes
    if with_copy and workload.copy_source is not None:
        result.update(measure_copy(workload.copy_source, max(5, case.repeats), cuda))
    return result


def measure_copy(logits, repeats=5, cuda=False):
    """``{"copy_s", "copy_kind", "copy_times_s", ...}``: the same-run copy of ``logits``
    (2 S bytes), at least ``repeats`` copies (more, up to 4x, while they take under 0.5 s).

    On CPU a ``copy_`` of the same bytes runs at one of two speeds from process to process
    (up to 1.7x apart, by where the kernel placed the destination's pages), so the copy is
    timed into a plain ``empty_like`` and into a huge-page buffer, and the floor is the faster
    median (``copy_kind`` says which; ``copy_medians_s`` has both): the ratios are against the
    best copy this process gets. ``clone_s``: a copy into a fresh buffer, what an op returning
    a new gradient also pays for the first touch of its pages.
    """
    import torch

    src = logits.detach()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def median_time(fn):
        fn()
        sync()
        times = []
        while len(times) < repeats or (len(times) < 4 * repeats and sum(times) < 0.5):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times), times

    if cuda:
        copy_s, times = median_time(src.clone)
        return {"copy_s": copy_s, "copy_kind": "clone", "copy_times_s": times}
    from astrai_kernels.kernels.memory import cached_empty

    by_kind = {}
    for kind, make_dst in (("copy_", torch.empty_like),
                           ("copy_ to huge pages",
                            lambda x: cached_empty(x.shape, x.dtype, x.device))):
        by_kind[kind] = median_time(functools.partial(make_dst(src).copy_, src))
    kind = min(by_kind, key=lambda k: by_kind[k][0])
    result = {"copy_s": by_kind[kind][0], "copy_kind": kind, "copy_times_s": by_kind[kind][1],
              "copy_medians_s": {k: v[0] for k, v in by_kind.items()}}
    clones = []
    for _ in range(max(3, repeats // 2)):
        start = time.perf_counter()
        out = src.clone()
        clones.append(time.perf_counter() - start)
        del out
    result.update({"clone_s": statistics.median(clones), "clone_times_s": clones})
    return result
