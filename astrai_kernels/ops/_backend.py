"""The primitives every kernel backend implements, and how a backend is chosen.

A backend is a module exposing the four primitives below plus ``unavailable_reason(device)``
(``None`` when it can serve tensors on ``device``, else a sentence saying why not).

Conventions shared by every primitive:

* ``logits`` is a 3-D view ``[A, B, V]`` of the caller's logits with arbitrary strides (any of
  them may be non-unit, the vocabulary stride included); row ``n`` of the flattened ``N = A * B``
  rows is ``logits[n // B, n % B]``. Dtype float32, bfloat16 or float16, read as is (no upcast
  copy); all arithmetic accumulates in float32.
* ``target`` is a contiguous int64 or int32 tensor of ``N`` elements, already validated: every
  entry is in ``[0, V)`` or equals ``ignore_index``.
* ``grad`` (when given) is a ``[A, B, V]`` tensor of the logits' dtype with arbitrary strides,
  written completely (every element, zeros on ignored rows). It may be ``logits`` itself
  (in-place backward): a backend must finish reading a row before it writes that row.
* Every returned per-row tensor is a new contiguous float32 tensor of ``N`` elements.
* Float hyperparameters arrive as Python floats; kernels take them as runtime arguments.

Primitives (``s = z / T``, ``p = softmax(s)``, ``lse = logsumexp(s)``, ``d_jy`` the one-hot):

``logprobs_forward(logits, target, temperature, ignore_index, with_entropy)``
    -> ``(logp, entropy, lse)``; ``logp = s_y - lse``; ``entropy = lse - sum_j p_j s_j`` (an
    empty tensor when ``with_entropy`` is false). Ignored rows: ``logp = entropy = 0``, ``lse = 0``.

``logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
ignore_index, grad)`` -> None
    writes ``grad_j = (1/T) * (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H))``; ``entropy``
    and ``grad_entropy`` are empty tensors when entropy was not requested (then ``g_H = 0``).

``cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss, softcap,
grad_scale, grad)`` -> ``(loss, lse)``
    with ``c = softcap`` (``0.0`` means off) the row's logits are ``z = c * tanh(x / c)``;
    ``loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + z_loss * lse**2``, ``lse`` that
    of ``z``; ignored rows give 0. When ``grad`` is not None, ``grad_scale`` is a float32 tensor
    of 1 or N elements (row ``n`` uses element ``n`` or the single one) and the primitive also
    writes ``grad_j = grad_scale * ((1 + 2 * z_loss * lse) * p_j - (1 - eps) * d_jy - eps / V)``,
    times ``1 - (z_j / c)**2`` when softcap is on (the ``d_jy`` term folded in float32 before the
    cast). Ignored rows get zeros.

``grpo_forward(logits, target, temperature, advantages, old_logprobs, ref_logprobs,
token_weight, clip_low, clip_high, delta, beta, grad)`` -> ``(logp, loss)``
    per row, float32 inputs of N elements (``old_logprobs``/``ref_logprobs`` may be None; None
    old means on-policy: ``old = logp`` detached). Rows with ``token_weight == 0`` are masked:
    their target is not read, ``logp = loss = 0`` and grad is zero. Otherwise, with ``A`` the
    advantage::

        lr = clamp(logp - old, -20, 20);  r = exp(lr)
        r_u = min(r, delta) if delta > 0 else r          (delta <= 0 means off)
        l = -min(r_u * A, clamp(r, 1 - clip_low, 1 + clip_high) * A)
        if beta > 0:  dr = clamp(ref - logp, -20, 20);  l += beta * (exp(dr) - dr - 1)

    ``loss`` is ``l`` (unweighted). When ``grad`` is given it writes
    ``grad_j = token_weight * dl/dlogp * (d_jy - p_j) / T``, with ``dl/dlogp`` the derivative of
    the formula above, taking clamp's gradient as zero outside its range and, where the two
    branches of the min are equal, the unclipped branch.

``distill_forward(student, teacher, target, ignore_index, beta, temperature, hard_weight)``
    -> ``(loss, student_lse, teacher_lse, student_kl, hard_lse)``. ``teacher`` is an
    ``[A, B, V]`` view of the same ``A, B, V`` as ``student`` (its own strides and dtype).
    With ``a = log softmax(student / T)``, ``b = log softmax(teacher / T)`` (TRL's generalized
    JSD): ``beta = 0``: ``loss = sum_j p_t (b - a)``; otherwise ``m = b`` when ``beta = 1``,
    else ``m = log((1 - beta) p_s + beta p_t)``, ``student_kl = sum_j p_s (a - m)`` and
    ``loss = beta * sum_j p_t (b - m) + (1 - beta) * student_kl`` (``loss = student_kl`` at
    ``beta = 1``); terms with ``p = 0`` are 0. ``hard_weight > 0`` adds
    ``hard_weight * (hard_lse - x_y)``, ``hard_lse = logsumexp(student)`` at temperature 1
    (an empty tensor when ``hard_weight == 0``). The lses are those of ``z / T``. Ignored rows:
    every output 0. ``student_kl`` is 0 when ``beta = 0``.

``distill_backward(student, teacher, target, ignore_index, beta, temperature, hard_weight,
student_lse, teacher_lse, student_kl, hard_lse, grad_loss, grad)`` -> None
    writes the student's gradient ``grad_j = g / T * (p_s,j - p_t,j)`` (``beta = 0``), else
    ``g / T * (1 - beta') * p_s,j * (a_j - m_j - student_kl)`` (``beta' = 0`` at ``beta = 1``),
    plus ``g * hard_weight * (softmax(student)_j - d_jy)``; ``g`` the row's ``grad_loss``.
    ``grad`` may be ``student`` itself (the fused head writes over its logits chunk).

Optional primitive (vocabulary parallel, ``ops/vocab_parallel.py``; ``torch`` implements it,
``cpp`` and ``triton`` not yet: ``auto`` then runs a vocab-parallel gradient on ``torch``, and
asking for them by name raises ``NotImplementedError``):

``vocab_shard_backward(logits, target, lse, alpha, beta, gamma, delta, temperature, softcap,
ignore_index, grad)`` -> None
    ``logits`` hold one vocabulary shard; ``lse`` (float32, N) is the row's log-sum-exp over the
    whole vocabulary, of ``s = z / T`` with ``z = c * tanh(x / c)`` when ``softcap = c`` is
    not 0.0 (else ``z = x``). ``target`` entries in ``[0, V)`` are local target columns,
    ``ignore_index`` rows get zeros, any other value is a counted row whose target lies in
    another shard. With ``p_j = exp(s_j - lse)`` and per-row float32 coefficients (``beta``
    and ``delta`` may be None: 0) it writes
    ``grad_j = (1/T) * dz_j/dx_j * (p_j * (alpha + beta * log p_j) + gamma * d_jy + delta)``.
    The forward statistics of a shard come from ``logprobs_forward`` and
    ``cross_entropy_forward`` above, so every backend serves forward-only calls.

``reference.py`` states the same math naively; ``cpu/torch_backend.py`` is the readable
chunked implementation of these primitives.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import List, Optional, Union

import torch

BACKENDS = ("triton", "cpp", "torch", "reference")
_MODULES = {
    "triton": "astrai_kernels.triton.backend",
    "cpp": "astrai_kernels.cpu.cpp_backend",
    "torch": "astrai_kernels.cpu.torch_backend",
}
ENV_VAR = "ASTRAI_KERNELS_BACKEND"


def backend_module(name: str) -> ModuleType:
    """The module implementing the primitives of kernel backend ``name``."""
    return importlib.import_module(_MODULES[name])


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
