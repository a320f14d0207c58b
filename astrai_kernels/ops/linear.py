"""The fused LM head: losses from the hidden states and the LM head weight, never the logits.

Contract (docs/architecture.md, "Fused LM head"): each ``linear_*`` op equals its logits op
applied to ``F.linear(hidden, weight, bias)``, up to the rounding of the logits. The rows are
walked in chunks: a chunk's logits come from one matmul into a reused ``[chunk, V]`` buffer,
the backend's logits primitive (``kernels/primitives.py``) runs on it and writes the chunk's logit
gradient over the same buffer, and three more matmuls fold that gradient into the gradients of
``hidden``, ``weight`` and ``bias``. Nothing ``[N, V]`` is ever allocated.

* ``linear_cross_entropy`` (``mean``/``sum``) and token-level ``linear_grpo_loss`` know each
  row's gradient factor up front, so the forward produces all three gradients in one walk and
  backward only scales them (out of place: a retained graph can be walked again).
* ``linear_token_logprobs`` and ``reduction="none"`` keep per-row ``lse`` (and entropy) and walk
  the chunks again in backward with the upstream per-row gradients.

The chunk walk, its chunk rule and its compute dtype are ``ops/head.py``'s.
"""

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, Literal, Optional, Sequence, Tuple, Union, overload

import torch
from torch import Tensor

from .. import reference
from ..kernels.library import traceable_op
from ..kernels.primitives import CrossEntropyArgs, LogprobsArgs, SurrogateArgs
from ..kernels.registry import backend_module, resolve_backend
from . import cross_entropy as ce_op
from . import dtensor, vocab_parallel
from . import grpo as grpo_op
from . import logprobs as lp_op
from ._common import (
    LogitsShape,
    check_bool,
    check_in_range,
    dense_grad,
    flat_target,
    refuse_double_backward,
)
from .door import Checked, Door
from .grpo_options import GRPOOptions, options_from, options_or_keywords
from .head import (
    AttachHeadGrads,
    ChunkedHead,
    HeadArgs,
    check_head,
    checked_transform,
    fake_head_gradients,
    grad_or_none,
    head_any_grad,
    head_needs,
    reference_logits,
    row_floats,
)
from .reduction import loss_grad_scale, reduce_loss
from .sampling import (
    SamplingParams,
    checked_sampling,
    full_support,
    linear_sampled_token_logprobs,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# named by the error of a double backward (refuse_double_backward)
CE_EQUIVALENT = ("torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, "
                 "bias).float(), target, ...)")
LOGPROBS_EQUIVALENT = ("torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias)"
                       ".float() / temperature, -1).gather(-1, target[..., None])")



@traceable_op("linear_cross_entropy", params={"args": CrossEntropyArgs})
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                          args: CrossEntropyArgs, grad_scale: Optional[Tensor],
                          needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                          chunk_size: Optional[int], backend: str
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row losses and, when ``grad_scale`` is given, the gradients of the scaled sum."""
    needs = (needs_hidden, needs_weight, needs_bias) if grad_scale is not None else (False,) * 3
    head = ChunkedHead(hidden, weight, bias, chunk_size, needs)
    kernels = backend_module(backend)
    loss = row_floats(hidden.shape[0], hidden.device)
    for start, stop, logits in head.chunks():
        scale = None
        if grad_scale is not None:
            scale = grad_scale if grad_scale.numel() == 1 else grad_scale[start:stop]
        loss[start:stop], _ = kernels.cross_entropy_forward(
            logits, target[start:stop], scale, args, logits if scale is not None else None)
        if scale is not None:
            head.fold(start, stop, logits)
    return (loss, *head.gradients())


@_linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, args, grad_scale, needs_hidden, needs_weight, needs_bias,
      chunk_size, backend):
    needs = (needs_hidden, needs_weight, needs_bias) if grad_scale is not None else (False,) * 3
    return (row_floats(hidden.shape[0], hidden.device),
            *fake_head_gradients(hidden, weight, *needs))


@traceable_op("linear_logprobs_forward", floats=("logit_scale", "softcap"),
               params={"args": LogprobsArgs})
def _linear_logprobs_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                             target: Tensor, args: LogprobsArgs, chunk_size: Optional[int],
                             backend: str, logit_scale: float, softcap: float, statistics: int
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse, stats)`` per row; entropy is empty unless ``with_entropy``;
    ``stats [k, N]`` holds the ``k`` statistics of the ``statistics`` bit mask
    (``STATISTICS`` order; ``is_top1`` as 0/1)."""
    head = ChunkedHead(hidden, weight, bias, chunk_size, (False,) * 3, logit_scale, softcap)
    kernels = backend_module(backend)
    n_rows, with_entropy = hidden.shape[0], args.with_entropy
    logp, lse = row_floats(n_rows, hidden.device), row_floats(n_rows, hidden.device)
    entropy = row_floats(n_rows if with_entropy else 0, hidden.device)
    chosen = _chosen_statistics(statistics)
    stats = hidden.new_empty((len(chosen), n_rows), dtype=torch.float32)
    for start, stop, logits in head.chunks():
        chunk_logp, chunk_entropy, chunk_lse = kernels.logprobs_forward(
            logits, target[start:stop], args)
        logp[start:stop], lse[start:stop] = chunk_logp, chunk_lse
        if with_entropy:
            entropy[start:stop] = chunk_entropy
        if chosen:
            stats[:, start:stop] = _chunk_statistics(logits[0], target[start:stop],
                                                     args.temperature, chosen)
    return logp, entropy, lse, stats


@_linear_logprobs_forward.register_fake
def _(hidden, weight, bias, target, args, chunk_size, backend, logit_scale, softcap, statistics):
    n_rows = hidden.shape[0]
    return (row_floats(n_rows, hidden.device),
            row_floats(n_rows if args.with_entropy else 0, hidden.device),
            row_floats(n_rows, hidden.device),
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


@traceable_op("linear_logprobs_backward", floats=("logit_scale", "softcap"),
               params={"args": LogprobsArgs})
def _linear_logprobs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                              target: Tensor, lse: Tensor, entropy: Tensor, grad_logp: Tensor,
                              grad_entropy: Tensor, args: LogprobsArgs,
                              needs_hidden: bool, needs_weight: bool, needs_bias: bool,
                              chunk_size: Optional[int], backend: str,
                              logit_scale: float, softcap: float
                              ) -> Tuple[Tensor, Tensor, Tensor]:
    head = ChunkedHead(hidden, weight, bias, chunk_size, (needs_hidden, needs_weight, needs_bias),
                        logit_scale, softcap)
    kernels = backend_module(backend)
    with_entropy = args.with_entropy
    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        kernels.logprobs_backward(
            logits, target[rows], lse[rows], entropy[rows] if with_entropy else entropy,
            grad_logp[rows], grad_entropy[rows] if with_entropy else grad_entropy, args, logits)
        head.fold(start, stop, logits)
    return head.gradients()


@_linear_logprobs_backward.register_fake
def _(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, args, needs_hidden,
      needs_weight, needs_bias, chunk_size, backend, logit_scale, softcap):
    return fake_head_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias)


