"""How a kernel backend is chosen: ``triton`` (CUDA), ``cpp`` (CPU), ``torch`` (the chunked
``portable`` module, any device) or ``reference`` (the float64 spec, a test oracle).

A backend is a module implementing the primitives declared in ``kernels/primitives.py`` (its
``Backend`` protocol, where their contract is stated) plus ``unavailable_reason(device)``:
``None`` when it can serve tensors on ``device``, else a sentence saying why not. Each is
imported by a statement of its own below (on first use: triton and the C++ build are costly),
so the module graph, and ``tests/test_layering.py``, sees every backend the ops reach.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import List, Optional, Union

import torch

BACKENDS = ("triton", "cpp", "torch", "reference")
ENV_VAR = "ASTRAI_KERNELS_BACKEND"


def backend_module(name: str) -> ModuleType:
    """The module implementing the primitives of kernel backend ``name``."""
    if name == "triton":
        from .triton import backend as triton_backend
        return triton_backend
    if name == "cpp":
        from .cpp import backend as cpp_backend
        return cpp_backend
    if name == "torch":
        from . import portable
        return portable
    raise KeyError(f"backend {name!r} has no kernel module (one of 'triton', 'cpp', 'torch')")


def _device(device: Union[str, torch.device]) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or "
                         f"'cuda', got {device!r}") from exc


def unavailable_reason(name: str, device: Union[str, torch.device]) -> Optional[str]:
    """None when backend ``name`` can serve tensors on ``device``, else why it cannot."""
    device = _device(device)
    if name == "reference":
        return None
    try:
        module = backend_module(name)
    except ImportError as exc:
        return f"backend {name!r} failed to import: {exc}"
    return module.unavailable_reason(device)


def available_backends(device: Union[str, torch.device] = "cpu") -> List[str]:
    """Names of the backends usable on ``device`` now, in order of preference."""
    device = _device(device)
    return [name for name in BACKENDS if unavailable_reason(name, device) is None]


def resolve_backend(backend: str, device: Union[str, torch.device]) -> str:
    """The concrete backend name for a call; ``auto`` honours ``ASTRAI_KERNELS_BACKEND``."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    return _resolve(backend, str(device))


def _resolve(backend, device):
    if backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto") or "auto"
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"the environment variable {ENV_VAR} must be 'auto' or one of "
                             f"{BACKENDS}, got {backend!r}")
        if backend == "auto":
            device = torch.device(device)
            preferred = ("triton", "torch") if device.type == "cuda" else ("cpp", "torch")
            for name in preferred:
                if unavailable_reason(name, device) is None:
                    return name
            return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} cannot serve tensors on {device}: {reason}")
    return backend


# Under torch.compile the choice is made once at trace time and baked into the graph. This is
# what torch.compiler.assume_constant_result does, without importing dynamo (~1.7 s) up front.
_resolve._dynamo_marked_constant = True
