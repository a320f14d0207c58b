"""The plot of ``astrai-kernels bench``, read top down.

1. Against the naive path: per op and dtype, how many times faster and how many times less peak
   memory this package's kernel is than the naive path (and than ``torch.compile`` of it; the
   fused head also than PyTorch's own ``linear_cross_entropy``). Higher is better, 1 = the same.
2. Against the floor: the same kernel's time over its floor (a ``copy_`` of the logits scaled to
   the bytes the op moves; the fused head: its matmuls) and its peak memory over its bound (the
   logits ops: S, the one gradient they return; the fused head: issue 13's bound), the numbers of
   the printed tables' ``x floor`` / ``x gemm``, ``peak/S`` and ``/bound`` columns. Lower is
   better, 1 = at the floor.
3. Each (op, dtype, shape) measured at more than one V: time and peak memory against V, a line
   per method, the band around a time line the spread of its timed calls (fastest to slowest).

A caption names every method drawn. A run cut by its deadline says so in red in the title.

    python -m astrai_kernels.bench.plot bench/results/bench.json bench.png
"""

import argparse
import json
import math
import os
import statistics
import textwrap

from .cases import (
    BASELINES,
    DTYPES,
    FLOOR_FACTOR,
    GRPO_BATCH,
    GRPO_OPS,
    INPLACE_SUFFIX,
    KERNEL_BACKENDS,
    LINEAR_OPS,
    TENSOR_OPS,
)
from .report import OutputError, deadline_note, method_rank

FIGURE_INCHES = 12.0
DETAIL_ROW_INCHES = 3.0
SUMMARY_ROW_INCHES = 0.42
# The first panel's comparisons: (baseline, legend label, colour, hatch)
VERSUS = (("naive", "vs the naive path", "C0", None),
          ("compile", "vs torch.compile of the naive path", "C2", "//"),
          ("torch_lce", "vs PyTorch's F.linear_cross_entropy", "C3", ".."),
          ("torch_lce_chunked", "vs PyTorch's F.linear_cross_entropy, chunked", "C4", "xx"))
KERNEL_COLOUR = "C1"
# a peak below this share of the logits' size is drawn nowhere on the log memory axes
NEGLIGIBLE_SHARE_OF_S = 0.01
# What each method name in the picture means (the caption; cases.METHOD_NOTES has the details)
METHOD_CAPTIONS = {
    "naive": "the naive path: log_softmax(logits.float()) + gather, F.cross_entropy("
             "logits.float()), the seed's GRPO and TRL's JSD on float logits; fused-head ops: "
             "F.linear(hidden, weight) first, then the same",
    "compile": "torch.compile of the naive path",
    "gemm": "the fused head's time floor: only the matmuls it must do, into preallocated outputs",
    "torch_lce": "PyTorch's torch.nn.functional.linear_cross_entropy (its reference path)",
    "torch_lce_chunked": "the same with options=torch.nn.LinearCrossEntropyOptions() (its "
                         "chunked path)",
    "triton": "this package, Triton kernels (CUDA)",
    "cpp": "this package, C++ kernels (CPU)",
    "torch": "this package, chunked PyTorch (any device)",
    "reference": "this package's reference math (the spec)",
    INPLACE_SUFFIX: "with inplace_backward=True: the gradient written over the logits (next "
                    "to 0 MiB extra, under 1% of S: not drawn on the log memory axes)",
    "copy floor": "a copy_ of the logits (same run) scaled to the bytes the op must move "
                  "(k S: read the logits, write the gradient)",
    "logits size S": "the bytes of the [N, V] logits: a logits op's gradient alone holds S",
    "bound": "the fused head's memory bound: its gradients + an fp32 [V, H] accumulator + 96 MiB",
}


def have_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _group_key(r):
    return (r["op"], r["dtype"], r["rows"], r.get("hidden", 0))


def _case_key(r, method=None):
    return _group_key(r) + (r["vocab"], method or r["method"])


def shape_label(op, rows, hidden, vocab=None):
    shape = f"B={GRPO_BATCH}, T={rows // GRPO_BATCH}" if op in GRPO_OPS else f"N={rows}"
    if op in LINEAR_OPS:
        shape += f", H={hidden}"
    return shape + (f", V={vocab}" if vocab else "")


