"""Rollout correction in ``ak.grpo_loss`` and ``ak.linear_grpo_loss``: TRL 1.16's vLLM
importance sampling (``vllm_importance_sampling_mode``) and verl's rollout correction (TIS,
IcePop, batch normalisation, k1/k2/k3 rejection), against their code transcribed here and run
in float64 (TRL: ``trl/trainer/grpo_trainer.py``; verl: ``verl/trainer/ppo/
rollout_corr_helper.py`` at verl-project/verl 20c30bf8, ``verl/utils/torch_functional.py``),
and against TRL's own ``GRPOTrainer.get_gamma_weights`` and ``get_off_policy_mask``. TRL's IS
ratio is computed inline in ``_generate_and_score_completions``, not in a function: it is
transcribed. The losses the weights and masks enter are test_grpo_family's float64
transcription of TRL's ``_compute_loss``."""

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from test_grpo_family import _base_grad_terms, _expected, _logit_grad_terms, trl_grpo
from test_linear import _compare as linear_compare
from test_linear import _inputs as linear_inputs

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.ops._common import LogitsShape
from astrai_kernels.testing import assert_close

BACKENDS = ["cpp", "torch"]  # and triton once: test_triton_backend


# ------------------------------------------------------------------ the sources, transcribed


def trl_vllm_importance_sampling(old, sampling, mask, mode, clip_min=None, clip_max=3.0):
    """TRL 1.16 ``GRPOTrainer._generate_and_score_completions``: the ratio (grpo_trainer.py
    lines 2660-2707) and its metrics (lines 2860-2895; one process, so ``gather`` is the
    identity and ``nanmin``/``nanmax`` of one value is that value). ``(ratio, metrics)``."""
    device = old.device
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio,
                                                     min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = ((vllm_importance_sampling_ratio < min_val)
                            | (vllm_importance_sampling_ratio > max_val))
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(
            invalid_mis_mask, value=0.0)
    delta = torch.abs(old - sampling)
    mask = mask.bool()
    delta = delta[mask & ~torch.isnan(delta)]
    zero = torch.tensor(0.0, device=device, dtype=old.dtype)
    if sequence_level_is:
        flat_is_ratio = vllm_importance_sampling_ratio.flatten()
    else:
        flat_is_ratio = vllm_importance_sampling_ratio[mask]
    metrics = {
        "sampling/sampling_logp_difference/mean": torch.mean(delta) if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": torch.max(delta) if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": (torch.min(flat_is_ratio)
                                                   if flat_is_ratio.numel() else zero),
        "sampling/importance_sampling_ratio/mean": (torch.mean(flat_is_ratio)
                                                    if flat_is_ratio.numel() else zero),
        "sampling/importance_sampling_ratio/max": (torch.max(flat_is_ratio)
                                                   if flat_is_ratio.numel() else zero),
    }
    return vllm_importance_sampling_ratio, metrics


SAFETY_BOUND = 20.0


