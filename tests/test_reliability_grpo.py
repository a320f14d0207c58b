"""GRPO, DPO and advantages: an independent spec, non-finite values at masked positions, the
zero token count, clear errors for bad input, and the seed baselines of
``baselines/original.py``."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.baselines import original
from astrai_kernels.strategies import SEQStrategy, SFTStrategy
from astrai_kernels.strategies import base as strategy_base
from astrai_kernels.strategies import dpo as strategy_dpo
from astrai_kernels.strategies import grpo as strategy_grpo
from astrai_kernels.strategies import logprobs as strategy_logprobs
from astrai_kernels.strategies import masks as strategy_masks
from astrai_kernels.strategies import sft as strategy_sft
from astrai_kernels.testing import ToyRolloutRunner, assert_close, spec

from cases import KERNEL_BACKENDS

ALL_BACKENDS = KERNEL_BACKENDS + ["reference"]


def _batch(batch=3, length=5, vocab=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=g) * 2
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    mask[:, -1] = 0.0
    logp = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = (logp + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.2 * torch.randn(batch, length, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(batch, generator=g)
    return logits, target, mask, advantages, old, ref


def _loss_and_grad(backend, logits, target, advantages, **kwargs):
    x = logits.clone().requires_grad_(True)
    loss, metrics = ak.grpo_loss(x, target, advantages, backend=backend, **kwargs)
    loss.backward()
    return loss.detach(), metrics, x.grad


# ---------------------------------------------------------------- an independent spec


def test_ops_do_not_call_the_spec(monkeypatch):
    """Production paths run with every function of reference.py broken."""
    logits, target, mask, advantages, old, ref = _batch()
    expected = {}
    for sampling in ("token", "sequence"):
        expected[sampling] = ak.grpo_loss(logits, target, advantages, mask=mask,
                                          old_logprobs=old, ref_logprobs=ref, beta=0.1,
                                          importance_sampling=sampling, backend="torch")[0]
    pc, pr, rc, rr = (torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(4))
    expected_dpo = ak.dpo_loss(pc, pr, rc, rr)[0]
    rewards = torch.tensor([[1.0, 2.0, 4.0], [0.0, 0.0, 0.0]])
    expected_adv = ak.group_advantages(rewards)

    def broken(*args, **kwargs):
        raise AssertionError("production code called reference.py")

    for name, value in vars(reference).items():
        if inspect.isfunction(value) and value.__module__ == reference.__name__:
            monkeypatch.setattr(reference, name, broken)
    for sampling in ("token", "sequence"):
        loss, _ = ak.grpo_loss(logits, target, advantages, mask=mask, old_logprobs=old,
                               ref_logprobs=ref, beta=0.1, importance_sampling=sampling,
                               backend="torch")
        assert torch.equal(loss, expected[sampling])
    assert torch.equal(ak.dpo_loss(pc, pr, rc, rr)[0], expected_dpo)
    assert torch.equal(ak.group_advantages(rewards), expected_adv)
    with pytest.raises(AssertionError, match="reference.py"):
        ak.grpo_loss(logits, target, advantages, mask=mask, backend="reference")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_matches_the_spec_in_float64(loss_type):
    g = torch.Generator().manual_seed(5)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    smoothing = 0.1 if loss_type in ("sigmoid", "robust") else 0.0  # ipo, hinge: an error
    leaf = pc.float().requires_grad_(True)
    loss, metrics = ak.dpo_loss(leaf, pr.float(), rc.float(), rr.float(), beta=0.3,
                                loss_type=loss_type, label_smoothing=smoothing)
    leaf64 = pc.clone().requires_grad_(True)
    expected, expected_metrics = reference.dpo_loss(leaf64, pr, rc, rr, 0.3, loss_type, smoothing)
    loss.backward()
    expected.backward()
    assert_close(loss, expected, "value", torch.float32)
    assert_close(leaf.grad, leaf64.grad, "grad", torch.float32)
    for key, value in expected_metrics.items():
        assert metrics[key].dtype == torch.float32 and not metrics[key].requires_grad
        assert_close(metrics[key], value, "value", torch.float32, key)


# ---------------------------------------------------------------- baselines/original.py: the seed


def test_naive_token_logprobs_and_cross_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 23, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 23, (2, 6), generator=g)
    expected, _ = reference.token_logprobs(logits.double(), target)
    got = original.log_softmax_gather(logits, target)
    assert got.dtype == torch.float32
    assert_close(got, expected, "value", torch.float32)
    target[0, :3] = -100
    x = logits.float().requires_grad_(True)
    loss = original.cross_entropy(x, target, label_smoothing=0.1)
    torch_loss = F.cross_entropy(logits.float().reshape(-1, 23), target.reshape(-1),
                                 label_smoothing=0.1)
    assert_close(loss, torch_loss, "value", torch.float32)


def test_naive_cross_entropy_all_ignored_is_zero_with_zero_gradient():
    x = torch.randn(2, 3, 7, requires_grad=True)
    loss = original.cross_entropy(x, torch.full((2, 3), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0


def test_naive_grpo_step_matches_the_spec():
    """The seed's GRPO (bnpo, symmetric clip, k3) equals the spec while log-ratios stay
    inside the spec's +-20 clamp."""
    g = torch.Generator().manual_seed(2)
    batch, length, vocab = 4, 6, 19
    policy, old_logits, ref_logits = (torch.randn(batch, length, vocab, generator=g,
                                                  dtype=torch.float64) for _ in range(3))
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.3).double()
    advantages = original.group_advantages(torch.rand(batch // 2, 2, generator=g)).reshape(-1)
    x = policy.clone().requires_grad_(True)
    loss = original.grpo_step(x, old_logits, ref_logits, target, advantages, mask, 0.2, 0.05)
    loss.backward()
    old, _ = reference.token_logprobs(old_logits, target)
    ref, _ = reference.token_logprobs(ref_logits, target)
    xd = policy.clone().requires_grad_(True)
    expected, _ = reference.grpo_loss(xd, target, advantages.double(), mask, old, ref,
                                      beta=0.05, loss_type="bnpo")
    expected.backward()
    assert_close(loss, expected, "value", torch.float32)
    # The seed computes in float32: judge its gradient by the sizes of the terms forming it.
    token_weight = mask / mask.sum()
    per_token = advantages.double().unsqueeze(1).expand(batch, length)
    terms = spec.grpo_terms(policy, target.reshape(-1), 1.0, per_token.reshape(-1),
                            old.reshape(-1), ref.reshape(-1), token_weight.reshape(-1), 0.2, 0.2,
                            0.0, 0.05)
    assert_close(x.grad, xd.grad, "grad", torch.float32, scale=terms)


def test_naive_grpo_loss_metrics_and_on_policy():
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(2, 3, 5, generator=g) - 3
    mask = torch.ones(2, 3, 5)
    mask[..., -2:] = 0
    advantages = original.group_advantages(torch.randn(2, 3, generator=g)).unsqueeze(-1)
    loss, metrics = original.grpo_loss(logp, None, None, advantages, mask)
    # On policy the ratio is 1: the loss is -mean(A) over the unmasked tokens.
    expected = -(advantages.expand_as(mask) * mask).sum() / mask.sum()
    assert_close(loss, expected, "value", torch.float32)
    assert metrics["ratio/mean"].item() == pytest.approx(1.0)
    assert metrics["kl"].item() == 0.0 and metrics["clip_ratio/region"].item() == 0.0


def test_naive_dpo_is_the_sigmoid_loss_of_the_spec():
    g = torch.Generator().manual_seed(4)
    pc, pr, rc, rr = (torch.randn(5, generator=g) for _ in range(4))
    loss, metrics = original.dpo_loss(pc, pr, rc, rr, 0.2)
    expected, expected_metrics = reference.dpo_loss(pc.double(), pr.double(), rc.double(),
                                                    rr.double(), 0.2)
    assert_close(loss, expected, "value", torch.float32)
    for key, value in expected_metrics.items():
        assert_close(metrics[key], value, "value", torch.float32, key)


# ---------------------------------------------------------------- the reference backend's contract


def test_reference_logprobs_ignore_non_finite_rows():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(6))
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    target = torch.tensor([2, -100, -100, 5])
    x = logits.clone().requires_grad_(True)
    logp, entropy = ak.token_logprobs(x, target, return_entropy=True, backend="reference")
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert logp[1] == 0 and logp[2] == 0 and entropy[1] == 0 and entropy[2] == 0
    assert torch.isfinite(x.grad).all() and torch.count_nonzero(x.grad[1:3]) == 0
    expected = torch.log_softmax(logits[[0, 3]].double(), -1)[[0, 1], [2, 5]]
    assert_close(logp[[0, 3]], expected, "value", torch.float32)


def test_reference_cross_entropy_ignores_non_finite_rows():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(7))
    logits[1] = float("nan")
    logits[2, 0] = float("inf")
    target = torch.tensor([2, -100, -100, 5])
    x = logits.clone().requires_grad_(True)
    loss = ak.cross_entropy(x, target, label_smoothing=0.1, backend="reference")
    loss.backward()
    expected = F.cross_entropy(logits[[0, 3]].double(), target[[0, 3]], label_smoothing=0.1)
    assert_close(loss, expected, "value", torch.float32)
    assert torch.isfinite(x.grad).all() and torch.count_nonzero(x.grad[1:3]) == 0


