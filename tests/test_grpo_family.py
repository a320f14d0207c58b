"""The GRPO family beyond the clipped surrogate (CISPO, SAPO, LUSPO, VESPO) and its options
(KL ratio correction, importance weights, the off-policy and top-entropy masks, the entropy
bonus), on ``ak.grpo_loss`` and ``ak.linear_grpo_loss``, against TRL's math written here in
float64 (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss`` and
``get_gamma_weights``)."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_linear import _compare as linear_compare
from test_linear import _inputs as _linear_inputs

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.ops._common import LogitsShape
from astrai_kernels.testing import assert_close

from cases import KERNEL_BACKENDS, reference_and_naive, spec_logprobs

BACKENDS = KERNEL_BACKENDS + ["reference"]
FAST_BACKENDS = ["torch", "cpp", "reference"]  # the triton interpreter runs a subset
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def trl_grpo(x, target, advantages, mask, *, old=None, ref=None, sampling=None,
             importance_weights=None, beta=0.0, clip_eps_low=0.2, clip_eps_high=None,
             delta=None, loss_type="bnpo", importance_sampling="token", temperature=1.0,
             max_completion_length=None, normalizer=None, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
             vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
             kl_ratio_correction=False, off_policy_threshold=None, top_entropy_quantile=1.0,
             entropy_coef=0.0, token_stats_out=None):
    """TRL's ``_compute_loss`` on logits ``x`` in ``x``'s dtype: ``(loss, metrics)``.

    The keep/drop decisions of the two masks come from float64 logits whatever ``x``'s dtype,
    so the naive low-precision yardstick makes the same decisions. ``luspo`` is aggregated as
    ``mean_b(sum_t l m)`` (issue 16; TRL's ``mean((l * len_b))`` equals it for sequence ratios
    and beta = 0, see ``test_luspo_matches_trl_literally_at_sequence_level``). Padding holds
    importance weights of 1 here, as TRL's vLLM ratio there is ``exp(0)``. A dict
    ``token_stats_out`` receives the token log-probs and entropies (their ``.grad`` retained).
    """
    dtype = x.dtype
    m = mask.to(dtype)
    bool_mask = mask > 0
    # TRL's padding holds finite log-probs (the tests put NaN there for the ops to ignore)
    old, ref, sampling = (None if v is None else torch.where(bool_mask, v, 0.0)
                          for v in (old, ref, sampling))
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    safe = torch.where(mask > 0, target, 0).unsqueeze(-1)

    def token_stats(logits):
        logp_all = torch.log_softmax(logits / temperature, -1)
        return (logp_all.gather(-1, safe).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1))

    per_token_logps, entropies = token_stats(x)
    if token_stats_out is not None and x.requires_grad:
        per_token_logps.retain_grad()
        entropies.retain_grad()
        token_stats_out.update(logp=per_token_logps, entropy=entropies)
    logps64, entropies64 = token_stats(x.detach().double())
    advantages = advantages.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_logps = per_token_logps.detach() if old is None else old.to(dtype)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        threshold = torch.quantile(entropies64[bool_mask], 1 - top_entropy_quantile)
        entropy_mask = ((entropies64 * m.double() >= threshold) & bool_mask).to(dtype)
    if off_policy_threshold is not None:
        sampling64 = (old.double() if old is not None else logps64) if sampling is None \
            else sampling.double()
        # TRL 1.16 get_off_policy_mask: a NaN (unscored) sampling log-prob gives no KL
        kl_div = torch.nan_to_num(sampling64 - logps64, nan=0.0)
        avg_seq_kl = (kl_div * m.double()).sum(1, keepdim=True) / m.double().sum(
            1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (avg_seq_kl <= off_policy_threshold)).to(dtype)
    log_ratio = per_token_logps - old_logps
    if importance_sampling == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.zeros_like(per_token_logps)
    if ref is not None:
        ref = ref.to(dtype)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if kl_ratio_correction:
            per_token_kl = per_token_kl * coef_1
    phi_seq = None
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - clip_eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_tau_pos, sapo_tau_neg).to(dtype)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        with torch.no_grad():  # get_gamma_weights
            lower_clamp = math.log(1e-8)
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * m, -1, keepdim=True)
            if importance_weights is not None:
                is_ratio = torch.where(bool_mask, importance_weights.to(dtype), 1.0)
                log_is_ratio = torch.clamp(torch.log(is_ratio), lower_clamp, 20.0)
                seq_log_ratio = seq_log_ratio + torch.sum(log_is_ratio, -1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
            is_nonneg_adv = advantages >= 0
            k_seq = torch.where(is_nonneg_adv, vespo_k_pos, vespo_k_neg).to(dtype)
            lambda_seq = torch.where(is_nonneg_adv, vespo_lambda_pos,
                                     vespo_lambda_neg).to(dtype).clamp(min=1e-4)
            log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * torch.exp(log_w_seq)
            phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:
        raise ValueError(loss_type)
    if off_policy_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_weights is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * torch.where(bool_mask, importance_weights.to(dtype), 1.0)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    count = normalizer if normalizer is not None else m.sum()
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type in ("cispo", "dapo", "vespo"):
        loss = (per_token_loss * m).sum() / count
    else:
        loss = (per_token_loss * m).sum(-1).mean()
    if entropy_coef != 0.0:
        effective_mask = m if entropy_mask is None else m * entropy_mask
        if loss_type in ("cispo", "dapo", "vespo"):
            entropy_loss = (entropies * effective_mask).sum() / count
        else:
            entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1)
        loss = loss - entropy_coef * entropy_loss

    def global_masked_mean(values):
        values = values.to(dtype).expand_as(m)
        return (values * m).sum() / m.sum().clamp(min=1.0)

    metrics = {"kl": global_masked_mean(per_token_kl),
               "ratio/mean": global_masked_mean(torch.exp(log_importance_weights))}
    if loss_type == "cispo":
        is_cispo_clipped = (torch.exp(log_importance_weights) > eps_high) & (advantages > 0)
        metrics["clip_ratio/cispo"] = global_masked_mean(is_cispo_clipped)
    if phi_seq is not None:
        metrics["vespo/phi_mean"] = global_masked_mean(phi_seq)
    if entropy_mask is not None:
        metrics["mask/entropy"] = global_masked_mean(entropy_mask)
    if off_policy_threshold is not None:
        metrics["mask/off_policy"] = global_masked_mean(off_policy_mask)
    if entropy_mask is not None or entropy_coef != 0.0:
        metrics["entropy"] = global_masked_mean(entropies)
    return loss, metrics


def _batch(dtype, batch=3, length=6, vocab=45, seed=0, off_policy=0.3):
    """Logits ``[B, T + 1, V]`` (the op sees ``x[:, :-1]``), a mask with one fully masked
    sequence, and per-token inputs holding garbage (NaN, huge ids) under the mask."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(batch, length + 1, vocab, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.25).float()
    mask[0, :4] = 1.0
    mask[-1] = 0.0
    target[mask == 0] = 10**6
    logp = torch.log_softmax(base[:, :-1].double(), -1).gather(
        -1, target.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1).float()
    # sequence 1 (A < 0) drifted: its mean of old - logp is > 0, the off-policy mask drops it
    drift = torch.tensor([0.0, 0.15, 0.0])[:batch, None]
    old = logp + off_policy * torch.randn(batch, length, generator=g) + drift
    ref = logp + 0.2 * torch.randn(batch, length, generator=g)
    advantages = torch.tensor([0.8, -1.1, 0.5])[:batch]
    sampling = old + torch.tensor([-0.3, 0.4, 0.2])[:batch, None]  # one sequence far off
    weights = (0.5 + torch.rand(batch, length, generator=g)).clamp(max=1.3)
    for values in (old, ref, sampling, weights):
        values[mask == 0] = float("nan")
    return dict(base=base, target=target, mask=mask, advantages=advantages, old=old, ref=ref,
                sampling=sampling, weights=weights)


