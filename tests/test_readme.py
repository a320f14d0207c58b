"""The README and docs/*.md as a newcomer reads them (issue 44).

Every ```python and ```py block runs alone, as pasted into a fresh interpreter: the blocks run in
one subprocess, each in a namespace of its own (nothing carries over from the block above).
The line above a block may say what it needs: ``<!-- needs: transformers -->`` (modules: the
block runs where they import, else it is skipped saying which is missing), or
``<!-- not run: REASON -->`` (a sketch, a GPU, several ranks: skipped with that reason).
Two pages' blocks are run by tests of their own, which this one names when it skips them. The
lists the docs copy from the code
(the C++ sources the build compiles, the version floors) are checked against it, and the
README's measured tables against docs/benchmarks.md's (both written by bench/doc_tables.py from
one run)."""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RUN_ELSEWHERE = {
    "distributed.md": "torchrun recipes, run on several ranks by tests/test_distributed_docs.py",
    "verl.md": "run by tests/test_integration_verl.py in make test-verl's venv (verl pins an "
               "older transformers)",
}
FENCE = re.compile(r"^```(python|py)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
NEEDS = re.compile(r"<!-- needs: ([\w.]+(?:, [\w.]+)*) -->")
MARKER = re.compile(f"{NOT_RUN.pattern}|{NEEDS.pattern}")


class Block(NamedTuple):
    path: pathlib.Path
    line: int
    source: str
    not_run: Optional[str]  # why it is skipped, from its marker

    @property
    def name(self):
        return f"{self.path.name}:{self.line}"


def _missing(modules):
    return [name for name in modules if importlib.util.find_spec(name) is None]


def blocks_of(path):
    """The page's blocks, each with why it is not run here (None: it runs)."""
    text = path.read_text()
    found = []
    for fence in FENCE.finditer(text):
        above = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        not_run = NOT_RUN.fullmatch(above)
        needs = NEEDS.fullmatch(above)
        why = RUN_ELSEWHERE.get(path.name)
        if why is None and not_run:
            why = not_run.group(1)
        elif why is None and needs and _missing(needs.group(1).split(", ")):
            why = f"needs {', '.join(_missing(needs.group(1).split(', ')))} (not installed)"
        found.append(Block(path, text.count("\n", 0, fence.start()) + 1, fence.group(2), why))
    return found


BLOCKS = [block for path in [README, *DOCS] for block in blocks_of(path)]
RUNNABLE = [block for block in BLOCKS if block.not_run is None]

# Run in a fresh interpreter: each block in a namespace of its own, from the same seed; the
# outcome of each (None or its traceback) written to the file named by argv[1] as JSON.
RUNNER = """
import json, sys, traceback
import torch
blocks = json.load(sys.stdin)
outcomes = []
for name, source in blocks:
    torch.manual_seed(0)
    try:
        exec(compile(source, name, "exec"), {"__name__": "__main__"})
        outcomes.append(None)
    except BaseException:
        outcomes.append(traceback.format_exc())
with open(sys.argv[1], "w") as out:
    json.dump(outcomes, out)
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each runnable block's outcome (None, or its traceback), by name."""
    where = tmp_path_factory.mktemp("doc_blocks")
    result_path = where / "outcomes.json"
    done = subprocess.run([sys.executable, "-c", RUNNER, str(result_path)], cwd=where,
                          input=json.dumps([(b.name, b.source) for b in RUNNABLE]),
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not result_path.exists():
        pytest.fail(f"the blocks' interpreter died (status {done.returncode}):\n"
                    f"{done.stderr[-4000:]}")
    return dict(zip((b.name for b in RUNNABLE), json.loads(result_path.read_text())))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs_alone(block, outcomes):
    if block.not_run is not None:
        pytest.skip(f"{block.name}: {block.not_run}")
    assert outcomes[block.name] is None, (f"{block.name} does not run alone:\n"
                                          f"{outcomes[block.name]}")


def test_the_pages_that_document_calls_show_runnable_ones():
    pages = {block.path.name for block in RUNNABLE}
    assert {"README.md", "usage.md", "objectives.md"} <= pages
    assert sum(block.path == README for block in RUNNABLE) >= 8, (
        "the README should show an example per op and per strategy")


def test_every_marker_heads_a_block():
    """A marker left above prose (its block moved or gone) would mark nothing."""
    for path in [README, *DOCS]:
        text = path.read_text()
        for marker in MARKER.finditer(text):
            after = text[marker.end():].lstrip("\n")
            assert re.match(r"```(python|py)\n", after), (
                f"{path.name}: the marker {marker.group(0)!r} is not right above a code block")


def test_readme_links_resolve():
    """Every relative link of the README and the docs names a file that exists."""
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_install_names_the_sources_the_build_compiles():
    """docs/install.md's build lines and source names are the build's (it once showed
    ``[k/7]`` and six sources while the build compiled eight and printed ``[k/9]``)."""
    from astrai_kernels.kernels.cpp.backend import SOURCES

    compiled = [name for name in SOURCES if name.endswith(".cpp")]
    install = " ".join((ROOT / "docs" / "install.md").read_text().split())
    steps = len(compiled) + 1  # each source, then the link
    assert set(re.findall(r"\[k/(\d+)\]", install)) == {str(steps)}
    listed = ", ".join(f"`{name}`" for name in compiled)
    assert listed in install, f"docs/install.md should list the build's sources: {listed}"
    named = set(re.findall(r"\b(\w+\.cpp)\b", install))
    assert named == set(compiled), f"sources named but not built: {named - set(compiled)}, " \
                                   f"built but not named: {set(compiled) - named}"


def _floor(requirement):
    return re.search(r">=\s*([\d.]+)", requirement).group(1)


def test_version_floors_are_pyprojects():
    """The Python, torch and Triton floors the README and docs/install.md state are
    pyproject.toml's, and install.md's tested torch and Triton are the Makefile's pins."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    by_name = {re.match(r"[\w-]+", dep).group(0): dep for dep in project["dependencies"]}
    floors = (f"Python >= {_floor(project['requires-python'])}, torch >= "
              f"{_floor(by_name['torch'])} and, on Linux, Triton >= {_floor(by_name['triton'])}")
    install = (ROOT / "docs" / "install.md").read_text()
    for path, text in ((README, README.read_text()), (ROOT / "docs" / "install.md", install)):
        assert floors in " ".join(text.split()), f"{path.name} should say: {floors}"
    makefile = (ROOT / "Makefile").read_text()
    for which in ("OLDEST", "NEWEST"):
        torch_pin = re.search(rf"^{which}_TORCH_SPEC \?= torch==(\S+)", makefile, re.M).group(1)
        triton_pin = re.search(rf"^{which}_TRITON_SPEC \?= triton==(\S+)", makefile,
                               re.M).group(1)
        assert re.search(rf"^\| {re.escape(torch_pin)} \([^)]*\) \| {re.escape(triton_pin)} \|",
                         install, re.M), f"install.md's table should show {which} {torch_pin}"


def load_doc_tables():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "bench" / "doc_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table_rows(markdown):
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]


def test_readme_tables_are_docs_benchmarks_run():
    """The README's measured tables and docs/benchmarks.md's come from one run: the same
    commit, and each README figure is the docs table's for that op, shape, dtype and method."""
    doc_tables = load_doc_tables()
    readme = README.read_text().split(doc_tables.README_BEGIN)[1].split(doc_tables.README_END)[0]
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    bench = bench.split(doc_tables.BEGIN)[1].split(doc_tables.END)[0]
    commit = re.search(r"written at commit (\w+)", bench).group(1)
    assert f"commit {commit}" in readme
    logits, linear = {}, {}
    for cells in _table_rows(bench):
        if len(cells) == 9:
            logits[tuple(cells[:4])] = cells
        elif len(cells) == 10:
            linear[tuple(cells[:4])] = cells
    checked = 0
    for cells in _table_rows(readme):
        op = re.sub(r"`|\(one step\)", "", cells[0]).strip()
        op = {"grpo_loss": "grpo", "distill_loss": "distill", "linear_grpo_loss": "linear_grpo",
              "linear_distill_loss": "linear_distill"}.get(op, op)
        if cells[0] in ("op", "fused head"):
            continue
        if len(cells) == 7:  # the logits ops: the cpp kernel against the floor and baselines
            row = logits[(op, cells[1], cells[2], "cpp")]
            assert cells[3:6] == row[5:8], cells
            naive = logits[(op, cells[1], cells[2], "naive")][8]
            assert cells[6].startswith(f"{naive}, {row[8]}"), cells
        else:  # the fused head: this / naive / torch_lce / torch_lce_chunked
            methods = ("cpp", "naive", "torch_lce", "torch_lce_chunked")
            rows = [linear.get((op, cells[1], cells[2], method)) for method in methods]
            assert cells[3] == " / ".join(r[5] if r else "-" for r in rows), cells
            assert cells[4] == " / ".join(r[7] if r else "-" for r in rows), cells
            assert cells[5] == rows[0][9], cells
        checked += 1
    assert checked >= 10


def test_doc_tables_rewrite_only_the_marked_section(tmp_path):
    doc_tables = load_doc_tables()
    doc = tmp_path / "benchmarks.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    doc.write_text(original)
    result = {"op": "cross_entropy", "vocab": 32768, "rows": 4096, "dtype": "fp32",
              "method": "cpp", "median_s": 0.087, "ratio_vs_copy": 2.79, "ratio_vs_naive": 0.15,
              "ratio_vs_compile": 0.29, "peak_extra_bytes": 2**29, "logits_bytes": 2**29}
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps({"machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x",
                                                  "loadavg_at_start": [0.5, 0.5, 0.5]},
                                      "results": [result], "skipped": []}))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    written = doc.read_text()
    head, rest = original.split(doc_tables.BEGIN)
    tail = rest.split(doc_tables.END)[1]
    assert written.startswith(head + doc_tables.BEGIN) and written.endswith(doc_tables.END + tail)
    row = "| cross_entropy | N=4096, V=32768 | fp32 | cpp | 87.0 | 2.79x | 0.15x | 0.29x | 1.00 |"
    assert row in written
    assert "Measured Test CPU (2 cores; SIMD flags: not recorded)" in written
    bench_json.write_text(json.dumps({"machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x",
                                                  "cpu_flags": ["avx2", "fma"],
                                                  "cpu_isa_cap": "avx2"},
                                      "results": [result], "skipped": []}))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    assert ("Measured Test CPU (2 cores; SIMD flags: avx2 fma, kernels capped at avx2)"
            in doc.read_text())
