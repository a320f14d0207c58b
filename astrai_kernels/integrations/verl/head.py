"""The fused head verl's patched forwards call, served by ``ak.linear_token_logprobs``.

verl's forwards (``dense_common`` and the vision-language families, each
``forward_with_torch_backend``) build ``FusedLinearForPPO(impl_backend=...)`` from
``verl.utils.experimental.torch_functional`` at call time and call it with the final hidden
states, ``self.lm_head.weight``, the rolled labels and the temperature. ``install`` puts
:class:`FusedLinearForPPO` there: with ``impl_backend="astrai"`` it computes the log-probs and
the entropy with our op, from the model that :func:`serving` names (its ``lm_head`` called
through ``__call__`` when FSDP2 shards it on its own, so the weight is gathered there; its
logit scale and final soft-cap); other backend names are verl's class unchanged.
"""

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

import astrai_kernels as ak

BACKEND_NAME = "astrai"
#: labels the engine never produces (token ids are >= 0): no row is ignored
_NO_IGNORE = -(2 ** 62)


@dataclass(frozen=True)
class HeadTransform:
    """``logits = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)``."""
    logit_scale: float = 1.0
    softcap: Optional[float] = None


@dataclass
class Serving:
    """What one patched forward asks of the head: the model, ``sum_pi_squared`` or not, the
    op's options; ``sum_pi_squared`` holds the result after the call."""
    model: nn.Module
    transform: HeadTransform
    with_sum_pi_squared: bool
    options: Dict
    sum_pi_squared: Optional[Tensor] = None


_SERVING: contextvars.ContextVar = contextvars.ContextVar("astrai_verl_serving", default=None)


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else getattr(config, "text_config", config)


def head_transform(model: nn.Module) -> HeadTransform:
    """The logit scale and final soft-cap the model's own forward applies to its logits, from
    its config as transformers' models read them (Gemma's ``final_logit_softcapping``,
    Cohere's ``logit_scale``, Granite's ``logits_scaling``); verl's own fused backends drop
    them."""
    config = _text_config(model.config)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    return HeadTransform(scale, None if softcap is None else float(softcap))


@contextlib.contextmanager
def serving(model: nn.Module, transform: HeadTransform, with_sum_pi_squared: bool,
            options: Dict):
    """While inside, ``FusedLinearForPPO(impl_backend="astrai")`` serves ``model``'s head."""
    state = Serving(model, transform, with_sum_pi_squared, options)
    token = _SERVING.set(state)
    try:
        yield state
    finally:
        _SERVING.reset(token)


def per_row_temperature(temperature, labels: Tensor) -> Tensor:
    """``temperature`` (a float, a 0-d tensor, one value per sequence ``[B]`` for labels
    ``[B, T]``, or a tensor broadcastable to the labels) as float32 ``labels.shape``."""
    if not isinstance(temperature, Tensor):
        temperature = torch.tensor(float(temperature))
    if not temperature.is_floating_point():
        raise TypeError(f"temperature must be a float or a floating tensor, got "
                        f"{temperature.dtype}")
    temperature = temperature.detach().to(device=labels.device, dtype=torch.float32)
    if temperature.dim() == 1 and labels.dim() == 2 and temperature.shape[0] == labels.shape[0] \
            and temperature.shape[0] != 1:
        temperature = temperature.unsqueeze(-1)  # one per sequence, as the engine keeps it
    try:
        temperature = temperature.expand(labels.shape)
    except RuntimeError:
        raise ValueError(f"temperature of shape {tuple(temperature.shape)} is neither one value "
                         f"per sequence nor broadcastable to the labels "
                         f"{tuple(labels.shape)}") from None
    if not bool((temperature > 0).all()):
        raise ValueError("temperature must be > 0 everywhere")
    return temperature


