"""The logits ops' cases: the inputs and the one timed forward + backward call of each.

Every case is timed forward + backward (GRPO: policy forward + backward plus the old and
reference forwards, one step). What a logits op must move (``S`` = bytes of one logits tensor)
is its *floor*: ``2 S`` for token log-probs and cross-entropy (read the logits, write the
gradient), ``4 S`` for the GRPO step (also read the old and the reference logits once), ``3 S``
for distillation (read the student's and the teacher's logits, write the student's gradient). The
linear ops' floor is a same-run GEMM case instead (:mod:`astrai_kernels.bench.linear`).
"""

from ..baselines import original
from .cases import (
    FLOOR_FACTOR,
    GRPO_BATCH,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    LOGITS_OPS,
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
)


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
