"""The triton backend's sampled-logprobs primitives (``kernels/triton/sampling.py``) against
``reference.sampled_token_logprobs`` in float64, per element, and against the cpp and torch
backends' supports.

Without CUDA these run under Triton's interpreter (``tests/conftest.py``), so shapes stay small:
``BLOCK_V_OVERRIDE = 16`` walks a row of 37 in three tiles (the last partial), the default rule
keeps it in one tile; ``PROGRAMS_OVERRIDE`` gives fewer programs than rows. The yardstick of
the tolerance model (``astrai_kernels.testing``) is the same float64 reference run on the
float32 logits. The support (``in_support``, ``support_size``) is compared exactly, and the
threshold bit for bit with the cpp kernel's (the same encoding: the smallest logit ``x`` with
``x / T >= tau``).
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.kernels.cpp import backend as cpp_backend
from astrai_kernels.kernels.primitives import LogprobsArgs, SamplingArgs
from astrai_kernels.kernels.triton import backend as kb
from astrai_kernels.kernels.triton import config
from astrai_kernels.kernels.triton.sampling import round_quotient
from astrai_kernels.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() and not kb.kernels_interpreted() else "cpu"
_REASON = kb.unavailable_reason(DEVICE)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"triton backend: {_REASON}")

IGNORE = -100
VOCAB = 37  # not a power of 2: one tile of 64, or three of 16
OUTPUTS = ("logp", "lse_kept", "threshold", "log_kept_mass", "support_size", "in_support")
# (temperature, top_k, top_p, min_p)
SETTINGS = {
    "all": (0.7, 5, 0.9, 0.05),
    "top_p": (1.0, 0, 0.5, 0.0),
    "top_k": (0.8, 3, 1.0, 0.0),
    "min_p": (1.3, 0, 1.0, 0.1),
    "top_k_above_V": (0.7, VOCAB + 3, 0.8, 0.0),
    "off": (0.7, 0, 1.0, 0.0),
}


@pytest.fixture(params=[None, 16], ids=["tile_auto", "tile16"])
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


def make_rows(n_rows, vocab, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n_rows, vocab, generator=g) * scale).to(dtype)


def mixed_targets(logits, seed=1):
    """Per row in turn: the argmax (always kept), a uniform draw (mostly outside the support),
    the second largest, an ignored row."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    g = torch.Generator().manual_seed(seed)
    order = rows.argsort(-1, descending=True)
    uniform = torch.randint(0, rows.shape[-1], (rows.shape[0],), generator=g)
    kind = torch.arange(rows.shape[0]) % 4
    target = torch.where(kind == 0, order[:, 0], torch.where(kind == 1, uniform, order[:, 1]))
    return torch.where(kind == 3, IGNORE, target)


def spec(logits, target, args, upstream):
    """``(expected, naive)``: ``reference.sampled_token_logprobs`` in float64, and the same on
    the float32 logits; each a dict of ``logp``, ``log_kept_mass``, ``support_size``,
    ``in_support`` and the gradient of ``sum(upstream * logp)`` (``grad``)."""
    target = target.cpu().reshape(logits.shape[:-1])
    results = []
    for precision in (torch.float64, torch.float32):
        x = logits.detach().cpu().to(precision).requires_grad_(True)
        logp, log_kept_mass, support_size, in_support = reference.sampled_token_logprobs(
            x, target, args.temperature, args.top_k, args.top_p, args.min_p, IGNORE)
        logp.reshape(-1).backward(upstream.to(precision))
        results.append({"logp": logp.detach(), "log_kept_mass": log_kept_mass,
                        "support_size": support_size, "in_support": in_support,
                        "grad": x.grad})
    return results


