"""Pure-PyTorch chunked backend: the primitives of ``ops/_backend.py`` over blocks of rows.

Each block is upcast to float32 on its own, so the extra memory is bounded by a few float32
copies of one block (``CHUNK_ELEMENTS`` elements each), never by ``N x V``.
"""

import torch

CHUNK_ELEMENTS = 1 << 21
LOG_RATIO_CLAMP = 20.0


def unavailable_reason(device):
    return None


def _row_blocks(logits):
    """Yield ``(n0, n1, block)``: flattened rows ``n0:n1`` and their ``[rows, V]`` view."""
    outer, inner, vocab = logits.shape
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for a in range(outer):
        for b0 in range(0, inner, rows):
            b1 = min(inner, b0 + rows)
            yield a * inner + b0, a * inner + b1, logits[a, b0:b1]


def _grad_block(grad, n0, n1):
    inner = grad.shape[1]
    a = n0 // inner
    return grad[a, n0 - a * inner:n1 - a * inner]


def _safe_target(target, valid):
    return torch.where(valid, target, torch.zeros_like(target)).long().unsqueeze(1)


def _shifted_row_stats(s):
    """``(row_max, log_sumexp_shifted, shifted, exp_shifted)`` of a ``[rows, V]`` block.

    Working relative to the row max keeps ``logp`` and entropy accurate for confident rows:
    ``s_y - max`` is exactly 0 there, where ``s_y - lse`` would cancel two large numbers.
    """
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    shifted = s - row_max
    exp_shifted = torch.exp(shifted)
    return row_max.squeeze(1), torch.log(exp_shifted.sum(dim=-1)), shifted, exp_shifted


def logprobs_forward(logits, target, temperature, ignore_index, with_entropy):
    n_rows = target.numel()
    logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.zeros_like(logp)
    entropy = torch.zeros_like(logp) if with_entropy else logp.new_empty(0)
    for n0, n1, block in _row_blocks(logits):
        y = target[n0:n1]
        valid = y != ignore_index
        s = block.float() / temperature
        row_max, log_sum, shifted, exp_shifted = _shifted_row_stats(s)
        row_logp = shifted.gather(1, _safe_target(y, valid)).squeeze(1) - log_sum
        logp[n0:n1] = torch.where(valid, row_logp, 0.0)
        lse[n0:n1] = torch.where(valid, row_max + log_sum, 0.0)
        if with_entropy:
            # H = log S - sum_j e_j d_j / S with d = s - max, e = exp(d), S = sum e;
            # terms with e = 0 (s = -inf) are 0, not 0 * -inf.
            weighted = torch.where(exp_shifted > 0, exp_shifted * shifted, 0.0).sum(dim=-1)
            row_entropy = log_sum - weighted / exp_shifted.sum(dim=-1)
            entropy[n0:n1] = torch.where(valid, row_entropy, 0.0)
    return logp, entropy, lse


def _onehot_minus_p_grad(block, y, valid, p, coef, temperature):
    """``coef * (onehot(y) - p) / T`` with ignored rows zeroed, in float32."""
    g = -p * coef.unsqueeze(1)
    g.scatter_add_(1, _safe_target(y, valid), coef.unsqueeze(1))
    g.mul_(valid.unsqueeze(1) / temperature)
    return g


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, temperature,
                      ignore_index, grad):
    with_entropy = grad_entropy.numel() > 0
    for n0, n1, block in _row_blocks(logits):
        y = target[n0:n1]
        valid = y != ignore_index
        s = block.float() / temperature
        row_lse = lse[n0:n1].unsqueeze(1)
        p = torch.exp(s - row_lse)
        g = _onehot_minus_p_grad(block, y, valid, p, grad_logp[n0:n1], temperature)
        if with_entropy:
            g_h = (grad_entropy[n0:n1] * valid / temperature).unsqueeze(1)
            log_p_plus_h = s - row_lse + entropy[n0:n1].unsqueeze(1)
            g -= g_h * torch.where(p > 0, p * log_p_plus_h, 0.0)
        _grad_block(grad, n0, n1).copy_(g)


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                          grad_scale, grad):
    n_rows = target.numel()
    vocab = logits.shape[-1]
    loss = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.zeros_like(loss)
    for n0, n1, block in _row_blocks(logits):
        y = target[n0:n1]
        valid = y != ignore_index
        z = block.float()
        if softcap:
            z = torch.tanh(z / softcap).mul_(softcap)
        row_max, log_sum, shifted, _ = _shifted_row_stats(z)
        row_lse = row_max + log_sum
        shifted_y = shifted.gather(1, _safe_target(y, valid)).squeeze(1)
        row_loss = (1.0 - label_smoothing) * (log_sum - shifted_y) + z_loss * row_lse * row_lse
        if label_smoothing:
            row_loss = row_loss + label_smoothing * (log_sum - shifted.mean(dim=-1))
        loss[n0:n1] = torch.where(valid, row_loss, 0.0)
        lse[n0:n1] = torch.where(valid, row_lse, 0.0)
        if grad is None:
            continue
        scale = grad_scale[n0:n1] if grad_scale.numel() > 1 else grad_scale.expand(n1 - n0)
        row_scale = torch.where(valid, scale, 0.0).unsqueeze(1)
        p = torch.exp(z - row_lse.unsqueeze(1))
        g = p.mul_((1.0 + 2.0 * z_loss * row_lse).unsqueeze(1))
        g.sub_(label_smoothing / vocab)
        g.scatter_add_(1, _safe_target(y, valid),
                       torch.full_like(row_lse, label_smoothing - 1.0).unsqueeze(1))
        g.mul_(row_scale)
        if softcap:
            g.mul_(1.0 - (z / softcap) ** 2)
        _grad_block(grad, n0, n1).copy_(g)
    return loss, lse


