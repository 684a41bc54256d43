"""The tree passes the linter configured in pyproject.toml (ruff: pyflakes, pycodestyle with
lines of at most 120 characters, and import order with cacheback_mlx ahead of mlx)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_passes_ruff():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e .[test])")
    r = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
