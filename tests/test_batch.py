"""Several requests in one pass (batch.py): every lane's greedy output equals its solo run on
every family of the zoo, with adversarial drafters, lanes joining and leaving at different steps."""

from cacheback_mlx import recurrent
from cacheback_mlx.batch import Batch
from cacheback_mlx.batch_plan import LaneCosts, Riding, share, share_side_by_side
from cacheback_mlx.budget import Sizer
from cacheback_mlx.costs import CostTable
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.kvcache import KVStack, ModelCache
from cacheback_mlx.positions import TreePass
from cacheback_mlx.sampling import SamplingParams
from cacheback_mlx.shared_pass import PassPlan, batch_pass
from cacheback_mlx.sharing import check_sharing, describe
from cacheback_mlx.tree import DraftTree
from cacheback_mlx.verify import prefill, verify_pass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, gemma2

import zoo
from adversarial import HearsPicks, KnownStreamsDrafter
from test_families import reference

PROMPTS = [[(7 * i + 3) % 97 + 1 for i in range(24)], [(5 * i + 2) % 97 + 1 for i in range(15)],
           [(3 * i + 1) % 97 + 1 for i in range(31)], [(11 * i + 4) % 97 + 1 for i in range(9)],
           [(7 * i + 3) % 97 + 1 for i in range(20)]]  # the last shares a prefix with the first
LENGTHS = [24, 9, 17, 20, 12]
# lanes that take turns instead of sharing a pass (batch.sharing_reason / check_sharing)
TURNS: set[str] = set()
PACKED = {"gemma2"}  # attention over the keys its caches return, with a mask of its own
UNDO_PADDED = {"jamba", "mamba"}  # recurrent mixers that run a lane's padding into its states
CURVE = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.6, 32: 2.4, 64: 4.0, 128: 7.5, 256: 15.0}


def streams(model):
    return [(p, reference(model, p, n)) for p, n in zip(PROMPTS, LENGTHS)]


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_every_lane_gets_its_solo_output(family):
    model = zoo.tiny_model(family)
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12)
    seeds = iter(range(100))
    batch = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=next(seeds)))
    assert (batch.reason is None) == (family not in TURNS), batch.reason
    assert batch.undo_padded == (family in UNDO_PADDED)
    assert batch.packed == (family in PACKED)
    lanes = batch.run([dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [lane.tokens for lane in lanes] == [t for _, t in known]
    assert all(lane.finish_reason == "length" for lane in lanes)
    assert batch.passes < sum(lane.stats.passes for lane in lanes)  # lanes ran side by side
    # the next requests reuse the lanes' caches: the one that shares a prefix prefills only the rest
    again = batch.run([dict(prompt=PROMPTS[0] + known[0][1][:4], max_tokens=6)])[0]
    assert again.tokens == reference(model, PROMPTS[0] + known[0][1][:4], 6)
    if not eng.seq.cache.recurrent:  # (a recurrent state cannot be cut back to the shorter prompt)
        assert again.stats.prefill_tokens < len(PROMPTS[0])


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "qwen3_next", "nemotron_h"])
def test_lanes_share_rows_by_measured_cost_and_stay_exact(family):
    model = zoo.tiny_model(family)
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, sizer=Sizer(CostTable({256: CURVE})))
    batch = Batch(eng, 4, lambda: KnownStreamsDrafter(known, seed=3))
    lanes = batch.run([dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [lane.tokens for lane in lanes] == [t for _, t in known]


def test_watchers_hear_how_each_pass_shared_its_rows_out():
    """Batch.watch: per pass of the decoding lanes, each lane's drafts offered, sent and the tokens
    it produced; those add up to every lane's output, and the weights are what share was given."""
    model = zoo.tiny_model("llama")
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, sizer=Sizer(CostTable({256: CURVE})))
    batch = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=5))
    heard = []
    stop = batch.watch(heard.append)
    lanes = batch.run([dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS[:3], LENGTHS[:3])])
    assert [lane.tokens for lane in lanes] == [t for _, t in known[:3]]
    produced = {lane.index: 0 for lane in lanes}
    for event in heard:
        assert event.seconds > 0 and event.chunk >= 0
        for x in event.lanes:
            assert 0 <= x.sent <= x.offered and 0.0 <= x.expected <= x.offered and x.weight >= 1.0
            assert 1 <= x.produced <= x.sent + 1
            produced[x.index] += x.produced
    assert produced == {lane.index: len(lane.tokens) for lane in lanes}
    assert sum(x.sent for e in heard for x in e.lanes) == sum(lane.stats.drafted for lane in lanes) > 0
    assert any(len(e.lanes) > 1 for e in heard)
    stop()
    batch.run([dict(prompt=PROMPTS[3], max_tokens=4)])
    assert sum(len(e.lanes) for e in heard) == sum(lane.stats.passes for lane in lanes)  # nothing heard after stop


