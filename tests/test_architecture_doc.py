"""docs/architecture.md stays true where the code grows: two of its tables are rendered from the
code and must equal the doc's.

* The primitives and the backends that implement each: ``kernels/primitives.py``'s
  declarations, each backend module's functions.
* Each public op's routes: the ``Door`` its file declares (``ops/door.py``), the function each
  route runs and the public ops a route calls again (entering their doors), or why the op has
  no door.

``python tests/test_architecture_doc.py --write`` rewrites both tables in the doc."""

import ast
import dataclasses
import inspect
import pathlib
import re
import sys
import textwrap
import types

import pytest

import astrai_kernels
from astrai_kernels.distributed import dtensor
from astrai_kernels.kernels import primitives, registry
from astrai_kernels.ops.door import Door

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
PRIMITIVES_MARKERS = ("<!-- primitives table: begin -->", "<!-- primitives table: end -->")
ROUTES_MARKERS = ("<!-- op routes table: begin -->", "<!-- op routes table: end -->")
KERNEL_BACKENDS = ("triton", "cpp", "torch")
#: each table of declarations, and what the doc calls its primitives
DECLARED = (
    (primitives.PRIMITIVES, "required"),
    ({primitives.SHARD_PRIMITIVE.name: primitives.SHARD_PRIMITIVE},
     "optional: vocabulary parallel"),
    (primitives.SAMPLING_PRIMITIVES, "optional: `sampling=`"),
    (primitives.TOPK_DISTILL_PRIMITIVES, "optional: top-k distillation"),
)
#: each route of a ``Door``, in the order ``Door.enter`` tries them, and the doc's column
ROUTE_COLUMNS = (
    ("dtensor", "DTensor"),
    ("vocab_parallel", "`process_group=`"),
    ("check", "check"),
    ("reference", '`backend="reference"`'),
    ("local", "local"),
)
#: why the public ops of a file enter no door
NO_DOOR = {"ops/preference.py": "plain torch on per-sequence `[B]` / `[B, G]` tensors, no kernel"}
SAMPLING_MODULE = "astrai_kernels.ops.sampling"
DTENSOR_MODULE = "astrai_kernels.distributed.dtensor"
#: a cell the code does not explain (an op without a door in a file NO_DOOR has no reason for,
#: a ``sampling=`` that no route takes)
UNEXPLAINED = "(unexplained)"


def render_table():
    """The markdown table of every declared primitive and the backends that implement it."""
    modules = {name: registry.backend_module(name) for name in KERNEL_BACKENDS}
    lines = ["| primitive | kind | " + " | ".join(f"`{b}`" for b in KERNEL_BACKENDS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in KERNEL_BACKENDS) + " |"]
    for table, kind in DECLARED:
        for name in table:
            marks = ["yes" if hasattr(modules[b], name) else "-" for b in KERNEL_BACKENDS]
            lines.append(f"| `{name}` | {kind} | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"


def public_ops():
    """``{name: function}`` of the public API's functions defined in ``ops/``."""
    return {name: getattr(astrai_kernels, name) for name in sorted(astrai_kernels.__all__)
            if inspect.isfunction(getattr(astrai_kernels, name))
            and getattr(astrai_kernels, name).__module__.startswith("astrai_kernels.ops.")}


def door_of(op):
    """The ``Door`` of ``op`` in its own file, or None."""
    doors = [value for value in vars(sys.modules[op.__module__]).values()
             if isinstance(value, Door) and value.op is op]
    assert len(doors) <= 1, f"{op.__name__} has {len(doors)} doors"
    return doors[0] if doors else None


def _file(module_name):
    return module_name.removeprefix("astrai_kernels.").replace(".", "/") + ".py"


def _parameters(op):
    return inspect.signature(op).parameters


def reached(function, ops):
    """The package's functions outside ``function``'s file that it names (following the functions
    of its own file it names), in the order first met; a public op in ``ops`` counts as outside."""
    home = sys.modules[function.__module__]
    found, seen, todo = [], set(), [function]
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(current)))):
            target = None
            if isinstance(node, ast.Name):
                target = vars(home).get(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                base = vars(home).get(node.value.id)
                if isinstance(base, types.ModuleType):
                    target = getattr(base, node.attr, None)
            if not (inspect.isfunction(target)
                    and target.__module__.startswith("astrai_kernels.")):
                continue
            if target.__module__ == home.__name__ and target not in ops:
                todo.append(target)
            elif target not in found:
                found.append(target)
    return found


def _named(function, home):
    """A function as a cell names it: with its file when that is not ``home``."""
    if function.__module__ == home:
        return f"`{function.__name__}`"
    return f"`{function.__name__}` (`{_file(function.__module__)}`)"


def _route_cell(route, home, ops):
    """The route's function, then (after an arrow) the public ops it calls again and the
    functions of ``distributed/dtensor.py`` it hands the call to."""
    onward = [f"`{function.__name__}`" if function in ops else _named(function, home)
              for function in reached(route, ops)
              if function in ops or (function.__module__ == DTENSOR_MODULE
                                     and route.__module__ != DTENSOR_MODULE)]
    return _named(route, home) + (" -> " + ", ".join(onward) if onward else "")


def _sampling_cell(op, door, ops):
    """Where a ``sampling=`` call goes: the functions of ``ops/sampling.py`` the local route
    reaches, or the public ops taking ``sampling`` it calls again."""
    if "sampling" not in _parameters(op):
        return "-"
    route = reached(door.local, ops)
    sampler = [f"`{f.__name__}`" for f in route if f.__module__ == SAMPLING_MODULE]
    if sampler:
        return ", ".join(sampler) + f" (`{_file(SAMPLING_MODULE)}`)"
    onward = [f"`{f.__name__}`" for f in route if f in ops and "sampling" in _parameters(f)]
    return "through " + ", ".join(onward) if onward else UNEXPLAINED


def _dtensor_wrapper(op):
    """The function of ``distributed/dtensor.py`` whose wrapper ``op`` is, or None."""
    for value in vars(dtensor).values():
        if inspect.isfunction(value) and op.__code__ in value.__code__.co_consts:
            return value
    return None


def render_routes():
    """The markdown table of each public op's routes."""
    ops = public_ops()
    lines = ["| op | file | " + " | ".join(column for _, column in ROUTE_COLUMNS)
             + " | `sampling=` |",
             "| --- | --- | " + " | ".join("---" for _ in ROUTE_COLUMNS) + " | --- |"]
    for name, op in ops.items():
        home, door = op.__module__, door_of(op)
        cells = [f"`{name}`", f"`{_file(home)}`"]
        if door is None:
            wrapper = _dtensor_wrapper(op)
            cells += [_named(wrapper, home) if wrapper else "-", "-", "-", "-",
                      "no door: " + NO_DOOR.get(_file(home), UNEXPLAINED), "-"]
        else:
            for field, _ in ROUTE_COLUMNS:
                route = getattr(door, field)
                if route is not None:
                    cells.append(_route_cell(route, home, set(ops.values())))
                elif field == "dtensor":
                    cells.append("refused (`TypeError`)")
                else:
                    cells.append("-")
            cells.append(_sampling_cell(op, door, set(ops.values())))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: each rendered block of the doc: its markers and what renders it
BLOCKS = ((PRIMITIVES_MARKERS, render_table), (ROUTES_MARKERS, render_routes))


def _doc_block(text, markers):
    begin, end = markers
    match = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)
    assert match, f"{DOC} has no {begin} ... {end} block"
    return match


