"""``astrai-kernels bench --check``: the regression guard.

Runs the cases named in a bounds file (``bench/bounds.toml``), each next to its same-run
baseline, and compares every ratio with the case's ``max_ratio``. A case is ``ok`` at or under
its bound, ``over`` above it, ``failed`` when it or its baseline did not run; the check fails
(exit 1) on any case that is not ``ok``. It is a benchmark, not a unit test: a developer runs it
(``make bench-check``) before a kernel change lands and quotes its output.

A bound: ``op``, ``method`` (a backend, ``NAME:inplace`` allowed), ``dtype``, ``rows``,
``vocab``, ``hidden`` (linear ops), ``against`` (the ratio's denominator, :data:`AGAINST`: the
same-run copy floor, a baseline method of the same op, or ``plain``: the op without its option,
:data:`~astrai_kernels.bench.cases.PLAIN_OP`, same method and shape) and ``max_ratio``, and
optionally ``target`` (where the ratio should get to: printed with whether it is met, not
checked) and ``sampler`` (token_logprobs_sampling's sampler, a name of
:data:`~astrai_kernels.bench.cases.BENCH_SAMPLERS`; the headline when absent); the file's
``[machine]`` table names the machine class the bounds were set on.
"""

import math
import os
import sys
from dataclasses import dataclass

from .cases import (
    BENCH_SAMPLERS,
    BF16_MATMUL_FLAGS,
    DEFAULT_HIDDEN,
    DEFAULT_MIN_REPEATS,
    LINEAR_OPS,
    PLAIN_OP,
    TENSOR_OPS,
    Case,
    native_bf16_matmul,
    normalize_dtype,
    split_method,
)
from .report import add_ratios

# against -> (result key of the ratio, the baseline method that must run beside the case; PLAIN:
# the same method on the op's plain form)
PLAIN = "plain"
AGAINST = {
    "copy": ("ratio_vs_copy", None),
    "copy_fresh_grad": ("ratio_vs_floor_fresh_grad", None),
    "gemm": ("ratio_vs_gemm", "gemm"),
    "naive": ("ratio_vs_naive", "naive"),
    PLAIN: ("ratio_vs_plain", PLAIN),
}
LOGITS_AGAINST = ("copy", "copy_fresh_grad", "naive", PLAIN)
LINEAR_AGAINST = ("gemm", "naive")
BOUND_KEYS = ("op", "method", "dtype", "rows", "vocab", "hidden", "against", "max_ratio",
              "target", "sampler")
OPTIONAL_KEYS = ("hidden", "target", "sampler")


class BoundsError(ValueError):
    """A bounds file that cannot be read or names an unknown op, method or baseline."""


@dataclass(frozen=True)
class Bound:
    op: str
    method: str
    dtype: str
    rows: int
    vocab: int
    against: str
    max_ratio: float
    hidden: int = 0
    target: float = None  # where the ratio should get to (printed; the check is max_ratio)
    sampler: str = ""  # token_logprobs_sampling's sampler (BENCH_SAMPLERS)

    def label(self):
        hidden = f" H={self.hidden}" if self.op in LINEAR_OPS else ""
        sampler = f" {self.sampler}" if self.sampler else ""
        return (f"{self.op}{sampler} {self.method} {self.dtype} N={self.rows}{hidden} "
                f"V={self.vocab} vs {self.against}")

    def case(self, method=None, min_repeats=None, op=None, **case_options):
        """The bound's case, or with ``op`` another op's of the same shape (its plain form: no
        sampler)."""
        op = op or self.op
        min_repeats = DEFAULT_MIN_REPEATS[op] if min_repeats is None else min_repeats
        return Case(op, method or self.method, self.rows, self.vocab, self.dtype,
                    hidden=self.hidden, min_repeats=min_repeats,
                    sampler=self.sampler if op == self.op else "", **case_options)

    def baseline(self):
        """``(op, method)`` of the case the ratio divides by, None for a same-run floor."""
        base = AGAINST[self.against][1]
        if base is None:
            return None
        return (PLAIN_OP[self.op], self.method) if base == PLAIN else (self.op, base)


@dataclass(frozen=True)
class Verdict:
    bound: Bound
    ratio: float = None
    status: str = "failed"  # ok | over | failed | skipped
    why: str = ""
    ratios: tuple = ()  # every round's ratio, when the check ran more than one


