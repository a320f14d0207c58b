"""The cpp backend's primitives against reference.py in float64, per element.

Every check runs once per instruction set the CPU supports (generic, avx2, avx512), since each
is a separately compiled copy of the kernels, and for the fused kernels on both gradient paths
(kept exps and recompute). The torch backend's primitives are held to the same spec on the same
inputs. Tolerances: the one per-element model of :mod:`astrai_kernels.testing.tolerances`, the
naive same-dtype path's error as the yardstick. A failed build fails these tests.
"""

import contextlib
import dataclasses
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from astrai_kernels.kernels import portable as tb
from astrai_kernels.kernels import primitives
from astrai_kernels.kernels.cpp import backend as cb
from astrai_kernels.kernels.primitives import (
    CrossEntropyArgs,
    DistillArgs,
    LogprobsArgs,
    ShardGradArgs,
    SurrogateArgs,
    mixture_weights,
)
from astrai_kernels.testing import assert_close as check_close

from cases import (
    assert_matches_spec,
    make_logits,
    shard_grad_float64,
    spec_cross_entropy,
    spec_expected_and_naive,
    spec_grpo,
    spec_logprobs,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VOCABS = (1, 7, 1003, 4096)
IGNORE = -100


@pytest.fixture(scope="module", autouse=True)
def extension():
    return cb.load_extension()  # raises (fails every test) when the build fails


def isas():
    order = ("generic", "avx2", "avx512")
    best = cb.load_extension().detected_isa()
    return order[:order.index(best) + 1]


@contextlib.contextmanager
def using_isa(name):
    previous = cb.set_isa(name)
    try:
        yield
    finally:
        cb.set_isa(previous)


def each_isa():
    """Yield each supported ISA name with the kernels switched to it."""
    for name in isas():
        with using_isa(name):
            yield name


def each_isa_and_path():
    """As each_isa, and for the fused kernels both gradient paths: from the first pass's kept
    exps (the default) and recomputing them (the fallback when no scratch memory is had)."""
    ext = cb.load_extension()
    for name in isas():
        for keep in (True, False):
            previous = ext._set_keep_exps(keep)
            try:
                with using_isa(name):
                    yield f"{name}{'' if keep else ' recompute'}"
            finally:
                ext._set_keep_exps(previous)


def test_every_isa_and_path_is_run():
    """The ISA loop is not silently empty: generic always, and the recompute path too."""
    names = list(each_isa_and_path())
    assert names[:2] == ["generic", "generic recompute"] and len(names) == 2 * len(isas())


# ------------------------------------------------------------------------------------------
# Inputs and comparisons
# ------------------------------------------------------------------------------------------

def make_target(n_rows, vocab, ignored=(), seed=1, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (n_rows,), generator=g)
    for i in ignored:
        if i < n_rows:
            target[i] = IGNORE
    return target.to(dtype)


def named(names, values):
    return dict(zip(names, values))


def empty_grad_like(logits, layout="contiguous"):
    """A gradient buffer pre-filled with NaN (every element must be written)."""
    if layout == "strided":
        a, b, v = logits.shape
        return torch.full((a, b, 2 * v), float("nan"), dtype=logits.dtype)[..., ::2]
    return torch.full(logits.shape, float("nan"), dtype=logits.dtype)


# ------------------------------------------------------------------------------------------
# logprobs_forward / logprobs_backward
# ------------------------------------------------------------------------------------------

LOGPROBS = ("logp", "entropy", "lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("layout", ("contiguous", "strided_vocab", "shifted"))
def test_logprobs_forward_backward(dtype, vocab, layout):
    x = make_logits((2, 5, vocab), dtype, layout)
    n = 10
    target = make_target(n, vocab, ignored=(1, 7))
    g = torch.Generator().manual_seed(3)
    grad_logp = torch.randn(n, generator=g)
    grad_entropy = torch.randn(n, generator=g)
    for temperature in (1.0, 0.7):
        for with_entropy in (False, True):
            g_h = grad_entropy if with_entropy else torch.empty(0)
            expected, naive = spec_expected_and_naive(
                spec_logprobs, x, target, temperature, IGNORE, with_entropy, grad_logp, g_h)
            for backend in [tb] + list(each_isa()):
                isa = "torch" if backend is tb else backend
                kernels = tb if backend is tb else cb
                what = f"{isa} T={temperature} entropy={with_entropy}"
                got = kernels.logprobs_forward(x, target,
                                               LogprobsArgs(temperature, IGNORE, with_entropy))
                assert_matches_spec(named(LOGPROBS, got), expected, naive, what, dtype)
                for i in (1, 7):
                    assert got[0][i] == 0 and got[2][i] == 0
                grad = empty_grad_like(x)
                kernels.logprobs_backward(x, target, got[2], got[1], grad_logp, g_h,
                                          LogprobsArgs(temperature, IGNORE, False), grad)
                assert_matches_spec({"grad": grad}, expected, naive, what, dtype)
                assert (grad[0, 1] == 0).all() and (grad[1, 2] == 0).all()  # ignored rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", (False, True))
def test_logprobs_backward_inplace_and_strided_grad(dtype, with_entropy):
    vocab = 1003
    x0 = make_logits((3, 4, vocab), dtype)
    target = make_target(12, vocab, ignored=(0, 5), dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    grad_logp = torch.randn(12, generator=g)
    grad_entropy = torch.randn(12, generator=g) if with_entropy else torch.empty(0)
    expected, naive = spec_expected_and_naive(spec_logprobs, x0, target, 0.9, IGNORE,
                                              with_entropy, grad_logp, grad_entropy)
    _, entropy, lse = tb.logprobs_forward(x0, target, LogprobsArgs(0.9, IGNORE, with_entropy))
    for isa in each_isa():
        x = x0.clone()
        cb.logprobs_backward(x, target, lse, entropy, grad_logp, grad_entropy,
                             LogprobsArgs(0.9, IGNORE, False), x)  # grad is logits
        assert_matches_spec({"grad": x}, expected, naive, f"{isa} in-place", dtype)
        grad = empty_grad_like(x0, "strided")  # contiguous logits, vocab-strided grad
        cb.logprobs_backward(x0, target, lse, entropy, grad_logp, grad_entropy,
                             LogprobsArgs(0.9, IGNORE, False), grad)
        assert_matches_spec({"grad": grad}, expected, naive, f"{isa} strided grad", dtype)


def test_logprobs_expanded_upstream_gradient():
    x = make_logits((1, 6, 50), torch.float32)
    target = make_target(6, 50)
    ones = torch.ones(()).expand(6)  # what autograd hands over for .sum().backward()
    expected, naive = spec_expected_and_naive(spec_logprobs, x, target, 1.0, IGNORE, True,
                                              ones, ones)
    for isa in each_isa():
        logp, entropy, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
        grad = torch.empty_like(x)
        cb.logprobs_backward(x, target, lse, entropy, ones, ones, LogprobsArgs(1.0, IGNORE, False),
                             grad)
        assert_matches_spec({"grad": grad}, expected, naive, f"{isa} expanded grad_logp",
                            torch.float32)


# ------------------------------------------------------------------------------------------
# cross_entropy_forward
# ------------------------------------------------------------------------------------------

CE_CONFIGS = (  # (label_smoothing, z_loss, softcap, logit_scale)
    (0.0, 0.0, 0.0, 1.0),
    (0.1, 0.0, 0.0, 1.0),
    (0.0, 1e-3, 0.0, 1.0),
    (0.0, 0.0, 5.0, 1.0),
    (0.1, 1e-4, 30.0, 1.0),
    (0.1, 1e-3, 0.0, -1.0),
    (0.0, 0.0, 5.0, 2.0),
    (0.2, 1e-4, 30.0, 0.5),
)
CE = ("loss", "lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", (1, 7, 1003))
@pytest.mark.parametrize("layout", ("contiguous", "strided_vocab", "shifted"))
def test_cross_entropy(dtype, vocab, layout):
    x0 = make_logits((2, 6, vocab), dtype, layout, scale=4.0)
    n = 12
    target = make_target(n, vocab, ignored=(0, 11))
    for smoothing, z_loss, softcap, logit_scale in CE_CONFIGS:
        for scale_rows in (1, n):
            grad_scale = torch.rand(scale_rows, generator=torch.Generator().manual_seed(5)) + 0.5
            config = (IGNORE, smoothing, z_loss, softcap)
            args = CrossEntropyArgs(*config, logit_scale=logit_scale)
            expected, naive = spec_expected_and_naive(spec_cross_entropy, x0, target, *config,
                                                      grad_scale, logit_scale=logit_scale)
            grad = empty_grad_like(x0)
            got = tb.cross_entropy_forward(x0, target, grad_scale, args, grad)
            what = f"eps={smoothing} z={z_loss} cap={softcap} a={logit_scale} scale={scale_rows}"
            assert_matches_spec({**named(CE, got), "grad": grad}, expected, naive,
                                f"torch {what}", dtype)
            got = tb.cross_entropy_forward(x0, target, None, args, None)  # no gradient
            assert_matches_spec(named(CE, got), expected, naive, f"torch {what} (no grad)", dtype)
            for isa in each_isa_and_path():
                what = (f"{isa} eps={smoothing} z={z_loss} cap={softcap} a={logit_scale} "
                        f"scale={scale_rows}")
                got = cb.cross_entropy_forward(x0, target, None, args, None)  # no gradient
                assert_matches_spec(named(CE, got), expected, naive, f"{what} (no grad)", dtype)
                grad = empty_grad_like(x0)
                got = cb.cross_entropy_forward(x0, target, grad_scale, args, grad)
                assert_matches_spec({**named(CE, got), "grad": grad}, expected, naive, what,
                                    dtype)
                assert got[0][0] == 0 and (grad[0, 0] == 0).all()  # ignored row
                if layout == "contiguous":
                    x = x0.clone()
                    got = cb.cross_entropy_forward(x, target, grad_scale, args,
                                                   x)  # grad is logits
                    assert_matches_spec({**named(CE, got), "grad": x}, expected, naive,
                                        f"{what} (in-place)", dtype)


def test_cross_entropy_all_ignored():
    x = make_logits((1, 4, 9), torch.bfloat16)
    target = torch.full((4,), IGNORE)
    grad = empty_grad_like(x)
    for isa in each_isa():
        loss, lse = cb.cross_entropy_forward(x, target, torch.ones(1),
                                             CrossEntropyArgs(IGNORE, 0.1, 1e-3, 0.0), grad)
        assert (loss == 0).all() and (lse == 0).all() and (grad == 0).all(), isa


# ------------------------------------------------------------------------------------------
# grpo_forward
# ------------------------------------------------------------------------------------------

# Log-ratio offsets of old_logprobs: far off-policy both ways (clamped at +-20), clipped low and
# high, inside the trust region.
OFFSETS = (-30.0, -1.0, -0.5, 0.0, 0.05, 0.5, 1.0, 30.0, 0.3, -0.1)
GRPO = ("logp", "loss", "entropy")
# (ref, beta, kl_ratio_correction) x (delta, with_entropy): the KL term plain and times the
# ratio; the entropy from the online walk with and without the gradient pass. The ref of row 4
# has its KL log-ratio clamped above (+25) or below (-25): times the ratio, k3's own gradient
# k3 * dr stays, and k3 = e^20 there would overflow a float16 gradient.
GRPO_KL = ((None, 0.0, False), ("above", 0.04, False), ("below", 0.04, True))
GRPO_DELTA_ENTROPY = ((0.0, True), (2.0, False), (1.2, True))  # 1.2 = 1 + clip_high: ties


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ("contiguous", "strided_vocab", "shifted"))
def test_grpo(dtype, layout):
    vocab, n = 1003, 20
    x0 = make_logits((2, 10, vocab), dtype, layout)
    target = make_target(n, vocab)
    g = torch.Generator().manual_seed(11)
    token_weight = torch.rand(n, generator=g) + 0.5
    token_weight[[2, 13]] = 0.0  # masked rows (their target is not read)
    target[13] = IGNORE
    advantages = torch.randn(n, generator=g)
    logp_now = spec_logprobs(x0, target.clamp(min=0), 0.8, IGNORE, False)["logp"]  # float64
    offsets = torch.tensor(OFFSETS * (n // len(OFFSETS)), dtype=torch.float64)
    old = (logp_now + offsets).float()
    ref = (logp_now + torch.randn(n, generator=g, dtype=torch.float64)).float()
    refs = {None: None, "above": ref.clone(), "below": ref.clone()}
    refs["above"][4] = logp_now[4] + 25.0
    refs["below"][4] = logp_now[4] - 25.0
    # float16 with the ratio correction: beta * (1 - e^dr) * r at the clamped r = e^20 exceeds
    # its range, so the far off-policy rows stay at |log r| <= 5 (float32 and bf16 take +-30)
    old_fp16 = (logp_now + offsets.clamp(-5.0, 5.0)).float()
    for off_policy in (False, True):
        for ref_name, beta, correction in GRPO_KL:
            ref_lp = refs[ref_name]
            old_lp = None
            if off_policy:
                old_lp = old_fp16 if correction and dtype == torch.float16 else old
            for delta, with_entropy in GRPO_DELTA_ENTROPY:
                args = (0.8, advantages, old_lp, ref_lp, token_weight, 0.2, 0.2, delta, beta,
                        correction, with_entropy)
                expected, naive = spec_expected_and_naive(spec_grpo, x0, target, *args)
                rows = (advantages, old_lp, ref_lp, token_weight)
                surrogate = SurrogateArgs(0.8, 0.2, 0.2, delta, beta, correction, with_entropy)
                grad = empty_grad_like(x0)
                got = tb.grpo_forward(x0, target, *rows, surrogate, grad)
                what = (f"old={old_lp is not None} beta={beta} correction={correction} "
                        f"delta={delta} entropy={with_entropy}")
                assert_matches_spec({**named(GRPO, got), "grad": grad}, expected, naive,
                                    f"torch {what}", dtype)
                got = tb.grpo_forward(x0, target, *rows, surrogate, None)
                assert_matches_spec(named(GRPO, got), expected, naive, f"torch {what} (no grad)",
                                    dtype)
                for isa in each_isa_and_path():
                    label = f"{isa} {what}"
                    got = cb.grpo_forward(x0, target, *rows, surrogate, None)
                    assert_matches_spec(named(GRPO, got), expected, naive, f"{label} (no grad)",
                                        dtype)
                    grad = empty_grad_like(x0)
                    got = cb.grpo_forward(x0, target, *rows, surrogate, grad)
                    assert_matches_spec({**named(GRPO, got), "grad": grad}, expected, naive,
                                        label, dtype)
                    assert got[2].shape == ((n,) if with_entropy else (0,))
                    assert got[0][2] == 0 and got[1][13] == 0
                    if with_entropy:
                        assert got[2][2] == 0 and got[2][13] == 0
                    assert (grad[0, 2] == 0).all() and (grad[1, 3] == 0).all()
                    if layout == "contiguous":
                        x = x0.clone()
                        cb.grpo_forward(x, target, *rows, surrogate, x)
                        assert_matches_spec({"grad": x}, expected, naive, f"{label} (in-place)",
                                            dtype)


def test_grpo_clipping_zeroes_gradient():
    """Far off-policy rows (log-ratio clamped, or clipped with the matching advantage sign) get
    no surrogate gradient."""
    x = make_logits((1, 4, 64), torch.float32)
    target = make_target(4, 64)
    logp = tb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, False))[0]
    old = logp - torch.tensor([30.0, -30.0, 1.0, -1.0])  # ratio e^30 (clamped), e^-30, e, 1/e
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])  # clipped side for rows 2, 3
    for isa in each_isa_and_path():
        grad = torch.empty_like(x)
        cb.grpo_forward(x, target, advantages, old, None, torch.ones(4),
                        SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.0, False, False), grad)
        assert (grad == 0).all(), isa


