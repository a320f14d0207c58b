"""The fused LM head ops against float64 math on ``hidden.double() @ weight.double().T``."""

import pytest
import torch
import torch.nn.functional as F

import astrai_kernels as ak
from astrai_kernels import reference
from astrai_kernels.kernels import matmul as head_matmul
from astrai_kernels.ops import head as head_op
from astrai_kernels.testing import assert_close_elementwise, spec

from cases import DTYPE_IDS, DTYPES, KERNEL_BACKENDS, spec_logprobs

BACKENDS = KERNEL_BACKENDS + ["reference"]


def _inputs(n_rows, hidden_size, vocab, dtype, seed=0, bias=True, lead=None):
    g = torch.Generator().manual_seed(seed)
    lead = (n_rows,) if lead is None else lead
    hidden = torch.randn(*lead, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size ** -0.5 * 3).to(dtype)
    bias_t = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, lead, generator=g)
    target[torch.rand(lead, generator=g) < 0.2] = -100
    return hidden, weight, bias_t, target


def _leaves(*tensors, dtype=None):
    return [None if t is None else
            (t.detach().clone() if dtype is None else t.detach().to(dtype)).requires_grad_(True)
            for t in tensors]


def _upstream(shape, seed=3):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def _grads(output, inputs, upstream):
    present = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(output, present, upstream, allow_unused=True))
    return [None if t is None else next(grads) for t in inputs]


def _term_scales(exact_in, grad_logits):
    """Size of the terms summed into each gradient entry: ``|dz| @ |W|``, ``|dz|.T @ |h|`` and
    ``sum |dz|`` with ``dz`` the float64 gradient of the logits."""
    hidden, weight = exact_in[0].detach(), exact_in[1].detach()
    dz = grad_logits.abs().reshape(-1, weight.shape[0])
    rows = hidden.reshape(-1, weight.shape[1]).abs()
    return ((dz @ weight.abs()).reshape(hidden.shape), dz.t() @ rows, dz.sum(0))


def _compare(fused_fn, logits_fn, tensors, dtype, upstream_seed=3, output_terms=None,
             grad_logits_terms=None):
    """Run ``fused_fn(h, w, b)`` and ``logits_fn(logits)`` (float64 exact and same-dtype naive)
    and compare the output and every gradient entry by entry (the shared tolerance model:
    within a small multiple of the naive path's error on that entry, or of the float64 size of
    the terms that form it)."""
    fused_in = _leaves(*tensors)
    exact_in = _leaves(*tensors, dtype=torch.float64)
    naive_in = _leaves(*tensors)
    out = fused_fn(*fused_in)
    exact_logits = F.linear(*exact_in)
    exact = logits_fn(exact_logits)
    naive = logits_fn(F.linear(*naive_in).float())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    upstream = _upstream(out.shape, upstream_seed)
    scale = None if output_terms is None else output_terms(exact_logits.detach())
    assert_close_elementwise(out, exact, naive, scale=scale, dtype=torch.float32, name="output")
    if out.numel() == 0:
        return
    got = _grads(out, fused_in, upstream)
    *want, grad_logits = _grads(exact, exact_in + [exact_logits], upstream.double())
    naive_grads = _grads(naive, naive_in, upstream)
    if grad_logits_terms is not None:  # the logits' gradient itself cancels: use its terms
        grad_logits = grad_logits_terms(exact_logits.detach(), upstream.double())
    scales = _term_scales(exact_in, grad_logits)
    for name, g, w, n, t, scale in zip(("hidden", "weight", "bias"), got, want, naive_grads,
                                       tensors, scales):
        if t is None:
            continue
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert_close_elementwise(g, w, n, scale=scale, dtype=dtype, name=f"grad {name}")


