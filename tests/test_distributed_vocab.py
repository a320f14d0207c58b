"""Vocabulary-parallel ops (``process_group=``) on 2 and 3 gloo CPU ranks against the
single-process op on the concatenated vocabulary: values and each rank's shard gradient (the
hidden states' gradient too for the fused head), float32 and bfloat16, unequal shards, ignored
rows and targets in every shard.

One spawn of 3 processes runs every case: on the world (3 ranks, shards 5/2/4 of V=11) and on
a 2-rank subgroup (shards 4/7). Each case's outcome per rank comes back to a test of its own.
"""

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.distributed import vocab_shard
from astrai_kernels.ops import grpo as grpo_op
from astrai_kernels.ops._common import LogitsShape
from astrai_kernels.testing import assert_close, assert_close_elementwise, spec
from astrai_kernels.testing.multiprocess import (
    assert_ranks_passed,
    case_outcome,
    spawn_ranks,
)

from cases import spec_cross_entropy, spec_expected_and_naive, spec_grpo, spec_logprobs

VOCAB = 11
SHARDS = {2: (4, 7), 3: (5, 2, 4)}
BATCH, LENGTH, HIDDEN = 2, 6, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _target():
    # ids 0, 7, 3, 10, 6, 2, 9, 5, 1, 8, 4, 0: every shard of both layouts holds targets
    target = (torch.arange(BATCH * LENGTH) * 7 % VOCAB).reshape(BATCH, LENGTH)
    target[0, 2] = target[1, 4] = -100
    return target


def _logits(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, LENGTH, VOCAB, generator=g) * 3).to(dtype)


def _upstream(seed):
    return torch.randn(BATCH, LENGTH, generator=torch.Generator().manual_seed(seed))


def _shard_leaf(full, start, stop):
    return full[..., start:stop].detach().clone().requires_grad_(True)


def case_token_logprobs(group, start, stop, dtype):
    _check_token_logprobs(group, start, stop, dtype, _logits(dtype), _target())


def _check_token_logprobs(group, start, stop, dtype, full, target):
    temperature, g_lp, g_h = 0.7, _upstream(1), _upstream(2)
    expected, naive = spec_expected_and_naive(
        spec_logprobs, full, target.reshape(-1), temperature, -100, True, g_lp.reshape(-1),
        g_h.reshape(-1))
    shard = _shard_leaf(full, start, stop)
    logp, entropy = ak.token_logprobs(shard, target, temperature=temperature,
                                      return_entropy=True, process_group=group)
    (logp * g_lp + entropy * g_h).sum().backward()
    shape = target.shape
    assert_close(logp, expected["logp"].reshape(shape), "value", dtype, "logp",
                 naive=naive["logp"].reshape(shape))
    assert_close(entropy, expected["entropy"].reshape(shape), "value", dtype, "entropy",
                 naive=naive["entropy"].reshape(shape),
                 scale=expected["entropy_terms"].reshape(shape))
    assert shard.grad.dtype == dtype
    assert_close(shard.grad, expected["grad"][..., start:stop], "grad", dtype, "grad",
                 naive=naive["grad"][..., start:stop],
                 scale=expected["grad_terms"][..., start:stop])
    with torch.no_grad():  # forward only (old / reference policy log-probs), on auto's backend
        again = ak.token_logprobs(shard, target, temperature=temperature, process_group=group)
    assert_close(again, expected["logp"].reshape(shape), "value", dtype, "forward-only logp",
                 naive=naive["logp"].reshape(shape))


def _check_cross_entropy(group, start, stop, dtype, options, reduction, full=None, target=None):
    if full is None:
        full, target = _logits(dtype, seed=3), _target()
    valid = target != -100
    if reduction == "none":
        upstream = _upstream(4)
    else:
        upstream = torch.full(target.shape, 1.0 / float(valid.sum()))
    expected, naive = spec_expected_and_naive(
        spec_cross_entropy, full, target.reshape(-1), -100, options.get("label_smoothing", 0.0),
        options.get("z_loss", 0.0), options.get("softcap", 0.0), upstream.reshape(-1))
    shard = _shard_leaf(full, start, stop)
    loss = ak.cross_entropy(shard, target, reduction=reduction, process_group=group, **options)
    if reduction == "none":
        assert_close(loss, expected["loss"].reshape(target.shape), "value", dtype, "loss",
                     naive=naive["loss"].reshape(target.shape))
        (loss * upstream).sum().backward()
    else:
        assert_close(loss, (expected["loss"] * upstream.reshape(-1).double()).sum(), "value",
                     dtype, "loss")
        loss.backward()
    assert_close(shard.grad, expected["grad"][..., start:stop], "grad", dtype, "grad",
                 naive=naive["grad"][..., start:stop],
                 scale=expected["grad_terms"][..., start:stop])


