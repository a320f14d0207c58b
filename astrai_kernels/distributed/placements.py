"""DTensor placements: what each mesh dimension of a DTensor call's arguments means, read once.

The placements on each mesh dimension choose the path (``distributed/dtensor.py`` holds what
each op family adds):

* logits ``Shard(-1)``, or a weight ``Shard(0)`` (ColwiseParallel's lm_head): a vocabulary shard,
  served by the op's ``process_group=`` path over that dimension's group. torch's ``Shard``
  splits like ``torch.chunk`` (ceil-sized contiguous chunks in rank order, the last ones smaller
  or empty), which is that path's contract (``distributed/vocab_parallel.py``).
* logits ``Shard(d)``, or hidden states ``Shard(d)`` beside a weight replicated there, ``d`` a
  row dimension: the op on this rank's rows. ``mean`` divides by the count of counted targets
  summed over the dimension (``normalizer=``), reduced results are summed over it into a
  Replicate result, and a replicated weight's (and bias's) gradient is summed over it.
* hidden states ``Shard(d)`` beside a weight ``Shard(0)`` on the same dimension (sequence
  parallel): the hidden rows are all-gathered (``[N, H]``, small next to ``[N, V]``), the
  vocabulary path runs, and per-row results come back sharded as the hidden states were.
* ``Replicate``, and a plain tensor (read as replicated over the mesh): the op as it is.

Bad input on one rank raises on every rank (``distributed/agreement.py``): the local op runs
inside the ranks' agreement over the whole mesh, which a vocabulary path settles at its own
checks and a row path when the op returns or raises, before the route's next collective. A
DTensor's placements and shape are the same on every rank (DTensor's contract), so the checks of
them here raise at once; a plain tensor is this rank's own, so a check of one here (its shape)
is deferred to the agreement, and the route goes on to the same collectives as its peers.

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

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..options.scalars import check_index
from . import agreement
from .agreement import SumGradOverGroup, SumOverGroups, summed


def has_dtensor(*values) -> bool:
    """True when any of ``values`` is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = getattr(module, "DTensor", None)
    return dtensor_type is not None and any(isinstance(value, dtensor_type) for value in values)


def replicated_head(call, named):
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
            tensor = SumGradOverGroup.apply(tensor, group)
        local[name] = tensor
    return local


def replicated_results(out, mesh):
    from torch.distributed.tensor import DTensor

    if isinstance(out, tuple):
        return tuple(replicated_results(part, mesh) for part in out)
    if isinstance(out, dict):
        return {name: replicated_results(part, mesh) for name, part in out.items()}
    if isinstance(out, torch.Tensor):
        return DTensor.from_local(out, mesh, replicated(mesh), run_check=False)
    return out


def rows_call(op_name, logits_named, target, target_name, normalizer, others=None):
    """``LocalCall`` of an op served on rows only (no vocabulary path): the first of
    ``logits_named`` sets the layout (Replicate or a row ``Shard`` per mesh dimension); the
    others must have it, or be replicated (a local slice); ``target`` (may be None) follows the
    rows; ``others``: the op's other arguments that may be DTensors (they share the mesh).
    Returns the call and the local logits by name."""
    from torch.distributed.tensor import Replicate, Shard

    named = {**logits_named, target_name: target, **(others or {})}
    mesh = common_mesh(op_name, dict(named, normalizer=normalizer), None)
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
    return LocalCall(op_name=op_name, mesh=mesh, vocab_group=None,
                      row_groups=tuple(mesh.get_group(d) for d in row_mesh_dims),
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=row_placements,
                      plain=_plain(named), deferred=deferred), local


def per_row_columns(call, name, value):
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


def per_row_input(op_name, name, value, call, full_shape=False):
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


