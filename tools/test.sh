#!/usr/bin/env bash
# The test suite: the tests marked `serial` (they time something, or start processes or servers)
# alone, after the rest, which run on up to 4 cores at once (pytest-xdist). Other arguments go to
# both runs, and a -m EXPR narrows both (e.g. -m "not slow"); `.venv/bin/python -m pytest -q` runs
# everything one test at a time.
set -uo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
args=()
mark=""
while [ $# -gt 0 ]; do
    case "$1" in
        -m) mark="$2"; shift 2 ;;
        -m*) mark="${1#-m}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
both() { if [ -n "$mark" ]; then echo "($1) and ($mark)"; else echo "$1"; fi; }
cores=$("$python" -c "import os; print(len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1)")
workers=$(( cores < 4 ? cores : 4 ))
# one BLAS thread per core in all: OpenBLAS's threads spin while they wait, and workers that each
# ran one per core would take turns at every product (cores.py does the same between processes
# on one machine; each worker's test session counts only its own: conftest.py). A test file runs
# whole on one worker (--dist loadfile): its models and fixtures are built once, not once a worker.
OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$(( cores / workers > 1 ? cores / workers : 1 ))} \
    "$python" -m pytest -q -n "$workers" --dist loadfile -m "$(both "not serial")" ${args[@]+"${args[@]}"}
rest=$?
"$python" -m pytest -q -m "$(both serial)" ${args[@]+"${args[@]}"}
alone=$?
# 5: no test collected in that run
if [ "$rest" -eq 5 ] && [ "$alone" -eq 5 ]; then echo "no tests were collected"; exit 5; fi
for rc in "$rest" "$alone"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
