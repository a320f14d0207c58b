"""AOT-compile every Triton kernel configuration for real GPU targets, no GPU needed.

``run(archs)`` compiles each entry of ``backend.compile_configurations()`` with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` and reads registers, spills
and shared memory from the cubin with Triton's bundled ``cuobjdump --dump-resource-usage``
(falling back to the compiled kernel's ``n_regs`` / ``n_spills`` where a Triton version has them).
A failed compile or any spill (a non-zero stack / local frame) makes an entry not ok. ``shared``
is the shared memory Triton requests per program (the reduction scratch), ``shared_static`` what
the cubin declares (on sm_90 the 1 KiB the hardware reserves per block).

The interpreter (``TRITON_INTERPRET=1``) would replace the compiler, so this refuses to run then.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

INTERPRET_ENV = "TRITON_INTERPRET"
DEFAULT_ARCHS = ("sm_80", "sm_90")


class CompileCheckError(RuntimeError):
    pass


def _require_compiler():
    if os.environ.get(INTERPRET_ENV, "0") not in ("", "0"):
        raise CompileCheckError(
            f"compile-check needs the Triton compiler, but {INTERPRET_ENV}="
            f"{os.environ[INTERPRET_ENV]} selects the interpreter; unset it and run again")
    from . import backend
    if backend.import_error() is not None:
        raise CompileCheckError(f"triton could not be imported: {backend.import_error()}")
    if backend.kernels_interpreted():
        raise CompileCheckError("the triton kernels were built for the interpreter "
                                f"({INTERPRET_ENV}=1 when they were imported); run in a fresh "
                                f"process without {INTERPRET_ENV}")
    return backend


def _capability(arch):
    match = re.fullmatch(r"sm_?(\d+)a?", str(arch).strip())
    if not match:
        raise CompileCheckError(f"arch must look like sm_80 or sm_90, got {arch!r}")
    return int(match.group(1))


def _cuobjdump():
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def resource_usage(cubin):
    """``{"registers", "stack", "local", "shared"}`` of the (single) function in a cubin."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
        path = handle.name
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                             text=True, timeout=120)
    finally:
        os.unlink(path)
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout))
    if "REG" not in fields:
        return None
    return {"registers": int(fields["REG"]), "stack": int(fields.get("STACK", 0)),
            "local": int(fields.get("LOCAL", 0)), "shared": int(fields.get("SHARED", 0))}


def _attrs(fn, divisible):
    """Triton's ``attrs`` for 16-divisible arguments (the format of Triton >= 3.2)."""
    names = list(fn.arg_names)
    return {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}


def _compile_one(index, arch):
    """Compile entry ``index`` for ``arch``; returns the report row (runs in a worker process)."""
    backend = _require_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    entry = _entries(backend)[index]
    row = {"kernel": entry["kernel"], "config": entry["config"], "arch": arch,
           "registers": None, "spills": None, "shared": None, "ok": False, "error": None}
    target = GPUTarget("cuda", _capability(arch), 32)
    options = {"num_warps": entry["num_warps"]}
    try:
        try:
            source = ASTSource(fn=entry["fn"], signature=entry["signature"],
                               constexprs=entry["constexprs"],
                               attrs=_attrs(entry["fn"], entry["divisible"]))
            compiled = triton.compile(source, target=target, options=options)
        except (TypeError, KeyError, AttributeError):
            # a Triton whose attrs format differs: compile without the alignment hints
            source = ASTSource(fn=entry["fn"], signature=entry["signature"],
                               constexprs=entry["constexprs"])
            compiled = triton.compile(source, target=target, options=options)
    except Exception as exc:  # the report says what failed; never raise for one entry
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
        return row
    usage = resource_usage(compiled.asm["cubin"])
    if usage is not None:
        row["registers"] = usage["registers"]
        row["spills"] = usage["stack"] + usage["local"]
        row["shared_static"] = usage["shared"]  # e.g. the 1 KiB sm_90 reserves per block
    else:
        row["registers"] = getattr(compiled, "n_regs", None)
        row["spills"] = getattr(compiled, "n_spills", None)
    # the shared memory Triton requests at launch (reduction scratch)
    row["shared"] = getattr(compiled.metadata, "shared", None)
    if row["registers"] is None or row["spills"] is None:
        row["error"] = "could not read registers/spills (no cuobjdump, no n_regs/n_spills)"
    elif row["spills"] > 0:
        row["error"] = f"{row['spills']} bytes of stack/local memory (register spills)"
    else:
        row["ok"] = True
    return row


_QUICK = False
_ENTRIES = None


