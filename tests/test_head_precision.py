"""The fused head's 16-bit gradients against the naive same-dtype path, entry by entry, over many
chunks, on both matmul paths (``ASTRAI_KERNELS_HEAD_MATMUL``: ``native`` runs the matmuls in
the inputs' dtype, as every GPU and a CPU with AVX512-BF16/AMX do; ``float32`` on float32
copies). The yardstick is the head row of the tolerance table (``head_gradient_allowed``): 2x
the naive path's own error on the entry (before or after its last rounding, the larger), plus
half an ulp of the entry, plus 1e-4 of the gradient's largest entry, plus the naive path's RMS
error. A second test checks the head's float32 sum directly: each gradient against the float64
sum of the head's own chunk logit gradients, within its one rounding.
"""

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.kernels import matmul as head_matmul
from astrai_kernels.ops import head as head_op
from astrai_kernels.testing import assert_close_elementwise, assert_head_gradient_close
from astrai_kernels.testing.tolerances import half_ulp

N_ROWS, HIDDEN, VOCAB, CHUNK = 192, 48, 3001, 8  # 24 chunks
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_ROWS, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 3).to(dtype)
    bias = (torch.randn(VOCAB, generator=g) * 0.5).to(dtype)
    teacher = (torch.randn(N_ROWS, HIDDEN, generator=g)).to(dtype)
    teacher_weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 3).to(dtype)
    target = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    target[::9] = -100
    advantages = torch.randn(4, generator=g)
    upstream = torch.rand(N_ROWS, generator=g) + 0.5
    return dict(hidden=hidden, weight=weight, bias=bias, teacher=teacher,
                teacher_weight=teacher_weight, target=target, advantages=advantages,
                upstream=upstream)


def _grpo_shape(t):
    return t.reshape(4, N_ROWS // 4, *t.shape[1:])


def _teacher_logits(x, dtype):
    """The teacher's logits as each path forms them: float64 for the expected gradient, in the
    inputs' dtype (then upcast) for the naive path."""
    teacher, weight = x["teacher"], x["teacher_weight"]
    if dtype == torch.float64:
        return F.linear(teacher.double(), weight.double())
    return F.linear(teacher, weight).to(dtype)


# Each op: its fused form on (hidden, weight, bias), and the same loss on given logits
# (float64 for the expected gradient, the naive path's logits.float() for the yardstick).
OPS = {
    "cross_entropy": (
        lambda x, h, w, b, **kw: ak.linear_cross_entropy(
            h, w, x["target"], bias=b, reduction="sum", label_smoothing=0.05, **kw),
        lambda x, z: reference.cross_entropy(z, x["target"], reduction="sum",
                                             label_smoothing=0.05)),
    "token_logprobs_entropy": (
        lambda x, h, w, b, **kw: sum(
            (t * x["upstream"]).sum() for t in ak.linear_token_logprobs(
                h, w, x["target"], bias=b, return_entropy=True, temperature=0.7, **kw)),
        lambda x, z: sum((t * x["upstream"].to(z.dtype)).sum()
                         for t in reference.token_logprobs(z, x["target"], 0.7))),
    "grpo": (
        lambda x, h, w, b, **kw: ak.linear_grpo_loss(
            _grpo_shape(h), w, _grpo_shape(x["target"].clamp(min=0)), x["advantages"],
            bias=b, mask=_grpo_shape(x["target"] != -100), **kw)[0],
        lambda x, z: reference.grpo_loss(
            _grpo_shape(z), _grpo_shape(x["target"].clamp(min=0)), x["advantages"].to(z.dtype),
            mask=_grpo_shape(x["target"] != -100))[0]),
    # reduction "sum": batchmean's 1/96 puts float16 logit gradients (p / N ~ 3e-6) among the
    # subnormals, where both paths' roundings are 2% of an entry and no yardstick is informative
    "distill": (
        lambda x, h, w, b, **kw: ak.linear_distill_loss(
            h, w, x["teacher"], x["teacher_weight"], x["target"], student_bias=b,
            reduction="sum", **kw),
        lambda x, z: reference.distill_loss(z, _teacher_logits(x, z.dtype), x["target"],
                                            reduction="sum")),
    "cross_entropy_softcap": (
        lambda x, h, w, b, **kw: ak.linear_cross_entropy(
            h, w, x["target"], bias=b, reduction="sum", softcap=15.0, **kw),
        lambda x, z: reference.cross_entropy(z, x["target"], reduction="sum", softcap=15.0)),
}


def _leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in tensors]


