"""The cpp kernels' elementwise gradient loops vectorize (GCC's vectorization report).

A loop that silently turns scalar costs 3-10x (the log-prob backward after a234fd3: a float
`?:` in log_prob_exp kept its `omp simd` loop scalar). Each case compiles one small translation
unit instantiating a helper of ``csrc/common.h`` for AVX2 and reads ``-fopt-info-vec``.
Compile-only: nothing is timed.
"""

import shutil
import subprocess

import pytest

from astrai_kernels.kernels.cpp import backend as cb

DTYPES = ("F32T", "BF16T", "F16T")

# write_logprob_grad's main loop (its other loops, the tail and the lane sum, vectorize too, so
# "some loop vectorized" would not notice this one turning scalar)
MAIN_LOOPS = {"write_logprob_grad": "others_lanes[l] += write_non_target(j + l);"}

# (name, body): the loop under test is the only vectorizable loop of the body's function, or the
# one MAIN_LOOPS names
LOOPS = {
    "write_logprob_grad": "write_logprob_grad<{T}, true, {ENT}>(x, 1, g, 1, V, 0, 1.0f, 0.0f, "
                          "a, b, c, d, 0.5f);",
    "store": "for (int64_t j = 0; j < V; ++j) g[j] = {T}::store(f[j] * a);",
    "load": "for (int64_t j = 0; j < V; ++j) f[j] = {T}::load(x[j]) * a;",
}

SOURCE = """
#include "common.h"
using namespace astrai;
using S = {T}::storage;
__attribute__((target("avx2,avx,fma,f16c"))) void run(const S* x, S* g, float* f, int64_t V,
                                                      float a, float b, float c, float d) {{
  {body}
}}
"""


def gcc():
    compiler = cb._compiler()
    if compiler is None:
        return None
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    return compiler if "clang" not in out.lower() and shutil.which(compiler) else None


@pytest.mark.skipif(cb.source_dir() is None, reason="csrc/ not found")
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_loops_vectorize(tmp_path, loop, dtype):
    compiler = gcc()
    if compiler is None:  # -fopt-info is GCC's; the cpp backend's own tests still run
        pytest.skip("needs GCC (its -fopt-info-vec report)")
    ents = ("false", "true") if loop == "write_logprob_grad" else ("false",)
    for ent in ents:
        body = LOOPS[loop].format(T=dtype, ENT=ent)
        src = tmp_path / f"{loop}_{ent}.cpp"
        src.write_text(SOURCE.format(T=dtype, body=body))
        proc = subprocess.run(
            [compiler, "-O3", "-fopenmp", "-ffp-contract=fast", "-std=c++17",
             f"-I{cb.source_dir()}", "-c", str(src), "-o", str(tmp_path / "out.o"),
             "-fopt-info-vec-optimized"],
            capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "loop vectorized" in proc.stderr, (
            f"{loop}<{dtype}, ENT={ent}> did not vectorize:\n{proc.stderr}")
        if loop in MAIN_LOOPS:
            header = (cb.source_dir() / "common.h").read_text().splitlines()
            lines = [i for i, text in enumerate(header, 1) if MAIN_LOOPS[loop] in text]
            assert len(lines) == 1, f"csrc/common.h has no single line {MAIN_LOOPS[loop]!r}"
            assert any(f"common.h:{lines[0]}:" in line and "loop vectorized" in line
                       for line in proc.stderr.splitlines()), (
                f"{loop}<{dtype}, ENT={ent}>: its main loop (common.h:{lines[0]}) did not "
                f"vectorize:\n{proc.stderr}")
