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
6. Logits ops, the same-run copy floor (:class:`CopyFloor`): ``dst.copy_(logits)`` of the op's
   own logits, ``2 S`` bytes, into a buffer allocated as the gradient cache allocates the op's
   gradient (huge pages advised before the first touch) and first touched before the peak's
   baseline (so it adds nothing to the peak). Copies run between the op's timed calls so
   that both sample the same moments; ``copy_s`` is their median;
   ``floor_s = copy_s * floor_bytes / (2 S)``. The linear ops' floor is the ``gemm`` case of the
   same shape instead (:mod:`astrai_kernels.bench.linear`; ratios in
   :func:`astrai_kernels.bench.report.add_ratios`).

Why a median of interleaved copies: on the 2-core VM the bounds were set on, one warm copy of the
same buffers in one process takes 14 ms or 23-32 ms (fp32, N=4096, V=32768) from one second to
the next, with what the other core and the host are doing; the op's own time does not follow.
A floor read in one burst after the op's calls (the old rule) caught one of those moments, and the
ratio flipped with it.
"""

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

    floor = None
    if with_copy and workload.copy_source is not None:
        floor = CopyFloor(workload.copy_source, cuda)  # allocated and touched before any peak
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
        if floor is not None:
            floor.sample(COPIES_PER_CALL)
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
    if floor is not None:
        floor.sample(MIN_COPIES - len(floor.times))
        result.update(floor.result())
        if not cuda:
            result.update(measure_clone(workload.copy_source, max(3, case.repeats // 2)))
    return result


COPIES_PER_CALL = 2  # copies timed after each timed call of the op
MIN_COPIES = 10  # the floor's median is over at least this many (the rest after the last call)


class CopyFloor:
    """The same-run copy floor of a logits op: ``dst.copy_(logits)``, ``2 S`` bytes (module doc,
    step 6). ``sample(n)`` times ``n`` copies; ``result()`` gives ``copy_s`` (their median),
    ``copy_kind`` and every ``copy_times_s``."""

    def __init__(self, logits, cuda=False):
        import torch

        self.src = logits.detach()
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.kind = "copy_" if cuda else "copy_ to huge pages"
        self.dst = _gradient_like(self.src)
        self.dst.copy_(self.src)  # the first touch, untimed
        self.sync()
        self.times = []

    def sample(self, count):
        for _ in range(max(0, count)):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            self.sync()
            self.times.append(time.perf_counter() - start)

    def result(self):
        if not self.times:
            raise RuntimeError("the copy floor was never sampled")
        return {"copy_s": statistics.median(self.times), "copy_kind": self.kind,
                "copy_times_s": list(self.times)}


def _gradient_like(src):
    """An empty tensor like ``src`` whose memory is allocated as the gradient cache allocates an
    op's gradient (on CPU a :class:`~astrai_kernels.kernels.memory.Block`, huge pages advised),
    but held here, outside the cache: the op's own cache use is untouched."""
    import torch

    if src.device.type != "cpu":
        return torch.empty_like(src, memory_format=torch.contiguous_format)
    from astrai_kernels.kernels.memory import HUGE_PAGE, Block

    nbytes = src.numel() * src.element_size()
    block = Block(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    return block.memory[:nbytes].view(src.dtype).view(src.shape)


def measure_clone(logits, repeats=3):
    """``{"clone_s", "clone_times_s"}``: copies of ``logits`` into fresh buffers (median), what an
    op returning a new gradient also pays for the first touch of its pages."""
    src = logits.detach()
    clones = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = src.clone()
        clones.append(time.perf_counter() - start)
        del out
    return {"clone_s": statistics.median(clones), "clone_times_s": clones}


def measure_copy(logits, copies=MIN_COPIES, cuda=False):
    """The copy floor alone (no op between the copies): :class:`CopyFloor`'s result over
    ``copies`` copies, and on CPU :func:`measure_clone`'s."""
    floor = CopyFloor(logits, cuda)
    floor.sample(copies)
    result = floor.result()
    if not cuda:
        result.update(measure_clone(logits, max(3, copies // 2)))
    return result
