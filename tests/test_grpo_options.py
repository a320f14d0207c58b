"""``GRPOOptions``: one object for the GRPO family's scalar options, equal to the keywords."""

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.ops._common import LogitsShape

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
        grpo_op.plan(LogitsShape.of(logits), target, advantages, ak.GRPOOptions(beta=0.04),
                     ref_logprobs=ref, beta=0.0)


def _keyword_defaults(function):
    import inspect

    return {name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


# the strategy's seed names for two options; its kl_coef default (0.01) is the seed's
STRATEGY_NAMES = {"beta": "kl_coef", "clip_eps_low": "clip_eps"}


@pytest.mark.parametrize("function", [ak.grpo_loss, ak.linear_grpo_loss, reference.grpo_loss],
                         ids=["grpo_loss", "linear_grpo_loss", "reference.grpo_loss"])
def test_the_public_keywords_are_the_options_fields_with_their_defaults(function):
    from dataclasses import fields

    defaults = _keyword_defaults(function)
    for field in fields(ak.GRPOOptions):
        assert field.name in defaults, field.name
        assert defaults[field.name] == field.default, field.name


def test_the_strategy_keywords_have_the_options_defaults():
    from dataclasses import fields

    from astrai_kernels.strategies.grpo import GRPOStrategy

    defaults = _keyword_defaults(GRPOStrategy.__init__)
    shared = [f for f in fields(ak.GRPOOptions)
              if STRATEGY_NAMES.get(f.name, f.name) in defaults]
    # the strategy takes every option of the seed's and TRL's loss, not the rollout correction
    assert {f.name for f in fields(ak.GRPOOptions)} - {f.name for f in shared} == {
        name for name in (f.name for f in fields(ak.GRPOOptions)) if name.startswith("rollout_")}
    for field in shared:
        if field.name not in STRATEGY_NAMES:
            assert defaults[field.name] == field.default, field.name
    assert defaults["clip_eps"] == ak.GRPOOptions().clip_eps_low


def test_checked_options_resolve_the_kernel_arguments_and_check_again_to_themselves():
    from astrai_kernels.options.grpo import LOSS_TYPE_RECORDS

    for name, record in LOSS_TYPE_RECORDS.items():
        options = ak.GRPOOptions(loss_type=name, clip_eps_low=0.1,
                                 clip_eps_high=5.0 if record.clip_high == "required" else None)
        checked = options.checked()
        assert checked.checked() == checked
        args = checked.surrogate_args()
        assert args.clip_eps_high == (5.0 if record.clip_high == "required" else 0.1)
        assert args.delta == 0.0
    args = ak.GRPOOptions(clip_eps_high=0.28, delta=2.0).checked().surrogate_args()
    assert (args.clip_eps_low, args.clip_eps_high, args.delta) == (0.2, 0.28, 2.0)


@pytest.mark.parametrize("options, match", [
    (dict(clip_eps_low=1.5), "clip_eps_low"),
    (dict(loss_type="ppo"), "loss_type"),
    (dict(loss_type="cispo"), "loss_type='cispo' needs clip_eps_high"),
    (dict(loss_type="sapo", clip_eps_high=0.3), "clip_eps_high does not apply"),
    (dict(loss_type="sapo", delta=2.0), "delta caps the clipped surrogate"),
    (dict(vespo_k_pos=1.0), "vespo_k_pos applies to loss_type='vespo'"),
    (dict(temperature=0.0), "temperature"),
    (dict(rollout_is="token_truncate", rollout_is_max=None), "needs rollout_is_min or"),
    (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold applies with rollout_rs only"),
])
def test_the_options_check_themselves_without_tensors(options, match):
    with pytest.raises(ValueError, match=match):
        ak.GRPOOptions(**options).checked()


def test_every_loss_type_has_a_record_the_ops_read():
    from astrai_kernels.options.grpo import (
        CLIPPED_LOSS_TYPES,
        GLOBAL_COUNT_LOSS_TYPES,
        LOSS_TYPE_RECORDS,
        LOSS_TYPES,
    )

    assert LOSS_TYPES == tuple(LOSS_TYPE_RECORDS)
    assert set(CLIPPED_LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo"}
    assert set(GLOBAL_COUNT_LOSS_TYPES) == {"dapo", "cispo", "vespo", "sapo_token_mean"}
    for record in LOSS_TYPE_RECORDS.values():
        assert record.citation
        assert record.policy in ("clipped", "cispo", "sapo", "vespo")
        assert record.token_weight in ("sequence_mean", "token_mean", "max_length",
                                       "sequence_sum", "global_count")


def test_each_loss_type_reports_the_metrics_its_record_names():
    from astrai_kernels.options.grpo import LOSS_TYPE_RECORDS

    logits, target, mask, advantages, _ = _batch()
    for name, record in LOSS_TYPE_RECORDS.items():
        _, metrics = ak.grpo_loss(logits, target, advantages, mask=mask, loss_type=name,
                                  clip_eps_high=5.0 if record.clip_high == "required" else None,
                                  backend="torch")
        others = {m for r in LOSS_TYPE_RECORDS.values() for m in r.metrics} - set(record.metrics)
        assert set(record.metrics) <= set(metrics), name
        assert not others & set(metrics), name
