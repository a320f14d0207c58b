"""Run a function on N CPU processes joined in a gloo process group, for the distributed tests.

``spawn_ranks(worker, world_size, args)`` starts ``world_size`` fresh interpreters, joins them
in a gloo group through a file rendezvous in a temporary directory (no port to pick, so no race
for one), calls ``worker(rank, world_size, *args)`` on each and returns the JSON-serializable
results in rank order. ``worker`` must be importable by name (a module-level function).

Teardown is the same on every rank: the result is written, every rank meets in a barrier (no
rank closes its connections while a peer still talks to it), the process group is destroyed
once, and the rank leaves with ``os._exit``. The interpreter's own teardown is skipped: there a
gloo thread still joinable now and then aborted a finished rank ("terminate called without an
active exception").

Failures are reported, never waited out: a rank that raises, or dies by a signal or an exit
code, fails the call with ``RankFailed`` carrying its traceback (faulthandler's Python stack for
a fatal signal); the ranks still running a few seconds later (waiting in a collective for the
dead rank) are killed, their stacks shown too. Ranks still running after ``timeout`` seconds
have their stacks dumped and are killed, and ``TimeoutError`` is raised. ``group_timeout``
(seconds) is the process group's own timeout for a collective (gloo's default is 30 minutes):
a test of a call that must not hang sets it short, so a rank left waiting fails soon.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_exit
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Seconds the other ranks get to finish once a rank failed: a peer blocked in a collective on
# the dead rank usually errors at once (its connection closes), one computing reaches the next.
PEER_GRACE_S = 10.0
# Seconds for a rank to write its stack after SIGUSR1, before it is killed.
STACK_DUMP_WAIT_S = 1.0


class RankFailed(RuntimeError):
    """A rank of ``spawn_ranks`` raised, or exited by a signal or a non-zero code."""


def _path(workdir: str, rank: int, kind: str) -> str:
    return os.path.join(workdir, f"rank{rank}.{kind}")


def _entry(rank: int, world_size: int, workdir: str, worker: Callable, args: Sequence,
           group_timeout: Optional[float] = None) -> None:
    # kept open until the process leaves: faulthandler writes the Python stack here on a fatal
    # signal, and on SIGUSR1 (the parent's request before it kills a hung rank)
    stacks = open(_path(workdir, rank, "stack"), "w")
    faulthandler.enable(file=stacks, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    exit_code = 0
    try:
        timeout = {} if group_timeout is None else {"timeout": timedelta(seconds=group_timeout)}
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                                world_size=world_size, **timeout)
        result = worker(rank, world_size, *args)
        partial = _path(workdir, rank, "json.partial")
        with open(partial, "w") as out:
            json.dump(result, out)
        os.replace(partial, _path(workdir, rank, "json"))
        dist.barrier()
    except BaseException:
        # taken first: a peer fails only once this rank has left, so strictly later (a file's
        # mtime is too coarse to order the two)
        failed_ns = time.time_ns()
        exit_code = 1
        with open(_path(workdir, rank, "error"), "w") as error:
            error.write(traceback.format_exc())
        with open(_path(workdir, rank, "failed_at"), "w") as failed_at:
            failed_at.write(str(failed_ns))
    finally:
        # the worker may have destroyed it already
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _read(path: str) -> str:
    try:
        with open(path) as text:
            return text.read().strip()
    except FileNotFoundError:
        return ""


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"died by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"died by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _dump_stacks_and_kill(processes, workdir: str) -> dict:
    """``{rank: its Python stacks}`` of the ranks still running, which are then killed."""
    running = {rank: process for rank, process in enumerate(processes) if process.is_alive()}
    if hasattr(signal, "SIGUSR1"):
        for process in running.values():
            os.kill(process.pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
    for process in running.values():
        process.kill()
    for process in running.values():
        process.join()
    return {rank: _read(_path(workdir, rank, "stack")) or "(no stack written)"
            for rank in running}


def _failure_time(workdir: str, rank: int) -> float:
    """When the rank raised (or faulthandler wrote its stack, on a fatal signal), else now: a
    peer failing because this rank left (its collective's connection closed) fails later, so
    the cause is reported first."""
    failed_ns = _read(_path(workdir, rank, "failed_at"))
    if failed_ns:
        return int(failed_ns) / 1e9
    path = _path(workdir, rank, "stack")
    if os.path.exists(path) and os.path.getsize(path):
        return os.stat(path).st_mtime
    return time.time()


def _wait(processes, workdir: str, deadline: float) -> Optional[List[int]]:
    """The failed ranks, first to fail first, once every rank exited or ``PEER_GRACE_S`` after
    a failure; None at ``deadline`` with ranks still running."""
    failed_at = {}
    grace_end = None
    while True:
        # one reading of the exit codes: a rank exiting between two readings would be neither
        # failed nor running
        exitcodes = [process.exitcode for process in processes]
        for rank, exitcode in enumerate(exitcodes):
            if exitcode not in (None, 0) and rank not in failed_at:
                failed_at[rank] = _failure_time(workdir, rank)
        failed = sorted(failed_at, key=failed_at.get)
        running = [process for process, exitcode in zip(processes, exitcodes)
                   if exitcode is None]
        if not running:
            return failed
        now = time.monotonic()
        if failed and grace_end is None:
            grace_end = now + PEER_GRACE_S
        if grace_end is not None and now >= grace_end:
            return failed
        if now >= deadline:
            return None
        wake = deadline if grace_end is None else min(deadline, grace_end)
        wait_for_exit([process.sentinel for process in running], timeout=wake - now)


def _failure_report(processes, failed: List[int], killed: dict, workdir: str) -> str:
    parts = []
    for rank in failed:
        how = _exit_description(processes[rank].exitcode)
        error = _read(_path(workdir, rank, "error"))
        if error:
            parts.append(f"rank {rank} raised ({how}):\n{error}")
        else:
            stack = _read(_path(workdir, rank, "stack")) or "(no Python stack written)"
            parts.append(f"rank {rank} {how}; its Python stack:\n{stack}")
    for rank, stack in killed.items():
        parts.append(f"rank {rank} was still running {PEER_GRACE_S:.0f} s after rank "
                     f"{failed[0]} failed and was killed; its stack:\n{stack}")
    return "\n\n".join(parts)


def spawn_ranks(worker: Callable, world_size: int, args: Sequence = (),
                timeout: float = 180.0, group_timeout: Optional[float] = None) -> List[Any]:
    """``[worker(r, world_size, *args) for r in ranks]`` computed in ``world_size`` processes."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if group_timeout is not None and not (isinstance(group_timeout, (int, float))
                                          and group_timeout > 0):
        raise ValueError(f"group_timeout must be None or a number of seconds > 0, got "
                         f"{group_timeout!r}")
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="astrai-ranks-") as workdir:
        processes = [context.Process(target=_entry, name=f"rank{rank}",
                                     args=(rank, world_size, workdir, worker, tuple(args),
                                           group_timeout))
                     for rank in range(world_size)]
        try:
            for process in processes:
                process.start()
            failed = _wait(processes, workdir, time.monotonic() + timeout)
            if failed is None:
                stacks = _dump_stacks_and_kill(processes, workdir)
                shown = "\n\n".join(f"rank {rank}:\n{stack}" for rank, stack in stacks.items())
                raise TimeoutError(
                    f"ranks {sorted(stacks)} of {world_size} still running after {timeout:g} s "
                    f"(a rank stuck, or a collective waiting for it), killed; where each "
                    f"was:\n{shown}")
            if failed:
                killed = _dump_stacks_and_kill(processes, workdir)
                raise RankFailed(_failure_report(processes, failed, killed, workdir))
            missing = [rank for rank in range(world_size)
                       if not os.path.exists(_path(workdir, rank, "json"))]
            if missing:
                raise RankFailed(f"ranks {missing} exited with code 0 without writing a result "
                                 f"(os._exit inside the worker?)")
            results = []
            for rank in range(world_size):
                with open(_path(workdir, rank, "json")) as result:
                    results.append(json.load(result))
            return results
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                if process.pid is not None:
                    process.join()


def case_outcome(case: Callable, *args) -> Optional[str]:
    """One case of a spawn's worker: None when ``case(*args)`` returns, else its traceback (the
    worker goes on with its other cases; the case's own test reports it)."""
    try:
        case(*args)
    except Exception:
        return traceback.format_exc()
    return None


def assert_ranks_passed(outcomes: Sequence[dict], key: str, ranks: Optional[int] = None):
    """Fail with every rank's traceback of the case ``key`` (``outcomes``: ``spawn_ranks``'s
    per-rank dicts of ``case_outcome``s; the first ``ranks`` of them when given)."""
    failures = [f"rank {rank}:\n{result[key]}"
                for rank, result in enumerate(outcomes[:ranks]) if result[key] is not None]
    assert not failures, "\n".join(failures)
