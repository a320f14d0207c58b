"""ak.topk_distill_loss / ak.linear_topk_distill_loss against ``reference.topk_distill_loss``
and against verl's and Axolotl's top-k losses transcribed here; the comparisons with TRL's own
functions are in ``test_topk_distill_trl.py`` (they need the ``trl`` extra, these tests do not).
Values and gradients per element with the shared tolerance model: the expected code run in
float64 is the expected value, the same code run on float32 logits (values) or in the logits'
dtype (gradients) is the yardstick."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.kernels import matmul as head_matmul
from astrai_kernels.ops import head as head_op
from astrai_kernels.testing import assert_close, assert_head_gradient_close

from cases import assert_compiles_like_eager

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
VOCAB = 37  # not a power of two


def server_batch(dtype, k=5, shape=(2, 5, VOCAB), seed=0):
    """Student logits; the teacher's sorted top-k of another distribution, one position with
    fewer entries filled (-inf, id 0: as the server pads); labels with -100 on some rows."""
    g = torch.Generator().manual_seed(seed)
    *lead, vocab = shape
    logits = (torch.randn(*shape, generator=g) * 2).to(dtype)
    teacher_all = torch.log_softmax(torch.randn(*shape, generator=g) * 2, -1)
    top = teacher_all.topk(k, -1)
    ids, teacher = top.indices, top.values
    if k > 1:
        teacher[0, 1, k // 2:] = -math.inf
        ids[0, 1, k // 2:] = 0
    labels = torch.randint(0, vocab, tuple(lead), generator=g)
    labels[torch.rand(tuple(lead), generator=g) < 0.25] = -100
    labels[0, 0], labels[1, -1] = -100, 3
    return logits, ids, teacher, labels, teacher_all


def _support_rows(logits, ids, teacher, live, labels, temperature):
    """``(log_p, counted, live, index, s, t)`` in float64: the rows' tempered log-softmax, the
    counted rows, the live support entries (of counted rows), their ids (0 where dead) and the
    student's and teacher's log-probs there (-inf where dead)."""
    vocab, k = logits.shape[-1], ids.shape[-1]
    log_p = torch.log_softmax(logits.detach().double().reshape(-1, vocab) / temperature, -1)
    counted = (torch.ones(log_p.shape[0], dtype=torch.bool) if labels is None
               else labels.reshape(-1) != -100)
    live = live.reshape(-1, k) & counted.unsqueeze(1)
    index = torch.where(live, ids.reshape(-1, k), 0)
    s = torch.where(live, log_p.gather(1, index), -math.inf)
    t = torch.where(live, teacher.reshape(-1, k).double(), -math.inf)
    return log_p, counted, live, index, s, t


def _entry_terms(log_p, index, shares, full_softmax, counted, labels, logits, temperature,
                 reduction, weights):
    """Entry ``j`` of each row's gradient terms: ``|w| / T (sum_{id_k = j} C_k + p_j (1 +
    |log p_j|) sum_k C_k)`` (the ``p_j`` term where the loss reads the full softmax), ``C_k``
    the ``shares``, ``w`` the row's weight under ``reduction``."""
    terms = torch.zeros_like(log_p).scatter_add_(1, index, shares)
    if full_softmax:
        terms += log_p.exp() * (1 + log_p.abs()) * shares.sum(1, keepdim=True)
    if reduction == "none":
        row_weights = weights.reshape(-1).double()
    elif reduction == "sum":
        row_weights = weights.double().expand(log_p.shape[0])
    else:
        count = counted.sum().clamp(min=1) if labels is not None else logits.shape[0]
        row_weights = weights.double().expand(log_p.shape[0]) / count
    terms = row_weights.abs().unsqueeze(1) / temperature * terms * counted.unsqueeze(1)
    return terms.nan_to_num(0.0, 0.0, 0.0).reshape(logits.shape)


def grad_terms(logits, ids, teacher, live, labels, beta, tail, temperature, reduction,
               weights):
    """float64 sizes of the terms that form each entry of the logit gradient (the comparison's
    scale, as ``softmax_grad_scale``): per support entry ``k``, ``C_k`` sums the sizes of
    ``d loss / d a_k`` (``q``; ``p (1 + |a| + |b|)``; ``(1 - beta) p (1 + |a| + |log m|)``) and
    of the tail's share ``G_tail exp(s_k - tail)`` or the renormalisation's ``r_k sum G``;
    entry ``j`` gets ``|w| / T (sum_{id_k = j} C_k + p_j (1 + |log p_j|) sum_k C_k)``, the
    ``p_j`` term only with the tail (renormalised, ``sum_k c_k = 0``)."""
    log_p, counted, live, index, s, t = _support_rows(logits, ids, teacher, live, labels,
                                                      temperature)
    if tail:
        def with_tail(x):
            log_sum = torch.logsumexp(x, 1, keepdim=True).clamp(max=-1e-7)
            return torch.cat([x, torch.log(-torch.expm1(log_sum))], 1)
        a, b = with_tail(s), with_tail(t)
        student_tail = a[:, -1:]
        live_e = torch.cat([live, torch.ones_like(live[:, :1])], 1)
    else:
        a, b = s - torch.logsumexp(s, 1, keepdim=True), t - torch.logsumexp(t, 1, keepdim=True)
        live_e = live
    p, sizes = _divergence_sizes(a, b, live_e, beta)
    if tail:
        shares = sizes[:, :-1] + sizes[:, -1:] * torch.exp(s - student_tail)
    else:
        shares = sizes + p * sizes.sum(1, keepdim=True)
    return _entry_terms(log_p, index, torch.where(live, shares, 0.0), tail, counted, labels,
                        logits, temperature, reduction, weights)


def _divergence_sizes(a, b, live, beta):
    """``(p, sizes)``: the student's probabilities ``exp(a)`` and, per live entry, the size of
    ``d loss / d a`` of the generalized JSD with the teacher's log-probs ``b``: ``q`` at
    ``beta = 0``, ``p (1 + |a| + |b|)`` at 1, ``(1 - beta) p (1 + |a| + |log m|)`` between."""
    p, q = torch.where(live, a.exp(), 0.0), torch.where(live, b.exp(), 0.0)
    a_abs, b_abs = torch.where(live, a, 0.0).abs(), torch.where(live, b, 0.0).abs()
    if beta == 0:
        return p, q
    if beta == 1:
        return p, p * (1 + a_abs + b_abs)
    log_m = torch.where(live, torch.log((1 - beta) * p + beta * q), 0.0).abs()
    return p, (1 - beta) * p * (1 + a_abs + log_m)


def terms_of(logits, ids, teacher, live, labels, beta, tail, temperature,
             reduction="batchmean"):
    """:func:`grad_terms` of these inputs, given the upstream weights."""
    return functools.partial(grad_terms, logits, ids, teacher, live, labels, beta, tail,
                             temperature, reduction)