def best_of(rounds):
    """One Verdict per bound from several rounds' verdicts (``rounds``: lists in bound order):
    the round with the lowest ratio. A shared machine only ever adds time, so the lowest of a
    few rounds is the measurement least disturbed by other work; a real regression raises every
    round. A bound no round measured keeps the last round's reason."""
    best = []
    for per_bound in zip(*rounds):
        measured = [v for v in per_bound if v.ratio is not None]
        if not measured:
            best.append(per_bound[-1])
            continue
        chosen = min(measured, key=lambda v: v.ratio)
        best.append(Verdict(chosen.bound, chosen.ratio, chosen.status, chosen.why,
                            tuple(v.ratio for v in measured)))
    return best


def read_toml(path):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise BoundsError(
                f"reading {path} needs Python >= 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise BoundsError(f"cannot read bounds file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BoundsError(f"bounds file {path} is not valid TOML: {exc}") from None


def parse_bounds(table, source="bounds"):
    """``(machine, [Bound])`` from a parsed bounds table; BoundsError names a bad entry and
    its key, so that no malformed value reaches a case."""
    machine_table = table.get("machine", {})
    if not isinstance(machine_table, dict):
        raise BoundsError(f"{source}: machine must be a table ([machine] with class = "
                          f"\"...\"), got {machine_table!r}")
    machine = machine_table.get("class", "unstated")
    if not isinstance(machine, str):
        raise BoundsError(f"{source}: machine.class must be a string, got {machine!r}")
    entries = table.get("case")
    if entries is None or entries == []:
        raise BoundsError(f"{source}: no [[case]] entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BoundsError(f"{source}: case must be an array of tables ([[case]] entries), "
                          f"got {entries!r}")
    return machine, [_parse_case(entry, f"{source}: case {i + 1}")
                     for i, entry in enumerate(entries)]


def _parse_case(entry, where):
    unknown = sorted(set(entry) - set(BOUND_KEYS))
    missing = [k for k in BOUND_KEYS if k not in entry and k not in OPTIONAL_KEYS]
    if unknown or missing:
        raise BoundsError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    for key in ("op", "method", "dtype", "against", "sampler"):
        if key in entry and not isinstance(entry[key], str):
            raise BoundsError(f"{where}: {key} must be a string, got {entry[key]!r}")
    if entry["op"] not in TENSOR_OPS:
        raise BoundsError(f"{where}: op must be one of {TENSOR_OPS}, got {entry['op']!r}")
    try:
        split_method(entry["method"])
        dtype = normalize_dtype(entry["dtype"])
    except ValueError as exc:
        raise BoundsError(f"{where}: {exc}") from None
    if entry["against"] not in AGAINST:
        raise BoundsError(f"{where}: against must be one of {sorted(AGAINST)}, "
                          f"got {entry['against']!r}")
    linear = entry["op"] in LINEAR_OPS
    allowed = LINEAR_AGAINST if linear else LOGITS_AGAINST
    if entry["against"] not in allowed:
        raise BoundsError(f"{where}: {entry['op']} is measured against one of {allowed}, "
                          f"got {entry['against']!r}")
    if entry["against"] == PLAIN and entry["op"] not in PLAIN_OP:
        raise BoundsError(f"{where}: against {PLAIN!r} needs an op with a plain form "
                          f"{sorted(PLAIN_OP)}, got {entry['op']!r}")
    sizes = {key: _positive_int(entry[key], key, where)
             for key in ("rows", "vocab", "hidden") if key in entry}
    ratio = _positive_number(entry["max_ratio"], "max_ratio", where)
    target = entry.get("target")
    if target is not None:
        target = _positive_number(target, "target", where)
    sampler = entry.get("sampler", "")
    if sampler and (entry["op"] != "token_logprobs_sampling" or sampler not in BENCH_SAMPLERS):
        raise BoundsError(f"{where}: sampler must be one of {sorted(BENCH_SAMPLERS)} on "
                          f"token_logprobs_sampling, got {sampler!r} on {entry['op']}")
    hidden = sizes.get("hidden", DEFAULT_HIDDEN) if linear else 0
    return Bound(entry["op"], entry["method"], dtype, sizes["rows"], sizes["vocab"],
                 entry["against"], ratio, hidden, target, sampler)


def _positive_int(value, key, where):
    # bool is an int in Python: `rows = true` must not read as 1
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BoundsError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_number(value, key, where):
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < math.inf):
        raise BoundsError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def load_bounds(path):
    return parse_bounds(read_toml(path), source=path)


def planned_cases(bounds, **case_options):
    """Each bound's case and the baseline case it is divided by, once each, in bound order."""
    cases = []
    for bound in bounds:
        for op, method in ((bound.op, bound.method), bound.baseline() or (None, None)):
            case = bound.case(method, op=op, **case_options) if method else None
            if case is not None and case not in cases:
                cases.append(case)
    return cases


