"""The model's own caches, each kind wrapped so a speculative pass can be undone.

A model's caches come from its own `make_cache()` (mlx-lm's `make_prompt_cache`), so sliding-window
layers, layers that share another layer's K/V (no cache of their own) and recurrent layers get
what the model expects. `wrap` is the one place that decides how each kind is wrapped:

  KVCache          -> TreeKVCache: rollback by length counter, tree masks
  RotatingKVCache  -> WindowKVCache: keeps the window plus some slack (evicted in chunks), so a
                      rejected pass never needs an evicted entry; masks honour the layer's window
                      measured from each row's own position
  ArraysCache      -> RecurrentCache (recurrent.py): a recurrent state cannot be shortened. On
                      a model whose recurrent mixers all capture (recurrent.plan), a verify pass
                      captures each row's state, and a chain accepted up to row m-1 keeps the
                      states after row m-1; on any other, a snapshot before each pass undoes a
                      pass not accepted whole, and its accepted tokens are fed again at the head
                      of the next pass (engine.py)
  CacheList        -> the same list of wrapped caches
Any other kind (quantized, chunked, rotating with `keep`) is refused with a one-line error.
A model's own quantized caches are not taken; quantizing the K/V is the engine's to ask
(`ModelCache.set_kv_quantization`, mlx-lm's --kv-bits): TreeKVCache -> QuantizedTreeKVCache at
the point where mlx-lm's generate_step would convert its caches.
Attention over these caches goes through attention.py, which on the CPU gives passes of several
rows a faster softmax (mlx-lm's own caches keep MLX's kernel).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from . import activations, attention
from .errors import CachebackError
from .positions import TreePass, attach_tree_pass, model_family, model_modules
from .recurrent import Capture, RecurrentCache, count, plan


def pass_mask(tp: TreePass, offset: int, start: int, n: int, window: int | None) -> mx.array:
    """[n, offset - start + n] bool: which cached slots (positions start..offset-1) and which rows
    of this pass each row may attend to. A row's position is offset + tp.rel[row] (a chain:
    offset + row); with a window W it sees only keys less than W positions back."""
    rel = tp.rel if tp.rel is not None else mx.arange(n, dtype=mx.int32)
    in_pass = tp.in_pass if tp.in_pass is not None else mx.tril(mx.ones((n, n), dtype=mx.bool_))
    cached = offset - start
    if window is None:
        seen = mx.ones((n, cached), dtype=mx.bool_)
    else:
        back = (offset + rel)[:, None] - mx.arange(start, offset, dtype=mx.int32)[None]
        seen = back < window
        in_pass = in_pass & ((rel[:, None] - rel[None]) < window)
    if tp.tail is not None:  # the last cached slots hold a tree: each row sees only its ancestors there
        t = tp.tail.shape[1]
        seen = mx.concatenate([seen[:, : cached - t], seen[:, cached - t :] & tp.tail], axis=1)
    return mx.concatenate([seen, in_pass], axis=1)


class TreeKVCache(KVCache):
    """mlx-lm's KVCache; masks come from the current TreePass while one is set."""

    start = 0  # absolute position of the first stored slot (a full cache never evicts)
    fast_attention = True  # passes of several rows on the CPU use attention.cpu_attention

    def __init__(self, tree_pass: TreePass):
        super().__init__()
        self.tree_pass = tree_pass

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        return self.mask_at(self.offset, N, self.tree_pass, window_size, return_array)

    def mask_at(self, offset: int, N: int, tp: TreePass, window_size: int | None = None,
                return_array: bool = False):
        """The mask of a pass of N rows laid out by `tp` when the cache held `offset` positions
        (make_mask's, for a pass that shares its rows with other sequences: batch.py)."""
        if tp.rel is None and (window_size is None or offset + N <= window_size):
            return create_attention_mask(N, offset=offset, window_size=window_size, return_array=return_array)
        return pass_mask(tp, offset, self.start, N, window_size)

    def update_and_fetch(self, keys, values):
        """mlx-lm's, except that when the buffers grow they keep every position they had, so their
        length stays a multiple of `step` (mlx-lm's first cuts them to `offset` when that is not
        one, which its plain decoding never meets but a rolled-back pass does). MLX's CUDA backend
        gives a one-query attention over 256 keys or more cuDNN's kernel only when the keys are a
        slice of such a buffer, and its own vector kernel otherwise: a step after a pass must get
        the kernel, and so the bits, of mlx-lm's step."""
        prev, n = self.offset, keys.shape[2]
        if self.keys is not None and prev + n > self.keys.shape[2] and prev % self.step:
            grow = -(-(prev + n - self.keys.shape[2]) // self.step) * self.step
            B, H, _, dk = keys.shape
            self.keys = mx.concatenate([self.keys, mx.zeros((B, H, grow, dk), keys.dtype)], axis=2)
            self.values = mx.concatenate([self.values, mx.zeros((B, H, grow, values.shape[3]), values.dtype)], axis=2)
        return super().update_and_fetch(keys, values)

    def can_trim_to(self, length: int) -> bool:
        return True

    def trim_to(self, length: int) -> None:
        self.offset = min(self.offset, length)
        self.fit()

    def fit(self) -> None:
        """Cut the buffers to the length plain decoding's would have at this offset (the multiple
        of `step` at or above it) where a pass that grew them was rolled back: MLX's CUDA backend
        rounds a step's attention over the first keys of a longer buffer otherwise than over those
        of one of that length (docs/BENCHMARKS.md §15), and mlx-lm's step sees the latter. The
        cut copies the kept positions into buffers of their own (a slice would keep the stride)."""
        want = max(1, -(-self.offset // self.step)) * self.step
        if self.keys is not None and self.keys.shape[2] > want:
            self.keys = mx.contiguous(self.keys[..., :want, :])
            self.values = mx.contiguous(self.values[..., :want, :])

    def move_rows(self, src: mx.array, dst: mx.array) -> None:
        """Copy the K/V at absolute positions src to positions dst."""
        self.keys[..., dst - self.start, :] = self.keys[..., src - self.start, :]
        self.values[..., dst - self.start, :] = self.values[..., src - self.start, :]

    def clear(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    def to_quantized(self, group_size: int, bits: int) -> "QuantizedTreeKVCache":
        """This cache's positions quantized as mlx-lm's KVCache.to_quantized does (each position's
        keys and values in groups along the head dimension)."""
        q = QuantizedTreeKVCache(self.tree_pass, group_size, bits)
        q.offset = self.offset
        if self.keys is not None:
            if self.keys.shape[-1] % group_size or self.values.shape[-1] % group_size:
                raise CachebackError(f"--kv-group-size {group_size} does not divide this model's head size "
                                     f"({self.keys.shape[-1]}); try 32")
            q.keys = mx.quantize(self.keys, group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values, group_size=group_size, bits=bits)
        return q


class QuantizedTreeKVCache(TreeKVCache):
    """mlx-lm's QuantizedKVCache (keys and values as (data, scales, biases), quantized as they
    come; attention through mlx-lm's quantized path, which reads `bits` and `group_size`) that
    rolls back like TreeKVCache and takes its masks from the current TreePass."""

    fast_attention = False  # mlx-lm's quantized attention

    def __init__(self, tree_pass: TreePass, group_size: int, bits: int):
        super().__init__(tree_pass)
        self.group_size, self.bits = group_size, bits

    update_and_fetch = QuantizedKVCache.update_and_fetch
    keys_and_values = QuantizedKVCache.keys_and_values

    def fit(self) -> None:
        """Nothing: mlx-lm's quantized buffers grow as they do."""

    def move_rows(self, src: mx.array, dst: mx.array) -> None:
        for parts in (self.keys, self.values):
            for a in parts:
                a[..., dst, :] = a[..., src, :]


class WindowKVCache(TreeKVCache):
    """A sliding-window layer's cache that can roll back: it keeps at least the last window - 1
    positions before the next pass, and evicts older ones only once `slack` have piled up, so
    trimming back a rejected pass (or a little more) never needs an evicted entry."""

    def __init__(self, tree_pass: TreePass, window: int, slack: int = 256):
        super().__init__(tree_pass)
        self.window = window
        self.slack = slack
        self.start = 0

    def evict(self) -> None:
        """Before a pass (never inside one: its mask was made for the slots as they were)."""
        used = self.offset - self.start
        if used > self.window - 1 + self.slack:  # keep the last window - 1 positions
            cut = used - (self.window - 1)
            self.keys = self.keys[..., cut:used, :]
            self.values = self.values[..., cut:used, :]
            self.start += cut

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        used = self.offset - self.start
        if self.keys is None or used + n > self.keys.shape[2]:
            grow = ((n + self.step - 1) // self.step) * self.step
            B, H, _, dk = keys.shape
            new_k = mx.zeros((B, H, grow, dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :used, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :used, :], new_v], axis=2)
        self.keys[..., used : used + n, :] = keys
        self.values[..., used : used + n, :] = values
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self):
        """The stored slots (positions start..offset-1); also what a shared-KV layer reads."""
        used = self.offset - self.start
        return self.keys[..., :used, :], self.values[..., :used, :]

    def mask_at(self, offset: int, N: int, tp: TreePass, window_size: int | None = None,
                return_array: bool = False):
        window = min(window_size or self.window, self.window)
        if tp.rel is None and offset + N - self.start <= window:
            return "causal" if N > 1 else None  # every stored key is inside every row's window
        return pass_mask(tp, offset, self.start, N, window)

    def can_trim_to(self, length: int) -> bool:
        return length >= self.offset or self.start == 0 or length - (self.window - 1) >= self.start

    def fit(self) -> None:
        """Nothing: this buffer is laid out by its own eviction, not as plain decoding's."""

    def clear(self) -> None:
        super().clear()
        self.start = 0


class KVStack:
    """One layer's keys and values for several sequences (a batch's lanes), stacked
    [lanes, heads, capacity, dim], so attention over every lane is one operation (batch.py)."""

    step = 256

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.keys = self.values = None

    def reserve(self, length: int, keys: mx.array, values: mx.array) -> None:
        """Room for `length` positions in every lane (shaped and typed as `keys`, `values`)."""
        have = 0 if self.keys is None else self.keys.shape[2]
        if length <= have:
            return
        grow = ((length - have + self.step - 1) // self.step) * self.step
        _, H, _, dk = keys.shape
        new_k = mx.zeros((self.lanes, H, grow, dk), keys.dtype)
        new_v = mx.zeros((self.lanes, H, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)


class LaneKVCache(TreeKVCache):
    """A lane's cache of one layer: row `row` of a KVStack. A sliding-window layer keeps every
    position (its masks honour the window), so nothing is ever evicted."""

    def __init__(self, tree_pass: TreePass, stack: KVStack, row: int, window: int | None = None):
        self.stack, self.row, self.window = stack, row, window
        super().__init__(tree_pass)

    keys = property(lambda self: None if self.stack.keys is None else self.stack.keys[self.row : self.row + 1],
                    lambda self, value: None)
    values = property(lambda self: None if self.stack.values is None else self.stack.values[self.row : self.row + 1],
                      lambda self, value: None)

    def update_and_fetch(self, keys, values):
        prev, n, stack = self.offset, keys.shape[2], self.stack
        stack.reserve(prev + n, keys, values)
        stack.keys[self.row : self.row + 1, :, prev : prev + n, :] = keys
        stack.values[self.row : self.row + 1, :, prev : prev + n, :] = values
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self):
        return (self.stack.keys[self.row : self.row + 1, :, : self.offset, :],
                self.stack.values[self.row : self.row + 1, :, : self.offset, :])

    def mask_at(self, offset: int, N: int, tp: TreePass, window_size: int | None = None,
                return_array: bool = False):
        if self.window is None:
            return super().mask_at(offset, N, tp, window_size, return_array)
        window = min(window_size or self.window, self.window)
        if tp.rel is None and offset + N <= window:
            return "causal" if N > 1 else None
        return pass_mask(tp, offset, 0, N, window)

    def move_rows(self, src: mx.array, dst: mx.array) -> None:
        b, stack = self.row, self.stack
        stack.keys[b : b + 1, :, dst, :] = stack.keys[b : b + 1, :, src, :]
        stack.values[b : b + 1, :, dst, :] = stack.values[b : b + 1, :, src, :]

    def clear(self) -> None:
        self.offset = 0


def wrap(cache, tree_pass: TreePass, family: str, capture: Capture | None = None, stack: KVStack | None = None,
         row: int = 0):
    """The one place that decides how each kind of layer cache is wrapped. `capture`: the model's
    recurrent.plan (None: its recurrent layers roll back by snapshot only). `stack`: the layer's
    KVStack when the cache is lane `row` of a batch (key/value layers only)."""
    kind = type(cache)
    if stack is not None and (kind is KVCache or (kind is RotatingKVCache and cache.keep == 0)):
        return LaneKVCache(tree_pass, stack, row, cache.max_size if kind is RotatingKVCache else None)
    if kind is KVCache:
        return TreeKVCache(tree_pass)
    if kind is RotatingKVCache and cache.keep == 0:
        return WindowKVCache(tree_pass, cache.max_size)
    if kind is ArraysCache:
        return RecurrentCache(len(cache.cache), capture)
    if kind is CacheList:
        return CacheList(*(wrap(c, tree_pass, family, capture) for c in cache.caches))
    what = f"{kind.__name__}(keep={cache.keep})" if kind is RotatingKVCache else kind.__name__
    raise CachebackError(f"{family}: layer cache {what} is not supported for exact speculative decoding")


def quantize_point(start: int, cached: int, prompt_length: int, chunk: int = 2048) -> int:
    """The cache length at which mlx-lm's generate_step turns the caches quantized: the end of its
    first model call that leaves at least `start` positions, for a prompt of `prompt_length` tokens
    of which the caches hold `cached`: chunks of `chunk` (its prefill_step_size) up to the
    prompt's last token, which goes alone in the first step, then a token a step."""
    last = prompt_length - 1
    if cached < last:
        end = cached + max(1, -(-(start - cached) // chunk)) * chunk  # the first chunk's end at or past start
        if end < last:
            return end
        if last >= start:
            return last
    return max(start, prompt_length)


def cache_leaves(caches):
    for c in caches:
        if isinstance(c, CacheList):
            yield from cache_leaves(c.caches)
        elif c is not None:
            yield c


class ModelCache:
    """All of a model's wrapped caches, and what a pass needs of them: the cached length, a
    snapshot before a pass, keeping the accepted rows after it, trimming to a shared prefix."""

    def __init__(self, model: nn.Module, stacks: list[KVStack] | None = None, row: int = 0):
        """stacks: one KVStack per layer cache when these are lane `row` of a batch (batch.py)."""
        self.family = model_family(model)
        self.tree_pass = attach_tree_pass(model)
        attention.install(model_modules(model))
        activations.install(model_modules(model))
        raw = make_prompt_cache(model)
        self.capture = plan(model, count(raw))  # None: recurrent layers are undone by snapshot only
        stacks = stacks or [None] * len(raw)
        self.layers = [wrap(c, self.tree_pass, self.family, self.capture, k, row) for c, k in zip(raw, stacks)]
        self._index()
        self.shared_layers = max(len(getattr(model, "layers", raw)) - len(raw), 0)
        self.length = 0  # tokens whose effect is in every cache
        self.in_pass = False  # a pass began and was not finished (interrupted)
        self.kv_quant: tuple[int, int, int] | None = None  # (bits, group size, start): set_kv_quantization
        self.quantize_at: int | None = None  # the length at which this request's caches turn quantized
        self.quantized_at = 0  # the length at which they did

    def _index(self) -> None:
        leaves = list(cache_leaves(self.layers))
        self.kv = [c for c in leaves if isinstance(c, TreeKVCache)]
        self.recurrent = [c for c in leaves if isinstance(c, RecurrentCache)]

    # K/V quantization, as mlx-lm's generate_step does it (kv_bits, kv_group_size, quantized_kv_start):
    # after each of its model calls, a cache holding at least `start` positions turns quantized, its
    # positions quantized then and every later one as it comes. Only the model's top-level
    # full-attention caches (mlx-lm's converts those with a to_quantized; a CacheList's stay as
    # they are). A call of the engine never spans the point where mlx-lm's turns quantized
    # (rows_before_quantizing), so every position sees the keys in the precision mlx-lm's did.
    def set_kv_quantization(self, bits: int | None, group_size: int = 64, start: int = 5000) -> None:
        want = None if bits is None else (int(bits), int(group_size), max(int(start), 0))
        if not any(type(c) in (TreeKVCache, QuantizedTreeKVCache) for c in self.layers):
            want = None  # nothing that mlx-lm would quantize (recurrent layers; CacheLists)
        if want != self.kv_quant and self.quantized and (want is None or want[:2] != self.kv_quant[:2]):
            self.trim(0)  # caches quantized otherwise than asked: start afresh
        self.kv_quant = want

    @property
    def quantized(self) -> bool:
        return any(isinstance(c, QuantizedTreeKVCache) for c in self.layers)

    def plan_quantization(self, prompt_length: int, chunk: int = 2048) -> None:
        """At the start of a request whose prompt the caches hold up to `self.length`: where the
        caches turn quantized (None: they are already, or never are)."""
        self.quantize_at = None
        if self.kv_quant is not None and not self.quantized:
            self.quantize_at = quantize_point(self.kv_quant[2], self.length, prompt_length, chunk)

    def rows_before_quantizing(self) -> int | None:
        """Positions a call may still add before the caches turn quantized (None: no such point)."""
        if self.quantize_at is None or self.quantized:
            return None
        return self.quantize_at - self.length

    def _maybe_quantize(self) -> None:
        if self.quantize_at is None or self.length < self.quantize_at or self.quantized:
            return
        bits, group_size, _ = self.kv_quant
        self.layers = [c.to_quantized(group_size, bits) if type(c) is TreeKVCache else c for c in self.layers]
        self._index()
        self.quantized_at = self.length

    def quantized_past(self, length: int) -> bool:
        """Whether the caches turned quantized after their first `length` positions (a pass kept
        tokens past what plain decoding fed: cutting back to it cannot undo the turn)."""
        return self.quantized and self.quantized_at > length

    def describe(self) -> dict[str, int]:
        """How many layer caches of each kind (for `doctor --model`)."""
        out: dict[str, int] = {}
        for c in cache_leaves(self.layers):
            name = f"{type(c).__name__}(window={c.window})" if isinstance(c, WindowKVCache) else type(c).__name__
            out[name] = out.get(name, 0) + 1
        if self.shared_layers:  # K/V shared with an earlier layer, or no attention at all
            out["layers without a cache of their own"] = self.shared_layers
        return out

    def arrays(self) -> list:
        out = [a for c in self.kv for _, a in tree_flatten((c.keys, c.values)) if a is not None]
        return out + [a for c in self.recurrent for a in c.cache if a is not None]

    def trim(self, length: int) -> int:
        """Keep the first `length` tokens if every cache can; else empty everything. Returns the
        length kept (a caller prefills from there)."""
        if self.in_pass:  # an interrupted pass may have moved the recurrent states: undo it
            for c in self.recurrent:
                c.restore()
            self.in_pass = False
        self._end_capture()
        length = min(length, self.length)
        if length < self.length and (self.recurrent or not all(c.can_trim_to(length) for c in self.kv)):
            length = 0
        if self.quantized and length < self.quantized_at:  # full precision there in a fresh request's caches
            length = 0
        for c in self.kv:
            c.clear() if length == 0 else c.trim_to(length)
        if length == 0:
            for c in self.recurrent:
                c.clear()
            if self.quantized:  # an empty cache is a fresh one, as a new generate_step's
                self.layers = [TreeKVCache(self.tree_pass) if isinstance(c, QuantizedTreeKVCache) else c
                               for c in self.layers]
                self._index()
        self.length = length
        return length

    def begin_pass(self) -> None:
        self.in_pass = True
        for c in self.kv:
            if isinstance(c, WindowKVCache):
                c.evict()
        for c in self.recurrent:
            c.snapshot()
        if self.capture is not None:
            self.capture.arm()

    def finish_pass(self, rows: list[int], whole: bool, committed: int | None = None) -> bool:
        """After a pass that wrote rows length.. of each cache, keep only `rows` (relative to the
        old length, compacted). With recurrent layers a pass accepted whole (`whole`: every row
        kept, no padding) stays; so does a prefix 0..m-1 of a pass that captured its rows' states
        (recurrent.py); otherwise everything is undone. Returns whether kept.
        committed: how many of the kept rows join the sequence (default all); the others stay
        stored past it (a draft tree kept in the cache, draft_model/runner.py)."""
        base = self.length
        self.in_pass = False
        if self.recurrent and not whole and not self._keep_prefix(rows, committed):
            for c in self.recurrent:
                c.restore()
            for c in self.kv:
                c.trim_to(base)
            self._end_capture()
            return False
        self._end_capture()
        n = len(rows)
        if rows != list(range(n)):
            src = mx.array([base + r for r in rows], dtype=mx.int32)
            dst = mx.arange(base, base + n, dtype=mx.int32)
            for c in self.kv:
                c.move_rows(src, dst)
        for c in self.kv:
            c.trim_to(base + n)
        self.length = base + (n if committed is None else committed)
        self._maybe_quantize()
        return True

    def _keep_prefix(self, rows: list[int], committed: int | None) -> bool:
        """Set every recurrent layer to its state after the pass's rows 0..m-1 when `rows` is that
        prefix, all joining the sequence, and the pass captured them (m = 0: the snapshot)."""
        m = len(rows)
        if self.capture is None or rows != list(range(m)) or committed not in (None, m):
            return False
        if m == 0:
            for c in self.recurrent:
                c.restore()
            return True
        if not all(c.can_keep(m) for c in self.recurrent):
            return False
        for c in self.recurrent:
            c.keep(m)
        return True

    def _end_capture(self) -> None:
        """Drop what the pass captured (held for the pass in flight only)."""
        if self.capture is not None:
            self.capture.stop()

    def take_length(self, length: int) -> None:
        """Its key/value layers now hold `length` positions, written into them from outside (a
        batch's lane given another lane's prefix, batch.Batch); only for key/value layers."""
        if self.recurrent:
            raise CachebackError("recurrent states cannot be copied between sequences")
        for c in self.kv:
            c.offset = length
        self.length = length
        self.in_pass = False

    def advance(self, n: int) -> None:
        """n tokens went in whole (a prefill)."""
        self.length += n
        self.in_pass = False
        self._end_capture()
        self._maybe_quantize()
