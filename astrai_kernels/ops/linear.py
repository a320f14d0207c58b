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
from dataclasses import replace
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
from ._common import check_bool, check_in_range, dense_grad, flat_target, refuse_double_backward
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
    logits_like,
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
    if dtensor.has_dtensor(hidden, weight, target, bias, normalizer):  # locals(): every argument
        return dtensor.linear_cross_entropy(linear_cross_entropy, **locals())
    if process_group is not None:
        if check_in_range(logit_scale, "logit_scale", -math.inf, math.inf) != 1.0:
            raise ValueError("logit_scale is not supported with process_group")
        return _vocab_parallel_cross_entropy(
            hidden, weight, target, process_group, bias, ignore_index, reduction,
            label_smoothing, z_loss, softcap, normalizer, chunk_size, backend, check_consistency)
    hidden_rows = check_head(hidden, weight, bias, chunk_size)
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        return ce_op.cross_entropy(torch.nn.functional.linear(hidden, weight, bias), target,
                                   ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=label_smoothing, z_loss=z_loss,
                                   softcap=softcap, logit_scale=logit_scale,
                                   normalizer=normalizer, backend="reference")
    # The logits op's own checks and scale rules, run on a zero-byte stand-in for the logits.
    params, normalizer_t = ce_op.checked_params(
        logits_like(hidden, weight), target, ignore_index, reduction, label_smoothing, z_loss,
        softcap, normalizer, False, backend, logit_scale)
    target_flat = flat_target(target)
    ce_args = params  # a CrossEntropyArgs subclass: the walk reads its declared fields
    head_args = HeadArgs(chunk_size, params.backend)
    if reduction == "none":
        if head_any_grad(hidden, weight, bias):
            loss = _LinearCrossEntropyRows.apply(hidden_rows, weight, bias, target_flat,
                                                 ce_args, head_args)
        else:
            loss, _, _, _ = _linear_cross_entropy(hidden_rows, weight, bias, target_flat,
                                                  ce_args, None, False, False, False,
                                                  chunk_size, params.backend)
        return loss.view(target.shape)
    scale = loss_grad_scale(target_flat, params, normalizer_t)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    with torch.no_grad():
        loss, grad_hidden, grad_weight, grad_bias = _linear_cross_entropy(
            hidden_rows, weight, bias, target_flat, ce_args, scale if any(needs) else None,
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
    """
    if dtensor.has_dtensor(hidden, weight, target, bias):  # locals(): every argument
        return dtensor.linear_token_logprobs(linear_token_logprobs, **locals())
    logit_scale, softcap_value = checked_transform(logit_scale, softcap)
    stats_mask = _statistics_mask(statistics)
    if sampling is not None or check_bool(return_support, "return_support"):
        sampling = checked_sampling(sampling, temperature, return_entropy=return_entropy,
                                    statistics=bool(stats_mask),
                                    process_group=process_group is not None)
        check_head(hidden, weight, bias, chunk_size)
        if sampling.filters(weight.shape[0]):
            return linear_sampled_token_logprobs(hidden, weight, bias, target, sampling,
                                                 ignore_index, return_support, logit_scale,
                                                 softcap, chunk_size, backend)
        logp = linear_token_logprobs(hidden, weight, target, bias=bias,
                                     temperature=sampling.temperature, ignore_index=ignore_index,
                                     softcap=softcap, logit_scale=logit_scale,
                                     chunk_size=chunk_size, backend=backend)
        if return_support:
            return logp, full_support(target, ignore_index, weight.shape[0])
        return logp
    if process_group is not None:
        _refuse_transform_with_process_group(logit_scale, softcap_value, stats_mask)
        return _vocab_parallel_token_logprobs(
            hidden, weight, target, process_group, bias, temperature, ignore_index,
            return_entropy, chunk_size, backend, check_consistency)
    hidden_rows = check_head(hidden, weight, bias, chunk_size)
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        logits = reference_logits(hidden, weight, bias, logit_scale, softcap)
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
    params = lp_op.checked_params(logits_like(hidden, weight), target, temperature,
                                  ignore_index, return_entropy, False, backend)
    target_flat = flat_target(target)
    transform = (logit_scale, softcap_value)
    if head_any_grad(hidden, weight, bias):
        logp, entropy, stats = _LinearTokenLogprobs.apply(
            hidden_rows, weight, bias, target_flat, params,
            HeadArgs(chunk_size, params.backend), transform, stats_mask)
    else:
        logp, entropy, _, stats = _linear_logprobs_forward(
            hidden_rows, weight, bias, target_flat, params, chunk_size, params.backend,
            *transform, stats_mask)
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
    if dtensor.has_dtensor(hidden, weight, target, mask, bias):  # locals(): every argument
        return dtensor.linear_sequence_logprobs(linear_sequence_logprobs, linear_token_logprobs,
                                                lp_op.reduce_sequence, **locals())
    check_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    keep = lp_op.checked_sequence_mask(logits_like(hidden, weight), target, mask, average)
    masked_target = torch.where(keep, target, torch.full_like(target, -100))
    logp = linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                 temperature=temperature, ignore_index=-100, softcap=softcap,
                                 logit_scale=logit_scale, chunk_size=chunk_size,
                                 backend=backend, sampling=sampling)
    return lp_op.reduce_sequence(logp, mask, average)


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
    sharded = dtensor.has_dtensor(hidden, weight, target, advantages, bias, mask, old_logprobs,
                                  ref_logprobs, normalizer, importance_weights, sampling_logprobs)
    if sampling is not None:
        sampling = grpo_op.check_sampling(sampling, options, return_token_values,
                                          sharded or process_group is not None)
    elif sharded:
        return dtensor.linear_grpo_loss(linear_grpo_loss, **locals())  # locals(): every argument
    logit_scale, softcap_value = checked_transform(logit_scale, softcap)
    inputs = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                  normalizer=normalizer, importance_weights=importance_weights,
                  sampling_logprobs=sampling_logprobs, return_token_values=return_token_values)
    if process_group is not None:
        _refuse_transform_with_process_group(logit_scale, softcap_value, 0)
        return _vocab_parallel_grpo_loss(hidden, weight, target, advantages, process_group, bias,
                                         chunk_size, backend, check_consistency, options, inputs)
    check_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    backend = resolve_backend(backend, hidden.device)
    if backend == "reference":
        logits = reference_logits(hidden, weight, bias, logit_scale, softcap)
        return grpo_op.grpo_loss(logits, target, advantages, backend="reference",
                                 options=options, sampling=sampling, **inputs)
    plan = grpo_op.plan(logits_like(hidden, weight), target, advantages, options,
                        backend=backend, **inputs)
    if sampling is not None:
        return grpo_op.from_logprobs(grpo_op.sampled_logprobs_of(
            lambda masked_target: linear_token_logprobs(
                hidden, weight, masked_target, bias=bias, ignore_index=-100, softcap=softcap,
                logit_scale=logit_scale, chunk_size=chunk_size, backend=plan.params.backend,
                sampling=sampling)), target, replace(plan, support_pending=True))
    if not plan.fused:
        def logprobs_of(masked_target, with_entropy):
            out = linear_token_logprobs(hidden, weight, masked_target, bias=bias,
                                        temperature=plan.params.temperature,
                                        return_entropy=with_entropy, softcap=softcap,
                                        logit_scale=logit_scale, chunk_size=chunk_size,
                                        backend=plan.params.backend)
            return out if with_entropy else (out, None)
        return grpo_op.from_logprobs(logprobs_of, target, plan)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])
    flat = plan.flat_rows()
    with torch.no_grad():
        logp, token_loss, entropy, grad_hidden, grad_weight, grad_bias = _linear_grpo_forward(
            hidden_rows, weight, bias, flat_target(target), flat.advantages, flat.old,
            flat.ref, flat.weight, replace(plan.params, with_entropy=plan.token_values),
            *needs, chunk_size, plan.params.backend, logit_scale, softcap_value)
        value, metrics, *values = grpo_op.token_level_result(logp, token_loss, entropy, plan)
    if not any(needs):
        return (value, metrics, *values)
    loss = AttachHeadGrads.apply(hidden_rows, weight, bias, value, grad_hidden, grad_weight,
                                  grad_bias, "linear_grpo_loss", None)
    return (loss, metrics, *values)


def _vocab_parallel_cross_entropy(hidden, weight, target, process_group, bias, ignore_index,
                                  reduction, label_smoothing, z_loss, softcap, normalizer,
                                  chunk_size, backend, check_consistency):
    """``linear_cross_entropy`` with this rank's vocabulary shard of the head."""
    hidden_rows, layout, needs_grad = vocab_parallel.head_setup(
        hidden, weight, bias, chunk_size, process_group, target, ignore_index, check_consistency)
    params, normalizer_t = ce_op.checked_params(
        vocab_parallel.global_stand_in(hidden, hidden.shape[:-1], layout), target, ignore_index,
        reduction, label_smoothing, z_loss, softcap, normalizer, False, backend)
    if params.backend == "reference":
        logits = vocab_parallel.head_reference_logits(hidden, weight, bias, process_group)
        return ce_op.cross_entropy(logits, target, process_group=process_group,
                                   ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=label_smoothing, z_loss=z_loss,
                                   softcap=softcap, normalizer=normalizer, backend="reference")
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


def _vocab_parallel_token_logprobs(hidden, weight, target, process_group, bias, temperature,
                                   ignore_index, return_entropy, chunk_size, backend,
                                   check_consistency):
    """``linear_token_logprobs`` with this rank's vocabulary shard of the head."""
    hidden_rows, layout, needs_grad = vocab_parallel.head_setup(
        hidden, weight, bias, chunk_size, process_group, target, ignore_index, check_consistency)
    params = lp_op.checked_params(vocab_parallel.global_stand_in(hidden, hidden.shape[:-1],
                                                                 layout),
                                  target, temperature, ignore_index, return_entropy, False,
                                  backend)
    if params.backend == "reference":
        logits = vocab_parallel.head_reference_logits(hidden, weight, bias, process_group)
        return lp_op.token_logprobs(logits, target, process_group=process_group,
                                    temperature=temperature, ignore_index=ignore_index,
                                    return_entropy=return_entropy, backend="reference")
    logp, entropy = vocab_parallel.head_shard_token_logprobs(
        hidden_rows, weight, bias, flat_target(target), params, layout, chunk_size, backend,
        needs_grad)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if return_entropy else logp


def _vocab_parallel_grpo_loss(hidden, weight, target, advantages, process_group, bias,
                              chunk_size, backend, check_consistency, options, inputs):
    """``linear_grpo_loss`` with this rank's vocabulary shard of the head: its token log-probs,
    then the per-token objective in torch."""
    vocab_parallel.check_shard_head(hidden, weight, bias, chunk_size)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    # the row count here; the targets' fingerprint (masked ones ignored) in the log-probs call
    layout = vocab_parallel.shard_layout(process_group, weight.shape[0], hidden.device, target,
                                         check_consistency=False)
    vocab_parallel.check_consistency_flag(check_consistency)
    checked = grpo_op.plan(vocab_parallel.global_stand_in(hidden, hidden.shape[:-1], layout),
                           target, advantages, options, backend=backend, **inputs)
    if checked.params.backend == "reference":
        logits = vocab_parallel.head_reference_logits(hidden, weight, bias, process_group)
        return grpo_op.grpo_loss(logits, target, advantages, process_group=process_group,
                                 backend="reference", options=options, **inputs)

    def logprobs_of(masked_target, with_entropy):
        out = linear_token_logprobs(hidden, weight, masked_target, process_group=process_group,
                                    bias=bias, temperature=checked.params.temperature,
                                    ignore_index=-100, return_entropy=with_entropy,
                                    chunk_size=chunk_size, backend=backend,
                                    check_consistency=check_consistency)
        return out if with_entropy else (out, None)

    return grpo_op.from_logprobs(logprobs_of, target, checked)
