"""Tensor parallel as torch users write it, on a tiny transformers Llama and 2 gloo CPU ranks.

``lm_head`` parallelized with ``ColwiseParallel(use_local_output=False)`` (its weight a
``Shard(0)`` DTensor), the model patched by ``integrations.transformers.patch``: two SGD steps
leave every parameter equal to the unsharded, unpatched model's trained in one process (judged per
element against that run in float64, allowed twice the float32 run's own error).

transformers' own ``tp_plan``: the same model saved to disk and loaded with
``tp_plan="auto", tp_size=2`` (on CPU transformers applies no plan unless ``tp_size`` is given:
the weights load whole), then patched: the same two steps, the same result. Its plan shards
the attention and MLP too, so its result is judged the same way against the unsharded run.
"""

import dataclasses
import functools
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from astrai_kernels.testing import assert_close  # noqa: E402
from astrai_kernels.testing.multiprocess import (  # noqa: E402
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)

VOCAB = 97
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB)


def _model(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL)).to(dtype).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _train(model, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        model(**_batch()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for name, p in model.named_parameters()}


def _assert_trained_as_one_process(got):
    """Every parameter of ``got`` (the sharded, patched run) against the unsharded, unpatched
    model trained in one process: per element against float64, twice the float32 run's error,
    a matrix's entries scaled by their row's largest (the terms their sums share)."""
    expected = _train(_model(torch.float64))
    naive = _train(_model())
    for name, value in got.items():
        scale = expected[name].abs().amax(-1, keepdim=True).expand_as(expected[name]) \
            if expected[name].dim() > 1 else None
        assert_close(value, expected[name], "value", torch.float32, name, naive=naive[name],
                     scale=scale)


@functools.lru_cache(maxsize=None)
def _mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _colwise_lm_head_and_patch(backend):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from astrai_kernels.integrations import transformers as hf
    from astrai_kernels.ops import cross_entropy as ce_op

    model = _model()
    parallelize_module(model, _mesh(), {"lm_head": ColwiseParallel(use_local_output=False)})
    assert isinstance(model.lm_head.weight, DTensor)
    hf.patch(model, backend=backend)
    door = ce_op.LINEAR_CROSS_ENTROPY
    front_door = mock.Mock(wraps=door.dtensor)
    with mock.patch.object(ce_op, "LINEAR_CROSS_ENTROPY",
                           dataclasses.replace(door, dtensor=front_door)):
        got = _train(model)
    assert front_door.call_count == 2  # each step's loss went through the DTensor front door
    _assert_trained_as_one_process(got)


def _tp_plan_and_patch(backend, path):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from transformers import LlamaForCausalLM

    from astrai_kernels.integrations import transformers as hf

    if dist.get_rank() == 0:
        _model().save_pretrained(path)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto", tp_size=2).float().train()
    assert isinstance(model.lm_head.weight, DTensor)
    assert tuple(model.lm_head.weight.placements) == (Shard(0),)
    hf.patch(model, backend=backend)
    got = _train(model)
    _assert_trained_as_one_process(got)


CASES = {f"{case.__name__.lstrip('_')}-{backend}": functools.partial(case, backend)
         for case in (_colwise_lm_head_and_patch, _tp_plan_and_patch)
         for backend in ("cpp", "torch")}


def _worker(rank, world_size, path):
    outcomes = {}
    for name, case in CASES.items():
        arguments = (f"{path}/{name}",) if "tp_plan" in name else ()
        outcomes[name] = case_outcome(case, *arguments)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return spawn_ranks(_worker, 2, args=(str(tmp_path_factory.mktemp("tp_plan")),),
                       timeout=300.0)


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_hf(outcomes, name):
    assert_ranks_passed(outcomes, name)
