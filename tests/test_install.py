"""The package as a user installs it: a wheel built from this tree and a wheel built from its
sdist (``python -m build``), each installed outside the checkout and made read-only, serve the
cpp backend from a directory that is not the checkout, through the API and the console script.

The wheels are built without build isolation (the test extra brings the backend) from a copy of
the working tree without build outputs, as a clean clone has it. The installed copy carries the
same C++ sources, so it finds the build this suite's cpp tests use in the per-user cache and
does not compile again.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import astrai_kernels.kernels.cpp.backend as cb

ROOT = Path(__file__).resolve().parents[1]
# what a clone does not hold (.gitignore) or a build must not see (earlier build outputs)
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache",
                                     ".benchmarks", "results")

CHECK = r"""
import json, sys
from pathlib import Path

import torch

import astrai_kernels as ak
import astrai_kernels.cli
import astrai_kernels.testing.verify
import astrai_kernels.kernels.cpp.backend as cb
from astrai_kernels import reference
from astrai_kernels.testing import assert_close

generator = torch.Generator().manual_seed(0)
logits = torch.randn(3, 5, 37, generator=generator) * 4
target = torch.randint(0, 37, (3, 5), generator=generator)
target[0, :2] = -100
expected_loss = reference.cross_entropy(logits.double(), target)
expected_logp, _ = reference.token_logprobs(logits.double(), target)
for backend in ("cpp", "torch"):
    loss = ak.cross_entropy(logits, target, backend=backend)
    logp = ak.token_logprobs(logits, target, backend=backend)
    # both within the tolerance table of the float64 reference, hence of each other
    assert_close(loss, expected_loss, what=f"{backend} cross_entropy")
    assert_close(logp, expected_logp, what=f"{backend} token_logprobs")
modules = sorted({m.__file__ for name, m in sys.modules.items()
                  if name.split(".")[0] == "astrai_kernels" and getattr(m, "__file__", None)})
print(json.dumps({
    "available": ak.available_backends("cpu"),
    "modules": modules,
    "source_dir": str(cb.source_dir()),
    "build_directory": str(cb.build_directory()),
    "extension": cb.load_extension().__file__,
}))
"""


def _run(args, **kwargs):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    return proc


def _pip(*args):
    env = {k: v for k, v in os.environ.items() if k != cb.PREBUILD_ENV}  # the plain wheel
    return _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                env=env)


def _only(folder, pattern):
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


def _csrc():
    return {p.name: p.read_bytes() for p in sorted((ROOT / "csrc").iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """``{"tree": wheel built from the working tree, "sdist": wheel built from its sdist}``."""
    base = tmp_path_factory.mktemp("packaging")
    tree = base / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCES)
    _pip("wheel", "--no-build-isolation", "--no-deps", "-w", base / "from-tree", tree)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
          base / "sdist", tree])
    sdist = _only(base / "sdist", "*.tar.gz")
    _pip("wheel", "--no-build-isolation", "--no-deps", "-w", base / "from-sdist", sdist)
    return {"tree": _only(base / "from-tree", "*.whl"),
            "sdist": _only(base / "from-sdist", "*.whl"), "sdist archive": sdist}


def test_sdist_carries_the_cpp_sources(wheels):
    with tarfile.open(wheels["sdist archive"]) as archive:
        members = {name.split("/", 1)[1]: name for name in archive.getnames() if "/" in name}
        packed = {name: archive.extractfile(members[f"csrc/{name}"]).read() for name in _csrc()
                  if f"csrc/{name}" in members}
    assert packed == _csrc(), "the sdist lacks or alters csrc/"


@pytest.mark.parametrize("origin", ["tree", "sdist"])
def test_wheel_carries_the_cpp_sources(wheels, origin):
    with zipfile.ZipFile(wheels[origin]) as archive:
        names = set(archive.namelist())
        packed = {name: archive.read(f"astrai_kernels/csrc/{name}") for name in _csrc()
                  if f"astrai_kernels/csrc/{name}" in names}
    assert packed == _csrc(), f"the wheel from the {origin} lacks or alters csrc/"
    assert not any(name.startswith("csrc/") for name in names)  # only inside the package
    # without ASTRAI_KERNELS_PREBUILD=1 no library (test_prebuilt_wheel builds one with it)
    assert not any(name.startswith("astrai_kernels/prebuilt/") for name in names)
    assert wheels[origin].name.endswith("-py3-none-any.whl"), wheels[origin].name


def _snapshot(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*"))


def _set_writable(path, writable):
    for entry in [path, *path.rglob("*")]:
        mode = entry.stat().st_mode
        entry.chmod(mode | stat.S_IWUSR if writable else mode & ~0o222)


@pytest.mark.parametrize("origin", ["tree", "sdist"])
def test_installed_wheel_serves_cpp(wheels, origin, tmp_path):
    # the build this suite uses; the installed copy, with the same sources, must find it
    cb.load_extension()
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-index", "--target", site, wheels[origin])
    _set_writable(site, False)  # as a root-owned site-packages is to its users
    before = _snapshot(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # ASTRAI_KERNELS_BUILD_DIR is kept: the installed copy then shares the suite's build wherever
    # it is (the default cache roots are tested in test_cpp_backend)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASTRAI_KERNELS_BACKEND")}
    env["PYTHONPATH"] = str(site)
    try:
        check = _run([sys.executable, "-c", CHECK], cwd=elsewhere, env=env)
        script = site / "bin" / "astrai-kernels"
        verify = _run([script, "verify", "--ops", "cross_entropy,token_logprobs", "--backends",
                       "cpp,torch", "--dtypes", "fp32", "--shapes", "2x3x37"],
                      cwd=elsewhere, env=env)
        after = _snapshot(site)
    finally:
        _set_writable(site, True)
    result = json.loads(check.stdout.strip().splitlines()[-1])
    assert "cpp" in result["available"], check.stderr
    assert all(Path(m).is_relative_to(site) for m in result["modules"]), result["modules"]
    assert Path(result["source_dir"]) == site / "astrai_kernels" / "csrc"
    assert Path(result["build_directory"]) == cb.build_directory()  # no rebuild, not in site
    assert Path(result["extension"]).parent == cb.build_directory()
    assert "0 failed" in verify.stdout, verify.stdout
    assert " cpp " in verify.stdout, verify.stdout
    assert after == before, "running the installed package wrote into it"
