"""The real default model (SmolLM2-135M): sensible answers, and every drafter lossless against
plain greedy decoding, token for token."""

from cacheback_mlx.api import Session
from cacheback_mlx.drafters import drafter_names, make_drafter
from cacheback_mlx.engine import Engine

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

pytestmark = pytest.mark.slow

PROMPTS = [
    ("chat", "Write a Python function that returns the n-th Fibonacci number, then explain it."),
    ("raw", "def bubble_sort(items):\n    \"\"\"Sort a list in place.\"\"\"\n    n = len(items)\n"),
]
N = 64


@pytest.fixture(scope="module")
def session(default_model):
    return Session(default_model, drafter="none")


@pytest.fixture(scope="module")
def plain_outputs(session, default_model):
    out = {}
    for mode, text in PROMPTS:
        ids = session.encode(text, chat=(mode == "chat"))
        eng = Engine(default_model.model, [], make_drafter("none"), default_model.context_length)
        out[mode] = (ids, [t for step in eng.generate(ids, N) for t in step])
    return out


def test_capital_of_france(session):
    session.set_drafter("ngram")
    assert "Paris" in session.generate("What is the capital of France?", max_tokens=24)


def test_plain_engine_matches_mlx_lm(default_model, plain_outputs):
    ids, ours = plain_outputs["raw"]
    ref = [int(t) for t, _ in generate_step(mx.array(ids), default_model.model, max_tokens=N)]
    assert ours == ref


def test_passes_rolled_back_across_a_256_position_boundary_match_mlx_lm(default_model):
    """A 250-token prompt, then draft trees of up to 16 rows across position 256, partly rolled back:
    the caches grow from mid-buffer (in whole 256-position steps, as mlx-lm's decoding keeps them)
    and the tokens are mlx-lm's; then wrong drafts once over position 256 and plain steps after
    them: each pass sees the buffer length plain decoding has at its length (TreeKVCache.fit)."""
    from cacheback_mlx.kvcache import TreeKVCache

    from adversarial import RandomTreeDrafter, WrongOnce

    prompt = [(11 * i + 7) % 5000 + 100 for i in range(250)]
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), default_model.model, max_tokens=24)]
    eng = Engine(default_model.model, [], RandomTreeDrafter(prompt, truth, seed=7, vocab=5000),
                 default_model.context_length, draft_budget=16)
    lengths = []
    eng.watch(lambda event: lengths.extend(c.keys.shape[2] for c in eng.seq.cache.kv if type(c) is TreeKVCache))
    assert [t for step in eng.generate(prompt, 24) for t in step] == truth
    assert eng.stats.passes < 24 and max(lengths) == 512 and all(n % 256 == 0 for n in lengths)
    eng = Engine(default_model.model, [], WrongOnce(lambda h: (truth + [0])[len(h) - len(prompt)], len(prompt) + 3),
                 default_model.context_length, draft_budget=16)
    seen = []
    eng.watch(lambda event: seen.extend((c.keys.shape[2], c.offset) for c in eng.seq.cache.kv
                                        if type(c) is TreeKVCache))
    assert [t for step in eng.generate(prompt, 24) for t in step] == truth
    assert eng.stats.drafted > 0 and max(n for n, _ in seen) == 512
    assert all(n == -(-offset // 256) * 256 for n, offset in seen), sorted(set(seen))


def test_a_last_prefill_piece_joined_to_the_chunk_before_matches_mlx_lm(default_model):
    """A 180-token prompt: its prefill ends in one chunk of more than 128 rows (a last piece of at
    most half a chunk joins the chunk before it, verify.cpu_prefill_chunk), then draft trees; the
    tokens are mlx-lm's."""
    from adversarial import RandomTreeDrafter

    prompt = [(13 * i + 3) % 5000 + 100 for i in range(180)]
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), default_model.model, max_tokens=16)]
    eng = Engine(default_model.model, [], RandomTreeDrafter(prompt, truth, seed=3, vocab=5000),
                 default_model.context_length, draft_budget=8)
    chunks = []
    eng.watch(lambda event: event.kind == "prefill" and chunks.append(event.rows))
    assert [t for step in eng.generate(prompt, 16) for t in step] == truth
    assert chunks and chunks[0] > 128, chunks


