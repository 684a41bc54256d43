"""The architecture zoo: every family's tiny random model, decoded by the engine with adversarial
drafters, must give mlx-lm's own greedy tokens (generate_step with the model's own cache)."""

from cacheback_mlx.budget import Sizer
from cacheback_mlx.costs import CostTable
from cacheback_mlx.drafters.auto import AutoDrafter
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.kvcache import WindowKVCache
from cacheback_mlx.sampling import SamplingParams
from cacheback_mlx.tree import DraftTree
from cacheback_mlx.verify import verify_pass, warm_up

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter, WrongOnce

# 24 prompt tokens + 24 generated: crosses the sliding window (8) and the position threshold (16)
PROMPT = [(7 * i + 3) % 97 + 1 for i in range(24)]
N = 24
FAMILIES = list(zoo.FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, zoo.tiny_model(request.param)


def reference(model, prompt, n):
    """mlx-lm's own greedy decoding, with the model's own caches."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class Scored(NoDrafter):
    """Another drafter's trees with node scores (path probabilities that halve with depth), so the
    sizer takes its scored path: calibrated scores (budget.Calibration) choose the nodes sent."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, history, budget, max_branching=None):
        tree = self.inner.propose(history, budget, max_branching=max_branching)
        return DraftTree(tree.tokens, tree.parents, 0.9 * 0.5 ** (tree.depths() - 1))


def run(model, drafter, prompt=PROMPT, n=N, engine=None, **kw):
    eng = engine or Engine(model, eos_ids=[], drafter=drafter, context_length=4096, **kw)
    eng.set_drafter(drafter)
    return [t for step in eng.generate(prompt, n) for t in step], eng


class Foreign(NoDrafter):
    def propose(self, history, budget, max_branching=None):
        return DraftTree([zoo.VOCAB, 3, 10**6, 7, 5], [-1, 0, -1, -1, 3])


def test_greedy_tokens_equal_mlx_lm(family):
    name, model = family
    truth = reference(model, PROMPT, N)
    assert len(set(truth)) >= 4, f"{name}: the tiny model's stream is too uniform to test anything"
    drafters = {
        "none": NoDrafter(),
        "oracle-chain": OracleDrafter(PROMPT, truth),
        "oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
        "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)]),
        "random-0": RandomTreeDrafter(PROMPT, truth, seed=0),
        "random-1": RandomTreeDrafter(PROMPT, truth, seed=1),
        "foreign": Foreign(),  # ids past the vocabulary (a table built for another tokenizer)
    }
    for label, d in drafters.items():
        out, eng = run(model, d, draft_budget=16)
        assert out == truth, (name, label)
        assert eng.vocab_size == zoo.VOCAB, name  # out-of-vocabulary drafts are dropped
        if label == "oracle-chain":
            assert eng.stats.passes <= N // 3, (name, eng.stats.passes)  # it did speculate
        if label == "wrong":
            assert eng.stats.passes == N
    out, _ = run(model, RandomTreeDrafter(PROMPT, truth, seed=3), draft_budget=20, buckets=(1, 2, 4, 8, 16, 32))
    assert out == truth, (name, "buckets")
    # per-step sizing: passes padded to a cheaper row count (8 rows cost less than 2-7), and the
    # uncached prompt (24 tokens, under the planner's LEAD_TAIL) leading the first pass with the drafts
    padded = CostTable({256: {1: 1.0, 2: 1.5, 3: 1.5, 4: 1.5, 5: 1.5, 6: 1.5, 7: 1.5, 8: 1.2, 16: 2.0}})
    for label, d in {"oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
                     "random-2": RandomTreeDrafter(PROMPT, truth, seed=2),
                     "scored": Scored(RandomTreeDrafter(PROMPT, truth, seed=4)),
                     "auto": AutoDrafter(persist=False),
                     "auto-best-4": AutoDrafter(persist=False, recycle=4),  # each row's 4 best tokens, heard
                     "auto-shipped-scores": AutoDrafter(persist=False, scores=True)}.items():
        sizer = Sizer(padded)
        sizer.EXPLORE, sizer.LEARN_SHARE = 2, 1.0  # every other pass tries the runner-up size: still exact
        out, _ = run(model, d, sizer=sizer)
        assert out == truth, (name, "per-step", label)
        assert sizer.times.n > 0 and sizer.tried >= 1, (name, label)  # passes timed, sizes tried
        if label != "oracle-tree" and label != "random-2":  # scored drafts: the calibration learned from them
            assert sizer.calibration.expected.sum() > 0, name


def test_an_end_token_set_on_the_engine_ends_where_mlx_lm_s_stream_has_it(family):
    """An end token besides the model's own (set_eos: --extra-eos-token, add_eos_token) ends the
    answer before its first place in mlx-lm's greedy stream, drafts past it or not."""
    name, model = family
    truth = reference(model, PROMPT, N)
    k = next(i for i in range(3, N) if truth[i] not in truth[:i])
    for label, d in {"none": NoDrafter(), "oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
                     "random": RandomTreeDrafter(PROMPT, truth, seed=5)}.items():
        eng = Engine(model, eos_ids=[], drafter=d, context_length=4096, draft_budget=16)
        eng.set_eos([truth[k]])
        out = [t for step in eng.generate(PROMPT, N) for t in step]
        assert out == truth[:k] and eng.stats.stop_token == truth[k], (name, label)


def test_a_prompt_prefilled_whole_before_a_sized_first_pass_gives_mlx_lm_s_tokens(family):
    """Where the planner keeps the prompt's tail out of the first pass (its rows cost more there
    than in prefill: planner.CostPlanner.lead_tail), the prompt is prefilled whole but its last
    token, and the sized passes that follow give mlx-lm's tokens."""
    name, model = family
    truth = reference(model, PROMPT, N)
    table = CostTable({256: {1: 1.0, 2: 1.5, 4: 1.5, 8: 1.2, 16: 2.0, 32: 4.0}})
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, sizer=Sizer(table))
    eng.planner.prefill_rate = 0.0  # as if prefill had cost nothing here: no tail in the first pass
    tails, leads = [], []
    ask, plan = eng.planner.lead_tail, eng.planner.plan
    eng.planner.lead_tail = lambda *a: tails.append(ask(*a)) or tails[-1]  # (spies)
    eng.planner.plan = lambda tree, lead, cached: leads.append(lead) or plan(tree, lead, cached)
    out, _ = run(model, OracleDrafter(PROMPT, truth, extra_wrong_branches=2), engine=eng)
    assert out == truth, name
    assert tails and set(tails) == {1}, (name, tails)
    assert leads[0] == 1, (name, leads[:3])  # the first pass: the last prompt token and drafts


