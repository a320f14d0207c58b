"""Running each case in a process of its own, so each peak is its own.

:class:`CaseRunner` forks each case from a server that has imported torch and this package once
(``isolation="forkserver"``: about a second per case), or starts a fresh interpreter
(``"subprocess"``). ``python -m astrai_kernels.bench.runner --case '<json>'`` runs one case and
prints its result as the last stdout line, prefixed with ``@@RESULT``; ``--serve`` is the fork
server.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

from .cases import Case
from .measure import measure
from .peak import child_env

RESULT_PREFIX = "@@RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "astrai_kernels.bench.runner"


def run_case_subprocess(case, timeout=600, with_copy=True):
    """Run ``case`` in a fresh Python interpreter; its result dict (``error`` set on failure)."""
    cmd = [sys.executable, "-m", MODULE, "--case", case.to_json()]
    if not with_copy:
        cmd.append("--no-copy")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env(ROOT), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**asdict(case), "error": f"timed out after {timeout} s",
                "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result["wall_s"] = wall
            result["isolation"] = "subprocess"
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {**asdict(case), "error": f"exit status {proc.returncode}: " + "\n".join(tail),
            "wall_s": wall}


def _read_all(fd, deadline):
    """Everything written to pipe ``fd`` until EOF, or None when ``deadline`` passes first."""
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def serve():
    """The fork server: imports torch and this package once, then for each request line on
    stdin (``{"case": ..., "timeout": ..., "with_copy": ...}``) forks a process that measures the
    case, and writes its result on stdout as one ``@@RESULT`` line. The server itself runs no
    torch op (so no thread pool exists when it forks) and never initializes CUDA."""
    import signal
    import tempfile
    import traceback

    import torch

    import astrai_kernels  # noqa: F401  (preloaded for the children)

    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        case = Case.from_json(request["case"])
        start = time.perf_counter()
        if torch.cuda.is_initialized():
            result = {"error": "the fork server initialized CUDA; use isolation='subprocess'"}
        else:
            log_fd, log_path = tempfile.mkstemp(prefix="astrai-bench-", suffix=".log")
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the case process
                os.close(read_fd)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                code = 0
                try:
                    payload = json.dumps(measure(case, with_copy=request.get("with_copy", True)))
                except BaseException as exc:
                    traceback.print_exc()
                    payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
                    code = 1
                with os.fdopen(write_fd, "w") as out:
                    out.write(payload)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            os.close(write_fd)
            os.close(log_fd)
            data = _read_all(read_fd, time.monotonic() + float(request.get("timeout", 600)))
            os.close(read_fd)
            if data is None:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            with open(log_path, errors="replace") as handle:
                log = handle.read()
            os.unlink(log_path)
            if data is None:
                result = {"error": f"timed out after {request.get('timeout')} s"}
            elif not data:
                result = {"error": f"case process died (wait status {status})"}
            else:
                result = json.loads(data)
            if "error" in result:
                tail = "\n".join(log.strip().splitlines()[-12:])
                result = {**asdict(case), "error": result["error"] + ("\n" + tail if tail else "")}
        result["wall_s"] = time.perf_counter() - start
        result["isolation"] = "forkserver"
        protocol.write(RESULT_PREFIX + json.dumps(result) + "\n")
        protocol.flush()


class CaseRunner:
    """Runs each case in its own process: forked by a fork server that has already imported
    torch and this package (``isolation="forkserver"``: about a second per case instead of an
    interpreter start and the imports), or a fresh interpreter (``"subprocess"``). Either way each
    case process has its own resident-set high-water mark. Use as a context manager or call
    ``close()``."""

    def __init__(self, isolation="forkserver", timeout=600):
        if isolation not in ("forkserver", "subprocess"):
            raise ValueError(f"isolation must be 'forkserver' or 'subprocess', got {isolation!r}")
        if isolation == "forkserver" and not hasattr(os, "fork"):
            isolation = "subprocess"
        self.isolation, self.timeout, self.server = isolation, timeout, None

    def _start_server(self):
        self.server = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--serve"], env=child_env(ROOT),
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""

    def _read_line(self, deadline):
        """One line from the server (None on timeout or EOF)."""
        import select

        fd = self.server.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, case, with_copy=True):
        """The result dict of ``case`` (``error`` set when it failed)."""
        if self.isolation == "subprocess":
            return run_case_subprocess(case, self.timeout, with_copy)
        if self.server is None or self.server.poll() is not None:
            self._start_server()
        request = {"case": case.to_json(), "timeout": self.timeout, "with_copy": with_copy}
        start = time.perf_counter()
        try:
            self.server.stdin.write((json.dumps(request) + "\n").encode())
            self.server.stdin.flush()
            # The server enforces the timeout; allow for its imports on the first case.
            deadline = time.monotonic() + self.timeout + 180
            while True:
                line = self._read_line(deadline)
                if line is None or line.startswith(RESULT_PREFIX):
                    break
        except OSError as exc:
            line, why = None, f"fork server failed: {exc}"
        else:
            why = "the fork server stopped without an answer"
        if line is not None:
            return json.loads(line[len(RESULT_PREFIX):])
        self.close()
        return {**asdict(case), "error": why, "wall_s": time.perf_counter() - start}

    def close(self):
        if self.server is not None:
            if self.server.poll() is None:
                try:
                    self.server.stdin.close()
                except OSError:
                    pass
                try:
                    self.server.wait(10)
                except subprocess.TimeoutExpired:
                    self.server.kill()
                    self.server.wait()
            self.server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



def main(argv=None):
    parser = argparse.ArgumentParser(description="run one benchmark case (internal)")
    parser.add_argument("--case", help="a Case as JSON")
    parser.add_argument("--no-copy", action="store_true")
    parser.add_argument("--serve", action="store_true", help="run the fork server")
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return
    result = measure(Case.from_json(args.case), with_copy=not args.no_copy)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