def test_reference_cross_entropy_huge_lse_without_z_loss():
    """|lse| > 1.8e19: lse**2 overflows fp32, and 0 * inf is NaN unless z_loss is left out."""
    logits = torch.tensor([[3e19, 0.0, -1.0], [1.0, 2.0, 3.0]])
    target = torch.tensor([1, 1])
    loss = ak.cross_entropy(logits, target, reduction="none", backend="reference")
    expected = F.cross_entropy(logits.double(), target, reduction="none")
    assert torch.isfinite(loss).all()
    assert_close(loss, expected, "value", torch.float32)


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_nan_logits_at_masked_tokens(backend, importance_sampling):
    logits, target, mask, advantages, old, ref = _batch(seed=8)
    kwargs = dict(mask=mask, old_logprobs=old, ref_logprobs=ref, beta=0.1,
                  importance_sampling=importance_sampling)
    clean_loss, clean_metrics, clean_grad = _loss_and_grad(backend, logits, target, advantages,
                                                           **kwargs)
    poisoned = torch.where((mask == 0).unsqueeze(-1), float("nan"), logits)
    loss, metrics, grad = _loss_and_grad(backend, poisoned, target, advantages, **kwargs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean_loss)
    assert torch.equal(grad, clean_grad)
    for key, value in clean_metrics.items():
        assert torch.equal(metrics[key], value), key


