"""Benchmark harness: prompt sets and columns, aggregation, the lossless check, JSON output."""

import json

from cacheback_mlx import bench as B

import pytest


def test_spec_bench_columns_and_humaneval_prompts():
    if not (B.DATA / "spec_bench" / "question.jsonl").is_file():
        pytest.skip("../shared/data not present")
    prompts = B.load_prompts(["spec_bench", "humaneval"], per_category=1)
    cols = {p.column for p in prompts}
    assert cols == set(B.COLUMNS)
    mt = [p for p in prompts if p.column == "multi-turn conversation"]
    assert len(mt) == 8 and all(len(p.turns) == 2 and p.chat for p in mt)
    he = [p for p in prompts if p.column == "humaneval"]
    assert len(he) == 1 and not he[0].chat and he[0].turns[0].startswith(("def", "from", "import", "\n"))
    only = B.load_prompts(["spec_bench"], per_category=3, categories=["qa"])
    assert len(only) == 3 and {p.column for p in only} == {"qa"}
    a = B.load_prompts(["spec_bench"], per_category=3, categories=["qa", "writing"], seed=1)
    b = B.load_prompts(["spec_bench"], per_category=3, categories=["qa", "writing"], seed=2)
    assert len(a) == len(b) == 6 and [p.id for p in a] != [p.id for p in b]  # seeded samples differ
    assert [p.id for p in a] == [p.id for p in B.load_prompts(["spec_bench"], per_category=3,
                                                              categories=["qa", "writing"], seed=1)]


def runs():
    R = B.Run
    return [R("q1", "qa", "none", [1, 2, 3, 4], 2.0, 4, 4, 0.0), R("q1", "qa", "ngram", [1, 2, 3, 4], 1.0, 2, 4, 0.1),
            R("q1", "qa", "mlx-lm", [1, 2, 3, 4], 2.0, 4, 4, 0.0),
            R("h1", "humaneval", "none", [5, 6], 1.0, 2, 2, 0.0), R("h1", "humaneval", "ngram", [5, 7], 0.5, 1, 2, 0.0),
            R("h1", "humaneval", "mlx-lm", [5, 6], 1.0, 2, 2, 0.0)]


def test_summary_aggregates_per_column_and_overall():
    s = B.summarize(runs())
    assert list(s) == ["qa", "humaneval", "spec_bench", "overall"]  # spec_bench: all but HumanEval
    assert s["spec_bench"]["ngram"] == s["qa"]["ngram"]
    assert "spec_bench" not in B.summarize([r for r in runs() if r.column == "qa"])
    assert s["qa"]["ngram"]["tokens_per_s"] == 4.0 and s["qa"]["ngram"]["speedup_vs_none"] == 2.0
    assert s["qa"]["ngram"]["speedup_vs_mlx_lm"] == 2.0 and s["qa"]["ngram"]["mat"] == 2.0
    assert s["overall"]["none"]["tokens"] == 6 and s["overall"]["ngram"]["tokens_per_s"] == 6 / 1.5
    assert abs(s["qa"]["ngram"]["draft_share"] - 0.1) < 1e-9
    assert s["qa"]["ngram"]["draft_us_per_pass"] == pytest.approx(1e6 * 0.1 / 2)
    assert "qa" in B.format_table(s)
    no_mlx_lm = B.format_table(B.summarize([r for r in runs() if r.drafter != "mlx-lm"]))
    assert "nan" not in no_mlx_lm and "|         - |" in no_mlx_lm  # a baseline not run shows as "-"


def test_a_drafter_whose_output_differs_is_reported():
    bad = B.mismatches(runs())
    assert bad == ["ngram differs from none on h1 at token 1"]


def test_a_difference_says_in_which_turn_it_began():
    def two_turns(drafter, second):
        r = B.Run("c1", "multi-turn conversation", drafter)
        r.add([1, 2, 3], 1.0)
        r.add(second, 1.0)
        return r

    runs_ = [two_turns("none", [4, 5]), two_turns("mlx-lm", [4, 6]), two_turns("auto", [4, 5])]
    first = B.Run("c2", "qa", "none")
    first.add([1, 2], 1.0)
    other = B.Run("c2", "qa", "mlx-lm")
    other.add([1, 3], 1.0)
    assert B.mismatches(runs_ + [first, other]) == ["mlx-lm differs from none on c1 at token 4 (turn 2 of 2)",
                                                    "mlx-lm differs from none on c2 at token 1"]
    runs_[1].tokens[1] = 9
    assert B.mismatches(runs_) == ["mlx-lm differs from none on c1 at token 1 (turn 1 of 2)"]
    runs_[1].tokens[1:] = [2, 3, 4, 5, 7]  # longer than the reference: where it ends
    assert B.mismatches(runs_) == ["mlx-lm differs from none on c1 at token 5 (turn 2 of 2)"]
    assert "prefilled the whole conversation again" in B.later_turn_note(B.mismatches(runs_))
    assert B.later_turn_note(["mlx-lm differs from none on c1 at token 1 (turn 1 of 2)",
                              "auto differs from none on c1 at token 4 (turn 2 of 2)",
                              "mlx-lm differs from none on c2 at token 1"]) is None