def _kwargs(data, case):
    """The op's keywords of ``case``: the tensor names resolved from ``data``."""
    kwargs = dict(case)
    tensors = dict(old="old_logprobs", ref="ref_logprobs", sampling="sampling_logprobs",
                   weights="importance_weights")
    for short, name in tensors.items():
        if kwargs.pop(short, False):
            kwargs[name] = data[short]
    return kwargs


def _trl_kwargs(kwargs):
    renames = dict(old_logprobs="old", ref_logprobs="ref", sampling_logprobs="sampling")
    return {renames.get(k, k): v for k, v in kwargs.items()}


CASES = {
    "cispo": dict(loss_type="cispo", clip_eps_high=1.05, old=True, ref=True, beta=0.05),
    "cispo_sequence_normalizer": dict(loss_type="cispo", clip_eps_high=1.02, old=True,
                                      importance_sampling="sequence", normalizer=11.0),
    "sapo": dict(loss_type="sapo", old=True, ref=True, beta=0.04),
    "sapo_sequence_taus": dict(loss_type="sapo", old=True, importance_sampling="sequence",
                               sapo_tau_pos=2.0, sapo_tau_neg=0.5),
    "luspo_sequence": dict(loss_type="luspo", old=True, importance_sampling="sequence"),
    "luspo_token_kl": dict(loss_type="luspo", old=True, ref=True, beta=0.05,
                           clip_eps_high=0.28),
    "vespo": dict(loss_type="vespo", old=True, ref=True, beta=0.02),
    "vespo_weights_params": dict(loss_type="vespo", old=True, weights=True, vespo_k_pos=1.5,
                                 vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0,
                                 normalizer=9.0),
    "kl_ratio_correction": dict(loss_type="grpo", old=True, ref=True, beta=0.1,
                                kl_ratio_correction=True),
    "kl_ratio_correction_gspo": dict(loss_type="grpo", old=True, ref=True, beta=0.1,
                                     kl_ratio_correction=True, importance_sampling="sequence"),
    "importance_weights_no_kl": dict(loss_type="bnpo", old=True, weights=True),
    "importance_weights_kl": dict(loss_type="dapo", old=True, ref=True, beta=0.05,
                                  weights=True),
    "off_policy_sampling": dict(loss_type="grpo", old=True, ref=True, beta=0.03,
                                off_policy_threshold=0.1, sampling=True),
    "off_policy_old": dict(loss_type="bnpo", old=True, off_policy_threshold=0.0),
    "top_entropy": dict(loss_type="bnpo", old=True, top_entropy_quantile=0.5),
    "entropy_coef": dict(loss_type="grpo", old=True, entropy_coef=0.05),
    "entropy_coef_dapo_top": dict(loss_type="dapo", old=True, entropy_coef=0.1,
                                  top_entropy_quantile=0.25, normalizer=13.0),
    "everything_cispo": dict(loss_type="cispo", clip_eps_high=1.1, old=True, ref=True,
                             beta=0.05, kl_ratio_correction=True, weights=True,
                             off_policy_threshold=0.1, sampling=True, top_entropy_quantile=0.75,
                             entropy_coef=0.02, temperature=0.8),
}
TRITON_CASES = ["cispo", "sapo_sequence_taus", "vespo_weights_params", "kl_ratio_correction",
                "importance_weights_no_kl", "everything_cispo"]


