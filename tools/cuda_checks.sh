#!/usr/bin/env bash
# The GPU measurements of docs/BENCHMARKS.md §15 in one run, for a machine with MLX's CUDA backend
# (`pip install "mlx[cuda]"` in the venv; on a host that reaches no package index, the site
# `tools/offline_site.sh` packs, with PYTHON=python3), each step under a time limit so one that
# hangs does not take the others with it, most wanted first, and no step started past a total budget:
#   1. the exact-rows kernels' first-use checks, timed (MLX compiles their builds in every process:
#      this is what each process pays before its first pass): plain per dtype, quantized per
#      dtype and bits (groups of 64), biased layers row by row, the attention rows in one call per
#      dtype and head dim; then tests/test_kernels.py, whose
#      CUDA tests compare tree passes with one-row steps bit for bit (needs pytest);
#   2. whole passes against one-row steps, bit for bit, on short prompts and a 300-token one, with
#      the kernels off and on (the attention rows a call each and in one rows_sdpa call), tree rows'
#      keys laid out as a cache slice, and what a pass costs by rows each way (tools.ab.gpu_rows);
#   3. the same on a 4-bit model (random:llama-3.2-1b:q4, 4 layers), after the quantized matmul
#      by rows at an 8B model's shapes, 4 and 8 bits, MLX's against the kernel's;
#   4. `bench` in float16 (the GPU default) and in bfloat16, `none` and `auto` against mlx-lm: `none`
#      should give mlx-lm's tokens on every prompt, `auto` `none`'s; then in float16 `auto` (the
#      model's 4 best tokens at each row once passes are wide, as 63 drafts a pass are here) against
#      `auto:recycle=1` (its pick alone) and `auto:recycle=false` (neither), for their MAT and tok/s;
#   5. `bench` on a Llama-3.1-8B-shaped 4-bit model (random weights: nothing accepted; outputs
#      equal, and `auto` no slower than `none`), its verify pass cost by rows, and its speed at the
#      default model's acceptance (--forced along tools/data/streams_seed101, 64 tokens a turn: a
#      projection); the pass cost of the same shape in bfloat16;
#   6. `doctor --model default --rounding` (and the 4-bit model; and with the kernels off): the
#      backend, the kernels, the prompt layout, which dtypes are exact, and how far a chain pass's
#      logits lie from one-token steps' in float16;
#   7. the default model's bench with the kernels off (CACHEBACK_MLX_KERNELS=0), and with plain steps not
#      running ahead (CACHEBACK_MLX_RUN_AHEAD=0; on by default on a GPU since such a bench showed it pays);
#   8. what a step and a pass of 1-64 rows cost to build and to run (tools.ab.step_time);
#   9. a step and passes of 2 and 8 rows with each layer's q/k/v and gate/up projections as one product
#      (tools.ab.fused_proj: fewer launches; bits and time);
#  10. where a short `none` bench's time goes before its first prompt (cProfile, by cumulative time);
#   then the pass-cost tables the runs measured are copied to OUT/verify_cost (for
#   `tools.scale_projection --cost FILE`: projections from them here, on recordings not run there).
#
#     tools/cuda_checks.sh [OUT]        (default OUT: cuda_checks; logs and JSON go there)
#
# Before a run on a GPU host: `python -m tools.nvrtc_check --fetch` compiles every kernel build here as
# MLX will there (a build that does not compile there only shows in the logs of the run).
#
# Environment: PYTHON (default .venv/bin/python), TOKENS (bench tokens a prompt, default 128),
# LIMIT (seconds a step may run, default 240), TOTAL (no step runs past this many seconds from the
# start, default 3600), STEPS (the steps to run, by the names of their logs, in that order; default
# all of them in the order above), LIMIT_<step> (that step's own limit; LIMIT_forced_8b_q4 is 300 unless
# set: building the 8B model, measuring its pass costs and 17 questions three ways took past 150 s;
# LIMIT_kernel_tests is 150 unless set: tests/test_kernels.py took 94 s alone on an H200).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-cuda_checks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-.venv/bin/python}
TOKENS=${TOKENS:-128}
LIMIT=${LIMIT:-240}
TOTAL=${TOTAL:-3600}
LIMIT_forced_8b_q4=${LIMIT_forced_8b_q4:-300}  # building the 8B model and its pass-cost table come first
LIMIT_kernel_tests=${LIMIT_kernel_tests:-150}