def case_cross_entropy_mean_options(group, start, stop, dtype):
    _check_cross_entropy(group, start, stop, dtype,
                         {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}, "mean")


def case_cross_entropy_rows(group, start, stop, dtype):
    _check_cross_entropy(group, start, stop, dtype, {"label_smoothing": 0.2}, "none")


def case_cross_entropy_inplace(group, start, stop, dtype):
    """``inplace_backward`` writes the same gradient over the shard's logits."""
    full, target = _logits(dtype, seed=5), _target()
    plain = _shard_leaf(full, start, stop)
    ak.cross_entropy(plain, target, z_loss=1e-3, process_group=group).backward()
    leaf = _shard_leaf(full, start, stop)
    buffer = leaf * 1
    ak.cross_entropy(buffer, target, z_loss=1e-3, inplace_backward=True,
                     process_group=group).backward()
    assert torch.equal(leaf.grad, plain.grad)
    assert torch.equal(buffer.detach(), plain.grad)


GRPO_OPTIONS = {
    "token": dict(beta=0.04, clip_eps_low=0.2, clip_eps_high=0.28, delta=1.5, temperature=0.8,
                  loss_type="dapo", normalizer=7.0),
    "sequence": dict(importance_sampling="sequence", loss_type="grpo", temperature=1.3),
    # the GRPO family's torch math on the group's log-probs and entropies
    "family": dict(loss_type="cispo", clip_eps_high=4.0, beta=0.04, kl_ratio_correction=True,
                   entropy_coef=0.01, top_entropy_quantile=0.5, temperature=0.9),
}


def _grpo_inputs(dtype):
    g = torch.Generator().manual_seed(6)
    full, target = _logits(dtype, seed=7), _target()
    mask = target != -100
    target = torch.where(mask, target, 0)  # masked targets are never read
    advantages = torch.randn(BATCH, generator=g)
    old = torch.randn(BATCH, LENGTH, generator=g) * 0.3 - 2.5
    ref = torch.randn(BATCH, LENGTH, generator=g) * 0.3 - 2.5
    return full, target, mask, advantages, old, ref


def _check_grpo(group, start, stop, dtype, name):
    full, target, mask, advantages, old, ref = _grpo_inputs(dtype)
    options = dict(GRPO_OPTIONS[name], mask=mask, old_logprobs=old, ref_logprobs=ref)
    if name == "token":
        checked = grpo_op.plan(LogitsShape.of(full), target, advantages, **options)
        params, weight = checked.params, checked.flat_rows().weight
        expected, naive = spec_expected_and_naive(
            spec_grpo, full, target.reshape(-1), params.temperature,
            checked.flat_rows().advantages, old.reshape(-1), ref.reshape(-1), weight,
            params.clip_eps_low, params.clip_eps_high, params.delta, params.beta)
        want = (expected["loss"] * weight.double()).sum()
        want_grad, naive_grad = expected["grad"], naive["grad"]
        scale = expected["grad_terms"][..., start:stop]
    else:  # the reference op itself, float64 and the dtype's naive path
        results = {}
        for precision in (torch.float64, dtype):
            x = full.detach().to(precision).requires_grad_(True)
            value, _ = reference.grpo_loss(x, target, advantages, **options)
            value.backward()
            results[precision] = (value.detach(), x.grad)
        want, want_grad = results[torch.float64]
        naive_grad, scale = results[dtype][1], None
    shard = _shard_leaf(full, start, stop)
    loss, metrics = ak.grpo_loss(shard, target, advantages, process_group=group, **options)
    _, single_metrics = ak.grpo_loss(full.float(), target, advantages, backend="torch",
                                     **options)
    assert_close(loss, want, "value", dtype, "loss")
    for key, value in single_metrics.items():
        assert_close(metrics[key], value, "value", torch.float32, key)
    loss.backward()
    assert_close(shard.grad, want_grad[..., start:stop], "grad", dtype, "grad",
                 naive=naive_grad[..., start:stop], scale=scale)