def _kernel_method(methods):
    """The package's kernel a user gets: the first backend in KERNEL_BACKENDS order that ran,
    without ``:inplace`` (not the default)."""
    plain = [m for m in methods if m in KERNEL_BACKENDS]
    return min(plain, key=KERNEL_BACKENDS.index) if plain else None


def _spread(r):
    """(fastest, slowest) of a case's timed calls; its median twice where none are recorded."""
    times = r.get("times_s") or [r["median_s"]]
    return min(times), max(times)


def _ratio_and_spread(over, under):
    """``over``'s median time over ``under``'s, with the extremes of that ratio that their
    calls' spreads allow: ``(ratio, low, high)``."""
    (over_fast, over_slow), (under_fast, under_slow) = _spread(over), _spread(under)
    return (over["median_s"] / under["median_s"], over_fast / under_slow,
            over_slow / under_fast)


def _time_over_floor(r, linear):
    """``(ratio, low, high)`` of a kernel's time over its floor: the tables' figure (``x gemm``,
    or ``x floor``: the median of each call over the copies timed right after it, where the
    run paired them) and the extremes of the calls' own ratios; None without a floor."""
    ratio = r.get("ratio_vs_gemm" if linear else "ratio_vs_copy")
    if ratio is None or not r.get("floor_s"):
        return None
    times, paired = r.get("times_s") or [r["median_s"]], r.get("paired_copy_s")
    if not linear and paired:
        per_copy = r["floor_s"] / r["copy_s"]  # the op's bytes over the copy's
        calls = [t / (c * per_copy) for t, c in zip(times, paired)]
    else:
        calls = [t / r["floor_s"] for t in times]
    return ratio, min(calls + [ratio]), max(calls + [ratio])


def summary_rows(results):
    """The rows of the first two panels: per op (TENSOR_OPS order) and dtype (DTYPES order), the
    package's kernel at the largest shape measured with the naive path where there is one.

    A row is a dict: ``op``, ``dtype``, ``method``, ``shape``; ``faster`` and ``less_memory``,
    ``{baseline: (ratio, low, high)}`` of the baselines measured at that shape (the baseline's
    time or peak over the kernel's: > 1 is better; ``low``/``high`` the spread of the timed
    calls, equal to the ratio for memory); ``time_over_floor`` ``(ratio, low, high)`` or None
    (the tables' ``x floor``/``x gemm``); ``memory_over_bound`` and ``bound`` (``"S"`` for the
    logits ops, the tables' ``peak/S``; ``"bound"`` for the fused head, ``/bound``)."""
    ok = [r for r in results if "error" not in r and r.get("op") in TENSOR_OPS]
    by_case = {_case_key(r): r for r in ok}
    rows = []
    dtypes = sorted({r["dtype"] for r in ok}, key=lambda d: (list(DTYPES) + [d]).index(d))
    for op in TENSOR_OPS:
        for dtype in dtypes:
            mine = [r for r in ok if r["op"] == op and r["dtype"] == dtype]
            method = _kernel_method({r["method"] for r in mine})
            if method is None:
                continue
            kernel = max((r for r in mine if r["method"] == method),
                         key=lambda r: (_case_key(r, "naive") in by_case, r["vocab"], r["rows"],
                                        r.get("hidden", 0)))
            linear = op in LINEAR_OPS
            faster, less_memory = {}, {}
            for base_name, *_ in VERSUS:
                base = by_case.get(_case_key(kernel, base_name))
                if base is None:
                    continue
                faster[base_name] = _ratio_and_spread(base, kernel)
                peak = kernel["peak_extra_bytes"]
                memory = base["peak_extra_bytes"] / peak if peak > 0 else math.inf
                less_memory[base_name] = (memory, memory, memory)
            rows.append({
                "op": op, "dtype": dtype, "method": method,
                "shape": shape_label(op, kernel["rows"], kernel.get("hidden", 0),
                                     kernel["vocab"]),
                "faster": faster, "less_memory": less_memory,
                "time_over_floor": _time_over_floor(kernel, linear),
                "memory_over_bound": (kernel.get("peak_over_bound") if linear
                                      else kernel.get("peak_extra_over_logits")),
                "bound": "bound" if linear else "S",
            })
    return rows