def _expected(data, kwargs, upstream):
    """``(expected, naive)`` of TRL's math: float64 and the naive same-dtype yardstick."""
    trl_kwargs = _trl_kwargs(kwargs)

    def run(x):
        loss, metrics = trl_grpo(x[:, :-1], data["target"], data["advantages"], data["mask"],
                                 **trl_kwargs)
        (loss * upstream).backward()
        return {"loss": loss, **metrics}

    return reference_and_naive(run, data["base"])


def _logit_grad_terms(logits, data, kwargs, upstream):
    """The magnitude of the terms forming each entry of the gradient of TRL's loss w.r.t.
    ``logits [B, T, V]`` (``testing.spec``): the loss's float64 gradients w.r.t. each token's
    log-prob and entropy, through the softmax."""
    x = logits.detach().double().requires_grad_(True)
    stats = {}
    loss, _ = trl_grpo(x, data["target"], data["advantages"], data["mask"],
                       token_stats_out=stats, **_trl_kwargs(kwargs))
    (loss * upstream).backward()

    def grad_of(name):
        grad = stats[name].grad
        return torch.zeros_like(stats[name]) if grad is None else grad

    target = torch.where(data["mask"] > 0, data["target"], -100)
    terms = spec_logprobs(logits, target.reshape(-1), kwargs.get("temperature", 1.0), -100,
                          True, grad_of("logp").reshape(-1), grad_of("entropy").reshape(-1))
    return terms["grad_terms"].reshape(logits.shape)


