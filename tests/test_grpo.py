import pytest
import torch

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.ops._common import LogitsShape
from astrai_kernels.options.grpo import LOSS_TYPE_RECORDS
from astrai_kernels.testing import assert_close, spec

from cases import (
    COMPILE_BACKENDS,
    DTYPE_IDS,
    DTYPES,
    KERNEL_BACKENDS,
    compile_device,
    reference_and_naive,
)

BACKENDS = KERNEL_BACKENDS + ["reference"]


def _batch(dtype, batch=3, length=6, vocab=45, seed=0, off_policy=0.3):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(batch, length + 1, vocab, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.25).float()
    mask[-1] = 0.0  # one fully masked sequence
    target[mask == 0] = 10**6  # padding ids under the mask are never read
    logp = torch.log_softmax(base[:, :-1].double(), -1).gather(
        -1, target.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1).float()
    old = logp + off_policy * torch.randn(batch, length, generator=g)
    ref = logp + 0.2 * torch.randn(batch, length, generator=g)
    advantages = torch.randn(batch, generator=g)
    return base, target, mask, advantages, old, ref


def _run(backend, base, target, advantages, **kwargs):
    x = base.detach().clone().requires_grad_(True)
    loss, metrics = ak.grpo_loss(x[:, :-1], target, advantages, backend=backend, **kwargs)
    return x, loss, metrics


METRICS = ("kl", "ratio/mean", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region")


def _surrogate_grad_terms(base, target, checked, upstream):
    """The size of the terms forming each gradient entry of a single-pass call (``base``'s
    shape; the advantage and the KL term of a token's ``dL/dlogp`` may cancel)."""
    rows, params = checked.flat_rows(), checked.params
    terms = spec.grpo_terms(base[:, :-1], target.reshape(-1), params.temperature,
                            rows.advantages, rows.old, rows.ref, rows.weight * upstream,
                            params.clip_eps_low, params.clip_eps_high, params.delta, params.beta,
                            params.kl_ratio_correction)
    full = torch.zeros(base.shape, dtype=torch.float64)
    full[:, :-1] = terms
    return full


def _run_reference(base, target, advantages, mask, upstream, metrics=METRICS, **kwargs):
    """``(expected, naive)``: reference.py's loss, metrics and gradient in float64 and in each
    result's dtype (see ``cases.reference_and_naive``)."""
    safe_target = torch.where(mask > 0, target, 0)

    def run(xr):
        def cast(v):
            return v.to(xr.dtype) if isinstance(v, torch.Tensor) else v

        loss, values = reference.grpo_loss(xr[:, :-1], safe_target, cast(advantages),
                                           cast(mask), **{k: cast(v) for k, v in kwargs.items()})
        (loss * upstream).backward()
        return {"loss": loss, **{key: values[key] for key in metrics}}

    return reference_and_naive(run, base)


def _check(backend, dtype, base, target, advantages, mask, upstream=0.7, grad_terms=None,
           metrics_checked=METRICS, **kwargs):
    before = base.clone()
    x, loss, metrics = _run(backend, base, target, advantages, mask=mask, **kwargs)
    expected, naive = _run_reference(base, target, advantages, mask, upstream,
                                     metrics_checked, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, expected["loss"], "value", dtype, "loss", naive=naive["loss"])
    for key in metrics_checked:
        assert metrics[key].dtype == torch.float32 and not metrics[key].requires_grad
        assert_close(metrics[key], expected[key], "value", dtype, key, naive=naive[key])
    (loss * upstream).backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, expected["grad"], "grad", dtype, "grad", naive=naive["grad"],
                 scale=grad_terms)
    masked = (mask == 0)
    assert torch.count_nonzero(x.grad[:, :-1][masked]) == 0, "masked tokens got a gradient"
    assert torch.count_nonzero(x.grad[:, -1]) == 0
    assert torch.equal(base, before)
    return metrics


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_types_with_kl(backend, importance_sampling, loss_type, dtype):
    base, target, mask, advantages, old, ref = _batch(dtype)
    _check(backend, dtype, base, target, advantages, mask, old_logprobs=old, ref_logprobs=ref,
           beta=0.05, loss_type=loss_type, importance_sampling=importance_sampling,
           temperature=0.8, max_completion_length=8, normalizer=None)


