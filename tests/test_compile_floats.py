"""``torch.compile(fullgraph=True)`` with float hyperparameters as arguments (issue 12 item 9).

Every float hyperparameter of the ops (temperature, softcap, z-loss, label smoothing, the GRPO
clip range, delta and beta) may be an argument of the compiled function: the result and the
gradients equal eager ones, and a new value reuses the compiled graph. Dynamo compiles the
first call with its floats as constants and, when a float changes, once more with it symbolic
(automatic dynamic); ``dynamic=True`` makes it symbolic from the start. So with the default,
four distinct values compile twice; with ``dynamic=True``, once. Before the float arguments
reached the custom ops as tensors, each value compiled again.

The compile counter runs AOTAutograd (``aot_eager``), which traces the custom ops and their
backward as Inductor would; one case runs Inductor itself. The triton backend's ``triton_op``
twins need CUDA to be compiled and take their floats as constants (``ops/_library.py``).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import astrai_kernels as ak

BACKENDS = ["torch", "cpp"]


def _batch(seed=0, batch=2, length=5, vocab=16, hidden=8):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen)
    target = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, -2:] = False
    advantages = torch.randn(batch, generator=gen)
    old = -torch.rand(batch, length, generator=gen) * 3
    ref = -torch.rand(batch, length, generator=gen) * 3
    hidden_states = torch.randn(batch, length, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    return dict(logits=logits, target=target, mask=mask, advantages=advantages, old=old, ref=ref,
                hidden=hidden_states, weight=weight)


def _grpo(logits, data, backend, temperature, clip_low, clip_high, delta, beta):
    loss, _ = ak.grpo_loss(logits, data["target"], data["advantages"], mask=data["mask"],
                           old_logprobs=data["old"], ref_logprobs=data["ref"], beta=beta,
                           clip_eps_low=clip_low, clip_eps_high=clip_high, delta=delta,
                           temperature=temperature, backend=backend)
    return loss


def _linear_grpo(hidden, weight, data, backend, temperature, clip_low, clip_high, delta, beta):
    loss, _ = ak.linear_grpo_loss(
        hidden, weight, data["target"], data["advantages"], mask=data["mask"],
        old_logprobs=data["old"], ref_logprobs=data["ref"], beta=beta, clip_eps_low=clip_low,
        clip_eps_high=clip_high, delta=delta, temperature=temperature, chunk_size=3,
        backend=backend)
    return loss


# Each case: a loss of (differentiable tensor, data, backend, *floats) and four float tuples.
CASES = {
    "token_logprobs": (
        lambda x, d, b, t: ak.token_logprobs(x, d["target"], temperature=t, backend=b).sum(),
        [(0.7,), (1.3,), (2.1,), (0.45,)]),
    "token_logprobs_entropy": (
        lambda x, d, b, t: sum(part.sum() for part in ak.token_logprobs(
            x, d["target"], temperature=t, return_entropy=True, backend=b)),
        [(0.7,), (1.3,), (2.1,), (0.45,)]),
    "cross_entropy": (
        lambda x, d, b, softcap, z_loss, smoothing: ak.cross_entropy(
            x, d["target"], softcap=softcap, z_loss=z_loss, label_smoothing=smoothing,
            backend=b),
        [(30.0, 1e-3, 0.1), (2.0, 1e-2, 0.0), (5.0, 0.0, 0.3), (1.5, 0.1, 0.05)]),
    "cross_entropy_none": (
        lambda x, d, b, softcap, z_loss: ak.cross_entropy(
            x, d["target"], softcap=softcap, z_loss=z_loss, reduction="none", backend=b).sum(),
        [(30.0, 1e-3), (2.0, 1e-2), (5.0, 0.0), (1.5, 0.1)]),
    "grpo_loss": (
        lambda x, d, b, *floats: _grpo(x, d, b, *floats),
        [(1.0, 0.2, 0.28, 1.5, 0.04), (0.7, 0.1, 0.3, 2.0, 0.0), (1.3, 0.3, 0.2, 1.2, 0.1),
         (0.9, 0.05, 0.05, 3.0, 0.2)]),
}
LINEAR_CASES = {
    "linear_token_logprobs": (
        lambda h, w, d, b, t: ak.linear_token_logprobs(h, w, d["target"], temperature=t,
                                                       chunk_size=3, backend=b).sum(),
        [(0.7,), (1.3,), (2.1,), (0.45,)]),
    "linear_cross_entropy": (
        lambda h, w, d, b, softcap, z_loss, smoothing: ak.linear_cross_entropy(
            h, w, d["target"], softcap=softcap, z_loss=z_loss, label_smoothing=smoothing,
            chunk_size=3, backend=b),
        [(30.0, 1e-3, 0.1), (2.0, 1e-2, 0.0), (5.0, 0.0, 0.3), (1.5, 0.1, 0.05)]),
    "linear_cross_entropy_none": (
        lambda h, w, d, b, softcap, z_loss: ak.linear_cross_entropy(
            h, w, d["target"], softcap=softcap, z_loss=z_loss, reduction="none", chunk_size=3,
            backend=b).sum(),
        [(30.0, 1e-3), (2.0, 1e-2), (5.0, 0.0), (1.5, 0.1)]),
    "linear_grpo_loss": (
        lambda h, w, d, b, *floats: _linear_grpo(h, w, d, b, *floats),
        [(1.0, 0.2, 0.28, 1.5, 0.04), (0.7, 0.1, 0.3, 2.0, 0.0), (1.3, 0.3, 0.2, 1.2, 0.1),
         (0.9, 0.05, 0.05, 3.0, 0.2)]),
}


def _loss_and_grads(fn, tensors, *args):
    leaves = [t.clone().requires_grad_() for t in tensors]
    loss = fn(*leaves, *args)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def _compiles(fn, tensors, extra, float_sets, dynamic, backend="aot_eager"):
    """How many graphs ``torch.compile(fn)`` builds over ``float_sets``; every call's loss and
    gradients are checked against the eager call's."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=dynamic)
    for floats in float_sets:
        loss, grads = _loss_and_grads(compiled, tensors, *extra, *floats)
        expected, expected_grads = _loss_and_grads(fn, tensors, *extra, *floats)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    return counter.frame_count


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_ops_compile_once_for_every_float_value(case, backend):
    fn, float_sets = CASES[case]
    data = _batch()
    assert _compiles(fn, [data["logits"]], (data, backend), float_sets[:3], dynamic=True) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linear_ops_compile_once_for_every_float_value(case, backend):
    fn, float_sets = LINEAR_CASES[case]
    data = _batch()
    tensors = [data["hidden"], data["weight"]]
    assert _compiles(fn, tensors, (data, backend), float_sets[:3], dynamic=True) == 1


