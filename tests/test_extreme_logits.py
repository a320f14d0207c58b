"""Extreme logits (issue 12, items 2, 3 and 5) on every kernel backend, against float64 torch.

* Large logits: log-probs, losses and gradients are formed relative to the row max, so their
  error does not grow with the logits' magnitude (``z_y - lse`` in float32 loses ``ulp(lse)``).
* Large ``|logit / T|`` with ``T != 1``: no contraction (FMA) of ``x / T - lse`` may leave a
  log-prob positive and its ``exp`` out of range.
* Non-finite logits on counted rows propagate as in float64 torch: a row holding ``+inf`` or NaN
  (or only ``-inf``) gives a NaN loss / log-prob and NaN gradients; ``-inf`` entries elsewhere are
  fine; ignored rows stay 0 with a zero gradient whatever they hold.
* bfloat16 logits near its largest finite value (``3.3e38``) do not overflow the kernels' float32.

The triton backend runs under Triton's interpreter on CPU (tests/conftest.py);
``triton-tile16`` forces 16-wide vocabulary tiles (the multi-tile code path).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.kernels.triton import config

BACKENDS = ["cpp", "torch", "triton"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INF, NAN = math.inf, math.nan
# |got - expected| <= ATOL + RTOL * |expected| on the values a backend stores in the logits' dtype
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}
ATOL = 2e-6


# every backend, and the triton backend once more with 16-wide tiles
BACKEND_TILES = [("cpp", None), ("torch", None), ("triton", None), ("triton", 16)]
BACKEND_TILE_IDS = ["cpp", "torch", "triton", "triton-tile16"]


@pytest.fixture(params=BACKEND_TILES, ids=BACKEND_TILE_IDS)
def backend(request):
    """The backend name; with a tile width, triton's ``BLOCK_V_OVERRIDE`` for the test."""
    name, tile = request.param
    saved = config.BLOCK_V_OVERRIDE
    config.BLOCK_V_OVERRIDE = tile
    yield name
    config.BLOCK_V_OVERRIDE = saved


def assert_close(got, expected, rtol, atol=ATOL, what=""):
    """Elementwise in float64, NaN where expected is NaN, infinities equal; finite values close."""
    got, expected = got.detach().double(), expected.detach().double()
    assert got.shape == expected.shape, what
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN pattern {got} vs {expected}"
    inf = torch.isinf(expected)
    assert torch.equal(got[inf], expected[inf]), f"{what}: infinities {got} vs {expected}"
    finite = ~nan & ~inf
    err = (got[finite] - expected[finite]).abs()
    bound = atol + rtol * expected[finite].abs()
    assert bool((err <= bound).all()), f"{what}: {got} vs {expected} (err {err.max()})"


def expected_cross_entropy(x, target, label_smoothing=0.0):
    """Per-row losses and the gradient of their sum, float64 torch on the same values."""
    x64 = x.detach().double().requires_grad_(True)
    loss = F.cross_entropy(x64, target, reduction="none", label_smoothing=label_smoothing)
    loss.sum().backward()
    return loss.detach(), x64.grad


