"""Bridges to the libraries users train with.

``astrai_kernels.integrations.transformers`` (the optional extra ``transformers``) makes a Hugging
Face causal LM compute its training loss through the fused LM head;
``astrai_kernels.integrations.trl`` (the extra ``trl``) serves TRL 1.16 trainers' fused-head
calls with it. This package imports nothing
from those libraries itself; each bridge imports its library when it is used.
"""