def test_second_call_reuses_the_cache_and_a_shared_prefix_is_trimmed(family):
    name, model = family
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12)
    first, _ = run(model, RandomTreeDrafter(PROMPT, [], seed=5), n=12, engine=eng)
    turn2 = PROMPT + first + [4, 5, 6]
    truth2 = reference(model, turn2, 12)
    second, _ = run(model, RandomTreeDrafter(turn2, truth2, seed=6), prompt=turn2, n=12, engine=eng)
    assert second == truth2, name
    assert eng.stats.prefill_tokens <= 4 + 12, name  # the new tokens (+ an undone lead), not all
    turn3 = PROMPT[:10] + [9, 8, 7, 6] * 3  # shares only 10 tokens with what is cached
    truth3 = reference(model, turn3, 12)
    third, _ = run(model, RandomTreeDrafter(turn3, truth3, seed=7), prompt=turn3, n=12, engine=eng)
    assert third == truth3, name


def test_tree_pass_logits_equal_mlx_lm_along_each_path(family):
    """One pass over a tree (a chain on chain-only models): each row's logits equal mlx-lm's
    logits after feeding that row's path token by token into the model's own cache. In float64,
    so that float32 noise (up to ~1e-3 on some tiny models) cannot hide a real difference
    (MoE layers only run in float32: those keep a float32 tolerance)."""
    name, _ = family
    model = zoo.tiny_model(name)
    model.set_dtype(mx.float64)
    tol = 1e-6  # float64 leaves only mlx-lm's own one-token vs many-token paths (SSM scans: ~1e-7)
    try:
        mx.eval(model(mx.array([PROMPT[:4]])))
    except RuntimeError:  # e.g. "[GatherMM::eval] Currently only supports float32"
        model.set_dtype(mx.float32)
        tol = 2e-3
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    tree = DraftTree([7, 9, 11, 13, 7, 2, 5], [-1, -1, 0, 0, 1, 3, 5])
    if eng.chain_reason:
        tree = DraftTree.chain([7, 11, 2, 13, 5])
    assert zoo.tree_logits_error(model, tree, PROMPT) <= tol, name


