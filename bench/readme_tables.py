"""Print the README's markdown tables from a ``astrai-kernels bench`` JSON file.

    python bench/readme_tables.py bench/results/bench.json
"""

import json
import sys

LINEAR_ORDER = ["gemm", "naive", "torch_lce", "torch_lce_chunked", "torch", "cpp", "triton"]


def _ratio(value):
    return "" if value is None else f"{value:.2f}x"


def main(path):
    data = json.load(open(path))
    machine = data["machine"]
    print(f"Measured {machine.get('cpu')} ({machine.get('cores')} cores), torch "
          f"{machine.get('torch')}, load average at start "
          f"{', '.join(f'{x:.1f}' for x in machine.get('loadavg_at_start', []))}.\n")
    print("| op | shape | dtype | method | median ms | vs copy_ | vs naive | vs compile "
          "| peak extra / S |")
    print("|---|---|---|---|---|---|---|---|---|")
    method_order = ["naive", "compile", "torch", "cpp", "cpp:inplace", "triton", "triton:inplace"]
    rows = sorted((r for r in data["results"] if r["op"] != "strategies"
                   and not r["op"].startswith("linear_") and r["vocab"] == 32768
                   and "median_s" in r),
                  key=lambda r: (r["op"], r["dtype"] != "fp32", method_order.index(r["method"])
                                 if r["method"] in method_order else 99))
    for r in rows:
        shape = "B=8, T=512" if r["op"] == "grpo" else f"N={r['rows']}"
        peak = r.get("peak_extra_bytes")
        peak_s = "" if peak is None else f"{peak / r['logits_bytes']:.2f}"
        print(f"| {r['op']} | {shape}, V={r['vocab']} | {r['dtype']} | {r['method']} | "
              f"{r['median_s'] * 1e3:.1f} | {_ratio(r.get('ratio_vs_copy'))} | "
              f"{_ratio(r.get('ratio_vs_naive'))} | {_ratio(r.get('ratio_vs_compile'))} | "
              f"{peak_s} |")
    linear = sorted((r for r in data["results"] if r["op"].startswith("linear_")
                     and "median_s" in r),
                    key=lambda r: (r["op"], r["dtype"] != "fp32", r["rows"], r["hidden"],
                                   r["vocab"], LINEAR_ORDER.index(r["method"])
                                   if r["method"] in LINEAR_ORDER else 99))
    if linear:
        print("\n| op | shape | dtype | method | median ms | vs GEMM floor | vs naive "
              "| peak extra MiB | peak / S | peak / bound |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in linear:
            shape = (f"B=8, T={r['rows'] // 8}" if r["op"] == "linear_grpo" else f"N={r['rows']}")
            print(f"| {r['op']} | {shape}, H={r['hidden']}, V={r['vocab']} | {r['dtype']} | "
                  f"{r['method']} | {r['median_s'] * 1e3:.1f} | {_ratio(r.get('ratio_vs_gemm'))} "
                  f"| {_ratio(r.get('ratio_vs_naive'))} | {r['peak_extra_bytes'] / 2**20:.0f} | "
                  f"{r['peak_extra_bytes'] / r['logits_bytes']:.2f} | "
                  f"{r['peak_extra_bytes'] / r['peak_bound_bytes']:.2f} |")
    strategies = [r for r in data["results"] if r["op"] == "strategies" and "median_s" in r]
    if strategies:
        print("\n| strategy | method | step ms | peak extra / S | time vs seed |")
        print("|---|---|---|---|---|")
        for r in strategies:
            print(f"| {r['strategy']} | {r['method']} | {r['median_s'] * 1e3:.1f} | "
                  f"{r['peak_extra_over_logits']:.2f} | {_ratio(r.get('ratio_vs_naive'))} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/bench.json")
