"""The ``triton`` backend: the primitives of ``kernels/primitives.py`` as fused Triton kernels.

Runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module
was imported (the kernels are then built for Triton's interpreter; that is how the tests run them).
No primitive synchronizes with the host. Every launch goes through :func:`_launch`, which is also
how :func:`compile_configurations` lists what the compile-check must build.
"""

import math
import os

import torch

from ..primitives import (
    CrossEntropyArgs,
    DistillArgs,
    LogprobsArgs,
    SamplingArgs,
    ShardGradArgs,
    SurrogateArgs,
)
from . import config

try:
    import triton

    from . import cross_entropy as _ce
    from . import distill as _distill
    from . import grpo as _grpo
    from . import helpers as _helpers
    from . import logprobs as _lp
    from . import sampling as _sampling
    from . import vocab_shard as _shard
    _IMPORT_ERROR = None
except Exception as exc:  # ImportError, or a triton too broken to build the kernels
    triton = None
    _IMPORT_ERROR = exc

INTERPRET_ENV = "TRITON_INTERPRET"


def import_error():
    """The exception that importing triton (or building the kernels) raised, None if it worked."""
    return _IMPORT_ERROR


def kernels_interpreted():
    """True when the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    if _IMPORT_ERROR is not None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(_lp.logprobs_fwd_kernel, InterpretedFunction)


def unavailable_reason(device):
    device = torch.device(device)
    if _IMPORT_ERROR is not None:
        return f"triton could not be imported ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR})"
    if kernels_interpreted():
        return None
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if os.environ.get(INTERPRET_ENV) == "1":
        return ("TRITON_INTERPRET=1 was set after astrai_kernels.kernels.triton was imported; "
                "set it before importing astrai_kernels to run the triton backend on CPU")
    return "the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 to run on CPU"


# ---------------------------------------------------------------------------------------------
# launching (and recording launches for the compile-check)

_RECORDER = None


def _identity(kernel):
    return kernel


# ``wrap_triton`` makes a launch visible to tracing (torch.compile, make_fx) inside the
# ``triton_op`` ops of ``kernels/library.py``; run eagerly it launches the kernel as is. torch < 2.6
# has none, and interpreted kernels cannot be traced, so both launch the kernel directly.
_wrap_triton = getattr(torch.library, "wrap_triton", None)
if _wrap_triton is None or kernels_interpreted():
    _wrap_triton = _identity


def _launch(kernel, n_programs, args, meta, num_warps):
    if _RECORDER is not None:
        _RECORDER.append((kernel, args, meta, num_warps))
        return
    _wrap_triton(kernel)[(n_programs,)](*args, **meta, num_warps=num_warps)


def _rows_f32(x):
    """A per-row input as a contiguous float32 vector (a no-op for what the ops pass)."""
    return x.reshape(-1).to(torch.float32).contiguous()


def _vector(x):
    """``(tensor, stride)`` of a 1-D float32 view of ``x``; an expanded scalar keeps stride 0."""
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    return x, (x.stride(0) if x.numel() > 1 else 0)


def _row_bytes(logits):
    return logits.shape[-1] * logits.element_size()


def _tile_config(logits, grad=None):
    unit = logits.stride(-1) == 1 or logits.shape[-1] <= 1
    if grad is not None:
        unit = unit and (grad.stride(-1) == 1 or grad.shape[-1] <= 1)
    return config.tile_config(logits.shape[-1], logits.dtype, unit_stride=unit)


# ---------------------------------------------------------------------------------------------
# primitives (signatures and semantics: kernels/primitives.py)

def logprobs_forward(logits, target, params):
    temperature, ignore_index, with_entropy = (
        params.temperature, params.ignore_index, params.with_entropy)
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    target = target.reshape(-1).contiguous()
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
    if n_rows == 0:
        return logp, entropy, lse
    cfg = _tile_config(logits)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device, rereads=False)
    _launch(_lp.logprobs_fwd_kernel, programs,
            (logits, target, logp, entropy if with_entropy else logp, lse,
             n_rows, inner, vocab, *logits.stride(), float(temperature), int(ignore_index)),
            dict(BLOCK_V=cfg.block_v, ONE_TILE=cfg.one_tile, WITH_ENTROPY=bool(with_entropy)),
            cfg.num_warps)
    return logp, entropy, lse


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, params, grad):
    temperature, ignore_index = params.temperature, params.ignore_index
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    if n_rows == 0 or vocab == 0:
        return None
    with_entropy = grad_entropy.numel() > 0
    target = target.reshape(-1).contiguous()
    lse = _rows_f32(lse)
    grad_logp, grad_logp_stride = _vector(grad_logp)
    if with_entropy:
        entropy = _rows_f32(entropy)
        grad_entropy, grad_entropy_stride = _vector(grad_entropy)
    else:
        entropy, grad_entropy, grad_entropy_stride = lse, lse, 0
    cfg = _tile_config(logits, grad)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device, rereads=False)
    _launch(_lp.logprobs_bwd_kernel, programs,
            (logits, target, lse, entropy, grad_logp, grad_entropy, grad,
             n_rows, inner, vocab, *logits.stride(), *grad.stride(),
             grad_logp_stride, grad_entropy_stride, float(temperature), int(ignore_index)),
            dict(BLOCK_V=cfg.block_v, WITH_ENTROPY=with_entropy), cfg.num_warps)
    return None


def cross_entropy_forward(logits, target, grad_scale, params, grad):
    ignore_index, label_smoothing, z_loss, softcap, logit_scale = (
        params.ignore_index, params.label_smoothing, params.z_loss, params.softcap,
        float(params.logit_scale))
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    target = target.reshape(-1).contiguous()
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if n_rows == 0:
        return loss, lse
    has_grad = grad is not None
    if has_grad:
        grad_scale, grad_scale_stride = _vector(grad_scale)
        grad_strides = grad.stride()
    else:
        grad, grad_scale, grad_scale_stride, grad_strides = loss, loss, 0, (0, 0, 0)
    softcap = float(softcap or 0.0)
    label_smoothing = float(label_smoothing)
    cfg = _tile_config(logits, grad if has_grad else None)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device,
                                   rereads=has_grad and not cfg.one_tile)
    _launch(_ce.cross_entropy_fwd_kernel, programs,
            (logits, target, loss, lse, grad, grad_scale,
             n_rows, inner, vocab, *logits.stride(), *grad_strides, grad_scale_stride,
             int(ignore_index), label_smoothing, float(z_loss), softcap, logit_scale),
            dict(BLOCK_V=cfg.block_v, ONE_TILE=cfg.one_tile, HAS_SMOOTHING=label_smoothing != 0.0,
                 HAS_SOFTCAP=softcap != 0.0, HAS_GRAD=has_grad,
                 HAS_LOGIT_SCALE=logit_scale != 1.0),
            cfg.num_warps)
    return loss, lse


def grpo_forward(logits, target, advantages, old_logprobs, ref_logprobs, token_weight, params,
                 grad):
    temperature, clip_low, clip_high, delta, beta = (
        params.temperature, params.clip_eps_low, params.clip_eps_high, params.delta, params.beta)
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    beta = float(beta or 0.0)
    has_old = old_logprobs is not None
    has_ref = beta > 0.0
    if has_ref and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta > 0")
    with_entropy = bool(params.with_entropy)
    target = target.reshape(-1).contiguous()
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
    if n_rows == 0:
        return logp, loss, entropy
    advantages = _rows_f32(advantages)
    token_weight = _rows_f32(token_weight)
    old_logprobs = _rows_f32(old_logprobs) if has_old else advantages
    ref_logprobs = _rows_f32(ref_logprobs) if has_ref else advantages
    has_grad = grad is not None
    grad_strides = grad.stride() if has_grad else (0, 0, 0)
    cfg = _tile_config(logits, grad)
    if not has_grad:
        grad = logp
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device,
                                   rereads=has_grad and not cfg.one_tile)
    _launch(_grpo.grpo_fwd_kernel, programs,
            (logits, target, advantages, old_logprobs, ref_logprobs, token_weight, logp, loss,
             entropy if with_entropy else logp, grad, n_rows, inner, vocab, *logits.stride(),
             *grad_strides, float(temperature), float(clip_low), float(clip_high),
             float(delta or 0.0), beta),
            dict(BLOCK_V=cfg.block_v, ONE_TILE=cfg.one_tile, HAS_OLD=has_old, HAS_REF=has_ref,
                 KL_RATIO_CORRECTION=has_ref and bool(params.kl_ratio_correction),
                 WITH_ENTROPY=with_entropy, HAS_GRAD=has_grad),
            cfg.num_warps)
    return logp, loss, entropy


def _distill_launch(student, teacher, grad=None):
    """Tile config for a distill kernel: two rows (student, teacher) per tile, from the wider of
    the two dtypes, unit stride only if every operand has it."""
    operands = (student, teacher) if grad is None else (student, teacher, grad)
    unit = all(t.stride(-1) == 1 or t.shape[-1] <= 1 for t in operands)
    wide = max(student, teacher, key=lambda t: t.element_size())
    return config.tile_config(student.shape[-1], wide.dtype, unit_stride=unit, rows=2)


#: log2(e): the distill kernels keep their logs in base 2
_LOG2E = 1.0 / math.log(2.0)


def _log2_weights(params):
    """``(w_t, w_s, log2 w_s, log2 w_t)``: the mixture weights of ``primitives.mixture_weights``
    (natural logs, shared by every backend) with the logs turned to base 2 here, the one place
    the Triton kernels' base enters (``-inf`` at ``beta = 1`` stays ``-inf``)."""
    w = params.weights
    return w.w_t, w.w_s, w.log_w_s * _LOG2E, w.log_w_t * _LOG2E