def _expected_and_naive(op, x):
    """The float64 gradients; the naive path's (``F.linear`` in the inputs' dtype, the loss on
    its ``.float()``); and the naive path's before their last rounding: its logit gradient,
    rounded to the inputs' dtype as its backward does, through the three GEMMs in float64."""
    loss_on_logits = OPS[op][1]
    exact = _leaves(x["hidden"], x["weight"], x["bias"], dtype=torch.float64)
    loss_on_logits(x, F.linear(*exact)).backward()
    naive = _leaves(x["hidden"], x["weight"], x["bias"])
    logits = F.linear(*naive).float()
    logits.retain_grad()
    loss_on_logits(x, logits).backward()
    grad_logits = logits.grad.to(x["hidden"].dtype).double()
    unrounded = (grad_logits @ x["weight"].double(), grad_logits.t() @ x["hidden"].double(),
                 grad_logits.sum(0))
    return [t.grad for t in exact], [t.grad for t in naive], unrounded


@pytest.mark.parametrize("path", ["native", "float32"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_head_gradients_within_the_naive_paths_error(op, dtype, backend, path, monkeypatch):
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, path)
    x = _inputs(DTYPES[dtype])
    ours = _leaves(x["hidden"], x["weight"], x["bias"])
    OPS[op][0](x, *ours, chunk_size=CHUNK, backend=backend).backward()
    expected, naive, unrounded = _expected_and_naive(op, x)
    for name, actual, *references in zip(("hidden", "weight", "bias"), (t.grad for t in ours),
                                         expected, naive, unrounded):
        assert actual.dtype == DTYPES[dtype]
        assert_head_gradient_close(actual, *references, name=f"{op} {name} grad")


def test_the_matmul_path_is_forced_and_checked(monkeypatch):
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, "native")
    assert head_matmul.compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, "float32")
    assert head_matmul.compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert head_matmul.compute_dtype(torch.float32, torch.device("cpu")) == torch.float32
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match=head_matmul.HEAD_MATMUL_ENV):
        head_matmul.compute_dtype(torch.bfloat16, torch.device("cpu"))


def test_a_bf16_running_sum_of_chunk_products_fails_the_yardstick(monkeypatch):
    """The defect this file guards against: each chunk's product rounded to bf16 before the
    float32 sum (the head before issue 34) breaks the yardstick at these shapes."""
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, "native")
    x = _inputs(torch.bfloat16)
    expected, naive, unrounded = _expected_and_naive("cross_entropy", x)
    running = torch.zeros(VOCAB, HIDDEN, dtype=torch.float32)
    hidden, weight, bias, target = x["hidden"], x["weight"], x["bias"], x["target"]
    for start in range(0, N_ROWS, CHUNK):
        rows = slice(start, start + CHUNK)
        z = F.linear(hidden[rows], weight, bias).float().requires_grad_(True)
        reference.cross_entropy(z, target[rows], reduction="sum",
                                label_smoothing=0.05).backward()
        running += (z.grad.to(torch.bfloat16).t() @ hidden[rows]).float()
    with pytest.raises(AssertionError, match="weight grad"):
        assert_head_gradient_close(running.to(torch.bfloat16), expected[1], naive[1],
                                   unrounded[1], name="weight grad")


