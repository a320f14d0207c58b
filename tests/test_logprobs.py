import subprocess
import sys

import pytest
import torch

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
    spec_logprobs,
    subprocess_env,
    view_terms,
)

BACKENDS = KERNEL_BACKENDS + ["reference"]


def _reference(case, with_grad=True):
    x = reference_leaf(case.base)
    logp, entropy = reference.token_logprobs(case.view(x), case.target, case.temperature,
                                             case.ignore_index)
    return x, logp, entropy


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_matches_reference(backend, name, dtype):
    case = make_case(name, dtype)
    x = leaf(case.base)
    before = case.base.clone()
    logp, entropy = ak.token_logprobs(case.view(x), case.target, temperature=case.temperature,
                                      ignore_index=case.ignore_index, return_entropy=True,
                                      backend=backend)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert logp.shape == case.target.shape and entropy.shape == case.target.shape
    g = torch.Generator().manual_seed(1)
    grad_logp = torch.randn(logp.shape, generator=g)
    grad_entropy = torch.randn(logp.shape, generator=g)

    def run(xr):
        ref_logp, ref_entropy = reference.token_logprobs(case.view(xr), case.target,
                                                         case.temperature, case.ignore_index)
        (ref_logp * grad_logp.to(xr.dtype) + ref_entropy * grad_entropy.to(xr.dtype)).sum(
            ).backward()
        return {"logp": ref_logp, "entropy": ref_entropy}

    expected, naive = reference_and_naive(run, case.base)
    terms = spec_logprobs(case.view(case.base), case.target.reshape(-1), case.temperature,
                          case.ignore_index, True, grad_logp.reshape(-1),
                          grad_entropy.reshape(-1))
    assert_close(logp, expected["logp"], "value", dtype, "logp", naive=naive["logp"])
    assert_close(entropy, expected["entropy"], "value", dtype, "entropy",
                 naive=naive["entropy"], scale=terms["entropy_terms"].reshape(entropy.shape))
    (logp * grad_logp + entropy * grad_entropy).sum().backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected["grad"], "grad", dtype, "grad", naive=naive["grad"],
                 scale=view_terms(case, terms["grad_terms"]))
    assert torch.equal(x.detach(), before), "token_logprobs modified its input"
    ignored = case.target == case.ignore_index
    assert torch.all(logp[ignored] == 0) and torch.all(entropy[ignored] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_logprobs_only_gradient(backend, dtype):
    """Without entropy, the gradient is g * (onehot - p) / T: check against torch's own ops."""
    case = make_case("shifted", dtype)
    x = leaf(case.base)
    logp = ak.token_logprobs(case.view(x), case.target, temperature=case.temperature,
                             backend=backend)
    upstream = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2))
    (logp * upstream).sum().backward()
    xd = reference_leaf(case.base)
    valid = case.target != -100
    logp_all = torch.log_softmax(case.view(xd) / case.temperature, dim=-1)
    torch_logp = logp_all.gather(-1, case.target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    (torch_logp * upstream.double()).sum().backward()
    assert_close(logp, torch_logp, "value", dtype)
    assert_close(x.grad, xd.grad, "grad", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_backward_writes_grad_into_logits(backend, dtype):
    case = make_case("3d", dtype)
    expected_x = leaf(case.base)
    ak.token_logprobs(expected_x, case.target, backend=backend).sum().backward()
    logits = case.base.clone().requires_grad_(True)
    buffer = logits * 1  # a non-leaf tensor whose storage may be destroyed
    logp = ak.token_logprobs(buffer, case.target, inplace_backward=True, backend=backend)
    logp.sum().backward()
    assert torch.equal(logits.grad, expected_x.grad)
    assert torch.equal(buffer.detach(), expected_x.grad), "buffer should now hold the gradient"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_no_grad_call_saves_nothing(backend):
    case = make_case("below_tile", torch.float32)
    x = leaf(case.base)
    with torch.no_grad():
        logp, entropy = ak.token_logprobs(x, case.target, return_entropy=True, backend=backend)
    assert logp.grad_fn is None and entropy.grad_fn is None and not logp.requires_grad
    plain = ak.token_logprobs(case.base, case.target, backend=backend)
    assert plain.grad_fn is None
    assert torch.equal(logp, plain)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_int32_and_int64_targets(backend, target_dtype):
    case = make_case("below_tile", torch.float32)
    out = ak.token_logprobs(case.base, case.target.to(target_dtype), backend=backend)
    expected, _ = reference.token_logprobs(case.base.double(), case.target, 1.0)
    assert_close(out, expected, "value", torch.float32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs(backend, average):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 6, 29, generator=g)
    target = torch.randint(0, 29, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[1] = False
    target[~mask] = 10**6  # padding ids that are never read
    x = leaf(base)
    out = ak.sequence_logprobs(x[:, :-1], target, mask, average=average, temperature=0.9,
                               backend=backend)
    out.sum().backward()
    xd = reference_leaf(base)
    expected = reference.sequence_logprobs(xd[:, :-1], torch.where(mask, target, -100), mask,
                                           average, 0.9)
    expected.sum().backward()
    assert out.shape == (3,) and out[1] == 0
    assert_close(out, expected, "value", torch.float32)
    assert_close(x.grad, xd.grad, "grad", torch.float32)


def test_available_backends_on_cpu():
    names = ak.available_backends("cpu")
    assert {"cpp", "torch", "reference", "triton"} <= set(names)


def test_auto_and_env_override(monkeypatch):
    from astrai_kernels.kernels.registry import resolve_backend

    assert resolve_backend("auto", "cpu") == "cpp"
    monkeypatch.setenv("ASTRAI_KERNELS_BACKEND", "torch")
    assert resolve_backend("auto", "cpu") == "torch"


def test_triton_on_cpu_without_interpreter_is_refused():
    """Triton fixes interpretation when kernels are defined, so this needs a fresh process."""
    code = ("import torch, astrai_kernels as ak\n"
            "try:\n"
            "    ak.token_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long),"
            " backend='triton')\n"
            "except RuntimeError as exc:\n"
            "    print('refused:', exc)\n"
            "print('available:', ak.available_backends('cpu'))\n")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                         text=True,
                         timeout=120, check=True).stdout
    assert "refused: backend 'triton' cannot serve tensors on cpu" in out
    assert "TRITON_INTERPRET=1" in out
    assert "'triton'" not in out.split("available:")[1]


@pytest.mark.parametrize("call, error, match", [
    (lambda x, y: ak.token_logprobs(x.long(), y), TypeError, "logits"),
    (lambda x, y: ak.token_logprobs(x, y.float()), TypeError, "target"),
    (lambda x, y: ak.token_logprobs(x, y[:-1]), ValueError, "target must have shape"),
    (lambda x, y: ak.token_logprobs(x, torch.full_like(y, 37)), ValueError, "outside"),
    (lambda x, y: ak.token_logprobs(x, torch.full_like(y, -1)), ValueError, "outside"),
    (lambda x, y: ak.token_logprobs(x, y, temperature=0.0), ValueError, "temperature"),
    (lambda x, y: ak.token_logprobs(x, y, temperature=float("nan")), ValueError, "temperature"),
    (lambda x, y: ak.token_logprobs(x, y, backend="cuda"), ValueError, "backend"),
    (lambda x, y: ak.token_logprobs(x, y.to("meta")), ValueError, "target is on meta"),
    (lambda x, y: ak.token_logprobs(x[:, :0], y), ValueError, "V >= 1"),
])
def test_bad_input(call, error, match):
    case = make_case("below_tile", torch.float32)
    with pytest.raises(error, match=match):
        call(case.base, case.target.clamp(min=0))


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(backend):
    case = make_case("shifted", torch.float32)
    case.base, case.target = case.base.to(compile_device(backend)), case.target.to(
        compile_device(backend))

    def loss_fn(x, y):
        logp, entropy = ak.token_logprobs(x[:, :-1], y, return_entropy=True, temperature=1.3,
                                          backend=backend)
        return (logp * 2.0 - 0.1 * entropy).sum()

    compiled = torch.compile(loss_fn, fullgraph=True)
    x = leaf(case.base)
    out = compiled(x, case.target)
    out.backward()
    x_eager = leaf(case.base)
    expected = loss_fn(x_eager, case.target)
    expected.backward()
    assert_close(out, expected, "value", torch.float32)
    assert_close(x.grad, x_eager.grad, "grad", torch.float32)
