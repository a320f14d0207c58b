"""``sampling=`` / ``return_support=``: targets scored under vLLM v1's processed distribution.

The expected values come from :func:`vllm_kept`, vLLM's sampler written out here in float64 and
sort-based (independent of the kernels' sort-free thresholds and of
``reference.sampled_token_logprobs``), then extended to the documented tie rule at the top-p
crossing. Values and gradients are compared per element (``astrai_kernels.testing``) with the
float64 math on the kept tokens; the support itself (``in_support``, ``support_size``) exactly.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels.kernels import portable_sampling
from astrai_kernels.testing import assert_close, assert_close_elementwise

BACKENDS = ["cpp", "torch", "reference"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
VOCAB = 97
TOP_KS = [0, 1, 5, VOCAB + 3]
TOP_PS = [1.0, 0.9, 0.3]
MIN_PS = [0.0, 0.1]
TEMPERATURES = [1.0, 0.7]
SETTINGS = list(itertools.product(TOP_KS, TOP_PS, MIN_PS, TEMPERATURES))
# full shape from the logits' [A, B, V], and the view of it the op gets
LAYOUTS = {
    "contiguous": (lambda a, b, v: (a, b, v), lambda x: x),
    "shifted": (lambda a, b, v: (a, b + 1, v), lambda x: x[:, :-1]),
    "strided_vocab": (lambda a, b, v: (a, b, 2 * v), lambda x: x[..., ::2]),
    "transposed": (lambda a, b, v: (v, a, b), lambda x: x.permute(1, 2, 0)),
}


def make_full(shape, dtype, layout="contiguous", seed=0):
    """``(full, view)``: random logits rounded to ``dtype`` and the layout's view of them."""
    full_shape, view = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(full_shape(*shape), generator=g) * 3.0).to(dtype), view


def vllm_sampler_kept(logits, params):
    """The tokens vLLM v1's sampler can draw, in float64: temperature, then
    ``MinPLogitsProcessor`` (drop ``p < min_p * max p``), then ``apply_top_k_top_p`` (sort
    ascending; drop values below the k-th largest; softmax and cumsum of what is left; drop
    where the cumsum is ``<= 1 - p``, never the last)."""
    processed = logits.double() / params.temperature
    if params.min_p > 0:
        probs = processed.softmax(-1)
        processed = processed.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True),
                                          -math.inf)
    vocab = processed.shape[-1]
    logits_sort, logits_idx = processed.sort(-1, descending=False)
    if 0 < params.top_k < vocab:
        kth_largest = logits_sort[..., vocab - params.top_k:vocab - params.top_k + 1]
        logits_sort = logits_sort.masked_fill(logits_sort < kth_largest, -math.inf)
    if params.top_p < 1:
        probs_sum = logits_sort.softmax(-1).cumsum(-1)
        top_p_mask = probs_sum <= 1 - params.top_p
        top_p_mask[..., -1] = False
        logits_sort = logits_sort.masked_fill(top_p_mask, -math.inf)
    return torch.empty_like(processed).scatter(-1, logits_idx, logits_sort) > -math.inf


def vllm_kept(logits, params):
    """:func:`vllm_sampler_kept` with the tie rule of ``ops/sampling.py``: a token tied in value
    with a kept one is kept (at the top-p crossing vLLM keeps an arbitrary part of a tie)."""
    scaled = logits.double() / params.temperature
    tied = scaled.unsqueeze(-1) == scaled.unsqueeze(-2)
    return (tied & vllm_sampler_kept(logits, params).unsqueeze(-2)).any(-1)


def kept_logprobs(x, target, kept, temperature, ignore_index=-100):
    """``(logp, log_kept_mass)`` of ``target`` over the ``kept`` tokens, in ``x``'s precision:
    ``s_y - logsumexp_K(s)``, ``-inf`` outside ``K``, 0 on ignored rows (autograd gives the
    reference gradient, zero on rows outside ``K``)."""
    valid = target != ignore_index
    s = x / temperature
    lse_kept = torch.logsumexp(s.masked_fill(~kept, -math.inf), -1)
    safe = torch.where(valid, target, 0).unsqueeze(-1)
    in_support = valid & kept.gather(-1, safe).squeeze(-1)
    logp = torch.where(in_support, s.gather(-1, safe).squeeze(-1) - lse_kept,
                       torch.where(valid, -math.inf, 0.0))
    log_kept_mass = torch.where(valid, lse_kept - torch.logsumexp(s, -1), 0.0)
    return logp, log_kept_mass.detach()


def sampled_targets(logits, kept, params, seed, mixed=True):
    """Targets drawn from the processed distribution; with ``mixed``, of every 7 rows (in a
    random order) 2 are drawn uniformly (mostly outside the support) and 1 is ignored."""
    g = torch.Generator().manual_seed(seed)
    scaled = (logits.double() / params.temperature).masked_fill(~kept, -math.inf)
    rows = scaled.reshape(-1, scaled.shape[-1])
    target = torch.multinomial(rows.softmax(-1), 1, generator=g).squeeze(-1)
    if mixed:
        kind = (torch.arange(target.numel()) % 7)[torch.randperm(target.numel(), generator=g)]
        uniform = torch.randint(0, rows.shape[-1], target.shape, generator=g)
        target = torch.where(kind >= 5, uniform, target)
        target = torch.where(kind == 6, -100, target)
    return target.reshape(scaled.shape[:-1])


