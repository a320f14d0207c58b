"""ak.distill_loss / ak.linear_distill_loss against TRL's generalized JSD written out here in
float64 (``GKDTrainer.generalized_jsd_loss``, trl/experimental/gkd/gkd_trainer.py), per element
with the shared tolerance model: the loss (or per-row losses) and the student's gradient."""

import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels.kernels.triton import config as triton_config
from astrai_kernels.testing import assert_close

from cases import KERNEL_BACKENDS, trl_generalized_jsd

BACKENDS = KERNEL_BACKENDS + ["reference"]
# the reductions are the op's (backend-independent) code: the interpreted triton kernels
# (seconds per call) run in fewer combinations than the CPU backends
CPU_BACKENDS = ["torch", "cpp", "reference"]


def combos(full, triton_subset):
    """``full`` (tuples starting with a backend) for the CPU backends, ``triton_subset`` (the
    same tuples without it) for triton."""
    return ([c for c in full if c[0] != "triton"]
            + [("triton", *c) for c in triton_subset])


def expected_loss(student, teacher, target, beta, temperature, reduction, normalizer=None,
                  hard_weight=0.0, ignore_index=-100):
    """TRL's loss (``none``: its elements summed per row, 0 on ignored rows, in the op's
    ``[...]`` shape) plus ``hard_weight * cross_entropy`` per row, reduced alike."""
    vocab = student.shape[-1]
    s, t = student.reshape(-1, vocab), teacher.reshape(-1, vocab).to(student.dtype)
    labels = None if target is None else target.reshape(-1)
    if reduction == "none":
        rows = trl_generalized_jsd(s, t, None, beta, temperature, "none").sum(-1)
    else:  # unflattened: without labels TRL's batchmean divides by the first dim
        value = trl_generalized_jsd(student, teacher.to(student.dtype), target, beta,
                                    temperature, reduction, normalizer, ignore_index)
    if hard_weight:
        ce_rows = F.cross_entropy(s, labels.clamp(min=0), reduction="none")
    valid = torch.ones(s.shape[0], dtype=torch.bool) if labels is None else labels != ignore_index
    if reduction == "none":
        if hard_weight:
            rows = rows + hard_weight * ce_rows
        return torch.where(valid, rows, 0.0).reshape(student.shape[:-1])
    if hard_weight:
        ce_sum = torch.where(valid, ce_rows, 0.0).sum()
        count = valid.sum()
        if normalizer is not None:
            denominator = normalizer
        elif reduction == "batchmean":
            denominator = count.clamp(min=1)
        elif reduction == "mean":
            denominator = count * vocab
        else:
            denominator = 1
        value = value + hard_weight * ce_sum / denominator
    return value


def grad_terms(student, teacher, target, beta, temperature, upstream_rows, hard_weight=0.0,
               ignore_index=-100):
    """float64 sizes of the terms forming each gradient entry (the comparison's scale):
    ``|g| / T * (p_s (1 + |a|)(w_s (1 + |a - m| + |K|)) + p_t (1 + |b|))`` plus the hard term's
    ``|g| hard_weight (p1 (1 + |log p1|) + [j == y])``."""
    vocab = student.shape[-1]
    s = student.reshape(-1, vocab).double()
    t = teacher.reshape(-1, vocab).double()
    a = torch.log_softmax(s / temperature, -1)
    b = torch.log_softmax(t / temperature, -1)
    p_s, p_t = a.exp(), b.exp()
    if beta == 0:
        terms = p_s * (1 + a.abs()) + p_t * (1 + b.abs())
    else:
        m = b if beta == 1 else torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
        kl = (p_s * (a - m)).sum(-1, keepdim=True)
        terms = p_s * (1 + a.abs()) * (1 + (a - m).abs() + kl.abs()) + p_t * (1 + b.abs())
    g = upstream_rows.reshape(-1, 1).double().abs()
    terms = g / temperature * terms
    if hard_weight:
        log_p1 = torch.log_softmax(s, -1)
        onehot = torch.zeros_like(s).scatter_(1, target.reshape(-1, 1).clamp(min=0), 1.0)
        terms = terms + g * hard_weight * (log_p1.exp() * (1 + log_p1.abs()) + onehot)
    if target is not None:
        terms = terms * (target.reshape(-1, 1) != ignore_index)
    return terms.nan_to_num(0.0, 0.0, 0.0).reshape(student.shape)