def case_grpo_token(group, start, stop, dtype):
    _check_grpo(group, start, stop, dtype, "token")


def case_grpo_sequence(group, start, stop, dtype):
    _check_grpo(group, start, stop, dtype, "sequence")


def case_grpo_family(group, start, stop, dtype):
    _check_grpo(group, start, stop, dtype, "family")


def _head_inputs(dtype):
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5 * 3).to(dtype)
    bias = (torch.randn(VOCAB, generator=g) * 0.5).to(dtype)
    return hidden, weight, bias


def _check_head(group, start, stop, dtype, fused_fn, logits_fn, upstream, grad_logits_terms=None,
                tensors=None):
    """``fused_fn(h, w_shard, b_shard)`` against ``logits_fn(F.linear(h, w, b))`` on the whole
    vocabulary: the output, the hidden states' gradient (summed over the group) and the
    shard's rows of the weight's and bias's gradients. ``grad_logits_terms(logits)``: the
    sizes of the terms forming each logit's gradient where that gradient itself cancels.
    ``tensors``: ``(hidden, weight, bias)`` instead of ``_head_inputs(dtype)``."""
    tensors = tensors or _head_inputs(dtype)
    fused_in = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fused_fn(fused_in[0], fused_in[1][start:stop], fused_in[2][start:stop])
    got = torch.autograd.grad(out, fused_in, upstream)
    results = {}
    for precision in {torch.float64, torch.float32, dtype}:
        inputs = [t.detach().to(precision).requires_grad_(True) for t in tensors]
        logits = F.linear(*inputs)
        value = logits_fn(logits if precision == torch.float64 else logits.float())
        grads = torch.autograd.grad(value, inputs + [logits], upstream.to(value.dtype))
        results[precision] = (value.detach(), grads, inputs)
    exact, grads64, inputs64 = results[torch.float64]
    # the naive output: float32 math on logits from a GEMM in dtype (rounded to it, as the head
    # computes them where the CPU has native bfloat16 GEMMs, kernels/matmul.py's compute_dtype)
    assert_close_elementwise(out, exact, results[dtype][0], dtype=torch.float32,
                             name="output")
    dz = grads64[3] if grad_logits_terms is None else grad_logits_terms(grads64[3], inputs64)
    dz = dz.abs().reshape(-1, VOCAB)
    rows = inputs64[0].detach().abs().reshape(-1, HIDDEN)
    scales = ((dz @ inputs64[1].detach().abs()).reshape(tensors[0].shape), dz.t() @ rows,
              dz.sum(0))
    shard = (slice(None), slice(start, stop), slice(start, stop))
    for name, g, want, naive, scale, part in zip(("hidden", "weight", "bias"), got, grads64,
                                                 results[dtype][1], scales, shard):
        assert g.dtype == dtype, name
        assert_close_elementwise(g[part] if name != "hidden" else g, want[part], naive[part],
                                 scale=scale[part], dtype=dtype, name=f"grad {name}")


