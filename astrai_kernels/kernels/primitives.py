"""The kernel primitives, each declared once: its tensors, its parameters, its outputs.

Every kernel backend (``triton/backend.py``, ``kernels/cpp/backend.py``, ``kernels/portable.py``)
is a module with the functions that :class:`Backend` lists; ``kernels/library.py`` generates each
primitive's ``torch.library`` custom op, its fake implementation, its Triton twin and its eager
wrapper from :data:`PRIMITIVES`. A primitive's non-tensor arguments travel as one frozen params
object (:class:`LogprobsArgs`, :class:`CrossEntropyArgs`, :class:`SurrogateArgs`,
:class:`DistillArgs`, :class:`ShardGradArgs`, :class:`SamplingArgs`,
:class:`TopkDistillArgs`); the ops' own params classes extend these, so an op hands its checked
params straight down, and the cpp backend hands the object itself to its extension
(``csrc/bindings.cpp`` reads the fields by name, one struct per class). Adding a kernel option
is a field here, its reading in the kernels (and in that struct), and its math in
``reference.py``.

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
* Float parameters are Python floats; kernels take them as runtime arguments.

Primitives (``s = z / T``, ``p = softmax(s)``, ``lse = logsumexp(s)``, ``d_jy`` the one-hot):

``logprobs_forward(logits, target, params: LogprobsArgs)`` -> ``(logp, entropy, lse)``
    ``logp = s_y - lse``; ``entropy = lse - sum_j p_j s_j`` (an empty tensor unless
    ``with_entropy``). Ignored rows: ``logp = entropy = 0``, ``lse = 0``.

``logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, params, grad)``
    writes ``grad_j = (1/T) * (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H))``; ``entropy``
    and ``grad_entropy`` are empty tensors when entropy was not requested (then ``g_H = 0``).

``cross_entropy_forward(logits, target, grad_scale, params: CrossEntropyArgs, grad)`` ->
``(loss, lse)``
    with ``a = logit_scale`` (``1.0`` means off) and ``c = softcap`` (``0.0`` means off) the
    row's logits are ``z = c * tanh(a * x / c)``, or ``z = a * x`` without softcap;
    ``loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + z_loss * lse**2``, ``lse`` that
    of ``z``; ignored rows give 0. When ``grad`` is not None, ``grad_scale`` is a float32 tensor
    of 1 or N elements (row ``n`` uses element ``n`` or the single one) and the primitive also
    writes ``grad_j = a * grad_scale * ((1 + 2 * z_loss * lse) * p_j - (1 - eps) * d_jy
    - eps / V)``, times ``1 - (z_j / c)**2`` when softcap is on (the ``d_jy`` term folded in
    float32 before the cast). Ignored rows get zeros.

``grpo_forward(logits, target, advantages, old_logprobs, ref_logprobs, token_weight,
params: SurrogateArgs, grad)`` -> ``(logp, loss, entropy)``
    per row, float32 inputs of N elements (``old_logprobs``/``ref_logprobs`` may be None; None
    old means on-policy: ``old = logp`` detached). Rows with ``token_weight == 0`` are masked:
    their target is not read, ``logp = loss = entropy = 0`` and grad is zero. Otherwise, with
    ``A`` the advantage::

        lr = clamp(logp - old, -C, C);  r = exp(lr)       (C = LOG_RATIO_CLAMP = 20)
        r_u = min(r, delta) if delta > 0 else r          (delta <= 0 means off)
        l = -min(r_u * A, clamp(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        if beta > 0:
            dr = clamp(ref - logp, -C, C);  k3 = exp(dr) - dr - 1
            l += beta * k3 * r if kl_ratio_correction else beta * k3

    ``r`` in the KL term is the uncapped ratio (TRL's ``use_bias_correction_kl``).
    ``entropy = lse - sum_j p_j s_j`` of the row, from the same walk (an empty tensor unless
    ``with_entropy``). ``loss`` is ``l`` (unweighted). When ``grad`` is given it writes
    ``grad_j = token_weight * dl/dlogp * (d_jy - p_j) / T``, with ``dl/dlogp`` the derivative of
    the formula above, taking clamp's gradient as zero outside its range and, where the two
    branches of the min are equal, the unclipped branch (the entropy gets no gradient here).

``distill_forward(student, teacher, target, grad_scale, params: DistillArgs, grad)``
    -> ``(loss, student_lse, teacher_lse, student_kl, hard_lse)``. ``teacher`` is an
    ``[A, B, V]`` view of the same ``A, B, V`` as ``student`` (its own strides and dtype).
    With ``a = log softmax(student / T)``, ``b = log softmax(teacher / T)`` (TRL's generalized
    JSD): ``beta = 0``: ``loss = sum_j p_t (b - a)``; otherwise ``m = b`` when ``beta = 1``,
    else ``m = log((1 - beta) p_s + beta p_t)`` (:func:`mixture_weights`),
    ``student_kl = sum_j p_s (a - m)`` and
    ``loss = beta * sum_j p_t (b - m) + (1 - beta) * student_kl`` (``loss = student_kl`` at
    ``beta = 1``); terms with ``p = 0`` are 0. ``hard_weight > 0`` adds
    ``hard_weight * (hard_lse - x_y)``, ``hard_lse = logsumexp(student)`` at temperature 1
    (an empty tensor when ``hard_weight == 0``). The lses are those of ``z / T``. Ignored rows:
    every output 0. ``student_kl`` is 0 when ``beta = 0``. When ``grad`` is not None,
    ``grad_scale`` is a float32 tensor of 1 or N elements and the primitive also writes
    ``distill_backward``'s gradient with it as ``grad_loss`` (row ``n`` uses element ``n`` or
    the single one).

``distill_backward(student, teacher, target, student_lse, teacher_lse, student_kl, hard_lse,
grad_loss, params, grad)``
    writes the student's gradient ``grad_j = g / T * (p_s,j - p_t,j)`` (``beta = 0``), else
    ``g / T * (1 - beta') * p_s,j * (a_j - m_j - student_kl)`` (``beta' = 0`` at ``beta = 1``),
    plus ``g * hard_weight * (softmax(student)_j - d_jy)``; ``g`` the row's ``grad_loss``.
    ``grad`` may be ``student`` itself (the fused head writes over its logits chunk).

Optional primitive (vocabulary parallel, ``distributed/vocab_shard.py``; every backend here
implements it; for a backend without it ``auto`` runs a vocab-parallel gradient on ``torch``,
and asking for that backend by name raises ``NotImplementedError``):

``vocab_shard_backward(logits, target, lse, alpha, beta, gamma, delta, params: ShardGradArgs,
grad)``
    ``logits`` hold one vocabulary shard; ``lse`` (float32, N) is the row's log-sum-exp over the
    whole vocabulary, of ``s = z / T`` with ``z = c * tanh(x / c)`` when ``softcap = c`` is
    not 0.0 (else ``z = x``). ``target`` entries in ``[0, V)`` are local target columns,
    ``ignore_index`` rows get zeros, any other value is a counted row whose target lies in
    another shard. With ``p_j = exp(s_j - lse)`` and per-row float32 coefficients (``beta``
    and ``delta`` may be None: 0) it writes
    ``grad_j = (1/T) * dz_j/dx_j * (p_j * (alpha + beta * log p_j) + gamma * d_jy + delta)``.
    The forward statistics of a shard come from ``logprobs_forward`` and
    ``cross_entropy_forward`` above, so every backend serves forward-only calls.

Optional primitives (targets scored under a sampler's distribution, ``ops/sampling.py``; the
``cpp`` and ``triton`` backends implement them; for a backend without them the op runs the
chunked-torch selection of ``kernels/portable_sampling.py`` on that backend's device):

``sampled_logprobs_forward(logits, target, params: SamplingArgs)`` -> ``(logp, lse_kept,
threshold, log_kept_mass, support_size, in_support)``
    with ``s = float32(z) / T`` (a float32 division), the support ``K = {j : s_j >= tau}`` of
    vLLM's min_p, top_k and top_p as ``ops/sampling.py`` states them (ties kept), and
    ``logp = s_y - logsumexp_K(s)`` (``-inf`` when ``y`` is not in ``K``),
    ``lse_kept = logsumexp_K(s)``, ``log_kept_mass = lse_kept - logsumexp(s)``,
    ``support_size = |K|`` (int64) and ``in_support = y in K`` (bool). ``threshold`` is the
    backend's own encoding of ``K``, read back only by its ``sampled_logprobs_backward``
    (the cpp backend's: the smallest float ``x`` with ``x / T >= tau``, so
    ``K = {j : float32(z_j) >= threshold}``). Ignored rows: zeros, ``in_support`` false.
    A row holding NaN or +inf gives NaN values and stays ``in_support``.

``sampled_logprobs_backward(logits, target, lse_kept, threshold, coef, params, grad)``
    writes ``grad_j = coef * ([j == y] - p'_j [j in K])``, ``p'_j = exp(s_j - lse_kept)``,
    for the per-row float32 ``coef`` (the op passes ``g / T``, 0 for a row outside the
    support or ignored); a row with ``coef == 0`` gets zeros without its logits being read.
    ``grad`` may be ``logits`` itself (the fused head writes over its logits chunk).

Optional primitive (a loss over a teacher's top-K support, ``ops/topk_distill.py``; the
``cpp`` backend implements it; for a backend without it the op runs its own chunked-torch
passes on that backend's device):

``topk_distill_forward(logits, support_ids, teacher, live, counted, grad_scale,
params: TopkDistillArgs, grad)`` -> ``(loss, row_max, sums, coef)``
    ``support_ids`` int64, ``teacher`` float32 and ``live`` bool ``[N, K]`` (contiguous; the
    ids of entries not live are never read), ``counted`` bool ``[N]``. Per counted row, with
    ``s_k`` the student's ``log_softmax(z / T)`` at ``id_k`` (``z_{id_k} / T`` where the
    objective reads no full softmax: ``trl_jsd`` without ``tail``, ``axolotl_kd`` with
    ``normalize_topk``), ``loss`` is ``ops/topk_support.py``'s ``support_loss`` of the live
    entries and ``coef [N, K]`` its ``c_k = d loss / d s_k`` (0 where not live);
    ``row_max`` and ``sums = sum_j exp((z_j - row_max) / T)`` (0 without the full softmax).
    Rows not counted are not read: 0 everywhere, ``sums = V`` with the full softmax. When
    ``grad`` is not None, ``grad_scale`` (1 or N float32 elements, ``g``) and the gradient
    ``grad_j = g / T * (sum_{k: id_k = j} c_k - p_j sum_k c_k)`` (no ``p_j`` term without
    the full softmax) is written too. ``grad`` may be ``logits`` itself.

``reference.py`` states the same math naively in float64; ``kernels/portable.py`` is the
readable chunked implementation of these primitives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

#: field metadata of a float that stays a Python float in a custom op's schema: the outputs'
#: shapes depend on it, which a fake implementation must know at trace time
STATIC = {"static": True}

#: GRPO's log-ratios (``logp - old``, ``ref - logp``) are clamped to ``[-C, C]`` before ``exp``:
#: ``exp(20)`` is ~4.9e8, finite in float32 with room for the products that follow. The kernels
#: use this value (``portable.py``, ``triton/helpers.py`` and ``csrc/common.h``'s
#: ``kLogRatioClamp``, which a test holds equal to it).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LogprobsArgs:
    temperature: float
    ignore_index: int
    with_entropy: bool


@dataclass(frozen=True)
class CrossEntropyArgs:
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float  # 0.0: off
    # keyword-only, so the op's params class may add fields without defaults after it
    logit_scale: float = field(default=1.0, kw_only=True)  # 1.0: off


@dataclass(frozen=True)
class SurrogateArgs:
    """GRPO's per-token clipped surrogate and k3 penalty."""
    temperature: float
    clip_eps_low: float
    clip_eps_high: float
    delta: float  # 0.0: off
    beta: float
    kl_ratio_correction: bool  # the k3 term times the ratio r
    with_entropy: bool


