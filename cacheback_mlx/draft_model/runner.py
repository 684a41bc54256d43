"""CARD's draft side: a draft model that grows the token tree (drafters/card_tree.TokenTree).

load_draft() turns the `draft` parameter into a model: "self:N" is the target's own first N layers
with its final norm and LM head (the same weight arrays, no second download); anything else is a
model the loader takes, whose tokenizer must match the target's (vocabulary fingerprint).

DraftRunner grows the tree one layer per forward pass with the engine's own tree machinery: a
node sees the verified sequence and its own ancestors only (kvcache.pass_mask), at position
root + depth (positions.TreeRoPE). Two ways to run a layer:

- kept (draft models whose layer caches are all plain KV caches): the nodes' K/V stay in the caches
  past the verified tokens, so a layer feeds only the new frontier (at most `paths` rows); each row
  sees its ancestors' slots (TreePass.tail). A correction moves the accepted path into the
  verified part and keeps the surviving subtree's slots (ModelCache.finish_pass(committed=...));
  each computed node's top-k is kept too, so a re-rooted tree grows on without a pass.
- recomputed (sliding windows, shared K/V, recurrent layers, position-dependent code): a layer
  passes the root and the whole tree (verify.verify_pass) and is rolled back, so the caches only
  hold verified tokens. A draft model that cannot run trees (recurrent layers, position-dependent
  code) grows a chain.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafters.card_tree import TokenTree
from ..errors import CachebackError
from ..kvcache import ModelCache, TreeKVCache
from ..positions import attach_tree_pass, prepare_positions
from ..tree import DraftTree, common_prefix
from ..verify import prefill, verify_pass


def parse_self(draft: str) -> int | None:
    """N for "self:N" (None for any other draft spec); a bad N is a one-line error."""
    if not draft.startswith("self:"):
        return None
    n = draft[len("self:"):]
    if not n.lstrip("-").isdigit():
        raise CachebackError(f"draft={draft!r}: write self:N with N a number of layers, e.g. self:4")
    return int(n)


def first_layers(model: nn.Module, n: int) -> nn.Module:
    """The model cut to its first n layers, keeping its embeddings, final norm and LM head: a view
    that shares every weight array with `model` (and its TreePass, as they share RoPE modules)."""
    layers = model.layers
    if not 1 <= n <= len(layers):
        raise CachebackError(f"draft=self:{n}: the target has {len(layers)} layers (choose N from 1 to {len(layers)})")
    owner = next((p for p, m in model.named_modules() if isinstance(m.get("layers"), list)
                  and len(m["layers"]) == len(layers) and all(a is b for a, b in zip(m["layers"], layers))), None)
    if owner is None:
        raise CachebackError(f"draft=self:{n}: cannot find the layers of {type(model).__module__}")
    attach_tree_pass(model)  # before copying, so the view shares it (the layers' RoPE points to it)
    view = copy.copy(model)
    node = view
    for name in [p for p in owner.split(".") if p]:
        child = copy.copy(node[name])
        node[name] = child
        node = child
    node["layers"] = list(node["layers"][:n])
    for m in {id(view): view, id(node): node}.values():  # make_cache() may count layers from args
        args = getattr(m, "args", None)
        if dataclasses.is_dataclass(args) and hasattr(args, "num_hidden_layers"):
            object.__setattr__(m, "args", dataclasses.replace(args, num_hidden_layers=n))
    try:  # a family whose forward pass cannot run cut (e.g. it indexes a layer past the cut) fails here
        prefill(view, ModelCache(view), [0, 0])
    except CachebackError:
        raise
    except Exception as e:  # a family whose structure the cut breaks
        raise CachebackError(f"draft=self:{n} does not work for {type(model).__module__}: {e}") from None
    return view


def load_draft(draft, target=None, dtype: str | None = None, fingerprint: str | None = None) -> nn.Module:
    """The draft model for `draft`: "self:N" (target's first N layers; target is a LoadedModel or a
    model spec for loader.load), a model spec, or a LoadedModel. A draft whose tokenizer differs from
    the target's (fingerprint) is refused."""
    from ..loader import LoadedModel, load
    from ..tokenizer import vocab_fingerprint

    if isinstance(draft, str):
        n = parse_self(draft)
        if n is not None:
            if target is None:
                raise CachebackError("draft=self:N needs the target model (set by the session)")
            base = target if isinstance(target, LoadedModel) else load(target, dtype=dtype)
            return first_layers(base.model, n)
        draft = load(draft, dtype=dtype)
    if not isinstance(draft, LoadedModel):
        raise CachebackError(f"draft must be a model spec or self:N, got {type(draft).__name__}")
    if fingerprint is not None and draft.tokenizer is not None and vocab_fingerprint(draft.tokenizer) != fingerprint:
        raise CachebackError(f"draft model {draft.name!r} has another tokenizer than the target "
                             f"(vocabulary {vocab_fingerprint(draft.tokenizer)} != {fingerprint}); "
                             "CARD needs the same vocabulary")
    return draft.model


