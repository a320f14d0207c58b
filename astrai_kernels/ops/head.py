"""The fused LM head's engine: ``hidden @ weight.T + bias`` walked in row chunks.

Every fused-head op (the ``linear_*`` form in each family's file, the vocabulary-parallel head
in ``distributed/vocab_shard.py``) runs its logits primitive on the chunks that
:class:`ChunkedHead` yields: a chunk's logits come from one matmul into a reused
``[chunk, V]`` buffer, the primitive writes the chunk's logit gradient over the same buffer, and
:meth:`ChunkedHead.fold` turns it into the gradients of ``hidden``, ``weight`` and ``bias``.
Nothing ``[N, V]`` is ever allocated. The weight's and bias's gradients are accumulated over
chunks in float32 and rounded to the inputs' dtype once, at the end. :func:`head_walk` generates
that walk for a primitive from its declaration (``kernels/primitives.py``): the custom op and its
fake.

Which pass computes what: ``linear_cross_entropy`` (``mean``/``sum``) and token-level
``linear_grpo_loss`` know each row's gradient factor up front, so the forward produces all three
gradients in one walk and backward only scales them (out of place: a retained graph can be
walked again); ``linear_token_logprobs`` and ``reduction="none"`` keep per-row ``lse`` (and
entropy) and walk the chunks again in backward with the upstream per-row gradients.

Chunk rule (:func:`chunk_rows`): a chunk's float32 logits take at most ``CHUNK_BYTES`` (64 MiB
on CPU, 256 MiB on CUDA; a quarter with a float32 copy of the weight) and at least
``MIN_GEMM_ROWS`` rows, so the workspace is bounded whatever N and V are and the three matmuls
stay near the GEMM floor (at N=2048, H=1024, V=32768 fp32 on 2 CPU cores, 128-row chunks ran
1.4-1.7x the floor, 512 1.0-1.3x); an explicit ``chunk_size`` is honoured as given.

Compute dtype (``kernels/matmul.py``): the inputs' dtype, except bf16/fp16 on a CPU without
native low-precision GEMMs (no AVX512-BF16/AMX; 10-100x slower there), which runs float32 on a
float32 copy of the weight. ``ASTRAI_KERNELS_HEAD_MATMUL`` (``native``/``float32``) forces one.

Weight gradient precision: every chunk's product ``grad_logits.T @ rows`` lands in the float32
accumulator unrounded, and the weight's gradient is rounded to a 16-bit dtype once, as the
naive path's single GEMM rounds it: a GEMM of the 16-bit operands with a float32 output where
torch has one (``torch.mm(..., out_dtype=torch.float32)``, CUDA), else (CPU) a float32 GEMM of
the upcast operands, on oneDNN's bf16 units for bf16 (``bf16_products``: exact on the
upcast values, 3.3x the float32 GEMM on an AVX512-BF16 EPYC). The hidden states' gradient is
one GEMM over the whole vocabulary per chunk of rows, rounded once; the bias's is summed in
float32.
"""

import collections
import contextlib
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from ..kernels.library import traceable_op
from ..kernels.matmul import (
    bf16_products,
    compute_dtype,
    has_bf16_float32_gemm,
    has_float32_product,
)
from ..kernels.memory import cached_empty
from ..kernels.primitives import ALWAYS, NONE, OPTIONAL, declared
from ..kernels.registry import backend_module
from ._common import FLOAT_DTYPES, refuse_double_backward, scale_saved_grad

CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}
WEIGHT_COPY_SHARE = 4  # with a float32 copy of the weight, a chunk gets a quarter of the budget
# Each chunk's three GEMMs read the whole [V, H] weight: with few rows they stream it from memory
# more than they compute. At V = 262144, H = 1024 (bf16, Xeon with AMX) 16-64 rows ran 3.0x the
# GEMM floor, 512 rows 1.19x. So a chunk has at least this many rows, or H / 2 where that is
# fewer: its float32 logits then take at most half the weight gradient's float32 accumulator.
MIN_GEMM_ROWS = 512


