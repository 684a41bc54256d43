"""The auto drafter (merged sources, scored nodes) and the per-step draft budget (budget.py)."""

import json
import math
import random

from cacheback_mlx import costs
from cacheback_mlx.budget import RankRates, Sizer, best_size, known_outcomes
from cacheback_mlx.costs import CostTable, load_or_measure, measure
from cacheback_mlx.drafters import auto, make_drafter
from cacheback_mlx.drafters.auto import RECYCLED, WIDE, AutoDrafter
from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.drafters.scorer import Scorer
from cacheback_mlx.engine import Engine
from cacheback_mlx.replay import SHARED_STREAMS, load_streams, replay
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter

PROMPT = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8]


def flat_costs(per_row: float, rows: int = 80) -> np.ndarray:
    """costs[r] = 1 + per_row * (r - 1): a linear synthetic cost curve (index 0 unused)."""
    return np.array([1.0] + [1.0 + per_row * (r - 1) for r in range(1, rows + 1)])


# -- the budget rule -------------------------------------------------------------------------
def test_budget_rule_drafts_nothing_when_nothing_is_accepted():
    assert best_size(np.zeros(40), 1, flat_costs(0.01)) == 0
    assert best_size(np.full(40, 1e-4), 1, flat_costs(0.001)) == 0


def test_budget_rule_takes_the_whole_budget_when_drafts_are_always_right():
    assert best_size(np.ones(40), 1, flat_costs(0.2)) == 40
    assert best_size(np.ones(63), 1, flat_costs(0.0)) == 63


def test_budget_rule_follows_a_synthetic_cost_curve():
    rng = np.random.default_rng(0)
    for _ in range(50):  # brute force over every size, random curves and decaying scores
        scores = np.cumprod(rng.uniform(0.3, 1.0, 30))
        costs = np.concatenate([[1.0], np.cumsum(rng.uniform(0.0, 0.5, 40)) + 1.0])
        rate = [(1 + scores[:n].sum()) / costs[1 + n] for n in range(31)]
        assert best_size(scores, 1, costs) == int(np.argmax(rate))
    # a step curve (a GPU bucket): rows up to 8 cost the same, then a pass costs 2x
    step = np.array([1.0] + [1.0 if r <= 8 else 2.0 for r in range(1, 80)])
    chain = 0.8 ** np.arange(1, 31)  # a chain: each token accepted with 0.8 given its parent
    assert best_size(chain, 1, step) == 7
    # the lead's rows come out of the same curve (recurrent models after an undone pass)
    assert best_size(chain, 3, step) == 5


def test_cost_table_interpolates_rows_contexts_and_buckets():
    t = CostTable({256: {1: 1.0, 8: 1.2, 16: 2.0}, 1024: {1: 1.0, 8: 2.0, 16: 3.0}})
    assert t.cost(8, 256) == pytest.approx(1.2)
    assert t.cost(12, 256) == pytest.approx(1.6)  # halfway between 8 and 16
    assert t.cost(32, 256) == pytest.approx(3.6)  # past the last point: the last slope (0.1/row) goes on
    assert t.cost(8, 640) == pytest.approx(1.6)  # halfway between the two contexts
    assert t.cost(8, 0) == pytest.approx(1.2)  # below the shortest: the shortest
    gpu = CostTable({256: {1: 1.0, 8: 1.5, 16: 1.5}}, buckets=(1, 8, 16))
    assert gpu.cost(3) == gpu.cost(8) == 1.5
    assert costs.from_json(t.to_json()).cost(12, 640) == pytest.approx(t.cost(12, 640))
    with pytest.raises(ValueError):
        costs.from_json({"format": "x"})


def test_sizer_caps_and_sizes_trees_from_a_fake_cost_table():
    sizer = Sizer(CostTable({256: {1: 1.0, 8: 1.1, 16: 1.5, 32: 3.0}}), pad=False, learn=False)  # interpolated between
    assert sizer.cap(63, 100) == 18  # about twice what recent passes used (8 at the start)
    assert sizer.cap(5, 100) == 5  # --draft-budget still caps
    sure = DraftTree.chain(list(range(15)))
    sure = DraftTree(sure.tokens, sure.parents, np.ones(15))
    for _ in range(20):
        assert len(sizer.choose(sure, 1, 100)) == 15
    assert sizer.cap(63, 100) == 20  # then the cost: 21 rows cost 1.97x one token, 22 rows 2.06x
    hopeless = DraftTree(sure.tokens, sure.parents, np.full(15, 0.01))
    assert len(sizer.choose(hopeless, 1, 100)) == 0


def test_drafts_asked_only_to_fill_a_padded_pass_stay_a_small_share_of_it():
    """A GPU-like table (a pass of 2-64 rows ~1.6x a step, 64 the cheapest): a pass with one draft
    runs as 64 rows, so without knowing what drafting costs the drafter is asked for 63 drafts;
    once it is known, only as many as take DRAFT_SHARE of the pass (drafts that are used still
    raise the cap, and a cheap drafter is still asked for all 63)."""
    flat = {1: 0.007, 2: 0.0120, 4: 0.0117, 8: 0.0116, 16: 0.0113, 32: 0.0119, 64: 0.0110}
    sizer = Sizer(CostTable({256: flat}), learn=False)
    hopeless = DraftTree([1, 2], [-1, 0], np.full(2, 0.001))
    for _ in range(60):
        assert len(sizer.choose(hopeless, 1, 0)) == 0
    assert sizer.rows(2, 0) == 64 and sizer.cap(63, 0) == 63
    sizer.drafted(63, 63 * 40e-6)  # 40 us a draft asked: 63 drafts take 23% of a 64-row pass
    assert sizer.cap(63, 0) == int(0.03 * 0.0110 / 40e-6) == 8
    sizer.drafted(8, 8 * 40e-6)
    assert sizer.cap(63, 0) == 8
    cheap = Sizer(CostTable({256: flat}), learn=False)
    cheap.drafted(63, 63 * 1e-6)
    assert cheap.cap(63, 0) == 63
    sure = DraftTree(np.arange(40), np.arange(-1, 39), np.ones(40))
    for _ in range(40):
        sizer.choose(sure, 1, 0)
    assert sizer.cap(63, 0) > 40  # drafts that are sent: twice what recent passes used


# Pass seconds by rows as measured on this project's CPU at 256 cached tokens (x one row): the
# BLAS tiles 4, 8 and 16 rows exactly, so 8 rows cost less than 5, 6 or 7.
CPU_CURVE = {1: 1.0, 2: 1.14, 3: 1.18, 4: 1.14, 5: 1.36, 6: 1.46, 7: 1.28, 8: 1.12, 9: 1.22, 10: 1.37,
             11: 1.42, 12: 1.45, 13: 1.57, 14: 1.71, 15: 1.56, 16: 1.41, 24: 1.78, 32: 2.15}