# ------------------------------------------------------- non-finite values at masked tokens


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_non_finite_old_ref_and_advantages_at_masked_tokens(backend, importance_sampling):
    logits, target, mask, _, old, ref = _batch(seed=9)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    kwargs = dict(mask=mask, beta=0.1, importance_sampling=importance_sampling)
    clean = _loss_and_grad(backend, logits, target, advantages, old_logprobs=old,
                           ref_logprobs=ref, **kwargs)
    masked = mask == 0
    bad_old = torch.where(masked, float("nan"), old)
    bad_old[0][masked[0]] = float("-inf")
    bad_ref = torch.where(masked, float("nan"), ref)
    bad_advantages = torch.where(masked, float("inf"), advantages)
    loss, metrics, grad = _loss_and_grad(backend, logits, target, bad_advantages,
                                         old_logprobs=bad_old, ref_logprobs=bad_ref, **kwargs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean[0]) and torch.equal(grad, clean[2])
    for key, value in clean[1].items():
        assert torch.isfinite(metrics[key]), key
        assert torch.equal(metrics[key], value), key


# ---------------------------------------------------------------- a zero global token count


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_dapo_zero_token_count_gives_zero_loss_and_gradient(backend, importance_sampling):
    logits, target, _, advantages, old, _ = _batch(seed=10)
    mask = torch.zeros(target.shape)
    target = torch.full_like(target, 10**6)  # never read under the mask
    for normalizer in (mask.sum(), 0, 0.0):
        loss, metrics, grad = _loss_and_grad(
            backend, logits, target, advantages, mask=mask, old_logprobs=old,
            loss_type="dapo", normalizer=normalizer, importance_sampling=importance_sampling)
        assert loss.item() == 0.0
        assert torch.count_nonzero(grad) == 0
        assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_dapo_tensor_normalizer_scales_the_loss(backend):
    logits, target, mask, advantages, old, _ = _batch(seed=11)
    base = _loss_and_grad(backend, logits, target, advantages, mask=mask, old_logprobs=old,
                          loss_type="dapo")
    scaled = _loss_and_grad(backend, logits, target, advantages, mask=mask, old_logprobs=old,
                            loss_type="dapo", normalizer=torch.tensor(4.0) * mask.sum())
    assert_close(scaled[0], base[0] / 4, "value", torch.float32)
    assert_close(scaled[2], base[2] / 4, "grad", torch.float32)


