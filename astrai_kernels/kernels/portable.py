"""Pure-PyTorch chunked backend: the primitives of ``kernels/primitives.py`` over blocks of rows.

Each block is upcast to float32 on its own, so the extra memory is bounded by a few float32
copies of one block (``CHUNK_ELEMENTS`` elements each), never by ``N x V``.

Speed comes from making few passes over each block: ``torch.log_softmax`` / ``torch.softmax``
(one vectorized kernel each, max-shifted internally) do the exponentials, the results land in
float32 scratch blocks reused from block to block (``out=``), the per-row factors (the ignore
mask, ``1 / T``, the upstream gradient) are folded into one per-row coefficient, and the
gradient is written by a single multiply straight into ``grad`` (casting once), after which
the target-class entry (computed in float32) is scattered over it. The backward recomputes
``p`` with ``torch.softmax`` rather than ``exp(s - lse)`` (cheaper, and equal up to rounding).
"""

import math

import torch

from .primitives import LOG_RATIO_CLAMP

CHUNK_ELEMENTS = 1 << 21
# log-probs below this are clamped before they multiply p: p is exactly 0 there in float32
# (p <= exp(LOG_P_FLOOR + log V)), and the clamp keeps ``0 * -inf`` from making a NaN.
LOG_P_FLOOR = -1e4


def unavailable_reason(device):
    return None


