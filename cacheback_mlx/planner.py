"""How big each verify pass is: the engine asks its planner, one of two kinds.

- FixedPlanner: every pass drafts up to a fixed budget (`--fixed-budget`, sharded models); the
  lead's extra rows come out of that budget.
- CostPlanner: every pass takes as many drafts as pay for their rows by the pass cost
  (budget.Sizer over costs.py's table or prior), at most a cap.

The engine calls, per pass: draft_cap (how many drafts to ask the drafter for), drafted (how long
the drafter took for them), plan (the drafts to send and the rows the pass runs as, padding
included), and after the accept step record (what the pass cost and which drafts were accepted),
learned from at catch_up while the next pass runs; prefilled hears each prefill chunk's time.
"""

from __future__ import annotations

from .budget import Sizer
from .tree import DraftTree
from .verify import padded_size

LEAD_TAIL = 48  # at most this many uncached prompt tokens go through the first pass (Engine._start)


class FixedPlanner:
    """Every pass drafts up to `budget` tokens, the lead's extra rows taken out of them."""

    sizer = None

    def __init__(self, budget: int, buckets: tuple[int, ...] | None = None):
        self.budget, self.buckets = budget, buckets

    def lead_tail(self, uncached: int, cached: int) -> int:
        """A new turn's text is prefilled; its last token leads the first pass."""
        return 1

    def draft_cap(self, lead: int, cached: int, limit: int) -> int:
        return min(self.budget - (lead - 1), limit)

    def plan(self, tree: DraftTree, lead: int, cached: int) -> tuple[DraftTree, int]:
        return tree, padded_size(lead + len(tree), self.buckets)

    def record(self, rows: int, cached: int, seconds: float, tree: DraftTree, path: list[int],
               accepted: list[int], ahead: bool = False) -> None:
        pass

    def catch_up(self) -> None:
        pass

    def prefilled(self, rows: int, cached: int, seconds: float) -> None:
        pass

    def drafted(self, asked: int, seconds: float) -> None:
        pass


class CostPlanner:
    """Each pass takes the drafts that maximise expected tokens per second (Sizer), at most
    `budget`; a short uncached prompt tail shares the first pass with them (its rows are priced
    like the drafts'), except on recurrent models, which undo a pass not accepted whole."""

    def __init__(self, sizer: Sizer, budget: int, buckets: tuple[int, ...] | None = None,
                 recurrent: bool = False):
        self.sizer, self.budget, self.buckets = sizer, budget, buckets
        sizer.pad = not recurrent  # padded rows would run the recurrence
        self.recurrent = recurrent
        self.prefill_rate: float | None = None  # seconds a token in prefill chunks here (running mean)

    def lead_tail(self, uncached: int, cached: int) -> int:
        """How many of a prompt's `uncached` last tokens go through the first pass, with its drafts,
        rather than through prefill: up to LEAD_TAIL (a short new turn then takes no prefill call
        of its own), unless those rows would cost more in the pass (by the pass-cost table) than
        prefilling them has cost here, times TAIL_SLACK where the tail is all the prompt left (it
        then saves a prefill call too), else times PREFILLING_SLACK (the rest is prefilled anyway,
        and the tail's tokens would only join it): every row of a pass also runs the output head and
        the last layer's attention output and feed-forward, which prefill never evaluates (no
        cache needs them), and where a pass costs each row anew (MLX's 4-bit matmul on
        the CPU) or each row reads other experts (mixture-of-experts layers) the tail's rows cost
        more than their prefill (then 1: only the last token leads). Recurrent models: 1 (a pass
        not accepted whole is undone)."""
        tail = min(LEAD_TAIL, uncached)
        if self.recurrent or tail <= 1:
            return 1
        if self.prefill_rate is None:  # nothing prefilled here yet: the rows priced alike
            return tail
        extra = self.sizer.price(tail, cached) - self.sizer.price(1, cached)
        slack = self.TAIL_SLACK if tail == uncached else self.PREFILLING_SLACK
        return tail if extra <= slack * (tail - 1) * self.prefill_rate else 1

    # Both costs are estimates. On a 2-core x86 CPU a 150-token prompt's 48-token tail costs the
    # default model ~0.9x in a pass what it costs in prefill, a mixture-of-experts model ~1.5x
    # (its first token then came 16% later than mlx-lm's), and a 4-bit model on MLX's CPU path
    # about three times as much (docs/BENCHMARKS.md §5).
    TAIL_SLACK = 2.0
    PREFILLING_SLACK = 1.25

    def draft_cap(self, lead: int, cached: int, limit: int) -> int:
        limit = min(self.budget, limit)
        return min(limit, self.sizer.cap(limit, cached))

    def plan(self, tree: DraftTree, lead: int, cached: int) -> tuple[DraftTree, int]:
        tree = self.sizer.choose(tree, lead, cached)  # as many nodes as pay for their rows
        rows = self.sizer.pass_rows(lead + len(tree), cached)  # padded where more rows cost less
        return tree, padded_size(rows, self.buckets)

    def record(self, rows: int, cached: int, seconds: float, tree: DraftTree, path: list[int],
               accepted: list[int], ahead: bool = False) -> None:
        """A pass ran (`ahead`: the plain step started before the last pass's token was read)."""
        self.sizer.timed(rows, cached, seconds, ahead)  # what a pass of this size really costs here
        self.sizer.update(tree, path, accepted)

    def catch_up(self) -> None:
        """While the next pass runs: the sizer learns from the last one (Sizer.update)."""
        self.sizer.catch_up()

    def prefilled(self, rows: int, cached: int, seconds: float) -> None:
        self.sizer.prefilled(rows, cached, seconds)
        if rows >= 16 and seconds > 0:  # chunks of a few tokens pay mostly for the call
            rate = seconds / rows
            self.prefill_rate = rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate

    def drafted(self, asked: int, seconds: float) -> None:
        self.sizer.drafted(asked, seconds)