def _row_labels(rows):
    return [f"{r['op']} {r['dtype']}\n{r['method']}, {r['shape']}" for r in rows]


def _times(value):
    return "inf" if math.isinf(value) else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def _draw_versus(ax, rows, key, xlabel):
    """Bars from 1 on a log axis, one per baseline measured: the baseline's figure over the
    kernel's (higher is better); whiskers from the spread of the timed calls."""
    values = [1.0]
    for i, row in enumerate(rows):
        present = [v for v in VERSUS if v[0] in row[key]]
        height = 0.8 / max(len(present), 1)
        for j, (name, _, colour, hatch) in enumerate(present):
            value, low, high = row[key][name]
            y = i + (j - (len(present) - 1) / 2) * height
            shown = min(value, 1e6)
            values.append(shown)
            ax.barh(y, max(shown, 1) - min(shown, 1), left=min(shown, 1), height=height * 0.9,
                    color=colour, alpha=0.85 if hatch is None else 0.5, hatch=hatch,
                    edgecolor=colour, linewidth=0.5)
            if high > low:
                ax.errorbar(shown, y, xerr=[[shown - low], [high - shown]], fmt="none",
                            ecolor="0.15", elinewidth=0.8, capsize=2)
                values.extend([low, high])
            ax.text(max(shown, high) * 1.06 if shown >= 1 else min(shown, low) / 1.06, y,
                    _times(value), va="center", ha="left" if shown >= 1 else "right",
                    fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2.2, max(values) * 3.0)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.axvline(1, color="k", linewidth=1)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(True, axis="x", which="major", alpha=0.3)
    ax.tick_params(labelsize=8)


def _draw_floor(ax, rows, key, xlabel):
    """One bar per row from 0 on a linear axis, the floor (1) a dashed line: lower is better."""
    values = [1.0]
    for i, row in enumerate(rows):
        figure = row[key]
        if figure is None:
            ax.text(0.02, i, "not measured", va="center", fontsize=7, color="0.4")
            continue
        value, low, high = figure if isinstance(figure, tuple) else (figure, figure, figure)
        values.append(high)
        ax.barh(i, value, height=0.6, color=KERNEL_COLOUR, alpha=0.85)
        if high > low:
            ax.errorbar(value, i, xerr=[[value - low], [high - value]], fmt="none",
                        ecolor="0.15", elinewidth=0.8, capsize=2)
        ax.text(high + 0.02 * max(values), i, _times(value), va="center", fontsize=7)
    ax.set_xlim(0, max(values) * 1.18)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.axvline(1, color="k", linewidth=1, linestyle="--")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(labelsize=8)


def _draw_summary(section_versus, section_floor, rows):
    ax_time, ax_memory = section_versus.subplots(1, 2, sharey=True)
    _draw_versus(ax_time, rows, "faster",
                 "baseline's median time / this package's (log; whiskers: fastest to slowest "
                 "calls)")
    _draw_versus(ax_memory, rows, "less_memory",
                 "baseline's peak extra memory / this package's (log)")
    ax_time.set_title("times faster (higher is better)", fontsize=10)
    ax_memory.set_title("times less peak memory (higher is better)", fontsize=10)
    ax_time.set_yticks(range(len(rows)), _row_labels(rows), fontsize=8)
    from matplotlib.patches import Patch

    drawn = {name for row in rows for name in row["faster"]}
    handles = [Patch(facecolor=colour, edgecolor=colour, hatch=hatch,
                     alpha=0.85 if hatch is None else 0.5, label=label)
               for name, label, colour, hatch in VERSUS if name in drawn]
    section_versus.legend(handles=handles, loc="outside lower center", ncol=len(handles),
                          fontsize=8, frameon=False)
    section_versus.suptitle("This package's kernel against the naive path, per op and dtype",
                            fontsize=11, fontweight="bold")

    ax_floor_t, ax_floor_m = section_floor.subplots(1, 2, sharey=True)
    _draw_floor(ax_floor_t, rows, "time_over_floor",
                "median time / its floor (the tables' x floor, x gemm; whiskers: calls' spread)")
    _draw_floor(ax_floor_m, rows, "memory_over_bound",
                "peak extra memory / S (logits ops: the tables' peak/S) or / the bound "
                "(fused head: /bound)")
    ax_floor_t.set_title("time over the floor (lower is better, 1 = at the floor)", fontsize=10)
    ax_floor_m.set_title("memory over its bound (lower is better, <= 1 meets it)", fontsize=10)
    ax_floor_t.set_yticks(range(len(rows)), _row_labels(rows), fontsize=8)
    section_floor.suptitle("The same kernels against the floor: copy_ of the logits (logits "
                           "ops) or the matmuls (fused head)", fontsize=11, fontweight="bold")


