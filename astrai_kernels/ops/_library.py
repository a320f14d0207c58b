"""The backends' primitives as ``torch.library`` custom ops, so ``torch.compile`` traces through.

Each op is functional (it allocates the gradient it returns) and dispatches on ``backend`` to
the module named in ``_backend.py``; its fake implementation states the output shapes. The
in-place-gradient paths call the backend modules directly instead (an op may not return an
alias of its input).

:func:`traceable_op` makes these ops (and the fused head's in ``linear.py``):

* Float hyperparameters (temperature, softcap, z-loss, ...) cross the op boundary as 0-d
  float64 CPU tensors (:func:`float_arg`) and are read back with ``.item()`` in the op body,
  where the kernels take them as runtime arguments. A ``float`` in an op's schema would make
  Dynamo specialize the graph on its value (one compile per temperature); a tensor keeps a
  float argument of a compiled function symbolic. Reading a CPU scalar is no device sync.
* Eager calls (no ``torch.compile``, no tracing mode, plain tensors) run the body directly with
  the Python floats: no dispatcher round trip, and no import of Dynamo, which a custom op's
  first call would otherwise trigger (and with it Inductor and Triton, about 1.5 s).

For ``backend="triton"`` (torch >= 2.6) the primitives also have ``torch.library.triton_op``
twins whose bodies launch the kernels through ``wrap_triton``: traced, Inductor then sees the
Triton kernels themselves in the graph (user-defined Triton kernels it can schedule and fuse
around) rather than an opaque call, and the fake implementation is the body traced with fake
tensors. The public functions below pick a twin when the backend is ``triton`` and the call is
traced; under ``torch.compile`` the string is a constant, so the choice is made once at trace
time. The twins take their hyperparameters as Python floats (a traced kernel launch needs
numbers), so under ``torch.compile`` the triton backend compiles once per distinct value of a
float argument. Defining them imports Inductor and Triton, so that happens on the first traced
triton call, not at import.
"""

import inspect
from typing import Optional

import torch
from torch import Tensor

from ..cpu.memory import empty_gradient
from ._backend import backend_module

_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def float_arg(value) -> Tensor:
    """A float hyperparameter as the 0-d float64 CPU tensor the custom ops take."""
    if torch.compiler.is_compiling():
        # torch.tensor(x) of a traced float bakes its value into the graph; arithmetic on a
        # tensor keeps it a graph input, so a new value reuses the compiled graph
        return torch.zeros((), dtype=torch.float64).add(value)
    return torch.tensor(value, dtype=torch.float64)


def runs_eagerly(args) -> bool:
    """True when nothing traces this call: not ``torch.compile``, no dispatch mode (fake,
    proxy, functionalization), no functorch transform, and the tensors are plain ones."""
    return (not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(type(arg) in _PLAIN_TENSORS for arg in args if isinstance(arg, Tensor)))


def traceable_op(name, floats=()):
    """Make ``fn`` (float hyperparameters ``floats`` taken as Python floats) the custom op
    ``astrai_kernels::name``: the returned function calls ``fn`` itself when
    :func:`runs_eagerly`, else the op, with those floats as :func:`float_arg` tensors.
    ``register_fake`` registers the op's fake implementation (it gets the tensors)."""
    def wrap(fn):
        signature = inspect.signature(fn)
        float_positions = [i for i, param in enumerate(signature.parameters.values())
                           if param.name in floats]

        def body(*args):
            args = list(args)
            for i in float_positions:
                args[i] = args[i].item()
            return fn(*args)

        body.__signature__ = signature.replace(parameters=[
            param.replace(annotation=Tensor) if param.name in floats else param
            for param in signature.parameters.values()])
        body.__name__, body.__doc__ = fn.__name__, fn.__doc__
        op = torch.library.custom_op(f"astrai_kernels::{name}", body, mutates_args=())

        def call(*args):
            if runs_eagerly(args):
                return fn(*args)
            args = list(args)
            for i in float_positions:
                args[i] = float_arg(args[i])
            return op(*args)

        call.op, call.register_fake = op, op.register_fake
        call.__name__, call.__doc__ = fn.__name__, fn.__doc__
        return call
    return wrap


def _rows(target):
    return target.numel()


def _grad_like(logits):
    return empty_gradient(logits.shape, logits.dtype, logits.device)


def _fake_grad_like(logits):
    return logits.new_empty(logits.shape)


@traceable_op("logprobs_forward", floats=("temperature",))
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


@traceable_op("logprobs_backward", floats=("temperature",))
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


@traceable_op("cross_entropy_forward", floats=("label_smoothing", "z_loss", "softcap"))
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


@traceable_op("grpo_forward", floats=("temperature", "clip_low", "clip_high", "delta", "beta"))
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


# hard_weight stays a Python float in the schema: the forward's outputs depend on whether it
# is 0 (no hard-term statistics), which a fake implementation must know at trace time.
@traceable_op("distill_forward", floats=("beta", "temperature"))
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


@traceable_op("distill_backward", floats=("beta", "temperature"))
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


TRITON_OPS = hasattr(torch.library, "triton_op")
_TRITON_TWINS = {}


