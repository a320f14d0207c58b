"""The fused LM head: losses from the hidden states and the LM head weight, never the logits.

Contract (docs/architecture.md, "Fused LM head"): each ``linear_*`` op equals its logits op
applied to ``F.linear(hidden, weight, bias)``, up to the rounding of the logits. The rows are
walked in chunks: a chunk's logits come from one matmul into a reused ``[chunk, V]`` buffer,
the backend's logits primitive (``ops/_backend.py``) runs on it and writes the chunk's logit
gradient over the same buffer, and three more matmuls fold that gradient into the gradients of
``hidden``, ``weight`` and ``bias``. Nothing ``[N, V]`` is ever allocated.

* ``linear_cross_entropy`` (``mean``/``sum``) and token-level ``linear_grpo_loss`` know each
  row's gradient factor up front, so the forward produces all three gradients in one walk and
  backward only scales them (out of place: a retained graph can be walked again).
* ``linear_token_logprobs`` and ``reduction="none"`` keep per-row ``lse`` (and entropy) and walk
  the chunks again in backward with the upstream per-row gradients.
* The weight's and bias's gradients are accumulated over chunks in float32 and rounded to the
  inputs' dtype once, at the end.

Chunk rule (``chunk_rows``): a chunk's logits buffer holds at most ``CHUNK_BYTES`` bytes of
float32 (64 MiB on CPU, 256 MiB on CUDA; a quarter of that when the head holds a float32 copy of
the weight), so the workspace is bounded whatever N and V are; an explicit ``chunk_size`` is
honoured as given. Larger chunks keep the three matmuls near the GEMM floor: at N=2048,
H=1024, V=32768 fp32 on 2 CPU cores, 128-row chunks ran at 1.4-1.7x the floor, 512 at 1.0-1.3x.

Compute dtype (``compute_dtype``): matmuls run in the inputs' dtype, except bfloat16/float16
on a CPU without native low-precision GEMMs (no AVX512-BF16/AMX), where they run in float32 on
a float32 copy of the weight: there a bf16 GEMM is 10-100x slower than the fp32 one.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Literal, Optional, Sequence, Tuple, Union, overload

import torch
from torch import Tensor

from .. import reference
from . import cross_entropy as ce_op
from . import grpo as grpo_op
from . import logprobs as lp_op
from ._backend import backend_module, resolve_backend
from ._common import (
    FLOAT_DTYPES,
    check_in_range,
    check_positive,
    flat_target,
    refuse_double_backward,
    scale_saved_grad,
)
from ._library import traceable_op

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}
# named by the error of a double backward (refuse_double_backward)
CE_EQUIVALENT = ("torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, "
                 "bias).float(), target, ...)")
LOGPROBS_EQUIVALENT = ("torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias)"
                       ".float() / temperature, -1).gather(-1, target[..., None])")
WEIGHT_COPY_SHARE = 4  # with a float32 copy of the weight, a chunk gets a quarter of the budget


def chunk_rows(n_rows: int, vocab: int, device: torch.device,
               chunk_size: Optional[int] = None, weight_copy: bool = False) -> int:
    """Rows per chunk: ``chunk_size`` when given, else what fits ``CHUNK_BYTES`` of fp32 logits
    (a quarter of it when the head also holds a float32 copy of the weight)."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n_rows))
    budget = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"])
    if weight_copy:
        budget //= WEIGHT_COPY_SHARE
    rows = budget // (4 * max(vocab, 1))
    if rows >= 16:
        rows -= rows % 16  # whole GEMM tiles
    return max(1, min(rows, n_rows))


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the head's matmuls run in (see the module docstring)."""
    if dtype == torch.float32 or torch.device(device).type != "cpu":
        return dtype
    mkldnn = getattr(torch.ops, "mkldnn", None)
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported",
             torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        native = bool(getattr(mkldnn, probe)())
    except (AttributeError, RuntimeError):
        native = False
    return dtype if native else torch.float32


