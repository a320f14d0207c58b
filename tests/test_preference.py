import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.testing import assert_close


def _logps(seed=0, batch=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, generator=g) * 3 - 20 for _ in range(4)]


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_loss_types_from_the_formulas(loss_type, label_smoothing):
    pc, pr, rc, rr = _logps()
    beta = 0.2
    if label_smoothing and loss_type in ("ipo", "hinge"):  # no label-flip term to smooth
        with pytest.raises(ValueError, match="label_smoothing"):
            ak.dpo_loss(pc, pr, rc, rr, loss_type=loss_type, label_smoothing=label_smoothing)
        return
    loss, metrics = ak.dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                                label_smoothing=label_smoothing)
    expected = []
    for i in range(5):
        margin = float((pc[i] - rc[i]) - (pr[i] - rr[i]))
        ls = label_smoothing
        if loss_type == "sigmoid":
            value = -(1 - ls) * math.log(_sig(beta * margin)) - ls * math.log(_sig(-beta * margin))
        elif loss_type == "ipo":
            value = (margin - 1 / (2 * beta)) ** 2
        elif loss_type == "hinge":
            value = max(0.0, 1 - beta * margin)
        else:
            value = (-(1 - ls) * math.log(_sig(beta * margin))
                     + ls * math.log(_sig(-beta * margin))) / (1 - 2 * ls)
        expected.append(value)
    assert_close(loss, torch.tensor(sum(expected) / 5, dtype=torch.float64), "value",
                 torch.float32)
    chosen = beta * (pc - rc)
    rejected = beta * (pr - rr)
    assert_close(metrics["rewards/chosen"], chosen.mean(), "value", torch.float32)
    assert_close(metrics["rewards/rejected"], rejected.mean(), "value", torch.float32)
    assert_close(metrics["rewards/margin"], (chosen - rejected).mean(), "value", torch.float32)
    assert_close(metrics["rewards/accuracy"], (chosen > rejected).float().mean(), "value",
                 torch.float32)


def test_dpo_gradient_and_reference_free():
    pc, pr, _, _ = _logps(1)
    pc.requires_grad_(True)
    loss, _ = ak.dpo_loss(pc, pr, beta=0.5)
    loss.backward()
    margin = (pc - pr).detach()
    expected = -F.logsigmoid(0.5 * margin).mean()
    assert_close(loss, expected, "value", torch.float32)
    assert_close(pc.grad, -0.5 * torch.sigmoid(-0.5 * margin) / 5, "grad", torch.float32)


def test_dpo_on_sequence_logprobs_end_to_end():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 7, 31, generator=g, requires_grad=True)
    target = torch.randint(0, 31, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    seq = ak.sequence_logprobs(logits[:, :-1], target, mask)
    loss, metrics = ak.dpo_loss(seq[:2], seq[2:], seq[:2].detach() - 1, seq[2:].detach())
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert metrics["rewards/accuracy"] == 1.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_type="kto"), ValueError, "loss_type"),
    (dict(beta=0.0), ValueError, "beta"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(loss_type="robust", label_smoothing=0.5), ValueError, "label_smoothing"),
])
def test_dpo_bad_arguments(kwargs, error, match):
    pc, pr, rc, rr = _logps()
    with pytest.raises(error, match=match):
        ak.dpo_loss(pc, pr, rc, rr, **kwargs)


def test_dpo_bad_shapes():
    pc, pr, rc, rr = _logps()
    with pytest.raises(ValueError, match="policy_rejected"):
        ak.dpo_loss(pc, pr[:3], rc, rr)
    with pytest.raises(ValueError, match="neither"):
        ak.dpo_loss(pc, pr, rc, None)
    with pytest.raises(ValueError, match="policy_chosen"):
        ak.dpo_loss(pc[None], pr, rc, rr)


def test_group_advantages_population_std():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0]])
    out = ak.group_advantages(rewards)
    centred = rewards - rewards.mean(-1, keepdim=True)
    std = centred.pow(2).mean(-1, keepdim=True).sqrt()
    assert_close(out, centred / (std + 1e-6), "value", torch.float32)
    assert_close(ak.group_advantages(rewards, scale="none"), centred, "value", torch.float32)
    batch_std = (rewards - rewards.mean()).pow(2).mean().sqrt()
    assert_close(ak.group_advantages(rewards, scale="batch"), centred / (batch_std + 1e-6),
                 "value", torch.float32)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_the_float64_spec(scale):
    """The float32 op against reference.py's float64 statement of the same definition (the
    yardstick: that statement's own error in float32), on continuous rewards, 0/1 rewards (tied
    groups among them), rewards far from 0 (the centring cancels) and a group of one."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(6, 8, generator=g) * 2.5 + 1.0,
               (torch.rand(6, 4, generator=g) < 0.5).float(),
               1000.0 + torch.randn(5, 3, generator=g),
               torch.randn(4, 1, generator=g)]
    for rewards in batches:
        for eps in (1e-6, 0.0):
            expected = reference.group_advantages(rewards.double(), scale, eps)
            naive = reference.group_advantages(rewards, scale, eps)
            assert_close(ak.group_advantages(rewards, scale=scale, eps=eps), expected, "value",
                         torch.float32, what=f"{scale} eps={eps} {tuple(rewards.shape)}",
                         naive=naive)


def test_group_advantages_degenerate_groups():
    assert torch.equal(ak.group_advantages(torch.tensor([[3.0], [5.0]]), eps=0.0),
                       torch.zeros(2, 1))
    same = ak.group_advantages(torch.full((2, 4), 7.0))
    assert torch.equal(same, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rewards"):
        ak.group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="scale"):
        ak.group_advantages(torch.ones(2, 2), scale="global")