def _base_grad_terms(data, kwargs, upstream):
    full = torch.zeros(data["base"].shape, dtype=torch.float64)
    full[:, :-1] = _logit_grad_terms(data["base"][:, :-1], data, kwargs, upstream)
    return full


def _check_against_trl(backend, dtype, data, kwargs, upstream=0.7):
    before = data["base"].clone()
    x = data["base"].detach().clone().requires_grad_(True)
    loss, metrics = ak.grpo_loss(x[:, :-1], data["target"], data["advantages"],
                                 mask=data["mask"], backend=backend, **kwargs)
    expected, naive = _expected(data, kwargs, upstream)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, expected["loss"], "value", dtype, "loss", naive=naive["loss"])
    for key in set(expected) - {"loss", "grad"}:
        assert metrics[key].dtype == torch.float32 and not metrics[key].requires_grad
        assert_close(metrics[key], expected[key], "value", dtype, key, naive=naive[key])
    (loss * upstream).backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected["grad"], "grad", dtype, "grad", naive=naive["grad"],
                 scale=_base_grad_terms(data, kwargs, upstream))
    assert torch.count_nonzero(x.grad[:, :-1][data["mask"] == 0]) == 0
    assert torch.count_nonzero(x.grad[:, -1]) == 0
    assert torch.equal(data["base"], before)
    return loss, metrics


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_matches_trl(backend, case, dtype):
    data = _batch(dtype)
    _check_against_trl(backend, dtype, data, _kwargs(data, CASES[case]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", TRITON_CASES)
def test_matches_trl_triton(case, dtype):
    data = _batch(dtype, batch=3, length=4, vocab=20, seed=3)
    _check_against_trl("triton", dtype, data, _kwargs(data, CASES[case]))


@pytest.mark.parametrize("case", list(CASES))
def test_same_metrics_as_reference(case):
    """Every backend reports the keys reference.py reports, and the masks both drop and keep
    tokens in this batch (so each case checks what it claims to)."""
    data = _batch(torch.float32)
    kwargs = _kwargs(data, CASES[case])
    _, metrics = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                              mask=data["mask"], backend="torch", **kwargs)
    _, expected = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                               mask=data["mask"], backend="reference", **kwargs)
    assert set(metrics) == set(expected)
    for key in ("mask/off_policy", "mask/entropy"):
        if key in metrics:
            assert 0.0 < float(metrics[key]) < 1.0, key
    if case.startswith("cispo"):
        assert 0.0 < float(metrics["clip_ratio/cispo"]) < 1.0


