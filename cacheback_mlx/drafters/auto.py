"""auto: every drafting source merged into ONE scored tree, the best nodes first (the default).

Sources, each a way to guess what follows the history:
- own: the request's own history (prompt and output so far): the continuations of the longest
  contexts (up to 8 tokens) seen earlier, as prompt lookup does;
- ssd: the cross-request buffer of everything served before (SsdDrafter's store and suffix index);
- dyn / frz: Cacheback's dynamic LRU table and the frozen corpus table (leader -> followers);
- rest: a REST datastore: one given, or by default the shipped one, the default model's own
  answers (rest.shipped_datastore; what it tends to say, matched on longer contexts than the
  frozen table's one-token leaders);
- pick: what the model itself picked after a token the last time a pass ran a row over it, and
  once passes are wide its next-best tokens there too (RECYCLED in all), the rows of rejected
  drafts included (Drafter.recycle; "token recycling"): the model's own next tokens in a context
  like this one, often ones the text has not shown yet.
Their candidates are merged into one trie (a token proposed by several sources is one node that
carries all their evidence). Each node gets an estimate of P(accepted | parent accepted) from its
features (scorer.Scorer, learned online from every pass: what each source says, which sources
agree, the depth, and the token itself alone and after its parent's), and its path probability is
the product down from the root. What the scorer learned is kept beside SSD's store on disk
(`auto-scores.json`, one per tokenizer), so a new process starts from it, and the drafters on one
store in a process (a server's lanes) learn into one scorer (scorer.KeptScores.of); a drafter that has
learned nothing starts from PRIOR, or with `scores=True` from the shipped scores (`shipped_scores`:
learned on the default model's own answers, for its tokenizer; not the default: docs/BENCHMARKS.md
§10). The tree is built
best-first: the most probable node not yet taken is taken next and looked up in the tables, so the
lookups go where acceptance is likely, and only the children of taken nodes are ever scored. The
tree sent is the `budget` nodes with the highest path probability, best first, with their scores:
the engine sizes the pass from them (budget.py), down to no draft at all when nothing is likely.
"""

from __future__ import annotations

import gzip
import heapq
import json
import logging
import math
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ..errors import CachebackError
from ..tree import DraftTree
from .base import Drafter
from .cacheback import CachebackDrafter
from .rest import RestDrafter, shipped_datastore
from .scorer import KeptScores, Scorer
from .ssd import SsdDrafter

MAX_K = 8  # longest own-history context matched
OWN_CONTS = 6  # own-history continuations per step
LENGTH = 12  # tokens per retrieved continuation
MAX_COUNT = 32  # occurrences sampled per retrieval
TABLE_FOLLOWERS = 16  # followers per table lookup and table, at most (fewer for small budgets)
WINDOW = 8192  # own-history tokens indexed (older ones fall out)
# A scorer that has labelled fewer nodes than this learns from each pass before the next proposal;
# after, while the next pass runs (catch_up). One pass late cost a new drafter 1% of its tokens a
# pass on the recorded streams, and a drafter past this many labels ~0.1% (docs/BENCHMARKS.md §4).
YOUNG = 3000
RETRIEVED = ("own", "ssd", "rest")  # sources of whole continuations (the tables give followers)
TABLE_SOURCES = {"dynamic": "dyn", "frozen": "frz"}  # CachebackDrafter.followers' tables -> sources
PICK = "pick"  # the model's picks at earlier passes' rows (recycle): one-token followers, ranked like a table's
RECYCLED = 4  # the model's best tokens kept per row (its pick and the next 3) once passes are wide: `recycle`
WIDE = 16  # passes of more rows than this (on average) are wide: at ~8 the next-best tokens cost more than they gained
GAP = -1  # separates learned text from the history in the own-history index (never a token)
# (previous token, token) pairs share this many scorer weights at most (a tuple of ints hashes the
# same in every process, so kept weights keep their meaning)
PAIR_MASK = (1 << 18) - 1
SCORES_FILE = "auto-scores.json"  # the scorer's weights, kept in SSD's store folder between runs
# The scorer's weights learned on the default model's own answers (tools/build_default_scores.py):
# where a drafter may start (scores=True) before it has learned anything on this machine
SHIPPED_SCORES = Path(__file__).resolve().parents[1] / "data" / "auto_scores_smollm2.json.gz"

