"""Losslessness of the engine on tiny random models, against plain greedy decoding."""

import random

from cacheback_mlx.drafters.base import Drafter, NoDrafter
from cacheback_mlx.engine import Engine, accept
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.kvcache import ModelCache
from cacheback_mlx.sampling import SamplingParams
from cacheback_mlx.tree import DraftTree
from cacheback_mlx.verify import prefill, verify_pass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from adversarial import HearsPicks, OracleDrafter, RandomTreeDrafter, WrongDrafter

PROMPT = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8]


def run(model, drafter, prompt=PROMPT, n=40, **kw):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, **kw)
    out = [t for step in eng.generate(prompt, n) for t in step]
    return out, eng


def test_plain_engine_matches_mlx_lm_generate_step(tiny_model):
    ours, _ = run(tiny_model, NoDrafter(), n=30)
    ref = []
    for tok, _ in generate_step(mx.array(PROMPT), tiny_model, max_tokens=30):
        ref.append(int(tok))
    assert ours == ref


def test_greedy_lossless_with_adversarial_drafters(tiny_model):
    truth, plain = run(tiny_model, NoDrafter(), n=48)
    assert plain.stats.passes == 48
    drafters = {
        "oracle-chain": OracleDrafter(PROMPT, truth),
        "oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
        "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)]),
        "random-0": RandomTreeDrafter(PROMPT, truth, seed=0),
        "random-1": RandomTreeDrafter(PROMPT, truth, seed=1),
    }
    for name, d in drafters.items():
        out, eng = run(tiny_model, d, n=48, draft_budget=64)
        assert out == truth, name
        if name.startswith("oracle"):
            assert eng.stats.passes < 48 / 3, (name, eng.stats.passes)
        if name == "wrong":
            assert eng.stats.passes == 48


def test_cache_buffers_stay_a_multiple_of_256_positions_through_rollbacks(tiny_model):
    """Passes that cross a 256-position boundary and are partly rolled back leave the layers'
    buffers a multiple of 256 long, as mlx-lm's plain decoding keeps them (MLX's CUDA backend picks
    a one-query attention kernel by that); mlx-lm's own growth, cutting the buffer to `offset`
    first, would not. Output is unchanged."""
    prompt = [(7 * i + 3) % 90 for i in range(240)]
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), tiny_model, max_tokens=60)]
    eng = Engine(tiny_model, eos_ids=[], drafter=RandomTreeDrafter(prompt, truth, seed=3), context_length=4096,
                 draft_budget=64)
    lengths = []
    eng.watch(lambda event: lengths.extend(c.keys.shape[2] for c in eng.seq.cache.kv))
    assert [t for step in eng.generate(prompt, 60) for t in step] == truth
    assert lengths and all(n % 256 == 0 for n in lengths), sorted(set(lengths))
    assert max(lengths) > 256  # passes went past the first boundary


def test_greedy_lossless_with_padding_buckets(tiny_model):
    truth, _ = run(tiny_model, NoDrafter(), n=32)
    out, _ = run(tiny_model, RandomTreeDrafter(PROMPT, truth, seed=3), n=32, draft_budget=40,
                 buckets=(1, 2, 4, 8, 16, 32, 64))
    assert out == truth


def test_rollback_offset_and_next_logits_match_a_cache_built_without_speculation(tiny_model):
    truth, _ = run(tiny_model, NoDrafter(), n=20)
    out, eng = run(tiny_model, RandomTreeDrafter(PROMPT, truth, seed=7), n=20, draft_budget=32)
    assert out == truth
    seq = PROMPT + truth
    # the cache holds everything but the last token (the next root)
    assert eng.cache.kv[0].offset == eng.cache.length == len(seq) - 1 == len(eng.cached)
    assert eng.cached == seq[:-1]
    spec = verify_pass(tiny_model, eng.cache, [seq[-1]], DraftTree.empty())
    fresh = ModelCache(tiny_model)
    prefill(tiny_model, fresh, seq[:-1])
    plain = verify_pass(tiny_model, fresh, [seq[-1]], DraftTree.empty())
    assert np.allclose(np.array(spec), np.array(plain), atol=1e-4)


