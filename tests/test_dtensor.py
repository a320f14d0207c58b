"""DTensor arguments of the ops (``distributed/dtensor.py``) on 2 gloo CPU ranks against the
single-process op on the full tensors: the values, the gradients' values and placements, and the
results' placements, float32 and bfloat16.

Served: logits ``Shard(-1)`` (V = 11 splits 6/5), row shards (``Shard(0)``, ``Shard(1)``, uneven,
one rank's rows all ignored), ``Replicate``, plain tensors beside DTensors; the fused head with a
``Shard(0)`` weight (ColwiseParallel) beside replicated or row-sharded hidden states, and a
replicated weight beside row-sharded hidden states; 2-D meshes of 2x1 and 1x2. Refused with a
clear error: Partial logits, a weight sharded on the hidden size, and the rest of the table.
``grpo_loss`` (grpo, bnpo, dr_grpo, dapo) and ``sequence_logprobs``: rows ``Shard(0)`` (3
sequences split 2/1, masks uneven) and the vocabulary ``Shard(-1)``, float32 only.

Each entry is judged per element against the float64 reference, allowed twice the single-process
op's own error on it (its ``naive``) plus the tolerance table's terms. One spawn of 2 processes
runs every case; each case's outcome per rank comes back to a test of its own.
"""

import functools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close, assert_close_elementwise, spec
from astrai_kernels.testing.multiprocess import (
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)

from cases import ROOT, subprocess_env

VOCAB = 11  # torch.chunk's split over 2 ranks: 6 and 5
BATCH, LENGTH, HIDDEN = 2, 5, 8  # Shard(1) of the length splits 3 and 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LABEL_SMOOTHING, TEMPERATURE = 0.1, 0.8


def _target(second_batch_ignored=False):
    target = (torch.arange(BATCH * LENGTH) * 7 % VOCAB).reshape(BATCH, LENGTH)
    target[0, 2] = target[1, 3] = -100
    if second_batch_ignored:  # under Shard(0) one rank holds only ignored rows
        target[1] = -100
    return target


def _logits(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 3).to(dtype)


def _head(dtype):
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 3).to(dtype)
    bias = (torch.randn(VOCAB, generator=g) * 0.5).to(dtype)
    return hidden, weight, bias


def _upstream(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)  # one mesh (and its process groups) per shape
def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[:len(shape)])


def _placements(*names):
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Replicate() if name == "R" else Shard(name) for name in names)


def _leaf(full, mesh, placements):
    """``full`` as a DTensor leaf with ``placements``, or a plain leaf when None."""
    from torch.distributed.tensor import distribute_tensor

    if placements is None:
        return full.detach().clone().requires_grad_(True)
    return distribute_tensor(full.detach(), mesh, placements).requires_grad_(True)


def _call(op, inputs, target, options):
    """The op's outputs as a tuple. ``inputs``: ``(logits,)`` or ``(hidden, weight, bias)``."""
    if op in ("cross_entropy", "token_logprobs"):
        out = getattr(ak, op)(inputs[0], target, **options)
    else:
        out = getattr(ak, op)(inputs[0], inputs[1], target, bias=inputs[2], **options)
    return out if isinstance(out, tuple) else (out,)


def _reference(op, inputs, target, options):
    """The op in float64 on the full tensors, as a tuple of outputs."""
    logits = inputs[0] if len(inputs) == 1 else F.linear(*inputs)
    if op.endswith("token_logprobs"):
        return reference.token_logprobs(logits, target, options["temperature"])
    loss = reference.cross_entropy(logits, target, reduction=options.get("reduction", "mean"),
                                   label_smoothing=options.get("label_smoothing", 0.0))
    return (loss.reshape(target.shape) if loss.dim() else loss,)


def _logits_grad_terms(op, logits64, target, options, upstream):
    """Per logit, the size of the terms forming its gradient (``testing/spec.py``)."""
    flat = target.reshape(-1)
    if op.endswith("token_logprobs"):
        return spec.logprobs_terms(logits64, flat, options["temperature"], -100, True,
                                   upstream[0].reshape(-1), upstream[1].reshape(-1))["grad_terms"]
    reduction = options.get("reduction", "mean")
    row_scale = {"none": upstream[0],
                 "sum": upstream[0].expand(target.shape),
                 "mean": upstream[0] / (target != -100).sum()}[reduction]
    return spec.cross_entropy_terms(logits64, flat, -100, options.get("label_smoothing", 0.0),
                                    0.0, 0.0, row_scale.reshape(-1))


