"""Recurrent layers' caches (conv states + SSM / gated-delta states): undo a pass, or keep a prefix.

A recurrent state cannot be cut back the way a K/V cache is. When a chain pass of n rows is
accepted up to row m-1 (m < n), there are two ways back to the state after row m-1:

- capture (the mixers in MIXERS, when every recurrent layer of a model has one): during the pass
  each recurrent layer keeps what it needs to give its state after any row, and
  ModelCache.finish_pass sets it to the state after row m-1. The pass is kept: nothing is fed again.
- snapshot (any other model with recurrent layers, and any pass that did not capture): the states
  are restored from a snapshot taken before the pass and the accepted tokens lead the next pass
  (engine.py), which costs their rows again.
`plan` decides which, once per model; CACHEBACK_MLX_CAPTURE=0 turns capture off (snapshots only).

Each row's state comes from mlx-lm's own code:
- conv state (the last kernel-1 conv inputs), through mlx-lm's `cache.lengths` protocol: a mixer
  whose cache has `lengths` keeps the conv window that ends at row `lengths` instead of the last
  one (meant for batches of sequences of unequal lengths). A capturing cache answers every length
  1..n at once, a batch of n lengths that broadcasts against the batch of one, so the mixer's own
  gather hands it every row's window of the pass's conv input ([n, kernel-1, channels]).
- SSM / gated-delta state: the recurrence function the mixer calls (mlx-lm's `ssm_update`,
  `gated_delta_update`) is routed through `capturing`, installed into the mixer's module as
  attention.install does. In a capturing pass, one of two ways (`by_rows`):
  - rows: where mlx-lm's own form for several rows is a loop over rows (gated_delta_update on the
    CPU), mlx-lm's function is called one row at a time, each row's state handed to the next, and
    every row's state is kept: the same arithmetic as mlx-lm's loop, bit for bit, for the cost of
    holding n states.
  - replay: elsewhere (ssm_update's chunked form, which returns the last state only and costs
    ~2x a pass when run row by row on the CPU; the Metal kernels) the pass runs mlx-lm's function
    unchanged and keeps its inputs; the state after row m-1 is mlx-lm's function run again on the
    first m rows from the state before the pass: bit for bit what feeding those rows gives.
A pass captures when it has at most MAX_ROWS rows: the engine's verify passes, and prefill chunks
that short (longer chunks never need a prefix). That depends on the pass alone, so every rank of a
sharded model (distributed.py) decides alike; where its rows' states would pass MAX_BYTES, a pass
replays instead of holding them (a choice each rank may make for itself). What a pass captured is
held for the pass in flight only: finish_pass keeps one row's state and drops the rest.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

enabled = os.environ.get("CACHEBACK_MLX_CAPTURE", "1") != "0"
MAX_ROWS = 64  # the longest pass that captures (a GPU verify pass: 63 drafts + the root)
MAX_BYTES = 1 << 30  # the most memory a pass may hold in its rows' states (past it: replay)

# The mixers whose recurrent layers can be captured (their conv follows the `lengths` protocol), by
# (module, class), with the recurrence function each calls from its module (None: a short conv only).
MIXERS = {
    ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet"): "gated_delta_update",
    ("mlx_lm.models.qwen3_5", "GatedDeltaNet"): "gated_delta_update",
    ("mlx_lm.models.mamba2", "Mamba2Block"): "ssm_update",
    ("mlx_lm.models.nemotron_h", "NemotronHMamba2Mixer"): "ssm_update",
    ("mlx_lm.models.falcon_h1", "FalconH1Mixer"): "ssm_update",
    ("mlx_lm.models.lfm2", "ShortConv"): None,
}
# each recurrence function's arguments that hold one entry per row ([batch, rows, ...])
ROW_ARGS = {
    "gated_delta_update": ("q", "k", "v", "a", "b"),
    "ssm_update": ("hidden_states", "B", "C", "dt"),
}


def by_rows(name: str) -> bool:
    """Whether mlx-lm's `name` for several rows is a loop over rows here (else: replay)."""
    return name == "gated_delta_update" and mx.default_device() == mx.cpu


_pending = threading.local()  # .cache: the capturing cache whose state the next recurrence call reads


