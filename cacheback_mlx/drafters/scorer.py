"""Online estimates of how likely a draft node is to be accepted, learned from the model's own picks.

A node is described by a few discrete features (which source proposed it, how long its context
match was, its rank among the source's followers, its depth...). The estimate of
P(node accepted | its parent accepted) is a logistic model over those features, fitted online by
stochastic gradient steps (per-feature step sizes shrink with use, down to a floor so the model
keeps adapting when a request changes its nature). Because a node's path probability is the
product of these estimates down from the root, the expected number of accepted draft tokens of a
tree is the sum of its nodes' path probabilities: the engine uses that to size each step.

Every verify pass labels every candidate the drafter considered, not only the ones it sent: once
the model's tokens are known, each candidate whose parent lies on the accepted path either is the
model's token or is not (`Scorer.learn_trie`). So the estimates see no selection bias.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Sequence

Feature = Hashable


class Scorer:
    def __init__(self, prior: dict[Feature, float] | None = None, bias: float = -1.0,
                 step: float = 0.5, floor: float = 0.03):
        """prior: starting weights (logits) of features; bias: the starting logit of every node."""
        self.w: dict[Feature, float] = dict(prior or {})
        self.n: dict[Feature, int] = {}
        self.bias, self.bias_n = bias, 0
        self.step, self.floor = step, floor

    def logit(self, feats: Sequence[Feature]) -> float:
        w = self.w
        return self.bias + sum(w.get(f, 0.0) for f in feats)

    def p(self, feats: Sequence[Feature]) -> float:
        z = self.logit(feats)
        return 1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0

    def update(self, feats: Sequence[Feature], accepted: bool) -> None:
        """One gradient step of the log-likelihood for one labelled node."""
        g = float(accepted) - self.p(feats)
        step, floor, n, w = self.step, self.floor, self.n, self.w
        self.bias_n += 1
        self.bias += g * max(floor, step / math.sqrt(self.bias_n))
        for f in feats:
            k = n.get(f, 0) + 1
            n[f] = k
            w[f] = w.get(f, 0.0) + g * max(floor, step / math.sqrt(k))

    def learn_trie(self, tokens: Sequence[int], parents: Sequence[int],
                   feats: Callable[[int], Sequence[Feature]], truth: Sequence[int]) -> int:
        """Label the candidates of one step against the tokens the model produced (`truth`, from the
        root's successor on): walk the true path down the candidate trie; every child of a node on
        it is accepted iff its token is the next true token. Returns how many were labelled."""
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        node, labelled = -1, 0
        for t in truth:
            nxt = None
            for c in kids.get(node, ()):
                hit = tokens[c] == t
                self.update(feats(c), hit)
                labelled += 1
                if hit:
                    nxt = c
            if nxt is None:
                break
            node = nxt
        return labelled
