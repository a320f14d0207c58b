"""``token_logprobs`` and ``linear_token_logprobs`` with ``target [..., K]`` (K targets a row,
verl's top-k log-probs): against ``reference.py`` and ``log_softmax(...).gather`` in float64."""

import pytest
import torch
import torch.nn.functional as F
from test_linear import _compare

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close

from cases import KERNEL_BACKENDS, assert_compiles_like_eager, leaf, reference_and_naive

BACKENDS = KERNEL_BACKENDS + ["reference"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _case(name, dtype):
    """``(base, view, target [..., K], temperature)``: ``view(base)`` are the logits."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=2.0):
        return torch.randn(*shape, generator=g) * scale

    def targets(shape, vocab, ignored=0.2):
        target = torch.randint(0, vocab, shape, generator=g)
        target[torch.rand(shape, generator=g) < ignored] = -100
        return target

    whole = lambda x: x
    if name == "below_tile":  # V = 37, smaller than a tile; ids repeated within rows
        target = targets((6, 4), 37)
        target[:, 3] = torch.where(target[:, 0] == -100, 5, target[:, 0])
        target[1] = torch.tensor([9, 9, 9, -100])
        base, view, temperature = randn(6, 37), whole, 0.7
    elif name == "one_row_k1":
        base, view, target, temperature = randn(1, 300), whole, torch.tensor([[299]]), 1.0
    elif name == "all_ignored":
        base, view, target, temperature = randn(3, 40), whole, torch.full((3, 2), -100), 1.0
    elif name == "shifted":  # x[:, :-1] of causal-LM logits: rows not uniformly strided
        base, view, temperature = randn(2, 5, 70), lambda x: x[:, :-1], 1.3
        target = targets((2, 4, 3), 70)
    elif name == "vocab_strided":
        base, view, temperature = randn(4, 90), lambda x: x[:, ::2], 1.0
        target = targets((4, 5), 45)
    elif name == "confident_large":  # lse ~ 400: logp_k = z_k / T - lse would lose ~1e-4
        base = randn(4, 64, scale=50.0)
        top = torch.tensor([1, 5, 9, 63])
        base[torch.arange(4), top] = base.amax(-1) + 20.0
        target = torch.stack([top, targets((4,), 64, ignored=0), top], -1)
        view, temperature = whole, 0.9
    else:
        raise KeyError(name)
    return base.to(dtype), view, target, temperature


CASES = ["below_tile", "one_row_k1", "all_ignored", "shifted", "vocab_strided",
         "confident_large"]


def _gathered(logits, target, temperature):
    """``log_softmax(logits / T).gather(-1, target)``, 0 on ignored entries."""
    valid = target != -100
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    return torch.where(valid, logp_all.gather(-1, torch.where(valid, target, 0)), 0.0)


def _grad_terms(logits, target, upstream, temperature, grad_entropy=None):
    """The terms forming each entry of ``(sum_{k: t_k = j} g_k - G p_j) / T``, float64:
    ``(sum_{k: t_k = j} |g_k| + sum_k |g_k| p_j (1 + |log p_j|)) / T``, plus the entropy's
    ``|g_H| p_j (|log p_j| + H) / T`` when ``grad_entropy`` is given."""
    valid = target != -100
    g = torch.where(valid, upstream.double().abs(), 0.0)
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    onehot_sum = torch.zeros_like(log_p).scatter_add_(-1, torch.where(valid, target, 0), g)
    row_valid = valid.any(-1, keepdim=True)
    p = log_p.exp()
    terms = onehot_sum + g.sum(-1, keepdim=True) * (p * (1 + log_p.abs())).nan_to_num(0.0)
    if grad_entropy is not None:
        entropy = -(p * log_p).nan_to_num(0.0).sum(-1, keepdim=True)
        spread = (p * (log_p.abs() + entropy)).nan_to_num(0.0)
        terms = terms + grad_entropy.double().abs().unsqueeze(-1) * spread
    return torch.where(row_valid, terms, 0.0) / temperature


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_columns(backend, name, dtype):
    base, view, target, temperature = _case(name, dtype)
    x = leaf(base)
    logp = ak.token_logprobs(view(x), target, temperature=temperature, backend=backend)
    assert logp.dtype == torch.float32 and logp.shape == target.shape
    upstream = torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
    (logp * upstream).sum().backward()

    def run(xr):
        out = reference.token_logprobs(view(xr), target, temperature)[0]
        (out * upstream.to(xr.dtype)).sum().backward()
        return {"logp": out}

    expected, naive = reference_and_naive(run, base)
    xd = base.double().requires_grad_(True)
    gathered = _gathered(view(xd), target, temperature)
    (gathered * upstream.double()).sum().backward()
    scale = torch.zeros(base.shape, dtype=torch.float64)
    view(scale).copy_(_grad_terms(view(base), target, upstream, temperature))
    for what, want, want_grad in (("reference", expected["logp"], expected["grad"]),
                                  ("gather", gathered.detach(), xd.grad)):
        assert_close(logp, want, "value", dtype, f"logp vs {what}", naive=naive["logp"])
        assert_close(x.grad, want_grad, "grad", dtype, f"grad vs {what}",
                     naive=naive["grad"], scale=scale)
    ignored = target == -100
    assert torch.all(logp[ignored] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_columns_with_entropy(backend):
    base, view, target, temperature = _case("below_tile", torch.float32)
    target[4] = -100  # a row whose K targets are all ignored: entropy 0, no gradient
    x = leaf(base)
    logp, entropy = ak.token_logprobs(view(x), target, temperature=temperature,
                                      return_entropy=True, backend=backend)
    assert entropy.shape == target.shape[:-1] and entropy[4] == 0
    g = torch.Generator().manual_seed(2)
    grad_logp, grad_entropy = torch.randn(target.shape, generator=g), torch.randn(6, generator=g)
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()

    def run(xr):
        out, ent = reference.token_logprobs(view(xr), target, temperature)
        ((out * grad_logp.to(xr.dtype)).sum() + (ent * grad_entropy.to(xr.dtype)).sum()
         ).backward()
        return {"logp": out, "entropy": ent}

    expected, naive = reference_and_naive(run, base)
    assert_close(logp, expected["logp"], "value", torch.float32, "logp", naive=naive["logp"])
    assert_close(entropy, expected["entropy"], "value", torch.float32, "entropy",
                 naive=naive["entropy"])
    assert_close(x.grad, expected["grad"], "grad", torch.float32, "grad", naive=naive["grad"])
    assert torch.all(x.grad[4] == 0)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_one_column_is_the_single_target_op(backend):
    base, _, target, _ = _case("below_tile", torch.bfloat16)
    single = target[:, 0]
    x_columns, x_single = leaf(base), leaf(base)
    columns = ak.token_logprobs(x_columns, single[:, None], temperature=0.7, backend=backend)
    logp = ak.token_logprobs(x_single, single, temperature=0.7, backend=backend)
    assert torch.equal(columns[:, 0], logp)
    upstream = torch.randn(6, generator=torch.Generator().manual_seed(3))
    (columns[:, 0] * upstream).sum().backward()
    (logp * upstream).sum().backward()
    xd = base.double().requires_grad_(True)
    (_gathered(xd, single[:, None], 0.7)[:, 0] * upstream.double()).sum().backward()
    assert_close(x_columns.grad, xd.grad, "grad", torch.bfloat16, naive=x_single.grad)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_only_equals_autograd_forward(backend):
    base, view, target, temperature = _case("shifted", torch.float32)
    with torch.no_grad():
        plain = ak.token_logprobs(view(base), target.int(), temperature=temperature,
                                  backend=backend)
    tracked = ak.token_logprobs(view(leaf(base)), target, temperature=temperature,
                                backend=backend)
    assert plain.grad_fn is None and torch.equal(plain, tracked.detach())


def _head_inputs(dtype, seed=4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 16, generator=g).to(dtype)
    weight = (torch.randn(37, 16, generator=g) * 16 ** -0.5 * 3).to(dtype)
    bias = (torch.randn(37, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, 37, (2, 5, 3), generator=g)
    target[torch.rand(2, 5, 3, generator=g) < 0.2] = -100
    target[0, 1, 2] = target[0, 1, 0] = 4  # a repeated id
    target[1, 3] = -100  # a row with every target ignored
    return (hidden, weight, bias), target


TRANSFORMS = {"plain": {}, "softcap": {"softcap": 4.0, "logit_scale": 0.8}}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_columns(backend, dtype, transform):
    """Values and the hidden/weight/bias gradients against float64 on ``F.linear``, entry by
    entry; chunks of 3 rows split the rows of a sequence."""
    kwargs = TRANSFORMS[transform]
    tensors, target = _head_inputs(dtype)

    def fused(h, w, b):
        logp, entropy = ak.linear_token_logprobs(h, w, target, bias=b, temperature=0.8,
                                                 return_entropy=True, chunk_size=3,
                                                 backend=backend, **kwargs)
        assert logp.shape == target.shape and entropy.shape == target.shape[:-1]
        return torch.cat([logp.flatten(), entropy.flatten()])

    def logits_fn(logits):
        z = reference.transform_logits(logits, **kwargs)
        logp, entropy = reference.token_logprobs(z, target, 0.8)
        return torch.cat([logp.flatten(), entropy.flatten()])

    def output_terms(logits):
        """``logp = s_y - lse`` and ``H = lse - sum p s`` cancel: judge them by their terms
        (the fused head's logits round differently from ``F.linear``'s)."""
        s = reference.transform_logits(logits, **kwargs) / 0.8
        logp, _ = reference.token_logprobs(s, target)
        row_valid = (target != -100).any(-1)
        lse = torch.logsumexp(s, -1)
        spread = (torch.softmax(s, -1) * s.abs()).sum(-1)
        return torch.cat([(logp.abs() + lse.abs().unsqueeze(-1)).flatten(),
                          torch.where(row_valid, lse.abs() + spread, 0.0).flatten()])

    def grad_logits_terms(logits, upstream):
        """Of the transformed logits, times ``|dz/dx| <= |logit_scale|``."""
        z = reference.transform_logits(logits, **kwargs)
        grad_logp, grad_entropy = upstream[:target.numel()], upstream[target.numel():]
        return abs(kwargs.get("logit_scale", 1.0)) * _grad_terms(
            z, target, grad_logp.view(target.shape), 0.8, grad_entropy.view(target.shape[:-1]))

    _compare(fused, logits_fn, tensors, dtype, output_terms=output_terms,
             grad_logits_terms=grad_logits_terms)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_linear_columns_equal_the_logits_op(backend):
    """Without autograd the fused head gives the logits op's values on its float32 logits."""
    (hidden, weight, bias), target = _head_inputs(torch.float32, seed=5)
    with torch.no_grad():
        fused = ak.linear_token_logprobs(hidden, weight, target, bias=bias, chunk_size=4,
                                         backend=backend)
        logits = F.linear(hidden, weight, bias)
        exact = _gathered(F.linear(hidden.double(), weight.double(), bias.double()), target, 1.0)
    assert_close(fused, exact, "value", torch.float32,
                 naive=ak.token_logprobs(logits, target, backend=backend))


def test_refusals_name_the_argument():
    logits = torch.randn(3, 11)
    target = torch.zeros(3, 2, dtype=torch.long)
    for kwargs, name in (({"inplace_backward": True}, "inplace_backward"),
                         ({"process_group": object()}, "process_group"),
                         ({"sampling": ak.SamplingParams(top_k=2)}, "sampling"),
                         ({"return_support": True}, "return_support")):
        with pytest.raises(ValueError, match=name):
            ak.token_logprobs(logits, target, **kwargs)
    hidden, weight = torch.randn(3, 4), torch.randn(11, 4)
    with pytest.raises(ValueError, match="statistics"):
        ak.linear_token_logprobs(hidden, weight, target, statistics=("is_top1",))
    with pytest.raises(ValueError, match="process_group"):
        ak.linear_token_logprobs(hidden, weight, target, process_group=object())
    with pytest.raises(ValueError, match=r"target \[\.\.\., K\]"):
        ak.token_logprobs(logits, torch.zeros(3, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target \[\.\.\., K\]"):
        ak.token_logprobs(logits, torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="target holds 11"):
        ak.token_logprobs(logits, torch.tensor([[0, 11], [1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="target holds -3"):
        ak.linear_token_logprobs(hidden, weight, torch.tensor([[0, -3], [1, 2], [3, 4]]))


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_both_forms_compile_fullgraph(backend, with_entropy):
    """``target [..., K]`` traced by ``torch.compile(fullgraph=True)``, the logits op and the
    fused head (whose backward runs the functional op when traced and copies it over the
    chunk): values and gradients equal the eager calls'."""
    g = torch.Generator().manual_seed(31)
    vocab, k, hidden_size = 23, 3, 8
    hidden, weight = torch.randn(2, 3, hidden_size, generator=g), torch.randn(vocab, hidden_size,
                                                                              generator=g)
    target = torch.randint(0, vocab, (2, 3, k), generator=g)
    target[0, 1, 1] = -100
    target[1, 2, 2] = target[1, 2, 0]  # a repeated id

    def step(h, w):
        fused = ak.linear_token_logprobs(h, w, target, softcap=4.0, chunk_size=2,
                                         return_entropy=with_entropy, backend=backend)
        plain = ak.token_logprobs(h @ w.T, target, temperature=0.7,
                                  return_entropy=with_entropy, backend=backend)
        if with_entropy:
            return fused[0].sum() + fused[1].sum() + plain[0].sum() + 0.5 * plain[1].sum()
        return fused.sum() + plain.sum()

    assert_compiles_like_eager(step, hidden, weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_overwrite_columns_is_scatter(dtype):
    """The K-target backward writes its columns through an int16 view on 16-bit CPU tensors
    (torch's CPU scatter_ into bfloat16 converts the whole tensor to float32 and back): the
    same bits as scatter_, duplicate-free columns, values cast from float32, NaN and -0.0
    included."""
    from astrai_kernels.ops._common import overwrite_columns_

    g = torch.Generator().manual_seed(5)
    dst = torch.randn(6, 40, generator=g).to(dtype)
    columns = torch.stack([torch.randperm(40, generator=g)[:4] for _ in range(6)])
    values = torch.randn(6, 4, generator=g)
    values[0, 0], values[1, 1] = float("nan"), -0.0
    expected = dst.clone().scatter_(1, columns, values.to(dtype))
    out = overwrite_columns_(dst, 1, columns, values)
    assert out is dst
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))  # bitwise
