"""The fused head's walks, generated from the primitives' declarations (``ops/head.py``'s
``head_walk``): their schemas follow the declarations and their fakes state what the walks
return. What they compute is checked per op against float64 (test_linear, test_distill, ...)."""

from dataclasses import fields, replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import astrai_kernels  # noqa: F401  (the op files declare their walks)
from astrai_kernels.kernels.primitives import (
    CrossEntropyArgs,
    DistillArgs,
    LogprobsArgs,
    SamplingArgs,
    SurrogateArgs,
    declared,
)
from astrai_kernels.ops.head import HEAD_WALKS

from cases import assert_compiles_like_eager

N, V, H = 5, 11, 4


def test_the_op_files_declare_a_walk_for_each_primitive_they_use():
    assert set(HEAD_WALKS) == {"logprobs_forward", "logprobs_backward", "cross_entropy_forward",
                               "grpo_forward", "distill_forward", "sampled_logprobs_forward",
                               "sampled_logprobs_backward"}
    for name, walk in HEAD_WALKS.items():
        assert walk.op._opoverload._schema.name == f"astrai_kernels::linear_{name}"


@pytest.mark.parametrize("name", ["logprobs_forward", "logprobs_backward",
                                  "cross_entropy_forward", "grpo_forward", "distill_forward",
                                  "sampled_logprobs_forward", "sampled_logprobs_backward"])
def test_walk_schema_follows_the_declaration(name):
    primitive = declared(name)
    schema = HEAD_WALKS[name].op._opoverload._schema
    names = [argument.name for argument in schema.arguments]
    heads = ["hidden", "weight", "bias"]
    transforms = ["logit_scale", "softcap"]
    for tensor, _ in primitive.tensors[1:primitive.logits]:
        heads += [f"{tensor}_hidden", f"{tensor}_weight", f"{tensor}_bias"]
        transforms += [f"{tensor}_logit_scale", f"{tensor}_softcap"]
    expected = heads + [tensor for tensor, _ in primitive.tensors[primitive.logits:]]
    expected += [f"args_{field.name}" for field in fields(primitive.params)]
    expected += ["needs_hidden", "needs_weight", "needs_bias", "chunk_size", "backend"]
    expected += transforms + (["statistics"] if name == "logprobs_forward" else [])
    assert names == expected
    floats = {argument.name for argument in schema.arguments if "Tensor" in str(argument.type)}
    assert set(transforms) <= floats  # runtime floats: no recompile per value
    assert len(schema.returns) == primitive.n_outputs + (name == "logprobs_forward") + 3


def _head(seed, dtype=torch.float32, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, generator=g).to(dtype), torch.randn(vocab, H, generator=g).to(dtype),
            torch.randn(vocab, generator=g).to(dtype))


def _rows(seed=1):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (N,), generator=g)
    target[2] = -100
    return target, torch.rand(N, generator=g)