# ------------------------------------------------------------------------------------------
# Edge cases: -inf and huge logits, V = 1, zero rows, bad targets, threads
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_infinity_logits(dtype):
    """Rows whose logits are -inf off a finite head behave as the finite head alone."""
    head, vocab = 10, 300
    x = make_logits((1, 6, vocab), dtype)
    x[..., head:] = float("-inf")
    target = make_target(6, head, ignored=(3,))
    g = torch.Generator().manual_seed(6)
    gl, gh = torch.randn(6, generator=g), torch.randn(6, generator=g)
    expected, naive = spec_expected_and_naive(spec_logprobs, x, target, 1.0, IGNORE, True,
                                              gl, gh)
    ce_expected, ce_naive = spec_expected_and_naive(
        spec_cross_entropy, x, target, IGNORE, 0.0, 1e-3, 0.0, torch.ones(1))
    for isa in each_isa():
        got = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
        assert all(torch.isfinite(t).all() for t in got), isa
        assert_matches_spec(named(LOGPROBS, got), expected, naive, isa, dtype)
        grad = empty_grad_like(x)
        cb.logprobs_backward(x, target, got[2], got[1], gl, gh, LogprobsArgs(1.0, IGNORE, False),
                             grad)
        assert torch.isfinite(grad.float()).all(), isa
        assert_matches_spec({"grad": grad}, expected, naive, isa, dtype)
        got = cb.cross_entropy_forward(x, target, torch.ones(1),
                                       CrossEntropyArgs(IGNORE, 0.0, 1e-3, 0.0), grad)
        assert_matches_spec({**named(CE, got), "grad": grad}, ce_expected, ce_naive,
                            f"{isa} ce", dtype)
        assert (grad[..., head:] == 0).all(), isa


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_online_rescaling_across_blocks(dtype):
    """Rows whose max jumps between vocabulary blocks (the kernels sum each block relative to a
    running shift): small steps, steps past the overflow guard, a target far below the max, and
    a -inf target logit (no usable starting shift)."""
    vocab = 3 * 2048 + 5
    x = make_logits((1, 6, vocab), torch.float32, scale=2.0)
    x[0, 0, 2048:] += 10.0
    x[0, 0, 4096:] += 10.0  # small steps up
    x[0, 1, 2048:4096] += 70.0
    x[0, 1, 4096:] += 150.0  # steps past the guard (exps relative to the old shift overflow)
    x[0, 2, :2048] -= 80.0  # target far below a later max
    x[0, 3, ::3] = float("-inf")
    x[0, 4, 5000:] += 300.0
    x = x.to(dtype)
    target = torch.tensor([5, 17, 100, 4, 2, 3])
    x[0, 5, 3] = float("-inf")  # target logit -inf: logp = -inf
    gl = torch.randn(6, generator=torch.Generator().manual_seed(7))
    expected, naive = spec_expected_and_naive(spec_logprobs, x, target, 1.0, IGNORE, True,
                                              gl, torch.zeros(6))
    for isa in each_isa():
        logp, entropy, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
        assert torch.isfinite(entropy).all()
        assert_matches_spec(named(LOGPROBS, (logp, entropy, lse)), expected, naive, isa, dtype)
        grad = empty_grad_like(x)
        cb.logprobs_backward(x, target, lse, entropy, gl, torch.empty(0),
                             LogprobsArgs(1.0, IGNORE, False), grad)
        assert_matches_spec({"grad": grad}, expected, naive, isa, dtype)


