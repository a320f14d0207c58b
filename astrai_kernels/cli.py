"""``astrai-kernels bench | verify | compile-check``.

* ``bench``: every op x method (kernel backends and the naive / ``torch.compile`` baselines),
  forward+backward median time, peak memory, ratios against the same-run copy floor, the naive
  path and its ``torch.compile``; a table, a JSON file of every figure and a plot
  (see :mod:`astrai_kernels.bench_runner` for how each figure is measured).
* ``verify``: every op x available backend x dtype x shape against ``reference.py`` in float64,
  values and gradients, against the tolerance table; exit status 1 on any failure
  (see :mod:`astrai_kernels.testing.verify`).
* ``compile-check``: AOT-compile every Triton kernel for real GPU targets
  (:mod:`astrai_kernels.triton.compile_check`; its own options).
"""

import argparse
import os
import sys
import time

_STARTED = time.perf_counter()  # the --deadline counts from here (imports and builds included)


def _split(text):
    return [item.strip() for item in str(text).split(",") if item.strip()]


def parse_size(text):
    """``32768``, ``32k`` (= 32768), ``128K``, ``1m`` -> int."""
    text = str(text).strip().lower()
    scale = 1
    if text.endswith("k"):
        scale, text = 1024, text[:-1]
    elif text.endswith("m"):
        scale, text = 1024 * 1024, text[:-1]
    try:
        value = int(text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 32k)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {value}")
    return value


def _sizes(text):
    return [parse_size(item) for item in _split(text)]


def _default_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------
# bench