@pytest.mark.parametrize("case", ["cross_entropy", "grpo_loss"])
def test_default_compile_specializes_the_first_value_only(case):
    fn, float_sets = CASES[case]
    data = _batch()
    assert _compiles(fn, [data["logits"]], (data, "torch"), float_sets, dynamic=None) == 2


def test_inductor_with_float_arguments():
    def fn(x, data, backend, temperature, softcap):
        logp = ak.token_logprobs(x[:, :-1], data["target"][:, 1:], temperature=temperature,
                                 backend=backend)
        return logp.sum() + ak.cross_entropy(x, data["target"], softcap=softcap, backend=backend)

    data = _batch()
    float_sets = [(0.7, 30.0), (1.3, 2.0), (2.1, 5.0)]
    assert _compiles(fn, [data["logits"]], (data, "torch"), float_sets, dynamic=True,
                     backend="inductor") == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fullgraph", [True, False])
def test_inplace_backward_with_float_arguments(backend, fullgraph):
    """``inplace_backward=True`` under compile: no graph break with ``fullgraph``, no internal
    Dynamo error without it; the result equals eager (which writes in place)."""
    data = _batch()

    def fn(x, x2, temperature, z_loss):
        ce = ak.cross_entropy(x[:, :-1], data["target"][:, 1:], z_loss=z_loss,
                              inplace_backward=True, backend=backend)
        rows = ak.cross_entropy(x2, data["target"], reduction="none", inplace_backward=True,
                                backend=backend)
        logp = ak.token_logprobs(x2[:, 1:], data["target"][:, 1:], temperature=temperature,
                                 inplace_backward=True, backend=backend)
        return ce + rows.sum() + logp.sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=counter, dynamic=True)
    for temperature, z_loss in ((0.7, 1e-3), (1.3, 0.0), (2.0, 1e-2)):
        tensors = [data["logits"], 2 * data["logits"]]
        loss, grads = _loss_and_grads(compiled, tensors, temperature, z_loss)
        expected, expected_grads = _loss_and_grads(fn, tensors, temperature, z_loss)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("fullgraph", [True, False])
def test_bad_float_argument_under_compile_names_it(fullgraph):
    data = _batch()

    def fn(x, temperature):
        return ak.token_logprobs(x, data["target"], temperature=temperature,
                                 backend="torch").sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend="aot_eager", dynamic=True)
    compiled(data["logits"], 0.7)
    for bad in (-1.0, 0.0, float("inf"), float("nan")):
        # fullgraph: Dynamo reports the ValueError it traced (a RuntimeError subclass)
        with pytest.raises(ValueError if not fullgraph else Exception, match="temperature"):
            compiled(data["logits"], bad)