def test_huge_logits_do_not_overflow():
    x = make_logits((1, 8, 2000), torch.float32, scale=1e4)
    target = make_target(8, 2000)
    expected, naive = spec_expected_and_naive(spec_logprobs, x, target, 1.0, IGNORE, True)
    ce_expected, ce_naive = spec_expected_and_naive(spec_cross_entropy, x, target, IGNORE, 0.0,
                                                    0.0, 0.0, torch.ones(1))
    for isa in each_isa():
        got = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
        assert all(torch.isfinite(t).all() for t in got), isa
        assert_matches_spec(named(LOGPROBS, got), expected, naive, isa, torch.float32)
        grad = empty_grad_like(x)
        got = cb.cross_entropy_forward(x, target, torch.ones(1),
                                       CrossEntropyArgs(IGNORE, 0.0, 0.0, 0.0), grad)
        assert_matches_spec({**named(CE, got), "grad": grad}, ce_expected, ce_naive,
                            f"{isa} ce", torch.float32)


def test_nan_logits_propagate():
    x = make_logits((1, 3, 40), torch.float32)
    x[0, 1, 17] = float("nan")
    target = make_target(3, 40)
    logp, _, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, False))
    assert torch.isnan(lse[1]) and torch.isnan(logp[1])
    assert torch.isfinite(lse[[0, 2]]).all()


