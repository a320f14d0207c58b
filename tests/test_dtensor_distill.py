"""DTensor logits through ``ak.distill_loss`` and ``ak.topk_distill_loss`` on 2 gloo CPU ranks
(``ops/dtensor.py``: rows sharded or replicated; these ops have no vocabulary-parallel path).

Rows ``Shard(0)`` (2 sequences split 1/1; with one rank's rows all ignored), ``Shard(1)`` (5
positions split 3/2), ``Replicate`` and a plain teacher beside a sharded student, each reduction,
float32 and bfloat16. Each result and the student's gradient are judged per element against
float64 on the full tensors, allowed twice the single-process op's own error (its ``naive``)
plus the tolerance table's terms; the gradient keeps the student's placements. A vocabulary
shard is refused, naming the row layout that would serve.
"""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close, assert_close_elementwise
from astrai_kernels.testing.multiprocess import assert_ranks_passed, case_outcome, spawn_ranks

VOCAB, BATCH, LENGTH, K = 11, 2, 5, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _placements(name):
    from torch.distributed.tensor import Replicate, Shard

    return (Replicate(),) if name == "R" else (Shard(name),)


def _logits(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 3).to(dtype)


def _target(all_ignored_second=False):
    target = (torch.arange(BATCH * LENGTH) * 7 % VOCAB).reshape(BATCH, LENGTH)
    target[0, 2] = target[1, 3] = -100
    if all_ignored_second:
        target[1] = -100
    return target


def _judge(op, out, single, exact, leaf, single_leaf, exact_leaf, dtype):
    from torch.distributed.tensor import DTensor

    assert isinstance(out, DTensor), type(out)
    assert_close(out.full_tensor(), exact, "value", dtype, f"{op} value", naive=single.detach())
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    from torch.distributed.tensor import distribute_tensor

    out.backward(distribute_tensor(upstream, out.device_mesh, out.placements))
    single.backward(upstream.to(single.dtype))
    exact.backward(upstream.double())
    assert leaf.grad.placements == leaf.placements, (leaf.grad.placements, leaf.placements)
    assert_close_elementwise(leaf.grad.full_tensor(), exact_leaf.grad, single_leaf.grad,
                             dtype=dtype, name=f"{op} grad")


def _distill_case(placement, reduction, with_target=True, plain_teacher=False,
                  all_ignored_second=False):
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh()
        student, teacher = _logits(dtype, 0), _logits(dtype, 1)
        target = _target(all_ignored_second) if with_target else None
        options = dict(beta=0.5, temperature=0.8, reduction=reduction)
        leaf = distribute_tensor(student, mesh, _placements(placement)).requires_grad_(True)
        teacher_arg = teacher if plain_teacher else distribute_tensor(
            teacher, mesh, _placements(placement))
        out = ak.distill_loss(leaf, teacher_arg, target, **options)
        single_leaf = student.clone().requires_grad_(True)
        single = ak.distill_loss(single_leaf, teacher, target, **options)
        exact_leaf = student.double().requires_grad_(True)
        exact = reference.distill_loss(exact_leaf, teacher.double(), target, 0.5, 0.8, -100,
                                       reduction)
        _judge("distill_loss", out, single, exact, leaf, single_leaf, exact_leaf, dtype)
    return case


def _topk_case(placement, reduction, with_labels=True, beta=0.0):
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh()
        student = _logits(dtype, 0)
        g = torch.Generator().manual_seed(5)
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K]
                           for _ in range(BATCH * LENGTH)]).reshape(BATCH, LENGTH, K)
        teacher = torch.log_softmax(torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 2, -1)
        teacher = teacher.gather(-1, ids)
        labels = _target() if with_labels else None
        options = dict(beta=beta, temperature=0.8, reduction=reduction)
        leaf = distribute_tensor(student, mesh, _placements(placement)).requires_grad_(True)
        out = ak.topk_distill_loss(leaf, ids, teacher, labels, **options)
        single_leaf = student.clone().requires_grad_(True)
        single = ak.topk_distill_loss(single_leaf, ids, teacher, labels, **options)
        exact_leaf = student.double().requires_grad_(True)
        exact = reference.topk_distill_loss(exact_leaf, ids, teacher.double(), labels, beta,
                                            0.8, True, None, reduction)
        _judge("topk_distill_loss", out, single, exact, leaf, single_leaf, exact_leaf, dtype)
    return case


def _refused(dtype):
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh()
    student, teacher = _logits(dtype, 0), _logits(dtype, 1)
    vocab_shard = distribute_tensor(student, mesh, _placements(-1))
    with pytest.raises(ValueError, match=r"distill_loss: student_logits is a DTensor with "
                       r"placements \(Shard\(dim=2\),\).*no vocabulary-parallel path.*"
                       r"student_logits\.redistribute\(student_logits\.device_mesh, "
                       r"\[Shard\(dim=0\)\]\)"):
        ak.distill_loss(vocab_shard, teacher, _target())
    rows = distribute_tensor(student, mesh, _placements(0))
    other_rows = distribute_tensor(teacher, mesh, _placements(1))
    with pytest.raises(ValueError, match=r"teacher_logits has placements \(Shard\(dim=1\),\) but "
                       r"student_logits \(Shard\(dim=0\),\)"):
        ak.distill_loss(rows, other_rows, _target())


CASES = {
    "distill_rows0_batchmean": _distill_case(0, "batchmean"),
    "distill_rows0_one_rank_ignored": _distill_case(0, "batchmean", all_ignored_second=True),
    "distill_rows1_mean": _distill_case(1, "mean"),
    "distill_rows1_sum_plain_teacher": _distill_case(1, "sum", plain_teacher=True),
    "distill_rows0_none": _distill_case(0, "none"),
    "distill_rows0_batchmean_no_target": _distill_case(0, "batchmean", with_target=False),
    "distill_rows1_mean_no_target": _distill_case(1, "mean", with_target=False),
    "distill_replicated": _distill_case("R", "batchmean"),
    "topk_rows0_batchmean": _topk_case(0, "batchmean"),
    "topk_rows1_batchmean_jsd": _topk_case(1, "batchmean", beta=0.5),
    "topk_rows1_none": _topk_case(1, "none"),
    "topk_rows0_no_labels": _topk_case(0, "batchmean", with_labels=False),
    "refused": _refused,
}
CASE_DTYPES = [(name, dtype_id) for name in CASES for dtype_id in DTYPES]


def _worker(rank, world_size):
    return {f"{name}-{dtype_id}": case_outcome(CASES[name], DTYPES[dtype_id])
            for name, dtype_id in CASE_DTYPES}


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 2, timeout=300.0)


@pytest.mark.parametrize("name, dtype_id", CASE_DTYPES,
                         ids=[f"{name}-{dtype_id}" for name, dtype_id in CASE_DTYPES])
def test_dtensor_distill(outcomes, name, dtype_id):
    assert_ranks_passed(outcomes, f"{name}-{dtype_id}")
