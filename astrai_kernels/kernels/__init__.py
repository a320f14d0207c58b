"""The ground floor: what every op stands on, and nothing above it.

- ``primitives``: the backend contract (each primitive's tensors, params and meaning);
- ``registry``: which backend serves a call (``triton``, ``cpp``, ``torch``, ``reference``);
- ``library``: the custom ops, fakes and Triton twins generated from the primitives;
- ``memory``: the CPU gradient cache the backends draw their outputs from;
- the backends: ``triton/`` (CUDA), ``cpp/`` (CPU, C++ from ``csrc/``), ``portable`` (chunked
  torch, any device), and ``portable_sampling``: the sampler's optional primitives in chunked
  torch, for a backend without them.

Nothing here imports ``ops``, ``strategies`` or the integrations; importing this package imports
neither triton nor the C++ extension.
"""