class _ChunkedHead:
    """``hidden [N, H] @ weight.T + bias`` walked in row chunks, gradients folded per chunk.

    With ``logit_scale`` (1.0: off) and ``softcap`` (0.0: off) each chunk's logits are
    ``softcap * tanh(logit_scale * x / softcap)`` before any kernel sees them, and ``fold``
    turns the kernel's gradient with respect to them into the one with respect to ``x``
    (times ``logit_scale * (1 - tanh**2)``, the tanh kept in a second chunk buffer). A
    low-precision product is transformed in a float32 chunk buffer, so the transformed logits
    are rounded once, as the logits of the untransformed head are.
    """

    def __init__(self, hidden, weight, bias, chunk_size, needs_grad=(False, False, False),
                 logit_scale=1.0, softcap=0.0):
        self.dtype = hidden.dtype
        self.work_dtype = compute_dtype(hidden.dtype, hidden.device)
        self.hidden = hidden
        self.weight = weight.to(self.work_dtype)
        self.bias = None if bias is None else bias.to(self.work_dtype)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        self.chunk = chunk_rows(n_rows, vocab, hidden.device, chunk_size,
                                weight_copy=self.work_dtype != weight.dtype)
        self.buffer = hidden.new_empty((min(self.chunk, n_rows), vocab), dtype=self.work_dtype)
        needs_hidden, needs_weight, needs_bias = needs_grad
        self.grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        self.grad_weight_acc = (torch.zeros(weight.shape, dtype=torch.float32,
                                            device=weight.device) if needs_weight else None)
        # A low-precision product of one chunk lands here before its float32 accumulation.
        self.product = (torch.empty_like(weight) if needs_weight
                        and self.work_dtype != torch.float32 else None)
        self.grad_bias_acc = (torch.zeros(weight.shape[0], dtype=torch.float32,
                                          device=weight.device) if needs_bias else None)
        self.logit_scale, self.softcap = float(logit_scale), float(softcap or 0.0)
        transformed = self.logit_scale != 1.0 or bool(self.softcap)
        self.transformed = (self.buffer.new_empty(self.buffer.shape, dtype=torch.float32)
                            if transformed and self.work_dtype != torch.float32 else None)
        self.tanh = (self.buffer.new_empty(self.buffer.shape, dtype=torch.float32)
                     if self.softcap and any(needs_grad) else None)

    def _transform(self, logits):
        """``logits`` (one chunk, in place) become ``softcap * tanh(logit_scale * x / softcap)``."""
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)
        if self.softcap:
            logits.div_(self.softcap)
            if self.tanh is None:
                logits.tanh_()
            else:
                tanh = self.tanh[:logits.shape[0]]
                torch.tanh(logits, out=tanh)
                logits.copy_(tanh)
            logits.mul_(self.softcap)

    def chunks(self):
        """Yield ``(start, stop, logits [1, n, V])`` with the chunk's logits in the buffer."""
        n_rows = self.hidden.shape[0]
        for start in range(0, n_rows, self.chunk):
            stop = min(start + self.chunk, n_rows)
            rows = self.hidden[start:stop].to(self.work_dtype)
            logits = self.buffer[:stop - start]
            if self.bias is None:
                torch.mm(rows, self.weight.t(), out=logits)
            else:
                torch.addmm(self.bias, rows, self.weight.t(), out=logits)
            if self.transformed is not None:
                logits = self.transformed[:stop - start].copy_(logits)
            self._transform(logits)
            yield start, stop, logits.unsqueeze(0)

    def fold(self, start, stop, grad_logits):
        """Add the chunk's logit gradient (in the buffer) into the three gradients."""
        grad_logits = grad_logits.reshape(stop - start, -1)
        if self.softcap:  # d z / d(scaled x) = 1 - tanh**2
            tanh = self.tanh[:stop - start]
            grad_logits.mul_(tanh.mul_(tanh).neg_().add_(1.0))
        if self.logit_scale != 1.0:
            grad_logits.mul_(self.logit_scale)
        if self.transformed is not None:
            grad_logits = self.buffer[:stop - start].copy_(grad_logits)
        if self.grad_hidden is not None:
            if self.work_dtype == self.dtype:
                torch.mm(grad_logits, self.weight, out=self.grad_hidden[start:stop])
            else:
                self.grad_hidden[start:stop] = grad_logits @ self.weight
        if self.grad_weight_acc is not None:
            rows = self.hidden[start:stop].to(self.work_dtype)
            if self.product is None:
                self.grad_weight_acc.addmm_(grad_logits.t(), rows)
            else:
                torch.mm(grad_logits.t(), rows, out=self.product)
                self.grad_weight_acc.add_(self.product)
        if self.grad_bias_acc is not None:
            self.grad_bias_acc.add_(grad_logits.sum(0, dtype=torch.float32))

    def gradients(self):
        """``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtype; empty where unneeded."""
        # free the workspace before rounding
        self.buffer = self.weight = self.product = self.tanh = self.transformed = None
        grad_weight = _absent(self.hidden)
        if self.grad_weight_acc is not None:
            grad_weight = (self.grad_weight_acc if self.dtype == torch.float32
                           else self.grad_weight_acc.to(self.dtype))
        grad_bias = (_absent(self.hidden) if self.grad_bias_acc is None
                     else self.grad_bias_acc.to(self.dtype))
        grad_hidden = _absent(self.hidden) if self.grad_hidden is None else self.grad_hidden
        return grad_hidden, grad_weight, grad_bias