def row_share(student, target, reduction, normalizer):
    """``d loss / d row_loss`` of the reduction (TRL's denominators)."""
    if reduction in ("none", "sum"):
        return 1.0
    if normalizer is not None:
        return 1.0 / float(normalizer)
    rows = student.shape[:-1].numel()
    count = rows if target is None else int((target != -100).sum())
    if reduction == "batchmean":
        if target is None:  # TRL's jsd.size(0)
            count = student.shape[0] if student.dim() > 1 else 1
        return 1.0 / max(count, 1)
    return 1.0 / (count * student.shape[-1])


def make_pair(shape, dtype, teacher_dtype=None, seed=0, scale=2.0, ignored=0.25):
    g = torch.Generator().manual_seed(seed)
    *lead, vocab = shape
    student = (torch.randn(*shape, generator=g) * scale).to(dtype)
    teacher = (torch.randn(*shape, generator=g) * scale).to(teacher_dtype or dtype)
    target = torch.randint(0, vocab, tuple(lead), generator=g)
    target[torch.rand(tuple(lead), generator=g) < ignored] = -100
    return student, teacher, target


def check(backend, student, teacher, target, beta=0.5, temperature=1.0, reduction="batchmean",
          normalizer=None, hard_weight=0.0, view=None, teacher_view=None, upstream=0.7):
    """Run the op on a leaf copy of ``student`` (through ``view`` when given; the teacher
    through ``teacher_view``), compare loss and gradient with the float64 formula and the naive
    path in the result's dtype."""
    view = view or (lambda x: x)
    teacher_view = teacher_view or view
    dtype = student.dtype
    x = student.detach().clone().requires_grad_(True)
    teacher_leaf = teacher.detach().clone().requires_grad_(True)
    loss = ak.distill_loss(view(x), teacher_view(teacher_leaf), target, beta=beta,
                           temperature=temperature, reduction=reduction, normalizer=normalizer,
                           hard_weight=hard_weight, backend=backend)
    assert loss.dtype == torch.float32
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape) * upstream
    (loss * weights).sum().backward()
    assert teacher_leaf.grad is None, "the teacher got a gradient"
    results = {}
    for precision in {torch.float64, torch.float32, dtype}:
        xr = student.detach().to(precision).requires_grad_(True)
        value = expected_loss(view(xr), teacher_view(teacher.to(precision)), target, beta,
                              temperature, reduction, normalizer, hard_weight)
        (value * weights.to(precision)).sum().backward()
        results[precision] = (value.detach(), xr.grad)
    expected, expected_grad = results[torch.float64]
    assert_close(loss, expected, "value", dtype, "loss", naive=results[torch.float32][0])
    upstream_rows = weights.double() * row_share(student, target, reduction, normalizer)
    scale = torch.zeros(student.shape, dtype=torch.float64)
    view(scale).copy_(grad_terms(view(student), teacher_view(teacher), target, beta, temperature,
                                 upstream_rows, hard_weight))
    assert_close(x.grad, expected_grad, "grad", dtype, "grad", naive=results[dtype][1],
                 scale=scale)
    return loss, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_trl(backend, beta, dtype):
    # V = 37: not a power of two, below every tile; two temperatures (one for triton)
    student, teacher, target = make_pair((2, 5, 37), dtype, seed=1)
    for temperature in (0.7,) if backend == "triton" else (1.0, 0.7):
        check(backend, student, teacher, target, beta=beta, temperature=temperature)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_reductions(backend, reduction):
    student, teacher, target = make_pair((3, 4, 50), torch.float32, seed=2)
    check(backend, student, teacher, target, beta=0.3, temperature=0.8, reduction=reduction)
    check(backend, student, teacher, None, beta=0.3, temperature=0.8, reduction=reduction)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_normalizer(backend):
    student, teacher, target = make_pair((2, 6, 40), torch.float32, seed=3)
    check(backend, student, teacher, target, beta=0.5, normalizer=7.0)
    check(backend, student, teacher, target, beta=0.0, normalizer=torch.tensor(11.0),
          reduction="mean")
    x = student.clone().requires_grad_(True)
    loss = ak.distill_loss(x, teacher, torch.full_like(target, -100), normalizer=0,
                           backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0
    with pytest.raises(ValueError, match="normalizer must be > 0 when a row is counted"):
        ak.distill_loss(x, teacher, target, normalizer=0, backend=backend)


@pytest.mark.parametrize("backend, dtype, teacher_dtype", combos(
    [(backend, dtype, teacher) for backend in KERNEL_BACKENDS
     for dtype in (torch.float32, torch.bfloat16)
     for teacher in (torch.float32, torch.bfloat16, torch.float16)],
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)]))
def test_mixed_teacher_dtype(backend, dtype, teacher_dtype):
    student, teacher, target = make_pair((2, 3, 45), dtype, teacher_dtype, seed=4)
    check(backend, student, teacher, target, beta=0.4, temperature=0.9)


