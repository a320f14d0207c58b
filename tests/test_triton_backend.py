"""The triton backend's primitives against reference.py in float64, per element.

Without CUDA these run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports triton), so shapes stay small; ``BLOCK_V_OVERRIDE`` forces several vocabulary
tiles at small V and ``PROGRAMS_OVERRIDE`` fewer programs than rows (the grid-stride loop).
Tolerances: the one per-element model of :mod:`astrai_kernels.testing.tolerances`, the naive
same-dtype path's error as the yardstick (``cases.assert_matches_spec``).
"""

import pytest
import torch

from astrai_kernels.kernels import portable as tb
from astrai_kernels.kernels.primitives import CrossEntropyArgs, LogprobsArgs, SurrogateArgs
from astrai_kernels.kernels.triton import backend as kb
from astrai_kernels.kernels.triton import config
from astrai_kernels.testing import assert_close as check_close

from cases import (
    assert_matches_spec,
    shard_grad_float64,
    spec_cross_entropy,
    spec_expected_and_naive,
    spec_grpo,
    spec_logprobs,
)
from cases import make_logits as make_cases_logits

DEVICE = "cuda" if torch.cuda.is_available() and not kb.kernels_interpreted() else "cpu"
_REASON = kb.unavailable_reason(DEVICE)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"triton backend: {_REASON}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPES_2 = [torch.float32, torch.bfloat16]  # fp16 takes the same 16-bit code path as bf16
VOCABS = [1, 5, 37, 300]
TILES = [None, 16]  # default rule (one tile at these V), or 16-wide tiles (up to 19 of them)
# (vocab, tile) of the matrix tests: 16-wide tiles at V <= 37 (V = 37: three tiles, the last
# partial) but not at V = 300, whose 19 interpreted tiles cost the most and cover no other edge
VOCAB_TILES = [(vocab, tile) for vocab in VOCABS for tile in TILES
               if not (tile == 16 and vocab == 300)]
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
    """``[outer, inner, vocab]`` logits on the test device (see ``cases.make_logits``)."""
    return make_cases_logits((outer, inner, vocab), dtype, layout, seed=seed, device=DEVICE)


def make_target(n_rows, vocab, seed=1, ignore_every=3, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, (n_rows,), generator=g)
    if ignore_every:
        y[::ignore_every] = IGNORE
    return y.to(dtype).to(DEVICE)


def assert_close(actual, expected, **kw):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **kw)


def named(names, values):
    return dict(zip(names, values))


LOGPROBS = ("logp", "entropy", "lse")
CE = ("loss", "lse")
GRPO = ("logp", "loss", "entropy")


# ---------------------------------------------------------------------------------------------
# token log-probs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, tile", VOCAB_TILES, indirect=["tile"],
                         ids=[f"V{v}-tile{t or 'auto'}" for v, t in VOCAB_TILES])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprobs_forward_backward(dtype, vocab, with_entropy, tile):
    logits = make_logits(2, 4, vocab, dtype, layout="shifted")
    target = make_target(8, vocab)
    temperature = 0.7
    g = torch.Generator().manual_seed(5)
    grad_logp = torch.randn(8, generator=g).to(DEVICE)
    grad_entropy = (torch.randn(8, generator=g).to(DEVICE) if with_entropy
                    else torch.empty(0, device=DEVICE))
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, temperature, IGNORE,
                                              with_entropy, grad_logp, grad_entropy)
    out_t = kb.logprobs_forward(logits, target, LogprobsArgs(temperature, IGNORE, with_entropy))
    assert_matches_spec(named(LOGPROBS, out_t), expected, naive, "forward", dtype)
    logp, entropy, lse = out_t
    grad_t = torch.full_like(logits, float("nan"))
    kb.logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy,
                         LogprobsArgs(temperature, IGNORE, False), grad_t)
    assert_matches_spec({"grad": grad_t}, expected, naive, "backward", dtype)
    assert (grad_t[0, 0] == 0).all()  # row 0 is ignored