def _row_blocks(logits, scratch):
    """Yield ``(n0, n1, block, bufs)``: flattened rows ``n0:n1``, their ``[rows, V]`` view and
    ``scratch`` float32 ``[rows, V]`` blocks to work in. The scratch blocks are allocated once
    and reused for every block of rows; together they hold at most ``CHUNK_ELEMENTS`` elements
    (or one row each), which sets the rows per block (fewer when more scratch is needed, so
    the working set stays cache-sized)."""
    outer, inner, vocab = logits.shape
    rows = min(inner, max(1, CHUNK_ELEMENTS // max(vocab * scratch, 1)))
    bufs = [torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
            for _ in range(scratch)]
    for a in range(outer):
        for b0 in range(0, inner, rows):
            b1 = min(inner, b0 + rows)
            yield a * inner + b0, a * inner + b1, logits[a, b0:b1], [buf[:b1 - b0] for buf in bufs]


def _grad_block(grad, n0, n1):
    inner = grad.shape[1]
    a = n0 // inner
    return grad[a, n0 - a * inner:n1 - a * inner]


def _safe_target(target, valid):
    """``[N, 1]`` int64 targets with masked rows pointed at column 0 (never read as such)."""
    return torch.where(valid, target, torch.zeros_like(target)).long().unsqueeze(1)


def _scaled(block, scale, buf):
    """``float32(block) / scale``: the block itself when it already is that, else into ``buf``."""
    if block.dtype == torch.float32 and scale == 1.0:
        return block if block.is_contiguous() else buf.copy_(block)
    if block.dtype == torch.float32:
        return torch.div(block, scale, out=buf)
    buf.copy_(block)  # upcast first: dividing a bf16/fp16 block would round in that dtype
    return buf if scale == 1.0 else buf.div_(scale)


def _multiplied(block, factor, buf):
    """``float32(block) * factor`` into ``buf`` (never in place on the block)."""
    if block.dtype == torch.float32:
        return torch.mul(block, factor, out=buf)
    return buf.copy_(block).mul_(factor)  # upcast first, as in _scaled


def _tempered(block, temperature, buf):
    """``(s, offset)`` with ``s + offset = float32(block) / T`` per row (``offset`` None: 0).

    At ``T = 1``, ``s`` is the block itself (or its float32 copy). Otherwise ``s = (x - max) / T``
    and ``offset = max / T``: dividing relative to the row max keeps the differences the softmax
    sees exact however large ``x`` is (``x / T`` alone rounds to ``ulp(x / T)``). A row holding
    +inf or NaN, or only -inf, becomes NaN, as its softmax is in float64 torch.
    """
    if temperature == 1.0:
        return _scaled(block, 1.0, buf), None
    row_max = block.amax(-1, keepdim=True).float()
    if block.dtype == torch.float32:
        s = torch.sub(block, row_max, out=buf)
    else:
        s = buf.copy_(block).sub_(row_max)  # upcast first, as in _scaled
    return s.div_(temperature), row_max.squeeze(1).div_(temperature)


def _log_softmax_rows(s, out, y):
    """``(ls, ls_y, s_y)`` of a float32 block: ``ls = log_softmax(s)`` written into ``out``
    (which may be ``s`` itself: ``s_y`` is read first).

    The kernel computes ``ls = (s - max) - log(sum exp(s - max))``, so ``ls_y`` (the log-prob)
    stays accurate for confident rows.
    """
    s_y = s.gather(1, y).squeeze(1)
    ls = torch.log_softmax(s, -1, out=out)
    return ls, ls.gather(1, y).squeeze(1), s_y


def _row_lse(s_y, ls_y, ls, source, scale, offset=None):
    """``lse = s_y - ls_y (+ offset)`` (exact up to rounding; ``offset`` that of
    :func:`_tempered`). Rows where that is not finite (target logit -inf, non-finite rows) take
    ``max(s) - max(ls)`` instead, with ``max(s)`` read as ``offset`` (the max of a tempered
    block is 0) or ``max(source) / scale`` (``s = float32(source) / scale``; rounding is
    monotone, so that is exactly the row max of ``s``, even when ``s`` itself was overwritten
    by ``ls``). A row of -inf only has ``lse = -inf``, as in the other backends (a
    vocabulary shard with no mass on that row, ``distributed/vocab_shard.py``)."""
    lse = s_y - ls_y
    if offset is not None:
        lse = lse + offset
    finite = torch.isfinite(lse)
    if not bool(finite.all()):
        top = offset if offset is not None else source.amax(-1).float() / scale
        lse = torch.where(finite, lse, torch.where(top == -math.inf, top, top - ls.amax(-1)))
    return lse


def _softmax_rows(s, out, y):
    """``(p, logp_y, lse, row_max, log_sum)`` of a float32 block: ``p = softmax(s)`` written into
    ``out`` (which may be ``s`` itself).

    ``logp_y = (s_y - max) - log_sum`` and ``lse = max + log_sum``, relative to the row max as
    the log-softmax kernel does; ``log_sum = -log(max_j p_j)``, since ``p`` at the argmax is
    ``1 / sum_j exp(s_j - max)``.
    """
    row_max = s.amax(-1)
    shifted_y = s.gather(1, y).squeeze(1) - row_max
    p = torch.softmax(s, -1, out=out)
    log_sum = torch.log(p.amax(-1)).neg_()
    return p, shifted_y - log_sum, row_max + log_sum, row_max, log_sum


def _entropy_rows(p, ls):
    """``H = -sum_j p_j log p_j`` per row; terms with ``p_j = 0`` are 0, not ``0 * -inf``
    (``ls`` is clamped in place)."""
    return torch.linalg.vecdot(p, ls.clamp_(min=LOG_P_FLOOR)).neg_()


def _grad_dst(grad_block, p):
    """Where the float32 gradient of a block is assembled: ``grad_block`` itself when it is
    float32 (written once), else ``p``'s scratch block, cast by one copy at the end (a bf16/fp16
    destination would make torch round-trip whole blocks through float32 temporaries)."""
    return grad_block if grad_block.dtype == torch.float32 else p


def _store_grad(grad_block, g, y, target_value, valid):
    """Finish the float32 gradient ``g`` of a block and write it: the target column set to
    ``target_value`` (unless None), masked rows zeroed (exactly, even where ``p`` was NaN as on
    all -inf rows), then one cast into ``grad_block`` when ``g`` is not already it."""
    if target_value is not None:
        g.scatter_(1, y, target_value.unsqueeze(1))
    if not bool(valid.all()):
        g.index_fill_(0, torch.nonzero(~valid).squeeze(1), 0)
    if g is not grad_block:
        grad_block.copy_(g)


def _write_grad(grad_block, p, coef, y, target_value, valid):
    """``grad_block = p * coef`` (per-row ``coef``), its target column ``target_value``."""
    g = torch.mul(p, coef.unsqueeze(1), out=_grad_dst(grad_block, p))
    _store_grad(grad_block, g, y, target_value, valid)


def logprobs_forward(logits, target, params):
    temperature, ignore_index, with_entropy = (
        params.temperature, params.ignore_index, params.with_entropy)
    n_rows = target.numel()
    logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.zeros_like(logp)
    entropy = torch.zeros_like(logp) if with_entropy else logp.new_empty(0)
    if n_rows == 0:
        return logp, entropy, lse
    valid = target != ignore_index
    safe_y = _safe_target(target, valid)
    for n0, n1, block, bufs in _row_blocks(logits, 2 if with_entropy else 1):
        y = safe_y[n0:n1]
        s, offset = _tempered(block, temperature, bufs[0])
        ls, ls_y, s_y = _log_softmax_rows(s, bufs[-1], y)
        logp[n0:n1] = ls_y
        lse[n0:n1] = _row_lse(s_y, ls_y, ls, block, temperature, offset)
        if with_entropy:
            entropy[n0:n1] = _entropy_rows(torch.softmax(s, -1, out=bufs[0]), ls)
    logp = torch.where(valid, logp, 0.0)
    lse = torch.where(valid, lse, 0.0)
    if with_entropy:
        entropy = torch.where(valid, entropy, 0.0)
    return logp, entropy, lse


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, params, grad):
    temperature, ignore_index = params.temperature, params.ignore_index
    if target.numel() == 0:
        return
    with_entropy = grad_entropy.numel() > 0
    valid = target != ignore_index
    safe_y = _safe_target(target, valid)
    # grad = c * (onehot - p) - g_H * p * (log p + H) = c * onehot + p * (a + b * log p)
    c = torch.where(valid, grad_logp, 0.0) / temperature
    if with_entropy:
        b = torch.where(valid, grad_entropy, 0.0).div(-temperature)
        a = torch.addcmul(c.neg(), b, entropy)  # -(c + g_H * H / T)
    else:
        a = c.neg()
    for n0, n1, block, bufs in _row_blocks(logits, 2 if with_entropy else 1):
        y = safe_y[n0:n1]
        s = _tempered(block, temperature, bufs[0])[0]  # the softmax is shift-invariant
        if with_entropy:
            ls = torch.log_softmax(s, -1, out=bufs[1]).clamp_(min=LOG_P_FLOOR)
            p = torch.softmax(s, -1, out=bufs[0])
            # the target entry term by term: c (1 - p_y) and g_H p_y (log p_y + H) are each
            # tiny on a confident row, where a = -(c + g_H H) would round g_H H away
            p_y = p.gather(1, y).squeeze(1)
            row_b, row_c = b[n0:n1], c[n0:n1]
            entropy_term = row_b * p_y * (ls.gather(1, y).squeeze(1) + entropy[n0:n1])
            target_value = torch.addcmul(row_c, p_y, row_c, value=-1.0).add_(entropy_term)
            coef = ls.mul_(row_b.unsqueeze(1)).add_(a[n0:n1].unsqueeze(1))
            grad_block = _grad_block(grad, n0, n1)
            g = torch.mul(p, coef, out=_grad_dst(grad_block, p))
            _store_grad(grad_block, g, y, target_value, valid[n0:n1])
        else:
            p = torch.softmax(s, -1, out=bufs[0])
            p_y = p.gather(1, y).squeeze(1)
            row_a, row_c = a[n0:n1], c[n0:n1]
            _write_grad(_grad_block(grad, n0, n1), p, row_a, y,
                        torch.addcmul(row_c, p_y, row_a), valid[n0:n1])


def _softcapped(block, softcap, bufs, logit_scale=1.0):
    """``(z, t)``: ``t = tanh(a x / c)`` in ``bufs[1]`` and ``z = c * t`` in ``bufs[0]``
    (``a = logit_scale``)."""
    if logit_scale == 1.0:
        u = _scaled(block, softcap, bufs[1])
    else:
        u = _multiplied(block, logit_scale / softcap, bufs[1])
    t = torch.tanh(u, out=bufs[1])  # never in place on the block
    return torch.mul(t, softcap, out=bufs[0]), t


def cross_entropy_forward(logits, target, grad_scale, params, grad):
    ignore_index, label_smoothing, z_loss, softcap, logit_scale = (
        params.ignore_index, params.label_smoothing, params.z_loss, params.softcap,
        params.logit_scale)
    n_rows = target.numel()
    vocab = logits.shape[-1]
    loss = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.zeros_like(loss)
    if n_rows == 0:
        return loss, lse
    valid = target != ignore_index
    safe_y = _safe_target(target, valid)
    eps = label_smoothing
    if grad is not None:
        scale = grad_scale if grad_scale.numel() > 1 else grad_scale.expand(n_rows)
        # dz/dx carries the logit scale: folded into the per-row factor
        row_scale = torch.where(valid, scale, 0.0).mul_(logit_scale)
    # z = a x is its own block when scaled, so the no-grad path's fallback lse can read it
    scaled = logit_scale != 1.0
    for n0, n1, block, bufs in _row_blocks(logits, 2 if softcap or scaled else 1):
        y = safe_y[n0:n1]
        if softcap:
            z, t = _softcapped(block, softcap, bufs, logit_scale)
        elif scaled:
            z = _multiplied(block, logit_scale, bufs[0])
        else:
            z = _scaled(block, 1.0, bufs[0])
        # eps * (lse - mean_j z_j) = eps * (log_sum - (mean_j z_j - max)), taken relative to the
        # row max so it does not lose ulp(lse) on large logits: -eps * mean_j log p_j from the
        # log-softmax, or with the mean in float64 (read before p overwrites z)
        mean_z = z.mean(-1, dtype=torch.float64) if eps and grad is not None else None
        if grad is None:
            ls, logp_y, z_y = _log_softmax_rows(z, bufs[-1], y)
            row_lse = _row_lse(z_y, logp_y, ls, z if softcap or scaled else block, 1.0)
            smooth = ls.mean(-1).neg_() if eps else None
        else:
            p, logp_y, row_lse, row_max, log_sum = _softmax_rows(z, bufs[0], y)
            smooth = log_sum - (mean_z - row_max).float() if eps else None
        row_loss = (1.0 - eps) * -logp_y + z_loss * row_lse * row_lse
        if eps:
            row_loss = row_loss + eps * smooth
        loss[n0:n1] = row_loss
        lse[n0:n1] = row_lse
        if grad is None:
            continue
        # grad = scale * ((1 + 2 z_loss lse) p - (1 - eps) onehot - eps / V) [* (1 - t^2)]
        s_n = row_scale[n0:n1]
        p_mult = 1.0 + 2.0 * z_loss * row_lse
        mult = s_n * p_mult
        shift = s_n * (-eps / vocab)
        # the target entry in the order of the formula: p_y * (1 + 2 z_loss lse) - eps / V
        # - (1 - eps) cancels to exactly 0 when V = 1
        p_y = p.gather(1, y).squeeze(1)
        target_value = (p_y * p_mult - eps / vocab + (eps - 1.0)) * s_n
        grad_block = _grad_block(grad, n0, n1)
        if softcap:  # -g (in p's block) times t^2 - 1, t = tanh(x / c) = z / c
            g = p.mul_(mult.neg_().unsqueeze(1))
            if eps:
                g.sub_(shift.unsqueeze(1))
            g.scatter_(1, y, target_value.neg_().unsqueeze(1))
            g = torch.mul(g, t.square_().sub_(1.0), out=_grad_dst(grad_block, g))
            _store_grad(grad_block, g, y, None, valid[n0:n1])
        else:
            g = torch.mul(p, mult.unsqueeze(1), out=_grad_dst(grad_block, p))
            if eps:
                g.add_(shift.unsqueeze(1))
            _store_grad(grad_block, g, y, target_value, valid[n0:n1])
    return torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0)


