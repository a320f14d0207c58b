"""A bad input on one rank of a distributed call: every rank raises the same error, within
seconds (issue 45 item 2; docs/distributed.md, "Bad input on one rank").

Two gloo ranks; rank 1 alone passes a bad input (a target out of range, a wrong shape, a wrong
dtype, a NaN the op refuses, a bad bias shape) to each op family on each distributed route: row
shards of DTensors (``Shard(0)``), vocabulary shards of DTensors (``Shard(-1)`` logits, a
``Shard(0)`` weight) and ``process_group=``. Before the ranks agreed on their checks, rank 1
raised at once and rank 0 waited in the op's next collective until the process group's timeout
(30 minutes by default), or returned a result while rank 1 raised. The process group's timeout
is set to 60 s here, so such a wait fails the elapsed-time check instead of blocking CI. One
spawn runs every case; each case's outcome per rank comes back to a test of its own.
"""

import time

import pytest
import torch
import torch.distributed as dist

import astrai_kernels as ak
from astrai_kernels.testing.multiprocess import spawn_ranks

VOCAB = 11  # torch.chunk's split over 2 ranks: 6 and 5
SHARDS = ((0, 6), (6, 11))
BATCH, LENGTH, HIDDEN, K = 2, 5, 8, 3
BAD_RANK = 1
GROUP_TIMEOUT_S = 60.0
# far below GROUP_TIMEOUT_S, far above a call on 2 shared CPU cores
AGREED_WITHIN_S = 15.0


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 3


def _target():
    target = (torch.arange(BATCH * LENGTH) * 7 % VOCAB).reshape(BATCH, LENGTH)
    target[0, 2] = -100
    return target


