"""DTensor front door: a DTensor argument stands for its ``full_tensor()``, served without it.

Each public op served here (``cross_entropy``, ``token_logprobs``, ``linear_cross_entropy``,
``linear_token_logprobs``, ``grpo_loss``, ``linear_grpo_loss``, ``sequence_logprobs``,
``linear_sequence_logprobs``, ``distill_loss``, ``topk_distill_loss`` and their ``linear_``
forms) is routed by its front
door (``ops/door.py``): on a DTensor it hands itself and every argument to its namesake below,
which calls it back on this rank's local tensors (so this module imports no op module at import
time; ``sequence_logprobs``' vocabulary path imports ``token_logprobs`` when called;
DESIGN.md, "Distributed"; docs/distributed.md, "DTensor"). The
placements on each mesh dimension choose the path:

* logits ``Shard(-1)``, or a weight ``Shard(0)`` (ColwiseParallel's lm_head): a vocabulary shard,
  served by the op's ``process_group=`` path over that dimension's group. torch's ``Shard``
  splits like ``torch.chunk`` (ceil-sized contiguous chunks in rank order, the last ones smaller
  or empty), which is that path's contract (``ops/vocab_parallel.py``).
* logits ``Shard(d)``, or hidden states ``Shard(d)`` beside a weight replicated there, ``d`` a
  row dimension: the op on this rank's rows. ``mean`` divides by the count of counted targets
  summed over the dimension (``normalizer=``), reduced results are summed over it into a
  Replicate result, and a replicated weight's (and bias's) gradient is summed over it.
* hidden states ``Shard(d)`` beside a weight ``Shard(0)`` on the same dimension (sequence
  parallel): the hidden rows are all-gathered (``[N, H]``, small next to ``[N, V]``), the
  vocabulary path runs, and per-row results come back sharded as the hidden states were.
* ``Replicate``, and a plain tensor (read as replicated over the mesh): the op as it is.
* ``distill_loss`` and ``topk_distill_loss``: rows or ``Replicate`` only (no vocabulary path);
  the other logits and the ``[..., K]`` inputs follow the student's rows; the means divide the
  rows' sum, summed over the shards, by the count summed over them. Their ``linear_`` forms
  take hidden states so, beside replicated weights and biases (gradients summed over the row
  shards).
* ``grpo_loss`` and ``sequence_logprobs`` (and their ``linear_`` forms) serve rows as whole
  sequences only (``Shard(0)`` of ``[B, T, V]`` or ``[B, T, H]``; ``Shard(1)`` is refused):
  per-row inputs come as plain full-batch tensors (sliced) or DTensors (redistributed to the
  rows'). The per-sequence loss types (``grpo``,
  ``sapo``, ``dr_grpo``, ``luspo``) are scaled by ``B_local / B``; the global-count ones
  (``bnpo`` as ``dapo``, ``dapo``, ``cispo``, ``vespo``) get the all-reduced unmasked count as
  ``normalizer=``; the metrics are the full batch's masked means (count-weighted, summed).
  Options reading across sequences are refused there (``_check_row_local_options``).
  ``sequence_logprobs`` of a vocabulary shard is ``token_logprobs``' vocabulary path and a
  masked sum.

Bad input on one rank raises on every rank (``ops/agreement.py``): the local op runs inside
the ranks' agreement over the whole mesh, which a vocabulary path settles at its own checks and
a row path when the op returns or raises, before the route's next collective. A DTensor's
placements and shape are the same on every rank (DTensor's contract), so the checks of them
here raise at once; a plain tensor is this rank's own, so a check of one here (its shape) is
deferred to the agreement, and the route goes on to the same collectives as its peers.

Targets follow the rows (redistributed to the rows' placements: a local slice, or an all-gather
of integers). Results are DTensors on the same mesh: per-row ones sharded as the rows, reduced
ones Replicate; each input's gradient has that input's placements. Anything else (Partial, the
vocabulary sharded over two mesh dimensions, a shard of the hidden size, a strided shard) raises
``ValueError`` naming the placements and the ``redistribute`` that would serve: an ``[N, V]``
tensor is never gathered here.

torch.distributed.tensor is imported only by the serving functions: no DTensor exists before it
is loaded, so :func:`has_dtensor` costs a dictionary lookup and ``import astrai_kernels`` stays
light.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..options.scalars import check_index
from . import agreement


def has_dtensor(*values) -> bool:
    """True when any of ``values`` is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = getattr(module, "DTensor", None)
    return dtensor_type is not None and any(isinstance(value, dtensor_type) for value in values)


def cross_entropy(op, logits, target, *, reduction="mean", normalizer=None, ignore_index=-100,
                  process_group=None, **options):
    """``op`` (``ak.cross_entropy``) of DTensor logits (or a DTensor target)."""
    call = _logits_call("cross_entropy", logits, target, process_group, normalizer)
    options = call.inplace_where_served(options)
    normalizer = call.normalizer(reduction, normalizer, ignore_index)
    loss = call.run(op, call.logits, call.target, reduction=reduction, normalizer=normalizer,
              ignore_index=ignore_index, process_group=call.vocab_group, **options)
    return call.per_row(loss) if reduction == "none" else call.reduced(loss)


def token_logprobs(op, logits, target, *, ignore_index=-100, process_group=None, **options):
    """``op`` (``ak.token_logprobs``) of DTensor logits (or a DTensor target)."""
    call = _logits_call("token_logprobs", logits, target, process_group)
    options = call.inplace_where_served(options)
    out = call.run(op, call.logits, call.target, ignore_index=ignore_index,
             process_group=call.vocab_group, **options)
    return call.per_row(out)


def linear_cross_entropy(op, hidden, weight, target, *, bias=None, reduction="mean",
                         normalizer=None, ignore_index=-100, process_group=None, **options):
    """``op`` (``ak.linear_cross_entropy``) of a DTensor head (hidden states, weight, bias or
    target)."""
    call = _head_call("linear_cross_entropy", hidden, weight, bias, target, process_group,
                      normalizer)
    normalizer = call.normalizer(reduction, normalizer, ignore_index)
    loss = call.run(op, call.hidden, call.weight, call.target, bias=call.bias,
                    reduction=reduction,
              normalizer=normalizer, ignore_index=ignore_index, process_group=call.vocab_group,
              **options)
    return call.per_row(loss) if reduction == "none" else call.reduced(loss)


