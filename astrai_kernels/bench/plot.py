"""The plot of ``astrai-kernels bench``. First a summary panel: per op, this package's kernel
against the naive path and against the floor, time and peak memory, as ratios on a log scale.
Then two detail panels per (op, dtype, shape) whose run measured more than one V: median time and
peak extra memory against V, a line per method (log-log). A run cut by its deadline says so in red.

    python -m astrai_kernels.bench.plot bench/results/bench.json bench.png
"""

import argparse
import json
import os
import statistics
import textwrap

from .cases import (
    BASELINES,
    DTYPES,
    FLOOR_FACTOR,
    GRPO_BATCH,
    GRPO_OPS,
    KERNEL_BACKENDS,
    LINEAR_OPS,
    TENSOR_OPS,
)
from .report import OutputError, deadline_note, method_rank

DETAIL_ROW_INCHES = 3.4
# (label, colour, hatch) of the summary's four bars per op, top to bottom
SUMMARY_BARS = (("time / naive", "C0", None), ("time / floor", "C0", "//"),
                ("peak memory / naive", "C1", None), ("peak memory / floor", "C1", "//"))


def have_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _group_key(r):
    return (r["op"], r["dtype"], r["rows"], r.get("hidden", 0))


def shape_label(op, rows, hidden, vocab=None):
    shape = f"B={GRPO_BATCH}, T={rows // GRPO_BATCH}" if op in GRPO_OPS else f"N={rows}"
    if op in LINEAR_OPS:
        shape += f", H={hidden}"
    return shape + (f", V={vocab}" if vocab else "")


def _kernel_method(methods):
    """The package's kernel a user gets: the first backend in KERNEL_BACKENDS order that ran,
    without ``:inplace`` (not the default; its zero memory has no place on a log scale)."""
    plain = [m for m in methods if m in KERNEL_BACKENDS]
    return min(plain, key=KERNEL_BACKENDS.index) if plain else None


def summary_rows(results):
    """``(dtype, rows)`` of the summary panel, one row per op in TENSOR_OPS order: the dtype most
    ops ran (ties: DTYPES order), and for each op its kernel at the largest shape measured with
    the naive path where there is one. A row is a dict: op, method, shape, and the four ratios of
    SUMMARY_BARS (None where that baseline or floor did not run)."""
    ok = [r for r in results if "error" not in r and r.get("op") in TENSOR_OPS]
    by_dtype = {}
    for r in ok:
        by_dtype.setdefault(r["dtype"], set()).add(r["op"])
    if not by_dtype:
        return None, []
    dtype = min(by_dtype, key=lambda d: (-len(by_dtype[d]), list(DTYPES).index(d)))
    naive = {_group_key(r) + (r["vocab"],): r for r in ok if r["method"] == "naive"}
    rows = []
    for op in TENSOR_OPS:
        mine = [r for r in ok if r["op"] == op and r["dtype"] == dtype]
        method = _kernel_method({r["method"] for r in mine})
        if method is None:
            continue
        kernel = max((r for r in mine if r["method"] == method),
                     key=lambda r: (_group_key(r) + (r["vocab"],) in naive, r["vocab"],
                                    r["rows"], r.get("hidden", 0)))
        base = naive.get(_group_key(kernel) + (kernel["vocab"],))
        peak = kernel["peak_extra_bytes"]
        linear = op in LINEAR_OPS
        rows.append({
            "op": op, "method": method,
            "shape": shape_label(op, kernel["rows"], kernel.get("hidden", 0), kernel["vocab"]),
            "time / naive": kernel.get("ratio_vs_naive"),
            "time / floor": kernel.get("ratio_vs_gemm" if linear else "ratio_vs_copy"),
            "peak memory / naive": (peak / base["peak_extra_bytes"]
                                    if base and base["peak_extra_bytes"] > 0 else None),
            # the floor of memory is the gradients the op returns (logits ops: one of size S)
            "peak memory / floor": kernel.get("peak_extra_over_grads" if linear
                                              else "peak_extra_over_logits"),
        })
    return dtype, rows


def _shapes_line(rows):
    by_shape = {}
    for row in rows:
        by_shape.setdefault(row["shape"], []).append(row["op"])
    return "; ".join(f"{shape} ({', '.join(ops)})" for shape, ops in by_shape.items())