class Capture:
    """One model's capture: whether the pass in flight captures, and its rows' lengths. Shared by
    the model's RecurrentCaches (as a TreePass is by its K/V caches)."""

    def __init__(self):
        self.caches: list[RecurrentCache] = []
        self.armed = False  # a pass began and has not decided yet
        self.rows = 0  # rows of the pass capturing now (0: none)
        self.ends: mx.array | None = None  # 1..rows: the conv window wanted after each row
        self.hold = False  # every row's state fits in MAX_BYTES (by rows allowed)

    def arm(self) -> None:
        """Before a pass: it decides on its first mask (RecurrentCache.make_mask), knowing its rows."""
        self.stop()
        self.armed = True

    def start(self, rows: int) -> None:
        self.armed = False
        if rows <= MAX_ROWS:
            self.rows, self.ends = rows, mx.arange(1, rows + 1, dtype=mx.int32)
            row_bytes = sum(a.nbytes for c in self.caches for a in c.cache if a is not None)
            self.hold = rows * row_bytes <= MAX_BYTES

    def stop(self) -> None:
        """After a pass (kept, undone or a prefill): drop what it captured."""
        self.armed, self.rows, self.ends, self.hold = False, 0, None, False
        _pending.cache = None
        for c in self.caches:
            c.windows = c.row_state = None


class RecurrentCache(ArraysCache):
    """mlx-lm's ArraysCache (slot 0: conv state, slot 1: SSM / gated-delta state) with a snapshot
    to undo a pass and, with a Capture, what a capturing pass needs to keep any prefix of it."""

    def __init__(self, size: int, capture: Capture | None = None):
        super().__init__(size)
        self.saved: list | None = None
        self.capture = capture
        self.windows: mx.array | None = None  # [rows, kernel-1, channels]: conv state after each row
        self.row_state = None  # m -> the SSM / gated-delta state after row m-1 of this pass
        if capture is not None:
            capture.caches.append(self)

    def snapshot(self) -> None:
        self.saved = list(self.cache)  # MLX arrays are immutable: keeping references is enough

    def restore(self) -> None:
        self.cache = list(self.saved)

    def clear(self) -> None:
        self.cache = [None] * len(self.cache)
        self.windows = self.row_state = None

    def _capturing(self) -> bool:
        return self.capture is not None and self.capture.rows > 0

    # mlx-lm's side: what its mixers read and write while a pass is built
    @property
    def lengths(self):
        return self.capture.ends if self._capturing() else self._lengths

    @lengths.setter
    def lengths(self, value) -> None:
        self._lengths = value

    def make_mask(self, N: int):
        """The model's first call in a pass (mlx-lm's create_ssm_mask): an armed pass decides here."""
        if self.capture is not None and self.capture.armed:
            self.capture.start(N)
        return None if self._capturing() else super().make_mask(N)

    def advance(self, N: int) -> None:
        if not self._capturing():
            super().advance(N)

    def __getitem__(self, idx):
        if idx == 1 and self._capturing():
            _pending.cache = self  # the mixer hands this state to its recurrence function next
        return self.cache[idx]

    def __setitem__(self, idx, value) -> None:
        if idx == 0 and self._capturing() and value is not None and value.shape[0] == self.capture.rows:
            self.windows = value  # every row's conv window (the lengths protocol)
            value = mx.contiguous(value[-1:])
        self.cache[idx] = value

    # the engine's side
    def can_keep(self, m: int) -> bool:
        """Whether this pass captured the states after row m-1."""
        return (self.windows is not None and self.windows.shape[0] >= m
                and (len(self.cache) < 2 or self.row_state is not None))

    def keep(self, m: int) -> None:
        """The states after row m-1 of this pass (m >= 1) become the cache's."""
        self.cache[0] = mx.contiguous(self.windows[m - 1 : m])
        if len(self.cache) > 1:
            self.cache[1] = self.row_state(m)


