"""Never slower than plain decoding: where no draft is ever accepted, the passes the planner sends
cost at most a few percent more than one-row steps, whatever a row costs; where drafts are
accepted, it never chooses rows that lose time."""

import random

from cacheback_mlx.budget import Sizer
from cacheback_mlx.costs import SIZES, CostTable
from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.replay import decode
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.models import llama

# pass cost by rows, relative to one row: a CPU at ~1.5B float32 (2-8 rows ~1.1-1.2x), a GPU's
# flat curve, and a compute-bound one where every row costs almost a step
CURVES = {
    "cpu": {1: 1, 2: 1.18, 4: 1.13, 8: 1.12, 16: 1.35, 32: 2.2, 64: 4.0},
    "flat": {1: 1, 2: 1.02, 4: 1.03, 8: 1.05, 16: 1.1, 32: 1.2, 64: 1.5},
    "steep": {1: 1, 2: 1.9, 4: 3.5, 8: 7, 16: 14, 32: 28, 64: 56},
}


def table(curve: dict) -> CostTable:
    pts = sorted(curve)
    rel = {r: float(np.interp(r, pts, [curve[p] for p in pts])) for r in SIZES}
    return CostTable({c: {r: 0.05 * x * (1 + c / 8192) for r, x in rel.items()} for c in (256, 1024)})


class Wrong(Drafter):
    """Drafts tokens the stream never holds; with scores, it claims they are likely."""

    name = "wrong"

    def __init__(self, scored: bool, branching: int = 1):
        self.scored, self.branching, self.rng = scored, branching, random.Random(0)

    def propose(self, history, budget, max_branching=None):
        parents = [-1 if i < self.branching else i - self.branching for i in range(budget)]
        tokens = [self.rng.randrange(50_000, 60_000) for _ in range(budget)]
        depth = [1 if p < 0 else 0 for p in parents]
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return DraftTree(tokens, parents, [0.9 ** d for d in depth] if self.scored else None)


class Right(Drafter):
    """Drafts the stream itself, with honest scores of a drafter right 70% of the time a token."""

    name = "right"

    def __init__(self, stream):
        self.stream = stream

    def propose(self, history, budget, max_branching=None):
        nxt = self.stream[len(history) : len(history) + budget]
        return DraftTree.chain(nxt) if not len(nxt) else DraftTree(nxt, np.arange(-1, len(nxt) - 1),
                                                                     0.7 ** np.arange(1, len(nxt) + 1))


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("drafter", ["scored", "unscored", "scored-tree"])
def test_no_draft_accepted_costs_under_three_percent(curve, drafter):
    """400 tokens of a stream no draft matches: the passes sent (exploration and probes
    included) take at most 3% longer than 400 one-row steps; runs at most 0.97x."""
    cost = table(CURVES[curve])
    sizer = Sizer(cost)
    history = list(range(50))
    out = list(range(1000, 1400))
    d = Wrong(drafter != "unscored", branching=3 if drafter == "scored-tree" else 1)
    r = decode(d, history, out, budget=63, sizer=sizer, clock=lambda rows, ctx: cost.cost(rows, ctx))
    plain = sum(cost.cost(1, 50 + i) for i in range(len(out)))
    assert r.steps == len(out)  # nothing accepted
    assert plain / r.pass_seconds >= 0.97, (curve, drafter, plain / r.pass_seconds)


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_accepted_drafts_never_cost_time(curve):
    """Drafts that are accepted at the rate their scores say: the planner's passes beat one-row
    steps (or equal them where rows are too dear to pay)."""
    cost = table(CURVES[curve])
    stream = list(range(1000, 1400))
    history = list(range(50))
    r = decode(Right(history + stream), list(history), stream, budget=63, sizer=Sizer(cost),
               clock=lambda rows, ctx: cost.cost(rows, ctx))
    plain = sum(cost.cost(1, 50 + i) for i in range(len(stream)))
    assert plain / r.pass_seconds >= 0.99 and (curve == "steep" or plain / r.pass_seconds > 1.5)


class Recorded(Sizer):
    """A Sizer that keeps the rows of every pass the engine ran (what it reports by `timed`). It
    decides by the table alone (no correction from the passes' own times, which on a busy machine
    would move its prices away from the table the test judges its passes by)."""

    def __init__(self, cost):
        super().__init__(cost, learn=False)
        self.passes: list[tuple[int, int]] = []

    def timed(self, rows, context, seconds, ahead=False):
        self.passes.append((rows, context))
        super().timed(rows, context, seconds, ahead)