def _entries(backend):
    global _ENTRIES
    if _ENTRIES is None:
        _ENTRIES = backend.compile_configurations(quick=_QUICK)
    return _ENTRIES


def _init_worker(quick):
    global _QUICK, _ENTRIES
    if quick != _QUICK:
        _ENTRIES = None
    _QUICK = quick
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 warning; the default


def run(archs=DEFAULT_ARCHS, quick=False, jobs=None):
    """Compile every kernel configuration for each arch; a list of report dicts (see module doc).

    ``quick`` compiles the reduced list of ``compile_configurations(quick=True)``; ``jobs``
    parallel worker processes (default: the CPU count, at most 8; each is ``python -m`` of this
    module, so callers need no ``__main__`` guard).
    """
    backend = _require_compiler()
    archs = [f"sm_{_capability(arch)}" for arch in archs]
    count = len(backend.compile_configurations(quick=quick))
    work = [(index, arch) for arch in archs for index in range(count)]
    jobs = max(1, min(jobs or min(8, os.cpu_count() or 1), len(work)))
    if jobs == 1:
        _init_worker(quick)
        return [_compile_one(index, arch) for index, arch in work]
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in
                                        env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = []
    for shard in range(jobs):
        cmd = [sys.executable, "-m", "astrai_kernels.kernels.triton.compile_check", "--worker",
               f"{shard}/{jobs}", "--arch", ",".join(archs)] + (["--quick"] if quick else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    results = {}
    for shard, proc in enumerate(procs):
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise CompileCheckError(f"compile worker {shard} failed ({proc.returncode}): "
                                    f"{err.strip()[-2000:]}")
        for item in json.loads(out):
            results[(item["index"], item["row"]["arch"])] = item["row"]
    return [results[(index, arch)] for index, arch in work]


def _worker(spec, archs, quick):
    shard, count = (int(x) for x in spec.split("/"))
    _init_worker(quick)
    backend = _require_compiler()
    work = [(index, arch) for arch in archs
            for index in range(len(_entries(backend)))]
    rows = [{"index": index, "row": _compile_one(index, arch)}
            for position, (index, arch) in enumerate(work) if position % count == shard]
    print(json.dumps(rows))
    return 0


def _describe(config):
    flags = [k for k, v in config.items() if v is True]
    keys = ("dtype", "V", "BLOCK_V", "num_warps")
    base = " ".join(f"{k}={config[k]}" for k in keys if k in config)
    return base + (" " + ",".join(flags) if flags else "")


def format_table(rows):
    header = f"{'kernel':<26} {'arch':<6} {'regs':>4} {'spill':>5} {'smem':>6}  {'ok':<4} config"
    lines = [header, "-" * len(header)]
    for row in rows:
        regs = "-" if row["registers"] is None else row["registers"]
        spills = "-" if row["spills"] is None else row["spills"]
        shared = "-" if row["shared"] is None else row["shared"]
        lines.append(f"{row['kernel']:<26} {row['arch']:<6} {regs:>4} {spills:>5} {shared:>6}  "
                     f"{'ok' if row['ok'] else 'FAIL':<4} {_describe(row['config'])}")
        if row["error"]:
            lines.append(f"    error: {row['error']}")
    failed = sum(not row["ok"] for row in rows)
    lines.append(f"{len(rows)} compiled, {failed} failed or spilled")
    return "\n".join(lines)


def main(argv=None):
    """``astrai-kernels compile-check [--arch sm_80,sm_90] [--json] [--quick] [--jobs N]``."""
    parser = argparse.ArgumentParser(prog="astrai-kernels compile-check",
                                     description="AOT-compile every Triton kernel configuration "
                                                 "and report registers, spills, shared memory")
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                        help="comma-separated targets (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--quick", action="store_true",
                        help="fewer flag combinations and dtypes (every kernel still built)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes")
    parser.add_argument("--allow-spills", action="store_true",
                        help="exit 0 when every configuration compiles, spills or not (they are "
                             "still reported): an older Triton's spill is a speed note")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    archs = [a for a in args.arch.split(",") if a.strip()]
    try:
        if args.worker:
            return _worker(args.worker, [f"sm_{_capability(a)}" for a in archs], args.quick)
        rows = run(archs, quick=args.quick, jobs=args.jobs)
    except CompileCheckError as exc:
        print(f"compile-check: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
    return 0 if rows and all(row["ok"] or (args.allow_spills and spilled_only(row))
                             for row in rows) else 1


def spilled_only(row):
    """Whether the entry compiled and is not ok only because it spills."""
    return row["registers"] is not None and bool(row["spills"])


if __name__ == "__main__":
    sys.exit(main())
