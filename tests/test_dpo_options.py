"""``DPOOptions``: one object for ``ak.dpo_loss``'s scalar options, equal to the keywords
(``ops/preference.py``). The smaller preference ops take keywords only."""

import inspect
import math
from dataclasses import fields

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.ops.preference import DISCOPOP_TAU, DPO_LOSS_TYPES
from astrai_kernels.strategies.dpo import DPOStrategy


def _pairs():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(6, generator=g) * 4 - 20 for _ in range(4)]


def _keyword_defaults(function):
    return {name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("function", [ak.dpo_loss, DPOStrategy.__init__],
                         ids=["dpo_loss", "DPOStrategy"])
def test_the_public_keywords_are_the_options_fields_with_their_defaults(function):
    defaults = _keyword_defaults(function)
    for field in fields(ak.DPOOptions):
        assert field.name in defaults, field.name
        assert defaults[field.name] == field.default, field.name


def test_the_spec_takes_the_options_fields():
    # the spec's discopop_tau is the number the options' None stands for
    defaults = _keyword_defaults(reference.dpo_loss)
    for field in fields(ak.DPOOptions):
        expected = DISCOPOP_TAU if field.name == "discopop_tau" else field.default
        assert defaults[field.name] == expected, field.name


def test_the_op_takes_options_and_no_other_scalar_of_the_loss():
    inputs = {"policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected", "bco_delta",
              "chosen_lengths", "rejected_lengths", "options"}
    names = set(inspect.signature(ak.dpo_loss).parameters)
    assert names - inputs == {field.name for field in fields(ak.DPOOptions)}


def _options_for(loss_type):
    keywords = dict(beta=0.3, loss_type=loss_type)
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    if {"exo_pair", "robust", "sigmoid"} & set(types):
        keywords["label_smoothing"] = 0.1
    if "discopop" in types:
        keywords["discopop_tau"] = 0.2
    if not isinstance(loss_type, str):
        keywords["loss_weights"] = [1.0, 0.5, 2.0][:len(types)]
    return keywords


def _inputs_for(loss_type):
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    extra = {}
    if "sigmoid_norm" in types:
        extra.update(chosen_lengths=torch.tensor([3, 5, 1, 7, 2, 4]),
                     rejected_lengths=torch.tensor([4, 4, 6, 1, 2, 8]))
    if "bco_pair" in types:
        extra["bco_delta"] = 0.25
    return extra


@pytest.mark.parametrize("loss_type", list(DPO_LOSS_TYPES)
                         + [["sigmoid", "bco_pair", "sigmoid_norm"]],
                         ids=lambda t: t if isinstance(t, str) else "+".join(t))
def test_options_object_equals_the_keywords(loss_type):
    keywords, extra = _options_for(loss_type), _inputs_for(loss_type)
    results = []
    for call in (dict(**keywords), dict(options=ak.DPOOptions(**keywords))):
        policy_chosen, policy_rejected, ref_chosen, ref_rejected = _pairs()
        policy_chosen.requires_grad_()
        policy_rejected.requires_grad_()
        loss, metrics = ak.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                                    **call, **extra)
        loss.backward()
        results.append((loss.detach(), metrics, policy_chosen.grad, policy_rejected.grad))
    (loss_a, metrics_a, *grads_a), (loss_b, metrics_b, *grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert metrics_a.keys() == metrics_b.keys()
    assert all(torch.equal(metrics_a[k], metrics_b[k]) for k in metrics_a)


@pytest.mark.parametrize("keyword", [dict(beta=0.1), dict(loss_type="sigmoid"),
                                     dict(label_smoothing=0.0), dict(loss_weights=None),
                                     dict(discopop_tau=None)],
                         ids=lambda keyword: next(iter(keyword)))
def test_a_keyword_at_its_default_beside_options_is_refused(keyword):
    # the value equals the keyword's default, yet it was passed: options= must not win silently
    name = next(iter(keyword))
    with pytest.raises(ValueError, match=rf"\['{name}'\] given beside options"):
        ak.dpo_loss(*_pairs(), options=ak.DPOOptions(beta=0.3, loss_type="ipo"), **keyword)


def test_a_positional_reference_beside_options_is_an_input():
    # ref_chosen/ref_rejected are positional inputs, not options: options= goes with them
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = _pairs()
    by_object = ak.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                            options=ak.DPOOptions(beta=0.3))[0]
    by_keywords = ak.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                              beta=0.3)[0]
    assert torch.equal(by_object, by_keywords)