@pytest.mark.parametrize("path", ["native", "float32"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_head_gradients_are_their_chunks_sum_rounded_once(op, dtype, path, monkeypatch):
    """Each gradient against the float64 sum of the head's own chunk logit gradients (recorded
    as the head folds them): within half an ulp (the one rounding) plus float32 summation
    (2^-20 of the terms' sizes). A per-chunk rounding of the products breaks this at once."""
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, path)
    seen = {"hidden": [], "weight": []}
    write_hidden, accumulate_weight = (head_op.ChunkedHead._write_hidden_grad,
                                       head_op.ChunkedHead._accumulate_weight_grad)

    def record_hidden(self, start, stop, grad_logits, float32_grads):
        seen["hidden"].append((start, stop, grad_logits.double()))
        write_hidden(self, start, stop, grad_logits, float32_grads)

    def record_weight(self, start, stop, grad_logits, float32_grads):
        summed = grad_logits if float32_grads is None else float32_grads
        seen["weight"].append((start, stop, summed.double(), grad_logits.double()))
        accumulate_weight(self, start, stop, grad_logits, float32_grads)

    monkeypatch.setattr(head_op.ChunkedHead, "_write_hidden_grad", record_hidden)
    monkeypatch.setattr(head_op.ChunkedHead, "_accumulate_weight_grad", record_weight)
    x = _inputs(DTYPES[dtype])
    ours = _leaves(x["hidden"], x["weight"], x["bias"])
    OPS[op][0](x, *ours, chunk_size=CHUNK, backend="cpp").backward()
    hidden, weight = x["hidden"].double(), x["weight"].double()
    grad_hidden, hidden_terms = torch.zeros_like(hidden), torch.zeros_like(hidden)
    for start, stop, dz in seen["hidden"]:
        grad_hidden[start:stop] = dz @ weight
        hidden_terms[start:stop] = dz.abs() @ weight.abs()
    grad_weight, weight_terms = torch.zeros_like(weight), torch.zeros_like(weight)
    grad_bias, bias_terms = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB)
    for start, stop, dz, rounded in seen["weight"]:
        grad_weight += dz.t() @ hidden[start:stop]
        weight_terms += dz.abs().t() @ hidden[start:stop].abs()
        grad_bias += rounded.sum(0)
        bias_terms += rounded.abs().sum(0)
    assert len(seen["weight"]) == N_ROWS // CHUNK
    for name, actual, exact, terms in (("hidden", ours[0].grad, grad_hidden, hidden_terms),
                                       ("weight", ours[1].grad, grad_weight, weight_terms),
                                       ("bias", ours[2].grad, grad_bias, bias_terms)):
        allowed = half_ulp(exact, DTYPES[dtype]) + 2.0 ** -20 * terms
        assert_close_elementwise(actual, exact, dtype=DTYPES[dtype], name=f"{op} {name} grad",
                                 allowed=allowed)


_ONE_THREAD_PRODUCTS = """
import torch
from astrai_kernels.kernels import matmul as head_matmul
matmul = torch.backends.mkldnn.matmul
before = matmul.fp32_precision
g = torch.Generator().manual_seed(5)
a = torch.randn(64, 300, generator=g).bfloat16().float()
b = torch.randn(300, 48, generator=g).bfloat16().float()
with head_matmul.bf16_products():
    assert matmul.fp32_precision == "bf16", matmul.fp32_precision
    product = a @ b
assert matmul.fp32_precision == before
exact = a.double() @ b.double()
terms = a.double().abs() @ b.double().abs()
assert bool(((product.double() - exact).abs() <= 2.0 ** -20 * terms).all())
"""


@pytest.mark.skipif(not head_matmul.has_bf16_float32_gemm(torch.device("cpu")),
                    reason="torch without oneDNN's fp32_precision setting: the head upcasts "
                           "and runs float32 GEMMs instead (covered above)")
def test_bf16_products_are_exact_and_taken_only_on_one_thread():
    """The setting behind the CPU's bf16 weight products: in a process with one Python thread
    (a fresh one: the suite's own may hold others), exact products of bf16-valued float32
    operands with float32 sums, restored after; left alone while another Python thread runs."""
    import subprocess
    import sys
    import threading

    from cases import subprocess_env

    run = subprocess.run([sys.executable, "-c", _ONE_THREAD_PRODUCTS], capture_output=True,
                         text=True, env=subprocess_env())
    assert run.returncode == 0, run.stderr
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        with head_matmul.bf16_products():
            assert matmul.fp32_precision == before
    finally:
        release.set()
        other.join()