def test_tree_pass_logits_equal_sequential_logits(tiny_model):
    """Every node's logits in a tree pass equal those of decoding its root path one by one."""
    caches = ModelCache(tiny_model)
    prefill(tiny_model, caches, PROMPT[:-1])
    tree = DraftTree([7, 9, 11, 13, 7, 2], [-1, -1, 0, 0, 1, 3])
    logits = np.array(verify_pass(tiny_model, caches, [PROMPT[-1]], tree))
    for node in range(len(tree)):
        path, p = [], node
        while p >= 0:
            path.append(int(tree.tokens[p]))
            p = tree.parents[p]
        seq = PROMPT + path[::-1]
        fresh = ModelCache(tiny_model)
        prefill(tiny_model, fresh, seq[:-1])
        ref = np.array(verify_pass(tiny_model, fresh, [seq[-1]], DraftTree.empty()))
        assert np.allclose(logits[node + 1], ref[0], atol=1e-4), node


def test_prefix_reuse_across_calls(tiny_model):
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    first = [t for s in eng.generate(PROMPT, 8) for t in s]
    turn2 = PROMPT + first + [4, 5, 6]
    second = [t for s in eng.generate(turn2, 8) for t in s]
    assert eng.stats.prefill_tokens == 3  # only the new tokens (minus the root) were computed
    fresh = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert second == [t for s in fresh.generate(turn2, 8) for t in s]


def test_a_reply_leaves_the_cache_as_plain_decoding_does_whatever_was_drafted(tiny_model):
    """Drafts accepted past the token limit or an EOS are not kept: the next turn prefills the same
    tokens with any drafter (in half precision on a GPU a prefill's bits depend on its rows)."""
    truth, _ = run(tiny_model, NoDrafter(), n=20)
    for eos_ids, n in (([], 7), ([], 12), ([truth[6]], 20)):
        engines = [Engine(tiny_model, eos_ids=eos_ids, drafter=d, context_length=4096)
                   for d in (NoDrafter(), OracleDrafter(PROMPT, truth))]
        outs = [[t for s in eng.generate(PROMPT, n) for t in s] for eng in engines]
        assert outs[0] == outs[1]
        plain, drafted = engines
        assert drafted.stats.passes < plain.stats.passes  # the drafts were accepted, past the end too
        fed = len(PROMPT) + len(outs[0]) - (not eos_ids)
        assert plain.seq.cached == drafted.seq.cached == (PROMPT + outs[0])[:fed]
        assert plain.seq.cache.length == drafted.seq.cache.length == fed
        turn2 = PROMPT + outs[0] + [4, 5, 6]
        seconds = [[t for s in eng.generate(turn2, 8) for t in s] for eng in engines]
        assert seconds[0] == seconds[1] and plain.stats.prefill_tokens == drafted.stats.prefill_tokens


def test_warm_up_runs_decoding_s_operations_on_caches_of_its_own(tiny_model, monkeypatch):
    """On CUDA an engine runs a tree pass whose kept rows are moved, below and past 256 cached
    keys, before its first request (MLX compiles gathers and scatters at first use there)."""
    from cacheback_mlx import engine as engine_mod
    from cacheback_mlx import kernels, verify
    from cacheback_mlx.kvcache import TreeKVCache

    moved, passes = [], []
    move_rows, verify_pass_ = TreeKVCache.move_rows, verify.verify_pass
    monkeypatch.setattr(TreeKVCache, "move_rows", lambda self, s, d: (moved.append(s.tolist()), move_rows(self, s, d)))
    monkeypatch.setattr(verify, "verify_pass", lambda model, cache, lead, tree, *a: (
        passes.append((cache.length, tree.is_chain())), verify_pass_(model, cache, lead, tree, *a))[1])
    verify.warm_up(tiny_model)
    assert [c for c, _ in passes] == [7, 299] and not any(chain for _, chain in passes)
    assert moved and all(m == [m[0], m[0] + 2, m[0] + 3] for m in moved)  # the path off the first branch
    moved.clear(), passes.clear()
    verify.warm_up(tiny_model, tree_ok=False)
    assert not moved and all(chain for _, chain in passes)
    calls = []
    monkeypatch.setattr(engine_mod, "warm_up", lambda *a, **kw: calls.append(kw))
    Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert calls == []  # not on the CPU
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(kernels, "enabled", False)
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert calls and calls[0]["cached"] == (8, 300) and eng.seq.cache.length == 0