def distill_forward(student, teacher, target, grad_scale, params, grad):
    """The forward kernel; with ``grad``, then the backward kernel with ``grad_scale`` as every
    row's upstream gradient (not fused into the forward here, unlike the cpp kernel)."""
    outputs = _distill_forward(student, teacher, target, params)
    if grad is not None:
        grad_loss = _rows_f32(grad_scale).expand(target.numel())
        distill_backward(student, teacher, target, *outputs[1:], grad_loss, params, grad)
    return outputs


def _distill_forward(student, teacher, target, params):
    ignore_index, beta, temperature, hard_weight = (
        params.ignore_index, params.beta, params.temperature, params.hard_weight)
    outer, inner, vocab = student.shape
    n_rows = outer * inner
    target = target.reshape(-1).contiguous()
    loss, lse_s, lse_t, kl = (torch.empty(n_rows, dtype=torch.float32, device=student.device)
                              for _ in range(4))
    hard = bool(hard_weight)
    hard_lse = torch.empty(n_rows if hard else 0, dtype=torch.float32, device=student.device)
    if n_rows == 0:
        return loss, lse_s, lse_t, kl, hard_lse
    cfg = _distill_launch(student, teacher)
    w_t, w_s, log2_w_s, log2_w_t = _log2_weights(params)
    programs = config.row_programs(n_rows, _row_bytes(student) + _row_bytes(teacher),
                                   student.device, rereads=True)
    _launch(_distill.distill_fwd_kernel, programs,
            (student, teacher, target, loss, lse_s, lse_t, kl, hard_lse if hard else loss,
             n_rows, inner, vocab, *student.stride(), *teacher.stride(), float(temperature),
             int(ignore_index), w_t, w_s, log2_w_s, log2_w_t, float(hard_weight)),
            dict(BLOCK_V=cfg.block_v, FORWARD_KL=float(beta) == 0.0, HARD=hard,
                 HARD_OWN_STATS=hard and float(temperature) != 1.0), cfg.num_warps)
    return loss, lse_s, lse_t, kl, hard_lse


