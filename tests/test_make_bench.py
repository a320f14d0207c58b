"""``make bench`` writes only under bench/results/, and ``make bench-docs`` rewrites
docs/benchmarks.md and the README's measured tables from one run and says so (issue 44: after
``make bench``, ``git status`` showed docs/benchmarks.md rewritten without a word).

Each target's own recipe runs, from the Makefile, in a throwaway git repository holding the
files it may touch (a copy of the Makefile, the docs, bench/doc_tables.py), with the real
``astrai-kernels bench`` on one tiny case (``BENCH_ARGS``) and this interpreter as ``PY``; the
set-up stamps are faked, so nothing is installed or built."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("Makefile", ".gitignore", "pyproject.toml", "README.md", "docs/benchmarks.md",
          "bench/doc_tables.py")
# one case of each kind the docs' tables hold: a logits op with its naive path, at the README's V
TINY_RUN = ("--ops cross_entropy --rows 64 --vocab 32768 --dtype fp32 --backends torch "
            "--baselines naive --repeats 1 --min-repeats 1 --no-progress --deadline inf")

pytestmark = pytest.mark.skipif(not (shutil.which("make") and shutil.which("git")),
                                reason="needs make and git")


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def checkout(tmp_path):
    """A committed copy of the files the bench targets may touch, set up as far as make sees."""
    repo = tmp_path / "checkout"
    for name in COPIED:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q",
         "-m", "the files the bench targets may touch")
    # make's set-up stamps, newer than pyproject.toml (and no csrc/ here): setup is done
    past = os.stat(repo / "pyproject.toml").st_mtime - 60
    os.utime(repo / "pyproject.toml", (past, past))
    (repo / ".venv").mkdir()
    for stamp in (".astrai-kernels-installed", ".astrai-kernels-built"):
        (repo / ".venv" / stamp).touch()
    return repo


def _make(repo, target):
    command = ["make", "--no-print-directory", target, f"PY={sys.executable}",
               f"BENCH_ARGS={TINY_RUN}"]
    # a recipe that dropped BENCH_ARGS would run the whole default benchmark (10 minutes)
    planned = subprocess.run(command + ["--dry-run"], cwd=repo, capture_output=True, text=True)
    assert TINY_RUN in planned.stdout, f"make {target} does not pass BENCH_ARGS on:\n" \
                                       f"{planned.stdout}{planned.stderr}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                          timeout=600)


def test_make_bench_leaves_the_checkout_clean(checkout):
    done = _make(checkout, "bench")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    results = sorted(p.name for p in (checkout / "bench" / "results").iterdir())
    assert results == ["bench.json", "bench.png"]


def test_make_bench_docs_rewrites_both_tables_and_says_so(checkout):
    commit = _git(checkout, "rev-parse", "--short=7", "HEAD").strip()
    readme_before = (checkout / "README.md").read_text()
    done = _make(checkout, "bench-docs")
    assert done.returncode == 0, done.stdout + done.stderr
    changed = _git(checkout, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert sorted(changed) == [" M README.md", " M docs/benchmarks.md"]
    said = [line for line in done.stdout.splitlines() if line.startswith("wrote ")]
    assert len(said) == 1, done.stdout
    assert said[0].startswith("wrote docs/benchmarks.md and README.md from "
                              "bench/results/bench.json: measured on ")
    assert said[0].endswith(f"commit {commit}")
    readme = (checkout / "README.md").read_text()
    bench = (checkout / "docs" / "benchmarks.md").read_text()
    assert f"commit {commit}" in readme and f"written at commit {commit}" in bench
    # only the marked tables changed: the README around them is as it was
    begin, end = "<!-- BEGIN README tables", "<!-- END README tables"
    assert readme.split(begin)[0] == readme_before.split(begin)[0]
    assert readme.split(end)[1] == readme_before.split(end)[1]
    assert "| `cross_entropy` | N=64, V=32768 | fp32 |" in readme