def _absent(like):
    """Marks a gradient that was not asked for (custom ops return tensors, never None)."""
    return like.new_empty(0)


def _or_none(grad):
    """None for an ``_absent`` gradient; real gradients are never 1-D and empty (V >= 1)."""
    return None if grad.dim() == 1 and grad.shape[0] == 0 else grad


def _fake_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias):
    return (hidden.new_empty(hidden.shape) if needs_hidden else _absent(hidden),
            weight.new_empty(weight.shape) if needs_weight else _absent(hidden),
            weight.new_empty(weight.shape[0]) if needs_bias else _absent(hidden))


def _row_floats(n_rows, device):
    return torch.empty(n_rows, dtype=torch.float32, device=device)


@traceable_op("linear_cross_entropy", floats=("label_smoothing", "z_loss", "softcap"))
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                          ignore_index: int, label_smoothing: float, z_loss: float,
                          softcap: float, grad_scale: Optional[Tensor], needs_hidden: bool,
                          needs_weight: bool, needs_bias: bool, chunk_size: Optional[int],
                          backend: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row losses and, when ``grad_scale`` is given, the gradients of the scaled sum."""
    needs = (needs_hidden, needs_weight, needs_bias) if grad_scale is not None else (False,) * 3
    head = _ChunkedHead(hidden, weight, bias, chunk_size, needs)
    kernels = backend_module(backend)
    loss = _row_floats(hidden.shape[0], hidden.device)
    for start, stop, logits in head.chunks():
        scale = None
        if grad_scale is not None:
            scale = grad_scale if grad_scale.numel() == 1 else grad_scale[start:stop]
        loss[start:stop], _ = kernels.cross_entropy_forward(
            logits, target[start:stop], ignore_index, label_smoothing, z_loss, softcap, scale,
            logits if scale is not None else None)
        if scale is not None:
            head.fold(start, stop, logits)
    return (loss, *head.gradients())


@_linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
      needs_hidden, needs_weight, needs_bias, chunk_size, backend):
    needs = (needs_hidden, needs_weight, needs_bias) if grad_scale is not None else (False,) * 3
    return (_row_floats(hidden.shape[0], hidden.device),
            *_fake_gradients(hidden, weight, *needs))


@traceable_op("linear_logprobs_forward", floats=("temperature", "logit_scale", "softcap"))
def _linear_logprobs_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                             target: Tensor, temperature: float, ignore_index: int,
                             with_entropy: bool, chunk_size: Optional[int], backend: str,
                             logit_scale: float, softcap: float, statistics: int
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse, stats)`` per row; entropy is empty unless ``with_entropy``;
    ``stats [k, N]`` holds the ``k`` statistics of the ``statistics`` bit mask
    (``STATISTICS`` order; ``is_top1`` as 0/1)."""
    head = _ChunkedHead(hidden, weight, bias, chunk_size, (False,) * 3, logit_scale, softcap)
    kernels = backend_module(backend)
    n_rows = hidden.shape[0]
    logp, lse = _row_floats(n_rows, hidden.device), _row_floats(n_rows, hidden.device)
    entropy = _row_floats(n_rows if with_entropy else 0, hidden.device)
    chosen = _chosen_statistics(statistics)
    stats = hidden.new_empty((len(chosen), n_rows), dtype=torch.float32)
    for start, stop, logits in head.chunks():
        chunk_logp, chunk_entropy, chunk_lse = kernels.logprobs_forward(
            logits, target[start:stop], temperature, ignore_index, with_entropy)
        logp[start:stop], lse[start:stop] = chunk_logp, chunk_lse
        if with_entropy:
            entropy[start:stop] = chunk_entropy
        if chosen:
            stats[:, start:stop] = _chunk_statistics(logits[0], target[start:stop], temperature,
                                                     chosen)
    return logp, entropy, lse, stats