@pytest.mark.parametrize("layout", ["contiguous", "strided_vocab", "transposed"])
def test_logprobs_layouts_and_int32_target(layout, tile):
    logits = make_logits(3, 3, 37, torch.float32, layout=layout)
    target = make_target(9, 37, dtype=torch.int32)
    grad_logp = torch.linspace(-1, 1, 9).to(DEVICE)
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, 1.0, IGNORE, True,
                                              grad_logp, grad_logp.flip(0))
    out_t = kb.logprobs_forward(logits, target, LogprobsArgs(1.0, IGNORE, True))
    assert_matches_spec(named(LOGPROBS, out_t), expected, naive, layout, torch.float32)
    grad_t = torch.empty(3, 3, 37, device=DEVICE).transpose(0, 1)  # a strided grad as well
    kb.logprobs_backward(logits, target, out_t[2], out_t[1], grad_logp, grad_logp.flip(0),
                         LogprobsArgs(1.0, IGNORE, False), grad_t)
    assert_matches_spec({"grad": grad_t}, expected, naive, layout, torch.float32)


def test_logprobs_expanded_grad_and_ignored_only(tile):
    logits = make_logits(1, 4, 37, torch.float32)
    target = make_target(4, 37)
    grad_logp = torch.ones((), device=DEVICE).expand(4)  # what sum().backward() hands over
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, 1.0, IGNORE, False,
                                              grad_logp)
    logp, entropy, lse = kb.logprobs_forward(logits, target, LogprobsArgs(1.0, IGNORE, False))
    grad_t = torch.empty_like(logits)
    kb.logprobs_backward(logits, target, lse, entropy, grad_logp, entropy,
                         LogprobsArgs(1.0, IGNORE, False), grad_t)
    assert_matches_spec({"grad": grad_t}, expected, naive, "expanded", torch.float32)
    all_ignored = torch.full((4,), IGNORE, device=DEVICE)
    logp, entropy, lse = kb.logprobs_forward(logits, all_ignored, LogprobsArgs(1.0, IGNORE, True))
    assert (logp == 0).all() and (entropy == 0).all() and (lse == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_backward_inplace(dtype, tile):
    logits = make_logits(2, 3, 300, dtype)
    target = make_target(6, 300)
    g = torch.Generator().manual_seed(6)
    grad_logp, grad_entropy = (torch.randn(6, generator=g).to(DEVICE) for _ in range(2))
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, 1.3, IGNORE, True,
                                              grad_logp, grad_entropy)
    logp, entropy, lse = tb.logprobs_forward(logits, target, LogprobsArgs(1.3, IGNORE, True))
    buffer = logits.clone()
    kb.logprobs_backward(buffer, target, lse, entropy, grad_logp, grad_entropy,
                         LogprobsArgs(1.3, IGNORE, False), buffer)
    assert_matches_spec({"grad": buffer}, expected, naive, "in-place", dtype)


def test_grid_stride_loop(few_programs, tile):
    logits = make_logits(2, 5, 37, torch.float32)
    target = make_target(10, 37)
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, 1.0, IGNORE, True)
    out_t = kb.logprobs_forward(logits, target, LogprobsArgs(1.0, IGNORE, True))
    assert_matches_spec(named(LOGPROBS, out_t), expected, naive, "grid-stride", torch.float32)
    scale = torch.full((1,), 0.5, device=DEVICE)
    expected, naive = spec_expected_and_naive(spec_cross_entropy, logits, target, IGNORE, 0.1,
                                              0.0, 0.0, scale)
    grad_t = torch.empty_like(logits)
    out_t = kb.cross_entropy_forward(logits, target, scale, CrossEntropyArgs(IGNORE, 0.1, 0.0, 0.0),
                                     grad_t)
    assert_matches_spec({**named(CE, out_t), "grad": grad_t}, expected, naive,
                        "grid-stride ce", torch.float32)


