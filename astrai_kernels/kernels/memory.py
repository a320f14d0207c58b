"""The ops' large CPU buffers (gradients, the fused head's chunk buffer and accumulators):
transparent huge pages, and a caching allocator that reuses them.

A fresh ``[N, V]`` gradient is ``N * V`` bytes of untouched pages. With 4 KiB pages the first
write faults once per page, which at N = 4096, V = 32768 (fp32) costs about 4x a ``copy_`` of
the logits. Where the kernel's THP mode is ``madvise``, asking for huge pages on the buffer
before it is first written takes one fault per 2 MiB instead; the kernel still zeroes every
page it hands out, a memory pass as long as the copy. Elsewhere (not Linux, THP off, no libc)
the buffer is a plain ``torch.empty``.

The cache removes that pass from a training loop, as PyTorch's CUDA caching allocator does on
GPUs. It owns blocks of memory; a buffer of at least :data:`MIN_BYTES` gets a storage of its
own, sized to the request, whose data lies in a block and whose deleter gives the block back.
So a block returns only when the last user of that storage is gone: tensors, views, a
``UntypedStorage`` the user kept, a NumPy array on it; or when the storage's data leaves it: a
storage moved to shared memory for another process (``share_memory_``) leaves the block at once,
with its data copied out, and so does a resize. The storage is resizable as ``torch.empty``'s
is (the cpp backend's extension marks it so, with torch's CPU allocator): ``resize_(0)`` and a
growing ``resize_`` allocate the new bytes with torch's allocator, copy what fits and free the
block through the deleter, as torch frees its own. The cache serves only where that extension
is built; elsewhere a buffer is a plain ``torch.empty`` on huge pages. The free list sits under
a lock held through the claim, so two threads never get one block.

Release rules, which keep what the cache holds between steps to what the previous step held:

- a request takes the smallest free block of at least its size and at most :data:`MAX_SLACK`
  times it; when none fits, every free block is released before a new one is allocated, so a
  free block never sits beside a fresh allocation of ours;
- a step ends when none of the cache's buffers is in use (autograd consumed the gradients,
  ``.grad`` was set to None); then the free blocks that step did not use are released;
- the blocks total at most :func:`gradient_cache_limit` bytes
  (``ASTRAI_KERNELS_GRADIENT_CACHE_BYTES``; default an eighth of physical memory; ``0`` turns
  the cache off); a block over it is a plain allocation, freed with its storage.

A buffer kept past its step (a ``.grad`` kept across steps) keeps that step from ending; the
first and third rules still bound what is held. Fake tensors and traced code (a dispatch mode,
torch.compile) bypass the cache. :func:`release_gradient_cache` gives every free block back now.
"""

import collections
import ctypes
import ctypes.util
import math
import os
import sys
import threading
import weakref

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


class Block:
    """Memory the cache owns: ``memory`` (a uint8 tensor) and a NumPy view of it that leases
    borrow; ``step`` is the step that last took it, ``kept`` whether it returns to the cache."""

    __slots__ = ("memory", "array", "nbytes", "step", "kept")

    def __init__(self, nbytes):
        self.memory = torch.empty(nbytes, dtype=torch.uint8)
        _advise_huge_pages(self.memory, nbytes)
        self.array = self.memory.numpy()
        self.nbytes = nbytes
        self.step = 0
        self.kept = False