def linear_token_logprobs(op, hidden, weight, target, *, bias=None, ignore_index=-100,
                          process_group=None, **options):
    """``op`` (``ak.linear_token_logprobs``) of a DTensor head (hidden states, weight, bias or
    target)."""
    call = _head_call("linear_token_logprobs", hidden, weight, bias, target, process_group)
    out = call.run(op, call.hidden, call.weight, call.target, bias=call.bias,
                   ignore_index=ignore_index,
             process_group=call.vocab_group, **options)
    return call.per_row(out)


def distill_loss(op, student_logits, teacher_logits, target=None, *, reduction="batchmean",
                 normalizer=None, ignore_index=-100, **options):
    """``op`` (``ak.distill_loss``) of DTensor logits: rows sharded (each rank's rows, the
    reduction's sum and count over the shards) or replicated. There is no vocabulary-parallel
    distillation: a vocabulary shard is refused, naming the row layout that would serve."""
    call, local = _rows_call("distill_loss", {"student_logits": student_logits,
                                              "teacher_logits": teacher_logits},
                             target, "target", normalizer)
    return _row_reduced(call, reduction, normalizer, _DISTILL_MEANS, lambda reduction: call.run(
        op, local["student_logits"], local["teacher_logits"], call.target, reduction=reduction,
        normalizer=None if normalizer is None else call.normalizer("sum", normalizer, None),
        ignore_index=ignore_index, **options), ignore_index, student_logits.shape[-1])


def topk_distill_loss(op, student_logits, support_ids, teacher_logprobs, labels=None, *,
                      support_mask=None, reduction="batchmean", **options):
    """``op`` (``ak.topk_distill_loss``) of DTensor logits: rows sharded or replicated, as
    :func:`distill_loss`; ``support_ids``, ``teacher_logprobs`` and ``support_mask``
    (``[..., K]``) follow the rows."""
    call, local = _rows_call("topk_distill_loss", {"student_logits": student_logits}, labels,
                             "labels", None, dict(support_ids=support_ids,
                                                  teacher_logprobs=teacher_logprobs,
                                                  support_mask=support_mask))
    support = {name: _per_row_columns(call, name, value) for name, value in (
        ("support_ids", support_ids), ("teacher_logprobs", teacher_logprobs),
        ("support_mask", support_mask))}
    return _row_reduced(call, reduction, None, _TOPK_MEANS, lambda reduction: call.run(
        op, local["student_logits"], support["support_ids"], support["teacher_logprobs"],
        call.target, support_mask=support["support_mask"], reduction=reduction, **options))


def linear_distill_loss(op, student_hidden, student_weight, teacher_hidden, teacher_weight,
                        target=None, *, student_bias=None, teacher_bias=None,
                        reduction="batchmean", normalizer=None, ignore_index=-100, **options):
    """``op`` (``ak.linear_distill_loss``) of DTensor heads: both heads' hidden states sharded
    on rows alike (or replicated), the weights and biases replicated (their gradients summed
    over the row shards); the reduction as :func:`distill_loss`'s."""
    head = dict(student_weight=student_weight, student_bias=student_bias,
                teacher_weight=teacher_weight, teacher_bias=teacher_bias)
    call, local = _rows_call("linear_distill_loss", {"student_hidden": student_hidden,
                                                     "teacher_hidden": teacher_hidden},
                             target, "target", normalizer, head)
    replicated = _replicated_head(call, head)
    return _row_reduced(call, reduction, normalizer, _DISTILL_MEANS, lambda reduction: call.run(
        op, local["student_hidden"], replicated["student_weight"], local["teacher_hidden"],
        replicated["teacher_weight"], call.target, student_bias=replicated["student_bias"],
        teacher_bias=replicated["teacher_bias"], reduction=reduction,
        normalizer=None if normalizer is None else call.normalizer("sum", normalizer, None),
        ignore_index=ignore_index, **options), ignore_index, student_weight.shape[0])


def linear_topk_distill_loss(op, hidden, weight, support_ids, teacher_logprobs, labels=None, *,
                             bias=None, support_mask=None, reduction="batchmean", **options):
    """``op`` (``ak.linear_topk_distill_loss``) of a DTensor head: hidden states sharded on rows
    (or replicated), the weight and bias replicated (gradients summed over the row shards),
    the ``[..., K]`` inputs following the rows; the reduction as :func:`topk_distill_loss`'s."""
    call, local = _rows_call("linear_topk_distill_loss", {"hidden": hidden}, labels, "labels",
                             None, dict(support_ids=support_ids,
                                        teacher_logprobs=teacher_logprobs,
                                        support_mask=support_mask, weight=weight, bias=bias))
    replicated = _replicated_head(call, dict(weight=weight, bias=bias))
    support = {name: _per_row_columns(call, name, value) for name, value in (
        ("support_ids", support_ids), ("teacher_logprobs", teacher_logprobs),
        ("support_mask", support_mask))}
    return _row_reduced(call, reduction, None, _TOPK_MEANS, lambda reduction: call.run(
        op, local["hidden"], replicated["weight"], support["support_ids"],
        support["teacher_logprobs"], call.target, bias=replicated["bias"],
        support_mask=support["support_mask"], reduction=reduction, **options))


def _replicated_head(call, named):
    """Head parameters beside row-sharded hidden states: each replicated (a plain tensor read
    so), as its local tensor whose gradient is summed over the row shards. A vocabulary shard
    (``ColwiseParallel``'s ``Shard(0)``) is refused: these ops have no vocabulary path."""
    from torch.distributed.tensor import Replicate

    local = {}
    for name, value in named.items():
        value = _as_dtensor(value, call.mesh)
        if not isinstance(value, torch.Tensor):
            local[name] = value  # None, or the op's own checks name what it is
            continue
        for mesh_dim, placement in enumerate(value.placements):
            if not placement.is_replicate():
                raise _unserved(call.op_name, name, value, mesh_dim, Replicate(),
                                f"served: Replicate; {call.op_name} has no "
                                f"vocabulary-parallel path")
        tensor = value.to_local()
        for group in call.row_groups:
            tensor = _sum_grad_over_group(tensor, group)
        local[name] = tensor
    return local


