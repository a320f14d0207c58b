"""Test support: the tolerance model, a tiny causal LM, the verify runner."""

from .tiny_lm import TinyCausalLM, ToyRolloutRunner
from .tolerances import (
    TOLERANCES,
    Comparison,
    assert_close,
    assert_close_elementwise,
    assert_head_gradient_close,
    assert_model_gradient_close,
    compare,
    compare_elementwise,
    compare_model_gradient,
    softmax_grad_scale,
)

__all__ = ["TOLERANCES", "Comparison", "TinyCausalLM", "ToyRolloutRunner", "assert_close",
           "assert_close_elementwise", "assert_head_gradient_close",
           "assert_model_gradient_close", "compare", "compare_elementwise",
           "compare_model_gradient", "softmax_grad_scale"]
