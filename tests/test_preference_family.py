"""TRL's preference losses (DPO's loss types, MPO, ORPO, SimPO, CPO, KTO) against float64
formulas written here from TRL's trainers, forward and gradient, and fed by the fused head."""

import math

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.strategies import StrategyFactory
from astrai_kernels.testing import assert_close, assert_close_elementwise
from astrai_kernels.testing.tiny_lm import TinyCausalLM

from cases import KERNEL_BACKENDS

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
ORPO_TOP = math.log1p(-2.0 ** -24)  # the documented clamp of ORPO's log-probs

# ------------------------------------------------------------------ TRL's math, float64

logsig, sig = F.logsigmoid, torch.sigmoid


def trl_dpo_losses(kind, pc, pr, rc, rr, beta, eps=0.0, tau=0.05, delta=0.0, lc=None, lr=None):
    """Per-pair losses of ``DPOTrainer._compute_loss`` (TRL 1.x, reverse KL); ``delta`` is the
    BCO reward shift of TRL 0.x (0 in 1.x)."""
    cl, rl = pc - rc, pr - rr  # chosen_logratios, rejected_logratios
    d = cl - rl  # delta_score
    if kind == "sigmoid":  # TRL 1.x has no label smoothing here; cDPO is TRL 0.x's
        return -logsig(beta * d) * (1 - eps) - logsig(-beta * d) * eps
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    if kind == "robust":
        return (-(1 - eps) * logsig(beta * d) + eps * logsig(-beta * d)) / (1 - 2 * eps)
    if kind == "exo_pair":
        e = torch.tensor(eps, dtype=torch.float64)
        return (sig(beta * d) * (logsig(beta * d) - torch.log1p(-e))
                + sig(-beta * d) * (logsig(-beta * d) - torch.log(e)))
    if kind == "nca_pair":
        return -logsig(beta * cl) - 0.5 * logsig(-beta * cl) - 0.5 * logsig(-beta * rl)
    if kind == "bco_pair":
        return -logsig(beta * cl - delta) - logsig(-(beta * rl - delta))
    if kind == "sppo_hard":
        return (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    if kind == "aot":
        s = torch.sort(pc - pr).values - torch.sort(rc - rr).values
        return -logsig(beta * s) * (1 - eps) - logsig(-beta * s) * eps
    if kind == "aot_unpaired":
        s = torch.sort(cl).values - torch.sort(rl).values
        return -logsig(beta * s) * (1 - eps) - logsig(-beta * s) * eps
    if kind == "apo_zero":
        return 1 - sig(beta * cl) + sig(beta * rl)
    if kind == "apo_down":
        return sig(beta * cl) + 1 - sig(beta * d)
    if kind == "discopop":
        x = beta * d
        m = sig(x / tau)
        return -logsig(x) * (1 - m) + torch.exp(-x) * m
    if kind == "sigmoid_norm":
        lc, lr = lc.to(cl.dtype).clamp(min=1), lr.to(cl.dtype).clamp(min=1)
        return -logsig(beta * (cl / lc - rl / lr))
    raise AssertionError(kind)


def trl_log1mexp(x):
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def trl_orpo(c, r, beta):
    """``-mean(ORPOTrainer.odds_ratio_loss)`` on log-probs clamped at ``log(1 - 2**-24)``."""
    c, r = c.clamp(max=ORPO_TOP), r.clamp(max=ORPO_TOP)
    log_odds = (c - r) - (trl_log1mexp(c) - trl_log1mexp(r))
    return -(beta * logsig(log_odds)).mean()


def trl_simpo(c, r, beta, gamma, eps):
    x = beta * (c - r) - gamma  # Liger's form; TRL's is beta * ((c - r) - gamma / beta)
    return (-logsig(x) * (1 - eps) - logsig(-x) * eps).mean()


def trl_cpo(c, r, beta, eps, kind, gamma=0.5, alpha=0.0):
    """``CPOTrainer.cpo_loss`` (mean), AlphaPO rewards ``(1 - p**-alpha) / alpha``."""
    if alpha != 0.0:
        c = (1 - torch.exp(c).pow(-alpha)) / alpha
        r = (1 - torch.exp(r).pow(-alpha)) / alpha
    x = c - r
    if kind == "simpo":
        x = x - gamma / beta
    if kind in ("sigmoid", "simpo"):
        losses = -logsig(beta * x) * (1 - eps) - logsig(-beta * x) * eps
    elif kind == "hinge":
        losses = torch.relu(1 - beta * x)
    else:
        losses = (x - 1 / (2 * beta)) ** 2
    return losses.mean()


def trl_kto(logps, ref, labels, kl, beta, dw, uw, kind):
    """``KTOTrainer._compute_loss``: weighted chosen and rejected losses, their nanmean."""
    x = logps - (0.0 if ref is None else ref)
    kl = max(float(kl), 0.0)
    chosen, rejected = x[labels], x[~labels]
    if kind == "kto":
        chosen_losses = 1 - sig(beta * (chosen - kl))
        rejected_losses = 1 - sig(beta * (kl - rejected))
    else:
        chosen_losses = 1 - sig(beta * chosen)
        rejected_losses = sig(beta * rejected)
    return torch.cat([dw * chosen_losses, uw * rejected_losses]).nanmean()


# ------------------------------------------------------------------ inputs and comparisons


def pair_logps(seed=0, batch=6, centre=-20.0, spread=3.0, ref_spread=1.5):
    """Summed log-probs: policy and reference of chosen and rejected, the last pair's chosen
    fully masked (sum 0 under both models)."""
    g = torch.Generator().manual_seed(seed)
    pc = torch.randn(batch, generator=g, dtype=torch.float64) * spread + centre
    pr = torch.randn(batch, generator=g, dtype=torch.float64) * spread + centre
    rc = pc + torch.randn(batch, generator=g, dtype=torch.float64) * ref_spread
    rr = pr + torch.randn(batch, generator=g, dtype=torch.float64) * ref_spread
    pc[-1] = rc[-1] = 0.0
    return pc, pr, rc, rr


def leaves(tensors, dtype):
    """The inputs rounded to ``dtype`` (as the op sees them) and their float64 copies."""
    rounded = [t.to(dtype) for t in tensors]
    return ([t.clone().requires_grad_(True) for t in rounded],
            [t.double().requires_grad_(True) for t in rounded],
            [t.float().requires_grad_(True) for t in rounded])


def check_op(op, formula, tensors, dtype, grad_of=None):
    """``op(*inputs)`` against ``formula`` in float64 on the same rounded inputs (its float32
    run is the naive path), value and the gradient of every input in ``grad_of``."""
    grad_of = range(len(tensors)) if grad_of is None else grad_of
    got_in, exact_in, naive_in = leaves(tensors, dtype)
    got, metrics = op(*got_in)
    exact, naive = formula(*exact_in), formula(*naive_in)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert_close_elementwise(got, exact, naive, dtype=torch.float32, name="loss")
    wanted = [exact_in[i] for i in grad_of]
    got_grads = torch.autograd.grad(got, [got_in[i] for i in grad_of], allow_unused=True)
    exact_grads = torch.autograd.grad(exact, wanted, allow_unused=True)
    naive_grads = torch.autograd.grad(naive, [naive_in[i] for i in grad_of], allow_unused=True)
    for i, g, e, n in zip(grad_of, got_grads, exact_grads, naive_grads):
        e = torch.zeros_like(wanted[0]) if e is None else e
        n = torch.zeros_like(e) if n is None else n
        assert g is not None and g.dtype == dtype, f"input {i}"
        assert_close_elementwise(g, e, n.to(dtype), dtype=dtype, name=f"grad of input {i}")
    return metrics, exact_in


# ------------------------------------------------------------------ dpo_loss's new types

DPO_CASES = {
    "exo_pair": dict(label_smoothing=1e-3),
    "exo_pair_eps": dict(loss_type="exo_pair", label_smoothing=0.2),
    "nca_pair": {},
    "bco_pair": {},
    "bco_pair_delta": dict(loss_type="bco_pair", bco_delta=0.3),
    "bco_pair_tensor_delta": dict(loss_type="bco_pair", bco_delta=torch.tensor([-0.2])),
    "sppo_hard": {},
    "aot": {},
    "aot_smoothed": dict(loss_type="aot", label_smoothing=0.1),
    "aot_unpaired": dict(label_smoothing=0.05),
    "apo_zero": {},
    "apo_down": {},
    "discopop": {},
    "discopop_tau": dict(loss_type="discopop", discopop_tau=0.3),
    "sigmoid_norm": {},
    "robust": dict(label_smoothing=0.2),
    "mpo": dict(loss_type=["sigmoid", "bco_pair", "sigmoid_norm"], loss_weights=[0.8, 0.2, 1.0]),
    "mpo_default_weights": dict(loss_type=["ipo", "apo_down"]),
}
LENGTHS = torch.tensor([7, 3, 12, 5, 9, 0])  # the last pair's chosen is fully masked


def dpo_formula(kwargs, beta, with_ref):
    types = kwargs.get("loss_type", [])
    types = [types] if isinstance(types, str) else types
    weights = kwargs.get("loss_weights", [1.0] * len(types))
    extra = dict(eps=kwargs.get("label_smoothing", 0.0), tau=kwargs.get("discopop_tau", 0.05),
                 delta=float(kwargs.get("bco_delta", 0.0)), lc=LENGTHS.double(),
                 lr=LENGTHS.flip(0).double())

    def formula(pc, pr, *ref):
        rc, rr = ref if with_ref else (torch.zeros_like(pc), torch.zeros_like(pr))
        return sum(w * trl_dpo_losses(t, pc, pr, rc, rr, beta, **extra).mean()
                   for t, w in zip(types, weights))
    return formula


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_ref", [True, False], ids=["ref", "ref_free"])
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_loss_types(case, with_ref, dtype):
    kwargs = dict(DPO_CASES[case])
    kwargs.setdefault("loss_type", case)
    types = [kwargs["loss_type"]] if isinstance(kwargs["loss_type"], str) else kwargs["loss_type"]
    beta = 0.4
    if "sigmoid_norm" in types:
        kwargs.update(chosen_lengths=LENGTHS, rejected_lengths=LENGTHS.flip(0))
    centre = 0.0 if not with_ref else -20.0  # reference-free log-ratios are the log-probs
    tensors = pair_logps(centre=centre, spread=3.0 if with_ref else 1.0)
    tensors = tensors if with_ref else tensors[:2]

    def op(pc, pr, *ref):
        return ak.dpo_loss(pc, pr, *ref, beta=beta, **kwargs)

    formula = dpo_formula(kwargs, beta, with_ref)
    metrics, exact_in = check_op(op, formula, tensors, dtype, grad_of=(0, 1))
    pc, pr = exact_in[0].detach(), exact_in[1].detach()
    rc, rr = (exact_in[2].detach(), exact_in[3].detach()) if with_ref else (0.0, 0.0)
    assert_close(metrics["rewards/margin"], (beta * ((pc - rc) - (pr - rr))).mean(), "value")
    assert_close(metrics["rewards/chosen"], (beta * (pc - rc)).mean(), "value")
    if len(types) > 1:
        assert set(metrics) >= {f"loss/{t}" for t in types}
    # the spec in reference.py agrees with TRL's math in float64
    spec_kwargs = {k: (float(v) if k == "bco_delta" else v) for k, v in kwargs.items()}
    spec, _ = reference.dpo_loss(*[t.detach() for t in exact_in], beta=beta, **spec_kwargs)
    assert_close_elementwise(spec, formula(*[t.detach() for t in exact_in]), name="spec")


def test_dpo_types_are_finite_on_extreme_margins():
    pc = torch.tensor([-400.0, -1.0, 0.0], requires_grad=True)
    pr = torch.tensor([-1.0, -400.0, 0.0], requires_grad=True)
    for loss_type in ("discopop", "exo_pair", "apo_down", "nca_pair"):
        loss, _ = ak.dpo_loss(pc, pr, beta=1.0, loss_type=loss_type,
                              label_smoothing=1e-3 if loss_type == "exo_pair" else 0.0)
        grads = torch.autograd.grad(loss, (pc, pr))
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads), loss_type


