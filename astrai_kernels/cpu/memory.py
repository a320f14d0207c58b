"""The ops' large CPU buffers (gradients, the fused head's chunk buffer and accumulators):
transparent huge pages, and a small cache that reuses them.

A fresh ``[N, V]`` gradient is ``N * V`` bytes of untouched pages. With 4 KiB pages the first
write faults once per page, which at N = 4096, V = 32768 (fp32) costs about 4x a ``copy_`` of
the logits. Where the kernel's THP mode is ``madvise``, asking for huge pages on the buffer
before it is first written takes one fault per 2 MiB instead; the kernel still zeroes every
page it hands out, a memory pass as long as the copy. Elsewhere (not Linux, THP off, no libc)
the buffer is a plain ``torch.empty``.

The cache removes that pass from a training loop, as PyTorch's CUDA caching allocator does on
GPUs: a buffer of at least :data:`MIN_BYTES` is carved from a cached block, and once every
tensor on that block is gone (autograd consumed the gradient, ``.grad`` was set to None) the
next buffer of a fitting size (at least half the block's) reuses its pages. A block is free
when its storage's use count is back to the cache's own reference
(``torch._C._storage_Use_Count``, the count PyTorch's CUDA-graph trees read; the baseline is
measured, not assumed). When no free block fits, every free block is released before a new
one is allocated, so cached memory never sits beside a fresh allocation of ours: what the
cache holds between steps is what the previous step's buffers held at that point. Fake
tensors and traced code (a dispatch mode, torch.compile) bypass the cache. The blocks it keeps
total at most :func:`gradient_cache_limit` bytes (``ASTRAI_KERNELS_GRADIENT_CACHE_BYTES``;
default an eighth of physical memory; ``0`` turns the cache off); :func:`release_gradient_cache`
gives every free block back at once.
"""

import ctypes
import ctypes.util
import math
import os
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 4 * HUGE_PAGE
CACHE_ENV = "ASTRAI_KERNELS_GRADIENT_CACHE_BYTES"
MAX_SLACK = 2  # a cached block serves a request of at least 1 / MAX_SLACK of its size

_madvise = None


def _load_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.madvise.restype = ctypes.c_int
                _madvise = libc.madvise
            except (OSError, AttributeError):
                _madvise = False
    return _madvise


def _advise_huge_pages(buffer, nbytes):
    madvise = _load_madvise()
    if madvise:
        start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (buffer.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # advice only: a failure changes nothing


def _default_limit():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 0


def _limit_from_env():
    value = os.environ.get(CACHE_ENV)
    if value is None or value.strip() == "":
        return _default_limit()
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"{CACHE_ENV} must be a whole number of bytes (0 turns the gradient "
                         f"cache off), got {value!r}") from None
    if limit < 0:
        raise ValueError(f"{CACHE_ENV} must be >= 0, got {limit}")
    return limit


class GradientCache:
    """Blocks of uint8 storage whose storage the handed-out buffers share; see the module
    doc."""

    def __init__(self, limit):
        self.limit = limit
        self.blocks = []  # uint8 tensors, oldest first
        self.lock = threading.Lock()
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self.idle_count = self._count(torch.empty(1, dtype=torch.uint8))

    @property
    def enabled(self):
        return self.limit > 0 and self.idle_count is not None

    def _count(self, block):
        if self._use_count is None:
            return None
        return self._use_count(block.untyped_storage()._cdata)

    def _is_free(self, block):
        return self._count(block) == self.idle_count

    def cached_bytes(self):
        with self.lock:
            return sum(block.numel() for block in self.blocks)

    def free_bytes(self):
        """Bytes of cached blocks no tensor uses now (resident memory a plain allocator would
        have given back)."""
        with self.lock:
            return sum(block.numel() for block in self.blocks if self._is_free(block))

    def release(self):
        with self.lock:
            self.blocks = [block for block in self.blocks if not self._is_free(block)]

    def take(self, nbytes):
        """A cached free block of at least ``nbytes`` bytes, or a new one (kept when it fits
        under the limit)."""
        with self.lock:
            fitting = [block for block in self.blocks if self._is_free(block)
                       and nbytes <= block.numel() <= MAX_SLACK * nbytes]
            if fitting:
                block = min(fitting, key=torch.Tensor.numel)
                self.blocks = [b for b in self.blocks if b is not block] + [block]
                return block
            self.blocks = [block for block in self.blocks if not self._is_free(block)]
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            block = torch.empty(size, dtype=torch.uint8)
            _advise_huge_pages(block, size)
            if sum(b.numel() for b in self.blocks) + size <= self.limit:
                self.blocks.append(block)
            return block


_cache = None
_cache_lock = threading.Lock()


def _gradient_cache():
    global _cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = GradientCache(_limit_from_env())
    return _cache


def gradient_cache_limit():
    """The most bytes the gradient cache keeps (0: off)."""
    cache = _gradient_cache()
    return cache.limit if cache.enabled else 0


def set_gradient_cache_limit(limit):
    """Keep at most ``limit`` bytes of gradient blocks (0 turns the cache off); returns the
    previous limit. Free blocks over the new limit are released now."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a whole number of bytes >= 0, got {limit!r}")
    cache = _gradient_cache()
    with cache.lock:
        previous, cache.limit = cache.limit, limit
    if cache.cached_bytes() > limit:
        cache.release()
    return previous


def release_gradient_cache():
    """Give every cached block that no tensor uses back to the allocator."""
    _gradient_cache().release()


def gradient_cache_free_bytes():
    """Resident bytes the cache holds that no tensor uses (0 when the cache is off)."""
    return _gradient_cache().free_bytes() if _cache is not None else 0


def _tracing():
    """Under a dispatch mode (fake tensors, tracing) or torch.compile a "buffer" is not memory:
    it must not enter, or come from, the cache."""
    stack_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return torch.compiler.is_compiling() or bool(stack_depth and stack_depth())


def cached_empty(shape, dtype, device):
    """``torch.empty(shape)``; on CPU, when large, on huge pages and from the gradient cache."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _tracing():
        return torch.empty(shape, dtype=dtype, device=device)
    cache = _gradient_cache()
    if cache.enabled:
        # A tensor on the block's storage, not a view of it: no ``_base`` for autograd or
        # torch.library to see, and the storage's use count says when it is free again.
        return torch.empty(0, dtype=dtype).set_(cache.take(nbytes).untyped_storage(), 0,
                                                tuple(shape))
    grad = torch.empty(shape, dtype=dtype, device=device)
    _advise_huge_pages(grad, nbytes)
    return grad
