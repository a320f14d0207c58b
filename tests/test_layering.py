"""The package's module graph: no import cycle, no use of another module's underscore names.

Read from the source (``ast``), not by importing: every ``import`` counts, those inside
functions too (a lazy import is how a cycle hides), except the ones under
``if TYPE_CHECKING:``, which never run.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "astrai_kernels"


def _modules():
    """``{dotted name: (path, is_package)}`` of every module in the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


MODULES = _modules()


def _absolute(module, is_package, level, name):
    if level == 0:
        return name
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _type_checking_nodes(tree):
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def _scan(module, source=None):
    """``(imported package modules, underscore names of other modules used)``."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    skipped = _type_checking_nodes(tree)
    imported, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    imported.add(full)
                    aliases[alias.asname or alias.name] = full
                elif source in MODULES:
                    imported.add(source)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{module}:{node.lineno} imports {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    imported.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in MODULES):
            private.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    imported.discard(module)
    return imported, private


SCANS = {module: _scan(module) for module in MODULES}


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package():
    assert {"astrai_kernels.ops.cross_entropy", "astrai_kernels.ops.head", "astrai_kernels.cli",
            "astrai_kernels.distributed.vocab_parallel"} <= set(MODULES)
    assert "astrai_kernels.ops.head" in SCANS["astrai_kernels.ops.cross_entropy"][0]


def test_the_walk_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_walk_finds_private_uses_and_lazy_imports():
    source = ("from . import cross_entropy as ce\n"
              "from ._common import _shown\n"
              "def f():\n"
              "    from . import sampling\n"
              "    return ce._reduce, sampling.__name__\n"
              "if TYPE_CHECKING:\n"
              "    from . import grpo\n")
    imported, private = _scan("astrai_kernels.ops.distill", source)
    assert imported == {"astrai_kernels.ops.cross_entropy", "astrai_kernels.ops._common",
                        "astrai_kernels.ops.sampling"}
    assert private == ["astrai_kernels.ops.distill:2 imports astrai_kernels.ops._common._shown",
                       "astrai_kernels.ops.distill:5 uses astrai_kernels.ops.cross_entropy._reduce"]


def test_no_import_cycle():
    graph = {module: imported for module, (imported, _) in SCANS.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_other_modules_underscore_names(module):
    assert SCANS[module][1] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                           if m.startswith("astrai_kernels.distributed.")))
def test_vocab_parallel_sits_below_the_ops(module):
    imported = SCANS[module][0]
    ops = {f"astrai_kernels.ops.{name}" for name in
           ("cross_entropy", "logprobs", "grpo", "linear", "distill")}
    assert not imported & ops


def test_kernels_is_the_ground_floor():
    upstairs = {module: sorted(m for m in imported if not m.startswith("astrai_kernels.kernels"))
                for module, (imported, _) in SCANS.items()
                if module.startswith("astrai_kernels.kernels")}
    assert {module: found for module, found in upstairs.items() if found} == {}


#: the generators of custom ops and head walks that take a kernel-module resolver, and where
RESOLVER_TAKERS = {"optional_primitive_op": 1, "head_walk": None}


def _resolvers_passed(module):
    """``(line, resolver expression, where its name comes from)`` of every resolver ``module``
    passes to a ``RESOLVER_TAKERS`` generator (``None``: a name of ``module`` itself)."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    imported_from = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.level, node.module)
            for alias in node.names:
                imported_from[alias.asname or alias.name] = source
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported_from[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", None))
        if name not in RESOLVER_TAKERS:
            continue
        position = RESOLVER_TAKERS[name]
        passed = [k.value for k in node.keywords if k.arg == "kernels"]
        if position is not None and len(node.args) > position:
            passed.append(node.args[position])
        for resolver in passed:
            root = resolver
            while isinstance(root, ast.Attribute):
                root = root.value
            source = imported_from.get(getattr(root, "id", None))
            found.append((node.lineno, ast.unparse(resolver), source))
    return found


def test_kernel_resolvers_come_from_the_kernels():
    """The arrow an import scan cannot see: a resolver (``backend -> kernel module``) handed to
    ``library.optional_primitive_op`` or ``head.head_walk`` is called from below, so one
    defined above ``kernels/`` would be a call back up into it."""
    upward = [f"{module}:{line} passes {resolver} (from {source or 'itself'})"
              for module in MODULES
              for line, resolver, source in _resolvers_passed(module)
              if not (source or "").startswith("astrai_kernels.kernels")]
    assert upward == []


def test_the_registry_reaches_every_backend_by_an_import_statement():
    assert {"astrai_kernels.kernels.triton.backend", "astrai_kernels.kernels.cpp.backend",
            "astrai_kernels.kernels.portable"} <= SCANS["astrai_kernels.kernels.registry"][0]


def test_the_options_sit_below_the_spec_and_the_ops():
    # the option objects and the loss-type records are read by both: they import neither
    upstairs = {module: sorted(m for m in imported if not m.startswith(
                    ("astrai_kernels.options", "astrai_kernels.kernels")))
                for module, (imported, _) in SCANS.items()
                if module.startswith("astrai_kernels.options")}
    assert {module: found for module, found in upstairs.items() if found} == {}
    assert "astrai_kernels.options.grpo" in SCANS["astrai_kernels.reference"][0]
    assert not [m for m in SCANS["astrai_kernels.reference"][0]
                if m.startswith("astrai_kernels.ops")]