def _sum_grad_over_group(tensor, group):
    from .vocab_parallel import SumGradOverGroup

    return SumGradOverGroup.apply(tensor, group)


def on_full_tensors(op):
    """``op`` (a loss over per-sequence tensors ``[B]``: the preference losses) served on
    DTensor arguments: each is gathered whole (``full_tensor()``: B numbers, differentiable),
    every rank runs ``op`` as one process would, and its tensor results come back
    ``Replicate`` on the arguments' mesh; each gradient has its input's placements. (DTensor's
    own operators run these forwards but not all their backwards: ``log_sigmoid_backward`` has
    no sharding rule.)"""
    @functools.wraps(op)
    def served(*args, **kwargs):
        if not has_dtensor(*args, *kwargs.values()):
            return op(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        named = {f"argument {index}": value for index, value in enumerate(args)}
        mesh = _common_mesh(op.__name__, {**named, **kwargs}, None)

        def whole(value):
            return value.full_tensor() if isinstance(value, DTensor) else value

        args = [whole(value) for value in args]
        kwargs = {name: whole(value) for name, value in kwargs.items()}
        with agreement.over(op.__name__, _mesh_groups(mesh), _mesh_device(mesh)):
            out = op(*args, **kwargs)
        return _replicated_results(out, mesh)

    return served


def _replicated_results(out, mesh):
    from torch.distributed.tensor import DTensor

    if isinstance(out, tuple):
        return tuple(_replicated_results(part, mesh) for part in out)
    if isinstance(out, dict):
        return {name: _replicated_results(part, mesh) for name, part in out.items()}
    if isinstance(out, torch.Tensor):
        return DTensor.from_local(out, mesh, _replicated(mesh), run_check=False)
    return out


def _rows_call(op_name, logits_named, target, target_name, normalizer, others=None):
    """``_LocalCall`` of an op served on rows only (no vocabulary path): the first of
    ``logits_named`` sets the layout (Replicate or a row ``Shard`` per mesh dimension); the
    others must have it, or be replicated (a local slice); ``target`` (may be None) follows the
    rows; ``others``: the op's other arguments that may be DTensors (they share the mesh).
    Returns the call and the local logits by name."""
    from torch.distributed.tensor import Replicate, Shard

    named = {**logits_named, target_name: target, **(others or {})}
    mesh = _common_mesh(op_name, dict(named, normalizer=normalizer), None)
    (lead_name, lead), *rest = [(name, _as_dtensor(value, mesh))
                                for name, value in logits_named.items()]
    if not isinstance(lead, torch.Tensor):
        raise TypeError(f"{lead_name} must be a torch.Tensor, got {type(lead).__name__}")
    row_mesh_dims = []
    for mesh_dim, placement in enumerate(lead.placements):
        if placement.is_replicate():
            continue
        if not _is_row_shard(placement, lead.ndim):
            raise _unserved(op_name, lead_name, lead, mesh_dim,
                            Shard(0) if _is_shard(placement, lead.ndim - 1, lead.ndim)
                            else Replicate(),
                            f"served: Replicate, Shard(d) of a row dimension d < "
                            f"{lead.ndim - 1}; {op_name} has no vocabulary-parallel path")
        row_mesh_dims.append(mesh_dim)
    local = {lead_name: lead.to_local()}
    deferred = []
    for name, value in rest:  # the last dimension is the op's to check (V, or a hidden size)
        if not isinstance(value, torch.Tensor) or tuple(value.shape[:-1]) != tuple(
                lead.shape[:-1]):
            error = ValueError(f"{op_name}: {name} must have {lead_name}'s leading shape "
                               f"{tuple(lead.shape[:-1])}, got "
                               f"{tuple(getattr(value, 'shape', ()))}")
            if has_dtensor(logits_named[name]):
                raise error
            deferred.append(error)
            local[name] = None
            continue
        if tuple(value.placements) != tuple(lead.placements):
            if not all(placement.is_replicate() for placement in value.placements):
                raise ValueError(f"{op_name}: {name} has placements {tuple(value.placements)} "
                                 f"but {lead_name} {tuple(lead.placements)}; "
                                 f"{name}.redistribute({name}.device_mesh, "
                                 f"{list(lead.placements)}) would serve it")
            value = value.redistribute(mesh, lead.placements)  # replicated: a local slice
        local[name] = value.to_local()
    row_placements = _row_placements(lead.placements, row_mesh_dims, lead.ndim)
    rows_shape = tuple(lead.shape[:-1])
    if target is not None:
        target = _local_rows(op_name, target, mesh, row_placements, rows_shape, lead_name,
                             local[lead_name], deferred)
    return _LocalCall(op_name=op_name, mesh=mesh, vocab_group=None,
                      row_groups=tuple(mesh.get_group(d) for d in row_mesh_dims),
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=row_placements,
                      plain=_plain(named), deferred=deferred), local


def _per_row_columns(call, name, value):
    """A ``[..., K]`` per-row input laid out like the rows (its local tensor); None as is."""
    if value is None:
        return None
    plain = not has_dtensor(value)
    value = _as_dtensor(value, call.mesh)
    if not isinstance(value, torch.Tensor):
        return value  # the op's own checks name what it is
    if tuple(value.shape[:-1]) != tuple(call.rows_shape) or value.ndim != len(call.rows_shape) + 1:
        error = ValueError(f"{call.op_name}: {name} must have shape {tuple(call.rows_shape)} + "
                           f"(K,), got {tuple(value.shape)}")
        if not plain:
            raise error
        call.defer(error)
        return None  # this rank's error at the agreement is the one deferred
    return _in_row_layout(call.op_name, name, value, call.row_placements,
                          lambda placement: _is_row_shard(placement, value.ndim),
                          "Shard(d) of a row dimension").to_local()


def _row_count(call, ignore_index, every_row=False) -> torch.Tensor:
    """The rows a mean counts over the whole mesh: the targets not ``ignore_index`` summed over
    the row shards; without targets the first dimension (TRL's ``batchmean``: B), or every row
    with ``every_row``."""
    if call.target is None:
        rows = call.rows_shape.numel() if every_row else (
            call.rows_shape[0] if len(call.rows_shape) else 1)
        return torch.tensor(float(rows))
    count = (call.target != ignore_index).sum(dtype=torch.int64)
    return _summed(count, call.row_groups).to(torch.float32)


# the reductions that divide the rows' sum by a count: TRL's batchmean (the counted rows, B
# without targets) and, for distill_loss, mean (every counted element: the rows times V)
_DISTILL_MEANS = ("batchmean", "mean")
_TOPK_MEANS = ("batchmean",)


def _row_reduced(call, reduction, normalizer, means, run, ignore_index=-100, vocab=None):
    """A distillation loss over sharded rows: per row as the rows; a reduction among ``means``
    without ``normalizer``: this rank's sum over the global count; anything else as the op
    reduces (and checks) it. Reduced results are summed over the row shards into a Replicate
    result (TRL's means: a count of 0 gives 0, batchmean's is at least 1, so the clamp serves
    both)."""
    if reduction == "none":
        return call.per_row(run("none"))
    if reduction not in means or normalizer is not None or not call.row_groups:
        return call.reduced(run(reduction))
    total = run("sum")
    count = _row_count(call, ignore_index, every_row=reduction == "mean")
    if reduction == "mean":
        count = count * vocab
    # a count of 0 has a sum of 0: the loss is 0 (never 0 / 0)
    return call.reduced(total / count.to(total.device).clamp(min=1.0))


# grpo_loss's token means: on a shard of whole sequences (Shard(0) of [B, T, V]) the full
# batch's loss is a sum over its tokens divided by their global count (all-reduced as
# ``normalizer``; bnpo's count of unmasked tokens is dapo's normalizer). The other loss types
# (grpo, sapo, dr_grpo, luspo) sum over sequences divided by B: scaled by B_local / B.
_TOKEN_MEAN_WEIGHTS = ("token_mean", "global_count")  # LossType.token_weight
_GRPO_PER_ROW = ("mask", "old_logprobs", "ref_logprobs", "importance_weights",
                 "sampling_logprobs")


def grpo_loss(op, logits, target, advantages, *, options, mask=None, old_logprobs=None,
              ref_logprobs=None, normalizer=None, importance_weights=None,
              sampling_logprobs=None, return_token_values=False, backend="auto",
              process_group=None, check_consistency=True, **keywords):
    """``op`` (``ak.grpo_loss``) of DTensor logits (or any DTensor argument); ``options`` the
    call's resolved ``GRPOOptions`` (the scalar ``keywords`` are folded in it). Rows are served
    as whole sequences (``Shard(0)`` of ``[B, T, V]``); the loss is the full batch's, and the
    metrics (masked means over the unmasked tokens) are the full batch's too: each rank's mean
    weighed by its count of unmasked tokens, summed over the row shards."""
    per_row = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                   importance_weights=importance_weights, sampling_logprobs=sampling_logprobs)
    call = _logits_call("grpo_loss", logits, target, process_group, normalizer,
                        others=dict(advantages=advantages, **per_row), whole_sequences=True)
    return _grpo(call, (call.logits,), {}, op, advantages, options, normalizer, per_row,
                 dict(return_token_values=return_token_values, backend=backend,
                      check_consistency=check_consistency))