def token_fields(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                 temperature, transform: HeadTransform, with_sum_pi_squared: bool,
                 options: Dict) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(log_probs, entropy, sum_pi_squared or None)`` of ``labels`` (``hidden``'s leading
    shape), float32. Temperatures per sequence or per token: without a bias or a soft-cap the
    temperature divides the hidden states (one walk); otherwise one walk of the head per
    distinct temperature value."""
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"the labels' shape {tuple(labels.shape)} must be the hidden states' "
                         f"leading shape {tuple(hidden.shape[:-1])}")
    hidden = hidden.to(weight.dtype)
    labels = labels.to(device=hidden.device, dtype=torch.long)
    statistics = ("log_sum_sq_probs",) if with_sum_pi_squared else ()
    call = dict(bias=bias, ignore_index=_NO_IGNORE, return_entropy=True,
                softcap=transform.softcap, logit_scale=transform.logit_scale,
                statistics=statistics, **options)

    def walk(rows, target, value):
        out = ak.linear_token_logprobs(rows, weight, target, temperature=value, **call)
        stats = out[2]["log_sum_sq_probs"].exp() if statistics else None
        return out[0], out[1], stats

    with torch.autocast(hidden.device.type, enabled=False):
        if not isinstance(temperature, Tensor) or temperature.numel() == 1:
            value = float(temperature)
            if value <= 0:
                raise ValueError(f"temperature must be > 0, got {value}")
            return walk(hidden, labels, value)
        per_row = per_row_temperature(temperature, labels)
        if bias is None and transform.softcap is None:
            # logits / T = logit_scale * (hidden / T) @ weight.T: one walk at T = 1, whatever
            # the temperatures, and the weight's gradient accumulated once in float32
            scaled = (hidden.float() / per_row.unsqueeze(-1)).to(hidden.dtype)
            return walk(scaled, labels, 1.0)
        per_row = per_row.reshape(-1)
        values, group = torch.unique(per_row, return_inverse=True)
        if values.numel() == 1:
            return walk(hidden, labels, float(values[0]))
        rows, target = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        log_probs = rows.new_zeros(target.shape, dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        sum_pi_squared = torch.zeros_like(log_probs) if statistics else None
        for index, value in enumerate(values.tolist()):
            where = (group == index).nonzero().squeeze(-1)
            logp, ent, stats = walk(rows.index_select(0, where), target[where], value)
            log_probs = log_probs.index_put((where,), logp)
            entropy = entropy.index_put((where,), ent)
            if stats is not None:
                sum_pi_squared[where] = stats
        shape = labels.shape
        return (log_probs.view(shape), entropy.view(shape),
                None if sum_pi_squared is None else sum_pi_squared.view(shape))


def _is_fsdp2_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def lm_head_fields(lm_head: nn.Module, hidden: Tensor, labels: Tensor, temperature,
                   transform: HeadTransform, with_sum_pi_squared: bool, options: Dict):
    """:func:`token_fields` on ``lm_head``'s weight and bias. Under FSDP2, a head sharded on its
    own (untied embeddings) holds its weight unsharded only inside its own call, which verl's
    fused forwards never make: the computation runs as that call, so FSDP2 gathers the weight,
    gathers it again for the backward and reduce-scatters its gradient."""
    def compute(rows):
        return token_fields(rows, lm_head.weight, lm_head.bias, labels, temperature, transform,
                            with_sum_pi_squared, options)

    if not _is_fsdp2_module(lm_head):
        return compute(hidden)
    # only the hidden states go through the call's arguments: FSDP2 casts floating inputs to
    # its parameter dtype, which must not touch the temperature
    lm_head.__dict__["forward"] = compute
    try:
        return lm_head(hidden)
    finally:
        del lm_head.__dict__["forward"]


def _output_embedding(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Module) else model.lm_head


def make_fused_linear_class(verl_class: type) -> type:
    """verl's ``FusedLinearForPPO`` with the backend name ``"astrai"`` served here."""

    class FusedLinearForPPO(verl_class):
        __doc__ = verl_class.__doc__

        def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
            if impl_backend != BACKEND_NAME:
                super().__init__(chunk_size=chunk_size, impl_backend=impl_backend)
                return
            nn.Module.__init__(self)
            self.chunk_size = chunk_size
            self.impl_backend = impl_backend

        def forward(self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor,
                    temperature=1.0):
            state: Optional[Serving] = _SERVING.get()
            if state is None and self.impl_backend != BACKEND_NAME:
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            # inside our forward every FusedLinearForPPO is ours, whatever name it was built with
            if state is None:
                # called outside a patched forward: the weight verl hands over, untransformed
                log_probs, entropy, _ = token_fields(hidden_states, vocab_weights, None,
                                                     input_ids, temperature, HeadTransform(),
                                                     False, {})
                return log_probs, entropy
            log_probs, entropy, state.sum_pi_squared = lm_head_fields(
                _output_embedding(state.model), hidden_states, input_ids, temperature,
                state.transform, state.with_sum_pi_squared, state.options)
            return log_probs, entropy

    FusedLinearForPPO.__qualname__ = verl_class.__qualname__
    FusedLinearForPPO.__module__ = verl_class.__module__
    return FusedLinearForPPO


_OUTPUT_CLASSES: Dict[type, type] = {}


def with_sum_pi_squared(output, sum_pi_squared: Tensor):
    """``output`` (a verl ``...CausalLMOutputForPPO``) as a subclass carrying
    ``sum_pi_squared``."""
    base = type(output)
    cls = _OUTPUT_CLASSES.get(base)
    if cls is None:
        cls = dataclasses.make_dataclass(
            base.__name__, [("sum_pi_squared", Optional[Tensor], None)], bases=(base,))
        cls.__module__ = __name__
        _OUTPUT_CLASSES[base] = cls
    return cls(**dict(output.items()), sum_pi_squared=sum_pi_squared)
