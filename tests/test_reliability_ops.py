"""Issue 24: double backward, -inf logits in distillation, TRL's batchmean without labels, and
one ``normalizer=0`` rule for every op. (The vocabulary-parallel items are in
``test_distributed_vocab.py``.) Tiny shapes: the triton backend runs under the interpreter."""

import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close

from cases import KERNEL_BACKENDS, trl_generalized_jsd

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# item 1: double backward raises a clear error; first-order backward is unchanged

def _head(seed=0, vocab=40, rows=6, hidden=8):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=g).requires_grad_(True)
    y = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, y


def _grpo_args(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(advantages=torch.randn(1, generator=g),
                old_logprobs=torch.randn(1, rows, generator=g) * 0.1 - 3.0)


def _double_backward_cases(backend):
    """``(op name in the error, loss of (h, w, y))``: every op whose backward is a kernel."""
    def grpo(h, w, y):
        args = _grpo_args(y.numel())
        logits = F.linear(h, w).unsqueeze(0)
        return ak.grpo_loss(logits, y.unsqueeze(0), args["advantages"],
                            old_logprobs=args["old_logprobs"], backend=backend)[0]

    def linear_grpo(h, w, y):
        args = _grpo_args(y.numel())
        return ak.linear_grpo_loss(h.unsqueeze(0), w, y.unsqueeze(0), args["advantages"],
                                   old_logprobs=args["old_logprobs"], backend=backend)[0]

    def distill(h, w, y):
        teacher = F.linear(h, w).detach().flip(-1)
        return ak.distill_loss(F.linear(h, w), teacher, y, backend=backend)

    def linear_distill(h, w, y):
        return ak.linear_distill_loss(h, w, h.detach(), w.detach().flip(0), y, backend=backend)

    return {
        "cross_entropy": lambda h, w, y: ak.cross_entropy(F.linear(h, w), y, backend=backend),
        "cross_entropy-none": lambda h, w, y: ak.cross_entropy(
            F.linear(h, w), y, reduction="none", backend=backend).sum(),
        "linear_cross_entropy": lambda h, w, y: ak.linear_cross_entropy(h, w, y,
                                                                        backend=backend),
        "linear_cross_entropy-none": lambda h, w, y: ak.linear_cross_entropy(
            h, w, y, reduction="none", backend=backend).sum(),
        "token_logprobs": lambda h, w, y: ak.token_logprobs(F.linear(h, w), y,
                                                            backend=backend).sum(),
        "linear_token_logprobs": lambda h, w, y: ak.linear_token_logprobs(
            h, w, y, backend=backend).sum(),
        "grpo_loss": grpo,
        "linear_grpo_loss": linear_grpo,
        "distill_loss": distill,
        "linear_distill_loss": linear_distill,
    }


@pytest.mark.parametrize("case", list(_double_backward_cases("torch")))
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_double_backward_raises_naming_the_op(backend, case):
    loss_fn = _double_backward_cases(backend)[case]
    h, w, y = _head()
    loss = loss_fn(h, w, y) + 0.5 * (h ** 2).sum()
    op = case.split("-")[0]
    with pytest.raises(RuntimeError, match=rf"astrai_kernels\.{op} has no double backward"):
        torch.autograd.grad(loss, h, create_graph=True)
    # the same graph still serves an ordinary backward (the check only looks at grad mode)
    h2, w2, y2 = _head()
    loss_fn(h2, w2, y2).backward()
    assert torch.isfinite(h2.grad).all() and torch.isfinite(w2.grad).all()


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "linear"])
def test_double_backward_alternatives_match_pytorch(fused):
    """The error's alternatives: ``backend='reference'`` gives PyTorch's second-order gradient
    (the issue's gradient penalty: ``|w.grad|`` about 3.4), and the first-order gradient of the
    kernels equals F.cross_entropy's."""
    def penalty(loss_of):
        h, w, y = _head()
        loss = loss_of(h, w, y) + 0.5 * (h ** 2).sum()
        (g,) = torch.autograd.grad(loss, h, create_graph=True)
        (g ** 2).sum().backward()
        return h.grad, w.grad

    def pytorch(h, w, y):
        return F.cross_entropy(F.linear(h, w), y)

    def ours(h, w, y):
        if fused:
            return ak.linear_cross_entropy(h, w, y, backend="reference")
        return ak.cross_entropy(F.linear(h, w), y, backend="reference")

    want_h, want_w = penalty(pytorch)
    got_h, got_w = penalty(ours)
    assert want_w is not None and float(want_w.norm()) > 1.0
    torch.testing.assert_close(got_h, want_h)
    torch.testing.assert_close(got_w, want_w)
    h, w, y = _head()
    first = torch.autograd.grad(ak.linear_cross_entropy(h, w, y, backend="cpp"), (h, w))
    expected = torch.autograd.grad(pytorch(h, w, y), (h, w))
    for got, want in zip(first, expected):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# item 2: -inf logits (excluded ids) on either side, at every beta, on every backend

