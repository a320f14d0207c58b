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

# The loop each case holds to vectorizing, as (the line opening its helper in csrc/common.h, the
# text of the first line after it where GCC's report places the loop: its first statement):
# write_logprob_grad's other loops (the tail and the lane sum) vectorize too, so "some loop
# vectorized" would not notice its main loop turning scalar.
MAIN_LOOPS = {
    # the two write their non-target columns in lane_sum's loop (each case's translation unit
    # instantiates one of them, so the loop's line there is that helper's)
    "write_logprob_grad": ("float lane_sum(", "lanes[l] += term(j + l);"),
    "write_shard_grad": ("void write_shard_grad(", "const float xj = T::load(x[C ? j : j * sv]);"),
    "write_kept_grad": ("float lane_sum(", "lanes[l] += term(j + l);"),
    "write_softmax_grad": ("void write_softmax_grad(",
                           "const float d = (T::load(x[C ? j : j * sv]) - ref) * inv_t - log_sum;"),
}

# (name, body): the loop under test is the only vectorizable loop of the body's function, or the
# one MAIN_LOOPS names. write_shard_grad is vocab_shard_backward's loop (reading its scalars
# through the arguments struct, the float32 loop once stayed scalar, 10x slower than bfloat16:
# issue 32); its other loop, zero_row on an ignored row, is a memset when contiguous.
LOOPS = {
    "write_logprob_grad": "write_logprob_grad<{T}, true, {ENT}>(x, 1, g, 1, V, 0, 1.0f, 0.0f, "
                          "a, b, c, d, 0.5f);",
    "write_shard_grad": "write_shard_grad<{T}, {C}, {SOFTCAP}>(x, 3, g, 2, V, a, b, c, d, a, b, "
                        "c);",
    # sampled_logprobs_backward's loop: the support mask x_j >= threshold is a select
    "write_kept_grad": "write_kept_grad<{T}, {C}>(x, 3, g, 2, V, 7, a, b, c, d, a);",
    # topk_distill_forward's dense gradient pass (its support's columns are written after)
    "write_softmax_grad": "write_softmax_grad<{T}, {C}>(x, 3, g, 2, V, a, b, c, d);",
    "store": "for (int64_t j = 0; j < V; ++j) g[j] = {T}::store(f[j] * a);",
    "load": "for (int64_t j = 0; j < V; ++j) f[j] = {T}::load(x[j]) * a;",
}

# the template arguments each case is compiled with (every combination)
VARIANTS = {
    "write_logprob_grad": {"ENT": ("false", "true")},
    "write_shard_grad": {"C": ("true", "false"), "SOFTCAP": ("false", "true")},
    "write_kept_grad": {"C": ("true", "false")},
    "write_softmax_grad": {"C": ("true", "false")},
}


def variants(loop):
    combos = [{}]
    for name, values in VARIANTS.get(loop, {}).items():
        combos = [dict(combo, **{name: value}) for combo in combos for value in values]
    return combos


def loop_line(loop):
    """The line of csrc/common.h holding the loop MAIN_LOOPS names for ``loop``."""
    opening, text = MAIN_LOOPS[loop]
    header = (cb.source_dir() / "common.h").read_text().splitlines()
    starts = [i for i, line in enumerate(header) if opening in line]
    assert len(starts) == 1, f"csrc/common.h has no single line {opening!r}"
    after = [i for i in range(starts[0], len(header)) if text in header[i]]
    assert after, f"csrc/common.h has no line {text!r} after {opening!r}"
    return after[0] + 1


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
    compiler = cb.compiler()
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
    for variant in variants(loop):
        body = LOOPS[loop].format(T=dtype, **variant)
        name = f"{loop}<{dtype}{''.join(f', {k}={v}' for k, v in variant.items())}>"
        src = tmp_path / f"{loop}_{'_'.join(variant.values()) or 'plain'}.cpp"
        src.write_text(SOURCE.format(T=dtype, body=body))
        proc = subprocess.run(
            [compiler, "-O3", "-fopenmp", "-ffp-contract=fast", "-std=c++17",
             f"-I{cb.source_dir()}", "-c", str(src), "-o", str(tmp_path / "out.o"),
             "-fopt-info-vec-optimized"],
            capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "loop vectorized" in proc.stderr, f"{name} did not vectorize:\n{proc.stderr}"
        if loop in MAIN_LOOPS:
            line = loop_line(loop)
            assert any(f"common.h:{line}:" in report and "loop vectorized" in report
                       for report in proc.stderr.splitlines()), (
                f"{name}: its main loop (common.h:{line}) did not vectorize:\n{proc.stderr}")
