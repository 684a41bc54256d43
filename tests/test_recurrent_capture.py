"""Recurrent layers keep the accepted prefix of a chain pass (recurrent.py): every row's conv and
SSM / gated-delta state is captured during a verify pass, so a chain accepted up to row m-1 keeps
the states after row m-1 instead of being undone and fed again. Exact against mlx-lm: the engine's
greedy tokens equal mlx-lm's own, with no pass undone on a capturing family; families whose mixers
do not capture (Mamba 1, Jamba) keep the snapshot-and-re-feed fallback."""

import random

from cacheback_mlx import recurrent
from cacheback_mlx.drafters.base import Drafter, NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.kvcache import ModelCache
from cacheback_mlx.tree import DraftTree
from cacheback_mlx.verify import prefill, verify_pass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta, ssm

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter
from test_families import reference

PROMPT = [(7 * i + 3) % 97 + 1 for i in range(24)]
N = 24
CHAIN = [5, 9, 11, 2, 40, 7, 3]  # a pass of 8 rows: the root + 7 drafts
CAPTURING = ("qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1", "lfm2", "mamba2")
SNAPSHOT_ONLY = ("mamba", "jamba")


def test_every_hybrid_family_is_placed():
    assert set(CAPTURING) | set(SNAPSHOT_ONLY) == set(zoo.HYBRID)


@pytest.fixture(scope="module", params=CAPTURING)
def capturing(request):
    return request.param, zoo.tiny_model(request.param)


class PartlyRight(Drafter):
    """Chains whose first k tokens (k drawn from 0..right each pass) are the true continuation and
    the rest wrong: most passes are accepted up to a strict prefix. vary: chains of 1..budget
    tokens (else the whole budget)."""

    def __init__(self, prompt, truth, right=3, seed=0, vary=False):
        self.full = list(prompt) + list(truth)
        self.right = right
        self.rng = random.Random(seed)
        self.vary = vary

    def propose(self, history, budget, max_branching=None):
        pos = len(history)
        budget = self.rng.randint(1, budget) if self.vary and budget > 0 else budget
        k = min(self.rng.randint(0, self.right), budget)
        good = self.full[pos : pos + k]
        last = len(self.full) - 1
        # never the true token: it plus 1..budget, mod 90
        bad = [(self.full[min(pos + k + i, last)] + 1 + i) % 90 for i in range(budget - len(good))]
        return DraftTree.chain(good + bad)


def spy_finish(eng):
    """Record every (rows, whole, kept) of the engine's finish_pass calls."""
    calls = []
    inner = eng.cache.finish_pass

    def finish(rows, whole, committed=None):
        kept = inner(rows, whole, committed)
        calls.append((list(rows), whole, kept))
        return kept

    eng.cache.finish_pass = finish
    return calls


def run(model, drafter, prompt=PROMPT, n=N, **kw):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, **kw)
    calls = spy_finish(eng)
    return [t for step in eng.generate(prompt, n) for t in step], eng, calls


def states(cache: ModelCache) -> list[np.ndarray]:
    return [np.array(a) for c in cache.recurrent for a in c.cache]


def worst(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest difference, relative to each array's largest value (at least 1)."""
    return max(float(np.abs(x - y).max() / max(1.0, float(np.abs(y).max()))) for x, y in zip(a, b))


# --- where capture is decided ------------------------------------------------------------------

@pytest.mark.parametrize("name", zoo.HYBRID)
def test_capture_is_decided_once_per_model(name, monkeypatch):
    cache = ModelCache(zoo.tiny_model(name))
    assert (cache.capture is not None) == (name in CAPTURING), name
    assert all(c.capture is cache.capture for c in cache.recurrent), name
    monkeypatch.setattr(recurrent, "enabled", False)  # CACHEBACK_MLX_CAPTURE=0
    assert ModelCache(zoo.tiny_model(name)).capture is None


# --- the recurrence, one row at a time -----------------------------------------------------------

def test_gated_delta_by_rows_is_mlx_lm_own_loop_bit_for_bit():
    """On the CPU mlx-lm's gated_delta_update runs a loop over rows: one row per call gives the
    same outputs and final state bit for bit, and every row's state is the state of mlx-lm's
    one-row call from the previous row's state."""
    assert recurrent.by_rows("gated_delta_update")
    mx.random.seed(3)
    B, T, Hk, Hv, D = 1, 6, 2, 4, 16
    q, k = (mx.random.normal((B, T, Hk, D)) for _ in range(2))
    v = mx.random.normal((B, T, Hv, D))
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = mx.random.normal((B, Hv, D, D))
    stock = gated_delta.gated_delta_update
    y_ref, s_ref = stock(q, k, v, a, b, A_log, dt_bias, state)
    capture = recurrent.Capture()
    cache = recurrent.RecurrentCache(2, capture)
    capture.start(T)
    assert capture.hold
    recurrent._pending.cache = cache
    y, s = recurrent.capturing(stock)(q, k, v, a, b, A_log, dt_bias, state)
    assert np.array_equal(np.array(y), np.array(y_ref)) and np.array_equal(np.array(s), np.array(s_ref))
    prev = state
    for t in range(T):
        _, one = stock(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], a[:, t : t + 1], b[:, t : t + 1],
                       A_log, dt_bias, prev)
        assert np.array_equal(np.array(cache.row_state(t + 1)), np.array(one)), t
        prev = one