def test_passes_are_padded_to_the_cheapest_measured_row_count_and_filled_with_drafts():
    sizer = Sizer(CostTable({256: CPU_CURVE}), learn=False)
    assert [sizer.rows(r, 0)
            for r in (1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 25, 40)] == [1, 8, 8, 8, 8, 8, 8, 9, 16, 17, 25, 40]
    for r in range(2, 17):  # the cheapest measured count at or above r
        assert sizer.costs(0)[r] == min(t for s, t in CPU_CURVE.items() if s >= r)
    # past the counts measured one by one, a count runs as itself at its interpolated cost
    assert sizer.costs(0)[20] == pytest.approx((1.41 + 1.78) / 2)
    # steps that sent nothing lower the recent use, but the drafter is still asked for the 7
    # drafts that fill the 8 rows any pass with a draft runs as
    hopeless = DraftTree([1, 2], [-1, 0], np.full(2, 0.001))
    for _ in range(60):
        assert len(sizer.choose(hopeless, 1, 0)) == 0
    assert sizer.used < 0.1 and sizer.cap(63, 0) == 7
    assert Sizer(CostTable({256: CPU_CURVE}), pad=False, learn=False).cap(63, 0) == 18  # 2 x 8 + 2
    assert sizer.costs(0)[6] == pytest.approx(1.12)
    assert sizer.costs(0)[1] == 1.0  # a one-row step is the plain step, never padded
    chain = DraftTree.chain(list(range(20)))
    decaying = DraftTree(chain.tokens, chain.parents, 0.6 ** np.arange(1, 21))
    # 5 rows cost 1.36x without padding and were not worth it; padded, the pass takes 7 drafts,
    # filling all 8 rows for the price of 8 (the 9th node would add a row that costs more)
    assert len(sizer.choose(decaying, 1, 0)) == 7
    assert len(Sizer(CostTable({256: CPU_CURVE}), pad=False, learn=False).choose(decaying, 1, 0)) in (3, 7)
    short = DraftTree(chain.tokens[:4], chain.parents[:4], np.full(4, 0.9))  # all the drafter had
    assert len(sizer.choose(short, 1, 0)) == 4 and sizer.rows(5, 0) == 8
    flat = Sizer(CostTable({256: CPU_CURVE}), pad=False, learn=False)
    assert [flat.rows(r, 0) for r in (5, 6, 13)] == [5, 6, 13] and flat.costs(0)[6] == pytest.approx(1.46)


def simulate(sizer, truth, passes, rng, speed=lambda i: 1.0):
    """Send `passes` passes of random decaying chains through `sizer`, timing each at the true
    curve `truth` (rows -> seconds) times the machine's speed at that pass and 3% noise."""
    for i in range(passes):
        chain = DraftTree.chain(list(range(24)))
        tree = sizer.choose(DraftTree(chain.tokens, chain.parents, np.cumprod(rng.uniform(0.4, 0.98, 24))), 1, 300)
        rows = sizer.pass_rows(1 + len(tree), 300)
        sizer.timed(rows, 300, truth[rows] * speed(i) * rng.uniform(0.97, 1.03))


def rate(sizer, trees, truth) -> float:
    """Expected tokens per true second of the sizer's choices on these trees."""
    tokens = seconds = 0.0
    for tree in trees:
        n = len(sizer.choose(tree, 1, 300))
        tokens += 1 + tree.scores[:n].sum()
        seconds += truth[sizer.rows(1 + n, 300)]
    return tokens / seconds


def test_a_cost_table_priced_wrong_is_corrected_from_the_passes_own_times():
    """As in a live run of 2026-11-24: a slow spell while the table was measured priced 9 and 24 rows
    too low and one row too high. Learned from the passes it sends, the sizer ends up choosing as
    well as one that knew the true curve, though the machine slows down by 30% half way."""
    truth = {r: t for r, t in CPU_CURVE.items()}
    truth.update({r: 1.41 + (1.78 - 1.41) * (r - 16) / 8 for r in range(17, 24)})
    truth.update({r: 1.78 + (2.15 - 1.78) * (r - 24) / 8 for r in range(25, 33)})
    skewed = {**CPU_CURVE, 1: 1.12, 9: 0.98, 24: 1.40}
    rng = np.random.default_rng(0)
    chain = DraftTree.chain(list(range(24)))
    trees = [DraftTree(chain.tokens, chain.parents, np.cumprod(rng.uniform(0.4, 0.98, 24))) for _ in range(200)]
    best = rate(Sizer(CostTable({256: truth}), learn=False), trees, truth)
    fooled = rate(Sizer(CostTable({256: skewed}), learn=False), trees, truth)
    learner = Sizer(CostTable({256: skewed}))
    simulate(learner, truth, 1200, rng, speed=lambda i: 1.0 if i < 600 else 1.3)
    learner.learn = False  # rated on its prices alone, no trial passes
    assert fooled < 0.97 * best  # the skew costs (9-row passes that really cost 1.22x)
    assert rate(learner, trees, truth) > 0.995 * best
    assert learner.factor(9) / learner.factor(8) > 1.15  # the truth: 1.22 / 1.12 against 0.98 / 1.12
    assert learner.price(9, 300) > learner.price(8, 300)


def test_prices_learned_over_long_prompts_do_not_carry_to_short_ones():
    """As in a bench run of 2026-11-25: over ~2,000 cached tokens, 8-row passes cost 1.3x what the table
    (measured at shorter contexts) says against one-row steps; over 300 tokens the table is right.
    Learned over the long prompt first, the short one still gets the table's 8-row price."""
    table = CostTable({256: {1: 1.0, 2: 1.03, 4: 1.06, 8: 1.1, 16: 1.4}})
    sizer = Sizer(table)
    rng = np.random.default_rng(0)
    for context, skew in ((2000, 1.3), (300, 1.0)):
        for i in range(240):
            rows = (1, 8)[i % 2]
            true = table.cost(rows, context) * (skew if rows > 1 else 1.0)
            sizer.timed(rows, context, true * rng.uniform(0.97, 1.03))
    assert sizer.factor(8, 2000) / sizer.factor(1, 2000) > 1.2
    assert sizer.factor(8, 300) / sizer.factor(1, 300) == pytest.approx(1.0, abs=0.04)
    assert sizer.price(8, 300) / sizer.price(1, 300) == pytest.approx(1.1, abs=0.05)


def test_drafter_scores_are_calibrated_by_what_the_model_accepted():
    """A drafter whose scores promise half of what the model accepts gets its scores corrected,
    and the sizer then sends the drafts it dropped before; a calibrated drafter's stay as they are."""
    rng = np.random.default_rng(2)
    tree = DraftTree([11, 12], [-1, -1], np.array([0.06, 0.06]))  # two guesses at the next token
    for truth_factor, lo, hi in ((2.0, 1.7, 2.3), (1.0, 0.8, 1.2)):
        sizer = Sizer(CostTable({256: CPU_CURVE}), learn=False)
        before = len(sizer.choose(tree, 1, 0))  # 1.12 tokens expected for 1.12x a step: not worth it
        for _ in range(3000):
            u = rng.random() / truth_factor  # the model picks each guess with 0.06 x truth_factor
            sizer.update(tree, [0] if u < 0.06 else [1] if u < 0.12 else [])
        sizer.catch_up()
        f = sizer.calibration.factors()[np.searchsorted(sizer.calibration.EDGES, 0.06, side="right"), :2]
        assert (lo < f).all() and (f < hi).all(), (truth_factor, f)
        assert before == 0
        if truth_factor == 2.0:  # 1.24 tokens for 1.12x a step (3 rows run as 8): now worth it
            assert len(sizer.choose(tree, 1, 0)) == 2


