"""The cpp backend's build cache when it cannot be written (a shared cache, a container image).

A read-only build directory holding a complete build is loaded without a build and without the
lock; one holding none (or a damaged one) gives a reason naming the directory and the cause.
Running as root, permission bits deny no write, so there the read-only directory is simulated
by making ``os.access`` report it unwritable (the check the loader makes before taking the lock).
"""

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import astrai_kernels.kernels.cpp.backend as cb
from astrai_kernels.kernels.registry import resolve_backend

from cases import subprocess_env


def _make_read_only(path):
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            entry = Path(root) / name
            entry.chmod(entry.stat().st_mode & ~0o222)
    path.chmod(path.stat().st_mode & ~0o222)


def _make_writable(path):
    path.chmod(path.stat().st_mode | stat.S_IWUSR)
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            entry = Path(root) / name
            entry.chmod(entry.stat().st_mode | stat.S_IWUSR)


def _writes_denied(path):
    """Whether the permission bits stop this process writing in ``path`` (not so for root)."""
    probe = path / ".astrai-write-probe"
    try:
        probe.write_text("")
    except PermissionError:
        return True
    probe.unlink()
    return False


def _snapshot(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*"))


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """Returns a function making a directory read-only (really, or for ``os.access``)."""
    made = []

    def make(path):
        _make_read_only(path)
        made.append(path)
        if not _writes_denied(path):
            real_access = os.access

            def access(target, mode, *args, **kwargs):
                if mode & os.W_OK and Path(target).resolve().is_relative_to(path.resolve()):
                    return False
                return real_access(target, mode, *args, **kwargs)

            monkeypatch.setattr(os, "access", access)
        return path

    yield make
    for path in made:
        _make_writable(path)


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader's per-process state reset for the test and restored after it."""
    monkeypatch.setattr(cb, "_EXTENSION", None)
    monkeypatch.setattr(cb, "_BUILD_ERROR", None)
    monkeypatch.setattr(cb, "_WARNED", False)


@pytest.fixture(scope="module")
def built_library():
    """The library of a complete build (built here if needed), which leaves its marker."""
    library = Path(cb.load_extension().__file__)
    assert cb.complete_library(library.parent, library.stem) == library
    return library


_CHILD = r"""
import fcntl, json, os, sys
from pathlib import Path
import torch
import torch.utils.cpp_extension as cpp_extension

build_dir = Path(os.environ["ASTRAI_KERNELS_BUILD_DIR"]).resolve()
if os.environ["SIMULATE_READ_ONLY"] == "1":  # root: the permission bits deny nothing
    real_access = os.access
    def access(target, mode, *args, **kwargs):
        if mode & os.W_OK and Path(target).resolve().is_relative_to(build_dir):
            return False
        return real_access(target, mode, *args, **kwargs)
    os.access = access

def refuse(*args, **kwargs):
    raise PermissionError(13, "the test forbids locking or building here")
fcntl.flock = refuse
cpp_extension.load = refuse

import astrai_kernels.kernels.cpp.backend as cb
from astrai_kernels.kernels.registry import resolve_backend
from astrai_kernels.kernels import portable as torch_backend
from astrai_kernels.kernels.primitives import LogprobsArgs

reason = cb.unavailable_reason("cpu")
gen = torch.Generator().manual_seed(0)
logits = torch.randn(1, 6, 37, generator=gen, dtype=torch.float64).float()
target = torch.randint(0, 37, (6,), generator=gen)
got = cb.logprobs_forward(logits, target, LogprobsArgs(0.7, -100, True))
want = torch_backend.logprobs_forward(logits, target, LogprobsArgs(0.7, -100, True))
print(json.dumps({
    "reason": reason,
    "auto": resolve_backend("auto", "cpu"),
    "library": cb.load_extension().__file__,
    "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
}))
"""


def test_read_only_copy_of_a_complete_build_loads_without_lock(built_library, tmp_path):
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(built_library.parent, prebuilt)
    _make_read_only(prebuilt)
    try:
        simulate = not _writes_denied(prebuilt)
        before = _snapshot(prebuilt)
        env = subprocess_env(ASTRAI_KERNELS_BUILD_DIR=str(prebuilt),
                             SIMULATE_READ_ONLY="1" if simulate else "0", OMP_NUM_THREADS="1")
        env.pop("ASTRAI_KERNELS_BACKEND", None)
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        after = _snapshot(prebuilt)
    finally:
        _make_writable(prebuilt)
    assert result["reason"] is None
    assert result["auto"] == "cpp"
    assert Path(result["library"]).resolve() == (prebuilt / built_library.name).resolve()
    assert result["max_diff"] < 1e-5
    assert after == before  # nothing written: no lock file, no ninja file, no rebuild


def test_empty_read_only_directory_gives_the_real_reason(tmp_path, monkeypatch, read_only_dir,
                                                         fresh_loader):
    build_dir = tmp_path / "image-cache"
    build_dir.mkdir()
    read_only_dir(build_dir)
    monkeypatch.setenv(cb.BUILD_DIR_ENV, str(build_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = cb.unavailable_reason("cpu")
        assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="read-only") as first:
        cb.load_extension()
    with pytest.raises(RuntimeError) as second:  # kept, not retried
        cb.load_extension()
    with pytest.raises(RuntimeError, match="cannot serve tensors on cpu.*read-only"):
        resolve_backend("cpp", "cpu")
    assert reason.startswith(f"the cpp backend cannot be used: build directory {build_dir} "
                             "is read-only and it holds no complete build")
    assert cb.BUILD_DIR_ENV in reason and "compiler output" not in reason
    assert str(first.value) == str(second.value) == reason
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and reason in messages[0] and "'torch' backend" in messages[0]
    assert list(build_dir.iterdir()) == []


@pytest.mark.parametrize("error, cause", [
    (PermissionError(errno.EACCES, "Permission denied"), "cannot be written"),
    (OSError(errno.EROFS, "Read-only file system"), "is on a read-only file system"),
], ids=["acl", "read-only-mount"])
def test_lock_refused_by_the_file_system_gives_the_real_reason(tmp_path, monkeypatch,
                                                               fresh_loader, error, cause):
    """Permission bits that allow writing, but a mount or ACL that does not."""
    build_dir = tmp_path / "mounted"
    build_dir.mkdir()

    def refused_lock(path):
        raise error

    monkeypatch.setattr(cb, "process_lock", refused_lock)
    monkeypatch.setenv(cb.BUILD_DIR_ENV, str(build_dir))
    with pytest.raises(RuntimeError) as caught:
        cb.load_extension()
    message = str(caught.value)
    assert f"build directory {build_dir} {cause}" in message
    assert "holds no complete build" in message and "compiler output" not in message


def test_damaged_library_in_a_read_only_directory_is_not_loaded(built_library, tmp_path,
                                                                read_only_dir, fresh_loader,
                                                                monkeypatch):
    copy = tmp_path / "damaged"
    shutil.copytree(built_library.parent, copy)
    with open(copy / built_library.name, "r+b") as handle:  # a link cut short
        handle.truncate(built_library.stat().st_size // 2)
    read_only_dir(copy)
    monkeypatch.setenv(cb.BUILD_DIR_ENV, str(copy))
    with pytest.raises(RuntimeError, match="holds no complete build"):
        cb.load_extension()


def test_build_leaves_a_marker_matching_the_library(built_library):
    marker = built_library.with_suffix(".complete")
    assert marker.read_text().strip() == hashlib.sha256(built_library.read_bytes()).hexdigest()