def run_triton(logits, target, args, upstream, grad=None):
    """The forward primitive's outputs (named) and the backward's gradient into ``grad`` (a
    fresh NaN-filled buffer by default), with the op's ``coef = g / T`` (0 outside K)."""
    out = dict(zip(OUTPUTS, kb.sampled_logprobs_forward(logits, target, args)))
    coef = torch.where(out["in_support"], upstream.to(DEVICE) / args.temperature, 0.0)
    if grad is None:
        grad = torch.full_like(logits, math.nan)
    kb.sampled_logprobs_backward(logits, target, out["lse_kept"], out["threshold"], coef, args,
                                 grad)
    out["grad"] = grad
    return out


def assert_matches_reference(out, expected, naive, dtype, what):
    assert torch.equal(out["in_support"].cpu(), expected["in_support"].reshape(-1)), what
    assert torch.equal(out["support_size"].cpu(), expected["support_size"].reshape(-1)), what
    for name in ("logp", "log_kept_mass"):
        assert out[name].dtype == torch.float32
        assert_close(out[name].cpu(), expected[name].reshape(-1), "value", dtype,
                     f"{what} {name}", naive=naive[name].reshape(-1))
    assert out["grad"].dtype == dtype
    assert_close(out["grad"].cpu(), expected["grad"], "grad", dtype, f"{what} grad",
                 naive=naive["grad"])


def assert_matches_cpp(logits, target, args, out):
    """The cpp kernel's support and threshold, exactly (both encode K the same way)."""
    cpp = dict(zip(OUTPUTS, cpp_backend.sampled_logprobs_forward(logits.cpu(), target.cpu(),
                                                                 args)))
    for name in ("support_size", "in_support", "threshold"):
        assert torch.equal(out[name].cpu(), cpp[name]), name


# every setting in fp32 and bf16 with the row in one tile, in fp32 over three tiles; bf16 over
# three tiles with every filter on (each interpreted tile pass costs)
MATRIX = [(setting, dtype, tile) for setting in SETTINGS
          for dtype, tile in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 16))]
MATRIX.append(("all", torch.bfloat16, 16))


@pytest.mark.parametrize("setting, dtype, tile", MATRIX, indirect=["tile"],
                         ids=[f"{s}-{str(d)[6:]}-tile{t or 'auto'}" for s, d, t in MATRIX])
def test_matches_reference_and_cpp(setting, dtype, tile):
    args = SamplingArgs(*SETTINGS[setting], IGNORE)
    logits = make_rows(8, VOCAB, dtype, seed=len(setting)).to(DEVICE)
    target = mixed_targets(logits).to(DEVICE)
    upstream = torch.rand(8, generator=torch.Generator().manual_seed(2)) + 0.5
    expected, naive = spec(logits, target, args, upstream)
    out = run_triton(logits, target, args, upstream)
    assert_matches_reference(out, expected, naive, dtype, setting)
    assert_matches_cpp(logits, target, args, out)
    valid = target.cpu() != IGNORE
    assert bool(out["in_support"].cpu()[valid].any())
    if setting not in ("off", "top_k_above_V"):  # a filter drops something
        assert bool((out["support_size"].cpu()[valid] < VOCAB).all())
        assert bool((valid & ~out["in_support"].cpu()).any())  # a target outside K
    assert torch.all(out["grad"].cpu()[~out["in_support"].cpu().view(1, -1)] == 0)


def test_all_filters_off_equals_the_plain_kernel(tile):
    """No filter (and ``top_k >= V``): every token kept, the plain log-probs bit for bit."""
    logits = make_rows(6, VOCAB, torch.float32, seed=3).to(DEVICE)
    target = mixed_targets(logits).to(DEVICE)
    plain_logp, _, plain_lse = kb.logprobs_forward(logits, target, LogprobsArgs(0.7, IGNORE,
                                                                                False))
    valid = (target != IGNORE).cpu()
    for top_k in (0, VOCAB, VOCAB + 5):
        out = dict(zip(OUTPUTS, kb.sampled_logprobs_forward(
            logits, target, SamplingArgs(0.7, top_k, 1.0, 0.0, IGNORE))))
        assert torch.equal(out["logp"], plain_logp)
        assert torch.equal(out["lse_kept"][valid], plain_lse[valid])
        assert torch.equal(out["log_kept_mass"], torch.zeros(6, device=DEVICE))
        assert torch.equal(out["support_size"].cpu(), torch.where(valid, VOCAB, 0))
        assert torch.equal(out["in_support"].cpu(), valid)


