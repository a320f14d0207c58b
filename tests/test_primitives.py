"""The primitives' declarations (``kernels/primitives.py``): every backend module satisfies the
``Backend`` protocol, and the custom ops ``kernels/library.py`` generates follow the
declarations."""

import inspect
import math
from dataclasses import fields

import pytest
import torch

from astrai_kernels.kernels import library as _library
from astrai_kernels.kernels import portable as torch_backend
from astrai_kernels.kernels import primitives
from astrai_kernels.kernels.cpp import backend as cpp_backend
from astrai_kernels.kernels.primitives import (
    PRIMITIVES,
    SAMPLING_PRIMITIVES,
    SHARD_PRIMITIVE,
    TOPK_DISTILL_PRIMITIVES,
    Backend,
    CrossEntropyArgs,
    DistillArgs,
    MixtureWeights,
    SampledLogprobsBackend,
    SamplingArgs,
    VocabShardBackend,
    args_of,
    declared,
    mixture_weights,
)
from astrai_kernels.kernels.triton import backend as triton_backend
from astrai_kernels.ops import sampling as sampling_op
from astrai_kernels.ops import topk_distill  # noqa: F401  (makes the top-k primitive's op)
from astrai_kernels.ops.cross_entropy import CrossEntropyParams

MODULES = {"torch": torch_backend, "cpp": cpp_backend, "triton": triton_backend}


def _protocol_parameters(protocol, name):
    return list(inspect.signature(getattr(protocol, name)).parameters)[1:]  # without self


@pytest.mark.parametrize("name", sorted(MODULES))
def test_backend_modules_satisfy_the_protocol(name):
    module = MODULES[name]
    assert isinstance(module, Backend)
    for primitive in (*PRIMITIVES, "unavailable_reason"):
        assert (list(inspect.signature(getattr(module, primitive)).parameters)
                == _protocol_parameters(Backend, primitive)), (name, primitive)


def test_every_backend_serves_the_shard_gradient():
    for module in (torch_backend, cpp_backend, triton_backend):
        assert (list(inspect.signature(module.vocab_shard_backward).parameters)
                == _protocol_parameters(VocabShardBackend, "vocab_shard_backward"))
        assert isinstance(module, VocabShardBackend)


def test_the_sampling_primitives_are_optional():
    """The cpp and triton backends score sampled targets in their kernels; the torch backend
    lacks the primitives, and ``kernels/portable_sampling.py``'s chunked torch serves it."""
    for module in (cpp_backend, triton_backend):
        for name in SAMPLING_PRIMITIVES:
            assert (list(inspect.signature(getattr(module, name)).parameters)
                    == _protocol_parameters(SampledLogprobsBackend, name)), (module, name)
        assert isinstance(module, SampledLogprobsBackend)
    assert not isinstance(torch_backend, SampledLogprobsBackend)


@pytest.mark.parametrize("primitive", [*PRIMITIVES.values(), SHARD_PRIMITIVE,
                                       *SAMPLING_PRIMITIVES.values()], ids=lambda p: p.name)
def test_declarations_state_the_protocol(primitive):
    """A declaration's tensors, then ``params``, then ``grad`` when it writes one: the
    protocol's order."""
    protocol = (VocabShardBackend if primitive is SHARD_PRIMITIVE
                else SampledLogprobsBackend if primitive.name in SAMPLING_PRIMITIVES
                else Backend)
    expected = [name for name, _ in primitive.tensors] + ["params"]
    if primitive.gradient != primitives.NONE:
        expected.append("grad")
    assert _protocol_parameters(protocol, primitive.name) == expected


@pytest.mark.parametrize("name", sorted(PRIMITIVES) + sorted(SAMPLING_PRIMITIVES)
                         + sorted(TOPK_DISTILL_PRIMITIVES))
def test_generated_schema_follows_the_declaration(name):
    primitive = declared(name)
    schema = _library._GENERATED[name].op._opoverload._schema
    names = [argument.name for argument in schema.arguments]
    expected = [tensor for tensor, _ in primitive.tensors]
    expected += [field.name for field in fields(primitive.params)]
    if primitive.gradient == primitives.OPTIONAL:
        expected.append("compute_grad")
    assert names == expected + ["backend"]
    for argument, field in zip(schema.arguments[len(primitive.tensors):],
                               fields(primitive.params)):
        runtime_float = field.type == "float" and not field.metadata.get("static")
        assert ("Tensor" in str(argument.type)) == runtime_float, (name, field.name)