def test_the_calibration_learns_from_candidates_that_were_not_sent():
    """A step that sends nothing (low scores) still shows how often such scores are accepted:
    the model's own token labels every candidate under the accepted path, sent or not."""
    tree = DraftTree([11, 12, 13], [-1, 0, -1], np.array([0.03, 0.02, 0.01]))
    assert known_outcomes(tree, [11, 12]).tolist() == [1, 1, 0]
    assert known_outcomes(tree, [11]).tolist() == [1, -1, 0]  # 12 lies past what is known
    assert known_outcomes(tree, [13, 5]).tolist() == [0, 0, 1]
    rng = np.random.default_rng(3)
    sizer = Sizer(CostTable({256: CPU_CURVE}), learn=False)
    assert len(sizer.choose(tree, 1, 0)) == 0  # 0.03 tokens expected: not worth a row
    for _ in range(2000):
        sent = sizer.choose(tree, 1, 0)
        assert len(sent) == 0 or sent.tokens[0] == 11
        pick = 11 if rng.random() < 0.3 else 7  # the model takes 11 ten times as often as scored
        sizer.update(sent, [0] if len(sent) and pick == 11 else [], [pick, 12])
    f = sizer.calibration.factors()[0, 0]  # score bin < 0.05, first place
    assert 6 < f < 12, f
    assert len(sizer.choose(tree, 1, 0)) >= 1  # 0.3 expected for ~1.1x a step: now worth sending


def test_the_sizer_learns_from_a_pass_at_catch_up_against_what_it_offered_for_it():
    """update() keeps what the pass was offered and sent; the calibration learns at catch_up()
    (the engine's call while the next pass runs) or at the next update(), whatever the next pass
    offered meanwhile: the same as learning at once, one pass later."""
    first = DraftTree([11, 12], [-1, 0], np.array([0.5, 0.4]))
    then = DraftTree([21, 22, 23], [-1, 0, -1], np.array([0.6, 0.3, 0.2]))
    at_once, late = (Sizer(CostTable({256: CPU_CURVE}), learn=False) for _ in range(2))
    for sizer in (at_once, late):
        sent = sizer.choose(first, 1, 0)
        assert len(sent)
        sizer.update(sent, [0], [11, 5])
    at_once.catch_up()
    before = late.calibration.hits.copy()
    late.choose(then, 1, 0)  # the next pass, planned before the last one is learned from
    assert np.array_equal(late.calibration.hits, before)
    late.catch_up()
    assert np.array_equal(late.calibration.hits, at_once.calibration.hits)
    assert np.array_equal(late.calibration.expected, at_once.calibration.expected)
    assert late.calibration.hits.sum() > before.sum()


def test_a_machine_that_slows_down_as_a_whole_changes_no_price():
    sizer = Sizer(CostTable({256: CPU_CURVE}))
    before = sizer.costs(300).copy()
    simulate(sizer, CPU_CURVE, 160, np.random.default_rng(1), speed=lambda i: 1.5)
    assert sizer.factors and all(f == pytest.approx(1.0, abs=0.04) for f in sizer.factors.values())
    assert np.allclose(sizer.costs(300), before, rtol=0.04)
    frozen = Sizer(CostTable({256: CPU_CURVE}), learn=False)  # learn=False: the table as measured
    frozen.timed(9, 300, 100.0)
    assert frozen.times.n == 0 and not frozen.factors


def test_the_engine_reports_every_pass_s_rows_and_time_to_the_sizer():
    model = zoo.tiny_model("llama")
    truth = reference(model, PROMPT * 3, 30)
    sizer = Sizer(CostTable({256: CPU_CURVE}))
    seen = []
    timed = sizer.timed
    sizer.timed = (lambda rows, context, seconds, ahead=False:
                   seen.append((rows, context, seconds, ahead)) or timed(rows, context, seconds, ahead))
    eng = Engine(model, eos_ids=[], drafter=OracleDrafter(PROMPT * 3, truth, 2), context_length=4096, sizer=sizer)
    sizes = []
    eng.watch(lambda e: e.kind == "verify" and sizes.append((e.rows, e.cached)))
    assert [t for s in eng.generate(PROMPT * 3, 30) for t in s] == truth
    assert [(r, c) for r, c, _, _ in seen] == sizes and all(s > 0 for _, _, s, _ in seen)
    assert sum(s for _, _, s, _ in seen) == pytest.approx(eng.stats.verify_s)
    assert not any(a for *_, a in seen)  # no step ran ahead here (the CPU's default)


def test_the_engine_pads_passes_and_stays_lossless_but_never_pads_recurrent_layers():
    table = CostTable({256: {1: 1.0, 2: 2.0, 3: 2.0, 8: 1.2}})  # 2 or 3 rows cost more than 8
    for family in ("llama", "gemma3_text", "qwen3_next"):
        model = zoo.tiny_model(family)
        truth = reference(model, PROMPT * 3, 30)
        eng = Engine(model, eos_ids=[], drafter=OracleDrafter(PROMPT * 3, truth, 2), context_length=4096,
                     sizer=Sizer(table))
        sizes = []
        eng.watch(lambda e: e.kind == "verify" and sizes.append((e.lead + e.drafts, e.rows)))
        assert [t for s in eng.generate(PROMPT * 3, 30) for t in s] == truth, family
        if family == "qwen3_next":
            assert all(n == size for n, size in sizes)
        else:
            assert any(n < size == 8 for n, size in sizes), family
            assert all(size == n or size == 8 for n, size in sizes)