def grpo_token_terms(logp, old_logprobs, ref_logprobs, advantages, clip_low, clip_high, delta,
                     beta, kl_ratio_correction):
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
        ref_inside = raw_ref_ratio.abs() <= LOG_RATIO_CLAMP
        k3 = torch.exp(ref_ratio) - ref_ratio - 1.0
        dk3 = (1.0 - torch.exp(ref_ratio)) * ref_inside
        if kl_ratio_correction:
            # k3 * r, r the uncapped ratio (not delta's). Its derivative dk3 * r + k3 * dr is
            # r * (1 - e + k3) = -r * dr inside both clamps, formed so: the sum cancels
            ratio_inside = raw_log_ratio.abs() <= LOG_RATIO_CLAMP
            inner = torch.where(ref_inside, torch.where(ratio_inside, -ref_ratio, dk3),
                                k3 * ratio_inside)
            dk3 = ratio * inner
            k3 = k3 * ratio
        loss = loss + beta * k3
        dloss = dloss + beta * dk3
    return loss, dloss


def grpo_forward(logits, target, advantages, old_logprobs, ref_logprobs, token_weight, params,
                 grad):
    temperature, clip_low, clip_high, delta, beta = (
        params.temperature, params.clip_eps_low, params.clip_eps_high, params.delta, params.beta)
    correction, with_entropy = params.kl_ratio_correction, params.with_entropy
    n_rows = target.numel()
    logp = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.zeros_like(logp) if with_entropy else logp.new_empty(0)
    if n_rows == 0:
        return logp, torch.zeros_like(logp), entropy
    valid = token_weight != 0
    safe_y = _safe_target(target, valid)
    loss = torch.zeros_like(logp) if grad is not None else None
    for n0, n1, block, bufs in _row_blocks(logits, 2 if with_entropy else 1):
        y = safe_y[n0:n1]
        s = _tempered(block, temperature, bufs[0])[0]  # log-probs are shift-invariant
        if grad is None:  # log-probs only here; the token terms are computed once below
            ls, logp[n0:n1], _ = _log_softmax_rows(s, bufs[-1], y)
            if with_entropy:
                entropy[n0:n1] = _entropy_rows(torch.softmax(s, -1, out=bufs[0]), ls)
            continue
        ls = torch.log_softmax(s, -1, out=bufs[1]) if with_entropy else None
        p, row_logp = _softmax_rows(s, bufs[0], y)[:2]
        if with_entropy:
            entropy[n0:n1] = _entropy_rows(p, ls)
        row_valid = valid[n0:n1]
        row_logp = torch.where(row_valid, row_logp, 0.0)
        old = None if old_logprobs is None else old_logprobs[n0:n1]
        ref = None if ref_logprobs is None else ref_logprobs[n0:n1]
        row_loss, dloss = grpo_token_terms(row_logp, old, ref, advantages[n0:n1], clip_low,
                                           clip_high, delta, beta, correction)
        logp[n0:n1] = row_logp
        loss[n0:n1] = row_loss
        # grad = coef * (onehot - p) = -coef * p + coef * onehot, coef = weight * dl/dlogp / T
        coef = torch.where(row_valid, dloss * token_weight[n0:n1], 0.0) / temperature
        neg_coef = coef.neg()
        p_y = p.gather(1, y).squeeze(1)
        _write_grad(_grad_block(grad, n0, n1), p, neg_coef, y,
                    torch.addcmul(coef, p_y, neg_coef), row_valid)
    if grad is None:
        logp = torch.where(valid, logp, 0.0)
        loss, _ = grpo_token_terms(logp, old_logprobs, ref_logprobs, advantages, clip_low,
                                   clip_high, delta, beta, correction)
    if with_entropy:
        entropy = torch.where(valid, entropy, 0.0)
    return logp, torch.where(valid, loss, 0.0), entropy


