#!/usr/bin/env bash
# The GPU measurements of docs/BENCHMARKS.md §15 in one run, for a machine with MLX's CUDA backend
# (`pip install "mlx[cuda]"` in the venv), each step under a time limit so one that hangs does not
# take the others with it:
#   1. the exact-rows matmul's first-use check per dtype, timed (MLX compiles its builds in every
#      process: this is what each process pays before its first pass);
#   1b. whole passes against one-row steps, bit for bit, on short prompts and a 300-token one, with
#      the kernels off and on, and tree rows' keys laid out as a cache slice (tools.ab.gpu_rows);
#   2. `doctor --model default`: the backend, the kernels, the prompt layout, which dtypes are exact;
#   3. `bench` in float16 (the GPU default), `none` and `auto` against mlx-lm: `none` should give
#      mlx-lm's tokens on every prompt, `auto` `none`'s;
#   4. the same with the kernels off (CACHEBACK_MLX_KERNELS=0);
#   5. what a step and a pass of 1-64 rows cost to build and to run (tools.ab.step_time);
#   6. where a short `none` bench's time goes before its first prompt (cProfile, by cumulative time):
#      such runs waited 33-42 s before it on an H100 host, most of it the kernels' check (compiling).
#
#     tools/cuda_checks.sh [OUT]        (default OUT: cuda_checks; logs and JSON go there)
#
# Environment: PYTHON (default .venv/bin/python), TOKENS (bench tokens a prompt, default 128),
# LIMIT (seconds a step may run, default 240).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-cuda_checks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
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
step kernel_check "$PY" -c "
import time, cacheback_mlx, mlx.core as mx
from cacheback_mlx import kernels
for d in (mx.float16, mx.bfloat16, mx.float32):
    t = time.perf_counter()
    ok = kernels.usable(d)
    print(d, 'on' if ok else 'off', f'{time.perf_counter() - t:.1f} s', flush=True)
"
step gpu_rows "$PY" -m tools.ab.gpu_rows --skip-matmul --dtypes float16 --long-prompt 300
step doctor "$PY" -m cacheback_mlx.cli doctor --model default
BENCH=(-m cacheback_mlx.cli bench --per-category 1 --humaneval-prompts 2 -n "$TOKENS" --dtype float16
       --drafters none,auto)
step bench_float16 "$PY" "${BENCH[@]}" --json "$OUT/bench_float16.json"
CACHEBACK_MLX_KERNELS=0 step bench_float16_kernels_off "$PY" "${BENCH[@]}" --json "$OUT/bench_float16_kernels_off.json"
step step_time "$PY" -m tools.ab.step_time --dtype float16 --cached 256 --rows 1,2,8,16,64 --repeats 8 \
    --steps 128 --rounds 5
step startup_profile "$PY" -m cProfile -s cumtime -m cacheback_mlx.cli bench --per-category 1 --humaneval-prompts 0 \
    -n 16 --dtype float16 --drafters none --no-mlx-lm