def test_json_output(tmp_path):
    r = runs()
    B.save_json(r, B.summarize(r), tmp_path / "b.json", {"machine": "test"})
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["meta"]["machine"] == "test" and len(data["runs"]) == 6
    assert data["summary"]["overall"]["ngram"]["mat"] == pytest.approx(2.0)
    r[0].pass_log = [[1, 0, 5, 8.25], [8, 7, 6, 1e-05]]
    B.save_json(r, B.summarize(r), tmp_path / "b.json", {"machine": "test"})
    text = (tmp_path / "b.json").read_text()
    assert f'"tokens": {json.dumps(r[0].tokens)}' in text  # a list of numbers on one line
    assert "[8, 7, 6, 1e-05]" in text and json.loads(text)["runs"][0]["pass_log"][1] == [8, 7, 6, 1e-05]


def test_engine_runs_interleave_and_match_on_a_tiny_model(tmp_path, monkeypatch):
    from cacheback_mlx.api import Session

    from conftest import write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    session = Session(str(tmp_path / "t.gguf"), "none")
    prompts = [B.Prompt("a", "qa", ["hello there"], chat=True), B.Prompt("b", "humaneval", ["def f(x):"], chat=False),
               B.Prompt("c", "multi-turn conversation", ["hi", "and then?"], chat=True)]
    drafters = {n: session.make_drafter(n) for n in ("none", "ngram", "cacheback")}
    out = B.run_bench(session, prompts, drafters, max_tokens=12, warmup=0, progress=False)
    assert len(out) == 3 * 4 and not B.mismatches(out)
    warmed = []
    run_mlx_lm = B.run_mlx_lm
    monkeypatch.setattr(B, "run_mlx_lm", lambda s, p, n, *args: (warmed.append(p.id), run_mlx_lm(s, p, n))[1])
    # on a GPU every prompt first runs once untimed (not on the CPU unless asked)
    again = B.run_bench(session, prompts[:2], {"none": drafters["none"]}, max_tokens=4, warmup=0, progress=False,
                        warm_every_prompt=True)
    assert warmed == ["a", "b", "a", "b"] and len(again) == 4
    warmed.clear()
    B.run_bench(session, prompts[:1], {"none": drafters["none"]}, max_tokens=4, warmup=0, progress=False)
    assert warmed == ["a"]
    assert {r.drafter for r in out} == {"none", "ngram", "cacheback", "mlx-lm"}
    assert all(r.tokens for r in out if r.drafter == "none")
    assert all(0 < r.verify_s < r.seconds for r in out if r.drafter != "mlx-lm")
    for r in out:  # each engine run logs its verify passes: [rows, drafts, cached, ms]
        if r.drafter == "mlx-lm":
            assert r.pass_log == []
            continue
        assert len(r.pass_log) == r.passes
        assert all(rows >= 1 + drafts and ms > 0 for rows, drafts, _, ms in r.pass_log)
        assert sum(ms for *_, ms in r.pass_log) == pytest.approx(r.verify_s * 1000, rel=0.01)
        if r.drafter == "none":  # (a turn's first pass may take the prompt's last tokens with its own)
            assert all(drafts == 0 for _, drafts, _, _ in r.pass_log)
            assert sum(rows == 1 for rows, _, _, _ in r.pass_log) >= len(r.pass_log) - len(r.turns)
        cached = [c for _, _, c, _ in r.pass_log]
        assert cached[: r.turns[0]] == sorted(cached[: r.turns[0]])  # a turn's cache only grows



def test_sampled_runs_give_every_drafter_the_same_text(tmp_path):
    """With sampling each question's turns get a seed of their own (bench.sampled), the same for
    every drafter and every run, so the lossless check still holds: every drafter's sampled text
    equals none's; mlx-lm samples with its own sampler, seeded the same way (the same twice)."""
    from cacheback_mlx.api import Session
    from cacheback_mlx.sampling import SamplingParams

    from conftest import write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    session = Session(str(tmp_path / "t.gguf"), "none")
    prompts = [B.Prompt("a", "qa", ["hello there"], chat=True),
               B.Prompt("c", "multi-turn conversation", ["hi", "and then?"], chat=True)]
    drafters = {n: session.make_drafter(n) for n in ("none", "ngram", "cacheback")}
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    out = B.run_bench(session, prompts, drafters, max_tokens=12, warmup=0, progress=False, sampling=sampling)
    assert not B.mismatches([r for r in out if r.drafter != B.MLX_LM])
    greedy = B.run_bench(session, prompts, {"none": drafters["none"]}, max_tokens=12, warmup=0, progress=False,
                         with_mlx_lm=False)
    sampled = {r.prompt: r.tokens for r in out if r.drafter == "none"}
    assert any(sampled[r.prompt] != r.tokens for r in greedy)  # it does sample
    again = B.run_bench(session, prompts, {"none": drafters["none"]}, max_tokens=12, warmup=0, progress=False,
                        sampling=sampling)
    assert {(r.prompt, r.drafter): r.tokens for r in again} == {(r.prompt, r.drafter): r.tokens for r in out
                                                                  if r.drafter in ("none", B.MLX_LM)}
    assert B.sampled(sampling, prompts[1], 0).seed != B.sampled(sampling, prompts[1], 1).seed
    assert B.sampled(None, prompts[0], 0).greedy

def test_stalled_passes_are_those_far_past_the_median_of_their_row_count():
    logs = [[[1, 0, 5, 8.0]] * 9 + [[1, 0, 14, 90.0]], [[8, 7, 3, 20.0], [8, 7, 11, 21.0], [8, 7, 19, 150.0]], []]
    assert B.pass_medians(logs) == {1: 8.0, 8: 21.0}
    assert B.stalls(logs, 5.0) == [[[1, 0, 14, 90.0]], [[8, 7, 19, 150.0]], []]
    assert B.stalls(logs, 10.0) == [[[1, 0, 14, 90.0]], [], []]
