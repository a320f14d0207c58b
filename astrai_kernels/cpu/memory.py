"""Gradient buffers on CPU backed by transparent huge pages.

A fresh ``[N, V]`` gradient is ``N * V`` bytes of untouched pages; with 4 KiB pages the first
write faults once per page, which at N = 4096, V = 32768 (fp32) costs about 4x a ``copy_`` of
the logits. Where the kernel's THP mode is ``madvise``, asking for huge pages on the buffer
before it is first written takes one fault per 2 MiB instead. Elsewhere (not Linux, THP off,
no libc) the buffer is a plain ``torch.empty``.
"""

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 4 * HUGE_PAGE

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


def empty_gradient(shape, dtype, device):
    """``torch.empty(shape)`` whose pages (on CPU, when large) are asked to be huge pages."""
    grad = torch.empty(shape, dtype=dtype, device=device)
    nbytes = grad.numel() * grad.element_size()
    if grad.device.type != "cpu" or nbytes < MIN_BYTES:
        return grad
    madvise = _load_madvise()
    if madvise:
        start = -(-grad.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (grad.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return grad
