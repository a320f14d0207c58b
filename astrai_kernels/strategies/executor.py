"""A minimal executor and ``broadcast_state_dict`` over ``torch.distributed``.

The seed took both from its trainer (``astrai.parallel.executor``). Only what the strategies need
is kept: :meth:`Executor.unwrap_model` returns the *state dict* of the bare model (the seed's
executor contract), and :attr:`Executor.use_distributed` says whether more than one process runs.
Any object with those two members can be passed as ``executor=`` to a strategy.
"""

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

_COMPILE_PREFIX = "_orig_mod."


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap_module(model: nn.Module) -> nn.Module:
    """The bare module under DDP / DataParallel (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _strip_prefix(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    if any(key.startswith(_COMPILE_PREFIX) for key in state_dict):
        return {key.replace(_COMPILE_PREFIX, "", 1) if key.startswith(_COMPILE_PREFIX) else key:
                value for key, value in state_dict.items()}
    return state_dict


class Executor:
    """Single-process / DDP executor: what :class:`GRPOStrategy` needs to sync its old policy."""

    def unwrap_model(self, model: nn.Module) -> Dict[str, Any]:
        """State dict of the bare model, with wrapper prefixes removed."""
        return _strip_prefix(unwrap_module(model).state_dict())

    @property
    def use_distributed(self) -> bool:
        return is_distributed()


def broadcast_state_dict(
    state_dict: Optional[Dict[str, Any]],
    src: int = 0,
    group: Optional[Any] = None,
    device: Optional[torch.device] = None,
) -> Optional[Dict[str, Any]]:
    """Rank ``src``'s state dict, on every rank. All ranks of ``group`` must call it.

    In a single process (no process group, or world size 1) it returns ``state_dict`` unchanged.
    Otherwise ``src`` sends the keys, shapes and dtypes first (so other ranks may pass ``None``,
    e.g. under FSDP where only rank 0 holds the full state dict), then every tensor. Receiving
    ranks get new tensors: the tensors they passed in (possibly the live parameters of their own
    model) are never written. ``device`` is where received tensors live: by default the device of
    the local tensor of the same name, else CUDA's current device for NCCL groups, else CPU.
    Non-tensor entries (e.g. ``_extra_state``) travel as objects.
    """
    if not is_distributed():
        return state_dict
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    global_src = src if group is None else dist.get_global_rank(group, src)
    if rank == src:
        if state_dict is None:
            raise ValueError(f"broadcast_state_dict: the source rank {src} passed no state dict")
        meta = [
            (key, ("tensor", tuple(value.shape), value.dtype))
            if isinstance(value, torch.Tensor) else (key, ("object", value))
            for key, value in state_dict.items()
        ]
    else:
        meta = None
    box = [meta]
    dist.broadcast_object_list(box, src=global_src, group=group)
    meta = box[0]

    # NCCL moves CUDA tensors only; gloo moves CPU tensors (and CUDA ones through host copies).
    comm_device = (torch.device("cuda", torch.cuda.current_device())
                   if dist.get_backend(group) == "nccl" else None)
    local = state_dict or {}
    out: Dict[str, Any] = {}
    for key, (kind, *info) in meta:
        if kind == "object":
            out[key] = info[0]
            continue
        shape, dtype = info
        if rank == src:
            payload = state_dict[key].detach()
            if comm_device is not None and payload.device != comm_device:
                payload = payload.to(comm_device)
            dist.broadcast(payload.contiguous(), src=global_src, group=group)
            out[key] = state_dict[key]
            continue
        here = local.get(key)
        if device is not None:
            target = torch.device(device)
        elif isinstance(here, torch.Tensor):
            target = here.device
        else:
            target = comm_device or torch.device("cpu")
        buffer = torch.empty(shape, dtype=dtype, device=comm_device or target)
        dist.broadcast(buffer, src=global_src, group=group)
        out[key] = buffer.to(target)
    return out
