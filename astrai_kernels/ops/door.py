"""Each public op's one entrance, ``DOOR.enter(call)``: an op's body builds its call, a
``NamedTuple`` of its arguments by name declared beside it (``CrossEntropyCall``; the GRPO and
distillation ops fold their option keywords into ``options`` first), and hands it to its door
(docs/architecture.md renders each op's routes; the preference losses and ``group_advantages``
have no door).

``Door.enter`` routes every call the same way, in this order:

1. a DTensor among the op's tensor arguments: the op's ``dtensor`` route
   (``distributed/dtensor.py``), which calls the op again on each rank's local tensors with a
   process group;
2. ``process_group`` given: the op's ``vocab_parallel`` route (this rank's vocabulary shard);
3. ``check(call)``: every argument checked once, into one object the routes share (its
   ``backend`` resolved);
4. ``backend="reference"``: the ``reference`` route (the float64 spec, ``reference.py``);
5. otherwise the ``local`` route: the kernels of the resolved backend.

Every route reads the call's attributes (``call.hidden``): a reader, a type checker or a
call-graph tool follows an argument from the signature to the kernel, and ``torch.compile``
traces a ``NamedTuple`` like any tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch

from ..distributed.placements import has_dtensor

#: an op's call: a ``NamedTuple`` of its arguments (``CrossEntropyCall``)
Call = Any


@dataclass(frozen=True)
class Door:
    """The routes of one public op (``op``), each a function of its file."""
    op: Callable[..., Any]
    #: the arguments a DTensor may arrive in
    tensors: Tuple[str, ...]
    check: Callable[[Call], Any]
    local: Callable[[Call, Any], Any]
    reference: Callable[[Call, Any], Any]
    vocab_parallel: Optional[Callable[[Call], Any]] = None
    dtensor: Optional[Callable[..., Any]] = None

    def enter(self, call: Call):
        if has_dtensor(*[getattr(call, name) for name in self.tensors]):
            if self.dtensor is None:
                raise TypeError(
                    f"{self.op.__name__} does not take DTensor arguments (got "
                    f"{_dtensor_names(call, self.tensors)}): pass local tensors, e.g. "
                    f"x.full_tensor() or x.to_local()")
            return self.dtensor(self.op, **call._asdict())
        if getattr(call, "process_group", None) is not None:
            return self.vocab_parallel(call)
        checked = self.check(call)
        if checked.backend == "reference":
            return self.reference(call, checked)
        return self.local(call, checked)


class Checked(NamedTuple):
    """A checked call whose loss has a normalizer: the params and the normalizer as a device
    tensor (or None)."""
    params: Any
    normalizer: Optional[torch.Tensor]

    @property
    def backend(self) -> str:
        return self.params.backend


def _dtensor_names(call: Call, names: Tuple[str, ...]) -> str:
    return ", ".join(name for name in names if has_dtensor(getattr(call, name)))