def test_window_caches_evict_and_still_roll_back():
    """Sliding layers evict old entries (slack 3 here) and stay exact, across reuse and trims
    that reach behind the evicted part (which then re-prefill)."""
    model = zoo.tiny_model("gemma3_text")
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12)
    windows = [c for c in eng.cache.kv if isinstance(c, WindowKVCache)]
    assert windows
    for c in windows:
        c.slack = 3
    truth = reference(model, PROMPT, 32)
    out, _ = run(model, RandomTreeDrafter(PROMPT, truth, seed=2), n=32, engine=eng)
    assert out == truth
    assert all(c.start > 0 and c.offset - c.start <= c.window - 1 + c.slack + 13 for c in windows)
    turn = PROMPT[:12] + [3, 1, 4, 1, 5]
    assert eng.cache.trim(12) == 0  # behind the evicted entries: must start over
    out, _ = run(model, RandomTreeDrafter(turn, reference(model, turn, 16), seed=4), prompt=turn, n=16, engine=eng)
    assert out == reference(model, turn, 16)


@pytest.mark.parametrize("name", ["gemma3_text", "gemma3n", "qwen3_next"])  # sliding, shared KV, hybrid
def test_every_registered_drafter_is_lossless_on_sliding_and_hybrid_families(name, tmp_path):
    from cacheback_mlx.drafters import drafter_names, make_drafter
    from cacheback_mlx.drafters.rest import save_datastore

    model = zoo.tiny_model(name)
    prompt = PROMPT[:12] * 3  # repetition gives the drafters something to find
    truth = reference(model, prompt, 32)
    save_datastore([prompt + truth[:16], truth], tmp_path / "rest")
    from cacheback_mlx.loader import LoadedModel

    target = LoadedModel(model, None, name, "", 4096, "float32", None)
    params = {"rest": {"datastore": str(tmp_path / "rest")}, "ssd": {"path": str(tmp_path / "ssd.npy")},
              "card": {"draft": "self:3", "parallel": False, "target": target}}
    for d in drafter_names():
        out, eng = run(model, make_drafter(d, **params.get(d, {})), prompt=prompt, n=32, draft_budget=16)
        assert out == truth, (name, d)


def test_hybrid_models_get_chains_and_drafters_are_told():
    seen = []

    class Spy(NoDrafter):
        def propose(self, history, budget, max_branching=None):
            seen.append(max_branching)
            return DraftTree([1, 2, 3], [-1, -1, 0])  # a tree: the engine must cut it to a chain

    model = zoo.tiny_model("qwen3_next")
    eng = Engine(model, eos_ids=[], drafter=Spy(), context_length=4096)
    assert eng.chain_reason == "recurrent layers" and eng.max_branching == 1
    assert [t for s in eng.generate(PROMPT, 6) for t in s] == reference(model, PROMPT, 6)
    assert seen and set(seen) == {1}
    assert "RecurrentCache" in eng.describe()["caches"]


def test_unsupported_cache_kinds_get_a_one_line_error():
    model = zoo.tiny_model("llama")
    from mlx_lm.models.cache import QuantizedKVCache

    model.make_cache = lambda: [QuantizedKVCache() for _ in model.layers]
    with pytest.raises(CachebackError) as e:
        Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert "QuantizedKVCache" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    from cacheback_mlx.loader import load

    from conftest import write_tiny_gguf

    d = tmp_path_factory.mktemp("tok")
    write_tiny_gguf(d / "t.gguf")
    load(d / "t.gguf").tokenizer._tokenizer.save_pretrained(d / "files")
    return d / "files"


