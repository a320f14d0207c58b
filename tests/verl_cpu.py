"""verl 0.9.1's FSDP engine on CPU and gloo, for tests/test_integration_verl*.py.

Importing this module registers a test-only CPU platform with verl
(``verl.plugin.platform.set_platform``), which must happen before anything imports verl's
engine modules: they read the device name at import time. What else the engine needs on CPU
(each found by trying, /work/shared/verl/cpu_engine_step.py): ``VERL_ENGINE_DEVICE=cuda`` (its
FSDP engines are registered for cuda/npu only), ``attn_implementation="sdpa"`` through the
model config's overrides (the default is flash-attention 2), and for FSDP1 torch's check that
refuses CPU parameters under ``sync_module_states=True`` patched out (gloo broadcasts CPU
tensors). ``engine_worker`` runs one actor update per case on a rank of ``spawn_ranks``.
"""

import functools
import os
import types
from contextlib import contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform  # noqa: E402

VOCAB = 256


def _cpu_device_module():
    """torch.cpu with the torch.cuda-style calls verl makes."""
    module = types.ModuleType("verl_test_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    for name, value in dict(
            current_device=lambda: "cpu", device_count=lambda: 1, is_available=lambda: True,
            set_device=lambda *a, **k: None, synchronize=lambda *a, **k: None,
            empty_cache=lambda: None, manual_seed=torch.manual_seed,
            manual_seed_all=torch.manual_seed, memory_allocated=lambda *a, **k: 0,
            memory_reserved=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
            max_memory_reserved=lambda *a, **k: 0, reset_peak_memory_stats=lambda *a, **k: None,
            mem_get_info=lambda *a, **k: (0, 0), get_rng_state=torch.get_rng_state,
            set_rng_state=torch.set_rng_state).items():
        setattr(module, name, value)
    return module


_DEVICE_MODULE = _cpu_device_module()


class PlatformTestCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "testcpu"

    @property
    def device_module(self):
        return _DEVICE_MODULE

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # an int would send `tensor.to(get_device_id())` to cuda:0

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "VERL_TEST_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


if "testcpu" not in getattr(PlatformRegistry, "_registry", {}):
    PlatformRegistry.register(platform="testcpu")(PlatformTestCPU)
set_platform(PlatformTestCPU())


def tiny_qwen2_config(tie: bool, vocab: int = VOCAB):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, tie_word_embeddings=tie,
                       architectures=["Qwen2ForCausalLM"], bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def save_tiny_qwen2(path: str, tie: bool) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(tie))
    model.save_pretrained(path)
    return path


def _batch(rank: int, per_sample_temperature: bool):
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask, create_random_mask

    size, length = 4, 16
    generator = torch.Generator().manual_seed(1 + rank)
    input_ids = torch.randint(3, VOCAB, (size, length), generator=generator)
    np.random.seed(1 + rank)  # create_random_mask draws from numpy
    attention_mask = create_random_mask(input_ids=input_ids, max_ratio_of_valid_token=0.8,
                                        max_ratio_of_left_padding=0.2,
                                        min_ratio_of_valid_token=0.6)
    half = length // 2
    tensors = {"input_ids": input_ids, "prompts": input_ids[:, :half],
               "attention_mask": attention_mask,
               "position_ids": compute_position_id_with_mask(attention_mask),
               "responses": input_ids[:, half:], "response_mask": attention_mask[:, half:]}
    meta = {}
    if per_sample_temperature:
        tensors["temperature"] = torch.linspace(0.6, 1.5, size)
    else:
        meta["temperature"] = 0.8
    return DataProto.from_single_dict(tensors, meta_info=meta), generator