def case_linear_head_precision(group, start, stop, dtype):
    """16-bit gradients of the sharded head on the native matmul path, 12 chunks, V = 1501
    split evenly: the hidden states' gradient is the ranks' float32 parts summed, rounded once
    (tests/test_head_precision.py's yardstick, the head row of the tolerance table)."""
    if dtype == torch.float32:
        return
    import os

    from astrai_kernels.kernels import matmul as head_matmul
    from astrai_kernels.testing import assert_head_gradient_close

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    vocab, rows, hidden_size = 1501, 48, 16
    start, stop = rank * vocab // world, (rank + 1) * vocab // world
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(rows, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size ** -0.5 * 3).to(dtype)
    bias = (torch.randn(vocab, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    previous = os.environ.get(head_matmul.HEAD_MATMUL_ENV)
    os.environ[head_matmul.HEAD_MATMUL_ENV] = "native"
    try:
        ours = [t.detach().clone().requires_grad_(True) for t in (hidden, weight[start:stop],
                                                                  bias[start:stop])]
        ak.linear_cross_entropy(ours[0], ours[1], target, bias=ours[2], reduction="sum",
                                chunk_size=4, process_group=group).backward()
    finally:
        if previous is None:
            del os.environ[head_matmul.HEAD_MATMUL_ENV]
        else:
            os.environ[head_matmul.HEAD_MATMUL_ENV] = previous
    exact = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    reference.cross_entropy(F.linear(*exact), target, reduction="sum").backward()
    naive = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = F.linear(*naive).float()
    logits.retain_grad()
    reference.cross_entropy(logits, target, reduction="sum").backward()
    dz = logits.grad.to(dtype).double()
    unrounded = (dz @ weight.double(), dz.t() @ hidden.double(), dz.sum(0))
    parts = (slice(None), slice(start, stop), slice(start, stop))
    for name, got, want, naive_t, unrounded_t, part in zip(
            ("hidden", "weight", "bias"), ours, exact, naive, unrounded, parts):
        assert got.grad.dtype == dtype, name
        assert_head_gradient_close(got.grad, want.grad[part], naive_t.grad[part],
                                   unrounded_t[part], name=f"grad {name}")


def case_linear_token_logprobs(group, start, stop, dtype):
    target = _target()

    def fused(h, w, b):
        logp, entropy = ak.linear_token_logprobs(h, w, target, bias=b, temperature=0.9,
                                                 return_entropy=True, chunk_size=5,
                                                 process_group=group)
        return torch.stack([logp, entropy])

    def logits_fn(logits):
        return torch.stack(reference.token_logprobs(logits, target, 0.9))

    upstream = torch.stack([_upstream(9), _upstream(10)])

    def grad_logits_terms(_, inputs64):
        # the entropy's gradient cancels within a logit: judge by the terms forming it
        logits = F.linear(*(t.detach() for t in inputs64))
        return spec.logprobs_terms(logits, target.reshape(-1), 0.9, -100, True,
                                   upstream[0].reshape(-1), upstream[1].reshape(-1))["grad_terms"]

    _check_head(group, start, stop, dtype, fused, logits_fn, upstream, grad_logits_terms)


def case_linear_cross_entropy(group, start, stop, dtype):
    target = _target()
    options = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0)

    def fused(h, w, b):
        return ak.linear_cross_entropy(h, w, target, bias=b, reduction="none", chunk_size=5,
                                       process_group=group, **options)

    def logits_fn(logits):
        return reference.cross_entropy(logits, target, reduction="none", **options)

    _check_head(group, start, stop, dtype, fused, logits_fn, _upstream(11))


def case_linear_cross_entropy_reduced(group, start, stop, dtype):
    """``mean`` and ``sum``: the gradient factor is known up front, so the gradient is written
    in the forward's one walk (``head_shard_cross_entropy_walk``)."""
    target = _target()
    walk, walks = vocab_shard.head_shard_cross_entropy_walk, []

    def counted_walk(*args, **kwargs):
        walks.append(1)
        return walk(*args, **kwargs)

    vocab_shard.head_shard_cross_entropy_walk = counted_walk
    try:
        for options in (dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, softcap=4.0),
                        dict(reduction="sum"), dict(reduction="mean", normalizer=7.0)):
            def fused(h, w, b, options=options):
                return ak.linear_cross_entropy(h, w, target, bias=b, chunk_size=5,
                                               process_group=group, **options)

            def logits_fn(logits, options=options):
                return reference.cross_entropy(logits, target, **options)

            _check_head(group, start, stop, dtype, fused, logits_fn, torch.tensor(0.7))
    finally:
        vocab_shard.head_shard_cross_entropy_walk = walk
    assert walks, "the one-walk path did not run"