log = logging.getLogger(__name__)

# Starting logits (a fresh drafter has seen no pass yet); learning moves them within a few steps.
PRIOR = {("own", 1): 0.0, ("own", 2): 0.6, ("own", 3): 1.0, ("own", 4): 1.4, ("ssd", 1): 0.0,
         ("ssd", 2): 0.4, ("ssd", 3): 0.8, ("ssd", 4): 1.2, ("rest", 1): 0.0, ("rest", 2): 0.4,
         ("rest", 3): 0.8, ("rest", 4): 1.2, ("dyn", 0): 0.6, ("dyn", 1): 0.0,
         ("frz", 0): 0.2, (PICK, 0): 0.0, (PICK, 1): -0.3,
         (PICK, 2): -0.6, (PICK, 3): -0.9, ("agree", 2): 0.5, ("agree", 3): 0.8}


def read_scores(path: str | Path) -> tuple[dict, str]:
    """A scores file as tools/build_default_scores.py writes it (gzipped JSON: {"fingerprint": the
    tokenizer's, "scores": Scorer.state()}): (the scorer's state, the fingerprint). OSError when it
    cannot be read, ValueError when it is not such a file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            saved = json.load(f)
        Scorer().load_state(saved["scores"])  # raises on anything but a scorer's state
        return saved["scores"], str(saved["fingerprint"])
    except (KeyError, TypeError, EOFError) as e:  # (a bad gzip or JSON is a ValueError or OSError already)
        raise ValueError(f"not a scores file: {type(e).__name__}: {e}") from None


@lru_cache(maxsize=1)
def _shipped_scores() -> tuple[dict, str] | None:
    if not SHIPPED_SCORES.is_file():
        return None
    try:
        return read_scores(SHIPPED_SCORES)
    except (OSError, ValueError) as e:
        log.warning("the shipped scores %s are unreadable (%s: %s); starting from the defaults",
                    SHIPPED_SCORES, type(e).__name__, e)
        return None


def shipped_scores(fingerprint: str | None = None) -> dict | None:
    """The scorer's weights learned by replaying `auto` over the default model's own answers (the
    shipped datastore's, each with a datastore and a frozen table that leave it out:
    tools/build_default_scores.py), as Scorer.state() gives them; read once per process. None when
    missing or learned for another tokenizer than `fingerprint`'s. A new drafter drafts better
    from them than from PRIOR until it has learned on its own (docs/BENCHMARKS.md §4, §5), but a
    server's 8 lanes ran slower from them (§10), so they are used only when asked for (scores=True)."""
    shipped = _shipped_scores()
    if shipped is None or fingerprint not in (None, shipped[1]):
        return None
    return shipped[0]


def _bucket(n: int) -> int:
    return n if n < 4 else 4 if n < 6 else 6 if n < 10 else 10


def _frac(part: int, whole: int) -> int:
    """How many of the parent's continuations go through this node: all, most, some, few."""
    return 3 if part >= whole else 2 if 2 * part >= whole else 1 if 4 * part >= whole else 0


