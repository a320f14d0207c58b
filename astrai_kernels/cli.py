"""``astrai-kernels bench | verify | compile-check | build``.

* ``bench``: every op x method (kernel backends and baselines), forward+backward median time,
  peak memory, ratios against the same-run floor (a copy of the logits; for the fused-LM-head
  ``linear_*`` ops the matmuls they must do) and the baselines (the naive path, its
  ``torch.compile``, ``torch.nn.functional.linear_cross_entropy``); a table, a JSON file of every
  figure and a plot (see :mod:`astrai_kernels.bench` for how each figure is measured).
* Bad arguments (an unknown op or backend, an empty list, a count below 1, an output path that
  cannot be written, ``--plot`` without matplotlib) give a one-line error and exit status 2
  before anything runs.
* ``verify``: token_logprobs, cross_entropy, grpo_loss and sequence_logprobs x available backend
  x dtype x shape against ``reference.py`` in float64, values and gradients, against the
  tolerance table; exit status 1 on any failure (see :mod:`astrai_kernels.testing.verify`, which
  also says why the other ops are not in it).
* ``compile-check``: AOT-compile every Triton kernel for real GPU targets
  (:mod:`astrai_kernels.kernels.triton.compile_check`; its own options).
* ``build``: compile the cpp backend's C++ kernels now rather than on the first CPU call (a few
  minutes, once; the cached library loads in well under a second after); prints where it went and
  how long it took, exit status 1 with the compiler's error when it fails.
"""

import argparse
import os
import sys
import tempfile
import time

# the --deadline counts from main()'s start (the heavy imports and builds come after it)
_STARTED = time.perf_counter()


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
# argument checks shared by bench and verify: one-line errors before any work


class UsageError(ValueError):
    """A bad command line; ``main`` prints it as one line and exits with status 2."""


