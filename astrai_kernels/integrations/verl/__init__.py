"""verl on astrai-kernels (the optional extra ``verl``; tested with verl 0.9.1).

``install()`` adds ``"astrai"`` to verl's fused-kernel backends, so the model config line
``actor_rollout_ref.model.fused_kernel_options.impl_backend: astrai`` (with
``use_fused_kernels: true``) makes verl's own ``apply_monkey_patch(model,
use_fused_kernels=True, fused_kernels_backend="astrai")`` give the model a forward whose
``log_probs`` and ``entropy`` (float32) come from ``ak.linear_token_logprobs`` on the final
hidden states and the LM head, never forming the logits. What it changes in verl, each undone
by ``uninstall()``:

* ``verl.models.transformers.monkey_patch.patch_forward_with_backends``: for ``"astrai"``, the
  model class's forward is verl's own ``forward_with_torch_backend`` of its family
  (``dense_common`` and the vision-language ones) around our head (``forward.py``): the
  model's logit scale and final soft-cap honoured (verl's fused backends drop them);
  ``temperature`` a float or a tensor (one value per sequence, or broadcastable to the labels);
  ``shift_labels`` used verbatim, the remove-padding layout ``[1, total_nnz]`` as any other;
  ``calculate_sum_pi_squared=True`` adds ``sum_pi_squared`` (``sum_v p_v**2`` at the
  temperature, float32, no gradient) to the output. Under FSDP2 with untied embeddings
  (``lm_head`` sharded on its own, which verl's fused backends read unsharded-never) the head
  runs inside ``lm_head``'s call, where FSDP2 gathers it.
* ``verl.utils.experimental.torch_functional.FusedLinearForPPO``: the class verl's forwards
  build, with ``impl_backend="astrai"`` served by us (``head.py``), other names verl's.
* ``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs``: on our backend the
  engine hands per-sample temperature through instead of asserting, and passes
  ``sum_pi_squared`` on instead of raising ``NotImplementedError`` (``engine.py``).
* ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``: verl's top-K forward KL
  without the student's ``[B, T, V]`` log-softmax (``distillation.py``), same outputs.

``install(backend=..., chunk_size=...)`` passes those to the head's op (the backend also
to the distillation's ``ak.token_logprobs``). verl is imported only when
these functions run; ``import astrai_kernels`` never imports it.
"""

from typing import Optional

from ...kernels.registry import BACKENDS
from ...ops.head import check_chunk_size
from . import distillation, engine, forward, head
from .head import BACKEND_NAME

__all__ = ["BACKEND_NAME", "TESTED_VERL", "install", "is_installed", "uninstall"]

TESTED_VERL = "0.9.1"

_INSTALLED: list = []


def _targets():
    """``(owner, attribute, make_replacement)`` of everything ``install`` replaces."""
    from verl.models.transformers import monkey_patch
    from verl.trainer.distillation.fsdp import losses
    from verl.utils.experimental import torch_functional
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return [
        (monkey_patch, "patch_forward_with_backends",
         lambda original, options: forward.make_patch_forward_with_backends(original, options)),
        (torch_functional, "FusedLinearForPPO",
         lambda original, options: head.make_fused_linear_class(original)),
        (FSDPEngineWithLMHead, "prepare_model_inputs",
         lambda original, options: engine.make_prepare_model_inputs(original)),
        (FSDPEngineWithLMHead, "prepare_model_outputs",
         lambda original, options: engine.make_prepare_model_outputs(original)),
        (losses, "compute_forward_kl_topk",
         lambda original, options: distillation.make_compute_forward_kl_topk(
             options["backend"])),
    ]


def install(*, backend: str = "auto", chunk_size: Optional[int] = None) -> None:
    """Serve ``fused_kernels_backend="astrai"`` in verl (module docstring); calling it again
    with the same options does nothing, with others replaces them. ``backend`` and
    ``chunk_size`` go to ``ak.linear_token_logprobs``."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    check_chunk_size(chunk_size)
    options = {"backend": backend, "chunk_size": chunk_size}
    if _INSTALLED and _INSTALLED[0][3] == options:
        return
    uninstall()
    for owner, name, make in _targets():
        original = owner.__dict__[name]
        _INSTALLED.append((owner, name, original, options))
        setattr(owner, name, make(original, options))


def uninstall() -> None:
    """Give verl its own functions back (idempotent). Model classes patched for ``"astrai"``
    get verl's ``forward_with_torch_backend`` of their family (what ``"torch"`` gives)."""
    while _INSTALLED:
        owner, name, original, _ = _INSTALLED.pop()
        setattr(owner, name, original)
    _restore_patched_classes()


def is_installed() -> bool:
    return bool(_INSTALLED)


def _restore_patched_classes() -> None:
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return
    from transformers import PreTrainedModel

    pending = list(PreTrainedModel.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        function = cls.__dict__.get("forward")
        if function is not None and forward.is_astrai_forward(function):
            cls.forward = function._astrai_kernels_verl_torch_forward
