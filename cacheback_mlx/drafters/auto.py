"""auto: every drafting source merged into ONE scored tree, the best nodes first (the default).

Sources, each a way to guess what follows the history:
- own: the request's own history (prompt and output so far): the continuations of the longest
  contexts (up to 8 tokens) seen earlier, as prompt lookup does;
- ssd: the cross-request buffer of everything served before (SsdDrafter's store and suffix index);
- dyn / frz: Cacheback's dynamic LRU table and the frozen corpus table (leader -> followers);
- rest: a REST datastore, when one is given.
Their candidates are merged into one trie (a token proposed by several sources is one node that
carries all their evidence). Each node gets an estimate of P(accepted | parent accepted) from its
features (scorer.Scorer, learned online from every pass), and its path probability is the product
down from the root. The tables are queried best-first: the most probable node not yet expanded
is looked up next, so the lookups go where acceptance is likely. The tree sent is the `budget`
nodes with the highest path probability, best first, with their scores: the engine sizes the pass
from them (budget.py), down to no draft at all when nothing is likely.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Sequence

import numpy as np

from ..tree import DraftTree
from .base import Drafter
from .cacheback import CachebackDrafter
from .scorer import Scorer
from .ssd import SsdDrafter

MAX_K = 8  # longest own-history context matched
OWN_CONTS = 6  # own-history continuations per step
LENGTH = 12  # tokens per retrieved continuation
MAX_COUNT = 32  # occurrences sampled per retrieval
TABLE_FOLLOWERS = 16  # followers per table lookup and table, at most (fewer for small budgets)
WINDOW = 8192  # own-history tokens indexed (older ones fall out)
GAP = -1  # separates learned text from the history in the own-history index (never a token)

# Starting logits (a fresh drafter has seen no pass yet); learning moves them within a few steps.
PRIOR = {("own", 1): 0.0, ("own", 2): 0.6, ("own", 3): 1.0, ("own", 4): 1.4, ("ssd", 1): 0.0,
         ("ssd", 2): 0.4, ("ssd", 3): 0.8, ("ssd", 4): 1.2, ("dyn", 0): 0.6, ("dyn", 1): 0.0,
         ("frz", 0): 0.2, ("agree", 2): 0.5, ("agree", 3): 0.8}


def _bucket(n: int) -> int:
    return n if n < 4 else 4 if n < 6 else 6 if n < 10 else 10


def _frac(part: int, whole: int) -> int:
    """How many of the parent's continuations go through this node: all, most, some, few."""
    return 3 if part >= whole else 2 if 2 * part >= whole else 1 if 4 * part >= whole else 0


