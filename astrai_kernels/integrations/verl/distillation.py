"""verl's FSDP top-K distillation (``verl.trainer.distillation.fsdp.losses
.compute_forward_kl_topk``, which ``compute_topk_loss`` looks up at each call) without the
student's ``[B, T, V]`` log-softmax.

verl forms ``log_softmax(student_logits)`` over the whole vocabulary (its chunked option:
float32 chunks of it) only to read it at the teacher's K ids and to rank the student's own
top K. Here the K log-probs come from ``ak.token_logprobs`` with targets ``[..., K]`` (one
pass over each row, float32, its gradient written once into the logits' gradient). The
overlap diagnostics need only whether each teacher id is among the student's K largest
logits (``log_softmax`` is a per-row shift): on CPU tensors that the ``cpp`` backend serves,
each row's K-th largest logit and its index from one streaming read
(``kernels/cpp/backend.py``'s ``row_kth_largest``; docs/verl.md times it against
``torch.topk``), elsewhere ``torch.topk``'s K ids, as verl. Everything after that is verl's own
arithmetic on ``[..., K]``: the clamps at ``log_prob_min_clamp``, the forward KL, the
masses, the overlap diagnostics; so the per-token outputs are verl's, in float32.

Ties at the K-th value: ``torch.topk`` picks which of the tied logits it returns in an
unspecified way, so ``overlap_count`` is not determined on such a row. On the ``cpp`` path the
lower vocabulary id wins a tie (a stable descending sort's top K). Such a tie, ids of the
K-th value both inside and outside the top K, is the common case in bfloat16: 55-77% of random
LM-like rows at V = 32768, K = 64 (docs/verl.md), against none of 2000 in float32. Without it
both rules give the same top K. verl's default path ranks its ``log_softmax`` in
the logits' dtype, whose rounding can tie logits that differ; the ranking here is of the
logits themselves, as verl's ``use_chunked_topk`` path ranks them.
"""

import torch

import astrai_kernels as ak

from ...kernels.registry import resolve_backend

_IGNORE = -(2 ** 62)
_ROW_KTH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        overlap_mask = student_topk_membership(student_logits.detach(), teacher_topk_ids.long(),
                                               k, backend)
    teacher_topk_log_probs = teacher_topk_log_probs.float()
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    teacher_probs = teacher_topk_log_probs.exp()
    token_kl = teacher_probs * (teacher_topk_log_probs - student_topk_log_probs)
    distillation_losses = token_kl.sum(dim=-1)
    overlap_count = overlap_mask.sum(dim=-1)
    overlap_sum = (-token_kl * overlap_mask).sum(dim=-1)
    overlap_token_advantage = torch.where(overlap_count > 0,
                                          overlap_sum / overlap_count.clamp_min(1),
                                          torch.zeros_like(overlap_sum))
    return {"distillation_losses": distillation_losses, "student_mass": student_mass,
            "teacher_mass": teacher_mass, "overlap_count": overlap_count,
            "overlap_token_advantage": overlap_token_advantage}


def student_topk_membership(student_logits, ids, k, backend="auto"):
    """Whether each of ``ids [..., K]`` is among the ``k`` largest of ``student_logits [...,
    V]`` (bool ``[..., K]``): ``torch.topk``'s ``k`` ids, or on CPU logits that the ``cpp``
    backend serves, each id against its row's ``k``-th largest ``(value, index)``, ties at it
    going to the lower id (the module doc), in the same kernel call. NaN ranks above every
    number, as ``torch.topk`` ranks it."""
    vocab = student_logits.shape[-1]
    # a plain tensor: a DTensor's (or a tracer's) elements are not the kernel's to read
    if (type(student_logits) is torch.Tensor and student_logits.device.type == "cpu"
            and student_logits.dtype in _ROW_KTH_DTYPES and 1 <= k <= vocab
            and resolve_backend(backend, student_logits.device) == "cpp"):
        from ...kernels.cpp import backend as cpp_backend

        return cpp_backend.row_kth_largest(student_logits, k, ids)[2]
    student_topk_ids = torch.topk(student_logits, k=k, dim=-1).indices
    return (ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
