"""Token log-probs ``logp = z_y / T - logsumexp(z / T)`` (and entropy) without an [N, V] copy.

Contract (docs/architecture.md, "Ops"): ``token_logprobs(logits [..., V], target [...])`` ->
float32 ``[...]``, or ``(logprobs, entropy)``; rows whose target is ``ignore_index`` give 0
and zero gradient.
The forward keeps one float32 ``lse`` (and entropy) per row; the backward recomputes
``p`` tile by tile and writes the gradient once, into the logits' buffer when
``inplace_backward=True`` (which destroys the logits: use it when nothing else needs them).

``linear_token_logprobs`` (``ops/linear_logprobs.py``): the same from the hidden states and the
LM head, never the logits, with this module's checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import (
    TYPE_CHECKING,
    Dict,
    Literal,
    NamedTuple,
    Optional,
    Tuple,
    Union,
    overload,
)

import torch
from torch import Tensor

from .. import reference

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
from ..distributed import dtensor, vocab_parallel, vocab_shard
from ..kernels import library
from ..kernels.primitives import LogprobsArgs, args_of
from ..kernels.registry import backend_module, resolve_backend
from ..options.scalars import check_bool, check_index, check_positive
from ._common import (
    LogitsShape,
    check_inplace,
    check_logits,
    check_target,
    dense_grad,
    finish_inplace_grad,
    flat_target,
    grad_for_owner,
    graph_is_retained,
    inplace_grad_owner,
    overwrite_columns_,
    refuse_double_backward,
    rows_view,
)
from .door import Door
from .sampling import (
    SamplingParams,
    checked_sampling,
    full_support,
    sampled_token_logprobs,
)

# named by the error of a double backward (refuse_double_backward)
TORCH_EQUIVALENT = ("torch.log_softmax(logits.float() / temperature, -1)"
                    ".gather(-1, target[..., None])")


@dataclass(frozen=True)
class LogprobsParams(LogprobsArgs):
    """The kernel's parameters (``kernels/primitives.py``) and the op's own."""
    inplace_backward: bool
    backend: str


def checked_params(logits: LogitsShape, target, temperature, ignore_index, return_entropy,
                   inplace_backward, backend):
    """Validate every argument but the logits tensor itself (the fused head and a vocabulary
    shard have none)."""
    ignore_index = check_index(ignore_index, "ignore_index")
    check_target(target, logits, ignore_index)
    check_bool(return_entropy, "return_entropy")
    return LogprobsParams(temperature=check_positive(temperature, "temperature"),
                          ignore_index=ignore_index, with_entropy=return_entropy,
                          inplace_backward=inplace_backward,
                          backend=resolve_backend(backend, logits.device))


class _TokenLogprobs(torch.autograd.Function):
    """``base`` is None, or (``inplace_backward``) the tensor ``logits`` slice that autograd is
    given the gradient of instead (``inplace_grad_owner``); ``logits`` are read in the backward."""

    @staticmethod
    def forward(ctx, logits, base, target_flat, params, starts):
        logp, entropy, lse = library.logprobs_forward(rows_view(logits), target_flat, params,
                                                       params.backend)
        ctx.save_for_backward(logits, target_flat, lse, entropy)
        ctx.params, ctx.starts = params, starts
        if params.with_entropy:
            return logp, entropy
        return logp, entropy.new_zeros(logp.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("token_logprobs", TORCH_EQUIVALENT)
        logits, target_flat, lse, entropy = ctx.saved_tensors
        params = ctx.params
        grad_logp = dense_grad(grad_logp, lse)
        grad_entropy = dense_grad(grad_entropy, lse) if params.with_entropy else lse.new_empty(0)
        args = (target_flat, lse, entropy, grad_logp, grad_entropy)
        logits_rows = rows_view(logits)
        # a retained graph may run this again: then the logits must survive
        if params.inplace_backward and not graph_is_retained():
            backend_module(params.backend).logprobs_backward(
                logits_rows, *args, args_of(params, LogprobsArgs), logits_rows)
            if ctx.starts is None:
                return finish_inplace_grad(logits, None, logits.shape), None, None, None, None
            grad_base = finish_inplace_grad(logits._base, ctx.starts, logits.shape)
            return None, grad_base, None, None, None
        grad = library.logprobs_backward(logits_rows, *args, params, params.backend)
        grad = grad.view(logits.shape)
        if ctx.starts is None:
            return grad, None, None, None, None
        return None, grad_for_owner(grad, logits._base, ctx.starts), None, None, None


def _forward_only(logits_rows, target_flat, params):
    logp, entropy, _ = library.logprobs_forward(logits_rows, target_flat, params,
                                                 params.backend)
    return logp, entropy


class TokenLogprobsCall(NamedTuple):
    """``token_logprobs``'s arguments, as its door hands them to the routes."""
    logits: Tensor
    target: Tensor
    temperature: float
    ignore_index: int
    return_entropy: bool
    inplace_backward: bool
    backend: str
    process_group: Optional[ProcessGroup]
    check_consistency: bool
    sampling: Optional[SamplingParams]
    return_support: bool


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., return_entropy: Literal[False] = ...,
                   inplace_backward: bool = ..., backend: str = ...,
                   process_group: Optional[ProcessGroup] = ...,
                   check_consistency: bool = ..., sampling: Optional[SamplingParams] = ...,
                   return_support: Literal[False] = ...) -> torch.Tensor: ...


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., return_entropy: Literal[True],
                   inplace_backward: bool = ..., backend: str = ...,
                   process_group: Optional[ProcessGroup] = ...,
                   check_consistency: bool = ...) -> Tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = ...,
                   ignore_index: int = ..., backend: str = ...,
                   sampling: Optional[SamplingParams] = ..., return_support: Literal[True]
                   ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]: ...


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    process_group: Optional[ProcessGroup] = None,
    check_consistency: bool = True,
    sampling: Optional[SamplingParams] = None,
    return_support: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor],
           Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Log-probability of ``target`` under ``softmax(logits / temperature)``, float32 ``[...]``.

    ``return_entropy=True`` also returns the entropy of that softmax (differentiable).
    A call without autograd (``torch.no_grad()`` or logits not requiring grad) runs the
    forward only and saves nothing: the way to compute old/reference-policy log-probs.

    ``inplace_backward=True`` makes the backward write the gradient over the logits (their
    values are destroyed; overlapping logits such as an ``expand`` are refused). When
    ``logits`` slice a contiguous tensor that requires grad (``x[:, :-1]``), that tensor's
    whole buffer becomes its gradient (the rest zeroed). The logits are kept, and the gradient
    is a new buffer, under ``torch.compile`` and in a backward that retains the graph.

    ``process_group`` (vocabulary parallel): ``logits`` hold this rank's contiguous shard of the
    vocabulary (shards in rank order), ``target`` global ids; every rank gets the
    full-vocabulary result and its shard's gradient (``distributed/vocab_parallel.py``).
    ``check_consistency`` (with ``process_group``): every rank must pass the same rows and targets
    (only the vocabulary shard differs); the shard sizes' all-gather also carries each rank's row
    count (always compared: a mismatch would hang) and, when True (the default), the sum and
    count of its counted targets, so ranks that disagree raise ``ValueError`` on every rank.

    ``sampling`` (an ``ak.SamplingParams``): score each target under the distribution vLLM's
    sampler draws from (temperature, min_p, top_k, top_p; ``ops/sampling.py``): ``-inf`` for a
    target outside that support, whose row then gets a zero gradient. The temperature is
    ``sampling.temperature`` (``temperature`` must stay 1.0). ``return_support=True`` also
    returns a dict of ``[...]`` tensors: ``log_kept_mass`` (float32, log of the kept mass
    under the full tempered softmax), ``support_size`` (int64) and ``in_support`` (bool: the
    target is kept); ignored rows give 0, 0 and False. Neither goes with ``return_entropy``,
    ``inplace_backward`` or ``process_group``.

    ``target [..., K]`` (one more dim than the rows: K targets a row, verl's top-k log-probs)
    gives float32 ``[..., K]`` from one pass over each row (its lse computed once), ignored
    entries 0 with no gradient, and with ``return_entropy`` the rows' entropy ``[...]``; not
    with ``inplace_backward``, ``process_group``, ``sampling`` or DTensors.
    """
    return TOKEN_LOGPROBS.enter(TokenLogprobsCall(
        logits=logits, target=target, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, inplace_backward=inplace_backward, backend=backend,
        process_group=process_group, check_consistency=check_consistency, sampling=sampling,
        return_support=return_support))


@dataclass(frozen=True)
class _Sampled:
    """A checked ``token_logprobs`` call under ``sampling=`` (or ``return_support``): the
    sampler's settings, and the plain op's params at the sampler's temperature (what a sampler
    that keeps every token of a row scores with)."""
    sampling: SamplingParams
    params: LogprobsParams
    return_support: bool

    @property
    def backend(self) -> str:
        return self.params.backend


@dataclass(frozen=True)
class _Columns:
    """A checked ``token_logprobs`` call with ``target [..., K]``."""
    params: LogprobsParams

    @property
    def backend(self) -> str:
        return self.params.backend


def _check(call: TokenLogprobsCall) -> Union[LogprobsParams, _Sampled, _Columns]:
    logits = call.logits
    check_logits(logits)
    if has_target_columns(logits, call.target):
        refuse_with_target_columns(
            "token_logprobs", inplace_backward=call.inplace_backward is not False,
            sampling=call.sampling is not None,
            return_support=call.return_support is not False)
        return _Columns(checked_target_columns(
            LogitsShape.of(logits), call.target, call.temperature, call.ignore_index,
            call.return_entropy, call.backend))
    if call.sampling is not None or check_bool(call.return_support, "return_support"):
        sampling = checked_sampling(call.sampling, call.temperature,
                                    return_entropy=call.return_entropy,
                                    inplace_backward=call.inplace_backward)
        params = checked_params(LogitsShape.of(logits), call.target, sampling.temperature,
                                call.ignore_index, False, False, call.backend)
        return _Sampled(sampling, params, check_bool(call.return_support, "return_support"))
    check_inplace(logits, call.inplace_backward)
    return checked_params(LogitsShape.of(logits), call.target, call.temperature,
                          call.ignore_index, call.return_entropy, call.inplace_backward,
                          call.backend)


def _sampled(call, checked: _Sampled, plain_route):
    """``sampling=``: the processed distribution's log-probs, on ``ops/sampling.py``'s route
    down to the sampled primitives; when no filter can drop a token, the plain op's
    ``plain_route`` (this door's local or reference route) with ``checked.params``."""
    logits, target, params = call.logits, call.target, checked.params
    if checked.sampling.filters(logits.shape[-1]):
        return sampled_token_logprobs(logits, target, checked.sampling, params.ignore_index,
                                      checked.return_support, params.backend)
    logp = plain_route(call, params)
    if checked.return_support:
        return logp, full_support(target, params.ignore_index, logits.shape[-1])
    return logp


def _reference(call: TokenLogprobsCall, checked):
    if isinstance(checked, _Sampled):
        return _sampled(call, checked, _reference)
    params = checked.params if isinstance(checked, _Columns) else checked
    logp, entropy = reference.token_logprobs(call.logits.float(), call.target,
                                             params.temperature, params.ignore_index)
    return (logp, entropy) if params.with_entropy else logp


def _local(call: TokenLogprobsCall, checked):
    if isinstance(checked, _Sampled):
        return _sampled(call, checked, _local)
    if isinstance(checked, _Columns):
        return _local_columns(call.logits, call.target, checked.params)
    logits, target, params = call.logits, call.target, checked
    logits_rows, target_flat = rows_view(logits), flat_target(target)
    if torch.is_grad_enabled() and logits.requires_grad:
        inplace = inplace_grad_owner(logits, logits_rows) if params.inplace_backward else None
        if inplace is None:
            params = replace(params, inplace_backward=False)
            inplace = (logits, None)
        base, starts = inplace
        logp, entropy = _TokenLogprobs.apply(logits, None if starts is None else base,
                                             target_flat, params, starts)
    else:
        logp, entropy = _forward_only(logits_rows, target_flat, params)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if params.with_entropy else logp


def _vocab_parallel(call: TokenLogprobsCall):
    """``token_logprobs`` of a vocabulary shard (``distributed/vocab_parallel.py``)."""
    logits, target = call.logits, call.target
    if call.sampling is not None or check_bool(call.return_support, "return_support"):
        checked_sampling(call.sampling, call.temperature, process_group=True)

    def checks(layout):
        if has_target_columns(logits, target):
            refuse_with_target_columns("token_logprobs", process_group=True)
        check_logits(logits, allow_empty_vocab=True)
        params = checked_params(vocab_parallel.whole_logits(logits, layout), target,
                                call.temperature, call.ignore_index, call.return_entropy,
                                call.inplace_backward, call.backend)
        check_inplace(logits, params.inplace_backward)
        return params

    layout, params = vocab_parallel.agreed_layout(
        "token_logprobs", call.process_group, vocab_parallel.vocab_size(logits), (logits,),
        target, call.ignore_index, call.check_consistency, checks)
    if params.backend == "reference":
        return vocab_parallel.on_gathered_logits(token_logprobs, call, layout)
    logp, entropy = vocab_shard.shard_rows(vocab_shard.LogprobsShard, logits, flat_target(target),
                                           params, layout, call.backend)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if params.with_entropy else logp


TOKEN_LOGPROBS = Door(token_logprobs, ("logits", "target"), _check, _local, _reference,
                      _vocab_parallel, dtensor.token_logprobs)


# ``target [..., K]``: K log-probs of each row from one pass over it. The row's lse comes from
# the kernels' single-target walk, run with one of the row's own targets (the one of largest
# logit); the K logits are gathered, and the gradient is that walk's, run with the sum of the
# row's upstream gradients, with the target columns overwritten by their exact values.

def has_target_columns(rows, target):
    """True for ``target [..., K]`` beside ``rows [..., V]`` (``[..., H]`` hidden states): one
    more trailing dim than the rows, K targets a row."""
    return (isinstance(rows, torch.Tensor) and isinstance(target, torch.Tensor)
            and rows.dim() >= 1 and target.dim() == rows.dim())


def refuse_with_target_columns(op, **unserved):
    """ValueError naming the first argument in ``unserved`` (name -> whether it was set) that
    ``op`` does not serve with ``[..., K]`` targets."""
    for name, is_set in unserved.items():
        if is_set:
            raise ValueError(f"{op}: {name} is not supported with target [..., K] (K targets "
                             f"a row); pass one target per row for it")


def checked_target_columns(logits: LogitsShape, target, temperature, ignore_index,
                           return_entropy, backend):
    """``checked_params`` for ``target [..., K]``: the logits' rows ``[...]`` then ``K >= 1``,
    every entry in range."""
    if tuple(target.shape[:-1]) != logits.lead or target.shape[-1] < 1:
        raise ValueError(f"target [..., K] must have the logits' leading shape {logits.lead} "
                         f"followed by K >= 1, got {tuple(target.shape)}")
    columns = LogitsShape(tuple(target.shape), logits.vocab, logits.device)
    return checked_params(columns, target, temperature, ignore_index, return_entropy, False,
                          backend)


def _row_targets(z, valid, safe, ignore_index):
    """``(best [N, 1], row_target [N])``: each row's first valid column of largest gathered
    logit ``z`` (a NaN counts as largest) and its id; ``ignore_index`` where none is valid."""
    key = torch.where(valid, z, float("-inf"))
    top = key.amax(-1, keepdim=True)
    is_top = valid & ((key == top) | key.isnan())
    best = is_top.to(torch.uint8).argmax(-1, keepdim=True)
    row_target = torch.where(valid.any(-1), safe.gather(-1, best).squeeze(-1), ignore_index)
    return best, row_target.contiguous()


def column_logprobs_forward(logits_rows, target_rows, params, logprobs_forward):
    """``(logp [N, K], entropy, lse, row_target, best)`` of ``[A, B, V]`` logits and
    ``target_rows [N, K]``; ``logprobs_forward(logits_rows, row_target)`` is the backend's
    primitive (``(logp, entropy, lse)`` per row).

    ``logp_k = logp_best + (z_k - z_best) / T``: ``z_best`` is the largest valid target logit,
    so ``logp_k <= logp_best <= 0`` and the sum never cancels (``z_k / T - lse`` would lose
    ``eps * |lse|`` on a confident row of large logits)."""
    outer, inner, _ = logits_rows.shape
    valid = target_rows != params.ignore_index
    safe = torch.where(valid, target_rows, 0).long()
    z = logits_rows.gather(2, safe.view(outer, inner, -1)).reshape(safe.shape).float()
    best, row_target = _row_targets(z, valid, safe, params.ignore_index)
    row_logp, entropy, lse = logprobs_forward(logits_rows, row_target)
    z_best = z.gather(-1, best)
    step = torch.where(z == z_best, 0.0, z - z_best)  # equal -inf logits: 0, not NaN
    logp = torch.where(valid, row_logp.unsqueeze(-1) + step / params.temperature, 0.0)
    return logp, entropy, lse, row_target, best


def _same_target_sums(ids, values):
    """``S[n, k] = sum of values[n, k']`` over the ``k'`` with ``ids[n, k'] == ids[n, k]``:
    each row sorted, then summed by runs of equal ids."""
    sorted_ids, order = ids.sort(-1)
    run_start = torch.ones_like(sorted_ids, dtype=torch.bool)
    run_start[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = run_start.cumsum(-1) - 1
    totals = torch.zeros_like(values).scatter_add_(-1, run, values.gather(-1, order))
    return torch.empty_like(values).scatter_(-1, order, totals.gather(-1, run))


def column_grads(logp, grad_logp, target_rows, best, row_target, entropy, grad_entropy,
                 params):
    """``(row_grad, grad_entropy, columns, values)`` for the backward of ``[..., K]`` targets.

    ``dL/dz_j = (S_j - G p_j - g_H p_j (log p_j + H)) / T`` with ``S_j`` the sum of the
    ``g_k`` whose target is ``j`` and ``G = sum_k g_k``: the single-target primitive run with
    ``row_target`` and ``row_grad = G`` writes every column but the targets' right; ``values``
    (float32 ``[N, K]``) are the exact gradient at ``columns`` (the targets; an ignored entry
    repeats the row's best column), to scatter over it. ``S_j - G p_j`` is formed as
    ``(S_j - G) - G expm1(log p_j)``: exact when the row's targets are one id, as ``p_j -> 1``.
    """
    valid = target_rows != params.ignore_index
    row_valid = valid.any(-1)
    g = torch.where(valid, grad_logp.reshape(logp.shape).float(), 0.0)
    row_grad = g.sum(-1)
    ids = torch.where(valid, target_rows.long(), -1)
    numer = (_same_target_sums(ids, g) - row_grad.unsqueeze(-1)
             - row_grad.unsqueeze(-1) * torch.expm1(logp))
    if params.with_entropy:
        grad_entropy = torch.where(row_valid, grad_entropy.reshape(-1).float(), 0.0)
        p = logp.exp()
        spread = torch.where(p > 0, p * (logp + entropy.unsqueeze(-1)), 0.0)
        numer = numer - grad_entropy.unsqueeze(-1) * spread
    else:
        grad_entropy = logp.new_empty(0)
    values = torch.where(valid, numer / params.temperature,
                         (numer / params.temperature).gather(-1, best))
    values = torch.where(row_valid.unsqueeze(-1), values, 0.0)
    safe_row = torch.where(row_valid, row_target, 0).unsqueeze(-1)
    columns = torch.where(valid, ids, safe_row)
    return row_grad, grad_entropy, columns, values


class _TokenLogprobsColumns(torch.autograd.Function):
    """``token_logprobs`` of ``target [..., K]``: ``(logp [N, K], entropy [N])``."""

    @staticmethod
    def forward(ctx, logits, target_rows, params):
        logp, entropy, lse, row_target, best = column_logprobs_forward(
            rows_view(logits), target_rows, params,
            lambda rows, row_target: library.logprobs_forward(rows, row_target, params,
                                                              params.backend))
        ctx.save_for_backward(logits, target_rows, logp, entropy, lse, row_target, best)
        ctx.params = params
        return logp, entropy if params.with_entropy else lse.new_zeros(lse.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("token_logprobs", TORCH_EQUIVALENT)
        logits, target_rows, logp, entropy, lse, row_target, best = ctx.saved_tensors
        params = ctx.params
        grad_logp = torch.zeros_like(logp) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        row_grad, grad_entropy, columns, values = column_grads(
            logp, grad_logp, target_rows, best, row_target, entropy, grad_entropy, params)
        grad = library.logprobs_backward(rows_view(logits), row_target, lse, entropy,
                                         row_grad, grad_entropy, params, params.backend)
        grad_rows = grad.view(-1, grad.shape[-1])
        overwrite_columns_(grad_rows, 1, columns, values)
        return grad.view(logits.shape), None, None


def _local_columns(logits, target, params: LogprobsParams):
    """``token_logprobs`` of ``target [..., K]`` -> float32 ``[..., K]`` (and entropy ``[...]``,
    0 on rows whose K targets are all ignored)."""
    target_rows = target.reshape(-1, target.shape[-1]).contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, entropy = _TokenLogprobsColumns.apply(logits, target_rows, params)
    else:
        logp, entropy, *_ = column_logprobs_forward(
            rows_view(logits), target_rows, params,
            lambda rows, row_target: library.logprobs_forward(rows, row_target, params,
                                                              params.backend))
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape[:-1])) if params.with_entropy else logp