@pytest.mark.parametrize("name", FAMILIES)
def test_mlx_lm_folder_of_every_family_loads_and_doctor_names_its_caches(name, tmp_path, tokenizer_files):
    import json
    import shutil

    from cacheback_mlx.cli import main
    from cacheback_mlx.loader import load

    from click.testing import CliRunner
    from mlx.utils import tree_flatten

    model = zoo.tiny_model(name)
    folder = tmp_path / name
    shutil.copytree(tokenizer_files, folder)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(zoo.FAMILIES[name]))
    loaded = load(str(folder), dtype="float32")
    x = mx.array([PROMPT])
    assert np.allclose(np.array(loaded.model(x)), np.array(model(x)), atol=1e-4), name
    result = CliRunner().invoke(main, ["doctor", "--model", str(folder)])
    assert result.exit_code == 0, result.output
    caches = Engine(model, [], NoDrafter(), 4096).describe()["caches"]
    assert all(f"{k} x{v}" in result.output for k, v in caches.items()), result.output
    assert "several requests at once (serve --parallel): one shared pass" in result.output, result.output
    assert "exact greedy output (equal to mlx-lm's plain decoding): float32, tested on the CPU" in result.output


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3_text", "falcon_h1"])
def test_a_pass_interrupted_before_its_rollback_is_repaired_by_the_next_call(name):
    model = zoo.tiny_model(name)
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    first = [t for s in eng.generate(PROMPT, 6) for t in s]
    verify_pass(model, eng.cache, [first[-1], 3, 4], DraftTree.chain([5, 6]))  # e.g. Ctrl-C here
    turn = PROMPT + first + [9, 10]
    out, _ = run(model, NoDrafter(), prompt=turn, n=10, engine=eng)
    assert out == reference(model, turn, 10)


def test_a_family_the_engine_cannot_undo_is_refused_in_one_line(tmp_path, tokenizer_files):
    """Llama 4's chunked-attention cache cannot be rolled back: `generate` and `doctor --model`
    say so in one line and exit non-zero, and nothing is generated."""
    import json
    import shutil

    from cacheback_mlx.cli import main

    from click.testing import CliRunner
    from mlx.utils import tree_flatten

    model = zoo.tiny_model("llama4")
    folder = tmp_path / "llama4"
    shutil.copytree(tokenizer_files, folder)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(zoo.EXTRA_FAMILIES["llama4"]))
    for args in (["doctor", "--model", str(folder)], ["generate", "hi", "--model", str(folder), "--raw"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        last = result.output.strip().splitlines()[-1]
        assert last.startswith("error: llama4") and "ChunkedKVCache" in last, result.output


def test_a_folder_with_an_invalid_config_gets_a_one_line_error(tmp_path, tokenizer_files):
    import json
    import shutil

    from cacheback_mlx.loader import load

    folder = tmp_path / "bad"
    shutil.copytree(tokenizer_files, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba2", "hidden_size": 64, "num_heads": 3,
                                                    "head_dim": 16, "vocab_size": 128}))
    with pytest.raises(CachebackError) as e:
        load(str(folder))
    assert str(e.value).startswith("cannot load model folder") and "\n" not in str(e.value)


def test_warm_up_prefill_then_edited_prompts_equal_mlx_lm(family):
    """The editor path on every family: a warm-up prefill (n_predict 0), a request extending it,
    then an edited prompt (the drafter re-learns the text before the edit), all token for token
    equal to mlx-lm's own greedy decoding."""
    name, model = family
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12)
    eng.prefill_only(PROMPT[:16], context=[[5, 6, 7], [8, 9]])  # segments: an editor's chunk, then its suffix
    turn1 = PROMPT
    truth1 = reference(model, turn1, 12)
    out1, _ = run(model, RandomTreeDrafter(turn1, truth1, seed=8), prompt=turn1, n=12, engine=eng)
    assert out1 == truth1 and eng.stats.prefill_tokens <= len(PROMPT) - 16 + 12, name
    turn2 = PROMPT[:20] + [11, 12, 13, 14]  # departs from the history: an edit
    truth2 = reference(model, turn2, 12)
    out2, _ = run(model, OracleDrafter(turn2, truth2), prompt=turn2, n=12, engine=eng)
    assert out2 == truth2, name
    # auto drafting from context segments (chunks learned once, then the suffix) that hold the answer
    eng.set_drafter(AutoDrafter(persist=False))
    turn3 = PROMPT[:12] + [9, 8, 7]
    truth3 = reference(model, turn3, 12)
    context = [truth3[:6], list(turn3), truth3[6:]]
    out3 = [t for step in eng.generate(turn3, 12, context=context) for t in step]
    assert out3 == truth3, name