CE_OPTIONS = {
    "plain": {},
    "smooth_zloss": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "softcap": {"softcap": 4.0},
    "normalizer": {"normalizer": 11.0},
    "logit_scale": {"logit_scale": 0.5},
    "logit_scale_softcap": {"logit_scale": -1.5, "softcap": 4.0},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(CE_OPTIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy(backend, options, reduction, dtype):
    kwargs = dict(CE_OPTIONS[options])
    if reduction != "mean":
        kwargs.pop("normalizer", None)
    tensors = _inputs(37, 16, 101, dtype)
    target = tensors[3]

    def fused(h, w, b):
        return ak.linear_cross_entropy(h, w, target, bias=b, reduction=reduction, chunk_size=8,
                                       backend=backend, **kwargs)

    def logits_fn(logits):
        return reference.cross_entropy(logits, target, reduction=reduction, **kwargs)

    _compare(fused, logits_fn, tensors[:3], dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_transforms_equal_the_logits_op(backend, reduction):
    """``logit_scale`` and ``softcap`` against ``ak.cross_entropy`` on ``hidden @ weight.T +
    bias`` in float32: the logits op is the yardstick of every entry of the value and of each
    gradient (the float64 spec the expected values)."""
    kwargs = dict(logit_scale=-1.5, softcap=4.0, reduction=reduction)
    tensors = _inputs(31, 16, 97, torch.float32, seed=8)
    target = tensors[3]

    def fused(h, w, b):
        return ak.linear_cross_entropy(h, w, target, bias=b, chunk_size=8, backend=backend,
                                       **kwargs)

    def logits_fn(logits):
        if logits.dtype == torch.float64:
            return reference.cross_entropy(logits, target, **kwargs)
        return ak.cross_entropy(logits, target, backend=backend, **kwargs)

    _compare(fused, logits_fn, tensors[:3], torch.float32)


# keywords of a logits op with no meaning for its linear form (no logits buffer to overwrite)
LOGITS_ONLY_KEYWORDS = {"inplace_backward"}
LINEAR_FORMS = [("cross_entropy", "linear_cross_entropy"),
                ("token_logprobs", "linear_token_logprobs"),
                ("sequence_logprobs", "linear_sequence_logprobs"),
                ("grpo_loss", "linear_grpo_loss"), ("distill_loss", "linear_distill_loss")]


@pytest.mark.parametrize("logits_op, linear_op", LINEAR_FORMS, ids=[p[1] for p in LINEAR_FORMS])
def test_linear_forms_take_every_keyword_of_the_logits_op(logits_op, linear_op):
    import inspect

    logits_params = inspect.signature(getattr(ak, logits_op)).parameters
    linear_params = inspect.signature(getattr(ak, linear_op)).parameters
    keywords = [name for name, p in logits_params.items()
                if p.kind is p.KEYWORD_ONLY and name not in LOGITS_ONLY_KEYWORDS]
    missing = [name for name in keywords if name not in linear_params]
    assert not missing, f"{linear_op} lacks {missing} of {logits_op}"
    differ = [name for name in keywords
              if linear_params[name].default != logits_params[name].default]
    assert not differ, f"{linear_op} has other defaults for {differ}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_with_entropy(backend, dtype):
    tensors = _inputs(29, 12, 77, dtype, seed=1)
    target = tensors[3]

    def fused(h, w, b):
        logp, entropy = ak.linear_token_logprobs(h, w, target, bias=b, temperature=0.7,
                                                 return_entropy=True, chunk_size=6,
                                                 backend=backend)
        return torch.stack([logp, entropy])

    def logits_fn(logits):
        return torch.stack(reference.token_logprobs(logits, target, temperature=0.7))

    def output_terms(logits):
        """``logp = s_y - lse`` and ``H = lse - sum p s`` cancel: judge them by their terms."""
        exact = spec_logprobs(logits, target, 0.7, -100, True)
        return torch.stack([exact["logp"].abs() + exact["lse"].abs(), exact["entropy_terms"]])

    def grad_logits_terms(logits, upstream):
        return spec.logprobs_terms(logits, target, 0.7, -100, True, grad_logp=upstream[0],
                                   grad_entropy=upstream[1])["grad_terms"]

    _compare(fused, logits_fn, tensors[:3], dtype, output_terms=output_terms,
             grad_logits_terms=grad_logits_terms)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_sequence_logprobs(backend, average):
    dtype = torch.float32
    hidden, weight, bias, target = _inputs(0, 8, 50, dtype, seed=2, lead=(3, 7))
    target = target.clamp(min=0)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(4)) < 0.7
    mask[2] = False

    def fused(h, w, b):
        return ak.linear_sequence_logprobs(h, w, target, mask, bias=b, average=average,
                                           backend=backend)

    def logits_fn(logits):
        return reference.sequence_logprobs(logits, torch.where(mask, target, -100), mask,
                                           average)

    _compare(fused, logits_fn, (hidden, weight, bias), dtype)


GRPO_SETTINGS = {
    "bnpo_token": dict(loss_type="bnpo"),
    "grpo_kl_clip_high": dict(loss_type="grpo", beta=0.05, clip_eps_high=0.28),
    "dr_grpo_delta": dict(loss_type="dr_grpo", delta=1.5, max_completion_length=9),
    "dapo_normalizer": dict(loss_type="dapo", normalizer=13.0),
    "gspo": dict(loss_type="grpo", importance_sampling="sequence", beta=0.02),
    "grpo_kl_ratio_correction": dict(loss_type="grpo", beta=0.3, kl_ratio_correction=True,
                                     delta=1.2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("setting", list(GRPO_SETTINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_grpo_loss(backend, setting, dtype):
    kwargs = dict(GRPO_SETTINGS[setting])
    hidden, weight, bias, target = _inputs(0, 8, 45, dtype, seed=5, lead=(3, 6))
    target = target.clamp(min=0)
    g = torch.Generator().manual_seed(6)
    mask = (torch.rand(3, 6, generator=g) < 0.8).float()
    advantages = torch.randn(3, generator=g)
    with torch.no_grad():
        logp_now = reference.token_logprobs(F.linear(hidden, weight, bias).double(), target)[0]
    old = (logp_now + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)).float()
    ref = (logp_now + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)).float()
    kwargs.update(mask=mask, old_logprobs=old, ref_logprobs=ref)

    def fused(h, w, b):
        loss, metrics = ak.linear_grpo_loss(h, w, target, advantages, bias=b, chunk_size=5,
                                            backend=backend, **kwargs)
        assert set(metrics) >= {"kl", "ratio/mean", "clip_ratio/low", "clip_ratio/high",
                                "clip_ratio/region"}
        return loss

    def logits_fn(logits):
        return reference.grpo_loss(logits, target, advantages.to(logits.dtype),
                                   **kwargs)[0].to(logits.dtype)

    _compare(fused, logits_fn, (hidden, weight, bias), dtype)


SHAPES = {
    "one_row": dict(lead=(1,), vocab=33),
    "zero_rows": dict(lead=(0,), vocab=33),
    "3d_hidden": dict(lead=(2, 5), vocab=40),
    "vocab_below_chunk_tile": dict(lead=(9,), vocab=3),
    "one_class": dict(lead=(4,), vocab=1),
    "rows_below_chunk": dict(lead=(5,), vocab=64, chunk_size=64),
    "default_chunk": dict(lead=(11,), vocab=70, chunk_size=None),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_awkward_shapes(backend, shape):
    spec = dict(SHAPES[shape])
    chunk_size = spec.pop("chunk_size", 4)
    dtype = torch.float32
    hidden, weight, bias, target = _inputs(0, 6, spec["vocab"], dtype, seed=7, lead=spec["lead"])

    def fused(h, w, b):
        return ak.linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk_size,
                                       reduction="none", backend=backend)

    def logits_fn(logits):
        return reference.cross_entropy(logits, target, reduction="none")

    _compare(fused, logits_fn, (hidden, weight, bias), dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_non_contiguous_hidden_and_all_ignored(backend):
    hidden, weight, bias, target = _inputs(0, 10, 30, torch.float32, seed=8, lead=(4, 6))
    strided = hidden.transpose(0, 1)  # [6, 4, H], not contiguous
    target_t = target.transpose(0, 1).contiguous()

    def fused(h, w, b):
        return ak.linear_cross_entropy(h.transpose(0, 1), w, target_t, bias=b, chunk_size=5,
                                       backend=backend)

    def logits_fn(logits):
        return reference.cross_entropy(logits.transpose(0, 1), target_t)

    assert not strided.is_contiguous()
    _compare(fused, logits_fn, (hidden, weight, bias), torch.float32)
    everything_ignored = torch.full_like(target, -100)
    h, w = _leaves(hidden, weight)
    loss = ak.linear_cross_entropy(h, w, everything_ignored, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_tied_weight_gets_both_gradients(backend):
    g = torch.Generator().manual_seed(9)
    vocab, hidden_size = 40, 8
    embedding = torch.randn(vocab, hidden_size, generator=g)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    mix = torch.randn(hidden_size, hidden_size, generator=g) * 0.3

    def hidden_of(table):
        return torch.tanh(F.embedding(ids[:, :-1], table) @ mix.to(table.dtype))

    table = embedding.clone().requires_grad_(True)
    ak.linear_cross_entropy(hidden_of(table), table, ids[:, 1:], chunk_size=4,
                            backend=backend).backward()
    naive = embedding.clone().requires_grad_(True)
    F.cross_entropy(F.linear(hidden_of(naive), naive).reshape(-1, vocab),
                    ids[:, 1:].reshape(-1)).backward()
    # float64 with the two uses of the table apart: their sum is the expected gradient; the
    # sizes of the terms are the input path's and the head's (|dlogits|.T @ |hidden|).
    as_input, as_head = (embedding.double().requires_grad_(True) for _ in range(2))
    hidden = hidden_of(as_input)
    logits = F.linear(hidden, as_head)
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    grad_logits, = torch.autograd.grad(loss, logits, retain_graph=True)
    loss.backward()
    head_terms = grad_logits.abs().reshape(-1, vocab).t() @ hidden.detach().abs().reshape(
        -1, hidden_size)
    assert_close_elementwise(table.grad, as_input.grad + as_head.grad, naive.grad,
                             scale=as_input.grad.abs() + head_terms, dtype=torch.float32,
                             name="tied weight grad")


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_bf16_weight_gradient_rounded_once_over_many_chunks(backend, monkeypatch):
    """128 chunks: the float32 accumulator keeps the weight gradient at one bf16 rounding.

    With the head's matmuls in float32 (a CPU without native bf16; forced here so the test means
    the same on every CPU); tests/test_head_precision.py covers both matmul paths."""
    monkeypatch.setenv(head_matmul.HEAD_MATMUL_ENV, "float32")
    hidden, weight, _, target = _inputs(512, 16, 24, torch.bfloat16, seed=10)
    h, w = _leaves(hidden, weight)
    ak.linear_cross_entropy(h, w, target, reduction="sum", chunk_size=4,
                            backend=backend).backward()
    hd, wd = _leaves(hidden, weight, dtype=torch.float64)
    reference.cross_entropy(F.linear(hd, wd), target, reduction="sum").backward()
    exact = wd.grad
    allowed = exact.abs() * 2.0 ** -8 + exact.abs().max() * 1e-5
    assert bool(((w.grad.double() - exact).abs() <= allowed).all())
    # A bf16 running sum over the same chunks breaks that bound: the test can fail.
    running = torch.zeros_like(weight)
    with torch.no_grad():
        for start in range(0, 512, 4):
            rows = slice(start, start + 4)
            logits = F.linear(hidden[rows].float(), weight.float())
            y = target[rows]
            dlogits = torch.softmax(logits, -1)
            dlogits[y != -100, y[y != -100]] -= 1.0
            dlogits[y == -100] = 0.0
            running += (dlogits.t() @ hidden[rows].float()).to(torch.bfloat16)
    assert not bool(((running.double() - exact).abs() <= allowed).all())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_equals_torch_linear_cross_entropy(backend, reduction):
    hidden, weight, bias, target = _inputs(23, 12, 90, torch.float32, seed=11)
    ours = _leaves(hidden, weight, bias)
    theirs = _leaves(hidden, weight, bias)
    loss = ak.linear_cross_entropy(ours[0], ours[1], target, bias=ours[2], reduction=reduction,
                                   label_smoothing=0.05, chunk_size=7, backend=backend)
    if hasattr(F, "linear_cross_entropy"):
        expected = F.linear_cross_entropy(theirs[0], theirs[1], target, linear_bias=theirs[2],
                                          reduction=reduction, label_smoothing=0.05)
    else:  # torch 2.11 and older have no fused op: what it computes, unfused
        expected = F.cross_entropy(F.linear(theirs[0], theirs[1], theirs[2]), target,
                                   reduction=reduction, label_smoothing=0.05)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    upstream = _upstream(loss.shape)
    for a, b in zip(_grads(loss, ours, upstream), _grads(expected, theirs, upstream)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_second_backward_and_frozen_weight(backend):
    hidden, weight, bias, target = _inputs(17, 6, 25, torch.float32, seed=12)
    h, w, b = _leaves(hidden, weight, bias)
    loss = ak.linear_cross_entropy(h, w, target, bias=b, chunk_size=5, backend=backend)
    (loss / 2).backward(retain_graph=True)
    first = [t.grad.clone() for t in (h, w, b)]
    (loss / 2).backward(retain_graph=True)
    loss.backward()
    for t, once in zip((h, w, b), first):
        torch.testing.assert_close(t.grad, 4 * once)
    frozen = weight.clone()
    h2 = hidden.clone().requires_grad_(True)
    ak.linear_cross_entropy(h2, frozen, target, bias=bias, chunk_size=5,
                            backend=backend).backward()
    torch.testing.assert_close(h2.grad, first[0] * 2, rtol=1e-5, atol=1e-7)


def test_forward_only_under_no_grad_holds_no_gradient(monkeypatch):
    seen = []
    original = head_op.ChunkedHead.__init__

    def record(self, hidden, weight, bias, chunk_size, needs_grad=(False, False, False),
               *transform, **keywords):
        seen.append(tuple(needs_grad))
        original(self, hidden, weight, bias, chunk_size, needs_grad, *transform, **keywords)

    monkeypatch.setattr(head_op.ChunkedHead, "__init__", record)
    hidden, weight, bias, target = _inputs(9, 6, 20, torch.float32, seed=13)
    h, w, b = _leaves(hidden, weight, bias)
    with torch.no_grad():
        logp = ak.linear_token_logprobs(h, w, target, bias=b, backend="torch")
        loss = ak.linear_cross_entropy(h, w, target, bias=b, backend="torch")
    assert not logp.requires_grad and not loss.requires_grad
    assert seen == [(False, False, False)] * 2


def test_chunk_rule_bounds_the_workspace():
    for vocab in (1, 1000, 32768, 262144):
        rows = head_op.chunk_rows(10 ** 6, vocab, torch.device("cpu"))
        assert rows >= 1
        assert rows == 1 or rows * vocab * 4 <= head_op.CHUNK_BYTES["cpu"]
    assert head_op.chunk_rows(5, 100, torch.device("cpu"), chunk_size=3) == 3
    assert head_op.chunk_rows(5, 100, torch.device("cpu"), chunk_size=30) == 5


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_torch_compile_fullgraph(backend):
    hidden, weight, bias, target = _inputs(13, 8, 30, torch.float32, seed=14)

    advantages = torch.linspace(-1.0, 1.0, 13).reshape(1, 13)

    def step(h, w, b, temperature):
        loss = ak.linear_cross_entropy(h, w, target, bias=b, chunk_size=4, backend=backend)
        logp = ak.linear_token_logprobs(h, w, target, bias=b, temperature=temperature,
                                        chunk_size=4, backend=backend)
        grpo, _ = ak.linear_grpo_loss(h.unsqueeze(0), w, target.clamp(min=0).unsqueeze(0),
                                      advantages, bias=b, beta=0.1,
                                      ref_logprobs=logp.detach().unsqueeze(0), chunk_size=4,
                                      backend=backend)
        return loss + 0.1 * logp.sum() + grpo

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_in, compiled_in = _leaves(hidden, weight, bias), _leaves(hidden, weight, bias)
    expected = step(*eager_in, 0.7)
    got = compiled(*compiled_in, 0.7)
    torch.testing.assert_close(got, expected)
    for a, b in zip(_grads(got, compiled_in, None), _grads(expected, eager_in, None)):
        torch.testing.assert_close(a, b)


def test_nn_module():
    hidden, weight, bias, target = _inputs(10, 6, 21, torch.float32, seed=15)
    module = ak.nn.LinearCrossEntropyLoss(label_smoothing=0.1, chunk_size=3, backend="torch")
    expected = ak.linear_cross_entropy(hidden, weight, target, bias=bias, label_smoothing=0.1,
                                       backend="torch")
    torch.testing.assert_close(module(hidden, weight, target, bias), expected)
    assert "chunk_size=3" in repr(module)
    scaled = ak.nn.LinearCrossEntropyLoss(logit_scale=0.5, softcap=3.0, backend="torch")
    torch.testing.assert_close(scaled(hidden, weight, target, bias), ak.linear_cross_entropy(
        hidden, weight, target, bias=bias, logit_scale=0.5, softcap=3.0, backend="torch"))


# the call's tensors and per-call arguments (forward's), and torch's refused keywords
MODULE_CALL_ARGS = {"logits", "hidden", "weight", "target", "bias", "normalizer",
                    "process_group", "check_consistency", "size_average", "reduce"}


@pytest.mark.parametrize("module, op", [("CrossEntropyLoss", "cross_entropy"),
                                        ("LinearCrossEntropyLoss", "linear_cross_entropy")])
def test_nn_modules_take_every_keyword_of_their_op(module, op):
    import inspect

    module_params = set(inspect.signature(getattr(ak.nn, module)).parameters)
    op_params = set(inspect.signature(getattr(ak, op)).parameters)
    missing = sorted(op_params - module_params - MODULE_CALL_ARGS)
    assert not missing, f"ak.nn.{module} lacks {missing} of ak.{op}"


BAD = {
    "dtype_mismatch": (lambda h, w, b: (h, w.double(), b), TypeError, "weight must have"),
    "weight_1d": (lambda h, w, b: (h, w[0], b), ValueError, r"weight must have shape \[V, H\]"),
    # what DeepSpeed ZeRO-3 leaves outside the forward (a real ZeRO-3 engine is not run here)
    "weight_empty_1d": (lambda h, w, b: (h, w.new_empty(0), b), ValueError,
                        r"deepspeed\.zero\.GatheredParameters"),
    "hidden_size": (lambda h, w, b: (h, w[:, :-1], b), ValueError, "H = hidden.shape"),
    "bias_shape": (lambda h, w, b: (h, w, b[:-1]), ValueError, r"bias must have shape \[V\]"),
    "bias_dtype": (lambda h, w, b: (h, w, b.half()), TypeError, "bias must have"),
    "int_hidden": (lambda h, w, b: (h.long(), w.long(), b), TypeError, "hidden must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    hidden, weight, bias, target = _inputs(5, 4, 9, torch.float32, seed=16)
    change, error, message = BAD[case]
    h, w, b = change(hidden, weight, bias)
    with pytest.raises(error, match=message):
        ak.linear_cross_entropy(h, w, target, bias=b)
    with pytest.raises(error, match=message):
        ak.linear_token_logprobs(h, w, target, bias=b)


def test_bad_chunk_size_and_target():
    hidden, weight, bias, target = _inputs(5, 4, 9, torch.float32, seed=17)
    with pytest.raises(ValueError, match="chunk_size"):
        ak.linear_cross_entropy(hidden, weight, target, chunk_size=0)
    with pytest.raises(ValueError, match="target"):
        ak.linear_cross_entropy(hidden, weight, target.clamp(min=0) + 9)
    with pytest.raises(ValueError, match="target must have shape"):
        ak.linear_cross_entropy(hidden, weight, target[:-1])


TRANSFORMS = {"softcap": dict(softcap=2.5), "logit_scale": dict(logit_scale=0.6),
              "both": dict(softcap=3.0, logit_scale=1.7)}


def _transform_slope(logits, logit_scale=1.0, softcap=None):
    """``|d z / d x|`` of ``reference.transform_logits``, entry by entry."""
    if softcap is None:
        return torch.full_like(logits, abs(logit_scale))
    return abs(logit_scale) * (1 - torch.tanh(logit_scale * logits / softcap) ** 2)


# every dtype with both transforms; each alone in float32
TRANSFORM_CASES = ([("both", dtype, dtype_id) for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)]
                   + [(name, torch.float32, "fp32") for name in ("softcap", "logit_scale")])


@pytest.mark.parametrize("transform, dtype", [case[:2] for case in TRANSFORM_CASES],
                         ids=[f"{case[0]}-{case[2]}" for case in TRANSFORM_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_logprobs_softcap_and_logit_scale(backend, transform, dtype):
    kwargs = TRANSFORMS[transform]
    tensors = _inputs(23, 12, 61, dtype, seed=5)
    target = tensors[3]

    def fused(h, w, b):
        logp, entropy = ak.linear_token_logprobs(h, w, target, bias=b, temperature=0.8,
                                                 return_entropy=True, chunk_size=6,
                                                 backend=backend, **kwargs)
        return torch.stack([logp, entropy])

    def logits_fn(logits):
        z = reference.transform_logits(logits, **kwargs)
        return torch.stack(reference.token_logprobs(z, target, temperature=0.8))

    def output_terms(logits):
        exact = spec_logprobs(reference.transform_logits(logits, **kwargs), target, 0.8, -100,
                              True)
        return torch.stack([exact["logp"].abs() + exact["lse"].abs(), exact["entropy_terms"]])

    def grad_logits_terms(logits, upstream):
        z = reference.transform_logits(logits, **kwargs)
        terms = spec.logprobs_terms(z, target, 0.8, -100, True, grad_logp=upstream[0],
                                    grad_entropy=upstream[1])["grad_terms"]
        return terms.reshape(logits.shape) * _transform_slope(logits, **kwargs)

    _compare(fused, logits_fn, tensors[:3], dtype, output_terms=output_terms,
             grad_logits_terms=grad_logits_terms)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_sequence_logprobs_and_grpo_softcap(backend):
    hidden, weight, bias, target = _inputs(0, 8, 50, torch.float32, seed=6, lead=(3, 7))
    target = target.clamp(min=0)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(4)) < 0.7
    kwargs = dict(softcap=2.0, logit_scale=1.5)

    def fused_seq(h, w, b):
        return ak.linear_sequence_logprobs(h, w, target, mask, bias=b, temperature=0.9,
                                           chunk_size=4, backend=backend, **kwargs)

    def seq_fn(logits):
        return reference.sequence_logprobs(reference.transform_logits(logits, **kwargs),
                                           torch.where(mask, target, -100), mask,
                                           temperature=0.9)

    _compare(fused_seq, seq_fn, (hidden, weight, bias), torch.float32)
    advantages = torch.randn(3, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        z = reference.transform_logits(F.linear(hidden, weight, bias).double(), **kwargs)
        old = (reference.token_logprobs(z / 0.9, target)[0] + 0.2).float()
    # the fused walk, and the one through the log-probs (sequence-level ratios)
    for sampling in ("token", "sequence"):
        options = dict(mask=mask, old_logprobs=old, beta=0.0, importance_sampling=sampling,
                       temperature=0.9)

        def fused_grpo(h, w, b, options=options):
            return ak.linear_grpo_loss(h, w, target, advantages, bias=b, chunk_size=5,
                                       backend=backend, **kwargs, **options)[0]

        def grpo_fn(logits, options=options):
            z = reference.transform_logits(logits, **kwargs)
            return reference.grpo_loss(z, target, advantages.to(z.dtype),
                                       **options)[0].to(logits.dtype)

        _compare(fused_grpo, grpo_fn, (hidden, weight, bias), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_token_statistics(backend):
    hidden, weight, bias, target = _inputs(0, 10, 45, torch.float32, seed=8, lead=(4, 6))
    kwargs = dict(temperature=0.7, softcap=3.0, logit_scale=1.2)
    with torch.no_grad():
        z = reference.transform_logits(F.linear(hidden, weight, bias).double(), 1.2, 3.0)
        want = reference.token_statistics(z, target, 0.7)
        naive = reference.token_statistics(
            reference.transform_logits(F.linear(hidden, weight, bias), 1.2, 3.0), target, 0.7)
    # also the argmax for every row (the random targets are rarely it)
    top_target = torch.where(target == -100, -100, z.argmax(-1))
    leaves = _leaves(hidden, weight, bias)
    for tgt in (target, top_target):
        logp, entropy, stats = ak.linear_token_logprobs(
            *leaves[:2], tgt, bias=leaves[2], return_entropy=True, chunk_size=5,
            backend=backend, statistics=("is_top1", "mean_logits", "log_sum_sq_probs"),
            **kwargs)
        assert set(stats) == {"is_top1", "mean_logits", "log_sum_sq_probs"}
        assert logp.requires_grad and not any(v.requires_grad for v in stats.values())
        exact = reference.token_statistics(z, tgt, 0.7)
        assert stats["is_top1"].dtype == torch.bool
        assert torch.equal(stats["is_top1"], exact["is_top1"])
    assert stats["is_top1"].sum() == (target != -100).sum()
    for name in ("mean_logits", "log_sum_sq_probs"):
        assert stats[name].dtype == torch.float32
        assert_close_elementwise(stats[name], want[name], naive[name], name=name,
                                 scale=want[name].abs() + z.abs().amax(-1) / 0.7)
    # only the requested ones; the gradient is that of the log-probs alone
    logp_alone = ak.linear_token_logprobs(*leaves[:2], top_target, bias=leaves[2],
                                          backend=backend, **kwargs)
    logp2, stats = ak.linear_token_logprobs(*leaves[:2], top_target, bias=leaves[2],
                                            backend=backend, statistics=["mean_logits"],
                                            **kwargs)
    assert list(stats) == ["mean_logits"]
    assert torch.equal(logp2, logp_alone)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_top1_tie_rule(backend):
    """The target is top-1 when it is the first maximum: a tie with an earlier token is not,
    a tie with a later one is (``argmax``'s rule, and TRL's)."""
    weight = torch.zeros(5, 2)
    weight[:, 0] = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0])
    hidden = torch.tensor([[1.0, 0.0]] * 3)
    target = torch.tensor([1, 2, 4])
    _, stats = ak.linear_token_logprobs(hidden, weight, target, backend=backend,
                                        statistics=("is_top1",), softcap=10.0)
    assert stats["is_top1"].tolist() == [True, False, False]
    # the rule without the tie order ("the target's logit is the maximum") fails this test
    logits = hidden @ weight.t()
    untied = logits.gather(1, target[:, None]).squeeze(1) >= logits.amax(1)
    assert untied.tolist() != [True, False, False]


def test_transform_and_statistics_bad_input():
    hidden, weight, _, target = _inputs(4, 3, 7, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        ak.linear_token_logprobs(hidden, weight, target, softcap=-1.0)
    with pytest.raises(ValueError, match="logit_scale"):
        ak.linear_token_logprobs(hidden, weight, target, logit_scale=float("nan"))
    with pytest.raises(TypeError, match="logit_scale"):
        ak.linear_grpo_loss(hidden[None], weight, target[None], torch.ones(1), logit_scale="2")
    with pytest.raises(ValueError, match="statistics"):
        ak.linear_token_logprobs(hidden, weight, target, statistics=("top5",))
    with pytest.raises(TypeError, match="statistics"):
        ak.linear_token_logprobs(hidden, weight, target, statistics="is_top1")
    with pytest.raises(ValueError, match="process_group"):
        ak.linear_token_logprobs(hidden, weight, target, softcap=2.0, process_group=object())


def test_linear_cross_entropy_logit_scale_bad_input():
    hidden, weight, _, target = _inputs(4, 3, 7, torch.float32)
    with pytest.raises(ValueError, match="logit_scale"):
        ak.linear_cross_entropy(hidden, weight, target, logit_scale=float("inf"))
    with pytest.raises(TypeError, match="logit_scale"):
        ak.linear_cross_entropy(hidden, weight, target, logit_scale="2")
    with pytest.raises(ValueError, match="logit_scale is not supported with process_group"):
        ak.linear_cross_entropy(hidden, weight, target, logit_scale=2.0, process_group=object())
