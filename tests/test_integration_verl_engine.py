"""verl 0.9.1's own FSDP engine end to end on CPU (tests/verl_cpu.py): one actor update on 1
and 2 gloo ranks, FSDP1 and FSDP2, remove-padding on and off, on our backend and verl's
``torch`` fused backend, agreeing; per-sample temperature and ``sum_pi_squared`` (both refused
by verl's fused path) through the engine on ours; FSDP2 with untied embeddings, where verl's
own fused backends fail."""

import itertools
import os

import pytest
import torch

pytest.importorskip("verl")

import verl_cpu  # noqa: E402  (registers the CPU platform before verl's engine is imported)

from astrai_kernels.testing import assert_close_elementwise  # noqa: E402
from astrai_kernels.testing.multiprocess import spawn_ranks  # noqa: E402


def _case(strategy, rmpad, backend, tie=True, per_sample_temperature=False):
    return dict(strategy=strategy, rmpad=rmpad, backend=backend, tie=tie,
                per_sample_temperature=per_sample_temperature)


MATRIX = [_case(strategy, rmpad, backend) for strategy, rmpad, backend in
          itertools.product(("fsdp", "fsdp2"), (True, False), ("astrai", "torch"))]
OURS_ONLY = [_case("fsdp2", True, "astrai", tie=False),
             _case("fsdp2", True, "astrai", per_sample_temperature=True),
             _case("fsdp", False, "astrai", per_sample_temperature=True)]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_models")
    return {tie: verl_cpu.save_tiny_qwen2(os.path.join(root, f"tie{int(tie)}"), tie)
            for tie in (True, False)}


_RUNS = {}


def _runs(world_size, model_paths):
    """Every case of ``world_size`` ranks from one spawn: ``(cases, per-rank results)``."""
    if world_size not in _RUNS:
        cases = MATRIX + (OURS_ONLY if world_size == 2 else [])
        _RUNS[world_size] = cases, spawn_ranks(verl_cpu.engine_worker, world_size,
                                               (model_paths, cases), timeout=540.0)
    return _RUNS[world_size]


def _check_values(result, naive=None):
    for name, values in result["values"].items():
        naive_values = None if naive is None else naive["values"].get(name)
        assert_close_elementwise(
            torch.tensor(values), torch.tensor(result["expected"][name], dtype=torch.float64),
            name=name, naive=None if naive_values is None else torch.tensor(naive_values))


@pytest.mark.parametrize("world_size", [1, 2])
def test_engine_step_agrees_with_verls_torch_backend(world_size, model_paths):
    cases, per_rank = _runs(world_size, model_paths)
    for rank, results in enumerate(per_rank):
        by_case = {tuple(sorted(case.items())): result for case, result in zip(cases, results)}
        for case in MATRIX:
            if case["backend"] != "astrai":
                continue
            ours = by_case[tuple(sorted(case.items()))]
            theirs = by_case[tuple(sorted({**case, "backend": "torch"}.items()))]
            where = f"rank {rank} {case}"
            assert ours["changed"] == ours["parameters"], where
            assert theirs["changed"] == theirs["parameters"], where
            assert set(ours["values"]) == {"log_probs", "entropy", "sum_pi_squared"}, where
            _check_values(ours, naive=theirs)
            # one update's loss and gradient norm: float32 values of the same terms
            loss, their_loss = torch.tensor(ours["loss"]), torch.tensor(theirs["loss"])
            assert_close_elementwise(loss, their_loss, name=f"loss {where}",
                                     scale=their_loss.abs().clamp(min=1.0))
            assert_close_elementwise(torch.tensor(ours["grad_norm"]),
                                     torch.tensor(theirs["grad_norm"]),
                                     name=f"grad_norm {where}")


def test_per_sample_temperature_sum_pi_squared_and_untied_fsdp2(model_paths):
    cases, per_rank = _runs(2, model_paths)
    for rank, results in enumerate(per_rank):
        for case, result in zip(cases, results):
            if case in OURS_ONLY:
                assert result["changed"] == result["parameters"], (rank, case)
                assert set(result["values"]) == {"log_probs", "entropy", "sum_pi_squared"}
                _check_values(result)


def test_fsdp2_ranks_get_the_one_process_values_and_gradients():
    """verl's ``apply_fsdp2`` on 2 gloo ranks, tied and untied embeddings (untied, ``lm_head``
    is sharded on its own): each rank's log-probs and entropy and every parameter's gathered
    gradient equal the one-process float64 run's within the float32 path's error. Untied,
    verl's own ``torch`` backend fails on the same model (the weight it reads was never
    gathered)."""
    per_rank = spawn_ranks(verl_cpu.fsdp2_worker, 2, ((True, False),), timeout=300.0)
    for rank, by_tie in enumerate(per_rank):
        for tie, outcomes in by_tie.items():
            where = f"rank {rank}, tie_word_embeddings={tie}"
            assert outcomes["values"] is None, f"{where}:\n{outcomes['values']}"
            assert outcomes["grads"] is None, f"{where}:\n{outcomes['grads']}"
        untied = by_tie["False"]
        assert untied["lm_head_separate"], rank
        assert "mixed torch.Tensor and DTensor" in untied["verl_torch_error"], rank