class LanePicks(HearsPicks, KnownStreamsDrafter):
    """KnownStreamsDrafter that keeps each pass's tree and what recycle then heard (each row's
    pick and 2 next-best tokens)."""

    alternatives = 2


def test_each_lane_s_drafter_hears_the_picks_of_its_own_rows():
    """Drafter.recycle in a shared pass: a lane's drafter hears its own root's and nodes' rows, and
    where a row's path is the lane's known stream, the pick is that stream's next token."""
    model = zoo.tiny_model("llama")
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12)
    drafters = []
    batch = Batch(eng, 3, lambda: drafters.append(LanePicks(known, seed=len(drafters))) or drafters[-1])
    lanes = batch.run([dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [lane.tokens for lane in lanes] == [t for _, t in known]
    checked = 0
    for d in drafters:
        assert d.heard
        for history, tree, picks in d.heard:
            matching = [p + t for p, t in known if (p + t)[: len(history)] == history]
            assert matching
            if len(matching) > 1:  # (a prompt that begins another's: which one runs is not known here)
                continue
            stream = matching[0]
            assert picks[0][0] == history[-1] and picks[0][1][0] == stream[len(history)]
            assert all(len(best) == 3 for _, best in picks)  # the pick and 2 next best (alternatives)
            assert [t for t, _ in picks[1:]] == tree.tokens[: len(picks) - 1].tolist()
            depth = tree.depths()
            for node, (_, (pick, *_)) in enumerate(picks[1:]):
                path, p = [], node
                while p >= 0:
                    path.append(int(tree.tokens[p]))
                    p = int(tree.parents[p])
                end = len(history) + int(depth[node])
                if end < len(stream) and history + path[::-1] == stream[:end]:
                    assert pick == stream[end]
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_a_new_request_takes_the_lowest_free_lane_and_what_that_lane_held_moves(family):
    """Busy lanes stay at the stack's first rows: a request that reuses no lane's caches takes
    the lowest free lane, and that lane's caches (with its drafter) move to the lane the choice
    would have emptied, so a later request still reuses them; every output as alone. Lanes not in
    one stack (recurrent layers) stay where the choice put them."""
    model = zoo.tiny_model(family)
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    batch = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=3))
    movable = batch.stacks is not None and not eng.seq.cache.recurrent
    assert movable == (family not in TURNS and not eng.seq.cache.recurrent)
    done = batch.run([dict(prompt=p, max_tokens=n) for p, n in zip(PROMPTS[:3], LENGTHS[:3])])
    assert [lane.index for lane in done] == [0, 1, 2] and [lane.tokens for lane in done] == [t for _, t in known[:3]]
    for k in (0, 1):  # lanes 0 and 1 serve again (each reuses its own prompt), so lane 2 is the oldest
        follow = PROMPTS[k] + known[k][1][:3]
        again = batch.run([dict(prompt=follow, max_tokens=4)])[0]
        assert again.index == k and again.tokens == reference(model, follow, 4)
    drafter0 = batch.drafters[0]
    new = batch.join(PROMPTS[3], LENGTHS[3])  # no lane holds it: lane 2 (oldest) would be emptied
    if movable:  # lane 0's caches and drafter went to lane 2
        assert new.index == 0 and batch.drafters[2] is drafter0
    else:
        assert new.index == 2 and batch.drafters[0] is drafter0
    back = PROMPTS[0] + known[0][1][:3] + [5, 6]  # lane 0's last request, continued
    second = batch.join(back, 5)
    assert second.index == (2 if movable else 0)
    if movable:
        assert second.stats.prefill_tokens <= 3  # its caches moved intact
    while batch.lanes:
        batch.step()
    assert new.tokens == known[3][1] and second.tokens == reference(model, back, 5)


