"""The measured tables of docs/benchmarks.md, from one ``astrai-kernels bench`` JSON file.

    python bench/doc_tables.py bench/results/bench.json                           # print them
    python bench/doc_tables.py bench/results/bench.json --write docs/benchmarks.md

``--write`` replaces what lies between the BEGIN and END markers of that file and nothing else
(``make bench`` runs it after the benchmark), so every figure there comes from one run. From a
run that did not run every case (cut by its deadline, or stopped before its end) it writes only
with ``--partial``, and the tables then say so; otherwise it leaves the file alone with a note on
stderr and exits 0, so that ``make bench`` on a busy machine keeps the tracked tables.
"""

import argparse
import json
import subprocess
import sys

from astrai_kernels.bench.report import deadline_note

BEGIN = "<!-- BEGIN tables written by bench/doc_tables.py from one `make bench` run -->"
END = "<!-- END tables written by bench/doc_tables.py -->"
LOGITS_METHOD_ORDER = ["naive", "compile", "torch", "cpp", "cpp:inplace", "triton",
                       "triton:inplace"]
LINEAR_ORDER = ["gemm", "naive", "torch_lce", "torch_lce_chunked", "torch", "cpp", "triton"]


def _ratio(value):
    return "" if value is None else f"{value:.2f}x"


def _order(method, order):
    return order.index(method) if method in order else len(order)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


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


def partial_run(data):
    """Why the run of ``data`` did not run every case (a short phrase), or None."""
    if not data.get("complete", True):
        return "stopped before its end"
    return deadline_note(data)


def write_into(doc_path, text):
    """Replace the text between the markers of ``doc_path`` by ``text``."""
    with open(doc_path) as f:
        doc = f.read()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise SystemExit(f"{doc_path}: expected one {BEGIN!r} line, then one {END!r} line")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(doc_path, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}{END}{tail}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default="bench/results/bench.json")
    parser.add_argument("--write", metavar="DOC", help="replace the marked tables of DOC")
    parser.add_argument("--partial", action="store_true",
                        help="--write even from a run that did not run every case")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    text = tables(data, commit=_commit())
    why = partial_run(data)
    if args.write and why and not args.partial:
        print(f"{args.write} left as it was: {args.json} is a partial run ({why}); rerun "
              "without a deadline (astrai-kernels bench --deadline inf) or pass --partial",
              file=sys.stderr)
    elif args.write:
        write_into(args.write, text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