def chunk_rows(n_rows: int, vocab: int, device: torch.device,
               chunk_size: Optional[int] = None, weight_copy: bool = False,
               hidden: int = 0) -> int:
    """Rows per chunk: ``chunk_size`` when given, else what fits ``CHUNK_BYTES`` of fp32 logits
    (a quarter of it when the head also holds a float32 copy of the weight), but at least
    ``min(MIN_GEMM_ROWS, hidden // 2)`` for a head of ``hidden`` columns."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n_rows))
    budget = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"])
    if weight_copy:
        budget //= WEIGHT_COPY_SHARE
    rows = max(budget // (4 * max(vocab, 1)), min(MIN_GEMM_ROWS, hidden // 2))
    if rows >= 16:
        rows -= rows % 16  # whole GEMM tiles
    return max(1, min(rows, n_rows))


class ChunkedHead:
    """``hidden [N, H] @ weight.T + bias`` walked in row chunks, gradients folded per chunk.

    With ``logit_scale`` (1.0: off) and ``softcap`` (0.0: off) each chunk's logits are
    ``softcap * tanh(logit_scale * x / softcap)`` before any kernel sees them, and ``fold``
    turns the kernel's gradient with respect to them into the one with respect to ``x``
    (times ``logit_scale * (1 - tanh**2)``, the tanh kept in a second chunk buffer). A
    low-precision product is transformed in a float32 chunk buffer, so the transformed logits
    are rounded once, as the logits of the untransformed head are.
    """

    def __init__(self, hidden, weight, bias, chunk_size, needs_grad=(False, False, False),
                 logit_scale=1.0, softcap=0.0, hidden_grad_float32=False, kept=None):
        self.dtype = hidden.dtype
        self.work_dtype = compute_dtype(hidden.dtype, hidden.device)
        self.hidden = hidden
        self.weight = weight.to(self.work_dtype)
        self.bias = None if bias is None else bias.to(self.work_dtype)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        self.chunk = chunk_rows(n_rows, vocab, hidden.device, chunk_size,
                                weight_copy=self.work_dtype != weight.dtype,
                                hidden=weight.shape[1])
        # The large buffers come from the CPU gradient cache (kernels/memory.py): in a training loop
        # each call reuses the last call's pages instead of faulting fresh ones.
        device = hidden.device
        self.last_start = (n_rows - 1) // self.chunk * self.chunk if n_rows else None
        self._inputs = (weight, bias)
        # ``kept``: a forward's last chunk to start from (its product not computed again)
        self.kept_start = self.last_start if kept is not None and kept.holds(self.key()) else None
        self.buffer = (kept.logits if self.kept_start is not None else
                       cached_empty((min(self.chunk, n_rows), vocab), self.work_dtype, device))
        if kept is not None:
            kept.drop()
        needs_hidden, needs_weight, needs_bias = needs_grad
        # float32 where the caller sums it further (a vocabulary shard's part, all-reduced)
        self.grad_hidden = (cached_empty(hidden.shape, torch.float32 if hidden_grad_float32
                                         else hidden.dtype, device) if needs_hidden else None)
        # Written by the first chunk's product, accumulated into by the others (no zero pass).
        self.grad_weight_acc = (cached_empty(weight.shape, torch.float32, device)
                                if needs_weight else None)
        self.weight_grad_written = False
        self.grad_bias_acc = (torch.zeros(weight.shape[0], dtype=torch.float32,
                                          device=weight.device) if needs_bias else None)
        self.logit_scale, self.softcap = float(logit_scale), float(softcap or 0.0)
        transformed = self.logit_scale != 1.0 or bool(self.softcap)
        low_precision = self.work_dtype != torch.float32
        self.transformed = (cached_empty(self.buffer.shape, torch.float32, device)
                            if transformed and low_precision else None)
        self.tanh = (cached_empty(self.buffer.shape, torch.float32, device)
                     if self.softcap and any(needs_grad) else None)
        # 16-bit products with a float32 result: one GEMM where the device has it, else on the
        # chunk's logit gradient upcast into ``upcast`` (see the module docstring). A transformed
        # head already holds it in float32, unrounded, except where the bf16 units multiply
        # (bf16_products): they need the rounded values in float32 to be exact.
        self.float32_product = low_precision and has_float32_product(device, self.work_dtype)
        self.bf16_upcast_products = (self.work_dtype == torch.bfloat16
                                     and not self.float32_product
                                     and has_bf16_float32_gemm(device))
        float32_results = needs_weight or (needs_hidden and hidden_grad_float32)
        self.upcast = (cached_empty(self.buffer.shape, torch.float32, device)
                       if float32_results and low_precision and not self.float32_product
                       and (self.transformed is None or self.bf16_upcast_products) else None)
        self.weight_float32 = None  # for a float32 hidden gradient from upcast chunks

    def key(self):
        """What a kept chunk's head must equal: its tensors and its chunk rule."""
        weight, bias = self._inputs
        return (self.hidden.data_ptr(), tuple(self.hidden.shape), tuple(self.hidden.stride()),
                weight.data_ptr(), tuple(weight.shape), weight.dtype, self.work_dtype,
                None if bias is None else bias.data_ptr(), self.chunk)

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
        """Yield ``(start, stop, logits [1, n, V])`` with the chunk's logits in the buffer; a
        kept chunk first, as the forward left it."""
        n_rows = self.hidden.shape[0]
        starts = range(0, n_rows, self.chunk)
        if self.kept_start is not None:
            yield self.kept_start, n_rows, self.buffer[:n_rows - self.kept_start].unsqueeze(0)
            starts = [start for start in starts if start != self.kept_start]
        for start in starts:
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
        unrounded = grad_logits  # float32 where the transform ran in a float32 buffer
        if self.transformed is not None:
            grad_logits = self.buffer[:stop - start].copy_(grad_logits)
        float32_grads = self._float32_grads(start, stop, grad_logits, unrounded)
        if self.grad_hidden is not None:
            self._write_hidden_grad(start, stop, grad_logits, float32_grads)
        if self.grad_weight_acc is not None:
            self._accumulate_weight_grad(start, stop, grad_logits, float32_grads)
        if self.grad_bias_acc is not None:
            self.grad_bias_acc.add_(grad_logits.sum(0, dtype=torch.float32))

    def _float32_grads(self, start, stop, grad_logits, unrounded):
        """The chunk's logit gradient in float32 for the products with a float32 result where
        the device has no float32-output GEMM of 16-bit operands; None where none is needed."""
        if self.work_dtype == torch.float32:
            return grad_logits
        if self.upcast is not None:
            return self.upcast[:stop - start].copy_(grad_logits)
        return unrounded if unrounded.dtype == torch.float32 else None

    def _write_hidden_grad(self, start, stop, grad_logits, float32_grads):
        """The chunk's rows of ``grad_hidden``: one GEMM over the vocabulary, rounded once."""
        out = self.grad_hidden[start:stop]
        if self.work_dtype == out.dtype:
            torch.mm(grad_logits, self.weight, out=out)
        elif self.work_dtype == torch.float32:
            out.copy_(grad_logits @ self.weight)
        elif self.float32_product:
            out.copy_(torch.mm(grad_logits, self.weight, out_dtype=torch.float32))
        else:
            if self.weight_float32 is None:
                self.weight_float32 = self.weight.to(torch.float32)
            with self._upcast_products():
                torch.mm(float32_grads, self.weight_float32, out=out)

    def _accumulate_weight_grad(self, start, stop, grad_logits, float32_grads):
        """``grad_weight_acc (+)= grad_logits.T @ rows`` with a float32 product: written by the
        first chunk, accumulated into by the others (no zero pass)."""
        acc, written = self.grad_weight_acc, self.weight_grad_written
        self.weight_grad_written = True
        rows = self.hidden[start:stop]
        if self.float32_product:
            product = torch.mm(grad_logits.t(), rows, out_dtype=torch.float32)
            if written:
                acc.add_(product)
            else:
                acc.copy_(product)
            return
        grad_logits, rows = float32_grads, rows.to(torch.float32)
        with self._upcast_products():
            if written:
                acc.addmm_(grad_logits.t(), rows)
            else:
                torch.mm(grad_logits.t(), rows, out=acc)

    def _upcast_products(self):
        return bf16_products() if self.bf16_upcast_products else contextlib.nullcontext()

    def gradients(self):
        """``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtype (``grad_hidden`` in
        float32 with ``hidden_grad_float32``); empty where unneeded."""
        # free the workspace before rounding
        self.buffer = self.weight = self.upcast = self.tanh = self.transformed = None
        self.weight_float32 = None
        grad_weight = absent_grad(self.hidden)
        if self.grad_weight_acc is not None and not self.weight_grad_written:
            self.grad_weight_acc.zero_()  # no rows
        if self.grad_weight_acc is not None:
            grad_weight = (self.grad_weight_acc if self.dtype == torch.float32
                           else cached_empty(self.grad_weight_acc.shape, self.dtype,
                                             self.grad_weight_acc.device).copy_(
                                                 self.grad_weight_acc))
        grad_bias = (absent_grad(self.hidden) if self.grad_bias_acc is None
                     else self.grad_bias_acc.to(self.dtype))
        grad_hidden = absent_grad(self.hidden) if self.grad_hidden is None else self.grad_hidden
        return grad_hidden, grad_weight, grad_bias