def test_luspo_matches_trl_literally_at_sequence_level():
    """TRL aggregates luspo as ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` on the
    ``[B, 1]`` sequence losses: the same number as ``mean_b(sum_t l m)``."""
    data = _batch(torch.float32)
    x = data["base"][:, :-1].double()
    mask = data["mask"].double()
    logp = torch.log_softmax(x, -1).gather(
        -1, torch.where(mask > 0, data["target"], 0).unsqueeze(-1)).squeeze(-1)
    old = torch.where(mask > 0, data["old"].double(), 0.0)
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1, keepdim=True)
                          / mask.sum(-1, keepdim=True).clamp(min=1.0))
    advantages = data["advantages"].double().unsqueeze(1)
    per_sequence_loss = -torch.min(seq_ratio * advantages,
                                   seq_ratio.clamp(0.8, 1.2) * advantages)
    trl = (per_sequence_loss * mask.sum(1, keepdim=True)).mean()
    loss, _ = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                           mask=data["mask"], old_logprobs=data["old"], loss_type="luspo",
                           importance_sampling="sequence", backend="torch")
    assert_close(loss, trl, "value", torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_fully_masked_batch_gives_zero(backend):
    data = _batch(torch.float32)
    mask = torch.zeros_like(data["mask"])
    x = data["base"].clone().requires_grad_(True)
    for case in ("everything_cispo", "vespo_weights_params", "sapo", "luspo_sequence"):
        kwargs = _kwargs(data, CASES[case])
        kwargs.pop("normalizer", None)
        loss, metrics = ak.grpo_loss(x[:, :-1], data["target"], data["advantages"], mask=mask,
                                     backend=backend, **kwargs)
        loss.backward()
        assert float(loss.detach()) == 0.0, case
        assert all(torch.isfinite(v) for v in metrics.values()), case
        assert torch.count_nonzero(x.grad) == 0, case


LINEAR_CASES = [
    *((backend, case) for backend in ("torch", "cpp", "reference")
      for case in ("cispo", "sapo_sequence_taus", "vespo_weights_params",
                   "importance_weights_no_kl", "everything_cispo")),
    ("triton", "everything_cispo"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend, case", LINEAR_CASES)
def test_linear_matches_trl(backend, case, dtype):
    """The fused head: loss and the gradients of hidden, weight and bias against TRL's math on
    ``F.linear`` in float64 (test_linear's comparison: each entry against the size of the terms
    summed into it)."""
    batch, length, width, vocab = 3, 4, 8, 29
    hidden, weight, bias, _ = _linear_inputs(0, width, vocab, dtype, seed=7,
                                             lead=(batch, length))
    data = _batch(torch.float32, batch=batch, length=length, vocab=vocab, seed=8)
    data["target"] = data["target"].clamp(max=vocab - 1)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        logits64 = F.linear(hidden.double(), weight.double(), bias.double())
        logp = torch.log_softmax(logits64, -1).gather(
            -1, data["target"].unsqueeze(-1)).squeeze(-1).float()
    noise = torch.randn(batch, length, generator=g)
    data["old"] = torch.where(data["mask"] > 0, logp + 0.3 * noise, float("nan"))
    data["ref"] = torch.where(data["mask"] > 0, logp - 0.2 * noise, float("nan"))
    data["sampling"] = data["old"] + torch.tensor([-0.3, 0.4, 0.2])[:, None]
    kwargs = _kwargs(data, CASES[case])
    trl_kwargs = _trl_kwargs(kwargs)

    def fused(h, w, b):
        loss, _ = ak.linear_grpo_loss(h, w, data["target"], data["advantages"], bias=b,
                                      mask=data["mask"], chunk_size=5, backend=backend,
                                      **kwargs)
        return loss

    def logits_fn(logits):
        return trl_grpo(logits, data["target"], data["advantages"], data["mask"],
                        **trl_kwargs)[0]

    linear_compare(fused, logits_fn, (hidden, weight, bias), dtype,
                   grad_logits_terms=lambda z, up: _logit_grad_terms(z, data, kwargs, up))


def test_importance_weights_fold_into_the_fused_kernel():
    """Without a KL term the weights fold into the token weights (the single-pass kernel);
    with one they must not touch it: the two paths agree with TRL either way (checked above),
    and here the fused path is the one taken."""
    from astrai_kernels.ops import grpo as grpo_op

    data = _batch(torch.float32)
    common = dict(mask=data["mask"], old_logprobs=data["old"],
                  importance_weights=data["weights"])
    logits = LogitsShape.of(data["base"][:, :-1])
    folded = grpo_op.plan(logits, data["target"], data["advantages"], **common)
    with_kl = grpo_op.plan(logits, data["target"], data["advantages"],
                           ref_logprobs=data["ref"], beta=0.1, **common)
    assert folded.fused and not with_kl.fused


def test_reference_spec_matches_trl_in_float64():
    """reference.py's spec (what backend='reference' runs) against TRL's math, float64."""
    data = _batch(torch.float32)
    x = data["base"][:, :-1].double()
    for name, case in CASES.items():
        kwargs = _kwargs(data, case)
        expected, expected_metrics = trl_grpo(x, data["target"], data["advantages"],
                                              data["mask"], **_trl_kwargs(kwargs))
        spec_kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v)
                       for k, v in kwargs.items()}
        loss, metrics = reference.grpo_loss(
            x, torch.where(data["mask"] > 0, data["target"], 0), data["advantages"].double(),
            data["mask"], **spec_kwargs)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12, msg=name)
        for key, value in expected_metrics.items():
            torch.testing.assert_close(metrics[key], value.detach(), rtol=1e-12, atol=1e-12,
                                       msg=f"{name} {key}")


