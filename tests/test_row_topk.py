"""``row_kth_largest`` of the cpp backend (``csrc/row_topk.cpp``): each row's k-th largest
element, its value and its index, and which of some ids are among the k largest, exactly as a
float64 stable descending sort ranks them (NaN above every number, the lower index first among
equal values), on every instruction set the CPU runs, every logits dtype and awkward shapes and
layouts; its value is ``torch.topk``'s k-th, and so is its index where that value is unique in
its row.
"""

import pytest
import torch

from astrai_kernels.kernels.cpp import backend as cpp_backend

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
ISAS = ("generic", "avx2", "avx512")


def stable_order(logits):
    """The reference ranking ``[N, V]`` (ids, best first): each row sorted in float64 by NaN
    first, then descending value, then ascending index (stable sorts, last key first)."""
    x = logits.double().reshape(-1, logits.shape[-1])
    nan = x.isnan()
    order = torch.sort(-x.masked_fill(nan, 0.0), dim=-1, stable=True).indices
    return order.gather(-1, torch.sort(~nan.gather(-1, order), dim=-1, stable=True).indices)


def check(logits, k, seed=0):
    """``row_kth_largest`` against the reference: the k-th element's value and index, and the
    membership of ids drawn around the k-th rank and elsewhere."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    order = stable_order(logits)
    g = torch.Generator().manual_seed(seed)
    near = order[:, max(k - 4, 0):k + 4]
    ids = torch.cat([near, torch.randint(0, vocab, (order.shape[0], 6), generator=g)], -1)
    value, index, in_top_k = cpp_backend.row_kth_largest(logits, k, ids.reshape(*lead, -1))
    rank = order.argsort(-1)
    assert value.dtype == torch.float32 and index.dtype == torch.int64
    assert value.shape == index.shape == lead and in_top_k.shape == (*lead, ids.shape[-1])
    assert torch.equal(index.reshape(-1), order[:, k - 1])
    expected_value = logits.reshape(-1, vocab).float().gather(-1, order[:, k - 1:k])[:, 0]
    assert torch.allclose(value.reshape(-1), expected_value, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(in_top_k.reshape(ids.shape), rank.gather(-1, ids) < k)
    assert torch.equal(cpp_backend.row_kth_largest(logits, k)[1], index)
    # torch.topk's k-th value is defined however it breaks ties; its index where it is unique
    top = torch.topk(logits.float(), k, dim=-1)
    assert torch.allclose(value, top.values[..., -1], rtol=0, atol=0, equal_nan=True)
    unique = (logits.float() == value[..., None]).sum(-1) == 1
    assert torch.equal(index[unique], top.indices[..., -1][unique])
    return value, index


def rows(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# (shape, k): V not a multiple of 16; k = V; k = 1; a row shorter than k * 32 (the window is the
# row); rows longer than the window (the streaming part, V odd); one row; a 3-D batch
SHAPES = {
    "v37_k5": ((6, 37), 5), "k_is_v": ((4, 40), 40), "k1": ((5, 301), 1),
    "short_row": ((4, 1000), 64), "stream": ((8, 5001), 64), "one_row": ((1, 4099), 17),
    "batch3d": ((2, 3, 700), 9),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_matches_a_stable_sort(case, dtype):
    shape, k = SHAPES[case]
    check(rows(shape, dtype), k)


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set(isa):
    """Each variant this CPU runs (the stream's test vectorized at its width) ranks alike."""
    order = ISAS
    if order.index(isa) > order.index(cpp_backend.load_extension().detected_isa()):
        pytest.skip(f"this CPU does not run {isa}")
    previous = cpp_backend.set_isa(isa)
    try:
        for dtype in DTYPES:
            for case in ("stream", "short_row", "v37_k5"):
                shape, k = SHAPES[case]
                check(rows(shape, dtype, seed=1), k)
            check(ties(dtype), 32)
    finally:
        cpp_backend.set_isa(previous)


def ties(dtype):
    """Rows whose k-th value (k = 32) is tied: small integers (every value repeats), a constant
    row, a row of -0.0 and 0.0, a rising row (its buffer cut back all along) and a falling one."""
    g = torch.Generator().manual_seed(2)
    v = 3000
    out = torch.randint(-6, 7, (5, v), generator=g).float()
    out[1] = 1.5
    out[2] = torch.where(torch.rand(v, generator=g) < 0.5, -0.0, 0.0)
    out[3] = torch.arange(v).float() / 8
    out[4] = -torch.arange(v).float() / 8
    return out.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ties_go_to_the_lower_index(dtype):
    logits = ties(dtype)
    value, index = check(logits, 32)
    assert bool(((logits.float() >= value[:, None]).sum(-1) > 32)[:3].all())  # tied at the k-th
    assert index[1].item() == 31 and index[2].item() == 31  # the 32nd of the equal values


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_infinities(dtype):
    """NaN ranks above +inf, as torch.topk ranks it: a row with fewer than k NaNs gives its
    (k - #NaN)-th largest number; with k or more, NaN and the k-th NaN's index (the lower
    indices first)."""
    logits = rows((6, 2100), torch.float32, seed=3)
    nan, inf = float("nan"), float("inf")
    logits[0, [5, 900, 2000]] = nan
    logits[1, ::50] = nan  # 42 NaNs, k = 40
    logits[2, [7, 8, 1500]] = inf
    logits[3] = -inf
    logits[4, :2000] = -inf
    logits[5, 1000:] = nan
    value, index = check(logits.to(dtype), 40)
    assert value[1].isnan() and index[1].item() == 39 * 50
    assert value[3].item() == -inf and index[3].item() == 39
    assert value[5].isnan() and index[5].item() == 1039


def test_layouts():
    """Rows at any stride (a slice of wider rows, a transposed tensor, a strided vocabulary)
    give what their contiguous copy gives."""
    full = rows((7, 3100), torch.bfloat16, seed=4)
    for view in (full[:, 5:3005], full[::2, :3000], full.t().contiguous().t(), full[:, ::3]):
        value, index = check(view, 64)
        expected_value, expected_index = cpp_backend.row_kth_largest(view.contiguous(), 64)
        assert torch.equal(value, expected_value) and torch.equal(index, expected_index)


def test_no_rows():
    value, index = cpp_backend.row_kth_largest(torch.zeros(0, 50), 5)
    assert value.shape == index.shape == (0,)


def test_bad_arguments_name_what_is_wrong():
    logits = torch.randn(3, 50)
    for k in (51, 0, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must be an int between 1 and the logits' last "
                                             "dimension 50"):
            cpp_backend.row_kth_largest(logits, k)
    with pytest.raises(ValueError, match="logits must have a last dimension"):
        cpp_backend.row_kth_largest(torch.tensor(1.0), 1)
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16"):
        cpp_backend.row_kth_largest(logits.double(), 5)
    with pytest.raises(ValueError, match="k must be between 1 and the logits' last dimension 50"):
        cpp_backend.load_extension().row_kth_largest(logits[None], 51)
    with pytest.raises(ValueError, match=r"ids out of range in row_kth_largest: row 1 has id 50"):
        cpp_backend.row_kth_largest(logits, 5, torch.tensor([[0], [50], [3]]))
    with pytest.raises(ValueError, match=r"ids must have shape \[\.\.\., m\] with the logits' "
                                         r"leading shape \(3,\)"):
        cpp_backend.row_kth_largest(logits, 5, torch.zeros(2, 4, dtype=torch.long))
