"""A wheel that needs no build: ``ASTRAI_KERNELS_PREBUILD=1 pip wheel . --no-build-isolation``
puts the library compiled for the installed torch into the wheel (taken from the per-user build
this suite uses, so nothing compiles here), and that wheel, installed into a second venv whose
PATH holds no C++ compiler, serves the cpp backend on its first call in under a second.

The second venv sees the first one's torch (and numpy) through a ``.pth`` file rather than
installing torch again: the same torch, as the wheel requires. Another torch is simulated by
setting ``torch.__version__`` in the child before the first call: the prebuilt library is then
refused with a line saying why, and the per-user build starts as without the wheel (with a
compiler that fails at once, standing in for minutes of a real build), or, without a compiler,
``auto`` falls back to the torch backend.
The manifest's other checks (sources, instruction set, Python, platform, the library's bytes)
are tested on a copied manifest, without loading anything.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

import astrai_kernels.kernels.cpp.backend as cb

ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache",
                                     ".benchmarks", "results")

FIRST_CALL = r"""
import json, sys, time, warnings
import torch
if len(sys.argv) > 1:  # another torch than the wheel's
    torch.__version__ = sys.argv[1]
import astrai_kernels as ak
import astrai_kernels.kernels.cpp.backend as cb
from astrai_kernels import reference
from astrai_kernels.kernels.registry import resolve_backend
from astrai_kernels.testing import assert_close

generator = torch.Generator().manual_seed(0)
logits = torch.randn(3, 5, 37, generator=generator) * 4
target = torch.randint(0, 37, (3, 5), generator=generator)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    started = time.perf_counter()
    logp = ak.token_logprobs(logits, target)
    first_call_s = time.perf_counter() - started
    backend = resolve_backend("auto", "cpu")
assert_close(logp, reference.token_logprobs(logits.double(), target)[0], what="token_logprobs")
print(json.dumps({
    "first_call_s": first_call_s,
    "backend": backend,
    "library": cb.load_extension().__file__ if backend == "cpp" else None,
    "package": ak.__file__,
    "compiler": cb.compiler(),
    "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
}))
"""


def _run(args, **kwargs):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    return proc


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built with ASTRAI_KERNELS_PREBUILD=1 from a copy of the working tree."""
    built = Path(cb.load_extension().__file__)  # the suite's build, which the wheel reuses
    base = tmp_path_factory.mktemp("prebuilt")
    tree = base / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    env = {**os.environ, cb.PREBUILD_ENV: "1"}
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
          "--no-build-isolation", "--no-deps", "-w", base / "wheel", tree], env=env)
    (found,) = (base / "wheel").glob("*.whl")
    return {"path": found, "built": built}


@pytest.fixture(scope="module")
def second_venv(wheel, tmp_path_factory):
    """A venv holding only the wheel, which finds the first venv's torch through a .pth file;
    returns (python, its site-packages, an environment whose PATH has no compiler)."""
    base = tmp_path_factory.mktemp("second-venv")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                .stdout.strip())
    _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install",
          "--no-deps", "--no-index", "--target", site, wheel["path"]])
    (site / "first-venv-torch.pth").write_text(sysconfig.get_path("purelib") + "\n")
    home = base / "home"  # an empty per-user cache: nothing to find but the wheel's library
    home.mkdir()
    env = {"PATH": str(venv / "bin"), "HOME": str(home), "OMP_NUM_THREADS": "1",
           "LANG": os.environ.get("LANG", "C.UTF-8")}
    return python, site, env


def test_wheel_carries_the_library_for_this_torch(wheel):
    name = wheel["path"].name
    tag = sys.implementation.cache_tag.replace("python-", "p")  # cpython-311 -> cp311
    assert f"-{tag}-{tag}-" in name and "none-any" not in name, name
    with zipfile.ZipFile(wheel["path"]) as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read(f"astrai_kernels/prebuilt/{cb.PREBUILT_MANIFEST}"))
        library = archive.read(f"astrai_kernels/prebuilt/{manifest['library']}")
    assert {n for n in names if n.startswith("astrai_kernels/prebuilt/")} == {
        f"astrai_kernels/prebuilt/{cb.PREBUILT_MANIFEST}",
        f"astrai_kernels/prebuilt/{manifest['library']}"}
    assert manifest["torch"] == torch.__version__
    assert manifest["sources"] == cb._source_hash(cb.source_dir())
    assert manifest["library"] == wheel["built"].name
    assert manifest["sha256"] == hashlib.sha256(library).hexdigest() == _sha256(wheel["built"])