def test_ssm_replay_leaves_the_pass_to_mlx_lm_and_runs_the_kept_rows_again():
    """mlx-lm's ssm_update for several rows is chunked and returns the last state only (and run
    row by row it costs ~2x a pass on the CPU): the pass gets mlx-lm's own result, and the state
    after row m-1 is ssm_update on the first m rows from the state before the pass, bit for bit
    what feeding those rows gives; within float32 rounding of one-row steps."""
    assert not recurrent.by_rows("ssm_update")
    mx.random.seed(4)
    B, T, H, Dh, G, Ds = 1, 6, 4, 8, 1, 16
    x = mx.random.normal((B, T, H, Dh))
    Bm, C = mx.random.normal((B, T, G, Ds)), mx.random.normal((B, T, G, Ds))
    dt = mx.random.normal((B, T, H))
    A_log, D, dt_bias = mx.random.normal((H,)), mx.random.normal((H,)), mx.random.normal((H,))
    state = mx.random.normal((B, H, Dh, Ds))
    limit = (0.0, float("inf"))
    stock = ssm.ssm_update
    cache = recurrent.RecurrentCache(2)
    recurrent._pending.cache = cache
    got = recurrent.capturing(stock)(x, A_log, Bm, C, D, dt, dt_bias, state, limit)
    for g, w in zip(got, stock(x, A_log, Bm, C, D, dt, dt_bias, state, limit)):
        assert np.array_equal(np.array(g), np.array(w))
    prev = state
    for m in range(1, T + 1):
        fed = stock(x[:, :m], A_log, Bm[:, :m], C[:, :m], D, dt[:, :m], dt_bias, state, limit)[1]
        assert np.array_equal(np.array(cache.row_state(m)), np.array(fed)), m
        _, prev = stock(x[:, m - 1 : m], A_log, Bm[:, m - 1 : m], C[:, m - 1 : m], D, dt[:, m - 1 : m],
                        dt_bias, prev, limit)
        assert worst([np.array(cache.row_state(m))], [np.array(prev)]) < 1e-5, m


def test_without_a_capturing_cache_the_routed_functions_are_mlx_lm_own():
    mx.random.seed(5)
    x = mx.random.normal((1, 3, 2, 8))
    Bm, C, dt = mx.random.normal((1, 3, 1, 4)), mx.random.normal((1, 3, 1, 4)), mx.random.normal((1, 3, 2))
    args = (x, mx.zeros((2,)), Bm, C, mx.ones((2,)), dt, mx.zeros((2,)), mx.zeros((1, 2, 8, 4)))
    recurrent._pending.cache = None
    for got, want in zip(recurrent.capturing(ssm.ssm_update)(*args), ssm.ssm_update(*args)):
        assert np.array_equal(np.array(got), np.array(want))


# --- ModelCache: a chain pass of n rows, keep m ---------------------------------------------------

def model_in_float64(name):
    """The family's tiny model in float64 where it runs in it (MoE layers only run in float32), so
    that float32 noise from passes of other sizes cannot hide a wrong state; and a tolerance."""
    model = zoo.tiny_model(name)
    model.set_dtype(mx.float64)
    try:
        mx.eval(model(mx.array([PROMPT[:4]])))
        return model, 1e-12
    except RuntimeError:  # e.g. "[GatherMM::eval] Currently only supports float32"
        model.set_dtype(mx.float32)
        return model, 1e-4


