"""When a plain step starts the next one before its token is read (Engine.set_run_ahead, on a GPU).

Running ahead pays where the device runs a step while Python builds the next one, as mlx-lm's loop
does: on an H200 the default model's plain steps took 4.69 ms a token with it against 5.23 without
(docs/BENCHMARKS.md §15). It costs the drafter: a step already started when the drafter drafts
again takes the place of the drafted pass, which comes a token later; and a pass with drafts stops
it until enough plain passes follow. How many plain passes in a row to wait for depends on how
often drafts are sent: where they are rare (a pass of 2 rows costs 2.2x a step on that GPU at
135M), every drafted pass that stops running ahead for 8 passes costs more than it gains; where
they are common (passes of 2-64 rows 1.5-1.8x a step) running ahead at once costs drafted passes.
So the rule waits for `quiet` plain passes in a row (Engine.RUN_AHEAD_QUIET, 8), or for one while
fewer than SPARSE of recent passes sent drafts. On the recorded streams (`python -m tools.ab.run_ahead`,
chosen on the even half, checked on the odd one), priced by the H200's costs it took 3.2% / 3.7% less
pass time than always waiting for 8 (0.987x / 0.989x `none`'s speed against 0.955x / 0.952x), and
priced by the cheaper passes what waiting for 8 took, within 0.5%; with drafts also priced at the head
start they cost (budget.Sizer.ahead_saving), 0.994x / 0.994x against 0.970x / 0.966x, and within ~1%
of waiting for 8 on the cheaper passes (docs/BENCHMARKS.md §15).
"""

from __future__ import annotations


class RunAhead:
    """Counts the passes of one engine: `passed` after each, `ready` asks whether the plain step
    just run may start the next one."""

    SPARSE = 1 / 3  # below this share of recent passes with drafts, one plain pass is enough
    RATE = 0.05  # each pass's weight in that share (about the last 20 passes)

    def __init__(self, quiet: int = 8, sparse: float | None = None):
        """quiet: plain passes in a row to wait for while drafts are common; sparse: the share of
        recent passes with drafts under which one is enough (default SPARSE; 0: always `quiet`)."""
        self.quiet = quiet
        self.sparse = self.SPARSE if sparse is None else sparse
        self.share = 0.5  # of recent passes that sent drafts: an even start waits for `quiet` at first
        self.plain = 0  # plain passes in a row (this request's)

    def start(self) -> None:
        """A new request: its passes in a row start from none."""
        self.plain = 0

    def passed(self, drafts: bool) -> None:
        """A pass ran, with drafts or without (a plain step)."""
        self.plain = 0 if drafts else self.plain + 1
        self.share += self.RATE * (float(drafts) - self.share)

    def ready(self) -> bool:
        return self.plain >= (1 if self.share < self.sparse else self.quiet)