@pytest.fixture(scope="module")
def random_model():
    """Random weights on a real vocabulary, scaled so greedy decoding does not loop: drafts from
    its own history are (almost) never accepted."""
    mx.random.seed(1)
    args = llama.ModelArgs(model_type="llama", vocab_size=8192, hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    m.update(tree_map_with_path(lambda p, w: w * 4.0 if p.endswith("weight") and w.ndim == 2 else w, m.parameters()))
    m.eval()
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("curve", ["cpu", "steep"])
def test_auto_on_a_random_model_sends_what_costs_under_three_percent(random_model, curve):
    """The engine with `auto` and the planner on random weights: greedy output equals plain
    decoding's, and the passes it ran cost (by the table) at most 3% more per token."""
    prompt = [(37 * i + 11) % 8000 + 1 for i in range(40)]
    plain = Engine(random_model, eos_ids=[], drafter=make_drafter("none"), context_length=4096, draft_budget=0)
    want = [t for step in plain.generate(prompt, 160) for t in step]
    assert len(set(want)) > 40  # a varied stream, not a loop the drafter could follow
    cost = table(CURVES[curve])
    sizer = Recorded(cost)
    eng = Engine(random_model, eos_ids=[], drafter=make_drafter("auto", persist=False), context_length=4096,
                 sizer=sizer)
    got = [t for step in eng.generate(prompt, 160) for t in step]
    assert got == want
    later = sizer.passes[1:]  # the first pass also holds the prompt's tail
    spent = sum(cost.cost(rows, ctx) for rows, ctx in later)
    one_row = np.mean([cost.cost(1, ctx) for _, ctx in later])
    plain_s = (eng.stats.tokens - 1) * one_row  # what one-row steps take for the same tokens
    assert plain_s / spent >= 0.97, plain_s / spent
    assert eng.stats.tokens / eng.stats.passes < 1.1  # nothing to gain here: few drafts accepted


def test_the_prompt_s_tail_goes_where_its_rows_cost_less():
    """Up to LEAD_TAIL uncached prompt tokens lead the first pass, unless this machine's prefill
    has shown them to cost far less there than in a pass (a pass that costs each row anew)."""
    from cacheback_mlx.planner import LEAD_TAIL, CostPlanner

    for curve, want in (("flat", LEAD_TAIL), ("cpu", LEAD_TAIL), ("steep", 1)):
        plan = CostPlanner(Sizer(table(CURVES[curve])), 63)
        assert plan.lead_tail(150, 0) == LEAD_TAIL  # nothing prefilled yet: the rows priced alike
        assert plan.lead_tail(20, 0) == 20 and plan.lead_tail(1, 0) == 1
        step = plan.sizer.price(1, 0)
        plan.prefilled(128, 0, 128 * step / 4)  # a prompt token costs a quarter of a step in prefill
        assert plan.lead_tail(150, 0) == want, curve
    assert CostPlanner(Sizer(table(CURVES["flat"])), 63, recurrent=True).lead_tail(150, 0) == 1


def test_a_tail_that_costs_somewhat_more_in_a_pass_leads_only_when_it_saves_a_prefill_call():
    """A tail whose rows cost 1.6x in the pass what prefilling them costs (a mixture-of-experts
    model's cost ~1.5x on the CPU): prefilled with the rest of a long prompt, but a short new turn, all of it
    uncached, still leads the first pass (it saves a prefill call of its own)."""
    from cacheback_mlx.planner import LEAD_TAIL, CostPlanner

    plan = CostPlanner(Sizer(table(CURVES["cpu"])), 63)
    for ratio, long_tail in ((1.6, 1), (1.1, LEAD_TAIL)):
        extra = plan.sizer.price(LEAD_TAIL, 0) - plan.sizer.price(1, 0)
        plan.prefill_rate = extra / (ratio * (LEAD_TAIL - 1))
        assert plan.lead_tail(150, 0) == long_tail, ratio
        assert plan.lead_tail(LEAD_TAIL, 0) == LEAD_TAIL, ratio  # all that is uncached: 2x slack
        extra = plan.sizer.price(30, 0) - plan.sizer.price(1, 0)
        plan.prefill_rate = extra / (ratio * 29)
        assert plan.lead_tail(30, 0) == 30, ratio
    plan.prefill_rate = extra / (2.5 * 29)  # far dearer in the pass: prefilled even when all that is left
    assert plan.lead_tail(30, 0) == 1


def test_a_prompt_whose_tail_costs_more_in_a_pass_is_prefilled_whole(random_model):
    """The first pass then holds the last prompt token and its drafts only; the output is plain
    decoding's. Without a prefill seen before, the request's own prefill (all but the tail) decides."""
    prompt = [(37 * i + 11) % 8000 + 1 for i in range(150)]
    plain = Engine(random_model, eos_ids=[], drafter=make_drafter("none"), context_length=4096, draft_budget=0)
    want = [t for step in plain.generate(prompt, 12) for t in step]
    for curve, seen, first_rows in (("steep", True, lambda r: r < 8), ("flat", True, lambda r: r >= 48),
                                    ("steep", False, lambda r: r < 8)):
        sizer = Recorded(table(CURVES[curve]))  # (its seconds: a model far bigger than this one)
        eng = Engine(random_model, eos_ids=[], drafter=make_drafter("auto", persist=False), context_length=4096,
                     sizer=sizer)
        if seen:  # as if this machine had prefilled before: a prompt token at a quarter of a step
            eng.planner.prefill_rate = sizer.price(1, 0) / 4
        got = [t for step in eng.generate(prompt, 12) for t in step]
        assert got == want, curve
        assert first_rows(sizer.passes[0][0]), (curve, seen, sizer.passes[0])


def test_where_steps_run_ahead_a_draft_must_pay_for_the_head_start_it_costs():
    """Sizer.ahead_saving: while most plain steps run ahead (each 10% cheaper), a pass with drafts
    also costs the next step its head start, so a single draft sure at 95% no longer pays for a
    pass of 2 rows priced at 1.9x a step; with no steps run ahead it does, and the saving is 0."""
    cost = CostTable({256: {1: 1.0, 2: 1.9, 4: 2.2}})
    one = DraftTree([7], [-1], [0.95])
    for ahead, sent in ((False, 1), (True, 0)):
        sizer = Sizer(cost)
        for i in range(60):  # plain steps: 1.0 s without running ahead, 0.9 s with
            sizer.timed(1, 300, 1.0 if i % 10 == 0 or not ahead else 0.9, ahead=ahead and i % 10 != 0)
        assert (sizer.ahead_saving() > 0.05) == ahead
        assert len(sizer.choose(one, 1, 300)) == sent, ahead
