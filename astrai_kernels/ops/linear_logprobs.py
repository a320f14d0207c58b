"""``linear_token_logprobs``: token log-probs (and entropy, statistics, K targets a row, the
sampler's distribution) from the hidden states and the LM head, never the ``[N, V]`` logits:
``ops/head.py``'s walks of the ``logprobs_forward`` / ``logprobs_backward`` primitives (and the
sampler's, with ``sampling=``) over row chunks. Its checks are ``ops/logprobs.py``'s, given the
head's ``LogitsShape``; its contract is ``token_logprobs(F.linear(hidden, weight, bias), ...)``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import (
    TYPE_CHECKING,
    Literal,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    overload,
)

import torch
from torch import Tensor

from .. import reference

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
from ..distributed import dtensor, vocab_parallel, vocab_shard
from ..kernels import library
from ..kernels.registry import backend_module, resolve_backend
from ..options.scalars import check_bool, checked_transform
from ._common import (
    LogitsShape,
    dense_grad,
    flat_target,
    overwrite_columns_,
    refuse_double_backward,
)
from .door import Door
from .head import (
    ChunkedHead,
    ChunkExtra,
    KeptChunk,
    check_head,
    grad_or_none,
    head_any_grad,
    head_walk,
    keeping_last_chunk,
    reference_logits,
    row_floats,
)
from .logprobs import (
    LogprobsParams,
    checked_params,
    checked_target_columns,
    column_grads,
    column_logprobs_forward,
    has_target_columns,
    refuse_with_target_columns,
    token_logprobs,
)
from .sampling import (
    SamplingParams,
    checked_sampling,
    full_support,
    linear_sampled_token_logprobs,
)

# named by the error of a double backward (refuse_double_backward)
LOGPROBS_EQUIVALENT = ("torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias)"
                       ".float() / temperature, -1).gather(-1, target[..., None])")


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


def _chunk_statistics(logits, rows, args, mask):
    """The statistics of ``mask`` of one chunk's (transformed) logits ``[n, V]``, in float32
    torch ops on a temporary (forward only; the kernels' walk is untouched)."""
    scaled = logits.float() * (1.0 / args.temperature)
    target, rows = rows["target"], []
    for name in _chosen_statistics(mask):
        if name == "log_sum_sq_probs":
            rows.append(torch.logsumexp(2.0 * scaled, -1) - 2.0 * torch.logsumexp(scaled, -1))
        elif name == "mean_logits":
            rows.append(scaled.mean(-1))
        else:
            rows.append((scaled.argmax(-1) == target).float())
    return torch.stack(rows)


_FORWARD_WALK = head_walk("logprobs_forward", extra=ChunkExtra(
    "statistics", lambda mask: len(_chosen_statistics(mask)), _chunk_statistics))


_BACKWARD_WALK = head_walk("logprobs_backward")


class _LinearTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy, stats)``; the statistics are forward-only (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, args, chunk_size, transform=(1.0, 0.0),
                statistics=0):
        # the last chunk's logits, kept for the backward
        kept = KeptChunk.for_forward()
        logp, entropy, lse, stats, *_ = keeping_last_chunk(
            kept, _FORWARD_WALK, hidden, weight, bias, target, args, False, False, False,
            chunk_size, args.backend, *transform, statistics)
        ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
        ctx.args, ctx.kept = (args, chunk_size, transform), kept
        ctx.mark_non_differentiable(stats)
        if args.with_entropy:
            return logp, entropy, stats
        return logp, entropy.new_zeros(logp.shape), stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        refuse_double_backward("linear_token_logprobs", LOGPROBS_EQUIVALENT)
        hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
        args, chunk_size, transform = ctx.args
        grad_logp = dense_grad(grad_logp, lse)
        grad_entropy = dense_grad(grad_entropy, lse) if args.with_entropy else lse.new_empty(0)
        grads = keeping_last_chunk(
            ctx.kept, _BACKWARD_WALK, hidden, weight, bias, target, lse, entropy, grad_logp,
            grad_entropy, args, *ctx.needs_input_grad[:3], chunk_size, args.backend, *transform)
        return (*(grad_or_none(g) for g in grads), None, None, None, None, None)


