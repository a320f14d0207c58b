"""Issue 33's logits benchmark cases (``token_logprobs_sampling``, ``topk_distill``): the inputs
are what the cases claim (targets the sampler drew, a teacher's distinct top-K with a tail) and
every method's call is the op's forward + backward, per element against float64
(:mod:`astrai_kernels.testing`) at a tiny shape. No timing is asserted."""

import math

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.bench import cases as bc
from astrai_kernels.bench.logits import sampled_targets, teacher_topk
from astrai_kernels.bench.measure import build_workload
from astrai_kernels.bench.workloads import naive_sampled_token_logprobs
from astrai_kernels.testing import assert_close_elementwise

ROWS, VOCAB = 24, 300  # top_k = 50 < V: the sampler filters
SAMPLING = bc.BENCH_SAMPLING
BACKENDS = [b for b in ak.available_backends("cpu") if b != "triton"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(op, method, dtype="fp32", rows=ROWS, vocab=VOCAB):
    return bc.Case(op, method, rows, vocab, dtype, repeats=1, min_repeats=1)


def _grad(workload):
    workload.run()
    grad = workload.leaves[0].grad.detach().clone()
    workload.reset()
    return grad


def _sampled_inputs(dtype):
    """The logits and targets ``build_workload`` draws for token_logprobs_sampling (seed 0)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, dtype=DTYPES[dtype], generator=gen)
    return logits, sampled_targets(logits, gen, **SAMPLING)


def _kept_float64(logits, target, sampling=SAMPLING):
    """float64 ``(logp, grad, kept_logp, in_support)`` of ``target`` under the sampler (the spec,
    ``reference.sampled_token_logprobs``); ``kept_logp``: each row's log-softmax over the tokens
    the spec keeps (every token scored as a target; -inf elsewhere)."""
    x = logits.detach().double().requires_grad_(True)
    logp, _, _, in_support = reference.sampled_token_logprobs(x, target, **sampling)
    logp.sum().backward()
    every_token = torch.arange(VOCAB).repeat(logits.shape[0])
    kept = reference.sampled_token_logprobs(x.detach().repeat_interleave(VOCAB, 0), every_token,
                                            **sampling)[3].view(logits.shape)
    scaled = x.detach() / sampling["temperature"]
    kept_logp = torch.log_softmax(scaled.masked_fill(~kept, -math.inf), -1)
    return logp.detach(), x.grad, kept_logp, in_support


def _sampling_scales(logits, target, logp, kept_logp, temperature=SAMPLING["temperature"]):
    """Sizes of the terms of each value (``s_y`` and the kept logsumexp) and of each gradient
    entry (``([j = y] + p'_j (1 + |log p'_j|)) / T``, ``p'`` the kept softmax)."""
    s_y = (logits.double() / temperature).gather(-1, target[:, None]).squeeze(-1)
    value_scale = s_y.abs() + (s_y - logp).abs()
    p = kept_logp.exp()
    terms = p * (1 + kept_logp.abs().nan_to_num(0.0, 0.0, 0.0))
    terms += torch.nn.functional.one_hot(target, VOCAB).double()
    return value_scale, terms / temperature


def test_sampled_targets_are_in_the_support():
    logits, target = _sampled_inputs("fp32")
    workload = build_workload(_case("token_logprobs_sampling", "cpp"))
    assert torch.equal(workload.leaves[0].detach(), logits)
    *_, in_support = _kept_float64(logits, target)
    assert bool(in_support.all()), f"{int((~in_support).sum())} targets outside the support"


def test_sampled_targets_follow_the_sampler_distribution():
    """One row drawn 20000 times: each token's frequency is its probability under vLLM's
    processed distribution (within 5 standard errors), so no kept token (the top-p crossing
    one included) is left out and no dropped one drawn."""
    draws = 20000
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    target = sampled_targets(row.expand(draws, VOCAB), torch.Generator().manual_seed(4),
                             **SAMPLING)
    every_token = torch.arange(VOCAB)
    p = reference.sampled_token_logprobs(row.double().expand(VOCAB, VOCAB), every_token,
                                         **SAMPLING)[0].exp()
    freq = torch.bincount(target, minlength=VOCAB).double() / draws
    assert bool((freq[p == 0] == 0).all()), "a token outside the support was drawn"
    sigma = (p * (1 - p) / draws).sqrt()
    assert bool(((freq - p).abs() <= 5 * sigma + 1e-12).all())
    assert int((p > 0).sum()) > 1


def _tie_free_inputs(dtype, sampling):
    """Logits whose values are distinct within each row (a permutation of multiples of 2**-7,
    exact in bf16) and targets the sampler drew: vLLM's sort keeps an arbitrary part of a tie at
    the top-p crossing, where the spec keeps all of it (ops/sampling.py)."""
    gen = torch.Generator().manual_seed(1)
    steps = torch.stack([torch.randperm(VOCAB, generator=gen) for _ in range(ROWS)])
    logits = ((steps - VOCAB // 2).float() * 2.0 ** -7).to(DTYPES[dtype])
    return logits, sampled_targets(logits, gen, **{**sampling, "top_k": sampling["top_k"]
                                                   or VOCAB})


# the bench's sampler; top-k alone (its boundary kept); top-p alone; a top-p that cuts inside
# a small top-k
NAIVE_SETTINGS = [SAMPLING, {"temperature": 1.0, "top_k": 50, "top_p": 1.0},
                  {"temperature": 0.8, "top_k": 0, "top_p": 0.9},
                  {"temperature": 1.3, "top_k": 7, "top_p": 0.5}]


@pytest.mark.parametrize("sampling", NAIVE_SETTINGS, ids=lambda p: "k{top_k}-p{top_p}".format(**p))
@pytest.mark.parametrize("dtype", DTYPES)
def test_naive_sampling_is_vllm_in_float64(dtype, sampling):
    """The naive baseline (sort + cumsum mask, log_softmax, gather) against the float64 spec."""
    logits, target = _tie_free_inputs(dtype, sampling)
    logp64, grad64, kept_logp, _ = _kept_float64(logits, target, sampling)
    value_scale, grad_scale = _sampling_scales(logits, target, logp64, kept_logp,
                                               sampling["temperature"])
    x = logits.clone().requires_grad_(True)
    logp = naive_sampled_token_logprobs(x, target, **sampling)
    logp.sum().backward()
    assert_close_elementwise(logp, logp64, scale=value_scale, dtype=torch.float32,
                             name="naive logp")
    assert_close_elementwise(x.grad, grad64, scale=grad_scale, name="naive grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_workloads_are_the_op(dtype):
    """Every method's call is the sampled log-probs' forward + backward: its gradient is the
    float64 spec's within the table (yardstick: the spec run in float32, the gradient rounded
    to the logits' dtype). The naive call is vLLM's code, checked against the spec on tie-free
    rows above (bf16 rows tie): here it must be that code on these inputs."""
    logits, target = _sampled_inputs(dtype)
    logp64, grad64, kept_logp, _ = _kept_float64(logits, target)
    _, grad_scale = _sampling_scales(logits, target, logp64, kept_logp)
    x32 = logits.detach().float().clone().requires_grad_(True)
    reference.sampled_token_logprobs(x32, target, **SAMPLING)[0].sum().backward()
    naive = x32.grad.to(DTYPES[dtype])
    direct = logits.clone().requires_grad_(True)
    naive_sampled_token_logprobs(direct, target, **SAMPLING).sum().backward()
    assert torch.equal(_grad(build_workload(_case("token_logprobs_sampling", "naive", dtype))),
                       direct.grad)
    for method in BACKENDS:
        got = _grad(build_workload(_case("token_logprobs_sampling", method, dtype)))
        assert got.dtype == DTYPES[dtype]
        assert_close_elementwise(got, grad64, naive=naive, scale=grad_scale, name=method)


def test_teacher_topk_is_a_top_k_with_a_tail():
    gen = torch.Generator().manual_seed(0)
    ids, teacher = teacher_topk(ROWS, VOCAB, 7, "cpu", gen)
    assert ids.shape == teacher.shape == (ROWS, 7)
    assert bool(((ids >= 0) & (ids < VOCAB)).all())
    assert all(len(set(row.tolist())) == 7 for row in ids), "ids repeat within a row"
    assert bool((teacher[:, :-1] >= teacher[:, 1:]).all()), "not in descending order"
    assert bool((torch.logsumexp(teacher.double(), -1) < 0).all()), "no tail mass"
    with pytest.raises(ValueError, match="K must be in"):
        teacher_topk(ROWS, VOCAB, VOCAB + 1, "cpu", gen)


def _topk_float64(logits, ids, teacher):
    """float64 gradient of TRL's forward KL with the tail (the op's defaults, batchmean) and the
    sizes of its terms: ``C_k = q_k + q_tail p_k / (1 - P)`` per support entry; entry ``j``
    gets ``(sum_{id_k = j} C_k + p_j (1 + |log p_j|) sum_k C_k) / N``."""
    x = logits.detach().double().requires_grad_(True)
    reference.topk_distill_loss(x, ids, teacher.double()).backward()
    log_p = torch.log_softmax(x.detach(), -1)
    p_k = log_p.gather(-1, ids).exp()
    q = teacher.double().exp()
    q_tail = 1 - q.sum(-1, keepdim=True)
    shares = q + q_tail * p_k / (1 - p_k.sum(-1, keepdim=True))
    terms = torch.zeros_like(log_p).scatter_add_(1, ids, shares)
    terms += log_p.exp() * (1 + log_p.abs()) * shares.sum(-1, keepdim=True)
    return x.grad, terms / logits.shape[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_distill_workloads_are_the_op(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, dtype=DTYPES[dtype], generator=gen)
    ids, teacher = teacher_topk(ROWS, VOCAB, bc.TOPK_DISTILL_K, "cpu", gen)
    grad64, scale = _topk_float64(logits, ids, teacher)
    naive_workload = build_workload(_case("topk_distill", "naive", dtype))
    assert torch.equal(naive_workload.leaves[0].detach(), logits)
    naive = _grad(naive_workload)
    assert_close_elementwise(naive, grad64, scale=scale, name="naive")
    for method in BACKENDS:
        got = _grad(build_workload(_case("topk_distill", method, dtype)))
        assert got.dtype == DTYPES[dtype]
        assert_close_elementwise(got, grad64, naive=naive, scale=scale, name=method)


def test_new_cases_have_their_floor_and_plain_form():
    for op in ("token_logprobs_sampling", "topk_distill"):
        workload = build_workload(_case(op, "cpp"))
        assert workload.floor_bytes == 2 * workload.logits_bytes == 2 * ROWS * VOCAB * 4
        assert workload.copy_source is workload.leaves[0]
    assert bc.PLAIN_OP == {"token_logprobs_sampling": "token_logprobs"}
    with pytest.raises(ValueError, match="not a method of token_logprobs_sampling"):
        build_workload(_case("token_logprobs_sampling", "cpp:inplace"))


@pytest.mark.parametrize("sampler", ["top_p_flat", "top_k_5000"])
def test_samplers_build_their_workload(sampler):
    """Each sampler of issue 42's tails: logits at its scale, every target drawn inside its
    support (the float64 spec), and the op's call under its SamplingParams."""
    rows, vocab = 8, 6000  # top_k = 5000 < V
    case = bc.Case("token_logprobs_sampling", "cpp", rows, vocab, "fp32", repeats=1,
                   min_repeats=1, sampler=sampler)
    workload = build_workload(case)
    params, scale = bc.BENCH_SAMPLERS[sampler]
    assert workload.info["sampling"] == dict(params, logit_scale=scale)
    gen = torch.Generator().manual_seed(case.seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    assert torch.equal(workload.leaves[0].detach(), logits)
    target = sampled_targets(logits, gen, **params)
    assert reference.sampled_token_logprobs(logits.double(), target, **params)[3].all()
    grad = _grad(workload)
    expected = logits.clone().requires_grad_(True)
    ak.token_logprobs(expected, target, sampling=ak.SamplingParams(**params),
                      backend="cpp").sum().backward()
    assert torch.equal(grad, expected.grad)


def test_a_sampler_belongs_to_the_sampled_op():
    with pytest.raises(ValueError, match="sampler must be one of"):
        build_workload(bc.Case("token_logprobs", "cpp", ROWS, VOCAB, sampler="top_p_flat"))
    with pytest.raises(ValueError, match="sampler must be one of"):
        build_workload(bc.Case("token_logprobs_sampling", "cpp", ROWS, VOCAB, sampler="x"))
