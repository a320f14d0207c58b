"""Fused Triton kernels (the ``triton`` backend).

Importing this package never imports triton; ``astrai_kernels.kernels.triton.backend`` does,
and reports through its ``unavailable_reason`` when triton is missing.
"""
