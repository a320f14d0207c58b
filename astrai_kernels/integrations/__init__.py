"""Bridges to the libraries users train with.

``astrai_kernels.integrations.transformers`` (the optional extra ``transformers``) makes a Hugging
Face causal LM compute its training loss through the fused LM head;
``astrai_kernels.integrations.trl`` (the extra ``trl``) serves TRL 1.16 trainers' fused-head
calls with it; ``astrai_kernels.integrations.verl`` (the extra ``verl``, a venv of its own)
adds the fused-kernel backend ``astrai`` to verl 0.9. This package imports nothing
from those libraries itself; each bridge imports its library when it is used.
"""