def test_a_cancelled_lane_never_disturbs_the_others():
    model = zoo.tiny_model("llama")
    known = streams(model)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    batch = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=5))
    lanes = [batch.join(p, n) for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
    batch.step()
    batch.leave(lanes[1])  # a client went away
    assert lanes[1].done and 1 not in batch.lanes
    while batch.lanes:
        batch.step()
    assert lanes[0].tokens == known[0][1] and lanes[2].tokens == known[2][1]
    late = batch.join(PROMPTS[3], LENGTHS[3])  # the freed lane takes a new request
    while batch.lanes:
        batch.step()
    assert late.tokens == known[3][1]


@pytest.mark.parametrize("family,ride", [(f, True) for f in zoo.FAMILIES] + [("llama", False)])
def test_a_joining_prompt_goes_a_chunk_a_pass_while_the_running_lanes_keep_producing(family, ride):
    """A 61-token prompt joins beside a running lane, in 8-token chunks: each chunk rides in the
    running lane's pass (one pass for both where lanes share one end to end; recurrent lanes go
    side by side and their chunks never ride) or goes in one of its own, the running lane
    produces a token at every step meanwhile, and both outputs equal their solo runs (a riding
    chunk's rows skip the output head: head.py)."""
    model = zoo.tiny_model(family)
    long = [(13 * i + 5) % 97 + 1 for i in range(62)]
    known = streams(model)[:1] + [(long, reference(model, long, 6))]
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=4)
    eng.prefill_chunk = 8
    batch = Batch(eng, 2, lambda: KnownStreamsDrafter(known, seed=1), ride=ride)
    first = batch.join(PROMPTS[0], LENGTHS[0])
    while first.seq.lead == [] or first.prefilling:  # the first prompt alone: chunks of its own
        batch.step()
    batch.step()
    late = batch.join(long, 6)
    steps, passes, rode = 0, batch.passes, batch.rode
    while late.prefilling:
        before = len(first.tokens)
        batch.step()
        steps += 1
        assert len(first.tokens) > before or first.done  # the running lane never waits for the prompt
    assert steps == -(-61 // 8) and late.stats.prefill_tokens == 61
    if batch.reason is None:
        assert batch.passes - passes == steps  # one shared pass a step, every chunk in it or beside it
    assert batch.rode - rode == (steps if ride and batch.reason is None and not batch.side_by_side else 0)
    while batch.lanes:
        batch.step()
    assert first.tokens == known[0][1] and late.tokens == known[1][1]


def test_a_chunk_goes_the_way_that_cost_less_a_token_and_the_other_is_tried_now_and_then():
    riding = Riding()
    assert riding.ride() is True and riding.ride() is True  # untried: riding first, then alone
    riding.timed(True, 100, 1.0)
    assert riding.ride() is False
    riding.timed(False, 100, 0.5)
    ways = [riding.ride() for _ in range(4 * Riding.TRY)]
    assert ways.count(True) == 4 and ways.count(False) == 4 * Riding.TRY - 4  # cheaper alone; riding retried
    for _ in range(30):
        riding.timed(True, 100, 0.2)  # riding got cheaper: it takes over
    assert [riding.ride() for _ in range(Riding.TRY)].count(True) == Riding.TRY - 1
    assert Riding(fixed=False).ride() is False and Riding(fixed=True).ride() is True


@pytest.mark.parametrize("family", ["llama", "gemma4_text"])
def test_a_shared_pass_leaves_no_view_of_the_stack_behind(family):
    """Once a shared pass is built, its layer views are gone without waiting for the garbage
    collector: a view still alive holds slices of the stack, and the next pass's writes into the
    stack would copy all of it instead of writing in place."""
    import gc

    from cacheback_mlx.shared_pass import LaneView

    model = zoo.tiny_model(family)
    stacks = [KVStack(2) for _ in ModelCache(model).layers]
    caches = [ModelCache(model, stacks, row) for row in range(2)]
    for c, p in zip(caches, PROMPTS[:2]):
        prefill(model, c, p[:-1])
    gc.collect()
    gc.disable()
    try:
        mx.eval(batch_pass(model, [(c, p[-1:], DraftTree([5], [-1]), 2) for c, p in zip(caches, PROMPTS[:2])]))
        assert not [o for o in gc.get_objects() if isinstance(o, LaneView)]
    finally:
        gc.enable()


def test_eos_ends_a_lane_and_bad_requests_are_one_line_errors():
    model = zoo.tiny_model("qwen3")
    known = streams(model)
    stop = known[0][1][5]
    eng = Engine(model, eos_ids=[stop], drafter=NoDrafter(), context_length=4096)
    batch = Batch(eng, 2, lambda: KnownStreamsDrafter(known))
    lane = batch.run([dict(prompt=PROMPTS[0], max_tokens=20)])[0]
    assert lane.tokens == known[0][1][: known[0][1].index(stop)] and lane.finish_reason == "stop"
    with pytest.raises(CachebackError, match="empty prompt"):
        batch.join([], 4)
    with pytest.raises(CachebackError, match="max_tokens"):
        batch.join(PROMPTS[0], 0)
    batch.join(PROMPTS[0], 4)
    batch.join(PROMPTS[1], 4)
    with pytest.raises(CachebackError, match="lanes are busy"):
        batch.join(PROMPTS[2], 4)
    with pytest.raises(CachebackError, match="at least one lane"):
        Batch(eng, 0, NoDrafter)


def test_a_sampled_lane_alone_samples_as_its_solo_run():
    model = zoo.tiny_model("llama")
    known = streams(model)
    sampling = SamplingParams(temperature=0.8, seed=7)
    solo = Engine(model, eos_ids=[], drafter=KnownStreamsDrafter(known, seed=1), context_length=4096, draft_budget=8)
    want = [t for step in solo.generate(PROMPTS[0], 20, sampling) for t in step]
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    lane = Batch(eng, 2, lambda: KnownStreamsDrafter(known, seed=1)).run(
        [dict(prompt=PROMPTS[0], max_tokens=20, sampling=sampling)])[0]
    assert lane.tokens == want


def test_seeded_lanes_sample_as_their_solo_runs_beside_other_lanes():
    """A seeded request's text does not depend on the lanes beside it (nor on its drafts)."""
    model = zoo.tiny_model("llama")
    known = streams(model)
    a = SamplingParams(temperature=0.8, seed=7)
    b = SamplingParams(temperature=0.9, top_p=0.9, seed=8, xtc_probability=0.6, xtc_threshold=0.05)  # XTC's too

    def solo(prompt, sampling):
        eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
        return [t for step in eng.generate(prompt, 20, sampling) for t in step]

    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    lanes = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=4)).run(
        [dict(prompt=PROMPTS[0], max_tokens=20, sampling=a),
         dict(prompt=PROMPTS[2], max_tokens=20, sampling=SamplingParams(temperature=1.0)),  # unseeded
         dict(prompt=PROMPTS[1], max_tokens=20, sampling=b)])
    assert [lanes[0].tokens, lanes[2].tokens] == [solo(PROMPTS[0], a), solo(PROMPTS[1], b)]


