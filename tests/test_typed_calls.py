"""Each public op hands its door one typed call (``ops/door.py``): a ``NamedTuple`` of its
arguments declared beside it, built with every argument under its own name, and read by
attribute on every route. These tests hold that shape so it cannot drift back to dicts."""

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

import astrai_kernels.ops as ops_package
from astrai_kernels.ops import (
    cross_entropy,
    distill,
    grpo,
    linear_logprobs,
    logprobs,
    sequences,
    topk_distill,
)
from astrai_kernels.ops.door import Door

OPS_DIR = Path(ops_package.__file__).parent
OP_MODULES = (cross_entropy, distill, grpo, linear_logprobs, logprobs, sequences, topk_distill)


def _doors():
    return [(module, value) for module in OP_MODULES for value in vars(module).values()
            if isinstance(value, Door)]


def _call_type(module, op):
    """The ``NamedTuple`` the op's body builds, found in its source."""
    (built,) = [node for node in ast.walk(ast.parse(inspect.getsource(inspect.unwrap(op))))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id.endswith("Call")]
    return getattr(module, built.func.id), built


def _folded_option_names(module, op) -> set:
    """The option keywords an op folds into ``options`` (the fields of its options type)."""
    parameters = inspect.signature(op).parameters
    if "options" not in parameters:
        return set()
    annotation = parameters["options"].annotation
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(module))
    (options_type,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return {field.name for field in dataclasses.fields(options_type)}


def test_every_door_is_found():
    names = sorted(door.op.__name__ for _, door in _doors())
    assert names == sorted([
        "cross_entropy", "linear_cross_entropy", "token_logprobs", "linear_token_logprobs",
        "grpo_loss", "linear_grpo_loss", "distill_loss", "linear_distill_loss",
        "topk_distill_loss", "linear_topk_distill_loss", "sequence_logprobs",
        "linear_sequence_logprobs"])


@pytest.mark.parametrize("module, door", _doors(), ids=lambda item: getattr(
    getattr(item, "op", None), "__name__", getattr(item, "__name__", "")))
def test_call_type_is_the_signature(module, door):
    """The call's fields are the public parameters in their order, the option keywords
    folded into ``options``; its annotations are the signature's where the signature has
    them; the body passes each argument under its own name."""
    op = inspect.unwrap(door.op)
    call_type, built = _call_type(module, op)
    assert issubclass(call_type, tuple) and hasattr(call_type, "_fields")
    folded = _folded_option_names(module, op)
    parameters = [name for name in inspect.signature(op).parameters if name not in folded]
    assert list(call_type._fields) == parameters
    assert not built.args, f"{op.__name__} builds its call by position"
    for keyword in built.keywords:
        assert isinstance(keyword.value, ast.Name) and keyword.value.id == keyword.arg, (
            f"{op.__name__} passes {ast.unparse(keyword.value)} as {keyword.arg}")
    assert {keyword.arg for keyword in built.keywords} == set(parameters)
    for name in door.tensors:
        assert name in call_type._fields, f"{op.__name__}'s door names {name}"


def _string_lookups(tree):
    """``call[...]`` subscripts (by a string or a name) and ``locals()`` calls."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "call"):
            yield f"line {node.lineno}: call[{ast.unparse(node.slice)}]"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "locals"):
            yield f"line {node.lineno}: locals()"


@pytest.mark.parametrize("path", sorted(OPS_DIR.glob("*.py")), ids=lambda path: path.name)
def test_no_string_keyed_calls(path):
    assert list(_string_lookups(ast.parse(path.read_text()))) == []


def test_string_lookups_are_found():
    """The scan above sees what it forbids."""
    source = "def op(a, n):\n    call = locals()\n    return call['a'], call[n]\n"
    assert len(list(_string_lookups(ast.parse(source)))) == 3