def verl_masked_sum(values, mask, axis=None):
    """verl utils/torch_functional.masked_sum."""
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    """verl utils/torch_functional.masked_mean."""
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_correction_weights(log_ratio, response_mask, rollout_is, upper, lower=None,
                            batch_normalize=False):
    """verl ``compute_rollout_correction_weights`` (one process; ``lower`` set is the
    ``"lower_upper"`` IcePop threshold string) and the metrics of ``compute_is_metrics`` this
    package reports. ``(weights, metrics)``."""
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_for_metrics = log_ratio_sum
        raw = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND,
                                    max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        kept = (raw >= lower) & (raw <= upper)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
    metrics = {}
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(),
                                                          max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min())
        metrics["rollout_is_mean"] = verl_masked_mean(weights, response_mask)
    else:
        metrics["rollout_is_mean"] = verl_masked_mean(weights, response_mask)
        mask_bool = response_mask.bool()
        metrics["rollout_is_max"] = weights.masked_fill(~mask_bool, float("-inf")).max()
        metrics["rollout_is_min"] = weights.masked_fill(~mask_bool, float("inf")).min()
    if response_mask.sum() > 1:
        weights_for_std = weights.clamp(min=0.0, max=upper)
        mean_clamped = verl_masked_mean(weights_for_std, response_mask)
        var = verl_masked_mean(weights_for_std.square(), response_mask) - mean_clamped.square()
        metrics["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0))
    else:
        metrics["rollout_is_std"] = torch.zeros(())
    weights_for_ess = weights.clamp(min=0.0, max=upper)
    mean_for_ess = verl_masked_mean(weights_for_ess, response_mask)
    normalized = weights_for_ess / (mean_for_ess + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / verl_masked_mean(normalized.square(),
                                                                    response_mask)
    if batch_normalize:
        if rollout_is == "token":
            weights_mean = verl_masked_mean(weights, response_mask)
        else:
            seq_weights = verl_masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
            metrics["rollout_is_batch_norm_factor"] = weights_mean
        else:
            metrics["rollout_is_batch_norm_factor"] = torch.ones(())
    return weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def verl_rejection_statistic(log_ratio, response_mask, option):
    """The statistic ``compute_rollout_rejection_mask`` thresholds: per token, or per sequence
    ``[B, 1]``."""
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    token_stat = {"k1": -log_ratio_safe, "k2": 0.5 * log_ratio_safe ** 2,
                  "k3": torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe}[option[-2:]]
    if option.startswith("token"):
        return token_stat
    if option.startswith("seq_sum"):
        return verl_masked_sum(token_stat, response_mask, axis=-1).unsqueeze(-1)
    if option.startswith("seq_mean"):
        return verl_masked_mean(token_stat, response_mask, axis=-1).unsqueeze(-1)
    mask_bool = response_mask.bool()
    neg_inf = torch.tensor(float("-inf"), dtype=token_stat.dtype)
    max_values = token_stat.masked_fill(~mask_bool, neg_inf).max(dim=-1).values
    return torch.where(max_values == neg_inf, torch.zeros_like(max_values),
                       max_values).unsqueeze(-1)


def verl_rejection(log_ratio, response_mask, option, upper, lower=None):
    """verl ``compute_rollout_rejection_mask`` for one option (k1: ``lower_upper`` ratio
    bounds, lower ``1 / upper`` by default). ``(modified_response_mask, metrics)``."""
    statistic = verl_rejection_statistic(log_ratio, response_mask, option)
    if option.endswith("k1"):
        lower = 1.0 / upper if lower is None else lower
        keep = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
    else:
        keep = statistic <= upper
    token_keep_bool = keep.expand_as(response_mask)
    final_mask = token_keep_bool.to(log_ratio.dtype)
    response_mask_bool = response_mask.bool()
    final_keep_bool = (final_mask > 0.5) & response_mask_bool
    seq_has_masked = (~final_keep_bool & response_mask_bool).any(dim=-1)
    metrics = {
        "rollout_corr/rollout_rs_masked_fraction": verl_masked_mean(1 - final_mask,
                                                                    response_mask),
        "rollout_corr/rollout_rs_seq_masked_fraction": seq_has_masked.float().mean(),
    }
    return response_mask * final_mask, metrics


def verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """verl ``compute_offpolicy_metrics``: the metrics this package reports."""
    log_ratio = old_log_prob - rollout_log_prob
    mean_log_prob_training = verl_masked_mean(old_log_prob, response_mask, axis=-1)
    mean_log_prob_rollout = verl_masked_mean(rollout_log_prob, response_mask, axis=-1)
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    log_ratio_sum = verl_masked_sum(log_ratio, response_mask, axis=-1)
    log_ratio_sum_safe = torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {
        "rollout_corr/kl": verl_masked_mean(rollout_log_prob - old_log_prob, response_mask),
        "rollout_corr/k3_kl": verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1,
                                               response_mask),
        "rollout_corr/log_ppl_diff": (mean_log_prob_rollout - mean_log_prob_training).mean(),
        "rollout_corr/chi2_token": verl_masked_mean(torch.exp(log_ratio_safe).square(),
                                                    response_mask) - 1.0,
        "rollout_corr/chi2_seq": torch.exp(2.0 * log_ratio_sum_safe).mean() - 1.0,
    }


# ------------------------------------------------------------------ data and comparison


def _data(nan_sampling=True, seed=0, base=None):
    """Logits ``[B, T + 1, V]`` (the op sees ``x[:, :-1]``; ``base`` when given), a padded
    mask with one fully masked sequence, NaN under the mask, and sampler log-probs that drift
    per token and per sequence (with ``nan_sampling``, one unmasked token vLLM could not
    score)."""
    g = torch.Generator().manual_seed(seed)
    batch, length, vocab = 4, 7, 40
    if base is None:
        base = torch.randn(batch, length + 1, vocab, generator=g) * 2
    vocab = base.shape[-1]
    target = torch.randint(0, vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.2).float()
    mask[:3, :4] = 1.0
    mask[-1] = 0.0
    target[mask == 0] = 10**6
    logp = torch.log_softmax(base[:, :-1].double(), -1).gather(
        -1, target.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1).float()
    old = logp + 0.2 * torch.randn(batch, length, generator=g)
    ref = logp + 0.2 * torch.randn(batch, length, generator=g)
    drift = torch.tensor([-0.25, 0.3, 0.0, 0.0])[:, None]
    sampling = old + drift + 0.25 * torch.randn(batch, length, generator=g)
    if nan_sampling:
        sampling[1, 2] = float("nan")
    for values in (old, ref, sampling):
        values[mask == 0] = float("nan")
    return dict(base=base, target=target, mask=mask, advantages=torch.tensor([0.8, -1.1, 0.5,
                                                                              0.3]),
                old=old, ref=ref, sampling=sampling)


def _token_logps(data, dtype):
    """The token log-probs of ``data``'s logits, computed from ``dtype`` logits (``old`` of
    an on-policy call)."""
    logits = data["base"][:, :-1].to(dtype)
    target = data["target"].clamp(max=logits.shape[-1] - 1)
    return torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _call(data, backend, op_kwargs, x=None, **extra):
    x = data["base"] if x is None else x
    return ak.grpo_loss(x[:, :-1], data["target"], data["advantages"], mask=data["mask"],
                        backend=backend, **op_kwargs, **extra)


def _check(backend, data, op_kwargs, trl_kwargs, expected_metrics, trl_mask=None,
           upstream=0.7):
    """The op against TRL's loss with the weights and mask of the source (float64, per
    element, the gradient against the size of its terms), and the correction's metrics
    against the source's in float64 (``expected_metrics``: ``(float64, float32 naive)``)."""
    x = data["base"].clone().requires_grad_(True)
    loss, metrics = _call(data, backend, op_kwargs, x)
    trl_data = dict(data, mask=data["mask"] if trl_mask is None else trl_mask)
    expected, naive = _expected(trl_data, trl_kwargs, upstream)
    assert_close(loss, expected["loss"], "value", torch.float32, "loss", naive=naive["loss"])
    for key in set(expected) - {"loss", "grad"}:
        assert_close(metrics[key], expected[key], "value", torch.float32, key, naive=naive[key])
    exact, naive_metrics = expected_metrics
    for key, value in exact.items():
        assert metrics[key].dtype == torch.float32 and not metrics[key].requires_grad
        assert_close(metrics[key], value, "value", torch.float32, key,
                     naive=naive_metrics[key])
    (loss * upstream).backward()
    assert_close(x.grad, expected["grad"], "grad", torch.float32, "grad", naive=naive["grad"],
                 scale=_base_grad_terms(trl_data, trl_kwargs, upstream))
    assert torch.count_nonzero(x.grad[:, :-1][trl_data["mask"] == 0]) == 0
    return metrics


def _tensors(data, case):
    """``case`` with its tensor flags resolved: old (default on), ref and sampling."""
    kwargs = dict(case)
    if kwargs.pop("old", True):
        kwargs["old_logprobs"] = data["old"]
    if kwargs.pop("ref", False):
        kwargs["ref_logprobs"] = data["ref"]
    kwargs["sampling_logprobs"] = data["sampling"]
    return kwargs


def _trl_modes(data, kwargs):
    """TRL's ratio of ``kwargs`` (its mode and bounds) in float64 and in float32 (the naive
    yardstick), and TRL's loss keywords: the ratio as ``importance_weights``."""
    results = []
    for dtype in (torch.float64, torch.float32):
        old = (_token_logps(data, dtype) if kwargs.get("old_logprobs") is None
               else kwargs["old_logprobs"].to(dtype))
        ratio, metrics = trl_vllm_importance_sampling(
            old, data["sampling"].to(dtype), data["mask"].to(dtype), kwargs["rollout_is"],
            kwargs.get("rollout_is_min"), kwargs.get("rollout_is_max", 3.0))
        results.append((ratio.expand_as(old), metrics))
    (ratio, exact), (_, naive) = results
    trl_kwargs = {k: v for k, v in kwargs.items()
                  if not k.startswith("rollout_") and k != "sampling_logprobs"}
    trl_kwargs["importance_weights"] = ratio
    if "off_policy_threshold" in kwargs:
        trl_kwargs["sampling_logprobs"] = data["sampling"]
    return trl_kwargs, (exact, naive), ratio


TRL_CASES = {
    "token_truncate": dict(rollout_is="token_truncate", rollout_is_max=1.25),
    "token_truncate_both_kl": dict(rollout_is="token_truncate", rollout_is_min=0.8,
                                   rollout_is_max=1.25, loss_type="grpo", ref=True, beta=0.05),
    "token_mask_dapo": dict(rollout_is="token_mask", rollout_is_min=0.8, rollout_is_max=1.25,
                            loss_type="dapo", normalizer=13.0),
    "token_mask_upper_cispo": dict(rollout_is="token_mask", rollout_is_max=1.25,
                                   loss_type="cispo", clip_eps_high=1.1),
    "sequence_truncate": dict(rollout_is="sequence_truncate", rollout_is_min=0.5,
                              rollout_is_max=2.0),
    "sequence_truncate_kl": dict(rollout_is="sequence_truncate", rollout_is_max=2.0,
                                 loss_type="luspo", ref=True, beta=0.05),
    "sequence_mask_gspo": dict(rollout_is="sequence_mask", rollout_is_min=0.5,
                               rollout_is_max=2.0, loss_type="grpo",
                               importance_sampling="sequence"),
    "sequence_mask_lower_sapo": dict(rollout_is="sequence_mask", rollout_is_min=0.5,
                                     rollout_is_max=None, loss_type="sapo"),
    "token_mask_vespo": dict(rollout_is="token_mask", rollout_is_min=0.8, rollout_is_max=1.25,
                             loss_type="vespo"),
    "on_policy_token_truncate": dict(rollout_is="token_truncate", rollout_is_max=1.25,
                                     old=False),
    "on_policy_sequence_mask": dict(rollout_is="sequence_mask", rollout_is_min=0.5,
                                    rollout_is_max=2.5, old=False, loss_type="dr_grpo",
                                    max_completion_length=9),
    "with_off_policy_mask": dict(rollout_is="token_truncate", rollout_is_max=1.25,
                                 loss_type="grpo", off_policy_threshold=0.1),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_trl_modes_match_trl(backend, case):
    data = _data()
    kwargs = _tensors(data, TRL_CASES[case])
    trl_kwargs, expected_metrics, ratio = _trl_modes(data, kwargs)
    _check(backend, data, kwargs, trl_kwargs, expected_metrics)
    # the case exercises its bounds: some unmasked tokens changed by them, some not
    valid = data["mask"] > 0
    mode, low, high = kwargs["rollout_is"], kwargs.get("rollout_is_min"), kwargs.get(
        "rollout_is_max", 3.0)
    if mode.endswith("mask"):
        cut = ratio[valid] == 0
    else:
        cut = torch.zeros_like(ratio[valid], dtype=torch.bool)
        for bound in (low, high):
            if bound is not None:
                cut |= ratio[valid] == bound
    assert cut.any() and not cut.all(), case


@pytest.mark.parametrize("case", ["single_pass", "torch_path"])
def test_triton_backend(case):
    """The triton backend (the interpreter here) on its single-pass kernel and on the torch
    path, against TRL."""
    data = _data()
    cases = dict(single_pass=dict(rollout_is="token_truncate", rollout_is_min=0.8,
                                  rollout_is_max=1.25),
                 torch_path=TRL_CASES["sequence_mask_gspo"])
    kwargs = _tensors(data, cases[case])
    trl_kwargs, expected_metrics, _ = _trl_modes(data, kwargs)
    _check("triton", data, kwargs, trl_kwargs, expected_metrics)


def test_fused_and_unfused_paths_are_both_taken():
    """The weights fold into the single-pass kernel's token weights only when none can be 0
    (truncated from below; the kernel reads a weight of 0 as a masked token): old log-probs
    given, no KL. On-policy calls wait for the log-probs (the torch path)."""
    from astrai_kernels.ops import grpo as grpo_op

    data = _data()
    x = data["base"][:, :-1]

    def plan(**kwargs):
        return grpo_op.plan(LogitsShape.of(x), data["target"], data["advantages"],
                            mask=data["mask"], sampling_logprobs=data["sampling"], **kwargs)

    truncated = dict(rollout_is="token_truncate", rollout_is_min=0.8)
    assert plan(old_logprobs=data["old"], **truncated).fused
    assert not plan(**truncated).fused and plan(**truncated).correction_pending
    assert not plan(old_logprobs=data["old"], ref_logprobs=data["ref"], beta=0.1,
                    **truncated).fused
    assert not plan(old_logprobs=data["old"], rollout_is="token_mask", rollout_is_min=0.8).fused
    assert not plan(old_logprobs=data["old"], rollout_is="token_truncate").fused


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_importance_weights_keep_their_tokens_in_the_metrics(backend):
    """A weight of 0 zeroes a token's policy term, not its log-prob: ``ratio/mean`` and the
    token values still count it (the fused kernel would read it as masked)."""
    data = _data()
    weights = torch.where(data["mask"] > 0, 1.0, float("nan"))
    weights[0, :2] = 0.0
    kwargs = dict(old_logprobs=data["old"])
    _, metrics, values = _call(data, backend, kwargs, importance_weights=weights,
                               return_token_values=True)
    _, expected, expected_values = _call(data, "reference", kwargs, importance_weights=weights,
                                         return_token_values=True)
    assert_close(metrics["ratio/mean"], expected["ratio/mean"], "value", torch.float32,
                 "ratio/mean")
    assert_close(values["logprobs"][0, :2], expected_values["logprobs"][0, :2], "value",
                 torch.float32, "logprobs")
    assert (values["logprobs"][0, :2] != 0).all()


def test_vespo_matches_trl_get_gamma_weights():
    """VESPO with a token mode: TRL puts the ratio inside its gamma weight (``phi``), not on
    the loss; here TRL's own ``GRPOTrainer.get_gamma_weights`` gives ``phi``."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    data = _data()
    kwargs = _tensors(data, TRL_CASES["token_mask_vespo"])
    loss, metrics = _call(data, "cpp", kwargs)
    results = {}
    for dtype in (torch.float64, torch.float32):
        mask = data["mask"].to(dtype)
        logp = _token_logps(data, dtype)
        old = torch.where(mask > 0, data["old"].to(dtype), 0.0)
        ratio, _ = trl_vllm_importance_sampling(old, data["sampling"].to(dtype), mask,
                                                "token_mask", 0.8, 1.25)
        advantages = data["advantages"].to(dtype).unsqueeze(1)
        phi = GRPOTrainer.get_gamma_weights(advantages, logp - old, mask,
                                            importance_sampling_ratio=ratio)
        per_token_loss = -phi * advantages * logp
        results[dtype] = ((per_token_loss * mask).sum() / mask.sum(),
                          (phi.expand_as(mask) * mask).sum() / mask.sum())
    (expected, phi_mean), (naive, naive_phi) = results[torch.float64], results[torch.float32]
    assert_close(loss, expected, "value", torch.float32, "loss", naive=naive)
    assert_close(metrics["vespo/phi_mean"], phi_mean, "value", torch.float32, "phi",
                 naive=naive_phi)


def test_off_policy_mask_matches_trl_with_an_unscored_token():
    """A NaN sampling log-prob (vLLM could not score the token) carries no evidence in TRL's
    own ``get_off_policy_mask``: the sequence with a negative advantage is kept here too."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    data = _data()
    assert torch.isnan(data["sampling"][1][data["mask"][1] > 0]).any()
    for backend in ("cpp", "reference"):
        _, metrics = _call(data, backend, dict(old_logprobs=data["old"],
                                               sampling_logprobs=data["sampling"],
                                               off_policy_threshold=1.0))
        mask = data["mask"].double()
        kept = GRPOTrainer.get_off_policy_mask(
            data["advantages"].double().unsqueeze(1), _token_logps(data, torch.float64),
            torch.where(mask > 0, data["sampling"].double(), 0.0), mask, 1.0)
        expected = (kept.expand_as(mask) * mask).sum() / mask.sum()
        assert float(expected) == 1.0
        assert float(metrics["mask/off_policy"]) == float(expected), backend


# ------------------------------------------------------------------ verl


def _log_ratio(data, dtype):
    """verl's ``old_log_prob - rollout_log_prob``; padding holds finite log-probs there."""
    mask = data["mask"] > 0
    return torch.where(mask, data["old"].to(dtype) - data["sampling"].to(dtype), 0.0)


def _verl_metrics(data, weights_fn=None, rejection_fn=None):
    """verl's metrics of ``data`` (float64, float32) with its IS weights (``weights_fn(
    log_ratio, mask)``) and rejection mask (``rejection_fn``); ``(metrics pair, weights,
    modified mask)`` of the float64 run."""
    runs = []
    for dtype in (torch.float64, torch.float32):
        mask = data["mask"].to(dtype)
        log_ratio = _log_ratio(data, dtype)
        old = torch.where(mask > 0, data["old"].to(dtype), 0.0)
        sampling = torch.where(mask > 0, data["sampling"].to(dtype), 0.0)
        metrics = verl_offpolicy_metrics(old, sampling, mask)
        weights, modified = None, mask
        if weights_fn is not None:
            weights, is_metrics = weights_fn(log_ratio, mask)
            metrics.update(is_metrics)
        if rejection_fn is not None:
            modified, rs_metrics = rejection_fn(log_ratio, mask)
            metrics.update(rs_metrics)
        runs.append((metrics, weights, modified))
    (exact, weights, modified), (naive, _, _) = runs
    return (exact, naive), weights, modified


VERL_IS_CASES = {
    # (op keywords, verl's rollout_is, threshold upper, IcePop lower, batch_normalize)
    "tis_token": (dict(rollout_is="token_truncate", rollout_is_max=1.25), "token", 1.25,
                  None, False),
    "icepop_token": (dict(rollout_is="token_mask", rollout_is_min=0.8, rollout_is_max=1.25,
                          loss_type="grpo"), "token", 1.25, 0.8, False),
    "tis_sequence": (dict(rollout_is="sequence_truncate", rollout_is_max=2.0, ref=True,
                          beta=0.05), "sequence", 2.0, None, False),
    "icepop_sequence": (dict(rollout_is="sequence_mask", rollout_is_min=0.5,
                             rollout_is_max=2.0), "sequence", 2.0, 0.5, False),
    "tis_token_normalized": (dict(rollout_is="token_truncate", rollout_is_max=1.25,
                                  rollout_is_batch_normalize=True), "token", 1.25, None,
                             True),
    "icepop_sequence_normalized": (dict(rollout_is="sequence_mask", rollout_is_min=0.5,
                                        rollout_is_max=2.0, rollout_is_batch_normalize=True,
                                        loss_type="dapo"), "sequence", 2.0, 0.5, True),
}


def _verl_is_case(data, name):
    case, level, upper, lower, normalize = VERL_IS_CASES[name]
    kwargs = _tensors(data, case)

    def weights_fn(log_ratio, mask):
        return verl_correction_weights(log_ratio, mask, level, upper, lower, normalize)

    metrics, weights, _ = _verl_metrics(data, weights_fn)
    trl_kwargs = {k: v for k, v in kwargs.items()
                  if not k.startswith("rollout_") and k != "sampling_logprobs"}
    return kwargs, dict(trl_kwargs, importance_weights=weights), metrics, weights


@pytest.mark.parametrize("case", list(VERL_IS_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_importance_sampling_matches_verl(backend, case):
    """verl's TIS (``rollout_is_threshold=upper``) and IcePop (``"lower_upper"``) at token and
    sequence level, with and without batch normalisation: its weights on the policy term."""
    data = _data(nan_sampling=False)
    kwargs, trl_kwargs, metrics, weights = _verl_is_case(data, case)
    got = _check(backend, data, kwargs, trl_kwargs, metrics)
    if kwargs.get("rollout_is_batch_normalize"):
        assert abs(float(got["rollout_corr/rollout_is_batch_norm_factor"]) - 1.0) > 0.05
    valid = data["mask"] > 0
    assert (weights[valid] != weights[valid].amax()).any()


def _between(values):
    """A threshold strictly between the two middle distinct ``values``."""
    ordered = torch.unique(values)
    middle = len(ordered) // 2
    return float((ordered[middle - 1] + ordered[middle]) / 2)


def _rejection_thresholds(data, option):
    """Thresholds that reject part of the batch for ``option``: k1 keeps ``[lower, upper]``
    around the middle of its statistic, the others keep its lower half."""
    log_ratio = _log_ratio(data, torch.float64)
    mask = data["mask"].double()
    statistic = verl_rejection_statistic(log_ratio, mask, option)
    rows = mask > 0 if option.startswith("token") else mask.sum(-1, keepdim=True) > 0
    values = statistic[rows]
    if not option.endswith("k1"):
        return _between(values), None
    ordered = torch.unique(values)
    quarter = max(len(ordered) // 4, 1)
    lower = math.exp(float((ordered[quarter - 1] + ordered[quarter]) / 2))
    upper = math.exp(float((ordered[-quarter - 1] + ordered[-quarter]) / 2))
    return upper, lower


RS_OPTIONS = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


def _rejection_case(data, option, loss_kwargs):
    upper, lower = _rejection_thresholds(data, option)
    kwargs = _tensors(data, dict(loss_kwargs, rollout_rs=option, rollout_rs_threshold=upper,
                                 rollout_rs_threshold_lower=lower))

    def rejection_fn(log_ratio, mask):
        return verl_rejection(log_ratio, mask, option, upper, lower)

    metrics, _, modified = _verl_metrics(data, rejection_fn=rejection_fn)
    trl_kwargs = {k: v for k, v in kwargs.items()
                  if not k.startswith("rollout_") and k != "sampling_logprobs"}
    return kwargs, trl_kwargs, metrics, modified


@pytest.mark.parametrize("option", RS_OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_rejection_matches_verl(backend, option):
    """verl's rejection: the rejected tokens leave the mask (verl replaces ``response_mask``),
    so they leave the policy term, the KL term and every count of the aggregation."""
    data = _data(nan_sampling=False)
    loss_kwargs = dict(ref=True, beta=0.05, loss_type="grpo" if "mean" in option else "bnpo")
    kwargs, trl_kwargs, metrics, modified = _rejection_case(data, option, loss_kwargs)
    _check(backend, data, kwargs, trl_kwargs, metrics, trl_mask=modified)
    rejected = (data["mask"] > 0) & (modified == 0)
    assert rejected.any() and (modified > 0).any(), option


def test_k1_rejection_defaults_its_lower_bound_to_the_reciprocal():
    """verl's ``_parse_rollout_rs_thresholds``: a k1 threshold without ``lower_`` keeps
    ``[1 / upper, upper]``."""
    data = _data(nan_sampling=False)
    upper = math.exp(0.3)
    kwargs = _tensors(data, dict(rollout_rs="token_k1", rollout_rs_threshold=upper))

    def rejection_fn(log_ratio, mask):
        return verl_rejection(log_ratio, mask, "token_k1", upper)

    metrics, _, modified = _verl_metrics(data, rejection_fn=rejection_fn)
    trl_kwargs = dict(old_logprobs=data["old"])
    _check("cpp", data, kwargs, trl_kwargs, metrics, trl_mask=modified)
    assert ((data["mask"] > 0) & (modified == 0)).any()


def test_importance_sampling_and_rejection_together():
    """verl's pipeline: IcePop weights from the mask as given, rejection applied to it."""
    data = _data(nan_sampling=False)
    kwargs, trl_kwargs, _, weights = _verl_is_case(data, "icepop_token")
    rs_kwargs, _, _, modified = _rejection_case(data, "seq_mean_k3", {})

    def weights_fn(log_ratio, mask):
        return verl_correction_weights(log_ratio, mask, "token", 1.25, 0.8)

    def rejection_fn(log_ratio, mask):
        return verl_rejection(log_ratio, mask, "seq_mean_k3", rs_kwargs["rollout_rs_threshold"])

    metrics, _, _ = _verl_metrics(data, weights_fn, rejection_fn)
    kwargs.update(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_kwargs["rollout_rs_threshold"])
    _check("torch", data, kwargs, trl_kwargs, metrics, trl_mask=modified)


# ------------------------------------------------------------------ the spec, other forms


def _spec(data, kwargs, dtype=torch.float64):
    x = data["base"][:, :-1].to(dtype)
    spec_kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v)
                   for k, v in kwargs.items()}
    return reference.grpo_loss(x, torch.where(data["mask"] > 0, data["target"], 0),
                               data["advantages"].to(dtype), data["mask"], **spec_kwargs)


def test_the_spec_matches_the_sources_in_float64():
    """reference.py's ``grpo_loss`` against TRL's and verl's code, float64, every case."""
    cases = []
    data = _data()
    for name, case in TRL_CASES.items():
        kwargs = _tensors(data, case)
        trl_kwargs, (metrics, _), _ = _trl_modes(data, kwargs)
        cases.append((name, data, kwargs, trl_kwargs, metrics, data["mask"]))
    verl_data = _data(nan_sampling=False)
    for name in VERL_IS_CASES:
        kwargs, trl_kwargs, (metrics, _), _ = _verl_is_case(verl_data, name)
        cases.append((name, verl_data, kwargs, trl_kwargs, metrics, verl_data["mask"]))
    for option in RS_OPTIONS:
        kwargs, trl_kwargs, (metrics, _), modified = _rejection_case(verl_data, option, {})
        cases.append((option, verl_data, kwargs, trl_kwargs, metrics, modified))
    for name, case_data, kwargs, trl_kwargs, expected_metrics, mask in cases:
        loss, metrics = _spec(case_data, kwargs)
        trl_kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v)
                      for k, v in trl_kwargs.items()}
        renames = dict(old_logprobs="old", ref_logprobs="ref", sampling_logprobs="sampling")
        expected, expected_trl_metrics = trl_grpo(
            case_data["base"][:, :-1].double(), case_data["target"], case_data["advantages"],
            mask, **{renames.get(k, k): v for k, v in trl_kwargs.items()})
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12, msg=name)
        for key, value in {**expected_trl_metrics, **expected_metrics}.items():
            torch.testing.assert_close(metrics[key], value.detach().double(), rtol=1e-12,
                                       atol=1e-12, msg=f"{name} {key}")


#: an unmasked token the sampler gave no mass (``d = +inf``) and one the trainer did (``-inf``)
INFINITE = {(0, 1): "sampling", (2, 3): "old"}
INFINITE_CASES = {
    "token": dict(rollout_is="token_truncate", rollout_is_max=1.25, rollout_rs="token_k3",
                  rollout_rs_threshold=2.0),
    "sequence": dict(rollout_is="sequence_truncate", rollout_is_min=0.5, rollout_is_max=2.0,
                     rollout_rs="seq_mean_k1", rollout_rs_threshold=3.0),
}
MISMATCH_METRICS = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff",
                    "rollout_corr/chi2_token", "rollout_corr/chi2_seq")