def test_extreme_logits_stay_finite(tile):
    x = torch.tensor([[[-1e4, 0.0, 80.0, 80.0, -float("inf"), 3.0, -5.0, 2.0] * 5]])
    logits = x.to(DEVICE)
    target = torch.tensor([2], device=DEVICE)
    ones = torch.ones(1, device=DEVICE)
    expected, naive = spec_expected_and_naive(spec_logprobs, logits, target, 1.0, IGNORE, False,
                                              ones)
    logp, entropy, lse = kb.logprobs_forward(logits, target, LogprobsArgs(1.0, IGNORE, False))
    assert_matches_spec({"logp": logp, "lse": lse}, expected, naive, "extreme", torch.float32)
    grad = torch.empty_like(logits)
    kb.logprobs_backward(logits, target, lse, entropy, ones, entropy,
                         LogprobsArgs(1.0, IGNORE, False), grad)
    assert torch.isfinite(grad).all()
    assert_matches_spec({"grad": grad}, expected, naive, "extreme", torch.float32)


# ---------------------------------------------------------------------------------------------
# cross-entropy


CE_CASES = [  # (label_smoothing, z_loss, softcap, logit_scale)
    (0.0, 0.0, 0.0, 1.0),
    (0.1, 0.0, 0.0, 1.0),
    (0.0, 1e-3, 0.0, 1.0),
    (0.0, 0.0, 5.0, 1.0),
    (0.2, 1e-2, 4.0, 1.0),
    (0.1, 1e-3, 0.0, -1.0),
    (0.0, 0.0, 5.0, 2.0),
    (0.2, 1e-2, 4.0, 0.5),
]


@pytest.mark.parametrize("dtype", DTYPES_2)
@pytest.mark.parametrize("vocab, tile", VOCAB_TILES, indirect=["tile"],
                         ids=[f"V{v}-tile{t or 'auto'}" for v, t in VOCAB_TILES])
@pytest.mark.parametrize("case", CE_CASES, ids=lambda c: "ls{}-z{}-cap{}-a{}".format(*c))
def test_cross_entropy(dtype, vocab, case, tile):
    label_smoothing, z_loss, softcap, logit_scale = case
    logits = make_logits(2, 4, vocab, dtype, layout="shifted", seed=vocab)
    target = make_target(8, vocab)
    options = (IGNORE, label_smoothing, z_loss, softcap)
    args = CrossEntropyArgs(*options, logit_scale=logit_scale)
    out_t = kb.cross_entropy_forward(logits, target, None, args, None)
    for grad_scale in (torch.full((1,), 1.0 / 5), torch.linspace(0.5, 2.0, 8)):
        grad_scale = grad_scale.to(DEVICE)
        expected, naive = spec_expected_and_naive(spec_cross_entropy, logits, target, *options,
                                                  grad_scale, logit_scale=logit_scale)
        assert_matches_spec(named(CE, out_t), expected, naive, "no grad", dtype)
        grad_t = torch.full_like(logits, float("nan"))
        got = kb.cross_entropy_forward(logits, target, grad_scale, args, grad_t)
        assert_matches_spec({**named(CE, got), "grad": grad_t}, expected, naive,
                            f"scale {grad_scale.numel()}", dtype)
        assert (grad_t[0, 0] == 0).all()


