"""One forward pass over several sequences (a batch's lanes), each with its own lead, draft
tree, positions, mask and caches (batch.py decides what runs; this file runs it).

The lanes' rows are laid end to end, so the model's matmuls read the weights once for all of them.
RoPE gives every row its own absolute position (TreePass.rel, offset 0). Each layer gets a
LaneView for a cache: it writes each lane's new keys and values into that lane's caches and, when
attention asks (attention.py calls `attend`), attends lane by lane, or all lanes at once where
their caches are rows of one KVStack, each lane masked to its own positions.

A model with recurrent layers runs its lanes side by side instead, as the batch rows of one pass
([lanes, rows], each lane's chain right-padded to the longest): a recurrence cannot run over rows
laid end to end, and mlx-lm's mixers run a batch of sequences of unequal lengths as they do in
its own batched generation. Their layers get a recurrent.LaneStates, the others a LaneView that
lays the rows end to end for attention. Before lanes may share, sharing.check_sharing runs a
shared pass against passes of their own on the model.

A model whose attention works on the keys its cache returns, with a mask it asks for as an array
(Gemma 2's soft-capped scores), gets every lane's keys end to end instead, and a mask that lets
each lane's rows see only its own keys ("packed": its attention pays every row against every
lane's keys; sharing.Sharing.packed).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList

from . import activations, attention, head, kernels
from .kvcache import LaneKVCache, ModelCache, TreeKVCache
from .positions import TreePass
from .recurrent import LaneStates, RecurrentCache
from .tree import DraftTree
from .verify import tree_layout


class NotShared(Exception):
    """A model's attention did not go through the lanes' views (its lanes take turns)."""


class LaneMask:
    """The mask a LaneView hands the model: each lane's own is made at attention time. A layer
    without a cache of its own that attends over the keys another layer's cache handed it (gemma4's
    KV-shared layers) reaches that layer's view through the mask (`attend_keys`)."""

    def __init__(self, window_size: int | None, plan: "PassPlan"):
        self.window_size, self.plan = window_size, plan

    def attend_keys(self, queries: mx.array, keys: mx.array, scale: float, sinks=None) -> mx.array:
        view = self.plan.owners.get(id(keys))
        if view is None:
            raise NotShared("a layer attends over keys that no lane's cache handed out")
        return view.attend(queries, scale, self, sinks)


class PassPlan:
    """What every layer of a shared pass uses alike: each lane's rows, layout and positions before
    the pass, and, for lanes that are rows of one KVStack, how attention runs. The narrow lanes
    (at most `width` rows) go in stacked calls, each over a run of the stack's rows (`segments`:
    first row, rows), their queries gathered [rows, width, ...] and each masked to its own
    positions (stacked_mask, made once per segment and window); each wider lane goes as a call of
    its own. A stacked call pays `width` query rows for every stack row in its run, a lane's or
    not (a stack row whose lane is idle or not in this pass reads its keys and values as one that
    is), so a run is cut where the lanes leave a gap dearer than another call (SEGMENT_CALL); and
    one lane of 16 rows beside seven of one would cost 128 rows' attention (its exp dominates on
    the CPU): `width` is chosen for the fewest rows in all, counting a wide lane's call of its own
    as OWN_CALL rows."""

    OWN_CALL = 8  # what a wide lane's call of its own costs, in query rows of a stacked call (~400 keys, CPU)
    # What another stacked call costs, in idle stack rows at width one: about one such row's keys
    # and values read (2 lanes at rows 0 and 3 of 8 ran as fast either way, at rows 0 and 7 18%
    # faster in two calls; the default model, 400 cached tokens, CPU)
    SEGMENT_CALL = 2

    def __init__(self, caches: list[ModelCache], spans: list[tuple[int, int]], layouts: list[TreePass],
                 packed: bool = False):
        self.spans, self.layouts, self.packed = spans, layouts, packed
        self.before = [c.length for c in caches]  # each lane's positions before this pass
        self.owners: dict[int, LaneView] = {}  # id of the keys a view handed out -> the view (live in the pass)
        first = [c.kv[0] if c.kv else None for c in caches]
        stacked = all(isinstance(c, LaneKVCache) for c in caches[0].kv) and all(first)
        self.rows_of = [c.row for c in first] if stacked else None
        self.masks: dict = {}
        if self.rows_of is None or len(set(self.rows_of)) != len(caches) or len(caches) < 2:
            self.rows_of = None
            return
        sizes = [b - a for a, b in spans]
        self.width = min(set(sizes), key=lambda w: (self._rows(w, sizes), -w))
        self.narrow = [i for i, n in enumerate(sizes) if n <= self.width]
        self.wide = [i for i, n in enumerate(sizes) if n > self.width]
        self.segments = self._segments([self.rows_of[i] for i in self.narrow], self.width)
        self.members = [[i for i in self.narrow if lo <= self.rows_of[i] < lo + n]  # each segment's lanes
                        for lo, n in self.segments]
        self.rows = sum(n for _, n in self.segments)  # stack rows the stacked calls run, all segments
        place, at = {}, 0  # stack row -> its place among the stacked calls' rows
        for lo, n in self.segments:
            place.update({lo + k: at + k for k in range(n)})
            at += n
        gather = np.zeros((self.rows, self.width), np.int32)  # flat row of each (lane, row); padding: 0
        back = np.zeros(spans[-1][1], np.int32)  # each row's place in [stacked rows, then each wide lane's]
        for i in self.narrow:
            (a, b), r = spans[i], place[self.rows_of[i]]
            gather[r, : b - a] = np.arange(a, b)
            back[a:b] = r * self.width + np.arange(b - a)
        at = self.rows * self.width
        for i in self.wide:
            a, b = spans[i]
            back[a:b] = at + np.arange(b - a)
            at += b - a
        self.gather, self.back = mx.array(gather.reshape(-1)), mx.array(back)

    def _segments(self, rows: list[int], width: int) -> list[tuple[int, int]]:
        """The runs of stack rows (first, count) that the stacked calls take: the lanes' rows in
        order, a gap between two of them bridged unless its idle rows cost more than a call."""
        rows = sorted(rows)
        out = [[rows[0], 1]]
        for r in rows[1:]:
            lo, n = out[-1]
            if (r - lo - n) * width > self.SEGMENT_CALL:
                out.append([r, 1])
            else:
                out[-1][1] = r + 1 - lo
        return [(lo, n) for lo, n in out]

    def _rows(self, width: int, sizes: list[int]) -> int:
        """Query rows that attention runs with lanes of at most `width` rows stacked, each call
        past the first counted as its rows (SEGMENT_CALL for a stacked one, OWN_CALL for a wide
        lane's)."""
        rows = [self.rows_of[i] for i, n in enumerate(sizes) if n <= width]
        segments = self._segments(rows, width)
        return (sum(n for _, n in segments) * width + (len(segments) - 1) * self.SEGMENT_CALL
                + sum(n + self.OWN_CALL for n in sizes if n > width))

    def stacked_mask(self, caches: list[LaneKVCache], window_size: int | None, segment: int,
                     keys: int) -> mx.array:
        """[rows, 1, width, keys] bool over a segment's stack rows: each narrow lane's own mask (its
        rows over its positions), every other place False; rows of no narrow lane see one key
        (their output is dropped)."""
        key = (window_size, caches[0].window, segment, keys)
        if key not in self.masks:
            width, (lo, n) = self.width, self.segments[segment]
            idle = mx.arange(keys)[None].astype(mx.int32) == mx.zeros((width, 1), mx.int32)  # key 0 only
            out = [idle] * n
            for i in self.members[segment]:
                c, t, before = caches[i], self.spans[i][1] - self.spans[i][0], self.before[i]
                m = dense_mask(c.mask_at(before, t, self.layouts[i], window_size), t, before + t)
                out[self.rows_of[i] - lo] = _pad(_pad(m, 1, keys), 0, width, True)
            self.masks[key] = mx.stack(out)[:, None]
        return self.masks[key]

    def packed_mask(self, caches: list[TreeKVCache], window_size: int | None) -> mx.array:
        """[rows, keys] bool over every lane's rows and every lane's keys after the pass, both end to
        end (LaneView.packed): each lane's rows see only its own keys, as its own mask has them."""
        key = ("packed", window_size)
        if key not in self.masks:
            keys = [before - c.start + b - a for c, (a, b), before in zip(caches, self.spans, self.before)]
            total, at, rows = sum(keys), 0, []
            for c, (a, b), tp, before, n in zip(caches, self.spans, self.layouts, self.before, keys):
                m = dense_mask(c.mask_at(before, b - a, tp, window_size), b - a, n)
                rows.append(mx.concatenate([mx.zeros((b - a, at), mx.bool_), m,
                                            mx.zeros((b - a, total - at - n), mx.bool_)], axis=1))
                at += n
            self.masks[key] = mx.concatenate(rows, axis=0)
        return self.masks[key]


