"""Speed table: drafters vs plain decoding vs mlx-lm on Spec-Bench and HumanEval.

Same as `cacheback-mlx bench`; e.g.
    .venv/bin/python tools/bench.py --prompts spec_bench,humaneval --per-category 1 --max-tokens 96
"""

import sys

from cacheback_mlx.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
