"""DTensor arguments of the distillation and preference losses on 2 gloo CPU ranks
(``distributed/dtensor.py``: rows sharded or replicated; the distillation ops have no
vocabulary-parallel path).

``distill_loss``, ``topk_distill_loss`` and their ``linear_`` forms: rows ``Shard(0)`` (2
sequences split 1/1; with one rank's rows all ignored), ``Shard(1)`` (5 positions split 3/2),
``Replicate``, a plain teacher beside a sharded student, plain (replicated) head weights, each
reduction, float32 and bfloat16. The preference losses (``dpo_loss``, ``orpo_loss``,
``simpo_loss``, ``cpo_loss``, ``kto_loss``) on sequence log-probs ``Shard(0)``: DTensor's own
operators serve them. Each result and each gradient is judged per element against float64 on
the full tensors, allowed twice the single-process op's own error (its ``naive``) plus the
tolerance table's terms; gradients keep their inputs' placements. A vocabulary shard is
refused, naming the layout that would serve.
"""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close, assert_close_elementwise
from astrai_kernels.testing.multiprocess import assert_ranks_passed, case_outcome, spawn_ranks

VOCAB, BATCH, LENGTH, K, HIDDEN = 11, 2, 5, 4, 6
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


def _support():
    """K distinct teacher ids a row and their log-probs under a random teacher."""
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K]
                       for _ in range(BATCH * LENGTH)]).reshape(BATCH, LENGTH, K)
    teacher = torch.log_softmax(torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 2, -1)
    return ids, teacher.gather(-1, ids)


def _topk_case(placement, reduction, with_labels=True, beta=0.0):
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh()
        student = _logits(dtype, 0)
        ids, teacher = _support()
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


def _head(dtype, seed, hidden_size=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, LENGTH, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, hidden_size, generator=g) * hidden_size ** -0.5 * 3).to(dtype)
    bias = (torch.randn(VOCAB, generator=g) * 0.5).to(dtype)
    return hidden, weight, bias