def tied_rows(dtype):
    """Rows with repeated values at the boundaries (as ``tests/test_sampling.py``): top_k=2
    keeps ``5`` and the three ``4``s of row 0; row 1 has a tie across the top-p crossing;
    ``-0.0`` ties with ``0.0`` in row 2; row 3 starts with three equal maxima."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 40, generator=g) - 3.0
    rows[0, :5] = torch.tensor([5.0, 4.0, 4.0, 4.0, 3.0])
    rows[1, [7, 3, 30, 11]] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    rows[2, :6] = torch.tensor([1.0, 0.0, -0.0, -1.0, 0.0, -0.0])
    rows[3, :3] = torch.tensor([2.0, 2.0, 2.0])
    return rows.to(dtype).view(1, 4, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ties_at_the_top_k_boundary_are_kept(dtype, tile):
    logits = tied_rows(dtype).to(DEVICE)
    target = torch.tensor([2, 30, 4, 1], device=DEVICE)
    args = SamplingArgs(1.0, 2, 1.0, 0.0, IGNORE)
    upstream = torch.tensor([1.0, 0.5, 2.0, 1.5])
    expected, naive = spec(logits, target, args, upstream)
    out = run_triton(logits, target, args, upstream)
    # row 0: 5 and all three 4s; row 1: 3 and the three 2s; row 2: 1 and the four zeros
    assert out["support_size"].tolist() == [4, 4, 5, 3]
    assert out["in_support"].all()
    assert_matches_reference(out, expected, naive, dtype, "top_k ties")
    assert_matches_cpp(logits, target, args, out)


def test_top_p_keeps_the_crossing_token_and_its_ties(tile):
    logits = tied_rows(torch.float32)[:, 1:2].to(DEVICE)
    probs = logits.double().softmax(-1).reshape(-1).cpu()
    # p between the top token's mass and that plus one of the tied 2s: the crossing is inside
    # the tie; every tied token has exactly the top token's mass ranked strictly above it
    args = SamplingArgs(1.0, 0, float(probs[7] + 0.5 * probs[3]), 0.0, IGNORE)
    target = torch.tensor([11], device=DEVICE)
    upstream = torch.ones(1)
    expected, naive = spec(logits, target, args, upstream)
    out = run_triton(logits, target, args, upstream)
    assert out["support_size"].item() == 4 and bool(out["in_support"])
    assert_matches_reference(out, expected, naive, torch.float32, "top_p ties")
    assert_matches_cpp(logits, target, args, out)
    # without ties: 0.5 < 0.6 <= 0.8, the 0.3 token crosses p, the 0.15 one is out
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).to(DEVICE)
    args = SamplingArgs(1.0, 0, 0.6, 0.0, IGNORE)
    out = dict(zip(OUTPUTS, kb.sampled_logprobs_forward(
        logits.expand(1, 2, 4), torch.tensor([1, 2], device=DEVICE), args)))
    assert out["support_size"].tolist() == [2, 2] and out["in_support"].tolist() == [True, False]


def test_quotients_that_round_together_are_tied():
    """``s = float32(x) / T`` can round two adjacent logits to one value: the k-th largest then
    keeps both (the kernel's division is IEEE's, emulated exactly; the cpp test's case)."""
    temperature = 0.7
    t = torch.tensor(temperature, dtype=torch.float32)
    x = torch.linspace(2.0, 4.0, 200001, dtype=torch.float32).unique()
    upper = torch.nextafter(x, torch.tensor(math.inf))
    hit = (x / t == upper / t).nonzero()[0, 0]
    row = torch.randn(1, 1, 300, generator=torch.Generator().manual_seed(3)) - 2.0
    row[0, 0, [10, 250]] = torch.stack([upper[hit], x[hit]])  # the 1st and 2nd largest
    row[0, 0, 40] = upper[hit] + 1.0
    args = SamplingArgs(temperature, 2, 1.0, 0.0, IGNORE)
    target = torch.tensor([250], device=DEVICE)
    out = dict(zip(OUTPUTS, kb.sampled_logprobs_forward(row.to(DEVICE), target, args)))
    assert out["support_size"].item() == 3 and bool(out["in_support"])
    assert_matches_cpp(row, target, args, out)


def test_rows_with_nan_inf_or_only_minus_inf():
    """NaN or +inf (or only -inf) in a row: NaN results, every token counted, in the support,
    a NaN gradient; rows holding some -inf logits match the reference (they count in the
    support only where the threshold is -inf); the other rows are untouched."""
    rows = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(4)) * 3.0
    target = torch.tensor([3, 3, 9, 1, 4, 3, 5, 2])
    rows[1, 7] = math.nan
    rows[2, 9] = math.inf
    rows[3] = -math.inf
    rows[4, ::3] = -math.inf
    rows[5, ::3] = -math.inf  # its target among them
    rows[6] = -math.inf
    rows[6, [5, 20, 30]] = torch.tensor([1.0, 2.0, 0.5])  # three finite logits, top_k = 5
    args = SamplingArgs(0.8, 5, 0.95, 0.0, IGNORE)
    logits = rows.view(1, 8, VOCAB).to(DEVICE)
    upstream = torch.rand(8, generator=torch.Generator().manual_seed(8)) + 0.5
    out = run_triton(logits, target.to(DEVICE), args, upstream)
    bad = torch.tensor([False, True, True, True, False, False, False, False])
    assert torch.isnan(out["logp"].cpu()[bad]).all()
    assert torch.isnan(out["log_kept_mass"].cpu()[bad]).all()
    assert out["in_support"].cpu()[bad].all()
    assert torch.all(out["support_size"].cpu()[bad] == VOCAB)
    assert torch.isnan(out["grad"].cpu()[0, bad]).any(-1).all()
    good = ~bad
    expected, naive = spec(logits[:, good], target[good].to(DEVICE), args, upstream[good])
    alone = run_triton(logits[:, good].contiguous(), target[good].to(DEVICE), args,
                       upstream[good])
    assert_matches_reference(alone, expected, naive, torch.float32, "-inf rows")
    assert alone["support_size"][3].item() == 3  # top_p drops the -inf logits (mass 0)
    # top_k alone above the three finite logits: threshold -inf, the -inf logits kept too
    top_k_only = SamplingArgs(0.8, 5, 1.0, 0.0, IGNORE)
    row = logits[:, 6:7].contiguous()
    out_k = run_triton(row, target[6:7].to(DEVICE), top_k_only, upstream[6:7])
    expected_k, naive_k = spec(row, target[6:7], top_k_only, upstream[6:7])
    assert out_k["support_size"].item() == VOCAB and out_k["threshold"].item() == -math.inf
    assert_matches_reference(out_k, expected_k, naive_k, torch.float32, "-inf kept")
    for name in OUTPUTS:
        assert torch.equal(out[name][good.to(DEVICE)], alone[name]), name
    assert torch.equal(out["grad"][:, good.to(DEVICE)], alone["grad"])