def test_options_of_another_type_are_refused():
    with pytest.raises(TypeError, match="options must be a DPOOptions"):
        ak.dpo_loss(*_pairs(), options={"beta": 0.3})
    with pytest.raises(TypeError, match="options must be a DPOOptions"):
        ak.dpo_loss(*_pairs(), options=ak.DistillOptions())


@pytest.mark.parametrize("options, error, match", [
    (dict(beta=0.0), ValueError, "beta"),
    (dict(beta=math.inf), ValueError, "beta"),
    (dict(loss_type="kto"), ValueError, "loss_type"),
    (dict(loss_type=[]), ValueError, "loss_type"),
    (dict(loss_type=["ipo", "ipo"]), ValueError, "loss_type lists a type twice"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), ValueError, "loss_weights"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, -2.0]), ValueError,
     r"loss_weights\[1\]"),
    (dict(loss_weights="1"), TypeError, "loss_weights"),
    (dict(loss_type="robust", label_smoothing=0.5), ValueError, "label_smoothing"),
    (dict(loss_type="exo_pair"), ValueError, "needs label_smoothing"),
    (dict(loss_type="ipo", label_smoothing=0.1), ValueError, "label_smoothing=0.1 is not used"),
    (dict(discopop_tau=0.1), ValueError, "discopop_tau is only used"),
    (dict(loss_type="discopop", discopop_tau=0.0), ValueError, "discopop_tau"),
    (dict(loss_type="discopop", discopop_tau="0.1"), TypeError, "discopop_tau"),
])
def test_the_options_check_themselves_without_tensors(options, error, match):
    with pytest.raises(error, match=match):
        ak.DPOOptions(**options).checked()
    with pytest.raises(error, match=match):  # and the op checks them as its keywords
        ak.dpo_loss(*_pairs(), options=ak.DPOOptions(**options))


def test_checked_options_check_again_to_themselves():
    options = ak.DPOOptions(beta=1, loss_type=["sigmoid", "discopop"], label_smoothing=0.1,
                            loss_weights=[2, 1], discopop_tau=0.5)
    checked = options.checked()
    assert checked.checked() == checked
    assert checked.loss_type == ("sigmoid", "discopop") and checked.loss_weights == (2.0, 1.0)
    assert checked.loss_types == ("sigmoid", "discopop") and type(checked.beta) is float
    hash(checked)  # tuples, not lists: a checked object is hashable
    assert ak.DPOOptions().checked() == ak.DPOOptions()
    assert ak.DPOOptions(loss_type="ipo").checked().loss_types == ("ipo",)


def test_the_rules_that_need_inputs_stay_with_the_op():
    ak.DPOOptions(loss_type="sigmoid_norm").checked()  # the lengths are inputs
    with pytest.raises(ValueError, match="needs chosen_lengths"):
        ak.dpo_loss(*_pairs(), options=ak.DPOOptions(loss_type="sigmoid_norm"))
    with pytest.raises(ValueError, match="bco_delta is only used"):
        ak.dpo_loss(*_pairs(), options=ak.DPOOptions(), bco_delta=0.1)


def test_the_strategy_builds_checked_options_once():
    from astrai_kernels.testing.tiny_lm import TinyCausalLM

    model = TinyCausalLM(vocab_size=31, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                         seed=0)
    strategy = DPOStrategy(model, "cpu", ref_model=None, beta=0.3, loss_type=["ipo", "hinge"],
                           loss_weights=[1, 2], loss_backend="torch")
    assert strategy.options == ak.DPOOptions(beta=0.3, loss_type=["ipo", "hinge"],
                                             loss_weights=[1, 2]).checked()
    with pytest.raises(ValueError, match="label_smoothing=0.2 is not used"):
        DPOStrategy(model, "cpu", ref_model=None, loss_type="ipo", label_smoothing=0.2,
                    loss_backend="torch")
    with pytest.raises(ValueError, match="beta"):  # the seed's path checks its beta too
        DPOStrategy(model, "cpu", ref_model=None, beta=0.0, loss_backend="reference")
    with pytest.raises(ValueError, match="bco_delta is only used"):
        DPOStrategy(model, "cpu", ref_model=None, bco_delta=0.1, loss_backend="torch")