def case_linear_grpo(group, start, stop, dtype):
    _, target, mask, advantages, old, ref = _grpo_inputs(dtype)
    options = dict(GRPO_OPTIONS["token"], mask=mask, old_logprobs=old, ref_logprobs=ref)

    def fused(h, w, b):
        return ak.linear_grpo_loss(h, w, target, advantages, bias=b, chunk_size=5,
                                   process_group=group, **options)[0]

    def logits_fn(logits):
        return reference.grpo_loss(logits, target, advantages, **options)[0]

    def grad_logits_terms(_, inputs64):
        # dL/dlogp is formed from exps of log-prob differences: judge by spec.grpo_terms
        logits = F.linear(*(t.detach() for t in inputs64))
        checked = grpo_op.plan(LogitsShape.of(logits.float()), target, advantages, **options)
        rows, params = checked.flat_rows(), checked.params
        return spec.grpo_terms(logits, target.reshape(-1), params.temperature, rows.advantages,
                               rows.old, rows.ref, rows.weight, params.clip_eps_low,
                               params.clip_eps_high, params.delta, params.beta)

    _check_head(group, start, stop, dtype, fused, logits_fn, torch.tensor(1.0),
                grad_logits_terms)


def case_reference_backend(group, start, stop, dtype):
    """``backend="reference"`` gathers the full logits: same values, same shard gradient."""
    full, target = _logits(dtype, seed=12), _target()
    results = []
    for backend in ("reference", "torch"):
        shard = _shard_leaf(full, start, stop)
        loss = ak.cross_entropy(shard, target, label_smoothing=0.1, process_group=group,
                                backend=backend)
        loss.backward()
        results.append((loss.detach(), shard.grad))
    (ref_loss, ref_grad), (loss, grad) = results
    assert_close(loss, ref_loss.double(), "value", dtype, "loss")
    assert_close(grad, ref_grad.double(), "grad", dtype, "grad",
                 naive=ref_grad, scale=ref_grad.double().abs() + 1.0 / VOCAB)


def case_backends_and_errors(group, start, stop, dtype):
    """The cpp and triton (interpreted) backends' shard gradients equal the torch backend's; a
    backend without ``vocab_shard_backward`` names itself when a gradient is asked for; bad
    input raises before any collective hangs."""
    full, target = _logits(dtype, seed=13), _target()
    results = {}
    for backend in ak.available_backends("cpu"):
        if backend == "reference":
            continue
        shard = _shard_leaf(full, start, stop)
        logp, entropy = ak.token_logprobs(shard, target, process_group=group, backend=backend,
                                          temperature=0.7, return_entropy=True)
        (logp.sum() + 0.5 * entropy.sum()).backward()
        results[backend] = (logp.detach(), shard.grad)
    torch_logp, torch_grad = results["torch"]
    for backend in ("triton", "cpp"):
        if backend in results:
            got_logp, got_grad = results[backend]
            assert_close(got_logp, torch_logp.double(), "value", dtype, f"{backend} logp")
            assert_close(got_grad, torch_grad.double(), "grad", dtype, f"{backend} shard grad",
                         naive=torch_grad, scale=torch_grad.double().abs() + 1.0 / VOCAB)
    # a backend module without the primitive: auto falls back to torch, by name it refuses
    saved = vocab_shard.backend_module
    vocab_shard.backend_module = lambda name: types.SimpleNamespace()
    try:
        with pytest.raises(NotImplementedError, match="'cpp'"):
            vocab_shard.shard_backend("cpp", "cpp", needs_grad=True)
        assert vocab_shard.shard_backend("auto", "cpp", needs_grad=True) == "torch"
    finally:
        vocab_shard.backend_module = saved
    assert vocab_shard.shard_backend("auto", "cpp", needs_grad=True) == "cpp"
    with pytest.raises(ValueError, match="target holds 11"):
        ak.cross_entropy(_shard_leaf(full, start, stop), torch.full_like(target, VOCAB),
                         process_group=group)
    with pytest.raises(TypeError, match="process_group"):
        ak.cross_entropy(_shard_leaf(full, start, stop), target, process_group="world")


