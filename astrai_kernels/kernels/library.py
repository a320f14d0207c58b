"""The backends' primitives as ``torch.library`` custom ops, so ``torch.compile`` traces through.

Everything here is generated from the declarations in ``kernels/primitives.py``: each primitive's
custom op (its schema: the declared tensors, then the fields of its params class, then
``compute_grad`` for a gradient the caller may skip, then ``backend``), its fake implementation
(the declared output lengths), its ``triton_op`` twin and the eager wrapper the ops call,
``primitive_name(*tensors, params, [compute_grad,] backend)``. Each op is functional (it
allocates the gradient it returns) and dispatches on ``backend`` to the module named in
``kernels/registry.py``. The in-place-gradient paths call the backend modules directly instead
(an op may not return an alias of its input). An optional primitive's op
(:func:`optional_primitive_op`: the sampler's, top-k distillation's) is generated the same way by
its op's file, with a resolver of ``kernels/`` that picks the module to run (the sampler's,
``portable_sampling.sampling_kernels``, falls back to that module's chunked torch on a backend
without the primitive), so nothing here calls back up into ``ops/``.

:func:`traceable_op` makes these ops (and the fused head's walks, ``ops/head.py``'s
``head_walk``):

* Float hyperparameters (temperature, softcap, z-loss, ...) cross the op boundary as 0-d
  float64 CPU tensors (:func:`float_arg`) and are read back with ``.item()`` in the op body,
  where the kernels take them as runtime arguments. A ``float`` in an op's schema would make
  Dynamo specialize the graph on its value (one compile per temperature); a tensor keeps a
  float argument of a compiled function symbolic. Reading a CPU scalar is no device sync.
* Eager calls (no ``torch.compile``, no tracing mode, plain tensors) run the body directly with
  the Python floats: no dispatcher round trip, and no import of Dynamo, which a custom op's
  first call would otherwise trigger (and with it Inductor and Triton, about 1.5 s).

For ``backend="triton"`` (torch >= 2.6) the primitives also have ``torch.library.triton_op``
twins whose bodies launch the kernels through ``wrap_triton``: traced, Inductor then sees the
Triton kernels themselves in the graph (user-defined Triton kernels it can schedule and fuse
around) rather than an opaque call, and the fake implementation is the body traced with fake
tensors. The public functions below pick a twin when the backend is ``triton`` and the call is
traced; under ``torch.compile`` the string is a constant, so the choice is made once at trace
time. The twins take their hyperparameters as Python floats (a traced kernel launch needs
numbers), so under ``torch.compile`` the triton backend compiles once per distinct value of a
float argument. Defining them imports Inductor and Triton, so that happens on the first traced
triton call, not at import.
"""

import inspect
from dataclasses import fields
from typing import Optional, Tuple

import torch
from torch import Tensor

from .memory import cached_empty
from .primitives import ALWAYS, NONE, OPTIONAL, PRIMITIVES, args_of, declared
from .registry import backend_module

_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def float_arg(value) -> Tensor:
    """A float hyperparameter as the 0-d float64 CPU tensor the custom ops take."""
    if torch.compiler.is_compiling():
        # torch.tensor(x) of a traced float bakes its value into the graph; arithmetic on a
        # tensor keeps it a graph input, so a new value reuses the compiled graph
        return torch.zeros((), dtype=torch.float64).add(value)
    return torch.tensor(value, dtype=torch.float64)


def runs_eagerly(args) -> bool:
    """True when nothing traces this call: not ``torch.compile``, no dispatch mode (fake,
    proxy, functionalization), no functorch transform, and the tensors are plain ones."""
    return (not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(type(arg) in _PLAIN_TENSORS for arg in args if isinstance(arg, Tensor)))


