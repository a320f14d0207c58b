"""The backends' primitives as ``torch.library`` custom ops, so ``torch.compile`` traces through.

Each op is functional (it allocates the gradient it returns) and dispatches on ``backend`` to
the module named in ``_backend.py``; its fake implementation states the output shapes. The
in-place-gradient paths call the backend modules directly instead (an op may not return an
alias of its input).

For ``backend="triton"`` (torch >= 2.6) the same primitives are also ``torch.library.triton_op``
ops whose bodies launch the kernels through ``wrap_triton``: Inductor then sees the Triton
kernels themselves in the graph (user-defined Triton kernels it can schedule and fuse around)
rather than an opaque call, and the fake implementation is the body traced with fake tensors.
Each public function below picks that twin when the backend is ``triton``; under
``torch.compile`` the string is a constant, so the choice is made once at trace time.
"""

from typing import Optional

import torch
from torch import Tensor

from ..cpu.memory import empty_gradient
from ._backend import backend_module


def _rows(target):
    return target.numel()


def _grad_like(logits):
    return empty_gradient(logits.shape, logits.dtype, logits.device)


def _fake_grad_like(logits):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("astrai_kernels::logprobs_forward", mutates_args=())
def _logprobs_forward(logits: Tensor, target: Tensor, temperature: float, ignore_index: int,
                     with_entropy: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return backend_module(backend).logprobs_forward(logits, target, temperature, ignore_index,
                                                    with_entropy)


@_logprobs_forward.register_fake
def _(logits, target, temperature, ignore_index, with_entropy, backend):
    n_rows = _rows(target)
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (logits.new_empty(n_rows, **f32), logits.new_empty(n_rows if with_entropy else 0, **f32),
            logits.new_empty(n_rows, **f32))


@torch.library.custom_op("astrai_kernels::logprobs_backward", mutates_args=())
def _logprobs_backward(logits: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
                      grad_logp: Tensor, grad_entropy: Tensor, temperature: float,
                      ignore_index: int, backend: str) -> Tensor:
    grad = _grad_like(logits)
    backend_module(backend).logprobs_backward(logits, target, lse, entropy, grad_logp,
                                              grad_entropy, temperature, ignore_index, grad)
    return grad


@_logprobs_backward.register_fake
def _(logits, target, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, backend):
    return _fake_grad_like(logits)


@torch.library.custom_op("astrai_kernels::cross_entropy_forward", mutates_args=())
def _cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int,
                          label_smoothing: float, z_loss: float, softcap: float,
                          grad_scale: Optional[Tensor], backend: str
                          ) -> tuple[Tensor, Tensor, Tensor]:
    grad = _grad_like(logits) if grad_scale is not None else logits.new_empty(0)
    loss, lse = backend_module(backend).cross_entropy_forward(
        logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
        grad if grad_scale is not None else None)
    return loss, lse, grad


@_cross_entropy_forward.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale, backend):
    n_rows = _rows(target)
    grad = _fake_grad_like(logits) if grad_scale is not None else logits.new_empty(0)
    return (logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows, dtype=torch.float32), grad)


@torch.library.custom_op("astrai_kernels::grpo_forward", mutates_args=())
def _grpo_forward(logits: Tensor, target: Tensor, temperature: float, advantages: Tensor,
                 old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                 token_weight: Tensor, clip_low: float, clip_high: float, delta: float,
                 beta: float, compute_grad: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    grad = _grad_like(logits) if compute_grad else logits.new_empty(0)
    logp, loss = backend_module(backend).grpo_forward(
        logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
        clip_low, clip_high, delta, beta, grad if compute_grad else None)
    return logp, loss, grad


@_grpo_forward.register_fake
def _(logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
      clip_low, clip_high, delta, beta, compute_grad, backend):
    n_rows = _rows(target)
    grad = _fake_grad_like(logits) if compute_grad else logits.new_empty(0)
    return (logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows, dtype=torch.float32), grad)


TRITON_OPS = hasattr(torch.library, "triton_op")

if TRITON_OPS:
    def _triton():
        return backend_module("triton")

    @torch.library.triton_op("astrai_kernels::triton_logprobs_forward", mutates_args=())
    def _triton_logprobs_forward(logits: Tensor, target: Tensor, temperature: float,
                                 ignore_index: int, with_entropy: bool
                                 ) -> tuple[Tensor, Tensor, Tensor]:
        return _triton().logprobs_forward(logits, target, temperature, ignore_index,
                                          with_entropy)

    @torch.library.triton_op("astrai_kernels::triton_logprobs_backward", mutates_args=())
    def _triton_logprobs_backward(logits: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
                                  grad_logp: Tensor, grad_entropy: Tensor, temperature: float,
                                  ignore_index: int) -> Tensor:
        grad = torch.empty_like(logits)
        _triton().logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy,
                                    temperature, ignore_index, grad)
        return grad

    @torch.library.triton_op("astrai_kernels::triton_cross_entropy_forward", mutates_args=())
    def _triton_cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int,
                                      label_smoothing: float, z_loss: float, softcap: float,
                                      grad_scale: Optional[Tensor]
                                      ) -> tuple[Tensor, Tensor, Tensor]:
        grad = torch.empty_like(logits) if grad_scale is not None else logits.new_empty(0)
        loss, lse = _triton().cross_entropy_forward(
            logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
            grad if grad_scale is not None else None)
        return loss, lse, grad

    @torch.library.triton_op("astrai_kernels::triton_grpo_forward", mutates_args=())
    def _triton_grpo_forward(logits: Tensor, target: Tensor, temperature: float,
                             advantages: Tensor, old_logprobs: Optional[Tensor],
                             ref_logprobs: Optional[Tensor], token_weight: Tensor,
                             clip_low: float, clip_high: float, delta: float, beta: float,
                             compute_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
        logp, loss = _triton().grpo_forward(
            logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
            clip_low, clip_high, delta, beta, grad if compute_grad else None)
        return logp, loss, grad


def logprobs_forward(logits, target, temperature, ignore_index, with_entropy, backend):
    """``(logp, entropy, lse)``: ``ops/_backend.py``'s primitive as a traceable op."""
    if backend == "triton" and TRITON_OPS:
        return _triton_logprobs_forward(logits, target, temperature, ignore_index, with_entropy)
    return _logprobs_forward(logits, target, temperature, ignore_index, with_entropy, backend)


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
                      ignore_index, backend):
    """The gradient w.r.t. ``logits``, a new tensor: ``ops/_backend.py``'s primitive."""
    args = (logits, target, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index)
    if backend == "triton" and TRITON_OPS:
        return _triton_logprobs_backward(*args)
    return _logprobs_backward(*args, backend)


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                          grad_scale, backend):
    """``(loss, lse, grad)``; ``grad`` is empty unless ``grad_scale`` is given."""
    args = (logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale)
    if backend == "triton" and TRITON_OPS:
        return _triton_cross_entropy_forward(*args)
    return _cross_entropy_forward(*args, backend)


