"""``GRPOOptions``: one object for the GRPO family's scalar options, equal to the keywords."""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference

KEYWORDS = dict(beta=0.04, clip_eps_low=0.1, clip_eps_high=0.3, loss_type="dapo",
                temperature=0.7, entropy_coef=0.01, top_entropy_quantile=0.5)


def _batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 13, generator=g)
    target = torch.randint(0, 13, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    advantages = torch.randn(2, generator=g)
    ref = torch.randn(2, 5, generator=g) * 0.1 - 2.5
    return logits, target, mask, advantages, ref


@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_options_object_equals_the_keywords(backend):
    logits, target, mask, advantages, ref = _batch()
    results = []
    for call in (dict(**KEYWORDS), dict(options=ak.GRPOOptions(**KEYWORDS))):
        x = logits.clone().requires_grad_()
        loss, metrics = ak.grpo_loss(x, target, advantages, mask=mask, ref_logprobs=ref,
                                     backend=backend, **call)
        loss.backward()
        results.append((loss.detach(), metrics, x.grad))
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert metrics_a.keys() == metrics_b.keys()
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


def test_linear_options_object_equals_the_keywords():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(13, 8, generator=g)
    _, target, mask, advantages, ref = _batch()
    by_keywords = ak.linear_grpo_loss(hidden, weight, target, advantages, mask=mask,
                                      ref_logprobs=ref, backend="torch", **KEYWORDS)[0]
    by_object = ak.linear_grpo_loss(hidden, weight, target, advantages, mask=mask,
                                    ref_logprobs=ref, backend="torch",
                                    options=ak.GRPOOptions(**KEYWORDS))[0]
    assert torch.equal(by_keywords, by_object)


def test_the_spec_takes_the_options_object():
    logits, target, mask, advantages, ref = _batch()
    x = logits.double()
    by_keywords = reference.grpo_loss(x, target, advantages.double(), mask, None, ref.double(),
                                      **KEYWORDS)[0]
    by_object = reference.grpo_loss(x, target, advantages.double(), mask, None, ref.double(),
                                    options=ak.GRPOOptions(**KEYWORDS))[0]
    assert torch.equal(by_keywords, by_object)


def test_options_and_keywords_together_are_refused():
    logits, target, mask, advantages, ref = _batch()
    with pytest.raises(ValueError, match=r"\['beta'\] given beside options"):
        ak.grpo_loss(logits, target, advantages, ref_logprobs=ref, beta=0.1,
                     options=ak.GRPOOptions(beta=0.04))
    with pytest.raises(TypeError, match="options must be a GRPOOptions"):
        ak.grpo_loss(logits, target, advantages, options={"beta": 0.1})


def test_options_are_checked_like_the_keywords():
    logits, target, mask, advantages, ref = _batch()
    with pytest.raises(ValueError, match="clip_eps_low"):
        ak.grpo_loss(logits, target, advantages, options=ak.GRPOOptions(clip_eps_low=1.5))
    with pytest.raises(ValueError, match="sapo_tau_pos applies to loss_type='sapo'"):
        ak.grpo_loss(logits, target, advantages, options=ak.GRPOOptions(sapo_tau_pos=2.0))


def _linear_grpo_loss(logits, target, advantages, **keywords):
    """``linear_grpo_loss`` on an identity head, so its logits are ``logits``."""
    eye = torch.eye(logits.shape[-1])
    return ak.linear_grpo_loss(logits, eye, target, advantages, **keywords)


def _spec_grpo_loss(logits, target, advantages, **keywords):
    return reference.grpo_loss(logits, target, advantages, **keywords)


@pytest.mark.parametrize("op", [ak.grpo_loss, _linear_grpo_loss, _spec_grpo_loss],
                         ids=["grpo_loss", "linear_grpo_loss", "reference.grpo_loss"])
@pytest.mark.parametrize("keyword", [dict(beta=0.0), dict(loss_type="bnpo"),
                                     dict(clip_eps_high=None), dict(temperature=1.0)],
                         ids=lambda keyword: next(iter(keyword)))
def test_a_keyword_at_its_default_beside_options_is_refused(op, keyword):
    # the value equals the keyword's default, yet it was passed: options= must not win silently
    logits, target, mask, advantages, ref = _batch()
    dapo = ak.GRPOOptions(beta=0.04, loss_type="dapo", temperature=0.7)
    name = next(iter(keyword))
    with pytest.raises(ValueError, match=rf"\['{name}'\] given beside options"):
        op(logits, target, advantages, ref_logprobs=ref, options=dapo, **keyword)


def test_the_spec_refuses_a_positional_option_beside_options():
    logits, target, mask, advantages, ref = _batch()
    with pytest.raises(ValueError, match=r"\['beta'\] given beside options"):
        reference.grpo_loss(logits, target, advantages, mask, None, ref, 0.0,
                            options=ak.GRPOOptions(beta=0.04))


def test_the_plan_refuses_a_keyword_beside_options():
    from astrai_kernels.ops import grpo as grpo_op

    logits, target, mask, advantages, ref = _batch()
    with pytest.raises(ValueError, match=r"\['beta'\] given beside options"):
        grpo_op.plan(logits, target, advantages, ak.GRPOOptions(beta=0.04), ref_logprobs=ref,
                     beta=0.0)
