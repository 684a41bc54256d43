"""Cacheback drafter (../shared/seeds/cacheback.md): draft trees from LRU leader->follower tables.

A dynamic table learns every (leader, follower) window of the prompt and of the accepted tokens;
an optional frozen table, built offline from a corpus, adds common followers. The tree grows
breadth-first: the root's followers come from querying with the last LL tokens of the history,
then each follower's end is queried with the last LL tokens of history + its root-to-node path,
and so on, until the token budget is spent or no leaf has followers. CRT tokens of the budget are
held back from the first level so that chaining can happen at all.

Differences from the reference code, on purpose (MAT on the 64 recorded streams, replay.py):
- Followers are merged into a trie (no duplicate siblings), so the budget goes further.
- "Dynamic first, then frozen" is applied to the whole tree, not per node: the dynamic tree is
  grown to exhaustion first (the CRT reserve applies here), and frozen followers fill only the
  budget it leaves (again breadth-first from the root, merging into the dynamic nodes). Dynamic
  followers are far more precise than corpus followers, so they get the budget first at every
  depth; per node, the frozen followers of the root would otherwise crowd out the dynamic chains
  below it (MAT 2.54 -> 2.67 on the recorded streams).
- Budgets smaller than TDL-1 (the engine's CPU budget is ~7 tokens) scale the reserve down in
  proportion, and the first level always keeps at least half the budget.
Nodes are returned in BFS order (by depth; dynamic nodes before frozen ones at equal depth).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from ..tree import DraftTree
from .base import Drafter
from .lru_table import FrozenTable, LruTable

DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "data" / "frozen_smollm2_ll1_fl3.npz"

Lookup = Callable[[tuple], list]


@lru_cache(maxsize=1)
def default_table() -> FrozenTable:
    """The shipped table, loaded once per process (it is read-only, so drafters share it).

    It is shipped in the package rather than built on first use: 2.3 MB, and building it needs
    the default model's tokenizer (a model download) and ~30 s of CPU. Its corpus is the CPython
    3.11 standard library sources (580 files, 11 MB, 3.1M tokens) and the default model's own
    answers (tools/self_corpus.py; tools/build_default_table.py rebuilds it byte for byte), never
    the benchmark streams in ../shared/data (the test set)."""
    return FrozenTable.load(DEFAULT_TABLE)


class CachebackDrafter(Drafter):
    name = "cacheback"

    def __init__(self, ll: int = 1, fl: int = 3, lc: int = 1 << 20, fc: int = 128, tdl: int = 96,
                 crt: int = 16, frozen: str | Path | FrozenTable | bool | None = None,
                 fingerprint: str | None = None, dynamic: bool = True):
        """frozen: a table path or object; None = the shipped default when its LL/FL and tokenizer
        match; False = dynamic table only. dynamic=False leaves only the frozen table (ablations).
        fingerprint: the tokenizer's, checked against the table's."""
        if tdl < 2 or crt < 0:
            raise ValueError("need tdl >= 2 and crt >= 0")
        self.ll, self.fl, self.tdl, self.crt, self.fc = ll, fl, tdl, crt, fc
        self.use_dynamic = dynamic
        self.dynamic = LruTable(ll, fl, lc, fc)
        self.frozen = self._frozen_table(frozen, fingerprint)
        if self.frozen is not None and (self.frozen.ll, self.frozen.fl) != (ll, fl):
            raise ValueError(f"frozen table has LL={self.frozen.ll}, FL={self.frozen.fl}; drafter has {ll}, {fl}")
        self._tail: list[int] = []

    def _frozen_table(self, frozen, fingerprint) -> FrozenTable | None:
        if frozen is False:
            return None
        if isinstance(frozen, FrozenTable):
            return frozen
        if frozen is None:  # the shipped table, when it fits this tokenizer and LL/FL
            if not (DEFAULT_TABLE.is_file() and (self.ll, self.fl) == (1, 3)):
                return None
            table = default_table()
            return table if fingerprint in (None, table.fingerprint) else None
        return FrozenTable.load(frozen, fingerprint)

    def reset(self) -> None:
        self.dynamic.clear()
        self._tail = []

    def observe(self, tokens: Sequence[int]) -> None:
        """Insert every leader-follower window that ends in the new tokens, oldest first; the last
        LL+FL-1 tokens are kept so that windows span observe calls."""
        seq = self._tail + [int(t) for t in tokens]
        self._insert(seq)
        self._tail = seq[max(0, len(seq) - (self.ll + self.fl - 1)):]

    def learn(self, tokens: Sequence[int]) -> None:
        """Text beside the sequence: its windows go into the dynamic table, the tail stays."""
        self._insert([int(t) for t in tokens])

    def _insert(self, seq: list[int]) -> None:
        ll, span = self.ll, self.ll + self.fl
        put = self.dynamic.put
        for i in range(len(seq) - span + 1):
            put(tuple(seq[i : i + ll]), tuple(seq[i + ll : i + span]))

    def _frozen_followers(self, leader: tuple) -> list:
        return self.frozen.get(leader)[: self.fc]

    def followers(self, leader: tuple, limit: int) -> list[tuple[str, list]]:
        """The followers of `leader` (LL tokens) in each table this drafter uses, as
        ("dynamic", followers) then ("frozen", followers): at most `limit` per table, in each
        table's order (dynamic: most recently inserted first; frozen: most frequent first). A
        table not in use is left out; a leader a table lacks gives it an empty list. Looking a
        leader up refreshes it in the dynamic table (LruTable.get)."""
        out: list[tuple[str, list]] = []
        if self.use_dynamic:
            out.append(("dynamic", self.dynamic.get(leader, limit)))
        if self.frozen is not None:
            out.append(("frozen", self.frozen.get(leader)[:limit]))
        return out

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        budget = min(budget, self.tdl - 1)  # TDL counts the uncached root token too
        if budget <= 0 or len(history) < self.ll:
            return DraftTree.empty()
        reserve = min(self.crt, budget * self.crt // (self.tdl - 1), budget // 2)
        trie = DraftTrie(history[len(history) - self.ll:])
        if max_branching == 1:  # one path: the dynamic table's first followers, then the frozen one's
            lookups = [self.dynamic.get] if self.use_dynamic else []
            for lookup in lookups + ([self._frozen_followers] if self.frozen is not None else []):
                trie.grow_chain(lookup, budget)
            return trie.to_tree()
        if self.use_dynamic:
            trie.grow(self.dynamic.get, budget - reserve, budget)
        if self.frozen is not None:
            trie.grow(self._frozen_followers, budget, budget)
        return trie.to_tree()


class DraftTrie:
    """A draft tree under construction: followers are merged into it as token paths."""

    def __init__(self, base: Sequence[int]):
        self.base = list(base)  # the last LL history tokens (the root is base[-1])
        self.ll = len(self.base)
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = [0]  # depth[node + 1]; the root (-1) has depth 0
        self.child: dict[int, int] = {}  # (parent node + 1) << 32 | token -> child node

    def leader(self, node: int) -> tuple:
        """The last LL tokens of history + the root-to-node path."""
        if self.ll == 1:  # the common case, kept cheap
            return (self.tokens[node],) if node >= 0 else (self.base[0],)
        out: list[int] = []
        tokens, parents = self.tokens, self.parents
        while node >= 0 and len(out) < self.ll:
            out.append(tokens[node])
            node = parents[node]
        out.reverse()
        if len(out) < self.ll:
            out = self.base[len(self.base) - (self.ll - len(out)):] + out
        return tuple(out)

    def add(self, node: int, follower: Sequence[int], limit: int) -> int | None:
        """Merge `follower` below `node`; its end node, or None if the node limit cut it short
        (the tokens that fit stay: a partial follower can still be accepted)."""
        child_of, tokens, depth = self.child, self.tokens, self.depth
        for t in follower:
            key = (node + 1) << 32 | t
            child = child_of.get(key)
            if child is None:
                child = len(tokens)
                if child >= limit:
                    return None
                child_of[key] = child
                tokens.append(t)
                self.parents.append(node)
                depth.append(depth[node + 1] + 1)
            node = child
        return node

    def grow(self, lookup: Lookup, first_limit: int, limit: int) -> None:
        """Breadth-first from the root: query each frontier node, merge its followers; the first
        level may use at most `first_limit` nodes, the tree at most `limit`."""
        frontier = [-1]
        level_limit = first_limit
        while frontier and len(self.tokens) < limit:
            ends: dict[int, None] = {}
            for node in frontier:
                for follower in lookup(self.leader(node)):
                    end = self.add(node, follower, level_limit)
                    if end is None:
                        break
                    ends[end] = None
                if len(self.tokens) >= level_limit:
                    break
            frontier = list(ends)
            level_limit = limit

    def grow_chain(self, lookup: Lookup, limit: int) -> None:
        """Extend the deepest path by each end node's first follower, up to `limit` nodes."""
        node = len(self.tokens) - 1
        while len(self.tokens) < limit:
            followers = lookup(self.leader(node))
            end = self.add(node, followers[0], limit) if followers else None
            if end is None or end == node:
                return
            node = end

    def to_tree(self) -> DraftTree:
        """BFS order (stable by depth), parents remapped; parents still precede children."""
        depth = self.depth[1:]
        order = sorted(range(len(self.tokens)), key=depth.__getitem__)
        new_index = [0] * len(order)
        for new, old in enumerate(order):
            new_index[old] = new
        parents = self.parents
        return DraftTree([self.tokens[i] for i in order],
                         [-1 if parents[i] < 0 else new_index[parents[i]] for i in order])