def test_rows_go_to_the_drafts_likeliest_to_pay_across_lanes():
    costs = 1.0 + 0.02 * np.arange(Sizer.MAX_ROWS + 1)  # seconds by the pass's rows in all
    sure, unsure = np.array([0.95, 0.9, 0.85, 0.8]), np.array([0.05, 0.02])
    counts = share([(1, sure), (1, unsure), (1, np.zeros(0))], costs)
    assert counts[0] == 4 and counts[1] == 0 and counts[2] == 0
    assert share([(1, sure), (1, unsure)], None) == [4, 2]  # a fixed budget: all that was offered
    # nothing worth a row: every lane runs its root only
    assert share([(1, np.full(5, 0.01)), (1, np.full(3, 0.01))], costs) == [0, 0]
    assert share([(1, sure)], np.r_[0.0, 1.0 + 2.0 * np.arange(10)]) == [0]  # rows dearer than what they bring
    # where a tile of rows costs what one row does, drafts that fill it ride free
    tiled = np.array([0.0] + [1.0] * 8 + [2.0] * 8)
    assert share([(1, np.full(7, 0.05))], tiled) == [7]


def test_a_lane_worth_more_a_token_keeps_more_of_its_drafts():
    """Lanes weighed by what their tokens are worth (Batch.lane_weights): of two lanes with the
    same drafts, the one weighed higher gets the rows; level weights share them as no weights do."""
    costs = 1.0 + 0.2 * np.arange(Sizer.MAX_ROWS + 1)
    same = np.array([0.6, 0.5, 0.4, 0.3])
    level = share([(1, same), (1, same)], costs)
    assert level == share([(1, same), (1, same)], costs, [3.0, 3.0]) and level[0] == level[1] > 0
    a, b = share([(1, same), (1, same)], costs, [4.0, 1.0])
    assert a > level[0] and b < level[1], (a, b, level)


