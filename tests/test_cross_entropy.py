import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close

from cases import (
    CASE_NAMES,
    COMPILE_BACKENDS,
    DTYPE_IDS,
    DTYPES,
    KERNEL_BACKENDS,
    compile_device,
    leaf,
    make_case,
    reference_and_naive,
    reference_leaf,
    spec_cross_entropy,
    view_terms,
)

BACKENDS = KERNEL_BACKENDS + ["reference"]


def _torch_cross_entropy(logits, target, ignore_index, reduction, label_smoothing):
    """``F.cross_entropy`` on flattened rows, with the all-ignored mean defined as 0."""
    z = logits.reshape(-1, logits.shape[-1])
    y = target.reshape(-1).long()
    out = F.cross_entropy(z, y, ignore_index=ignore_index, reduction=reduction,
                          label_smoothing=label_smoothing)
    if reduction == "none":
        return out.reshape(target.shape)
    if reduction == "mean" and not bool((y != ignore_index).any()):
        return z.sum() * 0.0
    return out


def _upstream(loss, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(loss.shape, generator=g) + 0.5


def _check_loss_and_grad(loss, x, case, dtype, reference_loss, reduction, label_smoothing=0.0,
                         z_loss=0.0, softcap=None, ignore_index=-100, logit_scale=1.0):
    """``loss`` and the gradient of ``sum(loss * upstream)`` in ``x.grad`` against
    ``reference_loss(logits)`` in float64, per element (naive path and terms as yardstick)."""
    upstream = _upstream(loss)
    (loss * upstream).sum().backward()

    def run(xr):
        out = reference_loss(case.view(xr))
        (out * upstream.to(xr.dtype)).sum().backward()
        return {"loss": out}

    expected, naive = reference_and_naive(run, case.base)
    assert loss.shape == expected["loss"].shape
    assert_close(loss, expected["loss"], "value", dtype, "loss", naive=naive["loss"])
    target = case.target.reshape(-1)
    valid = target != ignore_index
    if reduction == "none":
        row_scale = upstream.reshape(-1)
    elif reduction == "sum":
        row_scale = upstream.expand(target.shape)
    else:
        row_scale = upstream.expand(target.shape) / max(int(valid.sum()), 1)
    terms = spec_cross_entropy(case.view(case.base), target, ignore_index, label_smoothing,
                               z_loss, softcap or 0.0, row_scale,
                               logit_scale=logit_scale)["grad_terms"]
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected["grad"], "grad", dtype, "grad", naive=naive["grad"],
                 scale=view_terms(case, terms))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_cross_entropy(backend, name, dtype):
    case = make_case(name, dtype)
    x = leaf(case.base)
    before = case.base.clone()
    # Smoothing spreads mass onto every class: with -inf logits the loss is inf by definition.
    smoothing = 0.0 if name == "neg_inf_off_target" else 0.1
    loss = ak.cross_entropy(case.view(x), case.target, ignore_index=case.ignore_index,
                            label_smoothing=smoothing, backend=backend)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert torch.isfinite(loss)
    _check_loss_and_grad(loss, x, case, dtype, lambda z: _torch_cross_entropy(
        z, case.target, case.ignore_index, "mean", smoothing), "mean", smoothing,
        ignore_index=case.ignore_index)
    assert torch.equal(x.detach(), before), "cross_entropy modified its input"


@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_reductions(backend, dtype, reduction, label_smoothing):
    case = make_case("shifted", dtype)
    x = leaf(case.base)
    loss = ak.cross_entropy(case.view(x), case.target, reduction=reduction,
                            label_smoothing=label_smoothing, backend=backend)
    _check_loss_and_grad(loss, x, case, dtype, lambda z: _torch_cross_entropy(
        z, case.target, -100, reduction, label_smoothing), reduction, label_smoothing)


FEATURES = [
    dict(z_loss=1e-2),
    dict(softcap=3.0),
    dict(softcap=3.0, label_smoothing=0.1),
    dict(z_loss=1e-3, softcap=5.0, label_smoothing=0.2),
    dict(label_smoothing=1.0),
]


