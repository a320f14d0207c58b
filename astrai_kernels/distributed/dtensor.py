"""DTensor front door, per op family: a DTensor argument stands for its ``full_tensor()``,
served without it.

Each public op served here (``cross_entropy``, ``token_logprobs``, ``linear_cross_entropy``,
``linear_token_logprobs``, ``grpo_loss``, ``linear_grpo_loss``, ``sequence_logprobs``,
``linear_sequence_logprobs``, ``distill_loss``, ``topk_distill_loss`` and their ``linear_``
forms) is routed by its front door (``ops/door.py``): on a DTensor it hands itself and every
argument to its namesake below, which reads the placements (``distributed/placements.py``) and
calls it back on this rank's local tensors (so this module imports no op module;
``sequence_logprobs``' vocabulary path is handed ``token_logprobs`` by its caller; DESIGN.md,
"Distributed"; docs/distributed.md, "DTensor"). What each family adds to the placements' paths:

* ``cross_entropy`` and ``token_logprobs`` (and their ``linear_`` forms): on row shards ``mean``
  divides by the count of counted targets summed over the row shards (``normalizer=``), reduced
  results are summed into a Replicate result.
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
* the preference losses (``on_full_tensors``): per-sequence ``[B]`` inputs gathered whole.

Bad input on one rank raises on every rank (``distributed/agreement.py``): the local op runs
inside the ranks' agreement over the whole mesh (``LocalCall.run``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import agreement
from .agreement import summed
from .placements import (
    common_mesh,
    contiguous_strides,
    has_dtensor,
    head_call,
    logits_call,
    mesh_device,
    mesh_groups,
    per_row_columns,
    per_row_input,
    replicated,
    replicated_head,
    replicated_results,
    rows_call,
)


def cross_entropy(op, logits, target, *, reduction="mean", normalizer=None, ignore_index=-100,
                  process_group=None, **options):
    """``op`` (``ak.cross_entropy``) of DTensor logits (or a DTensor target)."""
    call = logits_call("cross_entropy", logits, target, process_group, normalizer)
    options = call.inplace_where_served(options)
    normalizer = call.normalizer(reduction, normalizer, ignore_index)
    loss = call.run(op, call.logits, call.target, reduction=reduction, normalizer=normalizer,
              ignore_index=ignore_index, process_group=call.vocab_group, **options)
    return call.per_row(loss) if reduction == "none" else call.reduced(loss)


def token_logprobs(op, logits, target, *, ignore_index=-100, process_group=None, **options):
    """``op`` (``ak.token_logprobs``) of DTensor logits (or a DTensor target)."""
    call = logits_call("token_logprobs", logits, target, process_group)
    options = call.inplace_where_served(options)
    out = call.run(op, call.logits, call.target, ignore_index=ignore_index,
             process_group=call.vocab_group, **options)
    return call.per_row(out)


def linear_cross_entropy(op, hidden, weight, target, *, bias=None, reduction="mean",
                         normalizer=None, ignore_index=-100, process_group=None, **options):
    """``op`` (``ak.linear_cross_entropy``) of a DTensor head (hidden states, weight, bias or
    target)."""
    call = head_call("linear_cross_entropy", hidden, weight, bias, target, process_group,
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
    call = head_call("linear_token_logprobs", hidden, weight, bias, target, process_group)
    out = call.run(op, call.hidden, call.weight, call.target, bias=call.bias,
                   ignore_index=ignore_index,
             process_group=call.vocab_group, **options)
    return call.per_row(out)


def distill_loss(op, student_logits, teacher_logits, target=None, *, reduction="batchmean",
                 normalizer=None, ignore_index=-100, **options):
    """``op`` (``ak.distill_loss``) of DTensor logits: rows sharded (each rank's rows, the
    reduction's sum and count over the shards) or replicated. There is no vocabulary-parallel
    distillation: a vocabulary shard is refused, naming the row layout that would serve."""
    call, local = rows_call("distill_loss", {"student_logits": student_logits,
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
    call, local = rows_call("topk_distill_loss", {"student_logits": student_logits}, labels,
                             "labels", None, dict(support_ids=support_ids,
                                                  teacher_logprobs=teacher_logprobs,
                                                  support_mask=support_mask))
    support = {name: per_row_columns(call, name, value) for name, value in (
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
    call, local = rows_call("linear_distill_loss", {"student_hidden": student_hidden,
                                                     "teacher_hidden": teacher_hidden},
                             target, "target", normalizer, head)
    replicated = replicated_head(call, head)
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
    call, local = rows_call("linear_topk_distill_loss", {"hidden": hidden}, labels, "labels",
                             None, dict(support_ids=support_ids,
                                        teacher_logprobs=teacher_logprobs,
                                        support_mask=support_mask, weight=weight, bias=bias))
    replicated = replicated_head(call, dict(weight=weight, bias=bias))
    support = {name: per_row_columns(call, name, value) for name, value in (
        ("support_ids", support_ids), ("teacher_logprobs", teacher_logprobs),
        ("support_mask", support_mask))}
    return _row_reduced(call, reduction, None, _TOPK_MEANS, lambda reduction: call.run(
        op, local["hidden"], replicated["weight"], support["support_ids"],
        support["teacher_logprobs"], call.target, bias=replicated["bias"],
        support_mask=support["support_mask"], reduction=reduction, **options))


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
        mesh = common_mesh(op.__name__, {**named, **kwargs}, None)

        def whole(value):
            return value.full_tensor() if isinstance(value, DTensor) else value

        args = [whole(value) for value in args]
        kwargs = {name: whole(value) for name, value in kwargs.items()}
        with agreement.over(op.__name__, mesh_groups(mesh), mesh_device(mesh)):
            out = op(*args, **kwargs)
        return replicated_results(out, mesh)

    return served


def _row_count(call, ignore_index, every_row=False) -> torch.Tensor:
    """The rows a mean counts over the whole mesh: the targets not ``ignore_index`` summed over
    the row shards; without targets the first dimension (TRL's ``batchmean``: B), or every row
    with ``every_row``."""
    if call.target is None:
        rows = call.rows_shape.numel() if every_row else (
            call.rows_shape[0] if len(call.rows_shape) else 1)
        return torch.tensor(float(rows))
    count = (call.target != ignore_index).sum(dtype=torch.int64)
    return summed(count, call.row_groups).to(torch.float32)


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


# grpo_loss's token means (LossType.mean_over_tokens): on a shard of whole sequences (Shard(0)
# of [B, T, V]) the full batch's loss is a sum over its tokens divided by their global count
# (all-reduced as ``normalizer``; a batch's token mean is its loss type's global-count form over
# that count). The other loss types sum over sequences divided by B: scaled by B_local / B.
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
    call = logits_call("grpo_loss", logits, target, process_group, normalizer,
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
    placements of ``head_call``, rows as whole sequences, the rest as :func:`grpo_loss`."""
    per_row = dict(mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                   importance_weights=importance_weights, sampling_logprobs=sampling_logprobs)
    call = head_call("linear_grpo_loss", hidden, weight, bias, target, process_group,
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
    advantages = per_row_input(call.op_name, "advantages", advantages, call)
    per_row = {name: per_row_input(call.op_name, name, value, call)
               for name, value in per_row.items()}
    valid = (torch.ones(call.target.shape, dtype=torch.bool, device=call.target.device)
             if per_row["mask"] is None else per_row["mask"] != 0)
    scale = None
    if has_dtensor(normalizer):
        normalizer = call.normalizer("sum", normalizer, -100)
    if call.row_groups:
        _check_row_local_options(call.op_name, options)
        if not options.record.mean_over_tokens:
            scale = call.target.shape[0] / max(call.rows_shape[0], 1)
        elif normalizer is None:  # the batch's count as the normalizer: the same weights
            options = _replace(options, loss_type=options.record.global_count_form.name)
            normalizer = summed(valid.sum(dtype=torch.int64), call.row_groups).float()
    loss, metrics, *values = call.run(op, *head, call.target, advantages, options=options,
                                      normalizer=normalizer, process_group=call.vocab_group,
                                      **head_keywords, **keywords, **per_row)
    if scale is not None:
        loss = loss * scale
    if call.row_groups:
        count = valid.sum(dtype=torch.int64).float()
        total = summed(count, call.row_groups).clamp(min=1.0)
        metrics = {name: summed(value * count, call.row_groups) / total
                   for name, value in metrics.items()}
    from torch.distributed.tensor import DTensor

    metrics = {name: DTensor.from_local(value, call.mesh, replicated(call.mesh),
                                        run_check=False) for name, value in metrics.items()}
    return (call.reduced(loss), metrics, *(call.per_row(value) for value in values))


def sequence_logprobs(op, token_logprobs, reduce_sequence, logits, target, mask, *,
                      average=False, temperature=1.0, backend="auto", sampling=None):
    """``op`` (``ak.sequence_logprobs``) of DTensor logits (or target or mask): on whole
    sequences (``Shard(0)``) the op on the local rows; on a vocabulary shard the masked sum (or
    mean, ``reduce_sequence``) of ``token_logprobs``' ``process_group=`` path. Results ``[B]``,
    sharded as the rows. The logprobs module hands in its functions (it imports this one)."""
    call = logits_call("sequence_logprobs", logits, target, None, others=dict(mask=mask),
                        whole_sequences=True)
    return _sequence(call, (call.logits,), {}, op, token_logprobs, reduce_sequence, mask,
                     dict(average=average, temperature=temperature, backend=backend,
                          sampling=sampling))


def linear_sequence_logprobs(op, token_logprobs, reduce_sequence, hidden, weight, target, mask,
                             *, bias=None, average=False, temperature=1.0, softcap=None,
                             logit_scale=1.0, chunk_size=None, backend="auto", sampling=None):
    """``op`` (``ak.linear_sequence_logprobs``) of a DTensor head: as :func:`sequence_logprobs`
    on ``head_call``'s placements (``token_logprobs``: ``linear_token_logprobs``)."""
    call = head_call("linear_sequence_logprobs", hidden, weight, bias, target, None,
                      others=dict(mask=mask), whole_sequences=True)
    return _sequence(call, (call.hidden, call.weight),
                     dict(bias=call.bias, softcap=softcap, logit_scale=logit_scale,
                          chunk_size=chunk_size), op, token_logprobs, reduce_sequence, mask,
                     dict(average=average, temperature=temperature, backend=backend,
                          sampling=sampling))


def _sequence(call, head, head_keywords, op, token_logprobs, reduce_sequence, mask, keywords):
    from torch.distributed.tensor import DTensor

    mask = per_row_input(call.op_name, "mask", mask, call, full_shape=True)
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
    rows = call.rows_shape[:1]
    per_row = DTensor.from_local(out, call.mesh, call.row_placements, run_check=False,
                                 shape=rows, stride=contiguous_strides(rows))
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
            and not options.record.mean_over_tokens):
        refused.append(f"entropy_coef != 0 with loss_type={options.loss_type!r} (the bonus is "
                       f"a mean over the batch's tokens, the loss a mean over sequences)")
    if refused:
        rows = "logits" if op_name == "grpo_loss" else "hidden"
        raise ValueError(f"{op_name}: {rows} sharded over rows (Shard(0)) do not serve "
                         f"{'; '.join(refused)}: redistribute the {rows} to Replicate()"
                         f"{' or Shard(-1) (the vocabulary)' if rows == 'logits' else ''}")


def _replace(options, **changes):
    return dataclasses.replace(options, **changes)