def test_a_long_prompt_equals_mlx_lm_past_the_attention_routing_limits(family):
    """A 700-token prompt: the prefill takes chunks of several rows (the CPU attention in blocks
    of 16 rows; the last piece joins the chunk before it, verify.cpu_prefill_chunk), then the
    steps attend over more than MIN_KEYS_ONE_ROW cached keys, where even one-row steps use
    attention.py. Token for token mlx-lm's own greedy decoding."""
    from cacheback_mlx import attention
    from cacheback_mlx.verify import cpu_prefill_chunk

    name, model = family
    prompt = [(13 * i + 5) % 97 + 1 for i in range(700)]
    assert len(prompt) > cpu_prefill_chunk(0) and len(prompt) > attention.MIN_KEYS_ONE_ROW + 100
    truth = reference(model, prompt, 16)
    for label, d in {"none": NoDrafter(), "random": RandomTreeDrafter(prompt, truth, seed=5),
                     "oracle": OracleDrafter(prompt, truth)}.items():
        eng = Engine(model, eos_ids=[], drafter=d, context_length=4096, draft_budget=12)
        chunks = []
        eng.watch(lambda event: event.kind == "prefill" and chunks.append(event.rows))
        out, _ = run(model, d, prompt=prompt, n=16, engine=eng)
        assert out == truth, (name, label)
        assert max(chunks) > cpu_prefill_chunk(0), (name, label, chunks)  # a last piece joined the chunk before


