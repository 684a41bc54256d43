"""Rebuild the shipped default frozen table (cacheback_mlx/data/frozen_smollm2_ll1_fl3.npz).

Corpus: the CPython standard library sources of the running interpreter (site-packages and test
data excluded): code plus English docstrings and comments, available offline on every machine.
Not the benchmark data in ../shared/data, which is the test set. Takes ~20 s on 2 cores
(580 files, 11 MB, 3.1M tokens with Python 3.11.7; another Python version gives a slightly
different table).

    .venv/bin/python tools/build_default_table.py
"""

import sys
import sysconfig
from pathlib import Path

import cacheback_mlx  # noqa: F401  (OpenBLAS before mlx)
from cacheback_mlx.drafters.cacheback import DEFAULT_TABLE
from cacheback_mlx.loader import load
from cacheback_mlx.table_builder import build_table_from_files


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def main() -> None:
    files = stdlib_files()
    print(f"{len(files)} files from {sysconfig.get_paths()['stdlib']} (Python {sys.version.split()[0]})")
    DEFAULT_TABLE.parent.mkdir(parents=True, exist_ok=True)
    table = build_table_from_files(files, load().tokenizer, DEFAULT_TABLE, ll=1, fl=3, lc=1 << 20, fc=128)
    print(f"{len(table)} leaders, {len(table.followers)} followers -> {DEFAULT_TABLE} "
          f"({DEFAULT_TABLE.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
