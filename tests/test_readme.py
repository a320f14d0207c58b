"""Every ```python block of the README and of docs/*.md runs as shown (each file's blocks in
order, in one namespace per file); the ```py blocks need more (transformers, torchrun) and are
run elsewhere or not at all: docs/distributed.md's, scripts for torchrun, by
tests/test_distributed_docs.py. docs/benchmarks.md's tables are written by bench/doc_tables.py."""

import importlib.util
import json
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_blocks(path):
    torch.manual_seed(0)
    namespace = {}
    for block in python_blocks(path):
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_readme_examples_run():
    blocks = python_blocks(README)
    assert len(blocks) >= 8, "the README should show an example per op and per strategy"
    run_blocks(README)


DOCS_WITH_EXAMPLES = [path for path in DOCS if python_blocks(path)]


def test_docs_with_examples():
    """The pages that document calls show them."""
    assert {"usage.md", "objectives.md"} <= {path.name for path in DOCS_WITH_EXAMPLES}


@pytest.mark.parametrize("path", DOCS_WITH_EXAMPLES, ids=[p.name for p in DOCS_WITH_EXAMPLES])
def test_doc_examples_run(path):
    run_blocks(path)


def test_readme_links_resolve():
    """Every relative link of the README and the docs names a file that exists."""
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_doc_tables_rewrite_only_the_marked_section(tmp_path):
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "bench" / "doc_tables.py")
    doc_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc_tables)
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
