"""The triton backend's primitives against the torch chunked backend (the readable version).

Without CUDA these run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton), so shapes stay small; ``BLOCK_V_OVERRIDE`` forces several vocabulary
tiles at small V and ``PROGRAMS_OVERRIDE`` fewer programs than rows (the grid-stride loop).
"""

import pytest
import torch

from astrai_kernels.cpu import torch_backend as tb
from astrai_kernels.triton import backend as kb
from astrai_kernels.triton import config

DEVICE = "cuda" if torch.cuda.is_available() and not kb.kernels_interpreted() else "cpu"
_REASON = kb.unavailable_reason(DEVICE)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"triton backend: {_REASON}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPES_2 = [torch.float32, torch.bfloat16]  # fp16 takes the same 16-bit code path as bf16
VOCABS = [1, 5, 37, 300]
TILES = [None, 16]  # default rule (one tile at these V), or 16-wide tiles (up to 19 of them)
IGNORE = -100


@pytest.fixture(params=TILES, ids=lambda t: f"tile{t or 'auto'}")
def tile(request):
    saved = config.BLOCK_V_OVERRIDE
    config.BLOCK_V_OVERRIDE = request.param
    yield request.param
    config.BLOCK_V_OVERRIDE = saved


@pytest.fixture
def few_programs():
    saved = config.PROGRAMS_OVERRIDE
    config.PROGRAMS_OVERRIDE = 3
    yield
    config.PROGRAMS_OVERRIDE = saved