class _Trie:
    """Candidates of one step. Node i: tokens[i], parents[i] (-1 = root's child), depth[i]; per
    source the strongest evidence for the node and the number of continuations through it."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.child: dict[int, int] = {}  # (parent + 1) << 32 | token -> node
        self.ev: list[dict] = []  # per node: source -> (match length or rank, position in path)
        self.p: list[float | None] = []  # per node: P(accepted | parent accepted); None = to score
        self.count: dict[str, list[int]] = {}  # source -> continuations through each node (index + 1)

    def add(self, parent: int, tokens: Sequence[int], source: str, strength: int, weight: int = 1) -> None:
        node = parent
        counts = self.count.setdefault(source, [])
        for j, t in enumerate(tokens):
            key = (node + 1) << 32 | t
            nxt = self.child.get(key)
            if nxt is None:
                nxt = self.child[key] = len(self.tokens)
                self.tokens.append(t)
                self.parents.append(node)
                self.depth.append(1 if node < 0 else self.depth[node] + 1)
                self.ev.append({})
                self.p.append(None)
            ev = self.ev[nxt]
            old = ev.get(source)
            if old is None or strength > old[0]:
                ev[source] = (strength, j)
                self.p[nxt] = None
            if len(counts) <= nxt + 1:
                counts.extend([0] * (nxt + 2 - len(counts)))
            counts[nxt + 1] += weight
            node = nxt
        if counts:
            counts[0] += weight if parent < 0 else 0

    def features(self, i: int) -> list:
        """The node's features for the scorer (what each source says about it, and the depth)."""
        ev, p = self.ev[i], self.parents[i]
        feats: list = [("depth", min(self.depth[i], 6))]
        for source, (strength, j) in ev.items():
            feats.append((source, _bucket(strength) if source in ("own", "ssd", "rest") else min(strength, 3)))
            feats.append((source + "@", min(j, 3)))
            counts = self.count.get(source)
            if counts is not None and source in ("own", "ssd", "rest"):
                whole = counts[p + 1] if p + 1 < len(counts) else 0
                if whole:
                    feats.append((source + "%", _frac(counts[i + 1], whole)))
        if len(ev) > 1:
            feats.append(("agree", min(len(ev), 3)))
        return feats


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(self, ssd: bool = True, ssd_path: str | Path | None = None, persist: bool = True,
                 frozen: str | Path | bool | None = None, fingerprint: str | None = None,
                 datastore: str | Path | None = None, max_expand: int = 24, ssd_capacity: int = 4_000_000):
        """ssd=False leaves out the cross-request buffer (ssd_path / persist / ssd_capacity are
        SsdDrafter's path / persist / capacity);
        frozen / fingerprint are CachebackDrafter's; datastore: a REST datastore folder."""
        self.tables = CachebackDrafter(frozen=frozen, fingerprint=fingerprint)
        self.ssd = SsdDrafter(path=ssd_path, persist=persist, fingerprint=fingerprint,
                              capacity=ssd_capacity) if ssd else None
        self.rest = None
        if datastore is not None:
            from .rest import RestDrafter

            self.rest = RestDrafter(datastore, fingerprint=fingerprint)
        self.max_expand = max_expand
        self.scorer = Scorer(PRIOR)
        self._last: tuple | None = None  # the last step's candidates, labelled by the next observe
        self.labelled = 0
        self.reset()

    # -- state ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.tables.reset()
        if self.ssd is not None:
            self.ssd.reset()
        self.seq: list[int] = []
        self.pos: list[dict[tuple, list[int]]] = [{} for _ in range(MAX_K + 1)]
        self._last = None

    def observe(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if self._last is not None:  # the tokens the model produced after the last proposal
            self.labelled += self.scorer.learn_trie(*self._last, tokens)
            self._last = None
        self.tables.observe(tokens)
        if self.ssd is not None:
            self.ssd.observe(tokens)
        self._index(tokens)

    def learn(self, tokens: Sequence[int]) -> None:
        """Text beside the sequence (an editor's code below the cursor): the tables learn it, and
        the own-history index too, between separators so no continuation runs into or out of it."""
        self.tables.learn(tokens)
        self._index([GAP] + [int(t) for t in tokens] + [GAP])

    def end_request(self) -> None:
        self._last = None
        if self.ssd is not None:
            self.ssd.end_request()

    def stats(self) -> dict:
        return {"labelled_nodes": self.labelled}

    def _index(self, tokens: list[int]) -> None:
        """Index every context of 1..MAX_K tokens that now has a known next token."""
        seq = self.seq
        if len(seq) + len(tokens) > 2 * WINDOW:  # keep the last WINDOW tokens, re-indexed
            keep = (seq + tokens)[-WINDOW:]
            self.seq, self.pos = [], [{} for _ in range(MAX_K + 1)]
            self._index(keep)
            return
        pos = self.pos
        for t in tokens:
            i = len(seq)  # t's position: contexts ending just before it now have a continuation
            for k in range(1, min(MAX_K, i) + 1):
                hits = pos[k].setdefault(tuple(seq[i - k : i]), [])
                hits.append(i)
                if len(hits) > 4:
                    del hits[0]
            seq.append(t)

    # -- drafting -------------------------------------------------------------------------
    def _own(self, trie: _Trie, history: Sequence[int]) -> None:
        seq, taken = self.seq, set()
        for k in range(min(MAX_K, len(history)), 0, -1):
            for i in reversed(self.pos[k].get(tuple(history[len(history) - k:]), ())):
                if i not in taken and len(taken) < OWN_CONTS:
                    taken.add(i)
                    cont = seq[i : i + self._length]
                    if GAP in cont:
                        cont = cont[: cont.index(GAP)]
                    trie.add(-1, cont, "own", k)
            if len(taken) >= OWN_CONTS:
                return

    def _retrieved(self, trie: _Trie, history: Sequence[int], index, source: str) -> None:
        if index is None:
            return
        n, lo, hi = index.longest_match(history, 16)
        if not n:
            return
        grouped: dict[tuple, int] = {}
        for cont in index.continuations(lo, hi, self._length, MAX_COUNT):
            grouped[cont] = grouped.get(cont, 0) + 1
        for cont, w in grouped.items():
            trie.add(-1, cont, source, n, w)

    def _table_followers(self, token: int) -> list[tuple[str, list]]:
        out = []
        t = self.tables
        if t.use_dynamic:
            out.append(("dyn", t.dynamic.get((token,))[: self._followers]))
        if t.frozen is not None:
            out.append(("frz", t.frozen.get((token,))[: self._followers]))
        return out

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        self._last = None
        if budget <= 0 or not history:
            return DraftTree.empty()
        trie = _Trie()
        self._length = min(LENGTH, budget)
        self._followers = min(TABLE_FOLLOWERS, max(4, budget // 4))
        self._own(trie, history)
        if self.ssd is not None:
            with self.ssd._lock:
                index = self.ssd.index
            self._retrieved(trie, history, index, "ssd")
        if self.rest is not None:
            self._retrieved(trie, history, self.rest.index, "rest")
        path = self._expand(trie, history[-1], budget)
        self._last = (trie.tokens, trie.parents, trie.features)
        return self._select(trie, path, budget, max_branching == 1)

    def _scores(self, trie: _Trie, start: int = 0, path: list[float] | None = None) -> list[float]:
        """Path probabilities of nodes start.. (parents come before children); a node's own
        estimate is computed once and again only when new evidence reached it."""
        path = path if path is not None else []
        score, probs, parents = self.scorer.p, trie.p, trie.parents
        for i in range(start, len(trie.tokens)):
            p = probs[i]
            if p is None:
                p = probs[i] = score(trie.features(i))
            par = parents[i]
            path.append(p if par < 0 else p * path[par])
        return path

    def _expand(self, trie: _Trie, root_token: int, budget: int) -> list[float]:
        """Best-first table lookups: the most probable node not yet looked up goes next, until
        `max_expand` lookups or no unexpanded node could still make the best `budget`."""
        path = self._scores(trie)
        heap = [(-1.0, -1)] + [(-s, i) for i, s in enumerate(path)]
        heapq.heapify(heap)
        done: set[int] = set()
        for _ in range(min(self.max_expand, 4 + budget // 2)):
            while heap and heap[0][1] in done:
                heapq.heappop(heap)
            if not heap:
                break
            neg, node = heapq.heappop(heap)
            if len(path) > budget and -neg < heapq.nlargest(budget, path)[-1]:
                break  # its descendants cannot beat the current best `budget` nodes
            done.add(node)
            before = len(trie.tokens)
            token = root_token if node < 0 else trie.tokens[node]
            for source, followers in self._table_followers(token):
                for rank, follower in enumerate(followers):
                    trie.add(node, follower, source, rank)
            path = self._scores(trie, before, path)
            for i in range(before, len(trie.tokens)):
                heapq.heappush(heap, (-path[i], i))
        return self._scores(trie)  # again: evidence merged into existing nodes changes their scores

    def _select(self, trie: _Trie, path: list[float], budget: int, chain: bool) -> DraftTree:
        if chain:  # one path: the most probable child at each level
            kids: dict[int, list[int]] = {}
            for i, par in enumerate(trie.parents):
                kids.setdefault(par, []).append(i)
            nodes, node = [], -1
            while len(nodes) < budget and kids.get(node):
                node = max(kids[node], key=path.__getitem__)
                nodes.append(node)
            return DraftTree(np.asarray([trie.tokens[i] for i in nodes]), np.arange(-1, len(nodes) - 1),
                             [path[i] for i in nodes])
        depth = trie.depth
        order = sorted(range(len(path)), key=lambda i: (-path[i], depth[i], i))[:budget]
        # ancestors first: a path probability never exceeds its parent's, ties go to the shallower
        new = {old: k for k, old in enumerate(order)}
        return DraftTree([trie.tokens[i] for i in order],
                         [-1 if trie.parents[i] < 0 else new[trie.parents[i]] for i in order],
                         [path[i] for i in order])
