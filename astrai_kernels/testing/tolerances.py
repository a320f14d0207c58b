"""The one tolerance table every test and ``astrai-kernels verify`` use.

A backend's result is compared with ``reference.py`` run in float64 on the same (already
rounded) inputs, so the budget covers float32 accumulation and, for gradients, one rounding
to the logits' dtype. An element passes when ``|actual - expected| <= atol + rtol * |expected|``
with ``atol = atol_frac * max(max|expected|, scale_floor)``. Gradients use no floor, so a
gradient whose entries are all small (a confident row) is still checked relative to itself;
values use a floor of 1, since ``logp = z_y - lse`` carries the float32 rounding of ``lse``
(an absolute error of about 1e-7 * |lse| even when ``logp`` itself is near 0).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol_frac: float
    scale_floor: float = 0.0


# float32 outputs (log-probs, losses, metrics), keyed by the dtype of the logits they came from.
VALUE_TOLERANCES = {
    torch.float64: Tolerance(1e-7, 1e-7, 1.0),
    torch.float32: Tolerance(2e-5, 2e-6, 1.0),
    torch.bfloat16: Tolerance(2e-5, 2e-6, 1.0),
    torch.float16: Tolerance(2e-5, 2e-6, 1.0),
}

# Gradients w.r.t. the logits, which come back in the logits' dtype.
GRAD_TOLERANCES = {
    torch.float64: Tolerance(1e-7, 1e-8),
    torch.float32: Tolerance(2e-5, 4e-6),
    torch.bfloat16: Tolerance(8e-3, 1e-3),
    torch.float16: Tolerance(1e-3, 2e-4),
}

TOLERANCES = {"value": VALUE_TOLERANCES, "grad": GRAD_TOLERANCES}


def tolerance(kind, dtype):
    return TOLERANCES[kind][dtype]


def compare(actual, expected, kind, dtype):
    """``(ok, max_abs_err, max_rel_err)`` of ``actual`` against ``expected`` for the table row."""
    tol = tolerance(kind, dtype)
    actual = torch.as_tensor(actual).detach().double().cpu()
    expected = torch.as_tensor(expected).detach().double().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if expected.numel() == 0:
        return True, 0.0, 0.0
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)) or not torch.equal(
            actual[~finite], expected[~finite]):
        return False, float("inf"), float("inf")
    actual, expected = actual[finite], expected[finite]
    if expected.numel() == 0:
        return True, 0.0, 0.0
    err = (actual - expected).abs()
    atol = tol.atol_frac * max(float(expected.abs().max()), tol.scale_floor)
    ok = bool((err <= atol + tol.rtol * expected.abs()).all())
    rel = err / expected.abs().clamp(min=atol if atol > 0 else 1e-300)
    return ok, float(err.max()), float(rel.max())


def assert_close(actual, expected, kind="value", dtype=torch.float32, what=""):
    ok, max_abs, max_rel = compare(actual, expected, kind, dtype)
    if not ok:
        tol = tolerance(kind, dtype)
        raise AssertionError(f"{what or kind} mismatch for {dtype}: max abs err {max_abs:.3e}, "
                             f"max rel err {max_rel:.3e} (rtol {tol.rtol}, atol_frac "
                             f"{tol.atol_frac})")
