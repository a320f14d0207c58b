"""Which dtype and which GEMM the fused head's matmuls run in on a device (``ops/head.py``'s
``ChunkedHead`` asks): the inputs' dtype, except bf16/fp16 on a CPU without native
low-precision GEMMs (:func:`compute_dtype`; ``ASTRAI_KERNELS_HEAD_MATMUL`` forces ``native`` or
``float32``); whether torch has a 16-bit GEMM with a float32 output there
(:func:`has_float32_product`: CUDA); whether oneDNN can run float32 matmuls on its bf16 units
(:func:`has_bf16_float32_gemm`, :func:`bf16_products`)."""

import contextlib
import os
import threading

import torch

HEAD_MATMUL_ENV = "ASTRAI_KERNELS_HEAD_MATMUL"


HEAD_MATMUL_MODES = ("auto", "native", "float32")


def head_matmul_mode() -> str:
    """``ASTRAI_KERNELS_HEAD_MATMUL``: ``auto`` (unset), ``native`` or ``float32``."""
    mode = os.environ.get(HEAD_MATMUL_ENV, "").strip() or "auto"
    if mode not in HEAD_MATMUL_MODES:
        raise ValueError(f"{HEAD_MATMUL_ENV} must be one of {HEAD_MATMUL_MODES}, got {mode!r}")
    return mode


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the head's matmuls run in (see the module docstring)."""
    mode = head_matmul_mode()
    if dtype == torch.float32 or torch.device(device).type != "cpu" or mode == "native":
        return dtype
    if mode == "float32":
        return torch.float32
    mkldnn = getattr(torch.ops, "mkldnn", None)
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported",
             torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        native = bool(getattr(mkldnn, probe)())
    except (AttributeError, RuntimeError):
        native = False
    return dtype if native else torch.float32


_FLOAT32_PRODUCT = {}  # (device type, dtype) -> whether torch.mm takes out_dtype=float32


def has_float32_product(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` operands on
    ``device`` (CUDA on torch >= 2.8; not the CPU). Probed once per device type and dtype."""
    key = (device.type, dtype)
    if key not in _FLOAT32_PRODUCT:
        probe = torch.ones(1, 1, dtype=dtype, device=device)
        try:
            supported = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError):
            supported = False
        _FLOAT32_PRODUCT[key] = supported
    return _FLOAT32_PRODUCT[key]


def has_bf16_float32_gemm(device: torch.device) -> bool:
    """Whether oneDNN can run this CPU's float32 matmuls on its bf16 units with float32
    accumulation and output (``torch.backends.mkldnn.matmul.fp32_precision``)."""
    mkldnn = torch.backends.mkldnn
    return (device.type == "cpu" and mkldnn.is_available()
            and hasattr(getattr(mkldnn, "matmul", None), "fp32_precision"))


@contextlib.contextmanager
def bf16_products():
    """float32 matmuls inside run on oneDNN's bf16 units, float32 accumulation and output: the
    exact products of operands that hold bf16 values, at the bf16 GEMM's speed (3.3x the float32
    GEMM on an AVX512-BF16 EPYC). The setting is process-wide, so it is taken only while this is
    the only Python thread (no other can issue a matmul meanwhile); else nothing changes."""
    matmul = torch.backends.mkldnn.matmul
    if threading.active_count() != 1:
        yield
        return
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous
