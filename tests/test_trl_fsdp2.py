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
``fully_shard``s the policy at ``train()`` (its decoder layers, its input embedding, its final
norm and LM head together as one group with ``reshard_after_forward=False``, and the root), TRL's
``prepare_fsdp`` the reference model (the root alone) when the trainer is built. Outside the
forward each LM head weight is a ``Shard(0)`` DTensor, except the policy's between its forward
(the final norm's gathers it) and its backward: a layout the caller chooses can reshard it after
the forward (the ``gkd_caller_sharded`` case), which is why the served losses read the trained
head inside the forward.

Cases (each trains 2 SGD steps; the single-process runs use TRL's own loss on the same models,
in float64 (the expected values) and float32 (the yardstick, as in test_integration_trl.py)):

* SFT, installed: TRL's fused-head calls run ``ak.linear_token_logprobs`` inside the forward.
* GRPO with ``fused_loss=True`` (and ``beta > 0``: the reference model, FSDP2 already at
  ``install``, is served too): the loss runs inside the policy's forward (``astrai_loss``).
* GKD (Llama student, Qwen2 teacher, ``lmbda=0``): the loss runs inside the student's forward
  (``astrai_loss``); the teacher, which accelerate prepares with ``evaluation_mode=True`` and so
  leaves unsharded, gives its hidden states and its plain head. Twice: the student sharded by
  accelerate, and by the caller (``fully_shard`` of each layer and the root with
  ``reshard_after_forward=True``, which accelerate keeps), whose head is a DTensor again as
  soon as the forward returns.
* Distillation (Gemma 2 student with its soft-cap, Qwen2 teacher with tied embeddings, JSD at
  T = 0.7): TRL's ``_compute_loss`` runs inside the student's forward (its own
  ``_forward_redirection``); the teacher is ``fully_shard``ed by the caller (here the test), so
  its head is a ``Shard(0)`` DTensor at the loss and is gathered (``contract.teacher_head``).
  The float64 run computes TRL's loss with ``reference.py`` (TRL's kernel works in float32).
* ServerDistillation (Cohere student, logit scale; top-1 JSD at T = 0.8; the vLLM teacher
  answered in-process by a Qwen2 model, as in test_integration_trl_server_distillation.py): the
  loss runs inside the student's forward (``_forward_redirection``), the head read there.