def check(ours, expected, logits, what, terms, upstream=0.7):
    """``ours(leaf)`` against ``expected(logits in a precision)``: the loss (yardstick: the
    expected code on float32 logits) and the gradient (yardstick: in the logits' dtype; scale:
    ``terms(weights)``, the sizes of the terms forming each entry)."""
    dtype = logits.dtype
    x = logits.detach().clone().requires_grad_(True)
    loss = ours(x)
    assert loss.dtype == torch.float32
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape) * upstream
    (loss * weights).sum().backward()
    results = {}
    for precision in {torch.float64, torch.float32, dtype}:
        xr = logits.detach().to(precision).requires_grad_(True)
        value = expected(xr)
        (value * weights.to(value.dtype)).sum().backward()
        results[precision] = (value.detach(), xr.grad)
    assert_close(loss, results[torch.float64][0], "value", dtype, f"{what} loss",
                 naive=results[torch.float32][0])
    assert_close(x.grad, results[torch.float64][1], "grad", dtype, f"{what} grad",
                 naive=results[dtype][1], scale=terms(weights))
    return loss, x.grad


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_tail_gradient_where_the_support_is_improbable(beta):
    """Rows whose student puts ~1e-16 on the support: the tail's share of the gradient,
    ``-exp(s_k) / (1 - sum exp s)``, is exact here (TRL's autograd forms ``exp(log sum)`` as
    ``expm1(log sum) + 1``: 0 in float32, 5% off in float64; the spec avoids it)."""
    logits, ids, teacher, labels, _ = server_batch(torch.float32, k=2, seed=17)
    off_support = (ids[..., :1] + 1) % VOCAB
    for row in ((0, 2), (1, 1), (1, 3)):
        logits[row][off_support[row]] = 40.0
        labels[row] = 1
    options = dict(beta=beta, temperature=1.0, tail=True)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, beta=beta),
          spec(ids, teacher, labels, None, options, "batchmean"), logits, "improbable",
          terms_of(logits, ids, teacher, teacher > -math.inf, labels, beta, True, 1.0))


def spec(ids, teacher, labels, mask, options, reduction):
    return lambda z: reference.topk_distill_loss(z, ids, teacher.to(z.dtype), labels,
                                                 support_mask=mask, reduction=reduction,
                                                 **options)


@pytest.mark.parametrize("with_labels", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
@pytest.mark.parametrize("tail", [True, False])
def test_matches_reference(tail, reduction, with_labels, monkeypatch):
    """Three rows per chunk (the last one partial), on a ``logits[:, :-1]`` view."""
    monkeypatch.setitem(head_op.CHUNK_BYTES, "cpu", 3 * 4 * VOCAB)
    logits, ids, teacher, labels, _ = server_batch(torch.float32, k=3, shape=(2, 6, VOCAB),
                                                   seed=7)
    ids, teacher, labels = ids[:, :-1], teacher[:, :-1], labels[:, :-1] if with_labels else None
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(8)) > 0.2
    options = dict(beta=0.3, temperature=0.9, tail=tail)
    view_terms = terms_of(logits[:, :-1], ids, teacher, mask & (teacher > -math.inf), labels,
                          0.3, tail, 0.9, reduction)

    def terms(weights):
        full = torch.zeros(logits.shape, dtype=torch.float64)
        full[:, :-1] = view_terms(weights)
        return full

    check(lambda x: ak.topk_distill_loss(x[:, :-1], ids, teacher, labels, support_mask=mask,
                                         reduction=reduction, **options),
          lambda z: spec(ids, teacher, labels, mask, options, reduction)(z[:, :-1]),
          logits, reduction, terms)
    with torch.no_grad():
        forward_only = ak.topk_distill_loss(logits[:, :-1], ids, teacher, labels,
                                            support_mask=mask, reduction=reduction, **options)
    expected = spec(ids, teacher, labels, mask, options, reduction)(logits[:, :-1].double())
    naive = spec(ids, teacher, labels, mask, options, reduction)(logits[:, :-1])
    assert_close(forward_only, expected, "value", torch.float32, "no-grad loss", naive=naive)


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("tail", [True, False])
def test_rows_not_counted_may_hold_anything(tail, reduction):
    logits, ids, teacher, labels, _ = server_batch(torch.float32, seed=9)
    ignored = labels == -100
    dirty = logits.clone()
    dirty[0, 0] = math.nan
    dirty[tuple(ignored.nonzero()[-1].tolist())] = math.inf
    dirty_teacher = torch.where(ignored.unsqueeze(-1), math.nan, teacher)
    x = dirty.requires_grad_(True)
    loss = ak.topk_distill_loss(x, ids, dirty_teacher, labels, beta=0.5, tail=tail,
                                reduction=reduction)
    loss.sum().backward()
    expected = reference.topk_distill_loss(logits.double(), ids, teacher.double(), labels, 0.5,
                                           1.0, tail, None, reduction)
    naive = reference.topk_distill_loss(logits, ids, teacher, labels, 0.5, 1.0, tail, None,
                                         reduction)
    assert_close(loss, expected, "value", torch.float32, "loss", naive=naive)
    assert torch.equal(x.grad[ignored], torch.zeros_like(x.grad[ignored]))
    assert torch.isfinite(x.grad).all()
    none_counted = torch.full_like(labels, -100)
    y = dirty.detach().requires_grad_(True)
    loss = ak.topk_distill_loss(y, ids, dirty_teacher, none_counted, tail=tail)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(y.grad, torch.zeros_like(y.grad))


NAN_OPTIONS = [dict(), dict(tail=False), dict(beta=0.5), dict(objective="verl_forward_kl"),
               dict(objective="verl_forward_kl", log_prob_min_clamp=None, loss_max_clamp=None),
               dict(objective="axolotl_kd", normalize_topk=True)]
NAN_IDS = ["fkl-tail", "fkl", "jsd-tail", "verl", "verl-unclamped", "axolotl-norm"]
NAN_ROW = (1, 2)


def _nan_teacher_batch():
    """:func:`server_batch` with a NaN teacher log-prob on a filled entry of a counted row."""
    logits, ids, teacher, labels, _ = server_batch(torch.float32, seed=23)
    labels[NAN_ROW] = 4
    poisoned = teacher.clone()
    poisoned[NAN_ROW + (1,)] = math.nan
    return logits, ids, teacher, poisoned, labels


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("options", NAN_OPTIONS, ids=NAN_IDS)
@pytest.mark.parametrize("backend", ["cpp", "torch", "triton", "reference"])
def test_a_nan_teacher_logprob_reaches_the_loss(backend, options, reduction):
    """Issue 45 item 4: a NaN teacher log-prob on an entry that counts makes its row's loss
    NaN (so the summed loss) and puts NaN in its row's gradient, on every backend, as torch's
    arithmetic (and ``distill_loss``) carries a NaN: it never vanishes as a -inf (a slot the
    server did not fill) does. The other rows are those of the call with that row not
    counted."""
    logits, ids, teacher, poisoned, labels = _nan_teacher_batch()
    x = logits.clone().requires_grad_(True)
    loss = ak.topk_distill_loss(x, ids, poisoned, labels, reduction=reduction, backend=backend,
                                **options)
    loss.sum().backward()
    skipped = labels.clone()
    skipped[NAN_ROW] = -100
    y = logits.clone().requires_grad_(True)
    expected = ak.topk_distill_loss(y, ids, teacher, skipped, reduction=reduction,
                                    backend=backend, **options)
    expected.sum().backward()
    others = torch.ones_like(labels, dtype=torch.bool)
    others[NAN_ROW] = False
    if reduction == "none":
        assert loss[NAN_ROW].isnan()
        torch.testing.assert_close(loss.detach()[others], expected.detach()[others])
    else:
        assert loss.isnan()
    assert x.grad[NAN_ROW].isnan().any()
    torch.testing.assert_close(x.grad[others], y.grad[others])


