"""Adversarial drafters for exactness tests: always right (chains, trees with wrong siblings),
always wrong, and random trees that sometimes hold the true path."""

import random

from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.tree import DraftTree


class OracleDrafter(Drafter):
    """Always right: drafts the true continuation (known in advance)."""

    def __init__(self, prompt, truth, extra_wrong_branches=0):
        self.full = list(prompt) + list(truth)
        self.branches = extra_wrong_branches

    def propose(self, history, budget, max_branching=None):
        pos = len(history)
        chain = self.full[pos : pos + budget]
        if not self.branches:
            return DraftTree.chain(chain)
        tokens, parents = [], []
        for i, t in enumerate(chain[: budget // (self.branches + 1)]):
            parent = -1 if i == 0 else len(tokens) - 1  # the right node one level up
            for b in range(self.branches):  # wrong siblings first, the right one last
                tokens.append((t + 1 + b) % 90)
                parents.append(parent)
            tokens.append(t)
            parents.append(parent)
        return DraftTree(tokens, parents)


class WrongDrafter(Drafter):
    """Always wrong: drafts tokens the model never picks next."""

    def __init__(self, truth_after):
        self.truth_after = truth_after

    def propose(self, history, budget, max_branching=None):
        nxt = self.truth_after(history)
        return DraftTree.chain([(nxt + 1 + i) % 90 for i in range(min(budget, 5))])


class WrongOnce(WrongDrafter):
    """Wrong drafts once, after `at` tokens of history (say a pass from position 252 over
    256, all rolled back), nothing else: plain steps follow the rollback."""

    def __init__(self, truth_after, at):
        super().__init__(truth_after)
        self.at = at

    def propose(self, history, budget, max_branching=None):
        return super().propose(history, budget) if len(history) == self.at else DraftTree.empty()


class RandomTreeDrafter(Drafter):
    """Random trees of up to 64 nodes and depth 8, sometimes holding the true path."""

    def __init__(self, prompt, truth, seed=0, vocab=90):
        self.full = list(prompt) + list(truth)
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, history, budget, max_branching=None):
        n = self.rng.randint(0, min(64, budget))
        tokens, parents, depth = [], [], []
        for i in range(n):
            p = self.rng.choice([-1] + [j for j in range(i) if depth[j] < 8]) if i else -1
            d = 1 if p < 0 else depth[p] + 1
            pos = len(history) + d - 1
            # follow the truth along some paths so that long acceptances happen too
            on_truth = all(len(history) + depth[a] - 1 < len(self.full)
                           and tokens[a] == self.full[len(history) + depth[a] - 1]
                           for a in self._ancestors(parents, p))
            if on_truth and pos < len(self.full) and self.rng.random() < 0.6:
                t = self.full[pos]
            else:
                t = self.rng.randrange(self.vocab)
            if any(tokens[s] == t and parents[s] == p for s in range(i)):
                t = (t + 1) % self.vocab  # keep siblings distinct... or not: duplicates are legal too
            tokens.append(t)
            parents.append(p)
            depth.append(d)
        return DraftTree(tokens, parents)

    @staticmethod
    def _ancestors(parents, p):
        out = []
        while p >= 0:
            out.append(p)
            p = parents[p]
        return out


class KnownStreamsDrafter(RandomTreeDrafter):
    """RandomTreeDrafter along whichever of several known streams (prompt + truth) the history
    follows: one drafter that serves several requests in turn (a batch's lane)."""

    def __init__(self, streams, seed=0, vocab=90):
        super().__init__([], [], seed, vocab)
        self.streams = [list(p) + list(t) for p, t in streams]

    def propose(self, history, budget, max_branching=None):
        h = list(history)
        self.full = next((s for s in self.streams if s[: len(h)] == h), h)
        return super().propose(history, budget, max_branching)


class HearsPicks:
    """Mixed in before a drafter class: keeps each pass's history, tree and what Drafter.recycle
    heard of it (`heard`). A pass with no draft budget left is not asked for a tree: it runs after
    the last pass's history and tokens, with none."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.heard, self.history, self.tree, self.produced = [], [], DraftTree.empty(), []

    def observe(self, tokens):
        super().observe(tokens)
        self.produced = list(tokens)

    def propose(self, history, budget, max_branching=None):
        self.history, self.tree = list(history), super().propose(history, budget, max_branching)
        return self.tree

    def recycle(self, picks):
        self.heard.append((self.history, self.tree, list(picks)))
        self.history, self.tree = self.history + self.produced, DraftTree.empty()