def _masked_pair(kind, seed=2, rows=3, vocab=37):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab, generator=g) * 2
    teacher = torch.randn(rows, vocab, generator=g) * 2
    if kind in ("teacher", "both"):
        teacher[:, 20:] = NEG_INF  # a teacher with a smaller vocabulary mapped in
    if kind in ("student", "both"):
        student[:, 30:] = NEG_INF
        student[1, 5] = NEG_INF
    if kind == "same":  # padded ids excluded on both sides
        student[:, :4] = NEG_INF
        teacher[:, :4] = NEG_INF
    return student, teacher


def distill_grad_scale(student, teacher, beta, temperature, upstream):
    """float64 sizes of the terms forming each gradient entry (``test_distill.grad_terms``'s
    model), with an excluded id's terms 0 instead of ``0 * inf``."""
    vocab = student.shape[-1]
    a = torch.log_softmax(student.double().reshape(-1, vocab) / temperature, -1)
    b = torch.log_softmax(teacher.double().reshape(-1, vocab) / temperature, -1)
    p_s, p_t = a.exp(), b.exp()
    teacher_terms = torch.where(p_t > 0, p_t * (1 + b.abs()), 0.0)
    if beta == 0:
        student_terms = torch.where(p_s > 0, p_s * (1 + a.abs()), 0.0)
    else:
        m = b if beta == 1 else torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
        diff = torch.where(p_s > 0, a - m, 0.0)
        kl = (p_s * diff).sum(-1, keepdim=True)
        student_terms = torch.where(p_s > 0, p_s * (1 + a.abs()) * (1 + diff.abs() + kl.abs()),
                                    0.0)
    g = upstream.double().reshape(-1, 1).abs()
    return (g / temperature * (student_terms + teacher_terms)).reshape(student.shape)