@_linear_logprobs_forward.register_fake
def _(hidden, weight, bias, target, temperature, ignore_index, with_entropy, chunk_size, backend,
      logit_scale, softcap, statistics):
    n_rows = hidden.shape[0]
    return (_row_floats(n_rows, hidden.device),
            _row_floats(n_rows if with_entropy else 0, hidden.device),
            _row_floats(n_rows, hidden.device),
            hidden.new_empty((len(_chosen_statistics(statistics)), n_rows),
                             dtype=torch.float32))


#: The forward-only per-token statistics ``linear_token_logprobs(statistics=...)`` computes
#: from the walk's logits chunks, all of ``s = z / temperature`` (``z`` the transformed
#: logits): ``log sum_v softmax(s)_v**2``, the mean of ``s`` over the vocabulary, and whether
#: the target is ``argmax(s)`` (its first maximum: a tie with an earlier token is not top-1).
STATISTICS = ("log_sum_sq_probs", "mean_logits", "is_top1")


def _chosen_statistics(mask: int) -> Tuple[str, ...]:
    return tuple(name for bit, name in enumerate(STATISTICS) if mask >> bit & 1)


def _statistics_mask(statistics) -> int:
    if isinstance(statistics, str) or not all(isinstance(s, str) for s in statistics):
        raise TypeError(f"statistics must be a sequence of names among {STATISTICS}, got "
                        f"{statistics!r}")
    unknown = [name for name in statistics if name not in STATISTICS]
    if unknown:
        raise ValueError(f"statistics: unknown {unknown}; choose among {STATISTICS}")
    return sum(1 << bit for bit, name in enumerate(STATISTICS) if name in statistics)


def _chunk_statistics(logits, target, temperature, chosen):
    """The ``chosen`` statistics of one chunk's (transformed) logits ``[n, V]``, in float32
    torch ops on a temporary (forward only; the kernels' walk is untouched)."""
    scaled = logits.float() * (1.0 / temperature)
    rows = []
    for name in chosen:
        if name == "log_sum_sq_probs":
            rows.append(torch.logsumexp(2.0 * scaled, -1) - 2.0 * torch.logsumexp(scaled, -1))
        elif name == "mean_logits":
            rows.append(scaled.mean(-1))
        else:
            rows.append((scaled.argmax(-1) == target).float())
    return torch.stack(rows)


@traceable_op("linear_logprobs_backward", floats=("temperature", "logit_scale", "softcap"))
def _linear_logprobs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                              target: Tensor, lse: Tensor, entropy: Tensor, grad_logp: Tensor,
                              grad_entropy: Tensor, temperature: float, ignore_index: int,
                              needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                              chunk_size: Optional[int], backend: str,
                              logit_scale: float, softcap: float
                              ) -> Tuple[Tensor, Tensor, Tensor]:
    head = _ChunkedHead(hidden, weight, bias, chunk_size, (needs_hidden, needs_weight, needs_bias),
                        logit_scale, softcap)
    kernels = backend_module(backend)
    with_entropy = entropy.numel() > 0
    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        kernels.logprobs_backward(
            logits, target[rows], lse[rows], entropy[rows] if with_entropy else entropy,
            grad_logp[rows], grad_entropy[rows] if with_entropy else grad_entropy, temperature,
            ignore_index, logits)
        head.fold(start, stop, logits)
    return head.gradients()


@_linear_logprobs_backward.register_fake
def _(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, temperature,
      ignore_index, needs_hidden, needs_weight, needs_bias, chunk_size, backend, logit_scale,
      softcap):
    return _fake_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias)


@traceable_op("linear_grpo_forward",
               floats=("temperature", "clip_low", "clip_high", "delta", "beta"))
