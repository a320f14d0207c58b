"""One optimizer step of each training strategy, fused losses against the seed's math.

``run_strategy_steps(vocab=32768)`` runs every (strategy, method) case in a fresh Python
subprocess, so each peak is its own, and returns one dict per case (``astrai-kernels bench --ops
strategies`` runs it; ``bench/bench_strategies.py`` is its command line)::

    {"strategy", "method" ("fused_head" | "fused" | "reference"), "backend", "seconds",
     "peak_bytes", "logits_bytes", "peak_method", "threads"}

``method="fused_head"`` is the strategy with ``loss_backend=backend`` (default ``"auto"``: cpp on
CPU) on the fused LM head (``fused_head=True``: the ``linear_*`` ops on the model's hidden
states, no logits); ``"fused"`` the same ops on the model's logits (``fused_head=False``);
``"reference"`` is ``loss_backend="reference"``, the seed's own math.

How it is measured (CPU; :mod:`astrai_kernels.bench.step_cases`). The model is a
:class:`TinyCausalLM` with a large vocabulary, so the logits dominate memory as they do in a real
LLM. After one warm-up step (kernel build/load, first-touch allocations), each timed step is
``strategy(batch)`` (forwards of the policy and of the old/reference models where the strategy
has them), ``backward()`` and an SGD step.

* ``seconds``: the fastest of ``repeats`` timed steps (``time.perf_counter``), with one torch
  thread by default (``threads``): on a small shared machine more threads mostly add noise.
* ``peak_bytes``: the resident-set high-water mark during the step above the resident set just
  before it, read as ``astrai-kernels bench`` reads it (``astrai_kernels.bench.peak``: ``VmHWM``
  reset through ``/proc/self/clear_refs``, the child run with ``MALLOC_MMAP_THRESHOLD_=65536``
  so RSS follows the live tensors). Where ``clear_refs`` is not writable, the first step is
  measured instead (``ru_maxrss``, no warm-up) and ``peak_method`` says so. Tensors live before
  the step (weights, the batch) are not counted; the parameter gradients created by the step
  are.
* ``logits_bytes``: the size of the policy's logits (``rows x V x 4``), the natural unit.
"""

import argparse
import json

from .step_cases import add_step_arguments, best_of, run_in_fresh_processes, times, write_results

MODULE = "astrai_kernels.bench.strategy_steps"
STRATEGIES = ("seq", "sft", "dpo", "grpo")
METHODS = ("fused_head", "fused", "reference")


# ------------------------------------------------------------------ inside the child process


def _make_case(strategy_name, method, vocab, d_model, n_layers, backend, seed=0):
    import copy

    import torch

    from astrai_kernels.strategies import StrategyFactory
    from astrai_kernels.testing.tiny_lm import TinyCausalLM

    gen = torch.Generator().manual_seed(seed)
    model = TinyCausalLM(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=2,
                         max_seq_len=256, seed=seed)
    loss_backend = "reference" if method == "reference" else backend
    kwargs = {}
    if method in ("fused", "fused_inplace"):
        kwargs["fused_head"] = False
    elif method == "fused_head":
        kwargs["fused_head"] = True
    if method == "fused_inplace":
        if strategy_name not in ("seq", "sft"):
            raise ValueError("fused_inplace (inplace_backward=True) is for seq and sft only")
        kwargs["inplace_backward"] = True
    if strategy_name in ("seq", "sft"):
        batch_size, length = 4, 128
        ids = torch.randint(0, vocab, (batch_size, length), generator=gen)
        batch = {"input_ids": ids, "target_ids": ids.roll(-1, 1)}
        if strategy_name == "sft":
            mask = torch.ones_like(ids, dtype=torch.bool)
            mask[:, :32] = False
            batch["loss_mask"] = mask
            batch["position_ids"] = torch.cat([torch.arange(64), torch.arange(64)]).expand(
                batch_size, length)
        rows = batch_size * length
    elif strategy_name == "dpo":
        pairs, length = 2, 128
        batch = {side: torch.randint(0, vocab, (pairs, length), generator=gen)
                 for side in ("chosen", "rejected")}
        for side in ("chosen", "rejected"):
            mask = torch.zeros(pairs, length)
            mask[:, 32:] = 1
            batch[f"{side}_mask"] = mask
        kwargs["ref_model"] = copy.deepcopy(model)
        rows = 2 * pairs * (length - 1)
    else:
        prompts, group, prompt_len, response_len = 2, 4, 32, 96
        batch = {
            "prompts": torch.randint(0, vocab, (prompts, prompt_len), generator=gen),
            "responses": torch.randint(0, vocab, (prompts, group, response_len), generator=gen),
            "masks": torch.ones(prompts, group, response_len),
            "rewards": torch.rand(prompts, group, generator=gen),
        }
        kwargs["old_model"] = copy.deepcopy(model)
        kwargs["ref_model"] = copy.deepcopy(model)
        kwargs["kl_coef"] = 0.01
        rows = prompts * group * (prompt_len + response_len - 1)
    strategy = StrategyFactory.create(strategy_name, model, "cpu", loss_backend=loss_backend,
                                      **kwargs)
    return model, strategy, batch, rows