def test_vocab_of_one():
    x = make_logits((2, 3, 1), torch.bfloat16)
    target = torch.zeros(6, dtype=torch.int64)
    logp, entropy, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
    assert (logp == 0).all() and (entropy == 0).all()
    assert torch.equal(lse, x.float().reshape(-1))
    grad = empty_grad_like(x)
    cb.logprobs_backward(x, target, lse, entropy, torch.ones(6), torch.ones(6),
                         LogprobsArgs(1.0, IGNORE, False), grad)
    assert (grad == 0).all()


@pytest.mark.parametrize("shape", ((0, 3, 50), (2, 0, 50), (0, 0, 7)))
def test_zero_rows(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    target = torch.zeros(0, dtype=torch.int64)
    e = torch.empty(0)
    logp, entropy, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, True))
    assert logp.shape == entropy.shape == lse.shape == (0,)
    grad = torch.empty_like(x)
    cb.logprobs_backward(x, target, lse, entropy, e, e, LogprobsArgs(1.0, IGNORE, False), grad)
    loss, lse = cb.cross_entropy_forward(x, target, torch.ones(1),
                                         CrossEntropyArgs(IGNORE, 0.1, 0.0, 0.0), grad)
    assert loss.shape == lse.shape == (0,)
    logp, loss, entropy = cb.grpo_forward(x, target, e, None, None, e,
                                          SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.0, False, True),
                                          grad)
    assert logp.shape == loss.shape == entropy.shape == (0,)


