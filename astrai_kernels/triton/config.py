"""The one launch rule of the Triton kernels: tile size and warps from (V, dtype), grid from the row
count. Every launch and the compile-check use it.

Rule:

* ``BLOCK_V = min(next_pow2(V), 8192)`` for 16-bit logits, ``min(next_pow2(V), 4096)`` for fp32:
  a tile is at most 16 KiB of logits, 16 elements per thread (two 16-byte loads) for 16-bit
  logits and 16 for fp32 (four 16-byte loads) at the largest tile.
* ``num_warps = clamp(BLOCK_V // 512, 1, 16)``: 16 elements per thread at the largest tile.
* ``ONE_TILE = V <= BLOCK_V``: the whole row stays in registers between the reduction and the
  gradient, so the gradient costs no second read.
* Grid: one program per row up to ``ROWS_PER_SM_MAX`` programs per SM; rows are then walked by a
  grid-stride loop. When a kernel re-reads its row (two-pass gradient over several tiles) the
  number of programs is also capped so the rows in flight fit in about the L2 cache, keeping the
  second read an L2 hit rather than an HBM read (and tiles are re-read newest first).

Tests may set ``BLOCK_V_OVERRIDE`` (a power of two) to exercise the multi-tile paths at small V,
and ``PROGRAMS_OVERRIDE`` to exercise the grid-stride loop with few programs.
"""

from dataclasses import dataclass

import torch

MAX_TILE_BYTES = 16384
ELEMENTS_PER_THREAD = 16
MAX_WARPS = 16
ROWS_PER_SM_MAX = 16
REREAD_ROWS_PER_SM_MIN = 2
DEFAULT_L2_BYTES = 40 << 20

BLOCK_V_OVERRIDE = None
PROGRAMS_OVERRIDE = None


@dataclass(frozen=True)
class TileConfig:
    block_v: int
    num_warps: int
    one_tile: bool


def next_power_of_2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def tile_config(vocab, dtype):
    """``TileConfig`` for rows of ``vocab`` elements of ``dtype`` (the rule above)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    max_block = BLOCK_V_OVERRIDE or min(8192, MAX_TILE_BYTES // itemsize)
    block_v = min(next_power_of_2(max(int(vocab), 1)), max_block)
    num_warps = max(1, min(MAX_WARPS, block_v // (32 * ELEMENTS_PER_THREAD)))
    return TileConfig(block_v=block_v, num_warps=num_warps, one_tile=int(vocab) <= block_v)


_DEVICE_INFO = {}


def _device_info(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_INFO:
        props = torch.cuda.get_device_properties(index)
        l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
        _DEVICE_INFO[index] = (props.multi_processor_count, l2_bytes)
    return _DEVICE_INFO[index]


def row_programs(n_rows, row_bytes, device, rereads):
    """Number of programs for a row kernel over ``n_rows`` rows of ``row_bytes`` bytes each.

    ``rereads``: the kernel reads each row twice (streaming gradient pass).
    """
    if n_rows <= 0:
        return 0
    if PROGRAMS_OVERRIDE is not None:
        return max(1, min(n_rows, PROGRAMS_OVERRIDE))
    device = torch.device(device)
    if device.type != "cuda":
        return n_rows
    n_sm, l2_bytes = _device_info(device)
    per_sm = ROWS_PER_SM_MAX
    if rereads:
        fit = l2_bytes // max(1, row_bytes * n_sm)
        per_sm = max(REREAD_ROWS_PER_SM_MIN, min(ROWS_PER_SM_MAX, fit))
    return max(1, min(n_rows, n_sm * per_sm))


def flat_programs(n_items, device):
    """Programs for a grid-stride loop over ``n_items`` independent tiles (``scale_grad_``)."""
    if n_items <= 0:
        return 0
    if PROGRAMS_OVERRIDE is not None:
        return max(1, min(n_items, PROGRAMS_OVERRIDE))
    device = torch.device(device)
    if device.type != "cuda":
        return n_items
    n_sm, _ = _device_info(device)
    return max(1, min(n_items, n_sm * 8))
