"""The triton backend's ops are ``triton_op``s: tracing sees the Triton kernels, not an opaque op.

Without a GPU the kernels cannot run natively, so this traces them on meta tensors through
AOTAutograd's functionalization (what ``torch.compile`` hands Inductor) in a subprocess with the
interpreter off, and checks that each primitive's graph holds its kernels as
``triton_kernel_wrapper_functional`` nodes and no call to the wrapping op itself. On a machine
with CUDA, ``test_torch_compile_fullgraph[triton]`` in test_logprobs.py, test_cross_entropy.py and
test_grpo.py also runs ``torch.compile`` over the triton backend (skipped without CUDA).
"""

import json
import subprocess
import sys

import pytest
import torch

from cases import ROOT, subprocess_env

pytest.importorskip("triton")

SCRIPT = r"""
import json, torch
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from astrai_kernels.kernels import library as _library
from astrai_kernels.kernels.primitives import CrossEntropyArgs, LogprobsArgs, SurrogateArgs

class Captured(Exception):
    pass

def graph_of(fn, *args):
    codes = []
    def capture(gm, example_inputs):
        kernels = [kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                   for node in gm.graph.nodes
                   if "triton_kernel_wrapper" in str(node.target)]
        codes.append({"code": gm.code, "kernels": kernels})
        raise Captured
    try:
        aot_function(fn, fw_compiler=capture)(*args)
    except Captured:
        pass
    return codes[0]

meta = dict(device="meta")
logits = torch.empty(2, 9, 300, dtype=torch.bfloat16, **meta)[:, :-1]
target = torch.zeros(16, dtype=torch.int64, **meta)
rows = torch.empty(16, dtype=torch.float32, **meta)
one = torch.empty(1, dtype=torch.float32, **meta)
graphs = {
    "logprobs_forward": graph_of(
        lambda x, y: _library.logprobs_forward(x, y, LogprobsArgs(1.3, -100, True), "triton"),
        logits, target),
    "logprobs_backward": graph_of(
        lambda x, y, r: _library.logprobs_backward(x, y, r, r, r, r,
                                                   LogprobsArgs(1.3, -100, True), "triton"),
        logits, target, rows),
    "cross_entropy_forward": graph_of(
        lambda x, y, s: _library.cross_entropy_forward(
            x, y, s, CrossEntropyArgs(-100, 0.1, 1e-4, 30.0), True, "triton"),
        logits, target, one),
    "grpo_forward": graph_of(
        lambda x, y, r: _library.grpo_forward(
            x, y, r, r, r, r, SurrogateArgs(1.0, 0.2, 0.28, 0.0, 0.04, True, True), True,
            "triton"),
        logits, target, rows),
}
print(json.dumps({"triton_ops": _library.TRITON_OPS, "graphs": graphs}))
"""

KERNELS = {
    "logprobs_forward": "logprobs_fwd_kernel",
    "logprobs_backward": "logprobs_bwd_kernel",
    "cross_entropy_forward": "cross_entropy_fwd_kernel",
    "grpo_forward": "grpo_fwd_kernel",
}


@pytest.mark.skipif(not hasattr(torch.library, "triton_op"), reason="torch < 2.6 has no triton_op")
def test_triton_ops_trace_into_their_kernels():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=subprocess_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton_ops"]
    for name, graph in result["graphs"].items():
        code = graph["code"]
        assert graph["kernels"] == [KERNELS[name]], (name, code)
        assert "triton_kernel_wrapper_functional" in code, (name, code)
        assert "astrai_kernels" not in code, (name, code)