class LaneView:
    """One layer's caches of every lane in a shared pass, behind mlx-lm's cache interface: new
    keys and values go to each lane's own cache, and attention (attention.py calls `attend`) runs
    over all lanes at once when they are rows of one KVStack, else lane by lane."""

    offset = 0  # the pass's rows carry their absolute positions (TreePass.rel), RoPE adds this

    def __init__(self, caches: list[TreeKVCache], plan: PassPlan):
        self.caches, self.plan = caches, plan
        self.fetched: list | None = None
        self.new: tuple | None = None

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if self.plan.packed:
            return self.plan.packed_mask(self.caches, window_size)
        return LaneMask(window_size, self.plan)

    def keys_and_values(self):
        """This pass's new keys and values (a layer that shares this cache, as gemma3n's KV-shared
        layers do, attends through `attend`, which reads every lane's)."""
        return self.new

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        plan = self.plan
        self.new = keys, values
        plan.owners[id(keys)] = self
        given = keys, values
        keys, values = _end_to_end(keys), _end_to_end(values)
        if plan.rows_of is not None:  # every lane's rows into the stack at once
            stack = self.caches[0].stack
            stack.reserve(max(p + b - a for p, (a, b) in zip(plan.before, plan.spans)), keys, values)
            for c, (a, b) in zip(self.caches, plan.spans):  # (no view of the stack is kept meanwhile,
                r, p = c.row, c.offset  # so each write is done in place)
                stack.keys[r : r + 1, :, p : p + b - a, :] = keys[:, :, a:b]
                stack.values[r : r + 1, :, p : p + b - a, :] = values[:, :, a:b]
                c.offset += b - a
            self.fetched = []
        else:
            self.fetched = [c.update_and_fetch(keys[:, :, a:b], values[:, :, a:b])
                            for c, (a, b) in zip(self.caches, plan.spans)]
        if plan.packed:  # the model attends over what it gets back: every lane's keys end to end
            return self.packed()
        return given

    def packed(self) -> tuple[mx.array, mx.array]:
        """Every lane's keys and values after the pass, end to end (what a packed pass's model
        attends over: sharing.Sharing.packed)."""
        held = self.fetched or [c.keys_and_values() for c in self.caches]
        return tuple(mx.concatenate([kv[i] for kv in held], axis=2) for i in (0, 1))

    def attend(self, queries: mx.array, scale: float, mask, sinks=None) -> mx.array:
        if not isinstance(mask, LaneMask) or self.fetched is None:
            raise NotShared("the model's attention does not take the lanes' masks")
        B, H, T, D = queries.shape
        if B > 1:  # lanes side by side: attend with their rows end to end, then back
            out = self.attend(_end_to_end(queries), scale, mask, sinks)
            return out.reshape(H, B, T, D).transpose(1, 0, 2, 3)
        plan = self.plan
        if plan.rows_of is not None:
            return self._stacked(queries, scale, mask.window_size, sinks)
        out = []
        for c, (a, b), tp, before, (k, v) in zip(self.caches, plan.spans, plan.layouts, plan.before, self.fetched):
            lane_mask = c.mask_at(before, b - a, tp, mask.window_size)
            out.append(attention.scaled_dot_product_attention(queries[:, :, a:b], k, v, c, scale, lane_mask, sinks))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=2)

    def _stacked(self, queries: mx.array, scale: float, window_size: int | None, sinks) -> mx.array:
        """The narrow lanes in one attention per segment (queries gathered [rows, heads, width, dim]
        against the segment's stack rows, up to its longest lane, each lane masked to its own
        positions), then each wide lane in one of its own; every row back in its place."""
        plan, stack = self.plan, self.caches[0].stack
        _, H, _, D = queries.shape
        q = queries[0][:, plan.gather].reshape(H, plan.rows, plan.width, D).transpose(1, 0, 2, 3)
        parts, at = [], 0
        for k, (lo, n) in enumerate(plan.segments):
            keys = max(self.caches[i].offset for i in plan.members[k])
            out = attention.scaled_dot_product_attention(q[at : at + n], stack.keys[lo : lo + n, :, :keys],
                                                         stack.values[lo : lo + n, :, :keys], self.caches[0], scale,
                                                         plan.stacked_mask(self.caches, window_size, k, keys), sinks)
            parts.append(out.transpose(1, 0, 2, 3).reshape(H, n * plan.width, D))
            at += n
        for i in plan.wide:
            c, (a, b) = self.caches[i], plan.spans[i]
            k, v = c.keys_and_values()
            lane_mask = c.mask_at(plan.before[i], b - a, plan.layouts[i], window_size)
            parts.append(attention.scaled_dot_product_attention(queries[:, :, a:b], k, v, c, scale, lane_mask,
                                                                sinks)[0])
        flat = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return flat[:, plan.back][None]


def _end_to_end(x: mx.array) -> mx.array:
    """[B, H, T, D] (lanes side by side) -> [1, H, B * T, D] (their rows end to end)."""
    B, H, T, D = x.shape
    return x if B == 1 else x.transpose(1, 0, 2, 3).reshape(1, H, B * T, D)


