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
6. Logits ops, the same-run copy floor (:class:`CopyFloor`): ``dst.copy_(src)`` of ``B`` bytes
   (``copy_bytes``), ``2 B`` moved, into a buffer allocated as the gradient cache allocates the
   op's gradient (huge pages advised before the first touch) and first touched before the peak's
   baseline (so it adds nothing to the peak). ``src`` is the op's own logits (``B = S``), but
   where they are between a quarter of the last-level cache and twice it, a buffer of twice the
   cache: a copy that leaves the cache streams at the memory's bandwidth on every CPU, where a
   256 MB copy on a Xeon with 480 MB of L3 ran partly from the cache and made the same kernels
   look 10-30% slower against it than on an EPYC (32 MB of L3 per core complex). Logits well
   inside the cache are copied in place: the op runs from the cache too. Copies run between
   the op's timed calls so that both sample the same moments; ``copy_s`` is their median,
   ``floor_s = copy_s * floor_bytes / (2 B)``; ``paired_copy_s[i]`` is the median of the copies
   right after timed call ``i``, and the ratio to the floor is the median of the paired ratios
   (:func:`astrai_kernels.bench.report.add_ratios`): a moment when the machine is slow slows
   the call and its copies alike. The linear ops'
   floor is the ``gemm`` case of the same shape instead (:mod:`astrai_kernels.bench.linear`).

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
    times, paired_copies = [], []
    for _ in range(max(1, case.repeats)):
        times.append(call())
        if floor is not None:
            paired_copies.append(statistics.median(floor.sample(COPIES_PER_CALL)))
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
        result.update(floor.result(), paired_copy_s=paired_copies)
        if not cuda:
            result.update(measure_clone(workload.copy_source, max(3, case.repeats // 2)))
    return result


COPIES_PER_CALL = 2  # copies timed after each timed call of the op
MIN_COPIES = 10  # the floor's median is over at least this many (the rest after the last call)


class CopyFloor:
    """The same-run copy floor of a logits op: ``dst.copy_(src)`` of ``copy_bytes`` (the
    logits, or twice the last-level cache where the logits would partly stay in it; module
    doc, step 6).
    ``sample(n)`` times ``n`` copies and returns their times; ``result()`` gives ``copy_s``
    (the median of every copy), ``copy_bytes``, ``copy_kind`` and every ``copy_times_s``."""

    def __init__(self, logits, cuda=False, cache_bytes=None):
        import torch

        self.src = logits.detach()
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.kind = "copy_" if cuda else "copy_ to huge pages"
        cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
        if not cuda and cache_bytes / 4 <= self.src.numel() * self.src.element_size() < \
                2 * cache_bytes:
            self.src = _huge_page_bytes(2 * cache_bytes)
            self.src.fill_(1)
            self.kind += ", out of the cache"
        self.dst = _gradient_like(self.src)
        self.dst.copy_(self.src)  # the first touch, untimed
        self.sync()
        self.times = []

    def sample(self, count):
        times = []
        for _ in range(max(0, count)):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            self.sync()
            times.append(time.perf_counter() - start)
        self.times += times
        return times

    def result(self):
        if not self.times:
            raise RuntimeError("the copy floor was never sampled")
        return {"copy_s": statistics.median(self.times), "copy_kind": self.kind,
                "copy_bytes": self.src.numel() * self.src.element_size(),
                "copy_times_s": list(self.times)}


def last_level_cache_bytes():
    """The largest CPU cache this machine reports (sysfs, else sysconf; 32 MiB if neither)."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    if not sizes and hasattr(os, "sysconf"):
        try:
            sizes.append(int(os.sysconf("SC_LEVEL3_CACHE_SIZE")))
        except (ValueError, OSError):
            pass
    return max(sizes, default=0) or 32 << 20


def _gradient_like(src):
    """An empty tensor like ``src`` whose memory is allocated as the gradient cache allocates an
    op's gradient (on CPU a :class:`~astrai_kernels.kernels.memory.Block`, huge pages advised),
    but held here, outside the cache: the op's own cache use is untouched."""
    import torch

    if src.device.type != "cpu":
        return torch.empty_like(src, memory_format=torch.contiguous_format)
    nbytes = src.numel() * src.element_size()
    return _huge_page_bytes(nbytes).view(src.dtype).view(src.shape)


def _huge_page_bytes(nbytes):
    """``nbytes`` of uint8 CPU memory allocated as the gradient cache allocates a block."""
    from astrai_kernels.kernels.memory import HUGE_PAGE, Block

    return Block(-(-nbytes // HUGE_PAGE) * HUGE_PAGE).memory[:nbytes]


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