def case_empty_and_all_ignored(group, start, stop, dtype):
    """No rows, and every row ignored: zeros, zero gradients, no NaN."""
    full = _logits(dtype, seed=14)
    shard = _shard_leaf(full, start, stop)
    ignored = torch.full(full.shape[:-1], -100)
    loss = ak.cross_entropy(shard, ignored, z_loss=1e-3, process_group=group)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(shard.grad) == 0
    empty = shard[:, :0].detach().requires_grad_(True)
    logp = ak.token_logprobs(empty, ignored[:, :0], process_group=group)
    logp.sum().backward()
    assert logp.shape == (BATCH, 0) and empty.grad.shape == empty.shape


# issue 24 item 3: a shard whose row is all -inf (a padded vocabulary masked on the last rank)

def _masked_last_shard(group):
    """The first vocabulary id of the group's last shard, and targets outside that shard."""
    masked_from = VOCAB - SHARDS[dist.get_world_size(group)][-1]
    target = _target()
    return masked_from, torch.where(target >= masked_from, target % masked_from, target)


def case_all_inf_shard(group, start, stop, dtype):
    """Logits -inf on the whole last shard: finite values and gradients, as unsharded (and a
    target inside that shard has log-prob -inf, as unsharded)."""
    masked_from, target = _masked_last_shard(group)
    full = _logits(dtype, seed=15)
    full[..., masked_from:] = float("-inf")
    _check_token_logprobs(group, start, stop, dtype, full, target)
    _check_cross_entropy(group, start, stop, dtype, {"z_loss": 1e-3}, "mean", full, target)
    _check_cross_entropy(group, start, stop, dtype, {}, "none", full, target)
    inside = torch.full_like(target, masked_from)
    with torch.no_grad():
        logp = ak.token_logprobs(full[..., start:stop], inside, process_group=group)
    assert torch.equal(logp, torch.full_like(logp, float("-inf")))


def _masked_bias_head(group, dtype):
    """Small dyadic entries, so the logits are exact in bfloat16 too (the output is then
    judged against float64 without the logits' rounding); a -inf bias on the last shard."""
    g = torch.Generator().manual_seed(20)
    hidden = torch.randint(-2, 3, (BATCH, LENGTH, HIDDEN), generator=g) / 2
    weight = torch.randint(-4, 5, (VOCAB, HIDDEN), generator=g) / 8
    bias = torch.randint(-4, 5, (VOCAB,), generator=g) / 4
    masked_from, target = _masked_last_shard(group)
    bias[masked_from:] = float("-inf")
    return tuple(t.to(dtype) for t in (hidden, weight, bias)), target


def case_all_inf_shard_linear(group, start, stop, dtype):
    """The fused head with a -inf bias on the whole last shard."""
    tensors, target = _masked_bias_head(group, dtype)

    def fused_ce(h, w, b):
        return ak.linear_cross_entropy(h, w, target, bias=b, reduction="none", z_loss=1e-3,
                                       chunk_size=5, process_group=group)

    def logits_ce(logits):
        return reference.cross_entropy(logits, target, reduction="none", z_loss=1e-3)

    _check_head(group, start, stop, dtype, fused_ce, logits_ce, _upstream(17), tensors=tensors)

    def fused_logprobs(h, w, b):
        return torch.stack(ak.linear_token_logprobs(h, w, target, bias=b, return_entropy=True,
                                                    chunk_size=5, process_group=group))

    def logits_logprobs(logits):
        return torch.stack(reference.token_logprobs(logits, target, 1.0))

    upstream = torch.stack([_upstream(18), _upstream(19)])

    def grad_logits_terms(_, inputs64):
        logits = F.linear(*(t.detach() for t in inputs64))
        return spec.logprobs_terms(logits, target.reshape(-1), 1.0, -100, True,
                                   upstream[0].reshape(-1), upstream[1].reshape(-1))["grad_terms"]

    _check_head(group, start, stop, dtype, fused_logprobs, logits_logprobs, upstream,
                grad_logits_terms, tensors=tensors)


# issue 24 item 4: ranks that disagree raise on every rank within the call, never hang

