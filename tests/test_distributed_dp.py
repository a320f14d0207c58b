"""Data parallel: DDP and FSDP2 training of TinyCausalLM on 2 and 3 gloo CPU ranks, each with its
own micro-batch (uneven sizes and token counts), gives the parameters' gradients of one process
on the whole batch when the losses are normalized by ``ak.distributed.global_token_count``.

One spawn of 3 processes runs every case: on the world and on a 2-rank subgroup.
"""


import pytest
import torch
import torch.distributed as dist
from torch import nn

import astrai_kernels as ak
from astrai_kernels.testing.multiprocess import (
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)
from astrai_kernels.testing.tiny_lm import TinyCausalLM

VOCAB, LENGTH = 32, 7
ROWS = {2: (1, 3), 3: (2, 1, 3)}  # sequences per rank
LOSSES = ("cross_entropy", "linear_cross_entropy", "grpo_dapo")
WRAPPERS = ("ddp", "fsdp2")


class _Trainer(nn.Module):
    """TinyCausalLM and one of the losses, so the wrapper's forward covers the loss (the fused
    head reads ``lm_head.weight`` inside it)."""

    def __init__(self):
        super().__init__()
        self.lm = TinyCausalLM(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, seed=0)

    def hidden(self, input_ids):
        lm = self.lm
        batch, length = input_ids.shape
        positions = torch.arange(length).expand(batch, length)
        x = lm.embed(input_ids) + lm.pos(positions)
        mask = lm._attention_mask(None, batch, length, input_ids.device)
        for block in lm.blocks:
            x, _ = block(x, mask)
        return lm.ln_f(x)

    def forward(self, loss_name, input_ids, target, advantages, old, normalizer):
        if loss_name == "linear_cross_entropy":
            return ak.linear_cross_entropy(self.hidden(input_ids), self.lm.lm_head.weight, target,
                                           normalizer=normalizer)
        logits = self.lm(input_ids)["logits"]
        if loss_name == "cross_entropy":
            return ak.cross_entropy(logits, target, normalizer=normalizer)
        mask = target != -100
        loss, _ = ak.grpo_loss(logits, torch.where(mask, target, 0), advantages, mask=mask,
                               old_logprobs=old, loss_type="dapo", normalizer=normalizer)
        return loss


def _batch(sizes):
    """The whole batch (every rank builds the same one) and each rank's rows."""
    g = torch.Generator().manual_seed(sum(sizes))
    rows = sum(sizes)
    input_ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    target = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
    target[torch.rand(rows, LENGTH, generator=g) < 0.35] = -100  # uneven counts per rank
    advantages = torch.randn(rows, generator=g)
    old = torch.randn(rows, LENGTH, generator=g) * 0.2 - 3.5
    bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    return (input_ids, target, advantages, old), bounds


def _single_process_grads(loss_name, batch):
    trainer = _Trainer()
    input_ids, target, advantages, old = batch
    trainer(loss_name, input_ids, target, advantages, old, None).backward()
    return {name: p.grad for name, p in trainer.named_parameters()}


def _wrapped(wrapper, group):
    trainer = _Trainer()
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(trainer, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for block in trainer.lm.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(trainer, mesh=mesh)


def _check(group, rank, size, loss_name, wrapper):
    batch, bounds = _batch(ROWS[size])
    expected = _single_process_grads(loss_name, batch)
    mine = [t[bounds[rank]:bounds[rank + 1]] for t in batch]
    model = _wrapped(wrapper, group)
    target = mine[1]
    count = ak.distributed.global_token_count(target, process_group=group)
    assert count.dtype == torch.float32 and count.item() == (batch[1] != -100).sum().item()
    # DDP and FSDP2 average the ranks' gradients: the world size undoes that mean
    loss = model(loss_name, *mine, count) * dist.get_world_size(group)
    loss.backward()
    module = model.module if wrapper == "ddp" else model
    for name, param in module.named_parameters():
        grad = param.grad.full_tensor() if wrapper == "fsdp2" else param.grad
        want = expected[name.removeprefix("module.")]
        torch.testing.assert_close(grad, want, rtol=2e-4, atol=1e-6 * float(want.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def _worker(rank, world_size):
    groups = {3: dist.group.WORLD, 2: dist.new_group([0, 1])}
    outcome = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        for loss_name in LOSSES:
            for wrapper in WRAPPERS:
                outcome[f"{loss_name}-{wrapper}-{size}ranks"] = case_outcome(
                    _check, group, rank, size, loss_name, wrapper)
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 3, timeout=600.0)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("loss_name", LOSSES)
def test_data_parallel_matches_one_process(outcomes, loss_name, wrapper, size):
    assert_ranks_passed(outcomes, f"{loss_name}-{wrapper}-{size}ranks", size)


def test_global_token_count_local():
    """Without a process group it is the local count: targets, masks, and bad input."""
    target = torch.tensor([[1, -100, 3], [-100, -100, 0]])
    count = ak.distributed.global_token_count(target)
    assert count.dtype == torch.float32 and count.shape == () and count.item() == 3.0
    assert ak.distributed.global_token_count(target, ignore_index=0).item() == 5.0
    assert ak.distributed.global_token_count(target != -100).item() == 3.0
    with pytest.raises(TypeError, match="bool mask"):
        ak.distributed.global_token_count(target.float())
    with pytest.raises(TypeError, match="torch.Tensor"):
        ak.distributed.global_token_count([1, 2])