def linear_grpo_loss(op, hidden, weight, target, advantages, *, options, bias=None, mask=None,
                     old_logprobs=None, ref_logprobs=None, normalizer=None,
                     importance_weights=None, sampling_logprobs=None, softcap=None,
                     logit_scale=1.0, return_token_values=False, chunk_size=None,
                     backend="auto", process_group=None, check_consistency=True, **keywords):
    """``op`` (``ak.linear_grpo_loss``) of a DTensor head (or any DTensor argument): the
    placements of ``_head_call``, rows as whole sequences, the rest as :func:`grpo_loss`."""
    per_row = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                   importance_weights=importance_weights, sampling_logprobs=sampling_logprobs)
    call = _head_call("linear_grpo_loss", hidden, weight, bias, target, process_group,
                      normalizer, others=dict(advantages=advantages, **per_row),
                      whole_sequences=True)
    return _grpo(call, (call.hidden, call.weight), dict(bias=call.bias, softcap=softcap,
                                                       logit_scale=logit_scale,
                                                       chunk_size=chunk_size),
                 op, advantages, options, normalizer, per_row,
                 dict(return_token_values=return_token_values, backend=backend,
                      check_consistency=check_consistency))


def _grpo(call, head, head_keywords, op, advantages, options, normalizer, per_row, keywords):
    """The GRPO family on ``call``'s local tensors: ``op(*head, target, advantages, ...)``."""
    advantages = _per_row_input(call.op_name, "advantages", advantages, call)
    per_row = {name: _per_row_input(call.op_name, name, value, call)
               for name, value in per_row.items()}
    valid = (torch.ones(call.target.shape, dtype=torch.bool, device=call.target.device)
             if per_row["mask"] is None else per_row["mask"] != 0)
    scale = None
    if has_dtensor(normalizer):
        normalizer = call.normalizer("sum", normalizer, -100)
    if call.row_groups:
        _check_row_local_options(call.op_name, options)
        if options.record.token_weight not in _TOKEN_MEAN_WEIGHTS:
            scale = call.target.shape[0] / max(call.rows_shape[0], 1)
        elif normalizer is None:  # bnpo's count is dapo's normalizer: the same weights
            if options.loss_type == "bnpo":
                options = _replace(options, loss_type="dapo")
            normalizer = _summed(valid.sum(dtype=torch.int64), call.row_groups).float()
    loss, metrics, *values = call.run(op, *head, call.target, advantages, options=options,
                                      normalizer=normalizer, process_group=call.vocab_group,
                                      **head_keywords, **keywords, **per_row)
    if scale is not None:
        loss = loss * scale
    if call.row_groups:
        count = valid.sum(dtype=torch.int64).float()
        total = _summed(count, call.row_groups).clamp(min=1.0)
        metrics = {name: _summed(value * count, call.row_groups) / total
                   for name, value in metrics.items()}
    from torch.distributed.tensor import DTensor

    metrics = {name: DTensor.from_local(value, call.mesh, _replicated(call.mesh),
                                        run_check=False) for name, value in metrics.items()}
    return (call.reduced(loss), metrics, *(call.per_row(value) for value in values))


