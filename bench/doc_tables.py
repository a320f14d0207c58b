"""The measured tables of docs/benchmarks.md and of the README's "Measured (CPU)" section, from
one ``astrai-kernels bench`` JSON file.

    python bench/doc_tables.py bench/results/bench.json         # print docs/benchmarks.md's tables
    python bench/doc_tables.py bench/results/bench.json \
        --write docs/benchmarks.md --readme README.md             # write both (make bench-docs)

``--write`` and ``--readme`` each replace what lies between that file's BEGIN and END markers and
nothing else, both from the same JSON, so every figure there comes from one run; then one line on
stdout says what was written (the files, the machine, the commit). ``make bench-docs`` runs the
benchmark, then this with both (``make bench`` writes only under bench/results/). From a run that
did not run every case (cut by its deadline, or stopped before its end) it writes only with
``--partial``, and the tables then say so; otherwise it leaves the files alone with a note on
stderr and exits 0.
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

from astrai_kernels.bench.cases import KERNEL_BACKENDS, LINEAR_OPS, LOGITS_OPS
from astrai_kernels.bench.report import deadline_note

BEGIN = ("<!-- BEGIN tables written by bench/doc_tables.py from one `make bench-docs` "
         "run -->")
END = "<!-- END tables written by bench/doc_tables.py -->"
README_BEGIN = ("<!-- BEGIN README tables written by bench/doc_tables.py from one "
                "`make bench-docs` run -->")
README_END = "<!-- END README tables written by bench/doc_tables.py -->"
# The README's headline: the logits ops at this V, the fused head at every shape it ran
README_VOCAB = 32768
README_OP_NAMES = {"grpo": "`grpo_loss` (one step)", "distill": "`distill_loss`",
                   "linear_distill": "`linear_distill_loss`", "linear_grpo": "`linear_grpo_loss`"}
README_HEAD_VERSUS = ("naive", "torch_lce", "torch_lce_chunked")
LOGITS_METHOD_ORDER = ["naive", "compile", "torch", "cpp", "cpp:inplace", "triton",
                       "triton:inplace"]
LINEAR_ORDER = ["gemm", "naive", "torch_lce", "torch_lce_chunked", "torch", "cpp", "triton"]


def _ratio(value):
    return "" if value is None else f"{value:.2f}x"


def _order(method, order):
    return order.index(method) if method in order else len(order)


def _commit():
    """The checkout's commit, ``-dirty`` when its tracked files have uncommitted changes."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _machine_line(machine):
    """``AMD EPYC (2 cores; AVX-512 with bf16)``: the CPU and the widest SIMD its flags show."""
    flags = set(machine.get("cpu_flags") or ())
    simd = ("AMX and AVX-512 with bf16" if {"amx_tile", "avx512_bf16"} <= flags
            else "AVX-512 with bf16" if "avx512_bf16" in flags
            else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
            else "SIMD flags not recorded" if not flags else "no AVX2")
    cap = f", kernels capped at {machine['cpu_isa_cap']}" if machine.get("cpu_isa_cap") else ""
    where = machine.get("gpu") or machine.get("cpu")
    return f"{where} ({machine.get('cores')} cores; {simd}{cap})"