def vocab_shard_backward(logits, target, lse, alpha, beta, gamma, delta, params, grad):
    temperature, softcap, ignore_index = params.temperature, params.softcap, params.ignore_index
    n_rows = target.numel()
    if n_rows == 0:
        return
    vocab = logits.shape[-1]
    valid = target != ignore_index
    owned = valid & (target >= 0) & (target < vocab)
    y = _safe_target(target, owned)
    # 1/T (the chain rule of s = z / T) folded into the per-row coefficients once
    alpha, gamma = alpha / temperature, torch.where(owned, gamma, 0.0) / temperature
    beta = None if beta is None else beta / temperature
    delta = None if delta is None else delta / temperature
    scratch = 2 + (1 if softcap else 0)
    for n0, n1, block, bufs in _row_blocks(logits, scratch):
        if softcap:
            z, t = _softcapped(block, softcap, bufs[1:])
            s = z if temperature == 1.0 else z.div_(temperature)
        else:
            s = _scaled(block, temperature, bufs[1])
        # log p_j = s_j - lse with the group's lse; p_j = 0 terms never meet -inf (LOG_P_FLOOR)
        log_p = torch.sub(s, lse[n0:n1].unsqueeze(1), out=bufs[1]).clamp_(min=LOG_P_FLOOR)
        g = torch.exp(log_p, out=bufs[0])
        if beta is not None:
            g.mul_(log_p.mul_(beta[n0:n1].unsqueeze(1)).add_(alpha[n0:n1].unsqueeze(1)))
        else:
            g.mul_(alpha[n0:n1].unsqueeze(1))
        if delta is not None:
            g.add_(delta[n0:n1].unsqueeze(1))
        g.scatter_add_(1, y[n0:n1], gamma[n0:n1].unsqueeze(1))
        if softcap:  # dz/dx = 1 - t^2, t = tanh(x / c)
            g.mul_(t.square_().neg_().add_(1.0))
        _store_grad(_grad_block(grad, n0, n1), g, y[n0:n1], None, valid[n0:n1])


