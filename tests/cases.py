"""Shared inputs for the op tests: awkward shapes, layouts and contents."""

import os
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from astrai_kernels import reference
from astrai_kernels.testing import spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_BACKENDS = ["torch", "cpp", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# torch.compile over the Triton kernels needs them compiled for a GPU (the interpreter cannot be
# traced); without one, tests/test_triton_tracing.py traces the same ops on meta tensors.
CUDA_TRITON = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
COMPILE_BACKENDS = ["cpp", "torch", pytest.param("triton", marks=pytest.mark.skipif(
    not CUDA_TRITON, reason="torch.compile of the triton backend runs on CUDA only"))]


def compile_device(backend):
    """Where a torch.compile test of ``backend`` runs."""
    return "cuda" if backend == "triton" else "cpu"


def subprocess_env(**extra):
    """This process's environment for a child Python: ``TRITON_INTERPRET`` dropped (so Triton
    compiles instead of interpreting), this checkout first on ``PYTHONPATH``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env.update(extra)
    return env


@dataclass
class Case:
    name: str
    base: torch.Tensor
    target: torch.Tensor
    view: Callable = field(default=lambda x: x)
    ignore_index: int = -100
    temperature: float = 1.0


def _rand_target(shape, vocab, generator, ignored=0.2, ignore_index=-100):
    target = torch.randint(0, vocab, shape, generator=generator)
    if ignored:
        target[torch.rand(shape, generator=generator) < ignored] = ignore_index
    return target


def make_case(name, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=2.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    if name == "V1":
        return Case(name, randn(3, 1), torch.tensor([0, -100, 0]))
    if name == "below_tile":
        return Case(name, randn(6, 37), _rand_target((6,), 37, g), temperature=0.7)
    if name == "gpt2_vocab":
        return Case(name, randn(2, 50257), torch.tensor([50256, 17]))
    if name == "v131k":
        return Case(name, randn(2, 131072), torch.tensor([3, 131071]))
    if name == "one_row":
        return Case(name, randn(1, 300), torch.tensor([299]))
    if name == "zero_rows":
        return Case(name, randn(0, 64), torch.zeros(0, dtype=torch.long))
    if name == "3d":
        return Case(name, randn(2, 3, 100), _rand_target((2, 3), 100, g), temperature=0.7)
    if name == "shifted":
        base = randn(2, 5, 70)
        return Case(name, base, _rand_target((2, 4), 70, g), view=lambda x: x[:, :-1],
                    temperature=1.3)
    if name == "vocab_strided":
        return Case(name, randn(4, 90), _rand_target((4,), 45, g), view=lambda x: x[:, ::2])
    if name == "neg_inf_off_target":
        base = randn(4, 50)
        target = torch.tensor([3, 10, 0, 49])
        off = torch.rand(4, 50, generator=g) < 0.7
        off[torch.arange(4), target] = False
        return Case(name, base.masked_fill(off, float("-inf")), target)
    if name == "magnitude_1e4":
        return Case(name, randn(4, 64, scale=1e4), _rand_target((4,), 64, g, ignored=0))
    if name == "confident":
        base = randn(4, 64, scale=1.0).float()
        target = torch.tensor([1, 5, 9, 63])
        base[torch.arange(4), target] = 11.0
        return Case(name, base.to(dtype), target)
    if name == "all_ignored":
        return Case(name, randn(3, 40), torch.full((3,), -100))
    if name == "custom_ignore":
        target = torch.tensor([7, 1, 7, 30])
        return Case(name, randn(4, 33), target, ignore_index=7)
    raise KeyError(name)


CASE_NAMES = ["V1", "below_tile", "gpt2_vocab", "v131k", "one_row", "zero_rows", "3d",
              "shifted", "vocab_strided", "neg_inf_off_target", "magnitude_1e4", "confident",
              "all_ignored", "custom_ignore"]


def assert_compiles_like_eager(step, *inputs):
    """``torch.compile(step, fullgraph=True)`` (``aot_eager``) on leaf copies of ``inputs``:
    its outputs (a loss, or a tuple led by one) and the loss's gradients of the inputs equal
    the eager call's. Dynamo starts afresh: a test's cases would exceed its recompile limit."""
    torch._dynamo.reset()
    eager, traced = ([t.clone().requires_grad_(True) for t in inputs] for _ in range(2))
    expected, got = step(*eager), torch.compile(step, fullgraph=True,
                                                backend="aot_eager")(*traced)
    expected, got = ((out if isinstance(out, tuple) else (out,)) for out in (expected, got))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    expected[0].backward()
    got[0].backward()
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a.grad, b.grad)


def leaf(base):
    return base.detach().clone().requires_grad_(True)


def reference_leaf(base):
    return base.detach().double().requires_grad_(True)


def make_logits(shape, dtype, layout="contiguous", scale=3.0, seed=0, device="cpu"):
    """``[A, B, V]`` logits rounded to ``dtype``, in a memory layout (always a view of fresh
    data): ``contiguous``; ``shifted``, the ``x[:, :-1]`` view of causal-LM logits (rows not
    uniformly strided); ``strided_vocab``, vocabulary stride 2; ``transposed``, vocabulary
    stride != 1 and row stride 1."""
    g = torch.Generator().manual_seed(seed)
    a, b, v = shape
    if layout == "contiguous":
        x = torch.randn(a, b, v, generator=g) * scale
    elif layout == "shifted":
        x = (torch.randn(a, b + 1, v, generator=g) * scale)[:, :-1]
    elif layout == "strided_vocab":
        x = (torch.randn(a, b, 2 * v, generator=g) * scale)[..., ::2]
    elif layout == "transposed":
        x = (torch.randn(v, a, b, generator=g) * scale).permute(1, 2, 0)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return x.to(dtype).to(device)


def assert_matches_spec(got, expected, naive, what, dtype):
    """Each of the primitive's outputs ``got`` ({name: tensor}, None to skip) against the
    float64 spec, by the one tolerance model (per element, yardstick the naive path)."""
    from astrai_kernels.testing import assert_close

    for name, actual in got.items():
        if actual is None or expected.get(name) is None:
            continue
        kind = "grad" if name == "grad" else "value"
        if kind == "value":
            assert actual.dtype == torch.float32 and actual.is_contiguous(), f"{what} {name}"
        else:
            assert actual.dtype == dtype, f"{what} {name}"
        assert_close(actual.cpu(), expected[name].detach(), kind, dtype, f"{what} {name}",
                     naive=naive[name].detach(), scale=expected.get(f"{name}_terms"))


def reference_and_naive(run, base):
    """``(expected, naive)`` of ``run(x) -> {name: output}``, where ``run`` also calls backward
    through ``x``, a leaf copy of ``base`` (the gradient is returned as ``"grad"``): in float64,
    and the naive path in each result's dtype (values from float32 logits, the gradient from
    logits of ``base``'s dtype), the yardstick of the per-element comparison."""
    results = {}
    for precision in {torch.float64, torch.float32, base.dtype}:
        x = base.detach().to(precision).requires_grad_(True)
        out = {k: v.detach() for k, v in run(x).items()}
        results[precision] = {**out, "grad": x.grad}
    naive = dict(results[torch.float32], grad=results[base.dtype]["grad"])
    return results[torch.float64], naive


def view_terms(case, terms):
    """Gradient terms of ``case.view(base)`` placed in a float64 tensor shaped like the base."""
    full = torch.zeros(case.base.shape, dtype=torch.float64)
    case.view(full).copy_(terms.reshape(case.view(full).shape))
    return full


def trl_generalized_jsd(student_logits, teacher_logits, labels=None, beta=0.5,
                        temperature=1.0, reduction="batchmean", num_items_in_batch=None,
                        ignore_index=-100):
    """TRL's function as written there (labels' ignore value made a parameter)."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta),
                         teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none",
                              log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none",
                              log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != ignore_index
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


# ---------------------------------------------------------------- reference.py as the primitives
# Each takes a primitive's arguments (astrai_kernels/kernels/primitives.py) and returns its outputs
# {name: tensor} by reference.py in ``precision`` (float64: the expected result; the result's
# own dtype: the naive path, the yardstick of the tolerance model), with the gradient when an
# upstream gradient is given, and in float64 the term sizes of testing/spec.py as ``*_terms``.


def _spec_rows(logits, precision):
    return logits.detach().cpu().reshape(-1, logits.shape[-1]).to(precision).requires_grad_(True)


def _spec_grad(x, logits):
    return (torch.zeros(logits.shape, dtype=x.dtype) if x.grad is None
            else x.grad.reshape(logits.shape))


def _detached(out):
    return {k: None if v is None else v.detach() for k, v in out.items()}


def spec_logprobs(logits, target, temperature, ignore_index, with_entropy, grad_logp=None,
                  grad_entropy=None, precision=torch.float64):
    """``logprobs_forward`` (logp, entropy, lse) and, given ``grad_logp``,
    ``logprobs_backward`` (grad)."""
    x = _spec_rows(logits, precision)
    target = target.cpu().long()
    valid = target != ignore_index
    logp, entropy = reference.token_logprobs(x, target, temperature, ignore_index)
    lse = torch.logsumexp(x / temperature, dim=-1) * valid
    out = {"logp": logp, "entropy": entropy if with_entropy else None, "lse": lse}
    if grad_logp is not None:
        total = (logp * grad_logp.cpu().to(precision).expand(logp.shape)).sum()
        if with_entropy:
            total = total + (entropy * grad_entropy.cpu().to(precision).expand(logp.shape)).sum()
        total.backward()
        out["grad"] = _spec_grad(x, logits)
    if precision == torch.float64:
        terms = spec.logprobs_terms(logits, target, temperature, ignore_index, with_entropy,
                                    grad_logp, grad_entropy)
        out.update({k: v for k, v in terms.items() if v is not None})
    return _detached(out)


def spec_cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                       grad_scale=None, precision=torch.float64, logit_scale=1.0):
    """``cross_entropy_forward``'s (loss, lse) and, given ``grad_scale``, grad."""
    x = _spec_rows(logits, precision)
    target = target.cpu().long()
    valid = target != ignore_index
    loss = reference.cross_entropy(x, target, ignore_index, "none", label_smoothing, z_loss,
                                   softcap or None, logit_scale=logit_scale)
    lse = torch.logsumexp(reference.transform_logits(x, logit_scale, softcap or None), dim=-1)
    out = {"loss": loss, "lse": lse * valid}
    if grad_scale is not None:
        (loss * grad_scale.cpu().to(precision).expand(loss.shape)).sum().backward()
        out["grad"] = _spec_grad(x, logits)
        if precision == torch.float64:
            out["grad_terms"] = spec.cross_entropy_terms(logits, target, ignore_index,
                                                         label_smoothing, z_loss, softcap,
                                                         grad_scale, logit_scale)
    return _detached(out)


def spec_grpo(logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
              clip_low, clip_high, delta, beta, kl_ratio_correction=False, with_entropy=False,
              with_grad=True, precision=torch.float64):
    """``grpo_forward``'s (logp, loss, entropy) and grad of ``sum(token_weight * loss)``; the
    KL term as ``reference.grpo_loss`` states it (``k3 * r`` with ``kl_ratio_correction``)."""
    def rows(t):
        return None if t is None else t.detach().cpu().to(precision)

    x = _spec_rows(logits, precision)
    weight = rows(token_weight)
    active = weight != 0
    masked_target = torch.where(active, target.cpu().long(), -100)
    logp, entropy = reference.token_logprobs(x, masked_target, temperature, -100)
    ref = rows(ref_logprobs) if beta > 0 else None
    loss, ratio, k3 = reference.grpo_token_loss(logp, rows(old_logprobs), ref, rows(advantages),
                                                clip_low, clip_high,
                                                delta if delta > 0 else None, 0.0)
    if ref is not None:
        loss = loss + beta * (k3 * ratio if kl_ratio_correction else k3)
    loss = torch.where(active, loss, 0.0)
    out = {"logp": logp, "loss": loss, "entropy": entropy if with_entropy else None}
    if with_entropy and precision == torch.float64:
        out["entropy_terms"] = spec.logprobs_terms(logits, masked_target, temperature, -100,
                                                   True)["entropy_terms"]
    if with_grad:
        (loss * weight).sum().backward()
        out["grad"] = _spec_grad(x, logits)
        if precision == torch.float64:
            out["grad_terms"] = spec.grpo_terms(logits, target, temperature, advantages,
                                                old_logprobs, ref_logprobs, token_weight,
                                                clip_low, clip_high, delta, beta,
                                                kl_ratio_correction)
    return _detached(out)


def spec_expected_and_naive(primitive, logits, *args, **kwargs):
    """``(expected, naive)``: ``primitive`` (one of the above) in float64, and the naive path in
    each result's dtype (values in float32, the gradient in the logits' dtype)."""
    expected = primitive(logits, *args, precision=torch.float64, **kwargs)
    naive = primitive(logits, *args, precision=torch.float32, **kwargs)
    if logits.dtype not in (torch.float32, torch.float64) and "grad" in expected:
        naive["grad"] = primitive(logits, *args, precision=logits.dtype, **kwargs)["grad"]
    return expected, naive


def shard_grad_float64(logits, target, lse, alpha, beta, gamma, delta, temperature, softcap,
                       ignore_index=-100):
    """``(1/T) dz/dx (p (alpha + beta log p) + gamma d_jy + delta)`` in float64, with its term
    sizes (the scale of the tolerance)."""
    x = logits.double().reshape(-1, logits.shape[-1])
    z = softcap * torch.tanh(x / softcap) if softcap else x
    t2 = torch.tanh(x / softcap) ** 2 if softcap else torch.zeros_like(x)
    dz = 1.0 - t2  # itself formed by two terms: its size is 1 + t2
    log_p = (z / temperature - lse.double()[:, None]).clamp(min=-1e4)
    p = log_p.exp()
    rows = torch.arange(x.shape[0])
    owned = (target >= 0) & (target < x.shape[1])
    onehot = torch.zeros_like(x)
    onehot[rows[owned], target[owned]] = 1.0
    b = 0.0 if beta is None else beta.double()[:, None]
    d = 0.0 if delta is None else delta.double()[:, None]
    a, g = alpha.double()[:, None], gamma.double()[:, None]
    grad = dz * (p * (a + b * log_p) + g * onehot + d) / temperature
    scale = (1.0 + t2) * (p * (a.abs() + (b * log_p).abs()) + g.abs() * onehot + abs(d))
    scale = scale / temperature
    ignored = (target == ignore_index)[:, None]
    return (torch.where(ignored, 0.0, grad).reshape(logits.shape),
            torch.where(ignored, 0.0, scale).reshape(logits.shape))


def scale_a_logits_gradient_entry(monkeypatch, factor=1.01):
    """A deliberately wrong gradient: the fused head folds one entry of the loss's logit
    gradient, the largest of every walk's first chunk, scaled by ``factor``. Tests of the
    model row of the tolerance table show it still fails them. (An entry of 1e-5 of the
    largest, scaled so, moves the gradients by less than float32's own noise: no bound can.)"""
    from astrai_kernels.ops import head

    fold = head.ChunkedHead.fold

    def scaled_fold(self, start, stop, grad_logits):
        if start == 0:
            entries = grad_logits.view(-1)
            entries[entries.abs().argmax()] *= factor
        return fold(self, start, stop, grad_logits)

    monkeypatch.setattr(head.ChunkedHead, "fold", scaled_fold)
