"""Run a function on N CPU processes joined in a gloo process group, for the distributed tests.

``spawn_ranks(worker, world_size, args)`` starts ``world_size`` fresh interpreters
(``torch.multiprocessing.spawn``), joins them in a gloo group through a file rendezvous in a
temporary directory (no port to pick, so no race for one), calls ``worker(rank, world_size,
*args)`` on each and returns the JSON-serializable results in rank order. A rank that raises
fails the call with its traceback; a rank still running after ``timeout`` seconds (a collective
left waiting) prints its stack and exits, and ``TimeoutError`` is raised. ``worker`` must be
importable by name (a module-level function).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, workdir: str, worker: Callable, args: Sequence,
           timeout: float) -> None:
    # a rank still running near the deadline prints where it waits, then exits
    faulthandler.dump_traceback_later(max(1.0, timeout - 5.0), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size)
    try:
        result = worker(rank, world_size, *args)
        with open(os.path.join(workdir, f"rank{rank}.json"), "w") as out:
            json.dump(result, out)
    finally:
        dist.destroy_process_group()
    # The rank's work is done and written. Leave without the interpreter's teardown: there a
    # gloo thread still joinable now and then aborts the process ("terminate called without an
    # active exception", seen in 2 of about 6 whole-suite runs on torch 2.11 and 2.13), which
    # would fail a run whose results are complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Callable, world_size: int, args: Sequence = (),
                timeout: float = 180.0) -> List[Any]:
    """``[worker(r, world_size, *args) for r in ranks]`` computed in ``world_size`` processes."""
    with tempfile.TemporaryDirectory(prefix="astrai-ranks-") as workdir:
        context = mp.spawn(_entry, args=(world_size, workdir, worker, tuple(args), timeout),
                           nprocs=world_size, join=False)
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline + 10.0:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f} s "
                                   f"(a collective waiting for a rank that left?)")
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"rank{rank}.json")) as result:
                results.append(json.load(result))
        return results
