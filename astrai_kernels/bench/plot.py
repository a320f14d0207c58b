"""The plot of ``astrai-kernels bench``: two panels per (op, dtype, shape), median time and peak
extra memory against V, a line per method (log-log)."""

import os
import statistics

from .cases import BASELINES, DTYPES, FLOOR_FACTOR, GRPO_BATCH, LINEAR_OPS, TENSOR_OPS
from .report import OutputError, method_rank


def have_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(results, path, title=None):
    """Write the plot to ``path``; the path, or None (matplotlib missing or no results).

    Logits ops: the same-run copy floor and the logits' size S dashed. Linear ops: the ``gemm``
    floor is a method line; the memory bound (gradients + fp32 weight + 96 MiB) dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in results if "error" not in r and r.get("op") in TENSOR_OPS]
    groups = sorted({(r["op"], r["dtype"], r["rows"], r.get("hidden", 0)) for r in ok},
                    key=lambda g: (TENSOR_OPS.index(g[0]), list(DTYPES).index(g[1]), g[2], g[3]))
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.4 * len(groups)), squeeze=False)
    methods = sorted({r["method"] for r in ok}, key=method_rank)
    markers = "os^DvP*X"
    styles = {m: dict(color=f"C{i}", marker=markers[i % len(markers)],
                      linestyle="-" if m in BASELINES else "-.", markersize=6 - 0.5 * (i % 3))
              for i, m in enumerate(methods)}
    for (op, dtype, rows, hidden), (ax_t, ax_m) in zip(groups, axes):
        sel = [r for r in ok
               if (r["op"], r["dtype"], r["rows"], r.get("hidden", 0)) == (op, dtype, rows, hidden)]
        for method in methods:
            pts = sorted((r["vocab"], r) for r in sel if r["method"] == method)
            if not pts:
                continue
            vs = [v for v, _ in pts]
            ax_t.plot(vs, [r["median_s"] * 1e3 for _, r in pts], label=method, **styles[method])
            if method != "gemm":  # the floor writes into preallocated outputs: no memory
                ax_m.plot(vs, [max(r["peak_extra_bytes"], 1) / 2**20 for _, r in pts],
                          label=method, **styles[method])
        if op in LINEAR_OPS:
            bounds = sorted({(r["vocab"], r["peak_bound_bytes"]) for r in sel})
            ax_m.plot([v for v, _ in bounds], [b / 2**20 for _, b in bounds], "k+--",
                      label="bound: grads + fp32 W + 96 MiB")
        else:
            floor = {}
            for r in sel:
                if r.get("floor_s"):
                    floor.setdefault(r["vocab"], []).append(r["floor_s"])
            if floor:
                vs = sorted(floor)
                ax_t.plot(vs, [statistics.median(floor[v]) * 1e3 for v in vs], "k+--",
                          label=f"copy floor ({FLOOR_FACTOR[op]} S)")
            sizes = sorted({(r["vocab"], r["logits_bytes"]) for r in sel})
            ax_m.plot([v for v, _ in sizes], [s / 2**20 for _, s in sizes], "k+--",
                      label="logits size S")
        shape = (f"B={GRPO_BATCH}, T={rows // GRPO_BATCH}" if op in ("grpo", "linear_grpo")
                 else f"N={rows}") + (f", H={hidden}" if op in LINEAR_OPS else "")
        for ax, what in ((ax_t, "forward+backward time (ms)"), (ax_m, "peak extra memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("vocabulary size V")
            ax.set_ylabel(what)
            ax.set_title(f"{op} {dtype}, {shape}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / (3.4 * len(groups))))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=90)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return path