@dataclass(frozen=True)
class MixtureWeights:
    """TRL's generalized JSD at ``beta`` as every backend's kernels use it:
    ``loss = w_t * sum_j p_t (b - m) + w_s * sum_j p_s (a - m)`` with
    ``m = logaddexp(a + log_w_s, b + log_w_t)``. The logs are natural; the Triton kernels work
    in base 2 and multiply them by ``log2(e)`` (``triton/backend.py``'s ``_log2_weights``)."""
    w_t: float
    w_s: float
    log_w_s: float
    log_w_t: float


@functools.lru_cache(maxsize=64)  # one beta per training run: a kernel call reads it for free
def mixture_weights(beta: float) -> MixtureWeights:
    """The distillation mixture's weights at ``beta`` (in ``[0, 1]``): ``(beta, 1 - beta)``
    with their logs. ``beta = 1`` (reverse KL) is ``m = b``: ``w_t = 0``, ``log_w_s = -inf``.
    ``beta = 0`` (forward KL) has no mixture: ``(1, 0, 0, 0)``, which no kernel reads."""
    beta = float(beta)
    if beta == 0.0:
        return MixtureWeights(1.0, 0.0, 0.0, 0.0)
    if beta == 1.0:
        return MixtureWeights(0.0, 1.0, -math.inf, 0.0)
    return MixtureWeights(beta, 1.0 - beta, math.log1p(-beta), math.log(beta))


