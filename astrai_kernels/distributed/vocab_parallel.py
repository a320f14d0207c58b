"""Vocabulary parallel (``process_group=``): each rank of the group holds a contiguous vocabulary
shard; this module lays the shards out and checks the call, ``distributed/vocab_shard.py``
computes on them.

Contract (docs/distributed.md): rank ``r`` of the group passes logits ``[..., V_r]`` (or a
weight ``[V_r, H]``) holding the vocabulary ids ``[start_r, start_r + V_r)``, shards in rank
order, sizes free; targets hold global ids. Every rank gets the full-vocabulary result and the
gradient of its own shard; the ``linear_*`` forms also sum the hidden states' gradient over
the group (as Megatron's vocab-parallel cross-entropy does). Each op's ``process_group=``
branch (in the op's own module) checks its arguments with its own rules inside
:func:`agreed_layout`, then calls ``vocab_shard``'s row-level functions; neither module imports
an op module.

A rank may hold no vocabulary at all (``V_r = 0``: V smaller than the group, or padded
unevenly); only every shard empty is refused, on every rank, from the shard sizes' all-gather.

The shard sizes are all-gathered once per call (one host sync, like the target check), with
each rank's row count and, under ``check_consistency=True`` (the default), a fingerprint of its
targets (their sum and count over the counted rows). That all-gather is the call's first
collective, and every rank reaches it whatever its tensors (none is checked before it); then
the call's checks of its tensors run and are agreed over the group (``distributed/agreement.py``:
one small all-reduce), so an input one rank refuses raises on every rank; then every rank must
have passed the same rows and targets (only the vocabulary shard differs), else every rank
raises ``RanksDisagree`` (an unequal row count would otherwise hang in the next all-reduce
until the process group's timeout). The vocab-parallel paths are eager only (no
``torch.compile`` tracing). ``backend="reference"`` all-gathers the full logits and runs the
naive spec on them (a test oracle, not a path to use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops._common import LogitsShape
from ..ops.head import check_head, head_needs, reference_on_logits
from ..options.scalars import check_bool, check_index
from . import agreement
from .agreement import RanksDisagree, SumGradOverGroup


@dataclass(frozen=True)
class VocabShard:
    """This rank's vocabulary shard, ids ``[start, stop)`` of the group's whole vocabulary (as Cut
    Cross-Entropy's ``VocabParallelOptions`` carries it), and every rank's shard size in rank
    order. Built once per call, by :func:`agreed_layout` from the shard sizes' all-gather, and
    passed down to everything that reads the layout: the checks (the whole vocabulary), the
    shard's statistics and gradient (``distributed/vocab_shard.py``), the reference path."""

    start: int
    stop: int
    group: dist.ProcessGroup
    sizes: Tuple[int, ...]

    @property
    def size(self) -> int:
        """This rank's shard size (0 for a rank that holds no vocabulary)."""
        return self.stop - self.start

    @property
    def vocab_total(self) -> int:
        return sum(self.sizes)

    @property
    def vocab_largest(self) -> int:
        """The group's largest shard (the head walk's chunk rule reads it, alike on every rank)."""
        return max(self.sizes)


def _not_a_member(process_group) -> bool:
    """True for the sentinel ``dist.new_group`` returns to a rank outside the group."""
    sentinel = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return sentinel is not None and process_group is sentinel


def check_consistency_flag(check_consistency) -> bool:
    return check_bool(check_consistency, "check_consistency")


def vocab_size(shard, dim: int = -1) -> int:
    """The vocabulary size of this rank's ``shard`` (logits' last dimension, ``dim=-1``; a
    weight's rows, ``dim=0``), read before any check for the shard sizes' all-gather: 0 when
    ``shard`` has no such dimension (the checks after the all-gather refuse it)."""
    if not isinstance(shard, Tensor) or shard.dim() < (2 if dim == 0 else 1):
        return 0
    return shard.shape[dim]


def _target_fields(target, ignore_index: int, check_consistency: bool, device) -> Tensor:
    """The row count and the targets' fingerprint (sum and count of the counted targets; zeros
    unless ``check_consistency``), read whatever ``target`` is (-1 rows for no tensor)."""
    if not isinstance(target, Tensor):
        return torch.tensor([-1, 0, 0], dtype=torch.int64, device=device)
    rows = torch.tensor([target.numel()], dtype=torch.int64, device=device)
    integer = not (target.is_floating_point() or target.is_complex()
                   or target.dtype == torch.bool)
    if not (check_consistency and integer):
        return torch.cat([rows, rows.new_zeros(2)])
    counted = target.reshape(-1) != ignore_index
    fingerprint = torch.stack([torch.where(counted, target.reshape(-1), 0).sum(),
                               counted.sum()]).to(device=device, dtype=torch.int64)
    return torch.cat([rows, fingerprint])


def agreed_layout(op_name: str, process_group, vocab_local: int, like: Tuple, target,
                  ignore_index, check_consistency, checks: Callable[[VocabShard], Any]):
    """``(layout, checks(layout))``: this rank's :class:`VocabShard`, from the shard sizes
    all-gathered over the group (the one place a call's layout is derived), and the call's
    checks, agreed over the group.

    The all-gather is the call's first collective, and every rank reaches it whatever its
    tensors (``vocab_local`` and the target's fields are read without a check; before it only
    what is alike on every rank by the contract is checked: the group, ``check_consistency``,
    ``ignore_index`` and the op's refusals of its other keywords): 4 int64 per rank, the shard
    size, the row count (``target.numel()``) and, when ``check_consistency``, the sum and
    count of the counted targets. Then, alike on every rank:
    every shard empty is refused; ``checks(layout)`` (every check of the call's own arguments,
    which may read the whole vocabulary ``layout.vocab_total``) runs and is agreed
    (``agreement.agreed``), so an input one rank refuses raises on every rank; ranks that pass
    different rows (or targets) raise :class:`RanksDisagree`. ``like``: tensors of the call,
    whose device the collectives use.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group is set but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if _not_a_member(process_group):
        raise ValueError("this process is not a member of process_group (dist.new_group "
                         "returned GroupMember.NON_GROUP_MEMBER here): call the op only on "
                         "the group's ranks")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(process_group).__name__}")
    check_consistency = check_consistency_flag(check_consistency)
    ignore_index = check_index(ignore_index, "ignore_index")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    world = dist.get_world_size(process_group)
    device = agreement.device_of(*like, group=process_group)
    local = torch.cat([torch.tensor([vocab_local], dtype=torch.int64, device=device),
                       _target_fields(target, ignore_index, check_consistency, device)])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=process_group)
    per_rank = torch.stack(gathered).tolist()
    sizes = [values[0] for values in per_rank]
    if sum(sizes) < 1:
        raise ValueError(f"every rank of process_group holds an empty vocabulary shard (shard "
                         f"sizes per rank: {sizes}): the vocabulary needs V >= 1")
    start = sum(sizes[:rank])
    layout = VocabShard(start, start + vocab_local, process_group, tuple(sizes))
    checked = agreement.agreed(op_name, process_group, device, lambda: checks(layout))
    rows = [values[1] for values in per_rank]
    if len(set(rows)) > 1:
        raise RanksDisagree(f"the ranks of process_group pass different numbers of rows "
                            f"(target.numel() per rank: {rows}): every rank must pass the same "
                            f"rows, only the vocabulary shard differs")
    fingerprints = [tuple(values[2:]) for values in per_rank]
    if len(set(fingerprints)) > 1:
        raise RanksDisagree(f"the ranks of process_group pass different targets (sum and "
                            f"count of the counted targets per rank: {fingerprints}): every "
                            f"rank must pass the same targets (and ignore_index); "
                            f"check_consistency=False skips this check")
    return layout, checked


def whole_logits(rows: Tensor, layout: VocabShard) -> LogitsShape:
    """The group's logits as the checks see them: ``rows``' leading shape, the whole
    vocabulary."""
    return LogitsShape(tuple(rows.shape[:-1]), layout.vocab_total, rows.device)


def gathered_logits(logits: Tensor, layout: VocabShard) -> Tensor:
    """The full-vocabulary logits (the reference path): the other ranks' shards all-gathered
    (padded to the largest shard; the layout's sizes cut them) and detached, this rank's shard
    differentiable in place."""
    rank = dist.get_rank(layout.group)
    padded = logits.detach().new_zeros(*logits.shape[:-1], layout.vocab_largest)
    padded[..., :layout.size] = logits.detach()
    shards = [torch.empty_like(padded) for _ in layout.sizes]
    dist.all_gather(shards, padded.contiguous(), group=layout.group)
    pieces = [logits if r == rank else shard[..., :size]
              for r, (shard, size) in enumerate(zip(shards, layout.sizes))]
    return torch.cat(pieces, dim=-1)


def on_gathered_logits(op, call, layout: VocabShard):
    """``backend="reference"`` under ``process_group``: ``op`` in one process on the gathered
    full-vocabulary logits (each rank computes the whole result)."""
    return op(**call._replace(logits=gathered_logits(call.logits, layout), process_group=None,
                              backend="reference")._asdict())


def check_shard_head(hidden, weight, bias, chunk_size):
    """``check_head`` for a vocabulary shard of the head, which may hold no rows
    (``weight [0, H]``, ``bias [0]``); returns ``hidden`` as 2-D rows."""
    if not (isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == 0):
        return check_head(hidden, weight, bias, chunk_size)
    if isinstance(bias, Tensor) and tuple(bias.shape) != (0,):
        raise ValueError(f"bias must have shape [V] = (0,) (weight's rows), got "
                         f"{tuple(bias.shape)}")
    # check_head wants V >= 1: the rest is checked on zero-byte one-row stand-ins
    one_row = weight.new_zeros(()).expand(1, weight.shape[1])
    one_bias = bias.new_zeros(()).expand(1) if isinstance(bias, Tensor) else bias
    return check_head(hidden, one_row, one_bias, chunk_size)


def head_setup(op_name, process_group, hidden, weight, bias, chunk_size, target, ignore_index,
               check_consistency, checks):
    """``(hidden rows, layout, needs_grad, checks(layout))`` of a vocabulary-parallel head
    call: :func:`agreed_layout` of the weight's shard, the head's checks
    (:func:`check_shard_head`) agreed with the op's own ``checks``, which run first."""
    def head_checks(layout):
        checked = checks(layout)
        return check_shard_head(hidden, weight, bias, chunk_size), checked

    layout, (hidden_rows, checked) = agreed_layout(
        op_name, process_group, vocab_size(weight, 0), (hidden, weight), target, ignore_index,
        check_consistency, head_checks)
    needs = head_needs(hidden, weight, bias) if torch.is_grad_enabled() else (False,) * 3
    return hidden_rows, layout, any(needs), checked


def on_head_logits(op, call):
    """``backend="reference"`` under ``process_group`` for a fused-head op: its logits ``op``
    on this shard's logits (the hidden states' gradient summed over the group), with the
    call's arguments that ``op`` takes."""
    hidden = SumGradOverGroup.apply(call.hidden, call.process_group)
    return reference_on_logits(op, call, torch.nn.functional.linear(hidden, call.weight,
                                                                    call.bias))
