"""Peak resident memory of a call on Linux, shared by ``astrai-kernels bench`` and the step
benchmarks (:mod:`astrai_kernels.bench.step_cases`).

Writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's resident-set high-water mark
``VmHWM`` to the current ``VmRSS``, so ``VmHWM`` after a call minus ``VmRSS`` before it is the
most memory the call added. The process should run with ``MALLOC_MMAP_THRESHOLD_=65536``
(:func:`child_env`, :func:`fix_mmap_threshold`): every large buffer is then its own ``mmap``,
returned to the OS when freed, so RSS follows the live tensors (glibc would otherwise keep
freed heap pages, and a reused page never raises RSS again). Where ``clear_refs`` is not
writable the high-water mark cannot be reset: ``ru_maxrss`` is used instead, which is right for
the first call only (:attr:`PeakRss.resettable` says which). Blocks the gradient cache
(:mod:`astrai_kernels.kernels.memory`) holds unused at ``start()`` are resident but would have been
freed without the cache: they are taken off the baseline, so a gradient the cache serves counts
in the peak as a fresh one does.
"""

import ctypes
import gc
import os
import resource

MMAP_THRESHOLD = "65536"


def child_env(root):
    """The environment of a measuring child process: the mmap threshold, ``root`` on
    ``PYTHONPATH`` (so the child imports this checkout)."""
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def fix_mmap_threshold():
    """The same threshold set from inside the process (glibc ``mallopt``; a fixed threshold is
    also not raised by frees), for processes forked without :func:`child_env`."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, int(MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def status_bytes(field):
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_high_water():
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRss:
    """``start()`` before a call, ``extra()`` after it: the peak resident bytes it added.

    ``start()`` collects garbage, trims malloc, resets ``VmHWM`` and returns ``VmRSS`` less the
    gradient cache's unused blocks as the baseline; ``extra()`` is ``VmHWM`` (or, where it
    cannot be reset, ``ru_maxrss``) minus that baseline. Several calls between ``start()`` and
    ``extra()`` give the peak over all of them.
    """

    def __init__(self):
        self.resettable = _reset_high_water()
        self.method = ("VmHWM after clear_refs, minus VmRSS" if self.resettable else
                       "ru_maxrss minus VmRSS over the first call: /proc/self/clear_refs not "
                       "writable")
        self.baseline = None

    def start(self):
        gc.collect()
        _malloc_trim()
        _reset_high_water()
        from astrai_kernels.kernels.memory import gradient_cache_free_bytes

        self.baseline = status_bytes("VmRSS") - gradient_cache_free_bytes()
        return self.baseline

    def high_water(self):
        if self.resettable:
            return status_bytes("VmHWM")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def extra(self):
        return self.high_water() - self.baseline