def _define_triton_twins():
    """The ``triton_op`` twins of the primitives, by primitive name."""
    def triton():
        return backend_module("triton")

    @torch.library.triton_op("astrai_kernels::triton_logprobs_forward", mutates_args=())
    def logprobs_forward(logits: Tensor, target: Tensor, temperature: float, ignore_index: int,
                         with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
        return triton().logprobs_forward(logits, target, temperature, ignore_index, with_entropy)

    @torch.library.triton_op("astrai_kernels::triton_logprobs_backward", mutates_args=())
    def logprobs_backward(logits: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
                          grad_logp: Tensor, grad_entropy: Tensor, temperature: float,
                          ignore_index: int) -> Tensor:
        grad = torch.empty_like(logits)
        triton().logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy,
                                   temperature, ignore_index, grad)
        return grad

    @torch.library.triton_op("astrai_kernels::triton_cross_entropy_forward", mutates_args=())
    def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int,
                              label_smoothing: float, z_loss: float, softcap: float,
                              grad_scale: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        grad = torch.empty_like(logits) if grad_scale is not None else logits.new_empty(0)
        loss, lse = triton().cross_entropy_forward(
            logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
            grad if grad_scale is not None else None)
        return loss, lse, grad

    @torch.library.triton_op("astrai_kernels::triton_grpo_forward", mutates_args=())
    def grpo_forward(logits: Tensor, target: Tensor, temperature: float, advantages: Tensor,
                     old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                     token_weight: Tensor, clip_low: float, clip_high: float, delta: float,
                     beta: float, compute_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
        logp, loss = triton().grpo_forward(
            logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
            clip_low, clip_high, delta, beta, grad if compute_grad else None)
        return logp, loss, grad

    @torch.library.triton_op("astrai_kernels::triton_distill_forward", mutates_args=())
    def distill_forward(student: Tensor, teacher: Tensor, target: Tensor, ignore_index: int,
                        beta: float, temperature: float, hard_weight: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return triton().distill_forward(student, teacher, target, ignore_index, beta,
                                        temperature, hard_weight)

    @torch.library.triton_op("astrai_kernels::triton_distill_backward", mutates_args=())
    def distill_backward(student: Tensor, teacher: Tensor, target: Tensor, ignore_index: int,
                         beta: float, temperature: float, hard_weight: float,
                         student_lse: Tensor, teacher_lse: Tensor, student_kl: Tensor,
                         hard_lse: Tensor, grad_loss: Tensor) -> Tensor:
        grad = torch.empty_like(student)
        triton().distill_backward(student, teacher, target, ignore_index, beta, temperature,
                                  hard_weight, student_lse, teacher_lse, student_kl, hard_lse,
                                  grad_loss, grad)
        return grad

    return dict(logprobs_forward=logprobs_forward, logprobs_backward=logprobs_backward,
                cross_entropy_forward=cross_entropy_forward, grpo_forward=grpo_forward,
                distill_forward=distill_forward, distill_backward=distill_backward)


def _use_triton_twins(backend, args):
    """True when ``backend`` is ``triton``, the call is traced and the ``triton_op`` twins exist
    (defined now if this is the first such call)."""
    if backend != "triton" or not TRITON_OPS or runs_eagerly(args):
        return False
    return _triton_twins_defined()


def _triton_twins_defined():
    if not _TRITON_TWINS:
        _TRITON_TWINS.update(_define_triton_twins())
    return True


# Run as plain Python when Dynamo meets it (the twins' definition cannot be traced); it takes
# no argument, so its result is a constant.
_triton_twins_defined._dynamo_marked_constant = True


def logprobs_forward(logits, target, temperature, ignore_index, with_entropy, backend):
    """``(logp, entropy, lse)``: ``ops/_backend.py``'s primitive as a traceable op."""
    if _use_triton_twins(backend, (logits, target)):
        return _TRITON_TWINS["logprobs_forward"](logits, target, temperature, ignore_index,
                                                 with_entropy)
    return _logprobs_forward(logits, target, temperature, ignore_index, with_entropy, backend)


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
                      ignore_index, backend):
    """The gradient w.r.t. ``logits``, a new tensor: ``ops/_backend.py``'s primitive."""
    args = (logits, target, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index)
    if _use_triton_twins(backend, args):
        return _TRITON_TWINS["logprobs_backward"](*args)
    return _logprobs_backward(*args, backend)


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                          grad_scale, backend):
    """``(loss, lse, grad)``; ``grad`` is empty unless ``grad_scale`` is given."""
    args = (logits, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale)
    if _use_triton_twins(backend, args):
        return _TRITON_TWINS["cross_entropy_forward"](*args)
    return _cross_entropy_forward(*args, backend)


def grpo_forward(logits, target, temperature, advantages, old_logprobs, ref_logprobs,
                 token_weight, clip_low, clip_high, delta, beta, compute_grad, backend):
    """``(logp, loss, grad)``; ``grad`` is empty unless ``compute_grad``."""
    args = (logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
            clip_low, clip_high, delta, beta, compute_grad)
    if _use_triton_twins(backend, args):
        return _TRITON_TWINS["grpo_forward"](*args)
    return _grpo_forward(*args, backend)


def distill_forward(student, teacher, target, ignore_index, beta, temperature, hard_weight,
                    backend):
    """``(loss, student_lse, teacher_lse, student_kl, hard_lse)``: ``ops/_backend.py``'s
    primitive as a traceable op."""
    args = (student, teacher, target, ignore_index, beta, temperature, hard_weight)
    if _use_triton_twins(backend, args):
        return _TRITON_TWINS["distill_forward"](*args)
    return _distill_forward(*args, backend)


def distill_backward(student, teacher, target, ignore_index, beta, temperature, hard_weight,
                     student_lse, teacher_lse, student_kl, hard_lse, grad_loss, backend):
    """The gradient w.r.t. ``student``, a new tensor: ``ops/_backend.py``'s primitive."""
    args = (student, teacher, target, ignore_index, beta, temperature, hard_weight, student_lse,
            teacher_lse, student_kl, hard_lse, grad_loss)
    if _use_triton_twins(backend, args):
        return _TRITON_TWINS["distill_backward"](*args)
    return _distill_backward(*args, backend)
