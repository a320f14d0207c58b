"""The errors every rank raises together, where docs/distributed.md first showed them: they live
in ``astrai_kernels.distributed`` (``distributed/agreement.py``)."""

from ..distributed.agreement import (
    RankRefused,
    RankRefusedNotImplemented,
    RankRefusedRuntime,
    RankRefusedType,
    RanksDisagree,
)

__all__ = ["RankRefused", "RankRefusedNotImplemented", "RankRefusedRuntime", "RankRefusedType",
           "RanksDisagree"]
