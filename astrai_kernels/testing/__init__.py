"""Test support: the tolerance table, a tiny causal LM, the verify runner."""

from .tiny_lm import TinyCausalLM, ToyRolloutRunner
from .tolerances import GRAD_TOLERANCES, TOLERANCES, VALUE_TOLERANCES, assert_close, compare

__all__ = ["GRAD_TOLERANCES", "TOLERANCES", "TinyCausalLM", "ToyRolloutRunner",
           "VALUE_TOLERANCES", "assert_close", "compare"]