def test_passes_rolled_back_across_a_256_position_boundary_equal_mlx_lm(family):
    """A 250-token prompt, then passes of up to 16 rows that cross position 256 and are partly
    rolled back: each layer's buffer grows from mid-buffer (kvcache.TreeKVCache keeps whole
    256-position steps there, as mlx-lm's decoding has them), a rollback below 256 cuts it back
    (every pass sees the buffer length plain decoding has at its length), and the tokens are mlx-lm's."""
    from cacheback_mlx.kvcache import TreeKVCache

    name, model = family
    prompt = [(11 * i + 7) % 97 + 1 for i in range(250)]
    truth = reference(model, prompt, 24)
    for label, d in {"random": RandomTreeDrafter(prompt, truth, seed=7),
                     "oracle-tree": OracleDrafter(prompt, truth, extra_wrong_branches=2),
                     "wrong-once": WrongOnce(lambda h: (truth + [0])[len(h) - len(prompt)], len(prompt) + 3)}.items():
        eng = Engine(model, eos_ids=[], drafter=d, context_length=4096, draft_budget=16)
        lengths = []
        eng.watch(lambda event: lengths.extend((c.keys.shape[2], c.offset) for c in eng.seq.cache.kv
                                               if type(c) is TreeKVCache and c.keys is not None))
        out, _ = run(model, d, prompt=prompt, n=24, engine=eng)
        assert out == truth, (name, label)
        assert lengths or not any(type(c) is TreeKVCache for c in eng.seq.cache.kv), name  # (recurrent only)
        assert all(n == -(-offset // 256) * 256 for n, offset in lengths), (name, label, set(lengths))


def test_two_sequences_in_two_slots_equal_mlx_lm(family):
    """Slots on every family (sliding-window, shared-KV and recurrent caches included): two
    sequences edited alternately each continue in their own cache, token for token equal to
    mlx-lm's greedy decoding, and a return to a sequence prefills only its new tokens."""
    name, model = family
    other = [(5 * i + 11) % 97 + 1 for i in range(24)]
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=12, slots=2)
    outs = {}
    for key, prompt in (("a", PROMPT), ("b", other)):
        truth = reference(model, prompt, 12)
        outs[key], _ = run(model, RandomTreeDrafter(prompt, truth, seed=9), prompt=prompt, n=12, engine=eng)
        assert outs[key] == truth, (name, key)
    for key, prompt in (("a", PROMPT), ("b", other)):
        turn = prompt + outs[key] + [4, 5]
        truth = reference(model, turn, 12)
        out, _ = run(model, RandomTreeDrafter(turn, truth, seed=10), prompt=turn, n=12, engine=eng)
        assert out == truth, (name, key, "return")
        assert eng.stats.prefill_tokens <= 2 + 12, (name, key)  # the new tokens (+ an undone lead), not all


def test_weights_stored_transposed_equal_mlx_lm_on_the_loaded_layout(family):
    """The loader stores float32 weights transposed for OpenBLAS (blas.transpose_weights): on every
    family, a copy so stored gives bitwise the same logits as the model as built, and the engine on
    it, with random trees, the same tokens as mlx-lm's greedy decoding on the model as built."""
    from cacheback_mlx import blas

    from mlx_lm.models.cache import make_prompt_cache

    name, model = family
    moved = zoo.tiny_model(name)
    assert blas.transpose_weights(moved) > 0, name
    logits = [np.array(m(mx.array(PROMPT)[None], cache=make_prompt_cache(m))) for m in (model, moved)]
    assert np.array_equal(*logits), name
    truth = reference(model, PROMPT, N)
    out, _ = run(moved, RandomTreeDrafter(PROMPT, truth, seed=11), draft_budget=16)
    assert out == truth, name


def test_a_prefill_stopped_between_chunks_resumes_exactly(family, monkeypatch):
    """A prefill told to stop after its first chunks (a client gone, a server stopping) keeps
    them in the caches; the same prompt then goes on from there, token for token mlx-lm's greedy
    decoding (every family: sliding windows, shared KV and recurrent states included)."""
    from cacheback_mlx.engine import Interrupted

    name, model = family
    prompt = [(11 * i + 4) % 97 + 1 for i in range(90)]
    truth = reference(model, prompt, 12)
    monkeypatch.setattr(Engine, "prefill_chunk", 16)
    eng = Engine(model, eos_ids=[], drafter=OracleDrafter(prompt, truth), context_length=4096, draft_budget=6)
    asked = []
    with pytest.raises(Interrupted):
        list(eng.generate(prompt, 12, stop=lambda: asked.append(1) or len(asked) >= 3))
    assert 16 <= len(eng.cached) < len(prompt) - 16, name
    out = [t for step in eng.generate(prompt, 12) for t in step]
    assert out == truth, name
    assert eng.stats.prefill_tokens < len(prompt) - 16, name  # it went on from the chunks kept


def test_the_prompt_as_mlx_lm_lays_it_out_equals_mlx_lm(family, monkeypatch):
    """The layout a GPU in half precision gets (engine.prompt_as_mlx_lm_default: generate_step's
    chunks, the last prompt token alone in the first pass), here with chunks of 16 so that a
    short prompt takes several: token for token mlx-lm's greedy decoding on every family, with
    no drafts and with random trees."""
    from cacheback_mlx import engine as engine_module

    name, model = family
    monkeypatch.setattr(engine_module, "MLX_LM_PREFILL_CHUNK", 16)
    prompt = [(17 * i + 2) % 97 + 1 for i in range(90)]
    truth = reference(model, prompt, 12)
    for label, d in {"none": NoDrafter(), "random": RandomTreeDrafter(prompt, truth, seed=12)}.items():
        eng = Engine(model, eos_ids=[], drafter=d, context_length=4096, draft_budget=8)
        eng.set_prompt_layout(True)
        chunks = []
        eng.watch(lambda e: chunks.append(e.rows) if e.kind == "prefill" else None)
        out, _ = run(model, d, prompt=prompt, n=12, engine=eng)
        assert out == truth, (name, label)
        assert chunks == [16] * 5 + [9], (name, label, chunks)  # all but the last token, as generate_step


class Intermittent(NoDrafter):
    """Drafts the true continuation only in some stretches of the stream, nothing in between: the
    engine goes in and out of running plain steps ahead."""

    def __init__(self, prompt, truth, on=(3, 4, 5, 11, 12, 17), length=None):
        self.oracle, self.start, self.on = OracleDrafter(prompt, truth), len(prompt), set(on)
        self.length = length  # drafts at most this many tokens (None: the budget)

    def propose(self, history, budget, max_branching=None):
        if len(history) - self.start not in self.on:
            return DraftTree.empty()
        return self.oracle.propose(history, min(budget, self.length or budget), max_branching)


class Eager(Engine):
    """Runs plain steps ahead from the first quiet pass (the default waits for RUN_AHEAD_QUIET),
    so every way in and out of running ahead comes up in a short stream."""

    RUN_AHEAD_QUIET = 1


def test_plain_steps_run_ahead_and_stay_exact(family):
    """A plain step starting the next one before its token is read (Metal's default, forced on
    here): the same tokens as mlx-lm, through drafters that go quiet and speak again, an EOS or
    a caller that stops in the middle (the step started past it is dropped: the next call goes
    on exactly), and a seeded sampled request gives the same text as without."""
    name, model = family
    truth = reference(model, PROMPT, N)

    def eager(drafter, eos=(), on=True):
        return Eager(model, eos_ids=list(eos), drafter=drafter, context_length=4096, draft_budget=16, run_ahead=on)

    drafters = {"none": NoDrafter(), "intermittent": Intermittent(PROMPT, truth),
                "random-0": RandomTreeDrafter(PROMPT, truth, seed=0),
                "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)])}
    for label, d in drafters.items():
        out, eng = run(model, d, engine=eager(d))
        assert out == truth, (name, label)
        assert eng.stats.ahead > 0 or label in ("wrong", "random-0"), (name, label)
        if label == "none":
            assert eng.stats.ahead == N - 1, name  # all but the first
    assert run(model, Intermittent(PROMPT, truth), engine=eager(NoDrafter(), on=False))[1].stats.ahead == 0
    # the default rule (run_ahead.RunAhead, tested in tests/test_run_ahead.py) waits for
    # RUN_AHEAD_QUIET quiet passes at first, then for one once drafts are rare; the drafter speaks
    # again while a step runs ahead (tokens 7 + q, 8 + q)
    q = Engine.RUN_AHEAD_QUIET
    late = Intermittent(PROMPT, truth, on=(3, 5, 7 + q, 8 + q), length=1)  # a pass per 1 or 2 tokens
    out, eng = run(model, late, draft_budget=16, run_ahead=True)
    assert out == truth and 0 < eng.stats.ahead < N - q, (name, eng.stats.ahead)
    assert run(model, NoDrafter(), draft_budget=16, run_ahead=True)[1].stats.ahead == N - q, name
    # EOS: generation stops there; the step already started past it leaves no trace
    k = next(i for i in range(5, N) if truth[i] not in truth[:i])
    eng = eager(NoDrafter(), eos=[truth[k]])
    got = [t for step in eng.generate(PROMPT, N) for t in step]
    assert got == truth[:k] and eng.stats.stop_token == truth[k] and eng.stats.ahead, name
    assert eng.cache.length == len(eng.cached) and not eng.cache.in_pass, name  # nothing half done
    eng.eos_ids = set()
    rest = [t for step in eng.generate(PROMPT + truth[: k + 1], N - k - 1) for t in step]
    assert rest == truth[k + 1 :], (name, "after EOS")
    # a caller that stops reading after a few tokens
    eng = eager(NoDrafter())
    steps = eng.generate(PROMPT, N)
    seen = [next(steps)[0] for _ in range(5)]
    steps.close()
    assert seen == truth[:5], name
    assert eng.cache.length == len(eng.cached) and not eng.cache.in_pass, name
    rest = [t for step in eng.generate(PROMPT + seen, N - 5) for t in step]
    assert rest == truth[5:], (name, "after a stop")
    # sampled: the same draws with and without
    sampling = SamplingParams(temperature=0.9, seed=11)
    texts = []
    for on in (True, False):
        eng = eager(Intermittent(PROMPT, truth), on=on)
        texts.append([t for step in eng.generate(PROMPT, N, sampling) for t in step])
    assert texts[0] == texts[1], name


def test_the_warm_up_a_cuda_engine_runs_first_runs_on_every_family(family):
    """verify.warm_up (run by an engine on CUDA before its first request) on each family's caches:
    trees where the engine runs trees, chains elsewhere; the engine's output stays mlx-lm's."""
    name, model = family
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    warm_up(model, eng.buckets, tree_ok=eng.chain_reason is None, vocab=min(32, eng.vocab_size))
    out, _ = run(model, RandomTreeDrafter(PROMPT, reference(model, PROMPT, 8), seed=5), n=8, engine=eng)
    assert out == reference(model, PROMPT, 8), name