def check_output_path(flag, path):
    """A UsageError unless ``path`` can be written (its folder is created if missing)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path}: is a directory")
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".astrai-kernels-write-check-"):
            pass
        if os.path.exists(target):
            with open(target, "a"):
                pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None


def check_device(text):
    """``text`` as a device string of type cpu or cuda, else a UsageError."""
    import torch

    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (e.g. cuda:0), got {text!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text} but CUDA is not available")
    return text


def nonempty(flag, items, choices=None):
    """``items`` if it names at least one thing, each in ``choices`` if given."""
    if not items:
        raise UsageError(f"{flag} names nothing" + (f"; choose from {', '.join(choices)}"
                                                    if choices else ""))
    for item in items:
        if choices is not None and item not in choices:
            raise UsageError(f"{flag}: unknown {item!r}; choose from {', '.join(choices)}")
    return items


def at_least(flag, value, low):
    if value < low:
        raise UsageError(f"{flag} must be at least {low}, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# verify


def add_verify_arguments(parser):
    from .testing import verify as vf

    parser.add_argument("--ops", default=",".join(vf.OPS),
                        help="comma-separated, from %(default)s (default: all four); "
                             "distill_loss, the linear_* ops and the preference ops are not "
                             "checked here (the test suite checks them)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated (default: the available ones except reference)")
    parser.add_argument("--dtypes", "--dtype", dest="dtypes", default="fp32,bf16,fp16",
                        help="comma-separated (default: %(default)s)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated BxTxV[:shifted] (default: "
                             f"{','.join(vf.DEFAULT_SHAPES)}; on CUDA also "
                             f"{','.join(vf.CUDA_EXTRA_SHAPES)}; interpreted triton: "
                             f"{','.join(vf.INTERPRETED_SHAPES)})")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="write the rows as JSON to PATH (no PATH: print JSON instead of "
                             "the table)")
    parser.add_argument("--failures-only", action="store_true",
                        help="print only the failed rows and the summary")


def verify_plan(args):
    """The checked verify arguments as ``verify.report`` keywords (a UsageError when bad);
    nothing is run."""
    from .kernels.registry import BACKENDS, available_backends, unavailable_reason
    from .testing import verify as vf

    ops = nonempty("--ops", _split(args.ops), vf.OPS)
    dtypes = nonempty("--dtypes", _split(args.dtypes), tuple(vf.DTYPES))
    shapes = None
    if args.shapes is not None:
        try:
            shapes = [vf.Shape.parse(text) for text in nonempty("--shapes", _split(args.shapes))]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.backends is not None:
        nonempty("--backends", _split(args.backends), BACKENDS)
    device = check_device(args.device) if args.device else _default_device()
    if args.json not in (None, "-"):
        check_output_path("--json", args.json)
    available = available_backends(device)
    if args.backends is None:
        backends = [b for b in available if b != "reference"]
    else:
        backends = _split(args.backends)
        missing = [b for b in backends if b not in available]
        if missing:
            raise UsageError("; ".join(f"backend {name!r} is not available on {device}: "
                                       f"{unavailable_reason(name, device)}"
                                       for name in missing))
    return dict(ops=ops, backends=backends, dtypes=dtypes, shapes=shapes, device=device,
                json_path=args.json, failures_only=args.failures_only)


# ---------------------------------------------------------------------------------------------
# bench


def add_bench_arguments(parser):
    from .bench import cases as bc

    def defaults(table):
        return "; ".join(f"{op} {','.join(map(str, v))}" for op, v in table.items())

    parser.add_argument("--ops", default=",".join(bc.DEFAULT_OPS),
                        help="comma-separated, from %s (default: all but %s)" % (
                            ", ".join(bc.OPS),
                            ", ".join(op for op in bc.OPS if op not in bc.DEFAULT_OPS)))
    parser.add_argument("--rows", default=None,
                        help=f"token rows N, comma-separated (default on CPU: "
                             f"{defaults(bc.CPU_DEFAULT_ROWS)}; on CUDA {bc.GPU_DEFAULT_ROWS}); "
                             f"GRPO uses B={bc.GRPO_BATCH}, T=N/B")
    parser.add_argument("--vocab", default=None,
                        help="vocabulary sizes V, comma-separated, k = 1024 (default on CPU: "
                             f"{defaults(bc.CPU_DEFAULT_VOCABS)}; then, with neither "
                             f"--rows nor --vocab, V={bc.CPU_LARGE_VOCAB}: token_logprobs and "
                             "cross_entropy at N=512, linear_cross_entropy and "
                             "linear_token_logprobs_entropy in bf16 at N=2048 where the CPU "
                             "has bf16 matmul instructions; on CUDA "
                             f"{','.join(map(str, bc.GPU_DEFAULT_VOCABS))})")
    parser.add_argument("--hidden", default=str(bc.DEFAULT_HIDDEN),
                        help="hidden sizes H of the linear ops, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", "--dtypes", dest="dtype", default=None,
                        help="fp32, bf16, fp16, comma-separated (default on CPU: "
                             f"{defaults(bc.CPU_DEFAULT_DTYPES)}: the linear ops' bf16 GEMMs "
                             "are 6-70x slower than fp32 on a CPU without bf16 matmul "
                             "instructions; on CUDA "
                             f"{','.join(bc.GPU_DEFAULT_DTYPES)})")
    parser.add_argument("--backends", default=None,
                        help="kernel backends to time (default: the available ones except "
                             "reference, and the first of them again as NAME:inplace; never "
                             "triton on CPU, where it only runs interpreted); "
                             "NAME:inplace times NAME with inplace_backward=True (token_logprobs "
                             "and cross_entropy only)")
    parser.add_argument("--baselines", default=",".join(bc.BASELINES),
                        help="comma-separated, or none (default: %(default)s; each runs for "
                             f"its op family: {', '.join(bc.LOGITS_BASELINES)} for the logits "
                             f"ops, {', '.join(bc.LINEAR_BASELINES)} for the linear ops)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile baseline (slow to compile)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per case after one warm-up (default: %(default)s)")
    parser.add_argument("--min-repeats", type=int, default=None,
                        help="at least this many timed calls even when over --case-budget "
                             "(default: 2; 1 for the linear ops, whose calls take seconds)")
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
                             f"{bc.CPU_DEFAULT_DEADLINE_S:.0f} (so the default run ends within "
                             "10 minutes), none on CUDA; 'inf' for none")
    parser.add_argument("--strategy-backends", default=None,
                        help="backends for the strategies' steps (default: the first of "
                             "--backends); the original training code's math always runs as "
                             "'naive'")
    parser.add_argument("--strategy-repeats", type=int, default=2,
                        help="timed steps per strategy case (default: %(default)s)")
    parser.add_argument("--check-rounds", type=int, default=3,
                        help="--check measures every case this many times and keeps each "
                             "case's best round (default 3)")
    parser.add_argument("--check", action="store_true",
                        help="the regression guard: run the cases of the bounds file, each "
                             "with its same-run baseline, print ok/over per case, exit 1 on "
                             "any case over its bound (the other case flags are ignored)")
    parser.add_argument("--bounds", metavar="PATH", default=None,
                        help="bounds file of --check (default: bench/bounds.toml)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH",
                        help="write the plot (PNG) here (needs matplotlib: the 'plot' extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _per_op(text, parse, flag, default_table, cuda_default, cuda):
    """One list for every op from ``text``, else the per-op CPU table or the CUDA default."""
    if text is not None:
        return nonempty(flag, parse(text))
    return cuda_default if cuda else dict(default_table)


def bench_plan(args):
    """The checked bench arguments as ``run_benchmarks`` keywords (a UsageError when bad);
    nothing is run."""
    from .bench import cases as bc
    from .bench.plot import have_matplotlib
    from .kernels.registry import available_backends

    for flag, value, low in (("--repeats", args.repeats, 1),
                             ("--min-repeats",
                              1 if args.min_repeats is None else args.min_repeats, 1),
                             ("--threads", args.threads, 0),
                             ("--strategy-repeats", args.strategy_repeats, 1)):
        at_least(flag, value, low)
    for flag, value in (("--case-budget", args.case_budget),
                        ("--case-timeout", args.case_timeout)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.deadline is not None and not args.deadline >= 0:
        raise UsageError(f"--deadline must be a number of seconds >= 0 (or inf), "
                         f"got {args.deadline}")
    device = check_device(args.device) if args.device else _default_device()
    cuda = device.startswith("cuda")
    ops = nonempty("--ops", _split(args.ops), bc.OPS)
    try:
        dtypes = _per_op(args.dtype, lambda t: [bc.normalize_dtype(d) for d in _split(t)],
                         "--dtype", bc.CPU_DEFAULT_DTYPES, list(bc.GPU_DEFAULT_DTYPES), cuda)
        rows = _per_op(args.rows, _sizes, "--rows", bc.CPU_DEFAULT_ROWS,
                       [bc.GPU_DEFAULT_ROWS], cuda)
        vocabs = _per_op(args.vocab, _sizes, "--vocab", bc.CPU_DEFAULT_VOCABS,
                         list(bc.GPU_DEFAULT_VOCABS), cuda)
        hidden = nonempty("--hidden", _sizes(args.hidden))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(vocabs, dict):
        vocabs = {op: vocabs for op in bc.OPS}
        if cuda and args.vocab is None:
            vocabs["strategies"] = (32768,)
    for op in bc.GRPO_OPS:
        bad = [n for n in (rows[op] if isinstance(rows, dict) else rows) if n % bc.GRPO_BATCH]
        if op in ops and bad:
            raise UsageError(f"{op} needs rows divisible by B={bc.GRPO_BATCH}, got {bad}")

    if args.plot and not have_matplotlib():
        raise UsageError(f"--plot {args.plot}: matplotlib is not installed "
                         "(pip install matplotlib, or the package's 'plot' extra)")
    for flag in ("json", "plot"):
        if getattr(args, flag):
            check_output_path(f"--{flag}", getattr(args, flag))

    available = [b for b in available_backends(device) if b != "reference"]
    if not cuda:
        available = [b for b in available if b != "triton"]
    notes = []
    if args.backends is None:
        # and the preferred backend once more with inplace_backward=True (no fresh gradient)
        backends = available + [available[0] + bc.INPLACE_SUFFIX] if available else []
    else:
        backends = [b for b in _split(args.backends) if b != "none"]
        for name in backends:
            try:
                base, _ = bc.split_method(name)
            except ValueError:
                base = None
            if base not in bc.KERNEL_BACKENDS:
                raise UsageError(f"unknown backend {name!r}; choose from "
                                 f"{', '.join(bc.KERNEL_BACKENDS)} (a backend may carry "
                                 f"{bc.INPLACE_SUFFIX!r}: inplace_backward=True)")
        skipped = [b for b in backends if bc.split_method(b)[0] != "reference"
                   and bc.split_method(b)[0] not in available]
        if skipped:
            why = ("the triton backend runs on CPU only interpreted (TRITON_INTERPRET=1), far "
                   "too slow to time" if skipped == ["triton"] and not cuda else
                   f"available on {device}: {', '.join(available) or 'none'}")
            notes.append(f"skipping backend(s) {', '.join(skipped)}: {why}")
            backends = [b for b in backends if b not in skipped]
    baselines = [b for b in _split(args.baselines) if b != "none"]
    for name in baselines:
        if name not in bc.BASELINES:
            raise UsageError(f"unknown baseline {name!r}; choose from "
                             f"{', '.join(bc.BASELINES)}")
    if args.no_compile:
        baselines = [b for b in baselines if b != "compile"]
    # only the methods that apply to one of the selected ops
    methods = [m for m in baselines + backends
               if any(bc.method_applies(op, m) for op in ops if op in bc.TENSOR_OPS)]
    if not methods and "strategies" not in ops:
        raise UsageError("nothing to run (no backend and no baseline for these ops)")
    plain_backends = [b for b in backends if not bc.split_method(b)[1]]  # not NAME:inplace
    if args.strategy_backends is not None:
        strategy_backends = _split(args.strategy_backends)
    else:
        strategy_backends = plain_backends[:1] or ["auto"]

    deadline = args.deadline
    if deadline is None and not cuda:
        deadline = bc.CPU_DEFAULT_DEADLINE_S
    if deadline is not None and deadline == float("inf"):
        deadline = None
    if deadline is not None:
        deadline = max(deadline - (time.perf_counter() - _STARTED), 0.0)
    min_repeats = (dict(bc.DEFAULT_MIN_REPEATS) if args.min_repeats is None
                   else args.min_repeats)
    # the default CPU run adds Gemma 3's vocabulary (bench/cases.py CPU_LARGE_VOCAB_CASES)
    large_vocab_cases = []
    if not cuda and args.rows is None and args.vocab is None and plain_backends:
        large_vocab_cases = bc.plan_large_vocab_cases(
            ops, plain_backends[0], args.repeats, min_repeats, args.case_budget, args.threads,
            hidden=hidden[0])
    return notes, dict(
        ops=ops, rows=rows, vocabs=vocabs, dtypes=dtypes, methods=methods, device=device,
        repeats=args.repeats, budget_s=args.case_budget, min_repeats=min_repeats,
        threads=args.threads, isolation=args.isolation, timeout=args.case_timeout,
        strategy_backends=strategy_backends, strategy_repeats=args.strategy_repeats,
        json_path=args.json, plot_path=args.plot, progress=not args.no_progress,
        deadline_s=deadline, hidden=hidden, large_vocab_cases=large_vocab_cases)


def bench_check(args):
    """``bench --check``: the bounds file's cases against their bounds (see bench/check.py)."""
    from .bench.check import BoundsError, default_bounds_path, run_check
    from .bench.runner import CaseRunner

    at_least("--threads", args.threads, 0)
    at_least("--check-rounds", args.check_rounds, 1)
    path = args.bounds or default_bounds_path()
    try:
        with CaseRunner(args.isolation, args.case_timeout) as runner:
            return run_check(path, runner.run, rounds=args.check_rounds, repeats=args.repeats,
                             min_repeats=args.min_repeats, budget_s=args.case_budget,
                             threads=args.threads)
    except BoundsError as exc:
        raise UsageError(str(exc)) from None


