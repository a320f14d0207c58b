"""reference.py as the kernel primitives, for tests and ``astrai-kernels verify``.

Each function takes a primitive's arguments (see ``astrai_kernels/ops/_backend.py``) and returns
``{name: tensor}`` computed in ``precision``: float64 for the expected result, the result's own
dtype for the naive path whose error is the per-element yardstick of
:mod:`astrai_kernels.testing.tolerances`. With a gradient, ``grad_terms`` is the magnitude of the
terms that form each gradient entry (the ``scale`` of the comparison, float64 only meaningful):
entries that cancel (``p_j`` near ``eps / V`` under label smoothing, ``p_y`` near 1) are judged
against their terms, not against their tiny difference.
"""

import torch

from .. import reference


def _rows(logits, precision):
    x = logits.detach().cpu().reshape(-1, logits.shape[-1]).to(precision)
    return x.requires_grad_(True)


def _grad(x, logits):
    return (torch.zeros(logits.shape, dtype=x.dtype) if x.grad is None
            else x.grad.reshape(logits.shape))


def logprobs(logits, target, temperature, ignore_index, with_entropy, grad_logp=None,
             grad_entropy=None, precision=torch.float64):
    """``logprobs_forward`` (logp, entropy, lse) and, given ``grad_logp``, ``logprobs_backward``
    (grad) by reference.py."""
    x = _rows(logits, precision)
    target = target.cpu().long()
    valid = target != ignore_index
    logp, entropy = reference.token_logprobs(x, target, temperature, ignore_index)
    lse = torch.logsumexp(x / temperature, dim=-1) * valid
    out = {"logp": logp, "entropy": entropy if with_entropy else None, "lse": lse}
    if with_entropy:  # the primitive's entropy = lse - sum_j p_j s_j cancels: judge by its terms
        with torch.no_grad():
            s = x / temperature
            p = torch.softmax(s, dim=-1)
            spread = (p * s.abs()).nan_to_num(0.0, 0.0, 0.0).sum(-1)
            out["entropy_terms"] = (lse.abs() + spread) * valid
    if grad_logp is not None:
        g_lp = grad_logp.cpu().to(precision).expand(logp.shape)
        total = (logp * g_lp).sum()
        # terms of (g_lp * (d_jy - p_j) - g_H * p_j * (s_j - lse + H)) / T
        with torch.no_grad():
            s = x / temperature
            p = torch.softmax(s, dim=-1)
            terms = g_lp.abs().unsqueeze(-1) * (_onehot(target, valid, p) + _prob_terms(s))
        if with_entropy:
            g_h = grad_entropy.cpu().to(precision).expand(logp.shape)
            total = total + (entropy * g_h).sum()
            with torch.no_grad():
                spread = (s - lse.unsqueeze(-1)).abs().nan_to_num(0.0, 0.0, 0.0)
                terms = terms + (g_h.abs().unsqueeze(-1) * p
                                 * (spread + entropy.abs().unsqueeze(-1)))
        total.backward()
        out["grad"] = _grad(x, logits)
        out["grad_terms"] = (terms * valid.unsqueeze(-1) / temperature).reshape(logits.shape)
    return _detached(out)


def _prob_terms(s):
    """``p_j (1 + |log p_j|)``: ``p_j = exp(s_j - lse)`` formed from an exponent of size
    ``|log p_j|``, whose float32 rounding moves ``p_j`` by about ``eps |log p_j|`` relative."""
    log_p = torch.log_softmax(s, dim=-1)
    return (log_p.exp() * (1 + log_p.abs())).nan_to_num(0.0, 0.0, 0.0)


def _detached(out):
    return {k: None if v is None else v.detach() for k, v in out.items()}


def _onehot(target, valid, like):
    onehot = torch.zeros_like(like)
    return onehot.scatter_(-1, torch.where(valid, target, 0).unsqueeze(-1), 1.0)


def cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                  grad_scale=None, precision=torch.float64):
    """``cross_entropy_forward``'s (loss, lse) and, given ``grad_scale``, grad."""
    x = _rows(logits, precision)
    target = target.cpu().long()
    valid = target != ignore_index
    loss = reference.cross_entropy(x, target, ignore_index, "none", label_smoothing, z_loss,
                                   softcap or None)
    z = softcap * torch.tanh(x / softcap) if softcap else x
    lse = torch.logsumexp(z, dim=-1)
    out = {"loss": loss, "lse": lse * valid}
    if grad_scale is not None:
        g = grad_scale.cpu().to(precision).expand(loss.shape)
        (loss * g).sum().backward()
        out["grad"] = _grad(x, logits)
        # terms of g * ((1 + 2 z_loss lse) p_j - (1 - eps) d_jy - eps / V) * (1 - (z_j / c)^2)
        with torch.no_grad():
            p = torch.softmax(z, dim=-1)
            terms = ((1 + 2 * z_loss * lse.abs()).unsqueeze(-1) * _prob_terms(z)
                     + (1 - label_smoothing) * _onehot(target, valid, p)
                     + label_smoothing / z.shape[-1])
            if softcap:  # the factor 1 - (z / c)^2 is itself formed by two terms
                terms = terms * (1 + (z / softcap) ** 2)
            terms = (g * valid).abs().unsqueeze(-1) * terms
        out["grad_terms"] = terms.nan_to_num(0.0, 0.0, 0.0).reshape(logits.shape)
    return _detached(out)


def grpo(logits, target, temperature, advantages, old_logprobs, ref_logprobs, token_weight,
         clip_low, clip_high, delta, beta, with_grad=True, precision=torch.float64):
    """``grpo_forward``'s (logp, loss) and grad of ``sum(token_weight * loss)``."""
    def rows(t):
        return None if t is None else t.detach().cpu().to(precision)

    x = _rows(logits, precision)
    weight = rows(token_weight)
    active = weight != 0
    target = torch.where(active, target.cpu().long(), -100)
    logp_x, _ = reference.token_logprobs(x, target, temperature, -100)
    logp = logp_x.detach().requires_grad_(True)  # for dl/dlogp, the row's coefficient
    ref = rows(ref_logprobs) if beta > 0 else None
    old = None if old_logprobs is None else rows(old_logprobs)
    loss, _, _ = reference.grpo_token_loss(logp, old, ref, rows(advantages), clip_low,
                                           clip_high, delta if delta > 0 else None, beta)
    loss = torch.where(active, loss, 0.0)
    out = {"logp": logp_x, "loss": loss}
    if with_grad:
        (loss * weight).sum().backward()
        coefficient = logp.grad
        logp_x.backward(coefficient)
        out["grad"] = _grad(x, logits)
        # terms of coefficient * (d_jy - p_j) / T; the coefficient is formed by A * r and
        # beta * (1 - exp(dr)), exps of differences of log-probs as large as |logp|, |old|, |ref|
        with torch.no_grad():
            p = torch.softmax(x / temperature, dim=-1)
            lp = logp.detach()
            old_lp = lp if old is None else old
            ratio = torch.exp((lp - old_lp).clamp(-20, 20))
            size = 1 + lp.abs() + old_lp.abs()
            coefficient_terms = rows(advantages).abs() * ratio * size
            if ref is not None:
                kl_terms = beta * (1 + torch.exp((ref - lp).clamp(-20, 20)))
                coefficient_terms = coefficient_terms + kl_terms * (size + ref.abs())
            coefficient_terms = (coefficient_terms * weight).abs() + coefficient.abs()
            terms = coefficient_terms.unsqueeze(-1) * (_onehot(target, active, p)
                                                       + _prob_terms(x / temperature))
        out["grad_terms"] = (terms / temperature).reshape(logits.shape)
    return _detached(out)


def expected_and_naive(spec, logits, *args, **kwargs):
    """``(expected, naive)``: ``spec`` in float64, and the naive path in each result's dtype
    (values in float32, the gradient in the logits' dtype)."""
    expected = spec(logits, *args, precision=torch.float64, **kwargs)
    naive = spec(logits, *args, precision=torch.float32, **kwargs)
    if logits.dtype not in (torch.float32, torch.float64) and "grad" in expected:
        naive["grad"] = spec(logits, *args, precision=logits.dtype, **kwargs)["grad"]
    return expected, naive
