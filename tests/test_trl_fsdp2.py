"""``integrations.trl.install`` on TRL trainers under accelerate's FSDP2 (``fsdp_version: 2``),
2 gloo CPU ranks, against one process on the whole batch.

accelerate 1.16 never turns FSDP on for CPU processes: ``AcceleratorState.__init__``
(accelerate/state.py, the ``elif self.distributed_type in [DistributedType.MULTI_GPU, ...]``
branch that sets ``DistributedType.FSDP``) lists no ``MULTI_CPU``, so ``fsdp="full_shard"`` with
``fsdp_config={"fsdp_version": 2}`` and ``use_cpu=True`` trains under DDP with
``trainer.is_fsdp_enabled`` False (and without ``use_cpu`` transformers raises "Using fsdp only
works in distributed training."). The ranks here take that branch themselves
(:func:`_fsdp_on_cpu`: the state TRL and transformers then read is accelerate's FSDP2 one); from
there on everything is accelerate's, TRL's and torch's own code: ``fsdp2_prepare_model``
``fully_shard``s the policy's decoder layers and root at ``train()``, TRL's ``prepare_fsdp`` the
reference model when the trainer is built, and each LM head weight is a ``Shard(0)`` DTensor
outside its model's forward.

Cases (each trains 2 SGD steps; the single-process runs use TRL's own head on the same model,
in float64 (the expected values) and float32 (the yardstick, as in test_integration_trl.py)):

* SFT, installed: TRL's fused-head calls run ``ak.linear_token_logprobs`` inside the forward.
* GRPO with ``fused_loss=True`` (and ``beta > 0``: the reference model, FSDP2 already at
  ``install``, is served too): the loss runs inside the policy's forward (``astrai_loss``).
  Completions are a fixed function of the prompt and its repeat (no sampling), so both layouts
  train on the same tokens.

The logged loss and metrics of rank 0 (TRL's global means) and every parameter after the two
steps (``full_tensor()``) pass the per-element tolerance model against the float64 run.
"""

import collections
import os
import types

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]'); "
                                  "`make test` installs it")

from test_integration_trl import (  # noqa: E402
    _UNCOMPARED,
    COMMON_ARGS,
    _case,
    _model_dir,
    _tokenizer,
    _yardstick,
)

import astrai_kernels as ak  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.integrations.trl import contract  # noqa: E402
from astrai_kernels.testing import compare_elementwise  # noqa: E402
from astrai_kernels.testing.multiprocess import (  # noqa: E402
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)

WORLD_SIZE = 2
#: per case: (install keywords, global batch: one process's per-device batch)
CASES = {"sft": ({}, 2), "grpo": ({"fused_loss": True}, 4)}


def _fixed_completions_trainer():
    import trl

    class FixedCompletionsGRPOTrainer(trl.GRPOTrainer):
        """GRPO whose completions are a function of the prompt and of its repeat within the
        group, drawn from no RNG: the same tokens in one process and on two ranks."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            repeats = collections.Counter()
            completions = []
            for ids in prompt_ids:
                repeat = repeats[tuple(ids)]
                repeats[tuple(ids)] += 1
                seed = 7 * sum(ids) + 13 * repeat
                completions.append([3 + seed * (j + 3) % 27 for j in range(2 + seed % 4)])
            return completions, None

    return FixedCompletionsGRPOTrainer


def _fsdp_on_cpu():
    """accelerate's FSDP branch for CPU processes given an FSDP plugin (module docstring)."""
    from accelerate import state
    from accelerate.utils import DistributedType

    accelerate_init = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        accelerate_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.AcceleratorState.__init__ = init