def distill_backward(student, teacher, target, student_lse, teacher_lse, student_kl, hard_lse,
                     grad_loss, params, grad):
    ignore_index, beta, temperature, hard_weight = (
        params.ignore_index, params.beta, params.temperature, params.hard_weight)
    outer, inner, vocab = student.shape
    n_rows = outer * inner
    if n_rows == 0 or vocab == 0:
        return None
    target = target.reshape(-1).contiguous()
    hard = bool(hard_weight)
    student_lse, teacher_lse = _rows_f32(student_lse), _rows_f32(teacher_lse)
    hard_lse = _rows_f32(hard_lse) if hard else student_lse
    cfg = _distill_launch(student, teacher, grad)
    _, w_s, log2_w_s, log2_w_t = _log2_weights(params)
    programs = config.row_programs(n_rows, _row_bytes(student) + _row_bytes(teacher),
                                   student.device, rereads=False)
    _launch(_distill.distill_bwd_kernel, programs,
            (student, teacher, target, student_lse, teacher_lse, _rows_f32(student_kl),
             hard_lse, _rows_f32(grad_loss), grad, n_rows, inner, vocab, *student.stride(),
             *teacher.stride(), *grad.stride(), float(temperature), int(ignore_index), w_s,
             log2_w_s, log2_w_t, float(hard_weight)),
            dict(BLOCK_V=cfg.block_v, FORWARD_KL=float(beta) == 0.0, HARD=hard,
                 HARD_OWN_STATS=hard and float(temperature) != 1.0), cfg.num_warps)
    return None


