"""The fused-LM-head cases: hidden states ``[N, H]`` (GRPO ``[B, T, H]``, T = N / B) and an LM
head ``weight [V, H]``, both requiring grad, one forward + backward per call.

* ``linear_cross_entropy``: the mean cross-entropy, ``backward()``.
* ``linear_token_logprobs``: the token log-probs, ``.sum().backward()``.
* ``linear_token_logprobs_entropy``: the token log-probs and entropies
  (``return_entropy=True``, what a GRPO step logs), ``(logp + entropy).sum().backward()``.
* ``linear_grpo``: one GRPO step: the old and the reference model's log-probs forward-only
  (their own hidden states and heads, no gradient), then the policy's loss forward + backward.
* ``linear_distill``: ``linear_distill_loss`` (beta 0.5, batchmean) of a student (hidden and
  head requiring grad) against a frozen teacher of the same shapes, ``backward()``.

Methods: a backend (``ak.linear_*`` with ``backend=``), ``naive`` (``F.linear`` then the seed's
fp32 math on the materialized logits), ``torch_lce`` / ``torch_lce_chunked``
(``torch.nn.functional.linear_cross_entropy`` without / with ``LinearCrossEntropyOptions()``;
token log-probs are minus its ``reduction="none"`` result; only for those two ops), and
``gemm``, the floor: the three matmuls any fused forward + backward must do,
``hidden @ weight.T`` (logits), ``dlogits @ weight`` (hidden's gradient) and
``dlogits.T @ hidden`` (weight's gradient), at the case's shapes and dtype into preallocated
outputs (``linear_grpo``: plus one forward matmul each for the old and the reference model;
``linear_distill``: plus the teacher's).
Its median is the linear ops' ``floor_s``.

Memory: the weight is scaled by ``H**-0.5`` so the logits are O(1) as in a trained model.
``grad_bytes`` is what the gradients of hidden and weight take in the case's dtype;
``peak_bound_bytes`` is issue 13's bound on a fused head's extra memory: those gradients, an
fp32 weight-sized accumulator and a chunk's workspace: 96 MiB, or where the head's rule gives
a chunk more rows (``ops.head.MIN_GEMM_ROWS`` at a large vocabulary) 8 bytes per logit of it
(a 16-bit buffer and its float32 copy, or a float32 buffer and a soft-cap's tanh).
"""

from ..baselines import original
from ..ops.head import chunk_rows
from .cases import (
    GEMM_COUNT,
    GRPO_BATCH,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    LINEAR_OPS,
    LINEAR_WORKSPACE_BOUND,
    split_method,
    torch_dtype,
)
from .workloads import (
    DISTILL_BETA,
    Workload,
    check_method,
    grpo_batch,
    naive_distill,
    seed_grpo_loss,
)


def _torch_lce_options(method):
    import torch

    return torch.nn.LinearCrossEntropyOptions() if method == "torch_lce_chunked" else None


def logprobs_fn(method):
    """``fn(hidden, weight, target) -> float32 token log-probs`` of a non-gemm method."""
    import torch.nn.functional as F

    if method == "naive":
        return lambda h, w, y: original.log_softmax_gather(F.linear(h, w), y)
    if method in ("torch_lce", "torch_lce_chunked"):
        options = _torch_lce_options(method)

        def torch_lce_logprobs(h, w, y):
            loss = F.linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, y.reshape(-1),
                                          reduction="none", options=options)
            return -loss.reshape(y.shape).float()
        return torch_lce_logprobs
    import astrai_kernels as ak

    return lambda h, w, y: ak.linear_token_logprobs(h, w, y, backend=method)


def logprobs_entropy_fn(method):
    """``fn(hidden, weight, target) -> (log-probs, entropies)``, float32, of a non-gemm method."""
    import torch.nn.functional as F

    if method == "naive":
        def naive_logprobs_entropy(h, w, y):
            logp_all = F.linear(h, w).float().log_softmax(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1), entropy
        return naive_logprobs_entropy
    import astrai_kernels as ak

    return lambda h, w, y: ak.linear_token_logprobs(h, w, y, return_entropy=True,
                                                    backend=method)


def distill_fn(method):
    """``fn(student_hidden, student_weight, teacher_hidden, teacher_weight, target) -> loss``."""
    import torch.nn.functional as F

    if method == "naive":
        return lambda hs, ws, ht, wt, y: naive_distill(F.linear(hs, ws), F.linear(ht, wt), y)
    import astrai_kernels as ak

    return lambda hs, ws, ht, wt, y: ak.linear_distill_loss(hs, ws, ht, wt, y,
                                                            beta=DISTILL_BETA, backend=method)


def cross_entropy_fn(method):
    """``fn(hidden, weight, target) -> mean cross-entropy`` of a non-gemm method."""
    import torch.nn.functional as F

    if method == "naive":
        return lambda h, w, y: original.cross_entropy(F.linear(h, w), y)
    if method in ("torch_lce", "torch_lce_chunked"):
        options = _torch_lce_options(method)
        return lambda h, w, y: F.linear_cross_entropy(h, w, y, options=options)
    import astrai_kernels as ak

    return lambda h, w, y: ak.linear_cross_entropy(h, w, y, backend=method)