def absent_grad(like):
    """Marks a gradient that was not asked for (custom ops return tensors, never None)."""
    return like.new_empty(0)


def grad_or_none(grad):
    """None for an ``absent_grad`` gradient; real gradients are never 1-D and empty (V >= 1)."""
    return None if grad.dim() == 1 and grad.shape[0] == 0 else grad


def fake_head_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias):
    return (hidden.new_empty(hidden.shape) if needs_hidden else absent_grad(hidden),
            weight.new_empty(weight.shape) if needs_weight else absent_grad(hidden),
            weight.new_empty(weight.shape[0]) if needs_bias else absent_grad(hidden))


def row_floats(n_rows, device):
    return torch.empty(n_rows, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class ChunkExtra:
    """A forward-only output ``[size(value), N]`` a walk computes from each chunk's logits
    beside its primitive: ``compute(logits [n, V], rows, args, value) -> [size(value), n]``,
    ``rows`` the chunk's per-row tensors by name, ``value`` the walk's int argument
    ``argument`` (last in its schema)."""
    argument: str
    size: Callable[[int], int]
    compute: Callable


class KeptChunk:
    """A fused-head forward walk's last chunk of logits, kept for its backward walk, which starts
    from it instead of computing its product again. ``logits`` is the forward's chunk buffer (a
    cache block of ``kernels/memory.py``): this object owns it, the forward's autograd context
    owns this object, the backward takes the buffer over as its own, and a newer forward on the
    thread drops it: at most one chunk buffer per thread outlives its walk. ``key``: the head's
    tensors and chunk rule (they fix the chunks: the kept one is the backward's last)."""

    def __init__(self):
        self.logits = self.key = None

    @staticmethod
    def for_forward() -> Optional["KeptChunk"]:
        """One for a forward to fill; None under torch.compile (an opaque op there)."""
        return None if torch.compiler.is_compiling() else KeptChunk()

    def hold(self, logits, key):
        latest = getattr(_KEEPING, "latest", None)
        previous = None if latest is None else latest()
        if previous is not None and previous is not self:
            previous.drop()
        self.logits, self.key = logits, key
        _KEEPING.latest = weakref.ref(self)

    def holds(self, key) -> bool:
        """Whether it holds the last chunk of the head of ``key``."""
        return self.logits is not None and self.key == key

    def drop(self):
        self.logits = self.key = None


_KEEPING = threading.local()  # .kept: the KeptChunk of the walk running; .latest: a weakref


def keeping_last_chunk(kept: Optional[KeptChunk], walk: Callable, *values):
    """``walk(*values)`` (a generated head walk) with ``kept`` handed to it: a single-head walk
    without a logits transform fills ``kept`` when it writes no gradient (a forward) and starts
    from it when it does (the backward). ``kept`` None: the walk alone."""
    if kept is None:
        return walk(*values)
    _KEEPING.kept = kept
    try:
        return walk(*values)
    finally:
        _KEEPING.kept = None


class _HeadNames(NamedTuple):
    hidden: str
    weight: str
    bias: str
    logit_scale: str
    softcap: str


def _head_names(prefix: str) -> _HeadNames:
    return _HeadNames(*(prefix + name for name in _HeadNames._fields))


class _HeadWalk:
    """A primitive's fused-head walk (see :func:`head_walk`): its schema, its body, its fake."""

    def __init__(self, primitive, extra: Optional[ChunkExtra], kernels):
        self.primitive, self.extra, self.kernels = primitive, extra, kernels
        self.heads = [_head_names("" if i == 0 else f"{name}_")
                      for i, (name, _) in enumerate(primitive.tensors[:primitive.logits])]
        self.row_names = [name for name, _ in primitive.tensors[primitive.logits:]]
        schema = []
        for head in self.heads:
            schema += [(head.hidden, Tensor), (head.weight, Tensor),
                       (head.bias, Optional[Tensor])]
        schema += list(primitive.tensors[primitive.logits:])
        schema += [("args", primitive.params), ("needs_hidden", bool), ("needs_weight", bool),
                   ("needs_bias", bool), ("chunk_size", Optional[int]), ("backend", str)]
        for head in self.heads:
            schema += [(head.logit_scale, float), (head.softcap, float)]
        if extra is not None:
            schema.append((extra.argument, int))
        self.names = [name for name, _ in schema]
        self.given_type = collections.namedtuple(f"{primitive.name}_walk", self.names)
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        self.signature = inspect.Signature(
            [inspect.Parameter(name, kind, annotation=annotation) for name, annotation in schema],
            return_annotation=Tuple[(Tensor,) * (primitive.n_outputs + (extra is not None) + 3)])
        self.floats = [name for head in self.heads for name in (head.logit_scale, head.softcap)]

    def layout(self, values):
        """``(given, needs, writes_grad)`` of the schema's values: ``given`` holds them by
        attribute (``given.hidden``; a second head's by its prefixed names)."""
        given = self.given_type(*values)
        needs = (given.needs_hidden, given.needs_weight, given.needs_bias)
        gradient = self.primitive.gradient
        writes_grad = gradient == ALWAYS or (gradient == OPTIONAL and any(needs))
        return given, needs if writes_grad else (False,) * 3, writes_grad

    def outputs(self, given):
        """New per-row outputs (and the extra's ``[k, N]``)."""
        hidden, primitive = given.hidden, self.primitive
        n_rows, device = hidden.shape[0], hidden.device
        rows = tuple(torch.empty(length, dtype=primitive.output_dtype(i), device=device)
                     for i, length in enumerate(primitive.outputs(given.args, n_rows)))
        if self.extra is None:
            return rows
        size = self.extra.size(getattr(given, self.extra.argument))
        return (*rows, torch.empty((size, n_rows), dtype=torch.float32, device=device))

    def walk(self, *values):
        given, needs, writes_grad = self.layout(values)
        primitive, extra = self.primitive, self.extra
        kept = getattr(_KEEPING, "kept", None)
        if len(self.heads) > 1 or given.logit_scale != 1.0 or given.softcap:
            kept = None  # a transformed chunk is not the product (and the tanh is not kept)
        first = ChunkedHead(given.hidden, given.weight, given.bias, given.chunk_size,
                            needs, given.logit_scale, given.softcap,
                            kept=kept if writes_grad else None)
        walked = [first] + [
            ChunkedHead(getattr(given, head.hidden), getattr(given, head.weight),
                        getattr(given, head.bias), first.chunk, (False,) * 3,
                        getattr(given, head.logit_scale), getattr(given, head.softcap))
            for head in self.heads[1:]]
        kernel = getattr(self.kernels(given.backend), primitive.name)
        args, n_rows = given.args, given.hidden.shape[0]
        results = self.outputs(given)
        for chunks in zip(*(head.chunks() for head in walked)):
            start, stop, logits = chunks[0]
            rows = {name: _chunk_rows(getattr(given, name), start, stop, n_rows)
                    for name in self.row_names}
            grad = () if primitive.gradient == NONE else (logits if writes_grad else None,)
            values = kernel(logits, *(chunk[2] for chunk in chunks[1:]), *rows.values(), args,
                            *grad)
            for out, value in zip(results[:primitive.n_outputs], values or ()):
                if out.numel():
                    out[start:stop] = value
            if extra is not None and results[-1].shape[0]:
                results[-1][:, start:stop] = extra.compute(logits[0], rows, args,
                                                           getattr(given, extra.argument))
            if writes_grad:
                first.fold(start, stop, logits)
        if kept is not None and not writes_grad and first.last_start is not None:
            kept.hold(first.buffer, first.key())
        return (*results, *first.gradients())

    def fake(self, *values):
        given, needs, _ = self.layout(values)
        return (*self.outputs(given),
                *fake_head_gradients(given.hidden, given.weight, *needs))


def head_walk(primitive_name: str, extra: Optional[ChunkExtra] = None,
              kernels: Callable[[str], object] = backend_module):
    """The fused-head walk of the primitive ``primitive_name`` (``kernels/primitives.py``),
    generated from its declaration: the custom op ``astrai_kernels::linear_<name>`` and its
    fake. In place of each logits tensor it takes a head ``(hidden [N, H], weight [V, H],
    bias)``, the first named so, any other prefixed by its tensor's name (``teacher_hidden``);
    then the primitive's per-row tensors, its params object ``args``, ``needs_hidden,
    needs_weight, needs_bias, chunk_size, backend``, each head's ``logit_scale, softcap`` and
    the extra's argument. It returns the primitive's per-row outputs, the extra's, and the first
    head's ``(grad_hidden, grad_weight, grad_bias)`` (empty where not needed): the primitive's
    logit gradient of each chunk, written over the chunk's logits and folded. An OPTIONAL
    gradient is written when any ``needs_*`` is set, an ALWAYS one always. Each chunk gets the
    rows ``[start, stop)`` of a per-row tensor with N rows; any other (an empty entropy, a
    single gradient scale, None) passes whole. ``kernels(backend)`` gives the module whose
    function of the primitive's name runs (an optional primitive's op passes a resolver of
    ``kernels/``, e.g. ``kernels/portable_sampling.sampling_kernels``, which falls back to
    chunked torch on a backend without it)."""
    generated = _HeadWalk(declared(primitive_name), extra, kernels)

    def walk(*values):
        return generated.walk(*values)

    def fake(*values):
        return generated.fake(*values)

    walk.__signature__ = fake.__signature__ = generated.signature
    walk.__name__ = f"linear_{primitive_name}"
    walk.__doc__ = head_walk.__doc__
    op = traceable_op(walk.__name__, floats=generated.floats,
                      params={"args": generated.primitive.params})(walk)
    op.register_fake(fake)
    HEAD_WALKS[primitive_name] = op
    return op


#: every generated walk by its primitive's name (filled as the op files declare theirs)
HEAD_WALKS = {}


def _chunk_rows(values, start, stop, n_rows):
    """A chunk's rows of a per-row tensor; anything else whole."""
    if values is None or values.dim() == 0 or values.shape[0] != n_rows:
        return values
    return values[start:stop]


class AttachHeadGrads(torch.autograd.Function):
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
        # by the inputs' flags, not the gradients' shapes: an empty vocabulary shard's bias
        # gradient is a real [0] gradient
        grads = (scale_saved_grad(g, grad_output) if needed else None
                 for g, needed in zip(ctx.saved_tensors, ctx.needs_input_grad[:3]))
        return (*grads, None, None, None, None, None, None)


def head_needs(hidden, weight, bias):
    return (hidden.requires_grad, weight.requires_grad,
            bias is not None and bias.requires_grad)


def head_any_grad(hidden, weight, bias):
    return torch.is_grad_enabled() and any(head_needs(hidden, weight, bias))

def check_head(hidden, weight, bias, chunk_size):
    """Types, shapes, dtypes and devices of the head's tensors; returns ``hidden`` as 2-D rows."""
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if weight.dim() != 2:
        # DeepSpeed ZeRO-3 leaves each parameter an empty 1-D tensor outside the forward
        partitioned = (" (an empty weight: DeepSpeed ZeRO-3's partitioned parameter outside "
                       "the module's forward looks like this; call the loss inside the "
                       "forward, or gather the weight with "
                       "deepspeed.zero.GatheredParameters(weight))"
                       if weight.numel() == 0 else "")
        raise ValueError(f"weight must have shape [V, H], got {tuple(weight.shape)}"
                         f"{partitioned}")
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
    check_chunk_size(chunk_size)
    return hidden.reshape(-1, hidden.shape[-1])


def check_chunk_size(chunk_size):
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")


def reference_logits(hidden, weight, bias, logit_scale, softcap):
    """The transformed logits for ``backend="reference"``: float32 math on the product."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if logit_scale == 1.0 and softcap is None:
        return logits
    return reference.transform_logits(logits.float(), logit_scale, softcap)


def reference_on_logits(op, call, logits):
    """A fused-head call on the reference backend: its logits ``op`` on ``logits`` with the
    call's arguments that ``op`` takes (the head's own, such as ``chunk_size``, dropped)."""
    accepted = inspect.signature(op).parameters
    keywords = {name: value for name, value in call._asdict().items() if name in accepted}
    return op(**{**keywords, "logits": logits, "backend": "reference"})
