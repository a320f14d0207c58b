"""ak.topk_distill_loss against TRL 1.16's ``ServerDistillationTrainer`` loss functions
imported from TRL (the ``beta = 0`` top-k path ``_compute_server_forward_kl_loss``, the
``beta > 0`` top-1 path ``_compute_server_sparse_top_1_divergence_loss``, and
``_add_tail_bucket`` / ``_jsd_divergence`` / ``_reduce_divergence_loss`` on a general support),
with ``test_topk_distill.py``'s batches and tolerance model: TRL's code run in float64 is the
expected value, the same code on float32 logits (values) or in the logits' dtype (gradients)
the yardstick. Needs the ``trl`` extra; the kernel's own tests do not."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels.ops.topk_distill import server_top1_support

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from test_topk_distill import (  # noqa: E402
    DTYPE_IDS,
    DTYPES,
    VOCAB,
    check,
    server_batch,
    terms_of,
)
from trl.experimental.server_distillation.server_distillation_trainer import (  # noqa: E402
    ServerDistillationTrainer,
    _add_tail_bucket,
    _jsd_divergence,
)


def trl_trainer(beta, tail):
    """A trainer holding only what its loss methods read (no model, no teacher server)."""
    trainer = object.__new__(ServerDistillationTrainer)
    trainer.beta, trainer.loss_add_tail, trainer.reverse_kl_top_1_mode = beta, tail, "sampled"
    return trainer


def trl_student_log_probs(logits, temperature):
    """``compute_loss``'s student log-probs."""
    return F.log_softmax(logits / temperature, dim=-1)


def trl_forward_kl(logits, ids, teacher, labels, tail, temperature):
    result = {"topk_logprobs": teacher, "topk_token_ids": ids}
    return trl_trainer(0.0, tail)._compute_server_forward_kl_loss(
        result, trl_student_log_probs(logits, temperature), labels)


def trl_top1(logits, top1_ids, top1_logprobs, sampled, actual, labels, beta, tail, temperature):
    result = {"topk_logprobs": top1_logprobs.unsqueeze(-1),
              "topk_token_ids": top1_ids.unsqueeze(-1), "actual_logprobs": actual}
    return trl_trainer(beta, tail)._compute_server_sparse_top_1_divergence_loss(
        result, trl_student_log_probs(logits, temperature), sampled, labels)


def trl_support(logits, ids, teacher, mask, labels, beta, tail, temperature):
    """TRL's sparse divergence on any support, its functions composed as
    ``_compute_sparse_top_1_divergence_loss`` composes them."""
    log_probs = trl_student_log_probs(logits, temperature)
    neg_inf = torch.full((), float("-inf"), dtype=log_probs.dtype)
    student = torch.where(mask, log_probs.gather(-1, torch.where(mask, ids, 0)), neg_inf)
    teacher = torch.where(mask, teacher, neg_inf)
    if tail:
        student, live = _add_tail_bucket(student, mask)
        teacher, _ = _add_tail_bucket(teacher, mask)
    else:
        live = mask
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    jsd = _jsd_divergence(student, teacher, beta, live)
    return ServerDistillationTrainer._reduce_divergence_loss(
        jsd, completion_mask=labels != -100, reduction="batchmean")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_kl_matches_trl(dtype, tail, k, temperature):
    logits, ids, teacher, labels, _ = server_batch(dtype, k=k)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, tail=tail,
                                         temperature=temperature),
          lambda z: trl_forward_kl(z, ids, teacher, labels, tail, temperature),
          logits, "forward KL",
          terms_of(logits, ids, teacher, teacher > -math.inf, labels, 0.0, tail, temperature))


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_top1_matches_trl(dtype, beta, tail):
    logits, _, _, labels, teacher_all = server_batch(dtype, k=1, seed=1)
    top1_logprobs, top1_ids = teacher_all.max(-1)
    sampled = labels.clamp(min=0)
    sampled[0, 2] = sampled[1, 0] = -1  # two counted rows sample the teacher's top-1 token
    sampled = torch.where(sampled < 0, top1_ids, sampled)
    labels = torch.where(labels == -100, -100, sampled)
    actual = teacher_all.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    actual[0, 0] = -math.inf  # the server's padding, on a row the labels do not count
    support_ids, support_logprobs, support_mask = server_top1_support(
        top1_ids, top1_logprobs, labels, actual, beta)
    check(lambda x: ak.topk_distill_loss(x, support_ids, support_logprobs, labels, beta=beta,
                                         temperature=0.8, tail=tail,
                                         support_mask=support_mask),
          lambda z: trl_top1(z, top1_ids, top1_logprobs, sampled, actual, labels, beta, tail,
                             0.8),
          logits, f"beta={beta}",
          terms_of(logits, support_ids, support_logprobs, support_mask, labels, beta, tail, 0.8))


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_any_support_matches_trl_functions(dtype, beta, tail):
    logits, ids, teacher, labels, _ = server_batch(dtype, k=7, seed=2)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[1, 1] = False  # a counted row whose whole support is dropped
    live = mask & (teacher > -math.inf)
    check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels, beta=beta, tail=tail,
                                         support_mask=mask, temperature=1.3),
          lambda z: trl_support(z, ids, teacher, live, labels, beta, tail, 1.3),
          logits, f"beta={beta}", terms_of(logits, ids, teacher, live, labels, beta, tail, 1.3))