def infinite_rows(student, teacher, beta):
    """The documented semantics: a row is +inf where the KL's support breaks (beta = 0: the
    student excludes an id the teacher keeps; beta = 1: the reverse); never between."""
    excluded_s, excluded_t = student == NEG_INF, teacher == NEG_INF
    if beta == 0:
        return (excluded_s & ~excluded_t).any(-1)
    if beta == 1:
        return (excluded_t & ~excluded_s).any(-1)
    return torch.zeros(student.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kind", ["teacher", "student", "both", "same"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS + ["reference"])
def test_distill_inf_logits_match_the_spec(backend, kind, beta):
    student, teacher = _masked_pair(kind)
    temperature = 0.9
    x = student.clone().requires_grad_(True)
    loss = ak.distill_loss(x, teacher, beta=beta, temperature=temperature, reduction="none",
                           backend=backend)
    upstream = torch.linspace(0.5, 1.5, loss.numel())
    loss.backward(upstream)
    x64 = student.double().requires_grad_(True)
    expected = reference.distill_loss(x64, teacher.double(), None, beta, temperature,
                                      reduction="none")
    expected.backward(upstream.double())
    assert torch.equal(torch.isinf(expected), infinite_rows(student, teacher, beta))
    assert not torch.isnan(expected).any()
    assert_close(loss, expected.detach(), "value", torch.float32, f"{kind} loss")
    finite = torch.isfinite(expected)
    if not finite.any():
        return  # the gradient of a +inf row is not defined
    scale = distill_grad_scale(student, teacher, beta, temperature, upstream)
    assert torch.isfinite(x64.grad[finite]).all()
    assert_close(x.grad[finite], x64.grad[finite], "grad", torch.float32, f"{kind} grad",
                 scale=scale[finite])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_linear_distill_inf_bias(backend, beta):
    """A -inf bias on the teacher's head (ids it cannot produce) through the fused form."""
    g = torch.Generator().manual_seed(3)
    sh, sw = torch.randn(4, 6, generator=g), torch.randn(29, 6, generator=g)
    th, tw = torch.randn(4, 5, generator=g), torch.randn(29, 5, generator=g)
    tb = torch.zeros(29)
    tb[25:] = NEG_INF
    loss = ak.linear_distill_loss(sh, sw, th, tw, teacher_bias=tb, beta=beta, reduction="none",
                                  chunk_size=3, backend=backend)
    expected = reference.distill_loss(F.linear(sh, sw).double(), F.linear(th, tw, tb).double(),
                                      None, beta, reduction="none")
    assert_close(loss, expected, "value", torch.float32, "loss")
    assert bool(torch.isinf(loss).all()) == (beta == 1.0)


# ---------------------------------------------------------------------------------------------
# item 5: batchmean without labels on [B, T, V] follows TRL (divides by B)

# the reduction is the op's code, not the kernels': one beta under the triton interpreter
@pytest.mark.parametrize("backend, beta", [
    (backend, beta) for backend in ("torch", "cpp", "reference") for beta in (0.0, 0.5, 1.0)]
    + [("triton", 0.5)])
def test_distill_batchmean_3d_without_labels_is_trl(backend, beta):
    g = torch.Generator().manual_seed(4)
    student = torch.randn(2, 5, 23, generator=g) * 2
    teacher = torch.randn(2, 5, 23, generator=g) * 2
    x = student.clone().requires_grad_(True)
    loss = ak.distill_loss(x, teacher, beta=beta, temperature=0.8, backend=backend)
    loss.backward()
    x64 = student.double().requires_grad_(True)
    expected = trl_generalized_jsd(x64, teacher.double(), beta=beta, temperature=0.8)
    expected.backward()
    assert_close(loss, expected.detach(), "value", torch.float32, "loss")
    # the division by B = 2, not by the B * T = 10 rows
    rows = reference.distill_loss(student.double(), teacher.double(), None, beta, 0.8,
                                  reduction="sum")
    assert abs(expected.item() - rows.item() / 2) <= 1e-9 * abs(rows.item())
    scale = distill_grad_scale(student, teacher, beta, 0.8, torch.full((2, 5), 0.5))
    assert_close(x.grad, x64.grad, "grad", torch.float32, "grad", scale=scale)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_linear_distill_batchmean_3d_without_labels_is_trl(backend):
    g = torch.Generator().manual_seed(5)
    sh, sw = torch.randn(3, 4, 6, generator=g), torch.randn(19, 6, generator=g)
    th, tw = torch.randn(3, 4, 7, generator=g), torch.randn(19, 7, generator=g)
    w = sw.clone().requires_grad_(True)
    loss = ak.linear_distill_loss(sh, w, th, tw, beta=0.3, chunk_size=5, backend=backend)
    loss.backward()
    w64 = sw.double().requires_grad_(True)
    expected = trl_generalized_jsd(F.linear(sh.double(), w64), F.linear(th, tw).double(),
                                        beta=0.3)
    expected.backward()
    assert_close(loss, expected.detach(), "value", torch.float32, "loss")
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# item 6: normalizer=0 is legal only when nothing is counted, for every op that takes one

def _normalizer_cases(backend):
    """``name -> loss(h, w, y, normalizer)`` with ``y`` the targets (-100 = not counted)."""
    def grpo_args(y):
        mask = y != -100
        return y.clamp(min=0).unsqueeze(0), mask.unsqueeze(0), torch.ones(1)

    def grpo(h, w, y, normalizer):
        target, mask, advantages = grpo_args(y)
        return ak.grpo_loss(F.linear(h, w).unsqueeze(0), target, advantages, mask=mask,
                            loss_type="dapo", normalizer=normalizer, backend=backend)[0]

    def linear_grpo(h, w, y, normalizer):
        target, mask, advantages = grpo_args(y)
        return ak.linear_grpo_loss(h.unsqueeze(0), w, target, advantages, mask=mask,
                                   loss_type="dapo", normalizer=normalizer, backend=backend)[0]

    return {
        "cross_entropy": lambda h, w, y, n: ak.cross_entropy(F.linear(h, w), y, normalizer=n,
                                                             backend=backend),
        "linear_cross_entropy": lambda h, w, y, n: ak.linear_cross_entropy(
            h, w, y, normalizer=n, backend=backend),
        "distill_loss": lambda h, w, y, n: ak.distill_loss(
            F.linear(h, w), F.linear(h, w).detach().flip(-1), y, normalizer=n, backend=backend),
        "linear_distill_loss": lambda h, w, y, n: ak.linear_distill_loss(
            h, w, h.detach(), w.detach().flip(0), y, normalizer=n, backend=backend),
        "grpo_loss": grpo,
        "linear_grpo_loss": linear_grpo,
    }


@pytest.mark.parametrize("normalizer", [0, 0.0, torch.tensor(0.0)], ids=["int", "float", "tensor"])
@pytest.mark.parametrize("case", list(_normalizer_cases("torch")))
@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_zero_normalizer_rule(backend, case, normalizer):
    loss_fn = _normalizer_cases(backend)[case]
    h, w, y = _head(seed=6)
    with pytest.raises(ValueError, match="normalizer"):
        loss_fn(h, w, y, normalizer)
    nothing = torch.full_like(y, -100)
    loss = loss_fn(h, w, nothing, normalizer)
    loss.backward()
    assert loss.item() == 0.0
    for grad in (h.grad, w.grad):
        assert grad is None or torch.count_nonzero(grad) == 0
    # a positive normalizer still divides the sum
    h2, w2, _ = _head(seed=6)
    positive = loss_fn(h2, w2, y, 4.0)
    assert math.isfinite(positive.item()) and positive.item() != 0.0