class _Trie:
    """Candidates of one step, placed only as far as they are looked at. Node i: tokens[i],
    parents[i] (-1 = root's child), depth[i]; per source the strongest evidence for the node and
    the number of continuations through it.

    A continuation added below a node whose children nobody has asked for yet waits there
    (`tails`); `open(node)` places the first token of every continuation waiting at the node (its
    children) and leaves the rest waiting at them. The drafter opens the nodes it takes and the
    nodes on the model's path when it learns, so most of the ~900 candidates a budget of 63 gathers
    are never placed. `order[i]` is the node's place in the order every continuation would have been
    placed at once (call, then continuation, then position: the first that reaches the node), so
    ties, children's order and evidence come out as if every continuation had been placed whole."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.order: list[int] = []
        self.child: dict[int, int] = {}  # (parent + 1) << 32 | token -> node
        self.kids: dict[int, list[int]] = {}  # node (-1: the root) -> its children, in order of arrival
        self.ev: list[dict] = []  # per node: source -> (match length or rank, position in path)
        self.count: dict[str, dict[int, int]] = {}  # retrieved source -> continuations through each node (-1: all)
        self.tails: dict[int, list | None] = {-1: []}  # node -> continuations waiting below it (None: opened)
        self.calls = 0  # add_all calls so far (the first part of `order`)
        self.root = -1  # the root's token (the last one of the history)

    def add(self, parent: int, tokens: Sequence[int], source: str, strength: int, weight: int = 1) -> None:
        """One continuation of `source` below `parent` (-1: the root), with its strength (a match's
        length, or a table follower's rank); a retrieved source's continuations are counted, `weight`
        times each."""
        self.add_all(parent, (tokens,), source, strength, weight)

    def add_all(self, parent: int, continuations: Sequence[Sequence[int]], source: str, first: int = 0,
                weight: int = 1, weights: Sequence[int] | None = None) -> None:
        """add() for each continuation, in one call, as a lookup or a retrieval adds dozens: the k-th
        with strength first + k (a table's followers of the parent's token, by rank), or with
        `weights` (a retrieval's continuations, identical ones grouped: how many times each came)
        each with strength `first` and its own weight. Below an opened node the first tokens are
        placed now, the rest wait at them."""
        call = self.calls << 40
        self.calls += 1
        counted = source in RETRIEVED
        ranked = weights is None
        waiting = [(cont, 0, source, first + k if ranked else first, weight if ranked else weights[k],
                    call | k << 20, counted) for k, cont in enumerate(continuations) if len(cont)]
        if counted:
            counts = self.count.setdefault(source, {})
            if parent < 0:
                counts[-1] = counts.get(-1, 0) + sum(w[4] for w in waiting)
        tails = self.tails[parent]
        if tails is None:
            self._place(parent, waiting)
        else:
            tails.extend(waiting)

    def open(self, node: int) -> list[int]:
        """Place what waits below `node`; its children, in order of arrival."""
        tails = self.tails[node]
        if tails is not None:
            self.tails[node] = None
            self._place(node, tails)
        return self.kids.get(node, [])

    def open_all(self) -> None:
        """Place every candidate (tests look at the whole trie)."""
        todo = [-1]
        while todo:
            todo.extend(self.open(todo.pop()))

    def _place(self, parent: int, waiting: list) -> None:
        child, evs, depth, tails, count = self.child, self.ev, self.depth, self.tails, self.count
        tokens, parents, order = self.tokens, self.parents, self.order
        kids = self.kids.setdefault(parent, [])
        d = (depth[parent] if parent >= 0 else 0) + 1
        high = (parent + 1) << 32
        for item in waiting:
            cont, j, source, strength, w, key, counted = item
            t = cont[j]
            nxt = child.get(high | t)
            if nxt is None:
                nxt = child[high | t] = len(tokens)
                tokens.append(t)
                parents.append(parent)
                depth.append(d)
                order.append(key | j)
                evs.append({source: (strength, j)})
                kids.append(nxt)
                tails[nxt] = []
            else:
                ev = evs[nxt]
                old = ev.get(source)
                if old is None or strength > old[0]:
                    ev[source] = (strength, j)
            if counted:
                counts = count[source]
                counts[nxt] = counts.get(nxt, 0) + w
            if j + 1 < len(cont):
                rest = tails[nxt]
                if rest is None:  # opened already: placed at once
                    self._place(nxt, [(cont, j + 1, source, strength, w, key, counted)])
                else:
                    rest.append((cont, j + 1, source, strength, w, key, counted))

    def features(self, i: int) -> list:
        """The node's features for the scorer: what each source says about it, which sources
        proposed it, its depth, and the token itself, alone and after its parent's token (some
        tokens and pairs the model takes far more often than their sources' evidence says)."""
        ev, p = self.ev[i], self.parents[i]
        token = self.tokens[i]
        before = self.tokens[p] if p >= 0 else self.root
        sources = tuple(ev)
        given = _FROM.get(sources)
        if given is None:
            given = _FROM[sources] = ("from",) + tuple(sorted(sources))
        d = self.depth[i]
        feats: list = [_DEPTH[d if d < 6 else 6], ("token", token), ("pair", hash((before, token)) & PAIR_MASK),
                       given]
        for source, (strength, j) in ev.items():
            feats.append(_AT[source][j if j < 3 else 3])
            if source in RETRIEVED:
                feats.append(_BUCKET[source][strength if strength < _BUCKETS else _BUCKETS])
                counts = self.count[source]
                whole = counts.get(p, 0)
                if whole:
                    feats.append((source + "%", _frac(counts.get(i, 0), whole)))
            else:
                feats.append(_RANK[source][strength if strength < 3 else 3])
        if len(sources) > 1:
            feats.append(_AGREE[len(sources) if len(sources) < 3 else 3])
        return feats

    def score(self, i: int, w: dict, bias: float) -> float:
        """Scorer.p(self.features(i)) for a scorer with weights w and bias, without building the
        list: the same weights added in the same order (the same bits). Every scored node of
        every step goes through here."""
        ev, p = self.ev[i], self.parents[i]
        token = self.tokens[i]
        get = w.get
        sources = tuple(ev)
        given = _FROM.get(sources)
        if given is None:
            given = _FROM[sources] = ("from",) + tuple(sorted(sources))
        d = self.depth[i]
        s = get(_DEPTH[d if d < 6 else 6], 0.0)
        s += get(("token", token), 0.0)
        s += get(("pair", hash((self.tokens[p] if p >= 0 else self.root, token)) & PAIR_MASK), 0.0)
        s += get(given, 0.0)
        for source, (strength, j) in ev.items():
            s += get(_AT[source][j if j < 3 else 3], 0.0)
            if source in RETRIEVED:
                s += get(_BUCKET[source][strength if strength < _BUCKETS else _BUCKETS], 0.0)
                counts = self.count[source]
                whole = counts.get(p, 0)
                if whole:
                    s += get(_FRAC[source][_frac(counts.get(i, 0), whole)], 0.0)
            else:
                s += get(_RANK[source][strength if strength < 3 else 3], 0.0)
        if len(sources) > 1:
            s += get(_AGREE[len(sources) if len(sources) < 3 else 3], 0.0)
        z = bias + s
        return 1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0

# features() builds the same tuples over and over: made once here (equal tuples, equal weights)
_DEPTH = [("depth", d) for d in range(7)]
_AT = {s: [(s + "@", j) for j in range(4)] for s in RETRIEVED + tuple(TABLE_SOURCES.values()) + (PICK,)}
_RANK = {s: [(s, k) for k in range(4)] for s in tuple(TABLE_SOURCES.values()) + (PICK,)}
_AGREE = [("agree", k) for k in range(4)]
_BUCKETS = 16  # a retrieved node's feature by its match length: _BUCKET[source][min(length, _BUCKETS)]
_BUCKET = {s: [(s, _bucket(n)) for n in range(_BUCKETS + 1)] for s in RETRIEVED}
_FRAC = {s: [(s + "%", f) for f in range(4)] for s in RETRIEVED}
_FROM: dict[tuple, tuple] = {}  # the sources of a node, in the order they came -> ("from", sorted...)


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(self, ssd: bool = True, ssd_path: str | Path | None = None, persist: bool = True,
                 frozen: str | Path | bool | None = None, fingerprint: str | None = None,
                 datastore: str | Path | bool | None = None, max_expand: int = 24, ssd_capacity: int = 4_000_000,
                 scores: str | Path | bool | None = None, recycle: bool | int = True):
        """ssd=False leaves out the cross-request buffer (ssd_path / persist / ssd_capacity are
        SsdDrafter's path / persist / capacity);
        frozen / fingerprint are CachebackDrafter's; datastore: a REST datastore folder; None = the
        shipped one (the default model's own answers) when the tokenizer is the one it was built
        with; False = none. scores: where the scorer starts (what it kept on disk, when persisted,
        replaces it): None or False = PRIOR; True = the shipped scores (shipped_scores) when the
        tokenizer is the one they were learned with, else PRIOR; a path = a scores file of
        tools/build_default_scores.py's format. The shipped scores draft better for a new
        drafter's first requests but ran slower with 8 requests at once (docs/BENCHMARKS.md §10).
        recycle: how many of the model's best tokens at each row of a pass (its pick first) are
        drafted after that row's token (the `pick` source): a number (0 = none), or True = the pick
        alone while passes run up to WIDE rows on average, RECYCLED once they run more (at ~8
        rows a pass on a 2-core CPU the next-best tokens drafted better but ran slower; at 32
        both better: docs/BENCHMARKS.md §4); False = none."""
        self.tables = CachebackDrafter(frozen=frozen, fingerprint=fingerprint)
        self.ssd = SsdDrafter(path=ssd_path, persist=persist, fingerprint=fingerprint,
                              capacity=ssd_capacity) if ssd else None
        self.rest = None
        if datastore is None:
            shipped = shipped_datastore(fingerprint)
            self.rest = RestDrafter(shipped) if shipped is not None else None
        elif datastore is not False:
            self.rest = RestDrafter(datastore, fingerprint=fingerprint)
        if not isinstance(recycle, int) or not 0 <= recycle <= 16:  # (a bool is an int)
            raise ValueError(f"recycle must be true, false or a number of tokens from 0 to 16, not {recycle!r}")
        self.max_expand = max_expand
        self.recycled = RECYCLED if recycle is True else int(recycle)
        self.when_wide = recycle is True  # the next-best tokens only while passes are wide
        self.rows = 0.0  # the rows of recent passes, on average (recycle)
        if scores is True:
            start = shipped_scores(fingerprint)
        elif scores is None or scores is False:
            start = None
        else:
            try:
                start = read_scores(scores)[0]
            except (OSError, ValueError) as e:
                raise CachebackError(f"auto: cannot read scores {scores}: {type(e).__name__}: {e}") from None

        def starting() -> Scorer:
            scorer = Scorer(PRIOR)
            if start is not None:
                scorer.load_state(start)
            return scorer

        self._last: _Trie | None = None  # the last step's candidates, labelled by the next observe
        self._pending: tuple[_Trie, list[int]] | None = None  # candidates and the model's tokens: catch_up
        self.labelled = 0
        # What the scorer learned in earlier runs and other processes: kept beside SSD's store (one
        # per tokenizer) when that is kept on disk, so a one-off `generate` starts from it too; and
        # every drafter on that store in this process (a server's lanes) learns into one scorer.
        self.scores_path = self.ssd.path / SCORES_FILE if self.ssd is not None and self.ssd.persist else None
        self.kept = None
        if self.scores_path is None:
            self.scorer = starting()
        else:
            self.kept = KeptScores.of(self.scores_path, starting, start=None if not scores else str(scores))
            self.scorer = self.kept.scorer
        self.reset()

    # -- state ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.tables.reset()
        if self.ssd is not None:
            self.ssd.reset()
        self.seq: list[int] = []
        self.pos: list[dict[tuple, list[int]]] = [{} for _ in range(MAX_K + 1)]
        self.picks: dict[int, tuple] = {}  # token -> the model's latest best tokens after it (recycle)
        self.catch_up()  # (what the last pass taught the scorer is kept: the scorer outlives a reset)
        self._last = None

    def observe(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        self.catch_up()  # the pass before's labels, where nobody called catch_up since
        if self._last is not None:  # the tokens the model produced after the last proposal
            self._pending = (self._last, tokens)
            self._last = None
            if self.scorer.bias_n < YOUNG:  # a scorer that has learned little learns at once
                self.catch_up()
        self.tables.observe(tokens)
        if self.ssd is not None:
            self.ssd.observe(tokens)
        self._index(tokens)

    def catch_up(self) -> None:
        """Label the last proposal's candidates with the tokens the model produced (the scorer's
        learning, most of observe's time). observe() leaves it here once the scorer has learned
        YOUNG labels, for the engine to call while the next pass runs (Drafter.catch_up); the next
        proposal is then scored without them, one pass late."""
        if self._pending is not None:
            trie, tokens = self._pending  # opened along the model's path as the labelling walks it
            self._pending = None
            self.labelled += self.scorer.learn_trie(trie.tokens, trie.parents, trie.features, tokens,
                                                    _Opening(trie))

    @property
    def alternatives(self) -> int:
        """How many next-best tokens recycle() wants beside each pick (Drafter.alternatives)."""
        if self.recycled <= 1 or (self.when_wide and self.rows <= WIDE):
            return 0
        return self.recycled - 1

    def recycle(self, picks: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        self.rows += 0.1 * (len(picks) - self.rows)
        if self.recycled:
            n = self.recycled
            self.picks.update((t, best[:n]) for t, best in picks)

    def learn(self, tokens: Sequence[int]) -> None:
        """Text beside the sequence (an editor's code below the cursor): the tables learn it, and
        the own-history index too, between separators so no continuation runs into or out of it."""
        self.tables.learn(tokens)
        self._index([GAP] + [int(t) for t in tokens] + [GAP])

    def end_request(self) -> None:
        self.catch_up()
        self._last = None
        if self.ssd is not None:
            self.ssd.end_request()
        if self.kept is not None:
            self.kept.request_done()

    def close(self) -> None:
        """Save what the scorer learned, and let go of it (the next drafter on the store reads the
        file once no other drafter of this process learns into it)."""
        self.catch_up()
        if self.kept is not None:
            self.kept.release()
            self.kept = None

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

    def _retrieved(self, trie: _Trie, history: Sequence[int], retriever: SsdDrafter | RestDrafter,
                   source: str) -> None:
        """The continuations `retriever` (the SSD buffer or a REST datastore) holds after the
        history, merged into the trie (identical ones once, weighted by their count)."""
        n, conts = retriever.continuations(history, 16, self._length, MAX_COUNT)
        if not n:
            return
        grouped: dict[tuple, int] = {}
        for cont in conts:
            grouped[cont] = grouped.get(cont, 0) + 1
        trie.add_all(-1, list(grouped), source, n, weights=list(grouped.values()))

    def _table_followers(self, token: int) -> list[tuple[str, list]]:
        """The followers of `token` in Cacheback's tables, labelled by source (dyn, frz), and the
        model's latest best tokens after it, its pick first (pick)."""
        out = [(TABLE_SOURCES[table], followers)
               for table, followers in self.tables.followers((token,), self._followers)]
        best = self.picks.get(token)
        if best is not None:
            out.append((PICK, [(t,) for t in best]))
        return out

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        self._last = None
        if budget <= 0 or not history:
            return DraftTree.empty()
        trie = _Trie()
        trie.root = int(history[-1])
        self._length = min(LENGTH, budget)
        self._followers = min(TABLE_FOLLOWERS, max(4, budget // 4))
        self._own(trie, history)
        if self.ssd is not None:
            self._retrieved(trie, history, self.ssd, "ssd")
        if self.rest is not None:
            self._retrieved(trie, history, self.rest, "rest")
        self._last = trie
        return self._best_first(trie, history[-1], budget, max_branching == 1)

    def _lookup(self, trie: _Trie, node: int, token: int) -> None:
        """The tables' followers of `token` become children of `node` (or add evidence to them)."""
        for source, followers in self._table_followers(token):
            trie.add_all(node, followers, source)

    def _best_first(self, trie: _Trie, root_token: int, budget: int, chain: bool) -> DraftTree:
        """The `budget` most probable nodes, best first. Best-first search from the root: the most
        probable node not yet taken is taken next, opened and looked up in the tables (its
        followers become its children, or evidence for children it has: at most `max_expand`
        lookups, the root's included), and only then are its children scored. A child's path
        probability never exceeds its parent's, so nodes come out in order of path probability
        (ties: the shallower, then the older) and only the children of taken nodes are ever
        scored. chain: one path, the most probable child at each level."""
        lookups = min(self.max_expand, 4 + budget // 2)
        score, depth, order = trie.score, trie.depth, trie.order
        w, bias = self.scorer.w, self.scorer.bias
        trie.open(-1)
        self._lookup(trie, -1, root_token)
        heap = [(-score(c, w, bias), depth[c], order[c], c) for c in trie.kids.get(-1, ())]
        heapq.heapify(heap)
        taken: list[int] = []
        path: list[float] = []
        while heap and len(taken) < budget:
            neg, _, _, node = heapq.heappop(heap)
            taken.append(node)
            path.append(-neg)
            kids = trie.open(node)
            if len(taken) < lookups:  # (the last node's too: its followers are labelled after the pass)
                self._lookup(trie, node, trie.tokens[node])
            if len(taken) == budget:  # its children would never be taken
                break
            children = [(neg * score(c, w, bias), depth[c], order[c], c) for c in kids]
            if chain:  # only this node's children remain candidates
                heap = [min(children)] if children else []
            else:
                for item in children:
                    heapq.heappush(heap, item)
        new = {old: k for k, old in enumerate(taken)}
        return DraftTree([trie.tokens[i] for i in taken],
                         [-1 if trie.parents[i] < 0 else new[trie.parents[i]] for i in taken], path)


class _Opening:
    """A trie's children by node for Scorer.learn_trie, each node opened as it is asked for."""

    def __init__(self, trie: _Trie):
        self.trie = trie

    def get(self, node: int, default=()) -> list[int]:
        return self.trie.open(node) or list(default)