def case_ranks_disagree(group, start, stop, dtype):
    rank = dist.get_rank(group)
    full, target = _logits(dtype, seed=16), _target()
    shard = full[..., start:stop]
    own = target.clone()
    own[0, 0] = (own[0, 0] + rank) % VOCAB  # rank 0 keeps the shared targets
    with pytest.raises(ValueError, match="different targets"):
        ak.cross_entropy(shard, own, process_group=group)
    hidden, weight, _ = _head_inputs(dtype)
    with pytest.raises(ValueError, match="different targets"):
        ak.linear_cross_entropy(hidden, weight[start:stop], own, process_group=group)
    _, grpo_target, mask, advantages, _, _ = _grpo_inputs(dtype)
    grpo_own = grpo_target.clone()
    grpo_own[0, 0] = (grpo_own[0, 0] + rank) % VOCAB
    with pytest.raises(ValueError, match="different targets"):
        ak.grpo_loss(shard, grpo_own, advantages, mask=mask, process_group=group)
    # without the fingerprint the call runs (on the ranks' mixed targets)
    unchecked = ak.cross_entropy(shard, own, process_group=group, check_consistency=False)
    assert torch.isfinite(unchecked)
    with pytest.raises(ValueError, match="different numbers of rows"):
        ak.token_logprobs(shard[:, rank:], target[:, rank:], process_group=group)
    with pytest.raises(ValueError, match="different numbers of rows"):
        ak.linear_token_logprobs(hidden[:, rank:], weight[start:stop], target[:, rank:],
                                 process_group=group, check_consistency=False)
    # issue 24 item 6 through the vocab-parallel path: normalizer 0 with counted rows
    with pytest.raises(ValueError, match="normalizer"):
        ak.cross_entropy(shard, target, normalizer=0, process_group=group)
    with pytest.raises(TypeError, match="check_consistency"):
        ak.cross_entropy(shard, target, process_group=group, check_consistency="yes")


def not_a_member(group):
    """A rank outside ``group`` (``dist.new_group`` gave it torch's non-member sentinel)."""
    full, target = _logits(torch.float32, seed=16), _target()
    with pytest.raises(ValueError, match="not a member of process_group"):
        ak.cross_entropy(full[..., :4], target, process_group=group)


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items())
         if name.startswith("case_")}


def _worker(rank, world_size):
    """Every case on every group this rank belongs to; ``{case id: error or None}``."""
    groups = {3: dist.group.WORLD, 2: dist.new_group([0, 1])}
    outcome = {}
    for size, group in groups.items():
        if rank >= size:
            outcome[f"non_member-{size}ranks"] = case_outcome(not_a_member, group)
            continue
        sizes = SHARDS[size]
        start = sum(sizes[:rank])
        stop = start + sizes[rank]
        for name, case in CASES.items():
            for dtype_id, dtype in DTYPES.items():
                outcome[f"{name}-{size}ranks-{dtype_id}"] = case_outcome(case, group, start,
                                                                         stop, dtype)
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 3, timeout=600.0)


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel(outcomes, name, size, dtype_id):
    assert_ranks_passed(outcomes, f"{name}-{size}ranks-{dtype_id}", size)


def test_non_member_rank(outcomes):
    """Rank 2 is outside the 2-rank subgroup: a clear error, not torch's "got int"."""
    assert outcomes[2]["non_member-2ranks"] is None, outcomes[2]["non_member-2ranks"]


# issue 36 item 8: a rank whose vocabulary shard is empty (V smaller than the group, or padded
# unevenly) is served, equal to the single-process op; before, it raised at once and left its
# peers waiting in the shard sizes' all-gather. Its own spawn, so a hang fails only these tests.
# Three ranks, the 4/7 split of the 2-rank cases around an empty shard (with two ranks the other
# would hold the whole vocabulary).

EMPTY_SHARD_LAYOUTS = {"empty_first": (0, 4, 7), "empty_middle": (4, 0, 7),
                       "empty_last": (4, 7, 0)}
EMPTY_SHARD_CASES = ("token_logprobs", "cross_entropy_mean_options", "cross_entropy_rows",
                     "cross_entropy_inplace", "grpo_token", "linear_token_logprobs",
                     "linear_cross_entropy", "linear_cross_entropy_reduced", "linear_grpo",
                     "reference_backend")