def run_case(strategy_name, method, vocab=32768, d_model=64, n_layers=2, backend="auto",
             repeats=2, threads=1):
    """One (strategy, method) case in this process; returns its result dict."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from astrai_kernels.kernels.registry import resolve_backend

    model, strategy, batch, rows = _make_case(strategy_name, method, vocab, d_model, n_layers,
                                              backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        out = strategy(batch)
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = best_of(step, repeats)
    return {
        "strategy": strategy_name,
        "method": method,
        "backend": "reference" if method == "reference" else resolve_backend(backend, "cpu"),
        "seconds": measured["seconds"],
        "peak_bytes": measured["peak_bytes"],
        "logits_bytes": rows * vocab * 4,
        "peak_method": measured["peak_method"],
        "threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------ driver


def run_strategy_steps(vocab=32768, strategies=STRATEGIES, methods=METHODS, backend="auto",
                       d_model=64, n_layers=2, repeats=3, threads=1, timeout=300):
    """Each (strategy, method) case in a fresh subprocess; a list of result dicts.

    ``methods`` may also hold ``"fused_inplace"`` (``inplace_backward=True``: the gradient is
    written into the logits' buffer), run for ``seq`` and ``sft`` only.
    """
    return run_in_fresh_processes(
        ["-m", MODULE],
        [["--case", strategy_name, method, "--vocab", vocab, "--d-model", d_model,
          "--n-layers", n_layers, "--backend", backend, "--repeats", repeats,
          "--threads", threads]
         for strategy_name in strategies for method in methods
         if method != "fused_inplace" or strategy_name in ("seq", "sft")],
        timeout)


def format_table(results):
    mib = 1 << 20
    by_key = {(r["strategy"], r["method"]): r for r in results}
    lines = [f"{'strategy':<9} {'method':<14} {'backend':<10} {'step ms':>9} {'peak MiB':>9} "
             f"{'peak/logits':>11} {'ref/this peak':>13} {'ref/this time':>13} "
             f"{'fused/this peak':>15} {'fused/this time':>15}"]

    def ratios(base, r):
        if base is None or base is r:
            return "", ""
        return (times(base["peak_bytes"], max(r["peak_bytes"], 1)),
                times(base["seconds"], r["seconds"]))

    for r in results:
        ref_peak, ref_time = ratios(by_key.get((r["strategy"], "reference")), r)
        fused_peak, fused_time = ("", "")
        if r["method"] == "fused_head":
            fused_peak, fused_time = ratios(by_key.get((r["strategy"], "fused")), r)
        lines.append(f"{r['strategy']:<9} {r['method']:<14} {r['backend']:<10} "
                     f"{r['seconds'] * 1e3:>9.1f} {r['peak_bytes'] / mib:>9.1f} "
                     f"{r['peak_bytes'] / r['logits_bytes']:>11.2f} {ref_peak:>13} "
                     f"{ref_time:>13} {fused_peak:>15} {fused_time:>15}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="loss_backend of the fused cases")
    add_step_arguments(parser, repeats=3)
    parser.add_argument("--inplace", action="store_true",
                        help="also run seq and sft with inplace_backward=True")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--case", nargs=2, metavar=("STRATEGY", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        result = run_case(*args.case, vocab=args.vocab, d_model=args.d_model,
                          n_layers=args.n_layers, backend=args.backend, repeats=args.repeats,
                          threads=args.threads)
        print(json.dumps(result))
        return
    methods = METHODS + (("fused_inplace",) if args.inplace else ())
    results = run_strategy_steps(vocab=args.vocab, strategies=args.strategies.split(","),
                                 methods=methods, backend=args.backend, d_model=args.d_model,
                                 n_layers=args.n_layers, repeats=args.repeats,
                                 threads=args.threads)
    print(f"One optimizer step per strategy, TinyCausalLM d_model={args.d_model} "
          f"n_layers={args.n_layers} V={args.vocab}, {args.threads or 'default'} thread(s); "
          f"best of {args.repeats}; peak = RSS high-water above the step's start (see the "
          f"module docstring)")
    print(format_table(results))
    write_results(args.json, results)


if __name__ == "__main__":
    main()