def test_out_of_range_target_raises():
    x = make_logits((1, 4, 10), torch.float32)
    for bad in (10, -1, 12345):
        target = torch.tensor([0, 1, bad, 3])
        with pytest.raises(ValueError, match="out of range"):
            cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, False))
        with pytest.raises(ValueError, match="out of range"):
            cb.cross_entropy_forward(x, target, torch.ones(1),
                                     CrossEntropyArgs(IGNORE, 0.0, 0.0, 0.0), torch.empty_like(x))
        with pytest.raises(ValueError, match="out of range"):
            cb.grpo_forward(x, target, torch.ones(4), None, None, torch.ones(4),
                            SurrogateArgs(1.0, 0.2, 0.2, 0.0, 0.0, False, False), None)


def test_results_do_not_depend_on_thread_count():
    x = make_logits((4, 64, 515), torch.bfloat16)
    target = make_target(256, 515, ignored=range(0, 256, 7))
    before = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            grad = torch.empty_like(x)
            loss, lse = cb.cross_entropy_forward(x, target, torch.ones(1),
                                                 CrossEntropyArgs(IGNORE, 0.0, 0.0, 0.0), grad)
            outputs.append((loss, lse, grad))
    finally:
        torch.set_num_threads(before)
    for loss, lse, grad in outputs[1:]:
        assert torch.equal(loss, outputs[0][0]) and torch.equal(lse, outputs[0][1])
        assert torch.equal(grad, outputs[0][2])


