"""The logits ops' cases: the inputs and the one timed forward + backward call of each.

Every case is timed forward + backward (GRPO: policy forward + backward plus the old and
reference forwards, one step). What a logits op must move (``S`` = bytes of one logits tensor)
is its *floor*: ``2 S`` for token log-probs (also under a sampler's top-k/top-p), cross-entropy
and top-k distillation (read the logits, write the gradient), ``4 S`` for the GRPO step (also read
the old and the reference logits once), ``3 S`` for distillation (read the student's and the
teacher's logits, write the student's gradient). The linear ops' floor is a same-run GEMM case
instead (:mod:`astrai_kernels.bench.linear`).

The sampled token log-probs' targets are drawn from the sampler's distribution (as in RL, every
target is in the support, so every row gets a gradient); the top-k distillation's teacher gives
``K`` distinct ids per row (evenly spaced from a random offset) with log-probs that leave a tail
mass outside them, as a real teacher's top ``K`` does.
"""

from .. import reference
from ..baselines import original
from .cases import (
    BENCH_SAMPLERS,
    FLOOR_FACTOR,
    GRPO_BATCH,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    LOGITS_OPS,
    TOPK_DISTILL_K,
    split_method,
    torch_dtype,
)
from .workloads import (
    DISTILL_BETA,
    Workload,
    check_method,
    grpo_batch,
    naive_distill,
    naive_grpo_step,
    naive_sampled_token_logprobs,
)

TARGET_DRAW_ROWS = 1024  # rows per block when drawing the sampled targets (bounded memory)


def sampled_targets(logits, gen, temperature, top_k=0, top_p=1.0):
    """One target per row drawn from vLLM's processed distribution: the top-k values (all of
    them with ``top_k = 0``), renormalised, keep a token iff the mass strictly above it is
    < ``top_p``."""
    import torch

    vocab = logits.shape[-1]
    if not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [0, V={vocab}] to draw targets, got {top_k}")
    blocks = []
    for block in logits.detach().split(TARGET_DRAW_ROWS):
        values, ids = (block.float() / temperature).topk(top_k or vocab, dim=-1)
        probs = values.softmax(-1)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
        blocks.append(ids.gather(-1, torch.multinomial(probs, 1, generator=gen)).squeeze(-1))
    return torch.cat(blocks)


def teacher_topk(rows, vocab, k, device, gen):
    """``(support_ids, teacher_logprobs)`` ``[rows, k]``: distinct ids (stride ``V // k`` from a
    random offset), log-probs descending whose mass is below 1 (a (k+1)-th share is the tail)."""
    import torch

    if not 0 < k <= vocab:
        raise ValueError(f"K must be in [1, V={vocab}], got {k}")
    offset = torch.randint(0, vocab, (rows, 1), device=device, generator=gen)
    ids = (offset + torch.arange(k, device=device) * (vocab // k)) % vocab
    shares = torch.randn(rows, k + 1, device=device, generator=gen).log_softmax(-1)
    return ids, shares[:, :k].sort(-1, descending=True).values


def build_logits_workload(case):
    """Inputs and the call of the logits op ``case`` (on ``case.device``)."""
    if case.op not in LOGITS_OPS:
        raise ValueError(f"op must be one of {LOGITS_OPS} here, got {case.op!r}")
    import torch

    device = torch.device(case.device)
    dtype = torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    rows, vocab = case.rows, case.vocab

    def logits(shape, grad):
        x = torch.randn(*shape, vocab, dtype=dtype, device=device, generator=gen)
        return x.requires_grad_(grad)

    def targets(shape):
        return torch.randint(0, vocab, shape, device=device, generator=gen)

    method, inplace = split_method(case.method)
    check_method(case)
    wrap = torch.compile if method == "compile" else (lambda fn: fn)
    info = {}

    if case.op in ("token_logprobs", "cross_entropy"):
        x, y = logits((rows,), True), targets((rows,))
        naive = (original.log_softmax_gather if case.op == "token_logprobs"
                 else original.cross_entropy)
        if method in ("naive", "compile"):
            fn = wrap(naive)

            def run():
                fn(x, y).sum().backward()
        else:
            import astrai_kernels as ak

            op = ak.token_logprobs if case.op == "token_logprobs" else ak.cross_entropy

            def run():
                op(x, y, backend=method, inplace_backward=inplace).sum().backward()
        policy = x
    elif case.op == "distill":
        policy, teacher, y = logits((rows,), True), logits((rows,), False), targets((rows,))
        if method in ("naive", "compile"):
            fn = wrap(naive_distill)

            def run():
                fn(policy, teacher, y).backward()
        else:
            import astrai_kernels as ak

            def run():
                ak.distill_loss(policy, teacher, y, beta=DISTILL_BETA, backend=method).backward()
    elif case.op == "token_logprobs_sampling":
        params, scale = BENCH_SAMPLERS[case.sampler]
        policy = logits((rows,), False)
        policy = (policy if scale == 1.0 else policy * scale).requires_grad_(True)
        y = sampled_targets(policy, gen, **params)
        if method in ("naive", "compile"):
            fn = wrap(naive_sampled_token_logprobs)

            def run():
                fn(policy, y, **params).sum().backward()
        else:
            import astrai_kernels as ak

            sampling = ak.SamplingParams(**params)

            def run():
                ak.token_logprobs(policy, y, sampling=sampling, backend=method).sum().backward()
        info["sampling"] = dict(params, logit_scale=scale)
    elif case.op == "topk_distill":
        policy = logits((rows,), True)
        ids, teacher_logprobs = teacher_topk(rows, vocab, TOPK_DISTILL_K, device, gen)
        if method in ("naive", "compile"):
            fn = wrap(reference.topk_distill_loss)

            def run():
                fn(policy.float(), ids, teacher_logprobs).backward()
        else:
            import astrai_kernels as ak

            def run():
                ak.topk_distill_loss(policy, ids, teacher_logprobs, backend=method).backward()
        info["topk"] = TOPK_DISTILL_K
    else:  # grpo
        if rows % GRPO_BATCH:
            raise ValueError(f"grpo needs rows divisible by B={GRPO_BATCH}, got {rows}")
        shape = (GRPO_BATCH, rows // GRPO_BATCH)
        policy = logits(shape, True)
        old_logits, ref_logits = logits(shape, False), logits(shape, False)
        target = targets(shape)
        advantages, mask = grpo_batch(shape, device, gen)
        info["grpo_shape"] = list(shape)
        if method in ("naive", "compile"):
            fn = wrap(naive_grpo_step)

            def run():
                fn(policy, old_logits, ref_logits, target, advantages, mask).backward()
        else:
            import astrai_kernels as ak

            def run():
                with torch.no_grad():
                    old = ak.token_logprobs(old_logits, target, backend=method)
                    ref = ak.token_logprobs(ref_logits, target, backend=method)
                loss, _ = ak.grpo_loss(policy, target, advantages, mask=mask, old_logprobs=old,
                                       ref_logprobs=ref, beta=GRPO_KL_COEF,
                                       clip_eps_low=GRPO_CLIP_EPS, loss_type="bnpo",
                                       backend=method)
                loss.backward()
    logits_bytes = policy.numel() * policy.element_size()
    workload = Workload(run, [policy], logits_bytes, copy_source=policy,
                        floor_bytes=FLOOR_FACTOR[case.op] * logits_bytes, info=info)
    if inplace:  # the gradient overwrote the logits: restore them (outside the timed call)
        workload.pristine = policy.detach().clone()
    return workload