@pytest.mark.parametrize("layout", ["strided_vocab", "transposed"])
def test_layouts_in_place_and_grid_stride(layout, few_programs, tile):
    """Vocabulary stride != 1, the gradient written over its logits, fewer programs than rows,
    and logits near 1000 (|lse_kept| > 64: the backward recomputes the kept row's max and
    log-sum)."""
    g = torch.Generator().manual_seed(5)
    if layout == "strided_vocab":
        logits = (torch.randn(2, 3, 2 * VOCAB, generator=g) * 3.0)[..., ::2]
    else:
        logits = (torch.randn(VOCAB, 2, 3, generator=g) * 3.0).permute(1, 2, 0)
    logits[1] += 1000.0
    logits = logits.to(DEVICE)
    target = mixed_targets(logits, seed=6).to(DEVICE)
    args = SamplingArgs(0.9, 6, 0.85, 0.01, IGNORE)
    upstream = torch.rand(6, generator=g) + 0.5
    expected, naive = spec(logits, target, args, upstream)
    buffer = logits.clone()
    out = run_triton(buffer, target, args, upstream, grad=buffer)
    assert_matches_reference(out, expected, naive, torch.float32, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs_routes_to_the_kernels(dtype):
    """``ak.token_logprobs(..., backend="triton")`` runs these kernels (autograd included) and
    keeps the supports of the cpp and torch backends."""
    params = ak.SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02)
    base = make_rows(8, VOCAB, dtype, seed=9).view(2, 4, VOCAB)
    target = mixed_targets(base, seed=3).view(2, 4)
    upstream = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    expected, naive = spec(base, target, SamplingArgs(0.7, 8, 0.9, 0.02, IGNORE),
                           upstream.reshape(-1))
    x = base.to(DEVICE).requires_grad_(True)
    logp, support = ak.token_logprobs(x, target.to(DEVICE), sampling=params,
                                      return_support=True, backend="triton")
    logp.backward(upstream.to(DEVICE))
    out = {"logp": logp.reshape(-1), "log_kept_mass": support["log_kept_mass"].reshape(-1),
           "support_size": support["support_size"].reshape(-1),
           "in_support": support["in_support"].reshape(-1), "grad": x.grad}
    assert_matches_reference(out, expected, naive, dtype, "token_logprobs")
    for backend in ("cpp", "torch"):
        _, other = ak.token_logprobs(base, target, sampling=params, return_support=True,
                                     backend=backend)
        for name in ("support_size", "in_support"):
            assert torch.equal(support[name].cpu(), other[name]), (backend, name)


