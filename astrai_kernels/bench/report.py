"""Derived figures and the text report: ratios against the floors and baselines, the machine
block, the progress bar, the tables, the JSON file."""

import json
import math
import os
import platform
import statistics
import sys
import time

from .cases import (
    BASELINES,
    DTYPES,
    KERNEL_BACKENDS,
    LINEAR_BASELINES,
    LINEAR_OPS,
    LOGITS_BASELINES,
    LOGITS_OPS,
    PLAIN_OP,
    TENSOR_OPS,
    split_method,
)


def _shape_key(r, method, op=None, sampler=None):
    return (op or r["op"], r["rows"], r.get("hidden", 0), r["vocab"], r["dtype"], r["device"],
            r.get("sampler", "") if sampler is None else sampler, method)


def add_ratios(results):
    """Fill, in place, the floor and the ratios of every result.

    Logits ops: ``floor_s`` from the same-run copy, ``ratio_vs_copy``, bandwidths, memory over
    the logits' size S. Linear ops: ``floor_s`` = the median of the ``gemm`` case of the same
    shape, ``ratio_vs_gemm``, ``effective_GFLOPs`` (the floor's matmul flops over the time),
    memory over S (the logits they never hold) and over ``peak_bound_bytes``. Both:
    ``ratio_vs_<baseline>`` for each baseline of the op's family (None where it did not run).
    An op with a plain form (``PLAIN_OP``): ``ratio_vs_plain``, over that op's result of the
    same method and shape (None where it did not run).
    """
    by_shape = {}
    for r in results:
        if "error" not in r and r.get("op") in TENSOR_OPS:
            by_shape[_shape_key(r, r["method"])] = r
    for r in results:
        if "error" in r or r.get("op") not in TENSOR_OPS:
            continue
        if r["op"] in LINEAR_OPS:
            _linear_figures(r, by_shape.get(_shape_key(r, "gemm")))
            baselines = LINEAR_BASELINES
        else:
            _logits_figures(r)
            baselines = LOGITS_BASELINES
        for base in baselines:
            other = by_shape.get(_shape_key(r, base))
            r[f"ratio_vs_{base}"] = r["median_s"] / other["median_s"] if other else None
        if r["op"] in PLAIN_OP:  # the plain op has no sampler
            plain = by_shape.get(_shape_key(r, r["method"], PLAIN_OP[r["op"]], ""))
            r["ratio_vs_plain"] = r["median_s"] / plain["median_s"] if plain else None
        r["peak_extra_over_logits"] = r["peak_extra_bytes"] / r["logits_bytes"]
    return results


def _logits_figures(r):
    if r.get("copy_s"):
        # the floor: the op's bytes at the copy's bandwidth (a copy of B bytes moves 2 B)
        per_copy = r["floor_bytes"] / (2 * r.get("copy_bytes", r["logits_bytes"]))
        r["floor_s"] = r["copy_s"] * per_copy
        paired = r.get("paired_copy_s")
        r["ratio_vs_copy"] = (statistics.median(t / (c * per_copy) for t, c in zip(
            r["times_s"], paired)) if paired else r["median_s"] / r["floor_s"])
        r["copy_bandwidth_GBps"] = 2 * r.get("copy_bytes", r["logits_bytes"]) / r["copy_s"] / 1e9
        if r.get("clone_s"):
            # the floor plus the first touch of one fresh S-sized buffer (the gradient)
            r["floor_fresh_grad_s"] = r["floor_s"] + max(r["clone_s"] - r["copy_s"], 0.0)
            r["ratio_vs_floor_fresh_grad"] = r["median_s"] / r["floor_fresh_grad_s"]
    r["effective_bandwidth_GBps"] = r["floor_bytes"] / r["median_s"] / 1e9
    if r.get("copy_bandwidth_GBps"):
        r["bandwidth_vs_copy"] = r["effective_bandwidth_GBps"] / r["copy_bandwidth_GBps"]
    # Total resident (logits + what the op adds) over logits + one gradient of their size.
    r["peak_over_logits_plus_grad"] = ((r["logits_bytes"] + r["peak_extra_bytes"])
                                       / (2 * r["logits_bytes"]))


def _linear_figures(r, gemm):
    if gemm is not None:
        r["floor_s"] = gemm["median_s"]
        r["ratio_vs_gemm"] = r["median_s"] / gemm["median_s"]
    r["effective_GFLOPs"] = r["floor_flops"] / r["median_s"] / 1e9
    r["peak_extra_over_grads"] = r["peak_extra_bytes"] / r["grad_bytes"]
    r["peak_over_bound"] = r["peak_extra_bytes"] / r["peak_bound_bytes"]