def test_op_params_extend_the_kernel_params():
    params = CrossEntropyParams(ignore_index=-1, label_smoothing=0.1, z_loss=0.0, softcap=30.0,
                                logit_scale=-2.0, reduction="sum", inplace_backward=False,
                                backend="torch")
    kernel = args_of(params, CrossEntropyArgs)
    assert type(kernel) is CrossEntropyArgs
    assert kernel == CrossEntropyArgs(-1, 0.1, 0.0, 30.0, logit_scale=-2.0)
    assert args_of(kernel, CrossEntropyArgs) is kernel
    assert CrossEntropyArgs(-1, 0.1, 0.0, 30.0).logit_scale == 1.0  # off unless given


def test_generated_op_matches_the_eager_call():
    """The same primitive through the custom op (as under tracing) and eagerly."""
    logits = torch.randn(1, 5, 11, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([0, 3, -100, 10, 2])
    params = CrossEntropyArgs(-100, 0.1, 1e-3, 0.0)
    scale = torch.full((1,), 0.25)
    eager = _library.cross_entropy_forward(logits, target, scale, params, True, "torch")
    generated = _library._GENERATED["cross_entropy_forward"]
    floats = [_library.float_arg(value) if isinstance(value, float) else value
              for value in (getattr(params, f.name) for f in fields(CrossEntropyArgs))]
    traced = generated.op(logits, target, scale, *floats, True, "torch")
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta, expected", [
    (0.0, MixtureWeights(1.0, 0.0, 0.0, 0.0)),  # forward KL: no mixture, read by no kernel
    (1.0, MixtureWeights(0.0, 1.0, -math.inf, 0.0)),  # reverse KL: m = b
    (0.25, MixtureWeights(0.25, 0.75, math.log(0.75), math.log(0.25))),
])
def test_mixture_weights_are_computed_once_for_every_backend(beta, expected):
    assert mixture_weights(beta) == expected
    assert DistillArgs(beta, 0.7, -100, 0.0).weights == expected
    for module in MODULES.values():  # no backend keeps its own copy of the formula
        assert not hasattr(module, "distill_weights") and not hasattr(module, "_distill_weights")


def test_log_ratio_clamp_is_declared_once():
    """The kernels' clamp is the contract's: the torch backend imports it, the Triton helpers
    and the C++ header state the same value (the C++ one is checked in test_cpp_backend)."""
    assert torch_backend.LOG_RATIO_CLAMP is primitives.LOG_RATIO_CLAMP
    if triton_backend.import_error() is None:
        from astrai_kernels.kernels.triton import helpers
        assert float(helpers.LOG_RATIO_CLAMP.value) == primitives.LOG_RATIO_CLAMP


@pytest.mark.parametrize("backend", ["torch", "cpp"])  # chunked torch, or the backend's kernel
def test_sampling_ops_fake_states_what_they_return(backend):
    """The optional sampled-logprobs primitives' generated ops (``ops/sampling.py`` makes them
    with ``kernels/portable_sampling.py``'s ``sampling_kernels``): under a fake mode their fakes
    give the eager call's shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 13, generator=g)
    target = torch.tensor([0, 5, -100, 12, 3, 7])
    args = SamplingArgs(0.7, 4, 0.9, 0.0, -100)
    coef = torch.rand(6, generator=g) * (target != -100)
    for op, arguments in (
            (sampling_op.sampled_logprobs_forward, (logits, target, args, backend)),
            (sampling_op.sampled_logprobs_backward,
             (logits, target, torch.rand(6, generator=g) + 3.0, torch.randn(6, generator=g),
              coef, args, backend))):
        eager = op(*arguments)
        eager = eager if isinstance(eager, tuple) else (eager,)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            faked = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                         for a in arguments))
        faked = faked if isinstance(faked, tuple) else (faked,)
        assert [(tuple(t.shape), t.dtype) for t in faked] == [
            (tuple(t.shape), t.dtype) for t in eager]