@pytest.mark.parametrize("case", list(INFINITE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_log_ratio_is_left_out_of_the_mismatch_metrics_and_counted(backend, case):
    """Issue 45 item 4: a ``-inf`` sampler log-prob (``d = +inf``) or old log-prob (``-inf``)
    on an unmasked token keeps the loss and its gradient finite (TRL's ``nan_to_num``: the
    weight truncated or masked, the rejection's statistic clamped at 20). The mismatch
    metrics (verl's ``compute_offpolicy_metrics``, TRL's ``sampling_logp_difference``) are
    the sources' over the other tokens, NaN counting as ``d = 0`` (TRL's rule; TRL's
    difference leaves it out), and count the tokens they leave out:
    ``rollout_corr/infinite_log_ratio_count`` the two, ``sampling/sampling_logp_difference/
    non_finite_count`` the two and the NaN. Every metric equals the float64 spec's."""
    data = _data()
    for position, name in INFINITE.items():
        assert data["mask"][position] > 0
        data[name][position] = float("-inf")
    kwargs = _tensors(data, INFINITE_CASES[case])
    x = data["base"].clone().requires_grad_(True)
    loss, metrics = _call(data, backend, kwargs, x)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    (_, exact), (_, naive) = (_spec(data, kwargs, dtype) for dtype in (torch.float64,
                                                                       torch.float32))
    assert set(metrics) == set(exact)
    for key in exact:
        assert torch.isfinite(metrics[key]), key
        assert_close(metrics[key], exact[key], "value", torch.float32, key, naive=naive[key])
    assert float(metrics["rollout_corr/infinite_log_ratio_count"]) == len(INFINITE)
    unscored = len(INFINITE) + 1  # and TRL's NaN
    assert float(metrics["sampling/sampling_logp_difference/non_finite_count"]) == unscored
    finite_mask = data["mask"].clone()
    for position in INFINITE:
        finite_mask[position] = 0.0
    sources = []
    for dtype in (torch.float64, torch.float32):
        valid = finite_mask > 0
        old = torch.where(valid, data["old"].to(dtype), 0.0)
        sampling = torch.where(valid, data["sampling"].to(dtype), 0.0)
        sampling_scored = torch.where(torch.isnan(sampling), old, sampling)
        verl = verl_offpolicy_metrics(old, sampling_scored, finite_mask.to(dtype))
        _, trl = trl_vllm_importance_sampling(old, sampling, finite_mask.to(dtype),
                                              kwargs["rollout_is"])
        sources.append({**verl, **{key: value for key, value in trl.items()
                                   if "sampling_logp_difference" in key}})
    for key in sources[0]:
        assert_close(metrics[key], sources[0][key], "value", torch.float32, key,
                     naive=sources[1][key])
    assert set(sources[0]) == set(MISMATCH_METRICS) | {
        "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_tokens_keep_their_token_values(backend):
    """``return_token_values``: a rejected token is still scored (its log-prob is what the
    trainer keeps), on the fused path (old given) and the torch path (on-policy)."""
    data = _data(nan_sampling=False)
    expected, naive = (torch.where(data["mask"] > 0, _token_logps(data, dtype), 0.0)
                       for dtype in (torch.float64, torch.float32))
    for old in (data["old"], None):
        _, metrics, values = _call(data, backend, dict(
            old_logprobs=old, sampling_logprobs=data["sampling"], rollout_rs="token_k2",
            rollout_rs_threshold=0.02), return_token_values=True)
        assert 0.0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1.0
        assert_close(values["logprobs"], expected, "value", torch.float32, "logprobs",
                     naive=naive)


def test_linear_form():
    """``linear_grpo_loss`` once, on its single-pass path (token truncation bounded below, a
    token rejection, no KL): the loss and the gradients of hidden, weight and bias against
    TRL's loss on ``F.linear`` in float64."""
    from astrai_kernels.ops import grpo as grpo_op

    batch, length, width, vocab = 4, 7, 8, 40
    hidden, weight, bias, _ = linear_inputs(0, width, vocab, torch.float32, seed=7,
                                            lead=(batch, length))
    with torch.no_grad():
        logits = F.linear(hidden, weight, bias)
    data = _data(nan_sampling=False, base=torch.cat([logits, logits[:, -1:]], 1))
    kwargs = _tensors(data, dict(rollout_is="token_truncate", rollout_is_min=0.8,
                                 rollout_is_max=1.25))
    trl_kwargs, _, _ = _trl_modes(data, kwargs)
    rs_kwargs, _, _, modified = _rejection_case(data, "token_k3", {})
    kwargs.update(rollout_rs="token_k3", rollout_rs_threshold=rs_kwargs["rollout_rs_threshold"])
    assert grpo_op.plan(LogitsShape.of(logits), data["target"], data["advantages"],
                        mask=data["mask"], **kwargs).fused
    trl_data = dict(data, mask=modified)
    trl_args = {("old" if k == "old_logprobs" else k): v for k, v in trl_kwargs.items()}

    def fused(h, w, b):
        return ak.linear_grpo_loss(h, w, data["target"], data["advantages"], bias=b,
                                   mask=data["mask"], chunk_size=5, backend="cpp", **kwargs)[0]

    def logits_fn(logits):
        return trl_grpo(logits, data["target"], data["advantages"], modified, **trl_args)[0]

    linear_compare(fused, logits_fn, (hidden, weight, bias), torch.float32,
                   grad_logits_terms=lambda z, up: _logit_grad_terms(z, trl_data, trl_kwargs,
                                                                     up))


def test_torch_compile_fullgraph_traces_the_correction():
    """No host sync and no data-dependent shape: the correction traces whole (``aot_eager``:
    the trace and its autograd), with the same loss, metrics and gradient as eager."""
    data = _data()
    kwargs = dict(old_logprobs=data["old"], sampling_logprobs=data["sampling"],
                  rollout_is="sequence_mask", rollout_is_min=0.5, rollout_is_max=2.0,
                  rollout_is_batch_normalize=True, rollout_rs="seq_max_k3",
                  rollout_rs_threshold=0.15)

    def loss_fn(x):
        loss, metrics = _call(data, "cpp", kwargs, x)
        return (loss, metrics["rollout_corr/rollout_is_eff_sample_size"],
                metrics["rollout_corr/rollout_rs_masked_fraction"])

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    x = data["base"].clone().requires_grad_(True)
    out = compiled(x)
    out[0].backward()
    x_eager = data["base"].clone().requires_grad_(True)
    expected = loss_fn(x_eager)
    expected[0].backward()
    for got, want in zip(out, expected):
        assert_close(got, want, "value", torch.float32)
    assert 0.0 < float(out[2]) < 1.0
    assert_close(x.grad, x_eager.grad, "grad", torch.float32)


# ------------------------------------------------------------------ contract


@pytest.mark.parametrize("op", [ak.grpo_loss, ak.linear_grpo_loss, reference.grpo_loss],
                         ids=["grpo_loss", "linear_grpo_loss", "reference.grpo_loss"])
def test_keyword_lists_are_the_options(op):
    """Every ``GRPOOptions`` field is a keyword of each public form, with its default."""
    parameters = inspect.signature(op).parameters
    for field in dataclasses.fields(ak.GRPOOptions):
        assert field.name in parameters, field.name
        assert parameters[field.name].default == field.default, field.name


def test_the_options_object_carries_the_correction():
    data = _data()
    kwargs = dict(rollout_is="sequence_mask", rollout_is_min=0.5, rollout_is_max=2.0,
                  rollout_is_batch_normalize=True, rollout_rs="seq_max_k3",
                  rollout_rs_threshold=0.15)
    tensors = dict(old_logprobs=data["old"], sampling_logprobs=data["sampling"])
    by_keywords = _call(data, "cpp", dict(tensors, **kwargs))
    by_object = _call(data, "cpp", dict(tensors, options=ak.GRPOOptions(**kwargs)))
    assert torch.equal(by_keywords[0], by_object[0])
    assert all(torch.equal(by_keywords[1][k], by_object[1][k]) for k in by_keywords[1])


BAD_ARGUMENTS = [
    (dict(rollout_is="token"), ValueError, "rollout_is must be one of"),
    (dict(rollout_is="token_mask", sampling_logprobs=None), ValueError, "sampling_logprobs"),
    (dict(rollout_is="token_truncate", rollout_is_max=None), ValueError, "rollout_is_min or"),
    (dict(rollout_is="token_mask", rollout_is_min=2.0, rollout_is_max=1.5), ValueError,
     "rollout_is_min must be < rollout_is_max"),
    (dict(rollout_is="token_mask", rollout_is_max=-1.0), ValueError, "rollout_is_max"),
    (dict(rollout_is="token_mask", rollout_is_min=float("nan")), ValueError,
     "rollout_is_min"),
    (dict(rollout_is_max=2.0), ValueError, "rollout_is_max applies with rollout_is"),
    (dict(rollout_is_batch_normalize=True), ValueError, "rollout_is_batch_normalize"),
    (dict(rollout_is="token_mask", rollout_is_batch_normalize=1), TypeError,
     "rollout_is_batch_normalize"),
    (dict(rollout_is="token_mask", importance_weights=torch.ones(4, 7)), ValueError,
     "importance_weights"),
    (dict(rollout_is="sequence_mask", loss_type="vespo"), ValueError, "token modes"),
    (dict(rollout_is="token_mask", loss_type="vespo", rollout_is_batch_normalize=True),
     ValueError, "rollout_is_batch_normalize"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), ValueError, "rollout_rs must be"),
    (dict(rollout_rs="token_k2"), ValueError, "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=0.0), ValueError,
     "rollout_rs_threshold"),
    (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1, rollout_rs_threshold_lower=0.5),
     ValueError, "k1 options only"),
    (dict(rollout_rs_threshold=2.0), ValueError, "rollout_rs_threshold applies"),
    (dict(sampling_logprobs=torch.zeros(4, 7)), ValueError, "off_policy_threshold, rollout_is"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_ARGUMENTS,
                         ids=[str(i) for i in range(len(BAD_ARGUMENTS))])
def test_bad_arguments(kwargs, error, match):
    data = _data()
    call = dict(old_logprobs=data["old"], sampling_logprobs=data["sampling"])
    call.update(kwargs)
    with pytest.raises(error, match=match):
        _call(data, "torch", call)