def _check(op, full_inputs, placements, target, options, result_placements, mesh, dtype,
           target_placements=None):
    """``op`` on DTensors (``placements`` per input; None: a plain tensor) against the single
    process op and the float64 reference on the full tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    leaves = [_leaf(full, mesh, places) for full, places in zip(full_inputs, placements)]
    target_arg = (target if target_placements is None
                  else distribute_tensor(target, mesh, target_placements))
    out = _call(op, leaves, target_arg, options)
    upstream = [_upstream(result.shape, seed) for seed, result in enumerate(out)]
    for result in out:
        assert isinstance(result, DTensor), type(result)
        assert result.placements == result_placements, (result.placements, result_placements)
    torch.autograd.backward(out, [distribute_tensor(grad, mesh, result.placements)
                                  for grad, result in zip(upstream, out)])

    single_leaves = [full.detach().clone().requires_grad_(True) for full in full_inputs]
    single = _call(op, single_leaves, target, options)
    torch.autograd.backward(single, upstream)
    exact_leaves = [full.detach().double().requires_grad_(True) for full in full_inputs]
    exact = _reference(op, exact_leaves, target, options)
    torch.autograd.backward(exact, [grad.double() for grad in upstream])

    logits64 = (exact_leaves[0] if len(full_inputs) == 1 else F.linear(*exact_leaves)).detach()
    entropy_terms = None
    if op.endswith("token_logprobs"):
        entropy_terms = spec.logprobs_terms(logits64, target.reshape(-1), options["temperature"],
                                            -100, True)["entropy_terms"].reshape(target.shape)
    for index, (result, single_result, exact_result) in enumerate(zip(out, single, exact)):
        scale = entropy_terms if index == 1 else None  # the entropy cancels: judge by its terms
        assert_close(result.full_tensor(), exact_result, "value", dtype, f"{op} output {index}",
                     naive=single_result.detach(), scale=scale)
    dz = _logits_grad_terms(op, logits64, target, options, upstream).reshape(-1, VOCAB)
    if len(full_inputs) == 1:
        scales = (dz.reshape(logits64.shape),)
    else:
        hidden64, weight64, _ = (t.detach() for t in exact_leaves)
        rows = hidden64.abs().reshape(-1, HIDDEN)
        scales = ((dz @ weight64.abs()).reshape(hidden64.shape), dz.t() @ rows, dz.sum(0))
    names = ("logits",) if len(full_inputs) == 1 else ("hidden", "weight", "bias")
    for name, leaf, places, single_leaf, exact_leaf, scale in zip(
            names, leaves, placements, single_leaves, exact_leaves, scales):
        grad = leaf.grad
        if places is None:
            assert not isinstance(grad, DTensor), name
        else:
            assert grad.placements == leaf.placements, (name, grad.placements, leaf.placements)
            grad = grad.full_tensor()
        assert grad.dtype == dtype, name
        assert_close_elementwise(grad, exact_leaf.grad, single_leaf.grad, scale=scale,
                                 dtype=dtype, name=f"{op} grad {name}")


CE_MEAN = dict(label_smoothing=LABEL_SMOOTHING)
LOGPROBS = dict(temperature=TEMPERATURE, return_entropy=True)


def _logits_case(op, placements, options, result_placements, second_batch_ignored=False,
                 target_placements=None, mesh_shape=(2,), rows=None):
    """A case of a logits op (``placements`` None: plain logits); ``rows`` flattens the logits
    to ``[rows, V]`` (the first ones)."""
    def case(dtype):
        full, target = _logits(dtype), _target(second_batch_ignored)
        if rows is not None:
            full, target = full.reshape(-1, VOCAB)[:rows], target.reshape(-1)[:rows]
        logits_placements = None if placements is None else _placements(*placements)
        _check(op, (full,), (logits_placements,), target, options,
               _placements(*result_placements), _mesh(mesh_shape), dtype,
               None if target_placements is None else _placements(*target_placements))
    return case


def _head_case(op, hidden, weight, options, result_placements, second_batch_ignored=False,
               target_placements=None, mesh_shape=(2,), bias="weight"):
    """A case of a fused-head op: placements of hidden (None: a plain tensor) and weight; the
    bias's are the weight's unless given."""
    def case(dtype):
        bias_places = weight if bias == "weight" else bias
        placements = tuple(None if p is None else _placements(*p)
                           for p in (hidden, weight, bias_places))
        _check(op, _head(dtype), placements, _target(second_batch_ignored), options,
               _placements(*result_placements), _mesh(mesh_shape), dtype,
               None if target_placements is None else _placements(*target_placements))
    return case


CASES = {
    # logits sharded over the vocabulary: the process_group= path over the mesh dimension
    "vocab_mean": _logits_case("cross_entropy", (-1,), CE_MEAN, ("R",)),
    "vocab_none": _logits_case("cross_entropy", (-1,), dict(reduction="none"), ("R",),
                               target_placements=("R",)),
    "vocab_sum_2d_logits": _logits_case("cross_entropy", (-1,), dict(reduction="sum"), ("R",),
                                        rows=7),
    "vocab_logprobs": _logits_case("token_logprobs", (-1,), LOGPROBS, ("R",)),
    # logits sharded over rows: the op on the local rows, a global mean (with one rank's rows all
    # ignored the other rank holds every counted row, so only the other cases tell a per-rank mean)
    "rows_mean_rank_all_ignored": _logits_case("cross_entropy", (0,), CE_MEAN, ("R",),
                                               second_batch_ignored=True),
    "rows_mean_uneven": _logits_case("cross_entropy", (1,), CE_MEAN, ("R",),
                                     target_placements=(1,)),
    "rows_sum": _logits_case("cross_entropy", (0,), dict(reduction="sum"), ("R",),
                             second_batch_ignored=True),
    "rows_none_uneven": _logits_case("cross_entropy", (0,), dict(reduction="none"), (0,),
                                     target_placements=("R",), rows=7),
    "rows_logprobs": _logits_case("token_logprobs", (1,), LOGPROBS, (1,)),
    "rows_mean_rank_without_rows": _logits_case("cross_entropy", (0,), CE_MEAN, ("R",), rows=1),
    "rows_logprobs_rank_without_rows": _logits_case("token_logprobs", (0,), LOGPROBS, (0,),
                                                    rows=1),
    # replicated logits: the op as it is
    "replicate_mean": _logits_case("cross_entropy", ("R",), CE_MEAN, ("R",)),
    "replicate_logprobs": _logits_case("token_logprobs", ("R",), LOGPROBS, ("R",),
                                       target_placements=(0,)),
    "plain_logits_sharded_target": _logits_case("cross_entropy", None, dict(reduction="none"),
                                                ("R",), target_placements=(1,)),
    # 2-D meshes (dp, tp)
    "mesh2x1_rows_vocab_mean": _logits_case("cross_entropy", (0, -1), CE_MEAN, ("R", "R"),
                                            mesh_shape=(2, 1)),
    "mesh1x2_rows_vocab_none": _logits_case("cross_entropy", (0, -1), dict(reduction="none"),
                                            (0, "R"), mesh_shape=(1, 2)),
    "mesh2x1_rows_logprobs": _logits_case("token_logprobs", (1, "R"), LOGPROBS, (1, "R"),
                                          mesh_shape=(2, 1)),
    # the fused head: ColwiseParallel's weight Shard(0) beside replicated hidden states
    "head_colwise_plain_hidden": _head_case("linear_cross_entropy", None, (0,), CE_MEAN, ("R",)),
    "head_colwise_none": _head_case("linear_cross_entropy", ("R",), (0,),
                                    dict(reduction="none"), ("R",), bias=("R",)),
    "head_colwise_logprobs": _head_case("linear_token_logprobs", ("R",), (0,), LOGPROBS, ("R",)),
    # sequence parallel: hidden rows gathered, per-row results sharded as the hidden states
    "head_sequence_parallel_mean": _head_case("linear_cross_entropy", (1,), (0,), CE_MEAN,
                                              ("R",), target_placements=(1,)),
    "head_sequence_parallel_none": _head_case("linear_cross_entropy", (1,), (0,),
                                              dict(reduction="none"), (1,)),
    "head_sequence_parallel_logprobs": _head_case("linear_token_logprobs", (0,), (0,),
                                                  LOGPROBS, (0,)),
    # rows sharded beside a replicated head: a global mean, the weight's gradient summed
    "head_rows_mean_rank_all_ignored": _head_case("linear_cross_entropy", (0,), ("R",),
                                                  CE_MEAN, ("R",), second_batch_ignored=True),
    "head_rows_mean_uneven": _head_case("linear_cross_entropy", (1,), ("R",), CE_MEAN, ("R",)),
    "head_rows_logprobs": _head_case("linear_token_logprobs", (1,), ("R",), LOGPROBS, (1,),
                                     bias=None),
    "head_mesh2x1_rows_vocab_sum": _head_case("linear_cross_entropy", (0, "R"), ("R", 0),
                                              dict(reduction="sum"), ("R", "R"),
                                              mesh_shape=(2, 1)),
    "head_mesh1x2_sequence_parallel_none": _head_case("linear_cross_entropy", ("R", 1),
                                                      ("R", 0), dict(reduction="none"),
                                                      ("R", 1), mesh_shape=(1, 2)),
}


def _refused(dtype):
    """Placements that would need an [N, V] gather, or that no path serves: a ValueError naming
    the placements and the redistribute that would serve."""
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    mesh = _mesh((2,))
    full, target = _logits(dtype), _target()
    partial = DTensor.from_local(full / 2, mesh, [Partial()], run_check=False)
    with pytest.raises(ValueError, match=r"logits is a DTensor with placements \(Partial\(sum\),\)"
                       r".*logits\.redistribute\(logits\.device_mesh, \[Shard\(dim=2\)\]\)"):
        ak.cross_entropy(partial, target)
    with pytest.raises(ValueError, match=r"logits is a DTensor with placements \(Partial"):
        ak.token_logprobs(partial, target)
    hidden, weight, _ = _head(dtype)
    rowwise = distribute_tensor(weight, mesh, _placements(1))
    with pytest.raises(ValueError, match=r"weight is a DTensor with placements \(Shard\(dim=1\),\)"
                       r".*weight\.redistribute\(weight\.device_mesh, \[Shard\(dim=0\)\]\)"):
        ak.linear_cross_entropy(hidden, rowwise, target)
    hidden_split = distribute_tensor(hidden, mesh, _placements(-1))
    colwise = distribute_tensor(weight, mesh, _placements(0))
    with pytest.raises(ValueError, match=r"hidden is a DTensor with placements \(Shard\(dim=2\),\)"
                       r".*hidden\.redistribute\(hidden\.device_mesh, \[Replicate\(\)\]\)"):
        ak.linear_token_logprobs(hidden_split, colwise, target)
    twice = distribute_tensor(full, _mesh((2, 1)), _placements(-1, -1))
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) on mesh dimension 1 is not served"):
        ak.cross_entropy(twice, target)
    sharded = distribute_tensor(full, mesh, _placements(-1))
    with pytest.raises(ValueError, match="process_group must be None with DTensor"):
        ak.cross_entropy(sharded, target, process_group=mesh.get_group(0))
    with pytest.raises(ValueError, match=r"target must have the shape of the leading "
                       r"dimensions of logits, \(2, 5\), got \(2, 4\)"):
        ak.cross_entropy(sharded, target[:, :-1])


CASES["refused_placements"] = _refused


def _no_dtensor_route(dtype):
    """A door without a DTensor route refuses a DTensor argument by name, before any of
    torch's mixed Tensor/DTensor errors (every public op has one today: a door built here)."""
    from typing import NamedTuple

    from torch.distributed.tensor import distribute_tensor

    from astrai_kernels.ops.door import Door

    class SumOfCall(NamedTuple):
        logits: torch.Tensor
        target: torch.Tensor

    def sum_of(logits, target):
        return door.enter(SumOfCall(logits=logits, target=target))

    def unreachable(*args):
        raise AssertionError("a DTensor reached a route")

    door = Door(sum_of, ("logits", "target"), unreachable, unreachable, unreachable)
    sharded = distribute_tensor(_logits(dtype), _mesh((2,)), _placements(-1))
    with pytest.raises(TypeError, match=r"sum_of does not take DTensor arguments \(got "
                       r"logits\)"):
        sum_of(sharded, _target())