def sequence_logprobs(op, token_logprobs, reduce_sequence, logits, target, mask, *,
                      average=False, temperature=1.0, backend="auto", sampling=None):
    """``op`` (``ak.sequence_logprobs``) of DTensor logits (or target or mask): on whole
    sequences (``Shard(0)``) the op on the local rows; on a vocabulary shard the masked sum (or
    mean, ``reduce_sequence``) of ``token_logprobs``' ``process_group=`` path. Results ``[B]``,
    sharded as the rows. The logprobs module hands in its functions (it imports this one)."""
    call = _logits_call("sequence_logprobs", logits, target, None, others=dict(mask=mask),
                        whole_sequences=True)
    return _sequence(call, (call.logits,), {}, op, token_logprobs, reduce_sequence, mask,
                     dict(average=average, temperature=temperature, backend=backend,
                          sampling=sampling))


def linear_sequence_logprobs(op, token_logprobs, reduce_sequence, hidden, weight, target, mask,
                             *, bias=None, average=False, temperature=1.0, softcap=None,
                             logit_scale=1.0, chunk_size=None, backend="auto", sampling=None):
    """``op`` (``ak.linear_sequence_logprobs``) of a DTensor head: as :func:`sequence_logprobs`
    on ``_head_call``'s placements (``token_logprobs``: ``linear_token_logprobs``)."""
    call = _head_call("linear_sequence_logprobs", hidden, weight, bias, target, None,
                      others=dict(mask=mask), whole_sequences=True)
    return _sequence(call, (call.hidden, call.weight),
                     dict(bias=call.bias, softcap=softcap, logit_scale=logit_scale,
                          chunk_size=chunk_size), op, token_logprobs, reduce_sequence, mask,
                     dict(average=average, temperature=temperature, backend=backend,
                          sampling=sampling))


def _sequence(call, head, head_keywords, op, token_logprobs, reduce_sequence, mask, keywords):
    from torch.distributed.tensor import DTensor

    mask = _per_row_input(call.op_name, "mask", mask, call, full_shape=True)
    if call.vocab_group is None:
        out = call.run(op, *head, call.target, mask, **head_keywords, **keywords)
    else:
        if not isinstance(mask, torch.Tensor) or mask.shape != call.target.shape:
            call.defer(ValueError(f"mask must be a tensor of target's shape "
                                  f"{tuple(call.rows_shape)}"))
            mask = torch.zeros_like(call.target, dtype=torch.bool)
        average = keywords.pop("average")
        masked_target = torch.where(mask.bool(), call.target,
                                    torch.full_like(call.target, -100))
        logp = call.run(token_logprobs, *head, masked_target, ignore_index=-100,
                        process_group=call.vocab_group, **head_keywords, **keywords)
        out = reduce_sequence(logp, mask, average)
    per_row = DTensor.from_local(out, call.mesh, call.row_placements, run_check=False,
                                 shape=call.rows_shape[:1], stride=_contiguous(call.rows_shape[:1]))
    if call.result_placements != call.row_placements:  # sequence parallel: back to Shard(0)
        per_row = per_row.redistribute(call.mesh, call.result_placements)
    return per_row


def _check_row_local_options(op_name, options):
    """Refuse the GRPO options that read across sequences (row shards cannot make them exact)."""
    refused = []
    if options.rollout_is is not None or options.rollout_rs is not None:
        refused.append("rollout_is/rollout_rs (the rollout correction's batch statistics and "
                       "metrics)")
    if options.top_entropy_quantile < 1.0:
        refused.append("top_entropy_quantile < 1 (a quantile over the whole batch)")
    if (options.entropy_coef != 0.0
            and options.record.token_weight not in _TOKEN_MEAN_WEIGHTS):
        refused.append(f"entropy_coef != 0 with loss_type={options.loss_type!r} (the bonus is "
                       f"a mean over the batch's tokens, the loss a mean over sequences)")
    if refused:
        rows = "logits" if op_name == "grpo_loss" else "hidden"
        raise ValueError(f"{op_name}: {rows} sharded over rows (Shard(0)) do not serve "
                         f"{'; '.join(refused)}: redistribute the {rows} to Replicate()"
                         f"{' or Shard(-1) (the vocabulary)' if rows == 'logits' else ''}")


def _replace(options, **changes):
    import dataclasses

    return dataclasses.replace(options, **changes)


def _summed(value, groups):
    total = value.clone()
    for group in groups:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _per_row_input(op_name, name, value, call, full_shape=False):
    """A per-row input (``[B]`` or ``[B, T]``; ``full_shape``: ``[B, T]`` only): a plain tensor
    (the full batch) sliced to this rank's rows, a DTensor redistributed to the rows' layout
    (its local tensor either way); None as is."""
    if value is None:
        return None
    plain = not has_dtensor(value)
    value = _as_dtensor(value, call.mesh)
    shape = tuple(call.rows_shape)
    if not isinstance(value, torch.Tensor):
        error = TypeError(f"{op_name}: {name} must be a torch.Tensor, got "
                          f"{type(value).__name__}")
    elif tuple(value.shape) not in ((shape,) if full_shape else (shape, shape[:1])):
        wanted = f"{shape}" if full_shape else f"{shape} or {shape[:1]}"
        error = ValueError(f"{op_name}: {name} must have shape {wanted}, got "
                           f"{tuple(value.shape)}")
    else:
        return _in_row_layout(op_name, name, value, call.row_placements).to_local()
    if not plain:
        raise error
    call.defer(error)
    # a stand-in: this rank's error at the agreement is the one deferred
    return torch.zeros(call.target.shape, device=call.target.device)