def _empty_shard_leaves(group, start, stop, dtype):
    """Each rank's gradients have its shard's shape (the logits', and the weight's and bias's
    of the fused head): empty tensors on the empty shard."""
    full, target = _logits(dtype, seed=21), _target()
    shard = _shard_leaf(full, start, stop)
    ak.cross_entropy(shard, target, label_smoothing=0.1, process_group=group).backward()
    assert shard.grad is not None and shard.grad.shape == shard.shape
    hidden, weight, bias = _head_inputs(dtype)
    weight, bias = (t[start:stop].detach().clone().requires_grad_(True) for t in (weight, bias))
    loss = ak.linear_cross_entropy(hidden, weight, target, bias=bias, reduction="none",
                                   process_group=group)
    loss.sum().backward()
    assert weight.grad.shape == weight.shape and bias.grad.shape == bias.shape
    assert torch.isfinite(loss).all()


def _all_shards_empty(group, start, stop, dtype):
    """No rank holds any vocabulary: the same clear error on every rank, from the shard sizes'
    all-gather."""
    full, target = _logits(dtype), _target()
    with pytest.raises(ValueError, match="every rank of process_group holds an empty vocab"):
        ak.cross_entropy(full[..., :0], target, process_group=group)
    hidden, weight, _ = _head_inputs(dtype)
    with pytest.raises(ValueError, match="every rank of process_group holds an empty vocab"):
        ak.linear_cross_entropy(hidden, weight[:0], target, process_group=group)


def _walk_default_chunks(group, start, stop, dtype):
    """``linear_cross_entropy``'s one walk with ``chunk_size=None`` under a budget that gives
    each shard size its own chunk count: every rank walks the same chunks (each chunk makes
    collectives), and the result equals the single-process one."""
    from astrai_kernels.kernels import matmul as head_matmul
    from astrai_kernels.ops import head

    budget = head.CHUNK_BYTES["cpu"]
    weight_copy = head_matmul.compute_dtype(dtype, torch.device("cpu")) != dtype
    # float32 rows of V logits: a 7-logit shard gets 4 rows per chunk, a 4-logit one 7, ...
    head.CHUNK_BYTES["cpu"] = 112 * (head.WEIGHT_COPY_SHARE if weight_copy else 1)
    target = _target()
    try:
        def fused(h, w, b):
            return ak.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.1,
                                           process_group=group)

        def logits_fn(logits):
            return reference.cross_entropy(logits, target, label_smoothing=0.1)

        _check_head(group, start, stop, dtype, fused, logits_fn, torch.tensor(0.7))
    finally:
        head.CHUNK_BYTES["cpu"] = budget


EMPTY_SHARD_RUNS = {
    **{(name, layout): CASES[name] for name in EMPTY_SHARD_CASES for layout in EMPTY_SHARD_LAYOUTS},
    **{("empty_shard_leaves", layout): _empty_shard_leaves for layout in EMPTY_SHARD_LAYOUTS},
    ("all_shards_empty", "all_empty"): _all_shards_empty,
    **{("walk_default_chunks", layout): _walk_default_chunks
       for layout in (*EMPTY_SHARD_LAYOUTS, "regular")},
}


def _empty_shard_worker(rank, world_size):
    """Every run of ``EMPTY_SHARD_RUNS`` on the 3-rank world; ``{run id: error or None}``."""
    layouts = {**EMPTY_SHARD_LAYOUTS, "all_empty": (0, 0, 0), "regular": SHARDS[3]}
    outcome = {}
    for (name, layout), case in EMPTY_SHARD_RUNS.items():
        shards = layouts[layout]
        start = sum(shards[:rank])
        for dtype_id, dtype in DTYPES.items():
            outcome[f"{name}-{layout}-{dtype_id}"] = case_outcome(
                case, dist.group.WORLD, start, start + shards[rank], dtype)
    return outcome


@pytest.fixture(scope="module")
def empty_shard_outcomes():
    return spawn_ranks(_empty_shard_worker, 3, timeout=300.0)


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("name, layout", list(EMPTY_SHARD_RUNS))
def test_empty_vocabulary_shard(empty_shard_outcomes, name, layout, dtype_id):
    assert_ranks_passed(empty_shard_outcomes, f"{name}-{layout}-{dtype_id}")