def traceable_op(name, floats=(), params=None):
    """Make ``fn`` (float hyperparameters ``floats`` taken as Python floats) the custom op
    ``astrai_kernels::name``: the returned function calls ``fn`` itself when
    :func:`runs_eagerly`, else the op, with those floats as :func:`float_arg` tensors.
    ``params`` (``{parameter: params class}``, the classes of ``kernels/primitives.py``): each
    such parameter is one params object; its fields become the op's schema arguments (runtime
    floats as tensors, as the primitives' own) and the object is rebuilt for ``fn`` and for the
    fake, so the object crosses the op boundary whole. ``register_fake`` registers the op's
    fake implementation (it gets the tensors, and the params objects rebuilt)."""
    params = dict(params or {})

    def wrap(fn):
        signature = inspect.signature(fn)
        layout = _FlatLayout(signature, floats, params)

        def body(*flat):
            flat = list(flat)
            for i in layout.float_positions:
                flat[i] = flat[i].item()
            return fn(*layout.unflatten(flat))

        body.__signature__ = layout.signature
        body.__name__, body.__doc__ = fn.__name__, fn.__doc__
        op = torch.library.custom_op(f"astrai_kernels::{name}", body, mutates_args=())

        def call(*args):
            if runs_eagerly(args):
                return fn(*args)
            flat = layout.flatten(args)
            for i in layout.float_positions:
                flat[i] = float_arg(flat[i])
            return op(*flat)

        def register_fake(fake):
            def flat_fake(*flat):
                return fake(*layout.unflatten(list(flat)))
            flat_fake.__signature__ = layout.signature
            return op.register_fake(flat_fake)

        call.op, call.register_fake = op, register_fake
        call.__name__, call.__doc__ = fn.__name__, fn.__doc__
        return call
    return wrap


class _FlatLayout:
    """A function's parameters as a custom op's flat schema: each params object's fields in
    its place, the floats to pass as tensors, and the way back."""

    def __init__(self, signature, floats, params):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        flat, self.entries, self.float_positions = [], [], []
        for parameter in signature.parameters.values():
            if parameter.name not in params:
                if parameter.name in floats:
                    self.float_positions.append(len(flat))
                    parameter = parameter.replace(annotation=Tensor)
                flat.append(parameter)
                self.entries.append(None)
                continue
            cls = params[parameter.name]
            names = []
            for field_name, annotation, runtime_float in _class_fields(cls):
                if runtime_float:
                    self.float_positions.append(len(flat))
                    annotation = Tensor
                flat.append(inspect.Parameter(f"{parameter.name}_{field_name}", kind,
                                              annotation=annotation))
                names.append(field_name)
            self.entries.append((cls, names))
        self.signature = inspect.Signature(flat, return_annotation=signature.return_annotation)

    def flatten(self, args):
        flat = []
        for entry, value in zip(self.entries, args):
            if entry is None:
                flat.append(value)
            else:
                flat.extend(getattr(value, name) for name in entry[1])
        return flat

    def unflatten(self, flat):
        args, i = [], 0
        for entry in self.entries:
            if entry is None:
                args.append(flat[i])
                i += 1
            else:
                cls, names = entry
                args.append(cls(**dict(zip(names, flat[i:i + len(names)]))))
                i += len(names)
        return args


def _class_fields(cls):
    """``(name, annotation, is_runtime_float)`` of a params class's fields as schema arguments
    (a float is passed as a tensor unless its metadata marks it static)."""
    out = []
    for f in fields(cls):
        kind = {"float": float, "int": int, "bool": bool, "str": str,
                "Optional[float]": Optional[float]}[str(f.type)]
        # an optional float (None: off) stays a Python float: a value compiles once
        out.append((f.name, kind, kind is float and not f.metadata.get("static")))
    return out


def _schema_fields(primitive):
    """``(name, annotation, is_runtime_float)`` of the params fields as schema arguments."""
    return _class_fields(primitive.params)