@pytest.mark.parametrize("backend, beta, temperature", combos(
    [(backend, beta, temperature) for backend in BACKENDS for beta in (0.0, 0.5)
     for temperature in (1.0, 0.6)], [(0.5, 0.6)]))
def test_hard_weight(backend, beta, temperature):
    student, teacher, target = make_pair((2, 4, 33), torch.float32, seed=5)
    check(backend, student, teacher, target, beta=beta, temperature=temperature,
          hard_weight=0.3)
    check(backend, student, teacher, target, beta=1.0, temperature=temperature,
          hard_weight=0.3, reduction="none")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_several_tiles(backend, beta, monkeypatch):
    # the triton kernels on 64-wide tiles (V = 300: 5 tiles, the last partial); the cpp
    # kernels' 2048-element blocks with V = 2100
    monkeypatch.setattr(triton_config, "BLOCK_V_OVERRIDE", 64)
    vocab = 300 if backend == "triton" else 2100
    student, teacher, target = make_pair((3, vocab), torch.bfloat16, seed=6)
    check(backend, student, teacher, target, beta=beta, temperature=0.8, hard_weight=0.2)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_every_isa(dtype, beta):
    """Each compiled copy of the cpp kernels (generic, avx2, avx512), the mixture's forward with
    its kept exps and recomputing them: V = 2100, two blocks of the statistics pass."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend

    if cpp_backend.unavailable_reason("cpu") is not None:
        pytest.skip(cpp_backend.unavailable_reason("cpu"))
    from test_cpp_backend import each_isa_and_path

    student, teacher, target = make_pair((3, 2100), dtype, seed=15)
    for _ in each_isa_and_path():
        # a scalar reduction: the forward writes the gradient (from its stored values, or
        # recomputed without scratch); "none": the backward kernel writes it
        check("cpp", student, teacher, target, beta=beta, temperature=0.8)
        check("cpp", student, teacher, target, beta=beta, hard_weight=0.2)
        check("cpp", student, teacher, target, beta=beta, hard_weight=0.2, reduction="none")


@pytest.mark.parametrize("beta", [0.01, 0.5, 0.99])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_mixture_where_one_side_dominates(backend, beta):
    # logits of spread 25: most ids have p_s and p_t orders of magnitude apart, many near
    # float32 underflow, so the mixture's log is taken of one side's mass alone
    student, teacher, target = make_pair((4, 300), torch.float32, seed=16, scale=25.0)
    check(backend, student, teacher, target, beta=beta, temperature=0.9)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_large_logits_recompute_the_row_stats(backend):
    # |lse| > 64: the backward re-reduces the rows instead of using the saved lse
    student, teacher, target = make_pair((4, 64), torch.float32, seed=7, scale=300.0)
    student = student + 500.0
    teacher = teacher - 400.0
    for reduction in ("batchmean", "none"):  # the forward's gradient, the backward's
        check(backend, student, teacher, target, beta=0.5, temperature=2.0, hard_weight=0.1,
              reduction=reduction)
        check(backend, student, teacher, target, beta=0.0, temperature=2.0,
              reduction=reduction)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_layouts(backend):
    # the student the x[:, :-1] slice of causal-LM logits, the teacher contiguous (their row
    # views group differently); both sliced; a teacher with vocabulary stride 2
    student, teacher, _ = make_pair((2, 5, 30), torch.float32, seed=8)
    target = make_pair((2, 4, 30), torch.float32, seed=8)[2]

    def shifted(x):
        return x[:, :-1]

    check(backend, student, teacher, target, view=shifted, teacher_view=lambda t: t[:, 1:])
    check(backend, student, teacher, target, view=shifted)
    wide = make_pair((2, 5, 60), torch.bfloat16, seed=9)[0]
    check(backend, student.bfloat16(), wide, target, beta=0.2, view=shifted,
          teacher_view=lambda t: t[:, 1:, ::2])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_all_rows_ignored(backend):
    student, teacher, _ = make_pair((2, 3, 20), torch.float32, seed=9)
    target = torch.full((2, 3), -100)
    for reduction in ("batchmean", "mean", "sum"):
        x = student.clone().requires_grad_(True)
        loss = ak.distill_loss(x, teacher, target, reduction=reduction, hard_weight=0.5,
                               backend=backend)
        loss.backward()
        assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_no_grad_forward(backend):
    student, teacher, target = make_pair((2, 3, 20), torch.float32, seed=10)
    with torch.no_grad():
        loss = ak.distill_loss(student.requires_grad_(True), teacher, target, backend=backend)
    assert loss.grad_fn is None
    expected = expected_loss(student.double(), teacher.double(), target, 0.5, 1.0, "batchmean")
    assert_close(loss, expected, "value", torch.float32, "loss")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(beta=1.5), ValueError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(normalizer=3.0, reduction="sum"), ValueError, "normalizer"),
    (dict(hard_weight=-1.0), ValueError, "hard_weight"),
    (dict(hard_weight=0.5, target=None), ValueError, "target"),
    (dict(teacher=torch.zeros(2, 3, 21)), ValueError, "teacher_logits"),
    (dict(teacher=torch.zeros(2, 3, 20, dtype=torch.int64)), TypeError, "teacher_logits"),
    (dict(target=torch.full((2, 3), 20)), ValueError, "outside"),
])
def test_bad_arguments(kwargs, error, match):
    student, teacher, target = make_pair((2, 3, 20), torch.float32, seed=11)
    args = dict(teacher=teacher, target=target)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ak.distill_loss(student, args.pop("teacher"), args.pop("target"), **args)


# ---------------------------------------------------------------------------------------------
# the fused-head form

def _heads(dtype, n_rows=12, hidden=16, teacher_hidden=24, vocab=70, seed=12, bias=False):
    g = torch.Generator().manual_seed(seed)
    sh = (torch.randn(2, n_rows // 2, hidden, generator=g)).to(dtype)
    sw = (torch.randn(vocab, hidden, generator=g) * 0.4).to(dtype)
    th = (torch.randn(2, n_rows // 2, teacher_hidden, generator=g)).to(dtype)
    tw = (torch.randn(vocab, teacher_hidden, generator=g) * 0.4).to(dtype)
    sb = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    target = torch.randint(0, vocab, (2, n_rows // 2), generator=g)
    target[0, 1] = -100
    return sh, sw, sb, th, tw, target


@pytest.mark.parametrize("backend, dtype, reduction", combos(
    [(backend, dtype, reduction) for backend in BACKENDS
     for dtype in (torch.float32, torch.bfloat16) for reduction in ("batchmean", "none")],
    [(torch.bfloat16, "none")]))
def test_linear_distill_matches_fp64(backend, dtype, reduction):
    sh, sw, sb, th, tw, target = _heads(dtype, bias=True)
    options = dict(beta=0.4, temperature=0.9, reduction=reduction, hard_weight=0.2)
    leaves = [t.detach().clone().requires_grad_(True) for t in (sh, sw, sb)]
    loss = ak.linear_distill_loss(leaves[0], leaves[1], th, tw, target, student_bias=leaves[2],
                                  chunk_size=5, backend=backend, **options)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    results = {}
    for precision in {torch.float64, torch.float32, dtype}:
        refs = [t.detach().to(precision).requires_grad_(True) for t in (sh, sw, sb)]
        value = expected_loss(F.linear(*refs[:2], refs[2]),
                              F.linear(th.to(precision), tw.to(precision)),
                              target, options["beta"], options["temperature"], reduction,
                              hard_weight=options["hard_weight"])
        (value * weights.to(precision)).sum().backward()
        results[precision] = (value.detach(), [r.grad for r in refs])
    expected, expected_grads = results[torch.float64]
    # the naive loss: float32 math on logits from a GEMM in dtype (rounded to it)
    naive_loss = expected_loss(F.linear(sh, sw, sb).float(), F.linear(th, tw).float(), target,
                               options["beta"], options["temperature"], reduction,
                               hard_weight=options["hard_weight"])
    assert_close(loss, expected, "value", dtype, "loss", naive=naive_loss)
    # each gradient entry sums the logit gradient's terms times the other factor's entries
    student_logits = F.linear(sh.double(), sw.double(), sb.double())
    upstream_rows = weights.double() * row_share(student_logits, target, reduction, None)
    terms = grad_terms(student_logits, F.linear(th.double(), tw.double()), target,
                       options["beta"],
                       options["temperature"], upstream_rows, options["hard_weight"])
    terms = terms.reshape(-1, terms.shape[-1])
    scales = (terms @ sw.double().abs(), terms.t() @ sh.double().abs().reshape(-1, sh.shape[-1]),
              terms.sum(0))
    for name, leaf, want, naive, scale in zip(("hidden", "weight", "bias"), leaves,
                                              expected_grads, results[dtype][1], scales):
        assert leaf.grad.dtype == dtype
        assert_close(leaf.grad, want, "grad", dtype, name, naive=naive,
                     scale=scale.reshape(want.shape))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_linear_distill_no_target_forward_kl(backend):
    sh, sw, _, th, tw, _ = _heads(torch.float32, seed=13)
    x = sh.clone().requires_grad_(True)
    loss = ak.linear_distill_loss(x, sw, th, tw, beta=0.0, reduction="sum", backend=backend)
    loss.backward()
    xr = sh.double().requires_grad_(True)
    expected = expected_loss(F.linear(xr, sw.double()), F.linear(th, tw).double(), None, 0.0,
                             1.0, "sum")
    expected.backward()
    assert_close(loss, expected, "value", torch.float32, "loss")
    student_logits = F.linear(sh.double(), sw.double())
    terms = grad_terms(student_logits, F.linear(th, tw).double(), None, 0.0, 1.0,
                       torch.ones(()))
    assert_close(x.grad, xr.grad, "grad", torch.float32, "hidden",
                 scale=terms @ sw.double().abs())


def test_linear_distill_bad_heads():
    sh, sw, _, th, tw, target = _heads(torch.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        ak.linear_distill_loss(sh, sw, th, tw[:-1], target)
    with pytest.raises(ValueError, match="teacher head"):
        ak.linear_distill_loss(sh, sw, th, tw[:, :-1], target)
    with pytest.raises(ValueError, match="leading shape"):
        ak.linear_distill_loss(sh, sw, th[:, :-1], tw, target)


def test_cpp_log_is_accurate():
    """The C++ distill kernels' log (``log_with_offset`` in csrc/common.h: the mixture's
    ``log m``) over positive normal floats, every binade and the sqrt(1/2) split: within 2 ulp."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend

    if cpp_backend.unavailable_reason("cpu") is not None:
        pytest.skip(cpp_backend.unavailable_reason("cpu"))
    g = torch.Generator().manual_seed(14)
    q = torch.cat([torch.rand(20000, generator=g) + 0.5,
                   torch.logspace(-37, 38, 4000).float(),
                   torch.tensor([2.0 ** -126, 0.70710677, 0.70710683, 1.0, 1.41421354,
                                 3.4e38])])
    got = cpp_backend.load_extension()._log(q).double()
    want = torch.log(q.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=0.5)
    assert float(((got - want).abs() / ulp).max()) <= 2.0


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_torch_compile_fullgraph(backend):
    student, teacher, target = make_pair((2, 5, 40), torch.float32, seed=15)

    def loss_fn(x):
        return ak.distill_loss(x, teacher, target, beta=0.5, temperature=0.9, hard_weight=0.1,
                               backend=backend) * 2.0

    eager = student.clone().requires_grad_(True)
    expected = loss_fn(eager)
    expected.backward()
    compiled = student.clone().requires_grad_(True)
    value = torch.compile(loss_fn, fullgraph=True)(compiled)
    value.backward()
    assert_close(value, expected.detach().double(), "value", torch.float32, "compiled loss")
    assert_close(compiled.grad, eager.grad.double(), "grad", torch.float32, "compiled grad",
                 scale=eager.grad.abs() + 1e-6)