def grpo_forward(logits, target, temperature, advantages, old_logprobs, ref_logprobs,
                 token_weight, clip_low, clip_high, delta, beta, compute_grad, backend):
    """``(logp, loss, grad)``; ``grad`` is empty unless ``compute_grad``."""
    args = (logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
            clip_low, clip_high, delta, beta, compute_grad)
    if backend == "triton" and TRITON_OPS:
        return _triton_grpo_forward(*args)
    return _grpo_forward(*args, backend)


@torch.library.custom_op("astrai_kernels::distill_forward", mutates_args=())
def _distill_forward(student: Tensor, teacher: Tensor, target: Tensor, ignore_index: int,
                     beta: float, temperature: float, hard_weight: float, backend: str
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return backend_module(backend).distill_forward(student, teacher, target, ignore_index, beta,
                                                   temperature, hard_weight)


@_distill_forward.register_fake
def _(student, teacher, target, ignore_index, beta, temperature, hard_weight, backend):
    n_rows = _rows(target)
    f32 = dict(dtype=torch.float32, device=student.device)
    return (*(student.new_empty(n_rows, **f32) for _ in range(4)),
            student.new_empty(n_rows if hard_weight else 0, **f32))


@torch.library.custom_op("astrai_kernels::distill_backward", mutates_args=())
def _distill_backward(student: Tensor, teacher: Tensor, target: Tensor, ignore_index: int,
                      beta: float, temperature: float, hard_weight: float, student_lse: Tensor,
                      teacher_lse: Tensor, student_kl: Tensor, hard_lse: Tensor,
                      grad_loss: Tensor, backend: str) -> Tensor:
    grad = _grad_like(student)
    backend_module(backend).distill_backward(student, teacher, target, ignore_index, beta,
                                             temperature, hard_weight, student_lse, teacher_lse,
                                             student_kl, hard_lse, grad_loss, grad)
    return grad


@_distill_backward.register_fake
def _(student, teacher, target, ignore_index, beta, temperature, hard_weight, student_lse,
      teacher_lse, student_kl, hard_lse, grad_loss, backend):
    return _fake_grad_like(student)


if TRITON_OPS:
    @torch.library.triton_op("astrai_kernels::triton_distill_forward", mutates_args=())
    def _triton_distill_forward(student: Tensor, teacher: Tensor, target: Tensor,
                                ignore_index: int, beta: float, temperature: float,
                                hard_weight: float
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return _triton().distill_forward(student, teacher, target, ignore_index, beta,
                                         temperature, hard_weight)

    @torch.library.triton_op("astrai_kernels::triton_distill_backward", mutates_args=())
    def _triton_distill_backward(student: Tensor, teacher: Tensor, target: Tensor,
                                 ignore_index: int, beta: float, temperature: float,
                                 hard_weight: float, student_lse: Tensor, teacher_lse: Tensor,
                                 student_kl: Tensor, hard_lse: Tensor, grad_loss: Tensor
                                 ) -> Tensor:
        grad = torch.empty_like(student)
        _triton().distill_backward(student, teacher, target, ignore_index, beta, temperature,
                                   hard_weight, student_lse, teacher_lse, student_kl, hard_lse,
                                   grad_loss, grad)
        return grad


def distill_forward(student, teacher, target, ignore_index, beta, temperature, hard_weight,
                    backend):
    """``(loss, student_lse, teacher_lse, student_kl, hard_lse)``: ``ops/_backend.py``'s
    primitive as a traceable op."""
    args = (student, teacher, target, ignore_index, beta, temperature, hard_weight)
    if backend == "triton" and TRITON_OPS:
        return _triton_distill_forward(*args)
    return _distill_forward(*args, backend)


def distill_backward(student, teacher, target, ignore_index, beta, temperature, hard_weight,
                     student_lse, teacher_lse, student_kl, hard_lse, grad_loss, backend):
    """The gradient w.r.t. ``student``, a new tensor: ``ops/_backend.py``'s primitive."""
    args = (student, teacher, target, ignore_index, beta, temperature, hard_weight, student_lse,
            teacher_lse, student_kl, hard_lse, grad_loss)
    if backend == "triton" and TRITON_OPS:
        return _triton_distill_backward(*args)
    return _distill_backward(*args, backend)