def _train(name, model_path, output_dir, dtype, world_size, installed, fsdp):
    """Two steps; ``(logs with a loss, {name: full parameter}, head calls, trainer)``."""
    from trl.trainer import utils as trl_utils

    cls, config_cls, config_kwargs, trainer_kwargs = _case(name)
    if name == "grpo":
        cls = _fixed_completions_trainer()
    install_kwargs, batch = CASES[name]
    config_kwargs = {**COMMON_ARGS, **config_kwargs,
                     "per_device_train_batch_size": batch // world_size}
    if fsdp:
        config_kwargs.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    args = config_cls(output_dir=output_dir, model_init_kwargs={"dtype": dtype}, **config_kwargs)
    calls = collections.Counter()
    counted = {"linear_token_logprobs": ak, "linear_grpo_loss": ak}
    originals = {op: getattr(ak, op) for op in counted}
    trl_function = trl_utils._ChunkedLogProbFunction

    def counter(op):
        def call(*args, **kwargs):
            calls[op] += 1
            return originals[op](*args, **kwargs)
        return call

    class CountedTRLFunction:
        @staticmethod
        def apply(*args):
            calls["trl"] += 1
            return trl_function.apply(*args)

    try:
        for op in counted:
            setattr(ak, op, counter(op))
        trl_utils._ChunkedLogProbFunction = CountedTRLFunction
        torch.manual_seed(0)
        trainer = cls(model=model_path, args=args, processing_class=_tokenizer(),
                      **trainer_kwargs)
        if installed:
            ak_trl.install(trainer, chunk_size=8, **install_kwargs)
        torch.manual_seed(1)
        trainer.train()
    finally:
        for op, original in originals.items():
            setattr(ak, op, original)
        trl_utils._ChunkedLogProbFunction = trl_function
    params = {key: (p.full_tensor() if contract.sharded(p) else p).detach().clone()
              for key, p in trainer.model.named_parameters()}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, params, dict(calls), trainer


def _refuses_a_separately_sharded_head(model_path):
    """``fully_shard(model.lm_head)`` gathers the weight only in the lm_head's own forward,
    which the fused head never calls: refused at install's check."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    fully_shard(model.lm_head)
    fully_shard(model)
    with pytest.raises(ak_trl.TRLHeadError, match="does not gather"):
        contract.check_head_weight(types.SimpleNamespace(), "policy", model)


def _worker(rank, world_size, model_path, workdir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")  # read by accelerate; the group already exists
    _fsdp_on_cpu()
    results = {}
    for name in CASES:
        logs, params, calls, trainer = _train(name, model_path, os.path.join(workdir, name),
                                              torch.float32, world_size, True, fsdp=True)
        results[name] = dict(
            calls=calls, fsdp2=bool(trainer.accelerator.is_fsdp2),
            sharded=contract.sharded(trainer.model.get_output_embeddings().weight))
        if rank == 0:
            torch.save(dict(logs=logs, params=params), os.path.join(workdir, f"{name}.pt"))
    results["separately sharded head"] = case_outcome(_refuses_a_separately_sharded_head,
                                                      model_path)
    return results


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trl-fsdp2"))
    model_path = _model_dir("llama")
    outcomes = spawn_ranks(_worker, WORLD_SIZE, (model_path, workdir), timeout=240.0)
    return workdir, model_path, outcomes


def _log_vector(log, keys):
    return torch.tensor([float(log[key]) for key in keys], dtype=torch.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_under_fsdp2_matches_one_process(name, fsdp2_runs, tmp_path):
    workdir, model_path, outcomes = fsdp2_runs
    for rank, outcome in enumerate(outcomes):
        result = outcome[name]
        # under FSDP2, the LM head a DTensor outside the forward, and every head call ours
        assert result["fsdp2"] and result["sharded"], (rank, result)
        assert result["calls"].get("trl", 0) == 0, (rank, result["calls"])
        if name == "grpo":  # one loss per step; the reference's head served too (beta > 0)
            assert result["calls"]["linear_grpo_loss"] == 2, (rank, result["calls"])
        assert result["calls"]["linear_token_logprobs"] > 0, (rank, result["calls"])
    got = torch.load(os.path.join(workdir, f"{name}.pt"))
    expected_logs, expected, _, _ = _train(name, model_path, str(tmp_path / "fp64"),
                                           torch.float64, 1, False, fsdp=False)
    naive_logs, naive, _, _ = _train(name, model_path, str(tmp_path / "fp32"), torch.float32, 1,
                                     False, fsdp=False)
    failed = []
    assert len(got["logs"]) == len(expected_logs) == 2
    for step, (log, want, base) in enumerate(zip(got["logs"], expected_logs, naive_logs)):
        keys = sorted(key for key in want if isinstance(want[key], (int, float))
                      and not any(word in key for word in _UNCOMPARED))
        assert set(keys) <= set(log), set(keys) - set(log)
        result = compare_elementwise(_log_vector(log, keys), _log_vector(want, keys),
                                     _yardstick(_log_vector(base, keys), _log_vector(want, keys)),
                                     dtype=torch.float32, name=f"step {step} logs {keys}")
        failed += [] if result.ok else [result.message()]
    assert set(got["params"]) == set(expected)
    for key, want in expected.items():
        result = compare_elementwise(got["params"][key], want, _yardstick(naive[key], want),
                                     dtype=torch.float32, name=f"{key} after 2 steps")
        failed += [] if result.ok else [result.message()]
    assert not failed, "\n".join(failed[:5])


def test_separately_sharded_head_refused(fsdp2_runs):
    assert_ranks_passed(fsdp2_runs[2], "separately sharded head")


def test_fsdp1_and_deepspeed_refused():
    def trainer(fsdp_version=None, deepspeed=False):
        plugin = types.SimpleNamespace(fsdp_version=fsdp_version)
        return types.SimpleNamespace(
            is_fsdp_enabled=fsdp_version is not None, is_deepspeed_enabled=deepspeed,
            accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.raises(ak_trl.TRLHeadError, match="FSDP1.*fsdp_version: 2"):
        contract.check_trl(trainer(fsdp_version=1))
    with pytest.raises(ak_trl.TRLHeadError, match="DeepSpeed"):
        contract.check_trl(trainer(deepspeed=True))
    contract.check_trl(trainer(fsdp_version=2))
