"""The collectives of the distributed routes: the ranks' agreement on a call's checks (every
rank raises, or none does), and the sums over groups the routes reduce with.

A check that reads this rank's own tensors (a target out of range, a wrong shape or dtype, a NaN
the op refuses, a bias that does not fit this rank's shard) can come out differently on
different ranks. The rank whose check fails raises at once; its peers would go on into the op's
next collective and wait there for it until the process group's timeout (30 minutes by default
on gloo and NCCL). So every distributed route (``process_group=``, DTensor arguments) runs the
checks that read this rank's inputs before its first collective that depends on them, and
settles them with one small all-reduce (per mesh dimension for a DTensor call): ``int64[2]``,
the lowest failing rank with the kind of its error, and whether every rank failed, reduced by
``min``. Then:

* no rank failed: the call goes on (the all-reduce and the host read of its 16 bytes are the
  whole cost, beside the checks' own documented host sync);
* every rank failed: each raises its own error, as one process would (the same bad input on
  every rank gives the same error on every rank);
* some ranks failed: every rank raises the same :class:`RankRefused`, naming the lowest
  failing rank and quoting its error (which names the argument); the failing rank chains its
  own error. The quoted text reaches the other ranks by a second collective, on this error
  path only. The error is a ``ValueError``, and also a ``TypeError`` (``NotImplementedError``,
  ``RuntimeError``) when the failing rank's error was one.

Checks of what is alike on every rank by the contract (the keywords that are not tensors, a
DTensor's placements and shape) raise at once, the same on every rank. The checks of tensors
are agreed, two ways. A ``process_group=`` route (``distributed/vocab_parallel.py``) gathers
the shard sizes first (every rank reaches that all-gather whatever its tensors) and then runs
its checks inside :func:`agreed`. A DTensor route (``distributed/dtensor.py``) lays out the
local tensors (a plain tensor that does not fit is this rank's error, ``deferred``: a stand-in
takes its place, so every rank reaches the same collectives), then runs the op on them inside
:func:`over`: a vocabulary path inside settles the agreement over the whole mesh at its own
:func:`agreed`; a row path (no collective inside the op) settles it when the op returns or
raises, before the route's next collective. An op called inside a settled agreement
(``grpo_loss``'s log-probs under ``process_group=``) checks plainly.

The sums (:func:`summed`, :class:`SumOverGroups`, :class:`SumGradOverGroup`) all-reduce over
one group or over several (a mesh's row dimensions, one after another).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

Result = TypeVar("Result")

# Bytes of the failing rank's message shared on the error path (longer ones are cut).
MESSAGE_BYTES = 4096


class RanksDisagree(ValueError):
    """The ranks of a group pass what cannot differ between them: different rows or targets
    (``vocab_parallel.agreed_layout``), or an input one rank refused (:class:`RankRefused`)."""


class RankRefused(RanksDisagree):
    """Raised on every rank when some ranks' checks refused their input and others' passed.

    ``rank``: the lowest failing rank (the global rank); ``detail``: its error as text."""

    def __init__(self, message: str, rank: int = -1, detail: str = ""):
        super().__init__(message)
        self.rank, self.detail = rank, detail


class RankRefusedType(RankRefused, TypeError):
    """:class:`RankRefused` whose failing rank raised a ``TypeError``."""


class RankRefusedNotImplemented(RankRefused, NotImplementedError):
    """:class:`RankRefused` whose failing rank raised a ``NotImplementedError``."""


class RankRefusedRuntime(RankRefused, RuntimeError):
    """:class:`RankRefused` whose failing rank raised another error (``RuntimeError``)."""


# the kind code of a failure is its index here; the first base the error is an instance of
_KINDS = ((ValueError, RankRefused), (TypeError, RankRefusedType),
          (NotImplementedError, RankRefusedNotImplemented), (Exception, RankRefusedRuntime))


def _kind(error: BaseException) -> int:
    return next(code for code, (base, _) in enumerate(_KINDS) if isinstance(error, base))


@dataclass
class Agreement:
    """One call's agreement: the groups that together hold every rank taking part, the device
    their collectives take tensors on, and whether it is settled."""

    op_name: str
    groups: Sequence[dist.ProcessGroup]
    device: torch.device
    settled: bool = False
    #: a check that failed on this rank before the agreement; reported in its turn
    deferred: Optional[Exception] = None

    def settle(self, failure: Optional[Exception] = None):
        """The all-reduce of every rank's outcome; raises as the module says, else returns."""
        failure = self.deferred if self.deferred is not None else failure
        if self.settled:
            if failure is not None:
                raise failure
            return
        self.settled = True
        if torch.compiler.is_compiling():  # the distributed routes run eagerly
            if failure is not None:
                raise failure
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        passed = len(_KINDS) * world
        code = passed if failure is None else rank * len(_KINDS) + _kind(failure)
        status = torch.tensor([code, int(failure is not None)], dtype=torch.int64,
                              device=self.device)
        for group in self.groups:
            dist.all_reduce(status, op=dist.ReduceOp.MIN, group=group)
        lowest, every_rank_failed = status.tolist()
        if lowest == passed:
            return
        if every_rank_failed:
            raise failure
        failing_rank, kind = divmod(lowest, len(_KINDS))
        detail = self._shared_detail(failure if failing_rank == rank else None)
        error = _KINDS[kind][1](
            f"{self.op_name}: rank {failing_rank} (of {world}) refused its input, so every rank "
            f"raises (the ranks agree on their checks before the first collective): {detail}",
            failing_rank, detail)
        if failure is not None:
            raise error from failure
        raise error

    def _shared_detail(self, own: Optional[Exception]) -> str:
        """The failing rank's error as text, on every rank (only that rank passes ``own``: the
        sum over the groups is its bytes)."""
        text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if own is not None:
            encoded = f"{type(own).__name__}: {own}".encode()[:MESSAGE_BYTES]
            text[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        for group in self.groups:
            dist.all_reduce(text, op=dist.ReduceOp.SUM, group=group)
        return bytes(value for value in text.tolist() if value).decode(errors="replace")


_CURRENT: contextvars.ContextVar[Optional[Agreement]] = contextvars.ContextVar(
    "astrai_kernels_agreement", default=None)


def current() -> Optional[Agreement]:
    return _CURRENT.get()


@contextlib.contextmanager
def over(op_name: str, groups: Sequence[dist.ProcessGroup], device: torch.device,
         deferred: Optional[Exception] = None):
    """Run a DTensor route's local op inside the agreement over ``groups`` (every mesh
    dimension's): settled by an :func:`agreed` inside, else when the block ends, whether it
    returned or raised. ``deferred``: a failed check of the route's own, kept until then."""
    agreement = Agreement(op_name, tuple(groups), device, deferred=deferred)
    token = _CURRENT.set(agreement)
    try:
        yield agreement
    except Exception as error:
        if agreement.settled:
            raise
        agreement.settle(error)
        raise
    else:
        agreement.settle()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def settled():
    """Calls whose inputs an agreement already covered (an op's own inner ``process_group=``
    call on inputs it built): their :func:`agreed` checks plainly, with no collective."""
    token = _CURRENT.set(Agreement("", (), torch.device("cpu"), settled=True))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def agreed(op_name: str, group: dist.ProcessGroup, device: torch.device,
           checks: Callable[[], Result]) -> Result:
    """``checks()``, settled over ``group`` (or the DTensor call's agreement around this one):
    its result when every rank's checks passed, else the error of the module's rules."""
    agreement = current() or Agreement(op_name, (group,), device)
    if agreement.settled:
        return checks()
    try:
        result = checks()
    except Exception as error:
        agreement.settle(error)
        raise
    agreement.settle()
    return result


def device_of(*tensors, group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device the agreement's tensors go on: the first real tensor's among ``tensors``
    (a collective's inputs sit where the call's do), else the group's backend's."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            return tensor.device
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduced(tensor: Tensor, op, group) -> Tensor:
    """``tensor`` all-reduced over ``group`` in place, returned."""
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def summed(value: Tensor, groups) -> Tensor:
    """A copy of ``value`` summed over each of ``groups`` in turn (no gradient)."""
    total = value.clone()
    for group in groups:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


class SumOverGroups(torch.autograd.Function):
    """The sum of each rank's value over ``groups``, on every rank. The upstream gradient is
    replicated over them (a Replicate result's), and each rank's value enters the sum once, so
    the backward passes it through unchanged."""

    @staticmethod
    def forward(ctx, value, groups):
        return summed(value, groups)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient (the hidden states feed every
    rank's shard of the LM head; a weight replicated over row shards sees every shard's rows)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return all_reduced(grad.contiguous().clone(), dist.ReduceOp.SUM, ctx.group), None
