"""What a verify pass costs on this machine, by rows and cached tokens: a measured table, or a
prior learned from the engine's own passes, and the file each is kept in.

A process never measures in front of a user's request. It starts from what the cost file holds:
- a measured table (CostTable: every row count 1..16, 24, 32, 64 at two cache lengths, timed
  round-robin; `bench --verify-cost`, or `serve` in its idle time: Measurement, one pass a step);
- else a prior (PriorCost): a soft roofline, cost(r)^2 = t1^2 + (r * t_row)^2, a one-row step's
  time against each row's compute, fitted from the passes and prefills the engine times anyway.
  Only the shape matters to the sizer (the draft size that maximises tokens per second does not
  change when every price doubles), so before the first timed pass it uses a per-backend ratio.
One lock beside the cost file: a process that finds another measuring goes on with its prior and
reads the table when it appears. A table whose rounds disagree, or whose one-row pass is far
slower than the engine's own one-row passes, was measured under load and is not kept.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from filelock import FileLock, Timeout

from .tree import DraftTree
from .verify import padded_size

log = logging.getLogger(__name__)

# Rows measured: every count up to 16, then 24, 32 and 64 (~25 s in all for the default model on
# a 2-core CPU). Not just powers of two: a BLAS's matrix product runs fastest on row counts its
# kernels tile exactly, so on this project's CPU 8 rows cost less than 5, 6 or 7, and 16 less
# than 13 to 15. Past 16 a pass is padded to the next measured count (Sizer.rows).
SIZES = tuple(range(1, 17)) + (24, 32, 64)
CONTEXTS = (256, 1024)  # cached tokens measured (attention over a longer cache costs more per row)
FORMAT = "cacheback-verify-cost/3"
NOISY = 1.25  # rounds of a measurement whose median cell is this much slower than its fastest: under load


class CostTable:
    """Seconds per pass by (cached tokens, rows), interpolated between measured points."""

    kind = "measured"

    def __init__(self, table: dict[int, dict[int, float]], buckets: tuple[int, ...] | None = None):
        self.contexts = sorted(int(c) for c in table)
        self.table = {int(c): {int(r): float(t) for r, t in rows.items()} for c, rows in table.items()}
        if not self.contexts or any(not rows for rows in self.table.values()):
            raise ValueError("empty cost table")
        self.buckets = buckets

    @property
    def sizes(self) -> list[int]:
        """The row counts measured at every context."""
        return sorted(set.intersection(*(set(rows) for rows in self.table.values())))

    def _at(self, context: int, rows: int) -> float:
        points = self.table[context]
        sizes = sorted(points)
        rows = padded_size(rows, self.buckets)  # a pass padded to its bucket costs what the bucket costs
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes) and sizes[i] == rows:
            return points[rows]
        lo, hi = (sizes[-2], sizes[-1]) if i >= len(sizes) else (sizes[max(i - 1, 0)], sizes[i])
        if lo == hi:
            return points[lo]
        return points[lo] + (points[hi] - points[lo]) * (rows - lo) / (hi - lo)

    def cost(self, rows: int, context: int = 0) -> float:
        """Seconds for a pass of `rows` rows over `context` cached tokens."""
        cs = self.contexts
        if len(cs) == 1:
            return self._at(cs[0], rows)
        j = min(max(bisect.bisect_left(cs, context), 1), len(cs) - 1)
        lo, hi = cs[j - 1], cs[j]
        context = min(max(context, lo), 4 * hi)  # extrapolate past the longest measured, not wildly
        a, b = self._at(lo, rows), self._at(hi, rows)
        return max(a + (b - a) * (context - lo) / (hi - lo), 1e-9)

    def observe(self, rows: int, context: int, seconds: float) -> bool:
        """A measured table does not move (the sizer corrects its prices: budget.PassTimes)."""
        return False

    def to_json(self) -> dict:
        return {"format": FORMAT, "kind": self.kind,
                "seconds": {str(c): {str(r): t for r, t in rows.items()} for c, rows in self.table.items()}}


class PriorCost:
    """A pass's cost before a table is measured: cost(r, c) = t1 + r * t_row * (1 + att * c).
    A pass pays once for reading every weight and for its launch (t1), and each row its compute
    (t_row), which attention over c cached tokens adds to (att). On this project's CPU the
    default model's measured passes of 1..64 rows lie within ~10% of such a line; on a GPU, where
    a few rows cost little more than one, the fitted t_row comes out small. Before the first timed
    pass, att comes from the model's shape and t_row / t1 from the backend (RATIO); then t1, t_row
    and, once passes over two ranges of cached tokens were timed, att are fitted to the engine's
    timed passes and prefill chunks (per band of rows and range of cached tokens the fastest of
    the recent ones: a busy spell only slows), after 1, 2, 4, ... observations."""

    kind = "learned"
    RATIO = {"cpu": 0.04, "gpu": 0.01}  # t_row / t1 before any timed pass, by backend
    KEEP = 16  # recent observations kept per band of rows and range of cached tokens
    SMALL = 128  # fit only passes up to this many rows once two bands of them were seen
    CONTEXTS = np.array([512, 1536, 3072])

    def __init__(self, att: float, ratio: float | None = None, t1: float = 1.0,
                 buckets: tuple[int, ...] | None = None, seen: int = 0):
        ratio = (self.RATIO["gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"] if ratio is None
                 else ratio)
        self.att, self.t1, self.t_row = float(att), float(t1), float(ratio) * float(t1)
        self.buckets = buckets
        self.seen = seen  # observations taken (those of earlier processes included)
        self.sizes = list(SIZES)  # monotone in rows: padding to a larger count never pays
        self.contexts: list[int] = []
        self.points: dict[tuple[int, int], collections.deque] = {}
        self._taken = 0

    @staticmethod
    def for_model(model, buckets: tuple[int, ...] | None = None) -> "PriorCost":
        from .footprint import config, head_dim, param_count

        cfg = config(model)
        heads, dim = cfg.get("num_attention_heads"), head_dim(model)
        layers = cfg.get("num_hidden_layers")
        params = param_count(model)
        att = 2.0 * layers * heads * dim / params if heads and dim and layers and params else 3e-4
        return PriorCost(att, buckets=buckets)

    def cost(self, rows: int, context: int = 0) -> float:
        rows = padded_size(max(rows, 1), self.buckets)
        return self.t1 + rows * self.t_row * (1.0 + self.att * max(context, 0))

    def observe(self, rows: int, context: int, seconds: float) -> bool:
        """A pass (or prefill chunk) of `rows` rows over `context` cached tokens took `seconds`;
        True when this refitted the line."""
        if seconds <= 0 or rows < 1:
            return False
        key = (int(np.searchsorted(self.CONTEXTS, context, side="right")), int(np.searchsorted(BANDS, rows)))
        self.points.setdefault(key, collections.deque(maxlen=self.KEEP)).append((rows, max(context, 0), seconds))
        self.seen += 1
        self._taken += 1
        if self._taken & (self._taken - 1) == 0 or self._taken % 512 == 0:  # 1, 2, 4, ... then every 512
            self.fit()
            return True
        return False

    def fit(self) -> None:
        points = [min(q, key=lambda o: o[2]) for q in self.points.values()]
        small = [p for p in points if p[0] <= self.SMALL]
        if len({p[0] for p in small}) >= 2:
            points = small
        r, c, s = (np.array(v, float) for v in zip(*points))
        ratio = self.t_row / self.t1
        if len(set(c // 512)) >= 2 and len(points) >= 3:  # s = t1 + t_row r + t_row att r c
            (x, y, z), *_ = np.linalg.lstsq(np.stack([1 / s, r / s, r * c / s], 1), np.ones(len(s)), rcond=None)
            if x > 0 and y > 0 and z >= 0:
                self.t1, self.t_row, self.att = float(x), float(y), float(z / y)
                return
        q = r * (1.0 + self.att * c)
        if len(set(q)) >= 2:  # relative errors: a pass of 64 rows does not outweigh one of 2
            (x, y), *_ = np.linalg.lstsq(np.stack([1 / s, q / s], 1), np.ones(len(s)), rcond=None)
            if x > 0 and y >= 0:
                self.t1, self.t_row = float(x), float(y)
                return
        self.t1 = float(np.median(s / (1.0 + ratio * q)))  # one band seen: keep the shape, fit the scale
        self.t_row = ratio * self.t1

    def fastest_step(self) -> float | None:
        """The fastest pass of one row seen, or None."""
        times = [o[2] for q in self.points.values() for o in q if o[0] == 1]
        return min(times) if times else None

    def to_json(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "t1": self.t1, "t_row": self.t_row, "att": self.att,
                "seen": self.seen}


BANDS = np.array([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512])


def from_json(data: dict, buckets: tuple[int, ...] | None = None) -> CostTable | PriorCost:
    if data.get("format") != FORMAT:
        raise ValueError("not a verify-cost file of this version")
    if data.get("kind") == PriorCost.kind:
        t1 = float(data["t1"])
        if not t1 > 0 or not float(data["t_row"]) >= 0:
            raise ValueError("a learned cost needs t1 > 0 and t_row >= 0")
        return PriorCost(float(data["att"]), float(data["t_row"]) / t1, t1, buckets, int(data.get("seen", 0)))
    return CostTable({int(c): {int(r): float(t) for r, t in rows.items()} for c, rows in data["seconds"].items()},
                     buckets)


class Measurement:
    """Times passes of every (cached tokens, rows) cell, round-robin, `repeats` rounds after a
    warm-up round (a new shape may compile; its passes are trees), keeping each cell's fastest: a
    busy machine slows some passes, never speeds them up, and round-robin over contexts and sizes
    alike spreads a slow spell over all of them. step() does one prefill chunk or one pass, so a server can
    measure between requests. Uses its own caches (the model's real ones are not touched); each
    pass is undone."""

    CHUNK = 64  # tokens of a context's prefill per step

    def __init__(self, model, sizes=SIZES, contexts=CONTEXTS, repeats: int = 3, vocab: int = 32,
                 buckets: tuple[int, ...] | None = None):
        from .kvcache import ModelCache

        self.model, self.vocab, self.buckets, self.repeats = model, vocab, buckets, repeats
        self.rows = sorted({padded_size(s, buckets) for s in sizes})
        self.caches = {c: ModelCache(model) for c in sorted(contexts)}
        self.filled = {c: 0 for c in self.caches}
        self.times = {c: {r: [] for r in self.rows} for c in self.caches}
        self._cells = [(rnd, r, c) for rnd in range(repeats + 1) for r in self.rows for c in self.caches]
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._cells)

    def step(self) -> bool:
        """One prefill chunk or one timed pass; False once everything is measured."""
        from .verify import prefill, verify_pass

        for c, cache in self.caches.items():
            if self.filled[c] < c:
                n = min(self.CHUNK, c - self.filled[c])
                prefill(self.model, cache, [(100 + i) % self.vocab for i in range(self.filled[c], self.filled[c] + n)])
                self.filled[c] += n
                return True
        if self.done:
            return False
        rnd, r, c = self._cells[self._next]
        self._next += 1
        tokens = [(7 + i) % self.vocab for i in range(r - 1)]
        # timed rounds: chains; the warm-up round: a branching tree of as many rows, so the kernels
        # a tree pass takes (per-row positions, masks, gathered keys: compiled at first use on a
        # GPU, seconds each on a fresh machine) are built here rather than in the first decoding
        draft = DraftTree.chain(tokens) if rnd else DraftTree(tokens, [(i - 1) // 2 for i in range(len(tokens))])
        t0 = time.perf_counter()
        mx.eval(verify_pass(self.model, self.caches[c], [5], draft, self.buckets))
        t = time.perf_counter() - t0
        self.caches[c].finish_pass([], whole=False)
        if rnd:
            self.times[c][r].append(t)
        return not self.done

    def table(self) -> CostTable:
        return CostTable({c: {r: min(ts) for r, ts in rows.items()} for c, rows in self.times.items()}, self.buckets)

    def spread(self) -> float:
        """The median over cells of (a cell's median round / its fastest): ~1 on a quiet machine."""
        return float(np.median([np.median(ts) / min(ts) for rows in self.times.values() for ts in rows.values()]))


def measure(model, sizes=SIZES, contexts=CONTEXTS, repeats: int = 3, vocab: int = 32,
            buckets: tuple[int, ...] | None = None) -> CostTable:
    """A whole Measurement at once (bench --verify-cost, tools)."""
    m = Measurement(model, sizes, contexts, repeats, vocab, buckets)
    while m.step():
        pass
    return m.table()


def plan_measurement(model, context_length: int, vocab: int, buckets) -> Measurement:
    """The cells a model's table measures, within its context."""
    contexts = tuple(c for c in CONTEXTS if c + max(SIZES) < context_length) or (max(1, context_length // 4),)
    sizes = tuple(s for s in SIZES if contexts[-1] + s < context_length)
    return Measurement(model, sizes, contexts, vocab=vocab, buckets=buckets)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_path(model_key: str) -> Path:
    """Where a model's cost is kept: one file per (model, dtype, device, machine, mlx,
    attention.py's CPU attention: off, or which version of it, activations.py's SwiGLU, the
    weights' layout (blas.py), the GPU kernels in use (kernels/) and this file's format)."""
    from . import activations, attention, blas, kernels

    ident = "|".join([FORMAT, model_key, str(mx.default_device()), cpu_name(), mx.__version__]
                     + [f"attention/{attention.VERSION}" if attention.enabled else "mlx-attention"]
                     + ([f"swiglu/{activations.VERSION}"] if activations.enabled else [])
                     + (["weights [in, out]"] if blas.weight_layout_wanted() else [])
                     + [key for key in [kernels.cost_key()] if key])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheback-mlx" / "verify-cost" / (hashlib.sha256(ident.encode()).hexdigest()[:16] + ".json")


class CostFile:
    """A model's cost file and the lock beside it (one measurement per machine and model)."""

    def __init__(self, model_key: str):
        self.key = model_key
        self.path = cost_path(model_key)
        self.lock = FileLock(str(self.path.with_suffix(".lock")))
        self.known = 0.0  # passes the file was last seen to hold learned from (inf: a measured table)

    def read(self, buckets=None) -> CostTable | PriorCost | None:
        """What the file holds, or None (absent or unreadable: the prior then)."""
        if not self.path.is_file():
            return None
        try:
            cost = from_json(json.loads(self.path.read_text()), buckets)
            self.known = cost.seen if isinstance(cost, PriorCost) else float("inf")
            return cost
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("verify cost: %s is unreadable (%s); starting from the prior", self.path, e)
            return None

    def write(self, cost: CostTable | PriorCost) -> bool:
        """Write atomically (a reader never sees half a file); call holding the lock."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**cost.to_json(), "model": self.key, "device": str(mx.default_device()),
                                       "cpu": cpu_name(), "mlx": mx.__version__}, indent=1))
            os.replace(tmp, self.path)
            self.known = cost.seen if isinstance(cost, PriorCost) else float("inf")
            return True
        except OSError as e:
            log.warning("verify cost: cannot save %s: %s", self.path, e)
            return False

    def try_lock(self, wait: float = 0.0) -> bool:
        """Take the lock; False when another process holds it past `wait` seconds."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.lock.acquire(timeout=wait)
            return True
        except (Timeout, OSError):
            return False

    def unlock(self) -> None:
        self.lock.release()

    @contextlib.contextmanager
    def hold(self, wait: float = 0.0):
        """The lock for the block: True, or False when another process holds it past `wait` s."""
        held = self.try_lock(wait)
        try:
            yield held
        finally:
            if held:
                self.unlock()

    def keep_learned(self, prior: PriorCost) -> bool:
        """Save what the engine's passes taught the prior, unless the file holds a measured table
        or a prior learned from as many passes (so processes that learn alike write it once)."""
        if self.known * 4 > prior.seen:  # as far as this process knows, the file holds as much
            return False
        with self.hold() as held:
            if not held:
                return False
            old = self.read()
            if isinstance(old, CostTable) or (isinstance(old, PriorCost) and old.seen * 4 > prior.seen):
                return False
            return self.write(prior)

    def keep_measured(self, m: Measurement, reference: float | None = None) -> CostTable | None:
        """The measured table, saved if it was measured on a quiet machine (its rounds agree, and
        its one-row pass is not far slower than `reference`, the engine's fastest one-row pass);
        None when not kept. Call holding the lock."""
        table = m.table()
        one = table.cost(1, table.contexts[0])
        if m.spread() > NOISY or (reference is not None and one > 1.5 * reference):
            log.warning("verify cost: measured under load (rounds %.2fx apart; one row %.1f ms); not kept",
                        m.spread(), 1e3 * one)
            return None
        self.write(table)
        return table


def load_or_measure(model, model_key: str, context_length: int, buckets: tuple[int, ...] | None = None,
                    vocab: int = 32, remeasure: bool = False) -> CostTable:
    """The measured table for this model and machine, measured now if there is none (bench,
    `bench --verify-cost`: in front, waiting for another process that is measuring)."""
    f = CostFile(model_key)
    old = None if remeasure else f.read(buckets)
    if isinstance(old, CostTable):
        return old
    with f.hold(wait=3600) as held:
        old = None if remeasure or not held else f.read(buckets)
        if isinstance(old, CostTable):
            return old
        print("cacheback-mlx: measuring the cost of a verify pass for this model and machine "
              f"(kept in {f.path.parent})", file=sys.stderr, flush=True)
        m = plan_measurement(model, context_length, vocab, buckets)
        from . import cores

        with cores.share.busy():
            while m.step():
                cores.share.adjust()
        if held:
            f.keep_measured(m)
        return m.table()
