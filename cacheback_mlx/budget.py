"""How many draft tokens each pass gets: the count that maximises expected tokens per second.

A pass over r rows costs cost(r) seconds (costs.py: a table measured once per model, device and
dtype, or until then a prior fitted to the engine's own timed passes). A tree whose first n nodes
have acceptance probabilities s_1..s_n (DraftTree.scores: each node's whole root path accepted)
yields 1 + s_1 + ... + s_n tokens on average, the model's own token included. Each step keeps the
n that maximises (1 + sum s) / cost(lead + n): 0 drafts when nothing is likely to be accepted,
the whole budget when drafts are sure and rows are cheap. Drafters that give no scores get a
default estimate: per depth and rank among siblings, learned from their passes (RankRates).

Cost is not monotone in rows (a BLAS tiles some row counts exactly), so a pass is padded to the
measured row count at or above its own that costs least (Sizer.rows; padded rows are rolled back
like rejected ones), and the sizer fills those rows with drafts when any are left.

A table measured once can be wrong about some sizes (a slow spell during the measurement; real
trees attend differently from the measured chains), so the sizer also learns from the passes it
sends: the engine reports each pass's seconds (Sizer.timed), and the price of each band of row
counts is corrected by how much slower or faster than the table it ran, relative to all passes
over a similar number of cached tokens (PassTimes; one pass in EXPLORE tries the runner-up size,
so there is always a second size to compare with). A machine that slows down as a whole changes
no price; a size the table priced too low is sent, found out and priced up. Drafters' scores are
calibrated the same way, by what the model accepted, counting every candidate offered, sent or
not (Calibration, known_outcomes).
"""

from __future__ import annotations

import collections

import numpy as np

from .costs import CostTable, PriorCost
from .tree import DraftTree
from .verify import padded_size


def expected_tokens(scores: np.ndarray) -> np.ndarray:
    """[n + 1]: the tokens a pass yields on average with the first n nodes sent, its own included."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.clip(scores, 0.0, 1.0))])


def best_size(scores: np.ndarray, lead: int, costs: np.ndarray) -> int:
    """The n in 0..len(scores) maximising (1 + scores[:n].sum()) / costs[lead + n]
    (costs[r]: seconds of a pass of r rows)."""
    expected = expected_tokens(scores)
    return int(np.argmax(expected / costs[lead : lead + len(expected)]))


class RankRates:
    """The default estimate for trees without scores. Drafters list the likelier children first,
    so a node is described by its depth and its rank among its siblings; per (depth, rank) this
    learns P(node accepted | parent accepted) from every pass (each sent node whose parent was
    accepted is labelled). Before any pass: 0.6 for a first child, 0.15 for the others."""

    DEPTHS, RANKS = 12, 4

    def __init__(self):
        self.hits = np.full((self.DEPTHS + 1, self.RANKS + 1), 0.3)
        self.hits[:, 0] = 1.2
        self.trials = np.full((self.DEPTHS + 1, self.RANKS + 1), 2.0)

    def cells(self, tree: DraftTree) -> np.ndarray:
        """[n, 2]: each node's (depth, rank among its siblings), both capped."""
        rank = np.zeros(len(tree), np.int64)
        seen: dict[int, int] = {}
        for i, p in enumerate(tree.parents.tolist()):
            rank[i] = seen.get(p, 0)
            seen[p] = rank[i] + 1
        return np.stack([np.minimum(tree.depths(), self.DEPTHS), np.minimum(rank, self.RANKS)], axis=1)

    def scores(self, tree: DraftTree, cells: np.ndarray) -> np.ndarray:
        """Each node's path probability: the product of the estimates down from the root."""
        p = (self.hits / self.trials)[cells[:, 0], cells[:, 1]]
        out = np.empty(len(tree))
        for i, par in enumerate(tree.parents.tolist()):
            out[i] = p[i] * (out[par] if par >= 0 else 1.0)
        return out

    def update(self, tree: DraftTree, cells: np.ndarray, path: list[int]) -> None:
        on = set(path)
        for i, par in enumerate(tree.parents.tolist()):
            if par < 0 or par in on:  # its parent was accepted: this node is labelled
                self.trials[cells[i, 0], cells[i, 1]] += 1
                self.hits[cells[i, 0], cells[i, 1]] += i in on