@dataclass(frozen=True)
class LocalCall:
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
        mesh (``distributed/agreement.py``): a vocabulary path settles it at its checks, a row path
        when ``op`` returns or raises. A check of the route's own that failed on this rank (a
        plain tensor that does not fit, a stand-in in its place) is this rank's error there;
        ``op`` still runs, so this rank makes the same collectives as its peers up to it.

        When plain tensors were read as replicated beside a vocabulary shard and the ranks find
        their rows differ, the error names the likely cause: FSDP2's sharded parameters outside
        the module's forward."""
        deferred = self.deferred[0] if self.deferred else None
        try:
            with agreement.over(self.op_name, mesh_groups(self.mesh), mesh_device(self.mesh),
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
            wanted = list(replicated(normalizer.device_mesh))
            if list(normalizer.placements) != wanted:
                raise ValueError(f"normalizer is a DTensor with placements "
                                 f"{tuple(normalizer.placements)}: a normalizer is one global "
                                 f"count, so it must be replicated; call normalizer.redistribute("
                                 f"normalizer.device_mesh, {wanted}) or pass a number")
            return normalizer.to_local()
        if normalizer is not None or reduction != "mean" or not self.row_groups:
            return normalizer
        count = (self.target != check_index(ignore_index, "ignore_index")).sum(dtype=torch.int64)
        return summed(count, self.row_groups).to(torch.float32)

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
            value = SumOverGroups.apply(value, self.row_groups)
        return DTensor.from_local(value, self.mesh, replicated(self.mesh), run_check=False)

    def per_row(self, out):
        """Per-row results (a tensor, or a tuple of tensors and dicts of them) as DTensors."""
        if isinstance(out, tuple):
            return tuple(self.per_row(part) for part in out)
        if isinstance(out, dict):
            return {name: self.per_row(part) for name, part in out.items()}
        from torch.distributed.tensor import DTensor

        result = DTensor.from_local(out, self.mesh, self.row_placements, run_check=False,
                                    shape=self.rows_shape,
                                    stride=contiguous_strides(self.rows_shape))
        if self.result_placements != self.row_placements:
            result = result.redistribute(self.mesh, self.result_placements)
        return result


def logits_call(op_name, logits, target, process_group, normalizer=None, others=None,
                 whole_sequences=False) -> LocalCall:
    """``others``: more arguments that may be DTensors (on the same mesh); ``whole_sequences``:
    rows are served only as whole sequences (``Shard(0)`` of ``[B, T, V]``)."""
    from torch.distributed.tensor import Replicate, Shard

    named = {"logits": logits, "target": target, **(others or {})}
    mesh = common_mesh(op_name, dict(named, normalizer=normalizer), process_group)
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
    return LocalCall(op_name=op_name, mesh=mesh, vocab_group=_group(mesh, vocab_mesh_dim),
                      row_groups=tuple(mesh.get_group(d) for d in row_mesh_dims),
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=row_placements,
                      logits=local_logits, plain=_plain(named), deferred=deferred)


def head_call(op_name, hidden, weight, bias, target, process_group, normalizer=None,
               others=None, whole_sequences=False) -> LocalCall:
    """As :func:`logits_call`, for the fused head's hidden states, weight and bias."""
    from torch.distributed.tensor import Replicate, Shard

    named = {"hidden": hidden, "weight": weight, "bias": bias, "target": target,
             **(others or {})}
    mesh = common_mesh(op_name, dict(named, normalizer=normalizer), process_group)
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
    return LocalCall(op_name=op_name, mesh=mesh, vocab_group=_group(mesh, vocab_mesh_dim),
                      row_groups=row_groups,
                      target=target, rows_shape=torch.Size(rows_shape),
                      row_placements=row_placements, result_placements=result_placements,
                      hidden=hidden.to_local(), weight=weight_local, bias=bias_local,
                      plain=_plain(named), deferred=deferred)


def common_mesh(op_name, named: Dict[str, Any], process_group):
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
    return DTensor.from_local(value, mesh, replicated(mesh), run_check=False)


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


def mesh_groups(mesh) -> Tuple[dist.ProcessGroup, ...]:
    """The groups of every mesh dimension: together they reach every rank of the mesh."""
    return tuple(mesh.get_group(mesh_dim) for mesh_dim in range(mesh.ndim))


def mesh_device(mesh) -> torch.device:
    """The device the mesh's collectives take tensors on."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


def replicated(mesh) -> Tuple[Any, ...]:
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


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
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