class LinearTokenLogprobsCall(NamedTuple):
    """``linear_token_logprobs``'s arguments, as its door hands them to the routes."""
    hidden: Tensor
    weight: Tensor
    target: Tensor
    bias: Optional[Tensor]
    temperature: float
    ignore_index: int
    return_entropy: bool
    softcap: Optional[float]
    logit_scale: float
    statistics: Sequence[str]
    chunk_size: Optional[int]
    backend: str
    process_group: Optional["ProcessGroup"]
    check_consistency: bool
    sampling: Optional[SamplingParams]
    return_support: bool


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
                          process_group=None, check_consistency=True, sampling=None,
                          return_support=False):
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
    ``sampling`` and ``return_support``: as in ``token_logprobs``, on the transformed logits
    (not with ``return_entropy``, ``statistics`` or ``process_group``).

    ``target [..., K]`` (``hidden``'s rank: K targets a row) gives float32 ``[..., K]`` as
    ``token_logprobs`` does, from one walk (one more in backward; no ``[N, V]`` float32),
    softcap and logit scale included; not with ``statistics``, ``process_group``,
    ``sampling`` or DTensors.
    """
    return LINEAR_TOKEN_LOGPROBS.enter(LinearTokenLogprobsCall(
        hidden=hidden, weight=weight, target=target, bias=bias, temperature=temperature,
        ignore_index=ignore_index, return_entropy=return_entropy, softcap=softcap,
        logit_scale=logit_scale, statistics=statistics, chunk_size=chunk_size, backend=backend,
        process_group=process_group, check_consistency=check_consistency, sampling=sampling,
        return_support=return_support))


@dataclass(frozen=True)
class _HeadLogprobs:
    """A checked ``linear_token_logprobs`` call: the logits op's params (under ``sampling``:
    at the sampler's temperature), the sampler's distribution (or None), the transform and
    the statistics; ``columns``: ``target [..., K]``; ``return_support``."""
    params: LogprobsParams
    sampling: Optional[SamplingParams]
    transform: Tuple[float, float]
    stats_mask: int
    backend: str
    columns: bool = False
    return_support: bool = False


def _check_linear(call: LinearTokenLogprobsCall) -> _HeadLogprobs:
    hidden, weight = call.hidden, call.weight
    transform = checked_transform(call.logit_scale, call.softcap)
    stats_mask = _statistics_mask(call.statistics)
    check_head(hidden, weight, call.bias, call.chunk_size)
    backend = resolve_backend(call.backend, hidden.device)
    if has_target_columns(hidden, call.target):
        refuse_with_target_columns(
            "linear_token_logprobs", statistics=bool(stats_mask),
            sampling=call.sampling is not None,
            return_support=call.return_support is not False)
        params = checked_target_columns(
            LogitsShape.of_head(hidden, weight), call.target, call.temperature,
            call.ignore_index, call.return_entropy, backend)
        return _HeadLogprobs(params, None, transform, 0, backend, columns=True)
    if call.sampling is not None or check_bool(call.return_support, "return_support"):
        sampling = checked_sampling(call.sampling, call.temperature,
                                    return_entropy=call.return_entropy,
                                    statistics=bool(stats_mask))
        params = checked_params(LogitsShape.of_head(hidden, weight), call.target,
                                sampling.temperature, call.ignore_index, False, False,
                                backend)
        return _HeadLogprobs(params, sampling, transform, stats_mask, backend,
                             return_support=check_bool(call.return_support,
                                                       "return_support"))
    params = checked_params(LogitsShape.of_head(hidden, weight), call.target,
                                  call.temperature, call.ignore_index,
                                  call.return_entropy, False, backend)
    return _HeadLogprobs(params, None, transform, stats_mask, backend)


def _sampled_linear(call, checked: _HeadLogprobs, plain_route):
    """``sampling=``: the processed distribution's log-probs, on ``ops/sampling.py``'s route
    down to the sampled primitives' head walks; when no filter can drop a token, the plain
    op's ``plain_route`` (this door's local or reference route) with ``checked.params``."""
    weight, target, params = call.weight, call.target, checked.params
    if checked.sampling.filters(weight.shape[0]):
        return linear_sampled_token_logprobs(call.hidden, weight, call.bias, target,
                                             checked.sampling, params.ignore_index,
                                             checked.return_support, call.logit_scale,
                                             call.softcap, call.chunk_size,
                                             checked.backend)
    logp = plain_route(call, replace(checked, sampling=None, return_support=False))
    if checked.return_support:
        return logp, full_support(target, params.ignore_index, weight.shape[0])
    return logp


def _reference_linear(call: LinearTokenLogprobsCall, checked: _HeadLogprobs):
    if checked.sampling is not None:
        return _sampled_linear(call, checked, _reference_linear)
    if checked.columns:
        return token_logprobs(
            reference_logits(call.hidden, call.weight, call.bias, call.logit_scale,
                             call.softcap), call.target,
            temperature=call.temperature, ignore_index=call.ignore_index,
            return_entropy=call.return_entropy, backend="reference")
    params, target = checked.params, call.target
    logits = reference_logits(call.hidden, call.weight, call.bias, call.logit_scale,
                              call.softcap)
    out = token_logprobs(logits, target, temperature=params.temperature,
                               ignore_index=params.ignore_index,
                               return_entropy=params.with_entropy, backend="reference")
    if not checked.stats_mask:
        return out
    with torch.no_grad():
        stats = reference.token_statistics(logits.detach().float(), target, params.temperature,
                                           params.ignore_index)
    stats = {name: stats[name] for name in _chosen_statistics(checked.stats_mask)}
    return (*out, stats) if params.with_entropy else (out, stats)


def _local_linear(call: LinearTokenLogprobsCall, checked: _HeadLogprobs):
    if checked.sampling is not None:
        return _sampled_linear(call, checked, _local_linear)
    if checked.columns:
        return _local_linear_columns(call, checked)
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    params, stats_mask, chunk_size = checked.params, checked.stats_mask, call.chunk_size
    hidden_rows, target_flat = hidden.reshape(-1, hidden.shape[-1]), flat_target(target)
    if head_any_grad(hidden, weight, bias):
        logp, entropy, stats = _LinearTokenLogprobs.apply(
            hidden_rows, weight, bias, target_flat, params,
            chunk_size, checked.transform, stats_mask)
    else:
        logp, entropy, _, stats, *_ = _FORWARD_WALK(
            hidden_rows, weight, bias, target_flat, params, False, False, False, chunk_size,
            params.backend, *checked.transform, stats_mask)
    logp = logp.view(target.shape)
    out = (logp, entropy.view(target.shape)) if params.with_entropy else logp
    if not stats_mask:
        return out
    valid = (target_flat != params.ignore_index).view(target.shape)
    named = {}
    for row, name in zip(stats, _chosen_statistics(stats_mask)):
        value = row.view(target.shape)
        named[name] = (value > 0) & valid if name == "is_top1" else torch.where(valid, value, 0.0)
    return (*out, named) if params.with_entropy else (out, named)


def refuse_transform_with_process_group(logit_scale, softcap, stats_mask):
    if logit_scale != 1.0 or softcap or stats_mask:
        raise ValueError("softcap, logit_scale and statistics are not supported with "
                         "process_group (the vocabulary-parallel head)")


def _vocab_parallel_linear(call: LinearTokenLogprobsCall):
    """``linear_token_logprobs`` with this rank's vocabulary shard of the head."""
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    chunk_size, backend = call.chunk_size, call.backend
    if call.sampling is not None or check_bool(call.return_support, "return_support"):
        checked_sampling(call.sampling, call.temperature, process_group=True)
    logit_scale, softcap = checked_transform(call.logit_scale, call.softcap)
    refuse_transform_with_process_group(logit_scale, softcap,
                                         _statistics_mask(call.statistics))

    def checks(layout):
        if has_target_columns(hidden, target):
            refuse_with_target_columns("linear_token_logprobs", process_group=True)
        return checked_params(vocab_parallel.whole_logits(hidden, layout), target,
                              call.temperature, call.ignore_index, call.return_entropy,
                              False, backend)

    hidden_rows, layout, needs_grad, params = vocab_parallel.head_setup(
        "linear_token_logprobs", call.process_group, hidden, weight, bias, chunk_size, target,
        call.ignore_index, call.check_consistency, checks)
    if params.backend == "reference":
        return vocab_parallel.on_head_logits(token_logprobs, call)
    logp, entropy = vocab_shard.head_shard_rows(
        vocab_shard.LogprobsShard, hidden_rows, weight, bias, flat_target(target), params, layout,
        chunk_size, backend, needs_grad)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if params.with_entropy else logp


