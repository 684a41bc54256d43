#!/usr/bin/env bash
# The GPU measurements of docs/BENCHMARKS.md §15 in one run, for a machine with MLX's CUDA backend
# (`pip install "mlx[cuda]"` in the venv), each step under a time limit so one that hangs does not
# take the others with it:
#   1. `doctor --model default`: the backend, the prompt layout and in which dtypes output is exact;
#   2. `bench` in float16 (the GPU default), `none` and `auto` against mlx-lm: `none` should give
#      mlx-lm's tokens on every prompt, `auto` `none`'s;
#   3. the same with verify passes on cuDNN's attention (CACHEBACK_MLX_CUDNN_PASSES=1);
#   4. what a step and a pass of 1-64 rows cost to build and to run (tools.ab.step_time).
#
#     tools/cuda_checks.sh [OUT]        (default OUT: cuda_checks; logs and JSON go there)
#
# Environment: PYTHON (default .venv/bin/python), TOKENS (bench tokens a prompt, default 128),
# LIMIT (seconds a step may run, default 240). MLX keeps its compiled kernels in
# MLX_PTX_CACHE_DIR (default OUT/ptx), so a second run starts faster.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-cuda_checks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$OUT/ptx}
PY=${PYTHON:-.venv/bin/python}
TOKENS=${TOKENS:-128}
LIMIT=${LIMIT:-240}

step() {  # step NAME COMMAND...: run it under the limit, keep its log, show its end
    local name=$1
    shift
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
    echo "-- rc $? in $((SECONDS - t0)) s"
    tail -n 30 "$OUT/$name.log"
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
git log --oneline -1
step doctor "$PY" -m cacheback_mlx.cli doctor --model default
BENCH=(-m cacheback_mlx.cli bench --per-category 1 --humaneval-prompts 2 -n "$TOKENS" --dtype float16
       --drafters none,auto)
step bench_float16 "$PY" "${BENCH[@]}" --json "$OUT/bench_float16.json"
CACHEBACK_MLX_CUDNN_PASSES=1 step bench_float16_cudnn "$PY" "${BENCH[@]}" --json "$OUT/bench_float16_cudnn.json"
step step_time "$PY" -m tools.ab.step_time --dtype float16 --cached 256 --rows 1,2,8,16,64 --repeats 8
