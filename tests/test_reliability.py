"""Reliability of the ops (issue 12) and their untested paths (issue 11 item 5): no silent wrong
gradient, zero where the contract says zero, a clear error for every bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels.kernels import registry as _backend
from astrai_kernels.ops._common import rows_view

FAST_BACKENDS = ["torch", "cpp"]
KERNEL_BACKENDS = FAST_BACKENDS + ["triton"]  # triton runs interpreted on CPU (conftest)


def _batch(seed=0, batch=2, length=5, vocab=16):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, length, vocab, generator=gen)
    target = torch.randint(0, vocab, (batch, length - 1), generator=gen)
    return base, target


def _ce_grad(base, target, **kwargs):
    """``F.cross_entropy`` (float64) of ``base[:, :-1]`` and its gradient w.r.t. all of ``base``."""
    x = base.double().requires_grad_()
    loss = F.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), target.reshape(-1), **kwargs)
    loss.sum().backward()
    return loss.detach().reshape(loss.shape if loss.dim() == 0 else target.shape), x.grad


# issue 12 item 1: overlapping logits with inplace_backward


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton", "reference"])
@pytest.mark.parametrize("layout", ["expand", "as_strided"])
def test_inplace_backward_refuses_overlapping_logits(backend, layout):
    target = torch.arange(8)
    gen = torch.Generator().manual_seed(0)
    if layout == "expand":
        view = torch.randn(1, 50, generator=gen).requires_grad_().expand(8, 50)
    else:  # windows of 50 starting one element apart
        view = torch.randn(64, generator=gen).requires_grad_().as_strided((8, 50), (1, 1))
    for call in (lambda: ak.cross_entropy(view, target, reduction="sum", inplace_backward=True,
                                          backend=backend),
                 lambda: ak.token_logprobs(view, target, inplace_backward=True,
                                           backend=backend)):
        with pytest.raises(ValueError, match="inplace_backward"):
            call()


def test_overlap_check_accepts_slices():
    base, target = _batch()
    x = base.clone().requires_grad_()
    ak.cross_entropy(x[:, :-1], target, inplace_backward=True, backend="torch").backward()
    ak.token_logprobs(x.detach().clone().requires_grad_()[:, 1:], target,
                      inplace_backward=True, backend="torch")


# issue 12 item 6: a zero normalizer


@pytest.mark.parametrize("backend", FAST_BACKENDS + ["reference"])
@pytest.mark.parametrize("normalizer", [0, 0.0, torch.tensor(0.0), torch.tensor(0)],
                         ids=["int", "float", "tensor", "int_tensor"])
def test_zero_normalizer_gives_zero_loss_and_grad(backend, normalizer):
    base, target = _batch()
    ignored = torch.full_like(target, -100)
    x = base.clone().requires_grad_()
    loss = ak.cross_entropy(x[:, :-1], ignored, normalizer=normalizer, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(x.grad) == 0


def test_zero_normalizer_with_counted_rows_raises():
    # issue 24 item 6: GRPO's rule for every op, 0 only when nothing is counted
    base, target = _batch()
    with pytest.raises(ValueError, match="normalizer must be > 0 when a row is counted"):
        ak.cross_entropy(base, target.new_zeros(base.shape[:2]), normalizer=torch.tensor(0.0),
                         backend="torch")


@pytest.mark.parametrize("normalizer, error", [
    (torch.tensor(-5.0), ValueError), (torch.tensor(float("inf")), ValueError),
    (torch.tensor(float("nan")), ValueError), (-1, ValueError), (float("inf"), ValueError),
    (1e-45, ValueError), (torch.tensor(True), TypeError), (torch.ones(2), ValueError),
    ("4", TypeError),
])
def test_bad_normalizer(normalizer, error):
    base, target = _batch()
    with pytest.raises(error, match="normalizer"):
        ak.cross_entropy(base[:, :-1], target, normalizer=normalizer, backend="torch")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_normalizer_only_with_mean(reduction):
    base, target = _batch()
    with pytest.raises(ValueError, match="normalizer applies to reduction='mean'"):
        ak.cross_entropy(base[:, :-1], target, reduction=reduction, normalizer=4.0)


# issue 12 item 7: inplace_backward's gradient is the logits' buffer


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_inplace_cross_entropy_of_a_slice_reuses_the_buffer(backend, reduction):
    base, target = _batch()
    expected_loss, expected_grad = _ce_grad(base, target, reduction=reduction)
    x = base.clone().requires_grad_()
    loss = ak.cross_entropy(x[:, :-1], target, reduction=reduction, inplace_backward=True,
                            backend=backend)
    (loss.sum() if reduction == "none" else loss).backward()
    assert x.grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_inplace_cross_entropy_of_whole_logits_reuses_the_buffer(backend):
    base, target = _batch()
    x = base[:, :-1].clone().requires_grad_()
    ak.cross_entropy(x, target, inplace_backward=True, backend=backend).backward()
    assert x.grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.grad.double(), _ce_grad(base, target)[1][:, :-1],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_token_logprobs_of_a_slice_reuses_the_buffer(backend):
    base, target = _batch()
    x = base.clone().requires_grad_()
    ak.token_logprobs(x[:, :-1], target, temperature=0.7, inplace_backward=True,
                      backend=backend).sum().backward()
    expected = base.double().requires_grad_()
    torch.log_softmax(expected[:, :-1] / 0.7, -1).gather(-1, target.unsqueeze(-1)).sum().backward()
    assert x.grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.grad.double(), expected.grad, rtol=1e-5, atol=1e-6)


def test_inplace_slice_of_a_non_leaf_flows_to_its_producer():
    base, target = _batch()
    weight = torch.randn(base.shape[-1], base.shape[-1], generator=torch.Generator().manual_seed(1))
    w = weight.clone().requires_grad_()
    ak.cross_entropy((base @ w)[:, :-1], target, inplace_backward=True,
                     backend="torch").backward()
    w_ref = weight.double().requires_grad_()
    F.cross_entropy((base.double() @ w_ref)[:, :-1].reshape(-1, base.shape[-1]),
                    target.reshape(-1)).backward()
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-5, atol=1e-6)


# issue 12 item 8: a second backward


def _grpo_inputs():
    base, target = _batch()
    advantages = torch.tensor([0.5, -1.0])
    old = torch.log_softmax(base[:, :-1] + 0.1, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return base[:, :-1].contiguous(), target, advantages, old


def _losses(backend, loss_name):
    base, target = _batch()
    x = base.clone().requires_grad_()
    if loss_name == "grpo":
        logits, target, advantages, old = _grpo_inputs()
        x = logits.clone().requires_grad_()
        loss, _ = ak.grpo_loss(x, target, advantages, old_logprobs=old, backend=backend)
        return x, loss
    if loss_name == "distill":  # the gradient written by the forward, rescaled by the backward
        teacher = base[:, :-1].flip(-1) * 0.5
        return x, ak.distill_loss(x[:, :-1], teacher, target, beta=0.5, backend=backend)
    return x, ak.cross_entropy(x[:, :-1], target, inplace_backward=loss_name.endswith("inplace"),
                               backend=backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("loss_name",
                         ["cross_entropy", "cross_entropy_inplace", "grpo", "distill"])
def test_second_backward(backend, loss_name):
    x, loss = _losses("reference", loss_name)
    loss.backward()
    expected = x.grad.clone()

    x, loss = _losses(backend, loss_name)
    (loss / 2).backward(retain_graph=True)
    (loss / 2).backward(retain_graph=True)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * expected, rtol=1e-5, atol=1e-6)

    x, loss = _losses(backend, loss_name)
    first = torch.autograd.grad(3 * loss, x, retain_graph=True)[0]
    second = torch.autograd.grad(3 * loss, x, retain_graph=True)[0]
    torch.testing.assert_close(first, 3 * expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, 3 * expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_second_backward_of_inplace_token_logprobs(backend):
    base, target = _batch()
    expected = base.clone().requires_grad_()
    ak.token_logprobs(expected[:, :-1], target, backend="reference").sum().backward()
    x = base.clone().requires_grad_()
    logp = ak.token_logprobs(x[:, :-1], target, inplace_backward=True, backend=backend)
    (2 * logp.sum()).backward(retain_graph=True)
    logp.sum().backward()
    torch.testing.assert_close(x.grad, 3 * expected.grad, rtol=1e-5, atol=1e-6)


# issue 12 item 9: torch.compile with float hyperparameters as arguments, and in-place


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_compile_with_float_hyperparameters_as_arguments(backend):
    base, target = _batch()

    def loss_fn(x, y, temperature, softcap, z_loss, smoothing):
        logp = ak.token_logprobs(x[:, :-1], y, temperature=temperature, backend=backend)
        ce = ak.cross_entropy(x[:, :-1], y, softcap=softcap, z_loss=z_loss,
                              label_smoothing=smoothing, backend=backend)
        return logp.sum() + ce

    compiled = torch.compile(loss_fn, fullgraph=True)
    for args in ((0.7, 30.0, 1e-3, 0.1), (1.3, 20.0, 0.0, 0.0)):
        x = base.clone().requires_grad_()
        out = compiled(x, target, *args)
        out.backward()
        x_eager = base.clone().requires_grad_()
        expected = loss_fn(x_eager, target, *args)
        expected.backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_eager.grad)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compile_with_inplace_backward(backend, fullgraph):
    base, target = _batch()

    def loss_fn(x, x2, y):
        ce = ak.cross_entropy(x[:, :-1], y, inplace_backward=True, backend=backend)
        logp = ak.token_logprobs(x2[:, 1:], y, inplace_backward=True, backend=backend)
        return ce + logp.sum()

    x, x2 = base.clone().requires_grad_(), (2 * base).requires_grad_()
    out = torch.compile(loss_fn, fullgraph=fullgraph)(x, x2, target)
    out.backward()
    x_eager, x2_eager = base.clone().requires_grad_(), (2 * base).requires_grad_()
    expected = loss_fn(x_eager, x2_eager, target)
    expected.backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_eager.grad)
    torch.testing.assert_close(x2.grad, x2_eager.grad)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_on_device_target_assert_under_compile(backend):
    base, target = _batch()

    def loss_fn(x, y):
        return ak.cross_entropy(x, y, backend=backend)

    compiled = torch.compile(loss_fn, fullgraph=True)
    compiled(base[:, :-1], target)
    # Inductor may schedule the device assert after the op (no data dependency between them),
    # so the backend's own range error may come first: cpp's names the target, torch's index
    match = "target holds values outside|" + ("target out of range" if backend == "cpp"
                                              else "index 99 is out of bounds")
    with pytest.raises((RuntimeError, ValueError), match=match):
        compiled(base[:, :-1], torch.full_like(target, 99))


# issue 12 item 10: validation


@pytest.mark.parametrize("call, error, match", [
    (lambda x, y: ak.token_logprobs(x, y, temperature=1e-45), ValueError, "temperature"),
    (lambda x, y: ak.token_logprobs(x, y, temperature=1e39), ValueError, "temperature"),
    (lambda x, y: ak.token_logprobs(x, y, temperature=True), TypeError, "temperature"),
    (lambda x, y: ak.token_logprobs(x, y, temperature=torch.tensor(1.0)), TypeError,
     "temperature"),
    (lambda x, y: ak.cross_entropy(x, y, z_loss=float("inf")), ValueError, "z_loss"),
    (lambda x, y: ak.cross_entropy(x, y, z_loss=float("nan")), ValueError, "z_loss"),
    (lambda x, y: ak.cross_entropy(x, y, softcap=1e-45), ValueError, "softcap"),
    (lambda x, y: ak.cross_entropy(x, y, ignore_index=2**70), ValueError, "ignore_index"),
    (lambda x, y: ak.token_logprobs(x, y, ignore_index=2**70), ValueError, "ignore_index"),
    (lambda x, y: ak.cross_entropy(x, y, ignore_index=1.5), TypeError, "ignore_index"),
    (lambda x, y: ak.cross_entropy(x, y, reduction=None), ValueError, "reduction"),
    (lambda x, y: ak.cross_entropy(x, y, inplace_backward="yes"), TypeError, "inplace_backward"),
    (lambda x, y: ak.token_logprobs(x.to("meta"), y.to("meta")), ValueError, "meta"),
    (lambda x, y: ak.cross_entropy(x.to("meta"), y.to("meta")), ValueError, "meta"),
    (lambda x, y: ak.token_logprobs(x, y, backend=3), TypeError, "backend must be a string"),
    (lambda x, y: ak.cross_entropy(x, y, backend=None), TypeError, "backend must be a string"),
])
def test_bad_input(call, error, match, monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "torch")  # "auto" without building the C++ extension
    base, target = _batch()
    with pytest.raises(error, match=match):
        call(base[:, :-1], target)


def test_available_backends_of_an_unknown_device():
    with pytest.raises(ValueError, match="device"):
        ak.available_backends("gpu")


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_numpy_scalars_are_accepted(backend):
    base, target = _batch()
    target = target.clone()
    target[0, 0] = -100
    expected = ak.token_logprobs(base[:, :-1], target, temperature=0.7, ignore_index=-100,
                                 backend=backend)
    got = ak.token_logprobs(base[:, :-1], target, temperature=np.float32(0.7),
                            ignore_index=np.int64(-100), backend=backend)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    ce = ak.cross_entropy(base[:, :-1], target, ignore_index=np.int64(-100),
                          label_smoothing=np.float64(0.1), z_loss=np.float32(1e-3),
                          softcap=np.float32(20.0), normalizer=np.int64(4), backend=backend)
    ce_ref = ak.cross_entropy(base[:, :-1], target, ignore_index=-100, label_smoothing=0.1,
                              z_loss=float(np.float32(1e-3)), softcap=float(np.float32(20.0)),
                              normalizer=4, backend=backend)
    torch.testing.assert_close(ce, ce_ref)


# issue 11 item 5: untested paths


@pytest.mark.parametrize("change, error, match", [
    (dict(logits=lambda x: x[0]), ValueError, r"\[B, T, V\]"),
    (dict(mask=lambda m: m[:, :-1]), ValueError, "mask must be a tensor of target's shape"),
    (dict(mask=lambda m: m.tolist()), ValueError, "mask must be a tensor"),
    (dict(mask=lambda m: m.to("meta")), ValueError, "mask is on meta"),
    (dict(target=lambda y: y.float()), TypeError, "target"),
    (dict(target=lambda y: y.tolist()), TypeError, "target"),
    (dict(target=lambda y: torch.full_like(y, 16)), ValueError, "outside"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(average=1), TypeError, "average"),
    (dict(backend="nonsense"), ValueError, "backend"),
])
def test_sequence_logprobs_errors(change, error, match):
    base, target = _batch()
    args = dict(logits=base[:, :-1], target=target, mask=torch.ones_like(target))
    kwargs = {"backend": "torch"}
    for key, value in change.items():
        if key in args:
            args[key] = value(args[key])
        else:
            kwargs[key] = value
    with pytest.raises(error, match=match):
        ak.sequence_logprobs(args["logits"], args["target"], args["mask"], **kwargs)


def test_sequence_logprobs_ignores_masked_targets():
    base, target = _batch()
    mask = torch.ones_like(target)
    mask[:, -1] = 0
    wild = target.clone()
    wild[:, -1] = 10**6
    expected = ak.sequence_logprobs(base[:, :-1], target, mask, backend="torch")
    torch.testing.assert_close(ak.sequence_logprobs(base[:, :-1], wild, mask, backend="torch"),
                               expected)


@pytest.mark.parametrize("kwargs", [dict(size_average=True), dict(reduce=False),
                                    dict(weight=torch.ones(16))])
def test_cross_entropy_loss_module_rejects_torch_only_arguments(kwargs):
    with pytest.raises(ValueError, match="not supported"):
        ak.nn.CrossEntropyLoss(**kwargs)


def test_cross_entropy_loss_module_rejects_soft_targets():
    base, _ = _batch()
    with pytest.raises(ValueError, match="soft"):
        ak.nn.CrossEntropyLoss()(base, torch.softmax(base, -1))


def test_bad_backend_environment_variable(monkeypatch):
    base, target = _batch()
    monkeypatch.setenv(_backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="ASTRAI_KERNELS_BACKEND"):
        ak.cross_entropy(base[:, :-1], target)


def test_auto_falls_back_to_torch_without_the_cpp_build(monkeypatch):
    from astrai_kernels.kernels.cpp import backend as cpp_backend

    monkeypatch.setattr(cpp_backend, "unavailable_reason", lambda device: "no C++ compiler")
    assert _backend.resolve_backend("auto", "cpu") == "torch"
    assert "cpp" not in ak.available_backends("cpu")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _backend.resolve_backend("cpp", "cpu")


def test_shifted_logits_are_read_without_a_copy():
    base, _ = _batch(batch=3, length=7)
    for logits in (base[:, :-1], base[:, 1:], base[1:, :-1], base[:, :-1].unsqueeze(0)):
        rows = rows_view(logits)
        assert rows.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert rows.data_ptr() == logits.data_ptr()
        torch.testing.assert_close(rows.reshape(logits.shape), logits, rtol=0, atol=0)
