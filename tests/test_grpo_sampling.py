"""``grpo_loss(..., sampling=...)`` and ``linear_grpo_loss(..., sampling=...)``: the tokens scored
under the sampler's processed distribution (temperature, min_p, top_k, top_p), a token outside
its support masked and counted in ``mask/out_of_support``.

The oracle is independent of the op: the float64 spec's support
(``reference.sampled_token_logprobs`` asked for every vocabulary entry as a target) turns the
logits outside it into ``-inf``, and
``reference.grpo_loss`` on those logits, with the out-of-support tokens masked, is the loss under
the processed distribution (its log-softmax over the kept entries is ``s_y - lse_K``). Judged per
element against that float64 run, allowed twice the float32 run of the same oracle's own error.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.options.grpo import ROLLOUT_IS_MODES, ROLLOUT_RS_OPTIONS
from astrai_kernels.testing import assert_close, assert_close_elementwise

from cases import KERNEL_BACKENDS

BATCH, LENGTH, VOCAB, HIDDEN = 3, 6, 19, 8
SAMPLING = ak.SamplingParams(temperature=0.8, top_k=7, top_p=0.85, min_p=0.02)


def _inputs():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 2.5
    target = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH)
    mask[2, 4:] = 0
    advantages = torch.randn(BATCH, generator=g)
    old = torch.randn(BATCH, LENGTH, generator=g) * 0.3 - 1.0
    ref = old + 0.2 * torch.randn(BATCH, LENGTH, generator=g)
    return logits, target, mask, advantages, old, ref


def _kept(logits, sampling):
    """``[B, T, V]``: the entries the sampler keeps, from the float64 spec."""
    columns = []
    for j in range(logits.shape[-1]):
        target = torch.full(logits.shape[:-1], j)
        columns.append(reference.sampled_token_logprobs(
            logits, target, sampling.temperature, sampling.top_k, sampling.top_p,
            sampling.min_p)[3])
    return torch.stack(columns, -1)


def _oracle(logits, target, mask, advantages, old, ref, options, sampling=SAMPLING):
    """The loss under the processed distribution from the spec, in ``logits``' dtype."""
    kept = _kept(logits.detach().double(), sampling)
    in_support = kept.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    truncated = torch.where(kept, logits, float("-inf"))
    loss, metrics = reference.grpo_loss(truncated, target, advantages.to(logits.dtype),
                                        (mask != 0) & in_support, old.to(logits.dtype),
                                        ref.to(logits.dtype), temperature=sampling.temperature,
                                        **options)
    return loss, in_support


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("options", [dict(loss_type="bnpo", beta=0.04),
                                     dict(loss_type="grpo", importance_sampling="sequence"),
                                     dict(loss_type="cispo", clip_eps_high=4.0)],
                         ids=["bnpo", "gspo", "cispo"])
def test_grpo_loss_under_the_samplers_distribution(backend, options):
    logits, target, mask, advantages, old, ref = _inputs()
    leaf = logits.clone().requires_grad_(True)
    loss, metrics = ak.grpo_loss(leaf, target, advantages, mask=mask, old_logprobs=old,
                                 ref_logprobs=ref, sampling=SAMPLING, backend=backend, **options)
    loss.backward()
    exact_leaf = logits.double().requires_grad_(True)
    exact, in_support = _oracle(exact_leaf, target, mask, advantages, old, ref, options)
    exact.backward()
    naive_leaf = logits.clone().requires_grad_(True)
    naive, _ = _oracle(naive_leaf, target, mask, advantages, old, ref, options)
    naive.backward()
    outside = ((mask != 0) & ~in_support).sum()
    assert 0 < outside < (mask != 0).sum()  # the case masks some tokens, not all
    assert_close(loss, exact, "value", torch.float32, "loss", naive=naive.detach())
    assert_close_elementwise(leaf.grad, exact_leaf.grad, naive_leaf.grad, dtype=torch.float32,
                             name="grad logits")
    share = outside / (mask != 0).sum()
    torch.testing.assert_close(metrics["mask/out_of_support"], share.float())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_linear_grpo_loss_under_the_samplers_distribution(backend):
    logits, target, mask, advantages, old, ref = _inputs()
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    options = dict(loss_type="dapo", beta=0.04)
    leaves = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
    loss, metrics = ak.linear_grpo_loss(*leaves, target, advantages, mask=mask,
                                        old_logprobs=old, ref_logprobs=ref, sampling=SAMPLING,
                                        chunk_size=4, backend=backend, **options)
    logits_op, _ = ak.grpo_loss(F.linear(hidden, weight), target, advantages, mask=mask,
                                old_logprobs=old, ref_logprobs=ref, sampling=SAMPLING,
                                backend=backend, **options)
    exacts = (hidden.double().requires_grad_(True), weight.double().requires_grad_(True))
    exact, _ = _oracle(F.linear(*exacts), target, mask, advantages, old, ref, options)
    exact.backward()
    naives = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
    naive, _ = _oracle(F.linear(*naives), target, mask, advantages, old, ref, options)
    naive.backward()
    loss.backward()
    assert_close(loss, exact, "value", torch.float32, "loss", naive=naive.detach())
    assert_close(loss.detach(), exact, "value", torch.float32, "loss against the logits op",
                 naive=logits_op.detach())
    for name, leaf, exact_leaf, naive_leaf in zip(("hidden", "weight"), leaves, exacts, naives):
        assert_close_elementwise(leaf.grad, exact_leaf.grad, naive_leaf.grad,
                                 dtype=torch.float32, name=f"grad {name}",
                                 scale=exact_leaf.grad.abs().amax(-1, keepdim=True)
                                 .expand_as(exact_leaf.grad))
    assert metrics["mask/out_of_support"] > 0