def test_eos_and_max_tokens(tiny_model):
    truth, _ = run(tiny_model, NoDrafter(), n=20)
    eos = truth[6]
    first = truth.index(eos)
    eng = Engine(tiny_model, eos_ids=[eos], drafter=OracleDrafter(PROMPT, truth), context_length=4096)
    out = [t for s in eng.generate(PROMPT, 20) for t in s]
    assert out == truth[:first]
    out, _ = run(tiny_model, OracleDrafter(PROMPT, truth), n=7)
    assert out == truth[:7]


def test_accept_walks_the_models_choices():
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 1, 2])
    # root picks 2 (node 1), node 1 picks 3 (node 2), node 2 picks 9 (no child) -> bonus 9
    path, bonus = accept(tree, [2, 0, 3, 9, 0])
    assert path == [1, 2] and bonus == 9
    assert accept(tree, [5, 0, 0, 0, 0]) == ([], 5)


def test_sampled_first_tokens_match_plain_sampling_distribution(tiny_model):
    """With a drafter proposing the likely tokens, the sampled distribution of the first two
    tokens must equal plain sampling's. A biased acceptance rule would skew it."""
    from collections import Counter

    params = dict(temperature=1.5)
    n = 300

    class Likely(Drafter):
        def __init__(self):
            self.rng = random.Random(0)

        def propose(self, history, budget, max_branching=None):
            return DraftTree([3, 42, 8, 19, 17], [-1, -1, 0, 1, 1])

    engines = {}

    def first_two(drafter, seed):  # one engine per drafter: each call from the cached prompt, a draw of its own
        if type(drafter) not in engines:
            engines[type(drafter)] = Engine(tiny_model, eos_ids=[], drafter=drafter, context_length=4096)
        eng = engines[type(drafter)]
        out = [t for s in eng.generate(PROMPT, 2, SamplingParams(seed=seed, **params)) for t in s]
        return tuple(out[:2])

    plain = Counter(first_two(NoDrafter(), s)[0] for s in range(n))
    spec = Counter(first_two(Likely(), 10_000 + s)[0] for s in range(n))
    # exact target distribution of the first token
    caches = ModelCache(tiny_model)
    prefill(tiny_model, caches, PROMPT[:-1])
    logits = verify_pass(tiny_model, caches, [PROMPT[-1]], DraftTree.empty())[0] / params["temperature"]
    probs = np.array(mx.softmax(logits))
    for counts in (plain, spec):
        top = np.argsort(-probs)[:4]
        expected = np.array([probs[t] * n for t in top] + [n * (1 - probs[top].sum())])
        observed = np.array([counts.get(int(t), 0) for t in top] + [n - sum(counts.get(int(t), 0) for t in top)])
        chi2 = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
        assert chi2 < 20.5, (chi2, observed, expected)  # 4 dof, p ~ 0.0004


def test_a_seeded_request_samples_the_same_text_with_any_drafter(tiny_model):
    """Each position draws from a key of the seed and that position (sampling.seeded_picker), so
    drafting changes how the passes are cut, never what a seeded request samples."""
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=1234)

    def sample(drafter, budget=None):
        eng = Engine(tiny_model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=budget)
        return [t for step in eng.generate(PROMPT, 24, sampling) for t in step]

    plain = sample(NoDrafter())
    truth, _ = run(tiny_model, NoDrafter(), n=24)
    assert plain != truth  # it does sample
    assert sample(RandomTreeDrafter(PROMPT, plain, seed=2), budget=12) == plain
    assert sample(OracleDrafter(PROMPT, plain, extra_wrong_branches=1), budget=5) == plain
    assert sample(WrongDrafter(lambda history: plain[len(history) - len(PROMPT)]), budget=8) == plain
    other = SamplingParams(temperature=1.0, top_k=20, seed=1235)
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert [t for step in eng.generate(PROMPT, 24, other) for t in step] != plain