# ---------------------------------------------------------------- clear errors


def _grpo_error(**kwargs):
    logits, target, mask, advantages, old, ref = _batch()
    kwargs.setdefault("mask", mask)
    return ak.grpo_loss(logits, target, kwargs.pop("advantages", advantages), **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(beta=float("inf"), ref_logprobs=torch.zeros(3, 5)), ValueError, "beta"),
    (dict(beta=float("nan"), ref_logprobs=torch.zeros(3, 5)), ValueError, "beta"),
    (dict(old_logprobs=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "old_logprobs"),
    (dict(ref_logprobs=torch.zeros(3, 5, dtype=torch.int32), beta=0.1), TypeError,
     "ref_logprobs"),
    (dict(ref_logprobs=torch.zeros(3, 4), beta=0.1), ValueError, "ref_logprobs"),
    (dict(mask=torch.full((3, 5), 2.0)), ValueError, "mask must hold only 0 and 1"),
    (dict(mask=torch.full((3, 5), 2)), ValueError, "mask must hold only 0 and 1"),
    (dict(mask=torch.full((3, 5), 0.5)), ValueError, "mask must hold only 0 and 1"),
    (dict(mask=torch.full((3, 5), float("nan"))), ValueError, "mask must hold only 0 and 1"),
    (dict(mask=torch.ones(3, 5, device="meta")), ValueError, "mask is on meta"),
    (dict(clip_eps_high=-0.1), ValueError, "clip_eps_high"),
    (dict(max_completion_length=0, loss_type="dr_grpo"), ValueError, "max_completion_length"),
    (dict(max_completion_length=-4, loss_type="dr_grpo"), ValueError, "max_completion_length"),
    (dict(max_completion_length=2.5, loss_type="dr_grpo"), TypeError, "max_completion_length"),
    (dict(loss_type="dapo", normalizer=torch.tensor(-5.0)), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=torch.tensor(0.0)), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=0), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=-5), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=torch.tensor(float("inf"))), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=torch.tensor(float("nan"))), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer=torch.ones(2)), ValueError, "normalizer"),
    (dict(loss_type="dapo", normalizer="10"), TypeError, "normalizer"),
    (dict(loss_type="bnpo", normalizer=10.0), ValueError, "normalizer applies to"),
    (dict(loss_type="grpo", normalizer=torch.tensor(10.0)), ValueError, "normalizer applies to"),
    (dict(loss_type="dr_grpo", normalizer=10), ValueError, "normalizer applies to"),
    (dict(advantages=torch.ones(3, dtype=torch.bool)), TypeError, "advantages"),
])
def test_grpo_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        _grpo_error(**kwargs)


def test_grpo_bool_and_integer_masks_equal_float_mask():
    logits, target, mask, advantages, old, _ = _batch(seed=12)
    expected, _ = ak.grpo_loss(logits, target, advantages, mask=mask, old_logprobs=old,
                               backend="torch")
    for other in (mask.bool(), mask.long(), mask.double()):
        loss, _ = ak.grpo_loss(logits, target, advantages, mask=other, old_logprobs=old,
                               backend="torch")
        assert torch.equal(loss, expected)


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("x", "y"), {}, TypeError, "policy_chosen"),
    ((torch.zeros(3, dtype=torch.int64), torch.zeros(3)), {}, TypeError, "policy_chosen"),
    ((torch.zeros(3), torch.zeros(3, dtype=torch.int32)), {}, TypeError, "policy_rejected"),
    ((torch.zeros(3, 1), torch.zeros(3, 1)), {}, ValueError, "policy_chosen"),
    ((torch.zeros(3), torch.zeros(4)), {}, ValueError, "policy_rejected"),
    ((torch.zeros(3), torch.zeros(3, device="meta")), {}, ValueError, "policy_rejected is on"),
    ((torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.zeros(3)), {}, ValueError,
     "ref_chosen"),
    ((torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.int64)), {},
     TypeError, "ref_rejected"),
    ((torch.zeros(3), torch.zeros(3), None, torch.zeros(3)), {}, ValueError, "neither"),
    ((torch.zeros(3), torch.zeros(3)), dict(beta=float("inf")), ValueError, "beta"),
    ((torch.zeros(3), torch.zeros(3)), dict(beta=-0.1), ValueError, "beta"),
    ((torch.zeros(3), torch.zeros(3)), dict(beta="0.1"), TypeError, "beta"),
    ((torch.zeros(3), torch.zeros(3)), dict(label_smoothing=-0.1), ValueError,
     "label_smoothing"),
    ((torch.zeros(3), torch.zeros(3)), dict(loss_type="robust", label_smoothing=0.6),
     ValueError, "label_smoothing"),
    ((torch.zeros(3), torch.zeros(3)), dict(loss_type="kto"), ValueError, "loss_type"),
])
def test_dpo_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ak.dpo_loss(*args, **kwargs)