def _log_softmax_block(block, temperature, y, out):
    """``(log_softmax(block / T), lse)`` of one float32 block, written into ``out``."""
    s, offset = _tempered(block, temperature, out)
    ls, ls_y, s_y = _log_softmax_rows(s, out, y)
    return ls, _row_lse(s_y, ls_y, ls, block, temperature, offset)


def _distill_mixture(a, b, log_w_s, log_w_t, out):
    """``m = logaddexp(a + log_w_s, b + log_w_t)`` into ``out`` (``b`` itself when reverse)."""
    if log_w_s == float("-inf"):
        return b
    torch.add(a, log_w_s, out=out)
    return torch.logaddexp(out, b + log_w_t, out=out)


def _kl_rows(log_p, log_m, buf):
    """``sum_j p_j (log p_j - log m_j)`` per row, terms with ``p_j = 0`` as 0."""
    p = torch.exp(log_p, out=buf)
    terms = torch.where(p == 0, 0.0, p * (log_p - log_m))  # NaN stays NaN
    return terms.sum(-1)


def _distill_grad_block(block, y, a, b, m, row_kl, row_upstream, params, exp_buf, hard_buf):
    """The student's float32 gradient of one block (before ``_store_grad``) from its
    log-probs ``a``, ``b``, the mixture ``m`` (unused for beta = 0), each row's student_kl and
    upstream gradient; ``exp_buf`` and ``hard_buf`` are free float32 blocks (``b``'s may be
    the first)."""
    coef = (row_upstream / params.temperature).unsqueeze(1)
    if params.beta == 0:
        g = torch.exp(a).sub_(torch.exp(b, out=exp_buf)).mul_(coef)
    else:
        w_s = params.weights.w_s
        p = torch.exp(a)
        diff = (a - m).sub_(row_kl.unsqueeze(1))
        g = torch.where(p == 0, 0.0, p * diff).mul_(coef * w_s)
    if params.hard_weight:
        hard_coef = (row_upstream * params.hard_weight).unsqueeze(1)
        p1 = torch.softmax(_scaled(block, 1.0, hard_buf), -1)
        g.add_(p1 * hard_coef)
        g.scatter_add_(1, y, -hard_coef)
    return g