def _transformed(logits, logit_scale, softcap):
    return softcap * torch.tanh(logit_scale * logits / softcap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_distill_softcap_and_logit_scale(backend):
    """Each head's logits soft-capped and scaled before the temperature (TRL's
    ``ChunkedDivergenceFunction`` order), student and teacher with their own values."""
    sh, sw, sb, th, tw, target = _heads(torch.float32, bias=True, seed=14)
    sw, tw = sw * 4, tw * 4  # logits large enough for the cap to matter
    caps = dict(softcap=3.0, logit_scale=0.8, teacher_softcap=5.0, teacher_logit_scale=1.3)
    options = dict(beta=0.4, temperature=0.9, reduction="batchmean")
    leaves = [t.detach().clone().requires_grad_(True) for t in (sh, sw, sb)]
    loss = ak.linear_distill_loss(leaves[0], leaves[1], th, tw, target, student_bias=leaves[2],
                                  chunk_size=5, backend=backend, **caps, **options)
    loss.backward()
    results = {}
    for precision in (torch.float64, torch.float32):
        refs = [t.detach().to(precision).requires_grad_(True) for t in (sh, sw, sb)]
        student = _transformed(F.linear(*refs[:2], refs[2]), 0.8, 3.0)
        teacher = _transformed(F.linear(th.to(precision), tw.to(precision)), 1.3, 5.0)
        value = expected_loss(student, teacher, target, 0.4, 0.9, "batchmean")
        value.backward()
        results[precision] = (value.detach(), [r.grad for r in refs])
    expected, expected_grads = results[torch.float64]
    assert_close(loss, expected, "value", torch.float32, "loss", naive=results[torch.float32][0])
    # the terms of the logit gradient (of the capped logits) times the cap's slope
    x = F.linear(sh.double(), sw.double(), sb.double())
    student, teacher = _transformed(x, 0.8, 3.0), _transformed(F.linear(th.double(),
                                                                        tw.double()), 1.3, 5.0)
    terms = grad_terms(student, teacher, target, 0.4, 0.9,
                       torch.full(target.shape, row_share(student, target, "batchmean", None)))
    terms = (terms * 0.8 * (1 - torch.tanh(0.8 * x / 3.0) ** 2)).reshape(-1, x.shape[-1])
    scales = (terms @ sw.double().abs(), terms.t() @ sh.double().abs().reshape(-1, sh.shape[-1]),
              terms.sum(0))
    for name, leaf, want, naive, scale in zip(("hidden", "weight", "bias"), leaves,
                                              expected_grads, results[torch.float32][1], scales):
        assert_close(leaf.grad, want, "grad", torch.float32, name, naive=naive,
                     scale=scale.reshape(want.shape))
    # a dropped cap on either head is seen
    for dropped in ("softcap", "teacher_softcap"):
        wrong = ak.linear_distill_loss(sh, sw, th, tw, target, student_bias=sb, backend=backend,
                                       **{**caps, dropped: None}, **options)
        assert abs(float(wrong) - float(expected)) > 1e-3


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_linear_distill_torch_compile_fullgraph(backend, reduction):
    """The fused head's walk is a custom op (with a fake), as every ``linear_*`` walk: the
    compiled step traces it in one graph and equals the eager step, gradients too."""
    sh, sw, sb, th, tw, target = _heads(torch.float32, bias=True, seed=16)

    def step(h, w, b, temperature):
        loss = ak.linear_distill_loss(h, w, th, tw, target, student_bias=b, beta=0.4,
                                      temperature=temperature, hard_weight=0.2, softcap=4.0,
                                      reduction=reduction, chunk_size=5, backend=backend)
        return loss.sum() if reduction == "none" else loss

    eager = [t.detach().clone().requires_grad_(True) for t in (sh, sw, sb)]
    compiled = [t.detach().clone().requires_grad_(True) for t in (sh, sw, sb)]
    expected = step(*eager, 0.9)
    expected.backward()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled, 0.9)
    got.backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad)