BAD_ARGUMENTS = [
    (dict(loss_type="cispo"), ValueError, "clip_eps_high"),
    (dict(loss_type="cispo", clip_eps_high=0.0), ValueError, "clip_eps_high"),
    (dict(loss_type="sapo", clip_eps_high=0.3), ValueError, "clip_eps_high"),
    (dict(loss_type="sapo", delta=1.5), ValueError, "delta"),
    (dict(loss_type="sapo", normalizer=10.0), ValueError, "normalizer"),
    (dict(loss_type="sapo", sapo_tau_pos=0.0), ValueError, "sapo_tau_pos"),
    (dict(loss_type="sapo", sapo_tau_neg=-1.0), ValueError, "sapo_tau_neg"),
    (dict(loss_type="sapo", sapo_tau_neg=float("nan")), ValueError, "sapo_tau_neg"),
    (dict(loss_type="grpo", sapo_tau_pos=2.0), ValueError, "sapo_tau_pos"),
    (dict(loss_type="sapo", sapo_tau_pos="1"), TypeError, "sapo_tau_pos"),
    (dict(loss_type="vespo", vespo_k_pos=-1.0), ValueError, "vespo_k_pos"),
    (dict(loss_type="vespo", vespo_k_neg=float("inf")), ValueError, "vespo_k_neg"),
    (dict(loss_type="vespo", vespo_lambda_pos=0.0), ValueError, "vespo_lambda_pos"),
    (dict(loss_type="vespo", vespo_lambda_neg=-2.0), ValueError, "vespo_lambda_neg"),
    (dict(loss_type="bnpo", vespo_lambda_neg=1.0), ValueError, "vespo_lambda_neg"),
    (dict(kl_ratio_correction=1), TypeError, "kl_ratio_correction"),
    (dict(kl_ratio_correction=True), ValueError, "ref_logprobs"),
    (dict(importance_weights=torch.ones(3, 5)), ValueError, "importance_weights"),
    (dict(importance_weights=torch.ones(3, 6, dtype=torch.long)), TypeError,
     "importance_weights"),
    (dict(importance_weights=-torch.ones(3, 6)), ValueError, "importance_weights"),
    (dict(importance_weights=torch.full((3, 6), float("inf"))), ValueError,
     "importance_weights"),
    (dict(off_policy_threshold=-0.1), ValueError, "off_policy_threshold"),
    (dict(off_policy_threshold=float("nan")), ValueError, "off_policy_threshold"),
    (dict(off_policy_threshold=True), TypeError, "off_policy_threshold"),
    (dict(sampling_logprobs=torch.zeros(3, 6)), ValueError, "off_policy_threshold"),
    (dict(off_policy_threshold=0.1, sampling_logprobs=torch.zeros(3, 7)), ValueError,
     "sampling_logprobs"),
    (dict(off_policy_threshold=0.1, sampling_logprobs=torch.zeros(3, 6, dtype=torch.long)),
     TypeError, "sampling_logprobs"),
    (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile"),
    (dict(top_entropy_quantile=-0.1), ValueError, "top_entropy_quantile"),
    (dict(entropy_coef=float("inf")), ValueError, "entropy_coef"),
    (dict(entropy_coef=None), TypeError, "entropy_coef"),
]


def _bad_id(case):
    kwargs = case[0]
    return "-".join(f"{k}={v if not isinstance(v, torch.Tensor) else tuple(v.shape)}"
                    for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs, error, match", BAD_ARGUMENTS,
                         ids=[_bad_id(c) for c in BAD_ARGUMENTS])
def test_bad_arguments(kwargs, error, match):
    data = _batch(torch.float32)
    with pytest.raises(error, match=match):
        ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                     mask=data["mask"], **kwargs)


def test_bad_arguments_linear():
    hidden, weight = torch.randn(3, 6, 8), torch.randn(45, 8)
    data = _batch(torch.float32)
    target = data["target"].clamp(max=44)
    for kwargs, error, match in BAD_ARGUMENTS[:2] + BAD_ARGUMENTS[15:17]:
        with pytest.raises(error, match=match):
            ak.linear_grpo_loss(hidden, weight, target, data["advantages"], mask=data["mask"],
                                **kwargs)


