"""``DistillOptions``: one object for the distillation ops' scalar options, equal to the
keywords (``options/distill.py``)."""

import inspect
from dataclasses import fields

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing.multiprocess import assert_ranks_passed, case_outcome, spawn_ranks

KEYWORDS = dict(beta=0.3, temperature=0.8, ignore_index=-1, reduction="sum", hard_weight=0.25)
VOCAB = 13


def _batch():
    g = torch.Generator().manual_seed(7)
    student = torch.randn(2, 5, VOCAB, generator=g) * 2
    teacher = torch.randn(2, 5, VOCAB, generator=g) * 2
    target = torch.randint(0, VOCAB, (2, 5), generator=g)
    target[0, 1] = target[1, 4] = -1
    return student, teacher, target


def _keyword_defaults(function):
    return {name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("function", [ak.distill_loss, ak.linear_distill_loss,
                                      reference.distill_loss],
                         ids=["distill_loss", "linear_distill_loss", "reference.distill_loss"])
def test_the_public_keywords_are_the_options_fields_with_their_defaults(function):
    defaults = _keyword_defaults(function)
    for field in fields(ak.DistillOptions):
        assert field.name in defaults, field.name
        assert defaults[field.name] == field.default, field.name


def test_the_ops_take_options_and_no_other_scalar_of_the_loss():
    # every keyword of distill_loss is an option, an input or the backend: a new scalar
    # keyword of the loss must become a field
    inputs = {"student_logits", "teacher_logits", "target", "normalizer", "options", "backend"}
    names = set(inspect.signature(ak.distill_loss).parameters)
    assert names - inputs == {field.name for field in fields(ak.DistillOptions)}
    head = {"student_hidden", "student_weight", "teacher_hidden", "teacher_weight",
            "student_bias", "teacher_bias", "softcap", "logit_scale", "teacher_softcap",
            "teacher_logit_scale", "chunk_size"}
    linear_names = set(inspect.signature(ak.linear_distill_loss).parameters)
    assert linear_names - inputs - head == {field.name for field in fields(ak.DistillOptions)}


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_options_object_equals_the_keywords(backend, reduction):
    student, teacher, target = _batch()
    keywords = {**KEYWORDS, "reduction": reduction}
    results = []
    for call in (dict(**keywords), dict(options=ak.DistillOptions(**keywords))):
        x = student.clone().requires_grad_()
        loss = ak.distill_loss(x, teacher, target, backend=backend, **call)
        loss.backward(torch.ones_like(loss))
        results.append((loss.detach(), x.grad))
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert loss_a.shape == loss_b.shape
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    # the options were read: the defaults give another value
    assert not torch.equal(loss_a, ak.distill_loss(student, teacher, target, backend=backend,
                                                   ignore_index=-1,
                                                   reduction=reduction).detach())


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_linear_options_object_equals_the_keywords(backend):
    g = torch.Generator().manual_seed(8)
    student_hidden, teacher_hidden = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 4,
                                                                                    generator=g)
    student_weight, teacher_weight = (torch.randn(VOCAB, 6, generator=g),
                                      torch.randn(VOCAB, 4, generator=g))
    _, _, target = _batch()
    results = []
    for call in (dict(**KEYWORDS), dict(options=ak.DistillOptions(**KEYWORDS))):
        hidden = student_hidden.clone().requires_grad_()
        weight = student_weight.clone().requires_grad_()
        loss = ak.linear_distill_loss(hidden, weight, teacher_hidden, teacher_weight, target,
                                      softcap=5.0, backend=backend, **call)
        loss.backward()
        results.append((loss.detach(), hidden.grad, weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["distill_loss", "linear_distill_loss"])
@pytest.mark.parametrize("keyword", [dict(beta=0.5), dict(reduction="batchmean"),
                                     dict(ignore_index=-100), dict(hard_weight=0.0)],
                         ids=lambda keyword: next(iter(keyword)))
def test_a_keyword_at_its_default_beside_options_is_refused(op, keyword):
    # the value equals the keyword's default, yet it was passed: options= must not win silently
    student, teacher, target = _batch()
    name = next(iter(keyword))
    options = ak.DistillOptions(**KEYWORDS)
    with pytest.raises(ValueError, match=rf"\['{name}'\] given beside options"):
        if op == "distill_loss":
            ak.distill_loss(student, teacher, target, options=options, **keyword)
        else:
            eye = torch.eye(VOCAB)
            ak.linear_distill_loss(student, eye, teacher, eye, target, options=options,
                                   **keyword)


def test_options_of_another_type_are_refused():
    student, teacher, target = _batch()
    with pytest.raises(TypeError, match="options must be a DistillOptions"):
        ak.distill_loss(student, teacher, target, options={"beta": 0.3})
    with pytest.raises(TypeError, match="options must be a DistillOptions"):
        ak.distill_loss(student, teacher, target, options=ak.GRPOOptions())


@pytest.mark.parametrize("options, error, match", [
    (dict(beta=1.5), ValueError, "beta"),
    (dict(beta=float("nan")), ValueError, "beta"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(hard_weight=-0.1), ValueError, "hard_weight"),
])
def test_the_options_check_themselves_without_tensors(options, error, match):
    with pytest.raises(error, match=match):
        ak.DistillOptions(**options).checked()
    student, teacher, target = _batch()
    with pytest.raises(error, match=match):  # and the op checks them as its keywords
        ak.distill_loss(student, teacher, target, options=ak.DistillOptions(**options))


def test_checked_options_check_again_to_themselves():
    import numpy as np

    options = ak.DistillOptions(beta=np.float32(0.25), temperature=2, ignore_index=np.int64(-1),
                                reduction="mean", hard_weight=1)
    checked = options.checked()
    assert checked.checked() == checked
    assert type(checked.beta) is float and type(checked.ignore_index) is int
    assert checked.keywords() == dict(beta=0.25, temperature=2.0, ignore_index=-1,
                                      reduction="mean", hard_weight=1.0)


def test_the_rules_that_need_tensors_stay_with_the_op():
    student, teacher, _ = _batch()
    ak.DistillOptions(hard_weight=0.5).checked()  # no tensor: nothing to refuse
    with pytest.raises(ValueError, match="hard_weight > 0 needs target"):
        ak.distill_loss(student, teacher, options=ak.DistillOptions(hard_weight=0.5))
    with pytest.raises(ValueError, match="normalizer applies to reduction='batchmean'"):
        ak.distill_loss(student, teacher, normalizer=4.0,
                        options=ak.DistillOptions(reduction="sum"))


# -- DTensor logits: the DTensor route reads the reduction, so it must see the options'


def _dtensor_case(reduction):
    def case():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        student, teacher, target = _batch()
        keywords = {**KEYWORDS, "reduction": reduction}
        results = []
        for call in (dict(**keywords), dict(options=ak.DistillOptions(**keywords))):
            leaf = distribute_tensor(student, mesh, (Shard(0),)).requires_grad_(True)
            loss = ak.distill_loss(leaf, distribute_tensor(teacher, mesh, (Shard(0),)), target,
                                   **call)
            loss.full_tensor().sum().backward()
            results.append((loss.full_tensor().detach(), leaf.grad.full_tensor()))
        (loss_a, grad_a), (loss_b, grad_b) = results
        assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
        assert torch.equal(grad_a, grad_b)
    return case


DTENSOR_CASES = {reduction: _dtensor_case(reduction) for reduction in ("sum", "none")}


def _worker(rank, world_size):
    return {name: case_outcome(case) for name, case in DTENSOR_CASES.items()}


@pytest.fixture(scope="module")
def dtensor_outcomes():
    return spawn_ranks(_worker, 2, timeout=300.0)


@pytest.mark.parametrize("reduction", list(DTENSOR_CASES))
def test_dtensor_logits_take_the_options_object(dtensor_outcomes, reduction):
    assert_ranks_passed(dtensor_outcomes, reduction)
