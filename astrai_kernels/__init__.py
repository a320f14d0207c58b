"""astrai-kernels: fused, memory-lean LLM losses computed from the logits in vocabulary tiles."""

from . import distributed, nn
from .kernels.registry import available_backends
from .ops.cross_entropy import cross_entropy, linear_cross_entropy
from .ops.distill import distill_loss, linear_distill_loss
from .ops.grpo import grpo_loss, linear_grpo_loss
from .ops.linear_logprobs import linear_token_logprobs
from .ops.logprobs import token_logprobs
from .ops.preference import (
    DPOOptions,
    cpo_loss,
    dpo_loss,
    group_advantages,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from .ops.sampling import SamplingParams
from .ops.sequences import linear_sequence_logprobs, sequence_logprobs
from .ops.topk_distill import linear_topk_distill_loss, topk_distill_loss
from .options.distill import DistillOptions
from .options.grpo import GRPOOptions

__version__ = "0.1.0"

__all__ = [
    "DPOOptions",
    "DistillOptions",
    "GRPOOptions",
    "SamplingParams",
    "available_backends",
    "cpo_loss",
    "cross_entropy",
    "distributed",
    "distill_loss",
    "dpo_loss",
    "grpo_loss",
    "linear_cross_entropy",
    "linear_distill_loss",
    "linear_grpo_loss",
    "linear_sequence_logprobs",
    "linear_token_logprobs",
    "linear_topk_distill_loss",
    "group_advantages",
    "kto_loss",
    "nn",
    "orpo_loss",
    "sequence_logprobs",
    "simpo_loss",
    "token_logprobs",
    "topk_distill_loss",
]
