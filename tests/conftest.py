import importlib.util
import os
import sys

import pytest
import torch

# Without CUDA the triton backend runs under the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ASTRAI_KERNELS_BACKEND", None)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: more only add spin-waiting on a busy
    machine (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_sessionstart(session):
    # triton is a dependency on Linux (pyproject.toml): there a missing triton fails the whole
    # suite instead of skipping the triton tests (their importorskip serves other platforms).
    if sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
        raise pytest.UsageError("triton is not installed: it is a dependency on Linux "
                                "(pip install -e '.[test]'); the triton tests would be skipped")