def _signature(primitive, runtime_floats_as_tensors, with_backend):
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(name, kind, annotation=annotation)
              for name, annotation in primitive.tensors]
    for name, annotation, runtime_float in _schema_fields(primitive):
        if runtime_float and runtime_floats_as_tensors:
            annotation = Tensor
        params.append(inspect.Parameter(name, kind, annotation=annotation))
    if primitive.gradient == OPTIONAL:
        params.append(inspect.Parameter("compute_grad", kind, annotation=bool))
    if with_backend:
        params.append(inspect.Parameter("backend", kind, annotation=str))
    n_outputs = primitive.n_outputs
    if primitive.gradient == ALWAYS:
        returns = Tensor
    else:
        returns = Tuple[(Tensor,) * (n_outputs + (primitive.gradient == OPTIONAL))]
    return inspect.Signature(params, return_annotation=returns)


def _run(primitive, module, tensors, params, compute_grad, new_grad):
    """Call the backend's primitive; the gradient (when written) in a new tensor."""
    fn = getattr(module, primitive.name)
    if primitive.gradient == NONE:
        return tuple(fn(*tensors, params))
    if primitive.gradient == ALWAYS:
        grad = new_grad(tensors[0])
        fn(*tensors, params, grad)
        return grad
    grad = new_grad(tensors[0]) if compute_grad else tensors[0].new_empty(0)
    outputs = fn(*tensors, params, grad if compute_grad else None)
    return (*outputs, grad)


def _fake(primitive, tensors, params, compute_grad):
    first = tensors[0]
    if primitive.output_shapes is not None:
        shapes = primitive.output_shapes(params, tensors)
    else:
        n_rows = tensors[primitive_target_index(primitive)].numel()
        shapes = primitive.outputs(params, n_rows)
    rows = tuple(first.new_empty(shape, dtype=primitive.output_dtype(i))
                 for i, shape in enumerate(shapes))
    if primitive.gradient == ALWAYS:
        return first.new_empty(first.shape)
    if primitive.gradient == OPTIONAL:
        return (*rows, first.new_empty(first.shape) if compute_grad else first.new_empty(0))
    return rows


def primitive_target_index(primitive):
    return [name for name, _ in primitive.tensors].index("target")


def _grad_like(logits):
    return cached_empty(logits.shape, logits.dtype, logits.device)


