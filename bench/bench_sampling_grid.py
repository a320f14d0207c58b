"""``token_logprobs(..., sampling=)`` over the plain op, for every sampler setting RL users run
(issue 42 item 2: at most 2x for each).

Forward + backward of ``token_logprobs(x, y, sampling=SamplingParams(temperature=0.8, top_k,
top_p, min_p)).sum()`` over the same call without ``sampling=`` (temperature 0.8 passed to the
plain op, so only the filter differs), same process and backend, best of ``--repeats`` each,
the two alternating; targets drawn from each sampler's own distribution (vLLM's order: top_k,
then top_p on the renormalised top k; min_p first where set). Rows: ``peaked`` (3 * randn,
a few tokens hold the mass) and ``flat`` (0.3 * randn, tens of thousands of tokens kept).

    python bench/bench_sampling_grid.py                    # N=4096, V=32768, fp32 and bf16, cpp
    python bench/bench_sampling_grid.py --rows 512 --vocab 8192 --repeats 1   # a quick look
"""

import argparse
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import astrai_kernels as ak  # noqa: E402

TEMPERATURE = 0.8
TOP_KS = (20, 50, 500, 5000, 0)  # 0: off
TOP_PS = (0.9, 0.95, 1.0)
MIN_PS = (0.0, 0.05)
ROW_SCALES = {"peaked": 3.0, "flat": 0.3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kept_mask(logits, params):
    """vLLM's processed support of ``params`` on ``logits`` (float64 math): min_p, top_k, top_p."""
    scaled = logits.double() / params.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if params.min_p > 0:
        probs = scaled.softmax(-1)
        keep &= probs >= params.min_p * probs.amax(-1, keepdim=True)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.masked_fill(~keep, -float("inf")).topk(params.top_k, -1).values[..., -1:]
        keep &= scaled >= kth
    if params.top_p < 1:
        masked = scaled.masked_fill(~keep, -float("inf"))
        ordered, order = masked.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        above = probs.cumsum(-1) - probs
        keep &= torch.zeros_like(keep).scatter_(-1, order, above < params.top_p)
    return keep


def draw_targets(logits, params, generator, block=512):
    """One target per row from the processed distribution."""
    targets = []
    for rows in logits.split(block):
        keep = kept_mask(rows, params)
        probs = (rows.double() / params.temperature).masked_fill(~keep, -float("inf")).softmax(-1)
        targets.append(torch.multinomial(probs.float(), 1, generator=generator).squeeze(-1))
    return torch.cat(targets)


def best_times(calls, repeats):
    """Fastest of ``repeats`` rounds of each callable, the callables alternating in a round."""
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_setting(logits, target, params, backend, repeats):
    """``(plain_s, sampled_s)``: the op without and with ``sampling=params``, after a warm-up."""
    def plain():
        logits.grad = None
        ak.token_logprobs(logits, target, temperature=params.temperature,
                          backend=backend).sum().backward()

    def sampled():
        logits.grad = None
        ak.token_logprobs(logits, target, sampling=params, backend=backend).sum().backward()

    plain(), sampled()
    return best_times([plain, sampled], repeats)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"token_logprobs(sampling=) over the plain op, forward + backward, N={args.rows} "
          f"V={args.vocab}, backend {args.backend}, {torch.get_num_threads()} threads, "
          f"best of {args.repeats}; load {os.getloadavg()[0]:.2f}")
    print(f"{'dtype':5} {'rows':6} {'top_k':>5} {'top_p':>5} {'min_p':>5} {'kept':>7} "
          f"{'plain ms':>9} {'sampled ms':>10} {'ratio':>6}")
    results = []
    for dtype_name in args.dtype:
        for kind, scale in ROW_SCALES.items():
            generator = torch.Generator().manual_seed(0)
            base = torch.randn(args.rows, args.vocab, generator=generator) * scale
            logits = base.to(DTYPES[dtype_name]).requires_grad_(True)
            for top_k, top_p, min_p in itertools.product(TOP_KS, TOP_PS, MIN_PS):
                params = ak.SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=top_p,
                                           min_p=min_p)
                target = draw_targets(logits.detach().float(), params, generator)

                plain_s, sampled_s = time_setting(logits, target, params, args.backend,
                                                  args.repeats)
                kept = float(kept_mask(logits.detach().float()[:64], params).sum(-1)
                             .double().mean())
                row = {"dtype": dtype_name, "rows_kind": kind, "top_k": top_k, "top_p": top_p,
                       "min_p": min_p, "kept_mean": kept, "plain_s": plain_s,
                       "sampled_s": sampled_s, "ratio": sampled_s / plain_s}
                results.append(row)
                print(f"{dtype_name:5} {kind:6} {top_k:>5} {top_p:>5} {min_p:>5} {kept:>7.0f} "
                      f"{plain_s * 1e3:>9.1f} {sampled_s * 1e3:>10.1f} {row['ratio']:>5.2f}x",
                      flush=True)
    worst = max(results, key=lambda r: r["ratio"])
    print(f"worst: {worst['ratio']:.2f}x ({worst['dtype']} {worst['rows_kind']} top_k="
          f"{worst['top_k']} top_p={worst['top_p']} min_p={worst['min_p']}); "
          f"{sum(r['ratio'] > 2 for r in results)} of {len(results)} settings above 2x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"argv": sys.argv, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
