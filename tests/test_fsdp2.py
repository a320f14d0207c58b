"""FSDP2 (``fully_shard``) around a module whose forward calls the fused head, on 2 gloo CPU
ranks, each with its own half of the batch (data parallel).

- Inside the module's forward FSDP2 has gathered the weight: the op sees plain tensors, and two
  SGD steps leave the parameters of one process trained on the whole batch (judged per element
  against that run in float64, allowed twice the float32 single-process run's own error).
- Outside the forward the weight is a ``Shard(0)`` DTensor, which the op cannot tell from a
  ColwiseParallel weight: it reads the plain hidden states and targets beside it as replicated,
  the ranks' consistency check finds their rows differ, and every rank raises an error that names
  the likely cause (``unshard()``, or calling inside the forward).
- After ``unshard()`` the same call outside the forward is served.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close
from astrai_kernels.testing.multiprocess import assert_ranks_passed, case_outcome, spawn_ranks

BATCH_PER_RANK, LENGTH, HIDDEN, VOCAB = 2, 3, 8, 11
BACKENDS = ("cpp", "torch")


class Head(nn.Module):
    def __init__(self, weight, backend):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.backend = backend

    def forward(self, hidden, target):
        if self.backend is None:  # the spec, in the parameters' float64
            return reference.cross_entropy(F.linear(hidden, self.weight), target)
        return ak.linear_cross_entropy(hidden, self.weight, target, backend=self.backend)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(2 * BATCH_PER_RANK, LENGTH, HIDDEN, generator=g).to(dtype)
    target = torch.randint(0, VOCAB, (2 * BATCH_PER_RANK, LENGTH), generator=g)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype)
    return hidden, target, weight


@functools.lru_cache(maxsize=None)
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _mine(tensor):
    rank = dist.get_rank()
    return tensor[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]


def _sharded_head(weight, backend):
    from torch.distributed.fsdp import fully_shard

    model = Head(weight, backend)
    fully_shard(model, mesh=_mesh())
    return model


def _train(model, hidden, target, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        model(hidden, target).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.weight


def _inside_forward(backend):
    hidden, target, weight = _data()
    sharded = _train(_sharded_head(weight, backend), _mine(hidden), _mine(target))
    got = sharded.full_tensor().detach()
    expected = _train(Head(weight.double(), None), hidden.double(), target).detach()
    naive = _train(Head(weight, backend), hidden, target).detach()
    assert_close(got, expected, "value", torch.float32, "weight after 2 FSDP2 steps",
                 naive=naive)


def _outside_forward_names_the_cause(backend):
    from torch.distributed.tensor import DTensor

    hidden, target, weight = _data()
    model = _sharded_head(weight, backend)
    assert isinstance(model.weight, DTensor)  # fully_shard's Shard(0) outside the forward
    with pytest.raises(ValueError, match=r"fully_shard.*unshard\(\)"):
        ak.linear_cross_entropy(_mine(hidden), model.weight, _mine(target), backend=backend)


def _after_unshard(backend):
    hidden, target, weight = _data()
    model = _sharded_head(weight, backend)
    model.unshard()
    try:
        got = ak.linear_cross_entropy(_mine(hidden), model.weight, _mine(target),
                                      backend=backend)
    finally:
        model.reshard()
    expected = reference.cross_entropy(F.linear(_mine(hidden).double(), weight.double()),
                                       _mine(target))
    naive = ak.linear_cross_entropy(_mine(hidden), weight, _mine(target), backend=backend)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    assert_close(got.detach(), expected, "value", torch.float32, "loss after unshard",
                 naive=naive.detach())


CASES = {f"{case.__name__.lstrip('_')}-{backend}": functools.partial(case, backend)
         for case in (_inside_forward, _outside_forward_names_the_cause, _after_unshard)
         for backend in BACKENDS}


def _worker(rank, world_size):
    return {name: case_outcome(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 2, timeout=300.0)


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp2(outcomes, name):
    assert_ranks_passed(outcomes, name)