@dataclass(frozen=True)
class DistillArgs:
    beta: float
    temperature: float
    ignore_index: int
    hard_weight: float = field(metadata=STATIC)

    @property
    def weights(self) -> MixtureWeights:
        """The mixture weights of ``beta`` (computed here once for every backend)."""
        return mixture_weights(self.beta)


@dataclass(frozen=True)
class ShardGradArgs:
    temperature: float
    softcap: float  # 0.0: off
    ignore_index: int


@dataclass(frozen=True)
class SamplingArgs:
    """vLLM's sampler settings (``ops/sampling.py``'s ``SamplingParams``: ``top_k = 0``,
    ``top_p = 1.0`` and ``min_p = 0.0`` each mean off)."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    ignore_index: int


@dataclass(frozen=True)
class TopkDistillArgs:
    """A top-k distillation objective (``ops/topk_support.py``'s ``TopkDistillParams``): the
    clamps are None when off, and read only by ``verl_forward_kl``."""
    beta: float
    temperature: float
    tail: bool
    objective: str
    normalize_topk: bool
    log_prob_min_clamp: Optional[float]
    loss_max_clamp: Optional[float]


def args_of(params, kind: type):
    """The ``kind`` fields of ``params`` (an op's params object extends one of the classes
    above) as a ``kind`` instance."""
    if type(params) is kind:
        return params
    return kind(**{f.name: getattr(params, f.name) for f in fields(kind)})


#: gradient modes: NONE (the primitive writes none), ALWAYS (it returns only the gradient),
#: OPTIONAL (outputs plus the gradient, written when the caller's ``compute_grad`` is true)
NONE, ALWAYS, OPTIONAL = "none", "always", "optional"


@dataclass(frozen=True)
class Primitive:
    """One primitive: the tensors it takes (in order; ``Optional`` ones may be None), its
    params class, the lengths of its per-row outputs given the params and N, and whether it
    writes the gradient of its first tensor (``grad`` is then its last argument). The outputs
    are float32 unless ``output_dtypes`` gives each one's dtype. The first ``logits`` tensors
    are logits views (the rest are per-row): the fused head computes those from a head each.
    ``output_shapes`` (params, tensors) -> each output's shape, for a primitive whose outputs
    are not all per-row (``outputs`` then only counts them)."""
    name: str
    tensors: Tuple[Tuple[str, object], ...]
    params: type
    outputs: Callable[[object, int], Tuple[int, ...]]
    gradient: str = NONE
    output_dtypes: Optional[Tuple[torch.dtype, ...]] = None
    logits: int = 1
    output_shapes: Optional[Callable[[object, tuple], Tuple[Tuple[int, ...], ...]]] = None

    @property
    def n_outputs(self) -> int:
        """How many per-row outputs it returns (the gradient not counted)."""
        return len(self.outputs(_EveryFlagSet(), 1))

    def output_dtype(self, index: int) -> torch.dtype:
        return torch.float32 if self.output_dtypes is None else self.output_dtypes[index]


class _EveryFlagSet:
    """Params stand-in for counting outputs: every flag set."""

    def __getattr__(self, name):
        return 1


def _rows(count: int) -> Callable[[object, int], Tuple[int, ...]]:
    return lambda params, n_rows: (n_rows,) * count


_T, _OT = Tensor, Optional[Tensor]

PRIMITIVES = {p.name: p for p in (
    Primitive("logprobs_forward", (("logits", _T), ("target", _T)), LogprobsArgs,
              lambda p, n: (n, n if p.with_entropy else 0, n)),
    Primitive("logprobs_backward",
              (("logits", _T), ("target", _T), ("lse", _T), ("entropy", _T),
               ("grad_logp", _T), ("grad_entropy", _T)), LogprobsArgs, _rows(0), ALWAYS),
    Primitive("cross_entropy_forward", (("logits", _T), ("target", _T), ("grad_scale", _OT)),
              CrossEntropyArgs, _rows(2), OPTIONAL),
    Primitive("grpo_forward",
              (("logits", _T), ("target", _T), ("advantages", _T), ("old_logprobs", _OT),
               ("ref_logprobs", _OT), ("token_weight", _T)), SurrogateArgs,
              lambda p, n: (n, n, n if p.with_entropy else 0), OPTIONAL),
    Primitive("distill_forward",
              (("student", _T), ("teacher", _T), ("target", _T), ("grad_scale", _OT)),
              DistillArgs, lambda p, n: (n, n, n, n, n if p.hard_weight else 0), OPTIONAL,
              logits=2),
    Primitive("distill_backward",
              (("student", _T), ("teacher", _T), ("target", _T), ("student_lse", _T),
               ("teacher_lse", _T), ("student_kl", _T), ("hard_lse", _T), ("grad_loss", _T)),
              DistillArgs, _rows(0), ALWAYS, logits=2),
)}

#: the optional primitive, eager only (no custom op): ``vocab_shard_backward``
SHARD_PRIMITIVE = Primitive(
    "vocab_shard_backward",
    (("logits", _T), ("target", _T), ("lse", _T), ("alpha", _T), ("beta", _OT), ("gamma", _T),
     ("delta", _OT)), ShardGradArgs, _rows(0), ALWAYS)


#: the optional primitives of targets scored under a sampler (``ops/sampling.py`` makes their
#: custom ops, run by ``kernels/portable_sampling.py``'s ``sampling_kernels``)
SAMPLING_PRIMITIVES = {p.name: p for p in (
    Primitive("sampled_logprobs_forward", (("logits", _T), ("target", _T)), SamplingArgs,
              _rows(6), output_dtypes=(torch.float32,) * 4 + (torch.int64, torch.bool)),
    Primitive("sampled_logprobs_backward",
              (("logits", _T), ("target", _T), ("lse_kept", _T), ("threshold", _T),
               ("coef", _T)), SamplingArgs, _rows(0), ALWAYS),
)}


def _topk_output_shapes(params, tensors):
    """``(loss, row_max, sums)`` per row and ``coef [N, K]``, from ``support_ids [N, K]``."""
    n_rows, k = tensors[1].shape
    return (n_rows,), (n_rows,), (n_rows,), (n_rows, k)


#: the optional primitive of the top-k distillation loss (``ops/topk_distill.py`` makes its
#: custom op)
TOPK_DISTILL_PRIMITIVES = {p.name: p for p in (
    Primitive("topk_distill_forward",
              (("logits", _T), ("support_ids", _T), ("teacher", _T), ("live", _T),
               ("counted", _T), ("grad_scale", _OT)), TopkDistillArgs,
              _rows(4), OPTIONAL, output_shapes=_topk_output_shapes),
)}


def declared(name: str) -> Primitive:
    """The declaration of the primitive ``name``, required or optional."""
    for table in (PRIMITIVES, SAMPLING_PRIMITIVES, TOPK_DISTILL_PRIMITIVES,
                  {SHARD_PRIMITIVE.name: SHARD_PRIMITIVE}):
        if name in table:
            return table[name]
    raise KeyError(f"no primitive {name!r} is declared")


@runtime_checkable
class Backend(Protocol):
    """What a kernel backend module provides (the contract in this module's docstring)."""

    def unavailable_reason(self, device: torch.device) -> Optional[str]: ...

    def logprobs_forward(self, logits: Tensor, target: Tensor,
                         params: LogprobsArgs) -> Tuple[Tensor, Tensor, Tensor]: ...

    def logprobs_backward(self, logits: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
                          grad_logp: Tensor, grad_entropy: Tensor, params: LogprobsArgs,
                          grad: Tensor) -> None: ...

    def cross_entropy_forward(self, logits: Tensor, target: Tensor,
                              grad_scale: Optional[Tensor], params: CrossEntropyArgs,
                              grad: Optional[Tensor]) -> Tuple[Tensor, Tensor]: ...

    def grpo_forward(self, logits: Tensor, target: Tensor, advantages: Tensor,
                     old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                     token_weight: Tensor, params: SurrogateArgs,
                     grad: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]: ...

    def distill_forward(self, student: Tensor, teacher: Tensor, target: Tensor,
                        grad_scale: Optional[Tensor], params: DistillArgs,
                        grad: Optional[Tensor]) -> Tuple[Tensor, ...]: ...

    def distill_backward(self, student: Tensor, teacher: Tensor, target: Tensor,
                         student_lse: Tensor, teacher_lse: Tensor, student_kl: Tensor,
                         hard_lse: Tensor, grad_loss: Tensor, params: DistillArgs,
                         grad: Tensor) -> None: ...


@runtime_checkable
class VocabShardBackend(Backend, Protocol):
    """A backend that also serves the vocabulary-parallel gradient."""

    def vocab_shard_backward(self, logits: Tensor, target: Tensor, lse: Tensor, alpha: Tensor,
                             beta: Optional[Tensor], gamma: Tensor, delta: Optional[Tensor],
                             params: ShardGradArgs, grad: Tensor) -> None: ...


@runtime_checkable
class SampledLogprobsBackend(Backend, Protocol):
    """A backend that also scores targets under a sampler's distribution in its kernels."""

    def sampled_logprobs_forward(self, logits: Tensor, target: Tensor, params: SamplingArgs
                                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]: ...

    def sampled_logprobs_backward(self, logits: Tensor, target: Tensor, lse_kept: Tensor,
                                  threshold: Tensor, coef: Tensor, params: SamplingArgs,
                                  grad: Tensor) -> None: ...


@runtime_checkable
class TopkDistillBackend(Backend, Protocol):
    """A backend that also computes the top-k distillation loss in its kernels."""

    def topk_distill_forward(self, logits: Tensor, support_ids: Tensor, teacher: Tensor,
                             live: Tensor, counted: Tensor, grad_scale: Optional[Tensor],
                             params: TopkDistillArgs, grad: Optional[Tensor]
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]: ...