def distill_forward(student, teacher, target, grad_scale, params, grad):
    """With ``grad``, each block's gradient is written from the log-probs and mixture the loss
    just used (not recomputed as in ``distill_backward``)."""
    ignore_index, beta, temperature, hard_weight = (
        params.ignore_index, params.beta, params.temperature, params.hard_weight)
    n_rows = target.numel()
    loss, lse_s, lse_t, kl_s = (torch.zeros(n_rows, dtype=torch.float32, device=student.device)
                                for _ in range(4))
    hard_lse = torch.zeros_like(loss) if hard_weight else loss.new_empty(0)
    if n_rows == 0:
        return loss, lse_s, lse_t, kl_s, hard_lse
    valid = target != ignore_index
    safe_y = _safe_target(target, valid)
    if grad is not None:
        upstream = torch.where(valid, grad_scale.reshape(-1).float().expand(n_rows), 0.0)
    w = params.weights
    inner = student.shape[1]
    for n0, n1, block, bufs in _row_blocks(student, 4):
        y = safe_y[n0:n1]
        a_idx, b0 = n0 // inner, n0 % inner
        teacher_block = teacher[a_idx, b0:b0 + n1 - n0]
        a, lse_s[n0:n1] = _log_softmax_block(block, temperature, y, bufs[0])
        b, lse_t[n0:n1] = _log_softmax_block(teacher_block, temperature, y, bufs[1])
        m = None
        if beta == 0:
            row_loss = _kl_rows(b, a, bufs[2])
        else:
            m = _distill_mixture(a, b, w.log_w_s, w.log_w_t, bufs[2])
            row_kl = _kl_rows(a, m, bufs[3])
            kl_s[n0:n1] = row_kl
            row_loss = w.w_s * row_kl
            if w.w_t:
                row_loss = row_loss + w.w_t * _kl_rows(b, m, bufs[3])
        if hard_weight:
            if temperature == 1.0:
                row_hard_lse = lse_s[n0:n1]
            else:
                row_hard_lse = torch.logsumexp(_scaled(block, 1.0, bufs[3]), -1)
            hard_lse[n0:n1] = row_hard_lse
            x_y = block.gather(1, y).squeeze(1).float()
            row_loss = row_loss + hard_weight * (row_hard_lse - x_y)
        loss[n0:n1] = row_loss
        if grad is not None:
            g = _distill_grad_block(block, y, a, b, m, kl_s[n0:n1], upstream[n0:n1], params,
                                    bufs[1], bufs[3])
            _store_grad(_grad_block(grad, n0, n1), g, y, None, valid[n0:n1])
    outputs = [loss, lse_s, lse_t, kl_s] + ([hard_lse] if hard_weight else [])
    outputs = [torch.where(valid, out, 0.0) for out in outputs]
    if not hard_weight:
        outputs.append(hard_lse)
    return tuple(outputs)


