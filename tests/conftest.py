import importlib.util
import os
import sys

import pytest
import torch

# Without CUDA the triton backend runs under the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ASTRAI_KERNELS_BACKEND", None)


def pytest_sessionstart(session):
    # triton is a dependency on Linux (pyproject.toml): there a missing triton fails the whole
    # suite instead of skipping the triton tests (their importorskip serves other platforms).
    if sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError("triton is not installed: it is a dependency on Linux "
                                "(pip install -e '.[test]'); the triton tests would be skipped")
