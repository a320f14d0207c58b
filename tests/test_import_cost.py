"""``import astrai_kernels`` stays light: no Triton, Inductor or Dynamo until a path needs them.

The time and memory it costs are measured by ``bench/import_cost.py`` (not timed here). A first
eager call of a custom op imports Dynamo (``torch.library`` wraps every op body in
``torch._disable_dynamo``), but a CPU call never imports Triton or Inductor.
"""

import json
import subprocess
import sys

from cases import ROOT, subprocess_env

HEAVY_MODULES = ("triton", "torch._inductor", "torch._dynamo", "transformers")

SCRIPT = r"""
import json, sys
import astrai_kernels as ak
import torch
imported = [name for name in HEAVY if name in sys.modules]
logits = torch.randn(2, 3, 7)
target = torch.tensor([[0, 6, -100], [3, 2, 1]])
ak.cross_entropy(logits, target, backend="torch")
ak.token_logprobs(logits, target.clamp(min=0), temperature=0.7, backend="torch")
after_call = [name for name in HEAVY if name in sys.modules and name != "torch._dynamo"]
print(json.dumps({"import": imported, "call": after_call}))
"""


def test_import_leaves_triton_inductor_and_dynamo_unimported():
    proc = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY_MODULES!r}\n{SCRIPT}"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"import": [], "call": []}