def test_unscored_drafters_get_a_depth_and_rank_estimate_that_learns():
    rates = RankRates()
    tree = DraftTree([1, 9, 2, 8, 3, 4], [-1, -1, 0, 0, 2, 4])  # 1 2 3 4 with wrong siblings 9, 8
    cells = rates.cells(tree)
    assert cells.tolist() == [[1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [4, 0]]
    for _ in range(300):
        rates.update(tree, cells, [0, 2])  # the model takes 1, 2, then never 3
    s = rates.scores(tree, cells)
    assert s[0] > 0.95 and s[2] > 0.9 and s[1] < 0.05 and s[3] < 0.05 and s[4] < 0.05
    sizer = Sizer(CostTable({256: {1: 1.0, 8: 1.3, 64: 4.0}}), pad=False, learn=False)  # rows priced one by one
    sizer.rates = rates
    sent = sizer.choose(tree, 1, 0)  # best first: 1, then 2; the rest does not pay
    assert sent.tokens.tolist() == [1, 2] and sent.parents.tolist() == [-1, 0] and sent.scores is None
    sizer.update(sent, [0, 1])
    sizer.catch_up()  # (the engine's call while the next pass runs)
    assert rates.trials[2, 0] > 302  # learned from what was sent, in the drafter's own terms


# -- the scorer ------------------------------------------------------------------------------
def test_scores_converge_on_sources_with_known_acceptance_rates():
    rng = random.Random(0)
    scorer = Scorer()
    rates = {("src", 1): 0.3, ("src", 2): 0.8, ("other", 0): 0.05}
    for _ in range(30000):
        f = rng.choice(list(rates))
        scorer.update([f], rng.random() < rates[f])
    for f, p in rates.items():
        assert scorer.p([f]) == pytest.approx(p, abs=0.04), f


@pytest.mark.parametrize("floor", [0.03, 0.0])  # the default (its table ends at the floor); none
def test_scorer_steps_are_the_plain_gradient_rule_bit_for_bit(floor):
    """Scorer.update writes p() and the step sizes out (it runs for every labelled node): the
    weights after many updates equal, bit for bit, those of the rule written plainly, past the end
    of the step-size table too (a few features used thousands of times)."""
    rng = random.Random(1)
    feats = [("src", k) for k in range(4)] + [("depth", d) for d in range(3)]
    scorer = Scorer({("src", 0): 0.5}, floor=floor)
    w, n, bias, bias_n = {("src", 0): 0.5}, {}, -1.0, 0
    rate = lambda k: max(floor, 0.5 / math.sqrt(k))
    for _ in range(3000):
        fs = rng.sample(feats, rng.randint(1, 4))
        hit = rng.random() < 0.4
        z = bias + sum(w.get(f, 0.0) for f in fs)
        g = float(hit) - (1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0)
        bias_n += 1
        bias += g * rate(bias_n)
        for f in fs:
            n[f] = n.get(f, 0) + 1
            w[f] = w.get(f, 0.0) + g * rate(n[f])
        scorer.update(fs, hit)
    assert scorer.w == w and scorer.n == n and (scorer.bias, scorer.bias_n) == (bias, bias_n)
    assert scorer.p(feats[:3]) == 1.0 / (1.0 + math.exp(-scorer.logit(feats[:3])))


def test_every_candidate_is_labelled_against_the_model_s_tokens():
    seen = []

    class Spy(Scorer):
        def update(self, feats, accepted):
            seen.append((feats, accepted))

    # root -> 10 (-> 11 -> 12, -> 13), root -> 20; the model produced 10 11 99
    tokens, parents = [10, 20, 11, 13, 12], [-1, -1, 0, 0, 2]
    n = Spy().learn_trie(tokens, parents, lambda i: i, [10, 11, 99])
    assert seen == [(0, True), (1, False), (2, True), (3, False), (4, False)] and n == 5


# -- the auto drafter ------------------------------------------------------------------------
def test_auto_trees_are_scored_best_first_within_budget(tmp_path):
    d = AutoDrafter(ssd_path=tmp_path / "ssd.npy", persist=False)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 6 + [1, 2, 3, 40, 41, 1, 2, 3]
    d.observe(text)
    for budget in (1, 3, 7, 15, 40):
        tree = d.propose(text, budget)
        assert 0 < len(tree) <= budget and tree.scores is not None
        assert np.all(np.diff(tree.scores) <= 1e-12)  # best first: every prefix is the best tree
        for i, p in enumerate(tree.parents):
            assert p < i and (p < 0 or tree.scores[i] <= tree.scores[p])
        chain = d.propose(text, budget, max_branching=1)
        assert chain.is_chain() and len(chain) <= budget
    tree = d.propose(text, 7)
    assert {4, 40} <= {int(tree.tokens[c]) for c in tree.children()[0]}  # "1 2 3" was followed by both


def test_auto_retrieves_from_the_shipped_answers_of_the_default_model():
    """By default auto draws on the shipped datastore of the default model's own answers, for that
    model's tokenizer only (or unchecked offline); datastore=False leaves it out. A stretch of one
    of those answers is continued as the answer went on."""
    from cacheback_mlx.drafters.rest import SEP, SHIPPED, _shipped, shipped_datastore

    index = shipped_datastore()
    assert index is not None and index.n > 100_000
    fingerprint = _shipped()[1]
    assert shipped_datastore(fingerprint) is index and shipped_datastore("0" * 16) is None
    assert AutoDrafter(persist=False, fingerprint=fingerprint).rest.index is index
    assert AutoDrafter(persist=False, fingerprint="0" * 16).rest is None
    assert AutoDrafter(persist=False, datastore=False).rest is None

    tokens = np.load(SHIPPED)["tokens"]
    ends = np.flatnonzero(tokens == SEP)
    doc = tokens[ends[10] + 1 : ends[11]].tolist()  # the 12th answer
    assert len(doc) > 80
    history, following = doc[40:60], doc[60:63]
    for datastore, found in ((None, True), (False, False)):
        d = AutoDrafter(ssd=False, frozen=False, datastore=datastore)
        d.observe(history)
        tree = d.propose(history, 7)
        paths = set()
        for i in range(len(tree)):
            path = []
            while i >= 0:
                path.insert(0, int(tree.tokens[i]))
                i = int(tree.parents[i])
            paths.add(tuple(path))
        assert (tuple(following) in paths) is found


@pytest.mark.parametrize("damage", ["missing", "garbage", "truncated", "wrong dtype"])
def test_a_damaged_shipped_datastore_means_drafting_without_it(tmp_path, monkeypatch, caplog, damage):
    """A missing (stripped package) or unreadable shipped datastore leaves auto without that
    source, with a warning when the file is there but unreadable; never an error."""
    from cacheback_mlx.drafters import rest

    path = tmp_path / "self.npz"
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all")
    elif damage == "truncated":
        path.write_bytes(rest.SHIPPED.read_bytes()[:5000])
    elif damage == "wrong dtype":
        np.savez_compressed(path, tokens=np.zeros(10, np.float32), fingerprint=np.array("x"))
    monkeypatch.setattr(rest, "SHIPPED", path)
    rest._shipped.cache_clear()
    try:
        assert rest.shipped_datastore() is None
        assert AutoDrafter(persist=False).rest is None
        assert ("unreadable" in caplog.text) is (damage != "missing")
    finally:
        monkeypatch.undo()
        rest._shipped.cache_clear()
    assert rest.shipped_datastore() is not None


def test_a_new_auto_starts_from_prior_or_the_shipped_scores_for_their_tokenizer_only(tmp_path):
    """A drafter that has learned nothing starts from PRIOR (the default, or scores=False); with
    scores=True from the scores learned on the default model's own answers
    (tools/build_default_scores.py), for that tokenizer (or unchecked offline), from PRIOR for another
    tokenizer; scores=FILE from that file; a bad file is one line."""
    import gzip

    from cacheback_mlx.drafters import auto, rest
    from cacheback_mlx.errors import CachebackError

    state, fingerprint = auto._shipped_scores()
    assert fingerprint == rest._shipped()[1]  # the tokenizer of the shipped datastore: the default model's
    assert auto.shipped_scores(fingerprint) is state and auto.shipped_scores("0" * 16) is None
    assert len(state["w"]) > 10_000 and all(n >= 4 or n == 0 for _, _, n in state["w"])
    prior = Scorer(auto.PRIOR)
    shipped = Scorer()
    shipped.load_state(state)
    for kwargs in ({"scores": True}, {"fingerprint": fingerprint, "scores": True}):
        assert AutoDrafter(persist=False, **kwargs).scorer.w == shipped.w
    for kwargs in ({}, {"fingerprint": fingerprint}, {"fingerprint": "0" * 16, "scores": True}, {"scores": False}):
        d = AutoDrafter(persist=False, **kwargs)
        assert d.scorer.w == prior.w and d.scorer.bias == prior.bias
    mine = tmp_path / "mine.json.gz"
    with gzip.open(mine, "wt") as f:
        scores = {"version": 1, "bias": 0.5, "bias_n": 3, "w": [[["depth", 3], 1.5, 9]]}
        json.dump({"fingerprint": "x", "scores": scores}, f)
    d = AutoDrafter(persist=False, scores=mine)
    assert d.scorer.w == {("depth", 3): 1.5} and d.scorer.bias == 0.5
    for bad in (tmp_path / "missing.json.gz", tmp_path / "bad.json.gz"):
        if bad.name.startswith("bad"):
            bad.write_bytes(b"not gzip")
        with pytest.raises(CachebackError, match="cannot read scores") as e:
            AutoDrafter(persist=False, scores=bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["missing", "garbage", "not a scorer"])
def test_damaged_shipped_scores_mean_starting_from_prior(tmp_path, monkeypatch, caplog, damage):
    """A missing or unreadable shipped scores file: PRIOR, with a warning when it is there; never an error."""
    import gzip

    from cacheback_mlx.drafters import auto

    path = tmp_path / "scores.json.gz"
    if damage == "garbage":
        path.write_bytes(b"\x1f\x8b not really gzip")
    elif damage == "not a scorer":
        with gzip.open(path, "wt") as f:
            json.dump({"fingerprint": "x", "scores": {"version": 1, "bias": 0, "w": [["x", "y"]]}}, f)
    monkeypatch.setattr(auto, "SHIPPED_SCORES", path)
    auto._shipped_scores.cache_clear()
    try:
        assert auto.shipped_scores() is None
        assert AutoDrafter(persist=False, scores=True).scorer.w == Scorer(auto.PRIOR).w
        assert ("unreadable" in caplog.text) is (damage != "missing")
    finally:
        monkeypatch.undo()
        auto._shipped_scores.cache_clear()
    assert auto.shipped_scores() is not None


@pytest.mark.skipif(not (SHARED_STREAMS / "greedy_outputs.json").is_file(), reason="needs ../shared data")
def test_the_shipped_scores_draft_better_than_prior_for_a_new_drafter():
    """Exact MAT on recorded greedy streams of the default model, a new drafter for each (a fresh
    install's first requests; docs/BENCHMARKS.md §4 has every stream): the shipped scores, learned
    on other text (the model's own answers), beat the hand-set PRIOR (the default)."""
    streams = load_streams()[::8]

    def mat(scores):
        tokens = steps = 0
        for s in streams:
            r = replay(AutoDrafter(persist=False, scores=scores), s["prompt"], s["out"], 7)
            tokens, steps = tokens + r.tokens, steps + r.steps
        return tokens / steps

    assert mat(True) > 1.02 * mat(None)


def test_auto_scores_are_calibrated_after_learning():
    """On a noisy repeating stream the scores' sum (expected accepted drafts) tracks what is
    actually accepted, step by step: what the per-step budget relies on."""
    rng = random.Random(0)
    phrase = [rng.randrange(100, 200) for _ in range(24)]
    stream = [t if rng.random() > 0.15 else rng.randrange(200, 300) for _ in range(40) for t in phrase]
    d = AutoDrafter(ssd=False, frozen=False)
    history, pos, expected, accepted = list(stream[:48]), 48, [], []
    d.observe(history)
    while pos < len(stream) - 8:
        tree = d.propose(history, 7)
        kids = tree.children()
        node, n = -1, 0
        while True:  # the longest root path that matches the stream (greedy acceptance)
            nxt = next((c for c in kids[node + 1] if tree.tokens[c] == stream[pos + n]), None)
            if nxt is None:
                break
            node, n = nxt, n + 1
        expected.append(float(tree.scores.sum()) if len(tree) else 0.0)
        accepted.append(n)
        out = stream[pos : pos + n + 1]
        history += out
        pos += len(out)
        d.observe(out)
    late = slice(len(accepted) // 3, None)  # after a warm-up
    assert np.mean(accepted[late]) > 1.0  # the stream is predictable, and drafts find it
    assert np.mean(expected[late]) == pytest.approx(np.mean(accepted[late]), rel=0.25)


def test_auto_learns_which_tokens_the_model_takes_beside_the_sources_evidence():
    """Two candidates with the same evidence from the same source: after passes in which the model
    always took one token after the root's, that token (and that pair) scores higher."""
    from cacheback_mlx.drafters.auto import PAIR_MASK, _Trie

    d = AutoDrafter(ssd=False, frozen=False)
    def trie(root):
        t = _Trie()
        t.root = root
        t.add(-1, [50, 7], "own", 3)
        t.add(-1, [60, 7], "own", 3)
        t.open_all()
        return t
    t = trie(9)
    first = [t.child[tok] for tok in (50, 60)]  # the root's children ((-1 + 1) << 32 | token)
    before = [d.scorer.p(t.features(i)) for i in first]
    assert before[0] == pytest.approx(before[1])  # nothing tells them apart yet
    for _ in range(40):
        d.scorer.learn_trie(t.tokens, t.parents, t.features, [50, 7])
    after = [d.scorer.p(t.features(i)) for i in first]
    assert after[0] > 0.5 > after[1]
    other_root = trie(11)  # the token alone still counts after another token
    assert d.scorer.p(other_root.features(other_root.child[50])) > d.scorer.p(other_root.features(other_root.child[60]))
    assert all(t.score(i, d.scorer.w, d.scorer.bias) == d.scorer.p(t.features(i)) for i in range(len(t.tokens)))
    assert all(0 <= f[1] <= PAIR_MASK for f in t.features(0) if f[0] == "pair")


def _learn_a_phrase(d: AutoDrafter, rounds: int = 6) -> None:
    phrase = [5, 6, 7, 8, 9, 10, 11, 12]
    for _ in range(rounds):
        d.reset()
        history = [1, 2] + phrase * 3
        d.observe(history)
        for _ in range(4):
            d.propose(history, 7)
            d.observe(phrase[:3])
            history += phrase[:3]
        d.end_request()


def _walk(stream: dict, d: AutoDrafter, catch_up: bool, labelled: list | None = None) -> list:
    """`auto` along a recorded stream at budget 7, as the engine calls it (catch_up while each pass
    would run) or as a replay does (never): every tree, and with `labelled`, the drafter's labels
    after each observe() and after each catch_up()."""
    from cacheback_mlx.replay import forced_picks, longest_match

    history, out, pos, trees = list(stream["prompt"]), stream["out"], 0, []
    d.observe(history)
    while pos < len(out) - 1:
        tree = d.propose(history, min(7, len(out) - pos - 1))
        trees.append((tree.tokens.tolist(), tree.parents.tolist(), None if tree.scores is None else
                      tree.scores.tolist()))
        if catch_up:
            d.catch_up()
            if labelled is not None:
                labelled.append(("catch_up", d.labelled))
        path = longest_match(tree, out[pos:])
        accepted = [int(tree.tokens[i]) for i in path] + [int(out[pos + len(path)])]
        picks = tree.picked(history[-1], forced_picks(tree, out[pos:]))
        history += accepted
        pos += len(accepted)
        d.observe(accepted)
        if labelled is not None:
            labelled.append(("observe", d.labelled))
        d.recycle(picks)
    d.end_request()
    return trees


def test_a_grown_scorer_learns_while_the_next_pass_runs_and_drafts_the_same_either_way(monkeypatch):
    """Past YOUNG labels, what a pass teaches the scorer waits for catch_up(), which the engine
    calls while the next pass runs, so the host does it while the device works: the next
    proposal is scored without it. A replay that never calls catch_up learns it at the next
    observe(), still after that proposal: both draft the same trees (so a forced run's MAT is the
    replay's). A scorer with fewer labels learns at once (it learns fastest then); end_request
    learns what is left."""
    from cacheback_mlx.drafters.auto import YOUNG

    stream = load_streams()[3]
    grown = [AutoDrafter(persist=False, scores=True) for _ in range(2)]  # the shipped scores: grown
    assert grown[0].scorer.bias_n >= YOUNG
    seen: list = []
    assert _walk(stream, grown[0], True, seen) == _walk(stream, grown[1], False)
    assert grown[0].scorer.state() == grown[1].scorer.state()
    steps = [n for _, n in seen]
    assert all(b >= a for a, b in zip(steps, steps[1:]))
    learned_at = {kind for (kind, n), (_, before) in zip(seen[1:], seen) if n > before}
    assert learned_at == {"catch_up"}  # never in observe
    late = _walk(stream, AutoDrafter(persist=False, scores=True), True)
    monkeypatch.setattr(auto, "YOUNG", 1 << 60)  # every pass's labels at once, as before catch_up
    at_once = _walk(stream, AutoDrafter(persist=False, scores=True), True)
    monkeypatch.undo()
    assert late != at_once  # the proposals after a pass were scored without its labels
    young = AutoDrafter(persist=False)  # PRIOR: nothing learned yet
    seen = []
    _walk(stream, young, True, seen)
    first = [n for kind, n in seen if kind == "observe"][:3]
    assert first[0] > 0 and first[1] > first[0]  # learned in observe while young
    d = grown[1]  # a request's last pass: its labels wait for catch_up, or for the request's end
    history = list(stream["prompt"])
    d.observe(history)
    d.propose(history, 7)
    before = d.labelled
    d.observe(stream["out"][:2])
    assert d.labelled == before
    d.end_request()
    assert d.labelled > before


def test_auto_keeps_its_learned_scores_between_runs(tmp_path):
    """A new process (here: a new drafter on the same store) starts from the scores the last one
    learned, not from the defaults; the file is written atomically beside SSD's store."""
    first = AutoDrafter(ssd_path=tmp_path / "ssd")
    _learn_a_phrase(first)
    first.close()
    saved = tmp_path / "ssd" / "auto-scores.json"
    assert saved.is_file() and not list((tmp_path / "ssd").glob(".*.tmp"))
    second = AutoDrafter(ssd_path=tmp_path / "ssd")
    kept = {f: w for f, w in first.scorer.w.items() if first.scorer.n.get(f, 0) >= 2 or f not in first.scorer.n}
    assert second.scorer.w == pytest.approx(kept) and second.scorer.bias == pytest.approx(first.scorer.bias)
    assert any(isinstance(f, tuple) and f[0] == "from" for f in second.scorer.w)  # tuples survive JSON
    assert second.scorer.w != AutoDrafter(persist=False).scorer.w  # not the defaults
    second.close()


def test_drafters_on_one_store_learn_into_one_scorer_until_the_last_lets_go(tmp_path):
    """A server's lanes each have a drafter: on one store they share one scorer (each drafts from
    what all learned, no lane's save overwrites another's), until the last closes; drafters that
    start differently, or keep nothing on disk, have their own."""
    lanes = [AutoDrafter(ssd_path=tmp_path / "ssd") for _ in range(3)]
    assert lanes[0].scorer is lanes[1].scorer is lanes[2].scorer
    other_start = AutoDrafter(ssd_path=tmp_path / "ssd", scores=True)
    elsewhere = AutoDrafter(ssd_path=tmp_path / "other")
    alone = AutoDrafter(persist=False)
    assert other_start.scorer is not lanes[0].scorer
    assert elsewhere.scorer is not lanes[0].scorer and alone.scorer is not lanes[0].scorer
    prior = dict(alone.scorer.w)
    _learn_a_phrase(lanes[0], 2)
    assert lanes[2].scorer.w != prior and elsewhere.scorer.w == prior  # learned by lane 0, seen by lane 2
    lanes[0].close()
    _learn_a_phrase(lanes[1], 2)  # the others still learn into it
    learned = lanes[2].scorer.state()
    lanes[1].close()
    lanes[2].close()
    saved = json.loads((tmp_path / "ssd" / "auto-scores.json").read_text())
    assert saved == json.loads(json.dumps(learned))  # every lane's learning, saved by the last
    again = AutoDrafter(ssd_path=tmp_path / "ssd")  # all let go: a new drafter reads the file
    assert again.scorer is not lanes[0].scorer and again.scorer.state() == saved
    for d in (again, other_start, elsewhere, alone):
        d.close()


def test_auto_starts_from_the_defaults_when_its_scores_file_is_bad_and_rewrites_it(tmp_path, caplog):
    folder = tmp_path / "ssd"
    folder.mkdir()
    for bad in (b"{not json", b'{"version": 1, "bias": 0, "bias_n": 0, "w": [["x", 1]]}', b"[]",
                b'{"version": 99}', b'{"version": 1, "bias": NaN, "bias_n": 0, "w": []}', b"\xff\xfe{"):
        (folder / "auto-scores.json").write_bytes(bad)
        d = AutoDrafter(ssd_path=folder)
        assert d.scorer.w == AutoDrafter(persist=False).scorer.w
        assert "cannot read the learned scores" in caplog.text
        caplog.clear()
        _learn_a_phrase(d, 1)
        d.close()
    assert json.loads((folder / "auto-scores.json").read_text())["version"] == 1


def test_auto_without_a_kept_store_writes_no_scores(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = AutoDrafter(persist=False)
    _learn_a_phrase(d, 2)
    d.close()
    assert d.scores_path is None and not list(tmp_path.rglob("auto-scores.json"))


@pytest.mark.skipif(not (SHARED_STREAMS / "greedy_outputs.json").is_file(), reason="needs ../shared data")
def test_auto_beats_each_of_its_sources_on_recorded_streams():
    """Exact MAT on recorded greedy streams of the default model (the full table is in
    docs/BENCHMARKS.md; this checks the direction on a few streams)."""
    streams = load_streams()[::8]
    def mat(make):
        tokens = steps = 0
        d = make()
        for s in streams:
            d.reset()
            r = replay(d, s["prompt"], s["out"], 7)
            d.end_request()
            tokens, steps = tokens + r.tokens, steps + r.steps
        return tokens / steps
    auto = mat(lambda: AutoDrafter(persist=False))
    for name, make in {"cacheback": lambda: make_drafter("cacheback"), "pld": lambda: make_drafter("pld"),
                       "ssd": lambda: make_drafter("ssd", persist=False)}.items():
        assert auto > mat(make), name


def test_replay_prices_passes_by_a_clock_and_reports_them_to_the_sizer():
    """tools/auto_sweep.py --truth: the sizer decides with its table, each pass is priced by the
    clock and reported to the sizer as the engine reports a measured pass."""
    prompt, out = PROMPT * 4, PROMPT * 2 + list(range(100, 140))  # a repeat, then nothing to draft from
    seen = []
    clock = lambda rows, context: seen.append((rows, context)) or 0.01 * rows
    sizer = Sizer(CostTable({256: CPU_CURVE}))
    r = replay(make_drafter("pld"), prompt, out, 16, sizer=sizer, clock=clock)
    assert len(seen) == r.steps == sizer.times.n
    assert r.pass_seconds == pytest.approx(0.01 * sum(rows for rows, _ in seen))
    assert sizer.factors  # learned from the clock's times (every RELEARN passes)
    quiet = Sizer(CostTable({256: CPU_CURVE}))
    replay(make_drafter("pld"), prompt, out, 16, sizer=quiet)  # no clock: the table's prices, nothing reported
    assert quiet.times.n == 0


def test_auto_sweep_refuses_a_missing_or_foreign_cost_file_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    foreign = tmp_path / "x.json"
    foreign.write_text('{"x": 1}')
    for args in (["--cost", str(tmp_path / "none.json")], ["--cost", str(foreign)], ["--truth", str(foreign)]):
        r = subprocess.run([sys.executable, "-m", "tools.auto_sweep", "--no-sweep", *args],
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("auto_sweep.py: error:")


def test_auto_sweep_replays_a_bench_run_s_own_streams(tmp_path):
    """--bench-json: the streams of a bench run's `none` row, each turn encoded as the bench did;
    a repetitive reply is drafted well; a file that is no bench run is a one-line usage error."""
    import subprocess
    import sys
    from pathlib import Path

    from cacheback_mlx import bench as B
    from cacheback_mlx.models import default_model

    root = Path(__file__).resolve().parents[1]
    (p,) = B.load_prompts(["spec_bench"], B.DATA, 1, ["translation"], seed=3)
    reply = [1000 + i % 9 for i in range(90)]
    meta = {"model": default_model()["name"], "prompts": ["spec_bench"], "per_category": 1,
            "humaneval_prompts": None, "categories": "translation", "seed": 3, "max_tokens": 128}
    runs = [{"prompt": p.id, "column": p.column, "drafter": "none", "tokens": reply, "turns": [90]}]
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({"meta": meta, "runs": runs}))
    r = subprocess.run([sys.executable, "-m", "tools.auto_sweep", "--bench-json", str(run_json),
                        "--budgets", "7", "--drafters", "pld"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith("| fresh | pld | 7 |")]
    assert len(rows) == 1 and float(rows[0][6]) > 3.0  # all MAT: the reply repeats a 9-token phrase
    bad = tmp_path / "bad.json"
    bad.write_text('{"meta": {}}')
    r = subprocess.run([sys.executable, "-m", "tools.auto_sweep", "--bench-json", str(bad)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("auto_sweep.py: error: --bench-json")


# -- the engine with a per-step budget: lossless, and the sizes follow acceptance --------------
SIZER = Sizer(CostTable({256: {1: 1.0, 8: 1.1, 16: 1.4, 24: 1.8, 32: 2.2, 64: 4.0}}))


def reference(model, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run(model, drafter, prompt=PROMPT, n=40, sizer=None):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, sizer=sizer or Sizer(SIZER.cost))
    return [t for s in eng.generate(prompt, n) for t in s], eng


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_per_step_budget_is_lossless_with_adversarial_drafters(family, tmp_path):
    model = zoo.tiny_model(family)
    prompt = PROMPT * 3
    truth = reference(model, prompt, 40)
    drafters = {"oracle": OracleDrafter(prompt, truth), "oracle-tree": OracleDrafter(prompt, truth, 2),
                "wrong": WrongDrafter(lambda h: truth[len(h) - len(prompt)] if len(h) - len(prompt) < 40 else 0),
                "random": RandomTreeDrafter(prompt, truth, seed=3),
                "auto": AutoDrafter(ssd_path=tmp_path / "ssd.npy")}
    for name, d in drafters.items():
        out, eng = run(model, d, prompt)
        assert out == truth, (family, name)


def test_per_step_budget_drafts_less_for_a_wrong_drafter_and_all_for_a_right_one():
    model = zoo.tiny_model("llama")
    truth = reference(model, PROMPT, 60)
    _, right = run(model, OracleDrafter(PROMPT, truth), n=60)
    cap = SIZER.cap(63, 0)
    # the estimate starts cautious (0.6 per depth) and climbs with every sure pass
    assert cap > 16 and right.stats.passes <= 10 and right.stats.drafted >= 50
    wrong = WrongDrafter(lambda h: truth[len(h) - len(PROMPT)] if len(h) - len(PROMPT) < 60 else 0)
    # a draft row costs 30% of a step (not learned from the tiny model's real times: it is the curve)
    steep = Sizer(CostTable({256: {1: 1.0, 2: 1.3, 8: 2.0}}), learn=False)
    _, bad = run(model, wrong, n=60, sizer=steep)
    assert bad.stats.passes == 60
    assert bad.stats.drafted <= 25  # a fixed budget would have sent 5 per pass (300)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_a_short_uncached_tail_leads_the_first_pass_instead_of_a_prefill(family):
    """A new turn's text (here 20 tokens after a cached first turn) goes through the first pass
    with the drafts; recurrent models prefill it as before. Output as mlx-lm's either way."""
    model = zoo.tiny_model(family)
    first, second = PROMPT * 2, PROMPT * 2 + [9, 4, 3] + PROMPT + [11, 6, 2, 7]
    truth = reference(model, second, 30)
    eng = Engine(model, eos_ids=[], drafter=make_drafter("auto", persist=False), context_length=4096,
                 sizer=Sizer(SIZER.cost))
    list(eng.generate(first, 1))
    leads, prefilled = [], []
    eng.watch(lambda e: (leads if e.kind == "verify" else prefilled).append(e.lead if e.kind == "verify" else e.rows))
    assert [t for s in eng.generate(second, 30) for t in s] == truth, family
    tail = len(second) - len(first)
    assert eng.stats.prefill_tokens == tail - 1
    if family == "qwen3_next":
        assert leads[0] == 1 and sum(prefilled) == tail - 1
    else:
        assert leads[0] == tail and sum(prefilled) == 0


class Counting(Drafter):
    def __init__(self):
        self.budgets = []

    def propose(self, history, budget, max_branching=None):
        self.budgets.append(budget)
        return DraftTree.empty()


def test_draft_budget_still_caps_the_per_step_budget():
    model = zoo.tiny_model("llama")
    d = Counting()
    eng = Engine(model, eos_ids=[], drafter=d, context_length=4096, draft_budget=5, sizer=Sizer(SIZER.cost))
    list(eng.generate(PROMPT, 6))
    assert d.budgets and max(d.budgets) == 5
    d2 = Counting()
    eng = Engine(model, eos_ids=[], drafter=d2, context_length=4096, sizer=Sizer(SIZER.cost))
    list(eng.generate(PROMPT, 60))
    assert max(d2.budgets) == SIZER.cap(63, 0)


def test_pass_costs_are_measured_once_and_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "NOISY", float("inf"))  # kept however busy the machine (the guard: test_startup)
    model = zoo.tiny_model("llama")
    t = load_or_measure(model, "tiny-llama", 4096, vocab=zoo.VOCAB)
    files = list((tmp_path / "cacheback-mlx" / "verify-cost").glob("*.json"))
    assert len(files) == 1 and t.contexts == [256, 1024] and all(v > 0 for v in t.table[256].values())
    files[0].write_text(files[0].read_text().replace("256", "257", 1))  # a visible edit is read back
    assert load_or_measure(model, "tiny-llama", 4096).contexts == [257, 1024]
    files[0].write_text("{not json")  # a corrupt file is measured again
    assert load_or_measure(model, "tiny-llama", 4096, vocab=zoo.VOCAB).contexts == [256, 1024]
    small = measure(model, (1, 4), (8,), repeats=1, vocab=zoo.VOCAB)
    assert set(small.table[8]) == {1, 4}


def test_auto_drafts_from_learned_text_without_crossing_into_it():
    """An editor's suffix (Drafter.learn) is drafted from, but no continuation runs across the
    boundary between it and the history."""
    d = AutoDrafter(ssd=False, frozen=False)
    d.observe([1, 2, 3])
    d.learn([7, 8, 9, 10, 11])
    d.observe([4, 7, 8])
    tree = d.propose([1, 2, 3, 4, 7, 8], 7)
    assert [int(t) for t in tree.first_path().tokens][:3] == [9, 10, 11]
    assert -1 not in tree.tokens.tolist()
    d.observe([9])
    assert -1 not in d.propose([1, 2, 3, 4, 7, 8, 9], 7).tokens.tolist()


def test_auto_drafts_what_the_model_picked_after_a_token_in_an_earlier_pass():
    """Drafter.recycle: the model's pick at a row, a rejected draft's included, is drafted after that
    token (the latest pick wins), below any node of that token too; reset() forgets them, and
    recycle=False leaves them out; recycle=N drafts the row's N best tokens, the pick first, and the
    default asks for the next-best ones only while passes run more than WIDE rows."""
    def first_level(d, history):
        tree = d.propose(history, 7)
        return [int(t) for t, p in zip(tree.tokens, tree.parents) if p < 0]

    d = AutoDrafter(ssd=False, frozen=False, datastore=False)
    d.observe([1, 2, 3])
    assert first_level(d, [1, 2, 3]) == []
    assert d.alternatives == 0  # no pass seen yet: not wide
    d.recycle([(3, (41,)), (3, (40,)), (40, (50,))])
    assert first_level(d, [1, 2, 3]) == [40]
    assert d.propose([1, 2, 3], 7).first_path().tokens.tolist() == [40, 50]
    d.reset()
    d.observe([1, 2, 3])
    assert first_level(d, [1, 2, 3]) == []
    off = AutoDrafter(ssd=False, frozen=False, datastore=False, recycle=False)
    off.observe([1, 2, 3])
    off.recycle([(3, (40,))])
    assert first_level(off, [1, 2, 3]) == [] and off.alternatives == 0
    best = [(3, (40, 44, 41, 43, 42))]  # the pick, then the next best
    four = AutoDrafter(ssd=False, frozen=False, datastore=False, recycle=4)
    assert four.alternatives == 3
    four.observe([1, 2, 3])
    four.recycle(best)
    assert sorted(first_level(four, [1, 2, 3])) == [40, 41, 43, 44]
    assert four.propose([1, 2, 3], 7).first_path().tokens.tolist()[0] == 40  # the pick ranks first
    wide = [(t, (t + 1,)) for t in range(2 * WIDE)]  # a pass of 2 * WIDE rows
    for _ in range(12):
        d.recycle(wide)
    assert d.alternatives == RECYCLED - 1  # wide passes: the next best too
    for _ in range(20):
        d.recycle(wide[:8])
    assert d.alternatives == 0
    two = AutoDrafter(ssd=False, frozen=False, datastore=False, recycle=2)
    two.observe([1, 2, 3])
    two.recycle(best)
    assert sorted(first_level(two, [1, 2, 3])) == [40, 44] and two.alternatives == 1
    from cacheback_mlx.errors import CachebackError

    for bad in ("maybe", -1, 17, 2.5):  # `--drafter-arg auto.recycle=maybe`
        with pytest.raises(CachebackError, match="recycle must be true, false or a number") as e:
            make_drafter("auto", persist=False, recycle=bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("budget", [3, 7, 15, 40])
def test_best_first_tree_is_the_most_probable_nodes_of_the_whole_trie(budget):
    """auto scores only the children of the nodes it takes; the tree it sends must still be the
    `budget` nodes of highest path probability among ALL the candidates it gathered, best first,
    every parent before its child, each with its true path probability."""
    rng = random.Random(budget)
    d = AutoDrafter(persist=False)
    text = [rng.randrange(40) for _ in range(300)]
    text = text + text[50:120] + text[10:60]  # repeats, so own history and tables have matches
    d.observe(text[:-30])
    d.learn(text[-30:])  # evidence beside the history too
    tree = d.propose(text[:-30], budget)
    d._last.open_all()  # every candidate, placed or not
    tokens, parents, feats = d._last.tokens, d._last.parents, d._last.features
    sources = {s for ev in d._last.ev for s in ev}
    assert {"own", "dyn", "frz"} <= sources, sources  # the scores below cover those features
    weights = {f: rng.uniform(-2, 2) for i in range(len(tokens)) for f in feats(i)}  # every feature counts
    for i in range(len(tokens)):  # the scores best-first sums in place are the scorer's, bit for bit
        assert d._last.score(i, weights, d.scorer.bias) == Scorer(weights, d.scorer.bias).p(feats(i))
    path, key = [], []
    for i, p in enumerate(parents):  # every candidate's path probability and token path
        path.append(d.scorer.p(feats(i)) * (path[p] if p >= 0 else 1.0))
        key.append((key[p] if p >= 0 else ()) + (tokens[i],))
    by_key = dict(zip(key, path))
    sent = []
    for i, p in enumerate(tree.parents.tolist()):
        sent.append((sent[p] if p >= 0 else ()) + (int(tree.tokens[i]),))
    assert len(tree) == min(budget, len(tokens)) and len(set(sent)) == len(sent)
    assert np.all(np.diff(tree.scores) <= 1e-12)  # best first
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))
    for k, s in zip(sent, tree.scores):
        assert s == pytest.approx(by_key[k], rel=1e-12)
    left = [s for k, s in by_key.items() if k not in set(sent)]
    assert not left or max(left) <= min(tree.scores) + 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_a_trie_placed_as_it_is_opened_equals_one_placed_whole(seed):
    """auto's trie places a continuation's tokens only as the nodes above them are opened. Every
    node must come out as if each continuation had been placed whole when it was added: the same
    evidence (in the same order: it is the order of the scorer's sum), the same counts, children in
    the same order, and `order` ranking nodes as their creation would have. Checked against a
    brute-force account by token path, with nodes opened in a random order between additions."""
    from cacheback_mlx.drafters.auto import _Trie

    rng = random.Random(seed)
    trie, calls = _Trie(), []  # calls: (parent path, continuations, source, first strength, weights)

    def add(parent_path, node, source):
        conts = [[rng.randrange(5) for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 7))]
        retrieved = source in ("own", "ssd", "rest")
        weights = [rng.randrange(1, 4) for _ in conts] if retrieved else None
        first = rng.randrange(1, 9) if retrieved else 0
        trie.add_all(node, conts, source, first, weights=weights)
        calls.append((parent_path, conts, source, first, weights))

    for source in ("own", "own", "ssd", "rest"):  # retrievals at the root, before it is opened
        add((), -1, source)
    opened = {-1: ()}
    trie.open(-1)
    for _ in range(12):  # lookups at opened nodes, nodes opened in between, as best-first does
        node, path = rng.choice(list(opened.items()))
        add(path, node, rng.choice(("dyn", "frz")))
        kids = trie.kids.get(node, [])
        if kids:
            c = rng.choice(kids)
            trie.open(c)
            opened[c] = path + (trie.tokens[c],)
    trie.open_all()

    ev, count, first_at = {}, {}, {}
    key = 0
    for parent_path, conts, source, strength0, weights in calls:
        for k, cont in enumerate(conts):
            strength, w = (strength0 + k, 1) if weights is None else (strength0, weights[k])
            for j in range(len(cont)):
                path = parent_path + tuple(cont[: j + 1])
                first_at.setdefault(path, key)
                key += 1
                e = ev.setdefault(path, {})
                if source not in e or strength > e[source][0]:
                    e[source] = (strength, j)
                if weights is not None:
                    count.setdefault(source, {})[path] = count.get(source, {}).get(path, 0) + w
            if weights is not None and cont and not parent_path:
                count.setdefault(source, {})[()] = count.get(source, {}).get((), 0) + w
    paths = {}
    for i, p in enumerate(trie.parents):
        paths[i] = (paths[p] if p >= 0 else ()) + (trie.tokens[i],)
    assert sorted(paths.values()) == sorted(ev)  # the same nodes
    for i, path in paths.items():
        assert list(trie.ev[i].items()) == list(ev[path].items())
        for source, c in trie.count.items():
            assert c.get(i, 0) == count.get(source, {}).get(path, 0)
    assert all(c.get(-1, 0) == count.get(s, {}).get((), 0) for s, c in trie.count.items())
    assert len(set(trie.order)) == len(trie.order)  # no ties: the heap never compares node numbers
    assert sorted(paths, key=trie.order.__getitem__) == sorted(paths, key=lambda i: first_at[paths[i]])
    for node, kids in trie.kids.items():
        assert kids == sorted(kids, key=trie.order.__getitem__)
