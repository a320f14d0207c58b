"""A 2 x 2 device mesh (data parallel x tensor parallel) on 4 gloo CPU ranks, tiny shapes.

- Logits sharded on both dimensions, rows over ``dp`` and the vocabulary over ``tp``
  (``(Shard(0), Shard(-1))``): ``cross_entropy`` and ``token_logprobs`` equal the single-process
  op on the full tensors, values and gradients, per element against float64 (twice the
  single-process op's own error), and the gradient keeps the logits' placements.
- FSDP2 x TP: ``lm_head`` parallelized with ``ColwiseParallel`` over ``tp``, the module
  ``fully_shard``-ed over ``dp``; its forward calls ``ak.linear_cross_entropy`` on the weight
  (a ``Shard(0)`` DTensor over ``tp`` there). Two SGD steps leave the weight of one process
  trained on the whole batch.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close
from astrai_kernels.testing.multiprocess import assert_ranks_passed, case_outcome, spawn_ranks

BATCH, LENGTH, HIDDEN, VOCAB = 4, 3, 8, 11  # V = 11 splits 6/5 over tp
BACKENDS = ("cpp", "torch")


@functools.lru_cache(maxsize=None)
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _data():
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 3
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    target = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    target[0, 1] = target[1, 0] = target[3, 2] = -100  # dp rank 0 counts 4 rows, rank 1 5
    return logits, hidden, weight, target


def _logits_both_dims(backend):
    from torch.distributed.tensor import Shard, distribute_tensor

    logits, _, _, target = _data()
    placements = (Shard(0), Shard(2))
    for op in ("cross_entropy", "token_logprobs"):
        sharded = distribute_tensor(logits, _mesh(), placements).requires_grad_(True)
        got = getattr(ak, op)(sharded, target, backend=backend)
        upstream = torch.linspace(0.5, 1.5, got.numel()).reshape(got.shape)
        full = upstream if op == "cross_entropy" else distribute_tensor(
            upstream, _mesh(), got.placements)
        (got * full).sum().backward()
        assert tuple(sharded.grad.placements) == placements, op
        local = logits.clone().requires_grad_(True)
        naive = getattr(ak, op)(local, target, backend=backend)
        (naive * upstream).sum().backward()
        exact = logits.double().requires_grad_(True)
        expected = (reference.cross_entropy(exact, target) if op == "cross_entropy"
                    else reference.token_logprobs(exact, target, 1.0)[0])
        (expected * upstream.double()).sum().backward()
        got_full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert_close(got_full.detach(), expected.detach(), "value", torch.float32, op,
                     naive=naive.detach())
        assert_close(sharded.grad.full_tensor(), exact.grad, "grad", torch.float32,
                     f"{op} gradient", naive=local.grad,
                     scale=exact.grad.abs() + exact.grad.abs().amax(-1, keepdim=True))


class Model(nn.Module):
    def __init__(self, weight, backend):
        super().__init__()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.backend = backend

    def forward(self, hidden, target):
        self.weight_type = type(self.lm_head.weight).__name__
        if self.backend is None:  # the spec, in the parameters' dtype
            return reference.cross_entropy(F.linear(hidden, self.lm_head.weight), target)
        return ak.linear_cross_entropy(hidden, self.lm_head.weight, target,
                                       backend=self.backend)


def _train(model, hidden, target, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        model(hidden, target).backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model.lm_head.weight
    return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).detach()


def _fsdp_times_tp(backend):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    _, hidden, weight, target = _data()
    # every counted token's share of the mean must be the same on both dp ranks
    target = target.clone()
    target[target == -100] = 0
    mesh = _mesh()
    model = Model(weight, backend)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    fully_shard(model, mesh=mesh["dp"])
    half = BATCH // 2
    rows = slice(mesh.get_local_rank("dp") * half, (mesh.get_local_rank("dp") + 1) * half)
    got = _train(model, hidden[rows], target[rows])
    assert model.weight_type == "DTensor"  # a tp shard inside the forward, FSDP2 gathered on dp
    expected = _train(Model(weight.double(), None), hidden.double(), target)
    naive = _train(Model(weight, backend), hidden, target)
    assert_close(got, expected, "value", torch.float32, "weight after 2 FSDP2 x TP steps",
                 naive=naive)


CASES = {f"{case.__name__.lstrip('_')}-{backend}": functools.partial(case, backend)
         for case in (_logits_both_dims, _fsdp_times_tp) for backend in BACKENDS}


def _worker(rank, world_size):
    return {name: case_outcome(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 4, timeout=300.0)


@pytest.mark.parametrize("name", list(CASES))
def test_mesh_2x2(outcomes, name):
    assert_ranks_passed(outcomes, name)
