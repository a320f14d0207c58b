"""Run the recipes of docs/distributed.md as a reader would, for ``tests/test_distributed_docs.py``.

Each ```py block there is a script for ``torchrun``: its first line says how to launch it
(``# torchrun --nproc-per-node N train.py``, plus ``--nnodes M`` for several nodes), it joins
the process group with ``dist.init_process_group("gloo")`` (``env://``: the variables torchrun
sets), and it ends by checking its result against the same computation in one process.

``run_recipes`` is a ``spawn_ranks`` worker: on each rank it sets the variables torchrun would
(a fresh ``MASTER_PORT`` per recipe; ``LOCAL_WORLD_SIZE`` from the run line, so a recipe for
two nodes of two processes runs as such on four local ranks) and executes each recipe's source
as ``__main__``, so the block's own ``init_process_group`` and ``destroy_process_group`` run as
written.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from .multiprocess import case_outcome

BLOCK = re.compile(r"```py\n(.*?)```", re.S)
FENCE = re.compile(r"```.*?```", re.S)
HEADING = re.compile(r"^#+ (.+)$|^\*\*(.+?)\*\*", re.M)
RUN_LINE = re.compile(r"#.*\btorchrun\b(.*)")


@dataclass(frozen=True)
class Recipe:
    title: str  # the nearest heading (or bold paragraph lead) above the block
    nodes: int
    per_node: int
    source: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def _flag(arguments: str, name: str, default: Optional[int]) -> int:
    # torchrun takes --nproc-per-node and --nproc_per_node alike
    match = re.search(rf"--{name.replace('-', '[-_]')}[ =](\d+)", arguments)
    if match:
        return int(match.group(1))
    if default is None:
        raise ValueError(f"the run line's arguments {arguments!r} name no --{name}")
    return default


def recipes(markdown: str) -> List[Recipe]:
    """Every ```py block of ``markdown``, each of which must open with its torchrun line."""
    found = []
    for block in BLOCK.finditer(markdown):
        source = block.group(1)
        # headings outside code: a recipe's own "# ..." comments are not headings
        above = HEADING.findall(FENCE.sub("", markdown[:block.start()]))
        title = (above[-1][0] or above[-1][1]).rstrip(".") if above else "(no heading)"
        run_line = RUN_LINE.match(source.splitlines()[0]) if source.strip() else None
        if run_line is None:
            raise ValueError(f"the ```py block under {title!r} does not open with its "
                             f"'# torchrun --nproc-per-node N ...' line: every ```py block "
                             f"here is a recipe the tests run")
        arguments = run_line.group(1)
        found.append(Recipe(title, _flag(arguments, "nnodes", 1),
                            _flag(arguments, "nproc-per-node", None), source))
    return found


def free_ports(count: int) -> List[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held together, so all distinct)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for held in sockets:
            held.bind(("127.0.0.1", 0))
        return [held.getsockname()[1] for held in sockets]
    finally:
        for held in sockets:
            held.close()


def _run_script(source: str, filename: str) -> None:
    exec(compile(source, filename, "exec"), {"__name__": "__main__"})


def run_recipes(rank: int, world_size: int, scripts: Sequence[Tuple[str, int]],
                filename: str) -> List[Optional[str]]:
    """Each ``(source, processes per node)`` recipe's outcome on this rank (None, or its
    traceback), run in order."""
    ports = free_ports(len(scripts) + 1) if rank == 0 else [None] * (len(scripts) + 1)
    dist.broadcast_object_list(ports, src=0)
    # the recipes join their own groups, as under torchrun
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size))
    outcomes = []
    for (source, per_node), port in zip(scripts, ports):
        os.environ.update(MASTER_PORT=str(port), LOCAL_RANK=str(rank % per_node),
                          LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
        outcomes.append(case_outcome(_run_script, source, filename))
        if dist.is_initialized():  # a recipe that failed before its own destroy_process_group
            dist.destroy_process_group()
    # spawn_ranks ends with a barrier on the default group
    os.environ["MASTER_PORT"] = str(ports[-1])
    dist.init_process_group("gloo")
    return outcomes
