"""The whole run of ``astrai-kernels bench``: plan the cases, run each in its own process, in
this order, each only while the deadline allows: every op's largest vocabulary, the strategies'
steps (:mod:`astrai_kernels.bench.strategy_steps`), ``torch.compile`` at the largest
vocabulary, then the smaller vocabularies (the curves). The JSON is rewritten after each case,
the plot drawn at the end.

On a shared machine, timings carry the other processes' load: every result records
``loadavg`` (and the machine block ``loadavg_at_start``).
"""

import os
import time
from dataclasses import asdict

from .cases import (
    FLOOR_FACTOR,
    GEMM_COUNT,
    GRPO_BATCH,
    GRPO_CLIP_EPS,
    GRPO_KL_COEF,
    LINEAR_WORKSPACE_BOUND,
    METHOD_NOTES,
    STRATEGY_RESERVE_S,
    is_headline,
    plan_cases,
    split_method,
    unavailable_baselines,
)
from .plot import plot
from .report import Progress, add_ratios, deadline_note, machine_info, write_json
from .runner import CaseRunner


def load_strategy_bench():
    """``(run_strategy_steps, None)`` of :mod:`.strategy_steps`, or ``(None, why not)``: it
    imports the strategies, so only a run that times them does, and a failure is a note."""
    try:
        from .strategy_steps import run_strategy_steps
    except ImportError as exc:
        return None, f"importing astrai_kernels.bench.strategy_steps failed: {exc}"
    return run_strategy_steps, None


