"""The yardstick itself: the per-element comparator rejects known-wrong gradients and accepts
the backends' correct ones, at a realistic vocabulary, in float32 and bfloat16.

A tolerance that cannot fail is a defect: each mutation below is a plausible kernel bug (a tail
of the softmax scaled, tiny probabilities flushed, label smoothing's ``eps / V`` dropped, the
temperature applied twice, rows written to the wrong place), and each must be caught.
"""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import (
    TOLERANCES,
    assert_close,
    assert_close_elementwise,
    compare,
    compare_elementwise,
    compare_model_gradient,
    softmax_grad_scale,
)

VOCAB = 16384
ROWS = 12
TEMPERATURE = 0.7
SMOOTHING = 0.1
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
BACKENDS = ["cpp", "torch"]


def realistic_rows(dtype, seed=0):
    """Logits of rows from flat to confident (logit spread 0.5 to 4, two rows with a dominant
    target), the targets, and seeded upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.5, 4.0, ROWS).unsqueeze(1)
    logits = torch.randn(ROWS, VOCAB, generator=g) * spread
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    logits[0, target[0]] += 20.0  # p_y ~ 1
    logits[1, target[1]] += 8.0
    upstream = torch.randn(ROWS, generator=g)
    return logits.to(dtype), target, upstream


def gradients(op, logits, target, upstream, backend=None, temperature=TEMPERATURE):
    """The gradient of ``sum(upstream * op(logits))`` w.r.t. the logits, by ``backend``'s op
    (``None``: reference.py in the logits' own dtype)."""
    x = logits.detach().clone().requires_grad_(True)
    if op == "token_logprobs":
        if backend is None:
            out = reference.token_logprobs(x, target, temperature)[0]
        else:
            out = ak.token_logprobs(x, target, temperature=temperature, backend=backend)
    else:
        if backend is None:
            out = reference.cross_entropy(x, target, reduction="none",
                                          label_smoothing=SMOOTHING)
        else:
            out = ak.cross_entropy(x, target, reduction="none", label_smoothing=SMOOTHING,
                                   backend=backend)
    (out * upstream.to(out.dtype)).sum().backward()
    return x.grad


def probabilities(op, logits):
    t = TEMPERATURE if op == "token_logprobs" else 1.0
    return torch.softmax(logits.double() / t, dim=-1)


def mutations(op, logits, target, upstream, grad):
    """Known-wrong versions of the correct gradient ``grad``: ``{name: wrong}``."""
    dtype = grad.dtype
    p = probabilities(op, logits)
    wrong = {}
    wrong["tail p<1e-3 scaled by 2"] = torch.where(p < 1e-3, grad.double() * 2, grad.double())
    wrong["p<1e-4 zeroed"] = torch.where(p < 1e-4, 0.0, grad.double())
    swapped = grad.clone()
    swapped[[3, 7]] = grad[[7, 3]]
    wrong["rows 3 and 7 swapped"] = swapped
    if op == "cross_entropy":  # g * (p - (1 - eps) * onehot - eps / V): drop the eps / V
        wrong["smoothing eps/V dropped"] = (grad.double()
                                            + upstream.double().unsqueeze(1) * SMOOTHING / VOCAB)
    else:  # softmax(z / T^2) and a chain factor 1 / T^2
        wrong["temperature applied twice"] = gradients(
            op, logits.double() / TEMPERATURE, target, upstream.double()) / TEMPERATURE
    return {name: w.to(dtype) for name, w in wrong.items()}


def expected_and_naive(op, logits, target, upstream):
    """The float64 gradient, the naive same-dtype one, and the terms forming each entry."""
    expected = gradients(op, logits.double(), target, upstream.double())
    naive = gradients(op, logits, target, upstream)
    if op == "token_logprobs":
        scale = softmax_grad_scale(logits, target, upstream, temperature=TEMPERATURE)
    else:
        scale = softmax_grad_scale(logits, target, upstream, label_smoothing=SMOOTHING)
    return expected, naive, scale


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["token_logprobs", "cross_entropy"])
def test_comparator_rejects_wrong_gradients_and_accepts_the_backends(op, dtype):
    logits, target, upstream = realistic_rows(dtype)
    expected, naive, scale = expected_and_naive(op, logits, target, upstream)
    assert (probabilities(op, logits) < 1e-4).float().mean() > 0.5  # a realistic tail
    for backend in BACKENDS:
        grad = gradients(op, logits, target, upstream, backend)
        assert grad.dtype == dtype
        assert_close_elementwise(grad, expected, naive=naive, scale=scale,
                                 name=f"{backend} {op}")
        for name, wrong in mutations(op, logits, target, upstream, grad).items():
            assert not torch.equal(wrong, grad), f"mutation {name!r} changed nothing"
            result = compare_elementwise(wrong, expected, naive=naive, scale=scale)
            assert not result.ok, (f"{backend} {op} {dtype}: the comparator accepts a gradient "
                                   f"with {name} (worst ratio {result.max_ratio:.3g})")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_term_scale_rejects_wrong_gradients_and_accepts_the_backends(dtype):
    """Without a naive path: the scale of the terms forming each softmax-gradient entry."""
    op = "cross_entropy"
    logits, target, upstream = realistic_rows(dtype, seed=1)
    expected = gradients(op, logits.double(), target, upstream.double())
    scale = softmax_grad_scale(logits, target, upstream, label_smoothing=SMOOTHING)
    for backend in BACKENDS:
        grad = gradients(op, logits, target, upstream, backend)
        assert_close_elementwise(grad, expected, scale=scale, name=f"{backend} {op}")
        for name, wrong in mutations(op, logits, target, upstream, grad).items():
            result = compare_elementwise(wrong, expected, scale=scale)
            assert not result.ok, f"{backend} {dtype}: scale-based check accepts {name}"