def make_logits(outer, inner, vocab, dtype, layout="contiguous", seed=0):
    """``[outer, inner, vocab]`` logits in a given memory layout (always a view of fresh data)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(outer, inner, vocab, generator=g) * 3
    elif layout == "shifted":  # the x[:, :-1] view of causal-LM logits
        x = (torch.randn(outer, inner + 1, vocab, generator=g) * 3)[:, :-1]
    elif layout == "strided_vocab":
        x = (torch.randn(outer, inner, 2 * vocab, generator=g) * 3)[..., ::2]
    elif layout == "transposed":  # vocabulary stride != 1 and row stride 1
        x = torch.randn(vocab, outer, inner, generator=g).mul(3).permute(1, 2, 0)
    else:
        raise ValueError(layout)
    return x.to(dtype).to(DEVICE)


def make_target(n_rows, vocab, seed=1, ignore_every=3, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, (n_rows,), generator=g)
    if ignore_every:
        y[::ignore_every] = IGNORE
    return y.to(dtype).to(DEVICE)


def tol(dtype):
    """(atol, rtol) for fp32 outputs computed from ``dtype`` logits, and for grads in ``dtype``."""
    out = dict(atol=2e-5, rtol=2e-5)
    grad = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-2)
    return out, grad


def assert_close(actual, expected, **kw):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **kw)


# ---------------------------------------------------------------------------------------------
# token log-probs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprobs_forward_backward(dtype, vocab, with_entropy, tile):
    logits = make_logits(2, 4, vocab, dtype, layout="shifted")
    target = make_target(8, vocab)
    temperature = 0.7
    out_t = kb.logprobs_forward(logits, target, temperature, IGNORE, with_entropy)
    out_r = tb.logprobs_forward(logits, target, temperature, IGNORE, with_entropy)
    out_tol, grad_tol = tol(dtype)
    for a, b in zip(out_t, out_r):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert_close(a, b, **out_tol)
    logp, entropy, lse = out_r
    g = torch.Generator().manual_seed(5)
    grad_logp = torch.randn(8, generator=g).to(DEVICE)
    grad_entropy = torch.randn(8, generator=g).to(DEVICE) if with_entropy else logp.new_empty(0)
    grad_t = torch.full_like(logits, float("nan"))
    grad_r = torch.empty_like(logits)
    kb.logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
                         IGNORE, grad_t)
    tb.logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
                         IGNORE, grad_r)
    assert_close(grad_t, grad_r, **grad_tol)
    assert (grad_t[0, 0] == 0).all()  # row 0 is ignored


@pytest.mark.parametrize("layout", ["contiguous", "strided_vocab", "transposed"])
def test_logprobs_layouts_and_int32_target(layout, tile):
    logits = make_logits(3, 3, 37, torch.float32, layout=layout)
    target = make_target(9, 37, dtype=torch.int32)
    out_t = kb.logprobs_forward(logits, target, 1.0, IGNORE, True)
    out_r = tb.logprobs_forward(logits, target, 1.0, IGNORE, True)
    for a, b in zip(out_t, out_r):
        assert_close(a, b, atol=2e-5, rtol=2e-5)
    grad_logp = torch.linspace(-1, 1, 9).to(DEVICE)
    grad_t = torch.empty(3, 3, 37, device=DEVICE).transpose(0, 1)  # a strided grad as well
    grad_r = torch.empty_like(logits)
    args = (out_r[2], out_r[1], grad_logp, grad_logp.flip(0), 1.0, IGNORE)
    kb.logprobs_backward(logits, target, *args, grad_t)
    tb.logprobs_backward(logits, target, *args, grad_r)
    assert_close(grad_t, grad_r, atol=1e-6, rtol=1e-5)


def test_logprobs_expanded_grad_and_ignored_only(tile):
    logits = make_logits(1, 4, 37, torch.float32)
    target = make_target(4, 37)
    logp, entropy, lse = tb.logprobs_forward(logits, target, 1.0, IGNORE, False)
    grad_logp = torch.ones((), device=DEVICE).expand(4)  # what sum().backward() hands over
    grad_t, grad_r = torch.empty_like(logits), torch.empty_like(logits)
    kb.logprobs_backward(logits, target, lse, entropy, grad_logp, entropy, 1.0, IGNORE, grad_t)
    tb.logprobs_backward(logits, target, lse, entropy, grad_logp, entropy, 1.0, IGNORE, grad_r)
    assert_close(grad_t, grad_r, atol=1e-6, rtol=1e-5)
    all_ignored = torch.full((4,), IGNORE, device=DEVICE)
    logp, entropy, lse = kb.logprobs_forward(logits, all_ignored, 1.0, IGNORE, True)
    assert (logp == 0).all() and (entropy == 0).all() and (lse == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_backward_inplace(dtype, tile):
    logits = make_logits(2, 3, 300, dtype)
    target = make_target(6, 300)
    logp, entropy, lse = tb.logprobs_forward(logits, target, 1.3, IGNORE, True)
    grad_logp, grad_entropy = torch.randn(6).to(DEVICE), torch.randn(6).to(DEVICE)
    expected = torch.empty_like(logits)
    tb.logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, 1.3, IGNORE,
                         expected)
    buffer = logits.clone()
    kb.logprobs_backward(buffer, target, lse, entropy, grad_logp, grad_entropy, 1.3, IGNORE,
                         buffer)
    assert_close(buffer, expected, **tol(dtype)[1])


def test_grid_stride_loop(few_programs, tile):
    logits = make_logits(2, 5, 37, torch.float32)
    target = make_target(10, 37)
    out_t = kb.logprobs_forward(logits, target, 1.0, IGNORE, True)
    out_r = tb.logprobs_forward(logits, target, 1.0, IGNORE, True)
    for a, b in zip(out_t, out_r):
        assert_close(a, b, atol=2e-5, rtol=2e-5)
    grad_t, grad_r = torch.empty_like(logits), torch.empty_like(logits)
    scale = torch.full((1,), 0.5, device=DEVICE)
    loss_t, _ = kb.cross_entropy_forward(logits, target, IGNORE, 0.1, 0.0, 0.0, scale, grad_t)
    loss_r, _ = tb.cross_entropy_forward(logits, target, IGNORE, 0.1, 0.0, 0.0, scale, grad_r)
    assert_close(loss_t, loss_r, atol=2e-5, rtol=2e-5)
    assert_close(grad_t, grad_r, atol=1e-6, rtol=1e-5)


def test_extreme_logits_stay_finite(tile):
    x = torch.tensor([[[-1e4, 0.0, 80.0, 80.0, -float("inf"), 3.0, -5.0, 2.0] * 5]])
    logits = x.to(DEVICE)
    target = torch.tensor([2], device=DEVICE)
    logp, entropy, lse = kb.logprobs_forward(logits, target, 1.0, IGNORE, False)
    ref = tb.logprobs_forward(logits, target, 1.0, IGNORE, False)
    assert_close(logp, ref[0], atol=1e-5, rtol=1e-5)
    assert_close(lse, ref[2], atol=1e-5, rtol=1e-5)
    grad = torch.empty_like(logits)
    kb.logprobs_backward(logits, target, lse, entropy, torch.ones(1, device=DEVICE), entropy,
                         1.0, IGNORE, grad)
    assert torch.isfinite(grad).all()


# ---------------------------------------------------------------------------------------------
# cross-entropy


CE_CASES = [  # (label_smoothing, z_loss, softcap)
    (0.0, 0.0, 0.0),
    (0.1, 0.0, 0.0),
    (0.0, 1e-3, 0.0),
    (0.0, 0.0, 5.0),
    (0.2, 1e-2, 4.0),
]


@pytest.mark.parametrize("dtype", DTYPES_2)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: "ls{}-z{}-cap{}".format(*c))
def test_cross_entropy(dtype, vocab, case, tile):
    label_smoothing, z_loss, softcap = case
    logits = make_logits(2, 4, vocab, dtype, layout="shifted", seed=vocab)
    target = make_target(8, vocab)
    out_tol, grad_tol = tol(dtype)
    loss_r, lse_r = tb.cross_entropy_forward(logits, target, IGNORE, label_smoothing, z_loss,
                                             softcap, None, None)
    loss_t, lse_t = kb.cross_entropy_forward(logits, target, IGNORE, label_smoothing, z_loss,
                                             softcap, None, None)
    assert_close(loss_t, loss_r, **out_tol)
    assert_close(lse_t, lse_r, **out_tol)
    for grad_scale in (torch.full((1,), 1.0 / 5), torch.linspace(0.5, 2.0, 8)):
        grad_scale = grad_scale.to(DEVICE)
        grad_t = torch.full_like(logits, float("nan"))
        grad_r = torch.empty_like(logits)
        loss_t, lse_t = kb.cross_entropy_forward(logits, target, IGNORE, label_smoothing, z_loss,
                                                 softcap, grad_scale, grad_t)
        tb.cross_entropy_forward(logits, target, IGNORE, label_smoothing, z_loss, softcap,
                                 grad_scale, grad_r)
        assert_close(loss_t, loss_r, **out_tol)
        assert_close(grad_t, grad_r, **grad_tol)
        assert (grad_t[0, 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["strided_vocab", "transposed"])
def test_cross_entropy_inplace_and_strided(dtype, layout, tile):
    logits = make_logits(2, 3, 300, dtype, layout=layout)
    target = make_target(6, 300)
    scale = torch.full((1,), 0.25, device=DEVICE)
    expected = torch.empty_like(logits)
    loss_r, _ = tb.cross_entropy_forward(logits, target, IGNORE, 0.1, 1e-3, 3.0, scale, expected)
    buffer = logits.clone()  # clone keeps the layout (a dense strided copy)
    loss_t, _ = kb.cross_entropy_forward(buffer, target, IGNORE, 0.1, 1e-3, 3.0, scale, buffer)
    out_tol, grad_tol = tol(dtype)
    assert_close(loss_t, loss_r, **out_tol)
    assert_close(buffer, expected, **grad_tol)


def test_cross_entropy_int32_target_all_ignored(tile):
    logits = make_logits(1, 4, 37, torch.bfloat16)
    target = torch.full((4,), IGNORE, dtype=torch.int32, device=DEVICE)
    grad = torch.full_like(logits, float("nan"))
    loss, lse = kb.cross_entropy_forward(logits, target, IGNORE, 0.1, 1e-3, 0.0,
                                         torch.ones(1, device=DEVICE), grad)
    assert (loss == 0).all() and (lse == 0).all() and (grad == 0).all()


# ---------------------------------------------------------------------------------------------
# GRPO


def grpo_inputs(n_rows, seed=3, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(n_rows, generator=g)
    weight = torch.rand(n_rows, generator=g) + 0.5
    weight[1::4] = 0.0  # masked tokens
    noise = torch.randn(n_rows, generator=g) * spread  # pushes ratios outside the clip range
    return [t.to(DEVICE) for t in (advantages, weight, noise)]


GRPO_CASES = [  # (has_old, has_ref, beta, delta)
    (False, False, 0.0, 0.0),
    (True, False, 0.0, 0.0),
    (True, True, 0.1, 0.0),
    (False, True, 0.05, 0.0),
    (True, False, 0.0, 1.5),
]


@pytest.mark.parametrize("dtype", DTYPES_2)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", GRPO_CASES, ids=lambda c: "old{}-ref{}-b{}-d{}".format(*c))
def test_grpo_forward(dtype, vocab, case, tile):
    has_old, has_ref, beta, delta = case
    logits = make_logits(2, 4, vocab, dtype, layout="shifted", seed=vocab + 1)
    target = make_target(8, vocab, ignore_every=0)
    advantages, weight, noise = grpo_inputs(8)
    temperature = 0.9
    logp, _, _ = tb.logprobs_forward(logits, target, temperature, IGNORE, False)
    old = logp + noise if has_old else None
    ref = logp - noise.flip(0) if has_ref else None
    args = (temperature, advantages, old, ref, weight, 0.2, 0.28, delta, beta)
    out_tol, grad_tol = tol(dtype)
    logp_r, loss_r = tb.grpo_forward(logits, target, *args, None)
    logp_t, loss_t = kb.grpo_forward(logits, target, *args, None)
    assert_close(logp_t, logp_r, **out_tol)
    assert_close(loss_t, loss_r, **out_tol)
    grad_t = torch.full_like(logits, float("nan"))
    grad_r = torch.empty_like(logits)
    kb.grpo_forward(logits, target, *args, grad_t)
    tb.grpo_forward(logits, target, *args, grad_r)
    assert_close(grad_t, grad_r, **grad_tol)
    assert (grad_t[0, 1] == 0).all() and (logp_t[1] == 0) and (loss_t[1] == 0)  # masked row


def test_grpo_on_policy_gradient_flows():
    logits = make_logits(1, 4, 37, torch.float32)
    target = make_target(4, 37, ignore_every=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], device=DEVICE)
    weight = torch.ones(4, device=DEVICE)
    grad = torch.empty_like(logits)
    logp, loss = kb.grpo_forward(logits, target, 1.0, advantages, None, None, weight, 0.2, 0.2,
                                 0.0, 0.0, grad)
    assert_close(loss, -advantages, atol=1e-6, rtol=0)  # ratio 1
    p = torch.softmax(logits.float(), -1)[0]
    onehot = torch.nn.functional.one_hot(target, 37).float()
    assert_close(grad[0], -advantages[:, None] * (onehot - p), atol=1e-6, rtol=1e-5)


def test_grpo_inplace_and_strided(tile):
    logits = make_logits(2, 3, 300, torch.bfloat16, layout="transposed")
    target = make_target(6, 300, ignore_every=0)
    advantages, weight, noise = grpo_inputs(6, spread=1.0)
    logp, _, _ = tb.logprobs_forward(logits, target, 1.0, IGNORE, False)
    args = (1.0, advantages, logp + noise, logp - noise, weight, 0.2, 0.2, 0.0, 0.04)
    expected = torch.empty_like(logits)
    tb.grpo_forward(logits, target, *args, expected)
    buffer = logits.clone()
    kb.grpo_forward(buffer, target, *args, buffer)
    assert_close(buffer, expected, **tol(torch.bfloat16)[1])


def test_grpo_requires_ref_with_beta():
    logits = make_logits(1, 2, 5, torch.float32)
    rows = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kb.grpo_forward(logits, torch.zeros(2, dtype=torch.long, device=DEVICE), 1.0, rows,
                        None, None, rows + 1, 0.2, 0.2, 0.0, 0.1, None)


# ---------------------------------------------------------------------------------------------
# scale_grad_, availability


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "shifted", "transposed", "4d"])
@pytest.mark.parametrize("value", [1.0, 2.5, 0.0])
def test_scale_grad(dtype, layout, value, tile):
    if layout == "4d":
        grad = make_logits(2, 6, 37, dtype).reshape(2, 2, 3, 37)
    else:
        grad = make_logits(2, 3, 37, dtype, layout=layout)
    before = grad.clone()
    ptr = grad.data_ptr()
    out = kb.scale_grad_(grad, torch.tensor(value, device=DEVICE))
    assert out is grad and grad.data_ptr() == ptr
    if value == 1.0:
        assert torch.equal(grad, before)
    else:
        assert_close(grad, (before.float() * value).to(dtype), atol=0, rtol=0)


def test_scale_grad_unmergeable_view():
    base = make_logits(6, 4, 5, torch.float32)
    grad = base.permute(1, 0, 2)[:, :, None, :]  # 4-D, not viewable as 3-D
    with pytest.raises(RuntimeError):
        grad.view(-1, 1, 5)
    before = grad.clone()
    kb.scale_grad_(grad, torch.tensor(3.0, device=DEVICE))
    assert_close(grad, before * 3.0, atol=0, rtol=0)


def test_unavailable_reason():
    assert kb.unavailable_reason(DEVICE) is None
    if kb.kernels_interpreted():
        assert kb.unavailable_reason("cpu") is None
    else:
        assert "TRITON_INTERPRET" in kb.unavailable_reason("cpu")
