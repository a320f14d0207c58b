"""``astrai-kernels verify``: the logits ops x backend x dtype x shape against ``reference.py``.

It checks ``token_logprobs``, ``cross_entropy``, ``grpo_loss`` and ``sequence_logprobs``
(:data:`OPS`), the ops whose kernels differ per backend and per GPU. It does not check
``distill_loss`` or the fused-LM-head ``linear_*`` ops (the test suite compares them with
``reference.py``: ``tests/test_distill.py``, ``tests/test_linear.py``), nor the preference ops
and ``group_advantages``, which are plain PyTorch on ``[B]`` tensors with no backend to choose.

What a user runs after installing on a new machine (a new GPU): each of these ops is called with
each available kernel backend on random inputs rounded to each dtype, and compared with
``reference.py`` run in float64 on the same rounded inputs, forward values and the gradient
w.r.t. the logits (with random upstream gradients), per element by the one tolerance model
(:mod:`astrai_kernels.testing.tolerances`): each entry's error at most a small multiple of the
naive path's (``reference.py`` in the result's dtype) plus a few ulp of the terms forming it.
Every row of the table is the worst case over the
op's variants (options such as temperature, entropy, label smoothing, z-loss, softcap, GSPO) for
one (op, backend, dtype, shape, output). Exit status 1 when any check fails or any call raises.

Shapes are ``BxTxV``; a ``:shifted`` suffix makes the logits the non-contiguous view
``base[:, :-1]`` of a ``[B, T+1, V]`` tensor (how a causal LM's logits are aligned with their
targets). Defaults include a V below one tile, a V that is not a power of two, and V larger than
one tile; the triton backend running interpreted on CPU (``TRITON_INTERPRET=1``) gets smaller
shapes, the interpreter being slow.
"""

import json
import sys
import time
from dataclasses import dataclass

import torch

from . import spec
from .tolerances import compare, result_dtype, tolerance

OPS = ("token_logprobs", "cross_entropy", "grpo_loss", "sequence_logprobs")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHAPES = ("2x3x37", "2x8x1000:shifted", "2x4x50257", "1x2x131072")
CUDA_EXTRA_SHAPES = ("4x256x32000", "2x64x128256:shifted")
INTERPRETED_SHAPES = ("2x3x37", "2x4x1000:shifted", "1x3x5000")


