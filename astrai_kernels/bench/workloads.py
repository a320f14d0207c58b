"""What every case's workload shares: :class:`Workload` (the one timed forward + backward call
and its inputs), the method check, the GRPO batch, and the naive baselines' steps.

The logits ops' workloads are built in :mod:`astrai_kernels.bench.logits`, the fused-LM-head
ops' in :mod:`astrai_kernels.bench.linear`; :func:`astrai_kernels.bench.measure.build_workload`
picks one. The seed's materializing math lives once, in :mod:`astrai_kernels.baselines.original`.
"""

from dataclasses import dataclass, field

from ..baselines import original
from .cases import (
    BENCH_SAMPLERS,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    INPLACE_OPS,
    method_applies,
    split_method,
)


def seed_grpo_loss(logp, old, ref, advantages, mask, clip_eps=GRPO_CLIP_EPS,
                   kl_coef=GRPO_KL_COEF):
    """The seed's GRPO loss from token log-probs ``[B, T]``; ``advantages [B]``."""
    return original.grpo_loss(logp, old, ref, advantages.unsqueeze(-1), mask, clip_eps,
                              kl_coef)[0]


def naive_grpo_step(policy, old_logits, ref_logits, target, advantages, mask,
                    clip_eps=GRPO_CLIP_EPS, kl_coef=GRPO_KL_COEF):
    """The seed's GRPO step on logits: three log-softmax-gathers, then the loss."""
    return original.grpo_step(policy, old_logits, ref_logits, target, advantages, mask, clip_eps,
                           kl_coef)


def naive_sampled_token_logprobs(logits, target, temperature, top_k=0, top_p=1.0):
    """What a user writes to score ``target`` under vLLM v1's sampler (``apply_top_k_top_p``
    after the temperature): sort ascending, drop values below the ``top_k``-th largest, softmax
    and cumsum what is left and drop where the cumsum is ``<= 1 - top_p`` (never the largest:
    the token crossing ``top_p`` stays), scatter back, then ``log_softmax`` and gather."""
    import torch

    scaled = logits.float() / temperature
    ascending, order = scaled.sort(dim=-1)
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = ascending[..., vocab - top_k:vocab - top_k + 1]
        ascending = ascending.masked_fill(ascending < kth_largest, -torch.inf)
    if top_p < 1:
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        below[..., -1] = False
        ascending = ascending.masked_fill(below, -torch.inf)
    processed = ascending.scatter(-1, order, ascending)
    return processed.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


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
    """A ValueError unless ``case.method`` applies to ``case.op`` (and ``case.sampler`` names a
    sampler of token_logprobs_sampling)."""
    if not method_applies(case.op, case.method):
        why = (f"inplace_backward is an option of {INPLACE_OPS} only"
               if split_method(case.method)[1] else "a baseline of the other op family")
        raise ValueError(f"{case.method!r} is not a method of {case.op}: {why}")
    if case.sampler and (case.op != "token_logprobs_sampling"
                         or case.sampler not in BENCH_SAMPLERS):
        raise ValueError(f"sampler must be one of {sorted(BENCH_SAMPLERS)} on "
                         f"token_logprobs_sampling, got {case.sampler!r} on {case.op}")