def distill_backward(student, teacher, target, student_lse, teacher_lse, student_kl, hard_lse,
                     grad_loss, params, grad):
    ignore_index, beta, temperature = params.ignore_index, params.beta, params.temperature
    if target.numel() == 0:
        return
    valid = target != ignore_index
    safe_y = _safe_target(target, valid)
    upstream = torch.where(valid, grad_loss, 0.0)
    weights = params.weights
    inner = student.shape[1]
    for n0, n1, block, bufs in _row_blocks(student, 3):
        y = safe_y[n0:n1]
        a_idx, b0 = n0 // inner, n0 % inner
        teacher_block = teacher[a_idx, b0:b0 + n1 - n0]
        # the log-softmaxes are recomputed: exact whatever the size of the saved lses
        a = torch.log_softmax(_tempered(block, temperature, bufs[0])[0], -1, out=bufs[0])
        b = torch.log_softmax(_tempered(teacher_block, temperature, bufs[1])[0], -1,
                              out=bufs[1])
        m = _distill_mixture(a, b, weights.log_w_s, weights.log_w_t, bufs[2]) if beta else None
        g = _distill_grad_block(block, y, a, b, m, student_kl[n0:n1], upstream[n0:n1], params,
                                bufs[1], bufs[2])
        _store_grad(_grad_block(grad, n0, n1), g, y, None, valid[n0:n1])
