"""Forced acceptance: a model run at a recorded stream's acceptance (engine.generate(forced=)),
whose MAT must equal the offline replay's on the same streams, with real passes underneath."""

from cacheback_mlx import bench as B
from cacheback_mlx import recording as R
from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.engine import Engine, accept
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.replay import SHARED_STREAMS, load_streams, longest_match, replay_requests
from cacheback_mlx.tree import DraftTree, forced_picks

import mlx.core as mx
import pytest
from mlx_lm.models import llama

VOCAB = 49152  # the default model's vocabulary: the recorded streams' ids fit


@pytest.fixture(scope="module")
def model():
    """A small llama on the default model's vocabulary with random weights: it accepts no draft
    of its own, so every accepted draft below comes from the recording."""
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    m.eval()
    mx.eval(m.parameters())
    return m


def test_forced_picks_follow_the_recording_through_a_tree():
    # root children 5 (right) and 6; under 5: 9 (wrong) and 7 (right); under 7: 8 (right)
    tree = DraftTree([6, 5, 9, 7, 8], [-1, -1, 1, 1, 3])
    picks = forced_picks(tree, [5, 7, 8, 4])
    assert picks == [5, -1, 7, -1, 8, 4]
    path, bonus = accept(tree, picks)
    assert path == longest_match(tree, [5, 7, 8, 4]) == [1, 3, 4] and bonus == 4
    # a recording that ends inside the tree has no token after its last node: refused (the
    # engine drafts at most the tokens left but one)
    with pytest.raises(ValueError, match="shallower"):
        forced_picks(tree, [5, 7, 8])
    assert accept(tree, forced_picks(tree, [6, 1, 2, 3])) == ([0], 1)
    assert accept(DraftTree.empty(), forced_picks(DraftTree.empty(), [3, 1])) == ([], 3)


def streams(n=4, tokens=40):
    if not SHARED_STREAMS.exists():
        pytest.skip("../shared/data/smollm2_greedy not present")
    return [dict(s, out=s["out"][:tokens]) for s in load_streams()[:n]]


@pytest.mark.parametrize("drafter", ["ngram", "cacheback", "auto"])
def test_forced_mat_equals_the_offline_replay(model, drafter):
    """Fixed budget: the same drafts, the same accepted tokens, so the same passes and MAT as
    replay.py on the same streams; every pass really ran on the model."""
    params = {"persist": False} if drafter == "auto" else {}
    eng = Engine(model, eos_ids=[], drafter=make_drafter(drafter, **params), context_length=4096, draft_budget=7)
    total_tokens = total_passes = 0
    for s in streams():
        eng.reset(make_drafter(drafter, **params))
        out = [t for step in eng.generate(s["prompt"], 1000, forced=s["out"]) for t in step]
        assert out == s["out"]
        offline = replay_requests(lambda: make_drafter(drafter, **params),
                                  [{"prompt": s["prompt"], "out": s["out"]}], budget=7)[0]
        assert (eng.stats.passes, eng.stats.accepted) == (offline.steps, offline.tokens), s["id"]
        assert eng.stats.verify_s > 0 and eng.stats.drafted > 0
        total_tokens += eng.stats.accepted
        total_passes += eng.stats.passes
    assert total_tokens > total_passes + 8  # drafts were accepted: the recording's, not the model's


def test_unforced_the_model_goes_its_own_way(model):
    s = streams(1)[0]
    eng = Engine(model, eos_ids=[], drafter=make_drafter("ngram"), context_length=4096, draft_budget=7)
    out = [t for step in eng.generate(s["prompt"], 24) for t in step]
    assert out[:4] != s["out"][:4]  # what the forced runs accept is the recording's


def test_forced_stops_at_the_recording_and_refuses_an_empty_one(model):
    eng = Engine(model, eos_ids=[], drafter=make_drafter("ngram"), context_length=4096, draft_budget=7)
    prompt = [1, 2, 3, 4]
    assert [t for step in eng.generate(prompt, 100, forced=[9, 9, 9]) for t in step] == [9, 9, 9]
    assert [t for step in eng.generate(prompt, 2, forced=[9, 9, 9]) for t in step] == [9, 9]
    with pytest.raises(CachebackError, match="empty"):
        list(eng.generate(prompt, 5, forced=[]))


class Session:
    """What bench's forced runs use of a Session, on the small model."""

    def __init__(self, model):
        from cacheback_mlx.gguf import read_gguf
        from cacheback_mlx.loader import default_model_path
        from cacheback_mlx.tokenizer import tokenizer_from_gguf

        self.engine = Engine(model, eos_ids=[], drafter=make_drafter("none"), context_length=4096, draft_budget=7)
        self.loaded = type("Loaded", (), {"model": model})()
        self.tokenizer = tokenizer_from_gguf(read_gguf(default_model_path())[1])