def _ulp_error(actual, expected64):
    expected = expected64.float()
    ulp = (torch.nextafter(expected.abs(), torch.tensor(float("inf"))) - expected.abs())
    return ((actual.double() - expected64).abs() / ulp.double()).max().item()


def test_fast_exp_and_tanh_accuracy():
    ext = cb.load_extension()
    x = torch.cat([torch.linspace(-87.3, 0.0, 200001), torch.linspace(0.0, 88.0, 20001)])
    assert _ulp_error(ext._fast_exp(x), torch.exp(x.double())) <= 2.0
    special = torch.tensor([float("-inf"), -1e30, -104.0, -87.34, float("nan"), 0.0, -0.0])
    got = ext._fast_exp(special)
    assert (got[:4] == 0).all() and torch.isnan(got[4]) and (got[5:] == 1).all()
    y = torch.cat([torch.linspace(-12.0, 12.0, 200001), torch.logspace(-30, 0, 3001)])
    assert _ulp_error(ext._fast_tanh(y), torch.tanh(y.double())) <= 3.0
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 40.0])
    got = ext._fast_tanh(special)
    assert got[0] == 1 and got[1] == -1 and torch.isnan(got[2]) and got[3] == 0 and got[4] == 1


def test_softmax_tail_through_gradient():
    """grad_j = -p_j over p_j down to 1e-38: the exp of the kernels' inner loops, per ISA."""
    t = torch.linspace(-87.0, 0.0, 3001)
    x = torch.stack([torch.zeros_like(t), t], dim=-1).view(1, -1, 2)
    target = torch.zeros(t.numel(), dtype=torch.int64)
    d = t.double() - torch.log1p(torch.exp(t.double()))
    for isa in each_isa():
        _, _, lse = cb.logprobs_forward(x, target, LogprobsArgs(1.0, IGNORE, False))
        torch.testing.assert_close(lse.double(), torch.log1p(torch.exp(t.double())),
                                   rtol=3e-7, atol=1e-7, msg=isa)
        grad = torch.empty_like(x)
        cb.logprobs_backward(x, target, lse, torch.empty(0), torch.ones(t.numel()), torch.empty(0),
                             LogprobsArgs(1.0, IGNORE, False), grad)
        # d carries the float32 rounding of t - lse (|d| <= 87: about 4e-6 absolute)
        torch.testing.assert_close(-grad[0, :, 1].double(), torch.exp(d), rtol=1e-5, atol=0.0,
                                   msg=isa)


