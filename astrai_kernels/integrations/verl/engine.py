"""verl's FSDP engine (``FSDPEngineWithLMHead``) on our backend: what it refuses for fused
kernels, served when the model config names ``impl_backend: astrai``.

* Per-sample temperature (``micro_batch["temperature"]`` a tensor): the engine asserts it away
  with fused kernels. On our backend its inputs are prepared as on its unfused path (which
  already expands the temperature per token under remove-padding, and keeps it per sequence
  otherwise), then given the fused path's model arguments, the temperature as that tensor.
* ``calculate_sum_pi_squared``: the engine raises ``NotImplementedError`` with fused kernels.
  On our backend the model is asked for ``sum_pi_squared`` and the engine lays it out as it
  lays out the fused log-probs (gathered over Ulysses ranks, unpadded, nested per sequence).

Any other backend, or the unfused path, runs the engine's own methods unchanged.
"""

import contextlib
import functools

import torch

from . import head


def _serves(engine, micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    options = getattr(engine.model_config, "fused_kernel_options", None) or {}
    return (options.get("impl_backend") == head.BACKEND_NAME
            and tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False))


@contextlib.contextmanager
def _non_tensor(micro_batch, **values):
    """``micro_batch``'s non-tensor entries set to ``values`` while inside."""
    from verl.utils import tensordict_utils as tu

    before = {key: tu.get_non_tensor_data(data=micro_batch, key=key, default=None)
              for key in values}
    tu.assign_non_tensor(micro_batch, **values)
    try:
        yield
    finally:
        tu.assign_non_tensor(micro_batch, **before)


def _wants_sum_pi_squared(micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared",
                                       default=False))


def make_prepare_model_inputs(verl_method):
    def prepare_model_inputs(self, micro_batch):
        if not _serves(self, micro_batch):
            return verl_method(self, micro_batch)
        temperature = micro_batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            model_inputs, output_args = verl_method(self, micro_batch)
        else:
            from verl.utils import tensordict_utils as tu

            use_remove_padding = tu.get_non_tensor_data(data=micro_batch,
                                                        key="use_remove_padding", default=True)
            with _non_tensor(micro_batch, use_fused_kernels=False):
                model_inputs, output_args = verl_method(self, micro_batch)
            # the fused path's model arguments, with the engine's per-token (remove-padding:
            # [1, total_nnz], Ulysses-sliced) or per-sequence ([bsz, 1]) temperature
            model_inputs["return_dict"] = True
            if use_remove_padding:
                model_inputs["temperature"] = output_args["temperature_rmpad"].unsqueeze(0)
                model_inputs["shift_labels"] = output_args["input_ids_rmpad_rolled"].unsqueeze(0)
            else:
                model_inputs["temperature"] = output_args["temperature"].unsqueeze(-1)
        if _wants_sum_pi_squared(micro_batch):
            model_inputs["calculate_sum_pi_squared"] = True
        return model_inputs, output_args

    return functools.update_wrapper(prepare_model_inputs, verl_method)


def make_prepare_model_outputs(verl_method):
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if not (_serves(self, micro_batch) and _wants_sum_pi_squared(micro_batch)):
            return verl_method(self, output, output_args, micro_batch, logits_processor_func)
        with _non_tensor(micro_batch, calculate_sum_pi_squared=False):
            model_output = verl_method(self, output, output_args, micro_batch,
                                       logits_processor_func)
        model_output["sum_pi_squared"] = _laid_out(self, output.sum_pi_squared, output_args,
                                                   micro_batch)
        return model_output

    return functools.update_wrapper(prepare_model_outputs, verl_method)


def _laid_out(engine, values, output_args, micro_batch):
    """A per-token output of the fused forward laid out as the engine lays out its
    ``log_probs`` there: nested ``[bsz, j1]``."""
    from verl.utils import tensordict_utils as tu

    cu_seqlens = micro_batch["input_ids"].offsets()
    if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        values = engine._gather_and_unpad_packed(values.squeeze(0), output_args["pad_size"])
        return torch.nested.nested_tensor_from_jagged(values, cu_seqlens)
    lengths = cu_seqlens.diff()
    mask = torch.arange(values.shape[1], device=values.device) < lengths.unsqueeze(1)
    return torch.nested.nested_tensor_from_jagged(values[mask], cu_seqlens)
