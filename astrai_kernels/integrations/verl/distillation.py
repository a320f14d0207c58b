"""verl's FSDP top-K distillation (``verl.trainer.distillation.fsdp.losses
.compute_forward_kl_topk``, which ``compute_topk_loss`` looks up at each call) without the
student's ``[B, T, V]`` log-softmax.

verl forms ``log_softmax(student_logits)`` over the whole vocabulary (its chunked option:
float32 chunks of it) only to read it at the teacher's K ids and to rank the student's own
top K. Here the K log-probs come from ``ak.token_logprobs`` with targets ``[..., K]`` (one
pass over each row, float32, its gradient written once into the logits' gradient) and the
ranking from ``torch.topk`` of the logits (``log_softmax`` is a per-row shift). Everything
after that is verl's own arithmetic on ``[..., K]``: the clamps at ``log_prob_min_clamp``,
the forward KL, the masses, the overlap diagnostics; so the per-token outputs are verl's, in
float32.
"""

import torch

import astrai_kernels as ak

_IGNORE = -(2 ** 62)


def make_compute_forward_kl_topk(backend: str = "auto"):
    """verl's ``compute_forward_kl_topk`` with the student's top-K log-probs from
    ``ak.token_logprobs(backend=backend)`` (``install``'s backend)."""

    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids,
                                config, data_format):
        """verl's ``compute_forward_kl_topk``, same arguments and outputs (each ``[bsz,
        seqlen/sp]``): ``distillation_losses``, ``student_mass``, ``teacher_mass``,
        ``overlap_count``, ``overlap_token_advantage``."""
        from verl.utils.ulysses import (
            get_ulysses_sequence_parallel_world_size,
            slice_input_tensor,
        )

        assert teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested
        teacher_topk_log_probs = teacher_topk_log_probs.values().unsqueeze(0)
        teacher_topk_ids = teacher_topk_ids.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:
            teacher_topk_log_probs = slice_input_tensor(teacher_topk_log_probs, dim=1)
            teacher_topk_ids = slice_input_tensor(teacher_topk_ids, dim=1)
        assert teacher_topk_log_probs.shape[:2] == teacher_topk_ids.shape[:2] == \
            student_logits.shape[:2]
        return topk_outputs(student_logits, teacher_topk_log_probs, teacher_topk_ids,
                            config.distillation_loss.log_prob_min_clamp, backend)

    compute_forward_kl_topk._astrai_kernels_backend = backend
    return compute_forward_kl_topk


def is_astrai_topk(function) -> bool:
    """Whether ``function`` is a :func:`make_compute_forward_kl_topk` result."""
    return hasattr(function, "_astrai_kernels_backend")


compute_forward_kl_topk = make_compute_forward_kl_topk()


def topk_outputs(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp,
                 backend="auto"):
    """The per-token outputs of verl's ``compute_forward_kl_topk`` from ``[..., V]`` logits
    and the teacher's ``[..., K]`` log-probs and ids."""
    k = teacher_topk_ids.shape[-1]
    with torch.autocast(student_logits.device.type, enabled=False):
        student_topk_log_probs = ak.token_logprobs(student_logits, teacher_topk_ids.long(),
                                                   ignore_index=_IGNORE, backend=backend)
    with torch.no_grad():
        student_topk_ids = torch.topk(student_logits.detach(), k=k, dim=-1).indices
    teacher_topk_log_probs = teacher_topk_log_probs.float()
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    teacher_probs = teacher_topk_log_probs.exp()
    token_kl = teacher_probs * (teacher_topk_log_probs - student_topk_log_probs)
    distillation_losses = token_kl.sum(dim=-1)
    overlap_mask = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap_mask.sum(dim=-1)
    overlap_sum = (-token_kl * overlap_mask).sum(dim=-1)
    overlap_token_advantage = torch.where(overlap_count > 0,
                                          overlap_sum / overlap_count.clamp_min(1),
                                          torch.zeros_like(overlap_sum))
    return {"distillation_losses": distillation_losses, "student_mass": student_mass,
            "teacher_mass": teacher_mass, "overlap_count": overlap_count,
            "overlap_token_advantage": overlap_token_advantage}