@pytest.mark.parametrize("options", NAN_OPTIONS, ids=NAN_IDS)
def test_a_nan_teacher_logprob_that_does_not_count_is_not_read(options):
    """Where the support mask drops the NaN's entry, or the labels its row, the loss is the
    one without it."""
    logits, ids, teacher, poisoned, labels = _nan_teacher_batch()
    dropped = torch.ones_like(ids, dtype=torch.bool)
    dropped[NAN_ROW + (1,)] = False
    skipped = labels.clone()
    skipped[NAN_ROW] = -100
    for keywords in (dict(labels=labels, support_mask=dropped), dict(labels=skipped)):
        loss = ak.topk_distill_loss(logits, ids, poisoned, **keywords, **options)
        clean = ak.topk_distill_loss(logits, ids, teacher, **keywords, **options)
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, clean)


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_linear_form_carries_a_nan_teacher_logprob(backend, reduction):
    """``linear_topk_distill_loss``: the NaN row's loss and the head's gradients are NaN (the
    row's hidden state, the weight), the other rows' hidden-state gradients finite."""
    h, w, b = _head(torch.float32, n_rows=10)
    _, ids, _, poisoned, labels = _nan_teacher_batch()
    leaves = [t.clone().requires_grad_(True) for t in (h, w, b)]
    loss = ak.linear_topk_distill_loss(leaves[0], leaves[1], ids, poisoned, labels,
                                       bias=leaves[2], reduction=reduction, chunk_size=4,
                                       backend=backend)
    loss.sum().backward()
    assert loss.sum().isnan() and (reduction == "batchmean" or loss[NAN_ROW].isnan())
    others = torch.ones_like(labels, dtype=torch.bool)
    others[NAN_ROW] = False
    grad_hidden = leaves[0].grad
    assert grad_hidden[NAN_ROW].isnan().any() and torch.isfinite(grad_hidden[others]).all()
    assert leaves[1].grad.isnan().any()


def test_reference_backend_routes_to_the_spec():
    logits, ids, teacher, labels, _ = server_batch(torch.float32, seed=10)
    x = logits.clone().requires_grad_(True)
    loss = ak.topk_distill_loss(x, ids, teacher, labels, beta=0.5, backend="reference")
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)  # plain autograd: twice
    assert grad.requires_grad
    expected = reference.topk_distill_loss(logits, ids, teacher, labels, 0.5)
    assert torch.equal(loss.detach(), expected)


def _head(dtype, n_rows=12, hidden=16, seed=11):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n_rows // 2, hidden, generator=g).to(dtype)
    w = (torch.randn(VOCAB, hidden, generator=g) * 0.5).to(dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.2).to(dtype)
    return h, w, b


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("tail", [True, False])
def test_linear_matches_logits_form(tail, reduction):
    """The fused head (chunks of 5 rows of 12) and the logits op on ``F.linear``, both per
    element against the float64 spec, the spec's float32 run as the yardstick."""
    h, w, b = _head(torch.float32)
    _, ids, teacher, labels, _ = server_batch(torch.float32, k=5, shape=(2, 6, VOCAB), seed=12)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(13)) > 0.2
    options = dict(beta=0.5, temperature=0.8, tail=tail, support_mask=mask, reduction=reduction)
    spec_options = (0.5, 0.8, tail, mask, reduction)
    leaves = [t.clone().requires_grad_(True) for t in (h, w, b)]
    loss = ak.linear_topk_distill_loss(leaves[0], leaves[1], ids, teacher, labels,
                                       bias=leaves[2], chunk_size=5, **options)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    runs = {}
    for name, precision, run in (
            ("expected", torch.float64, lambda z: reference.topk_distill_loss(
                z, ids, teacher.double(), labels, *spec_options)),
            ("naive", torch.float32, lambda z: reference.topk_distill_loss(
                z, ids, teacher, labels, *spec_options)),
            ("logits op", torch.float32, lambda z: ak.topk_distill_loss(
                z, ids, teacher, labels, **options))):
        refs = [t.detach().to(precision).requires_grad_(True) for t in (h, w, b)]
        value = run(F.linear(*refs[:2], refs[2]))
        (value * weights.to(precision)).sum().backward()
        runs[name] = (value.detach(), [r.grad for r in refs])
    (expected, expected_grads), (naive, naive_grads) = runs["expected"], runs["naive"]
    # an entry of a head gradient sums ~V or ~N logit-gradient entries times the other factor
    terms = grad_terms(F.linear(h.double(), w.double(), b.double()), ids, teacher,
                       mask & (teacher > -math.inf), labels, 0.5, tail, 0.8, reduction,
                       weights).reshape(-1, VOCAB)
    scales = (terms @ w.double().abs(), terms.t() @ h.double().abs().reshape(-1, h.shape[-1]),
              terms.sum(0))
    for form, (value, grads) in (("linear", (loss, [leaf.grad for leaf in leaves])),
                                 ("logits", runs["logits op"])):
        assert_close(value, expected, "value", torch.float32, f"{form} loss", naive=naive)
        for name, grad, want, naive_grad, scale in zip(("hidden", "weight", "bias"), grads,
                                                       expected_grads, naive_grads, scales):
            assert_close(grad, want, "grad", torch.float32, f"{form} {name}", naive=naive_grad,
                         scale=scale.reshape(want.shape))


@pytest.mark.parametrize("path", ["native", "float32"])
@pytest.mark.parametrize("tail", [True, False])
def test_linear_bf16_head_gradients(tail, path, monkeypatch):
    """bf16 head, both matmul paths, against the head yardstick (tests/test_head_precision)."""
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, path)
    h, w, b = _head(torch.bfloat16, n_rows=24, hidden=32, seed=14)
    _, ids, teacher, labels, _ = server_batch(torch.float32, k=4, shape=(2, 12, VOCAB),
                                              seed=15)
    options = dict(beta=0.5, temperature=0.9, tail=tail)
    ours = [t.clone().requires_grad_(True) for t in (h, w, b)]
    ak.linear_topk_distill_loss(*ours[:2], ids, teacher, labels, bias=ours[2], chunk_size=5,
                                reduction="sum", **options).backward()
    exact = [t.double().requires_grad_(True) for t in (h, w, b)]
    reference.topk_distill_loss(F.linear(*exact), ids, teacher.double(), labels,
                                reduction="sum", **options).backward()
    naive = [t.clone().requires_grad_(True) for t in (h, w, b)]
    logits = F.linear(*naive).float()
    logits.retain_grad()
    reference.topk_distill_loss(logits, ids, teacher, labels, reduction="sum",
                                **options).backward()
    grad_logits = logits.grad.to(torch.bfloat16).double().reshape(-1, VOCAB)
    unrounded = (grad_logits @ w.double(), grad_logits.t() @ h.double().reshape(-1, 32),
                 grad_logits.sum(0))
    for name, actual, want, naive_grad, naive_unrounded in zip(
            ("hidden", "weight", "bias"), ours, exact, naive, unrounded):
        assert actual.grad.dtype == torch.bfloat16
        assert_head_gradient_close(actual.grad, want.grad, naive_grad.grad,
                                   naive_unrounded.reshape(want.shape), name=f"{name} grad")


