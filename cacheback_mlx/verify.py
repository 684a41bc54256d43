"""One batched forward pass over the root token and a draft tree.

Input rows: row 0 is the root (the last accepted token, not yet cached), row i+1 is tree node i.
A chain uses the model's plain causal path. A tree uses a mask where a node sees the cache, the
root and its own ancestors, and RoPE positions cache offset + depth (kvcache.TreeRoPE).
Passes can be padded to a few fixed sizes (`buckets`) so GPU backends compile few shapes: padded
rows see only the cache and the root, nobody sees them, and they are rolled back with the rejects.
"""

from __future__ import annotations

import bisect

import mlx.core as mx
import numpy as np

from .kvcache import TreeKVCache
from .tree import DraftTree


def padded_size(n: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket that holds n rows (n itself when no buckets or n is past the largest)."""
    if not buckets:
        return n
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def tree_layout(tree: DraftTree, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Depths [rows] and the in-pass mask [rows, rows] for root + tree + padding."""
    n = len(tree) + 1
    depths = np.zeros(rows, np.int32)
    depths[1:n] = tree.depths()
    mask = np.zeros((rows, rows), dtype=bool)
    mask[:n, :n] = tree.ancestor_mask()
    mask[n:, 0] = True  # padding rows see the root, so their softmax is well defined
    return depths, mask


def verify_pass(model, caches: list[TreeKVCache], root: int, tree: DraftTree,
                buckets: tuple[int, ...] | None = None) -> mx.array:
    """Run root + tree through the model in ONE pass; return logits [1 + len(tree), vocab].

    Afterwards each cache holds `rows` new entries past its old offset; the caller keeps the
    accepted ones with kvcache.keep_rows.
    """
    n = len(tree) + 1
    rows = padded_size(n, buckets)
    tokens = np.zeros(rows, np.int32)
    tokens[0] = root
    tokens[1:n] = tree.tokens
    tree_pass = caches[0].tree_pass
    if not tree.is_chain():
        depths, in_pass = tree_layout(tree, rows)
        offset = caches[0].offset
        tree_pass.depths = mx.array(depths)
        tree_pass.mask = mx.concatenate([mx.ones((rows, offset), dtype=mx.bool_), mx.array(in_pass)], axis=1)
    try:
        logits = model(mx.array(tokens)[None], cache=caches)
    finally:
        tree_pass.depths = tree_pass.mask = None
    return logits[0, :n]


def prefill(model, caches: list[TreeKVCache], tokens: list[int], chunk: int = 512) -> None:
    """Put tokens into the caches (in chunks, to bound memory on long prompts)."""
    for i in range(0, len(tokens), chunk):
        model(mx.array(tokens[i : i + chunk], dtype=mx.int32)[None], cache=caches)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