# The /proc/cpuinfo flags that decide which of the C++ kernels' ISA paths runs, and the GEMMs'
SIMD_FLAG_PREFIXES = ("avx", "fma", "amx", "f16c")


def machine_info(device="cpu"):
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    info["cpu_flags"] = [f for f in flags if f.startswith(SIMD_FLAG_PREFIXES)]
                    break
    except OSError:
        pass
    from ..kernels.cpp.backend import ISA_ENV

    if os.environ.get(ISA_ENV):
        info["cpu_isa_cap"] = os.environ[ISA_ENV]
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    try:
        from importlib.metadata import version

        info["triton"] = version("triton")
    except Exception:
        info["triton"] = None
    from .. import __version__

    info["astrai_kernels"] = __version__
    return info


class Progress:
    """A one-line progress bar on stderr (a line per step where stderr is not a terminal)."""

    def __init__(self, total, stream=None, width=28):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def _line(self, label):
        frac = min(self.done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = "?" if math.isnan(eta) else _clock(eta)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{_clock(elapsed)} elapsed, eta {eta_text}  {label}")

    def update(self, label, advance=0):
        self.done += advance
        line = self._line(label)
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
        elif advance:  # not a terminal: one line per finished step
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def method_rank(method):
    """Sort key: baselines, then backends in BACKENDS order, each before its ``:inplace``."""
    try:
        name, inplace = split_method(method)
    except (ValueError, AttributeError):
        return (99, 0, str(method))
    return ((BASELINES + KERNEL_BACKENDS).index(name), int(inplace), method)


def _dtype_rank(r):
    return list(DTYPES).index(r["dtype"]) if r.get("dtype") in DTYPES else 9


def _clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def format_table(results, cuda=False):
    """The results as a text table (ratios: < 1 means faster/smaller than the baseline)."""
    mib = 1 << 20
    width = max(map(len, LOGITS_OPS))
    head = (f"{'op':<{width}} {'method':<11} {'dtype':<5} {'N':>6} {'V':>7} {'median ms':>10} "
            f"{'n':>2} {'floor ms':>9} {'x floor':>8} {'x fresh':>8} {'x naive':>8} "
            f"{'x compile':>9} {'x plain':>8} {'peak MiB':>9} {'peak/S':>7}")
    if cuda:
        head += f" {'GB/s':>7} {'clone GB/s':>10} {'%clone':>6}"
    has_logits_rows = any(r.get("op") in LOGITS_OPS for r in results)
    lines = [head, "-" * len(head)] if has_logits_rows else []
    tensor_rows = sorted(
        (r for r in results if r.get("op") in LOGITS_OPS),
        key=lambda r: (LOGITS_OPS.index(r["op"]), _dtype_rank(r), r.get("rows", 0),
                       r.get("vocab", 0),
                       method_rank(r.get("method"))))
    for r in tensor_rows:
        prefix = (f"{r['op']:<{width}} {r['method']:<11} {r['dtype']:<5} {r['rows']:>6} "
                  f"{r['vocab']:>7} ")
        if "error" in r:
            lines.append(prefix + "FAILED: " + r["error"].splitlines()[-1][:100])
            continue
        line = (prefix + f"{r['median_s'] * 1e3:>10.1f} {r['repeats']:>2} "
                f"{_fmt(r.get('floor_s') and r['floor_s'] * 1e3, '>9.1f'):>9} "
                f"{_fmt(r.get('ratio_vs_copy'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_floor_fresh_grad'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_naive'), '>8.2f'):>8} "
                f"{_fmt(r.get('ratio_vs_compile'), '>9.2f'):>9} "
                f"{_fmt(r.get('ratio_vs_plain'), '>8.2f'):>8} "
                f"{r['peak_extra_bytes'] / mib:>9.1f} {r['peak_extra_over_logits']:>7.2f}")
        if cuda:
            pct = r.get("bandwidth_vs_copy") and 100 * r["bandwidth_vs_copy"]
            line += (f" {r['effective_bandwidth_GBps']:>7.0f} "
                     f"{_fmt(r.get('copy_bandwidth_GBps'), '>10.0f'):>10} "
                     f"{_fmt(pct, '>6.0f'):>6}")
        lines.append(line)
    strategy_rows = [r for r in results if r.get("op") == "strategies"]
    if strategy_rows:
        lines += [""] if lines else []
        lines.append(f"{'strategy step':<15} {'method':<9} {'backend':<9} {'V':>7} "
                     f"{'step ms':>9} {'peak MiB':>9} {'peak/S':>7} {'x naive':>8}")
        for r in strategy_rows:
            if "error" in r:
                lines.append(f"{r.get('strategy', '-'):<15} FAILED: {r['error'][:100]}")
                continue
            lines.append(f"{r['strategy']:<15} {r['method']:<9} {r['backend']:<9} "
                         f"{r['vocab']:>7} {r['median_s'] * 1e3:>9.1f} "
                         f"{r['peak_extra_bytes'] / mib:>9.1f} "
                         f"{r['peak_extra_over_logits']:>7.2f} "
                         f"{_fmt(r.get('ratio_vs_naive'), '>8.2f'):>8}")
    if any(r.get("op") in LINEAR_OPS for r in results):
        lines += ([""] if lines else []) + [format_linear_table(results)]
    return "\n".join(lines)


def format_linear_table(results):
    """The linear ops' results as a text table (ratios: < 1 means faster than the baseline)."""
    mib = 1 << 20
    head = (f"{'op':<29} {'method':<17} {'dtype':<5} {'N':>5} {'H':>5} {'V':>6} "
            f"{'median ms':>10} {'n':>2} {'gemm ms':>9} {'x gemm':>7} {'x naive':>8} "
            f"{'x lce-chk':>9} {'peak MiB':>9} {'peak/S':>7} {'/bound':>6}")
    lines = [head, "-" * len(head)]
    rows = sorted((r for r in results if r.get("op") in LINEAR_OPS),
                  key=lambda r: (LINEAR_OPS.index(r["op"]), _dtype_rank(r), r.get("rows", 0),
                                 r.get("hidden", 0), r.get("vocab", 0),
                                 method_rank(r.get("method"))))
    for r in rows:
        prefix = (f"{r['op']:<29} {r['method']:<17} {r['dtype']:<5} {r['rows']:>5} "
                  f"{r.get('hidden', 0):>5} {r['vocab']:>6} ")
        if "error" in r:
            lines.append(prefix + "FAILED: " + r["error"].splitlines()[-1][:100])
            continue
        lines.append(prefix + f"{r['median_s'] * 1e3:>10.1f} {r['repeats']:>2} "
                     f"{_fmt(r.get('floor_s') and r['floor_s'] * 1e3, '>9.1f'):>9} "
                     f"{_fmt(r.get('ratio_vs_gemm'), '>7.2f'):>7} "
                     f"{_fmt(r.get('ratio_vs_naive'), '>8.2f'):>8} "
                     f"{_fmt(r.get('ratio_vs_torch_lce_chunked'), '>9.2f'):>9} "
                     f"{r['peak_extra_bytes'] / mib:>9.1f} {r['peak_extra_over_logits']:>7.2f} "
                     f"{r['peak_over_bound']:>6.2f}")
    return "\n".join(lines)


LEGEND = ("median ms: forward+backward (GRPO: one step); n: timed calls; floor ms: the same-run "
          "copy_ of the logits (median of copies between the timed calls, into a buffer already "
          "touched) scaled to the bytes the op must move (2 S; GRPO 4 S; distill 3 S); x floor / "
          "x naive / x compile: time over that floor, the naive path, its torch.compile; "
          "x plain: token_logprobs_sampling's time over token_logprobs' (same method); lower is "
          "better; x fresh (CPU): time over the floor plus the first touch of one fresh S-sized "
          "buffer (clone - copy_ of the logits), what any op returning a new gradient pays; "
          "peak MiB: resident memory the call adds above its inputs (the gradient included); "
          "peak/S: that over the logits' bytes S.")
LINEAR_LEGEND = (
    "Linear ops (hidden [N, H] and LM head [V, H] in, logits never held): gemm ms: the same-run "
    "GEMM floor, hidden @ weight.T + dlogits @ weight + dlogits.T @ hidden at the same shapes "
    "and dtype (linear_grpo: + one forward matmul each for old and ref; linear_distill: + the "
    "teacher's); x gemm / x naive / "
    "x lce-chk: time over that floor / over F.linear + the seed's fp32 math / over "
    "torch.nn.functional.linear_cross_entropy with LinearCrossEntropyOptions(); peak MiB: "
    "resident memory the call adds above its inputs (gradients of hidden and weight included); "
    "peak/S: that over the bytes S of the [N, V] logits in the inputs' dtype; /bound: that over "
    "the gradients + an fp32 [V, H] accumulator + 96 MiB (issue 13's bound; <= 1 meets it).")


def deadline_note(payload):
    """``"cut by deadline: K of N cases skipped"`` for a bench payload whose deadline left cases
    unrun (``of N`` where it records ``planned_cases``), else None."""
    skipped = len(payload.get("skipped") or ())
    if not skipped:
        return None
    planned = payload.get("planned_cases")
    return f"cut by deadline: {skipped}{f' of {planned}' if planned else ''} cases skipped"


class OutputError(OSError):
    """A result file could not be written (the CLI prints it as one line)."""


def write_json(path, payload):
    """Write ``payload`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as out:
            json.dump(payload, out, indent=1, default=str)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