def compare(bounds, results):
    """One Verdict per bound from measured ``results`` (dicts as ``measure`` returns them)."""
    results = add_ratios([dict(r) for r in results])
    verdicts = []
    for bound in bounds:
        key = AGAINST[bound.against][0]
        mine = [r for r in results if _matches(r, bound, bound.op, bound.method)]
        if not mine:
            verdicts.append(Verdict(bound, why="not run"))
            continue
        result = mine[-1]
        if "error" in result:
            verdicts.append(Verdict(bound, why=f"failed: {result['error']}"))
            continue
        ratio = result.get(key)
        if ratio is None:
            base = bound.baseline()
            base_rows = [r for r in results if base and _matches(r, bound, *base)]
            name = base and (base[1] if base[0] == bound.op else f"{base[0]} {base[1]}")
            why = (f"baseline {name} failed: {base_rows[-1]['error']}"
                   if base_rows and "error" in base_rows[-1] else f"no {key} in the result")
            verdicts.append(Verdict(bound, why=why))
            continue
        verdicts.append(Verdict(bound, ratio, "ok" if ratio <= bound.max_ratio else "over"))
    return verdicts


def _matches(result, bound, op, method):
    return (result.get("op") == op and result.get("method") == method
            and result.get("dtype") == bound.dtype and result.get("rows") == bound.rows
            and result.get("vocab") == bound.vocab
            and (bound.op not in LINEAR_OPS or result.get("hidden") == bound.hidden)
            and result.get("sampler", "") == (bound.sampler if op == bound.op else ""))


def format_verdicts(verdicts, machine):
    lines = [f"bounds set on: {machine}"]
    width = max(len(v.bound.label()) for v in verdicts)
    for v in verdicts:
        ratio = f"{_ratio(v.ratio):>7}x" if v.ratio is not None else "      - "
        tail = f"  ({v.why})" if v.why else ""
        if len(v.ratios) > 1:
            tail += (f"  (best of {len(v.ratios)}: {_ratio(min(v.ratios))}-"
                     f"{_ratio(max(v.ratios))}x)")
        if v.bound.target is not None and v.ratio is not None:
            met = "met" if v.ratio <= v.bound.target else "not met"
            tail += f"  target {_ratio(v.bound.target)}x {met}"
        relation = ">" if v.status == "over" else "<="
        lines.append(f"{v.status:>6}  {v.bound.label():<{width}}  {ratio} "
                     f"{relation} {_ratio(v.bound.max_ratio)}x{tail}")
    count = {status: sum(v.status == status for v in verdicts)
             for status in ("ok", "over", "failed", "skipped")}
    lines.append(f"{count['ok']} ok, {count['over']} over, {count['failed']} failed"
                 + (f", {count['skipped']} skipped" if count["skipped"] else ""))
    return "\n".join(lines)


def _ratio(value):
    """Three significant digits, so that 0.0123 and 0.0149 stay apart beside a 0.014 bound."""
    return f"{value:#.3g}"


def run_check(path, run_case, stream=None, rounds=1, **case_options):
    """Measure every case of the bounds at ``path`` with ``run_case(case) -> result``, ``rounds``
    times (each bound then keeps its best round, :func:`best_of`), and print the verdicts;
    returns 0 when every case is within its bound, else 1."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise BoundsError(f"rounds must be an int >= 1, got {rounds!r}")
    stream = stream or sys.stdout
    machine, bounds = load_bounds(path)
    skipped = [b for b in bounds if b.op in LINEAR_OPS and b.dtype != "fp32"
               and not native_bf16_matmul()]
    bounds = [b for b in bounds if b not in skipped]
    every_round = []
    for index in range(rounds):
        results = []
        for case in planned_cases(bounds, **case_options):
            print(f"  running {case.label()} (round {index + 1} of {rounds})", file=sys.stderr,
                  flush=True)
            results.append(run_case(case))
        every_round.append(compare(bounds, results))
    verdicts = best_of(every_round) + [
        Verdict(b, status="skipped", why=f"this CPU has no bf16 matmul instructions "
                f"({' or '.join(BF16_MATMUL_FLAGS)}): its bf16 GEMMs take minutes")
        for b in skipped]
    print(format_verdicts(verdicts, machine), file=stream)
    return 0 if all(v.status in ("ok", "skipped") for v in verdicts) else 1


def default_bounds_path():
    from .runner import ROOT

    return os.path.join(ROOT, "bench", "bounds.toml")


__all__ = ["AGAINST", "Bound", "BoundsError", "Verdict", "best_of", "compare",
           "default_bounds_path", "format_verdicts", "load_bounds", "parse_bounds",
           "planned_cases", "run_check"]