class GradientCache:
    """A caching allocator for large CPU buffers; see the module doc for its rules."""

    def __init__(self, limit):
        self.limit = limit
        self.free = []  # blocks no storage uses, oldest first
        self.kept_bytes = 0  # the free blocks and the leased ones that will come back
        self.leased = 0  # blocks some storage uses now
        self.step = 0
        # Blocks given back by storage deleters, which may run while this thread holds the lock
        # (a garbage collection inside take): appended without it, collected under it.
        self.returned = collections.deque()
        self.lock = threading.Lock()

    @property
    def enabled(self):
        return self.limit > 0

    def _collect(self):
        """Move given-back blocks to the free list; end the step when none is leased."""
        while self.returned:
            block = self.returned.popleft()
            self.leased -= 1
            if block.kept and self.kept_bytes <= self.limit:
                self.free.append(block)
            elif block.kept:
                self._drop(block)
            if self.leased == 0:
                for unused in [b for b in self.free if b.step != self.step]:
                    self._drop(unused)
                    self.free.remove(unused)
                self.step += 1

    def _drop(self, block):
        block.kept = False
        self.kept_bytes -= block.nbytes

    def _give_back(self, block):
        """The deleter of a lease's storage (through its NumPy view's finalizer)."""
        self.returned.append(block)
        if self.lock.acquire(blocking=False):
            try:
                self._collect()
            finally:
                self.lock.release()

    def cached_bytes(self):
        """Bytes of the blocks the cache keeps, free or in use."""
        with self.lock:
            self._collect()
            return self.kept_bytes

    def free_bytes(self):
        """Bytes of cached blocks no tensor uses now (resident memory a plain allocator would
        have given back)."""
        with self.lock:
            self._collect()
            return sum(block.nbytes for block in self.free)

    def release(self):
        with self.lock:
            self._collect()
            for block in self.free:
                self._drop(block)
            self.free = []

    def take(self, nbytes):
        """Claim a block of at least ``nbytes`` bytes: a fitting free one, or a new one (kept
        when it fits under the limit). The caller must :meth:`lease` it."""
        with self.lock:
            self._collect()
            fitting = [block for block in self.free
                       if nbytes <= block.nbytes <= MAX_SLACK * nbytes]
            if fitting:
                block = min(fitting, key=lambda b: b.nbytes)
                self.free.remove(block)
            else:
                for unused in self.free:
                    self._drop(unused)
                self.free = []
                block = Block(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
                block.kept = self.kept_bytes + block.nbytes <= self.limit
                if block.kept:
                    self.kept_bytes += block.nbytes
            block.step = self.step
            self.leased += 1
            return block

    def lease(self, block, nbytes, shape, dtype, make_storage_resizable):
        """A tensor on a storage of its own, ``nbytes`` long, on ``block``'s memory; the block
        comes back when that storage is destroyed or its data leaves the block (a resize)."""
        try:
            view = block.array[:nbytes]
            weakref.finalize(view, self._give_back, block).atexit = False
        except BaseException:
            self._give_back(block)
            raise
        # The storage's data pointer holds ``view`` (torch.from_numpy keeps its array) and only
        # that; a resize replaces the data pointer, dropping ``view``.
        flat = torch.from_numpy(view)
        make_storage_resizable(flat)
        storage = flat.untyped_storage()
        # A tensor on that storage, not a view of a uint8 tensor: no ``_base`` for autograd or
        # torch.library to see.
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


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
        cache.release()  # leased blocks over the new limit are freed when they come back
    return previous


def release_gradient_cache():
    """Give every cached block that no tensor uses back to the allocator."""
    _gradient_cache().release()


def gradient_cache_free_bytes():
    """Resident bytes the cache holds that no tensor uses (0 when the cache is off)."""
    return _gradient_cache().free_bytes() if _cache is not None else 0


_make_storage_resizable = None


def _storage_maker():
    """The cpp extension's ``make_storage_resizable`` when the extension is loaded or built
    (never building it), else None: without it a cached storage could not be resized."""
    global _make_storage_resizable
    if _make_storage_resizable is None:
        from .cpp import backend

        extension = backend.extension_if_built()
        if extension is not None:
            _make_storage_resizable = extension.make_storage_resizable
    return _make_storage_resizable


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
    make_storage_resizable = _storage_maker() if cache.enabled else None
    if make_storage_resizable is not None:
        return cache.lease(cache.take(nbytes), nbytes, shape, dtype, make_storage_resizable)
    grad = torch.empty(shape, dtype=dtype, device=device)
    _advise_huge_pages(grad, nbytes)
    return grad
