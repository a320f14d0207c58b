"""``torch.compile(fullgraph=True)`` with float hyperparameters as arguments (issue 12 item 9).

Every float hyperparameter of the ops (temperature, softcap, z-loss, label smoothing, the logit
scale, the GRPO clip range, delta and beta) may be an argument of the compiled function: the
result and the gradients equal eager ones, and a new value reuses the compiled graph (checked with
``error_on_recompile``). Dynamo compiles the first call with its floats as constants and, when a
float changes, once more with it symbolic (automatic dynamic); ``dynamic=True`` makes it
symbolic from the start. Before the float arguments reached the custom ops as tensors, each
value compiled again. Switching a term on or off (``beta`` 0 or not, ``softcap=None``) may
compile again: the Python code branches on it.

The tests compile with AOTAutograd (``aot_eager``), which traces the custom ops and their
backward as Inductor would; one case runs Inductor itself. The triton backend's ``triton_op``
twins need CUDA to be compiled and take their floats as constants (``kernels/library.py``).
"""

import pytest
import torch

import astrai_kernels as ak


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


# (temperature, softcap, z_loss, label_smoothing, clip_low, clip_high, delta, beta): four
# distinct values of each, every term on in all of them
FLOAT_SETS = [(0.7, 30.0, 1e-3, 0.1, 0.2, 0.28, 1.5, 0.04),
              (1.3, 2.0, 1e-2, 0.3, 0.1, 0.3, 2.0, 0.01),
              (2.1, 5.0, 0.1, 0.05, 0.3, 0.2, 1.2, 0.1),
              (0.45, 1.5, 0.2, 0.2, 0.05, 0.05, 3.0, 0.2)]


def logits_losses(x, data, backend, temperature, softcap, z_loss, smoothing, *grpo_floats):
    """Every logits op, each float hyperparameter an argument."""
    target = data["target"]
    logp, entropy = ak.token_logprobs(x, target, temperature=temperature, return_entropy=True,
                                      backend=backend)
    mean = ak.cross_entropy(x, target, softcap=softcap, z_loss=z_loss,
                            label_smoothing=smoothing, backend=backend)
    rows = ak.cross_entropy(x, target, softcap=softcap, z_loss=z_loss, reduction="none",
                            backend=backend)
    grpo = _grpo(x, data, backend, temperature, *grpo_floats)
    return logp.sum() + 0.5 * entropy.sum() + mean + 0.1 * rows.sum() + grpo


def linear_losses(hidden, weight, data, backend, temperature, softcap, z_loss, smoothing,
                  *grpo_floats):
    """Every fused-head op, each float hyperparameter an argument."""
    target = data["target"]
    logp = ak.linear_token_logprobs(hidden, weight, target, temperature=temperature,
                                    chunk_size=3, backend=backend)
    mean = ak.linear_cross_entropy(hidden, weight, target, softcap=softcap, z_loss=z_loss,
                                   label_smoothing=smoothing, chunk_size=3, backend=backend)
    rows = ak.linear_cross_entropy(hidden, weight, target, softcap=softcap, z_loss=z_loss,
                                   reduction="none", chunk_size=3, backend=backend)
    grpo = _linear_grpo(hidden, weight, data, backend, temperature, *grpo_floats)
    return logp.sum() + mean + 0.1 * rows.sum() + grpo