def test_linear_forward_only_and_reference_backend():
    h, w, b = _head(torch.float32)
    _, ids, teacher, labels, _ = server_batch(torch.float32, k=3, shape=(2, 6, VOCAB), seed=16)
    expected = reference.topk_distill_loss(F.linear(h, w, b).double(), ids, teacher.double(),
                                           labels, reduction="none")
    for backend in ("auto", "reference"):
        with torch.no_grad():
            loss = ak.linear_topk_distill_loss(h, w, ids, teacher, labels, bias=b,
                                               reduction="none", chunk_size=4, backend=backend)
        assert_close(loss, expected, "value", torch.float32, backend,
                     naive=reference.topk_distill_loss(F.linear(h, w, b), ids, teacher, labels,
                                                       reduction="none"))


LOGITS = torch.zeros(2, 3, 11)
IDS = torch.zeros(2, 3, 4, dtype=torch.long)
TEACHER = torch.full((2, 3, 4), -1.0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(support_ids=IDS.float()), TypeError, "support_ids must be int32 or int64"),
    (dict(support_ids=IDS[..., :0]), ValueError, "K >= 1"),
    (dict(support_ids=IDS[:1]), ValueError, "support_ids must have shape"),
    (dict(teacher_logprobs=TEACHER[..., :3]), ValueError, "teacher_logprobs must have"),
    (dict(teacher_logprobs=IDS), TypeError, "teacher_logprobs must be a float tensor"),
    (dict(support_mask=IDS), TypeError, "support_mask must be None or a bool tensor"),
    (dict(labels=torch.zeros(2, 4, dtype=torch.long)), ValueError, "labels must have shape"),
    (dict(support_ids=IDS + 11), ValueError, "support_ids holds 11, outside"),
    (dict(beta=1.5), ValueError, "beta must be"),
    (dict(temperature=0.0), ValueError, "temperature must be"),
    (dict(tail=1), TypeError, "tail must be a bool"),
    (dict(reduction="mean"), ValueError, "reduction must be one of"),
    (dict(backend="fast"), ValueError, "backend must be"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(student_logits=LOGITS, support_ids=IDS, teacher_logprobs=TEACHER)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ak.topk_distill_loss(args.pop("student_logits"), args.pop("support_ids"),
                             args.pop("teacher_logprobs"), **args)


def test_out_of_range_ids_are_fine_where_dropped():
    ids = IDS.clone()
    ids[..., 1] = -1
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[..., 1] = False
    loss = ak.topk_distill_loss(LOGITS, ids, TEACHER, support_mask=mask)
    assert_close(loss, reference.topk_distill_loss(LOGITS.double(), ids, TEACHER.double(),
                                                   support_mask=mask),
                 "value", torch.float32, "loss")


# --- verl's forward_kl_topk and Axolotl's KD top-k loss (objective=) -----------------------
#
# The two sources, transcribed (docs/objectives.md cites them):
# verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9
#   verl/workers/engine/fsdp/transformer_impl.py:1357 (logits / temperature),
#   verl/trainer/distillation/fsdp/losses.py:66-72 (kl_divergence), :122-130
#   (compute_forward_kl_topk, the F.log_softmax path), verl/trainer/distillation/losses.py:365
#   (clamp_min(0.0)), :258-260 (loss_max_clamp), verl/trainer/ppo/core_algos.py:1170-1175
#   (agg_loss "token-mean"), defaults verl/workers/config/distillation.py:69-70.
# axolotl-ai-cloud/axolotl @ 067b021c8b87a9e5e380b9173c704cf7340e30f5
#   src/axolotl/integrations/kd/kernels/liger.py:43-117 (distillation_loss_fn), :163
#   (logits / temperature), :355 (times temperature**2), src/axolotl/integrations/kd/utils.py:11-43
#   (normalize_logprobs), trainer.py:84-85, 118-119 (/ num_items_in_batch from the labels),
#   collator_online_teacher.py:232-236 (target_mask: the row's label != -100, all K entries).


def verl_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, labels,
                         temperature, log_prob_min_clamp, loss_max_clamp, reduction):
    """verl's forward_kl_topk, its lines in order (no top-k padding: verl has none)."""
    student_logits = student_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    student_topk_log_probs = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    teacher_topk_log_probs = teacher_topk_log_probs.to(student_log_probs.dtype)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    log_p, log_q = teacher_topk_log_probs, student_topk_log_probs
    p = log_p.exp()
    distillation_losses = (p * (log_p - log_q)).sum(dim=-1)
    distillation_losses = distillation_losses.clamp_min(0.0)
    if loss_max_clamp is not None:
        distillation_losses = distillation_losses.clamp(min=-loss_max_clamp,
                                                        max=loss_max_clamp)
    response_mask = labels != -100
    if reduction == "none":
        return distillation_losses * response_mask
    masked_sum = (distillation_losses * response_mask).sum()
    return masked_sum / response_mask.sum()  # token-mean, dp_size 1


def axolotl_normalize_logprobs(logprobs):
    """Axolotl's ``normalize_logprobs`` (utils.py:11-43), K entries given."""
    position_logprobs_lse = torch.logsumexp(logprobs, dim=-1, keepdim=True)
    probs = torch.exp(logprobs - position_logprobs_lse)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.log(probs)


