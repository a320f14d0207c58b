"""Running across ranks. The public names: :func:`global_token_count`, and the errors every rank
raises together (:class:`RankRefused` and its kinds, :class:`RanksDisagree`).

The package's modules, below the ops (which call them) and above the kernels:
``vocab_parallel`` (the vocabulary-shard layout a ``process_group=`` call is checked against),
``vocab_shard`` (the shard's statistics combined over the group, its gradient), ``placements``
(what a DTensor call's placements mean), ``dtensor`` (the DTensor front door of each op
family), ``agreement`` (the collectives: the ranks' agreement on a call's checks, sums over
groups).

Data parallel: the global token count that makes a sharded batch's loss exact.

Under DDP or FSDP2 each rank computes the loss of its own micro-batch. A ``mean`` over each
rank's own tokens weighs the ranks equally whatever their token counts, so the averaged
gradient is not the whole batch's. Dividing every rank's token sum by the *global* count
(``normalizer=global_token_count(...)``) makes the sum over ranks of the local gradients equal
the single-process gradient of the whole batch; DDP and FSDP2 *average* the gradients over
the ranks, so multiply the local loss by the world size (or reduce with a sum)::

    count = ak.distributed.global_token_count(target)           # one all-reduce, no host sync
    loss = ak.cross_entropy(logits, target, normalizer=count) * world_size
    loss.backward()                                              # DDP/FSDP2 average: exact

For ``grpo_loss(loss_type="dapo")`` count the mask: ``global_token_count(mask)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .agreement import (
    RankRefused,
    RankRefusedNotImplemented,
    RankRefusedRuntime,
    RankRefusedType,
    RanksDisagree,
)

__all__ = ["RankRefused", "RankRefusedNotImplemented", "RankRefusedRuntime", "RankRefusedType",
           "RanksDisagree", "global_token_count"]


def global_token_count(target_or_mask: Tensor, ignore_index: int = -100,
                       process_group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """The number of counted tokens summed over ``process_group`` (default: the world), as a
    float32 0-d tensor on the input's device, for the losses' ``normalizer``.

    An integer tensor is read as targets (entries other than ``ignore_index`` count); a bool
    tensor as a mask (``True`` counts). One all-reduce of an int64 scalar, asynchronous on
    CUDA: no host sync. Outside an initialized process group it is the local count.
    """
    if not isinstance(target_or_mask, Tensor):
        raise TypeError(f"target_or_mask must be a torch.Tensor, got "
                        f"{type(target_or_mask).__name__}")
    if target_or_mask.dtype == torch.bool:
        count = target_or_mask.sum(dtype=torch.int64)
    elif not target_or_mask.is_floating_point() and not target_or_mask.is_complex():
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        count = (target_or_mask != ignore_index).sum(dtype=torch.int64)
    else:
        raise TypeError(f"target_or_mask must be integer targets or a bool mask, got "
                        f"{target_or_mask.dtype} (for a 0/1 float mask pass mask.bool())")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=process_group)
    elif process_group is not None:
        raise ValueError("process_group is set but torch.distributed is not initialized")
    return count.to(torch.float32)