def _judge_head(op, out, single, exact, leaves, single_leaves, exact_leaves, logits64, dtype):
    """As :func:`_judge`, for every leaf (hidden, weight, bias: DTensors or plain). The head's
    gradients are sums over rows (and over the vocabulary for hidden's) that cancel, summed in
    another order over the shards: each is judged against the size of the terms its matmul
    sums, ``|dL/dlogits|`` against ``|weight|`` or ``|hidden|`` (``logits64``: the float64
    logits the exact loss was formed on)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(out, DTensor), type(out)
    assert_close(out.full_tensor(), exact, "value", dtype, f"{op} value", naive=single.detach())
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(distribute_tensor(upstream, out.device_mesh, out.placements))
    single.backward(upstream.to(single.dtype))
    logits64.retain_grad()
    exact.backward(upstream.double())
    terms = logits64.grad.abs().reshape(-1, logits64.shape[-1])
    hidden64, weight64 = (t.detach().abs() for t in exact_leaves[:2])
    scales = ((terms @ weight64).reshape(hidden64.shape),
              terms.t() @ hidden64.reshape(-1, hidden64.shape[-1]), terms.sum(0))
    for name, leaf, single_leaf, exact_leaf, scale in zip(
            ("hidden", "weight", "bias"), leaves, single_leaves, exact_leaves, scales):
        grad = leaf.grad
        if isinstance(leaf, DTensor):
            assert grad.placements == leaf.placements, (name, grad.placements)
            grad = grad.full_tensor()
        assert_close_elementwise(grad, exact_leaf.grad, single_leaf.grad, scale=scale,
                                 dtype=dtype, name=f"{op} grad {name}")


def _linear_distill_case(placement, reduction, plain_weights=False):
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh()
        student = _head(dtype, 0)
        teacher = _head(dtype, 1, hidden_size=HIDDEN + 2)
        target = _target()
        options = dict(beta=0.5, temperature=0.8, reduction=reduction)
        hidden = distribute_tensor(student[0], mesh, _placements(placement)).requires_grad_(True)
        params = [t.clone().requires_grad_(True) if plain_weights else
                  distribute_tensor(t, mesh, _placements("R")).requires_grad_(True)
                  for t in student[1:]]
        teacher_hidden = distribute_tensor(teacher[0], mesh, _placements(placement))
        out = ak.linear_distill_loss(hidden, params[0], teacher_hidden, teacher[1], target,
                                     student_bias=params[1], teacher_bias=teacher[2],
                                     chunk_size=4, **options)
        singles = [t.clone().requires_grad_(True) for t in student]
        single = ak.linear_distill_loss(singles[0], singles[1], *teacher[:2], target,
                                        student_bias=singles[2], teacher_bias=teacher[2],
                                        chunk_size=4, **options)
        exacts = [t.double().requires_grad_(True) for t in student]
        teacher64 = torch.nn.functional.linear(*(t.double() for t in teacher))
        logits64 = torch.nn.functional.linear(*exacts)
        exact = reference.distill_loss(logits64, teacher64, target, 0.5, 0.8, -100, reduction)
        _judge_head("linear_distill_loss", out, single, exact, [hidden, *params], singles,
                    exacts, logits64, dtype)
    return case


def _linear_topk_case(placement, reduction):
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh()
        head = _head(dtype, 0)
        ids, teacher = _support()
        labels = _target()
        options = dict(temperature=0.8, reduction=reduction)
        leaves = [distribute_tensor(head[0], mesh, _placements(placement)).requires_grad_(True),
                  *(distribute_tensor(t, mesh, _placements("R")).requires_grad_(True)
                    for t in head[1:])]
        out = ak.linear_topk_distill_loss(leaves[0], leaves[1], ids, teacher, labels,
                                          bias=leaves[2], chunk_size=4, **options)
        singles = [t.clone().requires_grad_(True) for t in head]
        single = ak.linear_topk_distill_loss(singles[0], singles[1], ids, teacher, labels,
                                             bias=singles[2], chunk_size=4, **options)
        exacts = [t.double().requires_grad_(True) for t in head]
        logits64 = torch.nn.functional.linear(*exacts)
        exact = reference.topk_distill_loss(logits64, ids, teacher.double(), labels, 0.0, 0.8,
                                            True, None, reduction)
        _judge_head("linear_topk_distill_loss", out, single, exact, leaves, singles, exacts,
                    logits64, dtype)
    return case


PREFERENCE = {
    "dpo_loss": lambda a, b, c, d: ak.dpo_loss(a, b, c, d, beta=0.1),
    "orpo_loss": lambda a, b, c, d: ak.orpo_loss(a - 3.0, b - 3.0, beta=0.1),
    "simpo_loss": lambda a, b, c, d: ak.simpo_loss(a, b),
    "cpo_loss": lambda a, b, c, d: ak.cpo_loss(a, b, alpha=0.5),
    "kto_loss": lambda a, b, c, d: ak.kto_loss(a, c, d > 0, kl=0.0),
}


def _preference_case(name):
    """A preference loss on sequence log-probs ``[B]`` sharded over the batch: the loss and the
    metrics (the full batch's) and every gradient, against the one-process call and float64."""
    def case(dtype):
        from torch.distributed.tensor import DTensor, distribute_tensor

        mesh = _mesh()
        g = torch.Generator().manual_seed(9)
        full = [(torch.randn(6, generator=g) * 2 - 8).to(dtype) for _ in range(4)]
        leaves = [distribute_tensor(t, mesh, _placements(0)).requires_grad_(True) for t in full]
        singles = [t.clone().requires_grad_(True) for t in full]
        exacts = [t.double().requires_grad_(True) for t in full]
        (loss, metrics), (single, single_metrics), (exact, exact_metrics) = (
            PREFERENCE[name](*inputs) for inputs in (leaves, singles, exacts))
        assert isinstance(loss, DTensor), type(loss)
        assert_close(loss.full_tensor(), exact, "value", dtype, f"{name} loss",
                     naive=single.detach())
        for key, value in metrics.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            assert_close(value.float(), exact_metrics[key], "value", dtype, f"{name} {key}",
                         naive=single_metrics[key].detach().float())
        loss.backward()
        single.backward()
        exact.backward()
        for index, (leaf, single_leaf, exact_leaf) in enumerate(zip(leaves, singles, exacts)):
            if exact_leaf.grad is None:
                assert leaf.grad is None and single_leaf.grad is None, (name, index)
                continue
            assert leaf.grad.placements == leaf.placements, (name, index, leaf.grad.placements)
            assert_close_elementwise(leaf.grad.full_tensor(), exact_leaf.grad, single_leaf.grad,
                                     dtype=dtype, name=f"{name} grad {index}")
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
    # a reduction the op refuses is refused on row shards too (they reduce by a sum and a count)
    ids, teacher_logprobs = _support()
    for reduction in ("mean", "token_mean"):
        with pytest.raises(ValueError, match="reduction"):
            ak.topk_distill_loss(rows, ids, teacher_logprobs, reduction=reduction)
    with pytest.raises(ValueError, match="reduction"):
        ak.distill_loss(rows, distribute_tensor(teacher, mesh, _placements(0)),
                        reduction="token_mean")
    hidden, weight, _ = _head(dtype, 0)
    colwise = distribute_tensor(weight, mesh, _placements(0))
    with pytest.raises(ValueError, match=r"linear_topk_distill_loss: weight is a DTensor with "
                       r"placements \(Shard\(dim=0\),\).*no vocabulary-parallel path.*"
                       r"weight\.redistribute\(weight\.device_mesh, \[Replicate\(\)\]\)"):
        ak.linear_topk_distill_loss(hidden, colwise, torch.zeros(BATCH, LENGTH, K,
                                                                 dtype=torch.int64),
                                    torch.full((BATCH, LENGTH, K), -2.0))


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
    "linear_distill_rows0_batchmean": _linear_distill_case(0, "batchmean"),
    "linear_distill_rows1_mean_plain_weights": _linear_distill_case(1, "mean", plain_weights=True),
    "linear_distill_rows0_none": _linear_distill_case(0, "none"),
    "linear_topk_rows0_batchmean": _linear_topk_case(0, "batchmean"),
    "linear_topk_rows1_sum": _linear_topk_case(1, "sum"),
    **{f"preference_{name}": _preference_case(name) for name in PREFERENCE},
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
def test_dtensor_losses(outcomes, name, dtype_id):
    assert_ranks_passed(outcomes, f"{name}-{dtype_id}")