@pytest.mark.parametrize("logit_scale", [1.0, -0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["strided_vocab", "transposed"])
def test_cross_entropy_inplace_and_strided(dtype, layout, logit_scale, tile):
    logits = make_logits(2, 3, 300, dtype, layout=layout)
    target = make_target(6, 300)
    scale = torch.full((1,), 0.25, device=DEVICE)
    expected, naive = spec_expected_and_naive(spec_cross_entropy, logits, target, IGNORE, 0.1,
                                              1e-3, 3.0, scale, logit_scale=logit_scale)
    buffer = logits.clone()  # clone keeps the layout (a dense strided copy)
    args = CrossEntropyArgs(IGNORE, 0.1, 1e-3, 3.0, logit_scale=logit_scale)
    got = kb.cross_entropy_forward(buffer, target, scale, args, buffer)
    assert_matches_spec({**named(CE, got), "grad": buffer}, expected, naive, layout, dtype)


def test_cross_entropy_int32_target_all_ignored(tile):
    logits = make_logits(1, 4, 37, torch.bfloat16)
    target = torch.full((4,), IGNORE, dtype=torch.int32, device=DEVICE)
    grad = torch.full_like(logits, float("nan"))
    loss, lse = kb.cross_entropy_forward(logits, target, torch.ones(1, device=DEVICE),
                                         CrossEntropyArgs(IGNORE, 0.1, 1e-3, 0.0), grad)
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


GRPO_CASES = [  # (has_old, has_ref, beta, delta, kl_ratio_correction, with_entropy)
    (False, False, 0.0, 0.0, False, True),
    (True, False, 0.0, 0.0, False, False),
    (True, True, 0.1, 0.0, False, True),
    (True, True, 0.1, 0.0, True, False),
    (False, True, 0.05, 0.0, True, True),  # on-policy: r = 1, its gradient still flows
    (True, False, 0.0, 1.5, False, False),
    (True, True, 0.1, 1.5, True, True),  # delta caps the surrogate's ratio, not the KL's
]


@pytest.mark.parametrize("dtype", DTYPES_2)
@pytest.mark.parametrize("vocab, tile", VOCAB_TILES, indirect=["tile"],
                         ids=[f"V{v}-tile{t or 'auto'}" for v, t in VOCAB_TILES])
@pytest.mark.parametrize("case", GRPO_CASES,
                         ids=lambda c: "old{}-ref{}-b{}-d{}-kl_r{}-H{}".format(*c))
def test_grpo_forward(dtype, vocab, case, tile):
    has_old, has_ref, beta, delta, correction, with_entropy = case
    logits = make_logits(2, 4, vocab, dtype, layout="shifted", seed=vocab + 1)
    target = make_target(8, vocab, ignore_every=0)
    advantages, weight, noise = grpo_inputs(8)
    temperature = 0.9
    logp = spec_logprobs(logits, target, temperature, IGNORE, False)["logp"].float().to(DEVICE)
    old = logp + noise if has_old else None
    ref = logp - noise.flip(0) if has_ref else None
    args = (temperature, advantages, old, ref, weight, 0.2, 0.28, delta, beta, correction,
            with_entropy)
    expected, naive = spec_expected_and_naive(spec_grpo, logits, target, *args)
    rows = args[1:5]
    surrogate = SurrogateArgs(temperature, 0.2, 0.28, delta, beta, correction, with_entropy)
    got = kb.grpo_forward(logits, target, *rows, surrogate, None)
    assert_matches_spec(named(GRPO, got), expected, naive, "no grad", dtype)
    assert got[2].shape == ((8,) if with_entropy else (0,))
    grad_t = torch.full_like(logits, float("nan"))
    logp_t, loss_t, entropy_t = kb.grpo_forward(logits, target, *rows, surrogate, grad_t)
    assert_matches_spec({"logp": logp_t, "loss": loss_t, "entropy": entropy_t, "grad": grad_t},
                        expected, naive, "with grad", dtype)
    assert (grad_t[0, 1] == 0).all() and (logp_t[1] == 0) and (loss_t[1] == 0)  # masked row
    if with_entropy:
        assert entropy_t[1] == 0


def test_grpo_on_policy_gradient_flows():
    logits = make_logits(1, 4, 37, torch.float32)
    target = make_target(4, 37, ignore_every=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0], device=DEVICE)
    weight = torch.ones(4, device=DEVICE)
    grad = torch.empty_like(logits)
    logp, loss, _ = kb.grpo_forward(logits, target, advantages, None, None, weight,
                                    SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.0, False, False), grad)
    assert torch.equal(loss.cpu(), -advantages.cpu())  # ratio exactly 1
    p = torch.softmax(logits.double().cpu(), -1)[0]
    onehot = torch.nn.functional.one_hot(target.cpu(), 37).double()
    a = advantages.double().cpu()[:, None]
    check_close(grad[0].cpu(), -a * (onehot - p), "grad", torch.float32, "on-policy grad",
                scale=a.abs() * (onehot + p))