# ------------------------------------------------------------------------------------------
# Loader: availability, build directory, failure reporting
# ------------------------------------------------------------------------------------------

def test_unavailable_reason():
    assert cb.unavailable_reason("cpu") is None
    reason = cb.unavailable_reason("cuda")
    assert isinstance(reason, str) and "CPU tensors only" in reason
    assert cb.isa() in ("generic", "avx2", "avx512")


def test_build_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(cb.BUILD_DIR_ENV, str(tmp_path / "ext"))
    assert cb.build_directory() == tmp_path / "ext"
    monkeypatch.delenv(cb.BUILD_DIR_ENV)
    default = cb.build_directory()
    assert default.parent.name == "astrai_kernels" and torch.__version__ in default.name


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cb.BUILD_DIR_ENV, raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cb.cache_root() == Path.home() / ".cache" / "astrai_kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cb.cache_root() == tmp_path / "xdg" / "astrai_kernels"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert cb.cache_root() == tmp_path / "ext" / "astrai_kernels"
    assert cb.build_directory().parent == tmp_path / "ext" / "astrai_kernels"


def test_build_hash_covers_the_sources_contents_not_their_path(tmp_path):
    # an installed copy of the same sources shares the checkout's build; an edit does not
    src = cb.source_dir()
    copy = Path(shutil.copytree(src, tmp_path / "csrc"))
    assert cb._build_hash(copy) == cb._build_hash(src)
    (copy / "grpo.cpp").write_bytes((src / "grpo.cpp").read_bytes() + b"\n")
    assert cb._build_hash(copy) != cb._build_hash(src)


def test_missing_compiler_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cb, "_EXTENSION", None)
    monkeypatch.setattr(cb, "_WARNED", False)
    monkeypatch.setenv("CXX", "/nonexistent/astrai-c++")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = cb.unavailable_reason("cpu")
        assert cb.unavailable_reason("cpu") == reason
    assert "compiler" in reason
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'torch' backend" in messages[0]
    with pytest.raises(RuntimeError, match="compiler"):
        cb.load_extension()


def test_build_failure_carries_compiler_output(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension: csrc/logprobs.cpp:1:1: error: boom")

    monkeypatch.setattr(cb, "_EXTENSION", None)
    monkeypatch.setattr(cb, "_BUILD_ERROR", None)
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    monkeypatch.setenv(cb.BUILD_DIR_ENV, str(tmp_path))  # no complete build there to load
    for _ in range(2):  # the failure is kept, not retried
        with pytest.raises(RuntimeError, match="error: boom"):
            cb.load_extension()
    monkeypatch.setattr(cb, "_WARNED", True)
    assert "failed" in cb.unavailable_reason("cpu")


def test_lse_reference_value():
    """A hand-checked value, independent of the torch backend."""
    x = torch.tensor([[[1.0, 2.0, 3.0]]])
    logp, entropy, lse = cb.logprobs_forward(x, torch.tensor([2]), LogprobsArgs(1.0, IGNORE, True))
    expected_lse = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert abs(lse.item() - expected_lse) < 1e-6
    assert abs(logp.item() - (3 - expected_lse)) < 1e-6
    p = [math.exp(v - expected_lse) for v in (1, 2, 3)]
    assert abs(entropy.item() + sum(q * math.log(q) for q in p)) < 1e-6


# ------------------------------------------------------------------------------------------
# vocab_shard_backward
# ------------------------------------------------------------------------------------------

NOT_IN_SHARD = -2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ("contiguous", "strided_vocab"))
@pytest.mark.parametrize("softcap", (0.0, 3.0))
@pytest.mark.parametrize("with_beta", (False, True))
def test_vocab_shard_backward(dtype, layout, softcap, with_beta):
    vocab, n = 37, 12
    x = make_logits((2, 6, vocab), dtype, layout, scale=4.0)
    target = make_target(n, vocab, ignored=(3,))
    target[[1, 7]] = NOT_IN_SHARD  # counted rows whose target another rank holds
    g = torch.Generator().manual_seed(21)
    # a whole-vocabulary lse above this shard's own (other shards hold mass too)
    z = softcap * torch.tanh(x.float() / softcap) if softcap else x.float()
    lse = (torch.logsumexp(z.reshape(n, vocab) / 0.8, -1) + torch.rand(n, generator=g)).float()
    alpha, gamma = torch.randn(n, generator=g), torch.randn(n, generator=g)
    beta = torch.randn(n, generator=g) if with_beta else None
    delta = torch.randn(n, generator=g) * 0.01 if with_beta else None
    args = ShardGradArgs(0.8, softcap, IGNORE)
    expected, scale = shard_grad_float64(x, target, lse, alpha, beta, gamma, delta, 0.8, softcap)
    for isa in each_isa():
        grad = empty_grad_like(x)
        cb.vocab_shard_backward(x, target, lse, alpha, beta, gamma, delta, args, grad)
        check_close(grad, expected, "grad", dtype, f"{isa} shard grad", scale=scale)
        assert (grad[0, 3] == 0).all()  # ignored row
        if layout == "contiguous":
            inplace = x.clone()
            cb.vocab_shard_backward(inplace, target, lse, alpha, beta, gamma, delta, args,
                                    inplace)
            assert torch.equal(inplace, grad), isa