def grpo_token_terms(logp, old_logprobs, ref_logprobs, advantages, clip_low, clip_high, delta,
                     beta):
    """Per-token GRPO loss ``l`` and ``dl/dlogp`` (explicit, as the fused kernels compute them)."""
    raw_log_ratio = logp - old_logprobs if old_logprobs is not None else torch.zeros_like(logp)
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    dratio = ratio * (raw_log_ratio.abs() <= LOG_RATIO_CLAMP)
    if delta > 0:
        dratio_unclipped = dratio * (ratio <= delta)
        ratio_unclipped = ratio.clamp(max=delta)
    else:
        dratio_unclipped, ratio_unclipped = dratio, ratio
    ratio_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    dratio_clipped = dratio * ((ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high))
    unclipped = ratio_unclipped * advantages
    clipped = ratio_clipped * advantages
    take_unclipped = unclipped <= clipped
    loss = -torch.where(take_unclipped, unclipped, clipped)
    dloss = -advantages * torch.where(take_unclipped, dratio_unclipped, dratio_clipped)
    if beta > 0:
        raw_ref_ratio = ref_logprobs - logp
        ref_ratio = raw_ref_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        loss = loss + beta * (torch.exp(ref_ratio) - ref_ratio - 1.0)
        inside = raw_ref_ratio.abs() <= LOG_RATIO_CLAMP
        dloss = dloss + beta * (1.0 - torch.exp(ref_ratio)) * inside
    return loss, dloss


def grpo_forward(logits, target, temperature, advantages, old_logprobs, ref_logprobs,
                 token_weight, clip_low, clip_high, delta, beta, grad):
    n_rows = target.numel()
    logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    loss = torch.zeros_like(logp)
    for n0, n1, block in _row_blocks(logits):
        y = target[n0:n1]
        valid = token_weight[n0:n1] != 0
        s = block.float() / temperature
        row_max, log_sum, shifted, _ = _shifted_row_stats(s)
        row_lse = row_max + log_sum
        row_logp = shifted.gather(1, _safe_target(y, valid)).squeeze(1) - log_sum
        row_logp = torch.where(valid, row_logp, 0.0)
        old = None if old_logprobs is None else old_logprobs[n0:n1]
        ref = None if ref_logprobs is None else ref_logprobs[n0:n1]
        row_loss, dloss = grpo_token_terms(row_logp, old, ref, advantages[n0:n1], clip_low,
                                           clip_high, delta, beta)
        logp[n0:n1] = row_logp
        loss[n0:n1] = torch.where(valid, row_loss, 0.0)
        if grad is None:
            continue
        p = torch.exp(s - row_lse.unsqueeze(1))
        coef = torch.where(valid, dloss * token_weight[n0:n1], 0.0)
        g = _onehot_minus_p_grad(block, y, valid, p, coef, temperature)
        _grad_block(grad, n0, n1).copy_(g)
    return logp, loss
