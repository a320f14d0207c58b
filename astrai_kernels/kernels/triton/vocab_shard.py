"""The vocabulary-parallel gradient of one shard (``vocab_shard_backward`` of
``kernels/primitives.py``), one program per row at a time::

    grad_j = (1/T) * dz_j/dx_j * (p_j * (alpha + beta * log p_j) + gamma * d_jy + delta)

``p_j = exp(z_j / T - lse)`` with the group's ``lse`` (natural units): pass 2 of the other
kernels (:func:`write_grad_row`) with ``ref = 0``, ``log_sum = lse``, ``c_p = alpha``,
``c_u = beta``, ``c_const = -delta``, ``c_target = gamma``. A target outside ``[0, V)`` lies in
another shard and meets no column; an ``ignore_index`` row is written as zeros.
"""

import triton
import triton.language as tl

from .helpers import row_offset, write_grad_row, zero_row


@triton.jit
def vocab_shard_bwd_kernel(
    logits_ptr, target_ptr, lse_ptr, alpha_ptr, beta_ptr, gamma_ptr, delta_ptr, grad_ptr,
    n_rows, inner, V, stride0, stride1, stride_v, g_stride0, g_stride1, g_stride_v,
    temperature, softcap, ignore_index,
    BLOCK_V: tl.constexpr, HAS_BETA: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    inv_t = 1.0 / temperature
    for row in range(pid, n_rows, n_programs):
        target = tl.load(target_ptr + row).to(tl.int64)
        grad_row_ptr = grad_ptr + row_offset(row, inner, g_stride0, g_stride1)
        if target == ignore_index:
            zero_row(grad_row_ptr, V, g_stride_v, BLOCK_V)
        else:
            local_target = tl.where((target >= 0) & (target < V), target, -1)
            lse = tl.load(lse_ptr + row)
            alpha = tl.load(alpha_ptr + row)
            gamma = tl.load(gamma_ptr + row)
            if HAS_BETA:
                beta = tl.load(beta_ptr + row)
            else:
                beta = 0.0
            if HAS_DELTA:
                delta = tl.load(delta_ptr + row)
            else:
                delta = 0.0
            write_grad_row(logits_ptr + row_offset(row, inner, stride0, stride1), grad_row_ptr,
                           V, stride_v, g_stride_v, local_target, 0.0, lse, inv_t, gamma,
                           alpha, beta, -delta, inv_t, softcap, BLOCK_V, HAS_BETA, HAS_SOFTCAP,
                           True)