def bench(args, argv=None):
    from .bench import cases as bc
    from .bench.report import LEGEND, LINEAR_LEGEND, format_table
    from .bench.suite import run_benchmarks

    notes, plan = bench_plan(args)
    for note in notes:
        print(f"bench: {note}", file=sys.stderr)
    payload = run_benchmarks(argv=argv, **plan)
    machine = payload["machine"]
    device = plan["device"]
    print(f"astrai-kernels bench on {machine.get('gpu') or machine.get('cpu')} "
          f"({machine.get('cores')} cores, torch {machine.get('torch')}, triton "
          f"{machine.get('triton')}), {payload['config']['threads']} threads, device {device}")
    print(format_table(payload["results"], cuda=device.startswith("cuda")))
    print()
    ops_run = {r.get("op") for r in payload["results"]}
    if ops_run & set(bc.LOGITS_OPS):
        print(LEGEND)
    if ops_run & set(bc.LINEAR_OPS):
        print(LINEAR_LEGEND)
    for note in payload["notes"]:
        print(f"note: {note}")
    for item in payload["skipped"]:
        hidden = f" H={item['hidden']}" if item.get("hidden") else ""
        print(f"skipped: {item.get('op')} {item.get('method', '')} {item.get('dtype', '')} "
              f"N={item.get('rows', '-')}{hidden} V={item.get('vocab')}")
    failed = [r for r in payload["results"] if "error" in r]
    if args.json:
        print(f"JSON: {args.json}")
    if args.plot and os.path.exists(args.plot):
        print(f"plot: {args.plot}")
    print(f"total {payload['total_s']:.0f} s; {len(payload['results'])} results, "
          f"{len(failed)} failed, {len(payload['skipped'])} skipped")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# build