def add_bench_arguments(parser):
    from . import bench_runner as br

    parser.add_argument("--ops", default=",".join(br.OPS),
                        help="comma-separated, from %s (default: all)" % ", ".join(br.OPS))
    parser.add_argument("--rows", default=None,
                        help=f"token rows N, comma-separated (default {br.CPU_DEFAULT_ROWS} on "
                             f"CPU, {br.GPU_DEFAULT_ROWS} on CUDA); GRPO uses B={br.GRPO_BATCH}, "
                             f"T=N/B")
    parser.add_argument("--vocab", default=None,
                        help="vocabulary sizes V, comma-separated, k = 1024 (default on CPU: "
                             + "; ".join(f"{op} {','.join(map(str, v))}"
                                         for op, v in br.CPU_DEFAULT_VOCABS.items())
                             + f"; on CUDA {','.join(map(str, br.GPU_DEFAULT_VOCABS))})")
    parser.add_argument("--dtype", "--dtypes", dest="dtype", default="fp32,bf16",
                        help="fp32, bf16, fp16, comma-separated (default: %(default)s)")
    parser.add_argument("--backends", default=None,
                        help="kernel backends to time (default: the available ones except "
                             "reference, and the first of them again as NAME:inplace; never "
                             "triton on CPU, where it only runs interpreted); "
                             "NAME:inplace times NAME with inplace_backward=True (token_logprobs "
                             "and cross_entropy only)")
    parser.add_argument("--baselines", default=",".join(br.BASELINES),
                        help="naive, compile or none (default: %(default)s)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile baseline (slow to compile)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per case after one warm-up (default: %(default)s)")
    parser.add_argument("--min-repeats", type=int, default=2,
                        help="at least this many timed calls even when over --case-budget")
    parser.add_argument("--case-budget", type=float, default=2.0,
                        help="stop timing a case after about this many seconds of calls, once "
                             "--min-repeats ran (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per case (default 0: os.cpu_count())")
    parser.add_argument("--isolation", choices=("forkserver", "subprocess"), default="forkserver",
                        help="each case in a process forked from a preloaded server (default) "
                             "or a fresh interpreter")
    parser.add_argument("--case-timeout", type=float, default=300.0,
                        help="seconds before a case is killed and reported failed")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="start no case after this many seconds (counted from the start of "
                             "the command); the rest are listed as "
                             "skipped (table, JSON and plot still written). Default on CPU "
                             f"{br.CPU_DEFAULT_DEADLINE_S:.0f} (so the default run ends within "
                             "10 minutes), none on CUDA; 'inf' for none")
    parser.add_argument("--strategy-backends", default=None,
                        help="backends for the strategies' steps (default: the first of "
                             "--backends); the seed's math always runs as 'naive'")
    parser.add_argument("--strategy-repeats", type=int, default=2,
                        help="timed steps per strategy case (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="write the plot (PNG) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def bench(args, argv=None):
    import torch

    from . import bench_runner as br
    from .ops._backend import available_backends

    device = args.device or _default_device()
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    ops = _split(args.ops)
    for op in ops:
        if op not in br.OPS:
            print(f"bench: unknown op {op!r}; choose from {', '.join(br.OPS)}", file=sys.stderr)
            return 2
    try:
        dtypes = [br.normalize_dtype(d) for d in _split(args.dtype)]
        rows_list = _sizes(args.rows) if args.rows else [
            br.GPU_DEFAULT_ROWS if cuda else br.CPU_DEFAULT_ROWS]
        vocab_list = _sizes(args.vocab) if args.vocab else None
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if "grpo" in ops:
        bad = [n for n in rows_list if n % br.GRPO_BATCH]
        if bad:
            print(f"bench: grpo needs rows divisible by B={br.GRPO_BATCH}, got {bad}",
                  file=sys.stderr)
            return 2
    if vocab_list:
        vocabs = {op: vocab_list for op in br.OPS}
    elif cuda:
        vocabs = {op: br.GPU_DEFAULT_VOCABS for op in br.OPS}
        vocabs["strategies"] = (32768,)
    else:
        vocabs = dict(br.CPU_DEFAULT_VOCABS)

    available = [b for b in available_backends(device) if b != "reference"]
    if not cuda:
        available = [b for b in available if b != "triton"]
    if args.backends is None:
        # and the preferred backend once more with inplace_backward=True (no fresh gradient)
        backends = available + [available[0] + br.INPLACE_SUFFIX] if available else []
    else:
        backends = [b for b in _split(args.backends) if b != "none"]
        for name in backends:
            try:
                base, _ = br.split_method(name)
            except ValueError:
                base = None
            if base not in br.KERNEL_BACKENDS:
                print(f"bench: unknown backend {name!r}; choose from "
                      f"{', '.join(br.KERNEL_BACKENDS)} (a backend may carry "
                      f"{br.INPLACE_SUFFIX!r}: inplace_backward=True)", file=sys.stderr)
                return 2
        skipped = [b for b in backends if br.split_method(b)[0] != "reference"
                   and br.split_method(b)[0] not in available]
        if skipped:
            why = ("the triton backend runs on CPU only interpreted (TRITON_INTERPRET=1), far "
                   "too slow to time" if skipped == ["triton"] and not cuda else
                   f"available on {device}: {', '.join(available) or 'none'}")
            print(f"bench: skipping backend(s) {', '.join(skipped)}: {why}", file=sys.stderr)
            backends = [b for b in backends if b not in skipped]
    baselines = [b for b in _split(args.baselines) if b != "none"]
    for name in baselines:
        if name not in br.BASELINES:
            print(f"bench: unknown baseline {name!r}; choose from {', '.join(br.BASELINES)}",
                  file=sys.stderr)
            return 2
    if args.no_compile:
        baselines = [b for b in baselines if b != "compile"]
    methods = baselines + backends
    if not methods:
        print("bench: nothing to run (no backend and no baseline)", file=sys.stderr)
        return 2
    if args.strategy_backends is not None:
        strategy_backends = _split(args.strategy_backends)
    else:
        plain = [b for b in backends if not br.split_method(b)[1]]
        strategy_backends = plain[:1] or ["auto"]

    deadline = args.deadline
    if deadline is None and not cuda:
        deadline = br.CPU_DEFAULT_DEADLINE_S
    if deadline is not None and deadline == float("inf"):
        deadline = None
    if deadline is not None:
        deadline = max(deadline - (time.perf_counter() - _STARTED), 0.0)
    payload = br.run_benchmarks(
        ops, rows_list, vocabs, dtypes, methods, device=device, repeats=args.repeats,
        min_repeats=args.min_repeats, budget_s=args.case_budget, threads=args.threads,
        isolation=args.isolation, timeout=args.case_timeout, strategy_backends=strategy_backends,
        strategy_repeats=args.strategy_repeats, json_path=args.json, plot_path=args.plot,
        progress=not args.no_progress, argv=argv, deadline_s=deadline)
    machine = payload["machine"]
    print(f"astrai-kernels bench on {machine.get('gpu') or machine.get('cpu')} "
          f"({machine.get('cores')} cores, torch {machine.get('torch')}, triton "
          f"{machine.get('triton')}), {payload['config']['threads']} threads, device {device}")
    print(br.format_table(payload["results"], cuda=cuda))
    print()
    print(br.LEGEND)
    for note in payload["notes"]:
        print(f"note: {note}")
    for item in payload["skipped"]:
        print(f"skipped: {item.get('op')} {item.get('method', '')} {item.get('dtype', '')} "
              f"N={item.get('rows', '-')} V={item.get('vocab')}")
    failed = [r for r in payload["results"] if "error" in r]
    if args.json:
        print(f"JSON: {args.json}")
    if args.plot and os.path.exists(args.plot):
        print(f"plot: {args.plot}")
    print(f"total {payload['total_s']:.0f} s; {len(payload['results'])} results, "
          f"{len(failed)} failed, {len(payload['skipped'])} skipped")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# main


def build_parser():
    parser = argparse.ArgumentParser(
        prog="astrai-kernels",
        description="Fused LLM losses from the logits in vocabulary tiles: benchmarks and checks.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,verify,compile-check}")
    bench_parser = sub.add_parser(
        "bench", help="time and peak memory of every op and backend against the copy floor, "
                      "the naive path and torch.compile")
    add_bench_arguments(bench_parser)
    verify_parser = sub.add_parser(
        "verify", help="every op x backend x dtype x shape against reference.py in float64")
    from .testing import verify as verify_module

    verify_module.add_arguments(verify_parser)
    sub.add_parser("compile-check", add_help=False,
                   help="AOT-compile every Triton kernel for sm_80/sm_90 and report registers, "
                        "spills and shared memory (see compile-check --help)")
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compile-check":
        from .triton.compile_check import main as compile_check_main

        return compile_check_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench(args, argv)
    if args.command == "verify":
        from .testing import verify as verify_module

        return verify_module.run_from_args(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
