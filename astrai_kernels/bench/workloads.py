"""The inputs and the one timed forward + backward call of each case.

Every case is timed forward + backward (GRPO: policy forward + backward plus the old and
reference forwards, one step). What a logits op must move (``S`` = bytes of one logits tensor)
is its *floor*: ``2 S`` for token log-probs and cross-entropy (read the logits, write the
gradient), ``4 S`` for the GRPO step (also read the old and the reference logits once), ``3 S``
for distillation (read the student's and the teacher's logits, write the student's gradient). The
linear ops' floor is a same-run GEMM case instead (:mod:`astrai_kernels.bench.linear`).
"""

from dataclasses import dataclass, field

from .. import naive
from .cases import (
    FLOOR_FACTOR,
    GRPO_BATCH,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    INPLACE_OPS,
    LINEAR_OPS,
    LOGITS_OPS,
    method_applies,
    split_method,
    torch_dtype,
)

# The seed's materializing math lives once, in astrai_kernels/naive.py.
naive_token_logprobs = naive.token_logprobs
naive_cross_entropy = naive.cross_entropy


def seed_grpo_loss(logp, old, ref, advantages, mask, clip_eps=GRPO_CLIP_EPS,
                   kl_coef=GRPO_KL_COEF):
    """The seed's GRPO loss from token log-probs ``[B, T]``; ``advantages [B]``."""
    return naive.grpo_loss(logp, old, ref, advantages.unsqueeze(-1), mask, clip_eps, kl_coef)[0]


def naive_grpo_step(policy, old_logits, ref_logits, target, advantages, mask,
                    clip_eps=GRPO_CLIP_EPS, kl_coef=GRPO_KL_COEF):
    """The seed's GRPO step on logits: three log-softmax-gathers, then the loss."""
    return naive.grpo_step(policy, old_logits, ref_logits, target, advantages, mask, clip_eps,
                           kl_coef)


DISTILL_BETA = 0.5


def naive_distill(student, teacher, target, beta=DISTILL_BETA):
    """TRL's ``generalized_jsd_loss`` (batchmean, labels) on the float logits."""
    import torch
    import torch.nn.functional as F

    student_log_probs = F.log_softmax(student.float(), dim=-1)
    teacher_log_probs = F.log_softmax(teacher.float(), dim=-1)
    beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student.device)
    mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log1p(-beta_t),
                                           teacher_log_probs + torch.log(beta_t)]), dim=0)
    jsd = (beta * F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
           + (1 - beta) * F.kl_div(mixture, student_log_probs, reduction="none",
                                   log_target=True))
    mask = target != -100
    return jsd[mask].sum() / mask.sum().clamp_min(1)


def grpo_batch(shape, device, gen):
    """``advantages [B]`` (group-normalized rewards, groups of 4) and ``mask [B, T]`` (the last
    eighth of each response is padding) of the GRPO cases."""
    import torch

    batch = shape[0]
    rewards = torch.rand(batch // 4, 4, device=device, generator=gen)
    advantages = ((rewards - rewards.mean(-1, keepdim=True))
                  / (rewards.std(-1, keepdim=True, unbiased=False) + 1e-8)).reshape(-1)
    mask = torch.ones(shape, device=device)
    mask[:, -shape[1] // 8:] = 0.0
    return advantages, mask


@dataclass
class Workload:
    """``run()`` is one timed call; ``reset()`` drops the gradients it made."""
    run: object
    leaves: list
    logits_bytes: int  # S: one [N, V] logits tensor in the case's dtype (held or not)
    copy_source: object = None  # logits ops: the tensor the same-run copy floor copies
    floor_bytes: int = None  # logits ops: the bytes the op must move
    info: dict = field(default_factory=dict)  # more result fields (shapes, bounds)
    pristine: object = None  # a copy of the logits, restored after an in-place backward

    def reset(self):
        import torch

        for leaf in self.leaves:
            leaf.grad = None
        if self.pristine is not None:
            with torch.no_grad():
                self.copy_source.copy_(self.pristine)


def check_method(case):
    """A ValueError unless ``case.method`` applies to ``case.op``."""
    if not method_applies(case.op, case.method):
        why = (f"inplace_backward is an option of {INPLACE_OPS} only"
               if split_method(case.method)[1] else "a baseline of the other op family")
        raise ValueError(f"{case.method!r} is not a method of {case.op}: {why}")


def build_workload(case):
    """Inputs and the call of ``case`` (on ``case.device``)."""
    if case.op in LINEAR_OPS:
        from .linear import build_linear_workload

        return build_linear_workload(case)
    if case.op not in LOGITS_OPS:
        raise ValueError(f"op must be one of {LOGITS_OPS + LINEAR_OPS} here, got {case.op!r}")
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
        naive = naive_token_logprobs if case.op == "token_logprobs" else naive_cross_entropy
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