def _linear_grpo_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         temperature: float, advantages: Tensor, old_logprobs: Optional[Tensor],
                         ref_logprobs: Optional[Tensor], token_weight: Tensor, clip_low: float,
                         clip_high: float, delta: float, beta: float, needs_hidden: bool,
                         needs_weight: bool, needs_bias: bool, chunk_size: Optional[int],
                         backend: str, logit_scale: float, softcap: float
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, token_loss, grad_hidden, grad_weight, grad_bias)`` of ``sum(weight * loss)``."""
    needs = (needs_hidden, needs_weight, needs_bias)
    head = _ChunkedHead(hidden, weight, bias, chunk_size, needs, logit_scale, softcap)
    kernels = backend_module(backend)
    n_rows = hidden.shape[0]
    logp, token_loss = _row_floats(n_rows, hidden.device), _row_floats(n_rows, hidden.device)

    def rows_of(values, rows):
        return None if values is None else values[rows]

    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        logp[rows], token_loss[rows] = kernels.grpo_forward(
            logits, target[rows], temperature, advantages[rows], rows_of(old_logprobs, rows),
            rows_of(ref_logprobs, rows), token_weight[rows], clip_low, clip_high, delta, beta,
            logits if any(needs) else None)
        if any(needs):
            head.fold(start, stop, logits)
    return (logp, token_loss, *head.gradients())


@_linear_grpo_forward.register_fake
def _(hidden, weight, bias, target, temperature, advantages, old_logprobs, ref_logprobs,
      token_weight, clip_low, clip_high, delta, beta, needs_hidden, needs_weight, needs_bias,
      chunk_size, backend, logit_scale, softcap):
    n_rows = hidden.shape[0]
    return (_row_floats(n_rows, hidden.device), _row_floats(n_rows, hidden.device),
            *_fake_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias))


class _AttachHeadGrads(torch.autograd.Function):
    """Give ``value`` the forward-computed gradients w.r.t. ``hidden``, ``weight``, ``bias``.

    As ``AttachGrad`` does for logits: a single backward rescales them in place (no copy); a
    retained graph (or a compiled one) gets new tensors, so it can be walked again. ``op`` and
    ``alternative`` are for the error of a double backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, value, grad_hidden, grad_weight, grad_bias, op,
                alternative):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.op, ctx.alternative = op, alternative
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        refuse_double_backward(ctx.op, ctx.alternative)
        grads = (None if _or_none(g) is None else scale_saved_grad(g, grad_output)
                 for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None)


@dataclass(frozen=True)
class HeadArgs:
    """What every chunk walk needs besides the tensors: the chunk and the kernel backend."""
    chunk_size: Optional[int]
    backend: str


def _needs(hidden, weight, bias):
    return (hidden.requires_grad, weight.requires_grad,
            bias is not None and bias.requires_grad)


def _any_grad(hidden, weight, bias):
    return torch.is_grad_enabled() and any(_needs(hidden, weight, bias))


class _LinearCrossEntropyRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; backward walks the chunks with per-row grads."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ce_args, head_args):
        loss, _, _, _ = _linear_cross_entropy(hidden, weight, bias, target, *ce_args, None,
                                              False, False, False, head_args.chunk_size,
                                              head_args.backend)
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.ce_args, ctx.head_args = ce_args, head_args
        return loss

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward("linear_cross_entropy", CE_EQUIVALENT)
        hidden, weight, bias, target = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        _, grad_hidden, grad_weight, grad_bias = _linear_cross_entropy(
            hidden, weight, bias, target, *ctx.ce_args, grad_rows.float().contiguous(), *needs,
            ctx.head_args.chunk_size, ctx.head_args.backend)
        return (_or_none(grad_hidden), _or_none(grad_weight), _or_none(grad_bias), None, None,
                None)


class _LinearTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy, stats)``; the statistics are forward-only (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, temperature, ignore_index, with_entropy,
                head_args, transform=(1.0, 0.0), statistics=0):
        logp, entropy, lse, stats = _linear_logprobs_forward(
            hidden, weight, bias, target, temperature, ignore_index, with_entropy,
            head_args.chunk_size, head_args.backend, *transform, statistics)
        ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
        ctx.args = (temperature, ignore_index, with_entropy, head_args, transform)
        ctx.mark_non_differentiable(stats)
        if with_entropy:
            return logp, entropy, stats
        return logp, entropy.new_zeros(logp.shape), stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        refuse_double_backward("linear_token_logprobs", LOGPROBS_EQUIVALENT)
        hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, with_entropy, head_args, transform = ctx.args
        grad_logp = lp_op._dense(grad_logp, lse)
        grad_entropy = lp_op._dense(grad_entropy, lse) if with_entropy else lse.new_empty(0)
        grads = _linear_logprobs_backward(
            hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, temperature,
            ignore_index, *ctx.needs_input_grad[:3], head_args.chunk_size, head_args.backend,
            *transform)
        return (*(_or_none(g) for g in grads), None, None, None, None, None, None, None)


def _check_head(hidden, weight, bias, chunk_size):
    """Types, shapes, dtypes and devices of the head's tensors; returns ``hidden`` as 2-D rows."""
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[-1] = "
                         f"{hidden.shape[-1]}, got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one row (V >= 1), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    return hidden.reshape(-1, hidden.shape[-1])