def test_forced_bench_rows_replay_and_mlx_lm_count_the_same_tokens(model, tmp_path):
    records = [{"id": s["id"], "column": s["cat"], "turns": [{"prompt": s["prompt"], "out": s["out"]}]}
               for s in streams(2, 24)]
    R.save_recording(tmp_path, records, {"model": "test", "fingerprint": "x"})
    data = R.load_recording(tmp_path)
    assert data["prompts"] == records and R.requests_of(records[0])[0]["max_tokens"] == 24
    session = Session(model)
    rows = {"none": B.Row(make_drafter("none"), None, 7), "ngram": B.Row(make_drafter("ngram"), None, 7)}
    runs = R.run_forced_bench(session, data["prompts"], rows, warmup=1, progress=False)
    assert {r.drafter for r in runs} == {"none", "ngram", B.MLX_LM} and len(runs) == 6
    assert all(len(r.tokens) == 24 for r in runs)  # mlx-lm too: the same token counts, no EOS stop
    assert not B.mismatches([r for r in runs if r.drafter != B.MLX_LM])  # mlx-lm decodes its own picks
    summary = B.summarize(runs)["overall"]
    assert summary["none"]["mat"] == 1.0 and summary["ngram"]["mat"] > 1.0


def test_a_folder_that_is_not_a_recording_is_one_line_error(tmp_path):
    with pytest.raises(CachebackError, match="cannot read"):
        R.load_recording(tmp_path)
    (tmp_path / "streams.json").write_text('{"format": "other"}')
    with pytest.raises(CachebackError, match="not a `bench --record`"):
        R.load_recording(tmp_path)


def test_bench_record_then_forced_from_the_command_line(tmp_path):
    """`bench --record DIR`, then `bench --forced DIR`: the rows run the recorded token counts and
    the table says what it is; a recording of another tokenizer is a one-line error."""
    import json

    from conftest import write_tiny_gguf
    from test_cli import assert_one_line_error, cli, cli_here

    model = str(tmp_path / "t.gguf")
    write_tiny_gguf(model, context=512)
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text(
        "".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n"}) + "\n" for i in range(2)))
    rec = tmp_path / "rec"
    r = cli("bench", "--model", model, "--data", str(tmp_path), "--prompts", "humaneval", "--per-category", "2",
            "--max-tokens", "12", "--record", str(rec), timeout=300)
    assert r.returncode == 0, r.stderr
    streams = json.loads((rec / "streams.json").read_text())
    assert [p["id"] for p in streams["prompts"]] == ["HumanEval/0", "HumanEval/1"]
    counts = [len(t["out"]) for p in streams["prompts"] for t in p["turns"]]
    r = cli("bench", "--model", model, "--forced", str(rec), "--warmup", "0", "--json", str(tmp_path / "f.json"),
            "--drafters", "ngram:budget=7", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "projected (acceptance of" in r.stdout and "prompts=['humaneval']" in r.stdout
    runs = json.loads((tmp_path / "f.json").read_text())["runs"]
    assert {x["drafter"] for x in runs} == {"none", "ngram:budget=7", "mlx-lm"}
    assert all(x["turns"] == counts[i:i + 1] for i in range(2) for x in runs if x["prompt"] == f"HumanEval/{i}")
    streams["fingerprint"] = "another"
    (rec / "streams.json").write_text(json.dumps(streams))
    assert_one_line_error(cli("bench", "--model", model, "--forced", str(rec)), "another tokenizer")
    assert_one_line_error(cli_here("bench", "--model", model, "--forced", str(tmp_path)), "cannot read")
    assert_one_line_error(cli_here("bench", "--model", model, "--forced", str(rec), "--record", str(tmp_path / "x")),
                          "do not go together")
    assert_one_line_error(cli_here("bench", "--model", model, "--verify-cost", "--contexts", "a,b"), "--contexts")
    assert_one_line_error(cli_here("bench", "--model", model, "--verify-cost", "--contexts", "100000"), "--contexts")


@pytest.mark.parametrize("seed", [101, 102, 103])
def test_the_shipped_recordings_are_the_default_models(default_model, seed):
    """tools/data/streams_seed10N (`bench --record` of the default model, seeds 101-103: what GPU
    runs and tools.scale_projection --cost take as acceptance without recording first) are of the
    default model's vocabulary, and their streams replay with drafts accepted."""
    from pathlib import Path

    from cacheback_mlx.tokenizer import vocab_fingerprint

    rec = R.load_recording(Path(__file__).parent.parent / "tools" / "data" / f"streams_seed{seed}")
    assert rec["fingerprint"] == vocab_fingerprint(default_model.tokenizer)
    assert rec["seed"] == seed and len(rec["prompts"]) == 17
    requests = [q for record in rec["prompts"][:4] for q in R.requests_of(record)]
    assert all(0 <= t < VOCAB for q in requests for t in q["prompt"] + q["out"])
    results = replay_requests(lambda: make_drafter("ngram"), requests, budget=7)
    assert sum(r.tokens for r in results) > sum(r.steps for r in results)