def test_installed_where_no_compiler_is_the_first_call_loads_it(second_venv):
    python, site, env = second_venv
    proc = _run([python, "-c", FIRST_CALL], cwd=site.parent, env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compiler"] is None  # no c++ / g++ on this PATH
    assert Path(result["package"]).is_relative_to(site)
    assert result["backend"] == "cpp" and result["warnings"] == [], result
    assert Path(result["library"]).parent == site / "astrai_kernels" / "prebuilt"
    assert result["first_call_s"] < 1.0, result
    assert "astrai_kernels:" not in proc.stderr, proc.stderr  # no build, no refusal


def _tools(folder, with_toolchain):
    """A bin folder with ninja and a ``c++`` that answers g++'s version probes but fails every
    compile at once (a real build of the kernels takes a minute or more), or with neither."""
    folder.mkdir()
    if with_toolchain:
        found = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
        (folder / "ninja").symlink_to(found)
        compiler = folder / "c++"
        compiler.write_text('#!/bin/sh\ncase "$1" in -v) echo "gcc version 12.2.0 (test)" >&2; '
                            'exit 0;; --version|-dumpversion|-dumpfullversion) echo 12.2.0; '
                            'exit 0;; esac\necho "c++: error: a stand-in compiler" >&2\nexit 1\n')
        compiler.chmod(0o755)
    return folder


@pytest.mark.parametrize("toolchain", ["none", "compiler"])
def test_another_torch_is_refused_and_falls_back(second_venv, tmp_path, toolchain):
    python, site, env = second_venv
    env = {**env, "PATH": f"{env['PATH']}:{_tools(tmp_path / 'bin', toolchain == 'compiler')}"}
    proc = _run([python, "-c", FIRST_CALL, "2.0.0+other"], cwd=site.parent, env=env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("astrai_kernels: ")]
    prebuilt = site / "astrai_kernels" / "prebuilt"
    assert lines[0] == (f"astrai_kernels: not loading the prebuilt C++ kernels in {prebuilt}: it "
                        f"was built for torch {torch.__version__}, this process runs torch "
                        f"2.0.0+other; using the per-user build"), proc.stderr
    assert result["backend"] == "torch", result
    assert len(result["warnings"]) == 1, result["warnings"]
    if toolchain == "none":
        assert lines == lines[:1] and "no C++ compiler was found" in result["warnings"][0]
        return
    # the per-user build, in this torch's folder of the (empty) per-user cache, as without a wheel
    cache = Path(env["HOME"]) / ".cache" / "astrai_kernels"
    assert lines[1].startswith("astrai_kernels: compiling the cpp backend's C++ kernels once"), \
        lines
    assert f"in {cache}/cpp-2.0.0+other-" in lines[1], lines
    assert "failed after" in lines[2] and "a stand-in compiler" in lines[2], lines


@pytest.fixture
def copied_prebuilt(tmp_path, monkeypatch):
    """A prebuilt folder holding the suite's library and a manifest matching this process, as
    the package's own; returns (folder, manifest) to alter."""
    library = Path(cb.load_extension().__file__)
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    shutil.copyfile(library, folder / library.name)
    manifest = {"module": library.stem, "library": library.name, "sha256": _sha256(library),
                **cb._prebuilt_key(cb.source_dir())}
    monkeypatch.setattr(cb, "prebuilt_dir", lambda: folder)
    return folder, manifest


def _write(folder, manifest):
    (folder / cb.PREBUILT_MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("key, value, reason", [
    ("torch", "2.0.0", f"it was built for torch 2.0.0, this process runs torch "
                       f"{torch.__version__}"),
    ("sources", "0" * 64, "it was built from other C++ sources or flags (hash 000000000000, "
                          "these "),
    ("isa", "riscv64", "it was built for riscv64, this machine is "),
    ("python", "cpython-29", "it was built for cpython-29, this interpreter is "),
    ("platform", "plan9", "it was built for plan9, this platform is "),
    ("sha256", "0" * 64, "does not match the SHA-256 its manifest records"),
])
def test_a_manifest_that_does_not_match_is_refused(copied_prebuilt, key, value, reason):
    folder, manifest = copied_prebuilt
    _write(folder, manifest)
    found, refusal = cb._prebuilt_library(cb.source_dir())
    assert refusal is None and found == (manifest["module"], folder / manifest["library"])
    assert cb.cached_library() == folder / manifest["library"]
    _write(folder, {**manifest, key: value})
    found, refusal = cb._prebuilt_library(cb.source_dir())
    assert found is None and reason in refusal, refusal
    assert cb.cached_library() != folder / manifest["library"]


def test_no_manifest_is_no_prebuilt_and_a_broken_one_says_so(copied_prebuilt):
    folder, manifest = copied_prebuilt
    assert cb._prebuilt_library(cb.source_dir()) == (None, None)
    (folder / cb.PREBUILT_MANIFEST).write_text("{not json")
    found, refusal = cb._prebuilt_library(cb.source_dir())
    assert found is None and refusal.startswith(f"its manifest {folder / cb.PREBUILT_MANIFEST} "
                                                f"cannot be read")