def _logits_like(hidden, weight):
    """A zero-byte stand-in with the logits' shape, dtype and device, for the shared checks."""
    return hidden.new_zeros(()).expand(*hidden.shape[:-1], weight.shape[0])


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         normalizer: Union[None, float, Tensor] = None,
                         chunk_size: Optional[int] = None, backend: str = "auto",
                         process_group: Optional["ProcessGroup"] = None,
                         check_consistency: bool = True) -> Tensor:
    """Cross-entropy of ``hidden [..., H] @ weight[V, H].T + bias`` against ``target [...]``.

    Equals ``ak.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (every keyword
    means the same) without holding the ``[N, V]`` logits; float32 result. With
    ``process_group`` the weight (and bias) hold this rank's vocabulary shard and the hidden
    states' gradient is summed over the group (``ops/vocab_parallel.py``; ``check_consistency``
    as in ``cross_entropy``).
    """
    if process_group is not None:
        from . import vocab_parallel

        return vocab_parallel.linear_cross_entropy(
            hidden, weight, target, process_group=process_group, bias=bias,
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, normalizer=normalizer, chunk_size=chunk_size,
            backend=backend, check_consistency=check_consistency)
    hidden_rows = _check_head(hidden, weight, bias, chunk_size)
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        return ce_op.cross_entropy(torch.nn.functional.linear(hidden, weight, bias), target,
                                   ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=label_smoothing, z_loss=z_loss,
                                   softcap=softcap, normalizer=normalizer, backend="reference")
    # The logits op's own checks and scale rules, run on a zero-byte stand-in for the logits.
    params, normalizer_t = ce_op.checked_params(
        _logits_like(hidden, weight), target, ignore_index, reduction, label_smoothing, z_loss,
        softcap, normalizer, False, backend)
    target_flat = flat_target(target)
    ce_args = (params.ignore_index, params.label_smoothing, params.z_loss, params.softcap)
    head_args = HeadArgs(chunk_size, params.backend)
    if reduction == "none":
        if _any_grad(hidden, weight, bias):
            loss = _LinearCrossEntropyRows.apply(hidden_rows, weight, bias, target_flat,
                                                 ce_args, head_args)
        else:
            loss, _, _, _ = _linear_cross_entropy(hidden_rows, weight, bias, target_flat,
                                                  *ce_args, None, False, False, False,
                                                  chunk_size, params.backend)
        return loss.view(target.shape)
    scale = ce_op._grad_scale(target_flat, params, normalizer_t)
    needs = _needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    with torch.no_grad():
        loss, grad_hidden, grad_weight, grad_bias = _linear_cross_entropy(
            hidden_rows, weight, bias, target_flat, *ce_args, scale if any(needs) else None,
            *needs, chunk_size, params.backend)
        value = ce_op._reduce(loss, scale, params)
    if not any(needs):
        return value
    return _AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_cross_entropy", CE_EQUIVALENT)


@overload
def linear_token_logprobs(hidden: Tensor, weight: Tensor, target: Tensor, *,
                          bias: Optional[Tensor] = ..., temperature: float = ...,
                          ignore_index: int = ..., return_entropy: Literal[False] = ...,
                          softcap: Optional[float] = ..., logit_scale: float = ...,
                          statistics: Sequence[str] = ..., chunk_size: Optional[int] = ...,
                          backend: str = ...,
                          process_group: Optional["ProcessGroup"] = ...,
                          check_consistency: bool = ...) -> Tensor: ...


@overload
def linear_token_logprobs(hidden: Tensor, weight: Tensor, target: Tensor, *,
                          bias: Optional[Tensor] = ..., temperature: float = ...,
                          ignore_index: int = ..., return_entropy: Literal[True],
                          softcap: Optional[float] = ..., logit_scale: float = ...,
                          statistics: Sequence[str] = ..., chunk_size: Optional[int] = ...,
                          backend: str = ...,
                          process_group: Optional["ProcessGroup"] = ...,
                          check_consistency: bool = ...) -> Tuple[Tensor, Tensor]: ...