#: the sampled tokens outside the support in :func:`_corrected_inputs`, and one inside it
#: whose sampler log-prob is far from the old one (its sequence rejected, its weight cut)
OUTSIDE = ((0, 1), (1, 4))
FAR = (2, 2)


@functools.lru_cache(maxsize=1)
def _corrected_inputs():
    """:func:`_inputs` with targets drawn from the sampler's support but at :data:`OUTSIDE`,
    and the sampler's log-probs: ``old`` plus a drift of about 0.15 per token, ``d = old -
    sampling = 3`` at the tokens outside the support (a log-ratio that alone rejects its
    sequence or moves its sequence weight when counted) and ``d = -5`` at :data:`FAR`.
    ``(logits, target, mask, advantages, old, ref, sampling, kept)``, ``kept`` the support
    ``[B, T, V]`` (read only: cached)."""
    logits, _, mask, advantages, old, ref = _inputs()
    kept = _kept(logits.double(), SAMPLING)
    g = torch.Generator().manual_seed(9)
    target = torch.multinomial(kept.reshape(-1, VOCAB).double(), 1, generator=g)
    target = target.view(BATCH, LENGTH)
    for position in OUTSIDE:
        target[position] = int(torch.where(kept[position], 1e9, logits[position]).argmin())
    in_support = kept.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    drift = 0.15 * torch.randn(BATCH, LENGTH, generator=g)
    sampling = torch.where(in_support, old + drift, old - 3.0)
    sampling[FAR] = old[FAR] + 5.0
    return logits, target, mask, advantages, old, ref, sampling, kept


#: every rollout_is mode and rollout_rs option (thresholds the in-support tokens pass, the
#: out-of-support log-ratio does not), and both at once
CORRECTIONS = {
    **{mode: dict(rollout_is=mode, rollout_is_min=0.5, rollout_is_max=2.0)
       for mode in ROLLOUT_IS_MODES},
    **{option: dict(rollout_rs=option,
                    rollout_rs_threshold=2.0 if option.endswith("k1") else 0.5)
       for option in ROLLOUT_RS_OPTIONS},
    "is_and_rs": dict(rollout_is="sequence_truncate", rollout_is_max=2.0,
                      rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0),
}