@dataclass(frozen=True)
class Shape:
    batch: int
    length: int
    vocab: int
    shifted: bool = False

    @classmethod
    def parse(cls, text):
        spec, _, layout = str(text).strip().partition(":")
        if layout not in ("", "shifted", "contiguous"):
            raise ValueError(f"shape layout must be ':shifted' or none, got {text!r}")
        try:
            batch, length, vocab = (int(part) for part in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape must look like BxTxV (e.g. 2x8x1000), got {text!r}") from None
        if min(batch, length, vocab) < 1:
            raise ValueError(f"shape sizes must be >= 1, got {text!r}")
        return cls(batch, length, vocab, layout == "shifted")

    def __str__(self):
        return f"{self.batch}x{self.length}x{self.vocab}" + (":shifted" if self.shifted else "")


def _leaves(shape, dtype, device, seed):
    """``(base, view)``: random logits rounded to ``dtype`` and the op's view of a leaf copy."""
    g = torch.Generator().manual_seed(seed)
    length = shape.length + (1 if shape.shifted else 0)
    base = (torch.randn(shape.batch, length, shape.vocab, generator=g) * 2).to(dtype)
    return base.to(device), g


def _view(x, shape):
    return x[:, :-1] if shape.shifted else x


def _leaf(base):
    return base.detach().clone().requires_grad_(True)


def _targets(shape, g, device, ignored=0.2):
    target = torch.randint(0, shape.vocab, (shape.batch, shape.length), generator=g)
    target[torch.rand(shape.batch, shape.length, generator=g) < ignored] = -100
    return target.to(device)


def _upstream(shape, g, device):
    return torch.randn(shape.batch, shape.length, generator=g).to(device)


def _reference(run, base):
    """``(expected, naive)`` of ``run(x) -> {name: output}`` (with ``x`` a leaf of ``base`` in
    the given dtype, gradients in ``x.grad``): float64, and the naive path in each result's dtype
    (values from float32 logits, the gradient from logits of ``base``'s dtype)."""
    results = {}
    for precision in {torch.float64, torch.float32, base.dtype}:
        x = base.detach().to(precision).requires_grad_(True)
        results[precision] = {**run(x), "grad": x}
    naive = dict(results[torch.float32], grad=results[base.dtype]["grad"].grad)
    expected = dict(results[torch.float64], grad=results[torch.float64]["grad"].grad)
    return expected, naive


def _full_terms(terms, base, shape):
    """Gradient terms of the op's view placed in a tensor shaped like ``base``."""
    full = torch.zeros(base.shape, dtype=torch.float64)
    _view(full, shape).copy_(terms)
    return full


# Each check returns a list of (what, actual, expected, naive, scale, kind) for one variant.


def _check_token_logprobs(ak, reference, backend, base, shape, g, device):
    target = _targets(shape, g, device)
    out = []
    for temperature, entropy in ((1.0, False), (0.7, True)):
        g_lp, g_h = _upstream(shape, g, device), _upstream(shape, g, device)
        x = _leaf(base)
        result = ak.token_logprobs(_view(x, shape), target, temperature=temperature,
                                   return_entropy=entropy, backend=backend)
        lp, h = result if entropy else (result, None)
        ((lp * g_lp).sum() + ((h * g_h).sum() if entropy else 0.0)).backward()

        def run(xr, temperature=temperature, entropy=entropy, g_lp=g_lp, g_h=g_h):
            ref_lp, ref_h = reference.token_logprobs(_view(xr, shape), target, temperature, -100)
            loss = (ref_lp * g_lp.to(xr.dtype)).sum()
            if entropy:
                loss = loss + (ref_h * g_h.to(xr.dtype)).sum()
            loss.backward()
            return {"logp": ref_lp.detach(), "entropy": ref_h.detach()}

        expected, naive = _reference(run, base)
        terms = spec.logprobs_terms(_view(base, shape), target.reshape(-1), temperature, -100,
                                    entropy, g_lp.reshape(-1), g_h.reshape(-1))
        out += [("logp", lp, expected["logp"], naive["logp"], None, "value"),
                ("grad", x.grad, expected["grad"], naive["grad"],
                 _full_terms(terms["grad_terms"], base, shape), "grad")]
        if entropy:
            out.append(("entropy", h, expected["entropy"], naive["entropy"],
                        terms["entropy_terms"].reshape(h.shape), "value"))
    return out


def _check_cross_entropy(ak, reference, backend, base, shape, g, device):
    target = _targets(shape, g, device)
    out = []
    variants = (dict(reduction="mean"),
                dict(reduction="sum", label_smoothing=0.1, z_loss=1e-4, softcap=30.0),
                dict(reduction="none", label_smoothing=0.05))
    for kwargs in variants:
        x = _leaf(base)
        loss = ak.cross_entropy(_view(x, shape), target, backend=backend, **kwargs)
        count = max(int((target != -100).sum()), 1)
        upstream = {"none": _upstream(shape, g, device), "sum": torch.full_like(
            target, 0.7, dtype=torch.float32), "mean": torch.full_like(
            target, 0.7 / count, dtype=torch.float32)}[kwargs["reduction"]]
        (loss * (upstream if kwargs["reduction"] == "none" else 0.7)).sum().backward()
        options = (-100, kwargs.get("label_smoothing", 0.0), kwargs.get("z_loss", 0.0),
                   kwargs.get("softcap"))

        def run(xr, kwargs=kwargs, options=options, upstream=upstream):
            ref = reference.cross_entropy(_view(xr, shape), target, options[0],
                                          kwargs["reduction"], *options[1:], None)
            if kwargs["reduction"] == "none":
                (ref * upstream.to(xr.dtype)).sum().backward()
            else:
                (ref * 0.7).backward()
            return {"loss": ref.detach()}

        expected, naive = _reference(run, base)
        terms = spec.cross_entropy_terms(_view(base, shape), target.reshape(-1), *options[:3],
                                         options[3] or 0.0, upstream.reshape(-1))
        out += [("loss", loss, expected["loss"], naive["loss"], None, "value"),
                ("grad", x.grad, expected["grad"], naive["grad"],
                 _full_terms(terms, base, shape), "grad")]
    return out


def _check_grpo_loss(ak, reference, backend, base, shape, g, device):
    batch, length = shape.batch, shape.length
    target = torch.randint(0, shape.vocab, (batch, length), generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.25).float()
    target = torch.where(mask > 0, target, torch.full_like(target, 10**6))  # never read
    with torch.no_grad():
        logp = torch.log_softmax(_view(base.cpu(), shape).double(), -1).gather(
            -1, target.clamp(max=shape.vocab - 1).unsqueeze(-1)).squeeze(-1).float()
    old = logp + 0.3 * torch.randn(batch, length, generator=g)
    ref = logp + 0.2 * torch.randn(batch, length, generator=g)
    advantages = torch.randn(batch, generator=g)
    target, mask, old, ref, advantages = (t.to(device) for t in (target, mask, old, ref,
                                                                  advantages))
    out = []
    variants = (dict(beta=0.04, loss_type="bnpo"),
                dict(beta=0.04, loss_type="grpo", clip_eps_high=0.28, temperature=0.8),
                dict(beta=0.0, loss_type="dr_grpo", importance_sampling="sequence", delta=2.0))
    metric_keys = ("kl", "ratio/mean", "clip_ratio/region")
    for kwargs in variants:
        x = _leaf(base)
        loss, metrics = ak.grpo_loss(_view(x, shape), target, advantages, mask=mask,
                                     old_logprobs=old, ref_logprobs=ref, backend=backend,
                                     **kwargs)
        (loss * 0.7).backward()

        def run(xr, kwargs=kwargs):
            p = xr.dtype
            ref_loss, ref_metrics = reference.grpo_loss(
                _view(xr, shape), torch.where(mask > 0, target, 0), advantages.to(p),
                mask.to(p), old.to(p), ref.to(p), **kwargs)
            (ref_loss * 0.7).backward()
            return {"loss": ref_loss.detach(), **{k: ref_metrics[k] for k in metric_keys}}

        expected, naive = _reference(run, base)
        # each row is c * (d_jy - p_j) / T, c formed by exps of log-prob differences: its
        # entries' terms are |grad_j| times the log-probs' size (as testing/spec.grpo_terms)
        size = 1 + logp.abs() + old.cpu().abs() + ref.cpu().abs()
        scale = expected["grad"].abs().cpu()
        _view(scale, shape).mul_(size.double().unsqueeze(-1))
        out += [("loss", loss, expected["loss"], naive["loss"], None, "value"),
                ("grad", x.grad, expected["grad"], naive["grad"], scale, "grad")]
        out += [(f"metrics/{key}", metrics[key], expected[key], naive[key], None, "value")
                for key in metric_keys]
    return out


def _check_sequence_logprobs(ak, reference, backend, base, shape, g, device):
    target = torch.randint(0, shape.vocab, (shape.batch, shape.length), generator=g)
    mask = torch.rand(shape.batch, shape.length, generator=g) > 0.3
    target = torch.where(mask, target, torch.full_like(target, 10**6)).to(device)
    mask = mask.to(device)
    out = []
    for average, temperature in ((False, 1.0), (True, 0.9)):
        x = _leaf(base)
        value = ak.sequence_logprobs(_view(x, shape), target, mask, average=average,
                                     temperature=temperature, backend=backend)
        upstream = torch.randn(shape.batch, generator=g).to(device)
        (value * upstream).sum().backward()

        def run(xr, average=average, temperature=temperature, upstream=upstream):
            ref = reference.sequence_logprobs(_view(xr, shape), torch.where(mask, target, -100),
                                              mask, average, temperature)
            (ref * upstream.to(xr.dtype)).sum().backward()
            return {"value": ref.detach()}

        expected, naive = _reference(run, base)
        per_token = upstream.unsqueeze(1) * mask
        if average:
            per_token = per_token / mask.sum(-1, keepdim=True).clamp(min=1)
        terms = spec.logprobs_terms(_view(base, shape),
                                    torch.where(mask, target, -100).reshape(-1), temperature,
                                    -100, False, per_token.reshape(-1))["grad_terms"]
        out += [("value", value, expected["value"], naive["value"], None, "value"),
                ("grad", x.grad, expected["grad"], naive["grad"],
                 _full_terms(terms, base, shape), "grad")]
    return out


CHECKS = {"token_logprobs": _check_token_logprobs, "cross_entropy": _check_cross_entropy,
          "grpo_loss": _check_grpo_loss, "sequence_logprobs": _check_sequence_logprobs}


def _interpreted(backend, device):
    if backend != "triton" or torch.device(device).type == "cuda":
        return False
    try:
        from ..kernels.triton.backend import kernels_interpreted
    except Exception:
        return False
    return kernels_interpreted()


def run(ops=OPS, backends=None, dtypes=("fp32", "bf16", "fp16"), shapes=None, device=None,
        progress=None):
    """The list of check rows (dicts); see the module doc."""
    import astrai_kernels as ak
    from astrai_kernels import reference

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if backends is None:
        backends = [b for b in ak.available_backends(device) if b != "reference"]
    rows = []
    for op in ops:
        if op not in CHECKS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        for backend in backends:
            if shapes is not None:
                backend_shapes = shapes
            elif _interpreted(backend, device):
                backend_shapes = INTERPRETED_SHAPES
            else:
                backend_shapes = DEFAULT_SHAPES + (
                    CUDA_EXTRA_SHAPES if torch.device(device).type == "cuda" else ())
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                for index, text in enumerate(backend_shapes):
                    shape = text if isinstance(text, Shape) else Shape.parse(text)
                    if progress:
                        progress(f"{op} {backend} {dtype_name} {shape}")
                    rows += _run_one(ak, reference, op, backend, dtype_name, dtype, shape,
                                     device, seed=1000 * index + 7)
    return rows


def _run_one(ak, reference, op, backend, dtype_name, dtype, shape, device, seed):
    """Rows for one (op, backend, dtype, shape): the worst variant per output."""
    head = {"op": op, "backend": backend, "dtype": dtype_name, "shape": str(shape),
            "device": str(device)}
    start = time.perf_counter()
    try:
        base, g = _leaves(shape, dtype, device, seed)
        checks = CHECKS[op](ak, reference, backend, base, shape, g, device)
    except Exception as exc:
        return [{**head, "what": "call", "max_abs": None, "max_ratio": None, "ok": False,
                 "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}",
                 "seconds": time.perf_counter() - start}]
    worst = {}
    for what, actual, expected, naive, scale, kind in checks:
        tol = tolerance(result_dtype(kind, dtype))
        try:
            result = compare(actual, expected, kind, dtype, naive=naive, scale=scale, what=what)
            ok, max_abs, max_ratio = result.ok, result.max_abs, result.max_ratio
            error = None if ok else result.message()
        except (AssertionError, ValueError) as exc:
            ok, max_abs, max_ratio, error = False, float("inf"), float("inf"), str(exc)
        if what == "grad" and actual is not None and actual.dtype != dtype:
            ok, error = False, f"gradient dtype {actual.dtype}, expected {dtype}"
        row = worst.setdefault(what, {**head, "what": what, "kind": kind, "max_abs": 0.0,
                                      "max_ratio": 0.0, "naive_factor": tol.naive_factor,
                                      "term_factor": tol.term_factor, "floor": tol.floor,
                                      "ok": True, "error": None, "checks": 0})
        row["max_abs"] = max(row["max_abs"], max_abs)
        row["max_ratio"] = max(row["max_ratio"], max_ratio)
        row["ok"] = row["ok"] and ok
        row["error"] = row["error"] or error
        row["checks"] += 1
    elapsed = time.perf_counter() - start
    for row in worst.values():
        row["seconds"] = elapsed
    return list(worst.values())


def format_table(rows, failures_only=False):
    head = (f"{'op':<18} {'backend':<8} {'dtype':<5} {'shape':<20} {'what':<24} "
            f"{'max_abs':>9} {'err/allow':>9} {'tol (naive x/eps x)':>21} {'ok':<4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if failures_only and r["ok"]:
            continue
        if r["what"] == "call":
            lines.append(f"{r['op']:<18} {r['backend']:<8} {r['dtype']:<5} {r['shape']:<20} "
                         f"{'call':<24} {'-':>9} {'-':>9} {'-':>21} FAIL  {r['error']}")
            continue
        tol = f"{r['naive_factor']:g}/{r['term_factor']:g}"
        line = (f"{r['op']:<18} {r['backend']:<8} {r['dtype']:<5} {r['shape']:<20} "
                f"{r['what']:<24} {r['max_abs']:>9.2e} {r['max_ratio']:>9.2f} {tol:>21} "
                f"{'ok' if r['ok'] else 'FAIL':<4}")
        if r.get("error"):
            line += f"  {r['error']}"
        lines.append(line)
    failed = sum(not r["ok"] for r in rows)
    lines.append(f"{len(rows)} checks, {failed} failed")
    return "\n".join(lines)


def report(ops, backends, dtypes, shapes, device, json_path=None, failures_only=False):
    """Run the checks (arguments as checked by ``astrai-kernels verify``), print the table (or
    JSON with ``json_path="-"``; a file at any other ``json_path``); the exit status."""
    start = time.perf_counter()
    stream = sys.stderr

    def progress(label):
        stream.write(f"\rverify: {label:<70}")
        stream.flush()

    rows = run(ops, backends, dtypes, shapes, device,
               progress=progress if stream.isatty() else None)
    if stream.isatty():
        stream.write("\r" + " " * 80 + "\r")
    elapsed = time.perf_counter() - start
    payload = {"device": device, "backends": backends, "dtypes": dtypes, "ops": ops,
               "seconds": elapsed, "ok": all(r["ok"] for r in rows), "rows": rows}
    if json_path == "-":
        print(json.dumps(payload, indent=1))
    else:
        print(f"astrai-kernels verify on {device}: backends {', '.join(backends) or 'none'}; "
              f"reference.py in float64; tolerances from astrai_kernels.testing.tolerances")
        print(format_table(rows, failures_only=failures_only))
        print(f"{elapsed:.1f} s")
        if json_path:
            import os

            directory = os.path.dirname(os.path.abspath(json_path))
            os.makedirs(directory, exist_ok=True)
            with open(json_path, "w") as out:
                json.dump(payload, out, indent=1)
            print(f"JSON: {json_path}")
    if not backends:
        print("verify: no backend to check", file=sys.stderr)
        return 1
    return 0 if payload["ok"] else 1
