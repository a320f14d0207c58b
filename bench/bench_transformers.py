"""One training step of a Hugging Face Llama, patched (fused LM head) against unpatched.

``run_steps(vocab=..., ...)`` runs each case (``patched`` False/True) in a fresh Python
subprocess, so each peak is its own, and returns one dict per case::

    {"patched", "backend", "vocab", "hidden", "rows", "seconds", "peak_bytes", "logits_bytes",
     "peak_method", "threads", "transformers"}

The model is ``LlamaForCausalLM`` built from a config (no download) with a large vocabulary and
a small hidden size, so the logits dominate the step's memory as they do in a real LLM. A step
is ``model(input_ids, labels=labels).loss``, ``backward()`` and an SGD step; after one warm-up
step, ``seconds`` is the fastest of ``repeats`` steps and ``peak_bytes`` the resident-set
high-water mark during a step above the resident set before it
(:mod:`astrai_kernels.bench.step_cases`, as the strategies' steps are measured).
``logits_bytes`` is ``rows x V x 4``, the size of the float32 logits, the natural unit.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

from astrai_kernels.bench.step_cases import (  # noqa: E402
    add_step_arguments,
    best_of,
    run_in_fresh_processes,
    times,
    write_results,
)


def run_case(patched, vocab=32768, hidden=64, n_layers=2, batch=4, seq_len=256, backend="auto",
             repeats=2, threads=1, seed=0):
    """One case in this process; returns its result dict."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from astrai_kernels.integrations.transformers import patch
    from astrai_kernels.kernels.registry import resolve_backend

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=n_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=max(seq_len, 64))
    model = LlamaForCausalLM(config).float().train()
    if patched:
        patch(model, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    labels = input_ids.clone()
    labels[:, : seq_len // 4] = -100  # a prompt not scored, as in SFT
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = best_of(step, repeats)
    rows = batch * seq_len
    return {"patched": bool(patched),
            "backend": resolve_backend(backend, "cpu") if patched else "transformers",
            "vocab": vocab, "hidden": hidden, "rows": rows, **measured,
            "logits_bytes": rows * vocab * 4, "threads": torch.get_num_threads(),
            "transformers": transformers.__version__}


def run_steps(vocab=32768, hidden=64, n_layers=2, batch=4, seq_len=256, backend="auto",
              repeats=2, threads=1, timeout=600):
    """Both cases (unpatched, patched), each in a fresh subprocess; a list of result dicts."""
    return run_in_fresh_processes(
        [os.path.abspath(__file__)],
        [["--case", int(patched), "--vocab", vocab, "--hidden", hidden, "--n-layers", n_layers,
          "--batch", batch, "--seq-len", seq_len, "--backend", backend, "--repeats", repeats,
          "--threads", threads] for patched in (False, True)],
        timeout)


def format_table(results):
    mib = 1 << 20
    base = next((r for r in results if not r["patched"]), None)
    lines = [f"{'model':<10} {'backend':<13} {'step ms':>9} {'peak MiB':>9} {'peak/logits':>11} "
             f"{'unpatched/this peak':>19} {'unpatched/this time':>19}"]
    for r in results:
        peak_ratio = time_ratio = ""
        if base is not None and r is not base:
            peak_ratio = times(base["peak_bytes"], max(r["peak_bytes"], 1))
            time_ratio = times(base["seconds"], r["seconds"])
        lines.append(f"{'patched' if r['patched'] else 'unpatched':<10} {r['backend']:<13} "
                     f"{r['seconds'] * 1e3:>9.1f} {r['peak_bytes'] / mib:>9.1f} "
                     f"{r['peak_bytes'] / r['logits_bytes']:>11.2f} {peak_ratio:>19} "
                     f"{time_ratio:>19}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--backend", default="auto", help="backend of the patched loss")
    add_step_arguments(parser, repeats=2)
    parser.add_argument("--case", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = dict(vocab=args.vocab, hidden=args.hidden, n_layers=args.n_layers, batch=args.batch,
                 seq_len=args.seq_len, backend=args.backend, repeats=args.repeats,
                 threads=args.threads)
    if args.case is not None:
        print(json.dumps(run_case(bool(args.case), **shape)))
        return
    results = run_steps(**shape)
    print(f"One training step of LlamaForCausalLM (transformers {results[0]['transformers']}), "
          f"hidden={args.hidden}, {args.n_layers} layers, V={args.vocab}, batch {args.batch} x "
          f"{args.seq_len} tokens, float32, {args.threads or 'default'} thread(s), best of "
          f"{args.repeats}; peak = RSS high-water above the step's start")
    print(format_table(results))
    write_results(args.json, results)


if __name__ == "__main__":
    main()