def _as_rows(grad):
    """An ``[A, B, V]`` view of ``grad`` sharing its memory, or None when no such view exists."""
    if grad.is_contiguous():
        return grad.view(1, 1, -1)
    if grad.dim() == 3:
        return grad
    if grad.dim() < 3:
        while grad.dim() < 3:
            grad = grad.unsqueeze(0)
        return grad
    try:
        return grad.view(-1, grad.shape[-2], grad.shape[-1])
    except RuntimeError:
        return None


def scale_grad_(grad, grad_output):
    """``grad *= grad_output`` in place (``grad_output`` a 0-d tensor), without a host sync.

    The kernel loads the scalar and exits when it is 1.0, so the usual ``loss.backward()`` costs a
    tiny launch and no pass over ``grad``.
    """
    if grad.numel() == 0:
        return grad
    scalar = grad_output.detach().reshape(())
    if scalar.device != grad.device:
        scalar = scalar.to(grad.device, non_blocking=True)
    rows = _as_rows(grad)
    if rows is None or rows.data_ptr() != grad.data_ptr():
        return grad.mul_(scalar)
    outer, inner, vocab = rows.shape
    cfg = _tile_config(rows)
    tiles_per_row = triton.cdiv(vocab, cfg.block_v)
    n_items = outer * inner * tiles_per_row
    _launch(_helpers.scale_kernel, config.flat_programs(n_items, grad.device),
            (rows, scalar, n_items, tiles_per_row, inner, vocab, *rows.stride()),
            dict(BLOCK_V=cfg.block_v), cfg.num_warps)
    return grad



def vocab_shard_backward(logits, target, lse, alpha, beta, gamma, delta, params, grad):
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    if n_rows == 0:
        return
    softcap = float(params.softcap or 0.0)
    target = target.reshape(-1).contiguous()
    has_beta, has_delta = beta is not None, delta is not None
    lse, alpha, gamma = _rows_f32(lse), _rows_f32(alpha), _rows_f32(gamma)
    beta = _rows_f32(beta) if has_beta else alpha  # unread without HAS_BETA
    delta = _rows_f32(delta) if has_delta else alpha  # unread without HAS_DELTA
    cfg = _tile_config(logits, grad)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device, rereads=False)
    _launch(_shard.vocab_shard_bwd_kernel, programs,
            (logits, target, lse, alpha, beta, gamma, delta, grad, n_rows, inner, vocab,
             *logits.stride(), *grad.stride(), float(params.temperature), softcap,
             int(params.ignore_index)),
            dict(BLOCK_V=cfg.block_v, HAS_BETA=has_beta, HAS_DELTA=has_delta,
                 HAS_SOFTCAP=softcap != 0.0),
            cfg.num_warps)