class _Generated:
    """A primitive's custom op, its Triton twin (defined on first traced use) and its
    eager wrapper. ``kernels(backend)`` gives the module whose function of the primitive's
    name runs; ``triton_twin``: whether traced triton calls get a ``triton_op`` twin."""

    def __init__(self, primitive, kernels=backend_module, triton_twin=True):
        self.primitive, self.kernels, self.triton_twin = primitive, kernels, triton_twin
        self.n_tensors = len(primitive.tensors)
        self.field_names = [name for name, _, _ in _schema_fields(primitive)]
        self.runtime_floats = [i for i, (_, _, runtime) in enumerate(_schema_fields(primitive))
                               if runtime]
        self.optional = primitive.gradient == OPTIONAL
        entry = self._make_entry(_signature(primitive, True, True), self._op_body)
        self.op = torch.library.custom_op(f"astrai_kernels::{primitive.name}", entry,
                                          mutates_args=())
        self.op.register_fake(self._make_entry(_signature(primitive, True, True),
                                               self._fake_body))

    @staticmethod
    def _make_entry(signature, impl):
        def entry(*args):
            return impl(*args)
        entry.__signature__ = signature
        return entry

    def _split(self, args, floats_are_tensors):
        """``(tensors, params, compute_grad, rest)`` from a flat schema argument list."""
        tensors = args[:self.n_tensors]
        values = list(args[self.n_tensors:self.n_tensors + len(self.field_names)])
        if floats_are_tensors:
            for i in self.runtime_floats:
                values[i] = values[i].item()
        params = self.primitive.params(**dict(zip(self.field_names, values)))
        rest = args[self.n_tensors + len(self.field_names):]
        compute_grad = rest[0] if self.optional else None
        return tensors, params, compute_grad, rest[1:] if self.optional else rest

    def _op_body(self, *args):
        tensors, params, compute_grad, (backend,) = self._split(args, True)
        return _run(self.primitive, self.kernels(backend), tensors, params, compute_grad,
                    _grad_like)

    def _fake_body(self, *args):
        tensors = args[:self.n_tensors]
        values = args[self.n_tensors:self.n_tensors + len(self.field_names)]
        params = _FieldView(dict(zip(self.field_names, values)))
        compute_grad = args[self.n_tensors + len(self.field_names)] if self.optional else None
        return _fake(self.primitive, tensors, params, compute_grad)

    def define_twin(self):
        """The ``triton_op`` twin: its body launches the Triton kernels (traced, Inductor sees
        them); it takes the floats as Python floats."""
        def twin_body(*args):
            tensors, params, compute_grad, _ = self._split(args, False)
            return _run(self.primitive, self.kernels("triton"), tensors, params,
                        compute_grad, torch.empty_like)
        entry = self._make_entry(_signature(self.primitive, False, False), twin_body)
        return torch.library.triton_op(f"astrai_kernels::triton_{self.primitive.name}", entry,
                                       mutates_args=())

    def __call__(self, *args):
        """``(*tensors, params, [compute_grad,] backend)``: the primitive's outputs."""
        tensors = args[:self.n_tensors]
        params = args[self.n_tensors]
        compute_grad = args[self.n_tensors + 1] if self.optional else None
        backend = args[-1]
        if runs_eagerly(tensors):
            return _run(self.primitive, self.kernels(backend), tensors,
                        args_of(params, self.primitive.params), compute_grad, _grad_like)
        values = [getattr(params, name) for name in self.field_names]
        flags = (compute_grad,) if self.optional else ()
        if (backend == "triton" and self.triton_twin and TRITON_OPS
                and _triton_twins_defined()):
            return _TRITON_TWINS[self.primitive.name](*tensors, *values, *flags)
        for i in self.runtime_floats:
            values[i] = float_arg(values[i])
        return self.op(*tensors, *values, *flags, backend)


class _FieldView:
    """The params' fields as attributes, as the fake implementation receives them."""

    def __init__(self, values):
        self.__dict__.update(values)




TRITON_OPS = hasattr(torch.library, "triton_op")
_TRITON_TWINS = {}


def _triton_twins_defined():
    """Define the ``triton_op`` twins on the first traced triton call (it imports Inductor and
    Triton); True."""
    if not _TRITON_TWINS:
        _TRITON_TWINS.update({name: generated.define_twin()
                              for name, generated in _GENERATED.items()
                              if generated.triton_twin})
    return True


# Run as plain Python when Dynamo meets it (defining the twins cannot be traced); it takes
# no argument, so its result is a constant.
_triton_twins_defined._dynamo_marked_constant = True

_GENERATED = {name: _Generated(primitive) for name, primitive in PRIMITIVES.items()}


def optional_primitive_op(name, kernels):
    """The custom op, fake and eager wrapper of the optional primitive ``name``
    (``kernels/primitives.py``), run by the module ``kernels(backend)`` gives: a resolver of
    ``kernels/`` (``registry.backend_module``, or ``portable_sampling.sampling_kernels``, which
    falls back to chunked torch on a backend without the primitive). No Triton twin: traced, a
    triton call runs through the opaque op."""
    generated = _Generated(declared(name), kernels, triton_twin=False)
    _GENERATED[name] = generated
    return generated

logprobs_forward = _GENERATED["logprobs_forward"]
logprobs_backward = _GENERATED["logprobs_backward"]
cross_entropy_forward = _GENERATED["cross_entropy_forward"]
grpo_forward = _GENERATED["grpo_forward"]
distill_forward = _GENERATED["distill_forward"]
distill_backward = _GENERATED["distill_backward"]