@traceable_op("linear_grpo_forward", floats=("logit_scale", "softcap"),
               params={"args": SurrogateArgs})
def _linear_grpo_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         advantages: Tensor, old_logprobs: Optional[Tensor],
                         ref_logprobs: Optional[Tensor], token_weight: Tensor,
                         args: SurrogateArgs, needs_hidden: bool, needs_weight: bool,
                         needs_bias: bool, chunk_size: Optional[int], backend: str,
                         logit_scale: float, softcap: float
                         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, token_loss, entropy, grad_hidden, grad_weight, grad_bias)`` of
    ``sum(weight * loss)``; ``entropy`` is empty unless ``args.with_entropy``."""
    needs = (needs_hidden, needs_weight, needs_bias)
    head = ChunkedHead(hidden, weight, bias, chunk_size, needs, logit_scale, softcap)
    kernels = backend_module(backend)
    n_rows = hidden.shape[0]
    with_entropy = args.with_entropy
    logp, token_loss = row_floats(n_rows, hidden.device), row_floats(n_rows, hidden.device)
    entropy = row_floats(n_rows if with_entropy else 0, hidden.device)

    def rows_of(values, rows):
        return None if values is None else values[rows]

    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        logp[rows], token_loss[rows], chunk_entropy = kernels.grpo_forward(
            logits, target[rows], advantages[rows], rows_of(old_logprobs, rows),
            rows_of(ref_logprobs, rows), token_weight[rows], args,
            logits if any(needs) else None)
        if with_entropy:
            entropy[rows] = chunk_entropy
        if any(needs):
            head.fold(start, stop, logits)
    return (logp, token_loss, entropy, *head.gradients())


@_linear_grpo_forward.register_fake
def _(hidden, weight, bias, target, advantages, old_logprobs, ref_logprobs, token_weight, args,
      needs_hidden, needs_weight, needs_bias, chunk_size, backend, logit_scale, softcap):
    n_rows = hidden.shape[0]
    return (row_floats(n_rows, hidden.device), row_floats(n_rows, hidden.device),
            row_floats(n_rows if args.with_entropy else 0, hidden.device),
            *fake_head_gradients(hidden, weight, needs_hidden, needs_weight, needs_bias))



class _LinearCrossEntropyRows(torch.autograd.Function):
    """``reduction="none"``: per-row losses; backward walks the chunks with per-row grads."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ce_args, head_args):
        loss, _, _, _ = _linear_cross_entropy(hidden, weight, bias, target, ce_args, None,
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
            hidden, weight, bias, target, ctx.ce_args, grad_rows.float().contiguous(), *needs,
            ctx.head_args.chunk_size, ctx.head_args.backend)
        return (grad_or_none(grad_hidden), grad_or_none(grad_weight), grad_or_none(grad_bias),
                None, None, None)