class _SumOverGroups(torch.autograd.Function):
    """The sum of each rank's value over ``groups``, on every rank. The upstream gradient is
    replicated over them (a Replicate result's), and each rank's value enters the sum once, so
    the backward passes it through unchanged."""

    @staticmethod
    def forward(ctx, value, groups):
        total = value.clone()
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass(frozen=True)
class _LocalCall:
    """One op call on this rank's local tensors, and how its results become DTensors.

    ``row_groups``: the groups of the mesh dimensions whose rows stay sharded (counts and reduced
    results are summed over them). ``row_placements``: the local per-row results' placements (the
    local target's); ``result_placements``: the per-row results' placements as returned."""

    op_name: str
    mesh: Any
    vocab_group: Optional[dist.ProcessGroup]
    row_groups: Tuple[dist.ProcessGroup, ...]
    target: torch.Tensor
    rows_shape: torch.Size
    row_placements: Tuple[Any, ...]
    result_placements: Tuple[Any, ...]
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    #: the arguments given as plain tensors, read as replicated over the mesh
    plain: Tuple[str, ...] = ()
    #: checks of this rank's plain tensors that failed, kept for the ranks' agreement
    deferred: list = field(default_factory=list)

    def defer(self, error: Exception):
        self.deferred.append(error)

    def run(self, op, *args, **kwargs):
        """``op(*args, **kwargs)`` on the local tensors, inside the ranks' agreement over the
        mesh (``ops/agreement.py``): a vocabulary path settles it at its checks, a row path
        when ``op`` returns or raises. A check of the route's own that failed on this rank (a
        plain tensor that does not fit, a stand-in in its place) is this rank's error there;
        ``op`` still runs, so this rank makes the same collectives as its peers up to it.

        When plain tensors were read as replicated beside a vocabulary shard and the ranks find
        their rows differ, the error names the likely cause: FSDP2's sharded parameters outside
        the module's forward."""
        deferred = self.deferred[0] if self.deferred else None
        try:
            with agreement.over(self.op_name, _mesh_groups(self.mesh), _mesh_device(self.mesh),
                                deferred):
                return op(*args, **kwargs)
        except agreement.RanksDisagree as error:
            if (isinstance(error, agreement.RankRefused) or self.vocab_group is None
                    or not self.plain):
                raise
            raise agreement.RanksDisagree(
                f"{self.op_name}: {', '.join(self.plain)} "
                f"{'is a plain tensor' if len(self.plain) == 1 else 'are plain tensors'}, "
                f"read as replicated over the mesh beside a vocabulary-sharded DTensor "
                f"(Shard(0) of the weight, as ColwiseParallel makes it), yet the ranks' rows "
                f"differ ({error}). This is what a weight sharded by FSDP2's fully_shard "
                f"looks like outside the module's forward, where each rank holds its own "
                f"batch: call the loss inside the module's forward (where FSDP2 has gathered "
                f"the weight), or call module.unshard() first; for tensor parallelism pass "
                f"the same rows on every rank of the vocabulary group") from None

    def normalizer(self, reduction, normalizer, ignore_index):
        """The caller's normalizer (its local value when a Replicate DTensor); for ``mean`` over
        sharded rows without one, the count of counted targets summed over the shards."""
        if has_dtensor(normalizer):
            replicated = list(_replicated(normalizer.device_mesh))
            if list(normalizer.placements) != replicated:
                raise ValueError(f"normalizer is a DTensor with placements "
                                 f"{tuple(normalizer.placements)}: a normalizer is one global "
                                 f"count, so it must be replicated; call normalizer.redistribute("
                                 f"normalizer.device_mesh, {replicated}) or pass a number")
            return normalizer.to_local()
        if normalizer is not None or reduction != "mean" or not self.row_groups:
            return normalizer
        count = (self.target != check_index(ignore_index, "ignore_index")).sum(dtype=torch.int64)
        for group in self.row_groups:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        return count.to(torch.float32)

    def inplace_where_served(self, options):
        """``options`` with ``inplace_backward`` off outside the vocabulary path: there the op
        would write over ``to_local()``'s view in its forward, which autograd forbids, so the
        gradient takes a new buffer (as the op does where it cannot write in place)."""
        if self.vocab_group is None and options.get("inplace_backward"):
            return dict(options, inplace_backward=False)
        return options

    def reduced(self, value):
        """A reduced result (this rank's rows' part) as a Replicate DTensor of the total."""
        from torch.distributed.tensor import DTensor

        if self.row_groups:
            value = _SumOverGroups.apply(value, self.row_groups)
        return DTensor.from_local(value, self.mesh, _replicated(self.mesh), run_check=False)

    def per_row(self, out):
        """Per-row results (a tensor, or a tuple of tensors and dicts of them) as DTensors."""
        if isinstance(out, tuple):
            return tuple(self.per_row(part) for part in out)
        if isinstance(out, dict):
            return {name: self.per_row(part) for name, part in out.items()}
        from torch.distributed.tensor import DTensor

        result = DTensor.from_local(out, self.mesh, self.row_placements, run_check=False,
                                    shape=self.rows_shape, stride=_contiguous(self.rows_shape))
        if self.result_placements != self.row_placements:
            result = result.redistribute(self.mesh, self.result_placements)
        return result