@triton.jit
def _round_quotient_kernel(a_ptr, approx_ptr, out_ptr, temperature):
    i = tl.program_id(0)
    tl.store(out_ptr + i, round_quotient(tl.load(a_ptr + i), tl.load(approx_ptr + i),
                                         temperature))


@pytest.mark.parametrize("temperature", [0.7, 1.3, 2.0])
def test_round_quotient_is_the_ieee_division(temperature):
    """The compiled ``/`` is approximate (2 ulps), so the kernels correct it to the IEEE
    quotient: from approximations 3 ulps either side, every result is torch's float32 division,
    ties to even included (``T = 2``: half a subnormal step)."""
    g = torch.Generator().manual_seed(11)
    values = torch.cat([torch.randn(40, generator=g) * 5.0,
                        torch.tensor([0.0, -0.0, 1e-45, 3e-45, -3e-45, 1e30, -7.5])])
    exact = values / torch.tensor(temperature)
    steps = torch.arange(-3, 4)
    approx = exact.view(-1, 1).expand(-1, len(steps)).contiguous()
    for column, step in enumerate(steps.tolist()):
        for _ in range(abs(step)):
            approx[:, column] = torch.nextafter(approx[:, column],
                                                torch.tensor(math.copysign(math.inf, step)))
    a = values.view(-1, 1).expand_as(approx).contiguous().to(DEVICE)
    out = torch.empty_like(a)
    _round_quotient_kernel[(a.numel(),)](a, approx.to(DEVICE), out, temperature)
    # -0.0 may come back as 0.0 (they share a key), which compare equal
    assert torch.equal(out.cpu(), exact.view(-1, 1).expand_as(approx))