def _draw_summary(ax, dtype, rows, machine):
    """Diverging bars from 1 on a log axis: left of 1 is smaller than the naive path, right of 1
    is how far above the floor (1 = at the floor)."""
    from matplotlib.transforms import offset_copy

    height = 0.8 / len(SUMMARY_BARS)
    values, labelled = [], set()
    for i, row in enumerate(rows):
        for j, (label, colour, hatch) in enumerate(SUMMARY_BARS):
            y = i + (j - (len(SUMMARY_BARS) - 1) / 2) * height
            value = row[label]
            if not value:  # not run, or a zero that a log axis cannot place
                ax.text(1, y, " not run" if value is None else " 0", va="center", fontsize=7,
                        color="0.5")
                continue
            values.append(value)
            ax.barh(y, max(value, 1) - min(value, 1), left=min(value, 1), height=height * 0.9,
                    color=colour, alpha=0.9 if hatch is None else 0.45, hatch=hatch,
                    edgecolor=colour, label=None if label in labelled else label)
            labelled.add(label)
            ax.text(value * (1.1 if value >= 1 else 1 / 1.1), y, f"{value:.2f}x", va="center",
                    ha="left" if value >= 1 else "right", fontsize=7)
    low, high = min(values + [1]), max(values + [1])
    ax.set_xscale("log")
    ax.set_xlim(low / 4, high * 4)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['op']} ({r['method']})\n{r['shape']}" for r in rows], fontsize=8)
    ax.axvline(1, color="k", linewidth=1)
    ax.set_xlabel("ratio, log scale: < 1 faster / smaller than the naive path; "
                  "1 = at the floor (time: copy of the logits or the GEMMs; memory: the gradients)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    # below the x label at any panel height: a fixed offset in points, not in axes fractions
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=len(SUMMARY_BARS),
              bbox_transform=offset_copy(ax.transAxes, ax.figure, y=-30, units="points"),
              frameon=False)
    where = machine.get("gpu") or machine.get("cpu") or "unknown machine"
    shapes = textwrap.fill("shapes: " + _shapes_line(rows), 125)
    ax.set_title(f"{dtype} on {where} ({machine.get('cores')} cores), torch "
                 f"{machine.get('torch')}: this package's kernel (in brackets) against the naive "
                 f"path and the floor\n{shapes}", fontsize=9)


def _draw_detail(ax_t, ax_m, sel, op, methods, styles):
    for method in methods:
        pts = sorted((r["vocab"], r) for r in sel if r["method"] == method)
        if not pts:
            continue
        vs = [v for v, _ in pts]
        ax_t.plot(vs, [r["median_s"] * 1e3 for _, r in pts], label=method, **styles[method])
        if method == "gemm":  # the floor writes into preallocated outputs: no memory
            continue
        held = [(v, r["peak_extra_bytes"] / 2**20) for v, r in pts if r["peak_extra_bytes"] > 0]
        # zero (inplace_backward) has no place on a log scale: named in the legend only
        ax_m.plot([v for v, _ in held], [mib for _, mib in held], **styles[method],
                  label=method if held else f"{method}: 0 MiB")
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
    for ax, what in ((ax_t, "forward+backward time (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("vocabulary size V")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)


def build_figure(payload):
    """The figure of a bench payload (the JSON's dict), or None (matplotlib missing or no
    results). A (op, dtype, shape) group measured at one V only is no curve: the summary carries
    it (its dtype) and the figure's footer counts it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in payload.get("results", ())
          if "error" not in r and r.get("op") in TENSOR_OPS]
    dtype, rows = summary_rows(ok)
    vocabs_of = {}
    for r in ok:
        vocabs_of.setdefault(_group_key(r), set()).add(r["vocab"])
    curves = sorted((g for g, vs in vocabs_of.items() if len(vs) > 1),
                    key=lambda g: (TENSOR_OPS.index(g[0]), list(DTYPES).index(g[1]), g[2], g[3]))
    if not rows and not curves:
        return None
    summary_inches = 2.2 + 0.55 * len(rows) if rows else 0
    heights = ([summary_inches] if rows else []) + [DETAIL_ROW_INCHES] * len(curves)
    fig = plt.figure(figsize=(12, sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    if rows:
        _draw_summary(fig.add_subplot(grid[0, :]), dtype, rows, payload.get("machine", {}))
    methods = sorted({r["method"] for r in ok}, key=method_rank)
    markers = "os^DvP*X"
    styles = {m: dict(color=f"C{i}", marker=markers[i % len(markers)],
                      linestyle="-" if m in BASELINES else "-.", markersize=6 - 0.5 * (i % 3))
              for i, m in enumerate(methods)}
    for index, (op, group_dtype, n, hidden) in enumerate(curves, start=1 if rows else 0):
        ax_t, ax_m = fig.add_subplot(grid[index, 0]), fig.add_subplot(grid[index, 1])
        sel = [r for r in ok if _group_key(r) == (op, group_dtype, n, hidden)]
        _draw_detail(ax_t, ax_m, sel, op, methods, styles)
        for ax in (ax_t, ax_m):
            ax.set_title(f"{op} {group_dtype}, {shape_label(op, n, hidden)}", fontsize=10)
    cut = deadline_note(payload)
    if cut:
        fig.suptitle(f"{cut}: partial results (see the JSON's \"skipped\")", color="red",
                     fontsize=12, fontweight="bold")
    single = len(vocabs_of) - len(curves)
    if single:
        fig.supxlabel(f"{single} (op, dtype, shape) group(s) measured at one V only are not "
                      "drawn as curves (the summary and the tables have them)", fontsize=8,
                      color="0.3")
    return fig


def plot(payload, path):
    """Write the figure of a bench payload to ``path``; the path, or None (see build_figure)."""
    fig = build_figure(payload)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=90)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description="draw the plot of an astrai-kernels bench JSON")
    parser.add_argument("json", help="the JSON written by `astrai-kernels bench --json`")
    parser.add_argument("png", help="where to write the plot")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        payload = json.load(f)
    if plot(payload, args.png) is None:
        raise SystemExit(f"{args.json}: no plot (matplotlib missing or no results)")


if __name__ == "__main__":
    main()