def build_extension():
    """``build``: compile (or find cached) and load the cpp backend's extension; 0, else 1."""
    from .kernels.cpp import backend as cpp_backend

    cached = cpp_backend.cached_library()
    started = time.perf_counter()
    try:
        module = cpp_backend.load_extension()
    except RuntimeError as exc:
        print(f"build: {exc}", file=sys.stderr)
        print("build: without it, backend='auto' runs CPU tensors on the slower torch backend "
              "(ASTRAI_KERNELS_BACKEND=torch chooses that outright)", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    done = f"already built, loaded in {elapsed:.2f} s" if cached else f"built in {elapsed:.0f} s"
    print(f"cpp backend: {module.__file__} ({done}; kernels use {module.isa()})")
    return 0


# ---------------------------------------------------------------------------------------------
# main


def build_parser():
    parser = argparse.ArgumentParser(
        prog="astrai-kernels",
        description="Fused LLM losses from the logits in vocabulary tiles: benchmarks, checks "
                    "and the ahead-of-time build of the C++ kernels.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,verify,compile-check,build}")
    bench_parser = sub.add_parser(
        "bench", help="time and peak memory of every op and backend against the copy floor, "
                      "the naive path and torch.compile")
    add_bench_arguments(bench_parser)
    verify_parser = sub.add_parser(
        "verify", help="token_logprobs, cross_entropy, grpo_loss and sequence_logprobs x "
                       "backend x dtype x shape against reference.py in float64",
        description="Checks token_logprobs, cross_entropy, grpo_loss and sequence_logprobs, "
                    "values and gradients, on each available backend x dtype x shape against "
                    "reference.py in float64. Not checked here: distill_loss and the linear_* "
                    "ops (the test suite compares them with reference.py), the preference ops "
                    "and group_advantages (plain PyTorch, no backend to choose).")
    add_verify_arguments(verify_parser)
    sub.add_parser("compile-check", add_help=False,
                   help="AOT-compile every Triton kernel for sm_80/sm_90 and report registers, "
                        "spills and shared memory (see compile-check --help)")
    sub.add_parser("build", help="compile the cpp backend's C++ kernels now (once, a few "
                                 "minutes) instead of on the first call with CPU tensors",
                   description="Compiles the cpp backend's C++ kernels into the build cache "
                               "($ASTRAI_KERNELS_BUILD_DIR, else the per-user cache) and loads "
                               "them; prints the library's path and the time taken. Exit status "
                               "1, with the compiler's error, when the build fails.")
    return parser


def main(argv=None):
    global _STARTED
    _STARTED = time.perf_counter()  # an in-process caller (a test) may import this module early
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compile-check":
        from .kernels.triton.compile_check import main as compile_check_main

        return compile_check_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "build":
        return build_extension()
    if args.command not in ("bench", "verify"):
        parser.print_help()
        return 2
    from .bench.report import OutputError

    try:
        if args.command == "bench":
            return bench_check(args) if args.check else bench(args, argv)
        plan = verify_plan(args)
    except (UsageError, OutputError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    from .testing import verify as verify_module

    return verify_module.report(**plan)


if __name__ == "__main__":
    sys.exit(main())