def linear_token_logprobs(hidden, weight, target, *, bias=None, temperature=1.0,
                          ignore_index=-100, return_entropy=False, softcap=None,
                          logit_scale=1.0, statistics=(), chunk_size=None, backend="auto",
                          process_group=None, check_consistency=True):
    """Log-probs of ``target`` under ``softmax(z / temperature)``, where ``z`` are the logits
    ``x = hidden @ weight.T + bias`` times ``logit_scale``, then soft-capped to
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set (Gemma 2's final soft-cap; TRL's
    and transformers' order: scale, cap, temperature).

    float32 ``[...]`` (and the entropy with ``return_entropy=True``, differentiable). Under
    ``torch.no_grad()`` (or with no input requiring grad) it runs forward only and allocates no
    gradient buffer: the way to compute old- and reference-policy log-probs. ``statistics``:
    names among ``STATISTICS`` (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), computed
    from the same walk, without gradient; when given, a dict of them (float32, ``is_top1``
    bool; 0 / False on ignored rows) is appended to the result. ``process_group``: vocabulary
    parallel, as in ``linear_cross_entropy`` (no softcap, logit scale or statistics there).
    """
    logit_scale, softcap_value = _checked_transform(logit_scale, softcap)
    stats_mask = _statistics_mask(statistics)
    if process_group is not None:
        _refuse_transform_with_process_group(logit_scale, softcap_value, stats_mask)
        from . import vocab_parallel

        return vocab_parallel.linear_token_logprobs(
            hidden, weight, target, process_group=process_group, bias=bias,
            temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
            chunk_size=chunk_size, backend=backend, check_consistency=check_consistency)
    hidden_rows = _check_head(hidden, weight, bias, chunk_size)
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        logits = _reference_logits(hidden, weight, bias, logit_scale, softcap)
        out = lp_op.token_logprobs(logits, target, temperature=temperature,
                                   ignore_index=ignore_index, return_entropy=return_entropy,
                                   backend="reference")
        if not stats_mask:
            return out
        with torch.no_grad():
            stats = reference.token_statistics(logits.detach().float(), target, temperature,
                                               ignore_index)
        stats = {name: stats[name] for name in _chosen_statistics(stats_mask)}
        return (*out, stats) if return_entropy else (out, stats)
    params = lp_op.checked_params(_logits_like(hidden, weight), target, temperature,
                                  ignore_index, return_entropy, False, backend)
    target_flat = flat_target(target)
    transform = (logit_scale, softcap_value)
    if _any_grad(hidden, weight, bias):
        logp, entropy, stats = _LinearTokenLogprobs.apply(
            hidden_rows, weight, bias, target_flat, params.temperature, params.ignore_index,
            params.with_entropy, HeadArgs(chunk_size, params.backend), transform, stats_mask)
    else:
        logp, entropy, _, stats = _linear_logprobs_forward(
            hidden_rows, weight, bias, target_flat, params.temperature, params.ignore_index,
            params.with_entropy, chunk_size, params.backend, *transform, stats_mask)
    logp = logp.view(target.shape)
    out = (logp, entropy.view(target.shape)) if return_entropy else logp
    if not stats_mask:
        return out
    valid = (target_flat != params.ignore_index).view(target.shape)
    named = {}
    for row, name in zip(stats, _chosen_statistics(stats_mask)):
        value = row.view(target.shape)
        named[name] = (value > 0) & valid if name == "is_top1" else torch.where(valid, value, 0.0)
    return (*out, named) if return_entropy else (out, named)