class LaneStates(ArraysCache):
    """One recurrent layer's states of several sequences in one pass (a batch's lanes, side by side
    as batch rows, right-padded: shared_pass.py), as mlx-lm's batched ArraysCache: `lengths` holds
    each lane's real rows, so the mixers (their `lengths` and mask protocol for sequences of unequal
    lengths) leave each lane the state after its own last row, not after the padding. A mixer in
    MIXERS that calls its recurrence without the `lengths` it takes (Nemotron-H's ssm_update) runs
    its state on into the padding: there `own_rows` runs it again over each padded lane's rows.
    `give_back` hands each lane its row. Nothing is captured: a lane not accepted whole is undone
    by its snapshot (ModelCache.finish_pass)."""

    def __init__(self, caches: list[RecurrentCache], rows: list[int]):
        super().__init__(len(caches[0].cache))
        self.lanes, self.rows = caches, rows
        self.routed = caches[0].capture is not None  # the mixers' recurrence goes through `capturing`
        for k in range(len(self.cache)):
            parts = [c.cache[k] for c in caches]
            like = next((p for p in parts if p is not None), None)
            if like is not None:  # a lane with no state yet starts from zeros, as mlx-lm's mixers do
                self.cache[k] = mx.concatenate([mx.zeros_like(like) if p is None else p for p in parts])
        self.lengths = mx.array(rows, dtype=mx.int32)

    def __getitem__(self, idx):
        if idx == 1 and self.routed and min(self.rows) < max(self.rows):
            _pending.cache = self  # the mixer hands this state to its recurrence function next
        return self.cache[idx]

    def own_rows(self, stock, args: dict, names) -> tuple:
        """mlx-lm's recurrence `stock` over the lanes side by side, called without the `lengths`
        it takes: each padded lane's state is its state after its own rows, run again on them."""
        y, state = stock(**args)
        width, parts = args[names[0]].shape[1], []
        for i, rows in enumerate(self.rows):
            if rows == width:
                parts.append(state[i : i + 1])
                continue
            own = dict(args, **{k: args[k][i : i + 1, :rows] for k in names})
            if args.get("state") is not None:
                own["state"] = args["state"][i : i + 1]
            if "mask" in own:
                own["mask"] = None
            parts.append(stock(**own)[1])
        return y, mx.concatenate(parts)

    def give_back(self) -> None:
        for i, c in enumerate(self.lanes):
            c.cache = [None if a is None else a[i : i + 1] for a in self.cache]


def _rows(args: dict, names, start: int, stop: int) -> dict:
    return dict(args, **{k: args[k][:, start:stop] for k in names})


def capturing(stock):
    """mlx-lm's recurrence function `stock`, which, when a capturing cache asked for it (its state
    was the last one read), leaves that cache a way to the state after any row (`row_state`)."""
    signature = inspect.signature(stock)
    names = ROW_ARGS[stock.__name__]

    def update(*args, **kwargs):
        cache, _pending.cache = getattr(_pending, "cache", None), None
        if cache is None:
            return stock(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        if isinstance(cache, LaneStates):  # lanes side by side
            if "lengths" in signature.parameters and a.get("lengths") is None:  # (a gated-delta
                return cache.own_rows(stock, a, names)  # update's mask keeps the padding out)
            return stock(**a)
        if "lengths" in a:
            a["lengths"] = None  # the capture's lengths were for the conv window
        if a.get("mask") is not None:  # a padded batch: not the engine's, not captured
            return stock(**a)
        if not (by_rows(stock.__name__) and cache.capture.hold):
            # replay: the pass as mlx-lm runs it; its first m rows run again if a prefix is kept
            cache.row_state = lambda m: stock(**_rows(a, names, 0, m))[1]
            return stock(**a)
        state, ys, states = a.get("state"), [], []
        for t in range(a[names[0]].shape[1]):
            y, state = stock(**dict(_rows(a, names, t, t + 1), state=state))
            ys.append(y)
            states.append(state)
        cache.row_state = lambda m: states[m - 1]
        return mx.concatenate(ys, axis=1), state

    update.stock = stock
    return update


_routed: dict = {}  # mlx-lm's function -> its capturing form (one for every module)


def _route(module, name: str) -> bool:
    """Route a mixer module's recurrence function through `capturing` (once); False if it is not
    mlx-lm's function as ROW_ARGS knows it."""
    fn = getattr(module, name, None)
    if getattr(fn, "stock", None) is not None:
        return True
    home = sys.modules.get(getattr(fn, "__module__", "") or "")
    if fn is None or getattr(home, name, None) is not fn or not home.__name__.startswith("mlx_lm.models."):
        return False
    if name not in ROW_ARGS:
        return False
    setattr(module, name, _routed.setdefault(fn, capturing(fn)))
    return True


def plan(model: nn.Module, recurrent: int) -> Capture | None:
    """The one place that decides, per model, how its `recurrent` ArraysCache layers roll back:
    a Capture when capture is on and every one of them belongs to a mixer in MIXERS (whose
    recurrence function is then routed through `capturing`); None (snapshots only) otherwise."""
    if not enabled or recurrent == 0:
        return None
    kinds = [(type(m).__module__, type(m).__name__) for _, m in model.named_modules()]
    mixers = [k for k in kinds if k in MIXERS]
    if len(mixers) != recurrent:  # a recurrent layer of another kind (Mamba 1, Jamba): snapshots
        return None
    for module_name, cls in set(mixers):
        fn = MIXERS[(module_name, cls)]
        if fn is not None and not _route(sys.modules[module_name], fn):
            return None
    return Capture()


def count(caches) -> int:
    """How many mlx-lm ArraysCache layers a model's caches hold (CacheLists opened)."""
    n = 0
    for c in caches:
        n += count(c.caches) if hasattr(c, "caches") else type(c) is ArraysCache
    return n