def expected_and_naive(base, target, kept, temperature, upstream):
    """float64 ``(logp, log_kept_mass, grad)`` on the kept tokens, and the same math run in
    float32 (values) and in the logits' dtype (gradient): the per-element yardstick."""
    results = {}
    for precision in {torch.float64, torch.float32, base.dtype}:
        x = base.detach().to(precision).requires_grad_(True)
        logp, log_kept_mass = kept_logprobs(x, target, kept, temperature)
        logp.backward(upstream.to(precision))
        results[precision] = (logp.detach(), log_kept_mass, x.grad)
    naive_values = results[torch.float32]
    return results[torch.float64], (naive_values[0], naive_values[1], results[base.dtype][2])


def check_against_vllm(full, target, params, backend, view=lambda x: x, kept=None):
    """Run ``token_logprobs(view(x), sampling=params)`` on a leaf ``x`` of ``full``'s values and
    compare everything with the float64 math on the tokens :func:`vllm_kept` keeps (or ``kept``,
    the same tokens found by :func:`vllm_kept_wide`)."""
    dtype = full.dtype
    kept = vllm_kept(view(full), params) if kept is None else kept
    x = full.detach().clone().requires_grad_(True)
    logp, support = ak.token_logprobs(view(x), target, sampling=params, return_support=True,
                                      backend=backend)
    upstream = torch.rand(target.shape, generator=torch.Generator().manual_seed(7)) + 0.5
    logp.backward(upstream)
    expected, naive = expected_and_naive(view(full), target, kept, params.temperature, upstream)
    valid = target != -100
    in_support = valid & kept.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    assert logp.dtype == torch.float32 and logp.shape == target.shape
    assert torch.equal(support["in_support"], in_support)
    assert torch.equal(support["support_size"], torch.where(valid, kept.sum(-1), 0))
    assert support["support_size"].dtype == torch.int64
    assert_close(logp, expected[0], "value", dtype, "logp", naive=naive[0])
    assert_close(support["log_kept_mass"], expected[1], "value", dtype, "log_kept_mass",
                 naive=naive[1])
    grad = view(x.grad)
    assert x.grad.dtype == dtype and not torch.isnan(x.grad).any()
    assert_close(grad, expected[2], "grad", dtype, "grad", naive=naive[2])
    outside_view = x.grad.clone()
    view(outside_view).zero_()
    assert not outside_view.any(), "gradient outside the view"
    outside = valid & ~in_support
    assert torch.all(logp[outside] == -math.inf) and torch.all(grad[outside] == 0)
    return logp, support


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k, top_p, min_p, temperature", SETTINGS)
def test_matches_vllm_in_float64(top_k, top_p, min_p, temperature, backend, dtype):
    """Every combination, on the ``x[:, :-1]`` view of causal-LM logits (V not a power of 2)."""
    params = ak.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    full, view = make_full((2, 5, VOCAB), dtype, "shifted", seed=top_k + 3)
    target = sampled_targets(view(full), vllm_kept(view(full), params), params, seed=11)
    _, support = check_against_vllm(full, target, params, backend, view)
    assert bool(support["in_support"].any()) and bool((target == -100).any())


