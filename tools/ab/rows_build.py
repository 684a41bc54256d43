"""What building a verify pass's row-by-row attention (kernels/attention.py) costs in Python, per pass.

    .venv/bin/python -m tools.ab.rows_build [--rows 8,16,64] [--cached 256] [--layers 30] [--repeats 7]

On a CUDA GPU a small model's pass is bound by building its graph (docs/BENCHMARKS.md §15), and
row-by-row attention builds one attention call per row and layer. This times only that graph
building (nothing is evaluated inside the timing), for a chain and a random draft tree of each row
count, over --layers layers as one pass calls it: the median of --repeats rounds. It runs the same
on any backend, since it measures Python and MLX's graph building, not the device. To compare two
commits, run it in a checkout of each, one after the other, twice.
"""

from __future__ import annotations

import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)
from cacheback_mlx.kernels import attention
from cacheback_mlx.positions import TreePass
from cacheback_mlx.tree import DraftTree

import click
import mlx.core as mx
import numpy as np


class _Cache:  # what row-by-row attention reads of a layer's cache: its buffer, a tree pass's rows
    def __init__(self, seen: np.ndarray | None, keys: mx.array):
        self.keys = keys
        self.tree_pass = TreePass()
        if seen is not None:
            self.tree_pass.set(None, None, host=seen)


def _stock(q, k, v, cache=None, scale=1.0, mask=None, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def random_tree(rows: int, rng) -> np.ndarray:
    """A random draft tree's visibility (DraftTree.ancestor_mask): the root and rows - 1 nodes."""
    parents = [int(rng.integers(-1, i)) for i in range(rows - 1)]  # -1: under the root
    return DraftTree(np.zeros(rows - 1, dtype=np.int32), np.array(parents)).ancestor_mask()


@click.command()
@click.option("--rows", default="8,16,64", show_default=True, help="Rows of a pass, comma-separated.")
@click.option("--cached", default=256, show_default=True, help="Cached tokens before the pass.")
@click.option("--layers", default=30, show_default=True, help="Layers a pass builds (the default model's 30).")
@click.option("--repeats", default=7, show_default=True)
def main(rows, cached, layers, repeats):
    rng = np.random.default_rng(0)
    attention.grouping.ok = False  # one call per row, as on the GPU where grouping rounded differently
    print(f"row-by-row attention, graph building only: {layers} layers, {cached} cached, 9 heads over 3, dim 64")
    print("| pass | rows | build ms (median) |")
    print("|---|---:|---:|")
    for n in (int(r) for r in rows.split(",")):
        q = mx.random.normal((1, 9, n, 64))
        buffer = mx.random.normal((1, 3, -(-(cached + n) // 256) * 256, 64))  # as the engine's cache grows
        k = buffer[:, :, : cached + n]
        mx.eval(q, buffer)
        for kind, seen, mask in (("chain", np.tril(np.ones((n, n), bool)), "causal"),
                                 ("tree", (t := random_tree(n, rng)), mx.array(t))):
            times = []
            for _ in range(repeats):
                cache = _Cache(seen if kind == "tree" else None, buffer)
                t0 = time.perf_counter()
                outs = [attention.rows_attention(_stock, q, k, k, cache, 0.125, mask, None) for _ in range(layers)]
                times.append(time.perf_counter() - t0)
                mx.eval(outs)
            print(f"| {kind} | {n} | {1e3 * sorted(times)[len(times) // 2]:.2f} |")


if __name__ == "__main__":
    main()
