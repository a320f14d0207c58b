"""The backends' primitives as ``torch.library`` custom ops, so ``torch.compile`` traces through.

Each op is functional (it allocates the gradient it returns) and dispatches on ``backend`` to
the module named in ``_backend.py``; its fake implementation states the output shapes. The
in-place-gradient paths call the backend modules directly instead (an op may not return an
alias of its input).
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
def logprobs_forward(logits: Tensor, target: Tensor, temperature: float, ignore_index: int,
                     with_entropy: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return backend_module(backend).logprobs_forward(logits, target, temperature, ignore_index,
                                                    with_entropy)


@logprobs_forward.register_fake
def _(logits, target, temperature, ignore_index, with_entropy, backend):
    n_rows = _rows(target)
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (logits.new_empty(n_rows, **f32), logits.new_empty(n_rows if with_entropy else 0, **f32),
            logits.new_empty(n_rows, **f32))


@torch.library.custom_op("astrai_kernels::logprobs_backward", mutates_args=())
def logprobs_backward(logits: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
                      grad_logp: Tensor, grad_entropy: Tensor, temperature: float,
                      ignore_index: int, backend: str) -> Tensor:
    grad = _grad_like(logits)
    backend_module(backend).logprobs_backward(logits, target, lse, entropy, grad_logp,
                                              grad_entropy, temperature, ignore_index, grad)
    return grad


@logprobs_backward.register_fake
def _(logits, target, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, backend):
    return _fake_grad_like(logits)


@torch.library.custom_op("astrai_kernels::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int,
                          label_smoothing: float, z_loss: float, softcap: float,
                          grad_scale: Optional[Tensor], backend: str
                          ) -> tuple[Tensor, Tensor, Tensor]:
    grad = _grad_like(logits) if grad_scale is not None else logits.new_empty(0)
    loss, lse = backend_module(backend).cross_entropy_forward(
        logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
        grad if grad_scale is not None else None)
    return loss, lse, grad


@cross_entropy_forward.register_fake
def _(logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale, backend):
    n_rows = _rows(target)
    grad = _fake_grad_like(logits) if grad_scale is not None else logits.new_empty(0)
    return (logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows, dtype=torch.float32), grad)


@torch.library.custom_op("astrai_kernels::grpo_forward", mutates_args=())
def grpo_forward(logits: Tensor, target: Tensor, temperature: float, advantages: Tensor,
                 old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                 token_weight: Tensor, clip_low: float, clip_high: float, delta: float,
                 beta: float, compute_grad: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    grad = _grad_like(logits) if compute_grad else logits.new_empty(0)
    logp, loss = backend_module(backend).grpo_forward(
        logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
        clip_low, clip_high, delta, beta, grad if compute_grad else None)
    return logp, loss, grad


@grpo_forward.register_fake
def _(logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
      clip_low, clip_high, delta, beta, compute_grad, backend):
    n_rows = _rows(target)
    grad = _fake_grad_like(logits) if compute_grad else logits.new_empty(0)
    return (logits.new_empty(n_rows, dtype=torch.float32),
            logits.new_empty(n_rows, dtype=torch.float32), grad)
