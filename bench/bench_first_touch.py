"""The first-touch (page-fault) cost of a logits op's fresh gradient buffer, and what removes it.

A logits op's backward writes an ``[N, V]`` gradient. Into a fresh buffer, each 4 KiB page is
faulted in (zeroed by the kernel) on first write: for 512 MiB that is 131072 faults, about as
long as the op's own pass over the logits. Measured per variant, each in a fresh process (one
torch thread, best of ``--repeats``), as a ratio to the same-run ``copy_`` of the logits into
an existing buffer (the copy floor):

* ``clone``: ``logits.clone()``, a copy into a fresh buffer (the floor plus first touch);
* ``op``: ``ak.cross_entropy`` forward + backward, as a training loop calls it: its gradient
  comes from the CPU gradient cache (``astrai_kernels.kernels.memory``), so after the warm-up each
  call reuses the pages of the last call's (released) gradient;
* ``op_uncached``: the same with the cache off (each gradient a fresh huge-page buffer);
* ``op_inplace``: the same with ``inplace_backward=True`` (the gradient overwrites the logits:
  no fresh buffer);
* everything again with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator then
  ``madvise``s large buffers for transparent huge pages: one fault per 2 MiB), which only
  helps where ``/sys/kernel/mm/transparent_hugepage/enabled`` allows ``madvise``.

    python bench/bench_first_touch.py                       # N=4096, V=32768, float32, cpp
    python bench/bench_first_touch.py --rows 1024 --vocab 8192 --repeats 2   # a quick look
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("copy", "clone", "op", "op_uncached", "op_inplace")


def _best(fn, repeats):
    fn()  # warm-up (the library's first call, the allocator's first large block)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_variant(variant, rows, vocab, repeats, backend):
    """One variant in this process: its best time in seconds."""
    import torch

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import astrai_kernels as ak
    from astrai_kernels.kernels import memory

    if variant == "op_uncached":
        memory.set_gradient_cache_limit(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=g)
    out = torch.empty_like(logits)
    if variant == "copy":
        return _best(lambda: out.copy_(logits), repeats)
    if variant == "clone":
        return _best(lambda: logits.clone(), repeats)

    inplace = variant == "op_inplace"

    def step():
        # a fresh leaf each time (a training step's logits); in place, it shares ``out``'s
        # storage, which the gradient then overwrites
        if inplace:
            with torch.no_grad():
                out.copy_(logits)
            x = out.detach().requires_grad_(True)
        else:
            x = logits.detach().requires_grad_(True)
        ak.cross_entropy(x, target, backend=backend, inplace_backward=inplace).backward()
        return x.grad

    seconds = _best(step, repeats)
    if inplace:  # the refill of the logits buffer is the benchmark's, not the op's
        seconds -= _best(lambda: out.copy_(logits), repeats)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.rows, args.vocab, args.repeats,
                                     args.backend)))
        return
    results = {}
    for thp in ("0", "1"):
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp, OMP_NUM_THREADS="1")
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--variant", variant, "--rows", str(args.rows),
                       "--vocab", str(args.vocab), "--repeats", str(args.repeats),
                       "--backend", args.backend]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            results[(thp, variant)] = json.loads(out.stdout.strip().splitlines()[-1])
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_mode = f.read().strip()
    except OSError:
        thp_mode = "unknown"
    size_mib = args.rows * args.vocab * 4 / 2 ** 20
    print(f"N={args.rows} V={args.vocab} float32 ({size_mib:.0f} MiB logits), backend="
          f"{args.backend}, 1 thread, best of {args.repeats}; THP: {thp_mode}")
    print(f"{'THP_MEM_ALLOC_ENABLE':<22}{'variant':<12}{'seconds':>9}{'x copy':>8}")
    for (thp, variant), seconds in results.items():
        floor = results[(thp, "copy")]
        print(f"{thp:<22}{variant:<12}{seconds:>9.4f}{seconds / floor:>8.2f}")
    print(json.dumps({f"thp{thp}_{variant}": s for (thp, variant), s in results.items()}))


if __name__ == "__main__":
    main()