def test_lanes_side_by_side_take_the_width_with_the_most_tokens_a_second():
    """Every lane of a side-by-side pass is as wide as the widest: a width w costs lanes x w rows."""
    sure, unsure = np.array([0.95, 0.9, 0.85, 0.8]), np.array([0.05, 0.02])
    flat = np.ones(64)  # rows cost nothing beside the pass: every lane sends all it offered
    assert share_side_by_side([(1, sure), (1, unsure)], flat) == [4, 2]
    steep = 1.0 + 0.3 * np.arange(64)  # dearer rows: the width with the most tokens a second (4 here),
    assert share_side_by_side([(1, sure), (1, unsure)], steep) == [3, 2]  # the unsure lane's drafts ride in it
    # a lane with a long lead sets the narrowest width, and the others fill it at no cost
    assert share_side_by_side([(5, np.zeros(0)), (1, np.full(6, 0.3))], 1.0 + 2.0 * np.arange(64)) == [0, 4]
    assert share_side_by_side([(1, sure), (1, unsure)], None) == [4, 2]  # a fixed budget: all offered


def test_the_cost_of_a_shared_pass_is_the_solo_price_of_its_rows_times_what_the_lanes_add():
    sizer = Sizer(CostTable({256: CURVE}))
    costs = LaneCosts(sizer)
    assert np.array_equal(costs.costs(8, 300), sizer.costs(300))  # nothing timed: the solo price
    for rows, ratio in [(8, 1.05), (8, 1.15), (32, 1.5), (32, 1.6)] * 20:
        costs.timed(8, 300, rows, sizer.price(rows, 300) * ratio)
    assert costs.factor(8, 300, 8) == pytest.approx(1.1, rel=0.02)  # one row a lane
    assert costs.factor(8, 300, 32) == pytest.approx(1.55, rel=0.02)  # four rows a lane: dearer
    # a spread not timed takes the nearest timed one below it (above it where none is below)
    assert costs.factor(8, 300, 16) == costs.factor(8, 300, 8)
    assert costs.factor(8, 300, 60) == costs.factor(8, 300, 32)
    assert costs.factor(8, 300, 5) == costs.factor(8, 300, 8)
    price = costs.costs(8, 300)
    assert price[8] == pytest.approx(sizer.costs(300)[8] * 1.1, rel=0.02)
    assert price[32] == pytest.approx(sizer.costs(300)[32] * 1.55, rel=0.02)
    assert price[33] == pytest.approx(sizer.costs(300)[33] * 1.55, rel=0.02)
    assert costs.factor(4, 300, 8) == 1.0 and costs.factor(8, 3000, 8) == 1.0  # per lane count and context band
    for _ in range(40):  # a wider spread timed cheaper than a narrower one (noise) is priced as the narrower
        costs.timed(4, 300, 8, sizer.price(8, 300) * 1.3)
        costs.timed(4, 300, 16, sizer.price(16, 300) * 1.1)
    assert costs.factor(4, 300, 16) == pytest.approx(1.3, rel=0.02)


def test_drafts_are_priced_at_what_wide_shared_passes_cost():
    """Where a lane's extra rows cost more in a shared pass than in a solo one (here the factor
    grows by 0.12 a row per lane), the plan takes about the best count of drafts; a level factor
    (what one number over every pass gives) prices wide passes low and sends them all."""
    sizer = Sizer(CostTable({256: CURVE}))
    true = lambda rows: sizer.price(rows, 300) * (1.0 + 0.12 * rows / 8)
    costs = LaneCosts(sizer)
    for rows in list(range(8, 41)) * 3:
        costs.timed(8, 300, rows, true(rows))
    for p in (0.45, 0.6):
        offers = [(1, np.full(4, p))] * 8
        rate = lambda k: (8 + p * k) / true(8 + k)  # tokens a second with k drafts in all
        best = max(rate(k) for k in range(33))
        learned, level = sum(share(offers, costs.costs(8, 300))), sum(share(offers, sizer.costs(300) * 1.35))
        assert rate(learned) > 0.99 * best
        assert level == 32 and rate(level) < 0.95 * best