def test_weights_stored_transposed_match_mlx_lm_on_the_loaded_layout(default_model, plain_outputs, monkeypatch):
    """The loader stores the weights [in, out] for OpenBLAS (blas.transpose_weights): the engine
    on them gives mlx-lm's greedy tokens on the model loaded in its own layout."""
    from cacheback_mlx import blas
    from cacheback_mlx.loader import load

    if not blas.weight_layout_wanted():
        pytest.skip(f"the layout is not used here (openblas: {blas.status})")
    q = default_model.model.model.layers[0].mlp.up_proj.weight
    assert memoryview(q).strides[0] < memoryview(q).strides[1]  # stored [in, out]
    monkeypatch.setenv(blas.LAYOUT_ENV, "0")
    stock = load(None).model
    w = stock.model.layers[0].mlp.up_proj.weight
    assert memoryview(w).strides[0] > memoryview(w).strides[1]  # as loaded
    ids, ours = plain_outputs["raw"]
    n = N // 4  # a matmul's layout shows at every step
    assert ours[:n] == [int(t) for t, _ in generate_step(mx.array(ids), stock, max_tokens=n)]


@pytest.fixture(scope="module")
def drafter_params(default_model, tmp_path_factory):
    """What drafters need beyond defaults: a small REST datastore, a private SSD buffer."""
    import sysconfig
    from pathlib import Path

    from cacheback_mlx.drafters.rest import save_datastore

    folder = tmp_path_factory.mktemp("drafters")
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = [default_model.tokenizer.encode(p.read_text()) for p in (lib / "textwrap.py", lib / "string.py")]
    save_datastore(docs, folder / "rest")
    return {"rest": {"datastore": str(folder / "rest")}, "ssd": {"path": str(folder / "ssd.npy")},
            "card": {"draft": "self:8", "parallel": False, "target": default_model}}