@pytest.mark.parametrize("vocab", [100, 1000, 49152, 5000 + 17])
def test_top_tokens_are_each_row_s_best_in_order(vocab):
    """sampling.top_tokens: the k best ids of each row, best first, as a full sort gives them: for
    small vocabularies, whole blocks, and a short last block; with the best all in one block, or
    in the last one."""
    from cacheback_mlx.sampling import TOP_BLOCK, top_tokens

    rows = np.array(mx.random.normal((5, vocab), key=mx.random.key(vocab)))
    rows[1, 7:15] = 10 + np.arange(8)  # one block holds the best 8
    rows[2, vocab - 5 :] = 20 + np.arange(5)  # the last block holds the best 5
    rows[3, ::TOP_BLOCK] = 30 + np.arange(len(rows[3, ::TOP_BLOCK]))  # one each in many blocks
    for k in (1, 4, 8):
        got = np.array(top_tokens(mx.array(rows), k))
        assert got.shape == (5, min(k, vocab))
        assert (got == np.argsort(-rows, axis=-1, kind="stable")[:, :k]).all(), k
    assert np.array(top_tokens(mx.array(rows[:, :3]), 8)).shape == (5, 3)  # k above the vocabulary: all


def test_a_seeded_pick_is_the_same_whatever_rows_beside_it():
    from cacheback_mlx.sampling import token_picker

    logits = mx.random.normal((4, 64), key=mx.random.key(0))
    pick = token_picker(SamplingParams(temperature=0.7, top_p=0.95, seed=9))
    tree = DraftTree([1, 2, 3], [-1, 0, -1])  # rows at positions 10 (the root), 11, 12 and 11
    together = pick(logits, 10, tree).tolist()
    alone = [pick(logits[i : i + 1], p, DraftTree.empty()).item() for i, p in enumerate([10, 11, 12, 11])]
    assert together == alone
    # the draws of one position over many seeds follow the distribution
    probs = np.array(mx.softmax(logits[0] / 0.5))
    counts = np.zeros(64)
    for seed in range(600):
        counts[token_picker(SamplingParams(temperature=0.5, seed=seed))(logits[:1], 3, DraftTree.empty()).item()] += 1
    top = np.argsort(-probs)[:4]
    expected = np.append(probs[top], 1 - probs[top].sum()) * 600
    observed = np.append(counts[top], 600 - counts[top].sum())
    chi2 = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert chi2 < 20.5, (chi2, observed, expected)  # 4 dof, p ~ 0.0004


def test_out_of_vocabulary_drafts_are_dropped_not_crashing(tiny_model):
    truth, _ = run(tiny_model, NoDrafter(), n=12)

    class Foreign(Drafter):  # e.g. a table built for another tokenizer
        def propose(self, history, budget, max_branching=None):
            return DraftTree([10**6, 3, -5, 7], [-1, 0, -1, -1])

    out, _ = run(tiny_model, Foreign(), n=12)
    assert out == truth
    kept = DraftTree([10**6, 3, -5, 7, 8], [-1, 0, -1, -1, 3]).keep_valid(96)
    assert list(kept.tokens) == [7, 8] and list(kept.parents) == [-1, 0]


def test_every_registered_drafter_is_lossless_on_tiny_models(tiny_model, tmp_path):
    from cacheback_mlx.drafters import drafter_names, make_drafter
    from cacheback_mlx.drafters.rest import save_datastore

    prompt = PROMPT * 4  # repetition gives the drafters something to find
    truth, _ = run(tiny_model, NoDrafter(), prompt=prompt, n=40)
    save_datastore([prompt + truth[:20], truth], tmp_path / "rest")
    from cacheback_mlx.loader import LoadedModel

    target = LoadedModel(tiny_model, None, "tiny", "", 4096, "float32", None)
    params = {"rest": {"datastore": str(tmp_path / "rest")}, "ssd": {"path": str(tmp_path / "ssd.npy")},
              "card": {"draft": "self:1", "parallel": False, "target": target}}
    for name in drafter_names():
        d = make_drafter(name, **params.get(name, {}))
        out, eng = run(tiny_model, d, prompt=prompt, n=40, draft_budget=16)
        assert out == truth, name