def _check_correction_reads_the_support(op, inputs, correction, with_old, backend,
                                        options=None):
    """``op`` (``ak.grpo_loss`` or a ``linear_grpo_loss`` whose input is the logits) against
    the float64 spec on the logits outside the support at -inf, with the tokens outside it
    masked by the caller (the loss and every metric: ``rollout_corr/*``, ``sampling/*``, the
    GRPO ones), and against the op itself with the caller masking them (loss, metrics and
    gradient equal)."""
    logits, target, mask, advantages, old, ref, sampling, kept = inputs
    in_support = kept.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    options = dict(loss_type="bnpo", beta=0.04) if options is None else options
    old = old if with_old else None
    keywords = dict(old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling,
                    **options, **correction)
    results = {}
    for name, leaf, op_mask in (("support", logits.clone(), mask),
                                ("caller", logits.clone(), mask * in_support)):
        leaf.requires_grad_(True)
        loss, metrics = op(leaf, target, advantages, mask=op_mask, sampling=SAMPLING,
                           backend=backend, **keywords)
        loss.backward()
        results[name] = loss.detach(), metrics, leaf.grad
    spec = {}
    for dtype in (torch.float64, torch.float32):
        truncated = torch.where(kept, logits.to(dtype), float("-inf"))
        spec[dtype] = reference.grpo_loss(
            truncated, target, advantages.to(dtype), (mask != 0) & in_support,
            None if old is None else old.to(dtype), ref.to(dtype),
            temperature=SAMPLING.temperature, sampling_logprobs=sampling.to(dtype),
            **options, **correction)
    (exact, exact_metrics), (naive, naive_metrics) = spec[torch.float64], spec[torch.float32]
    loss, metrics, grad = results["support"]
    assert_close(loss, exact, "value", torch.float32, "loss", naive=naive)
    outside = ((mask != 0) & ~in_support).sum() / (mask != 0).sum()
    assert ((mask != 0) & ~in_support).sum() == len(OUTSIDE)
    assert set(metrics) == set(exact_metrics) | {"mask/out_of_support"}
    torch.testing.assert_close(metrics["mask/out_of_support"], outside.float())
    for key in exact_metrics:
        assert_close(metrics[key], exact_metrics[key], "value", torch.float32, key,
                     naive=naive_metrics[key])
    caller_loss, caller_metrics, caller_grad = results["caller"]
    torch.testing.assert_close(loss, caller_loss)
    torch.testing.assert_close(grad, caller_grad)
    for key in exact_metrics:
        torch.testing.assert_close(metrics[key], caller_metrics[key], msg=key)


def _identity_head_op(hidden, *args, **keywords):
    """``linear_grpo_loss`` through an identity head: the hidden states are the logits."""
    return ak.linear_grpo_loss(hidden, torch.eye(hidden.shape[-1]), *args, chunk_size=4,
                               **keywords)


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on_policy"])
@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_rollout_correction_reads_the_mask_without_the_tokens_outside_the_support(
        correction, with_old):
    """Issue 45 item 1: a token outside the sampler's support leaves the mask before the
    rollout correction reads it, with ``old_logprobs`` given as without: every correction mode
    and metric equals the spec's and the op's own with the caller masking that token."""
    _check_correction_reads_the_support(ak.grpo_loss, _corrected_inputs(),
                                        CORRECTIONS[correction], with_old, "cpp")


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on_policy"])
@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_rollout_correction_reads_the_support_on_every_backend(backend, with_old):
    _check_correction_reads_the_support(ak.grpo_loss, _corrected_inputs(),
                                        CORRECTIONS["is_and_rs"], with_old, backend,
                                        options=dict(loss_type="grpo"))


@pytest.mark.parametrize("with_old", [True, False], ids=["old", "on_policy"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_linear_rollout_correction_reads_the_support(backend, with_old):
    """``linear_grpo_loss`` (what ``integrations.trl.install(..., score_support="sampler")``
    calls) on hidden states that are the logits themselves (an identity head)."""
    _check_correction_reads_the_support(_identity_head_op, _corrected_inputs(),
                                        CORRECTIONS["is_and_rs"], with_old, backend)


def test_a_filter_off_scores_as_the_plain_op():
    logits, target, mask, advantages, old, ref = _inputs()
    plain, _ = ak.grpo_loss(logits, target, advantages, mask=mask, old_logprobs=old,
                            temperature=0.8, backend="torch")
    sampled, metrics = ak.grpo_loss(logits, target, advantages, mask=mask, old_logprobs=old,
                                    sampling=ak.SamplingParams(temperature=0.8),
                                    backend="torch")
    torch.testing.assert_close(sampled, plain)
    assert float(metrics["mask/out_of_support"]) == 0.0


@pytest.mark.parametrize("keywords, match", [
    (dict(temperature=0.7), "temperature must be left at 1.0"),
    (dict(entropy_coef=0.1), "entropy_coef is not supported with sampling="),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile is not supported"),
    (dict(return_token_values=True), "return_token_values is not supported"),
])
def test_what_sampling_does_not_go_with(keywords, match):
    logits, target, mask, advantages, *_ = _inputs()
    with pytest.raises(ValueError, match=match):
        ak.grpo_loss(logits, target, advantages, mask=mask, sampling=SAMPLING, **keywords)
    with pytest.raises(TypeError, match="sampling must be an astrai_kernels.SamplingParams"):
        ak.grpo_loss(logits, target, advantages, sampling=dict(top_k=3))