LINEAR_TOKEN_LOGPROBS = Door(linear_token_logprobs, ("hidden", "weight", "target", "bias"),
                             _check_linear, _local_linear, _reference_linear,
                             _vocab_parallel_linear, dtensor.linear_token_logprobs)


# ``target [..., K]`` on the fused head: the logits op's way (``ops/logprobs.py``, "target
# [..., K]") run on each chunk of ChunkedHead's walk, the target columns of a chunk's logit
# gradient overwritten before it is folded.
def _linear_column_walk(hidden_rows, weight, bias, target_rows, params, chunk_size, transform):
    """``(logp [N, K], entropy, lse, row_target, best)`` from one forward walk."""
    head = ChunkedHead(hidden_rows, weight, bias, chunk_size, (False,) * 3, *transform)
    n_rows, device = hidden_rows.shape[0], hidden_rows.device
    logp = torch.empty(target_rows.shape, dtype=torch.float32, device=device)
    lse = row_floats(n_rows, device)
    entropy = row_floats(n_rows if params.with_entropy else 0, device)
    row_target = torch.empty(n_rows, dtype=torch.long, device=device)
    best = torch.empty((n_rows, 1), dtype=torch.long, device=device)

    def chunk_forward(chunk_logits, chunk_row_target):
        return library.logprobs_forward(chunk_logits, chunk_row_target, params, params.backend)

    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        logp[rows], chunk_entropy, lse[rows], row_target[rows], best[rows] = (
            column_logprobs_forward(logits, target_rows[rows], params, chunk_forward))
        if params.with_entropy:
            entropy[rows] = chunk_entropy
    return logp, entropy, lse, row_target, best