def _feature_id(features):
    return "-".join(f"{k}={v}" for k, v in features.items())


@pytest.mark.parametrize("features", FEATURES, ids=_feature_id)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_z_loss_and_softcap_match_reference(backend, dtype, reduction, features):
    case = make_case("3d", dtype)
    x = leaf(case.base)
    loss = ak.cross_entropy(x, case.target, reduction=reduction, backend=backend, **features)
    _check_loss_and_grad(loss, x, case, dtype, lambda z: reference.cross_entropy(
        z, case.target, reduction=reduction, **features), reduction, **features)


SCALED = [
    dict(logit_scale=0.5),
    dict(logit_scale=2.0, label_smoothing=0.1),
    dict(logit_scale=-1.0, z_loss=1e-3, label_smoothing=0.2),
    dict(logit_scale=2.0, softcap=5.0),
    dict(logit_scale=-1.0, softcap=3.0, label_smoothing=0.1),
    dict(logit_scale=0.5, softcap=5.0, z_loss=1e-3, label_smoothing=0.2),
]


@pytest.mark.parametrize("features", SCALED, ids=_feature_id)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logit_scale_matches_reference(backend, dtype, reduction, features):
    """``logit_scale`` multiplies the logits before the soft cap; the gradient carries it."""
    case = make_case("shifted", dtype)
    x = leaf(case.base)
    loss = ak.cross_entropy(case.view(x), case.target, reduction=reduction, backend=backend,
                            **features)
    _check_loss_and_grad(loss, x, case, dtype, lambda z: reference.cross_entropy(
        z, case.target, reduction=reduction, **features), reduction, **features)