def test_the_primitives_table_is_the_codes():
    assert _doc_block(DOC.read_text(), PRIMITIVES_MARKERS).group(1) == render_table(), (
        "docs/architecture.md's primitives table is stale: run "
        "`python tests/test_architecture_doc.py --write`")


def test_every_declared_primitive_is_implemented_somewhere():
    """A required primitive on every backend; an optional one on at least one."""
    table = render_table().splitlines()[2:]
    for row in table:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        marks = cells[2:]
        assert "yes" in marks, row
        if cells[1] == "required":
            assert marks == ["yes"] * len(KERNEL_BACKENDS), row


def test_the_op_routes_table_is_the_codes():
    assert _doc_block(DOC.read_text(), ROUTES_MARKERS).group(1) == render_routes(), (
        "docs/architecture.md's op routes table is stale: run "
        "`python tests/test_architecture_doc.py --write`")


def test_the_table_renders_every_route_a_door_has():
    """A new kind of route (a field of ``Door``) needs its column."""
    routes = {field.name for field in dataclasses.fields(Door)} - {"op", "tensors"}
    assert routes == {field for field, _ in ROUTE_COLUMNS}, (
        f"Door's routes are {sorted(routes)}: give ROUTE_COLUMNS a column for each")


def test_every_row_is_explained():
    """An op without a door has its file's reason in ``NO_DOOR``; an op taking ``sampling=``
    has a local route that reaches ``ops/sampling.py`` or calls an op taking it."""
    rendered = render_routes()
    assert UNEXPLAINED not in rendered, rendered


def test_process_group_and_the_vocab_parallel_route_go_together():
    """``Door.enter`` calls ``vocab_parallel`` whenever ``process_group`` is given."""
    for name, op in public_ops().items():
        door = door_of(op)
        if door is not None:
            assert ("process_group" in _parameters(op)) == (door.vocab_parallel is not None), name


def _door_changed_makes_the_check_fail(monkeypatch, op, **routes):
    """The doc check passes on the code, and fails once ``op``'s door has ``routes``."""
    test_the_op_routes_table_is_the_codes()
    module, door = sys.modules[op.__module__], door_of(op)
    attribute = next(key for key, value in vars(module).items() if value is door)
    monkeypatch.setattr(module, attribute, dataclasses.replace(door, **routes))
    with pytest.raises(AssertionError, match="op routes table is stale"):
        test_the_op_routes_table_is_the_codes()


def test_a_route_removed_makes_the_doc_stale(monkeypatch):
    _door_changed_makes_the_check_fail(monkeypatch, astrai_kernels.token_logprobs,
                                       vocab_parallel=None)


def test_a_route_added_makes_the_doc_stale(monkeypatch):
    _door_changed_makes_the_check_fail(
        monkeypatch, astrai_kernels.distill_loss,
        vocab_parallel=door_of(astrai_kernels.cross_entropy).vocab_parallel)


def test_a_route_running_another_function_makes_the_doc_stale(monkeypatch):
    _door_changed_makes_the_check_fail(
        monkeypatch, astrai_kernels.sequence_logprobs,
        reference=door_of(astrai_kernels.sequence_logprobs).local)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = DOC.read_text()
    for markers, render in BLOCKS:
        span = _doc_block(text, markers).span(1)
        text = text[:span[0]] + render() + text[span[1]:]
    DOC.write_text(text)
    print(f"wrote the primitives and op routes tables of {DOC}")