def axolotl_kd_loss(student_logits, target_token_ids, target_logprobs, labels, temperature,
                    beta, normalize_topk, reduction):
    """Axolotl's ``distillation_loss_fn`` on the whole batch as one chunk, times ``T**2``,
    divided by ``num_items_in_batch`` (``batchmean``) or not (``sum``)."""
    target_mask = (labels != -100).unsqueeze(-1).expand(target_token_ids.shape)
    student_logits_temp_scaled = student_logits / temperature
    vocab, k = student_logits.shape[-1], target_token_ids.shape[-1]
    student_logits_temp_scaled = student_logits_temp_scaled.reshape(-1, vocab)
    target_token_ids = target_token_ids.reshape(-1, k)
    target_logprobs = target_logprobs.reshape(-1, k)
    target_logprobs = target_logprobs.to(student_logits_temp_scaled.dtype)
    student_logits_topk = torch.gather(student_logits_temp_scaled, dim=-1, index=target_token_ids)
    student_lse = torch.logsumexp(student_logits_temp_scaled, dim=-1, keepdim=True)
    student_logprobs_topk = student_logits_topk - student_lse
    if normalize_topk:
        student_logprobs_topk = axolotl_normalize_logprobs(student_logprobs_topk)
    valid_mask = target_mask.reshape(-1, k).to(torch.bool)
    student_logprobs_topk_valid = student_logprobs_topk[valid_mask]
    teacher_logprobs_valid = target_logprobs[valid_mask]
    teacher_probs_valid = teacher_logprobs_valid.exp()
    student_probs_topk_valid = student_logprobs_topk_valid.exp()
    if beta == 0.0:
        kd_loss = (teacher_probs_valid
                   * (teacher_logprobs_valid - student_logprobs_topk_valid)).sum()
    elif beta == 1.0:
        kd_loss = (student_probs_topk_valid
                   * (student_logprobs_topk_valid - teacher_logprobs_valid)).sum()
    else:
        mean_probs = (1 - beta) * student_probs_topk_valid + beta * teacher_probs_valid
        log_mean_probs = mean_probs.log()
        student_kl = F.kl_div(log_mean_probs, student_logprobs_topk_valid, reduction="sum",
                              log_target=True)
        teacher_kl = F.kl_div(log_mean_probs, teacher_logprobs_valid, reduction="sum",
                              log_target=True)
        kd_loss = beta * teacher_kl + (1 - beta) * student_kl
    kd_loss = kd_loss * temperature ** 2
    if reduction == "sum":
        return kd_loss
    return kd_loss / (labels != -100).sum()


def objective_grad_terms(logits, ids, teacher, live, labels, options, reduction, weights):
    """:func:`grad_terms` for ``verl_forward_kl`` and ``axolotl_kd``: per support entry the
    size of ``c_k`` (verl: ``q_k``; Axolotl: TRL's sizes times ``T**2``, plus the
    renormalisation's share with ``normalize_topk``), entry ``j`` of the row's gradient
    ``|w| / T (sum_{id_k = j} C_k + p_j (1 + |log p_j|) sum_k C_k)`` (the ``p_j`` term where
    the loss reads the full softmax)."""
    temperature, beta = options.get("temperature", 1.0), options.get("beta", 0.0)
    log_p, counted, live, index, s, t = _support_rows(logits, ids, teacher, live, labels,
                                                      temperature)
    full = True
    if options["objective"] == "verl_forward_kl":
        low = options.get("log_prob_min_clamp", -10.0)
        shares = torch.exp(t if low is None else t.clamp_min(low))
    else:
        full = not options.get("normalize_topk", False)
        a = s if full else s - torch.logsumexp(s, 1, keepdim=True)
        p, sizes = _divergence_sizes(a, t, live, beta)
        shares = (sizes if full else sizes + p * sizes.sum(1, keepdim=True)) * temperature ** 2
    return _entry_terms(log_p, index, torch.where(live, shares, 0.0).nan_to_num(0.0, 0.0, 0.0),
                        full, counted, labels, logits, temperature, reduction, weights)


def objective_live(teacher, mask, options):
    """The entries that count: verl's clamp keeps a -inf teacher entry (at the clamp)."""
    if (options["objective"] == "verl_forward_kl"
            and options.get("log_prob_min_clamp", -10.0) is not None):
        live = ~teacher.isnan()
    else:
        live = teacher > -math.inf
    return live if mask is None else live & mask


def source_batch(dtype, seed, k=5, shape=(2, 5, VOCAB)):
    """:func:`server_batch` with the partly filled position's padding (id 0) given the
    teacher's real log-prob there (a finite support, as the sources require, whose id 0 may
    repeat), two rows pushed far from the teacher (student log-probs under -10) and one
    whose top-k KL is negative."""
    logits, ids, teacher, labels, teacher_all = server_batch(dtype, k=k, shape=shape,
                                                             seed=seed)
    teacher = torch.where(teacher > -math.inf, teacher, teacher_all.gather(-1, ids))
    logits = logits.float()
    logits[0, 3] *= 6
    logits[1, 2] *= 4
    # the teacher renormalised over its top-k (and next to nothing off it): KL < 0
    logits[1, 0] = -20.0
    logits[1, 0, ids[1, 0]] = teacher[1, 0]
    labels[1, 0] = 3
    return logits.to(dtype), ids, teacher, labels, teacher_all


VERL_CLAMPS = [(-10.0, 10.0), (None, None), (-3.0, 0.3)]


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("clamps", VERL_CLAMPS, ids=["default", "off", "tight"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_verl_forward_kl_matches_verl(dtype, temperature, clamps, reduction):
    logits, ids, teacher, labels, _ = source_batch(dtype, seed=20)
    low, high = clamps
    options = dict(objective="verl_forward_kl", temperature=temperature,
                   log_prob_min_clamp=low, loss_max_clamp=high)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, reduction=reduction,
                                         **options),
          lambda z: verl_forward_kl_topk(z, teacher.to(z.dtype), ids, labels, temperature,
                                         low, high, reduction),
          logits, f"verl {clamps}",
          functools.partial(objective_grad_terms, logits, ids, teacher,
                            objective_live(teacher, None, options), labels, options,
                            reduction))


def test_verl_clamps_bind():
    """The batch of the test above reaches every branch: student log-probs under the clamp,
    rows below 0 and above ``loss_max_clamp``."""
    logits, ids, teacher, labels, _ = source_batch(torch.float32, seed=20)
    student = torch.log_softmax(logits, -1).gather(-1, ids)
    kl = (teacher.exp() * (teacher - student.clamp_min(-3.0))).sum(-1)
    assert bool((student < -10).any()) and bool((kl < 0).any()) and bool((kl > 0.3).any())


@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("normalize_topk", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_axolotl_kd_matches_axolotl(dtype, normalize_topk, beta, temperature, reduction):
    logits, ids, teacher, labels, _ = source_batch(dtype, seed=21)
    if normalize_topk:  # as the collator serves them with kd_normalize_topk
        teacher = axolotl_normalize_logprobs(teacher)
    options = dict(objective="axolotl_kd", beta=beta, temperature=temperature,
                   normalize_topk=normalize_topk)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, reduction=reduction,
                                         **options),
          lambda z: axolotl_kd_loss(z, ids, teacher.to(z.dtype), labels, temperature, beta,
                                    normalize_topk, reduction),
          logits, f"axolotl {reduction}",
          functools.partial(objective_grad_terms, logits, ids, teacher,
                            objective_live(teacher, None, options), labels, options,
                            reduction))


@pytest.mark.parametrize("broken", ["verl renormalised student", "verl no clamp_min(0)",
                                    "axolotl renormalised teacher", "axolotl without T**2",
                                    "axolotl student not renormalised"])