def test_prompt_ids_outside_the_vocabulary_get_a_one_line_error(tiny_model):
    from cacheback_mlx.errors import CachebackError

    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    for bad in ([5, eng.vocab_size], [-1, 5]):
        with pytest.raises(CachebackError) as e:
            list(eng.generate(bad, 4))
        assert str(e.value).startswith("prompt token ids must be in [0, ") and "\n" not in str(e.value)
    assert [t for s in eng.generate(PROMPT, 4) for t in s] == run(tiny_model, NoDrafter(), n=4)[0]


def test_prefill_only_then_generate_reuses_it_and_stays_lossless(tiny_model):
    """Editors' warm-ups (n_predict 0): the prompt is prefilled and nothing generated; the next
    request that extends it computes only its new tokens, with the same output as a fresh run."""
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    eng.prefill_only(PROMPT, context=[9, 9, 9])
    assert eng.stats.prefill_tokens == len(PROMPT) - 1 and eng.stats.tokens == 0
    longer = PROMPT + [4, 5, 6]
    out = [t for s in eng.generate(longer, 12) for t in s]
    assert eng.stats.prefill_tokens == 3
    assert out == run(tiny_model, NoDrafter(), prompt=longer, n=12)[0]
    with pytest.raises(CachebackError, match="max_tokens"):
        next(eng.generate(longer, 0))


class Recorder(Drafter):
    def __init__(self):
        self.calls = []

    def learn(self, tokens):
        self.calls.append(("learn", list(tokens)))

    def observe(self, tokens):
        self.calls.append(("observe", list(tokens)))


class Order(Drafter):
    """Drafts the same three tokens every pass, and keeps the order of the engine's calls."""

    def __init__(self):
        self.calls = []

    def propose(self, history, budget, max_branching=None):
        self.calls.append("propose")
        return DraftTree.chain([7, 8, 9][:budget])

    def catch_up(self):
        self.calls.append("catch_up")

    def observe(self, tokens):
        self.calls.append("observe")


def passes_of(calls: list[str]) -> int:
    """The passes in an Order drafter's calls, each checked to be [propose,] catch_up, observe (no
    proposal where no token is left to draft), after the prompt's observe calls."""
    text = " ".join(calls).split("observe")
    assert text[-1] == "" and all(not part.strip() for part in text[:1])
    parts = [part.split() for part in text[1:-1]]
    body = [p for p in parts if p]
    assert all(p in (["propose", "catch_up"], ["catch_up"]) for p in body), body
    assert ["propose", "catch_up"] in body
    return len(body)


def test_the_drafter_catches_up_once_a_pass_while_it_runs(tiny_model):
    """Between proposing for a pass and hearing its tokens, the drafter gets catch_up() once (the
    engine's passes and a batch's lanes alike; Drafter.catch_up); the outputs stay plain decoding's."""
    from cacheback_mlx.batch import Batch

    truth, _ = run(tiny_model, NoDrafter(), n=16)
    d = Order()
    out, eng = run(tiny_model, d, n=16, draft_budget=4)
    assert out == truth
    assert passes_of(d.calls) == eng.stats.passes
    lanes = []
    batch = Batch(Engine(tiny_model, [], NoDrafter(), 4096, draft_budget=4), 2,
                  lambda: lanes.append(Order()) or lanes[-1])
    done = batch.run([dict(prompt=PROMPT, max_tokens=16), dict(prompt=PROMPT[:6], max_tokens=12)])
    assert done[0].tokens == truth
    for lane in done:
        assert passes_of(lane.drafter.calls) == lane.stats.passes


class PickRecorder(HearsPicks, RandomTreeDrafter):
    """Random trees (rows accepted and rejected alike), and what Drafter.recycle hears of each pass."""


class BestRecorder(PickRecorder):
    """PickRecorder that asks for the model's 3 next-best tokens at each row too."""

    alternatives = 3