@pytest.mark.parametrize("name", CAPTURING)
def test_a_kept_prefix_equals_prefilling_it_from_the_snapshot(name):
    """Run a chain pass of 8 rows, keep rows 0..m-1: every recurrent layer's conv and recurrent
    state equals the state after prefilling the same m tokens (from the same cached prompt), and
    is far from the state one row further on (so the comparison would see an off-by-one)."""
    model, tol = model_in_float64(name)
    rows = [PROMPT[-1]] + CHAIN
    for m in (1, 2, 5, len(rows) - 1):
        cache = ModelCache(model)
        prefill(model, cache, PROMPT[:-1])
        mx.eval(verify_pass(model, cache, [PROMPT[-1]], DraftTree.chain(CHAIN)))
        assert cache.capture.rows == len(rows)  # the pass captured
        assert cache.finish_pass(list(range(m)), whole=False) is True
        assert cache.length == len(PROMPT) - 1 + m
        assert all(c.windows is None and c.row_state is None for c in cache.recurrent)  # dropped
        got = states(cache)
        fed = {}
        for k in (m, m + 1):
            ref = ModelCache(model)
            prefill(model, ref, PROMPT[:-1])
            prefill(model, ref, rows[:k])
            fed[k] = states(ref)
        assert worst(got, fed[m]) <= tol, (name, m, worst(got, fed[m]))
        assert worst(got, fed[m + 1]) > 1000 * tol, (name, m)


@pytest.mark.parametrize("name", ("qwen3_next", "qwen3_5", "lfm2"))
def test_a_kept_prefix_is_mlx_lm_own_prefix_state_of_the_same_pass(name):
    """The same pass run with mlx-lm's own way of stopping a sequence early (its caches'
    `lengths`: the conv window at row m, the gated-delta recurrence masked past it) ends in the
    states kept here, bit for bit: every conv window and every gated-delta state. (On the SSM
    families one-row steps differ from mlx-lm's chunked form for several rows in the last bits,
    and mlx-lm's SSM form has no exact early stop: their states are checked against one-row
    steps and against prefills above.)"""
    model = zoo.tiny_model(name)
    rows = len(CHAIN) + 1
    for m in (1, 3, rows - 1):
        kept = ModelCache(model)
        prefill(model, kept, PROMPT[:-1])
        mx.eval(verify_pass(model, kept, [PROMPT[-1]], DraftTree.chain(CHAIN)))
        assert kept.finish_pass(list(range(m)), whole=False)
        plain = ModelCache(model)
        prefill(model, plain, PROMPT[:-1])
        plain.capture = None
        for c in plain.recurrent:
            c.capture = None
            c.lengths = mx.array([m])
        mx.eval(verify_pass(model, plain, [PROMPT[-1]], DraftTree.chain(CHAIN)))
        for c, p in zip(kept.recurrent, plain.recurrent):
            for got, want in zip(c.cache, p.cache):
                assert np.array_equal(np.array(got), np.array(want)), (name, m)


@pytest.mark.parametrize("name", CAPTURING)
def test_capture_leaves_the_pass_unchanged(name, monkeypatch):
    """A capturing pass gives the same logits and final states as a plain one, bit for bit (by
    rows, gated delta is mlx-lm's own loop over rows; replay leaves the pass to mlx-lm)."""
    model = zoo.tiny_model(name)
    out = []
    for on in (True, False):
        monkeypatch.setattr(recurrent, "enabled", on)
        cache = ModelCache(model)
        prefill(model, cache, PROMPT[:-1])
        logits = verify_pass(model, cache, [PROMPT[-1]], DraftTree.chain(CHAIN))
        mx.eval(logits)
        assert cache.finish_pass(list(range(len(CHAIN) + 1)), whole=True)
        out.append([np.array(logits)] + states(cache))
    assert all(np.array_equal(a, b) for a, b in zip(*out)), name