DRAFTERS = [n for n in drafter_names() if n != "none"]
# the default drafter for all N tokens, the others for half of them (CARD's draft model drafts in
# this process at ~5 tokens/s: 12); every one for all N with -m long
SHORT = {"auto": N, "card": 12}
LOSSLESS = ([pytest.param(name, SHORT.get(name, N // 2), id=name) for name in DRAFTERS]
            + [pytest.param(name, N, id=f"{name}-{N}", marks=pytest.mark.long) for name in DRAFTERS if name != "auto"])


@pytest.mark.parametrize("name,n", LOSSLESS)
def test_drafter_is_lossless_on_the_default_model(name, n, default_model, plain_outputs, drafter_params):
    drafter = make_drafter(name, **drafter_params.get(name, {}))
    for mode, (ids, truth) in plain_outputs.items():
        eng = Engine(default_model.model, [], drafter, default_model.context_length, draft_budget=16)
        out = [t for step in eng.generate(ids, n) for t in step]
        assert out == truth[:n], (name, mode)
        assert eng.stats.passes <= n


def test_an_extra_end_token_ends_where_mlx_lm_s_stream_has_it_on_the_default_model(default_model, plain_outputs):
    """Session.add_eos_tokens (--extra-eos-token) with auto's drafts: the answer is plain decoding's
    (mlx-lm's, test_plain_engine_matches_mlx_lm) up to the first place of that token."""
    from cacheback_mlx.api import Session

    ids, truth = plain_outputs["raw"]
    k = next(i for i in range(8, N) if truth[i] not in truth[:i])
    session = Session(default_model, "auto", persist=False)
    assert session.add_eos_tokens([str(truth[k])]) == [truth[k]]
    out = [t for _, tokens in session.stream_ids(ids, N) for t in tokens]
    assert out == truth[:k] and session.stats.stop_token == truth[k]


def test_auto_from_the_shipped_scores_is_lossless_on_the_default_model(default_model, plain_outputs):
    """auto:scores=true (the scores learned on the model's own answers, for its tokenizer) drafts
    otherwise, never differently: every token as plain decoding's."""
    from cacheback_mlx.tokenizer import vocab_fingerprint

    drafter = make_drafter("auto", persist=False, scores=True, fingerprint=vocab_fingerprint(default_model.tokenizer))
    assert len(drafter.scorer.w) > 10_000  # the shipped scores, for this tokenizer
    for mode, (ids, truth) in plain_outputs.items():
        eng = Engine(default_model.model, [], drafter, default_model.context_length, draft_budget=16)
        out = [t for step in eng.generate(ids, N) for t in step]
        assert out == truth, mode
        assert eng.stats.passes < N, mode


def test_auto_drafting_each_row_s_best_tokens_is_lossless_on_the_default_model(default_model, plain_outputs):
    """auto drafting the model's 4 best tokens at each row (as on a GPU's wide passes; top_tokens
    over the real vocabulary), 31 drafts a pass: every token as plain decoding's."""
    drafter = make_drafter("auto", persist=False, recycle=4)
    for mode, (ids, truth) in plain_outputs.items():
        eng = Engine(default_model.model, [], drafter, default_model.context_length, draft_budget=31)
        out = [t for step in eng.generate(ids, N) for t in step]
        assert out == truth, mode
        assert eng.stats.passes < N, mode
    assert drafter.alternatives == 3 and any(len(best) == 4 for best in drafter.picks.values())


def test_per_step_sizing_is_lossless_on_the_default_model(default_model, plain_outputs, drafter_params):
    """The default path: auto, passes sized per step from a cost curve whose 8 rows cost less than
    2-7 (so passes are padded), the uncached tail of a second turn leading the first pass."""
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import CostTable

    padded = CostTable({256: {1: 1.0, 2: 1.5, 4: 1.5, 7: 1.5, 8: 1.2, 16: 2.0, 32: 3.5}})
    sizer = Sizer(padded)
    sizer.EXPLORE, sizer.LEARN_SHARE = 3, 1.0  # one pass in three tries the runner-up size: still exact
    eng = Engine(default_model.model, [], make_drafter("auto", persist=False), default_model.context_length,
                 sizer=sizer)
    for mode, (ids, truth) in plain_outputs.items():
        eng.reset()
        assert [t for step in eng.generate(ids[:-20], 4) for t in step]  # a first turn, then 20 new tokens
        prefilled, leads = [], []
        unwatch = eng.watch(lambda e: prefilled.append(e.rows) if e.kind == "prefill"
                            else leads.append((e.lead, e.rows)))
        out = [t for step in eng.generate(ids, N) for t in step]
        unwatch()
        assert out == truth, mode
        # every uncached token (~20: the first turn may have produced the first of them) went
        # through the first pass, none through a prefill of its own
        assert sum(prefilled) == 0 and leads[0][0] == eng.stats.prefill_tokens + 1 >= 16, mode
        assert eng.stats.passes < N and any(size == 8 for _, size in leads[1:]), mode


def test_editor_context_segments_are_lossless_on_the_default_model(default_model, plain_outputs):
    """An editor's requests: chunks and the code below the cursor as context segments (auto learns
    each chunk once and the last segment every request), a warm-up, then the request itself: the
    output is plain greedy decoding's, token for token, even when the context holds the answer."""
    eng = Engine(default_model.model, [], make_drafter("auto", persist=False), default_model.context_length,
                 draft_budget=16)
    for mode, (ids, truth) in plain_outputs.items():
        eng.reset()
        chunks = [list(truth[: N // 2]), list(ids[: len(ids) // 2])]  # text that drafts the answer well
        eng.prefill_only(ids[:-5], context=chunks + [list(truth[N // 2:])])
        out = [t for step in eng.generate(ids, N, context=chunks + [list(truth[-8:])]) for t in step]
        assert out == truth, mode
        assert eng.stats.passes < N, mode


def test_two_sequences_in_slots_are_lossless_on_the_default_model(default_model, plain_outputs):
    """Slots (an editor flipping between two files): both sequences by turns, each continuing in
    its own cache with auto drafting, token for token plain greedy decoding; the return to each
    prefills only its new tokens."""
    eng = Engine(default_model.model, [], make_drafter("auto", persist=False), default_model.context_length,
                 slots=2)
    (a, truth_a), (b, truth_b) = plain_outputs["chat"], plain_outputs["raw"]
    half = N // 2
    assert [t for s in eng.generate(a, half) for t in s] == truth_a[:half]
    assert [t for s in eng.generate(b, half) for t in s] == truth_b[:half]
    for ids, truth in ((a, truth_a), (b, truth_b)):
        turn = ids + truth[:half]
        out = [t for s in eng.generate(turn, N - half) for t in s]
        assert out == truth[half:]
        assert eng.stats.prefill_tokens <= 1  # the previous reply's last token at most


def test_requests_in_one_batch_are_lossless_on_the_default_model(default_model, plain_outputs):
    """Every prompt, and the first one again, as lanes of one batch with `auto` (passes shared,
    the repeat takes the first one's prefix): each lane's output is plain greedy decoding's."""
    from cacheback_mlx.batch import Batch
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import PriorCost

    eng = Engine(default_model.model, [], make_drafter("none"), default_model.context_length)
    eng.set_sizer(Sizer(PriorCost.for_model(default_model.model, eng.buckets)))
    batch = Batch(eng, 3, lambda: make_drafter("auto", persist=False))
    assert batch.reason is None
    runs = list(plain_outputs.values())
    runs.append(runs[0])
    lanes = batch.run([dict(prompt=ids, max_tokens=N // 2) for ids, _ in runs])
    assert [lane.tokens for lane in lanes] == [truth[: N // 2] for _, truth in runs]
    assert lanes[-1].stats.prefill_tokens == 0


def test_lanes_far_apart_in_a_batch_are_lossless_on_the_default_model(default_model, plain_outputs, monkeypatch):
    """Two requests in lanes 0 and 5 of 6, the four between them done after one token: the two
    attend in runs of their own (shared_pass.PassPlan.segments) and each one's output is plain
    greedy decoding's."""
    from cacheback_mlx.batch import Batch
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import PriorCost
    from cacheback_mlx.shared_pass import PassPlan

    eng = Engine(default_model.model, [], make_drafter("none"), default_model.context_length)
    eng.set_sizer(Sizer(PriorCost.for_model(default_model.model, eng.buckets)))
    batch = Batch(eng, 6, lambda: make_drafter("auto", persist=False))
    (a, truth_a), (b, truth_b) = plain_outputs["chat"], plain_outputs["raw"]
    runs = [(a, N // 2)] + [(a if k % 2 else b, 1) for k in range(4)] + [(b, N // 2)]
    lanes = [batch.join(ids, n) for ids, n in runs]
    assert [lane.index for lane in lanes] == list(range(6))
    cut = []
    plan_init = PassPlan.__init__

    def watched(self, *args, **kwargs):
        plan_init(self, *args, **kwargs)
        if self.rows_of is not None and len(self.segments) > 1:
            cut.append(self.segments)

    monkeypatch.setattr(PassPlan, "__init__", watched)  # to see the plans the passes make
    while batch.lanes:
        batch.step()
    assert lanes[0].tokens == truth_a[: N // 2] and lanes[5].tokens == truth_b[: N // 2]
    assert all(lane.tokens == (truth_a if k % 2 else truth_b)[:1] for k, lane in zip(range(4), lanes[1:5]))
    assert cut, "no pass ran the two lanes in runs of their own"


def test_a_lane_s_caches_moved_to_another_lane_are_lossless_on_the_default_model(default_model, plain_outputs):
    """A request that reuses no lane's caches takes the lowest free lane, and what that lane held
    moves to another one (batch.Batch._free_lane): a later request finds it there and prefills
    nothing, and every output is plain greedy decoding's."""
    from cacheback_mlx.batch import Batch
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import PriorCost

    eng = Engine(default_model.model, [], make_drafter("none"), default_model.context_length)
    eng.set_sizer(Sizer(PriorCost.for_model(default_model.model, eng.buckets)))
    batch = Batch(eng, 2, lambda: make_drafter("auto", persist=False))
    (a, truth_a), (b, truth_b) = plain_outputs["chat"], plain_outputs["raw"]
    first = batch.run([dict(prompt=a, max_tokens=N // 2)])[0]
    second = batch.run([dict(prompt=b, max_tokens=N // 2)])[0]
    assert first.index == second.index == 0  # the first's caches moved to lane 1
    again = batch.run([dict(prompt=a + truth_a[: N // 4], max_tokens=N // 4)])[0]
    assert again.index == 1 and again.stats.prefill_tokens == 0
    assert first.tokens == truth_a[: N // 2] and second.tokens == truth_b[: N // 2]
    assert again.tokens == truth_a[N // 4 : N // 2]


def test_a_prompt_riding_in_the_lanes_pass_is_lossless_on_the_default_model(default_model, plain_outputs):
    """A prompt that joins while another lane decodes rides in its passes a chunk at a time, the
    output head skipping the chunk's rows (head.py): both outputs are plain greedy decoding's."""
    from cacheback_mlx.batch import Batch
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import PriorCost

    eng = Engine(default_model.model, [], make_drafter("none"), default_model.context_length)
    eng.set_sizer(Sizer(PriorCost.for_model(default_model.model, eng.buckets)))
    eng.prefill_chunk = 8
    batch = Batch(eng, 2, lambda: make_drafter("auto", persist=False), ride=True)
    (a, truth_a), (b, truth_b) = plain_outputs["chat"], plain_outputs["raw"]
    first = batch.join(a, N // 2)
    while first.prefilling or len(first.tokens) < 2:
        batch.step()
    second = batch.join(b, N // 2)
    rode = batch.rode
    while batch.lanes:
        batch.step()
    assert batch.rode - rode == -(-(len(b) - 1) // 8) > 0  # every chunk of the second prompt rode
    assert first.tokens == truth_a[: N // 2] and second.tokens == truth_b[: N // 2]


def test_plain_steps_run_ahead_are_lossless_on_the_default_model(default_model, plain_outputs):
    """Metal's default, forced on: plain steps start the next before their token is read, with
    `none` (the chat prompt) and with `auto` going quiet and drafting again (the raw one; every
    family's tiny model runs every way in and out of it, tests/test_families.py)."""
    for name, mode in (("none", "chat"), ("auto", "raw")):
        drafter = make_drafter(name, **({"persist": False} if name == "auto" else {}))
        eng = Engine(default_model.model, [], drafter, default_model.context_length, draft_budget=16,
                     run_ahead=True)
        ids, truth = plain_outputs[mode]
        assert [t for step in eng.generate(ids, N // 2) for t in step] == truth[: N // 2], (name, mode)
        assert eng.stats.ahead > 0 or name == "auto", mode  # auto may draft at every pass here


def test_the_prompt_as_mlx_lm_lays_it_out_is_lossless_on_the_default_model(default_model, plain_outputs):
    """A GPU's half-precision default, forced on: generate_step's prefill chunks and the last
    prompt token alone in the first pass, with `none` (the raw prompt) and `auto` (the chat one)."""
    for name, mode in (("none", "raw"), ("auto", "chat")):
        drafter = make_drafter(name, **({"persist": False} if name == "auto" else {}))
        eng = Engine(default_model.model, [], drafter, default_model.context_length, draft_budget=16)
        eng.set_prompt_layout(True)
        ids, truth = plain_outputs[mode]
        chunks = []
        eng.watch(lambda e: chunks.append(e.rows) if e.kind == "prefill" else None)
        assert [t for step in eng.generate(ids, N // 2) for t in step] == truth[: N // 2], (name, mode)
        assert chunks == [len(ids) - 1], (name, mode, chunks)  # one chunk, all but the last token


def test_a_prompt_kept_out_of_the_first_pass_is_lossless_on_the_default_model(default_model, plain_outputs):
    """Where the planner keeps the prompt's tail out of the first pass (planner.CostPlanner.lead_tail:
    its rows cost more there than in prefill), `auto` with passes sized by cost still gives plain
    decoding's tokens, and the first pass is led by the last prompt token alone."""
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import CostTable

    table = CostTable({256: {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 16: 1.6, 32: 2.4, 64: 4.0}})
    eng = Engine(default_model.model, [], make_drafter("auto", persist=False), default_model.context_length,
                 sizer=Sizer(table))
    eng.planner.prefill_rate = 0.0  # as if prefill cost nothing here
    leads, plan = [], eng.planner.plan
    eng.planner.plan = lambda tree, lead, cached: leads.append(lead) or plan(tree, lead, cached)  # (a spy)
    for mode, (ids, truth) in plain_outputs.items():
        leads.clear()
        assert [t for step in eng.generate(ids, N // 2) for t in step] == truth[: N // 2], mode
        assert leads[0] == 1, (mode, leads[:3])


def test_a_second_turn_after_drafts_past_the_token_limit_is_lossless_on_the_default_model(default_model,
                                                                                          plain_outputs):
    """A reply cut by its token limit in the middle of accepted drafts leaves the cache as plain
    decoding does: the next turn prefills the same tokens and gives plain decoding's tokens."""
    ids, truth = plain_outputs["raw"]
    engines = [Engine(default_model.model, [], make_drafter(name, **kw), default_model.context_length)
               for name, kw in (("none", {}), ("auto", {"persist": False}))]
    for n in (21, 37):
        outs = [[t for s in eng.generate(ids, n) for t in s] for eng in engines]
        assert outs[0] == outs[1] == truth[:n] and engines[1].stats.passes < n  # auto's drafts were accepted
        assert engines[0].seq.cached == engines[1].seq.cached == (ids + truth)[: len(ids) + n - 1]
        turn = ids + truth[:n] + truth[n : n + 3]
        want = [int(t) for t, _ in generate_step(mx.array(turn), default_model.model, max_tokens=12)]
        seconds = [[t for s in eng.generate(turn, 12) for t in s] for eng in engines]
        assert seconds[0] == seconds[1] == want
        assert engines[0].stats.prefill_tokens == engines[1].stats.prefill_tokens


@pytest.mark.parametrize("mode", ["raw", pytest.param("chat", marks=pytest.mark.long)])
def test_penalties_and_biases_are_lossless_on_the_default_model(mode, default_model, plain_outputs):
    """A repetition penalty, presence and frequency penalties and a logit bias (mlx-lm's processors):
    auto's output equals mlx-lm's generate_step with the same processors, and differs from without
    (the code prompt always, the chat one too with -m long: test_penalties.py covers the families)."""
    from cacheback_mlx.sampling import SamplingParams, penalties

    processors = penalties(repetition=1.3, presence=0.3, frequency=0.2, window=64, logit_bias={482: 1.5})
    for ids, plain in [plain_outputs[mode]]:
        truth = [int(t) for t, _ in generate_step(mx.array(ids), default_model.model, max_tokens=N,
                                                  logits_processors=list(processors))]
        eng = Engine(default_model.model, [], make_drafter("auto", persist=False), default_model.context_length)
        out = [t for step in eng.generate(ids, N, SamplingParams(logits_processors=processors)) for t in step]
        assert out == truth, mode
        assert truth != plain and eng.stats.passes < N, mode