def test_the_sharing_check_names_why_lanes_take_turns(monkeypatch):
    """Gemma 2 attends over the keys its caches return, with a mask it asks its cache for: it gets
    every lane's keys end to end. One whose attention makes its mask without asking the cache
    takes turns, and the check says why."""
    eng = Engine(zoo.tiny_model("gemma2"), eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert check_sharing(eng) == (None, False, True)
    assert describe(check_sharing(eng), False) == "one shared pass, rows end to end, every lane's keys end to end"
    own_mask = base.create_attention_mask
    monkeypatch.setattr(gemma2, "create_attention_mask", lambda h, cache=None, **kw: own_mask(h, None, **kw))
    assert check_sharing(eng).reason.startswith("its attention cannot be shared")
    assert describe(check_sharing(eng), False).startswith("in turns, a pass each (its attention cannot be shared")


@pytest.mark.parametrize("family", ["mamba", "qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("capture", [True, False])
def test_the_sharing_check_finds_mixers_that_run_the_padding_into_a_lanes_states(family, capture, monkeypatch):
    """Nemotron-H's recurrence takes no `lengths`: its padded lanes' states are run again over their
    own rows where its mixers go through the capturing wrapper (recurrent.LaneStates.own_rows);
    with capture off they are undone."""
    monkeypatch.setattr(recurrent, "enabled", capture)
    eng = Engine(zoo.tiny_model(family), eos_ids=[], drafter=NoDrafter(), context_length=4096)
    answer = check_sharing(eng)
    assert answer == (None, family in UNDO_PADDED or (family == "nemotron_h" and not capture), False)
    assert describe(answer, True).startswith("one shared pass, side by side, chains padded to the widest")
    assert describe(answer, True).endswith("undone after it") == answer.undo_padded


def test_sampled_lanes_keep_the_models_distribution():
    """Two lanes sampling side by side (top-k 4, temperature 1): the first token's frequencies over
    many requests match the model's own distribution."""
    import mlx.core as mx

    model = zoo.tiny_model("llama")
    known = streams(model)
    prompt = PROMPTS[1]
    logits = model(mx.array(prompt)[None])[0, -1]
    top = np.argsort(-np.array(logits))[:4]
    p = np.exp(np.array(logits)[top] - np.array(logits)[top].max())
    p /= p.sum()
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=6)
    batch = Batch(eng, 2, lambda: KnownStreamsDrafter(known, seed=9))
    mx.random.seed(11)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    counts = {int(t): 0 for t in top}
    for _ in range(300):
        for lane in batch.run([dict(prompt=prompt, max_tokens=2, sampling=sampling)] * 2):
            counts[lane.tokens[0]] += 1
    freq = np.array([counts[int(t)] for t in top]) / 600
    assert np.abs(freq - p).sum() / 2 < 0.08, (freq, p)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_a_lane_takes_another_lanes_prefix_instead_of_prefilling_it(family):
    """Three completions of one prompt (llama.vscode's n_cmpl): the first lane prefills it, the
    others copy its caches (gemma3_text: sliding-window layers too); every output is the solo one.
    A recurrent state holds no prefix of itself: on a hybrid each lane prefills its own."""
    model = zoo.tiny_model(family)
    copies = family != "qwen3_next"
    prompt = PROMPTS[2]
    truth = reference(model, prompt, 10)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=6)
    batch = Batch(eng, 3, lambda: KnownStreamsDrafter([(prompt, truth)], seed=2))
    lanes = [batch.join(prompt, 10) for _ in range(3)]  # all at once: the first prefills, the others wait
    while batch.lanes:
        batch.step()
    assert [lane.stats.prefill_tokens for lane in lanes] == [len(prompt) - 1] + [0 if copies else len(prompt) - 1] * 2
    assert all(lane.tokens == truth for lane in lanes)
    other = batch.run([dict(prompt=prompt[:20] + [5, 6, 7], max_tokens=6)])[0]  # a shorter shared prefix
    assert other.tokens == reference(model, prompt[:20] + [5, 6, 7], 6)
    assert other.stats.prefill_tokens == (2 if copies else 22)


def _against_solo_passes(model, prompts, trees, rows, lanes: int) -> PassPlan:
    """Each prompt prefilled but its last token, then that token and its tree in one shared pass
    (the prompts' caches in `rows` of a stack of `lanes`) and in passes of their own: each lane's
    logits equal its solo pass's to rounding, with the same picks. The shared pass's plan."""
    logits, plan = {}, None
    for shared in (False, True):
        stacks = [KVStack(lanes) for _ in ModelCache(model).layers] if shared else None
        caches = [ModelCache(model, stacks, row) for row in rows]
        for c, p in zip(caches, prompts):
            prefill(model, c, p[:-1])
        passes = [(c, p[-1:], t, 1 + len(t)) for c, p, t in zip(caches, prompts, trees)]
        if shared:
            sizes = [1 + len(t) for t in trees]
            spans = [(int(a), int(b)) for a, b in zip(np.cumsum([0] + sizes[:-1]), np.cumsum(sizes))]
            plan = PassPlan(caches, spans, [TreePass() for _ in caches])
            logits[shared] = batch_pass(model, passes)
        else:
            logits[shared] = [verify_pass(model, c, lead, t, rows=r) for c, lead, t, r in passes]
    for a, b in zip(logits[False], logits[True]):
        assert mx.abs(a - b).max().item() <= 1e-3 * max(1.0, mx.abs(a).max().item())
        assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item()
    return plan


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_wide_lane_attends_in_a_call_of_its_own_and_every_lane_equals_its_solo_pass(family):
    """One lane of 13 rows beside lanes of 1-2: stacking them all would pay 13 query rows a lane,
    so the wide lane goes alone (PassPlan.wide) and the narrow ones stacked; each lane's logits
    equal its solo pass's to rounding, with the same picks."""
    model = zoo.tiny_model(family)
    prompts = PROMPTS[:4]
    trees = [DraftTree([(i + 2) % 97 + 1 for i in range(12)], [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9]),
             DraftTree([], []), DraftTree([5], [-1]), DraftTree([], [])]
    plan = _against_solo_passes(model, prompts, trees, range(len(prompts)), len(prompts))
    assert plan.wide == [0] and plan.narrow == [1, 2, 3] and plan.width == 2


@pytest.mark.parametrize("family,rows,drafts,segments", [
    ("llama", [0, 1, 5, 7], [1, 0, 1, 0], [(0, 2), (5, 3)]),
    ("gemma3_text", [0, 1, 5, 7], [1, 0, 1, 0], [(0, 2), (5, 3)]),
    ("llama", [0, 7], [0, 0], [(0, 1), (7, 1)]),
    ("llama", [2, 4, 5], [0, 0, 0], [(2, 4)]),
    ("gemma3n", [0, 1, 5, 7], [1, 0, 1, 0], [(0, 2), (5, 3)]),
    ("qwen3_moe", [0, 7], [1, 0], [(0, 1), (7, 1)]),
    ("qwen3_5", [0, 1, 5, 7], [1, 0, 1, 0], [(0, 2), (5, 3)]),
])
def test_lanes_far_apart_in_the_stack_attend_in_runs_of_their_own_and_equal_their_solo_passes(
        family, rows, drafts, segments):
    """Lanes at some rows of a stack of 8 (the others idle): one stacked call over all the rows
    between them would read the idle rows' keys too, so the rows go in runs (PassPlan.segments),
    cut where the idle rows cost more than another call (rows 0, 1, 5 and 7, stacked 2 rows wide:
    0-1, then 5-7; rows 2, 4 and 5 at one row a lane: one run); each lane's logits equal its solo
    pass's to rounding, with the same picks."""
    model = zoo.tiny_model(family)
    prompts = [p + [9] * k for k, p in enumerate(PROMPTS[: len(rows)])]  # lengths differ: a run reads to its longest
    trees = [DraftTree([5 + k], [-1]) if n else DraftTree([], []) for k, n in enumerate(drafts)]
    plan = _against_solo_passes(model, prompts, trees, rows, 8)
    assert plan.wide == [] and plan.segments == segments
