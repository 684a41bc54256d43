"""CARD's draft cache: a token tree of candidate continuations of the verified sequence.

The tree hangs below the root, the last verified token. It grows one layer at a time (CARD's
primary/secondary caches): every node of the frontier (the K best paths so far) offers its top-k
next tokens, each scored by its cumulative draft probability (parent's score x the token's
conditional probability); the K best of all those candidates become the next layer and the new
frontier. The target queries the tree (best(n): the n best-scored nodes, a valid subtree because a
node never scores above its parent) and reports the tokens it accepted (advance): the tree keeps
only the subtree below the accepted path, re-rooted and re-scored, and growth continues from there
(cache correction). An accepted path that leaves the tree empties it (a miss): growth restarts
from the new root.

Pure Python/NumPy, no model: the draft process (draft_model/worker.py) and the sequential drafter share it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..tree import DraftTree


class TokenTree:
    def __init__(self, paths: int = 4, top_k: int = 4, depth: int = 10, nodes: int = 40, min_score: float = 0.0):
        """paths: nodes kept per layer (CARD's K); top_k: children offered per node; depth: the
        deepest node; nodes: the tree's size cap; min_score: stop growing when no frontier node's
        cumulative probability reaches it (a hopeless tree costs passes, and cores, for nothing)."""
        if paths < 1 or top_k < 1 or depth < 1 or nodes < 1 or not 0 <= min_score < 1:
            raise ValueError("paths, top_k, depth and nodes must be >= 1, min_score in [0, 1)")
        self.paths, self.top_k, self.max_depth, self.max_nodes = paths, top_k, depth, nodes
        self.min_score = min_score
        self.clear()

    def clear(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # cumulative draft probability given the root
        self.depths: list[int] = []
        self.frontier: list[int] = [-1]  # nodes to expand next; -1 is the root

    def __len__(self) -> int:
        return len(self.tokens)

    def full(self) -> bool:
        """Nothing left to grow: the node cap is reached or the frontier is as deep as allowed."""
        if len(self.tokens) >= self.max_nodes or not self.frontier:
            return True
        if all(f >= 0 and self.scores[f] < self.min_score for f in self.frontier):
            return True
        return all(f >= 0 and self.depths[f] >= self.max_depth for f in self.frontier)

    def as_draft_tree(self) -> DraftTree:
        """Every node, in insertion order (parents before children): what a draft pass feeds."""
        return DraftTree(np.array(self.tokens, np.int32), np.array(self.parents, np.int32))

    def grow(self, frontier: Sequence[int], ids: np.ndarray, probs: np.ndarray) -> int:
        """One layer: ids/probs [len(frontier), k] are each frontier node's top-k next tokens and
        their conditional probabilities. Keeps the `paths` best candidates by cumulative score
        (within the node cap), which become the frontier. Returns the nodes added."""
        room = self.max_nodes - len(self.tokens)
        cands = []
        for row, f in enumerate(frontier):
            if f >= 0 and self.depths[f] >= self.max_depth:
                continue
            base = 1.0 if f < 0 else self.scores[f]
            for j in range(min(self.top_k, ids.shape[1])):
                cands.append((base * float(probs[row, j]), f, int(ids[row, j])))
        cands.sort(key=lambda c: -c[0])
        self.frontier = []
        for score, f, tok in cands[: min(self.paths, room)]:
            self.frontier.append(len(self.tokens))
            self.tokens.append(tok)
            self.parents.append(f)
            self.scores.append(score)
            self.depths.append(1 if f < 0 else self.depths[f] + 1)
        return len(self.frontier)

    def path(self, tokens: Sequence[int]) -> list[int] | None:
        """The nodes holding `tokens` from the root down, or None when the path leaves the tree."""
        kids, node, out = self._children(), -1, []
        for tok in tokens:
            node = next((c for c in kids[node + 1] if self.tokens[c] == tok), None)
            if node is None:
                return None
            out.append(node)
        return out

    def advance(self, accepted: Sequence[int]) -> list[int] | None:
        """The verified sequence grew by `accepted` (the last one is the new root). Keep the subtree
        below the accepted path, re-rooted and re-scored, and return the kept nodes' old indices
        (new node i was old node kept[i]); None when the path left the tree (a miss): the tree is
        then empty and growth restarts from the new root."""
        if not accepted:
            return list(range(len(self.tokens)))
        path = self.path(accepted)
        if path is None:
            self.clear()
            return None
        node = path[-1]
        keep = [i for i in range(node + 1, len(self.tokens)) if self._below(i, node)]
        remap = {node: -1}
        base_score, base_depth = self.scores[node], self.depths[node]
        tokens, parents, scores, depths = [], [], [], []
        for i in keep:
            remap[i] = len(tokens)
            tokens.append(self.tokens[i])
            parents.append(remap[self.parents[i]])
            scores.append(self.scores[i] / base_score if base_score > 0 else 0.0)
            depths.append(self.depths[i] - base_depth)
        frontier = [remap[f] for f in self.frontier if f in remap]
        self.tokens, self.parents, self.scores, self.depths = tokens, parents, scores, depths
        if not frontier:  # the kept subtree lost the last layer: grow its leaves (or the root)
            has_kids = set(parents)
            frontier = [i for i in range(len(tokens)) if i not in has_kids] or [-1]
        self.frontier = frontier
        return keep

    def ancestors(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            node = self.parents[node]
            if node >= 0:
                out.append(node)
        return out

    def best(self, n: int, max_branching: int | None = None) -> DraftTree:
        """The n best-scored nodes as a DraftTree, best first, with scores (a subtree, as no node
        scores above its parent); max_branching=1: the best chain (the best child at each step)."""
        if not self.tokens or n <= 0:
            return DraftTree.empty()
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))
        if max_branching == 1:
            kids = {}
            for i in order:
                kids.setdefault(self.parents[i], i)
            chain, node = [], -1
            while node in kids and len(chain) < n:
                node = kids[node]
                chain.append(node)
            order = chain
        else:
            order = order[:n]
        pos = {i: k for k, i in enumerate(order)}
        return DraftTree(np.array([self.tokens[i] for i in order], np.int32),
                         np.array([-1 if self.parents[i] < 0 else pos[self.parents[i]] for i in order], np.int32),
                         np.array([self.scores[i] for i in order]))

    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def _below(self, i: int, node: int) -> bool:
        while i > node:
            i = self.parents[i]
        return i == node