def _engine(case: dict, model_path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(
        path=model_path, load_tokenizer=False, use_remove_padding=case["rmpad"],
        use_fused_kernels=True, fused_kernel_options={"impl_backend": case["backend"]},
        override_config={"attn_implementation": "sdpa"})
    engine_config = FSDPEngineConfig(
        strategy=case["strategy"], forward_only=False, fsdp_size=-1, param_offload=False,
        optimizer_offload=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2, use_torch_compile=False,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    engine_config.use_remove_padding = case["rmpad"]
    engine_config.use_fused_kernels = True
    engine = EngineRegistry.new(
        model_type="language_model", backend=case["strategy"], model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def _defaults(td, case: dict, **extra):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, use_remove_padding=case["rmpad"], use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, max_token_len_per_gpu=None,
                         use_fused_kernels=True, **extra)
    return td


def _reference_fields(model_path: str, data, temperature):
    """float64 log-probs, entropy and sum of squared probabilities ``[bsz, seqlen]`` of the
    distribution each token was drawn from (given the sequence's earlier tokens; padding 0),
    each sequence run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64,
                                                 attn_implementation="eager")
    input_ids, mask = data.batch["input_ids"], data.batch["attention_mask"].bool()
    temperature = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1)
    fields = [torch.zeros(input_ids.shape, dtype=torch.float64) for _ in range(3)]
    for row in range(input_ids.shape[0]):
        where = mask[row].nonzero().squeeze(-1)
        tokens = input_ids[row, where].unsqueeze(0)
        with torch.no_grad():
            hidden = model.model(input_ids=tokens)[0][0]
            logits = torch.nn.functional.linear(hidden, model.lm_head.weight)
        log_p = torch.log_softmax(logits[:-1] / temperature[row % temperature.numel()], -1)
        values = (log_p.gather(-1, tokens[0, 1:, None]).squeeze(-1),
                  -(log_p.exp() * log_p).sum(-1), (2 * log_p).exp().sum(-1))
        for field, value in zip(fields, values):
            field[row, where[1:]] = value
    return fields


def engine_worker(rank: int, world_size: int, model_paths: dict, cases: list):
    """Each case: one engine of verl's FSDP engine, a forward-only pass (log-probs, entropy,
    sum of squared probabilities), then one actor update with verl's ``ppo_loss``; returns per
    case the response positions' values (and their float64 reference) and the loss and
    gradient norm of the update."""
    import torch.distributed.fsdp._init_utils as fsdp_init_utils
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from astrai_kernels.integrations import verl as akv

    fsdp_init_utils._check_module_states_for_sync_module_states = lambda states: None
    akv.install()
    results = []
    for case in cases:
        model_path = model_paths[case["tie"]]
        data, generator = _batch(rank, case["per_sample_temperature"])
        engine = _engine(case, model_path)
        response_mask = data.batch["response_mask"].bool()
        half = response_mask.shape[1]
        sum_pi = case["backend"] == "astrai"
        td = _defaults(left_right_2_no_padding(data.to_tensordict()), case,
                       calculate_entropy=True, calculate_sum_pi_squared=sum_pi)
        with engine.eval_mode():
            output = engine.infer_batch(td, loss_function=None)["model_output"]
        fields = {name: no_padding_2_padding(output[name], td)[response_mask]
                  for name in ("log_probs", "entropy", *(("sum_pi_squared",) if sum_pi else ()))}
        temperature = (data.batch["temperature"] if case["per_sample_temperature"]
                       else data.meta_info["temperature"])
        expected = dict(zip(("log_probs", "entropy", "sum_pi_squared"),
                            (value[:, -half:][response_mask] for value in
                             _reference_fields(model_path, data, temperature))))

        data.batch["old_log_probs"] = no_padding_2_padding(output["log_probs"], td).detach()
        data.batch["advantages"] = torch.randn(response_mask.shape, generator=generator)
        td = _defaults(left_right_2_no_padding(data.to_tensordict()), case)
        tu.assign_non_tensor(td, global_batch_size=4 * world_size)
        actor_config = ActorConfig(strategy=case["strategy"], rollout_n=1,
                                   ppo_micro_batch_size_per_gpu=2,
                                   ppo_mini_batch_size=4 * world_size, use_dynamic_bsz=False)
        before = [p.detach().clone() for p in engine.module.parameters()]
        with engine.train_mode():
            step = engine.train_batch(td, loss_function=functools.partial(
                ppo_loss, config=actor_config))
        changed = sum(int(not torch.equal(b, p.detach()))
                      for b, p in zip(before, engine.module.parameters()))
        results.append({
            "values": {name: value.tolist() for name, value in fields.items()},
            "expected": {name: expected[name].tolist() for name in fields},
            "loss": float(step["loss"]) if not isinstance(step["loss"], list)
            else [float(x) for x in step["loss"]],
            "grad_norm": float(_scalar(step["metrics"]["grad_norm"])),
            "changed": changed, "parameters": len(before)})
        del engine
    return results


def _scalar(value):
    while isinstance(value, (list, tuple)):
        value = value[0]
    return getattr(value, "value", value)


def _head_fields(model, input_ids, temperature, how):
    """log-probs and entropy of the next tokens: ``"ours"`` through the patched forward,
    ``"logits"`` from the decoder and ``lm_head`` called as modules (the naive path)."""
    labels = torch.roll(input_ids, -1, -1)
    if how == "ours":
        output = model(input_ids=input_ids, temperature=temperature, return_dict=True)
        return output.log_probs, output.entropy
    logits = model.lm_head(model.model(input_ids=input_ids)[0])
    logits = logits / temperature.to(logits.dtype).reshape(-1, 1, 1)
    log_p = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), -1)
    return (log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
            -(log_p.exp() * log_p).sum(-1))


def _objective(fields, generator_seed):
    generator = torch.Generator().manual_seed(generator_seed)
    return sum((torch.rand(f.shape, generator=generator, dtype=torch.float64).to(f.dtype) * f)
               .sum() for f in fields)


def fsdp2_worker(rank: int, world_size: int, ties):
    """:func:`fsdp2_case` for each of ``ties``, by ``str(tie)``."""
    return {str(tie): fsdp2_case(rank, world_size, tie) for tie in ties}


def fsdp2_case(rank: int, world_size: int, tie: bool):
    """verl's ``apply_fsdp2`` wrapping of a tiny Qwen2 (its decoder layers, and with untied
    embeddings ``embed_tokens`` and ``lm_head`` each on their own, then the root), the
    ``astrai`` forward on this rank's sequences: returns, per case, None or why it failed, of
    the comparisons of this rank's values and every parameter's gathered gradient with the
    one-process float64 run over every rank's sequences (the naive path: the same in
    float32, logits formed)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.fsdp_utils import apply_fsdp2

    from astrai_kernels.integrations import verl as akv
    from astrai_kernels.testing import assert_model_gradient_close, compare_elementwise
    from astrai_kernels.testing.multiprocess import case_outcome

    torch.manual_seed(0)
    config = tiny_qwen2_config(tie, vocab=97)
    config._attn_implementation = "eager"
    model = Qwen2ForCausalLM(config).train()
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, 97, (world_size, 2, 9), generator=generator)
    temperature = torch.tensor([[0.7, 1.2], [0.9, 1.4]])[:world_size]

    def one_process(dtype):
        copied = copy.deepcopy(model).to(dtype)
        fields = [_head_fields(copied, input_ids[r], temperature[r], "logits")
                  for r in range(world_size)]
        # FSDP2 averages the ranks' gradients
        (sum(_objective(f, r) for r, f in enumerate(fields)) / world_size).backward()
        return fields[rank], {n: p.grad for n, p in copied.named_parameters()}

    (expected, expected_grads), (naive, naive_grads) = one_process(torch.float64), \
        one_process(torch.float32)
    akv.install(chunk_size=5)  # again after an untied case uninstalled
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                       fused_kernels_backend="astrai")
    apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (world_size,)),
                        "reshard_after_forward": True}, {})
    outcomes = {}

    def check(actual, want, base, name):
        want, base = want.detach(), base.detach()
        base = want + (base - want).abs().max()  # the yardstick of test_integration_verl.py
        result = compare_elementwise(actual.detach(), want, base, dtype=torch.float32,
                                     name=name)
        assert result.ok, result.message()

    fields = _head_fields(model, input_ids[rank], temperature[rank], "ours")
    _objective(fields, rank).backward()
    outcomes["values"] = case_outcome(lambda: [check(a, e, n, name) for a, e, n, name in zip(
        fields, expected, naive, ("log_probs", "entropy"))])
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    outcomes["grads"] = case_outcome(lambda: [
        assert_model_gradient_close(grads[name], expected_grads[name], naive_grads[name],
                                    dtype=torch.float32, name=f"grad {name}")
        for name in expected_grads])
    outcomes["lm_head_separate"] = not tie and type(model.lm_head).__name__.startswith("FSDP")
    if not tie:
        # verl's own torch backend reads the sharded weight without lm_head's call
        model._verl_fused_kernels_backend = "torch"
        akv.uninstall()
        try:
            model(input_ids=input_ids[rank], temperature=1.0, return_dict=True)
            outcomes["verl_torch_error"] = None
        except RuntimeError as error:
            outcomes["verl_torch_error"] = str(error)
    return outcomes
