"""Cacheback drafter (../shared/seeds/cacheback.md): draft trees from LRU leader->follower tables.

A dynamic table learns every (leader, follower) window of the prompt and of the accepted tokens;
an optional frozen table, built offline from a corpus, adds common followers. The tree grows
breadth-first: the root's followers come from querying with the last LL tokens of the history,
then each follower's end is queried with the last LL tokens of its root-to-node path, and so on,
dynamic table first, then the frozen table, until the token budget is spent or nothing matches.
CRT tokens of the budget are held back from the first level so that chaining can happen at all.
Followers are merged into a trie (no duplicate siblings), which makes the budget go further than
the reference code's flat lists. Nodes are returned in BFS order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..tree import DraftTree
from .base import Drafter
from .lru_table import FrozenTable, LruTable

DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "data" / "frozen_smollm2_ll1_fl3.npz"


class CachebackDrafter(Drafter):
    name = "cacheback"

    def __init__(self, ll: int = 1, fl: int = 3, lc: int = 1 << 20, fc: int = 128, tdl: int = 96,
                 crt: int = 16, frozen: str | Path | FrozenTable | bool | None = None,
                 fingerprint: str | None = None, dynamic: bool = True):
        """frozen: a table path or object; None = the shipped default when its LL/FL match;
        False = dynamic table only. dynamic=False leaves only the frozen table (for ablations).
        fingerprint: the tokenizer's, checked against the table's."""
        if not 0 <= crt < tdl:
            raise ValueError("need 0 <= crt < tdl")
        self.ll, self.fl, self.tdl, self.crt = ll, fl, tdl, crt
        self.use_dynamic = dynamic
        self.dynamic = LruTable(ll, fl, lc, fc)
        self.fc = fc
        self.frozen = self._frozen_table(frozen, fingerprint)
        if self.frozen is not None and (self.frozen.ll, self.frozen.fl) != (ll, fl):
            raise ValueError(f"frozen table has LL={self.frozen.ll}, FL={self.frozen.fl}; drafter has {ll}, {fl}")
        self._tail: list[int] = []

    def _frozen_table(self, frozen, fingerprint):
        if frozen is False:
            return None
        if isinstance(frozen, FrozenTable):
            return frozen
        if frozen is None:  # the shipped table, when it fits this tokenizer and LL/FL
            if not (DEFAULT_TABLE.is_file() and (self.ll, self.fl) == (1, 3)):
                return None
            table = FrozenTable.load(DEFAULT_TABLE)
            return table if fingerprint in (None, table.fingerprint) else None
        return FrozenTable.load(frozen, fingerprint)

    def reset(self) -> None:
        self.dynamic.clear()
        self._tail = []

    def observe(self, tokens: Sequence[int]) -> None:
        """Insert every leader-follower window that ends in the new tokens, oldest first."""
        span = self.ll + self.fl
        seq = self._tail + [int(t) for t in tokens]
        put = self.dynamic.put
        for i in range(len(seq) - span + 1):
            put(tuple(seq[i : i + self.ll]), tuple(seq[i + self.ll : i + span]))
        self._tail = seq[-(span - 1):] if span > 1 else []

    def _followers(self, leader: tuple[int, ...]):
        if self.use_dynamic:
            yield from self.dynamic.get(leader)
        if self.frozen is not None:
            yield from self.frozen.get(leader)[: self.fc]

    def propose(self, history: Sequence[int], budget: int) -> DraftTree:
        budget = min(budget, self.tdl - 1)  # TDL counts the uncached root token too
        if budget <= 0 or len(history) < self.ll:
            return DraftTree.empty()
        # the reserve scales down with small budgets (on the CPU a pass holds ~10 tokens)
        reserve = min(self.crt, budget * self.crt // (self.tdl - 1))
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        base = list(history[-self.ll:])
        frontier = [-1]  # nodes to expand, in BFS order; -1 is the root
        limit = budget - reserve
        while frontier and len(tokens) < budget:
            next_frontier = []
            for node in frontier:
                path = self._path_tail(node, tokens, parents, base)
                for follower in self._followers(path):
                    end = node
                    for t in follower:
                        child = children.get((end, t))
                        if child is None:
                            if len(tokens) >= limit:
                                break
                            child = len(tokens)
                            children[(end, t)] = child
                            tokens.append(t)
                            parents.append(end)
                            depth.append(1 if end < 0 else depth[end] + 1)
                        end = child
                    else:
                        next_frontier.append(end)
                        continue
                    break  # the budget ran out inside this follower
                if len(tokens) >= limit:
                    break
            frontier = list(dict.fromkeys(n for n in next_frontier if n >= 0))
            limit = budget
        return _bfs_order(tokens, parents, depth)

    def _path_tail(self, node: int, tokens: list[int], parents: list[int], base: list[int]) -> tuple[int, ...]:
        """The last LL tokens of history + the root-to-node path."""
        out: list[int] = []
        while node >= 0 and len(out) < self.ll:
            out.append(tokens[node])
            node = parents[node]
        out.reverse()
        if len(out) < self.ll:
            out = base[len(base) - (self.ll - len(out)):] + out
        return tuple(out)


def _bfs_order(tokens: list[int], parents: list[int], depth: list[int]) -> DraftTree:
    """Reorder nodes by depth (stable), remapping parents; parents still precede children."""
    order = sorted(range(len(tokens)), key=lambda i: depth[i])
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order],
                     [-1 if parents[i] < 0 else new_index[parents[i]] for i in order])