@pytest.mark.parametrize("recorder", [PickRecorder, BestRecorder])
def test_the_drafter_hears_the_model_s_pick_at_every_row_of_a_pass(tiny_model, recorder):
    """After each pass the drafter gets (row's token, the model's pick there and its next-best
    tokens) for the root's row and every node's, rejected drafts included: each pick is the token
    plain decoding would choose after that row's path, and the others (Drafter.alternatives of
    them) the next best logits there, best first."""
    truth, _ = run(tiny_model, NoDrafter(), n=24)
    d = recorder(PROMPT, truth, seed=3)
    out, eng = run(tiny_model, d, n=24, draft_budget=16)
    assert out == truth
    assert len(d.heard) == eng.stats.passes
    rejected = 0
    for history, tree, picks in d.heard:
        assert picks[0][0] == history[-1] and picks[0][1][0] == truth[len(history) - len(PROMPT)]
        assert [t for t, _ in picks[1:]] == tree.tokens[: len(picks) - 1].tolist()
        for node, (token, best) in enumerate(picks):
            path, p = [], node - 1  # row 0: the root's, then node - 1's
            while p >= 0:
                path.append(int(tree.tokens[p]))
                p = int(tree.parents[p])
            context = history + path[::-1]
            logits = np.array(tiny_model(mx.array(context)[None])[0, -1])
            assert len(best) == 1 + d.alternatives and len(set(best)) == len(best)
            ranked = np.sort(logits)[::-1]
            for k, b in enumerate(best):  # the k-th best, up to rounding
                assert abs(logits[b] - ranked[k]) <= 1e-4, (context, best)
            rejected += context != (PROMPT + truth)[: len(context)]
    assert rejected > 0  # rows off the model's path were heard too


def test_auto_drafting_the_model_s_best_tokens_stays_lossless(tiny_model):
    """auto with each row's 4 best tokens (recycle=4; the default once passes are wide): the same
    tokens as plain decoding, having heard 4 of them at rows of its passes."""
    from cacheback_mlx.drafters.auto import AutoDrafter

    truth, _ = run(tiny_model, NoDrafter(), n=48)
    d = AutoDrafter(ssd=False, frozen=False, datastore=False, recycle=4)
    out, _ = run(tiny_model, d, n=48, draft_budget=40)
    assert out == truth
    assert any(len(best) == 4 for best in d.picks.values())


def test_context_segments_are_learned_once_but_the_last(tiny_model):
    """Text beside the prompt in segments (an editor's chunks, then the code below the cursor):
    a drafter learns each chunk once and the last segment every request; a new drafter learns
    them all again; a flat list of ids is one segment, learned every time."""
    rec = Recorder()
    eng = Engine(tiny_model, eos_ids=[], drafter=rec, context_length=4096)
    a, b, c, below = [21, 22], [23, 24], [25], [31, 32]
    eng.prefill_only(PROMPT, context=[a, b, below])
    assert [x for x in rec.calls if x[0] == "learn"] == [("learn", a), ("learn", b), ("learn", below)]
    rec.calls.clear()
    list(eng.generate(PROMPT + [5], 2, context=[a, b, c, below]))
    assert [x for x in rec.calls if x[0] == "learn"] == [("learn", c), ("learn", below)]
    rec2 = Recorder()
    eng.reset_drafter(rec2)
    list(eng.generate(PROMPT + [5], 2, context=[a, b, c, below]))
    assert [x for x in rec2.calls if x[0] == "learn"] == [("learn", a), ("learn", b), ("learn", c), ("learn", below)]
    rec2.calls.clear()
    list(eng.generate(PROMPT + [5], 2, context=below))
    assert rec2.calls[0] == ("learn", below)


def test_edited_prompt_refreshes_the_text_before_the_edit(tiny_model):
    """An editor's next prompt departs from the last one at the cursor: the drafter learns the
    text just before it again (so it is the most recent), then observes only the new part. A
    prompt that continues the last one (a chat's next turn) is observed without that."""
    rec = Recorder()
    eng = Engine(tiny_model, eos_ids=[], drafter=rec, context_length=4096)
    first = [t for s in eng.generate(PROMPT, 4) for t in s]
    rec.calls.clear()
    list(eng.generate(PROMPT + first + [7], 2))  # continues: no refresh
    assert rec.calls[0] == ("observe", [7])
    rec.calls.clear()
    edited = PROMPT[:6] + [11, 12]
    list(eng.generate(edited, 2))
    assert rec.calls[:2] == [("learn", PROMPT[:6]), ("observe", [11, 12])]


