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

import json
import logging
import math
import os
import threading
import time
import weakref
from itertools import repeat
from pathlib import Path
from typing import Callable, Hashable, Sequence

log = logging.getLogger(__name__)

Feature = Hashable
STATE_VERSION = 1  # of Scorer.state()


class Scorer:
    def __init__(self, prior: dict[Feature, float] | None = None, bias: float = -1.0,
                 step: float = 0.5, floor: float = 0.03):
        """prior: starting weights (logits) of features; bias: the starting logit of every node."""
        self.w: dict[Feature, float] = dict(prior or {})
        self.n: dict[Feature, int] = {}
        self.bias, self.bias_n = bias, 0
        self.step, self.floor = step, floor
        # _rate(k) for every k until it is the floor (at most 2^16 of them); past the table, the
        # floor itself where the table reaches it, else _rate
        last = min(int((step / floor) ** 2) + 2 if floor > 0 else 1 << 16, 1 << 16)
        self._rates = [0.0] + [self._rate(k) for k in range(1, last)]
        self._tail = floor if floor > 0 and self._rate(last) == floor else None

    # -- kept between runs (auto.py saves it beside SSD's store) ------------------------
    def state(self, min_uses: int = 2) -> dict:
        """The learned weights, JSON-ready: features as lists; features used fewer than
        `min_uses` times are left out (they carry little, and the file stays small)."""
        w, n = dict(self.w), dict(self.n)  # (copies: drafters in other threads may be learning into it)
        return {"version": STATE_VERSION, "bias": self.bias, "bias_n": self.bias_n,
                "w": [[list(f) if isinstance(f, tuple) else f, x, n.get(f, 0)]
                      for f, x in w.items() if n.get(f, 0) >= min_uses or f not in n]}

    def load_state(self, state: dict) -> None:
        """Weights saved by state(); ValueError (or KeyError / TypeError) when it is not one."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError("not a saved scorer of this version")
        w, n = {}, {}
        for f, weight, uses in state["w"]:
            key = tuple(f) if isinstance(f, list) else f
            w[key] = float(weight)
            if uses:
                n[key] = int(uses)
        if not all(math.isfinite(v) for v in w.values()) or not math.isfinite(float(state["bias"])):
            raise ValueError("weights that are not finite numbers")
        self.w, self.n = w, n
        self.bias, self.bias_n = float(state["bias"]), int(state["bias_n"])

    def logit(self, feats: Sequence[Feature]) -> float:
        return self.bias + sum(map(self.w.get, feats, repeat(0.0)))  # (each weight, 0 if unseen)

    def p(self, feats: Sequence[Feature]) -> float:
        z = self.bias + sum(map(self.w.get, feats, repeat(0.0)))  # logit(), written out: hot
        return 1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0

    def update(self, feats: Sequence[Feature], accepted: bool) -> None:
        """One gradient step of the log-likelihood for one labelled node (p() and the step sizes
        written out here: it runs for every labelled node of every pass)."""
        n, w, rates = self.n, self.w, self._rates
        z = self.bias + sum(map(w.get, feats, repeat(0.0)))
        g = float(accepted) - (1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0)
        tail, top = self._tail, len(rates)
        k = self.bias_n = self.bias_n + 1
        self.bias += g * (rates[k] if k < top else tail if tail is not None else self._rate(k))
        for f in feats:
            k = n.get(f, 0) + 1
            n[f] = k
            w[f] = w.get(f, 0.0) + g * (rates[k] if k < top else tail if tail is not None else self._rate(k))

    def _rate(self, k: int) -> float:
        """The step size after k uses (the table _rates holds it for the first uses)."""
        return max(self.floor, self.step / math.sqrt(k))

    def learn_trie(self, tokens: Sequence[int], parents: Sequence[int],
                   feats: Callable[[int], Sequence[Feature]], truth: Sequence[int],
                   kids: dict[int, list[int]] | None = None) -> int:
        """Label the candidates of one step against the tokens the model produced (`truth`, from the
        root's successor on): walk the true path down the candidate trie; every child of a node on
        it is accepted iff its token is the next true token. Returns how many were labelled.
        kids: each node's children in index order (-1: the root's), where the caller keeps them."""
        if kids is None:
            kids = {}
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


class KeptScores:
    """A scorer's weights kept in a file between runs: read at the start (a missing file: the
    defaults; a bad one: the defaults and a warning, and the next save replaces it), written
    after a run's first request, then at most every `every` seconds and at close. A write goes to
    a temporary file renamed over the old one (readers never see half a file; of two processes
    the last to write wins), in a thread an exit waits for."""

    _open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (file, start) -> its kept scores
    _open_lock = threading.Lock()

    @classmethod
    def of(cls, path: str | Path, starting: Callable[[], Scorer], start: Hashable = None) -> "KeptScores":
        """The scores kept in `path`, one scorer for every drafter of this process that keeps its
        scores there (a server's lanes, each with a drafter of its own): each drafts from what all
        of them learned, and no lane's save overwrites the others' learning. `starting()` builds
        the scorer where none is open (the file, when readable, then replaces its weights);
        `start` tells apart drafters that start differently. Each drafter calls release() when
        done; after the last one, the next drafter starts from the file again."""
        key = (str(Path(path).resolve()), start)
        with cls._open_lock:
            kept = cls._open.get(key)
            if kept is None:
                kept = cls._open[key] = cls(path, starting())
                kept.key = key
            kept.users += 1
            return kept

    def release(self) -> None:
        """A drafter of of()'s is done with these scores: they are saved, and the last drafter's
        release lets go of them."""
        with KeptScores._open_lock:
            self.users -= 1
            last = self.users <= 0
            if last and self.key is not None and KeptScores._open.get(self.key) is self:
                del KeptScores._open[self.key]
        if last:
            self.close()
        else:
            self.save()

    def __init__(self, path: str | Path, scorer: Scorer, every: float = 30.0):
        self.key, self.users = None, 0  # of()'s
        self.path, self.scorer, self.every = Path(path), scorer, every
        self._saved_at: float | None = None  # monotonic time of the last save (None: not this run)
        self._writer: threading.Thread | None = None
        try:
            scorer.load_state(json.loads(self.path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("auto: cannot read the learned scores %s (%s); starting from the defaults", self.path, e)

    def request_done(self) -> None:
        if self._saved_at is None or time.monotonic() - self._saved_at >= self.every:
            self.save()

    def close(self) -> None:
        self.save()
        self._writer.join()

    def save(self) -> None:
        self._saved_at = time.monotonic()
        state, path = self.scorer.state(), self.path

        def write():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(self)}.tmp")  # one per writer
            try:
                tmp.write_text(json.dumps(state), encoding="utf-8")
                os.replace(tmp, path)
            except OSError as e:
                log.warning("auto: cannot save the learned scores to %s: %s", path, e)
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass

        if self._writer is not None:
            self._writer.join()  # one write at a time, in order
        self._writer = threading.Thread(target=write, name="auto-scores")  # not a daemon: exit waits
        self._writer.start()
