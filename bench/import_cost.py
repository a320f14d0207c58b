"""What ``import astrai_kernels`` costs over a bare ``import torch``: time and resident memory.

Each run is a fresh Python subprocess that imports torch, reads the clock and its resident set
(``VmRSS`` in ``/proc/self/status``, else ``ru_maxrss``), imports ``astrai_kernels`` and reads
them again; the cost is the difference, so torch's own import (seconds on a cold machine) is
not counted. The script prints the median over ``--runs`` runs of each figure, and which heavy
modules (Triton, Inductor, Dynamo, transformers) the import left in ``sys.modules``.

    python bench/import_cost.py [--runs 5] [--root CHECKOUT] [--json PATH]

``--root`` measures another checkout (its ``astrai_kernels`` first on ``sys.path``), e.g. the
state before a change. Target (issue 14 item 3): under 0.3 s and 30 MB.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY_MODULES = ("triton", "torch._inductor", "torch._dynamo", "transformers")

CHILD = r"""
import json, os, resource, sys, time

def rss_bytes():
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

start = time.perf_counter()
import torch
torch_done, torch_rss = time.perf_counter(), rss_bytes()
import astrai_kernels
done, rss = time.perf_counter(), rss_bytes()
print(json.dumps({
    "torch_seconds": torch_done - start, "torch_rss": torch_rss,
    "seconds": done - torch_done, "rss": rss - torch_rss,
    "file": astrai_kernels.__file__,
    "heavy": [name for name in HEAVY if name in sys.modules],
}))
"""


def measure_once(root, python):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    code = f"HEAVY = {HEAVY_MODULES!r}\n{CHILD}"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the import failed in {root}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(root=ROOT, runs=5, python=sys.executable):
    """Median figures over ``runs`` fresh subprocesses (seconds and bytes)."""
    samples = [measure_once(root, python) for _ in range(runs)]
    result = {key: statistics.median(sample[key] for sample in samples)
              for key in ("seconds", "rss", "torch_seconds", "torch_rss")}
    result.update(runs=runs, root=root, file=samples[0]["file"],
                  heavy=sorted({name for sample in samples for name in sample["heavy"]}),
                  samples=samples)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh subprocesses (default 5)")
    parser.add_argument("--root", default=ROOT, help="checkout to import astrai_kernels from")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    result = measure(os.path.abspath(args.root), args.runs)
    print(f"import astrai_kernels ({result['file']}), median of {args.runs} fresh processes:")
    print(f"  over import torch: {result['seconds']:.3f} s, "
          f"{result['rss'] / 2**20:.1f} MiB resident")
    print(f"  import torch itself: {result['torch_seconds']:.3f} s, "
          f"{result['torch_rss'] / 2**20:.1f} MiB resident")
    print(f"  heavy modules imported: {', '.join(result['heavy']) or 'none'}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