def test_discopop_product_is_finite_where_trl_overflows():
    # exp(-x) * sigmoid(x / tau) at x = -100 with tau = 0.05: TRL's product is inf * 0 = NaN;
    # the true value exp(100 - 2000) is 0.
    pc, pr = torch.tensor([-100.0]), torch.tensor([0.0])
    loss, _ = ak.dpo_loss(pc, pr, beta=1.0, loss_type="discopop")
    assert_close(loss, torch.tensor(-F.logsigmoid(torch.tensor(-100.0, dtype=torch.float64))
                                    .item(), dtype=torch.float64), "value")


# ------------------------------------------------------------------ reference-free objectives


def avg_logps(seed=1, batch=6):
    """Length-averaged log-probs in (-3, 0): one fully masked (0), one near probability one."""
    g = torch.Generator().manual_seed(seed)
    c = -torch.rand(batch, generator=g, dtype=torch.float64) * 3
    r = -torch.rand(batch, generator=g, dtype=torch.float64) * 3
    c[0], r[1], c[2] = 0.0, -1e-3, -0.69
    return c, r


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_loss(beta, dtype):
    def op(c, r):
        return ak.orpo_loss(c, r, beta=beta)

    metrics, exact_in = check_op(op, lambda c, r: trl_orpo(c, r, beta), avg_logps(), dtype)
    c, r = (t.detach() for t in exact_in)
    assert_close(metrics["rewards/chosen"], beta * c.mean(), "value")
    log_odds = (c.clamp(max=ORPO_TOP) - r) - (trl_log1mexp(c.clamp(max=ORPO_TOP))
                                              - trl_log1mexp(r))
    assert_close(metrics["log_odds_chosen"], log_odds.mean(), "value")
    assert_close(metrics["log_odds_ratio"], logsig(log_odds).mean(), "value")
    assert_close_elementwise(reference.orpo_loss(c, r, beta), trl_orpo(c, r, beta), name="spec")