def top_k(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k likeliest tokens of each row, likeliest first, and their probabilities."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    k = min(k, probs.shape[-1])
    ids = mx.argpartition(-probs, k - 1, axis=-1)[:, :k]
    p = mx.take_along_axis(probs, ids, axis=-1)
    order = mx.argsort(-p, axis=-1)
    ids, p = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(p, order, axis=-1)
    return np.array(ids), np.array(p)


class DraftRunner:
    """A draft model, its caches at the verified sequence, and the tree it grows."""

    def __init__(self, model: nn.Module, paths: int = 4, top_k: int = 4, depth: int = 10, nodes: int = 40,
                 min_score: float = 0.0, keep_tree: bool = True):
        self.model = model
        self.cache = ModelCache(model)
        unplaced = prepare_positions(model)
        self.chain = bool(self.cache.recurrent or unplaced)  # trees would be wrong there: grow a chain
        self.kept = keep_tree and not self.chain and not self.cache.shared_layers and bool(self.cache.kv) \
            and all(type(c) is TreeKVCache for c in self.cache.kv)
        self.tree = (TokenTree(1, 1, depth, min(nodes, depth), min_score) if self.chain
                     else TokenTree(paths, top_k, depth, nodes, min_score))
        self.seq: list[int] = []  # the verified sequence; seq[-1] is the tree's root
        self.cached: list[int] = []  # verified tokens in the caches
        self.slots: dict[int, int] = {}  # kept: node -> its slot past the verified tokens
        self.offers: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # kept: node (-1: root) -> top-k
        self.passes = 0  # draft forward passes
        self.hits = self.misses = 0  # corrections whose accepted path was in the tree, or not

    def sync(self, keep: int, tail: Sequence[int]) -> None:
        """The verified sequence is now seq[:keep] + tail: re-root the tree (a correction), or
        clear it when the sequence was cut (a new prompt)."""
        tail = [int(t) for t in tail]
        if keep < len(self.seq) or not self.seq:
            self._drop_tree()
        elif tail:
            hit = self._correct(tail) if self.kept else self.tree.advance(tail) is not None
            self.hits += hit
            self.misses += not hit
        self.seq = self.seq[:keep] + tail

    def expand(self) -> bool:
        """Grow the tree by one layer; False when there is nothing to grow."""
        if not self.seq or self.tree.full():
            return False
        if not self.kept:
            return self._expand_recomputed()
        self._catch_up()
        frontier = list(self.tree.frontier)
        need = [f for f in frontier if f not in self.offers]
        if need:
            self._feed(need)
        self.tree.grow(frontier, np.stack([self.offers[f][0] for f in frontier]),
                       np.stack([self.offers[f][1] for f in frontier]))
        return True

    # --- recomputed: the whole tree each layer ----------------------------------------------

    def _expand_recomputed(self) -> bool:
        keep = self.cache.trim(common_prefix(self.cached, self.seq[:-1]))
        prefill(self.model, self.cache, self.seq[keep:-1])
        self.cached = self.seq[:-1]
        frontier = list(self.tree.frontier)
        logits = verify_pass(self.model, self.cache, [self.seq[-1]], self.tree.as_draft_tree())
        rows = mx.array([f + 1 for f in frontier])
        ids, probs = top_k(logits[rows], self.tree.top_k)
        self.cache.finish_pass([], whole=False)  # the caches keep the verified sequence only
        self.tree.grow(frontier, ids, probs)
        self.passes += 1
        return True

    # --- kept: nodes stay in the caches -----------------------------------------------------

    def _drop_tree(self) -> None:
        self.tree.clear()
        if self.slots:
            self.cache.trim(self.cache.length)  # cut the tree's slots
        self.slots, self.offers = {}, {}

    def _correct(self, tail: list[int]) -> bool:
        """Accepted `tail`: the computed part of its path joins the verified tokens, the computed
        part of the subtree below it keeps its slots (compacted). Returns whether it was a hit."""
        path = self.tree.path(tail)
        if path is None:
            self._drop_tree()
            return False
        done = [n for n in path if n in self.slots]  # a node with children was computed: a prefix
        kept = self.tree.advance(tail)
        computed = [(new, old) for new, old in enumerate(kept) if old in self.slots]
        rows = [self.slots[n] for n in done] + [self.slots[old] for _, old in computed]
        self.cache.finish_pass(rows, whole=True, committed=len(done))
        self.cached = self.cached + tail[: len(done)]
        offers = {new: self.offers[old] for new, old in computed}
        if path[-1] in self.offers:
            offers[-1] = self.offers[path[-1]]
        self.offers = offers
        self.slots = {new: j for j, (new, _) in enumerate(computed)}
        return True

    def _catch_up(self) -> None:
        """Put the verified tokens into the caches and get the root's top-k."""
        c = common_prefix(self.cached, self.seq)
        if -1 not in self.offers:
            c = min(c, len(self.seq) - 1)
        if c < len(self.cached):
            self._drop_tree()
            c = self.cache.trim(c)
            self.cached = self.cached[:c]
        if len(self.cached) < len(self.seq):
            prefill(self.model, self.cache, self.seq[len(self.cached):-1])
            logits = verify_pass(self.model, self.cache, [self.seq[-1]], DraftTree.empty())
            self.cache.finish_pass([0], whole=True)
            self.cached = list(self.seq)
            ids, probs = top_k(logits, self.tree.top_k)
            self.offers[-1] = (ids[0], probs[0])
            self.passes += 1

    def _feed(self, need: list[int]) -> None:
        """One pass over the frontier nodes `need`: each sees the verified tokens and its ancestors'
        slots, at position root + depth; their K/V stay in the caches."""
        t = self.cache.kv[0].offset - self.cache.length  # slots in use
        rel = np.array([self.tree.depths[f] - 1 - t for f in need], np.int32)
        tail = np.zeros((len(need), t), bool)
        for r, f in enumerate(need):
            for a in self.tree.ancestors(f):
                tail[r, self.slots[a]] = True
        tp = self.cache.tree_pass
        tp.set(mx.array(rel), mx.eye(len(need), dtype=mx.bool_), mx.array(tail) if t else None)
        try:
            logits = self.model(mx.array([[self.tree.tokens[f] for f in need]], dtype=mx.int32),
                                cache=self.cache.layers)
        finally:
            tp.clear()
        ids, probs = top_k(logits[0], self.tree.top_k)
        for r, f in enumerate(need):
            self.slots[f] = t + r
            self.offers[f] = (ids[r], probs[r])
        self.passes += 1
