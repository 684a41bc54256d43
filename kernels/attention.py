"""A verify pass's attention row by row, each row as the one-row decoding step computes it.

A decoding step calls MLX's attention with one query over the cache's keys (a slice of the
cache's buffer, no mask). A pass of several rows calls it once with a mask, and on a GPU that
runs another kernel (cuDNN's, or the unfused path) that rounds differently. Here each row calls
it as the step would: its query alone over the keys it may see, with no mask: the cached ones and
those of the pass's rows it sees (for a chain, or a row whose visible pass rows are its first
ones, a slice of the buffer, as in the step; for a tree row, gathered).

Plain MLX (one call per row and layer): exact by construction where the kernel's result depends
only on its inputs' values and shapes, which `tools/ab/gpu_rows.py` checks on the machine.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def visible_rows(mask, cache, rows: int):
    """Per pass row, the pass rows it sees (numpy bool [rows, rows]), or None when this pass's
    attention cannot go row by row (a window, a draft tree kept in the cache, an unknown mask)."""
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return np.tril(np.ones((rows, rows), dtype=bool))
    tp = getattr(cache, "tree_pass", None)
    if tp is None or tp.host is None or tp.tail is not None or getattr(cache, "window", None) is not None:
        return None
    return tp.host if tp.host.shape == (rows, rows) else None


def rows_attention(stock, queries, keys, values, cache, scale, mask, sinks, real: int | None = None):
    """Attention of [B, H, T, D] queries over [B, Hk, S, D] keys whose last T are this pass's,
    row by row; None where visible_rows says it cannot. Rows from `real` on are padding that no
    row sees: they get zeros (any finite value would do; they are rolled back)."""
    T, S = queries.shape[2], keys.shape[2]
    seen = visible_rows(mask, cache, T)
    if seen is None:
        return None
    cached = S - T
    real = T if real is None else min(real, T)
    outs = []
    for i in range(real):
        cols = np.flatnonzero(seen[i])
        if cols.size and cols[-1] == cols.size - 1:  # pass rows 0..k: a slice, as in the step
            k, v = keys[:, :, : cached + cols.size], values[:, :, : cached + cols.size]
        else:
            idx = mx.array(np.concatenate([np.arange(cached), cached + cols]).astype(np.int32))
            k, v = mx.take(keys, idx, axis=2), mx.take(values, idx, axis=2)
        outs.append(stock(queries[:, :, i : i + 1], k, v, cache=cache, scale=scale, mask=None, sinks=sinks))
    if real < T:
        B, H, _, D = queries.shape
        outs.append(mx.zeros((B, H, T - real, values.shape[-1]), dtype=queries.dtype))
    return mx.concatenate(outs, axis=2)