def _styles(methods):
    markers = "os^DvP*X"
    return {m: dict(color=f"C{i}", marker=markers[i % len(markers)],
                    linestyle="-" if m in BASELINES else "-.", markersize=6 - 0.5 * (i % 3))
            for i, m in enumerate(methods)}


def _draw_detail(ax_t, ax_m, sel, op, methods, styles):
    """Time and peak memory against V, a line per method; the band around a time line spans
    its calls' spread; the op's floor of time and yardstick of memory dashed in black."""
    for method in methods:
        pts = sorted((r["vocab"], r) for r in sel if r["method"] == method)
        if not pts:
            continue
        vs = [v for v, _ in pts]
        ax_t.plot(vs, [r["median_s"] * 1e3 for _, r in pts], label=method, **styles[method])
        spreads = [_spread(r) for _, r in pts]
        if any(slow > fast for fast, slow in spreads):
            ax_t.fill_between(vs, [fast * 1e3 for fast, _ in spreads],
                              [slow * 1e3 for _, slow in spreads],
                              color=styles[method]["color"], alpha=0.18, linewidth=0)
        if method == "gemm":  # the floor writes into preallocated outputs: no memory
            continue
        # in place the op adds next to nothing (a few KiB): a log axis down there would squash
        # every other line, so such points are left out and the caption says so
        held = [(v, r["peak_extra_bytes"] / 2**20) for v, r in pts
                if r["peak_extra_bytes"] > NEGLIGIBLE_SHARE_OF_S * r["logits_bytes"]]
        ax_m.plot([v for v, _ in held], [mib for _, mib in held], **styles[method])
    if op in LINEAR_OPS:
        bounds = sorted({(r["vocab"], r["peak_bound_bytes"]) for r in sel})
        ax_m.plot([v for v, _ in bounds], [b / 2**20 for _, b in bounds], "k+--")
    else:
        floor = {}
        for r in sel:
            if r.get("floor_s"):
                floor.setdefault(r["vocab"], []).append(r["floor_s"])
        if floor:
            vs = sorted(floor)
            ax_t.plot(vs, [statistics.median(floor[v]) * 1e3 for v in vs], "k:", marker="+")
            ax_t.annotate(f"copy floor ({FLOOR_FACTOR[op]} S)",
                          (vs[0], statistics.median(floor[vs[0]]) * 1e3), xytext=(8, -3),
                          textcoords="offset points", fontsize=7, va="top")
        sizes = sorted({(r["vocab"], r["logits_bytes"]) for r in sel})
        ax_m.plot([v for v, _ in sizes], [s / 2**20 for _, s in sizes], "k+--", zorder=1)
    for ax, what in ((ax_t, "fwd+bwd time (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("vocabulary size V", fontsize=8)
        ax.set_ylabel(what, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelsize=8)


def _references(ops):
    """The reference lines the panels of ``ops`` compare with, in the legend's order."""
    logits = any(op not in LINEAR_OPS for op in ops)
    return [name for name, shown in (("copy floor", logits), ("logits size S", logits),
                                     ("bound", any(op in LINEAR_OPS for op in ops))) if shown]


def _detail_legend(section, methods, styles, references):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], label=m, **styles[m]) for m in methods]
    look = {"copy floor": dict(color="k", linestyle=":", marker="+"),
            "logits size S": dict(color="k", linestyle="--", marker="+"),
            "bound": dict(color="k", linestyle="--", marker="+")}
    handles += [Line2D([], [], label=name, **look[name]) for name in references]
    section.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)


