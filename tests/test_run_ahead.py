"""The rule that decides when a plain step starts the next one (run_ahead.RunAhead)."""

import subprocess
import sys
from pathlib import Path

from cacheback_mlx.drafters.base import Drafter, NoDrafter
from cacheback_mlx.replay import replay
from cacheback_mlx.run_ahead import RunAhead
from cacheback_mlx.tree import DraftTree


def passes(rule, drafts):
    """Feed passes (True: it sent drafts) and say after each whether the rule was ready."""
    out = []
    for d in drafts:
        rule.passed(d)
        out.append(rule.ready())
    return out


def test_at_first_it_waits_for_quiet_plain_passes_in_a_row():
    rule = RunAhead(quiet=8)
    assert passes(rule, [False] * 7) == [False] * 7
    assert passes(rule, [False]) == [True]
    assert passes(rule, [True]) == [False]  # a pass with drafts stops it


def test_once_drafts_are_rare_one_plain_pass_is_enough():
    rule = RunAhead(quiet=8)
    passes(rule, [False] * 40)
    assert rule.share < RunAhead.SPARSE
    assert passes(rule, [True, False]) == [False, True]


def test_where_drafts_are_common_it_keeps_waiting_for_quiet_passes():
    rule = RunAhead(quiet=8)
    seen = passes(rule, [True, False] * 40)
    assert rule.share > RunAhead.SPARSE and not any(seen)
    assert passes(rule, [False] * 6) == [False] * 6  # 7 plain passes in a row: not yet
    assert passes(rule, [False]) == [True]


def test_a_new_request_starts_its_count_and_keeps_what_was_learned():
    rule = RunAhead(quiet=8)
    passes(rule, [False] * 40)
    share = rule.share
    rule.start()
    assert not rule.ready() and rule.share == share
    assert passes(rule, [False]) == [True]


def test_sparse_zero_always_waits_for_quiet():
    rule = RunAhead(quiet=3, sparse=0)
    assert passes(rule, [False] * 50)[:3] == [False, False, True]
    assert passes(rule, [True, False, False, False]) == [False, False, False, True]


class Loop(Drafter):
    """Drafts the recorded stream's next tokens only where the history is in `on` (else nothing)."""

    name = "loop"

    def __init__(self, stream, start, on):
        super().__init__()
        self.stream, self.start, self.on = stream, start, on

    def propose(self, history, budget, max_branching=None):
        at = len(history) - self.start
        if at not in self.on:
            return DraftTree.empty()
        return DraftTree.chain(self.stream[at : at + min(budget, 3)])

    def observe(self, tokens):
        pass


def test_a_replay_runs_plain_steps_ahead_as_the_engine_does():
    """replay(ahead=...): the pass after a plain one the rule allowed is that plain step, priced as
    clock(0, ...), whatever was drafted for it; the stream still comes out whole."""
    out = list(range(100, 140))
    prompt = [1, 2, 3]
    seen = []

    def clock(rows, context):
        seen.append(rows)
        return 1.0

    r = replay(NoDrafter(), prompt, out, 8, clock=clock, ahead=RunAhead(quiet=8, sparse=0))
    assert r.tokens == len(out) and r.steps == len(out)
    assert r.ahead == len(out) - 8 and seen.count(0) == r.ahead and seen[:8] == [1] * 8
    # drafts at tokens 20, 21 and 30: at 20 a step already started takes the pass (its drafts
    # dropped), at 21 the drafter's pass runs; then 8 plain passes are waited for again, which
    # the drafts at 30 interrupt, and the 6 plain ones after them are too few
    seen.clear()
    r = replay(Loop(out, len(prompt), {20, 21, 30}), prompt, out, 8, clock=clock, ahead=RunAhead(quiet=8, sparse=0))
    assert r.tokens == len(out) and seen[20] == 0 and seen[21] == 4
    assert r.ahead == 20 - 8 + 1 and seen.count(4) == 2 and seen.count(0) == r.ahead
    assert replay(NoDrafter(), prompt, out, 8, clock=clock).ahead == 0  # no rule: nothing runs ahead


def test_the_run_ahead_tool_refuses_bad_passes_in_one_line():
    out = subprocess.run([sys.executable, "-m", "tools.ab.run_ahead", "--costs",
                          "tools/data/verify_cost_h200_smollm2_float16.json", "--passes", "2:9"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode != 0 and "bad --costs or --passes" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