def best_first(tree: DraftTree, scores: np.ndarray) -> tuple[DraftTree, list[int]]:
    """The tree's nodes reordered best first (ties: the drafter's order, which puts parents
    first), so every prefix is the best tree of its size, and the new order as old indices;
    parents still precede children (a path probability never exceeds its parent's)."""
    order = sorted(range(len(tree)), key=lambda i: (-scores[i], i))
    new = {old: k for k, old in enumerate(order)}
    parents = [-1 if tree.parents[i] < 0 else new[int(tree.parents[i])] for i in order]
    return DraftTree(tree.tokens[order], parents, scores[order]), order


class Calibration:
    """How often sent nodes were accepted against the drafter's scores, by bins of score and of
    place in the tree (nodes come best first: the first node, the second, 3rd-4th, 5th-8th, the
    rest): a factor per cell on the scores a drafter gives (they may promise more or less than the
    model then accepts on this kind of text). The place matters: a first node scored 0.1 is the
    best guess of a step where nothing is sure and is accepted far more often than a tenth node
    scored 0.1 under nine likelier ones. Learned from every pass; old passes fade (DECAY)."""

    EDGES = np.array([0.05, 0.15, 0.3, 0.5, 0.75])
    PLACES = np.array([1, 2, 4, 8])  # bin edges on a node's index in the tree
    PRIOR = 2.0  # pseudo-acceptances at the drafter's own scores, per cell
    DECAY = 0.998  # per pass (~500 passes remembered)

    def __init__(self):
        self.hits = np.zeros((len(self.EDGES) + 1, len(self.PLACES) + 1))
        self.expected = np.zeros_like(self.hits)

    def factors(self) -> np.ndarray:
        """[score bin, place bin] -> the factor on a drafter's score. A cell seen little is pulled
        toward the factor of all cells together, not toward the drafter's own scores: on text where
        nothing is accepted (a model that never agrees with the drafter) every cell learns that at
        once, where cells of rare scores would otherwise keep their promise for hundreds of passes
        and a cheap pass would keep sending their drafts."""
        overall = (self.hits.sum() + self.PRIOR) / (self.expected.sum() + self.PRIOR)
        return (self.hits + self.PRIOR * overall) / (self.expected + self.PRIOR)

    def _cells(self, scores: np.ndarray, places: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        places = np.arange(len(scores)) if places is None else places
        return np.searchsorted(self.EDGES, scores, side="right"), np.searchsorted(self.PLACES, places, side="right")

    def apply(self, scores: np.ndarray) -> np.ndarray:
        return np.clip(scores * self.factors()[self._cells(scores)], 0.0, 1.0)

    def update(self, scores: np.ndarray, accepted: np.ndarray, places: np.ndarray | None = None) -> None:
        """scores: nodes' scores; accepted: whether each was; places: their indices in the tree
        (default: 0, 1, 2, ...)."""
        self.hits *= self.DECAY
        self.expected *= self.DECAY
        cells = self._cells(scores, places)
        np.add.at(self.hits, cells, accepted.astype(float))
        np.add.at(self.expected, cells, np.clip(scores, 0.0, 1.0))


def known_outcomes(tree: DraftTree, continuation: list[int]) -> np.ndarray:
    """For every node, sent or not: 1 if its root path is a prefix of the model's continuation
    (the tokens a pass accepted, its own token included), 0 if the path leaves it, -1 if the
    path runs past what is known. A node a pass did not send is labelled as surely as a sent
    one: the model's token after each accepted node does not depend on which drafts were sent."""
    out = np.empty(len(tree), np.int8)
    depth = np.empty(len(tree), np.int64)
    for i, p in enumerate(tree.parents.tolist()):
        depth[i] = 1 if p < 0 else depth[p] + 1
        if p >= 0 and out[p] != 1:
            out[i] = out[p]  # off the continuation already, or past what is known
        elif depth[i] > len(continuation):
            out[i] = -1
        else:
            out[i] = int(tree.tokens[i]) == continuation[depth[i] - 1]
    return out


class PassTimes:
    """What passes of each band of row counts really cost, relative to the cost table: per band
    and range of cached tokens, the median of (seconds / the table's seconds) over its recent
    passes, divided by the median over all recent passes in that range, so a machine-wide slowdown
    cancels out. A band seen a few times is pulled toward the table (PRIOR), and what was seen more
    than WINDOW passes ago is forgotten (a band once priced up is tried again later). Bands, not
    single counts: a table's error is about the same for 17 rows as for 19 (one slow spell, one
    interpolation), and the counts past 16 are each sent too rarely to be learned one by one; 8
    and 16, the counts a BLAS tiles, end bands. Ranges of context: past the contexts the table
    measured, passes of many rows cost relatively more than it says (attention grows with rows x
    context); learned over long prompts and applied to a short one, that priced 8 rows too high
    and the sizer sent too few drafts (docs/BENCHMARKS.md §4)."""

    BANDS = np.array([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192])  # band b: BANDS[b-1] < rows <= BANDS[b]
    CONTEXTS = np.array([512, 1536, 3072])  # range c: CONTEXTS[c-1] <= cached tokens < CONTEXTS[c]
    WINDOW = 512  # passes an observation counts for
    PRIOR = 3  # observations of a band before they weigh as much as the table
    KEEP = 48  # observations kept per band

    def __init__(self):
        self.n = 0
        self.seen: dict[int, collections.deque] = {}

    @classmethod
    def band(cls, rows: int) -> int:
        return int(np.searchsorted(cls.BANDS, rows, side="left"))

    @classmethod
    def key(cls, rows: int, context: int) -> tuple[int, int]:
        """(range of context, band of rows)."""
        return int(np.searchsorted(cls.CONTEXTS, context, side="right")), cls.band(rows)

    def add(self, rows: int, context: int, ratio: float) -> None:
        self.n += 1
        self.seen.setdefault(self.key(rows, context), collections.deque(maxlen=self.KEEP)).append((self.n, ratio))

    def factors(self) -> dict[tuple[int, int], float]:
        """(range of context, band) -> the factor on the table's price."""
        recent = {k: [x for i, x in q if i > self.n - self.WINDOW] for k, q in self.seen.items()}
        pooled: dict[int, list] = {}
        for (c, _), xs in recent.items():
            pooled.setdefault(c, []).extend(xs)
        base = {c: float(np.median(xs)) for c, xs in pooled.items() if xs}
        return {k: 1.0 + len(xs) / (len(xs) + self.PRIOR) * (float(np.median(xs)) / base[k[0]] - 1.0)
                for k, xs in recent.items() if xs}


class Sizer:
    """Chooses each pass's draft size for the engine (the per-step budget)."""

    RELEARN = 16  # passes between updates of the learned prices
    EXPLORE = 32  # at most one pass in this many tries the runner-up size (learning prices)
    LEARN_SHARE = 0.01  # what passes sent to learn (runner-up sizes, probes) may cost, at most:
    # a share of the time of the passes chosen, so speculation that never pays (a model that
    # accepts nothing) stays within 1% of plain decoding whatever a row costs
    PROBE_IDLE = 8  # unscored drafters: passes without drafts before one node is sent to learn from
    DRAFT_SHARE = 0.03  # drafts asked for only to fill a padded pass may take this share of its time

    MAX_ROWS = 256
    CONTEXT_STEP = 256  # pass costs are looked up per 256 cached tokens

    def __init__(self, cost: CostTable | PriorCost, pad: bool = True, learn: bool = True,
                 rates: RankRates | None = None, calibration: Calibration | None = None):
        """pad: passes may be padded to a cheaper measured row count (the engine turns it off
        for recurrent layers, where padded rows would run the recurrence). learn: correct the
        table's prices from the passes' own times (`timed`). rates, calibration: what drafts'
        acceptance was learned into (default: new, empty ones)."""
        self.cost = cost
        self.pad = pad
        self.learn = learn
        self.rates = rates or RankRates()
        self.calibration = calibration or Calibration()
        self._idle = 0
        self.used = 8.0  # recent draft sizes chosen (a moving average)
        self._sent: tuple | None = None  # the last unscored tree sent, with its nodes' cells
        self._pending: tuple | None = None  # a pass update() heard of, learned at catch_up()
        self._offered: DraftTree | None = None  # the last scored tree's candidates, sent or not
        self._plans: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._base: dict[int, tuple[np.ndarray, list]] = {}  # context -> the table's prices, their keys
        self._caps: dict[tuple[int, int], int] = {}
        self.times = PassTimes()
        self._chosen = 0
        self._trial: int | None = None
        self._credit = 0.0  # seconds that learning passes may still cost (LEARN_SHARE)
        self.tried = 0  # passes sent at the runner-up size
        self.factors: dict[tuple[int, int], float] = {}  # PassTimes.key -> learned factor on the table's price
        self.draft_rate: float | None = None  # seconds the drafter takes per draft token asked (recent)
        self.steps: dict[bool, float] = {}  # recent seconds of a plain step, by whether it ran ahead
        self.ahead_share = 0.0  # of recent passes, those that ran ahead

    def lane(self) -> Sizer:
        """A sizer for one lane of a batch (batch.py): it learns acceptance into this sizer's
        tables (what a drafter's scores are worth belongs to the drafter and the model, not to one
        request: a lane's own tables started afresh with every request and sent too few drafts),
        with its own state between offer and update; it neither pads nor learns prices (the
        batch prices its shared passes)."""
        return Sizer(self.cost, pad=False, learn=False, rates=self.rates, calibration=self.calibration)

    def set_cost(self, cost: CostTable | PriorCost) -> None:
        """Price passes by `cost` from now on (a table measured meanwhile); what was learned of the
        old prices is dropped."""
        self.cost = cost
        self._relearn()

    def _relearn(self) -> None:
        self.times, self.factors = PassTimes(), {}
        self._plans.clear()
        self._base.clear()
        self._caps.clear()

    def prefilled(self, rows: int, context: int, seconds: float) -> None:
        """A prefill chunk of `rows` tokens after `context` cached ones took `seconds`: a point of
        the prior's curve (a measured table ignores it)."""
        if self.learn and self.cost.observe(rows, context, seconds):
            self._relearn()

    def timed(self, rows: int, context: int, seconds: float, ahead: bool = False) -> None:
        """A pass of `rows` rows (as run, padding included) over `context` cached tokens took
        `seconds`; every RELEARN passes the prices are corrected from these (PassTimes). A prior
        is refitted to them too (costs.PriorCost), and the corrections then start over.
        ahead: a plain step that started before the last pass's token was read (Engine.set_run_ahead)."""
        if not self.learn or seconds <= 0:
            return
        self.ahead_share += 0.05 * (float(ahead) - self.ahead_share)
        if rows == 1:
            last = self.steps.get(ahead)
            self.steps[ahead] = seconds if last is None else last + 0.05 * (seconds - last)
        if self.cost.observe(rows, context, seconds):
            self._relearn()
        self.times.add(rows, context, seconds / self.cost.cost(rows, context))
        if self.times.n % self.RELEARN == 0:
            self.factors = self.times.factors()
            self._plans.clear()
            self._caps.clear()

    def factor(self, rows: int, context: int = 0) -> float:
        """The learned factor on the table's price of a pass run as `rows` rows over `context`
        cached tokens."""
        return self.factors.get(PassTimes.key(rows, context), 1.0)

    def price(self, rows: int, context: int) -> float:
        """The table's seconds for a pass of `rows` rows, corrected by what such passes took."""
        run = padded_size(rows, self.cost.buckets)  # a pass runs as its shape bucket, if any
        return self.cost.cost(rows, context) * self.factor(run, context)

    def _prices(self, context: int) -> np.ndarray:
        """price(max(r, 1), context) for every r up to MAX_ROWS: the table's part kept until the
        table changes, the learned factors applied afresh (the engine asks for these once every
        RELEARN passes, on the path of the pass: on a GPU every 0.1 ms of Python counts)."""
        base = self._base.get(context)
        if base is None:
            sizes = [max(r, 1) for r in range(self.MAX_ROWS + 1)]
            base = self._base[context] = (
                np.array([self.cost.cost(r, context) for r in sizes]),
                [PassTimes.key(padded_size(r, self.cost.buckets), context) for r in sizes])
        table, keys = base
        return table * np.array([self.factors.get(k, 1.0) for k in keys])

    def _plan(self, context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cost, rows, price), all indexed by a pass's own row count r: the seconds it costs as
        run, the rows it runs as, and the price of r rows unpadded, at about this context. With
        padding on, r runs as the cheapest count >= r among the measured ones and, past the counts
        measured one by one (1..16), r itself (interpolated); a one-row step is never padded."""
        key = (context // self.CONTEXT_STEP, self.pad)
        plan = self._plans.get(key)
        if plan is None:
            c = key[0] * self.CONTEXT_STEP
            raw = self._prices(c)
            rows = np.arange(self.MAX_ROWS + 1)
            if self.pad:
                sizes = [s for s in self.cost.sizes if s <= self.MAX_ROWS]
                dense = next((k for k in range(1, len(sizes) + 1) if sizes[k - 1] != k), len(sizes) + 1) - 1
                for r in range(2, sizes[-1] + 1 if sizes else 0):
                    options = [s for s in sizes if s >= r] + ([r] if r > dense else [])
                    rows[r] = min(options, key=lambda s: (raw[s], s))
            plan = self._plans[key] = (raw[rows], rows, raw)
        return plan

    def costs(self, context: int) -> np.ndarray:
        """Seconds of a pass of r rows (index r) at about this context, padding included."""
        return self._plan(context)[0]

    def rows(self, n: int, context: int) -> int:
        """How many rows a pass of n rows runs as (padded to a cheaper count, or n)."""
        rows = self._plan(context)[1]
        return int(rows[n]) if n < len(rows) else n

    def pass_rows(self, n: int, context: int) -> int:
        """The rows the engine's next pass of n rows runs as: `rows`, or the size `choose` picked
        to try (learning)."""
        trial, self._trial = self._trial, None
        return trial if trial is not None and trial >= n else self.rows(n, context)

    def _runner_up(self, scores: np.ndarray, lead: int, context: int, n: int) -> tuple[int, int]:
        """(drafts, rows) of the best pass that runs as another row count than the best one's:
        what one in EXPLORE passes sends, so prices are learned beside the size mostly sent (a
        size never sent beside another cannot be found mispriced: only relative times count)."""
        _, rows, price = self._plan(context)
        expected = expected_tokens(scores)
        sizes = set(range(lead, lead + len(scores) + 1))
        if self.pad:
            sizes |= {s for s in self.cost.sizes if lead < s <= self.MAX_ROWS}
        sizes.discard(int(rows[lead + n]))
        sizes = [s for s in sizes if 0 < s < len(price)]
        if not sizes:
            return n, int(rows[lead + n])
        best = max(sizes, key=lambda s: (expected[min(len(scores), s - lead)] / price[s], -s))
        return min(len(scores), best - lead), best

    def cap(self, limit: int, context: int) -> int:
        """How many draft tokens to ask the drafter for: about twice what recent passes used
        (a bigger candidate tree costs drafting time every step), at least as many as fill the
        rows a one-draft pass is padded to (as far as drafting them stays under DRAFT_SHARE of
        that pass, by the drafter's time per draft asked: `drafted`), and never past the rows a pass
        can have before it costs 2x a one-token step: beyond that a pass pays only if more than
        one draft token is expected per extra step's worth of rows, rare outside long exact
        repeats (--draft-budget lowers the cap too)."""
        limit = min(limit, self.MAX_ROWS - 8)
        key = (limit, context // self.CONTEXT_STEP)
        if key not in self._caps:
            vec = self.costs(context)
            self._caps[key] = max([n for n in range(limit + 1) if vec[n + 1] <= 2.0 * vec[1]], default=0)
        # never fewer than fill the smallest pass with a draft (where 2 rows run as 8, 7 drafts ride
        # free), unless drafting them costs more than a small share of that pass: on a GPU a pass
        # of 2 rows may run as 64, and asking a drafter for 63 drafts every pass took ~10% of the time
        fill = self.rows(2, context) - 1
        if self.draft_rate:
            fill = min(fill, int(self.DRAFT_SHARE * self.costs(context)[fill + 1] / self.draft_rate))
        return min(self._caps[key], max(4, fill, int(2 * self.used) + 2))

    def drafted(self, asked: int, seconds: float) -> None:
        """The drafter took `seconds` to propose after being asked for `asked` drafts (cap)."""
        if asked > 0 and seconds > 0:
            rate = seconds / asked
            self.draft_rate = rate if self.draft_rate is None else self.draft_rate + 0.1 * (rate - self.draft_rate)

    def ahead_saving(self) -> float:
        """What a pass with drafts costs beside its own time where plain steps run ahead
        (Engine.set_run_ahead): the plain step after it cannot have started early
        (run_ahead.RunAhead), so it forgoes what running ahead saves a step (recent seconds of a
        plain step without, less with), as often as recent passes ran ahead. 0 until both were
        timed. On the recorded streams priced by an H200's costs (`python -m tools.ab.run_ahead`)
        this took `auto` from 0.987x / 0.989x `none`'s speed to 0.994x / 0.994x (docs/BENCHMARKS.md §15)."""
        if len(self.steps) < 2:
            return 0.0
        return max(0.0, self.steps[False] - self.steps[True]) * self.ahead_share

    def choose(self, tree: DraftTree, lead: int, context: int) -> DraftTree:
        """The first n nodes of the tree, n chosen for the most expected tokens per second (a pass
        with drafts priced with ahead_saving on top)."""
        if not len(tree):
            return tree
        tree, scores, cells = self.offer(tree, lead)
        costs = self.costs(context)
        priced = costs
        if saving := self.ahead_saving():
            priced = costs.copy()
            priced[lead + 1 :] += saving
        n = best_size(scores, lead, priced)
        self.used += 0.1 * (n - self.used)
        self._trial = None
        self._credit = min(self._credit + self.LEARN_SHARE * costs[lead + n], 4.0 * costs[lead + n])
        if self.learn:
            self._chosen += 1
            if self._chosen >= self.EXPLORE:
                trial_n, trial_rows = self._runner_up(scores, lead, context, n)
                extra = self._plan(context)[2][trial_rows] - costs[lead + n]
                if extra <= self._credit:
                    n, self._trial = trial_n, trial_rows
                    self._credit -= max(extra, 0.0)
                    self._chosen = 0
                    self.tried += 1
        if n == 0 and cells is not None:  # unscored drafters only learn from drafts they send:
            self._idle += 1  # now and then send one node, or a low estimate could never recover
            extra = costs[lead + 1] - costs[lead]
            if self._idle >= self.PROBE_IDLE and extra <= self._credit:
                n, self._idle = 1, 0
                self._credit -= max(extra, 0.0)
        return self.send(tree, cells, n)

    def offer(self, tree: DraftTree, lead: int) -> tuple[DraftTree, np.ndarray, np.ndarray | None]:
        """A drafted tree as sizing sees it: (the tree, each node's chance of acceptance, the
        nodes' cells). A tree without scores is reordered best first by our estimate (its cells
        kept for update()); a drafter's scores are calibrated by what the model accepted."""
        if tree.scores is None:
            cells = self.rates.cells(tree)
            tree, order = best_first(tree, self.rates.scores(tree, cells))
            return tree, tree.scores[: self.MAX_ROWS - lead], cells[order]
        self._offered = tree.truncate(self.MAX_ROWS - lead)
        return tree, self.calibration.apply(self._offered.scores), None

    def send(self, tree: DraftTree, cells: np.ndarray | None, n: int) -> DraftTree:
        """The first n nodes of an offered tree, as the pass will send them; update() learns
        from them after the pass."""
        tree = tree.truncate(n)
        if cells is not None:
            self._sent = (tree, cells[:n])
            tree = DraftTree(tree.tokens, tree.parents)  # not the drafter's scores
        return tree

    def update(self, tree: DraftTree, path: list[int], continuation: list[int] | None = None) -> None:
        """After a pass over `tree`: `path` lists the accepted nodes, `continuation` the tokens
        the pass produced (the accepted ones and the model's own after them). With it, the
        calibration learns from every candidate choose() was offered, not only the sent ones:
        learning from sent nodes alone, a step that sends nothing (its scores were low) could
        never show that such scores are accepted more often than they say. The learning waits for
        catch_up() (the engine calls it while the next pass runs: on a CPU the first sizeable
        allocation after a pass's graph is freed, here, stalled ~2 ms, docs/BENCHMARKS.md §1, §4)
        or for the next update(): the next pass is sized one pass late either way."""
        self.catch_up()
        offered, self._offered = self._offered, None
        sent, self._sent = self._sent, None
        self._pending = (tree, path, continuation, offered, sent)

    def catch_up(self) -> None:
        """What update() left: the calibration (or the rank rates) learn from the last pass."""
        if self._pending is None:
            return
        (tree, path, continuation, offered, sent), self._pending = self._pending, None
        if tree.scores is None and sent is not None and len(sent[0]) == len(tree):
            self.rates.update(tree, sent[1], path)
        elif (continuation and offered is not None and len(offered) >= len(tree)
              and np.array_equal(offered.tokens[: len(tree)], tree.tokens)):  # what choose() sent of it
            known = known_outcomes(offered, continuation)
            places = np.flatnonzero(known >= 0)
            self.calibration.update(offered.scores[places], known[places] == 1, places)
        elif tree.scores is not None and len(tree):
            accepted = np.zeros(len(tree), bool)
            accepted[path] = True
            self.calibration.update(tree.scores, accepted)
