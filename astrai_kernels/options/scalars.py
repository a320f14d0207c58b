"""Checks of one scalar argument (a number, an index, a choice, a flag), each raising a
``ValueError``/``TypeError`` that names the argument: what the option objects
(``options/grpo.py``, ``options/distill.py``) and the ops' front doors check scalars with."""

import math
import numbers
import operator

import torch

# Float hyperparameters reach the kernels as float32: they and (for scales such as a
# temperature) their reciprocals must be finite there.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_symbolic(value):
    """A value traced by ``torch.compile`` (a ``SymFloat``/``SymInt``): compared, never read."""
    return isinstance(value, (torch.SymFloat, torch.SymInt))


def check_real(value, name):
    """``value`` as a Python float (a traced ``SymFloat`` as is) if it is a real number.

    Any ``numbers.Real`` is accepted (Python and NumPy ints and floats), never a bool.

    Under ``torch.compile`` a float argument of the compiled function is traced as a symbolic
    float (``torch._dynamo.config.specialize_float`` is False; Dynamo's automatic dynamic
    makes it symbolic once a second value is seen, ``dynamic=True`` from the start). This is
    the one place its value is validated there: the range checks below are comparisons, which
    Dynamo turns into guards on the value's range (not on the value), so a new valid value
    reuses the graph, and one that fails them is traced again and raises the same error (with
    ``fullgraph=True`` Dynamo wraps it in its own error, which quotes the message). The
    message then leaves out the value, which a traced f-string cannot format; the custom ops
    take these floats as tensors (``kernels/library.py``), so no value is baked into the graph.
    """
    if _is_symbolic(value):
        return value
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _shown(value):
    """``value`` for an error message; under ``torch.compile`` a placeholder (see
    :func:`check_real`)."""
    return "a value traced by torch.compile" if torch.compiler.is_compiling() else value


def _float32_max():
    # a literal for Dynamo: a module-level float would be traced as one more symbolic input
    return torch.finfo(torch.float32).max


def check_positive(value, name):
    """A finite number > 0 whose float32 reciprocal is finite too (``1/T``, ``1/softcap``)."""
    value = check_real(value, name)
    limit = _float32_max()
    if not (0 < value <= limit):
        raise ValueError(f"{name} must be a finite number > 0, got {_shown(value)}")
    if not (1.0 / value <= limit):
        raise ValueError(f"{name} is too small, got {_shown(value)}: 1/{name} overflows "
                         f"float32 (the least allowed value is {1.0 / FLOAT32_MAX:.3g})")
    return value


def check_in_range(value, name, low, high):
    """A finite number in ``[low, high]`` (``high`` may be inf: then up to float32's max)."""
    value = check_real(value, name)
    limit = _float32_max()
    if not (low <= value <= high and -limit <= value <= limit):
        bound = "a finite number" if high == math.inf else "a number"
        raise ValueError(f"{name} must be {bound} in [{low}, {high}], got {_shown(value)}")
    return value


def check_choice(value, name, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_index(value, name):
    """An integer (Python or NumPy, never a bool) that fits in int64, as a Python int."""
    if _is_symbolic(value):
        return value
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if not (INT64_MIN <= value <= INT64_MAX):
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def checked_transform(logit_scale, softcap):
    """``(logit_scale, softcap)`` as floats (softcap 0.0 when None), checked."""
    logit_scale = check_in_range(logit_scale, "logit_scale", -math.inf, math.inf)
    softcap_value = 0.0 if softcap is None else check_positive(softcap, "softcap")
    return logit_scale, softcap_value