@pytest.mark.parametrize("name", ("qwen3_next", "qwen3_5"))
def test_gated_delta_past_the_memory_cap_replays_to_the_same_states(name, monkeypatch):
    """Where every row's state would take more than MAX_BYTES, gated delta replays the kept rows
    instead of holding every row's state: the same kept states, bit for bit, and still kept (the
    capture decision depends on the pass's rows alone, so all ranks of a sharded model agree)."""
    model = zoo.tiny_model(name)
    kept = {}
    for cap in (recurrent.MAX_BYTES, 0):
        monkeypatch.setattr(recurrent, "MAX_BYTES", cap)
        cache = ModelCache(model)
        prefill(model, cache, PROMPT[:-1])
        mx.eval(verify_pass(model, cache, [PROMPT[-1]], DraftTree.chain(CHAIN)))
        assert cache.capture.hold == (cap > 0)
        assert cache.finish_pass([0, 1, 2], whole=False)
        kept[cap] = states(cache)
    assert all(np.array_equal(a, b) for a, b in zip(*kept.values()))


def test_passes_past_the_row_limit_and_interrupted_passes_do_not_keep_a_prefix(monkeypatch):
    model = zoo.tiny_model("qwen3_5")
    cache = ModelCache(model)
    prefill(model, cache, PROMPT[:-1])
    monkeypatch.setattr(recurrent, "MAX_ROWS", 4)
    before = states(cache)
    mx.eval(verify_pass(model, cache, [PROMPT[-1]], DraftTree.chain(CHAIN)))  # 8 rows: no capture
    assert cache.capture.rows == 0
    assert cache.finish_pass([0, 1, 2], whole=False) is False  # undone from the snapshot
    assert worst(states(cache), before) == 0 and cache.length == len(PROMPT) - 1
    mx.eval(verify_pass(model, cache, [PROMPT[-1]], DraftTree.chain(CHAIN[:2])))  # 3 rows: captures
    assert cache.capture.rows == 3
    assert cache.trim(cache.length) == len(PROMPT) - 1  # an interrupted pass: restored, rows dropped
    assert worst(states(cache), before) == 0 and cache.capture.rows == 0
    assert all(c.windows is None and c.row_state is None for c in cache.recurrent)


# --- the engine: greedy tokens equal mlx-lm's; prefixes kept, nothing fed again --------------------

def test_capturing_families_keep_prefixes_and_equal_mlx_lm(capturing):
    name, model = capturing
    truth = reference(model, PROMPT, N)
    drafters = {
        "partly-right": PartlyRight(PROMPT, truth, right=3, seed=1),
        "partly-right-long": PartlyRight(PROMPT, truth, right=6, seed=2),
        "random": RandomTreeDrafter(PROMPT, truth, seed=0),
        "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)]),
        "oracle": OracleDrafter(PROMPT, truth),
        "none": NoDrafter(),
    }
    for label, d in drafters.items():
        out, eng, calls = run(model, d, draft_budget=6)
        assert out == truth, (name, label)
        assert eng.stats.undone == 0, (name, label)
        assert all(kept for _, _, kept in calls), (name, label)
        if label.startswith("partly-right"):
            assert eng.stats.mat > 1, (name, label, eng.stats.mat)
            strict = [rows for rows, whole, _ in calls if not whole and len(rows) > 1]
            assert strict, (name, label)  # passes kept a strict prefix of two rows or more


@pytest.mark.parametrize("name", SNAPSHOT_ONLY)
def test_families_without_capture_undo_and_feed_again(name):
    model = zoo.tiny_model(name)
    truth = reference(model, PROMPT, N)
    out, eng, calls = run(model, PartlyRight(PROMPT, truth, right=3, seed=1), draft_budget=6)
    assert out == truth, name
    assert eng.stats.undone > 0 and eng.stats.mat > 1, name
    assert all(not kept for _, whole, kept in calls if not whole), name


def test_capture_off_and_long_passes_fall_back_to_snapshots(monkeypatch):
    model = zoo.tiny_model("nemotron_h")
    truth = reference(model, PROMPT, N)
    monkeypatch.setattr(recurrent, "MAX_ROWS", 4)  # passes of 2-7 rows: only some capture
    out, eng, calls = run(model, PartlyRight(PROMPT, truth, right=3, seed=3, vary=True), draft_budget=6)
    assert out == truth and eng.stats.undone > 0
    assert any(kept for rows, whole, kept in calls if not whole)  # the short passes still keep
    monkeypatch.setattr(recurrent, "enabled", False)
    out, eng, _ = run(model, PartlyRight(PROMPT, truth, right=3, seed=1), draft_budget=6)
    assert out == truth and eng.stats.undone > 0 and eng.cache.capture is None