def test_vocab_shard_backward_all_inf_shard_row():
    """A shard row of all -inf (a masked padded vocabulary) has p = 0 there: only delta."""
    x = torch.full((1, 2, 5), float("-inf"))
    target = torch.tensor([NOT_IN_SHARD, NOT_IN_SHARD])
    ones = torch.ones(2)
    grad = torch.full_like(x, float("nan"))
    for isa in each_isa():
        cb.vocab_shard_backward(x, target, ones, ones, ones, ones, 0.5 * ones,
                                ShardGradArgs(1.0, 0.0, IGNORE), grad)
        assert torch.equal(grad, torch.full_like(x, 0.5)), isa


# ------------------------------------------------------------------------------------------
# The params objects at the boundary (bindings.cpp reads their fields by name)
# ------------------------------------------------------------------------------------------

def test_log_ratio_clamp_is_the_contracts():
    assert cb.load_extension().LOG_RATIO_CLAMP == primitives.LOG_RATIO_CLAMP


@dataclasses.dataclass(frozen=True)
class _OpParams(CrossEntropyArgs):  # an op's params class: the kernel's fields and its own
    reduction: str


def test_params_are_read_by_field_name():
    x = make_logits((1, 4, 10), torch.float32)
    target = torch.tensor([0, 1, IGNORE, 3])
    expected = cb.cross_entropy_forward(x, target, None, CrossEntropyArgs(IGNORE, 0.1, 0.0, 0.0),
                                        None)
    # a subclass with more fields, ints for floats, None for an option that is off
    for params in (_OpParams(IGNORE, 0.1, 0.0, 0.0, reduction="sum"),
                   CrossEntropyArgs(IGNORE, 0.1, 0, None)):
        for got, want in zip(cb.cross_entropy_forward(x, target, None, params, None), expected):
            assert torch.equal(got, want)
    with pytest.raises(TypeError, match=r"CrossEntropyArgs\.z_loss must be a float, got 'x'"):
        cb.cross_entropy_forward(x, target, None, CrossEntropyArgs(IGNORE, 0.1, "x", 0.0), None)
    with pytest.raises(AttributeError, match="label_smoothing"):
        cb.cross_entropy_forward(x, target, None, LogprobsArgs(1.0, IGNORE, False), None)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        cb.logprobs_forward(x, target, LogprobsArgs(0.0, IGNORE, False))


def test_distill_takes_the_mixture_weights_of_its_params():
    """The kernels use DistillArgs.weights as given (computed once, in Python): params whose
    weights are those of another beta give that beta's results."""
    student = make_logits((1, 5, 33), torch.float32)
    teacher = make_logits((1, 5, 33), torch.float32, seed=1)
    target = make_target(5, 33)

    @dataclasses.dataclass(frozen=True)
    class Reweighted(DistillArgs):
        @property
        def weights(self):
            return mixture_weights(0.3)

    expected = cb.distill_forward(student, teacher, target, None,
                                  DistillArgs(0.3, 1.0, IGNORE, 0.0), None)
    got = cb.distill_forward(student, teacher, target, None, Reweighted(0.6, 1.0, IGNORE, 0.0),
                             None)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
