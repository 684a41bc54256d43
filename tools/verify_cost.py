"""Cost of one forward pass over B tokens relative to one token, on the current backend.

Same as `cacheback-mlx bench --verify-cost`. The engine's default draft budget follows from it.
"""

import sys

from cacheback_mlx.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--verify-cost", *sys.argv[1:]]))