def test_importance_weights_nan_under_the_mask_is_ignored():
    data = _batch(torch.float32)
    assert torch.isnan(data["weights"][data["mask"] == 0]).all()
    loss, _ = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                           mask=data["mask"], importance_weights=data["weights"],
                           backend="torch")
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_off_policy_mask_keeps_zero_advantage(backend):
    """``A >= 0`` keeps a sequence however far off-policy: a zero advantage included (its
    policy term is 0 either way, so the kept share is what shows it)."""
    data = _batch(torch.float32)
    data["advantages"] = torch.tensor([0.8, 0.0, 0.5])
    kwargs = _kwargs(data, CASES["off_policy_sampling"])
    _, metrics = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                              mask=data["mask"], backend=backend, **kwargs)
    _, expected = trl_grpo(data["base"][:, :-1].double(), data["target"], data["advantages"],
                           data["mask"], **_trl_kwargs(kwargs))
    assert float(expected["mask/off_policy"]) == 1.0
    assert float(metrics["mask/off_policy"]) == 1.0
    data["advantages"] = torch.tensor([0.8, -1e-3, 0.5])
    _, metrics = ak.grpo_loss(data["base"][:, :-1], data["target"], data["advantages"],
                              mask=data["mask"], backend=backend, **kwargs)
    assert float(metrics["mask/off_policy"]) < 1.0


STRATEGY_OPTIONS = [
    dict(loss_type="cispo", clip_eps_high=5.0, kl_ratio_correction=True),
    dict(loss_type="sapo", sapo_tau_pos=1.5, sapo_tau_neg=0.9, entropy_coef=0.01),
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=2.5,
         vespo_lambda_neg=1.5),
    dict(loss_type="luspo", importance_sampling="sequence", off_policy_threshold=0.05,
         top_entropy_quantile=0.5),
]


@pytest.mark.parametrize("fused_head", [False, True], ids=["logits", "fused_head"])
@pytest.mark.parametrize("options", STRATEGY_OPTIONS,
                         ids=[o["loss_type"] for o in STRATEGY_OPTIONS])
def test_strategy_passes_the_options_through(monkeypatch, options, fused_head):
    from test_strategies import grpo_batch, make_model, perturbed

    from astrai_kernels.strategies import GRPOStrategy

    seen = {}
    op_name = "linear_grpo_loss" if fused_head else "grpo_loss"
    policy_loss = getattr(ak, op_name)

    def recording_policy_loss(*args, **kwargs):
        seen.update(kwargs)
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(ak, op_name, recording_policy_loss)
    model = make_model()
    strategy = GRPOStrategy(model, "cpu", old_model=perturbed(model, 0.02, 12),
                            ref_model=perturbed(model, 0.05, 13), kl_coef=0.1,
                            loss_backend="torch", fused_head=fused_head, **options)
    out = strategy(grpo_batch())
    out["loss"].backward()
    passed = seen["options"].keywords()  # the strategy hands the op one GRPOOptions
    assert {k: passed[k] for k in options} == options
    assert torch.isfinite(out["loss"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="needs a fused loss_backend"):
        GRPOStrategy(model, "cpu", old_model=None, ref_model=None, kl_coef=0.0,
                     loss_backend="reference", **options)


def test_torch_compile_fullgraph_traces_the_options():
    """The torch-math path traces whole (no host sync, no data-dependent shape): the entropy
    quantile, the off-policy mask, the entropy bonus. ``aot_eager`` checks the trace and its
    autograd without the inductor's code generation (test_grpo.py compiles the fused path)."""
    data = _batch(torch.float32)
    kwargs = _kwargs(data, CASES["everything_cispo"])

    def loss_fn(x):
        loss, metrics = ak.grpo_loss(x[:, :-1], data["target"], data["advantages"],
                                     mask=data["mask"], backend="cpp", **kwargs)
        return loss * 2.0, metrics["mask/entropy"]

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    x = data["base"].clone().requires_grad_(True)
    out, share = compiled(x)
    out.backward()
    x_eager = data["base"].clone().requires_grad_(True)
    expected, share_eager = loss_fn(x_eager)
    expected.backward()
    assert_close(out, expected, "value", torch.float32)
    assert_close(share, share_eager, "value", torch.float32)
    assert_close(x.grad, x_eager.grad, "grad", torch.float32)