@pytest.mark.parametrize("tail", [True, False])
def test_support_mask_drops_entries_as_trl_padding(tail):
    """``support_mask`` False equals TRL's unfilled entries (-inf teacher log-prob), whatever
    id the dropped entry holds."""
    logits, ids, teacher, labels, _ = server_batch(torch.float32, k=6, seed=4)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) > 0.4
    garbage = torch.where(mask, ids, torch.where(torch.arange(6) % 2 == 0, -1, VOCAB + 3))
    check(lambda x: ak.topk_distill_loss(x, garbage, teacher, labels, tail=tail,
                                         support_mask=mask),
          lambda z: trl_forward_kl(z, torch.where(mask, ids, 0),
                                   torch.where(mask, teacher, -math.inf), labels, tail, 1.0),
          logits, "masked",
          terms_of(logits, ids, teacher, mask & (teacher > -math.inf), labels, 0.0, tail, 1.0))


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_tail_clamp_matches_trl(beta):
    """A teacher whose top-1 log-prob is 0 (support mass 1: TRL clamps log(sum) at -1e-7) and a
    student all but certain of one support token (its tail's gradient stops at the clamp)."""
    logits, ids, teacher, labels, _ = server_batch(torch.float32, k=2, seed=6)
    teacher[0, 3, 0] = teacher[1, 1, 0] = 0.0
    logits[0, 3, ids[0, 3, 0]] = logits[1, 2, ids[1, 2, 1]] = 40.0
    labels[0, 3] = labels[1, 1] = labels[1, 2] = 5
    labels[0, 1] = -100  # the position the server filled partly: TRL's top-1 path refuses it
    if beta == 0:
        check(lambda x: ak.topk_distill_loss(x, ids, teacher, labels),
              lambda z: trl_forward_kl(z, ids, teacher, labels, True, 1.0), logits, "clamp",
              terms_of(logits, ids, teacher, teacher > -math.inf, labels, 0.0, True, 1.0))
        return
    top1_ids, top1 = ids[..., 0], teacher[..., 0]
    actual = teacher[..., 1]
    sampled = torch.where(labels == -100, ids[..., 1], labels)
    sampled[0, 3], sampled[1, 2] = ids[0, 3, 1], ids[1, 2, 1]
    labels = torch.where(labels == -100, -100, sampled)
    support = server_top1_support(top1_ids, top1, labels, actual, beta)
    check(lambda x: ak.topk_distill_loss(x, support[0], support[1], labels, beta=beta,
                                         support_mask=support[2]),
          lambda z: trl_top1(z, top1_ids, top1, sampled, actual, labels, beta, True, 1.0),
          logits, "clamp", terms_of(logits, *support[:2], support[2], labels, beta, True, 1.0))