def _cases():
    """``(id, walk name, argument list builder)`` over the flags that change the outputs."""
    target, values = _rows()
    rows = torch.randn(N)
    cases = []
    for with_entropy in (False, True):
        for statistics in (0, 0b101):
            cases.append((f"logprobs_forward-entropy{with_entropy}-stats{statistics}",
                          "logprobs_forward", lambda h, w=with_entropy, s=statistics: [
                              *h, target, LogprobsArgs(0.7, -100, w), False, False, False, 2,
                              "torch", 1.0, 0.0, s]))
        entropy = rows.abs() if with_entropy else torch.empty(0)
        cases.append((f"logprobs_backward-entropy{with_entropy}", "logprobs_backward",
                      lambda h, w=with_entropy, e=entropy: [
                          *h, target, rows.abs(), e, values, e.clone(),
                          LogprobsArgs(0.7, -100, w), True, False, True, 2, "torch", 1.0, 0.0]))
    for needs in ((False, False, False), (True, True, False), (False, True, True)):
        scale = values if any(needs) else None
        cases.append((f"cross_entropy_forward-needs{needs}", "cross_entropy_forward",
                      lambda h, n=needs, s=scale: [
                          *h, target, s, CrossEntropyArgs(-100, 0.1, 1e-4, 0.0), *n, 3, "torch",
                          1.0, 0.0]))
        cases.append((f"grpo_forward-needs{needs}", "grpo_forward", lambda h, n=needs: [
            *h, target, values - 0.5, None, rows * 0.1, (target != -100).float(),
            SurrogateArgs(1.0, 0.2, 0.28, 0.0, 0.04, False, any(n)), *n, 2, "torch", 2.0, 30.0]))
        for hard_weight in (0.0, 0.5):
            cases.append((f"distill_forward-needs{needs}-hard{hard_weight}", "distill_forward",
                          lambda h, n=needs, s=scale, hw=hard_weight: [
                              *h, *_head(7), target, s, DistillArgs(0.5, 2.0, -100, hw), *n, 2,
                              "torch", 1.0, 0.0, 1.0, 0.0]))
    for backend in ("torch", "cpp"):  # chunked torch, or the backend's own primitive
        for sampling in (SamplingArgs(0.8, 3, 0.9, 0.0, -100),
                         SamplingArgs(1.0, 0, 1.0, 0.05, -100)):
            cases.append((f"sampled_logprobs_forward-{backend}-{sampling.top_k}",
                          "sampled_logprobs_forward", lambda h, b=backend, s=sampling: [
                              *h, target, s, False, False, False, 2, b, 1.0, 0.0]))
        cases.append((f"sampled_logprobs_backward-{backend}", "sampled_logprobs_backward",
                      lambda h, b=backend: [
                          *h, target, rows.abs() + 3.0, rows, values * (target != -100),
                          SamplingArgs(0.8, 3, 0.9, 0.0, -100), True, True, False, 2, b, 2.0,
                          30.0]))
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_walk_fake_states_what_the_walk_returns(case):
    """Under a fake mode the walk goes through its custom op and its generated fake; the fake's
    shapes and dtypes are the eager walk's, for every flag that changes them."""
    _, name, arguments = case
    walk = HEAD_WALKS[name]
    real_arguments = arguments(_head(0))
    eager = walk(*real_arguments)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_arguments = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                          for a in real_arguments]
        faked = walk(*fake_arguments)
    assert len(faked) == len(eager)
    for i, (fake, real) in enumerate(zip(faked, eager)):
        assert (tuple(fake.shape), fake.dtype) == (tuple(real.shape), real.dtype), (name, i)


def test_a_walk_writes_the_gradients_asked_for_in_the_inputs_dtype():
    hidden, weight, bias = _head(0, torch.bfloat16)
    target, values = _rows()
    args = CrossEntropyArgs(-100, 0.0, 0.0, 0.0)
    walk = HEAD_WALKS["cross_entropy_forward"]
    *_, grad_hidden, grad_weight, grad_bias = walk(hidden, weight, bias, target, values, args,
                                                   True, True, True, 2, "torch", 1.0, 0.0)
    assert grad_hidden.dtype == grad_weight.dtype == grad_bias.dtype == torch.bfloat16
    assert (grad_hidden.shape, grad_weight.shape, grad_bias.shape) == (
        hidden.shape, weight.shape, bias.shape)
    *_, grad_hidden, grad_weight, grad_bias = walk(hidden, weight, None, target, values,
                                                   replace(args, z_loss=1e-4), False, True,
                                                   False, 2, "torch", 1.0, 0.0)
    assert grad_hidden.numel() == 0 and grad_bias.numel() == 0
    assert grad_weight.shape == weight.shape


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_the_generated_walks_compile_fullgraph(backend):
    """The walks the other compile tests do not reach (the rows' backward walk, the statistics
    extra, the sampler's walks) traced by ``torch.compile(fullgraph=True)`` through their
    generated ops and fakes: values and gradients equal the eager call's."""
    import astrai_kernels as ak

    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (torch.randn(N, H, generator=g), torch.randn(V, H, generator=g),
                            torch.randn(V, generator=g))
    target, _ = _rows()
    sampling = ak.SamplingParams(temperature=0.8, top_k=8, top_p=0.95)  # filters every row

    def step(h, w, b):
        rows = ak.linear_cross_entropy(h, w, target, bias=b, reduction="none", chunk_size=2,
                                       backend=backend)
        logp, entropy, stats = ak.linear_token_logprobs(
            h, w, target, bias=b, temperature=0.7, return_entropy=True, softcap=5.0,
            statistics=("log_sum_sq_probs", "is_top1"), chunk_size=2, backend=backend)
        sampled = ak.linear_token_logprobs(h, w, target, bias=b, sampling=sampling,
                                           logit_scale=0.5, chunk_size=2, backend=backend)
        kept = torch.isfinite(sampled)  # a target outside the support: -inf
        total = ((rows * torch.linspace(0.5, 1.5, N)).sum() + logp.sum() + 0.1 * entropy.sum()
                 + torch.where(kept, sampled, 0.0).sum())
        return total, stats["log_sum_sq_probs"], stats["is_top1"]

    assert_compiles_like_eager(step, hidden, weight, bias)