def _head():
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 3
    bias = torch.randn(VOCAB, generator=g) * 0.5
    return hidden, weight, bias


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _rows(full, rank):
    """``full`` as a DTensor sharded on its first dimension (half the rows on each rank)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(full.chunk(2)[rank].clone(), _mesh(), (Shard(0),),
                              run_check=False, shape=full.shape, stride=full.stride())


def _vocab(full, rank, dim=-1):
    """``full`` as a DTensor sharded on its vocabulary dimension ``dim`` (6 / 5 ids)."""
    from torch.distributed.tensor import DTensor, Shard

    start, stop = SHARDS[rank]
    local = full.narrow(dim, start, stop - start).clone()
    return DTensor.from_local(local, _mesh(), (Shard(dim % full.dim()),), run_check=False,
                              shape=full.shape, stride=full.stride())


def _bad_here(rank):
    return rank == BAD_RANK


def _out_of_range(target, rank):
    """``target`` with one counted id outside ``[0, V)`` on the bad rank (in its rows under
    ``_rows``)."""
    target = target.clone()
    if _bad_here(rank):
        target[1, 1] = VOCAB
    return target


def _grpo_inputs():
    g = torch.Generator().manual_seed(6)
    target = torch.where(_target() == -100, 0, _target())
    mask = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    mask[0, 4] = False
    advantages = torch.randn(BATCH, generator=g)
    return target, mask, advantages


# DTensor, rows sharded (Shard(0))

def cross_entropy_rows_target_range(rank):
    # the bad id lies in the bad rank's rows: a DTensor target's local shard
    ak.cross_entropy(_rows(_logits(), rank), _rows(_out_of_range(_target(), rank), rank))


def cross_entropy_rows_target_dtype(rank):
    target = _target()
    ak.cross_entropy(_rows(_logits(), rank), target.float() if _bad_here(rank) else target,
                     reduction="sum")


def token_logprobs_rows_target_shape(rank):
    target = _target()
    ak.token_logprobs(_rows(_logits(), rank), target[:, :-1] if _bad_here(rank) else target)


def linear_cross_entropy_rows_target_range(rank):
    hidden, weight, bias = _head()
    ak.linear_cross_entropy(_rows(hidden, rank), weight, _out_of_range(_target(), rank),
                            bias=bias)


def linear_cross_entropy_rows_weight_shape(rank):
    hidden, weight, bias = _head()
    ak.linear_cross_entropy(_rows(hidden, rank), weight.flatten() if _bad_here(rank) else weight,
                            _target(), bias=bias)


def linear_topk_distill_rows_support_range(rank):
    hidden, weight, bias = _head()
    ids = torch.arange(BATCH * LENGTH * K).reshape(BATCH, LENGTH, K) % VOCAB
    if _bad_here(rank):
        ids[1, 3, 2] = -1
    ak.linear_topk_distill_loss(_rows(hidden, rank), weight, ids,
                                torch.full((BATCH, LENGTH, K), -2.0), bias=bias)


def grpo_rows_target_range(rank):
    target, mask, advantages = _grpo_inputs()
    ak.grpo_loss(_rows(_logits(), rank), _out_of_range(target, rank), advantages, mask=mask,
                 loss_type="dapo")


def grpo_rows_importance_weights_nan(rank):
    target, mask, advantages = _grpo_inputs()
    weights = torch.ones(BATCH, LENGTH)
    if _bad_here(rank):
        weights[1, 2] = float("nan")
    ak.grpo_loss(_rows(_logits(), rank), target, advantages, mask=mask, loss_type="dapo",
                 importance_weights=weights)


def grpo_rows_advantages_shape(rank):
    target, mask, advantages = _grpo_inputs()
    if _bad_here(rank):
        advantages = torch.cat([advantages, advantages])
    ak.grpo_loss(_rows(_logits(), rank), target, advantages, mask=mask, loss_type="grpo")


def sequence_logprobs_rows_mask_shape(rank):
    target, mask, _ = _grpo_inputs()
    ak.sequence_logprobs(_rows(_logits(), rank), target, mask[:, :-1] if _bad_here(rank) else mask)


def distill_rows_target_range(rank):
    ak.distill_loss(_rows(_logits(0), rank), _rows(_logits(1), rank),
                    _out_of_range(_target(), rank))


def topk_distill_rows_support_range(rank):
    ids = torch.arange(BATCH * LENGTH * K).reshape(BATCH, LENGTH, K) % VOCAB
    if _bad_here(rank):
        ids[1, 0, 0] = VOCAB
    teacher = torch.full((BATCH, LENGTH, K), -2.0)
    ak.topk_distill_loss(_rows(_logits(), rank), ids, teacher)


def topk_distill_rows_teacher_shape(rank):
    ids = torch.arange(BATCH * LENGTH * K).reshape(BATCH, LENGTH, K) % VOCAB
    teacher = torch.full((BATCH, LENGTH, K + int(_bad_here(rank))), -2.0)
    ak.topk_distill_loss(_rows(_logits(), rank), ids, teacher)


def dpo_rows_shape(rank):
    g = torch.Generator().manual_seed(9)
    chosen, rejected, ref_chosen = (torch.randn(4, generator=g) - 8 for _ in range(3))
    ref_rejected = torch.randn(3 if _bad_here(rank) else 4, generator=g) - 8
    ak.dpo_loss(_rows(chosen, rank), _rows(rejected, rank), ref_chosen, ref_rejected)


# DTensor, the vocabulary sharded

def cross_entropy_vocab_target_range(rank):
    ak.cross_entropy(_vocab(_logits(), rank), _out_of_range(_target(), rank))


def grpo_vocab_advantages_shape(rank):
    target, mask, advantages = _grpo_inputs()
    if _bad_here(rank):
        advantages = advantages[:1]
    ak.grpo_loss(_vocab(_logits(), rank), target, advantages, mask=mask)


def linear_token_logprobs_vocab_bias_shape(rank):
    hidden, weight, bias = _head()
    bias = torch.cat([bias, bias[:1]]) if _bad_here(rank) else bias
    ak.linear_token_logprobs(hidden, _vocab(weight, rank, dim=0), _target(), bias=bias)


# process_group=

def _shard(full, rank, dim=-1):
    start, stop = SHARDS[rank]
    return full.narrow(dim, start, stop - start).clone()


def pg_cross_entropy_target_range(rank):
    ak.cross_entropy(_shard(_logits(), rank), _out_of_range(_target(), rank),
                     process_group=dist.group.WORLD, check_consistency=False)


def pg_token_logprobs_logits_dtype(rank):
    logits = _shard(_logits(), rank)
    ak.token_logprobs(logits.long() if _bad_here(rank) else logits, _target(),
                      process_group=dist.group.WORLD)


def pg_linear_cross_entropy_bias_shape(rank):
    hidden, weight, bias = _head()
    bias = _shard(bias, rank, 0)
    ak.linear_cross_entropy(hidden, _shard(weight, rank, 0), _target(),
                            bias=bias[:-1] if _bad_here(rank) else bias,
                            process_group=dist.group.WORLD)


def pg_linear_token_logprobs_bias_dtype(rank):
    hidden, weight, bias = _head()
    bias = _shard(bias, rank, 0)
    ak.linear_token_logprobs(hidden, _shard(weight, rank, 0), _target(),
                             bias=bias.double() if _bad_here(rank) else bias,
                             process_group=dist.group.WORLD)


def pg_grpo_mask_values(rank):
    target, mask, advantages = _grpo_inputs()
    mask = mask.float()
    if _bad_here(rank):
        mask[0, 0] = 2.0
    ak.grpo_loss(_shard(_logits(), rank), target, advantages, mask=mask,
                 process_group=dist.group.WORLD)


def pg_linear_grpo_importance_weights_nan(rank):
    target, mask, advantages = _grpo_inputs()
    hidden, weight, _ = _head()
    weights = torch.ones(BATCH, LENGTH)
    if _bad_here(rank):
        weights[0, 1] = float("nan")
    ak.linear_grpo_loss(hidden, _shard(weight, rank, 0), target, advantages, mask=mask,
                        loss_type="dapo", importance_weights=weights,
                        process_group=dist.group.WORLD)


# each case: (the call, the argument its error names, the class of the bad rank's own error)
CASES = {
    "cross_entropy_rows_target_range": (cross_entropy_rows_target_range, "target", ValueError),
    "cross_entropy_rows_target_dtype": (cross_entropy_rows_target_dtype, "target", TypeError),
    "token_logprobs_rows_target_shape": (token_logprobs_rows_target_shape, "target", ValueError),
    "linear_cross_entropy_rows_target_range": (linear_cross_entropy_rows_target_range,
                                               "target", ValueError),
    "linear_cross_entropy_rows_weight_shape": (linear_cross_entropy_rows_weight_shape,
                                               "weight", ValueError),
    "linear_topk_distill_rows_support_range": (linear_topk_distill_rows_support_range,
                                               "support_ids", ValueError),
    "grpo_rows_target_range": (grpo_rows_target_range, "target", ValueError),
    "grpo_rows_importance_weights_nan": (grpo_rows_importance_weights_nan,
                                         "importance_weights", ValueError),
    "grpo_rows_advantages_shape": (grpo_rows_advantages_shape, "advantages", ValueError),
    "sequence_logprobs_rows_mask_shape": (sequence_logprobs_rows_mask_shape, "mask",
                                          ValueError),
    "distill_rows_target_range": (distill_rows_target_range, "target", ValueError),
    "topk_distill_rows_support_range": (topk_distill_rows_support_range, "support_ids",
                                        ValueError),
    "topk_distill_rows_teacher_shape": (topk_distill_rows_teacher_shape, "teacher_logprobs",
                                        ValueError),
    "dpo_rows_shape": (dpo_rows_shape, "ref_rejected", ValueError),
    "cross_entropy_vocab_target_range": (cross_entropy_vocab_target_range, "target",
                                         ValueError),
    "grpo_vocab_advantages_shape": (grpo_vocab_advantages_shape, "advantages", ValueError),
    "linear_token_logprobs_vocab_bias_shape": (linear_token_logprobs_vocab_bias_shape, "bias",
                                               ValueError),
    "pg_cross_entropy_target_range": (pg_cross_entropy_target_range, "target", ValueError),
    "pg_token_logprobs_logits_dtype": (pg_token_logprobs_logits_dtype, "logits", TypeError),
    "pg_linear_cross_entropy_bias_shape": (pg_linear_cross_entropy_bias_shape, "bias",
                                           ValueError),
    "pg_linear_token_logprobs_bias_dtype": (pg_linear_token_logprobs_bias_dtype, "bias",
                                            TypeError),
    "pg_grpo_mask_values": (pg_grpo_mask_values, "mask", ValueError),
    "pg_linear_grpo_importance_weights_nan": (pg_linear_grpo_importance_weights_nan,
                                              "importance_weights", ValueError),
}


def _good_calls_after_errors(rank):
    """The group is whole after the refused calls: the same ops on good inputs, every rank's
    value equal to one process's."""
    logits, target = _logits(), _target()
    values = [ak.cross_entropy(_rows(logits, rank), target).full_tensor(),
              ak.cross_entropy(_shard(logits, rank), target, process_group=dist.group.WORLD)]
    expected = ak.cross_entropy(logits, target)
    return [abs(value.item() - expected.item()) <= 1e-5 * abs(expected.item())
            for value in values]