def test_orpo_fully_masked_pair_is_finite():
    c = torch.tensor([0.0, -0.5], requires_grad=True)
    r = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = ak.orpo_loss(c, r)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(c.grad).all() and torch.isfinite(r.grad).all()
    assert c.grad[0] == 0 and r.grad.eq(0).all()  # clamped entries get no gradient


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("options", [{}, dict(beta=2.5, gamma=1.4, label_smoothing=0.1),
                                     dict(beta=0.5, gamma=0.0)], ids=["default", "smooth", "g0"])
def test_simpo_loss(options, dtype):
    beta, gamma, eps = (options.get("beta", 2.0), options.get("gamma", 0.5),
                        options.get("label_smoothing", 0.0))

    def op(c, r):
        return ak.simpo_loss(c, r, **options)

    metrics, exact_in = check_op(op, lambda c, r: trl_simpo(c, r, beta, gamma, eps),
                                 avg_logps(2), dtype)
    c, r = (t.detach() for t in exact_in)
    assert_close(metrics["rewards/accuracy"], (c > r).double().mean(), "value")
    assert_close_elementwise(reference.simpo_loss(c, r, beta, gamma, eps),
                             trl_simpo(c, r, beta, gamma, eps), name="spec")
    # SimPO is CPO's "simpo" type with simpo_gamma = gamma
    cpo, _ = ak.cpo_loss(c.float(), r.float(), beta=beta, label_smoothing=eps,
                         loss_type="simpo", simpo_gamma=gamma)
    assert_close(cpo, trl_simpo(c, r, beta, gamma, eps), "value")