def test_broken_variants_fail(broken):
    """The comparisons above catch a variant that departs from the source in one step."""
    logits, ids, teacher, labels, _ = source_batch(torch.float32, seed=22)
    if broken.startswith("verl"):
        options = dict(objective="verl_forward_kl", temperature=0.7)

        def variant(z):
            z = z / 0.7
            s = torch.log_softmax(z, -1).gather(-1, ids)
            if broken == "verl renormalised student":
                s = s - torch.logsumexp(s, -1, keepdim=True)
            t = teacher.to(z.dtype).clamp_min(-10.0)
            kl = (t.exp() * (t - s.clamp_min(-10.0))).sum(-1)
            if broken != "verl no clamp_min(0)":
                kl = kl.clamp_min(0.0)
            kl = kl.clamp(max=10.0)
            mask = labels != -100
            return (kl * mask).sum() / mask.sum()
    else:
        normalize = broken != "axolotl renormalised teacher"
        options = dict(objective="axolotl_kd", temperature=2.0, normalize_topk=normalize)

        def variant(z):
            t = teacher.to(z.dtype)
            if broken == "axolotl renormalised teacher":
                t = axolotl_normalize_logprobs(t)
            loss = axolotl_kd_loss(z, ids, t, labels, 2.0, 0.0,
                                   broken == "axolotl without T**2", "batchmean")
            return loss / 4.0 if broken == "axolotl without T**2" else loss
    terms = functools.partial(objective_grad_terms, logits, ids, teacher,
                              objective_live(teacher, None, options), labels, options,
                              "batchmean")
    with pytest.raises(AssertionError):
        check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, **options), variant,
              logits, broken, terms)


OBJECTIVE_OPTIONS = [
    dict(objective="verl_forward_kl", temperature=0.9),
    dict(objective="verl_forward_kl", temperature=0.9, log_prob_min_clamp=-2.5,
         loss_max_clamp=0.4),
    dict(objective="verl_forward_kl", log_prob_min_clamp=None, loss_max_clamp=None),
    dict(objective="axolotl_kd", temperature=0.9, beta=0.3),
    dict(objective="axolotl_kd", temperature=1.5, normalize_topk=True),
    dict(objective="axolotl_kd", temperature=0.9, beta=1.0, normalize_topk=True),
]
OBJECTIVE_IDS = ["verl", "verl-tight", "verl-off", "axolotl-jsd", "axolotl-norm",
                 "axolotl-rkl-norm"]


def objective_spec(ids, teacher, labels, mask, options, reduction):
    options = dict(options)
    beta, temperature = options.pop("beta", 0.0), options.pop("temperature", 1.0)
    return lambda z: reference.topk_distill_loss(z, ids, teacher.to(z.dtype), labels, beta,
                                                 temperature, True, mask, reduction, **options)


@pytest.mark.parametrize("with_labels", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
@pytest.mark.parametrize("options", OBJECTIVE_OPTIONS, ids=OBJECTIVE_IDS)
def test_objectives_match_reference(options, reduction, with_labels, monkeypatch):
    """Per element against the float64 spec: three rows per chunk on a ``logits[:, :-1]``
    view, a support mask, -inf teacher entries (dropped; counted at the clamp by verl's) and
    duplicate ids (the server's padding at id 0), ignored rows."""
    monkeypatch.setitem(head_op.CHUNK_BYTES, "cpu", 3 * 4 * VOCAB)
    logits, ids, teacher, labels, _ = server_batch(torch.float32, k=4, shape=(2, 6, VOCAB),
                                                   seed=23)
    logits[0, 2] *= 5
    ids[1, 3, 2] = ids[1, 3, 0]  # a duplicate with a finite teacher entry
    ids, teacher, labels = ids[:, :-1], teacher[:, :-1], labels[:, :-1] if with_labels else None
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(24)) > 0.2
    live = objective_live(teacher, mask, options)
    view_terms = functools.partial(objective_grad_terms, logits[:, :-1], ids, teacher, live,
                                   labels, options, reduction)

    def terms(weights):
        full = torch.zeros(logits.shape, dtype=torch.float64)
        full[:, :-1] = view_terms(weights)
        return full

    spec_run = objective_spec(ids, teacher, labels, mask, options, reduction)
    check(lambda x: ak.topk_distill_loss(x[:, :-1], ids, teacher, labels, support_mask=mask,
                                         reduction=reduction, **options),
          lambda z: spec_run(z[:, :-1]), logits, reduction, terms)
    with torch.no_grad():
        forward_only = ak.topk_distill_loss(logits[:, :-1], ids, teacher, labels,
                                            support_mask=mask, reduction=reduction, **options)
    assert_close(forward_only, spec_run(logits[:, :-1].double()), "value", torch.float32,
                 "no-grad loss", naive=spec_run(logits[:, :-1]))
    routed = ak.topk_distill_loss(logits[:, :-1], ids, teacher, labels, support_mask=mask,
                                  reduction=reduction, backend="reference", **options)
    assert torch.equal(routed, spec_run(logits[:, :-1]))


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("options", OBJECTIVE_OPTIONS[:2] + OBJECTIVE_OPTIONS[3:5],
                         ids=OBJECTIVE_IDS[:2] + OBJECTIVE_IDS[3:5])
def test_objectives_linear_matches_reference(options, reduction):
    """The fused head (chunks of 5 rows of 12) and the logits op on ``F.linear`` against the
    float64 spec, the spec's float32 run as the yardstick."""
    h, w, b = _head(torch.float32)
    _, ids, teacher, labels, _ = server_batch(torch.float32, k=5, shape=(2, 6, VOCAB), seed=25)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(26)) > 0.2
    leaves = [t.clone().requires_grad_(True) for t in (h, w, b)]
    loss = ak.linear_topk_distill_loss(leaves[0], leaves[1], ids, teacher, labels,
                                       bias=leaves[2], chunk_size=5, support_mask=mask,
                                       reduction=reduction, **options)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    runs = {}
    for name, precision, run in (
            ("expected", torch.float64, objective_spec(ids, teacher, labels, mask, options,
                                                       reduction)),
            ("naive", torch.float32, objective_spec(ids, teacher, labels, mask, options,
                                                    reduction)),
            ("logits op", torch.float32, lambda z: ak.topk_distill_loss(
                z, ids, teacher, labels, support_mask=mask, reduction=reduction, **options))):
        refs = [t.detach().to(precision).requires_grad_(True) for t in (h, w, b)]
        value = run(F.linear(*refs[:2], refs[2]))
        (value * weights.to(precision)).sum().backward()
        runs[name] = (value.detach(), [r.grad for r in refs])
    (expected, expected_grads), (naive, naive_grads) = runs["expected"], runs["naive"]
    terms = objective_grad_terms(F.linear(h.double(), w.double(), b.double()), ids, teacher,
                                 objective_live(teacher, mask, options), labels, options,
                                 reduction, weights).reshape(-1, VOCAB)
    scales = (terms @ w.double().abs(), terms.t() @ h.double().abs().reshape(-1, h.shape[-1]),
              terms.sum(0))
    for form, (value, grads) in (("linear", (loss, [leaf.grad for leaf in leaves])),
                                 ("logits", runs["logits op"])):
        assert_close(value, expected, "value", torch.float32, f"{form} loss", naive=naive)
        for name, grad, want, naive_grad, scale in zip(("hidden", "weight", "bias"), grads,
                                                       expected_grads, naive_grads, scales):
            assert_close(grad, want, "grad", torch.float32, f"{form} {name}", naive=naive_grad,
                         scale=scale.reshape(want.shape))


