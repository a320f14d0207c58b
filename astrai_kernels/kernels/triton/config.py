"""The one launch rule of the Triton kernels: tile size and warps from (V, dtype), grid from the row
count. Every launch and the compile-check use it.

Rule:

* Each thread holds 32 bytes of a tile (two 16-byte vector loads): 16 elements of 16-bit logits,
  8 of fp32; with a vocabulary stride != 1 (no vector loads, 64-bit addresses per element) only 4.
  Kernels that hold two rows' tiles at once (distillation: student and teacher) split those
  32 bytes between them (half the tile).
* ``BLOCK_V = min(next_pow2(V), 8 warps * 32 threads * elements per thread)``: 4096 for 16-bit,
  2048 for fp32 (8 KiB tiles either way), 1024 when strided.
* ``num_warps = clamp(BLOCK_V // (32 * elements per thread), 1, 8)``. With the next tile
  prefetched while the current one is reduced (16 KiB of loads in flight per program), the
  heaviest kernels stay at <= 128 registers with no spills on sm_80 and sm_90 (see
  ``compile_check``), so at least two 8-warp programs fit per SM.
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

BYTES_PER_THREAD = 32
STRIDED_ELEMENTS_PER_THREAD = 4
MAX_WARPS = 8
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


def tile_config(vocab, dtype, unit_stride=True, rows=1):
    """``TileConfig`` for rows of ``vocab`` elements of ``dtype`` (the rule above).

    ``unit_stride``: the vocabulary dimension of the logits (and of the gradient) is contiguous.
    ``rows``: tiles of that many rows are live at once (distillation's student and teacher):
    each thread's share of the 32 bytes is split between them.
    """
    if unit_stride:
        per_thread = BYTES_PER_THREAD // torch.empty((), dtype=dtype).element_size()
    else:
        per_thread = STRIDED_ELEMENTS_PER_THREAD
    per_thread = max(1, per_thread // rows)
    max_block = BLOCK_V_OVERRIDE or MAX_WARPS * 32 * per_thread
    block_v = min(next_power_of_2(max(int(vocab), 1)), max_block)
    num_warps = max(1, min(MAX_WARPS, block_v // (32 * per_thread)))
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