def _every_rank_bad(rank):
    """Every rank refuses the same input: each raises the op's own error, unchanged."""
    try:
        ak.cross_entropy(_shard(_logits(), rank), torch.full_like(_target(), VOCAB),
                         process_group=dist.group.WORLD)
    except ValueError as error:
        return [type(error).__name__, str(error)]
    return None


def _outcome(case, rank):
    dist.barrier()  # every rank starts the case together: the time is the case's own
    start = time.monotonic()
    try:
        case(rank)
    except Exception as error:
        return dict(seconds=time.monotonic() - start, type=type(error).__name__,
                    message=str(error), is_value_error=isinstance(error, ValueError),
                    is_type_error=isinstance(error, TypeError))
    return dict(seconds=time.monotonic() - start, type=None, message="")


def _worker(rank, world_size):
    # the kernels loaded (the C++ ones built, on a first run) and DTensor imported, before any
    # case is timed
    ak.cross_entropy(_rows(_logits(), rank), _target())
    outcomes = {name: _outcome(case, rank) for name, (case, _, _) in CASES.items()}
    outcomes["good_calls_after_errors"] = _good_calls_after_errors(rank)
    outcomes["every_rank_bad"] = _every_rank_bad(rank)
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 2, timeout=300.0, group_timeout=GROUP_TIMEOUT_S)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_on_one_rank_raises_on_every_rank(outcomes, name):
    _, argument, kind = CASES[name]
    per_rank = [result[name] for result in outcomes]
    for rank, outcome in enumerate(per_rank):
        assert outcome["type"] is not None, f"rank {rank} returned a result"
        assert outcome["seconds"] < AGREED_WITHIN_S, (rank, outcome)
        # the bad rank's own kind of error, on every rank
        assert outcome["is_type_error" if kind is TypeError else "is_value_error"], (rank,
                                                                                    outcome)
    assert per_rank[0]["message"] == per_rank[1]["message"], per_rank
    message = per_rank[0]["message"]
    assert per_rank[0]["type"] == per_rank[1]["type"] == (
        "RankRefusedType" if kind is TypeError else "RankRefused"), per_rank
    assert f"rank {BAD_RANK} " in message and argument in message, message


def test_the_group_serves_good_calls_after_refused_ones(outcomes):
    assert [result["good_calls_after_errors"] for result in outcomes] == [[True, True]] * 2


def test_every_rank_bad_raises_the_ops_own_error(outcomes):
    for result in outcomes:
        assert result["every_rank_bad"] is not None
        kind, message = result["every_rank_bad"]
        assert kind == "ValueError" and message.startswith("target holds 11"), message
