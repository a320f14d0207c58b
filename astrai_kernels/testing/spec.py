"""The size of the terms that form each gradient entry of the kernel primitives, in float64:
the ``scale`` of :mod:`astrai_kernels.testing.tolerances` for tests and ``astrai-kernels verify``.

The values and gradients themselves come from ``reference.py``; this module only says how large
the terms are that the kernels add up: entries that cancel (``p_j`` near ``eps / V`` under label
smoothing, ``p_y`` near 1) are judged against their terms, not against their tiny difference.
Each function takes a primitive's arguments (see ``astrai_kernels/kernels/primitives.py``) with the
logits as ``[N, V]`` rows or any ``[..., V]`` and returns tensors shaped like them.
"""

import torch

from .. import reference


def _rows(logits):
    return logits.detach().cpu().reshape(-1, logits.shape[-1]).double()


def _per_row(values, like):
    return values.detach().cpu().double().expand(like.shape[:-1])


def _onehot(target, valid, like):
    onehot = torch.zeros_like(like)
    return onehot.scatter_(-1, torch.where(valid, target, 0).unsqueeze(-1), 1.0)


def _prob_terms(s):
    """``p_j (1 + |log p_j|)``: ``p_j = exp(s_j - lse)`` formed from an exponent of size
    ``|log p_j|``, whose float32 rounding moves ``p_j`` by about ``eps |log p_j|`` relative."""
    log_p = torch.log_softmax(s, dim=-1)
    return (log_p.exp() * (1 + log_p.abs())).nan_to_num(0.0, 0.0, 0.0)


def logprobs_terms(logits, target, temperature, ignore_index, with_entropy, grad_logp=None,
                   grad_entropy=None):
    """``{"entropy_terms": [N] or None, "grad_terms": [..., V] or None}`` of
    ``logprobs_forward`` (the entropy ``lse - sum_j p_j s_j`` cancels) and, given ``grad_logp``
    (and ``grad_entropy`` with the entropy), of ``logprobs_backward``."""
    x = _rows(logits)
    target = target.detach().cpu().reshape(-1).long()
    valid = target != ignore_index
    s = x / temperature
    lse = torch.logsumexp(s, dim=-1) * valid
    p = torch.softmax(s, dim=-1)
    out = {"entropy_terms": None, "grad_terms": None}
    if with_entropy:
        spread = (p * s.abs()).nan_to_num(0.0, 0.0, 0.0).sum(-1)
        out["entropy_terms"] = (lse.abs() + spread) * valid
    if grad_logp is not None:
        # terms of (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H)) / T
        g_lp = _per_row(grad_logp, x)
        terms = g_lp.abs().unsqueeze(-1) * (_onehot(target, valid, p) + _prob_terms(s))
        if with_entropy:
            _, entropy = reference.token_logprobs(x, target, temperature, ignore_index)
            g_h = _per_row(grad_entropy, x)
            spread = (s - lse.unsqueeze(-1)).abs().nan_to_num(0.0, 0.0, 0.0)
            terms = terms + g_h.abs().unsqueeze(-1) * p * (spread + entropy.abs().unsqueeze(-1))
        out["grad_terms"] = (terms * valid.unsqueeze(-1) / temperature).reshape(logits.shape)
    return out


def cross_entropy_terms(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                        grad_scale, logit_scale=1.0):
    """The gradient terms of ``cross_entropy_backward`` with per-row ``grad_scale``."""
    x = _rows(logits)
    target = target.detach().cpu().reshape(-1).long()
    valid = target != ignore_index
    z = reference.transform_logits(x, logit_scale, softcap or None)
    lse = torch.logsumexp(z, dim=-1)
    # terms of a g ((1 + 2 z_loss lse) p_j - (1 - eps) d_jy - eps / V) (1 - (z_j / c)^2)
    terms = ((1 + 2 * z_loss * lse.abs()).unsqueeze(-1) * _prob_terms(z)
             + (1 - label_smoothing) * _onehot(target, valid, z)
             + label_smoothing / z.shape[-1])
    if softcap:  # the factor 1 - (z / c)^2 is itself formed by two terms
        terms = terms * (1 + (z / softcap) ** 2)
    terms = (_per_row(grad_scale, x) * valid * logit_scale).abs().unsqueeze(-1) * terms
    return terms.nan_to_num(0.0, 0.0, 0.0).reshape(logits.shape)


def grpo_terms(logits, target, temperature, advantages, old_logprobs, ref_logprobs,
               token_weight, clip_low, clip_high, delta, beta, kl_ratio_correction=False):
    """The gradient terms of ``grpo_forward``'s gradient of ``sum(token_weight * loss)``."""
    def rows(t):
        return None if t is None else t.detach().cpu().reshape(-1).double()

    x = _rows(logits)
    weight = rows(token_weight)
    active = weight != 0
    target = torch.where(active, target.detach().cpu().reshape(-1).long(), -100)
    s = x / temperature
    logp, _ = reference.token_logprobs(x, target, temperature, -100)
    logp = logp.requires_grad_(True)  # for dl/dlogp, the row's coefficient
    ref = rows(ref_logprobs) if beta > 0 else None
    old = rows(old_logprobs)
    advantages = rows(advantages)
    with torch.enable_grad():
        loss, ratio, k3 = reference.grpo_token_loss(logp, old, ref, advantages, clip_low,
                                                    clip_high, delta if delta > 0 else None, 0.0)
        if ref is not None:
            loss = loss + beta * (k3 * ratio if kl_ratio_correction else k3)
        (torch.where(active, loss, 0.0) * weight).sum().backward()
    coefficient = logp.grad
    lp = logp.detach()
    # terms of coefficient * (d_jy - p_j) / T; the coefficient is formed by A * r and
    # beta * (1 - exp(dr)), exps of differences of log-probs as large as |logp|, |old|, |ref|
    old_lp = lp if old is None else old
    ratio = torch.exp((lp - old_lp).clamp(-20, 20))
    size = 1 + lp.abs() + old_lp.abs()
    coefficient_terms = advantages.abs() * ratio * size
    if ref is not None:
        ref_log_ratio = (ref - lp).clamp(-20, 20)
        kl_terms = beta * (1 + torch.exp(ref_log_ratio))
        if kl_ratio_correction:  # r * (dk3 + k3): k3 = exp(dr) - dr - 1 adds its own terms
            kl_terms = ratio * (2 * kl_terms + beta * ref_log_ratio.abs())
        coefficient_terms = coefficient_terms + kl_terms * (size + ref.abs())
    coefficient_terms = (coefficient_terms * weight).abs() + coefficient.abs()
    terms = coefficient_terms.unsqueeze(-1) * (_onehot(target, active, s) + _prob_terms(s))
    return (terms / temperature).reshape(logits.shape)