def test_grpo_inplace_and_strided(tile):
    logits = make_logits(2, 3, 300, torch.bfloat16, layout="transposed")
    target = make_target(6, 300, ignore_every=0)
    advantages, weight, noise = grpo_inputs(6, spread=1.0)
    logp, _, _ = tb.logprobs_forward(logits, target, LogprobsArgs(1.0, IGNORE, False))
    args = (1.0, advantages, logp + noise, logp - noise, weight, 0.2, 0.2, 0.0, 0.04, True, True)
    expected, naive = spec_expected_and_naive(spec_grpo, logits, target, *args)
    buffer = logits.clone()
    _, _, entropy = kb.grpo_forward(buffer, target, *args[1:5],
                                    SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.04, True, True), buffer)
    assert_matches_spec({"entropy": entropy, "grad": buffer}, expected, naive, "in-place",
                        torch.bfloat16)


def test_grpo_requires_ref_with_beta():
    logits = make_logits(1, 2, 5, torch.float32)
    rows = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kb.grpo_forward(logits, torch.zeros(2, dtype=torch.long, device=DEVICE), rows, None, None,
                        rows + 1, SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.1, False, False), None)


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


@pytest.mark.parametrize("dtype", DTYPES_2, ids=str)
@pytest.mark.parametrize("layout", ("contiguous", "strided_vocab"))
@pytest.mark.parametrize("softcap", (0.0, 3.0))
@pytest.mark.parametrize("with_beta", (False, True))
def test_vocab_shard_backward(dtype, layout, softcap, with_beta, tile, few_programs):
    """The shard gradient against its float64 statement (``cases.shard_grad_float64``): counted
    rows whose target another shard holds, an ignored row, several tiles, fewer programs than
    rows, in place."""
    from astrai_kernels.kernels.primitives import ShardGradArgs

    vocab, n = 37, 12
    x = make_logits(2, 6, vocab, dtype, layout)
    target = make_target(n, vocab, ignore_every=0)
    target[3] = IGNORE
    target[[1, 7]] = -2  # counted rows whose target another rank holds
    g = torch.Generator().manual_seed(21)
    z = x.float().cpu()
    z = softcap * torch.tanh(z / softcap) if softcap else z
    # a whole-vocabulary lse above this shard's own (other shards hold mass too)
    lse = torch.logsumexp(z.reshape(n, vocab) / 0.8, -1) + torch.rand(n, generator=g)
    alpha, gamma = torch.randn(n, generator=g), torch.randn(n, generator=g)
    beta = torch.randn(n, generator=g) if with_beta else None
    delta = torch.randn(n, generator=g) * 0.01 if with_beta else None
    expected, scale = shard_grad_float64(x.cpu(), target.cpu(), lse, alpha, beta, gamma, delta,
                                         0.8, softcap, IGNORE)

    def on_device(t):
        return None if t is None else t.to(DEVICE)

    args = ShardGradArgs(0.8, softcap, IGNORE)
    coefficients = [on_device(t) for t in (lse, alpha, beta, gamma, delta)]
    grad = torch.full_like(x, float("nan"))
    kb.vocab_shard_backward(x, target, *coefficients, args, grad)
    check_close(grad.cpu(), expected, "grad", dtype, "shard grad", scale=scale)
    assert (grad.reshape(n, vocab)[3] == 0).all()  # ignored row
    if layout == "contiguous":
        inplace = x.clone()
        kb.vocab_shard_backward(inplace, target, *coefficients, args, inplace)
        assert torch.equal(inplace, grad)
