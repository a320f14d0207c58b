import os

import torch

# Without CUDA the triton backend runs under the interpreter; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ASTRAI_KERNELS_BACKEND", None)