def test_axolotl_normalized_forward_kl_is_trl_renormalised():
    """With a teacher already renormalised over the support (Axolotl's pipeline), Axolotl's
    normalised forward KL at T = 1 is TRL's ``tail=False`` loss."""
    logits, ids, teacher, labels, _ = source_batch(torch.float32, seed=27)
    teacher = axolotl_normalize_logprobs(teacher)
    ours = ak.topk_distill_loss(logits, ids, teacher, labels, objective="axolotl_kd",
                                normalize_topk=True, reduction="none")
    trl = ak.topk_distill_loss(logits, ids, teacher, labels, tail=False, reduction="none")
    torch.testing.assert_close(ours, trl)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(objective="kl"), ValueError, "objective must be one of"),
    (dict(objective="verl_forward_kl", tail=True), ValueError, "tail applies only to"),
    (dict(objective="axolotl_kd", tail=False), ValueError, "tail applies only to"),
    (dict(normalize_topk=True), ValueError, "normalize_topk applies only to"),
    (dict(objective="axolotl_kd", normalize_topk=1), TypeError, "normalize_topk must be a bool"),
    (dict(log_prob_min_clamp=-5.0), ValueError, "log_prob_min_clamp applies only to"),
    (dict(objective="axolotl_kd", loss_max_clamp=None), ValueError,
     "loss_max_clamp applies only to"),
    (dict(objective="verl_forward_kl", beta=0.5), ValueError, "beta must be 0 with"),
    (dict(objective="verl_forward_kl", loss_max_clamp=-1.0), ValueError,
     "loss_max_clamp must be"),
    (dict(objective="verl_forward_kl", log_prob_min_clamp=math.nan), ValueError,
     "log_prob_min_clamp must be"),
    (dict(objective="verl_forward_kl", log_prob_min_clamp="-10"), TypeError,
     "log_prob_min_clamp must be a real number"),
])
def test_bad_objective_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ak.topk_distill_loss(LOGITS, IDS, TEACHER, **kwargs)
    with pytest.raises(error, match=match):
        ak.linear_topk_distill_loss(torch.zeros(2, 3, 5), torch.zeros(11, 5), IDS, TEACHER,
                                    **kwargs)


# The cpp backend's kernel (csrc/topk_distill.cpp), asked for by name, per element against the
# float64 spec for every objective and setting.
CPP_OPTIONS = [
    dict(beta=0.0, tail=True), dict(beta=0.0, tail=False), dict(beta=0.4, tail=True),
    dict(beta=0.4, tail=False), dict(beta=1.0, tail=True, temperature=0.8),
    dict(beta=1.0, tail=False, temperature=1.3), *OBJECTIVE_OPTIONS,
]
CPP_IDS = ["fkl-tail", "fkl", "jsd-tail", "jsd", "rkl-tail", "rkl", *OBJECTIVE_IDS]
# (lead shape, V, K, vocabulary stride 1): V not a power of 2; V < K (ids repeat); one row;
# V over the online pass's 2048-element blocks with a row far from the others; a transposed
# (strided) vocabulary
CPP_SHAPES = {"v37": ((2, 5), 37, 5, True), "v_below_k": ((3, 2), 3, 6, True),
              "one_row": ((1,), 37, 4, True), "v5000": ((4,), 5000, 9, True),
              "strided": ((6,), 41, 5, False)}


def cpp_batch(dtype, shape, seed):
    """Logits (one row scaled by 8), random ids with a duplicate per row (all repeat when V <
    K), the teacher's log-probs of another distribution there with a -inf entry, a support
    mask, labels with -100 on a row (none with one row)."""
    lead, vocab, k, unit_stride = CPP_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, vocab, generator=g) * 2
    logits.view(-1, vocab)[-1] *= 8
    if not unit_stride:
        logits = logits.reshape(-1, vocab).t().contiguous().t().reshape(*lead, vocab)
    ids = torch.randint(0, vocab, (*lead, k), generator=g)
    ids[..., -1] = ids[..., 0]
    teacher_all = torch.log_softmax(torch.randn(*lead, vocab, generator=g) * 2, -1)
    teacher = teacher_all.gather(-1, ids)
    teacher.view(-1, k)[0, 1] = -math.inf
    mask = torch.rand(ids.shape, generator=g) > 0.15
    labels = torch.randint(0, vocab, tuple(lead), generator=g)
    if labels.numel() > 1:
        labels.view(-1)[1] = -100
    logits = logits.to(dtype)
    assert logits.stride(-1) == 1 or not unit_stride
    return logits, ids, teacher, mask, labels


def cpp_terms(logits, ids, teacher, mask, labels, options, reduction):
    if options.get("objective", "trl_jsd") == "trl_jsd":
        return terms_of(logits, ids, teacher, mask & (teacher > -math.inf), labels,
                        options["beta"], options["tail"], options.get("temperature", 1.0),
                        reduction)
    return functools.partial(objective_grad_terms, logits, ids, teacher,
                             objective_live(teacher, mask, options), labels, options, reduction)


def cpp_spec(ids, teacher, labels, mask, options, reduction):
    return lambda z: reference.topk_distill_loss(z, ids, teacher.to(z.dtype), labels,
                                                 support_mask=mask, reduction=reduction,
                                                 **options)


@pytest.fixture
def cpp_kernel_calls(monkeypatch):
    """The cpp backend's topk_distill_forward, counted (the test then knows it served)."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend

    reason = cpp_backend.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"the cpp backend is unavailable: {reason}")
    calls = []
    kernel = cpp_backend.topk_distill_forward

    def counted(*args):
        calls.append(args[-1] is not None)
        return kernel(*args)

    monkeypatch.setattr(cpp_backend, "topk_distill_forward", counted)
    return calls


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
@pytest.mark.parametrize("shape", sorted(CPP_SHAPES))
@pytest.mark.parametrize("options", CPP_OPTIONS, ids=CPP_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpp_kernel_matches_reference(dtype, options, shape, reduction, cpp_kernel_calls):
    logits, ids, teacher, mask, labels = cpp_batch(dtype, shape, seed=31)
    spec_run = cpp_spec(ids, teacher, labels, mask, options, reduction)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, support_mask=mask,
                                         reduction=reduction, backend="cpp", **options),
          spec_run, logits, f"cpp {shape}",
          cpp_terms(logits, ids, teacher, mask, labels, options, reduction))
    # a scalar reduction's gradient is the kernel's; "none" keeps the torch backward
    assert cpp_kernel_calls == [reduction != "none"]
    with torch.no_grad():
        forward_only = ak.topk_distill_loss(logits, ids, teacher, labels, support_mask=mask,
                                            reduction=reduction, backend="cpp", **options)
    assert cpp_kernel_calls[1:] == [False]
    assert_close(forward_only, spec_run(logits.double()), "value", dtype, "cpp no-grad loss",
                 naive=spec_run(logits.float()))


@pytest.mark.parametrize("options", CPP_OPTIONS, ids=CPP_IDS)
def test_cpp_kernel_rows_not_counted_are_not_read(options, cpp_kernel_calls):
    """Rows whose label is -100 may hold inf / NaN: loss and gradient 0 there, the other rows
    as without them; the kernel's row stats feed the torch backward of ``reduction="none"``."""
    logits, ids, teacher, mask, labels = cpp_batch(torch.float32, "v37", seed=5)
    labels[0, 2] = -100
    poisoned = logits.clone()
    poisoned[0, 2, 3], poisoned[0, 2, 4] = math.inf, math.nan
    for reduction in ("sum", "none"):
        grads = []
        for x in (logits, poisoned):
            x = x.clone().requires_grad_(True)
            loss = ak.topk_distill_loss(x, ids, teacher, labels, support_mask=mask,
                                        reduction=reduction, backend="cpp", **options)
            loss.sum().backward()
            assert torch.isfinite(loss).all()
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1])
        assert torch.equal(grads[1][0, 2], torch.zeros_like(grads[1][0, 2]))


