"""The type aliases the strategy modules share (a leaf: it imports no strategy module)."""

from typing import Callable, Dict, Union

import torch
import torch.nn as nn
from torch import Tensor

#: A device as the strategies take it: ``"cuda:0"``, ``torch.device("cpu")``.
Device = Union[str, torch.device]
#: A model: called with ``input_ids=``, ``input_mask=``, ``position_ids=`` keywords, it returns a
#: dict with ``logits`` (and optionally ``aux_loss``).
Model = Union[nn.Module, Callable[..., Dict[str, Tensor]]]