_no_dtensor_route.fp32_only = True
CASES["no_dtensor_route"] = _no_dtensor_route


def _inplace(dtype):
    """``inplace_backward=True``: on the vocabulary path the gradient is written over the local
    logits; on a row shard the op cannot write over ``to_local()``'s view (autograd forbids it),
    so the logits are kept. The gradient is the one of the call without it, bit for bit."""
    from torch.distributed.tensor import distribute_tensor

    mesh, full, target = _mesh((2,)), _logits(dtype, seed=5), _target()
    for placements, overwritten in ((_placements(-1), True), (_placements(0), False)):
        grads = []
        for inplace in (False, True):
            leaf = distribute_tensor(full, mesh, placements).requires_grad_(True)
            logits = leaf * 1
            ak.cross_entropy(logits, target, label_smoothing=LABEL_SMOOTHING,
                             inplace_backward=inplace).backward()
            grads.append(leaf.grad.to_local())
        assert torch.equal(grads[0], grads[1]), placements
        if overwritten:
            assert torch.equal(logits.detach().to_local(), grads[1]), placements
        else:
            assert torch.equal(logits.detach().full_tensor(), full), placements


CASES["inplace_backward"] = _inplace


def _replicated_normalizer(dtype):
    """A normalizer given as a Replicate DTensor (a global count) replaces the counted rows',
    beside logits sharded over rows and beside plain logits (the normalizer is then the only
    DTensor); a sharded one is refused."""
    from torch.distributed.tensor import distribute_tensor

    mesh, full, target = _mesh((2,)), _logits(dtype, seed=6), _target()
    count = torch.tensor(23.0)
    normalizer = distribute_tensor(count, mesh, _placements("R"))
    exact_leaf = full.detach().double().requires_grad_(True)
    exact = reference.cross_entropy(exact_leaf, target, normalizer=count)
    exact.backward()
    single_leaf = full.detach().clone().requires_grad_(True)
    single = ak.cross_entropy(single_leaf, target, normalizer=count)
    single.backward()
    scale = spec.cross_entropy_terms(exact_leaf.detach(), target.reshape(-1), -100, 0.0, 0.0, 0.0,
                                     torch.ones(()) / count)
    for placements in (_placements(0), None):
        leaf = _leaf(full, mesh, placements)
        loss = ak.cross_entropy(leaf, target, normalizer=normalizer)
        assert loss.placements == _placements("R")
        assert_close(loss.full_tensor(), exact, "value", dtype, "loss", naive=single.detach())
        loss.backward()
        grad = leaf.grad if placements is None else leaf.grad.full_tensor()
        assert_close_elementwise(grad, exact_leaf.grad, single_leaf.grad, scale=scale,
                                 dtype=dtype, name="grad")
    sharded = distribute_tensor(torch.ones(2) * count / 2, mesh, _placements(0))
    with pytest.raises(ValueError, match=r"normalizer is a DTensor with placements "
                       r"\(Shard\(dim=0\),\).*normalizer\.redistribute"):
        ak.cross_entropy(full, target, normalizer=sharded)