def sampled_logprobs_forward(logits, target, params):
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    target = target.reshape(-1).contiguous()
    logp, lse_kept, threshold, log_kept_mass = (
        torch.empty(n_rows, dtype=torch.float32, device=logits.device) for _ in range(4))
    support_size = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    in_support = torch.empty(n_rows, dtype=torch.bool, device=logits.device)
    outputs = (logp, lse_kept, threshold, log_kept_mass, support_size, in_support)
    if n_rows == 0:
        return outputs
    # the kernel's "off" values: top_k 0 (also for top_k >= V), log(min_p) -inf
    top_k = int(params.top_k) if 0 < params.top_k < vocab else 0
    log_min_p = math.log(params.min_p) if params.min_p > 0.0 else -math.inf
    cfg = _tile_config(logits)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device,
                                   rereads=not cfg.one_tile)
    _launch(_sampling.sampled_logprobs_fwd_kernel, programs,
            (logits, target, logp, lse_kept, threshold, log_kept_mass, support_size,
             in_support.view(torch.uint8), n_rows, inner, vocab, *logits.stride(),
             float(params.temperature), top_k, float(params.top_p), log_min_p,
             int(params.ignore_index)),
            dict(BLOCK_V=cfg.block_v, ONE_TILE=cfg.one_tile), cfg.num_warps)
    return outputs


def sampled_logprobs_backward(logits, target, lse_kept, threshold, coef, params, grad):
    outer, inner, vocab = logits.shape
    n_rows = outer * inner
    if n_rows == 0 or vocab == 0:
        return None
    target = target.reshape(-1).contiguous()
    cfg = _tile_config(logits, grad)
    programs = config.row_programs(n_rows, _row_bytes(logits), logits.device, rereads=False)
    _launch(_sampling.sampled_logprobs_bwd_kernel, programs,
            (logits, target, _rows_f32(lse_kept), _rows_f32(threshold), _rows_f32(coef), grad,
             n_rows, inner, vocab, *logits.stride(), *grad.stride(),
             float(params.temperature), int(params.ignore_index)),
            dict(BLOCK_V=cfg.block_v), cfg.num_warps)
    return None


# ---------------------------------------------------------------------------------------------
# what the compile-check builds

REPRESENTATIVE_VOCABS = (2048, 4096, 128256)
REPRESENTATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
               torch.uint8: "u8", torch.bool: "i1"}


def _signature_of(kernel, args, meta):
    """Signature / constexprs / 16-divisible args as Triton's JIT would specialize the launch."""
    names = list(kernel.arg_names)
    signature, constexprs, divisible = {}, {}, []
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
            divisible.append(name)  # fresh allocations and these views are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"cannot type argument {name}={value!r} of {kernel.fn.__name__}")
    for name in names[len(args):]:
        signature[name] = "constexpr"
        constexprs[name] = meta[name]
    return signature, constexprs, divisible


def _representative_calls(logits, grad):
    """Call every primitive on meta tensors with each flag combination it can be launched with."""
    device = logits.device
    n_rows = logits.shape[0] * logits.shape[1]
    target = torch.empty(n_rows, dtype=torch.int64, device=device)
    rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    one = torch.empty(1, dtype=torch.float32, device=device)
    for with_entropy in (False, True):
        args = LogprobsArgs(1.0, -100, with_entropy)
        logprobs_forward(logits, target, args)
        logprobs_backward(logits, target, rows, rows if with_entropy else rows[:0], rows,
                          rows if with_entropy else rows[:0], args, grad)
    for has_grad in (False, True):
        for smoothing in (0.0, 0.1):
            for softcap in (0.0, 30.0):
                for logit_scale in (1.0, -2.0):
                    cross_entropy_forward(
                        logits, target, one,
                        CrossEntropyArgs(-100, smoothing, 1e-4, softcap, logit_scale=logit_scale),
                        grad if has_grad else None)
        for old in (None, rows):
            for ref, beta, correction in ((None, 0.0, False), (rows, 0.04, False),
                                          (rows, 0.04, True)):
                for with_entropy in (False, True):
                    grpo_forward(logits, target, rows, old, ref, rows,
                                 SurrogateArgs(1.0, 0.2, 0.2, 0.0, beta, correction,
                                               with_entropy),
                                 grad if has_grad else None)
    for beta in (0.0, 0.5, 1.0):
        for hard_weight in (0.0, 0.5):
            for temperature in (1.0, 0.7) if hard_weight else (1.0,):
                args = DistillArgs(beta, temperature, -100, hard_weight)
                distill_forward(logits, logits, target, None, args, None)
                distill_backward(logits, logits, target, rows, rows, rows,
                                 rows if hard_weight else rows[:0], rows, args, grad)
    for has_beta in (False, True):
        for has_delta in (False, True):
            for softcap in (0.0, 30.0):
                vocab_shard_backward(logits, target, rows, rows, rows if has_beta else None, rows,
                                     rows if has_delta else None,
                                     ShardGradArgs(1.0, softcap, -100), grad)
    sampling = SamplingArgs(0.7, 50, 0.9, 0.05, -100)
    sampled_logprobs_forward(logits, target, sampling)
    sampled_logprobs_backward(logits, target, rows, rows, rows, sampling, grad)
    scale_grad_(grad, torch.empty((), dtype=torch.float32, device=device))