def test_running_ahead_is_off_on_the_cpu_unless_asked(tiny_model, monkeypatch):
    from cacheback_mlx.engine import RUN_AHEAD_ENV

    monkeypatch.delenv(RUN_AHEAD_ENV, raising=False)
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert not eng.run_ahead
    list(eng.generate(PROMPT, 8))
    assert eng.stats.ahead == 0
    monkeypatch.setenv(RUN_AHEAD_ENV, "1")
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert [t for s in eng.generate(PROMPT, 16) for t in s] == run(tiny_model, NoDrafter(), n=16)[0]
    assert eng.stats.ahead == 16 - Engine.RUN_AHEAD_QUIET  # from the RUN_AHEAD_QUIET-th quiet pass on
    eng.set_run_ahead(False)
    list(eng.generate(PROMPT + [1], 4))
    assert eng.stats.ahead == 0


def test_half_precision_on_a_gpu_feeds_the_prompt_as_mlx_lm_does(monkeypatch):
    """Where a product's bits depend on how many rows it runs (a GPU in float16/bfloat16), only
    mlx-lm's own prompt layout leaves its bits in the caches: there the engine makes the very
    calls generate_step makes (chunks of 2,048 from the first uncached token, the last prompt
    token alone), then one-row steps for a pass without drafts. Checked by the calls' rows on a
    float16 model with that layout set (the CPU's default keeps the engine's own layout, whose
    calls differ), token for token equal to generate_step."""
    from cacheback_mlx.footprint import compute_dtype

    import zoo

    model = zoo.tiny_model("llama")
    model.set_dtype(mx.float16)
    assert compute_dtype(model) == mx.float16
    prompt = [(13 * i + 5) % 97 + 1 for i in range(2100)]
    rows = []
    cls, call = type(model), type(model).__call__

    def recording(self, inputs, *args, **kwargs):
        rows.append(int(inputs.shape[1]))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", recording)
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
    theirs = rows[:]
    assert theirs[:3] == [2048, 2100 - 2048 - 1, 1], theirs
    layouts = {}
    for as_mlx_lm in (False, True):
        eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
        assert not eng.prompt_as_mlx_lm  # on the CPU the engine's own layout by default
        eng.set_prompt_layout(as_mlx_lm)
        rows.clear()
        out = [t for step in eng.generate(prompt, 6) for t in step]
        assert out == truth, as_mlx_lm
        layouts[as_mlx_lm] = rows[:]
    assert layouts[True] == theirs[: len(layouts[True])] and len(layouts[True]) == 2 + 6, layouts[True]
    assert layouts[False][0] < 2048  # the engine's own chunks: its calls are not mlx-lm's
    # a request sharing passes with others (a server's lanes) is not exact in any layout: it
    # keeps the engine's chunks, which hold the other lanes' passes up less
    assert eng.chunk_rule() == 2048 and eng.chunk_rule(beside_others=True) != 2048


def test_a_short_last_prefill_chunk_joins_the_one_before():
    """On the CPU a prompt's last piece of at most half a chunk goes in the chunk before it, so no
    chunk reads all the weights for a few tokens; a longer one keeps a chunk of its own."""
    from cacheback_mlx.verify import cpu_prefill_chunk

    import zoo

    assert cpu_prefill_chunk(0) == 128 and cpu_prefill_chunk(0, 500) == 128
    assert cpu_prefill_chunk(0, 192) == 192 and cpu_prefill_chunk(0, 193) == 128
    assert cpu_prefill_chunk(5000, 96) == 96 and cpu_prefill_chunk(5000, 97) == 64
    model = zoo.tiny_model("llama")
    for n, want in ((179, [179]), (250, [128, 122]), (300, [128, 172]), (60, [60])):
        cache, rows = ModelCache(model), []
        prefill(model, cache, [(7 * i) % 90 + 1 for i in range(n)], cpu_prefill_chunk,
                timed=lambda r, cached, seconds: rows.append(r))
        assert rows == want and cache.length == n, (n, rows)