CASES["replicated_normalizer"] = _replicated_normalizer


def _colwise_recipe(dtype):
    """docs/distributed.md's recipe: an ``nn.Linear`` LM head under ColwiseParallel
    (``use_local_output=False``) through the fused head (weight and bias ``Shard(0)``, plain
    hidden states) and through its ``Shard(-1)`` logits, against the unsharded head."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    hidden_full, weight, bias = _head(dtype)
    target = _target()
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, dtype=dtype)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
        lm_head.bias.copy_(bias)
    parallelize_module(lm_head, _mesh((2,)), ColwiseParallel(use_local_output=False))
    for fused in (True, False):
        hidden = hidden_full.clone().requires_grad_(True)
        lm_head.zero_grad()
        if fused:
            loss = ak.linear_cross_entropy(hidden, lm_head.weight, target, bias=lm_head.bias,
                                           **CE_MEAN)
        else:
            logits = lm_head(hidden)
            assert isinstance(logits, DTensor) and logits.placements == _placements(2)
            loss = ak.cross_entropy(logits, target, **CE_MEAN)
        loss.backward()
        single = [t.detach().clone().requires_grad_(True) for t in (hidden_full, weight, bias)]
        if fused:
            single_loss = ak.linear_cross_entropy(single[0], single[1], target, bias=single[2],
                                                  **CE_MEAN)
        else:
            single_loss = ak.cross_entropy(F.linear(*single), target, **CE_MEAN)
        single_loss.backward()
        exact = [t.detach().double().requires_grad_(True) for t in (hidden_full, weight, bias)]
        exact_loss = reference.cross_entropy(F.linear(*exact), target, **CE_MEAN)
        exact_loss.backward()
        assert loss.placements == _placements("R")
        assert_close(loss.full_tensor(), exact_loss, "value", dtype, "recipe loss",
                     naive=single_loss.detach())
        logits64 = F.linear(*(t.detach() for t in exact))
        dz = spec.cross_entropy_terms(logits64, target.reshape(-1), -100, LABEL_SMOOTHING, 0.0,
                                      0.0, torch.ones(()) / (target != -100).sum())
        dz = dz.reshape(-1, VOCAB)
        rows = exact[0].detach().abs().reshape(-1, HIDDEN)
        scales = ((dz @ exact[1].detach().abs()).reshape(hidden.shape), dz.t() @ rows, dz.sum(0))
        grads = (hidden.grad, lm_head.weight.grad, lm_head.bias.grad)
        for name, grad, want, naive, scale in zip(("hidden", "weight", "bias"), grads, exact,
                                                  single, scales):
            if name != "hidden":
                assert grad.placements == _placements(0), (name, grad.placements)
                grad = grad.full_tensor()
            assert_close_elementwise(grad, want.grad, naive.grad, scale=scale, dtype=dtype,
                                     name=f"recipe grad {name} (fused={fused})")


CASES["colwise_parallel_recipe"] = _colwise_recipe


GRPO_BATCH = 3  # Shard(0) of the sequences splits 2 and 1


def _grpo_inputs():
    """Logits ``[3, 5, 11]``, targets, and per-row inputs with masks uneven across the ranks'
    rows (4 + 2 unmasked tokens on rank 0's two sequences, 3 on rank 1's one)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(GRPO_BATCH, LENGTH, VOCAB, generator=g) * 2
    target = torch.randint(0, VOCAB, (GRPO_BATCH, LENGTH), generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    target[mask == 0] = -7  # masked targets are never read
    advantages = torch.randn(GRPO_BATCH, generator=g)
    old = (torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
           + 0.3 * torch.randn(GRPO_BATCH, LENGTH, generator=g))
    ref = old + 0.2 * torch.randn(GRPO_BATCH, LENGTH, generator=g)
    return logits, target, mask, advantages, old, ref


def _grpo_case(loss_type, logits_places, sharded_row_inputs=True, **extra):
    """``ak.grpo_loss`` of DTensor logits against the single-process op and the float64 spec
    on the full tensors: loss, metrics, the logits' gradient. With ``sharded_row_inputs`` the
    advantages and reference log-probs come as DTensors sharded like the logits' rows (the
    others plain full tensors, sliced to the local rows)."""
    def case(dtype):
        from torch.distributed.tensor import DTensor, distribute_tensor

        mesh = _mesh((2,))
        logits, target, mask, advantages, old, ref = _grpo_inputs()
        options = dict(loss_type=loss_type, beta=0.04, clip_eps_low=0.2, **extra)
        leaf = _leaf(logits, mesh, _placements(*logits_places))
        rows = _placements(0) if sharded_row_inputs else None
        advantages_arg = (advantages if rows is None
                          else distribute_tensor(advantages, mesh, rows))
        ref_arg = ref if rows is None else distribute_tensor(ref, mesh, rows)
        loss, metrics = ak.grpo_loss(leaf, target, advantages_arg, mask=mask, old_logprobs=old,
                                     ref_logprobs=ref_arg, **options)
        assert isinstance(loss, DTensor) and loss.placements == _placements("R")
        loss.backward()
        assert leaf.grad.placements == leaf.placements
        single_leaf = logits.clone().requires_grad_(True)
        single, single_metrics = ak.grpo_loss(single_leaf, target, advantages, mask=mask,
                                              old_logprobs=old, ref_logprobs=ref, **options)
        single.backward()
        exact_leaf = logits.double().requires_grad_(True)
        exact, _ = reference.grpo_loss(exact_leaf, target, advantages.double(), mask,
                                       old.double(), ref.double(), **options)
        exact.backward()
        assert_close(loss.full_tensor(), exact, "value", dtype, f"grpo {loss_type} loss",
                     naive=single.detach())
        assert_close_elementwise(leaf.grad.full_tensor(), exact_leaf.grad, single_leaf.grad,
                                 dtype=dtype, name=f"grpo {loss_type} grad logits")
        assert set(metrics) == set(single_metrics)
        for name, value in metrics.items():
            assert value.placements == _placements("R"), name
            torch.testing.assert_close(value.full_tensor(), single_metrics[name],
                                       rtol=1e-5, atol=1e-6, msg=name)
    case.fp32_only = True
    return case


def _sequence_case(logits_places, average, mask_places=None):
    """``ak.sequence_logprobs`` of DTensor logits: ``[B]`` sharded as the rows."""
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh((2,))
        logits, target, mask, *_ = _grpo_inputs()
        leaf = _leaf(logits, mesh, _placements(*logits_places))
        mask_arg = mask if mask_places is None else distribute_tensor(
            mask, mesh, _placements(*mask_places))
        out = ak.sequence_logprobs(leaf, target, mask_arg, average=average,
                                   temperature=TEMPERATURE)
        rows = _placements(0 if logits_places[0] == 0 else "R")
        assert out.placements == rows, out.placements
        upstream = _upstream(out.shape, 3)
        out.backward(distribute_tensor(upstream, mesh, rows))
        single_leaf = logits.clone().requires_grad_(True)
        single = ak.sequence_logprobs(single_leaf, target, mask, average=average,
                                      temperature=TEMPERATURE)
        single.backward(upstream)
        exact_leaf = logits.double().requires_grad_(True)
        exact = reference.sequence_logprobs(exact_leaf, torch.where(mask.bool(), target, -100),
                                            mask, average, TEMPERATURE)
        exact.backward(upstream.double())
        assert_close(out.full_tensor(), exact, "value", dtype, "sequence_logprobs",
                     naive=single.detach())
        assert_close_elementwise(leaf.grad.full_tensor(), exact_leaf.grad, single_leaf.grad,
                                 dtype=dtype, name="sequence_logprobs grad logits")
    case.fp32_only = True
    return case


def _grpo_refused(dtype):
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh((2,))
    logits, target, mask, advantages, old, ref = _grpo_inputs()
    length_split = distribute_tensor(logits, mesh, _placements(1))
    with pytest.raises(ValueError, match=r"grpo_loss: logits .*Shard\(dim=1\) on mesh dimension "
                       r"0 is not served.*Shard\(0\) \(whole sequences\).*Shard\(dim=0\)"):
        ak.grpo_loss(length_split, target, advantages, mask=mask)
    with pytest.raises(ValueError, match=r"sequence_logprobs: logits .*Shard\(dim=1\)"):
        ak.sequence_logprobs(length_split, target, mask)
    rows = distribute_tensor(logits, mesh, _placements(0))
    with pytest.raises(ValueError, match=r"do not serve top_entropy_quantile < 1"):
        ak.grpo_loss(rows, target, advantages, mask=mask, top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match=r"entropy_coef != 0 with loss_type='grpo'"):
        ak.grpo_loss(rows, target, advantages, mask=mask, loss_type="grpo", entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"advantages must have shape \(3, 5\) or \(3,\)"):
        ak.grpo_loss(rows, target, advantages[:2], mask=mask)


def _linear_grpo_inputs():
    """``_grpo_inputs``' targets and per-row inputs, with hidden states ``[3, 5, H]`` and a
    head ``[V, H]`` in place of the logits."""
    _, target, mask, advantages, old, ref = _grpo_inputs()
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(GRPO_BATCH, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 2
    return hidden, weight, target, mask, advantages, old, ref


def _assert_head_grads(leaves, exacts, singles, logits64, dtype, what):
    """The DTensor leaves' ``(hidden, weight)`` gradients per element against the float64 ones
    (``exacts``, whose logits ``logits64`` kept their gradient), allowed twice the
    single-process op's error (``singles``). Each entry is scaled by the size of the terms
    summed into it (``|dL/dlogits| @ |weight|``, and its transpose against ``|hidden|``): a
    matmul's rounding follows them, not the entry, which cancellation can make small."""
    hidden, weight = exacts
    terms = logits64.grad.abs().reshape(-1, logits64.shape[-1])
    scales = ((terms @ weight.detach().abs()).reshape(hidden.shape),
              terms.t() @ hidden.detach().abs().reshape(-1, hidden.shape[-1]))
    for name, leaf, exact, single, scale in zip(("hidden", "weight"), leaves, exacts, singles,
                                                scales):
        assert_close_elementwise(leaf.grad.full_tensor(), exact.grad, single.grad, scale=scale,
                                 dtype=dtype, name=f"{what} grad {name}")


def _linear_grpo_case(loss_type, hidden_places, weight_places, **extra):
    """``ak.linear_grpo_loss`` of a DTensor head (rows ``Shard(0)``, the weight ``Shard(0)``
    (ColwiseParallel), or both: sequence parallel) against the single-process op and the
    float64 spec: loss, metrics, the hidden states' and the weight's gradients."""
    def case(dtype):
        from torch.distributed.tensor import DTensor

        mesh = _mesh((2,))
        hidden, weight, target, mask, advantages, old, ref = _linear_grpo_inputs()
        options = dict(loss_type=loss_type, beta=0.04, **extra)
        leaves = (_leaf(hidden, mesh, _placements(*hidden_places)),
                  _leaf(weight, mesh, _placements(*weight_places)))
        loss, metrics, values = ak.linear_grpo_loss(
            *leaves, target, advantages, mask=mask, old_logprobs=old, ref_logprobs=ref,
            return_token_values=True, chunk_size=4, **options)
        assert isinstance(loss, DTensor) and loss.placements == _placements("R")
        assert values["logprobs"].placements == _placements(
            0 if hidden_places[0] == 0 else "R")
        loss.backward()
        for leaf in leaves:
            assert leaf.grad.placements == leaf.placements
        singles = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
        single, single_metrics, single_values = ak.linear_grpo_loss(
            *singles, target, advantages, mask=mask, old_logprobs=old, ref_logprobs=ref,
            return_token_values=True, **options)
        single.backward()
        exacts = (hidden.double().requires_grad_(True), weight.double().requires_grad_(True))
        logits64 = F.linear(*exacts)
        logits64.retain_grad()
        exact, _ = reference.grpo_loss(logits64, target, advantages.double(), mask,
                                       old.double(), ref.double(), **options)
        exact.backward()
        assert_close(loss.full_tensor(), exact, "value", dtype, f"linear grpo {loss_type}",
                     naive=single.detach())
        _assert_head_grads(leaves, exacts, singles, logits64, dtype, f"linear grpo {loss_type}")
        torch.testing.assert_close(values["logprobs"].full_tensor(), single_values["logprobs"],
                                   rtol=1e-5, atol=1e-6)
        assert set(metrics) == set(single_metrics)
        for name, value in metrics.items():
            torch.testing.assert_close(value.full_tensor(), single_metrics[name],
                                       rtol=1e-5, atol=1e-6, msg=name)
    case.fp32_only = True
    return case


def _linear_sequence_case(hidden_places, weight_places):
    """``ak.linear_sequence_logprobs`` of a DTensor head: ``[B]`` sharded as the hidden rows."""
    def case(dtype):
        from torch.distributed.tensor import distribute_tensor

        mesh = _mesh((2,))
        hidden, weight, target, mask, *_ = _linear_grpo_inputs()
        leaves = (_leaf(hidden, mesh, _placements(*hidden_places)),
                  _leaf(weight, mesh, _placements(*weight_places)))
        out = ak.linear_sequence_logprobs(*leaves, target, mask, temperature=TEMPERATURE)
        rows = _placements(0 if hidden_places[0] == 0 else "R")
        assert out.placements == rows, out.placements
        upstream = _upstream(out.shape, 4)
        out.backward(distribute_tensor(upstream, mesh, rows))
        singles = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
        single = ak.linear_sequence_logprobs(*singles, target, mask, temperature=TEMPERATURE)
        single.backward(upstream)
        exacts = (hidden.double().requires_grad_(True), weight.double().requires_grad_(True))
        logits64 = F.linear(*exacts)
        logits64.retain_grad()
        exact = reference.sequence_logprobs(logits64, torch.where(mask.bool(), target, -100),
                                            mask, False, TEMPERATURE)
        exact.backward(upstream.double())
        assert_close(out.full_tensor(), exact, "value", dtype, "linear_sequence_logprobs",
                     naive=single.detach())
        _assert_head_grads(leaves, exacts, singles, logits64, dtype, "linear_sequence_logprobs")
    case.fp32_only = True
    return case


_grpo_refused.fp32_only = True
CASES.update({
    "linear_grpo_rows_grpo": _linear_grpo_case("grpo", (0,), ("R",)),
    "linear_grpo_rows_bnpo": _linear_grpo_case("bnpo", (0,), ("R",)),
    "linear_grpo_vocab_dapo": _linear_grpo_case("dapo", ("R",), (0,)),
    "linear_grpo_vocab_gspo": _linear_grpo_case("grpo", ("R",), (0,),
                                                importance_sampling="sequence"),
    "linear_grpo_sequence_parallel": _linear_grpo_case("grpo", (0,), (0,)),
    "linear_sequence_logprobs_rows": _linear_sequence_case((0,), ("R",)),
    "linear_sequence_logprobs_vocab": _linear_sequence_case(("R",), (0,)),
    "linear_sequence_logprobs_sequence_parallel": _linear_sequence_case((0,), (0,)),
    "grpo_rows_grpo": _grpo_case("grpo", (0,)),
    "grpo_rows_bnpo": _grpo_case("bnpo", (0,), sharded_row_inputs=False),
    "grpo_rows_dr_grpo": _grpo_case("dr_grpo", (0,), max_completion_length=7),
    "grpo_rows_dapo_entropy_bonus": _grpo_case("dapo", (0,), entropy_coef=0.05),
    "grpo_vocab_grpo": _grpo_case("grpo", (-1,)),
    "grpo_vocab_bnpo": _grpo_case("bnpo", (-1,), sharded_row_inputs=False),
    "grpo_vocab_dr_grpo": _grpo_case("dr_grpo", (-1,)),
    "sequence_logprobs_rows": _sequence_case((0,), False, mask_places=(0,)),
    "sequence_logprobs_rows_average": _sequence_case((0,), True),
    "sequence_logprobs_vocab_average": _sequence_case((-1,), True, mask_places=(1,)),
    "grpo_refused_placements": _grpo_refused,
})


# the (case, dtype) pairs run: every case in both dtypes but the float32-only ones
CASE_DTYPES = [(name, dtype_id) for name, case in CASES.items() for dtype_id, dtype in
               DTYPES.items() if dtype == torch.float32 or not getattr(case, "fp32_only", False)]


def _worker(rank, world_size):
    """Every case of ``CASE_DTYPES``; ``{case id: error or None}``."""
    outcome = {}
    for name, dtype_id in CASE_DTYPES:
        outcome[f"{name}-{dtype_id}"] = case_outcome(CASES[name], DTYPES[dtype_id])
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 2, timeout=300.0)


@pytest.mark.parametrize("name, dtype_id", CASE_DTYPES,
                         ids=[f"{name}-{dtype_id}" for name, dtype_id in CASE_DTYPES])
def test_dtensor(outcomes, name, dtype_id):
    assert_ranks_passed(outcomes, f"{name}-{dtype_id}")


def test_plain_tensors_do_not_import_dtensor():
    """The front door's check costs no import: plain calls never load torch.distributed.tensor."""
    script = ("import sys, torch, astrai_kernels as ak\n"
              "ak.cross_entropy(torch.randn(3, 5), torch.tensor([0, 4, -100]))\n"
              "print('torch.distributed.tensor' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