class _LinearTokenLogprobs(torch.autograd.Function):
    """``(logp, entropy, stats)``; the statistics are forward-only (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, args, head_args, transform=(1.0, 0.0),
                statistics=0):
        logp, entropy, lse, stats = _linear_logprobs_forward(
            hidden, weight, bias, target, args, head_args.chunk_size, head_args.backend,
            *transform, statistics)
        ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
        ctx.args = (args, head_args, transform)
        ctx.mark_non_differentiable(stats)
        if args.with_entropy:
            return logp, entropy, stats
        return logp, entropy.new_zeros(logp.shape), stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_stats):
        refuse_double_backward("linear_token_logprobs", LOGPROBS_EQUIVALENT)
        hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
        args, head_args, transform = ctx.args
        grad_logp = dense_grad(grad_logp, lse)
        grad_entropy = dense_grad(grad_entropy, lse) if args.with_entropy else lse.new_empty(0)
        grads = _linear_logprobs_backward(
            hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, args,
            *ctx.needs_input_grad[:3], head_args.chunk_size, head_args.backend, *transform)
        return (*(grad_or_none(g) for g in grads), None, None, None, None, None)



def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         logit_scale: float = 1.0,
                         normalizer: Union[None, float, Tensor] = None,
                         chunk_size: Optional[int] = None, backend: str = "auto",
                         process_group: Optional["ProcessGroup"] = None,
                         check_consistency: bool = True) -> Tensor:
    """Cross-entropy of ``hidden [..., H] @ weight[V, H].T + bias`` against ``target [...]``.

    Equals ``ak.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` (every keyword
    means the same, ``logit_scale`` and ``softcap`` included) without holding the ``[N, V]``
    logits; float32 result. With ``process_group`` the weight (and bias) hold this rank's
    vocabulary shard and the hidden states' gradient is summed over the group
    (``ops/vocab_parallel.py``; ``check_consistency`` as in ``cross_entropy``; no
    ``logit_scale`` there).
    """
    return LINEAR_CROSS_ENTROPY.enter(locals())


def _check_cross_entropy(call) -> Checked:
    hidden, weight = call["hidden"], call["weight"]
    check_head(hidden, weight, call["bias"], call["chunk_size"])
    return Checked(*ce_op.checked_params(
        LogitsShape.of_head(hidden, weight), call["target"], call["ignore_index"],
        call["reduction"], call["label_smoothing"], call["z_loss"], call["softcap"],
        call["normalizer"], False, call["backend"], call["logit_scale"]))


def _reference_cross_entropy(call, checked: Checked):
    logits = torch.nn.functional.linear(call["hidden"], call["weight"], call["bias"])
    return ce_op.cross_entropy(logits, call["target"], ignore_index=call["ignore_index"],
                               reduction=call["reduction"],
                               label_smoothing=call["label_smoothing"], z_loss=call["z_loss"],
                               softcap=call["softcap"], logit_scale=call["logit_scale"],
                               normalizer=call["normalizer"], backend="reference")


def _local_cross_entropy(call, checked: Checked):
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    params, normalizer_t = checked
    chunk_size = call["chunk_size"]
    hidden_rows, target_flat = hidden.reshape(-1, hidden.shape[-1]), flat_target(target)
    head_args = HeadArgs(chunk_size, params.backend)
    if params.reduction == "none":
        if head_any_grad(hidden, weight, bias):
            loss = _LinearCrossEntropyRows.apply(hidden_rows, weight, bias, target_flat,
                                                 params, head_args)
        else:
            loss, _, _, _ = _linear_cross_entropy(hidden_rows, weight, bias, target_flat,
                                                  params, None, False, False, False,
                                                  chunk_size, params.backend)
        return loss.view(target.shape)
    scale = loss_grad_scale(target_flat, params, normalizer_t)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    with torch.no_grad():
        loss, grad_hidden, grad_weight, grad_bias = _linear_cross_entropy(
            hidden_rows, weight, bias, target_flat, params, scale if any(needs) else None,
            *needs, chunk_size, params.backend)
        value = reduce_loss(loss, scale, params)
    if not any(needs):
        return value
    return AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
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
    return LINEAR_TOKEN_LOGPROBS.enter(locals())


@dataclass(frozen=True)
class _HeadLogprobs:
    """A checked ``linear_token_logprobs`` call: the logits op's params (None under
    ``sampling``), the sampler's distribution (or None), the transform and the statistics;
    ``columns``: ``target [..., K]``."""
    params: Optional[lp_op.LogprobsParams]
    sampling: Optional[SamplingParams]
    transform: Tuple[float, float]
    stats_mask: int
    backend: str
    columns: bool = False


def _check_token_logprobs(call) -> _HeadLogprobs:
    hidden, weight = call["hidden"], call["weight"]
    transform = checked_transform(call["logit_scale"], call["softcap"])
    stats_mask = _statistics_mask(call["statistics"])
    check_head(hidden, weight, call["bias"], call["chunk_size"])
    backend = resolve_backend(call["backend"], hidden.device)
    if lp_op.has_target_columns(hidden, call["target"]):
        lp_op.refuse_with_target_columns(
            "linear_token_logprobs", statistics=bool(stats_mask),
            sampling=call["sampling"] is not None,
            return_support=call["return_support"] is not False)
        params = lp_op.checked_target_columns(
            LogitsShape.of_head(hidden, weight), call["target"], call["temperature"],
            call["ignore_index"], call["return_entropy"], backend)
        return _HeadLogprobs(params, None, transform, 0, backend, columns=True)
    if call["sampling"] is not None or check_bool(call["return_support"], "return_support"):
        sampling = checked_sampling(call["sampling"], call["temperature"],
                                    return_entropy=call["return_entropy"],
                                    statistics=bool(stats_mask))
        return _HeadLogprobs(None, sampling, transform, stats_mask, backend)
    params = lp_op.checked_params(LogitsShape.of_head(hidden, weight), call["target"],
                                  call["temperature"], call["ignore_index"],
                                  call["return_entropy"], False, backend)
    return _HeadLogprobs(params, None, transform, stats_mask, backend)


def _sampled_token_logprobs(call, checked: _HeadLogprobs):
    """``sampling=``: the processed distribution's log-probs (``ops/sampling.py``)."""
    hidden, weight, target = call["hidden"], call["weight"], call["target"]
    sampling = checked.sampling
    if sampling.filters(weight.shape[0]):
        return linear_sampled_token_logprobs(hidden, weight, call["bias"], target, sampling,
                                             call["ignore_index"], call["return_support"],
                                             call["logit_scale"], call["softcap"],
                                             call["chunk_size"], checked.backend)
    logp = linear_token_logprobs(hidden, weight, target, bias=call["bias"],
                                 temperature=sampling.temperature,
                                 ignore_index=call["ignore_index"], softcap=call["softcap"],
                                 logit_scale=call["logit_scale"], chunk_size=call["chunk_size"],
                                 backend=checked.backend)
    if call["return_support"]:
        return logp, full_support(target, call["ignore_index"], weight.shape[0])
    return logp


def _reference_token_logprobs(call, checked: _HeadLogprobs):
    if checked.sampling is not None:
        return _sampled_token_logprobs(call, checked)
    if checked.columns:
        return lp_op.token_logprobs(
            reference_logits(call["hidden"], call["weight"], call["bias"], call["logit_scale"],
                             call["softcap"]), call["target"],
            temperature=call["temperature"], ignore_index=call["ignore_index"],
            return_entropy=call["return_entropy"], backend="reference")
    params, target = checked.params, call["target"]
    logits = reference_logits(call["hidden"], call["weight"], call["bias"], call["logit_scale"],
                              call["softcap"])
    out = lp_op.token_logprobs(logits, target, temperature=params.temperature,
                               ignore_index=params.ignore_index,
                               return_entropy=params.with_entropy, backend="reference")
    if not checked.stats_mask:
        return out
    with torch.no_grad():
        stats = reference.token_statistics(logits.detach().float(), target, params.temperature,
                                           params.ignore_index)
    stats = {name: stats[name] for name in _chosen_statistics(checked.stats_mask)}
    return (*out, stats) if params.with_entropy else (out, stats)


def _local_token_logprobs(call, checked: _HeadLogprobs):
    if checked.sampling is not None:
        return _sampled_token_logprobs(call, checked)
    if checked.columns:
        return _local_columns(call, checked)
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    params, stats_mask, chunk_size = checked.params, checked.stats_mask, call["chunk_size"]
    hidden_rows, target_flat = hidden.reshape(-1, hidden.shape[-1]), flat_target(target)
    if head_any_grad(hidden, weight, bias):
        logp, entropy, stats = _LinearTokenLogprobs.apply(
            hidden_rows, weight, bias, target_flat, params,
            HeadArgs(chunk_size, params.backend), checked.transform, stats_mask)
    else:
        logp, entropy, _, stats = _linear_logprobs_forward(
            hidden_rows, weight, bias, target_flat, params, chunk_size, params.backend,
            *checked.transform, stats_mask)
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


def _refuse_transform_with_process_group(logit_scale, softcap, stats_mask):
    if logit_scale != 1.0 or softcap or stats_mask:
        raise ValueError("softcap, logit_scale and statistics are not supported with "
                         "process_group (the vocabulary-parallel head)")


def linear_sequence_logprobs(hidden: Tensor, weight: Tensor, target: Tensor, mask: Tensor, *,
                             bias: Optional[Tensor] = None, average: bool = False,
                             temperature: float = 1.0, softcap: Optional[float] = None,
                             logit_scale: float = 1.0, chunk_size: Optional[int] = None,
                             backend: str = "auto",
                             sampling: Optional[SamplingParams] = None) -> Tensor:
    """Per-sequence sum (or mean over ``mask``) of token log-probs; hidden ``[B, T, H]``;
    ``softcap`` and ``logit_scale`` as in ``linear_token_logprobs``; ``sampling`` as in
    ``sequence_logprobs`` (a sequence with a token outside the support gets ``-inf``)."""
    return LINEAR_SEQUENCE_LOGPROBS.enter(locals())


def _check_sequence(call) -> lp_op.SequenceCall:
    hidden, weight = call["hidden"], call["weight"]
    check_head(hidden, weight, call["bias"], call["chunk_size"])
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    keep = lp_op.checked_sequence_mask(LogitsShape.of_head(hidden, weight), call["target"],
                                       call["mask"], call["average"])
    return lp_op.SequenceCall(keep, resolve_backend(call["backend"], hidden.device))


def _sequence_logprobs(call, checked: lp_op.SequenceCall):
    """Both routes: the token log-probs (the reference's on the reference backend) reduced."""
    target = call["target"]
    masked_target = torch.where(checked.keep, target, torch.full_like(target, -100))
    logp = linear_token_logprobs(call["hidden"], call["weight"], masked_target, bias=call["bias"],
                                 temperature=call["temperature"], ignore_index=-100,
                                 softcap=call["softcap"], logit_scale=call["logit_scale"],
                                 chunk_size=call["chunk_size"], backend=checked.backend,
                                 sampling=call["sampling"])
    return lp_op.reduce_sequence(logp, call["mask"], call["average"])


def _sequence_dtensor(op, **call):
    return dtensor.linear_sequence_logprobs(op, linear_token_logprobs, lp_op.reduce_sequence,
                                            **call)


@options_or_keywords
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
                     rollout_is: Optional[str] = None, rollout_is_min: Optional[float] = None,
                     rollout_is_max: Optional[float] = 3.0,
                     rollout_is_batch_normalize: bool = False,
                     rollout_rs: Optional[str] = None,
                     rollout_rs_threshold: Optional[float] = None,
                     rollout_rs_threshold_lower: Optional[float] = None,
                     options: Optional[GRPOOptions] = None, softcap: Optional[float] = None,
                     logit_scale: float = 1.0, sampling: Optional[SamplingParams] = None,
                     return_token_values: bool = False,
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
    ``linear_cross_entropy`` (no softcap or logit scale there). ``return_token_values`` as in
    ``ak.grpo_loss``: the token log-probs and entropies come out of the same walk.
    ``sampling`` as in ``ak.grpo_loss``: the token log-probs under the sampler's processed
    distribution (``linear_token_logprobs(sampling=...)``), a token outside it masked.
    """
    options = options_from(options, dict(
        beta=beta, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, delta=delta,
        loss_type=loss_type, importance_sampling=importance_sampling, temperature=temperature,
        max_completion_length=max_completion_length, sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
        kl_ratio_correction=kl_ratio_correction, off_policy_threshold=off_policy_threshold,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
        rollout_is=rollout_is, rollout_is_min=rollout_is_min, rollout_is_max=rollout_is_max,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        rollout_rs_threshold_lower=rollout_rs_threshold_lower))
    return LINEAR_GRPO_LOSS.enter(locals())


@dataclass(frozen=True)
class _HeadGRPO:
    """A checked ``linear_grpo_loss`` call: the GRPO plan and the logits' transform."""
    plan: grpo_op.GRPOPlan
    transform: Tuple[float, float]

    @property
    def backend(self) -> str:
        return self.plan.backend


def _check_grpo(call) -> _HeadGRPO:
    hidden, weight = call["hidden"], call["weight"]
    transform = checked_transform(call["logit_scale"], call["softcap"])
    check_head(hidden, weight, call["bias"], call["chunk_size"])
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    plan = grpo_op.plan(LogitsShape.of_head(hidden, weight), call["target"],
                        call["advantages"], call["options"], backend=call["backend"],
                        **grpo_op.call_inputs(call))
    return _HeadGRPO(plan, transform)


def _reference_grpo(call, checked: _HeadGRPO):
    logits = reference_logits(call["hidden"], call["weight"], call["bias"], call["logit_scale"],
                              call["softcap"])
    keywords = grpo_op.without_option_keywords(call)
    for name in ("hidden", "weight", "bias", "softcap", "logit_scale", "chunk_size"):
        del keywords[name]
    return grpo_op.grpo_loss(logits=logits, **{**keywords, "backend": "reference"})


def _local_grpo(call, checked: _HeadGRPO):
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    plan, chunk_size = checked.plan, call["chunk_size"]
    params = plan.params

    def head_logprobs(masked_target, **keywords):
        return linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                     softcap=call["softcap"], logit_scale=call["logit_scale"],
                                     chunk_size=chunk_size, backend=params.backend, **keywords)

    if plan.sampling is not None:
        return grpo_op.from_logprobs(grpo_op.sampled_logprobs_of(
            lambda masked_target: head_logprobs(masked_target, ignore_index=-100,
                                                sampling=plan.sampling)), target, plan)
    if not plan.fused:
        def logprobs_of(masked_target, with_entropy):
            out = head_logprobs(masked_target, temperature=params.temperature,
                                return_entropy=with_entropy)
            return out if with_entropy else (out, None)
        return grpo_op.from_logprobs(logprobs_of, target, plan)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    flat = plan.flat_rows()
    with torch.no_grad():
        logp, token_loss, entropy, grad_hidden, grad_weight, grad_bias = _linear_grpo_forward(
            hidden_rows, weight, bias, flat_target(target), flat.advantages, flat.old,
            flat.ref, flat.weight, replace(params, with_entropy=plan.token_values),
            *needs, chunk_size, params.backend, *checked.transform)
        value, metrics, *values = grpo_op.token_level_result(logp, token_loss, entropy, plan)
    if not any(needs):
        return (value, metrics, *values)
    loss = AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_grpo_loss", None)
    return (loss, metrics, *values)


def _grpo_dtensor(op, **call):
    if call["sampling"] is not None:
        grpo_op.check_sampling(call["sampling"], call["options"], call["return_token_values"],
                               sharded=True)
    return dtensor.linear_grpo_loss(op, **call)


def _vocab_parallel_cross_entropy(call):
    """``linear_cross_entropy`` with this rank's vocabulary shard of the head."""
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    chunk_size, backend = call["chunk_size"], call["backend"]
    if check_in_range(call["logit_scale"], "logit_scale", -math.inf, math.inf) != 1.0:
        raise ValueError("logit_scale is not supported with process_group")
    hidden_rows, layout, needs_grad = vocab_parallel.head_setup(
        hidden, weight, bias, chunk_size, call["process_group"], target, call["ignore_index"],
        call["check_consistency"])
    params, normalizer_t = ce_op.checked_params(
        vocab_parallel.whole_logits(hidden, layout), target, call["ignore_index"],
        call["reduction"], call["label_smoothing"], call["z_loss"], call["softcap"],
        call["normalizer"], False, backend)
    if params.backend == "reference":
        return vocab_parallel.on_head_logits(ce_op.cross_entropy, call)
    reduction = params.reduction
    target_flat = flat_target(target)
    if reduction != "none" and needs_grad:  # the gradient factor is known: one walk
        scale = loss_grad_scale(target_flat, params, normalizer_t)
        with torch.no_grad():
            rows_loss, grad_hidden, grad_weight, grad_bias = (
                vocab_parallel.head_shard_cross_entropy_walk(
                    hidden_rows, weight, bias, target_flat, params, layout, chunk_size, backend,
                    scale, head_needs(hidden, weight, bias)))
            value = reduce_loss(rows_loss, scale, params)
        return AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                      grad_bias, "linear_cross_entropy", CE_EQUIVALENT)
    rows_loss = vocab_parallel.head_shard_cross_entropy_rows(
        hidden_rows, weight, bias, target_flat, params, layout, chunk_size, backend, needs_grad)
    if reduction == "none":
        return rows_loss.view(target.shape)
    return reduce_loss(rows_loss, loss_grad_scale(target_flat, params, normalizer_t), params)


def _vocab_parallel_token_logprobs(call):
    """``linear_token_logprobs`` with this rank's vocabulary shard of the head."""
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    chunk_size, backend = call["chunk_size"], call["backend"]
    if lp_op.has_target_columns(hidden, target):
        lp_op.refuse_with_target_columns("linear_token_logprobs", process_group=True)
    if call["sampling"] is not None or check_bool(call["return_support"], "return_support"):
        checked_sampling(call["sampling"], call["temperature"], process_group=True)
    logit_scale, softcap = checked_transform(call["logit_scale"], call["softcap"])
    _refuse_transform_with_process_group(logit_scale, softcap,
                                         _statistics_mask(call["statistics"]))
    hidden_rows, layout, needs_grad = vocab_parallel.head_setup(
        hidden, weight, bias, chunk_size, call["process_group"], target, call["ignore_index"],
        call["check_consistency"])
    params = lp_op.checked_params(vocab_parallel.whole_logits(hidden, layout), target,
                                  call["temperature"], call["ignore_index"],
                                  call["return_entropy"], False, backend)
    if params.backend == "reference":
        return vocab_parallel.on_head_logits(lp_op.token_logprobs, call)
    logp, entropy = vocab_parallel.head_shard_token_logprobs(
        hidden_rows, weight, bias, flat_target(target), params, layout, chunk_size, backend,
        needs_grad)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if params.with_entropy else logp


def _vocab_parallel_grpo_loss(call):
    """``linear_grpo_loss`` with this rank's vocabulary shard of the head: its token log-probs,
    then the per-token objective in torch."""
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    chunk_size, process_group = call["chunk_size"], call["process_group"]
    if call["sampling"] is not None:
        grpo_op.check_sampling(call["sampling"], call["options"], call["return_token_values"],
                               sharded=True)
    logit_scale, softcap = checked_transform(call["logit_scale"], call["softcap"])
    _refuse_transform_with_process_group(logit_scale, softcap, 0)
    vocab_parallel.check_shard_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    # the row count here; the targets' fingerprint (masked ones ignored) in the log-probs call
    layout = vocab_parallel.shard_layout(process_group, weight.shape[0], hidden.device, target,
                                         check_consistency=False)
    check_consistency = vocab_parallel.check_consistency_flag(call["check_consistency"])
    checked = grpo_op.plan(vocab_parallel.whole_logits(hidden, layout), target,
                           call["advantages"], call["options"], backend=call["backend"],
                           **grpo_op.call_inputs(call))
    if checked.params.backend == "reference":
        return vocab_parallel.on_head_logits(grpo_op.grpo_loss,
                                             grpo_op.without_option_keywords(call))

    def logprobs_of(masked_target, with_entropy):
        out = linear_token_logprobs(hidden, weight, masked_target, process_group=process_group,
                                    bias=bias, temperature=checked.params.temperature,
                                    ignore_index=-100, return_entropy=with_entropy,
                                    chunk_size=chunk_size, backend=call["backend"],
                                    check_consistency=check_consistency)
        return out if with_entropy else (out, None)

    return grpo_op.from_logprobs(logprobs_of, target, checked)


LINEAR_CROSS_ENTROPY = Door(linear_cross_entropy,
                            ("hidden", "weight", "target", "bias", "normalizer"),
                            _check_cross_entropy, _local_cross_entropy, _reference_cross_entropy,
                            _vocab_parallel_cross_entropy, dtensor.linear_cross_entropy)
LINEAR_TOKEN_LOGPROBS = Door(linear_token_logprobs, ("hidden", "weight", "target", "bias"),
                             _check_token_logprobs, _local_token_logprobs,
                             _reference_token_logprobs, _vocab_parallel_token_logprobs,
                             dtensor.linear_token_logprobs)
LINEAR_SEQUENCE_LOGPROBS = Door(linear_sequence_logprobs,
                                ("hidden", "weight", "target", "mask", "bias"), _check_sequence,
                                _sequence_logprobs, _sequence_logprobs,
                                dtensor=_sequence_dtensor)
LINEAR_GRPO_LOSS = Door(linear_grpo_loss, ("hidden", "weight", "target", "advantages", "bias",
                                           "mask", "old_logprobs", "ref_logprobs", "normalizer",
                                           "importance_weights", "sampling_logprobs"),
                        _check_grpo, _local_grpo, _reference_grpo, _vocab_parallel_grpo_loss,
                        _grpo_dtensor)


# ``target [..., K]`` on the fused head: the logits op's way (``ops/logprobs.py``, "target
# [..., K]") run on each chunk of ChunkedHead's walk, the target columns of a chunk's logit
# gradient overwritten before it is folded.

def _linear_column_walk(hidden_rows, weight, bias, target_rows, params, chunk_size, transform):
    """``(logp [N, K], entropy, lse, row_target, best)`` from one forward walk."""
    head = ChunkedHead(hidden_rows, weight, bias, chunk_size, (False,) * 3, *transform)
    kernels = backend_module(params.backend)
    n_rows, device = hidden_rows.shape[0], hidden_rows.device
    logp = torch.empty(target_rows.shape, dtype=torch.float32, device=device)
    lse = row_floats(n_rows, device)
    entropy = row_floats(n_rows if params.with_entropy else 0, device)
    row_target = torch.empty(n_rows, dtype=torch.long, device=device)
    best = torch.empty((n_rows, 1), dtype=torch.long, device=device)

    def chunk_forward(chunk_logits, chunk_row_target):
        return kernels.logprobs_forward(chunk_logits, chunk_row_target, params)

    for start, stop, logits in head.chunks():
        rows = slice(start, stop)
        logp[rows], chunk_entropy, lse[rows], row_target[rows], best[rows] = (
            lp_op.column_logprobs_forward(logits, target_rows[rows], params, chunk_forward))
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
        row_grad, grad_entropy, columns, values = lp_op.column_grads(
            logp, grad_logp, target_rows, best, row_target, entropy, grad_entropy, params)
        head = ChunkedHead(hidden_rows, weight, bias, ctx.chunk_size,
                           tuple(ctx.needs_input_grad[:3]), *ctx.transform)
        kernels = backend_module(params.backend)
        with_entropy = params.with_entropy
        for start, stop, logits in head.chunks():
            rows = slice(start, stop)
            kernels.logprobs_backward(
                logits, row_target[rows], lse[rows], entropy[rows] if with_entropy else entropy,
                row_grad[rows], grad_entropy[rows] if with_entropy else grad_entropy, params,
                logits)
            logits[0].scatter_(1, columns[rows], values[rows].to(logits.dtype))
            head.fold(start, stop, logits)
        grads = head.gradients()
        return (*(grad_or_none(g) for g in grads), None, None, None, None)


def _local_columns(call, checked: _HeadLogprobs):
    """``linear_token_logprobs`` of ``target [..., K]`` -> float32 ``[..., K]`` (and the rows'
    entropy ``[...]``), as ``token_logprobs`` of ``target [..., K]`` on the head's logits."""
    hidden, weight, bias, target = call["hidden"], call["weight"], call["bias"], call["target"]
    params, chunk_size, transform = checked.params, call["chunk_size"], checked.transform
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