def run_cross_entropy(backend, x, target, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    loss = ak.cross_entropy(x, target, reduction="none", backend=backend, **kwargs)
    loss.sum().backward()
    return loss.detach(), x.grad


def expected_logprobs(x, target, temperature, grad_logp, grad_entropy=None):
    """``(logp, entropy, grad)`` in float64 torch: the gradient of
    ``sum(grad_logp * logp) + sum(grad_entropy * entropy)``."""
    x64 = x.detach().double().requires_grad_(True)
    ls = torch.log_softmax(x64 / temperature, -1)
    logp = ls.gather(1, target.unsqueeze(1)).squeeze(1)
    p = ls.exp()
    entropy = -(p * torch.where(p > 0, ls, 0.0)).sum(-1)  # terms with p = 0 are 0
    total = (grad_logp.double() * logp).sum()
    if grad_entropy is not None:
        total = total + (grad_entropy.double() * entropy).sum()
    total.backward()
    return logp.detach(), entropy.detach(), x64.grad


def run_logprobs(backend, x, target, temperature, grad_logp, grad_entropy=None):
    x = x.detach().clone().requires_grad_(True)
    out = ak.token_logprobs(x, target, temperature=temperature, backend=backend,
                            return_entropy=grad_entropy is not None)
    if grad_entropy is None:
        (out * grad_logp).sum().backward()
        return out.detach(), None, x.grad
    logp, entropy = out
    ((logp * grad_logp).sum() + (entropy * grad_entropy).sum()).backward()
    return logp.detach(), entropy.detach(), x.grad


def large_rows(dtype, seed=0):
    """``[6, 37]`` logits far from 0 whose differences are O(1) and exactly representable in
    ``dtype``: random small integers times the dtype's spacing at the offset, plus the offset
    (fp32: 1e5 and 2^24 = 1.7e7, i.e. spacing 1/64 and 2; fp16: 2048, spacing 2; bf16: 256,
    spacing 2), half of the rows negated."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        offsets, spacings = [1e5, 2.0 ** 24], [2.0 ** -6, 2.0]
    elif dtype == torch.float16:
        offsets, spacings = [2048.0], [2.0]
    else:
        offsets, spacings = [256.0], [2.0]
    rows = []
    for i in range(6):
        offset, spacing = offsets[i % len(offsets)], spacings[i % len(offsets)]
        steps = torch.randint(-3, 4, (37,), generator=g).double() * max(spacing, 0.5)
        steps = torch.round(steps / spacing) * spacing
        rows.append((offset + steps) * (1 if i < 3 else -1))
    x = torch.stack(rows)
    assert torch.equal(x.to(dtype).double(), x)  # exactly representable
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# The issue's own numbers
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_of_1e7_logits(backend):
    x = torch.tensor([[1e7, 1e7 - 1, 0.0]])
    loss, grad = run_cross_entropy(backend, x, torch.tensor([0]))
    assert loss.item() == pytest.approx(0.31326168751822286, abs=1e-6)
    expected_loss, expected_grad = expected_cross_entropy(x, torch.tensor([0]))
    assert_close(loss, expected_loss, 1e-6)
    assert_close(grad, expected_grad, 1e-6)
    assert abs(grad.double().sum().item()) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_of_1e30_logits_is_minus_log2(backend):
    x = torch.tensor([[1e30, -1e30, 1e30]])
    logp, _, grad = run_logprobs(backend, x, torch.tensor([0]), 1.0, torch.ones(1))
    assert logp.item() == pytest.approx(-math.log(2), abs=1e-6)
    assert_close(grad, torch.tensor([[0.5, 0.0, -0.5]]), 1e-6)


@pytest.mark.parametrize("temperature", [0.7, 1e-20])
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logit_over_temperature_gradient(backend, temperature):
    """``|x / T|`` near 4e9 (T = 0.7) and 3e29 (T = 1e-20): the gradient is
    ``(onehot - p) / T``, finite, with p one-hot at the large logit."""
    x = torch.tensor([[3e9, 0.0, -1.0]])
    target = torch.tensor([1])
    logp, _, grad = run_logprobs(backend, x, target, temperature, torch.ones(1))
    expected_logp, _, expected_grad = expected_logprobs(x, target, temperature, torch.ones(1))
    assert_close(logp, expected_logp, 1e-6)
    assert_close(grad, expected_grad, 1e-6, atol=0.0)
    assert bool(torch.isfinite(grad).all())


# ----------------------------------------------------------------------------------------------
# Large logits in every dtype
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_cross_entropy_large_logits(backend, dtype, label_smoothing):
    x = large_rows(dtype)
    target = torch.randint(0, 37, (6,), generator=torch.Generator().manual_seed(1))
    loss, grad = run_cross_entropy(backend, x, target, label_smoothing=label_smoothing)
    expected_loss, expected_grad = expected_cross_entropy(x, target, label_smoothing)
    assert_close(loss, expected_loss, 1e-5, what="loss")
    assert_close(grad, expected_grad, GRAD_RTOL[dtype], what="grad")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_logprobs_and_entropy_large_logits(backend, dtype, temperature):
    x = large_rows(dtype)
    g = torch.Generator().manual_seed(2)
    target = torch.randint(0, 37, (6,), generator=g)
    grad_logp, grad_entropy = torch.randn(6, generator=g), torch.randn(6, generator=g)
    for with_entropy in (False, True):
        g_h = grad_entropy if with_entropy else None
        logp, entropy, grad = run_logprobs(backend, x, target, temperature, grad_logp, g_h)
        expected = expected_logprobs(x, target, temperature, grad_logp, g_h)
        assert_close(logp, expected[0], 1e-5, what="logp")
        if with_entropy:
            assert_close(entropy, expected[1], 1e-5, what="entropy")
        assert_close(grad, expected[2], GRAD_RTOL[dtype], atol=1e-5, what="grad")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_large_logits(backend, dtype):
    """GRPO's log-probs (and so its ratio, KL and gradient) against reference.py in float64."""
    x = large_rows(dtype).reshape(2, 3, 37)
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, 37, (2, 3), generator=g)
    logp64 = torch.log_softmax(x.double() / 0.7, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = (logp64 + 0.05 * torch.randn(2, 3, generator=g, dtype=torch.float64)).float()
    ref = (logp64 + 0.05 * torch.randn(2, 3, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(2, generator=g)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kwargs = dict(mask=mask, old_logprobs=old, ref_logprobs=ref, beta=0.04, temperature=0.7)
    xg = x.detach().clone().requires_grad_(True)
    loss, metrics = ak.grpo_loss(xg, target, adv, backend=backend, **kwargs)
    loss.backward()
    x64 = x.detach().double().requires_grad_(True)
    expected, expected_metrics = reference.grpo_loss(
        x64, target, adv.double(), mask.double(), old.double(), ref.double(), 0.04, 0.2, None,
        None, "bnpo", "token", 0.7, None, None)
    expected.backward()
    assert_close(loss, expected, 1e-5, what="loss")
    assert_close(metrics["kl"], expected_metrics["kl"], 1e-4, atol=1e-5, what="kl")
    assert_close(xg.grad, x64.grad, GRAD_RTOL[dtype], atol=1e-5, what="grad")


# ----------------------------------------------------------------------------------------------
# Non-finite logits and the top of bfloat16's range
# ----------------------------------------------------------------------------------------------

EDGE_ROWS = {
    "inf": [INF, 1.0, 0.0, -2.0],
    "inf_nan": [INF, NAN, 0.0, -2.0],
    "nan": [NAN, 1.0, 0.0, -2.0],
    "two_inf": [INF, INF, 0.0, -2.0],
    "all_neg_inf": [-INF, -INF, -INF, -INF],
    "neg_inf": [-INF, 1.0, 0.0, -2.0],
    "bf16_top": [3.3e38, 3.2e38, -3.3e38, 0.0],
    "bf16_spread": [3.3e38, -3.3e38, 1.0, 0.0],
}


def edge_batch(dtype):
    """Every edge row with every target (1 counted row each), plus an ignored row holding +inf
    and NaN (it must stay 0 with a zero gradient)."""
    rows, targets = [], []
    for row in EDGE_ROWS.values():
        for t in range(4):
            rows.append(row)
            targets.append(t)
    rows.append([INF, NAN, -INF, 0.0])
    targets.append(-100)
    return torch.tensor(rows).to(dtype), torch.tensor(targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_non_finite_rows_match_float64_torch(backend, dtype):
    x, target = edge_batch(dtype)
    valid = target != -100
    loss, grad = run_cross_entropy(backend, x, target)
    # float64 torch on the counted rows (its ignored rows' gradient would be NaN here)
    expected_loss, expected_grad = expected_cross_entropy(x[valid], target[valid])
    assert_close(loss[valid], expected_loss.float(), 1e-6, what="loss")  # 6.6e38: inf in fp32
    assert_close(grad[valid], expected_grad, GRAD_RTOL[dtype], what="grad")
    assert loss[-1].item() == 0.0 and bool((grad[-1] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_non_finite_rows_match_float64_torch(backend, dtype):
    x, target = edge_batch(dtype)
    valid = target != -100
    safe_target = torch.where(valid, target, 0)
    grad_logp = torch.ones(len(target))
    logp, _, grad = run_logprobs(backend, x, target, 1.0, grad_logp)
    expected_logp, _, expected_grad = expected_logprobs(x[valid], safe_target[valid], 1.0,
                                                        grad_logp[valid])
    assert_close(logp[valid], expected_logp.float(), 1e-6, what="logp")
    assert_close(grad[valid], expected_grad, GRAD_RTOL[dtype], what="grad")
    assert logp[-1].item() == 0.0 and bool((grad[-1] == 0).all())
