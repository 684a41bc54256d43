"""How a batch's pass is planned (batch.py runs it): how many drafts each lane sends (share,
share_side_by_side), what a shared pass costs here (LaneCosts), and whether a prefill chunk rides
in the running lanes' pass or goes in one of its own (Riding)."""

from __future__ import annotations

import heapq

import numpy as np

from .budget import Sizer


class LaneCosts:
    """What a shared pass costs on this machine: the sizer's price of a solo pass of as many rows
    (its measured table knows the BLAS's row tiles) times what the lanes add: each attends over
    its own cache, in products of its own, and its keys and values are written apart. That factor
    grows with the rows each lane brings: 8 lanes of a 135M model on a 2-core CPU cost about
    1.2x the price of a solo pass of as many rows at 1-1.5 rows a lane and 1.6-1.7x at 4-6
    (docs/BENCHMARKS.md §10), so a factor level across rows priced wide passes low, and the
    planner sent drafts that cost more than they gave. It is learned per lane count, context
    band and rows per lane (SPREAD), each as one number: a running mean over the passes run,
    recent ones weighing more. A spread is priced at least as dear as the spreads below it
    (timings are noisy, and more rows a lane never cost less), and one not timed yet at the
    nearest timed one below it (above it, where none is), so the planner tries it and learns
    its own."""

    DECAY = 0.97  # weight of a pass after each later one
    SPREAD = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # rows per lane: the upper edges of the spreads learned apart

    def __init__(self, sizer: Sizer):
        self.sizer = sizer
        self.ratios: dict[tuple[int, int, int], tuple[float, float]] = {}  # (lanes, band, spread) -> (weight, sum)

    def spread(self, lanes: int, rows) -> np.ndarray | int:
        """Which spread a pass of `rows` rows in all (an int or an array of them) over `lanes` lanes is in."""
        return np.searchsorted(np.asarray(self.SPREAD) * lanes, rows, side="left")

    def factors(self, lanes: int, context: int) -> np.ndarray:
        """A shared pass of `lanes` lanes against a solo pass of as many rows, by spread (1 until one was timed)."""
        band, n = context // 1024, len(self.SPREAD) + 1
        timed = {}
        for k in range(n):
            w, total = self.ratios.get((lanes, band, k), (0.0, 0.0))
            if w:
                timed[k] = total / w
        out = np.ones(n)
        if timed:
            last = timed[min(timed)]  # spreads below the lowest timed one take its factor
            for k in range(n):  # and a spread is never priced below the ones under it
                last = out[k] = max(timed.get(k, last), last)
        return out

    def factor(self, lanes: int, context: int, rows: int) -> float:
        """The factor of a shared pass of `rows` rows in all over `lanes` lanes."""
        return float(self.factors(lanes, context)[self.spread(lanes, rows)])

    def costs(self, lanes: int, context: int) -> np.ndarray:
        """Seconds of a shared pass of `lanes` lanes by its rows in all (index), padding included,
        at about `context` cached tokens a lane."""
        solo = self.sizer.costs(context)
        return solo * self.factors(lanes, context)[self.spread(lanes, np.arange(len(solo)))]

    def timed(self, lanes: int, context: int, rows: int, seconds: float) -> None:
        """A shared pass of `lanes` lanes, run as `rows` rows in all, took `seconds`."""
        key = (lanes, context // 1024, int(self.spread(lanes, rows)))
        w, total = self.ratios.get(key, (0.0, 0.0))
        ratio = seconds / self.sizer.price(rows, context)
        self.ratios[key] = (w * self.DECAY + 1.0, total * self.DECAY + ratio)


class Riding:
    """Whether a prefill chunk rides in the running lanes' pass (the weights read once for both)
    or goes in a pass of its own, by what each way has cost a chunk's token here: riding, the
    pass's time beyond the price of the same pass without the chunk (LaneCosts); alone, the
    chunk's own time. Running means; the way not chosen is tried again once in TRY chunks. Where
    a pass's rows cost little beside what every pass costs (launch-bound passes), riding saves a
    pass; on a 2-core CPU a 128-row chunk's rows cost most of the pass, and riding costs about
    what the chunk and the pass cost apart (the output head runs on the chunk's rows too)."""

    TRY = 8
    DECAY = 0.9

    def __init__(self, fixed: bool | None = None):
        self.fixed = fixed  # True / False: always that way (None: learned)
        self.means: dict[bool, tuple[float, float]] = {}  # way -> (weight, sum of seconds a token)
        self.chunks = 0

    def ride(self) -> bool:
        if self.fixed is not None:
            return self.fixed
        self.chunks += 1
        for way in (True, False):
            if way not in self.means:
                return way
        cost = {way: total / w for way, (w, total) in self.means.items()}
        best = cost[True] <= cost[False]
        return (not best) if self.chunks % self.TRY == 0 else best

    def timed(self, ride: bool, tokens: int, seconds: float) -> None:
        w, total = self.means.get(ride, (0.0, 0.0))
        self.means[ride] = (w * self.DECAY + 1.0, total * self.DECAY + max(seconds, 0.0) / max(tokens, 1))


def share_side_by_side(offers: list[tuple[int, np.ndarray]], costs: np.ndarray | None) -> list[int]:
    """share's answer for lanes that go side by side (shared_pass.py: every lane padded to the
    widest): a pass `w` rows wide costs as many rows as lanes x w, and each lane sends its first
    w - lead drafts; the width taken is the one with the most expected tokens per second."""
    if costs is None:
        return [len(s) for _, s in offers]
    lanes = len(offers)
    lo, hi = max(lead for lead, _ in offers), max(lead + len(s) for lead, s in offers)
    best, width = -1.0, lo
    for w in range(lo, hi + 1):
        if lanes * w >= len(costs):
            break
        expected = lanes + sum(float(np.clip(s[: w - lead], 0.0, 1.0).sum()) for lead, s in offers)
        if expected / costs[lanes * w] > best:
            best, width = expected / costs[lanes * w], w
    return [min(len(s), width - lead) for lead, s in offers]


def share(offers: list[tuple[int, np.ndarray]], costs: np.ndarray | None,
          weights: list[float] | None = None) -> list[int]:
    """How many of its drafts each lane sends: offers are (lead rows, the drafts' chances of
    acceptance, best first) per lane. Every draft of every lane competes for the pass's rows:
    the count taken is the one with the most expected tokens per second of the whole pass, by
    `costs` (LaneCosts.costs: seconds by the pass's rows in all); `weights`: what an expected
    token of each lane is worth (Batch.lane_weights; None: level). Without costs (a fixed
    budget) every lane sends all it offered."""
    if costs is None:
        return [len(s) for _, s in offers]
    w = [1.0] * len(offers) if weights is None else [float(x) for x in weights]
    base = sum(lead for lead, _ in offers)
    heap = [(-w[i] * min(max(float(s[0]), 0.0), 1.0), i, 0) for i, (_, s) in enumerate(offers) if len(s)]
    heapq.heapify(heap)
    order, expected = [], [sum(w)]
    while heap and base + len(order) < len(costs) - 1:
        neg, i, j = heapq.heappop(heap)
        order.append(i)
        expected.append(expected[-1] - neg)
        if j + 1 < len(offers[i][1]):
            heapq.heappush(heap, (-w[i] * min(max(float(offers[i][1][j + 1]), 0.0), 1.0), i, j + 1))
    k = int(np.argmax(np.array(expected) / costs[base : base + len(expected)]))
    counts = [0] * len(offers)
    for i in order[:k]:
        counts[i] += 1
    return counts
