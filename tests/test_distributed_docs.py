"""Every recipe of docs/distributed.md (its ```py blocks) runs as shown, on gloo CPU ranks.

Each block is a ``torchrun`` script whose first line gives its launch (``--nproc-per-node``,
``--nnodes``); it ends by checking its result against the same computation in one process
(``astrai_kernels.testing.assert_close`` against float64), so a recipe that runs but computes
the wrong thing fails here. The recipes of one world size run in one ``spawn_ranks`` call (one
start-up of the interpreters for all of them), each with the variables torchrun would set
(``astrai_kernels/testing/doc_recipes.py``). The multi-node recipe also runs for real: two
``torchrun`` agents on 127.0.0.1 standing in for two nodes, as the page shows.
"""

import importlib.util
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

from astrai_kernels.testing.doc_recipes import free_ports, recipes, run_recipes
from astrai_kernels.testing.multiprocess import spawn_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "distributed.md"
RECIPES = recipes(DOC.read_text())
# what the page promises a recipe for, by heading
REQUIRED = ("Data parallel", "Vocabulary parallel", "DTensor", "FSDP2",
            "Tensor parallel in a transformers model", "FSDP2 x tensor parallel",
            "Sequence parallel", "Packed batches", "Many nodes")


def test_every_required_recipe_is_shown():
    titles = [recipe.title for recipe in RECIPES]
    assert len(set(titles)) == len(titles), f"two recipes under one heading: {titles}"
    missing = [name for name in REQUIRED if not any(t.startswith(name) for t in titles)]
    assert not missing, f"docs/distributed.md has no recipe under {missing}; it has {titles}"


SPAWNED = {}


def _missing_extra(recipe):
    """The optional package a recipe imports that is not installed here, else None."""
    for name in re.findall(r"^(?:from|import) (\w+)", recipe.source, re.M):
        if name == "transformers" and importlib.util.find_spec(name) is None:
            return name
    return None


def _outcomes(world_size):
    """Per recipe of this world size, its per-rank outcomes, from one spawn (a spawn that
    failed is not retried: each of its recipes' tests reports that failure)."""
    if world_size not in SPAWNED:
        chosen = [r for r in RECIPES if r.world_size == world_size and not _missing_extra(r)]
        try:
            per_rank = spawn_ranks(run_recipes, world_size,
                                   ([(r.source, r.per_node) for r in chosen], str(DOC)),
                                   timeout=240.0)
            SPAWNED[world_size] = {recipe.title: [outcome[index] for outcome in per_rank]
                                   for index, recipe in enumerate(chosen)}
        except Exception as error:
            SPAWNED[world_size] = error
    if isinstance(SPAWNED[world_size], Exception):
        raise SPAWNED[world_size]
    return SPAWNED[world_size]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.title for r in RECIPES])
def test_recipe_runs_and_matches_one_process(recipe):
    if _missing_extra(recipe):
        pytest.skip(f"{_missing_extra(recipe)} (an optional extra) is not installed")
    outcomes = _outcomes(recipe.world_size)[recipe.title]
    failures = [f"rank {rank}:\n{error}" for rank, error in enumerate(outcomes)
                if error is not None]
    assert not failures, "\n".join(failures)


MULTI_NODE = [r for r in RECIPES if r.nodes > 1]


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="no torchrun beside this interpreter")
@pytest.mark.parametrize("recipe", MULTI_NODE, ids=[r.title for r in MULTI_NODE])
def test_multi_node_recipe_under_two_torchrun_agents(recipe, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(recipe.source)
    (port,) = free_ports(1)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [torchrun, "--nnodes", str(recipe.nodes), "--nproc-per-node", str(recipe.per_node),
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True) for node in range(recipe.nodes)]
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:  # the agent and its workers: their own process group
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    codes = [agent.returncode for agent in agents]
    assert codes == [0] * recipe.nodes, "\n\n".join(
        f"node {node} exited {code}:\n{output[-4000:]}"
        for node, (code, output) in enumerate(zip(codes, outputs)))


def test_a_py_block_without_its_run_line_is_refused():
    page = "## Heading\n\n```py\n# torchrun --nproc_per_node 3 t.py\n# not a heading\nx = 1\n```\n"
    (recipe,) = recipes(page)
    assert (recipe.title, recipe.nodes, recipe.per_node) == ("Heading", 1, 3)
    with pytest.raises(ValueError, match="does not open with its"):
        recipes(page + "\n## Other\n\n```py\nx = 1\n```\n")
