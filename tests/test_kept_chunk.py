"""The fused head's backward starts from the forward's last chunk of logits (``ops/head.py``'s
``KeptChunk``) in ``linear_token_logprobs`` and ``linear_cross_entropy(reduction="none")``: one
chunk product fewer, the whole recompute where the rows fit in one chunk. These tests hold what
it may and may not do: the gradients are the recomputing path's (bit for bit where the order of
the float32 sum is the same), the product is skipped exactly once, the kept buffer dies with its
graph and at most one outlives its walk per thread, and a transformed head keeps nothing."""

import gc

import pytest
import torch

import astrai_kernels as ak
from astrai_kernels.ops import head as head_op
from astrai_kernels.testing.tolerances import assert_close

V, H = 96, 16


def _inputs(n_rows, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, H, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=generator) * 0.3).to(dtype).requires_grad_()
    target = torch.randint(0, V, (n_rows,), generator=generator)
    return hidden, weight, target


def _row_weights(n_rows, dtype=torch.float32):
    return torch.linspace(0.5, 1.5, n_rows, dtype=dtype)


def _logprobs_loss(hidden, weight, target, chunk_size):
    logp, entropy = ak.linear_token_logprobs(hidden, weight, target, return_entropy=True,
                                             chunk_size=chunk_size, backend="cpp")
    return logp, logp.sum() + 0.3 * entropy.sum()


def _cross_entropy_rows_loss(hidden, weight, target, chunk_size):
    rows = ak.linear_cross_entropy(hidden, weight, target, reduction="none", softcap=4.0,
                                   chunk_size=chunk_size, backend="cpp")
    return rows, (rows * _row_weights(rows.numel())).sum()


OPS = {"linear_token_logprobs": _logprobs_loss,
       "linear_cross_entropy_rows": _cross_entropy_rows_loss}


def _float64_weight_grad(op, hidden, weight, target):
    """The weight's gradient of ``OPS[op]``'s loss on the logits path, in float64."""
    hidden64 = hidden.detach().double()
    weight64 = weight.detach().double().requires_grad_()
    logits = torch.nn.functional.linear(hidden64, weight64)
    if op == "linear_token_logprobs":
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        loss = log_probs.gather(1, target[:, None]).sum() + 0.3 * entropy.sum()
    else:
        rows = torch.nn.functional.cross_entropy(4.0 * torch.tanh(logits / 4.0), target,
                                                 reduction="none")
        loss = (rows * _row_weights(rows.numel(), torch.float64)).sum()
    loss.backward()
    return weight64.grad


def _kept(out):
    """The ``KeptChunk`` of the fused-head node behind ``out`` (its autograd context)."""
    pending = [out.grad_fn]
    while pending:
        node = pending.pop()
        if node is None:
            continue
        if hasattr(node, "kept"):
            return node.kept
        pending.extend(function for function, _ in node.next_functions)
    raise AssertionError("no fused-head node behind the output")


class _ProductCounter:
    """Counts the head's chunk products: ``torch.mm`` / ``torch.addmm`` into a ``[n, V]``
    buffer (``ChunkedHead.chunks``)."""

    def __init__(self, monkeypatch):
        self.count = 0
        mm, addmm = torch.mm, torch.addmm

        def counted(function):
            def call(*args, out=None, **kwargs):
                if out is not None and out.dim() == 2 and out.shape[1] == V:
                    self.count += 1
                if out is None:
                    return function(*args, **kwargs)
                return function(*args, out=out, **kwargs)
            return call

        monkeypatch.setattr(torch, "mm", counted(mm))
        monkeypatch.setattr(torch, "addmm", counted(addmm))


