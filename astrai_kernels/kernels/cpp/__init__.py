"""The ``cpp`` backend (``backend``): the primitives as C++ kernels from ``csrc/``, built on first
use. Importing this package builds nothing."""
