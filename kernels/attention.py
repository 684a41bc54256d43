"""A verify pass's attention row by row, each row as the one-row decoding step computes it.

A decoding step calls MLX's attention with one query over the cache's keys (a slice of the
cache's buffer, no mask). A pass of several rows calls it once with a mask, and on a GPU that
runs another kernel (cuDNN's, or the unfused path) that rounds differently. Here each row calls
it as the step would: its query alone over the keys it may see, with no mask: the cached ones and
those of the pass's rows it sees (for a chain, or a row whose visible pass rows are its first
ones, a slice of the buffer, as in the step; for a tree row, gathered).

Plain MLX (one call per row and layer): exact by construction where the kernel's result depends
only on its inputs' values, shapes and buffers' layout (past 256 keys a row reads a slice of a
buffer shaped as the step's cache: _Plan), which `tools/ab/gpu_rows.py` checks on the machine. Rows
that see as many keys may go as one call (the rows as its batch), which must give each row the
same bits: `Grouping` checks that on the first passes, and keeps to one call per row otherwise.
"""

from __future__ import annotations

import sys
import threading

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


def _keys_seen(seen: np.ndarray, row: int, cached: int) -> np.ndarray:
    """Indices of the keys row `row` sees: every cached one, then the pass rows it sees."""
    return np.concatenate([np.arange(cached), cached + np.flatnonzero(seen[row])]).astype(np.int32)


STEP = 256  # mlx-lm's KVCache grows its buffers by this many positions


cache_layout = True  # see _Plan; set_cache_layout


def set_cache_layout(on: bool) -> None:
    """Lay a row's keys out as the one-row step's cache slice past STEP of them (the default), or
    as an array of their own length (tools.ab.gpu_rows compares the two on a GPU)."""
    global cache_layout
    cache_layout = bool(on)