# the loss types TRL lacks (tests/test_grpo_family.py checks TRL's against a transcription of
# its GRPOTrainer, and the spec against that): every backend against the float64 spec
BEYOND_TRL = [name for name, record in LOSS_TYPE_RECORDS.items() if not record.trl]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("loss_type", BEYOND_TRL)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_types_beyond_trl(backend, importance_sampling, loss_type, dtype):
    record = LOSS_TYPE_RECORDS[loss_type]
    base, target, mask, advantages, old, ref = _batch(dtype)
    _check(backend, dtype, base, target, advantages, mask, old_logprobs=old, ref_logprobs=ref,
           beta=0.05, loss_type=loss_type, importance_sampling=importance_sampling,
           temperature=0.8, normalizer=11.0 if record.global_count else None,
           metrics_checked=("kl", "ratio/mean", *record.metrics))


def test_sapo_token_mean_is_sapo_over_the_token_count():
    # sapo means each sequence's terms, then the sequences; sapo_token_mean divides the sum by
    # the token count (verl's token-mean): equal on sequences of one length, apart otherwise
    base, target, mask, advantages, old, ref = _batch(torch.float64)
    x, target = base[:, :-1], target.clamp(max=base.shape[-1] - 1)
    options = dict(old_logprobs=old.double(), ref_logprobs=ref.double(), beta=0.05)

    def loss(loss_type, mask, **extra):
        return reference.grpo_loss(x, target, advantages.double(), mask, loss_type=loss_type,
                                   **options, **extra)[0]

    full = torch.ones_like(mask)
    torch.testing.assert_close(loss("sapo_token_mean", full), loss("sapo", full))
    assert not torch.allclose(loss("sapo_token_mean", mask), loss("sapo", mask))
    count = mask.sum()
    torch.testing.assert_close(loss("sapo_token_mean", mask, normalizer=2 * count),
                               loss("sapo_token_mean", mask) / 2)


OPTIONS = [
    dict(),
    dict(clip_eps_low=0.2, clip_eps_high=0.28),
    dict(delta=1.3),
    dict(old=False),
    dict(per_token_advantages=True),
    dict(loss_type="dapo", normalizer=40.0),
    dict(temperature=0.6, beta=0.1),
]


def _options_id(options):
    return "-".join(f"{k}={v}" for k, v in options.items()) or "default"