def tables(data, commit=None):
    """The markdown of the machine line and the tables, as one string."""
    machine = data["machine"]
    flags = " ".join(machine.get("cpu_flags") or []) or "not recorded"
    cap = f", kernels capped at {machine['cpu_isa_cap']}" if machine.get("cpu_isa_cap") else ""
    lines = [f"Measured {machine.get('cpu')} ({machine.get('cores')} cores; SIMD flags: "
             f"{flags}{cap}), torch {machine.get('torch')}, load average at start "
             f"{', '.join(f'{x:.1f}' for x in machine.get('loadavg_at_start', []))}"
             + (f"; written at commit {commit}" if commit else "") + "."]
    why_partial = partial_run(data)
    if why_partial:
        lines.append(f"**Partial run: {why_partial}; these tables miss those cases.**")
    lines += ["", "| op | shape | dtype | method | median ms | vs copy_ | vs naive | vs compile "
              "| peak extra / S |", "|---|---|---|---|---|---|---|---|---|"]
    rows = sorted((r for r in data["results"] if r["op"] != "strategies"
                   and not r["op"].startswith("linear_") and r["vocab"] == 32768
                   and "median_s" in r),
                  key=lambda r: (r["op"], r["dtype"] != "fp32",
                                 _order(r["method"], LOGITS_METHOD_ORDER)))
    for r in rows:
        shape = "B=8, T=512" if r["op"] == "grpo" else f"N={r['rows']}"
        peak = r.get("peak_extra_bytes")
        peak_s = "" if peak is None else f"{peak / r['logits_bytes']:.2f}"
        lines.append(f"| {r['op']} | {shape}, V={r['vocab']} | {r['dtype']} | {r['method']} | "
                     f"{r['median_s'] * 1e3:.1f} | {_ratio(r.get('ratio_vs_copy'))} | "
                     f"{_ratio(r.get('ratio_vs_naive'))} | {_ratio(r.get('ratio_vs_compile'))} | "
                     f"{peak_s} |")
    linear = sorted((r for r in data["results"] if r["op"].startswith("linear_")
                     and "median_s" in r),
                    key=lambda r: (r["op"], r["dtype"] != "fp32", r["rows"], r["hidden"],
                                   r["vocab"], _order(r["method"], LINEAR_ORDER)))
    if linear:
        lines += ["", "| op | shape | dtype | method | median ms | vs GEMM floor | vs naive "
                  "| peak extra MiB | peak / S | peak / bound |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in linear:
            shape = f"B=8, T={r['rows'] // 8}" if r["op"] == "linear_grpo" else f"N={r['rows']}"
            lines.append(
                f"| {r['op']} | {shape}, H={r['hidden']}, V={r['vocab']} | {r['dtype']} | "
                f"{r['method']} | {r['median_s'] * 1e3:.1f} | {_ratio(r.get('ratio_vs_gemm'))} "
                f"| {_ratio(r.get('ratio_vs_naive'))} | {r['peak_extra_bytes'] / 2**20:.0f} | "
                f"{r['peak_extra_bytes'] / r['logits_bytes']:.2f} | "
                f"{r['peak_extra_bytes'] / r['peak_bound_bytes']:.2f} |")
    strategies = [r for r in data["results"] if r["op"] == "strategies" and "median_s" in r]
    if strategies:
        lines += ["", "| strategy | method | step ms | peak extra / S | time vs naive |",
                  "|---|---|---|---|---|"]
        for r in strategies:
            lines.append(f"| {r['strategy']} | {r['method']} | {r['median_s'] * 1e3:.1f} | "
                         f"{r['peak_extra_over_logits']:.2f} | {_ratio(r.get('ratio_vs_naive'))} |")
    return "\n".join(lines) + "\n"


def _kernel(results, op, dtype):
    """The first backend in KERNEL_BACKENDS order measured for ``op`` in ``dtype``, or None."""
    ran = {r["method"] for r in results if r["op"] == op and r["dtype"] == dtype}
    return next((m for m in KERNEL_BACKENDS if m in ran), None)


def _dtypes(results, op):
    order = ["fp32", "bf16", "fp16"]
    return sorted({r["dtype"] for r in results if r["op"] == op},
                  key=lambda d: order.index(d) if d in order else len(order))


def readme_tables(data, commit=None, date=None):
    """The markdown of the README's "Measured (CPU)" block: the run line, the logits ops at
    V = README_VOCAB (the package's kernel against the floor, the naive path and its
    torch.compile; memory: the naive path's and the kernel's, in place in brackets) and the fused
    head at every shape it ran (time over its GEMM floor, memory in MiB, peak over the bound)."""
    results = [r for r in data["results"] if "median_s" in r and r.get("op") != "strategies"]
    machine = data["machine"]
    kernels = sorted({m for op in LOGITS_OPS + LINEAR_OPS for d in _dtypes(results, op)
                      for m in [_kernel(results, op, d)] if m})
    run = ", ".join(x for x in (date, f"commit {commit}" if commit else None) if x)
    lines = [textwrap.fill(
        f"From one `astrai-kernels bench` run ({run}; every table of that run is in "
        f"[docs/benchmarks.md](docs/benchmarks.md)): forward + backward on "
        f"{_machine_line(machine)}, torch {machine.get('torch')}, "
        f"{', '.join(f'`{k}`' for k in kernels) or 'no'} backend.", 100,
        break_long_words=False, break_on_hyphens=False)]
    why_partial = partial_run(data)
    if why_partial:
        lines.append(f"**Partial run: {why_partial}; these tables miss those cases.**")
    by_case = {(r["op"], r["dtype"], r["rows"], r.get("hidden", 0), r["vocab"], r["method"]): r
               for r in results}
    lines += ["", "| op | shape | dtype | time vs floor | vs naive | vs compile "
              "| peak extra / S: naive, this (in place) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for op in LOGITS_OPS:
        for dtype in _dtypes(results, op):
            kernel = _kernel(results, op, dtype)
            cases = [r for r in results if r["op"] == op and r["dtype"] == dtype
                     and r["method"] == kernel and r["vocab"] == README_VOCAB]
            for r in cases:
                key = (op, dtype, r["rows"], r.get("hidden", 0), r["vocab"])
                naive = by_case.get(key + ("naive",))
                inplace = by_case.get(key + (f"{kernel}:inplace",))
                peaks = ", ".join(f"{x['peak_extra_bytes'] / x['logits_bytes']:.2f}"
                                  for x in (naive, r) if x is not None)
                if inplace is not None:
                    peaks += f" ({inplace['peak_extra_bytes'] / inplace['logits_bytes']:.2f})"
                shape = (f"B=8, T={r['rows'] // 8}" if op == "grpo" else f"N={r['rows']}")
                lines.append(f"| {README_OP_NAMES.get(op, f'`{op}`')} | {shape}, V={r['vocab']} "
                             f"| {dtype} | {_ratio(r.get('ratio_vs_copy'))} | "
                             f"{_ratio(r.get('ratio_vs_naive'))} | "
                             f"{_ratio(r.get('ratio_vs_compile'))} | {peaks} |")
    head = [(op, dtype) for op in LINEAR_OPS for dtype in _dtypes(results, op)]
    if head:
        names = " / ".join(("this",) + README_HEAD_VERSUS)
        lines += ["", f"| fused head | shape | dtype | time vs GEMM floor: {names} "
                  f"| peak extra MiB: {names} | peak / bound |",
                  "| --- | --- | --- | --- | --- | --- |"]
    for op, dtype in head:
        kernel = _kernel(results, op, dtype)
        for r in sorted((r for r in results if r["op"] == op and r["dtype"] == dtype
                         and r["method"] == kernel), key=lambda r: (r["rows"], r["vocab"])):
            key = (op, dtype, r["rows"], r.get("hidden", 0), r["vocab"])
            cases = [r] + [by_case.get(key + (base,)) for base in README_HEAD_VERSUS]
            times = " / ".join("-" if x is None else _ratio(x.get("ratio_vs_gemm")) or "-"
                               for x in cases)
            peaks = " / ".join("-" if x is None else f"{x['peak_extra_bytes'] / 2**20:.0f}"
                               for x in cases)
            shape = (f"B=8, T={r['rows'] // 8}" if op == "linear_grpo" else f"N={r['rows']}")
            lines.append(f"| {README_OP_NAMES.get(op, f'`{op}`')} | {shape}, H={r['hidden']}, "
                         f"V={r['vocab']} | {dtype} | {times} | {peaks} | "
                         f"{r['peak_extra_bytes'] / r['peak_bound_bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def partial_run(data):
    """Why the run of ``data`` did not run every case (a short phrase), or None."""
    if not data.get("complete", True):
        return "stopped before its end"
    return deadline_note(data)


def write_into(doc_path, text, begin=BEGIN, end=END):
    """Replace the text between the markers ``begin`` and ``end`` of ``doc_path`` by ``text``."""
    with open(doc_path) as f:
        doc = f.read()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise SystemExit(f"{doc_path}: expected one {begin!r} line, then one {end!r} line")
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(doc_path, "w") as f:
        f.write(f"{head}{begin}\n{text}{end}{tail}")


def _run_date(json_path):
    """The day the run ended: the JSON's last write (the bench saves it after every case)."""
    return time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(json_path)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default="bench/results/bench.json")
    parser.add_argument("--write", metavar="DOC", help="replace the marked tables of DOC")
    parser.add_argument("--readme", metavar="README",
                        help="replace the marked \"Measured (CPU)\" tables of README")
    parser.add_argument("--commit", default=None,
                        help="the commit the run measured (default: the checkout's now, "
                             "-dirty with uncommitted changes)")
    parser.add_argument("--partial", action="store_true",
                        help="write even from a run that did not run every case")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    commit = args.commit or _commit()
    text = tables(data, commit=commit)
    targets = [path for path in (args.write, args.readme) if path]
    why = partial_run(data)
    if targets and why and not args.partial:
        left = "left as it was" if len(targets) == 1 else "left as they were"
        print(f"{' and '.join(targets)} {left}: {args.json} is a partial run ({why}); rerun "
              "without a deadline (astrai-kernels bench --deadline inf) or pass --partial",
              file=sys.stderr)
        return
    if not targets:
        print(text, end="")
        return
    if args.write:
        write_into(args.write, text)
    if args.readme:
        write_into(args.readme, readme_tables(data, commit, _run_date(args.json)),
                   README_BEGIN, README_END)
    print(f"wrote {' and '.join(targets)} from {args.json}: measured on "
          f"{_machine_line(data['machine'])}, torch {data['machine'].get('torch')}, commit "
          f"{commit or 'unknown'}" + (f" (partial run: {why})" if why else ""))


if __name__ == "__main__":
    main()