def _grads(op, hidden, weight, target, chunk_size, keep, monkeypatch):
    """The op's gradients, the backward starting from the kept chunk or (``keep=False``)
    computing every chunk again, as before it was kept."""
    with monkeypatch.context() as patch:
        if not keep:
            patch.setattr(head_op.KeptChunk, "hold", lambda *args: None)
        OPS[op](hidden, weight, target, chunk_size)[1].backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    return grads


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows, chunk_size", [(40, None), (40, 16), (33, 16), (1, None)])
def test_backward_skips_the_kept_chunk(monkeypatch, op, n_rows, chunk_size):
    hidden, weight, target = _inputs(n_rows)
    counter = _ProductCounter(monkeypatch)
    out, loss = OPS[op](hidden, weight, target, chunk_size)
    rows = chunk_size or n_rows
    chunks = -(-n_rows // rows)
    assert counter.count == chunks
    kept = _kept(out)
    assert kept.logits is not None and tuple(kept.logits.shape) == (min(rows, n_rows), V)
    loss.backward()
    assert counter.count == 2 * chunks - 1, "the backward computed the kept chunk again"
    assert kept.logits is None, "the backward did not take the kept buffer over"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows, chunk_size", [(40, None), (40, 16), (33, 16), (1, None)])
def test_kept_chunk_gradients_are_the_recomputed_ones(monkeypatch, op, n_rows, chunk_size,
                                                      dtype):
    """The kept logits are the recomputed ones, so each row's hidden gradient is the same, bit
    for bit, and so is the weight's with one chunk; with several the kept chunk is folded into
    the float32 sum first: within the recomputing path's own error of float64, twice."""
    hidden, weight, target = _inputs(n_rows, dtype)
    kept = _grads(op, hidden, weight, target, chunk_size, True, monkeypatch)
    recomputed = _grads(op, hidden, weight, target, chunk_size, False, monkeypatch)
    torch.testing.assert_close(kept[0], recomputed[0], rtol=0, atol=0)
    if chunk_size is None or n_rows <= chunk_size:
        torch.testing.assert_close(kept[1], recomputed[1], rtol=0, atol=0)
        return
    expected = _float64_weight_grad(op, hidden, weight, target)
    assert_close(kept[1], expected, "grad", dtype, "grad_weight", naive=recomputed[1])


def test_a_newer_forward_drops_the_older_kept_chunk():
    hidden, weight, target = _inputs(24)
    first = ak.linear_token_logprobs(hidden, weight, target, backend="cpp")
    assert _kept(first).logits is not None
    second = ak.linear_token_logprobs(hidden, weight, target, backend="cpp")
    assert _kept(first).logits is None
    assert _kept(second).logits is not None
    # the older graph recomputes: its gradients are the newer one's
    first.sum().backward()
    grad_first = hidden.grad.clone()
    hidden.grad = None
    second.sum().backward()
    torch.testing.assert_close(hidden.grad, grad_first, rtol=0, atol=0)


def test_the_kept_buffer_goes_with_its_graph():
    hidden, weight, target = _inputs(24)
    logp = ak.linear_token_logprobs(hidden, weight, target, backend="cpp")
    buffer_ref = _kept(logp).logits.untyped_storage()._weak_ref()
    del logp
    gc.collect()
    assert torch.UntypedStorage._expired(buffer_ref), "the kept chunk outlived its graph"


def test_retained_graph_recomputes_the_second_time():
    """The first backward takes the kept chunk, the second computes it again: the same
    gradients, bit for bit (one chunk: the same order of the float32 sum)."""
    hidden, weight, target = _inputs(40)
    _, loss = _logprobs_loss(hidden, weight, target, None)
    loss.backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss.backward()
    torch.testing.assert_close(hidden.grad, first[0], rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, first[1], rtol=0, atol=0)


@pytest.mark.parametrize("transform", [dict(softcap=3.0), dict(logit_scale=0.5)])
def test_a_transformed_head_keeps_nothing(transform):
    hidden, weight, target = _inputs(24)
    logp = ak.linear_token_logprobs(hidden, weight, target, backend="cpp", **transform)
    assert _kept(logp).logits is None