def test_cpp_kernel_is_the_auto_route_on_cpu(cpp_kernel_calls, monkeypatch):
    logits, ids, teacher, mask, labels = cpp_batch(torch.float32, "v37", seed=3)
    ak.topk_distill_loss(logits, ids, teacher, labels)
    assert cpp_kernel_calls == [False]
    ak.topk_distill_loss(logits, ids, teacher, labels, backend="torch")
    monkeypatch.setenv("ASTRAI_KERNELS_BACKEND", "torch")
    ak.topk_distill_loss(logits, ids, teacher, labels)
    assert cpp_kernel_calls == [False]


def test_cpp_kernel_is_an_optional_primitive():
    """cpp implements ``topk_distill_forward`` with the protocol's signature; the torch and
    triton backends lack it (the op's chunked torch passes serve them); the tail clamp of the
    kernel is the spec's."""
    import inspect

    from astrai_kernels.kernels import portable
    from astrai_kernels.kernels.cpp import backend as cpp_backend
    from astrai_kernels.kernels.primitives import TOPK_DISTILL_PRIMITIVES, TopkDistillBackend
    from astrai_kernels.kernels.triton import backend as triton_backend

    declared = TOPK_DISTILL_PRIMITIVES["topk_distill_forward"]
    protocol = list(inspect.signature(TopkDistillBackend.topk_distill_forward).parameters)[1:]
    assert [name for name, _ in declared.tensors] + ["params", "grad"] == protocol
    assert list(inspect.signature(cpp_backend.topk_distill_forward).parameters) == protocol
    assert isinstance(cpp_backend, TopkDistillBackend)
    for module in (portable, triton_backend):
        assert not isinstance(module, TopkDistillBackend)
    if cpp_backend.unavailable_reason("cpu") is None:
        assert (cpp_backend.load_extension().TOPK_TAIL_LOG_SUM_MAX
                == torch.tensor(reference.TOPK_TAIL_LOG_SUM_MAX, dtype=torch.float32).item())


def test_cpp_kernel_refuses_a_live_id_out_of_range():
    """The primitive itself never reads outside the row (the op checks the ids before)."""
    from astrai_kernels.kernels.cpp import backend as cpp_backend
    from astrai_kernels.kernels.primitives import TopkDistillArgs

    if cpp_backend.unavailable_reason("cpu") is not None:
        pytest.skip("the cpp backend is unavailable")
    logits = torch.randn(1, 2, 7)
    ids = torch.tensor([[1, 7], [0, 2]])
    live = torch.tensor([[True, True], [True, False]])
    args = TopkDistillArgs(0.0, 1.0, True, "trl_jsd", False, None, None)
    with pytest.raises(ValueError, match="row 0 has live id 7"):
        cpp_backend.topk_distill_forward(logits, ids, torch.zeros(2, 2), live,
                                         torch.ones(2, dtype=torch.bool), None, args, None)


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("objective, keywords", [
    ("trl_jsd", {"beta": 0.3}), ("trl_jsd", {"beta": 0.0, "tail": False}),
    ("verl_forward_kl", {}), ("axolotl_kd", {"normalize_topk": False})],
    ids=["trl_jsd-tail", "trl_jsd-no_tail", "verl_forward_kl", "axolotl_kd"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_torch_compile_fullgraph(backend, objective, keywords, reduction):
    """``torch.compile(fullgraph=True)`` traces the op: its id check is a device assert there,
    and the cpp kernel is a custom op (``kernels/library.py``'s ``optional_primitive_op``, its
    fake stating ``coef [N, K]``). Values and gradients equal the eager call's."""
    g = torch.Generator().manual_seed(21)
    vocab, k = 37, 5
    logits = torch.randn(2, 3, vocab, generator=g) * 2.0
    ids = torch.randint(0, vocab, (2, 3, k), generator=g)
    teacher = torch.log_softmax(torch.randn(2, 3, k, generator=g), -1)
    teacher[0, 1, 2] = -math.inf  # a slot the server did not fill
    labels = torch.tensor([[1, 2, -100], [3, 4, 5]])

    def step(x):
        loss = ak.topk_distill_loss(x, ids, teacher, labels, objective=objective,
                                    reduction=reduction, backend=backend, **keywords)
        return loss.sum() if reduction == "none" else loss

    assert_compiles_like_eager(step, logits)


def test_torch_compile_refuses_an_id_out_of_range_at_run_time():
    """Traced, the check of the ids that count cannot raise a ``ValueError`` before the graph
    runs; the device assert it becomes stops the call."""
    logits = torch.randn(4, 11)
    ids = torch.tensor([[0, 3], [1, 11], [2, 4], [5, 6]])
    teacher = torch.log_softmax(torch.randn(4, 2), -1)
    step = torch.compile(lambda x: ak.topk_distill_loss(x, ids, teacher, backend="torch"),
                         fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="support_ids holds values outside"):
        step(logits)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_linear_form_compiles_fullgraph(backend):
    """``linear_topk_distill_loss`` traced whole (its chunk walk included): values and the
    head's gradients equal the eager call's."""
    g = torch.Generator().manual_seed(22)
    vocab, k, hidden_size = 29, 4, 8
    hidden, weight = torch.randn(2, 3, hidden_size, generator=g), torch.randn(vocab, hidden_size,
                                                                              generator=g)
    ids = torch.randint(0, vocab, (2, 3, k), generator=g)
    teacher = torch.log_softmax(torch.randn(2, 3, k, generator=g), -1)

    def step(h, w):
        return ak.linear_topk_distill_loss(h, w, ids, teacher, beta=0.3, chunk_size=2,
                                           backend=backend)

    assert_compiles_like_eager(step, hidden, weight)