def _logits_call(op_name, logits, target, process_group, normalizer=None, others=None,
                 whole_sequences=False) -> _LocalCall:
    """``others``: more arguments that may be DTensors (on the same mesh); ``whole_sequences``:
    rows are served only as whole sequences (``Shard(0)`` of ``[B, T, V]``)."""
    from torch.distributed.tensor import Replicate, Shard

    named = {"logits": logits, "target": target, **(others or {})}
    mesh = _common_mesh(op_name, dict(named, normalizer=normalizer), process_group)
    logits = _as_dtensor(logits, mesh)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    vocab_dim = logits.ndim - 1
    served = (f"served: Replicate, Shard({vocab_dim}) (the vocabulary, on one mesh dimension), "
              f"Shard(d) of a row dimension d < {vocab_dim}")
    vocab_mesh_dim, row_mesh_dims = None, []
    for mesh_dim, placement in enumerate(logits.placements):
        if placement.is_replicate():
            continue
        if whole_sequences and _is_row_shard(placement, logits.ndim) and (
                placement.dim % logits.ndim != 0):
            raise _unserved(op_name, "logits", logits, mesh_dim, Shard(0),
                            f"served: Replicate, Shard({vocab_dim}) (the vocabulary, on one mesh "
                            f"dimension), Shard(0) (whole sequences)")
        if _is_row_shard(placement, logits.ndim):
            row_mesh_dims.append(mesh_dim)
        elif _is_shard(placement, vocab_dim, logits.ndim) and vocab_mesh_dim is None:
            vocab_mesh_dim = mesh_dim
        elif _is_shard(placement, vocab_dim, logits.ndim):  # the vocabulary's second split
            raise _unserved(op_name, "logits", logits, mesh_dim, Replicate(), served)
        elif _is_strided(placement):
            raise _unserved(op_name, "logits", logits, mesh_dim, Shard(placement.dim), served)
        else:  # Partial: a reduce-scatter onto vocabulary shards, not an all-reduce of [N, V]
            raise _unserved(op_name, "logits", logits, mesh_dim, Shard(vocab_dim), served)
    row_placements = _row_placements(logits.placements, row_mesh_dims, logits.ndim)
    rows_shape = tuple(logits.shape[:-1])
    local_logits, deferred = logits.to_local(), []
    target = _local_rows(op_name, target, mesh, row_placements, rows_shape, "logits",
                         local_logits, deferred)
    return _LocalCall(op_name=op_name, mesh=mesh, vocab_group=_group(mesh, vocab_mesh_dim),
                      row_groups=tuple(mesh.get_group(d) for d in row_mesh_dims),
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=row_placements,
                      logits=local_logits, plain=_plain(named), deferred=deferred)