step() {  # step NAME COMMAND...: run it under the limit, keep its log, show its end
    local name=$1
    shift
    if [ "$SECONDS" -ge "$TOTAL" ]; then
        echo "== $name: skipped (past TOTAL=$TOTAL s)"
        return
    fi
    local limit=$((TOTAL - SECONDS))  # no step runs past TOTAL either
    local own="LIMIT_$name"  # a step's own limit, where one is set (LIMIT_forced_8b_q4=300)
    local most=${!own:-$LIMIT}
    [ "$limit" -gt "$most" ] && limit=$most
    echo "== $name (limit $limit s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "-- rc $? in $((SECONDS - t0)) s"
    tail -n 30 "$OUT/$name.log"
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
git log --oneline -1
Q4=random:llama-3.2-1b:q4:layers=4:vocab=49280
Q8B=random:llama-3.1-8b:q4:vocab=49280
BENCH=(-m cacheback_mlx.cli bench --per-category 1 --humaneval-prompts 2 -n "$TOKENS" --dtype float16
       --drafters none,auto)

run_kernel_check() {
    step kernel_check "$PY" -c "
import time, cacheback_mlx, mlx.core as mx
from cacheback_mlx import kernels
for d in (mx.float16, mx.bfloat16, mx.float32):
    t = time.perf_counter()
    ok = kernels.usable(d)
    print(d, 'on' if ok else 'off', f'{time.perf_counter() - t:.1f} s', flush=True)
for d, bits in ((mx.float16, 4), (mx.bfloat16, 4), (mx.float16, 8)):
    t = time.perf_counter()
    ok = kernels.usable_quantized(d, bits, 64)
    print(d, bits, 'bits', 'on' if ok else 'off', f'{time.perf_counter() - t:.1f} s', flush=True)
for d in (mx.float16, mx.bfloat16):
    t = time.perf_counter()
    ok = kernels.usable_biased(d)
    print(d, 'biased', 'on' if ok else 'off', f'{time.perf_counter() - t:.1f} s', flush=True)
for d, dim in ((mx.float16, 64), (mx.bfloat16, 64), (mx.float16, 128)):
    t = time.perf_counter()
    ok = kernels.usable_sdpa(d, dim)
    print(d, 'attention rows in one call, head dim', dim, 'on' if ok else 'off', f'{time.perf_counter() - t:.1f} s',
          flush=True)
print(kernels.describe())
"
}
run_kernel_tests() { step kernel_tests "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py; }
run_gpu_rows() {
    step gpu_rows "$PY" -m tools.ab.gpu_rows --skip-matmul --dtypes float16 --long-prompt 300 --pass-cost float16 \
        --rows 1,2,8,16,64
}
run_gpu_rows_q4() {
    step gpu_rows_q4 "$PY" -m tools.ab.gpu_rows --skip-matmul --qbits 4,8 --rows 1,2,8,16,64 --model "$Q4" \
        --dtypes float16
}
slow_passes() {  # the passes of a bench's JSON that stalled (tools/slow_passes.py)
    [ -f "$OUT/$1.json" ] && "$PY" -m tools.slow_passes "$OUT/$1.json" --top 5 2>&1 | tee "$OUT/$1.slow.log" | tail -n 25
}
run_bench_float16() { step bench_float16 "$PY" "${BENCH[@]}" --json "$OUT/bench_float16.json"; slow_passes bench_float16; }
run_bench_recycle() {
    step bench_recycle "$PY" "${BENCH[@]/%none,auto/none,auto,auto:recycle=1,auto:recycle=false}" --no-mlx-lm \
        --json "$OUT/bench_recycle.json"
}
run_bench_bfloat16() {
    step bench_bfloat16 "$PY" "${BENCH[@]/float16/bfloat16}" --json "$OUT/bench_bfloat16.json"
    slow_passes bench_bfloat16
}
run_bench_8b_q4() {
    step bench_8b_q4 "$PY" -m cacheback_mlx.cli bench --model "$Q8B" --prompts humaneval --per-category 3 \
        --max-tokens 24 --drafters none,auto --seed 11 --json "$OUT/bench_8b_q4.json"
}
run_verify_cost_8b_q4() {
    step verify_cost_8b_q4 "$PY" -m cacheback_mlx.cli bench --verify-cost --model "$Q8B" --contexts 512,2048
}
run_forced_8b_q4() {
    step forced_8b_q4 "$PY" -m cacheback_mlx.cli bench --model "$Q8B" --forced tools/data/streams_seed101 -n 64 \
        --drafters none,auto --json "$OUT/forced_8b_q4.json"
    slow_passes forced_8b_q4
}
run_verify_cost_8b_bf16() {
    step verify_cost_8b_bf16 "$PY" -m cacheback_mlx.cli bench --verify-cost \
        --model random:llama-3.1-8b:bf16:vocab=49280 --dtype bfloat16 --contexts 512,2048
}
run_doctor() { step doctor "$PY" -m cacheback_mlx.cli doctor --model default --rounding; }
run_doctor_q4() { step doctor_q4 "$PY" -m cacheback_mlx.cli doctor --model "$Q4" --rounding; }
run_doctor_kernels_off() {
    step doctor_kernels_off env CACHEBACK_MLX_KERNELS=0 "$PY" -m cacheback_mlx.cli doctor --model default --rounding
}
run_bench_float16_no_run_ahead() {  # plain steps not run ahead (on by default on a GPU): the A/B that keeps it
    CACHEBACK_MLX_RUN_AHEAD=0 step bench_float16_no_run_ahead "$PY" "${BENCH[@]}" \
        --json "$OUT/bench_float16_no_run_ahead.json"
    slow_passes bench_float16_no_run_ahead
}
run_bench_float16_kernels_off() {
    CACHEBACK_MLX_KERNELS=0 step bench_float16_kernels_off "$PY" "${BENCH[@]}" \
        --json "$OUT/bench_float16_kernels_off.json"
    slow_passes bench_float16_kernels_off
}
run_step_time() {
    step step_time "$PY" -m tools.ab.step_time --dtype float16 --cached 256 --rows 1,2,8,16,64 --repeats 8 \
        --steps 128 --rounds 4
}
run_fused_proj() { step fused_proj "$PY" -m tools.ab.fused_proj --dtype float16 --rows 1,2,8 --cached 256; }
run_startup_profile() {
    step startup_profile "$PY" -m cProfile -s cumtime -m cacheback_mlx.cli bench --per-category 1 \
        --humaneval-prompts 0 -n 16 --dtype float16 --drafters none --no-mlx-lm
}

ALL="kernel_check kernel_tests gpu_rows gpu_rows_q4 bench_float16 bench_recycle bench_bfloat16 bench_8b_q4 verify_cost_8b_q4 forced_8b_q4
     verify_cost_8b_bf16 doctor doctor_q4 doctor_kernels_off bench_float16_kernels_off bench_float16_no_run_ahead step_time fused_proj startup_profile"
for name in ${STEPS:-$ALL}; do
    if ! declare -F "run_$name" > /dev/null; then
        echo "unknown step: $name (known: $(echo $ALL))" >&2
        exit 2
    fi
done
for name in ${STEPS:-$ALL}; do
    "run_$name"
done
# the pass-cost tables the runs above measured and kept (tools.scale_projection --cost prices
# recordings by them offline)
mkdir -p "$OUT/verify_cost"
cp "${XDG_CACHE_HOME:-$HOME/.cache}"/cacheback-mlx/verify-cost/*.json "$OUT/verify_cost/" 2> /dev/null
ls "$OUT/verify_cost"
