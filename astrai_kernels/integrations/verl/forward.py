"""The forward ``apply_monkey_patch(..., fused_kernels_backend="astrai")`` gives a model.

verl's ``patch_forward_with_backends`` picks, by ``config.model_type``, the family's
``forward_with_torch_backend`` (``dense_common`` for text models; ``qwen2_vl``, ``qwen3_vl``,
``glm4v``, ``qwen3_5`` for the vision-language ones) and sets it as the model class's forward.
For ``"astrai"`` the class gets :func:`make_forward` of that same function: verl's forward runs
as it is (its backbone call, ``shift_labels`` used verbatim, the roll otherwise, its output
class), with its ``FusedLinearForPPO`` served by ``head.py``; around it this forward adds
``calculate_sum_pi_squared`` (then ``sum_pi_squared`` on the output) and a ``temperature`` that
may be a tensor (one value per sequence or per token).
"""

import functools
import importlib

from . import head

#: verl's families: ``model_type`` -> the module of their ``forward_with_torch_backend``
FAMILIES = {
    "qwen2_5_vl": "qwen2_vl", "qwen2_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
    "glm4v": "glm4v",
    "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5",
}
_DENSE = "dense_common"
_ORIGINAL_ATTR = "_astrai_kernels_verl_torch_forward"


def verl_torch_forward(model_type: str):
    """verl's ``forward_with_torch_backend`` for a ``model_type``, as verl chooses it."""
    family = FAMILIES.get(model_type, _DENSE)
    module = importlib.import_module(f"verl.models.transformers.{family}")
    return module.forward_with_torch_backend


def make_forward(verl_forward, options):
    """The model class's forward on our backend: ``verl_forward`` with its fused head served
    by ``ak.linear_token_logprobs`` (``options``: ``backend``, ``chunk_size``)."""
    def forward(self, *args, temperature=1.0, calculate_sum_pi_squared=False, **kwargs):
        with head.serving(self, head.head_transform(self), bool(calculate_sum_pi_squared),
                          options) as state:
            output = verl_forward(self, *args, temperature=temperature, **kwargs)
        if calculate_sum_pi_squared:
            output = head.with_sum_pi_squared(output, state.sum_pi_squared)
        return output

    functools.update_wrapper(forward, verl_forward)
    setattr(forward, _ORIGINAL_ATTR, verl_forward)
    return forward


def make_patch_forward_with_backends(verl_function, options):
    """verl's ``patch_forward_with_backends``, with ``"astrai"`` one more backend name."""
    def patch_forward_with_backends(model, use_fused_kernels: bool = False,
                                    fused_kernels_backend: str = None):
        if not use_fused_kernels or fused_kernels_backend != head.BACKEND_NAME:
            return verl_function(model, use_fused_kernels=use_fused_kernels,
                                 fused_kernels_backend=fused_kernels_backend)
        model._verl_fused_kernels_backend = fused_kernels_backend
        model.__class__.forward = make_forward(verl_torch_forward(model.config.model_type),
                                               options)
        print(f"Using astrai-kernels backend for fused kernels in {model.__class__.__name__}")

    return functools.update_wrapper(patch_forward_with_backends, verl_function)


def is_astrai_forward(function) -> bool:
    return hasattr(function, _ORIGINAL_ATTR)
