#!/usr/bin/env bash
# On a machine with a CUDA GPU: the test suite natively (no TRITON_INTERPRET), `verify`, and
# `bench` at GPU sizes (N = 8192, V = 32k/128k/256k, bf16), and the sampler
# (`--ops token_logprobs_sampling`, V = 128k), all in under 9 minutes, everything
# written under one folder: $OUT if set, else bench/results/gpu.
#
#   bash bench/gpu.sh                 # from the repository root, with the venv's python on PATH
#   PYTHON=.venv/bin/python OUT=/tmp/gpu bash bench/gpu.sh
#
# Each step has its own `timeout`; a step that fails or times out is recorded in status.txt and
# the next step still runs. The exit status is non-zero when any step failed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${OUT:-bench/results/gpu}
mkdir -p "$OUT_DIR"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Sizes and time limits (seconds); override from the environment.
ROWS=${ROWS:-8192}
VOCABS=${VOCABS:-32768,131072,262144}
DTYPES=${DTYPES:-bf16}
BACKENDS=${BACKENDS:-triton,triton:inplace,torch}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
VERIFY_TIMEOUT=${VERIFY_TIMEOUT:-90}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-220}
SAMPLING_TIMEOUT=${SAMPLING_TIMEOUT:-60}
BENCH_DEADLINE=${BENCH_DEADLINE:-$((BENCH_TIMEOUT - 50))}  # bench starts no case after this (cases: <= 40 s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET ASTRAI_KERNELS_BACKEND

STATUS="$OUT_DIR/status.txt"
: > "$STATUS"
failed=0
start=$SECONDS

step() {  # step NAME TIMEOUT CMD...: run with a time limit, log to $OUT_DIR/NAME.log
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT_DIR/summary.txt"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
  tail -n 40 "$OUT_DIR/$name.log" | tee -a "$OUT_DIR/summary.txt"
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$STATUS"
  if [[ $rc -ne 0 ]]; then failed=1; fi
}

: > "$OUT_DIR/summary.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -a)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv \
    2>/dev/null || echo "nvidia-smi: not available"
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

step tests "$TESTS_TIMEOUT" "$PYTHON" -m pytest tests -q -x -p no:cacheprovider \
  --junitxml="$OUT_DIR/tests.xml"
step verify "$VERIFY_TIMEOUT" "$PYTHON" -m astrai_kernels.cli verify --json "$OUT_DIR/verify.json"
step bench "$BENCH_TIMEOUT" "$PYTHON" -m astrai_kernels.cli bench --rows "$ROWS" \
  --vocab "$VOCABS" --dtype "$DTYPES" --backends "$BACKENDS" --ops token_logprobs,cross_entropy,grpo \
  --repeats 10 --min-repeats 5 --case-budget 2 --case-timeout 40 --deadline "$BENCH_DEADLINE" \
  --no-progress \
  --json "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png"

# issue 33's sampler on the GPU: the triton kernel (kernels/triton/sampling.py, a bisection of
# 32 passes per filter) against the torch radix path and the naive sort, one vocabulary
step bench_sampling "$SAMPLING_TIMEOUT" "$PYTHON" -m astrai_kernels.cli bench --rows "$ROWS" \
  --vocab 131072 --dtype "$DTYPES" --backends triton,torch --ops token_logprobs_sampling \
  --repeats 5 --min-repeats 3 --case-budget 2 --case-timeout 40 --no-progress \
  --json "$OUT_DIR/bench_sampling.json"

echo "total $((SECONDS - start)) s; results in $OUT_DIR" | tee -a "$STATUS"
exit "$failed"