Completions are a fixed function of the prompt and its repeat (no sampling), so both layouts
train on the same tokens. Two of TRL's losses equal the whole batch's on two ranks only when each
rank counts as many labelled positions: ServerDistillation's is a ``batchmean`` per rank, and
GKD's divides by ``num_items_in_batch`` but, unlike ``Trainer.compute_loss``, does not multiply
by the process count, so with transformers' default ``average_tokens_across_devices=True`` (a
global count) TRL's GKD trains with its gradient divided by the world size on any data-parallel
layout. Those cases get completions of one length, and GKD ``average_tokens_across_devices=False``
(each rank's own count), so that one process on the whole batch is the expected run.
The logged loss and metrics of rank 0 (TRL's global means) and every parameter after the two
steps (``full_tensor()``) pass the per-element tolerance model against the float64 run.
"""

import collections
import functools
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
    _prompt_data,
    _tokenizer,
    _yardstick,
)
from test_integration_trl_distillation import _reference_divergence_loss  # noqa: E402
from test_integration_trl_server_distillation import _local_teacher_server  # noqa: E402

import astrai_kernels as ak  # noqa: E402
from astrai_kernels.integrations import trl as ak_trl  # noqa: E402
from astrai_kernels.integrations.trl import contract  # noqa: E402
from astrai_kernels.testing import compare_elementwise, compare_model_gradient  # noqa: E402
from astrai_kernels.testing.multiprocess import (  # noqa: E402
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)

WORLD_SIZE = 2
#: per case: (install keywords, global batch: one process's per-device batch)
CASES = {"sft": ({}, 2), "grpo": ({"fused_loss": True}, 4), "gkd": ({}, 2),
         "gkd_caller_sharded": ({}, 2), "distillation": ({}, 2),
         "server_distillation": ({}, 2)}
#: the model kinds the cases load (test_integration_trl._model_dir), saved once by the parent
MODEL_KINDS = ("llama", "qwen2", "gemma2", "cohere")
#: the loss ops counted (installed, each runs once per step where its case computes its loss)
COUNTED_OPS = ("linear_token_logprobs", "linear_grpo_loss", "linear_distill_loss",
               "linear_topk_distill_loss")
SERVER_CONFIG = dict(teacher_model_server_url="http://local-teacher:8000", beta=0.4,
                     loss_top_k=1, loss_add_tail=False, temperature=0.8)


def _fixed_completion(ids, repeat, length=None):
    """A completion drawn from no RNG: a function of the prompt ``ids``, its ``repeat`` within
    the group and the ``length`` (else 2 to 5 tokens); no EOS."""
    seed = 7 * sum(ids) + 13 * repeat
    return [3 + seed * (j + 3) % 27 for j in range(length or 2 + seed % 4)]


def _fixed_completions_trainer(base, length=None):
    """``base`` (GRPO, Distillation or ServerDistillation) whose completions are
    :func:`_fixed_completion`: the same tokens in one process and on two ranks."""
    import trl

    if issubclass(base, trl.GRPOTrainer):
        def generate(self, prompt_ids, images, multimodal_fields, num_generations,
                     has_tool_images=False):
            repeats = collections.Counter()
            completions = []
            for ids in prompt_ids:
                completions.append(_fixed_completion(ids, repeats[tuple(ids)], length))
                repeats[tuple(ids)] += 1
            return completions, None
    else:  # distillation is n = 1 and returns the completions alone
        def generate(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
            return [_fixed_completion(ids, 0, length) for ids in prompt_ids]

    return type(f"FixedCompletions{base.__name__}", (base,), {"_generate_single_turn": generate})


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


def _load(model_dirs, kind, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=dtype)


def _trainer_parts(name, model_dirs, dtype, fsdp):
    """``(trainer class, config class, config kwargs, student path, trainer kwargs)``."""
    import trl

    if name in ("sft", "grpo", "gkd", "gkd_caller_sharded"):
        cls, config_cls, config_kwargs, trainer_kwargs = _case(name.split("_")[0])
        student = model_dirs["llama"]
        if name == "grpo":
            cls = _fixed_completions_trainer(cls)
        if name == "gkd_caller_sharded":  # module docstring: the head resharded after forward
            student = _load(model_dirs, "llama", dtype)
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                for layer in student.model.layers:
                    fully_shard(layer, reshard_after_forward=True)
                fully_shard(student, reshard_after_forward=True)
        if name.startswith("gkd"):  # module docstring: one label count per sample, per rank
            from datasets import Dataset

            conversations = [[{"role": "user", "content": f"say {c}"},
                              {"role": "assistant", "content": f" {c * 3}"}] for c in "abcd"]
            config_kwargs = dict(config_kwargs, average_tokens_across_devices=False)
            trainer_kwargs = dict(train_dataset=Dataset.from_dict({"messages": conversations}),
                                  teacher_model=_load(model_dirs, "qwen2", dtype))
        return cls, config_cls, config_kwargs, student, trainer_kwargs
    config_kwargs = dict(max_completion_length=5)
    if name == "distillation":
        teacher = _load(model_dirs, "qwen2", dtype)
        if fsdp:  # as a caller shards a large teacher; accelerate leaves it as it is
            from torch.distributed.fsdp import fully_shard

            fully_shard(teacher, reshard_after_forward=True)
        return (_fixed_completions_trainer(trl.DistillationTrainer), trl.DistillationConfig,
                dict(config_kwargs, beta=0.3, temperature=0.7), model_dirs["gemma2"],
                dict(train_dataset=_prompt_data(), teacher_model=teacher))
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )

    return (_fixed_completions_trainer(ServerDistillationTrainer, length=4),
            ServerDistillationConfig, dict(config_kwargs, **SERVER_CONFIG),
            model_dirs["cohere"], dict(train_dataset=_prompt_data()))


def _build(name, model_dirs, output_dir, dtype, world_size, fsdp):
    """The case's trainer, seeded as test_integration_trl's; ServerDistillation's built with
    its vLLM client answered by a local Qwen2 teacher."""
    from trl.generation import vllm_client

    cls, config_cls, config_kwargs, student, trainer_kwargs = _trainer_parts(
        name, model_dirs, dtype, fsdp)
    config_kwargs = {**COMMON_ARGS, **config_kwargs,
                     "per_device_train_batch_size": CASES[name][1] // world_size}
    if fsdp:
        config_kwargs.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    args = config_cls(output_dir=output_dir, **config_kwargs,
                      model_init_kwargs={"dtype": dtype} if isinstance(student, str) else None)
    client = vllm_client.VLLMClient
    if name == "server_distillation":
        vllm_client.VLLMClient = _local_teacher_server(_load(model_dirs, "qwen2",
                                                             torch.float32).eval())
    try:
        torch.manual_seed(0)
        return cls(model=student, args=args, processing_class=_tokenizer(), **trainer_kwargs)
    finally:
        vllm_client.VLLMClient = client


def _train(name, model_dirs, output_dir, dtype, world_size, installed, fsdp):
    """Two steps; ``(logs with a loss, {name: full parameter}, loss calls, trainer)``: calls of
    our ops, of TRL's losses (``trl``) and of ``contract.teacher_head`` on a DTensor head
    (``teacher gathers``). The float64 run of Distillation computes TRL's loss with
    ``reference.py``."""
    from trl.experimental.gkd import GKDTrainer
    from trl.experimental.server_distillation import server_distillation_trainer as trl_server
    from trl.trainer import distillation_trainer as trl_distillation
    from trl.trainer import utils as trl_utils

    calls = collections.Counter()

    def counted(key, function):
        @functools.wraps(function)  # install reads TRL's loss function's signature
        def call(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)
        return call

    gather, trl_function = contract.teacher_head, trl_utils._ChunkedLogProbFunction

    def teacher_head(weight, bias):
        calls["teacher gathers"] += contract.sharded(weight)
        return gather(weight, bias)

    class CountedTRLFunction:
        @staticmethod
        def apply(*args):
            calls["trl"] += 1
            return trl_function.apply(*args)

    divergence = (_reference_divergence_loss if dtype == torch.float64
                  else trl_distillation._chunked_divergence_loss)
    with pytest.MonkeyPatch.context() as patches:
        for op in COUNTED_OPS:
            patches.setattr(ak, op, counted(op, getattr(ak, op)))
        patches.setattr(contract, "teacher_head", teacher_head)
        patches.setattr(trl_utils, "_ChunkedLogProbFunction", CountedTRLFunction)
        patches.setattr(trl_distillation, "_chunked_divergence_loss", counted("trl", divergence))
        patches.setattr(trl_server, "_jsd_divergence", counted("trl", trl_server._jsd_divergence))
        patches.setattr(GKDTrainer, "generalized_jsd_loss",
                        staticmethod(counted("trl", GKDTrainer.generalized_jsd_loss)))
        trainer = _build(name, model_dirs, output_dir, dtype, world_size, fsdp)
        if name.startswith("gkd"):  # the student's head as its forward leaves it
            trainer.model.register_forward_hook(lambda module, args, output: calls.update(
                {"head sharded after forward": contract.sharded(
                    module.get_output_embeddings().weight)}))
        if installed:
            ak_trl.install(trainer, chunk_size=8, **CASES[name][0])
        torch.manual_seed(1)
        initial = _parameters(trainer.model)
        trainer.train()
    # what the steps changed, in float64 (exact for float32 values): the model row of the
    # tolerance table scales by the largest change, not by the parameters themselves
    updates = {key: value - initial[key] for key, value in _parameters(trainer.model).items()}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, updates, dict(calls), trainer


def _parameters(model):
    return {key: (p.full_tensor() if contract.sharded(p) else p).detach().double()
            for key, p in model.named_parameters()}


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


def _worker(rank, world_size, model_dirs, workdir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")  # read by accelerate; the group already exists
    _fsdp_on_cpu()
    results = {}
    for name in CASES:
        logs, updates, calls, trainer = _train(name, model_dirs, os.path.join(workdir, name),
                                              torch.float32, world_size, True, fsdp=True)
        teacher = getattr(trainer, "teacher_model", None)
        results[name] = dict(
            calls=calls, fsdp2=bool(trainer.accelerator.is_fsdp2),
            sharded=contract.sharded(trainer.model.get_output_embeddings().weight),
            teacher_sharded=(None if teacher is None
                             else contract.sharded(teacher.get_output_embeddings().weight)))
        if rank == 0:
            torch.save(dict(logs=logs, updates=updates), os.path.join(workdir, f"{name}.pt"))
    results["separately sharded head"] = case_outcome(_refuses_a_separately_sharded_head,
                                                      model_dirs["llama"])
    return results


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trl-fsdp2"))
    model_dirs = {kind: _model_dir(kind) for kind in MODEL_KINDS}
    outcomes = spawn_ranks(_worker, WORLD_SIZE, (model_dirs, workdir), timeout=300.0)
    return workdir, model_dirs, outcomes


#: per case, the calls each rank makes in its 2 steps (teacher gathers: of a DTensor head)
EXPECTED_CALLS = {
    "sft": {},
    "grpo": {"linear_grpo_loss": 2},
    "gkd": {"linear_distill_loss": 2, "teacher gathers": 0, "head sharded after forward": 0},
    "gkd_caller_sharded": {"linear_distill_loss": 2, "teacher gathers": 0,
                           "head sharded after forward": 2},
    "distillation": {"linear_distill_loss": 2, "linear_token_logprobs": 2,
                     "teacher gathers": 2},
    "server_distillation": {"linear_topk_distill_loss": 2},
}
#: per case, whether the teacher's head is a DTensor outside its forward (None: no teacher)
TEACHER_SHARDED = {"gkd": False, "gkd_caller_sharded": False, "distillation": True}


def _log_vector(log, keys):
    return torch.tensor([float(log[key]) for key in keys], dtype=torch.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_under_fsdp2_matches_one_process(name, fsdp2_runs, tmp_path):
    workdir, model_dirs, outcomes = fsdp2_runs
    for rank, outcome in enumerate(outcomes):
        result, calls = outcome[name], collections.Counter(outcome[name]["calls"])
        # under FSDP2, the LM head a DTensor outside the forward, and every loss ours
        assert result["fsdp2"] and result["sharded"], (rank, result)
        assert result["teacher_sharded"] == TEACHER_SHARDED.get(name), (rank, result)
        assert calls["trl"] == 0, (rank, calls)
        for key, count in EXPECTED_CALLS[name].items():
            assert calls[key] == count, (rank, key, calls)
        if name in ("sft", "grpo"):  # TRL's head calls (GRPO: the reference's too, beta > 0)
            assert calls["linear_token_logprobs"] > 0, (rank, calls)
    got = torch.load(os.path.join(workdir, f"{name}.pt"))
    expected_logs, expected, expected_calls, _ = _train(
        name, model_dirs, str(tmp_path / "fp64"), torch.float64, 1, False, fsdp=False)
    naive_logs, naive, naive_calls, _ = _train(name, model_dirs, str(tmp_path / "fp32"),
                                               torch.float32, 1, False, fsdp=False)
    # TRL's own loss computed the single-process runs
    assert expected_calls.get("trl", 0) > 0 and naive_calls.get("trl", 0) > 0
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
    assert set(got["updates"]) == set(expected)
    for key, want in expected.items():
        result = compare_model_gradient(got["updates"][key], want, naive[key],
                                        dtype=torch.float32, name=f"{key}'s change in 2 steps")
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
