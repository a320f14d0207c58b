"""ak.linear_cross_entropy on a real DeepSpeed ZeRO-3 engine: 2 CPU ranks, gloo,
DS_ACCELERATOR=cpu (deepspeed is the ``deepspeed`` extra, which ``make test`` installs).

Outside the forward a ZeRO-3 weight is an empty 1-D partition (``numel() == 0``, the full shape
in ``ds_shape``): the op must refuse it naming ``deepspeed.zero.GatheredParameters``. Gathered,
and inside the forward (where ZeRO-3 fetches the parameter on access), it must give what one
process gives on the full weight, compared per entry with the float64 reference.
"""

import os

# read when deepspeed is first imported, here and in each spawned rank (which re-imports this
# module)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close
from astrai_kernels.testing.multiprocess import spawn_ranks

deepspeed = pytest.importorskip("deepspeed")

VOCAB, HIDDEN, TOKENS, WORLD, LR, STEPS, SEED = 37, 16, 6, 2, 0.5, 2, 1234


class TinyHeadLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, target):
        # the head's weight read from the parent's forward, as transformers' models do
        return ak.linear_cross_entropy(self.embed(ids), self.lm_head.weight, target)


def head_inputs():
    generator = torch.Generator().manual_seed(SEED + 1)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return hidden, target


def batches():
    """``[step][rank]`` (ids, target), each rank's micro-batch of one sequence."""
    generator = torch.Generator().manual_seed(SEED + 2)
    return [[(torch.randint(0, VOCAB, (1, TOKENS), generator=generator),
              torch.randint(0, VOCAB, (1, TOKENS), generator=generator))
             for _ in range(WORLD)] for _ in range(STEPS)]


def zero3_worker(rank, world_size):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")  # wraps spawn_ranks' gloo group
    torch.manual_seed(SEED)
    model = TinyHeadLM()
    config = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              # DeepSpeed clips the gradient norm to 1.0 by default; the one-process SGD does not
              "gradient_clipping": 0.0,
              # 0: partition every parameter, however small (the default keeps small ones whole)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    weight = engine.module.lm_head.weight
    hidden, target = head_inputs()
    result = {"partition_shape": list(weight.shape), "ds_shape": list(weight.ds_shape)}

    def refusal():
        try:
            ak.linear_cross_entropy(hidden, weight, target)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    result["refusal"] = refusal()
    with deepspeed.zero.GatheredParameters(weight):
        result["gathered_weight"] = weight.detach().tolist()
        hidden_leaf = hidden.clone().requires_grad_()
        rows = ak.linear_cross_entropy(hidden_leaf, weight, target, reduction="none")
        # the hidden states' gradient only: a weight gradient made outside engine.backward would
        # enter ZeRO's reduce bucket and trip its next reduction
        (hidden_grad,) = torch.autograd.grad(rows.sum(), hidden_leaf)
        result["rows"] = rows.detach().tolist()
        result["hidden_grad"] = hidden_grad.tolist()

    result["step_losses"] = []
    for step_batches in batches():
        ids, step_target = step_batches[rank]
        loss = engine(ids, step_target)
        engine.backward(loss)
        engine.step()
        result["step_losses"].append(loss.item())

    result["refusal_after_steps"] = refusal()
    parameters = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(parameters.values())):
        result["trained"] = {name: p.detach().tolist() for name, p in parameters.items()}
    return result


def one_process_training(dtype, loss_fn):
    """The ranks' training on one process: SGD on the mean of the ranks' mean losses (ZeRO
    averages the ranks' gradients), in ``dtype``; ``([step][rank] losses, parameters)``."""
    torch.manual_seed(SEED)
    model = TinyHeadLM().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step_batches in batches():
        rank_losses = [loss_fn(F.linear(model.embed(ids), model.lm_head.weight).reshape(-1, VOCAB),
                               target.reshape(-1)) for ids, target in step_batches]
        optimizer.zero_grad()
        (sum(rank_losses) / WORLD).backward()
        optimizer.step()
        losses.append([loss.detach() for loss in rank_losses])
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(zero3_worker, WORLD, timeout=300)


def test_partitioned_weight_is_refused_naming_gathered_parameters(ranks):
    for rank in ranks:
        assert rank["partition_shape"] == [0] and rank["ds_shape"] == [VOCAB, HIDDEN]
        for refusal in (rank["refusal"], rank["refusal_after_steps"]):
            assert refusal is not None and refusal.startswith("ValueError: ")
            assert "weight must have shape [V, H], got (0,)" in refusal
            assert "deepspeed.zero.GatheredParameters(weight)" in refusal


def test_gathered_weight_gives_the_full_weight_loss(ranks):
    torch.manual_seed(SEED)
    full_weight = TinyHeadLM().lm_head.weight.detach()
    hidden, target = head_inputs()
    hidden64 = hidden.double().requires_grad_()
    expected = reference.cross_entropy(F.linear(hidden64, full_weight.double()), target,
                                       reduction="none")
    expected.sum().backward()
    hidden32 = hidden.clone().requires_grad_()
    naive = F.cross_entropy(F.linear(hidden32, full_weight), target, reduction="none")
    naive.sum().backward()
    for rank in ranks:
        assert torch.equal(torch.tensor(rank["gathered_weight"]), full_weight)
        assert_close(torch.tensor(rank["rows"]), expected.detach(), naive=naive.detach(),
                     what="per-row loss")
        assert_close(torch.tensor(rank["hidden_grad"]), hidden64.grad, kind="grad",
                     naive=hidden32.grad, what="hidden gradient")


def test_two_zero3_steps_equal_one_process(ranks):
    expected_losses, expected = one_process_training(torch.float64, reference.cross_entropy)
    naive_losses, naive = one_process_training(torch.float32, F.cross_entropy)
    for rank_index, rank in enumerate(ranks):
        assert_close(torch.tensor(rank["step_losses"]),
                     torch.stack([losses[rank_index] for losses in expected_losses]),
                     naive=torch.stack([losses[rank_index] for losses in naive_losses]),
                     what=f"rank {rank_index} step losses")
        assert sorted(rank["trained"]) == sorted(expected)
        for name, values in rank["trained"].items():
            # after the steps, still a float32 value: same row of the table as the loss
            assert_close(torch.tensor(values), expected[name], naive=naive[name],
                         what=f"rank {rank_index} {name} after {STEPS} steps")