class GemmFloor:
    """The floor's call: the three matmuls of a fused forward + backward into preallocated
    outputs (``logits``, ``grad_hidden``, ``grad_weight``), then ``h @ w.T`` into ``logits``
    for each ``(h, w)`` of ``forward_only``."""

    def __init__(self, hidden, weight, dlogits, forward_only=()):
        import torch

        self.hidden, self.weight, self.dlogits = hidden, weight, dlogits
        self.forward_only = list(forward_only)
        self.logits = torch.empty(dlogits.shape, dtype=dlogits.dtype, device=dlogits.device)
        self.grad_hidden = torch.empty_like(hidden)
        self.grad_weight = torch.empty_like(weight)

    def __call__(self):
        import torch

        torch.matmul(self.hidden, self.weight.T, out=self.logits)
        torch.matmul(self.dlogits, self.weight, out=self.grad_hidden)
        torch.matmul(self.dlogits.T, self.hidden, out=self.grad_weight)
        for h, w in self.forward_only:
            torch.matmul(h.reshape(-1, h.shape[-1]), w.T, out=self.logits)


def build_linear_workload(case):
    """Inputs and the call of a linear-op ``case``."""
    import torch

    if case.op not in LINEAR_OPS:
        raise ValueError(f"op must be one of {LINEAR_OPS} here, got {case.op!r}")
    check_method(case)
    rows, hidden_size, vocab = case.rows, case.hidden, case.vocab
    if hidden_size <= 0:
        raise ValueError(f"{case.op} needs the hidden size H > 0, got {hidden_size}")
    grpo = case.op == "linear_grpo"
    if grpo and rows % GRPO_BATCH:
        raise ValueError(f"linear_grpo needs rows divisible by B={GRPO_BATCH}, got {rows}")
    device = torch.device(case.device)
    dtype = torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    shape = (GRPO_BATCH, rows // GRPO_BATCH) if grpo else (rows,)

    def hidden_states(grad):
        x = torch.randn(*shape, hidden_size, dtype=dtype, device=device, generator=gen)
        return x.requires_grad_(grad)

    def head(grad):
        w = torch.randn(vocab, hidden_size, device=device, generator=gen) * hidden_size ** -0.5
        return w.to(dtype).requires_grad_(grad)

    element = torch.empty((), dtype=dtype).element_size()
    grad_bytes = (rows + vocab) * hidden_size * element
    info = {"hidden": hidden_size, "grad_bytes": grad_bytes,
            "peak_bound_bytes": grad_bytes + 4 * vocab * hidden_size + max(
                LINEAR_WORKSPACE_BOUND,
                8 * vocab * chunk_rows(rows, vocab, device, hidden=hidden_size)),
            "floor_flops": GEMM_COUNT[case.op] * 2 * rows * hidden_size * vocab}
    if grpo:
        info["grpo_shape"] = list(shape)
    logits_bytes = rows * vocab * element
    method = split_method(case.method)[0]
    hidden, weight = hidden_states(method != "gemm"), head(method != "gemm")
    target = torch.randint(0, vocab, shape, device=device, generator=gen)
    frozen = ([(hidden_states(False), head(False)) for _ in range(2)] if grpo else
              [(hidden_states(False), head(False))] if case.op == "linear_distill" else [])

    if method == "gemm":
        dlogits = torch.randn(rows, vocab, dtype=dtype, device=device, generator=gen)
        floor = GemmFloor(hidden.reshape(rows, hidden_size), weight, dlogits, frozen)
        return Workload(floor, [], logits_bytes, info=info)
    if case.op == "linear_cross_entropy":
        loss_fn = cross_entropy_fn(method)

        def run():
            loss_fn(hidden, weight, target).backward()
    elif case.op == "linear_token_logprobs":
        logp_fn = logprobs_fn(method)

        def run():
            logp_fn(hidden, weight, target).sum().backward()
    elif case.op == "linear_token_logprobs_entropy":
        logp_entropy_fn = logprobs_entropy_fn(method)

        def run():
            logp, entropy = logp_entropy_fn(hidden, weight, target)
            (logp.sum() + entropy.sum()).backward()
    elif case.op == "linear_distill":
        loss_fn = distill_fn(method)
        (teacher_h, teacher_w), = frozen

        def run():
            loss_fn(hidden, weight, teacher_h, teacher_w, target).backward()
    else:
        (old_h, old_w), (ref_h, ref_w) = frozen
        advantages, mask = grpo_batch(shape, device, gen)
        logp_fn = logprobs_fn(method)
        if method == "naive":
            def loss_fn(old, ref):
                return seed_grpo_loss(logp_fn(hidden, weight, target), old, ref, advantages, mask)
        else:
            import astrai_kernels as ak

            def loss_fn(old, ref):
                loss, _ = ak.linear_grpo_loss(
                    hidden, weight, target, advantages, mask=mask, old_logprobs=old,
                    ref_logprobs=ref, beta=GRPO_KL_COEF, clip_eps_low=GRPO_CLIP_EPS,
                    loss_type="bnpo", backend=method)
                return loss

        def run():
            with torch.no_grad():
                old = logp_fn(old_h, old_w, target)
                ref = logp_fn(ref_h, ref_w, target)
            loss_fn(old, ref).backward()
    return Workload(run, [hidden, weight], logits_bytes, info=info)