CPO_CASES = {
    "sigmoid": dict(loss_type="sigmoid"),
    "sigmoid_smooth": dict(loss_type="sigmoid", label_smoothing=0.1, beta=0.2),
    "hinge": dict(loss_type="hinge"),
    "ipo": dict(loss_type="ipo", beta=0.5),
    "simpo": dict(loss_type="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=0.05),
    "alphapo": dict(loss_type="simpo", beta=2.0, alpha=0.25),
    "sigmoid_alpha": dict(loss_type="sigmoid", alpha=-0.1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CPO_CASES))
def test_cpo_loss(case, dtype):
    kwargs = CPO_CASES[case]
    averaged = kwargs["loss_type"] in ("ipo", "simpo")  # TRL averages for these, sums otherwise
    tensors = avg_logps(3) if averaged else pair_logps(3, spread=2.0, centre=-8.0)[:2]
    beta = kwargs.get("beta", 0.1)
    formula_args = (beta, kwargs.get("label_smoothing", 0.0), kwargs["loss_type"],
                    kwargs.get("simpo_gamma", 0.5), kwargs.get("alpha", 0.0))

    def op(c, r):
        return ak.cpo_loss(c, r, **kwargs)

    metrics, exact_in = check_op(op, lambda c, r: trl_cpo(c, r, *formula_args), tensors, dtype)
    c, r = (t.detach() for t in exact_in)
    if kwargs.get("alpha", 0.0) == 0.0:
        assert_close(metrics["rewards/rejected"], beta * r.mean(), "value")
    assert_close_elementwise(reference.cpo_loss(c, r, *formula_args),
                             trl_cpo(c, r, *formula_args), name="spec")


KTO_CASES = {
    "kto": dict(kl=0.7),
    "kto_weights": dict(kl=0.4, desirable_weight=1.33, undesirable_weight=0.6, beta=0.3),
    "kto_negative_kl": dict(kl=-0.5),  # TRL clamps the estimate at 0
    "kto_tensor_kl": dict(kl=torch.tensor(1.2)),
    "kto_ref_free": dict(kl=0.0, ref=False),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", beta=0.2),
    "all_desirable": dict(kl=0.3, labels="all"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_loss(case, dtype):
    kwargs = dict(KTO_CASES[case])
    with_ref = kwargs.pop("ref", True)
    which = kwargs.pop("labels", "mixed")
    pc, pr, rc, rr = pair_logps(4, batch=4, centre=-12.0 if with_ref else -2.0,
                                spread=3.0 if with_ref else 0.5)
    logps, ref = torch.cat([pc, pr]), torch.cat([rc, rr])
    labels = torch.tensor([True, False, False, True, True, False, True, False])
    if which == "all":
        labels = torch.ones(8, dtype=torch.bool)
    beta = kwargs.get("beta", 0.1)
    options = (kwargs.get("kl", 0.0), beta, kwargs.get("desirable_weight", 1.0),
               kwargs.get("undesirable_weight", 1.0), kwargs.get("loss_type", "kto"))

    def op(x, *ref_in):
        return ak.kto_loss(x, ref_in[0] if ref_in else None, labels, **kwargs)

    def formula(x, *ref_in):
        return trl_kto(x, ref_in[0] if ref_in else None, labels, *options)

    metrics, exact_in = check_op(op, formula, [logps, ref] if with_ref else [logps], dtype,
                                 grad_of=(0,))
    x = exact_in[0].detach() - (exact_in[1].detach() if with_ref else 0.0)
    assert_close(metrics["kl"], torch.tensor(max(float(options[0]), 0.0) if options[4] == "kto"
                                             else 0.0, dtype=torch.float64), "value")
    assert_close(metrics["rewards/chosen"], (beta * x[labels]).mean(), "value")
    if which == "all":
        assert torch.isnan(metrics["rewards/rejected"])
    else:
        assert_close(metrics["rewards/rejected"], (beta * x[~labels]).mean(), "value")
    spec = reference.kto_loss(exact_in[0].detach(), exact_in[1].detach() if with_ref else None,
                              labels, *options)
    assert_close_elementwise(spec, formula(*[t.detach() for t in exact_in]), name="spec")


# ------------------------------------------------------------------ the fused head feeds them

HEAD_BACKENDS = KERNEL_BACKENDS + ["reference"]
PAIRS, LENGTH, HIDDEN, VOCAB = 2, 5, 8, 29


def head_inputs(dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2 * PAIRS, LENGTH, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 2).to(dtype)
    target = torch.randint(0, VOCAB, (2 * PAIRS, LENGTH), generator=g)
    mask = torch.rand(2 * PAIRS, LENGTH, generator=g) < 0.7
    mask[:, 0] = True
    mask[-1] = False  # the last rejected completion is fully masked
    target[~mask] = -7  # masked targets are not read
    ref = torch.randn(2 * PAIRS, generator=g, dtype=torch.float64) * 0.5
    return hidden, weight, target, mask, ref


HEAD_OBJECTIVES = {
    # name: (average, loss of the [2B] sequence log-probs s, float64 formula of s)
    "dpo_mpo": (False,
                lambda s, ref, lengths: ak.dpo_loss(
                    s[:PAIRS], s[PAIRS:], ref[:PAIRS].float(), ref[PAIRS:].float(), beta=0.3,
                    loss_type=["sigmoid", "sigmoid_norm"], loss_weights=[1.0, 0.5],
                    chosen_lengths=lengths[:PAIRS], rejected_lengths=lengths[PAIRS:])[0],
                lambda s, ref, lengths: (
                    trl_dpo_losses("sigmoid", s[:PAIRS], s[PAIRS:], ref[:PAIRS], ref[PAIRS:],
                                   0.3).mean()
                    + 0.5 * trl_dpo_losses("sigmoid_norm", s[:PAIRS], s[PAIRS:], ref[:PAIRS],
                                           ref[PAIRS:], 0.3, lc=lengths[:PAIRS].double(),
                                           lr=lengths[PAIRS:].double()).mean())),
    "orpo": (True, lambda s, ref, lengths: ak.orpo_loss(s[:PAIRS], s[PAIRS:], beta=0.5)[0],
             lambda s, ref, lengths: trl_orpo(s[:PAIRS], s[PAIRS:], 0.5)),
    "simpo": (True, lambda s, ref, lengths: ak.simpo_loss(s[:PAIRS], s[PAIRS:])[0],
              lambda s, ref, lengths: trl_simpo(s[:PAIRS], s[PAIRS:], 2.0, 0.5, 0.0)),
    "cpo": (False, lambda s, ref, lengths: ak.cpo_loss(s[:PAIRS], s[PAIRS:], beta=0.2)[0],
            lambda s, ref, lengths: trl_cpo(s[:PAIRS], s[PAIRS:], 0.2, 0.0, "sigmoid")),
    "kto": (False,
            lambda s, ref, lengths: ak.kto_loss(s, ref.float(), KTO_LABELS, kl=0.2, beta=0.5,
                                                desirable_weight=1.2)[0],
            lambda s, ref, lengths: trl_kto(s, ref, KTO_LABELS, 0.2, 0.5, 1.2, 1.0, "kto")),
}
KTO_LABELS = torch.tensor([True, False, True, False])


# The triton interpreter runs the float32 cases only (time); bf16 runs on the other backends.
HEAD_CASES = [(backend, dtype) for backend in HEAD_BACKENDS for dtype in DTYPES
              if backend != "triton" or dtype == torch.float32]


@pytest.mark.parametrize("objective", list(HEAD_OBJECTIVES))
@pytest.mark.parametrize("backend, dtype", HEAD_CASES,
                         ids=[f"{b}-{DTYPE_IDS[DTYPES.index(d)]}" for b, d in HEAD_CASES])
def test_fused_head_preference_gradients(backend, dtype, objective):
    """``linear_sequence_logprobs`` + each loss: no logits for chosen/rejected, and gradients
    to hidden and weight within the tolerance model of float64 on ``hidden @ weight.T``."""
    average, loss_fn, formula = HEAD_OBJECTIVES[objective]
    hidden, weight, target, mask, ref = head_inputs(dtype)
    ref = ref - (10.0 if not average else 0.0)
    lengths = mask.sum(-1)
    h, w = (t.clone().requires_grad_(True) for t in (hidden, weight))
    seq = ak.linear_sequence_logprobs(h, w, target, mask, average=average, chunk_size=3,
                                      backend=backend)
    loss = loss_fn(seq, ref, lengths)
    got = torch.autograd.grad(loss, (h, w))

    def chain(h_in, w_in, compute):
        """Float64 math, or the naive path: the logits in the inputs' dtype, then float32."""
        logits = F.linear(h_in, w_in).to(compute)
        s = reference.sequence_logprobs(logits, torch.where(mask, target, -100), mask, average)
        return formula(s, ref.to(compute), lengths), logits

    h64, w64 = (t.double().requires_grad_(True) for t in (hidden, weight))
    exact, logits64 = chain(h64, w64, torch.float64)
    *want, dz = torch.autograd.grad(exact, (h64, w64, logits64))
    h_naive, w_naive = (t.clone().requires_grad_(True) for t in (hidden, weight))
    naive, _ = chain(h_naive, w_naive, torch.float32)
    naive_grads = torch.autograd.grad(naive, (h_naive, w_naive))
    assert_close_elementwise(loss, exact, naive, dtype=torch.float32, name="loss")
    # each gradient entry sums |dz| times |weight| (or |hidden|) terms
    dz = dz.abs().reshape(-1, VOCAB)
    scales = ((dz @ w64.detach().abs()).reshape(hidden.shape),
              dz.t() @ h64.detach().abs().reshape(-1, HIDDEN))
    for name, g, e, n, scale in zip(("hidden", "weight"), got, want, naive_grads, scales):
        assert g.dtype == dtype
        assert_close_elementwise(g, e, n.to(dtype), scale=scale, dtype=dtype, name=f"grad {name}")
    # the fully-masked sequence's hidden states get no gradient
    assert got[0][-1].eq(0).all()


# ------------------------------------------------------------------ the DPO strategy


def test_dpo_strategy_takes_the_new_types():
    gen = torch.Generator().manual_seed(3)
    chosen, rejected = torch.randint(0, 31, (2, 3, 9), generator=gen)
    masks = torch.zeros(2, 3, 9)
    masks[:, :, 4:] = 1
    masks[1, 2, 7:] = 0
    batch = {"chosen": chosen, "rejected": rejected, "chosen_mask": masks[0],
             "rejected_mask": masks[1]}
    model = TinyCausalLM(vocab_size=31, d_model=16, n_layers=1, n_heads=2, max_seq_len=16, seed=0)
    ref_model = TinyCausalLM(vocab_size=31, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
                             seed=1)
    options = dict(loss_type=["sigmoid_norm", "discopop", "bco_pair"], loss_weights=[1, 0.5, 2],
                   discopop_tau=0.2, bco_delta=0.1)
    strategy = StrategyFactory.create("dpo", model, "cpu", ref_model=ref_model, beta=0.3,
                                      loss_backend="torch", **options)
    out = strategy(batch)
    # the same loss from the op on the sequence log-probs of both models
    with torch.no_grad():
        ids, loss_mask, key_mask, _ = strategy._concat_batch(batch)
        seqs = [strategy._sequence_logprobs(lm, ids, loss_mask, key_mask)[0]
                for lm in (model, ref_model)]
        lengths = loss_mask[:, 1:].sum(-1)
        assert lengths.tolist() == [5, 5, 5, 5, 5, 3]
        expected, _ = ak.dpo_loss(seqs[0][:3], seqs[0][3:], seqs[1][:3], seqs[1][3:], beta=0.3,
                                  chosen_lengths=lengths[:3], rejected_lengths=lengths[3:],
                                  **options)
    assert_close(out["loss"], expected.double(), "value")
    assert {"loss/sigmoid_norm", "loss/discopop", "loss/bco_pair"} <= set(out["metrics"])
    with pytest.raises(ValueError, match="reduction='sum'"):
        StrategyFactory.create("dpo", model, "cpu", ref_model=None, loss_backend="torch",
                               loss_type="sigmoid_norm", reduction="mean")
    with pytest.raises(ValueError, match="discopop_tau"):
        StrategyFactory.create("dpo", model, "cpu", ref_model=None, loss_backend="torch",
                               loss_type="discopop", discopop_tau=-1.0)
    with pytest.raises(ValueError, match="needs a fused"):
        StrategyFactory.create("dpo", model, "cpu", ref_model=None, loss_backend="reference",
                               loss_type="apo_zero")


# ------------------------------------------------------------------ bad values of every keyword

B = torch.zeros(3)
BAD_DPO = [
    (dict(loss_type="sft"), ValueError, "loss_type"),
    (dict(loss_type=[]), ValueError, "loss_type"),
    (dict(loss_type=["sigmoid", "sigmoid"]), ValueError, "twice"),
    (dict(loss_type=["sigmoid", "kto"]), ValueError, "loss_type"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), ValueError, "loss_weights"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, -1.0]), ValueError, "loss_weights"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0, math.nan]), ValueError,
     "loss_weights"),
    (dict(loss_weights="1"), TypeError, "loss_weights"),
    (dict(loss_type="exo_pair"), ValueError, "label_smoothing"),
    (dict(loss_type="exo_pair", label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(loss_type="nca_pair", label_smoothing=0.1), ValueError, "label_smoothing"),
    (dict(loss_type=["robust", "aot"], label_smoothing=0.6), ValueError, "label_smoothing"),
    (dict(loss_type="discopop", discopop_tau=0.0), ValueError, "discopop_tau"),
    (dict(loss_type="discopop", discopop_tau=math.inf), ValueError, "discopop_tau"),
    (dict(loss_type="discopop", discopop_tau="0.1"), TypeError, "discopop_tau"),
    (dict(loss_type="sigmoid", discopop_tau=0.1), ValueError, "discopop_tau"),
    (dict(loss_type="bco_pair", bco_delta=math.nan), ValueError, "bco_delta"),
    (dict(loss_type="bco_pair", bco_delta=torch.ones(2)), ValueError, "bco_delta"),
    (dict(loss_type="bco_pair", bco_delta=torch.ones(1, dtype=torch.long)), ValueError,
     "bco_delta"),
    (dict(loss_type="sigmoid", bco_delta=0.1), ValueError, "bco_delta"),
    (dict(loss_type="sigmoid_norm"), ValueError, "chosen_lengths"),
    (dict(loss_type="sigmoid_norm", chosen_lengths=torch.ones(3),
          rejected_lengths=torch.ones(2)), ValueError, "rejected_lengths"),
    (dict(loss_type="sigmoid_norm", chosen_lengths=torch.ones(3, dtype=torch.bool),
          rejected_lengths=torch.ones(3)), TypeError, "chosen_lengths"),
    (dict(loss_type="sigmoid", chosen_lengths=torch.ones(3), rejected_lengths=torch.ones(3)),
     ValueError, "sigmoid_norm"),
    (dict(beta=-1.0, loss_type="apo_zero"), ValueError, "beta"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_DPO)
def test_dpo_bad_keywords(kwargs, error, match):
    with pytest.raises(error, match=match):
        ak.dpo_loss(B, B, B, B, **kwargs)


BAD_PAIR = [
    (ak.orpo_loss, dict(beta=0.0), ValueError, "beta"),
    (ak.orpo_loss, dict(beta=math.nan), ValueError, "beta"),
    (ak.simpo_loss, dict(beta=-2.0), ValueError, "beta"),
    (ak.simpo_loss, dict(gamma=-0.1), ValueError, "gamma"),
    (ak.simpo_loss, dict(gamma=math.inf), ValueError, "gamma"),
    (ak.simpo_loss, dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (ak.simpo_loss, dict(label_smoothing=True), TypeError, "label_smoothing"),
    (ak.cpo_loss, dict(loss_type="alphapo"), ValueError, "loss_type"),
    (ak.cpo_loss, dict(beta=0.0), ValueError, "beta"),
    (ak.cpo_loss, dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (ak.cpo_loss, dict(loss_type="hinge", label_smoothing=0.1), ValueError, "label_smoothing"),
    (ak.cpo_loss, dict(loss_type="sigmoid", simpo_gamma=0.5), ValueError, "simpo_gamma"),
    (ak.cpo_loss, dict(loss_type="simpo", simpo_gamma=-1.0), ValueError, "simpo_gamma"),
    (ak.cpo_loss, dict(alpha=math.inf), ValueError, "alpha"),
    (ak.cpo_loss, dict(alpha="0.1"), TypeError, "alpha"),
]


@pytest.mark.parametrize("op, kwargs, error, match", BAD_PAIR)
def test_reference_free_bad_keywords(op, kwargs, error, match):
    with pytest.raises(error, match=match):
        op(B - 1, B - 2, **kwargs)


def test_reference_free_bad_inputs():
    for op in (ak.orpo_loss, ak.simpo_loss, ak.cpo_loss):
        with pytest.raises(ValueError, match="rejected"):
            op(B, torch.zeros(2))
        with pytest.raises(TypeError, match="chosen"):
            op(torch.zeros(3, dtype=torch.long), B)
        with pytest.raises(ValueError, match="chosen"):
            op(torch.zeros(3, 1), B)


LABELS = torch.tensor([True, False, True])
BAD_KTO = [
    (dict(), ValueError, "needs kl"),
    (dict(kl=0.1, loss_type="apo_zero_unpaired"), ValueError, "kl"),
    (dict(kl=0.1, loss_type="kto_pair"), ValueError, "loss_type"),
    (dict(kl=math.nan), ValueError, "kl"),
    (dict(kl=torch.ones(3)), ValueError, "kl"),
    (dict(kl=0.1, beta=0.0), ValueError, "beta"),
    (dict(kl=0.1, desirable_weight=-1.0), ValueError, "desirable_weight"),
    (dict(kl=0.1, undesirable_weight=math.inf), ValueError, "undesirable_weight"),
    (dict(kl=0.1, desirable_weight=None), TypeError, "desirable_weight"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_KTO)
def test_kto_bad_keywords(kwargs, error, match):
    with pytest.raises(error, match=match):
        ak.kto_loss(B, B, LABELS, **kwargs)


def test_kto_bad_inputs():
    with pytest.raises(TypeError, match="labels"):
        ak.kto_loss(B, B, LABELS.long(), kl=0.0)
    with pytest.raises(ValueError, match="labels"):
        ak.kto_loss(B, B, LABELS[:2], kl=0.0)
    with pytest.raises(ValueError, match="ref_logps"):
        ak.kto_loss(B, torch.zeros(2), LABELS, kl=0.0)
    with pytest.raises(TypeError, match="policy_logps"):
        ak.kto_loss([0.0], None, LABELS, kl=0.0)
