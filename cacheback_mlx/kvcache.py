"""KV cache for speculative steps: mlx-lm's KVCache, a tree mask hook, rollback by length counter.

Rejected drafts are dropped by moving the cache's offset back; nothing is zeroed, since the next
pass overwrites those slots. For a tree, the accepted path's K/V rows are first copied into
contiguous slots right after the cached prefix.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


class TreePass:
    """Per-pass tree layout shared by a model's RoPE wrappers and its caches (None = plain pass)."""

    def __init__(self):
        self.depths: mx.array | None = None  # [T] int32, position = cache offset + depth
        self.mask: mx.array | None = None  # [T, offset + T] bool, True = may attend


class TreeKVCache(KVCache):
    """A KVCache whose attention mask comes from the current TreePass when one is set."""

    def __init__(self, tree_pass: TreePass):
        super().__init__()
        self.tree_pass = tree_pass

    def make_mask(self, *args, **kwargs):
        if self.tree_pass.mask is not None:
            return self.tree_pass.mask
        return super().make_mask(*args, **kwargs)


class TreeRoPE(nn.Module):
    """Wraps a model's RoPE so each tree token gets its own position (cache offset + depth).

    mx.fast.rope takes one offset per batch row, so the T tokens of a pass are laid out as T rows
    of one token each: [1, H, T, D] -> [T, H, 1, D] -> rope with offsets -> back.
    """

    def __init__(self, inner: nn.Module, tree_pass: TreePass):
        super().__init__()
        self.inner = inner
        self.tree_pass = tree_pass

    def __call__(self, x, offset=0):
        depths = self.tree_pass.depths
        if depths is None:
            return self.inner(x, offset=offset)
        rows = x.transpose(2, 1, 0, 3)
        return self.inner(rows, offset=offset + depths).transpose(2, 1, 0, 3)


def attach_tree_pass(model: nn.Module) -> TreePass:
    """Install TreeRoPE on every attention layer of an mlx-lm model (once) and return its TreePass."""
    existing = getattr(model, "_cacheback_tree_pass", None)
    if existing is not None:
        return existing
    tree_pass = TreePass()
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        if attn is None or not hasattr(attn, "rope"):
            raise ValueError(f"{type(model).__module__}: attention layer without a rope module")
        attn.rope = TreeRoPE(attn.rope, tree_pass)
    object.__setattr__(model, "_cacheback_tree_pass", tree_pass)
    return tree_pass


def make_caches(model: nn.Module) -> list[TreeKVCache]:
    tree_pass = attach_tree_pass(model)
    return [TreeKVCache(tree_pass) for _ in model.layers]


def trim_to(caches: list[TreeKVCache], length: int) -> None:
    """Drop everything after the first `length` cached tokens."""
    for c in caches:
        c.offset = min(c.offset, length)


def keep_rows(caches: list[TreeKVCache], base: int, rows: list[int]) -> None:
    """After a pass that wrote rows base.. of each cache, keep only `rows` (relative to base),
    compacted into base, base+1, ...; the rest are rolled back."""
    n = len(rows)
    if rows != list(range(n)):
        src = mx.array([base + r for r in rows], dtype=mx.int32)
        dst = mx.arange(base, base + n, dtype=mx.int32)
        for c in caches:
            c.keys[..., dst, :] = c.keys[..., src, :]
            c.values[..., dst, :] = c.values[..., src, :]
    trim_to(caches, base + n)