def test_naive_same_dtype_path_is_itself_within_tolerance():
    """The yardstick's own baseline passes (the naive path's error is its own budget)."""
    logits, target, upstream = realistic_rows(torch.bfloat16)
    expected, naive, scale = expected_and_naive("token_logprobs", logits, target, upstream)
    assert_close_elementwise(naive, expected, naive=naive, scale=scale)


def test_float64_expected_rounded_passes_every_dtype():
    g = torch.Generator().manual_seed(4)
    expected = torch.randn(1000, generator=g, dtype=torch.float64) * torch.logspace(-30, 3, 1000,
                                                                                  dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert compare_elementwise(expected.to(dtype), expected).ok, dtype
    assert compare_elementwise(expected.to(torch.bfloat16), expected,
                               dtype=torch.float32).ok is False  # bf16 rounding is not fp32's


def test_failure_message_names_the_worst_entry():
    expected = torch.linspace(1.0, 2.0, 12, dtype=torch.float64).reshape(3, 4)
    actual = expected.float().clone()
    actual[2, 1] *= 1.01
    actual[0, 3] *= 1.001
    with pytest.raises(AssertionError) as info:
        assert_close_elementwise(actual, expected, name="probe")
    message = str(info.value)
    assert "probe" in message and "index (2, 1)" in message and "2 entries" in message
    assert f"{float(actual[2, 1]):.6e}" in message and "allowed" in message


def test_non_finite_entries_must_match():
    expected = torch.tensor([1.0, float("inf"), float("nan"), float("-inf")], dtype=torch.float64)
    assert compare_elementwise(expected.float(), expected).ok
    for bad in ([1.0, 1e30, float("nan"), float("-inf")], [1.0, float("inf"), 0.0, float("-inf")],
                [float("nan"), float("inf"), float("nan"), float("-inf")],
                [1.0, float("-inf"), float("nan"), float("-inf")]):
        assert not compare_elementwise(torch.tensor(bad), expected).ok, bad


def test_shape_mismatch_and_empty():
    result = compare_elementwise(torch.zeros(3), torch.zeros(4, dtype=torch.float64))
    assert not result.ok and "shape" in result.message()
    assert compare_elementwise(torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.float64)).ok
    with pytest.raises(ValueError, match="naive shape"):
        compare_elementwise(torch.zeros(3), torch.zeros(3, dtype=torch.float64),
                            naive=torch.zeros(4))


def test_values_are_scaled_per_entry_not_by_the_largest():
    """A large entry does not excuse an error in a small one (the old max-scaled atol did)."""
    expected = torch.tensor([1e4, 1.0, 1e-3], dtype=torch.float64)
    actual = expected.float().clone()
    actual[2] += 1e-4  # 10% off, far below 2e-6 * 1e4
    assert not compare(actual, expected, "value", torch.float32).ok
    actual = expected.float().clone()
    actual[1] += 1e-6  # within the float32 budget of an O(1) value
    assert_close(actual, expected, "value", torch.bfloat16, "logp")


def test_table_covers_every_result_dtype():
    assert set(TOLERANCES) == {torch.float64, torch.float32, torch.bfloat16, torch.float16}
    with pytest.raises(ValueError, match="no tolerance"):
        compare_elementwise(torch.zeros(2, dtype=torch.int64), torch.zeros(2),
                            dtype=torch.int64)


def test_model_row_allows_the_gemm_order_and_no_more():
    """The model row (a parameter's gradient through a float32 model): another summation
    order's noise (3x the naive run's, at 1e-6 of the largest entry) passes; one entry moved
    by 1e-4 of the largest entry, a small entry doubled, or a tensor scaled by 1 + 1e-4 fails."""
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(32, 16, generator=g, dtype=torch.float64)
    largest = expected.abs().max()
    naive = expected + 1e-7 * largest * torch.randn(32, 16, generator=g, dtype=torch.float64)
    other_order = expected + 1e-6 * largest * torch.randn(32, 16, generator=g,
                                                          dtype=torch.float64)
    assert compare_model_gradient(other_order.float(), expected, naive.float()).ok
    moved = expected.clone()
    moved[3, 5] += 1e-4 * largest
    small = expected.abs().argmin()
    doubled = expected.clone().view(-1)
    doubled[small] = 2 * doubled[small] + 1e-3 * largest
    for wrong in (moved, doubled.view(32, 16), expected * (1 + 1e-4)):
        result = compare_model_gradient(wrong.float(), expected, naive.float())
        assert not result.ok and result.failed >= 1
    with pytest.raises(ValueError, match="naive shape"):
        compare_model_gradient(expected.float(), expected, naive[:3].float())