@pytest.mark.parametrize("options", OPTIONS, ids=_options_id)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_options(backend, importance_sampling, options):
    options = dict(options)
    base, target, mask, advantages, old, ref = _batch(torch.float32, seed=1)
    if options.pop("per_token_advantages", False):
        advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))
    kwargs = dict(old_logprobs=None if options.pop("old", True) is False else old,
                  importance_sampling=importance_sampling, **options)
    if kwargs.get("beta"):
        kwargs["ref_logprobs"] = ref
    _check(backend, torch.float32, base, target, advantages, mask, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_far_off_policy_batch_clips_many_tokens(backend, dtype):
    base, target, mask, advantages, old, ref = _batch(dtype, seed=2, off_policy=3.0)
    old[0, 0] = old[0, 0] - 60.0  # a log-ratio of +60: the +-20 clamp keeps exp finite
    metrics = _check(backend, dtype, base, target, advantages, mask, old_logprobs=old,
                     ref_logprobs=ref, beta=0.02, clip_eps_high=0.28)
    assert metrics["clip_ratio/region"] > 0.2
    assert torch.isfinite(metrics["ratio/mean"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["off_policy", "on_policy", "delta"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kl_ratio_correction_in_the_single_pass_kernel(backend, policy, dtype):
    """TRL's bias-corrected KL, ``beta * k3 * r``, through the single-pass kernel: the loss, the
    ``kl`` metric (with the correction) and the gradient (``dk3 * r + k3 * dr``) against
    reference.py in float64; on-policy ``r = 1`` still carries ``k3``'s share of the gradient,
    and ``delta`` caps the surrogate's ratio but not the KL's."""
    from astrai_kernels.ops import grpo as grpo_op

    base, target, mask, advantages, old, ref = _batch(dtype, seed=5, off_policy=0.6)
    kwargs = dict(old_logprobs=None if policy == "on_policy" else old, ref_logprobs=ref,
                  beta=0.3, kl_ratio_correction=True, loss_type="grpo", temperature=0.8,
                  delta=1.1 if policy == "delta" else None)
    checked = grpo_op.plan(LogitsShape.of(base[:, :-1]), target, advantages, mask=mask, **kwargs)
    assert checked.fused
    _check(backend, dtype, base, target, advantages, mask,
           grad_terms=_surrogate_grad_terms(base, target, checked, 0.7), **kwargs)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_on_policy_ratio_is_one_and_gradient_is_policy_gradient(backend):
    base, target, mask, advantages, _, _ = _batch(torch.float32, seed=3)
    x, loss, metrics = _run(backend, base, target, advantages, mask=mask)
    assert_close(metrics["ratio/mean"], torch.tensor(1.0), "value", torch.float32)
    loss.backward()
    # On-policy GRPO's gradient is -A * dlogp / num_tokens (bnpo).
    xd = base.detach().clone().requires_grad_(True)
    safe = torch.where(mask > 0, target, 0)
    logp = torch.log_softmax(xd[:, :-1], -1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    (-(advantages[:, None] * logp * mask).sum() / mask.sum()).backward()
    assert_close(x.grad, xd.grad, "grad", torch.float32)


def test_no_grad_call_returns_loss_without_graph():
    base, target, mask, advantages, old, _ = _batch(torch.float32)
    x = base.clone().requires_grad_(True)
    with torch.no_grad():
        loss, _ = ak.grpo_loss(x[:, :-1], target, advantages, mask=mask, old_logprobs=old)
    expected, naive = _run_reference(base, target, advantages, mask, 1.0, old_logprobs=old)
    assert loss.grad_fn is None
    assert_close(loss, expected["loss"], "value", torch.float32, naive=naive["loss"])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(loss_type="ppo"), ValueError, "loss_type"),
    (dict(importance_sampling="tokens"), ValueError, "importance_sampling"),
    (dict(beta=0.1), ValueError, "ref_logprobs"),
    (dict(mask=torch.ones(3, 5)), ValueError, "mask"),
    (dict(old_logprobs=torch.zeros(3, 7)), ValueError, "old_logprobs"),
    (dict(clip_eps_low=-0.1), ValueError, "clip_eps_low"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(return_token_values=1), TypeError, "return_token_values"),
])
def test_bad_arguments(kwargs, error, match):
    base, target, mask, advantages, _, _ = _batch(torch.float32)
    kwargs.setdefault("mask", mask)
    with pytest.raises(error, match=match):
        ak.grpo_loss(base[:, :-1], target, advantages, **kwargs)


def test_bad_advantages_and_targets():
    base, target, mask, advantages, _, _ = _batch(torch.float32)
    with pytest.raises(ValueError, match="advantages"):
        ak.grpo_loss(base[:, :-1], target, advantages[:2], mask=mask)
    with pytest.raises(ValueError, match="advantages"):
        ak.grpo_loss(base[:, :-1], target, torch.zeros(3, 6, 1), mask=mask)
    with pytest.raises(ValueError, match="outside"):
        ak.grpo_loss(base[:, :-1], target, advantages)  # unmasked padding ids are read
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        ak.grpo_loss(base[0], target[0], advantages)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(backend):
    base, target, mask, advantages, old, ref = (
        t.to(compile_device(backend)) for t in _batch(torch.float32))

    def loss_fn(x):
        loss, metrics = ak.grpo_loss(x[:, :-1], target, advantages, mask=mask, old_logprobs=old,
                                     ref_logprobs=ref, beta=0.04, backend=backend)
        return loss * 2.0, metrics["kl"]

    compiled = torch.compile(loss_fn, fullgraph=True)
    x = base.clone().requires_grad_(True)
    out, kl = compiled(x)
    out.backward()
    x_eager = base.clone().requires_grad_(True)
    expected, kl_eager = loss_fn(x_eager)
    expected.backward()
    assert_close(out, expected, "value", torch.float32)
    assert_close(kl, kl_eager, "value", torch.float32)
    assert_close(x.grad, x_eager.grad, "grad", torch.float32)


TOKEN_VALUE_CASES = [  # single-pass kernel: clipped surrogate on token ratios, with/without KL
    dict(loss_type="dapo", beta=0.1, ref=True),
    dict(loss_type="grpo", beta=0.1, ref=True, kl_ratio_correction=True),
    dict(loss_type="bnpo"),
    # torch math on the token log-probs: GSPO, SAPO, the entropy mask
    dict(loss_type="grpo", importance_sampling="sequence"),
    dict(loss_type="sapo"),
    dict(loss_type="dapo", top_entropy_quantile=0.5),
]


@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear"])
@pytest.mark.parametrize("case", TOKEN_VALUE_CASES,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_return_token_values(backend, case, linear):
    """``return_token_values=True``: each token's log-prob and entropy (float64 spec, 0 where
    masked, detached) beside the same loss, gradient and metrics as without it, plus the mean
    entropy in the metrics."""
    case = dict(case)
    with_ref = case.pop("ref", False) or case.get("kl_ratio_correction", False)
    base, target, mask, advantages, old, ref = _batch(torch.float32, vocab=37)
    temperature = 0.8
    kwargs = dict(mask=mask, old_logprobs=old, ref_logprobs=ref if with_ref else None,
                  temperature=temperature, backend=backend, **case)
    if linear:
        g = torch.Generator().manual_seed(5)
        hidden = torch.randn(*target.shape, 8, generator=g)
        weight = torch.randn(37, 8, generator=g)

        def call(**extra):
            h = hidden.clone().requires_grad_(True)
            out = ak.linear_grpo_loss(h, weight, target, advantages, chunk_size=4, **kwargs,
                                      **extra)
            out[0].backward()
            return out, h.grad
        logits = (hidden @ weight.T).double()
    else:
        def call(**extra):
            x = base[:, :-1].clone().requires_grad_(True)
            out = ak.grpo_loss(x, target, advantages, **kwargs, **extra)
            out[0].backward()
            return out, x.grad
        logits = base[:, :-1].double()
    (loss, metrics), grad = call()
    (loss_v, metrics_v, values), grad_v = call(return_token_values=True)
    assert torch.equal(loss_v, loss) and torch.equal(grad_v, grad)
    assert set(metrics_v) == set(metrics) | {"entropy"}
    for key in metrics:
        assert torch.equal(metrics_v[key], metrics[key]), key
    valid = mask > 0
    masked_target = torch.where(valid, target, -100)
    expected = reference.token_logprobs(logits, masked_target, temperature)
    naive = reference.token_logprobs(logits.float(), masked_target, temperature)
    assert set(values) == {"logprobs", "entropy"}
    # the entropy's terms (lse - sum_j p_j s_j cancels): their float32 rounding is allowed
    entropy_terms = spec.logprobs_terms(logits, masked_target, temperature, -100,
                                        True)["entropy_terms"].view(target.shape)
    for i, (name, scale) in enumerate((("logprobs", None), ("entropy", entropy_terms))):
        got = values[name]
        assert got.dtype == torch.float32 and got.shape == target.shape
        assert not got.requires_grad
        assert torch.count_nonzero(got[~valid]) == 0, name
        assert_close(got, expected[i], "value", torch.float32, name, naive=naive[i],
                     scale=scale)
    assert_close(metrics_v["entropy"], expected[1][valid].mean(), "value", torch.float32,
                 "entropy mean", naive=naive[1][valid].mean(),
                 scale=entropy_terms[valid].mean())
