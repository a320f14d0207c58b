"""The cpp backend's compile step and the files it leaves (``backend.py`` decides when to build
and loads the result): the C++ compiler ``cpp_extension`` will use, the build's lines on stderr
(a line per object file or library ninja writes, a "still compiling" line after a quiet spell),
the compiler's output of a failed build, the ``.complete`` marker that makes a library loadable
without ninja or the lock, and the lock that serializes builds across processes."""

import contextlib
import hashlib
import os
import shlex
import shutil
import sys
import threading
import time


def compiler():
    """Path of the C++ compiler ``cpp_extension`` will use (``$CXX``, else c++ / g++), or None."""
    cxx = os.environ.get("CXX")
    if cxx:
        words = shlex.split(cxx)
        return shutil.which(words[0]) if words else None
    return shutil.which("c++") or shutil.which("g++")


class BuildFailed(RuntimeError):
    """The compiler or linker failed; the message carries their full output."""


def say(message):
    """One line on stderr about the build; stdout stays the caller's."""
    if sys.stderr is not None:  # None under pythonw
        print(f"astrai_kernels: {message}", file=sys.stderr, flush=True)


def failure_output(exc):
    """A failed build's message with the compiler's output: ninja's is in the message, but a
    compiler failing cpp_extension's ``-v`` probe leaves its own in the exception's ``output``."""
    message = str(exc)
    output = getattr(exc, "output", None)
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    if isinstance(output, str) and output.strip() and output.strip() not in message:
        message += "\n" + output.strip()
    return message


def first_error_line(text):
    """The compiler's first ``error:`` line in a failed build's output, or None."""
    return next((line.strip() for line in text.splitlines() if "error:" in line.lower()), None)


def _mtime(path):
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class BuildProgress:
    """While ninja builds, a line on stderr per output it writes (``[k/n] compiled grpo.cpp``),
    and a "still compiling" line after a quiet spell.

    It watches the build directory rather than ninja's output, which cpp_extension swallows (or
    writes to stdout with ``verbose``): the same lines then reach a terminal, a pipe or a CI log.
    An output ninja finds up to date is not rewritten and not counted.
    """

    POLL_S = 0.5
    QUIET_S = 30.0  # CI logs that stay silent for long look like a hang

    def __init__(self, build_dir, outputs, started):
        self._build_dir = build_dir
        self._outputs = outputs  # (file name, what writing it means), in build order
        self._before = {file: _mtime(build_dir / file) for file, _ in outputs}
        self._reported = set()
        self._started = started
        self._last_line = started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="astrai-kernels-build-progress",
                                        daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, traceback):
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._report_written()  # the link, when it finished between two polls

    def _watch(self):
        while not self._stop.wait(self.POLL_S):
            self._report_written()
            now = time.perf_counter()
            if now - self._last_line >= self.QUIET_S:
                self._last_line = now
                say(f"still compiling: {len(self._reported)} of {len(self._outputs)} steps "
                     f"done after {now - self._started:.0f} s")

    def _report_written(self):
        for file, what in self._outputs:
            if file in self._reported:
                continue
            mtime = _mtime(self._build_dir / file)
            if mtime is not None and mtime != self._before[file]:
                self._reported.add(file)
                self._last_line = time.perf_counter()
                say(f"[{len(self._reported)}/{len(self._outputs)}] {what} "
                     f"({self._last_line - self._started:.0f} s)")


LIB_SUFFIX = ".pyd" if sys.platform == "win32" else ".so"  # the names cpp_extension gives


COMPLETE_SUFFIX = ".complete"


def mark_complete(library):
    """Record that ``library`` is a finished build: a marker beside it holding its SHA-256."""
    marker = library.with_suffix(COMPLETE_SUFFIX)
    if complete_library(library.parent, library.stem) == library:
        return
    partial = marker.with_name(f"{marker.name}.{os.getpid()}")
    try:
        partial.write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
        os.replace(partial, marker)
    except OSError:  # the build is usable all the same; only a read-only copy needs the marker
        partial.unlink(missing_ok=True)


def complete_library(build_dir, name):
    """The library of a finished build of ``name`` in ``build_dir``, or None.

    Finished means a marker written after a successful build holds the library's SHA-256, so
    a library half-written by a killed build is never loaded.
    """
    library = build_dir / f"{name}{LIB_SUFFIX}"
    try:
        recorded = (build_dir / f"{name}{COMPLETE_SUFFIX}").read_text().strip()
        actual = hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError:
        return None
    return library if actual == recorded else None


def import_library(name, library):
    """Import the compiled extension ``library`` as module ``name`` (no build, no lock)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def process_lock(build_dir):
    """Serialize builds across processes with an OS lock (released even if a process dies).

    ``cpp_extension`` guards its build with a ``lock`` file that a killed build leaves behind,
    after which every later load waits forever; holding this lock, no other process of ours is
    building there, so such a file is stale and is removed.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on cpp_extension's own lock file
        yield
        return
    with open(build_dir / "astrai_build.lock", "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a wait of minutes deserves a word
            say(f"another process is compiling the C++ kernels in {build_dir}; waiting for it")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