def _caption(names):
    """One line per name drawn: what it means."""
    lines = []
    for name in names:
        if name.endswith(INPLACE_SUFFIX):
            text = (f"{name}: {METHOD_CAPTIONS[name[:-len(INPLACE_SUFFIX)]]}, "
                    f"{METHOD_CAPTIONS[INPLACE_SUFFIX]}")
        else:
            text = f"{name}: {METHOD_CAPTIONS[name]}"
        lines.extend(textwrap.wrap(text, 150, subsequent_indent="    "))
    return lines


def _title(payload):
    machine = payload.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu") or "unknown machine"
    title = (f"astrai-kernels bench: forward + backward on {where} ({machine.get('cores')} "
             f"cores), torch {machine.get('torch')}")
    cut = deadline_note(payload)
    return (f"{cut}: partial results (the JSON's \"skipped\"). {title}", "red") if cut \
        else (title, "black")


def build_figure(payload):
    """The figure of a bench payload (the JSON's dict), or None (matplotlib missing or no
    results). A (op, dtype, shape) group measured at one V only is no curve: the first panels
    carry it and the caption counts it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in payload.get("results", ())
          if "error" not in r and r.get("op") in TENSOR_OPS]
    rows = summary_rows(ok)
    vocabs_of = {}
    for r in ok:
        vocabs_of.setdefault(_group_key(r), set()).add(r["vocab"])
    curves = sorted((g for g, vs in vocabs_of.items() if len(vs) > 1),
                    key=lambda g: (TENSOR_OPS.index(g[0]), list(DTYPES).index(g[1]), g[2], g[3]))
    if not rows and not curves:
        return None
    methods = sorted({r["method"] for r in ok if _group_key(r) in curves}, key=method_rank)
    row_ops = {row["op"] for row in rows}
    # the floor panel's yardsticks are named whether or not a curve draws them
    names = sorted(set(methods) | {row["method"] for row in rows}
                   | {name for row in rows for name in row["faster"]}
                   | ({"gemm"} if row_ops & set(LINEAR_OPS) else set()), key=method_rank)
    caption_lines = (["What the names mean:"] + _caption(names)
                     + _caption(_references(row_ops | {g[0] for g in curves})))
    single = len(vocabs_of) - len(curves)
    if single:
        caption_lines.append(f"{single} (op, dtype, shape) group(s) measured at one V only are "
                             f"not drawn against V (the panels above and the tables have them).")
    summary_inches = 1.6 + SUMMARY_ROW_INCHES * len(rows) if rows else 0
    caption_inches = 0.3 + 0.17 * len(caption_lines)
    heights = ([summary_inches, summary_inches] if rows else []) \
        + ([DETAIL_ROW_INCHES * len(curves)] if curves else []) + [caption_inches]
    fig = plt.figure(figsize=(FIGURE_INCHES, sum(heights) + 0.5), layout="constrained")
    sections = list(fig.subfigures(len(heights), 1, height_ratios=heights))
    if rows:
        _draw_summary(sections.pop(0), sections.pop(0), rows)
    if curves:
        section = sections.pop(0)
        styles = _styles(methods)
        axes = section.subplots(len(curves), 2, squeeze=False)
        for (ax_t, ax_m), (op, group_dtype, n, hidden) in zip(axes, curves):
            sel = [r for r in ok if _group_key(r) == (op, group_dtype, n, hidden)]
            _draw_detail(ax_t, ax_m, sel, op, methods, styles)
            for ax, what in ((ax_t, "time"), (ax_m, "memory")):
                ax.set_title(f"{op} {group_dtype}, {shape_label(op, n, hidden)}: {what}",
                             fontsize=9)
        _detail_legend(section, methods, styles, _references({g[0] for g in curves}))
        section.suptitle("Against V: a line per method (band: fastest to slowest call)",
                         fontsize=11, fontweight="bold")
    sections.pop(0).text(0.01, 0.98, "\n".join(caption_lines), fontsize=9, va="top",
                         ha="left")
    title, colour = _title(payload)
    fig.suptitle(title, fontsize=12, color=colour,
                 fontweight="bold" if colour == "red" else "normal")
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