class _Plan:
    """What the rows of one pass see, worked out once and shared by all its layers (each layer
    would build the same index arrays again: 30 layers x 64 rows of them at the default model's
    size): per row, the indices of the keys it sees (None: the buffer's first ones, a slice as in
    the step) and how many; the rows grouped by how many keys they see; each group's indices.

    Past STEP keys the layout matters on a CUDA GPU: MLX gives a one-query attention cuDNN's kernel
    only when its keys are a slice of a buffer whose length is a multiple of STEP, and its own
    vector kernel otherwise. The one-row step reads a slice of its cache's buffer, which holds the
    fewest whole STEPs that take its keys (mlx-lm's and the engine's caches grow so), so a row
    past STEP keys reads a slice of a buffer of that length too: the pass's own buffer where that
    is its length (`capacity`), else its keys gathered into one."""

    def __init__(self, seen: np.ndarray, cached: int, real: int, capacity: int | None, layout: bool):
        self.seen, self.cached = seen, cached
        self.keys: list[tuple[np.ndarray | None, int]] = []
        for row in range(real):
            cols = np.flatnonzero(seen[row])
            n = cached + cols.size
            room = -(-n // STEP) * STEP if layout and n >= STEP else n
            if cols.size and cols[-1] == cols.size - 1 and (room == n or room == capacity):
                self.keys.append((None, n))  # pass rows 0..k: a slice of the pass's buffer
            else:
                self.keys.append((np.pad(_keys_seen(seen, row, cached), (0, room - n)), n))
        self._gathered: dict[int, mx.array] = {}  # row -> its key indices on the device, once asked
        self.most_keys = max((n for _, n in self.keys), default=0)
        self.real, self._keymap = real, None
        # rows seeing as many keys may share one call (Grouping), below STEP keys only: past them
        # the step runs another kernel (above), which a call over gathered keys never gets, and a
        # verdict reached on short contexts says nothing of it
        counts = seen[:real].sum(axis=1)
        self.groups = [rows for c in np.unique(counts) for rows in
                       ([np.flatnonzero(counts == c)] if cached + c < STEP else
                        [np.array([r]) for r in np.flatnonzero(counts == c)])]
        self._group_keys: dict[tuple[int, ...], tuple[mx.array, mx.array]] = {}

    def keymap(self, rows: int) -> tuple[mx.array, mx.array]:
        """Every row's key indices as one array [rows, most keys] and how many it sees [rows]
        (padding rows: none), for an attention kernel that takes all rows at once."""
        if self._keymap is None:
            keymap = np.zeros((rows, max(self.most_keys, 1)), np.int32)
            counts = np.zeros(rows, np.int32)
            for row in range(self.real):
                counts[row] = n = self.keys[row][1]
                keymap[row, :n] = _keys_seen(self.seen, row, self.cached)
            self._keymap = (mx.array(keymap), mx.array(counts))
        return self._keymap

    def gathered(self, row: int) -> mx.array:
        """Row `row`'s key indices (padded to its buffer's length) as a device array, made once a
        pass (not for a pass whose rows all go in one call, which never asks)."""
        if row not in self._gathered:
            self._gathered[row] = mx.array(self.keys[row][0])
        return self._gathered[row]

    def group_keys(self, rows: list[int]) -> tuple[mx.array, mx.array]:
        """A group's key indices [G, n] and its rows [G], as device arrays."""
        key = tuple(rows)
        if key not in self._group_keys:
            idx = np.stack([_keys_seen(self.seen, r, self.cached) for r in rows])
            self._group_keys[key] = (mx.array(idx), mx.array(rows))
        return self._group_keys[key]


_local = threading.local()  # the last pass's plan, per thread (an engine runs its passes in one)


def _plan(seen: np.ndarray, cached: int, real: int, capacity: int | None) -> _Plan:
    key = (cached, real, capacity, cache_layout, seen.shape, seen.tobytes())
    last = getattr(_local, "last", None)
    if last is None or last[0] != key:
        last = _local.last = (key, _Plan(seen, cached, real, capacity, cache_layout))
    return last[1]


def step_query(queries: mx.array, row: int) -> mx.array:
    """Row `row` of a pass's [1, H, T, D] queries laid out as a one-row step's query is: a step's
    [1, 1, H, D] projection seen as [1, H, 1, D] (a view of its own buffer, contiguous strides),
    not a view into the pass's T rows. Past STEP keys MLX's CUDA attention runs cuDNN, whose plan
    is chosen by the query's strides too, so a row's query is laid out as the step's (both views:
    nothing is copied). Not yet checked on a GPU: tools.ab.gpu_rows's layout table tells."""
    _, H, _, D = queries.shape
    q = queries[:, :, row : row + 1].transpose(0, 2, 1, 3)  # [1, 1, H, D]: the projection's own order
    return q.reshape(1, H, D).reshape(1, 1, H, D).transpose(0, 2, 1, 3)  # contiguous strides, as a step's


def _one_row(stock, queries, keys, values, cache, scale, sinks, plan, row):
    idx, n = plan.keys[row]
    if idx is None:
        k, v = keys[:, :, :n], values[:, :, :n]
    else:  # gathered, into a buffer of whole STEPs past STEP keys: attend over its first n
        idx = plan.gathered(row)
        k, v = mx.take(keys, idx, axis=2)[:, :, :n], mx.take(values, idx, axis=2)[:, :, :n]
    q = step_query(queries, row) if n >= STEP and cache_layout else queries[:, :, row : row + 1]
    return stock(q, k, v, cache=cache, scale=scale, mask=None, sinks=sinks)


def _group(stock, queries, keys, values, cache, scale, sinks, plan, rows):
    """Rows that see as many keys, as ONE call with the rows as its batch: [len(rows), H, 1, D]."""
    idx, picked = plan.group_keys(rows)  # [G, n], [G]
    k = mx.take(keys[0], idx, axis=1).transpose(1, 0, 2, 3)  # [Hk, G, n, D] -> [G, Hk, n, D]
    v = mx.take(values[0], idx, axis=1).transpose(1, 0, 2, 3)
    q = queries[0][:, picked][:, :, None].transpose(1, 0, 2, 3)  # [G, H, 1, D]
    return stock(q, k, v, cache=cache, scale=scale, mask=None, sinks=sinks)


class Grouping:
    """Whether rows seeing as many keys may share one call (fewer calls to build and launch): only
    where that call gives each row the bits of its own, which the first passes with such groups
    check on this machine (CHECKS of them), computing both; else row by row."""

    CHECKS = 3

    def __init__(self):
        self.ok: bool | None = None
        self.checked = 0

    def verdict(self, grouped: mx.array, single: mx.array) -> None:
        if not mx.array_equal(grouped, single).item():
            self.ok = False
            print("cacheback-mlx: attention rows grouped by length round differently here; row by row "
                  "instead", file=sys.stderr)
            return
        self.checked += 1
        if self.checked >= self.CHECKS:
            self.ok = True


grouping = Grouping()


def rows_attention(stock, queries, keys, values, cache, scale, mask, sinks, real: int | None = None,
                   all_rows=None):
    """Attention of [B, H, T, D] queries over [B, Hk, S, D] keys whose last T are this pass's,
    row by row (or rows seeing as many keys together, where Grouping found that exact); None where
    visible_rows says it cannot. Rows from `real` on are padding that no row sees: they get zeros
    (any finite value would do; they are rolled back). `all_rows(queries, keys, values, plan,
    scale)`, when given, may take every row in one call (a kernel with the step's bits: it returns
    None where it cannot)."""
    T, S = queries.shape[2], keys.shape[2]
    seen = visible_rows(mask, cache, T)
    if seen is None:
        return None
    real = T if real is None else min(real, T)
    buffer = getattr(cache, "keys", None)  # the pass's keys are a slice of it (mlx-lm's caches, ours)
    plan = _plan(seen, S - T, real, buffer.shape[2] if isinstance(buffer, mx.array) else None)
    if all_rows is not None:
        out = all_rows(queries, keys, values, plan, scale)
        if out is not None:
            return out
    args = (stock, queries, keys, values, cache, scale, sinks, plan)
    groups = plan.groups
    if grouping.ok is False or queries.shape[0] != 1 or all(len(g) == 1 for g in groups):
        outs = [_one_row(*args, row) for row in range(real)]
    else:
        parts, order = [], []
        for rows in groups:
            if len(rows) == 1:
                parts.append(_one_row(*args, int(rows[0])).transpose(2, 1, 0, 3))
            else:
                out = _group(*args, [int(r) for r in rows])
                if grouping.ok is None:
                    single = mx.concatenate([_one_row(*args, int(r)) for r in rows], axis=2)
                    grouping.verdict(out.transpose(2, 1, 0, 3), single)
                parts.append(out)
            order.extend(int(r) for r in rows)
        stacked = mx.concatenate(parts, axis=0)  # [real, H, 1, D] in group order
        back = mx.array(np.argsort(np.array(order)).astype(np.int32))
        outs = [mx.take(stacked, back, axis=0).transpose(2, 1, 0, 3)]
    if real < T:
        B, H, _, D = queries.shape
        outs.append(mx.zeros((B, H, T - real, values.shape[-1]), dtype=queries.dtype))
    return mx.concatenate(outs, axis=2)