def compile_configurations(quick=False):
    """Every (kernel, signature, constexprs) the primitives launch, with every flag combination,
    for the representative vocab sizes and dtypes (``quick``: bf16 and fp32 only, and V in 4096
    and 128256), plus a vocabulary-strided launch.

    Each entry: ``kernel`` (name), ``fn`` (the JIT function), ``signature``, ``constexprs``,
    ``divisible`` (arg names specialized as 16-divisible), ``num_warps``, ``config`` (a short
    dict describing the launch).
    """
    global _RECORDER
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"triton could not be imported: {_IMPORT_ERROR}")
    dtypes = (torch.bfloat16, torch.float32) if quick else REPRESENTATIVE_DTYPES
    vocabs = REPRESENTATIVE_VOCABS[1:] if quick else REPRESENTATIVE_VOCABS
    cases = []
    for dtype in dtypes:
        for vocab in vocabs:
            # the x[:, :-1] view of [2, 9, V] logits: row strides (9V, V), unit vocab stride
            logits = torch.empty(2, 9, vocab, dtype=dtype, device="meta")[:, :-1]
            cases.append((vocab, dtype, logits, torch.empty(2, 8, vocab, dtype=dtype,
                                                            device="meta")))
    # a vocabulary stride != 1 (a transposed [V, N] buffer): the general address path
    vocab = REPRESENTATIVE_VOCABS[-1]
    logits = torch.empty(vocab, 16, dtype=torch.bfloat16, device="meta").t().unsqueeze(0)
    cases.append((vocab, torch.bfloat16, logits,
                  torch.empty(1, 16, vocab, dtype=torch.bfloat16, device="meta")))
    records = []
    saved = config.BLOCK_V_OVERRIDE, config.PROGRAMS_OVERRIDE
    config.BLOCK_V_OVERRIDE = config.PROGRAMS_OVERRIDE = None
    _RECORDER = []
    try:
        for vocab, dtype, logits, grad in cases:
            _RECORDER.clear()
            _representative_calls(logits, grad)
            records += [(vocab, dtype, r) for r in _RECORDER]
    finally:
        _RECORDER = None
        config.BLOCK_V_OVERRIDE, config.PROGRAMS_OVERRIDE = saved
    entries, seen = [], set()
    for vocab, dtype, (kernel, args, meta, num_warps) in records:
        signature, constexprs, divisible = _signature_of(kernel, args, meta)
        key = (kernel.fn.__name__, tuple(sorted(signature.items())),
               tuple(sorted(constexprs.items())), tuple(divisible), num_warps)
        if key in seen:
            continue
        seen.add(key)
        described = {"dtype": _TYPE_NAMES[dtype], "V": vocab, "num_warps": num_warps}
        described.update({k: v for k, v in meta.items()})
        if constexprs.get("stride_v") != 1 and "stride_v" in signature:
            described["strided_vocab"] = True
        entries.append(dict(kernel=kernel.fn.__name__, fn=kernel, signature=signature,
                            constexprs=constexprs, divisible=divisible, num_warps=num_warps,
                            config=described))
    return entries
