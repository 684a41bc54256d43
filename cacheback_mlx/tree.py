"""DraftTree: the one thing drafters and the engine share.

A draft is a tree of tokens hanging below the root, which is the last accepted token (not yet in
the KV cache). Node i holds `tokens[i]`; `parents[i]` is the index of its parent node, or -1 when
its parent is the root. Parents always precede children, so a chain is parents = [-1, 0, 1, ...].
A drafter may add `scores[i]`: its estimate of the probability that node i is accepted (its whole
root path matches the model), with nodes listed best first, so that the first n nodes are the best
n-node tree; the engine then sizes each pass from them (budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n], -1 = child of the root, else an earlier index
    scores: np.ndarray | None = None  # float [n]: P(node accepted), best first; None = not estimated

    def __post_init__(self):
        object.__setattr__(self, "tokens", np.asarray(self.tokens, dtype=np.int32).reshape(-1))
        object.__setattr__(self, "parents", np.asarray(self.parents, dtype=np.int32).reshape(-1))
        if self.scores is not None:
            object.__setattr__(self, "scores", np.asarray(self.scores, dtype=np.float64).reshape(-1))
            if self.scores.shape != self.tokens.shape:
                raise ValueError("scores must have one value per node")
        if self.tokens.shape != self.parents.shape:
            raise ValueError("tokens and parents must have the same length")
        if len(self.parents) and np.any(self.parents >= np.arange(len(self.parents))):
            raise ValueError("every parent must precede its child")

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32))

    @staticmethod
    def chain(tokens) -> "DraftTree":
        n = len(tokens)
        return DraftTree(np.asarray(tokens, np.int32), np.arange(-1, n - 1, dtype=np.int32))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def is_chain(self) -> bool:
        return not len(self) or bool(np.all(self.parents == np.arange(-1, len(self) - 1)))

    def positions(self, first: int) -> np.ndarray:
        """The position of the token each row of a pass over this tree chooses: the root's row the
        one at `first` (the cached tokens + the lead), node i's at first + its depth."""
        return first + np.concatenate([[0], self.depths()])

    def depths(self) -> np.ndarray:
        """Depth of each node; children of the root have depth 1."""
        d = np.zeros(len(self), np.int32)
        for i, p in enumerate(self.parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """[n+1, n+1] bool over (root, nodes...): row i sees column j iff j is i or an ancestor."""
        n = len(self)
        m = np.zeros((n + 1, n + 1), dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                m[row] = m[p + 1]
            m[row, row] = True
        return m

    def children(self) -> list[list[int]]:
        """children()[0] lists the root's children, children()[i+1] those of node i."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def keep_valid(self, vocab_size: int) -> "DraftTree":
        """Drop nodes whose token is not a valid id, with their subtrees (a drafter's table may
        come from another tokenizer; an out-of-range id must never reach the embedding)."""
        if not len(self):
            return self
        ok = (self.tokens >= 0) & (self.tokens < vocab_size)
        if ok.all():
            return self
        for i, p in enumerate(self.parents):
            if p >= 0 and not ok[p]:
                ok[i] = False
        remap = np.cumsum(ok) - 1
        parents = np.where(self.parents[ok] < 0, -1, remap[np.maximum(self.parents[ok], 0)])
        return DraftTree(self.tokens[ok], parents, None if self.scores is None else self.scores[ok])

    def first_path(self) -> "DraftTree":
        """The chain along each node's first child (drafters list the likeliest child first)."""
        path, kids, node, scores = [], self.children(), -1, []
        while kids[node + 1]:
            node = kids[node + 1][0]
            path.append(int(self.tokens[node]))
            scores.append(None if self.scores is None else self.scores[node])
        chain = DraftTree.chain(path)
        return chain if self.scores is None else DraftTree(chain.tokens, chain.parents, scores)

    def picked(self, root: int, picks: Sequence[int],
               best: Sequence[Sequence[int]] | None = None) -> list[tuple[int, tuple[int, ...]]]:
        """(a row's token, (the model's pick after it, ...)) for every row of a pass over this
        tree, its drafts accepted or not: the root's row (`root`, the token the pass's picks start
        after) and each node's; with `best` (each row's k best tokens, best first: top_tokens),
        the pick is followed by the others of them (k tokens in all). A pick below 0 (a forced
        run's row off the recording) is left out."""
        rows = [int(root)] + self.tokens.tolist()
        if best is None:
            return [(t, (int(p),)) for t, p in zip(rows, picks) if p >= 0]
        return [(t, ((int(p),) + tuple(int(b) for b in top if b != p))[: len(top)])
                for t, p, top in zip(rows, picks, best) if p >= 0]

    def truncate(self, n: int) -> "DraftTree":
        """The first n nodes (still a valid tree, as parents precede children)."""
        if n >= len(self):
            return self
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.scores is None else self.scores[:n])


def forced_picks(tree: DraftTree, continuation: Sequence[int]) -> list[int]:
    """The picks a model would make if its greedy stream were `continuation` (a recorded one):
    row 0 (the root) picks continuation[0]; a node whose root path follows the continuation picks
    the token after it; any other node picks -1 (no token), so `accept` follows the recording.
    How a model with random weights is run at the acceptance of a real one (`generate(forced=)`),
    and what a replay (replay.py) knows of a pass's picks. The tree must be shallower than the
    continuation (the engine drafts at most the tokens left but one), so an accepted path always
    has a recorded token after it."""
    depth = tree.depths()
    if len(tree) and int(depth.max()) >= len(continuation):
        raise ValueError("a forced pass's tree must be shallower than the recorded tokens left")
    picks = [int(continuation[0])]
    on = np.zeros(len(tree), bool)
    for i, p in enumerate(tree.parents.tolist()):
        d = int(depth[i])
        on[i] = (p < 0 or on[p]) and int(tree.tokens[i]) == continuation[d - 1]
        picks.append(int(continuation[d]) if on[i] else -1)
    return picks


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (the engine's caches, CARD's draft cache)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