def _head_call(op_name, hidden, weight, bias, target, process_group, normalizer=None,
               others=None, whole_sequences=False) -> _LocalCall:
    """As :func:`_logits_call`, for the fused head's hidden states, weight and bias."""
    from torch.distributed.tensor import Replicate, Shard

    from .vocab_parallel import SumGradOverGroup

    named = {"hidden": hidden, "weight": weight, "bias": bias, "target": target,
             **(others or {})}
    mesh = _common_mesh(op_name, dict(named, normalizer=normalizer), process_group)
    hidden, weight = _as_dtensor(hidden, mesh), _as_dtensor(weight, mesh)
    for name, value in (("hidden", hidden), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    deferred = []
    if weight.ndim != 2:
        error = ValueError(f"weight must have shape [V, H], got {tuple(weight.shape)}")
        if has_dtensor(named["weight"]):
            raise error
        deferred.append(error)
    row_mesh_dims, gathered_mesh_dims, vocab_mesh_dim = [], [], None
    for mesh_dim, (hidden_placement, weight_placement) in enumerate(
            zip(hidden.placements, weight.placements)):
        if _is_shard(weight_placement, 0, 2) and vocab_mesh_dim is None:
            vocab_mesh_dim = mesh_dim
        elif not weight_placement.is_replicate():
            instead = Replicate() if _is_shard(weight_placement, 0, 2) else Shard(0)
            raise _unserved(op_name, "weight", weight, mesh_dim, instead,
                            "served: Replicate, Shard(0) (the vocabulary, as ColwiseParallel "
                            "makes it, on one mesh dimension)")
        if hidden_placement.is_replicate():
            continue
        if whole_sequences and _is_row_shard(hidden_placement, hidden.ndim) and (
                hidden_placement.dim % hidden.ndim != 0):
            raise _unserved(op_name, "hidden", hidden, mesh_dim, Shard(0),
                            "served: Replicate, Shard(0) (whole sequences)")
        if not _is_row_shard(hidden_placement, hidden.ndim):
            instead = (Shard(hidden_placement.dim) if _is_strided(hidden_placement)
                       else Replicate())
            raise _unserved(op_name, "hidden", hidden, mesh_dim, instead,
                            f"served: Replicate, Shard(d) of a row dimension d < "
                            f"{hidden.ndim - 1}")
        if vocab_mesh_dim == mesh_dim:
            gathered_mesh_dims.append(mesh_dim)
        else:
            row_mesh_dims.append(mesh_dim)
    result_placements = _row_placements(hidden.placements, row_mesh_dims + gathered_mesh_dims,
                                        hidden.ndim)
    row_placements = _row_placements(hidden.placements, row_mesh_dims, hidden.ndim)
    rows_shape = tuple(hidden.shape[:-1])
    if gathered_mesh_dims:  # sequence parallel: every rank of the vocabulary group gets all rows
        hidden = hidden.redistribute(mesh, _with_replicated(hidden.placements,
                                                            gathered_mesh_dims))
    target = _local_rows(op_name, target, mesh, row_placements, rows_shape, "hidden",
                         hidden.to_local(), deferred)
    row_groups = tuple(mesh.get_group(d) for d in row_mesh_dims)
    weight_local = weight.to_local()
    bias_local = None
    if bias is not None:
        bias_local = _bias_like(op_name, _as_dtensor(bias, mesh), weight).to_local()
    for group in row_groups:  # a weight replicated over sharded rows: its gradient sums them
        weight_local = SumGradOverGroup.apply(weight_local, group)
        if bias_local is not None:
            bias_local = SumGradOverGroup.apply(bias_local, group)
    return _LocalCall(op_name=op_name, mesh=mesh, vocab_group=_group(mesh, vocab_mesh_dim),
                      row_groups=row_groups,
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=result_placements,
                      hidden=hidden.to_local(), weight=weight_local, bias=bias_local,
                      plain=_plain(named), deferred=deferred)


def _common_mesh(op_name, named: Dict[str, Any], process_group):
    """The device mesh every DTensor argument shares."""
    from torch.distributed.tensor import DTensor

    meshes = {name: value.device_mesh for name, value in named.items()
              if isinstance(value, DTensor)}
    if process_group is not None:
        raise ValueError(f"{op_name}: process_group must be None with DTensor arguments (the "
                         f"vocabulary group is the mesh dimension the vocabulary is sharded on)")
    (first_name, mesh), *others = meshes.items()
    for name, other in others:
        if other != mesh:
            raise ValueError(f"{op_name}: {name} is on {other} but {first_name} on {mesh}: "
                             f"every DTensor argument must be on one device mesh")
    return mesh


def _plain(named: Dict[str, Any]) -> Tuple[str, ...]:
    """The names of the plain tensors (not DTensors) among ``named``."""
    from torch.distributed.tensor import DTensor

    return tuple(name for name, value in named.items()
                 if isinstance(value, torch.Tensor) and not isinstance(value, DTensor))


def _as_dtensor(value, mesh):
    """``value`` as a DTensor: a plain tensor is the same tensor replicated over ``mesh``."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value
    if not isinstance(value, torch.Tensor):
        return value  # the op's own checks name what it is
    return DTensor.from_local(value, mesh, _replicated(mesh), run_check=False)


def _local_rows(op_name, target, mesh, row_placements, rows_shape, rows_name, local_rows,
                deferred):
    """This rank's part of ``target`` laid out like the rows (a slice of a replicated target,
    or an all-gather of a sharded one: integers, never logits). A plain target that does not
    fit (this rank's own) appends its error to ``deferred`` and gives zeros of the rows of
    ``local_rows`` (this rank's rows, ``[..., V or H]``) in its stead."""
    plain = not has_dtensor(target)
    target = _as_dtensor(target, mesh)
    if not isinstance(target, torch.Tensor):
        error = TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    elif tuple(target.shape) != rows_shape:
        error = ValueError(f"{op_name}: target must have the shape of the leading dimensions "
                           f"of {rows_name}, {rows_shape}, got {tuple(target.shape)}")
    else:
        return _in_row_layout(op_name, "target", target, row_placements).to_local()
    if not plain:
        raise error
    deferred.append(error)
    return torch.zeros(local_rows.shape[:-1], dtype=torch.int64, device=local_rows.device)


def _in_row_layout(op_name, name, value, row_placements, is_served_shard=None,
                   served_shard="Shard(d)"):
    """The per-row DTensor ``value`` redistributed to ``row_placements`` (a slice of a
    replicated one, an all-gather of a small sharded one); a placement other than Replicate or
    a served shard (``is_served_shard``, any shard by default) is refused by name."""
    is_served_shard = is_served_shard or _is_shard_like
    for mesh_dim, placement in enumerate(value.placements):
        if not (placement.is_replicate() or is_served_shard(placement)):
            raise _unserved(op_name, name, value, mesh_dim, row_placements[mesh_dim],
                            f"served: Replicate, {served_shard} (redistributed to the rows')")
    if tuple(value.placements) != tuple(row_placements):
        value = value.redistribute(value.device_mesh, row_placements)
    return value


def _bias_like(op_name, bias, weight):
    """``bias`` laid out like the weight's rows (a slice, or an all-gather of ``[V]``)."""
    for mesh_dim, placement in enumerate(bias.placements):
        if not (placement.is_replicate() or _is_shard(placement, 0, 1)):
            raise _unserved(op_name, "bias", bias, mesh_dim, weight.placements[mesh_dim],
                            "served: Replicate, Shard(0)")
    if tuple(bias.placements) != tuple(weight.placements):
        bias = bias.redistribute(bias.device_mesh, weight.placements)
    return bias


def _row_placements(placements, row_mesh_dims, ndim) -> Tuple[Any, ...]:
    """The placements of per-row tensors (of the leading dimensions of a tensor of ``ndim``
    dimensions): its row shards on ``row_mesh_dims``, Replicate elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Shard(placement.dim % ndim) if mesh_dim in row_mesh_dims else Replicate()
                 for mesh_dim, placement in enumerate(placements))


def _with_replicated(placements, mesh_dims) -> Tuple[Any, ...]:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if mesh_dim in mesh_dims else placement
                 for mesh_dim, placement in enumerate(placements))


def _mesh_groups(mesh) -> Tuple[dist.ProcessGroup, ...]:
    """The groups of every mesh dimension: together they reach every rank of the mesh."""
    return tuple(mesh.get_group(mesh_dim) for mesh_dim in range(mesh.ndim))


def _mesh_device(mesh) -> torch.device:
    """The device the mesh's collectives take tensors on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


def _replicated(mesh) -> Tuple[Any, ...]:
    from torch.distributed.tensor import Replicate

    return (Replicate(),) * mesh.ndim


def _group(mesh, mesh_dim):
    return None if mesh_dim is None else mesh.get_group(mesh_dim)


def _is_shard_like(placement) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or _is_strided(placement)


def _is_strided(placement) -> bool:
    # _StridedShard is a Shard subclass in some torch versions, a sibling in others
    return type(placement).__name__ == "_StridedShard"


def _is_shard(placement, dim, ndim) -> bool:
    """A plain ``Shard`` of tensor dimension ``dim`` (contiguous chunks in rank order)."""
    from torch.distributed.tensor import Shard

    return type(placement) is Shard and placement.dim % ndim == dim


def _is_row_shard(placement, ndim) -> bool:
    return any(_is_shard(placement, dim, ndim) for dim in range(ndim - 1))


def _contiguous(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _unserved(op_name, name, tensor, mesh_dim, instead, served) -> ValueError:
    placements = tuple(tensor.placements)
    wanted = list(placements)
    wanted[mesh_dim] = instead
    return ValueError(f"{op_name}: {name} is a DTensor with placements {placements}, and "
                      f"{placements[mesh_dim]!r} on mesh dimension {mesh_dim} is not served "
                      f"({served}); {name}.redistribute({name}.device_mesh, {wanted}) would "
                      f"serve it (an [N, V] tensor is never gathered implicitly)")