def _pad(x: mx.array, axis: int, size: int, value=False) -> mx.array:
    """x padded at the end of `axis` to `size` (zeros; a bool mask: `value`)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[axis] = extra
    fill = mx.full(shape, value, mx.bool_) if x.dtype == mx.bool_ else mx.zeros(shape, x.dtype)
    return mx.concatenate([x, fill], axis=axis)


def dense_mask(mask, rows: int, keys: int) -> mx.array:
    """A mask as mlx-lm hands it to attention (None, "causal" or an array) as bool [rows, keys]."""
    if mask is None:
        return mx.ones((rows, keys), mx.bool_)
    if isinstance(mask, str):
        return mx.arange(keys)[None] <= mx.arange(keys - rows, keys)[:, None]
    if mask.dtype != mx.bool_:
        return mask > -mx.inf
    return mask.reshape(rows, keys)


def batch_pass(model, passes: list[tuple[ModelCache, list[int], DraftTree, int]],
               packed: bool = False, read: int | None = None) -> list[mx.array]:
    """ONE pass over every lane's lead + tree (padded to its rows); per lane, the logits of its
    root and nodes (verify_pass's). Each lane's caches then hold its rows past their old length,
    as after verify_pass; ModelCache.finish_pass keeps the accepted ones. Lanes with recurrent
    layers go side by side (chains, each padded to the longest lane's rows; their states end after
    their own rows, `rows` not counting the padding). packed: see sharing.Sharing.packed. read:
    only the first `read` passes' logits are wanted (the others, prompt chunks riding, fill their
    caches only): the model's head runs on those rows alone where it can (head.py)."""
    caches = [p[0] for p in passes]
    side_by_side = bool(caches[0].recurrent)
    width = max(p[3] for p in passes)
    tokens, positions, spans, layouts, start = [], [], [], [], 0
    for cache, lead, tree, rows in passes:
        n = len(lead) + len(tree)
        rows = width if side_by_side else rows
        row_tokens = np.zeros(rows, np.int32)
        row_tokens[: len(lead)], row_tokens[len(lead) : n] = lead, tree.tokens
        layout = TreePass()
        if tree.is_chain():
            rel = np.arange(rows, dtype=np.int32)
        else:
            rel, in_pass = tree_layout(tree, len(lead), rows)
            layout.rel, layout.in_pass = mx.array(rel), mx.array(in_pass)
        tokens.append(row_tokens)
        positions.append(cache.length + rel)
        spans.append((start, start + rows))
        layouts.append(layout)
        start += rows
    for c in caches:
        c.begin_pass()
    plan = PassPlan(caches, spans, layouts, packed)
    states: list[LaneStates] = []
    views = [_view([c.layers[j] for c in caches], plan, [p[3] for p in passes], states)
             for j in range(len(caches[0].layers))]
    tree_pass = caches[0].tree_pass  # the model's: its RoPE modules read every row's position from it
    tree_pass.set(mx.array(np.concatenate(positions)), None)
    inputs = mx.array(np.stack(tokens)) if side_by_side else mx.array(np.concatenate(tokens))[None]
    wanted = [(a + len(lead) - 1, a + len(lead) + len(tree)) for (a, _), (_, lead, tree, _) in zip(spans, passes)]
    wanted = wanted[:read] if read is not None else wanted
    some = read is not None and 0 < read < len(passes) and not side_by_side  # riders: the head skips theirs
    kept = np.concatenate([np.arange(lo, hi) for lo, hi in wanted]) if some else None
    try:
        with activations.engine_pass(), kernels.rows_pass(), head.keep_rows(mx.array(kept) if some else None):
            logits = model(inputs, cache=views)
        for view in states:
            view.give_back()
    finally:
        tree_pass.clear()
        plan.owners.clear()  # the views go now: a view still held keeps its slices of the stack, and
        # the next pass's writes into the stack would then copy all of it instead of writing in place
    if side_by_side:
        return [logits[i, len(lead) - 1 : len(lead) + len(tree)] for i, (_, lead, tree, _) in enumerate(passes)]
    if some and logits.shape[1] == len(kept):  # the head ran on the wanted rows alone, in order
        at = np.cumsum([0] + [hi - lo for lo, hi in wanted])
        return [logits[0, at[k] : at[k + 1]] for k in range(len(wanted))]
    return [logits[0, lo:hi] for lo, hi in wanted]


def _view(layers: list, plan: PassPlan, rows: list[int], states: list[LaneStates]):
    """What the model gets for one layer's caches of every lane in a shared pass."""
    if isinstance(layers[0], CacheList):
        return CacheList(*(_view([c.caches[k] for c in layers], plan, rows, states)
                           for k in range(len(layers[0].caches))))
    if isinstance(layers[0], RecurrentCache):
        states.append(LaneStates(layers, rows))
        return states[-1]
    return LaneView(layers, plan)