@pytest.mark.parametrize("layout", ["strided_vocab", "transposed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits(backend, layout):
    params = ak.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
    full, view = make_full((3, 4, 61), torch.float32, layout, seed=5)
    target = sampled_targets(view(full), vllm_kept(view(full), params), params, seed=2)
    check_against_vllm(full, target, params, backend, view)


def _tied_rows(dtype):
    """Rows with repeated values at the boundaries: ``[5, 4, 4, 4, 3, ...]`` (top_k=2 keeps
    the three 4s) and a tie across the top-p crossing (``[3, 2, 2, 2, 0, ...]``)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 40, generator=g) - 3.0
    rows[0, :5] = torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0])
    rows[1, [7, 3, 30, 11]] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    rows[2, :6] = torch.tensor([1.0, 0.0, -0.0, -1.0, 0.0, -0.0])  # -0.0 ties with 0.0
    rows[3, :3] = torch.tensor([2.0, 2.0, 2.0])
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_top_k_boundary_are_kept(backend, dtype):
    params = ak.SamplingParams(top_k=2)
    _, support = check_against_vllm(_tied_rows(dtype), torch.tensor([2, 30, 4, 1]), params,
                                    backend)
    # row 0: 5 and all three 4s; row 1: 3 and the three 2s; row 2: 1 and the four zeros
    assert support["support_size"].tolist() == [4, 4, 5, 3]
    assert support["in_support"].all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_keeps_the_crossing_token_and_its_ties(backend, dtype):
    rows = _tied_rows(dtype)[1:2]
    probs = rows.double().softmax(-1)[0]
    top, tied = float(probs[7]), float(probs[3])
    # p between the top token's mass and that plus one of the tied 2s: the crossing is inside
    # the tie, and every tied token has exactly the top token's mass ranked strictly above it
    params = ak.SamplingParams(top_p=top + 0.5 * tied)
    logp, support = check_against_vllm(rows, torch.tensor([11]), params, backend)
    assert support["support_size"].item() == 4 and bool(support["in_support"])
    assert torch.isfinite(logp).all()
    # where the sorting sampler differs: it keeps the top token and one of the three 2s
    assert vllm_sampler_kept(rows, params).sum().item() == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_keeps_the_token_that_crosses_p(backend):
    """Without ties: the support is the smallest set of top tokens whose mass reaches p."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = ak.SamplingParams(top_p=0.6)  # 0.5 < 0.6 <= 0.8: the 0.3 token crosses p
    _, support = check_against_vllm(logits, torch.tensor([1]), params, backend)
    assert support["support_size"].item() == 2 and bool(support["in_support"])
    _, support = check_against_vllm(logits, torch.tensor([2]), params, backend)
    assert not support["in_support"].item()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [0, VOCAB, VOCAB + 3])
def test_no_filter_equals_the_plain_op_exactly(top_k, backend, dtype):
    full, _ = make_full((2, 5, VOCAB), dtype, "shifted", seed=1)
    target = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    target[0, 1] = -100
    x_plain, x_sampled = (full.clone().requires_grad_(True) for _ in range(2))
    plain = ak.token_logprobs(x_plain[:, :-1], target, temperature=0.7, backend=backend)
    sampled, support = ak.token_logprobs(
        x_sampled[:, :-1], target, sampling=ak.SamplingParams(temperature=0.7, top_k=top_k),
        return_support=True, backend=backend)
    assert torch.equal(sampled, plain)
    upstream = torch.rand(target.shape, generator=torch.Generator().manual_seed(2))
    plain.backward(upstream)
    sampled.backward(upstream)
    assert torch.equal(x_sampled.grad, x_plain.grad)
    valid = target != -100
    assert torch.equal(support["in_support"], valid)
    assert torch.equal(support["support_size"], torch.where(valid, VOCAB, 0))
    assert torch.equal(support["log_kept_mass"], torch.zeros(target.shape))


@pytest.mark.parametrize("backend", BACKENDS)
def test_targets_outside_the_support_and_ignored_rows(backend):
    """-inf, in_support False and a zero gradient (no NaN), even with inf/NaN in ignored
    rows."""
    params = ak.SamplingParams(top_k=3, top_p=0.8)
    logits = make_full((1, 6, 50), torch.float32, seed=4)[0][0]
    order = logits.argsort(-1, descending=True)
    target = order[:, 20].clone()  # never among the top 3
    target[0] = order[0, 0]
    target[4] = -100
    logits[4, :5] = torch.tensor([math.inf, math.nan, -math.inf, 1e30, -1e30])
    x = logits.clone().requires_grad_(True)
    logp, support = ak.token_logprobs(x, target, sampling=params, return_support=True,
                                      backend=backend)
    logp.backward(torch.ones_like(logp))
    assert logp[0] > -math.inf and bool(support["in_support"][0])
    assert torch.all(logp[[1, 2, 3, 5]] == -math.inf)
    assert not support["in_support"][1:].any()
    assert logp[4] == 0 and support["support_size"][4] == 0 and support["log_kept_mass"][4] == 0
    assert not torch.isnan(x.grad).any()
    assert torch.all(x.grad[1:] == 0) and x.grad[0].abs().sum() > 0
    assert torch.all(support["support_size"][[0, 1, 2, 3, 5]] <= 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_logprobs_with_sampling(backend):
    """The masked sum of the token log-probs; -inf for a sequence holding a counted token
    outside the support, with finite gradients everywhere."""
    params = ak.SamplingParams(temperature=0.7, top_p=0.9)
    base, _ = make_full((3, 4, 30), torch.float32, seed=6)
    kept = vllm_kept(base, params)
    target = sampled_targets(base, kept, params, seed=3, mixed=False)
    target[2, 1] = (base[2, 1] / 0.7).argmin()  # outside the support
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 3] = False
    x = base.clone().requires_grad_(True)
    total = ak.sequence_logprobs(x, target, mask, sampling=params, backend=backend)
    total.backward(torch.ones(3))
    sums = {}
    for precision in (torch.float64, torch.float32):
        xr = base.to(precision).requires_grad_(True)
        logp, _ = kept_logprobs(xr, torch.where(mask, target, -100), kept, 0.7)
        logp.sum(-1)[:2].sum().backward()
        sums[precision] = (logp.detach().sum(-1), xr.grad)
    (expected, expected_grad), (naive, naive_grad) = sums[torch.float64], sums[torch.float32]
    assert total[2] == -math.inf and expected[2] == -math.inf
    assert_close(total[:2], expected[:2], "value", torch.float32, "sequence logp",
                 naive=naive[:2])
    assert not torch.isnan(x.grad).any()
    assert torch.all(x.grad[2, 1] == 0) and x.grad[2, 0].abs().sum() > 0
    assert_close(x.grad[:2], expected_grad[:2], "grad", torch.float32, "grad",
                 naive=naive_grad[:2])
    with pytest.raises(ValueError, match="temperature"):
        ak.sequence_logprobs(base, target, mask, temperature=0.7, sampling=params)


def _term_scales(hidden, weight, grad_logits):
    """Sizes of the terms summed into each gradient entry of hidden, weight and bias."""
    dz = grad_logits.abs()
    return dz @ weight.abs(), dz.t() @ hidden.abs(), dz.sum(0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", [{}, {"softcap": 3.0, "logit_scale": 1.5}])
def test_linear_token_logprobs_with_sampling(backend, transform):
    params = ak.SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(23, 12, generator=g)
    weight = torch.randn(61, 12, generator=g) * 12 ** -0.5 * 3
    bias = torch.randn(61, generator=g) * 0.5

    def logits_of(h, w, b):
        """``(product, logits)``: ``F.linear`` and the logits transformed from it."""
        product = F.linear(h, w, b)
        z = product * transform.get("logit_scale", 1.0)
        cap = transform.get("softcap")
        return product, z if cap is None else cap * torch.tanh(z / cap)

    exact_in = [t.double().requires_grad_(True) for t in (hidden, weight, bias)]
    exact_product, exact_logits = logits_of(*exact_in)
    kept = vllm_kept(exact_logits.detach(), params)
    target = sampled_targets(exact_logits.detach(), kept, params, seed=4)
    fused_in = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logp, support = ak.linear_token_logprobs(
        fused_in[0], fused_in[1], target, bias=fused_in[2], sampling=params,
        return_support=True, chunk_size=5, backend=backend, **transform)
    upstream = torch.rand(target.shape, generator=g) + 0.5
    logp.backward(upstream)
    exact, _ = kept_logprobs(exact_logits, target, kept, params.temperature)
    exact_product.retain_grad()
    exact.backward(upstream.double())
    naive_in = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    naive, _ = kept_logprobs(logits_of(*naive_in)[1], target, kept, params.temperature)
    naive.backward(upstream)
    valid = target != -100
    in_support = valid & kept.gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    assert torch.equal(support["in_support"], in_support) and bool(in_support.any())
    assert_close(logp, exact, "value", torch.float32, "logp", naive=naive)
    scales = _term_scales(exact_in[0].detach(), exact_in[1].detach(), exact_product.grad)
    for name, got, want, naive_input, scale in zip(("hidden", "weight", "bias"), fused_in,
                                                   exact_in, naive_in, scales):
        assert_close_elementwise(got.grad, want.grad, naive_input.grad, scale=scale,
                                 dtype=torch.float32, name=f"grad {name}")
    sequences = ak.linear_sequence_logprobs(hidden[None], weight, target[None], in_support[None],
                                            bias=bias, sampling=params, backend=backend,
                                            **transform)
    assert_close(sequences, exact.detach().where(in_support, 0.0).sum()[None], "value",
                 torch.float32, "sequence logp", naive=naive.detach().where(in_support, 0.0)
                 .sum()[None])


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_blocks_of_rows(backend, monkeypatch):
    """Rows walked in several blocks, and ``[A, B, V]`` views with A > 1 (``rows_view``)."""
    monkeypatch.setattr(portable_sampling, "BLOCK_ELEMENTS", 3 * 40)
    params = ak.SamplingParams(top_k=7, top_p=0.8)
    full, view = make_full((3, 7, 40), torch.float32, "shifted", seed=9)
    target = sampled_targets(view(full), vllm_kept(view(full), params), params, seed=5)
    check_against_vllm(full, target, params, backend, view)


def test_no_grad_and_forward_only_agree():
    params = ak.SamplingParams(top_k=5, top_p=0.9)
    base, _ = make_full((2, 3, 33), torch.float32, seed=2)
    target = torch.randint(0, 33, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        no_grad = ak.token_logprobs(base.clone().requires_grad_(True), target, sampling=params,
                                    backend="torch")
    assert no_grad.grad_fn is None
    assert torch.equal(no_grad, ak.token_logprobs(base, target, sampling=params,
                                                  backend="torch"))


def test_torch_compile_traces_the_sampling_path():
    params = ak.SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    base, _ = make_full((2, 3, 33), torch.float32, seed=3)
    target = torch.randint(0, 33, (2, 3), generator=torch.Generator().manual_seed(0))

    def step(x):
        logp, support = ak.token_logprobs(x, target, sampling=params, return_support=True,
                                          backend="torch")
        return torch.where(support["in_support"], logp, 0.0).sum()

    x_eager, x_compiled = (base.clone().requires_grad_(True) for _ in range(2))
    eager = step(x_eager)
    eager.backward()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x_compiled)
    compiled.backward()
    assert torch.equal(compiled, eager) and torch.equal(x_compiled.grad, x_eager.grad)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("dynamic", [True, None])
def test_torch_compile_does_not_recompile_for_new_sampling_floats(backend, dynamic):
    """``top_p`` and ``temperature`` as arguments of the compiled function: new values reuse
    the graph (after Dynamo's one recompile that makes a float symbolic when ``dynamic`` is
    left to it), with the eager result and gradient."""
    base, _ = make_full((2, 3, 33), torch.float32, seed=3)
    target = torch.randint(0, 33, (2, 3), generator=torch.Generator().manual_seed(0))

    def step(x, top_p, temperature):
        params = ak.SamplingParams(temperature=temperature, top_k=5, top_p=top_p)
        logp, support = ak.token_logprobs(x, target, sampling=params, return_support=True,
                                          backend=backend)
        return torch.where(support["in_support"], logp, 0.0).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    floats = [(0.9, 0.7), (0.8, 1.1), (0.95, 0.5), (0.6, 1.4)]
    allowed = 1 if dynamic else 2
    for index, (top_p, temperature) in enumerate(floats):
        x_eager, x_compiled = (base.clone().requires_grad_(True) for _ in range(2))
        with torch._dynamo.config.patch(error_on_recompile=index >= allowed):
            got = compiled(x_compiled, top_p, temperature)
        got.backward()
        expected = step(x_eager, top_p, temperature)
        expected.backward()
        assert torch.equal(got, expected) and torch.equal(x_compiled.grad, x_eager.grad)


def test_sampling_params_validation():
    assert ak.SamplingParams() == ak.SamplingParams(1.0, 0, 1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        ak.SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        ak.SamplingParams(temperature=math.inf)
    with pytest.raises(ValueError, match="top_k"):
        ak.SamplingParams(top_k=-1)
    with pytest.raises(TypeError, match="top_k"):
        ak.SamplingParams(top_k=5.0)
    with pytest.raises(TypeError, match="top_k"):
        ak.SamplingParams(top_k=True)
    for top_p in (0.0, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="top_p"):
            ak.SamplingParams(top_p=top_p)
    for min_p in (-0.1, 1.1, math.nan):
        with pytest.raises(ValueError, match="min_p"):
            ak.SamplingParams(min_p=min_p)
    with pytest.raises(AttributeError):
        ak.SamplingParams().top_k = 3  # frozen


def test_sampling_argument_errors():
    logits = torch.randn(2, 10)
    target = torch.tensor([1, 2])
    params = ak.SamplingParams(top_k=3)
    with pytest.raises(ValueError, match="SamplingParams\\(temperature"):
        ak.token_logprobs(logits, target, temperature=0.7, sampling=params)
    with pytest.raises(TypeError, match="sampling"):
        ak.token_logprobs(logits, target, sampling={"top_k": 3})
    with pytest.raises(TypeError, match="return_support"):
        ak.token_logprobs(logits, target, return_support=1)
    for option in ({"return_entropy": True}, {"inplace_backward": True}):
        with pytest.raises(ValueError, match=next(iter(option))):
            ak.token_logprobs(logits, target, sampling=params, **option)
        with pytest.raises(ValueError, match=next(iter(option))):
            ak.token_logprobs(logits, target, return_support=True, **option)
    with pytest.raises(ValueError, match="target"):
        ak.token_logprobs(logits, torch.tensor([1, 10]), sampling=params)
    hidden, weight = torch.randn(2, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="statistics"):
        ak.linear_token_logprobs(hidden, weight, target, sampling=params,
                                 statistics=("is_top1",))
    with pytest.raises(ValueError, match="temperature"):
        ak.linear_token_logprobs(hidden, weight, target, temperature=2.0, sampling=params)


# Rows long enough for the cpp kernel's candidate bounds (csrc/sampling.cpp): the group maxima
# bound top_k (2k groups and more; with fewer groups than k, the maxima of strided sub-groups
# while k <= V / 8, the last chunk partial at LONG_VOCAB) and top_p alone (its group maxima's
# mass, else cuts below the max, else the whole row); the rows of the tests above are too short
# to have groups.
LONG_VOCAB = 1500
# logits' scale: flat rows (top_p alone gathers everything), LM-like and very peaky rows, and
# rows of small integers (ties everywhere, the top-k and top-p boundaries included)
ROW_KINDS = {"flat": 0.3, "lm": 3.0, "peaky": 10.0, "integers": None}
LONG_SETTINGS = [
    {"top_k": 5},  # 2k or more groups: the group-maxima bound
    {"top_k": 30, "top_p": 0.9},
    {"top_k": 200, "top_p": 0.8},  # fewer than k groups: every logit a candidate
    {"top_k": 60},  # fewer than k groups: maxima of strided sub-groups of 8 logits bound top_k
    {"top_k": 150, "top_p": 0.9},  # ... of 4 logits
    {"top_p": 0.5},
    {"top_p": 0.95},
    {"top_p": 0.999},
    {"min_p": 0.05},
    {"min_p": 0.02, "top_k": 40},
    {"min_p": 0.01, "top_p": 0.7},
]


def long_rows(kind, dtype, seed):
    """``(full, view)`` of ``[2, 3, LONG_VOCAB]`` logits of one of :data:`ROW_KINDS`, seen
    through the ``x[:, :-1]`` view."""
    full_shape, view = LAYOUTS["shifted"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(full_shape(2, 3, LONG_VOCAB), generator=g)
    scale = ROW_KINDS[kind]
    x = torch.round(x * 2.0) if scale is None else x * scale
    return x.to(dtype), view


@pytest.mark.parametrize("settings", LONG_SETTINGS, ids=lambda s: "-".join(
    f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("kind", sorted(ROW_KINDS))
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_long_rows_match_vllm(backend, kind, settings):
    params = ak.SamplingParams(temperature=0.8, **settings)
    full, view = long_rows(kind, torch.float32, seed=len(kind) + settings.get("top_k", 0))
    target = sampled_targets(view(full), vllm_kept(view(full), params), params, seed=1)
    check_against_vllm(full, target, params, backend, view)


@pytest.mark.parametrize("top_k", [60, 150, 400])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_large_top_k_keeps_every_tie_at_its_boundary(backend, top_k):
    """top_k above the number of groups (60, 150: the strided sub-group bound; 400 > V / 8:
    every logit a candidate) on rows of small integers: the k-th largest value is tied many
    times over, and every copy of it is kept."""
    params = ak.SamplingParams(temperature=0.8, top_k=top_k)
    full, view = long_rows("integers", torch.float32, seed=top_k)
    kept = vllm_kept(view(full), params)
    target = sampled_targets(view(full), kept, params, seed=4)
    _, support = check_against_vllm(full, target, params, backend, view)
    # the boundary is tied (kept beyond k) in most rows; a row may end exactly at k
    assert int((kept.sum(-1) > top_k).sum()) >= 3
    valid = target != -100
    assert torch.all(support["support_size"][valid] >= top_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_long_rows_half_precision(backend, dtype):
    params = ak.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
    full, view = long_rows("lm", dtype, seed=3)
    target = sampled_targets(view(full), vllm_kept(view(full), params), params, seed=2)
    check_against_vllm(full, target, params, backend, view)


# Rows wider than the cpp kernel's direct bisection (kDirectMax = 1024 values in
# csrc/sampling.cpp): large top_k and top_p on a row without candidates (a flat one) take their
# first round on the row itself, with a bracket placed by a sample of it (a dominant token among
# the sampled values, a pattern the sample could alias); copied sets above 1024 values take a
# sampled bracket too, and a bracket that misses is followed by a pass on its other side.
WIDE_VOCAB = 5000
WIDE_KINDS = ("flat", "lm", "integers", "dominant", "periodic")
WIDE_SETTINGS = [
    {"top_p": 0.9},
    {"top_p": 0.95},
    {"top_p": 0.5},  # an LM row's crossing among its few largest logits: brackets that miss
    {"top_k": 500},
    {"top_k": 3000},  # the candidates (about 3500) take a sampled bracket
    {"top_k": 3000, "top_p": 0.9},
    {"top_k": 500, "top_p": 0.95},
    {"min_p": 0.05},
    {"min_p": 0.05, "top_p": 0.9},  # top_p above a floor: the mass known only after a pass
    {"min_p": 0.02, "top_k": 3000},
    {"top_k": 50, "top_p": 0.9},  # top_k within the group count: the group maxima's bound
]


def wide_rows(kind, dtype, seed):
    """``(full, view)`` of ``[2, 3, WIDE_VOCAB]`` logits seen through the ``x[:, :-1]`` view:
    flat, LM-like and small-integer rows as :func:`long_rows`, a flat row under two dominant
    tokens side by side (most of the mass, in one group of the kernel's pass), and a pattern of
    period 64 (plus a little noise)."""
    full_shape, view = LAYOUTS["shifted"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(full_shape(2, 3, WIDE_VOCAB), generator=g)
    if kind == "dominant":
        x = x * ROW_KINDS["flat"]
        top = torch.randint(0, WIDE_VOCAB - 1, (*x.shape[:-1], 1), generator=g)
        x.scatter_(-1, top, math.log(WIDE_VOCAB) + 1.0)
        x.scatter_(-1, top + 1, math.log(WIDE_VOCAB))
    elif kind == "periodic":
        x = (torch.arange(WIDE_VOCAB) * 37 % 64).float() / 16.0 + 0.01 * x
    else:
        scale = ROW_KINDS[kind]
        x = torch.round(x * 2.0) if scale is None else x * scale
    return x.to(dtype), view


def top_p_clear_of_rounding(logits, params, margin=2e-6):
    """Whether no row's top_p boundary sits within ``margin`` of top_p in float64: the mass of
    the kept tokens above each candidate (vLLM's ascending cumsum) is at least ``margin`` away
    from ``1 - top_p`` (the kernels sum float32 exps; a closer row may go either way, as the
    contract says)."""
    if params.top_p >= 1:
        return True
    processed = logits.double() / params.temperature
    if params.min_p > 0:
        probs = processed.softmax(-1)
        processed = processed.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True),
                                          -math.inf)
    ascending = processed.sort(-1).values
    vocab = processed.shape[-1]
    if 0 < params.top_k < vocab:
        kth = ascending[..., vocab - params.top_k:vocab - params.top_k + 1]
        ascending = ascending.masked_fill(ascending < kth, -math.inf)
    cumulative = ascending.softmax(-1).cumsum(-1)
    return bool(((cumulative - (1 - params.top_p)).abs() >= margin).all())


def clear_wide_rows(kind, dtype, params, seed):
    """:func:`wide_rows` of the first seed from ``seed`` whose rows are clear of float32
    rounding at the top_p boundary (:func:`top_p_clear_of_rounding`)."""
    return next(rows for rows in (wide_rows(kind, dtype, s) for s in range(seed, seed + 10))
                if top_p_clear_of_rounding(rows[1](rows[0]), params))


def vllm_kept_wide(logits, params):
    """:func:`vllm_kept` without its ``[V, V]`` table of ties: vLLM keeps every token above the
    lowest value it keeps and part of the tokens tied with it, so the tie rule keeps every
    token at or above that value."""
    kept = vllm_sampler_kept(logits, params)
    scaled = logits.double() / params.temperature
    return scaled >= scaled.masked_fill(~kept, math.inf).amin(-1, keepdim=True)


@pytest.mark.parametrize("kind", sorted(ROW_KINDS))
def test_vllm_kept_wide_is_vllm_kept(kind):
    for settings in [*LONG_SETTINGS, *WIDE_SETTINGS]:
        params = ak.SamplingParams(temperature=0.8, **settings)
        full, view = long_rows(kind, torch.float32, seed=len(kind))
        assert torch.equal(vllm_kept_wide(view(full), params), vllm_kept(view(full), params))


@pytest.mark.parametrize("settings", WIDE_SETTINGS, ids=lambda s: "-".join(
    f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("kind", WIDE_KINDS)
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_wide_rows_match_vllm(backend, kind, settings):
    params = ak.SamplingParams(temperature=0.8, **settings)
    full, view = clear_wide_rows(kind, torch.float32, params, len(kind) + settings.get("top_k", 0))
    kept = vllm_kept_wide(view(full), params)
    target = sampled_targets(view(full), kept, params, seed=1)
    check_against_vllm(full, target, params, backend, view, kept=kept)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_wide_rows_on_every_instruction_set(isa):
    """The cpp kernel copies a bracket's logits with AVX-512 compress instructions in its
    AVX-512 variant and with flags in the others: every variant this CPU runs keeps the same
    tokens, the float64 spec's."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend
    order = ("generic", "avx2", "avx512")
    if order.index(isa) > order.index(cpp_backend.load_extension().detected_isa()):
        pytest.skip(f"this CPU does not run {isa}")
    previous = cpp_backend.set_isa(isa)
    try:
        for kind, settings in [("flat", {"top_p": 0.9}), ("lm", {"top_k": 3000, "top_p": 0.9}),
                               ("flat", {"min_p": 0.05, "top_p": 0.95}),
                               ("dominant", {"top_p": 0.95}), ("integers", {"top_k": 1500})]:
            params = ak.SamplingParams(temperature=0.8, **settings)
            full, view = clear_wide_rows(kind, torch.float32, params, 3)
            kept = vllm_kept_wide(view(full), params)
            target = sampled_targets(view(full), kept, params, seed=2)
            check_against_vllm(full, target, params, "cpp", view, kept=kept)
    finally:
        cpp_backend.set_isa(previous)


@pytest.mark.parametrize("settings", [{"top_p": 0.9}, {"top_k": 3000, "top_p": 0.95},
                                      {"min_p": 0.05, "top_p": 0.9}],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("kind", ["flat", "lm"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_wide_rows_bfloat16(backend, kind, settings):
    """bfloat16 rows tie every few logits (8 bits of mantissa): the brackets' bounds and the
    bisections end on them whole."""
    params = ak.SamplingParams(temperature=0.8, **settings)
    full, view = clear_wide_rows(kind, torch.bfloat16, params, 11)
    kept = vllm_kept_wide(view(full), params)
    target = sampled_targets(view(full), kept, params, seed=2)
    check_against_vllm(full, target, params, backend, view, kept=kept)


@pytest.mark.parametrize("top_k", [1500, 4000])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_wide_large_top_k_keeps_every_tie_at_its_boundary(backend, top_k):
    """top_k far above the group count on wide rows of small integers: the k-th largest value
    is tied hundreds of times over, and every copy of it is kept."""
    params = ak.SamplingParams(temperature=0.8, top_k=top_k)
    full, view = wide_rows("integers", torch.float32, seed=top_k)
    kept = vllm_kept_wide(view(full), params)
    target = sampled_targets(view(full), kept, params, seed=4)
    _, support = check_against_vllm(full, target, params, backend, view, kept=kept)
    assert torch.all(kept.sum(-1) > top_k + 100)
    valid = target != -100
    assert torch.all(support["support_size"][valid] > top_k + 100)


@pytest.mark.parametrize("shift", [-1e-4, 1e-4])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_top_p_at_a_tie_groups_mass_on_wide_rows(backend, shift):
    """Wide rows of a few tied levels, top_p 1e-4 below or above the float64 mass of the levels
    from some level up: just below, the next level (its mass strictly above reaches top_p) is
    out whole; just above, it crosses top_p and is kept whole. The float32 sums of the kernels
    are far closer than 1e-4."""
    levels = torch.arange(12, dtype=torch.float64) * 0.4
    counts = torch.tensor([1700, 1000, 750, 560, 380, 250, 170, 100, 45, 25, 8, 2])
    row = torch.repeat_interleave(levels, counts)
    row = torch.cat([row, torch.full((WIDE_VOCAB - row.numel(),), -2.0, dtype=torch.float64)])
    g = torch.Generator().manual_seed(5)
    rows = torch.stack([row[torch.randperm(WIDE_VOCAB, generator=g)] for _ in range(6)])
    full = rows.reshape(2, 3, WIDE_VOCAB).float()
    temperature = 0.8
    probs = torch.softmax(row / temperature, -1)
    mass_from = torch.stack([probs[row >= level].sum() for level in levels])  # levels and up
    level = 6  # keep levels 6..11 (mass about 0.6), then decide level 5
    top_p = float(mass_from[level]) + shift
    params = ak.SamplingParams(temperature=temperature, top_p=top_p)
    kept = vllm_kept_wide(full, params)
    lowest_kept = levels[level - 1] if shift > 0 else levels[level]
    assert torch.equal(kept, full.double() >= lowest_kept)
    target = sampled_targets(full, kept, params, seed=6)
    check_against_vllm(full, target, params, backend, kept=kept)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_one_row_and_all_rows_ignored(backend):
    params = ak.SamplingParams(temperature=0.9, top_k=4, top_p=0.8)
    full, _ = make_full((1, 1, 37), torch.float32, seed=12)
    target = sampled_targets(full, vllm_kept(full, params), params, seed=0, mixed=False)
    check_against_vllm(full, target, params, backend)
    ignored = torch.full((1, 1), -100)
    x = full.clone().requires_grad_(True)
    logp, support = ak.token_logprobs(x, ignored, sampling=params, return_support=True,
                                      backend=backend)
    logp.sum().backward()
    assert torch.equal(logp, torch.zeros(1, 1)) and not x.grad.any()
    assert support["support_size"].item() == 0 and not support["in_support"].any()
    x = make_full((2, 3, 37), torch.float32, seed=1)[0].requires_grad_(True)
    logp = ak.token_logprobs(x, torch.full((2, 3), -100), sampling=params, backend=backend)
    logp.sum().backward()
    assert not logp.any() and not x.grad.any()


def _colliding_pair(temperature):
    """Two adjacent float32 logits whose float32 quotients by ``temperature`` are equal."""
    t = torch.tensor(temperature, dtype=torch.float32)
    x = torch.linspace(2.0, 4.0, 200001, dtype=torch.float32)
    x = torch.unique(x)
    lower = x
    upper = torch.nextafter(x, torch.tensor(math.inf))
    hit = (lower / t == upper / t).nonzero()[0, 0]
    return float(lower[hit]), float(upper[hit])


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_logits_whose_quotients_tie_are_tied(backend):
    """``s = float32(z) / T`` can round two adjacent logits to one value: they are tied in
    ``s``, so the k-th largest keeps both (the cpp kernel works on the logits themselves)."""
    temperature = 0.7
    low, high = _colliding_pair(temperature)
    row = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) - 2.0
    row[0, [10, 250]] = torch.tensor([high, low])  # the 1st and 2nd largest
    row[0, 40] = high + 1.0
    params = ak.SamplingParams(temperature=temperature, top_k=2)
    logp, support = ak.token_logprobs(row, torch.tensor([250]), sampling=params,
                                      return_support=True, backend=backend)
    assert support["support_size"].item() == 3 and bool(support["in_support"])
    assert torch.isfinite(logp).all()


def test_sampled_forward_declares_its_output_dtypes():
    """The cpp primitive returns what ``SAMPLING_PRIMITIVES`` declares: four float32 rows, then
    support_size int64 and in_support bool."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend
    from astrai_kernels.kernels.primitives import SAMPLING_PRIMITIVES, SamplingArgs
    declared = SAMPLING_PRIMITIVES["sampled_logprobs_forward"]
    logits = make_full((1, 3, 40), torch.float32, seed=1)[0]
    outputs = cpp_backend.sampled_logprobs_forward(logits, torch.tensor([0, 5, -100]),
                                                   SamplingArgs(0.7, 5, 0.9, 0.0, -100))
    assert declared.output_dtypes == portable_sampling.ROW_OUTPUT_DTYPES
    assert tuple(out.dtype for out in outputs) == declared.output_dtypes
    assert tuple(out.numel() for out in outputs) == declared.outputs(None, 3)


def _non_finite_rows(vocab):
    """``(rows, target, bad)``: LM-like rows, some made non-finite (NaN or +inf, at the target
    or elsewhere, all -inf, NaN with -inf), and which rows those are."""
    rows = torch.randn(9, vocab, generator=torch.Generator().manual_seed(4)) * 3.0
    target = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(5))
    rows[1, 7], target[1] = math.nan, 3
    rows[2, 7], target[2] = math.nan, 7
    rows[3, 9], target[3] = math.inf, 3
    rows[4, 9], target[4] = math.inf, 9
    rows[5] = -math.inf
    rows[6, ::5], rows[6, 2] = -math.inf, math.nan
    rows[7, :] = math.nan
    bad = torch.zeros(9, dtype=torch.bool)
    bad[1:8] = True
    return rows, target, bad


@pytest.mark.parametrize("settings", LONG_SETTINGS, ids=lambda s: "-".join(
    f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("vocab", [VOCAB, LONG_VOCAB, WIDE_VOCAB])
@pytest.mark.parametrize("backend", ["cpp", "torch", "reference"])
def test_rows_with_nan_or_inf_are_nan_as_in_the_plain_op(vocab, settings, backend):
    """A row holding NaN or +inf (or only -inf) has no distribution: the plain op gives NaN
    log-probs and a NaN gradient there, and so does the sampling path (in_support, every token
    counted), the cpp kernel and the torch path alike, whatever its filters; it never hangs,
    and the other rows are untouched. The float64 spec (``backend="reference"``) says so too."""
    params = ak.SamplingParams(temperature=0.8, **settings)
    rows, target, bad = _non_finite_rows(vocab)
    x, x_plain = (rows.clone().requires_grad_(True) for _ in range(2))
    logp, support = ak.token_logprobs(x, target, sampling=params, return_support=True,
                                      backend=backend)
    plain = ak.token_logprobs(x_plain, target, temperature=0.8, backend=backend)
    logp.backward(torch.ones_like(logp))
    plain.backward(torch.ones_like(plain))
    assert torch.isnan(plain[bad]).all() and torch.isnan(x_plain.grad[bad]).any(-1).all()
    assert torch.isnan(logp[bad]).all() and torch.isnan(x.grad[bad]).any(-1).all()
    assert torch.isnan(support["log_kept_mass"][bad]).all()
    assert support["in_support"][bad].all()
    assert torch.all(support["support_size"][bad] == vocab)
    finite = ~bad
    alone = rows[finite].clone().requires_grad_(True)
    logp_alone, support_alone = ak.token_logprobs(alone, target[finite], sampling=params,
                                                  return_support=True, backend=backend)
    logp_alone.backward(torch.ones_like(logp_alone))
    assert torch.equal(logp[finite], logp_alone)
    assert torch.equal(x.grad[finite], alone.grad)
    for name in support:
        assert torch.equal(support[name][finite], support_alone[name])
    check_against_vllm(rows[finite], target[finite], params, backend)


def _rows_with_minus_inf(vocab):
    """``(rows, target)``: rows holding -inf entries: a third of them, all but one (the target
    or another token), all but three, and a target at -inf among finite logits."""
    rows = torch.randn(6, vocab, generator=torch.Generator().manual_seed(6)) * 3.0
    target = torch.tensor([4, 3, 5, 2, vocab - 1, 1])
    rows[0, ::3] = -math.inf
    rows[1, ::3] = -math.inf  # target 3 at -inf
    rows[2:5] = -math.inf
    rows[2:4, 5] = 1.0
    rows[4, [5, vocab // 2, vocab - 1]] = torch.tensor([1.0, 2.0, 0.5])
    rows[5, 1] = -math.inf
    return rows, target


@pytest.mark.parametrize("settings", [*LONG_SETTINGS, {"top_k": 2}, {"top_k": 4, "top_p": 0.99}],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("vocab", [VOCAB, LONG_VOCAB, WIDE_VOCAB])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_rows_with_minus_inf_match_the_spec(backend, vocab, settings):
    """-inf logits are tokens of probability 0: the float64 spec
    (``reference.sampled_token_logprobs``) keeps them only where the threshold is -inf (top_k
    above the number of finite logits), and they count in support_size there."""
    params = ak.SamplingParams(temperature=0.8, **settings)
    rows, target = _rows_with_minus_inf(vocab)
    x = rows.clone().requires_grad_(True)
    logp, support = ak.token_logprobs(x, target, sampling=params, return_support=True,
                                      backend=backend)
    upstream = torch.rand(target.shape, generator=torch.Generator().manual_seed(8)) + 0.5
    logp.backward(upstream)
    spec = {}
    for precision in (torch.float64, torch.float32):
        xr = rows.to(precision).requires_grad_(True)
        result = ak.reference.sampled_token_logprobs(
            xr, target, params.temperature, params.top_k, params.top_p, params.min_p)
        result[0].backward(upstream.to(precision))
        spec[precision] = (*result, xr.grad)
    want, naive = spec[torch.float64], spec[torch.float32]
    assert torch.equal(support["in_support"], want[3])
    assert torch.equal(support["support_size"], want[2])
    assert_close(logp, want[0], "value", torch.float32, "logp", naive=naive[0])
    assert_close(support["log_kept_mass"], want[1], "value", torch.float32, "log_kept_mass",
                 naive=naive[1])
    assert not torch.isnan(x.grad).any()
    assert_close(x.grad, want[4], "grad", torch.float32, "grad", naive=naive[4])