def run_strategies(vocab, backends, repeats, timeout):
    """Strategy-step rows (one per strategy x method) in this module's result format."""
    fn, why = load_strategy_bench()
    if fn is None:
        return [], why
    rows = []
    for i, backend in enumerate(backends):
        methods = ("fused", "reference") if i == 0 else ("fused",)
        try:
            raw = fn(vocab=vocab, methods=methods, backend=backend, repeats=repeats,
                     timeout=timeout)
        except Exception as exc:
            rows.append({"op": "strategies", "method": backend, "vocab": vocab,
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        for item in raw:
            method = "naive" if item.get("method") == "reference" else item.get("backend", backend)
            if i > 0 and method == "naive":
                continue
            rows.append({"op": "strategies", "strategy": item.get("strategy"), "method": method,
                         "backend": item.get("backend"), "vocab": vocab, "dtype": "fp32",
                         "median_s": item["seconds"],
                         "time_statistic": "as reported by run_strategy_steps (min of repeats)",
                         "peak_extra_bytes": item["peak_bytes"],
                         "logits_bytes": item.get("logits_bytes"),
                         "peak_extra_over_logits": (item["peak_bytes"] / item["logits_bytes"]
                                                    if item.get("logits_bytes") else None),
                         "peak_method": item.get("peak_method"), "threads": item.get("threads"),
                         "raw": item})
    naive = {r["strategy"]: r for r in rows if r.get("method") == "naive" and "error" not in r}
    for r in rows:
        base = naive.get(r.get("strategy"))
        if "error" not in r and base is not None:
            r["ratio_vs_naive"] = r["median_s"] / base["median_s"]
    return rows, None


# ---------------------------------------------------------------------------------------------


def _distinct(values, ops):
    """The sizes of ``values`` (one sequence, or op -> sequence) over ``ops``, in order."""
    if not isinstance(values, dict):
        return list(values)
    seen = []
    for op in ops:
        for value in values.get(op, ()):
            if value not in seen:
                seen.append(value)
    return seen


def run_benchmarks(ops, rows, vocabs, dtypes, methods, device="cpu", repeats=5,
                   min_repeats=2, budget_s=4.0, threads=0, isolation="forkserver", timeout=600,
                   strategy_backends=(), strategy_repeats=2, json_path=None, plot_path=None,
                   progress=True, argv=None, deadline_s=None, hidden=(1024,),
                   large_vocab_cases=()):
    """Run every case (each in its own process), the strategies' steps, write JSON and plot.

    ``rows``, ``vocabs`` and ``dtypes`` are one sequence for every op or map op -> sequence;
    ``hidden`` are the linear ops' H. Baselines this torch lacks are dropped with a note. The
    JSON is rewritten after every case (``"complete": false`` until the end), so a run killed
    from outside still leaves its figures. With ``deadline_s`` no case starts after that many
    seconds; the ones left are listed under ``"skipped"`` (out of ``"planned_cases"``,
    ``"cut_by_deadline"`` true) and the table, JSON and plot are still written.
    ``large_vocab_cases`` (:func:`~astrai_kernels.bench.cases.plan_large_vocab_cases`) run after
    the strategies' steps. Returns the payload dict.
    """
    started = time.perf_counter()
    notes = []
    missing = unavailable_baselines()
    for method in [m for m in methods if split_method(m)[0] in missing]:
        notes.append(f"baseline {method} skipped: {missing[split_method(method)[0]]}")
    methods = [m for m in methods if split_method(m)[0] not in missing]
    cases = plan_cases(ops, rows, vocabs, dtypes, methods, device, repeats, min_repeats,
                       budget_s, threads, hidden=hidden)
    strategy_vocabs = list(vocabs.get("strategies", ())) if "strategies" in ops else []
    if strategy_vocabs and device != "cpu":
        strategy_vocabs = []
        notes.append("strategies: not run: the strategies' steps are timed "
                     "on CPU only (run `astrai-kernels bench --device cpu --ops "
                     "strategies`)")
    large_vocab_cases = list(large_vocab_cases)
    total = len(cases) + len(strategy_vocabs) + len(large_vocab_cases)
    config = {"argv": argv, "ops": list(ops), "rows": _distinct(rows, ops),
              "vocab": {op: list(vocabs[op]) for op in ops if op in vocabs},
              "dtypes": _distinct(dtypes, ops), "methods": list(methods), "device": device,
              "hidden": list(hidden),
              "repeats": repeats, "min_repeats": min_repeats, "case_budget_s": budget_s,
              "threads": threads or os.cpu_count(), "isolation": isolation,
              "case_timeout_s": timeout, "deadline_s": deadline_s,
              "grpo": {"B": GRPO_BATCH, "T": "rows / B", "clip_eps": GRPO_CLIP_EPS,
                       "kl_coef": GRPO_KL_COEF, "loss_type": "bnpo"},
              "floor_bytes": {op: f"{k} x logits bytes" for op, k in FLOOR_FACTOR.items()},
              "floor_gemms": {op: f"{k} matmuls of 2 N H V flops" for op, k in GEMM_COUNT.items()},
              "linear_peak_bound": "grad_bytes (hidden and weight in their dtype) + 4 V H + "
                                   f"{LINEAR_WORKSPACE_BOUND} bytes",
              "strategy_backends": list(strategy_backends), "strategy_repeats": strategy_repeats}
    for name, values in (("rows_by_op", rows), ("dtypes_by_op", dtypes)):
        if isinstance(values, dict):
            config[name] = {op: list(values[op]) for op in ops if op in values}
    used = {split_method(m)[0] for m in methods} | {"copy"}
    payload = {
        "machine": machine_info(device),
        "config": config,
        "method_notes": {k: v for k, v in METHOD_NOTES.items() if k in used},
        "notes": notes,
        "results": [],
        "skipped": [],
        "planned_cases": total,  # tensor cases + strategy blocks, run or skipped
        "cut_by_deadline": False,
        "complete": False,
    }
    bar = Progress(total) if progress else None

    def save():
        payload["total_s"] = time.perf_counter() - started
        if json_path:
            write_json(json_path, payload)

    def late(reserve=0.0):
        return (deadline_s is not None
                and time.perf_counter() - started + reserve > deadline_s)

    def run_tensor_cases(runner, selected):
        for case in selected:
            if late():
                payload["skipped"].append(asdict(case))
                continue
            if bar:
                bar.update(case.label())
            result = runner.run(case)
            payload["results"].append(result)
            add_ratios(payload["results"])
            save()
            if bar:
                bar.update(case.label() + ("  FAILED" if "error" in result else ""), advance=1)

    # Order: every op's largest V without torch.compile, the strategies' steps (one block that
    # cannot be cut short: started only with STRATEGY_RESERVE_S left), the large vocabulary,
    # torch.compile at the largest V, then the smaller V (the curves), without and with
    # torch.compile.
    headline = [c for c in cases if is_headline(c, vocabs)]
    curves = [c for c in cases if not is_headline(c, vocabs)]
    with CaseRunner(isolation, timeout) as runner:
        run_tensor_cases(runner, [c for c in headline if c.method != "compile"])
        for vocab in strategy_vocabs:
            if late(STRATEGY_RESERVE_S):
                payload["skipped"].append({"op": "strategies", "vocab": vocab})
                continue
            if bar:
                bar.update(f"strategies V={vocab} ({', '.join(strategy_backends)} + reference)")
            rows, why = run_strategies(vocab, strategy_backends, strategy_repeats, timeout)
            if why:
                payload["notes"].append(f"strategies: not available: {why}")
            payload["results"].extend(rows)
            save()
            if bar:
                bar.update(f"strategies V={vocab}", advance=1)
        run_tensor_cases(runner, large_vocab_cases)
        run_tensor_cases(runner, [c for c in headline if c.method == "compile"])
        run_tensor_cases(runner, [c for c in curves if c.method != "compile"])
        run_tensor_cases(runner, [c for c in curves if c.method == "compile"])
    if bar:
        bar.close()
    if payload["skipped"]:
        payload["cut_by_deadline"] = True
        payload["notes"].append(f"{deadline_note(payload)}: the deadline of {deadline_s:.0f} s "
                                "had passed")
    add_ratios(payload["results"])
    payload["complete"] = True
    save()
    if plot_path:
        if plot(payload, plot_path) is None:
            payload["notes"].append("no plot written (matplotlib missing or no results)")
            save()
    return payload