class _LinearTokenLogprobsColumns(torch.autograd.Function):
    """``linear_token_logprobs`` of ``target [..., K]``: ``(logp [N, K], entropy [N])``; the
    backward walks the chunks again."""

    @staticmethod
    def forward(ctx, hidden_rows, weight, bias, target_rows, params, chunk_size, transform):
        logp, entropy, lse, row_target, best = _linear_column_walk(
            hidden_rows, weight, bias, target_rows, params, chunk_size, transform)
        ctx.save_for_backward(hidden_rows, weight, bias, target_rows, logp, entropy, lse,
                              row_target, best)
        ctx.params, ctx.chunk_size, ctx.transform = params, chunk_size, transform
        return logp, entropy if params.with_entropy else lse.new_zeros(lse.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("linear_token_logprobs", LOGPROBS_EQUIVALENT)
        hidden_rows, weight, bias, target_rows, logp, entropy, lse, row_target, best = (
            ctx.saved_tensors)
        params = ctx.params
        grad_logp = torch.zeros_like(logp) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        row_grad, grad_entropy, columns, values = column_grads(
            logp, grad_logp, target_rows, best, row_target, entropy, grad_entropy, params)
        head = ChunkedHead(hidden_rows, weight, bias, ctx.chunk_size,
                           tuple(ctx.needs_input_grad[:3]), *ctx.transform)
        kernels = backend_module(params.backend)
        with_entropy = params.with_entropy
        for start, stop, logits in head.chunks():
            rows = slice(start, stop)
            chunk = (logits, row_target[rows], lse[rows],
                     entropy[rows] if with_entropy else entropy, row_grad[rows],
                     grad_entropy[rows] if with_entropy else grad_entropy, params)
            if torch.compiler.is_compiling():  # traced: the functional op, copied over
                logits.copy_(library.logprobs_backward(*chunk, params.backend))
            else:  # written over the chunk's logits
                kernels.logprobs_backward(*chunk, logits)
            overwrite_columns_(logits[0], 1, columns[rows], values[rows])
            head.fold(start, stop, logits)
        grads = head.gradients()
        return (*(grad_or_none(g) for g in grads), None, None, None, None)


def _local_linear_columns(call, checked: _HeadLogprobs):
    """``linear_token_logprobs`` of ``target [..., K]`` -> float32 ``[..., K]`` (and the rows'
    entropy ``[...]``), as ``token_logprobs`` of ``target [..., K]`` on the head's logits."""
    hidden, weight, bias, target = call.hidden, call.weight, call.bias, call.target
    params, chunk_size, transform = checked.params, call.chunk_size, checked.transform
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    target_rows = target.reshape(-1, target.shape[-1]).contiguous()
    if head_any_grad(hidden, weight, bias):
        logp, entropy = _LinearTokenLogprobsColumns.apply(hidden_rows, weight, bias, target_rows,
                                                          params, chunk_size, transform)
    else:
        logp, entropy, *_ = _linear_column_walk(hidden_rows, weight, bias, target_rows, params,
                                                chunk_size, transform)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape[:-1])) if params.with_entropy else logp