# ---------------------------------------------------------------- group advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_tied_groups_are_zero_with_eps_zero(scale):
    # 0.1 * 3 / 3 != 0.1 in float32: the centred values of the tied group are rounding noise.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 2.0, 4.0], [7.0, 7.0, 7.0]])
    out = ak.group_advantages(rewards, scale=scale, eps=0.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[[0, 2]], torch.zeros(2, 3))
    centred = rewards[1].double() - rewards[1].double().mean()
    if scale == "group":
        centred = centred / centred.pow(2).mean().sqrt()
    elif scale == "batch":
        centred = centred / rewards.double().std(unbiased=False)
    assert_close(out[1], centred, "value", torch.float32)
    spec = reference.group_advantages(rewards.double(), scale, 0.0)
    assert torch.equal(spec[[0, 2]], torch.zeros(2, 3, dtype=torch.float64))


def test_group_advantages_whole_batch_tied_and_bad_input():
    assert torch.equal(ak.group_advantages(torch.full((2, 3), 0.3), scale="batch", eps=0.0),
                       torch.zeros(2, 3))
    assert ak.group_advantages(torch.tensor([[1, 2, 3]])).dtype == torch.float32
    with pytest.raises(ValueError, match="eps"):
        ak.group_advantages(torch.ones(2, 2), eps=float("inf"))
    with pytest.raises(ValueError, match="eps"):
        ak.group_advantages(torch.ones(2, 2), eps=-1e-6)
    with pytest.raises(TypeError, match="rewards"):
        ak.group_advantages(torch.ones(2, 2, dtype=torch.bool))


# ---------------------------------------------------------------- structure and annotations


def _public_functions(module):
    return [value for name, value in vars(module).items()
            if inspect.isfunction(value) and not name.startswith("_")
            and value.__module__ == module.__name__]


def _strategy_functions():
    found = []
    for module in (strategy_base, strategy_dpo, strategy_grpo, strategy_logprobs, strategy_masks,
                   strategy_sft):
        found += _public_functions(module)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                found += [fn for name, fn in vars(value).items() if inspect.isfunction(fn)
                          and (not name.startswith("_") or name == "__init__")]
    return found


@pytest.mark.parametrize("fn", [ak.grpo_loss, ak.dpo_loss, ak.group_advantages]
                         + _public_functions(reference) + _public_functions(original)
                         + _strategy_functions(),
                         ids=lambda fn: f"{fn.__module__}.{fn.__qualname__}")
def test_public_functions_are_annotated(fn):
    signature = inspect.signature(fn)
    if fn.__name__ != "__init__":
        assert signature.return_annotation is not inspect.Signature.empty
    missing = [name for name, p in signature.parameters.items()
               if p.annotation is inspect.Parameter.empty and name not in ("self", "cls")
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not missing, f"{fn.__name__}: unannotated {missing}"


def test_sft_reuses_seq_and_dead_code_is_gone():
    assert issubclass(SFTStrategy, SEQStrategy)
    for name in ("__init__", "compute_loss", "compute_loss_output"):
        assert name not in vars(SFTStrategy), name
    assert not hasattr(ToyRolloutRunner, "clear_cache")