def _loss_and_grads(fn, tensors, *args):
    leaves = [t.clone().requires_grad_() for t in tensors]
    loss = fn(*leaves, *args)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def _check_calls(compiled, fn, tensors, extra, float_sets):
    for floats in float_sets:
        loss, grads = _loss_and_grads(compiled, tensors, *extra, *floats)
        expected, expected_grads = _loss_and_grads(fn, tensors, *extra, *floats)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def _compile_without_recompiles(fn, tensors, extra, float_sets, dynamic, backend="aot_eager",
                                fullgraph=True):
    """Compile ``fn``, call it with every float set, and fail on any recompile after the
    compiles Dynamo's policy allows (one with ``dynamic=True``, two by default: the first
    call's graph has its floats as constants). Each call's loss and gradients must equal the
    eager call's."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=backend, dynamic=dynamic)
    allowed = 1 if dynamic else 2
    _check_calls(compiled, fn, tensors, extra, float_sets[:allowed])
    with torch._dynamo.config.patch(error_on_recompile=True):
        _check_calls(compiled, fn, tensors, extra, float_sets[allowed:])


# What is traced (the custom ops' schemas, the floats as tensors) is the same for every
# backend, which only names the kernels the op bodies run: one backend per op family here
# (torch's logits ops compile in the two tests after these, cpp's in the inplace test).
@pytest.mark.parametrize("backend", ["cpp"])
def test_logits_ops_compile_once_for_every_float_value(backend):
    data = _batch()
    _compile_without_recompiles(logits_losses, [data["logits"]], (data, backend),
                                FLOAT_SETS[:3], dynamic=True)


@pytest.mark.parametrize("backend", ["torch"])
def test_linear_ops_compile_once_for_every_float_value(backend):
    data = _batch()
    _compile_without_recompiles(linear_losses, [data["hidden"], data["weight"]],
                                (data, backend), FLOAT_SETS[:3], dynamic=True)


def test_default_compile_specializes_the_first_value_only():
    data = _batch()
    _compile_without_recompiles(logits_losses, [data["logits"]], (data, "torch"), FLOAT_SETS,
                                dynamic=None)


def scaled_cross_entropy(x, data, backend, logit_scale, softcap, z_loss, smoothing):
    """Both cross-entropy paths (fused mean, per-row recompute) with ``logit_scale`` an argument,
    with and without the soft cap."""
    target = data["target"]
    capped = ak.cross_entropy(x, target, logit_scale=logit_scale, softcap=softcap, z_loss=z_loss,
                              label_smoothing=smoothing, backend=backend)
    rows = ak.cross_entropy(x, target, logit_scale=logit_scale, reduction="none",
                            backend=backend)
    return capped + 0.1 * rows.sum()


# (logit_scale, softcap, z_loss, label_smoothing)
SCALE_SETS = [(2.0, 30.0, 1e-3, 0.1), (0.5, 2.0, 1e-2, 0.3), (-1.0, 5.0, 0.1, 0.05),
              (1.5, 1.5, 0.2, 0.2)]


@pytest.mark.parametrize("backend, dynamic", [("cpp", True), ("torch", None)])
def test_logit_scale_compiles_once_for_every_value(backend, dynamic):
    data = _batch()
    _compile_without_recompiles(scaled_cross_entropy, [data["logits"]], (data, backend),
                                SCALE_SETS if dynamic is None else SCALE_SETS[:3],
                                dynamic=dynamic)


def test_inductor_with_float_arguments():
    def fn(x, data, backend, temperature, softcap):
        logp = ak.token_logprobs(x[:, :-1], data["target"][:, 1:], temperature=temperature,
                                 backend=backend)
        return logp.sum() + ak.cross_entropy(x, data["target"], softcap=softcap, backend=backend)

    data = _batch()
    float_sets = [(0.7, 30.0), (1.3, 2.0), (2.1, 5.0)]
    _compile_without_recompiles(fn, [data["logits"]], (data, "torch"), float_sets,
                                dynamic=True, backend="inductor")


@pytest.mark.parametrize("backend, fullgraph", [("cpp", True), ("torch", False)])
def test_inplace_backward_with_float_arguments(backend, fullgraph):
    """``inplace_backward=True`` under compile: no graph break with ``fullgraph``, no internal
    Dynamo error without it; the result equals eager (which writes in place)."""
    data = _batch()

    def fn(x, x2, x3, temperature, z_loss):
        ce = ak.cross_entropy(x[:, :-1], data["target"][:, 1:], z_loss=z_loss,
                              inplace_backward=True, backend=backend)
        rows = ak.cross_entropy(x2, data["target"], reduction="none", inplace_backward=True,
                                backend=backend)
        logp = ak.token_logprobs(x3[:, 1:], data["target"][:, 1:], temperature=temperature,
                                 inplace_backward=True, backend=backend)
        return ce + rows.sum() + logp.sum()

    tensors = [data["logits"], 2 * data["logits"], data["logits"] - 1]
    _compile_without_recompiles(fn, tensors, (), [(0.7, 1e-3), (1.3, 0.0), (2.0, 1e-2)],
                                dynamic=True, fullgraph=fullgraph)


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