@pytest.mark.parametrize("logit_scale", [0.5, 2.0, -1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logit_scale_matches_torch_on_scaled_logits(backend, dtype, logit_scale):
    """Without softcap: ``F.cross_entropy(logit_scale * logits)``, values and gradients."""
    case = make_case("3d", dtype)
    x = leaf(case.base)
    loss = ak.cross_entropy(x, case.target, label_smoothing=0.1, logit_scale=logit_scale,
                            backend=backend)
    _check_loss_and_grad(loss, x, case, dtype, lambda z: _torch_cross_entropy(
        logit_scale * z, case.target, -100, "mean", 0.1), "mean", 0.1,
        logit_scale=logit_scale)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_logit_scale_inplace_backward(backend, reduction):
    case = make_case("3d", torch.bfloat16)
    options = dict(reduction=reduction, softcap=5.0, logit_scale=-2.0, backend=backend)
    expected = leaf(case.base)
    ak.cross_entropy(expected, case.target, **options).sum().backward()
    logits = case.base.clone().requires_grad_(True)
    ak.cross_entropy(logits * 1, case.target, inplace_backward=True, **options).sum().backward()
    assert torch.equal(logits.grad, expected.grad)


def test_logit_scale_refused_with_process_group():
    case = make_case("below_tile", torch.float32)
    # refused before the group is used
    with pytest.raises(ValueError, match="logit_scale"):
        ak.cross_entropy(case.base, case.target, logit_scale=2.0, process_group=object())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_normalizer_for_gradient_accumulation(backend):
    case = make_case("below_tile", torch.float32)
    halves = [slice(0, 3), slice(3, 6)]
    total_tokens = int((case.target != -100).sum())
    x = leaf(case.base)
    for rows in halves:
        ak.cross_entropy(x[rows], case.target[rows], normalizer=total_tokens,
                         backend=backend).backward()
    whole = leaf(case.base)
    ak.cross_entropy(whole, case.target, backend=backend).backward()
    assert_close(x.grad, whole.grad, "grad", torch.float32)
    as_tensor = ak.cross_entropy(case.base, case.target, normalizer=torch.tensor(4.0),
                                 backend=backend)
    as_sum = ak.cross_entropy(case.base, case.target, reduction="sum", backend=backend)
    assert_close(as_tensor, as_sum / 4.0, "value", torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_all_rows_ignored_gives_zero_loss_and_gradient(backend):
    case = make_case("all_ignored", torch.bfloat16)
    x = leaf(case.base)
    loss = ak.cross_entropy(x, case.target, z_loss=1e-3, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_backward_overwrites_logits(backend, dtype):
    case = make_case("3d", dtype)
    expected = leaf(case.base)
    ak.cross_entropy(expected, case.target, label_smoothing=0.1, backend=backend).backward()
    logits = case.base.clone().requires_grad_(True)
    buffer = logits * 1
    loss = ak.cross_entropy(buffer, case.target, label_smoothing=0.1, inplace_backward=True,
                            backend=backend)
    assert torch.equal(buffer.detach(), expected.grad), "the forward writes the gradient in place"
    loss.backward()
    assert torch.equal(logits.grad, expected.grad)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_confident_bf16_rows_keep_gradient_precision(backend):
    """p = 0.998 at the target: the gradient p - 1 = -0.002 must not be rounded as p then 1."""
    vocab = 64
    base = torch.zeros(4, vocab)
    target = torch.tensor([0, 10, 20, 63])
    base[torch.arange(4), target] = 10.75  # p_target ~ 0.998
    base = base.bfloat16()
    x = leaf(base)
    ak.cross_entropy(x, target, reduction="sum", backend=backend).backward()
    xd = reference_leaf(base)
    F.cross_entropy(xd, target, reduction="sum").backward()
    at_target = x.grad[torch.arange(4), target].double()
    expected = xd.grad[torch.arange(4), target]
    assert torch.all((at_target - expected).abs() <= 8e-3 * expected.abs())


def test_second_backward_after_rescale():
    """A retained graph keeps the forward's gradient intact: the second backward adds it again."""
    case = make_case("below_tile", torch.float32)
    x = leaf(case.base)
    loss = ak.cross_entropy(x, case.target, backend="torch") * 2.0
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert_close(x.grad, 2 * first, "grad", torch.float32)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(z_loss=-1.0), ValueError, "z_loss"),
    (dict(logit_scale=float("inf")), ValueError, "logit_scale"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
    (dict(logit_scale="2"), TypeError, "logit_scale"),
    (dict(normalizer=-1), ValueError, "normalizer"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
])
def test_bad_arguments(kwargs, error, match):
    case = make_case("below_tile", torch.float32)
    with pytest.raises(error, match=match):
        ak.cross_entropy(case.base, case.target, **kwargs)


def test_bad_targets():
    case = make_case("below_tile", torch.float32)
    with pytest.raises(ValueError, match="outside"):
        ak.cross_entropy(case.base, torch.full((6,), 37))
    with pytest.raises(ValueError, match="target must have shape"):
        ak.cross_entropy(case.base, case.target[:4])
    with pytest.raises(TypeError, match="target"):
        ak.cross_entropy(case.base, case.target.float())


def test_module_matches_functional_and_refuses_unsupported():
    case = make_case("3d", torch.float32)
    module = ak.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)
    expected = ak.cross_entropy(case.base, case.target, label_smoothing=0.1, z_loss=1e-3)
    assert_close(module(case.base, case.target), expected, "value", torch.float32)
    with pytest.raises(ValueError, match="weight"):
        ak.nn.CrossEntropyLoss(weight=torch.ones(100))
    with pytest.raises(ValueError, match="probability"):
        module(case.base, torch.softmax(case.base, -1))
    with pytest.raises(ValueError, match="reduction"):
        ak.nn.CrossEntropyLoss(reduction="avg")(case.base, case.target)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(backend):
    case = make_case("shifted", torch.float32)
    case.base, case.target = case.base.to(compile_device(backend)), case.target.to(
        compile_device(backend))

    def loss_fn(x, y):
        return 3.0 * ak.cross_entropy(x[:, :-1], y, label_smoothing=0.1, z_loss=1e-3,
                                      backend=backend)

    compiled = torch.compile(loss_fn, fullgraph=True)
    x = leaf(case.base)
    out = compiled(x, case.target)
    out.backward()
    x_eager = leaf(case.base)
    expected = loss_fn(x_eager, case.target)
    expected.backward()
    assert_close(out, expected, "value", torch.float32)
    assert_close(x.grad, x_eager.grad, "grad", torch.float32)