def _reference_logits(hidden, weight, bias, logit_scale, softcap):
    """The transformed logits for ``backend="reference"``: float32 math on the product."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logit_scale == 1.0 and softcap is None:
        return logits
    return reference.transform_logits(logits.float(), logit_scale, softcap)


def _checked_transform(logit_scale, softcap):
    """``(logit_scale, softcap)`` as floats (softcap 0.0 when None), checked."""
    logit_scale = check_in_range(logit_scale, "logit_scale", -math.inf, math.inf)
    softcap_value = 0.0 if softcap is None else check_positive(softcap, "softcap")
    return logit_scale, softcap_value


def _refuse_transform_with_process_group(logit_scale, softcap, stats_mask):
    if logit_scale != 1.0 or softcap or stats_mask:
        raise ValueError("softcap, logit_scale and statistics are not supported with "
                         "process_group (the vocabulary-parallel head)")


def linear_sequence_logprobs(hidden: Tensor, weight: Tensor, target: Tensor, mask: Tensor, *,
                             bias: Optional[Tensor] = None, average: bool = False,
                             temperature: float = 1.0, softcap: Optional[float] = None,
                             logit_scale: float = 1.0, chunk_size: Optional[int] = None,
                             backend: str = "auto") -> Tensor:
    """Per-sequence sum (or mean over ``mask``) of token log-probs; hidden ``[B, T, H]``;
    ``softcap`` and ``logit_scale`` as in ``linear_token_logprobs``."""
    _check_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    keep = lp_op.checked_sequence_mask(_logits_like(hidden, weight), target, mask, average)
    masked_target = torch.where(keep, target, torch.full_like(target, -100))
    logp = linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                 temperature=temperature, ignore_index=-100, softcap=softcap,
                                 logit_scale=logit_scale, chunk_size=chunk_size,
                                 backend=backend)
    return lp_op.reduce_sequence(logp, mask, average)


def linear_grpo_loss(hidden: Tensor, weight: Tensor, target: Tensor, advantages: Tensor, *,
                     bias: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                     old_logprobs: Optional[Tensor] = None,
                     ref_logprobs: Optional[Tensor] = None, beta: float = 0.0,
                     clip_eps_low: float = 0.2, clip_eps_high: Optional[float] = None,
                     delta: Optional[float] = None, loss_type: str = "bnpo",
                     importance_sampling: str = "token", temperature: float = 1.0,
                     max_completion_length: Optional[int] = None,
                     normalizer: Union[None, float, Tensor] = None,
                     sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
                     vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                     vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                     kl_ratio_correction: bool = False,
                     importance_weights: Optional[Tensor] = None,
                     off_policy_threshold: Optional[float] = None,
                     sampling_logprobs: Optional[Tensor] = None,
                     top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0,
                     softcap: Optional[float] = None, logit_scale: float = 1.0,
                     chunk_size: Optional[int] = None, backend: str = "auto",
                     process_group: Optional["ProcessGroup"] = None,
                     check_consistency: bool = True) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO loss and metrics of ``grpo_loss(F.linear(hidden, weight, bias), ...)``, fused.

    ``hidden [B, T, H]`` aligned with ``target [B, T]`` (the caller shifts); every keyword as in
    ``ak.grpo_loss``. The clipped surrogate on token ratios computes all gradients in the
    forward's single walk over the chunks; every other objective and option (GSPO, CISPO, SAPO,
    VESPO, the masks, the entropy bonus) differentiates through ``linear_token_logprobs``.
    ``softcap`` and ``logit_scale`` transform the logits before the temperature, as in
    ``linear_token_logprobs``. ``process_group``: vocabulary parallel, as in
    ``linear_cross_entropy`` (no softcap or logit scale there).
    """
    logit_scale, softcap_value = _checked_transform(logit_scale, softcap)
    options = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, beta=beta,
                   clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, delta=delta,
                   loss_type=loss_type, importance_sampling=importance_sampling,
                   temperature=temperature, max_completion_length=max_completion_length,
                   normalizer=normalizer, sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg,
                   vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
                   vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
                   kl_ratio_correction=kl_ratio_correction,
                   importance_weights=importance_weights,
                   off_policy_threshold=off_policy_threshold,
                   sampling_logprobs=sampling_logprobs,
                   top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef)
    if process_group is not None:
        _refuse_transform_with_process_group(logit_scale, softcap_value, 0)
        from . import vocab_parallel

        return vocab_parallel.linear_grpo_loss(
            hidden, weight, target, advantages, process_group=process_group, bias=bias,
            chunk_size=chunk_size, backend=backend, check_consistency=check_consistency,
            **options)
    _check_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        logits = _reference_logits(hidden, weight, bias, logit_scale, softcap)
        return grpo_op.grpo_loss(logits, target, advantages, backend="reference", **options)
    plan = grpo_op.plan(_logits_like(hidden, weight), target, advantages, backend=backend,
                        **options)
    if not plan.fused:
        def logprobs_of(masked_target, with_entropy):
            out = linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                        temperature=plan.params.temperature,
                                        return_entropy=with_entropy, softcap=softcap,
                                        logit_scale=logit_scale, chunk_size=chunk_size,
                                        backend=plan.params.backend)
            return out if with_entropy else (out, None)
        return grpo_op.from_logprobs(logprobs_of, target, plan)
    needs = _needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    flat = plan.flat_rows()
    with torch.no_grad():
        logp, token_loss, grad_hidden, grad_weight, grad_bias = _linear_grpo_forward(
            hidden_rows, weight, bias, flat_target(target), plan.params.temperature,
            flat.advantages, flat.old, flat.ref, flat.weight, plan.params.clip_eps_low,
            plan.params.clip_eps_high, plan.params.delta, plan.params.beta, *needs, chunk_size,
            plan.params.backend, logit_scale, softcap_value)
        value, metrics = grpo_op.token_level_result(logp, token_loss, plan)
    if not any(needs):
        return value, metrics
    loss = _AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_grpo_loss", None)
    return loss, metrics
