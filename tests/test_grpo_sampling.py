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

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
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
