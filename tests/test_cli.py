"""The CLI as a user runs it: streaming output, stats, and one-line errors for bad input."""

import subprocess
import sys

import pytest

from conftest import write_tiny_gguf


def cli(*args, stdin=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cacheback_mlx.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def cli_here(*args):
    """The command run in this process (click's runner), as cli() returns it: for more bad inputs
    after a first one ran in a process of its own, which would only add its start-up."""
    from cacheback_mlx.cli import main

    from click.testing import CliRunner

    r = CliRunner().invoke(main, list(args))
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def assert_one_line_error(result, *needles):
    assert result.returncode == 1, (result.returncode, result.stderr)
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_tiny_gguf(path, context=64)
    return str(path)


def test_generate_streams_text_and_stats(tiny_gguf):
    r = cli("generate", "hello", "--model", tiny_gguf, "--raw", "--max-tokens", "8", "--stats")
    assert r.returncode == 0, r.stderr
    assert "MAT" in r.stderr and "tok/s" in r.stderr and "us/pass" in r.stderr


def test_missing_model(tmp_path):
    assert_one_line_error(cli("generate", "hi", "--model", str(tmp_path / "none.gguf")), "not found")


def test_corrupt_and_non_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    assert_one_line_error(cli("generate", "hi", "--model", str(bad)), "cannot read GGUF")
    txt = tmp_path / "notes.gguf"
    txt.write_text("not a model")
    assert_one_line_error(cli_here("generate", "hi", "--model", str(txt)), "not a GGUF")


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", arch="falcon")
    assert_one_line_error(cli("generate", "hi", "--model", str(tmp_path / "x.gguf")), "falcon")


def test_unknown_drafter_lists_known_ones(tiny_gguf):
    assert_one_line_error(cli("generate", "hi", "--model", tiny_gguf, "--drafter", "magic"), "magic", "ngram", "none")


def test_empty_prompt_bad_max_tokens_and_long_prompt(tiny_gguf):
    assert_one_line_error(cli("generate", "   ", "--model", tiny_gguf, "--raw"), "empty prompt")
    assert_one_line_error(cli_here("generate", "hi", "--model", tiny_gguf, "--max-tokens", "0"), "max_tokens")
    assert_one_line_error(cli_here("generate", "x" * 200, "--model", tiny_gguf, "--raw"), "context")


def test_bad_drafter_arg(tiny_gguf):
    assert_one_line_error(cli("generate", "hi", "--model", tiny_gguf, "--drafter", "ngram", "--drafter-arg", "oops"),
                          "KEY=VALUE")
    assert_one_line_error(cli_here("generate", "hi", "--model", tiny_gguf, "--drafter", "ngram", "--drafter-arg",
                                   "nope=1"), "ngram")


def test_prompt_from_stdin(tiny_gguf):
    r = cli("generate", "-", "--model", tiny_gguf, "--raw", "--max-tokens", "4", stdin="some text")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_default_model_answers_from_the_command_line():
    r = cli("generate", "What is the capital of France?", "--max-tokens", "24", "--drafter", "ngram", "--stats")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_build_table_from_a_folder_and_jsonl(tmp_path, tiny_gguf):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat. the cat sat on the hat. " * 20)
    (corpus / "b.jsonl").write_text('{"text": "the dog sat on the log."}\nnot json\n{"other": "the cat sat"}\n')
    out = tmp_path / "t.npz"
    r = cli("build-table", str(corpus), "--out", str(out), "--model", tiny_gguf, "--lc", "50", "--fc", "4")
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "leaders" in r.stdout
    # the table is tied to that tokenizer, and the drafter uses it
    r = cli_here("generate", "the cat", "--model", tiny_gguf, "--raw", "--max-tokens", "4", "--drafter", "cacheback",
                 "--drafter-arg", f"frozen={out}")
    assert r.returncode == 0, r.stderr
    assert_one_line_error(cli_here("build-table", str(tmp_path / "missing"), "--out", str(out), "--model", tiny_gguf),
                          "not found")


def test_build_datastore_and_use_it_with_rest(tmp_path, tiny_gguf):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 30)
    out = tmp_path / "ds"
    r = cli("build-datastore", str(corpus), "--out", str(out), "--model", tiny_gguf)
    assert r.returncode == 0, r.stderr
    r = cli_here("generate", "the cat", "--model", tiny_gguf, "--raw", "--max-tokens", "4", "--drafter", "rest",
                 "--drafter-arg", f"datastore={out}", "--stats")
    assert r.returncode == 0, r.stderr
    assert "datastore_tokens" in r.stderr and "mean_retrieval_ms" in r.stderr
    assert_one_line_error(cli_here("generate", "x", "--model", tiny_gguf, "--drafter", "rest"), "build-datastore")


def test_bench_runs_drafter_variants_side_by_side(tmp_path):
    """`--drafters` variants (NAME:KEY=VALUE) are separate rows, each checked against `none`."""
    import json

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["what is it?"]}) + "\n")
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text(
        json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n"}) + "\n")
    r = cli("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--per-category", "1",
            "--max-tokens", "8", "--warmup", "0", "--no-mlx-lm", "--json", str(tmp_path / "b.json"),
            "--drafters", "cacheback,cacheback:frozen=false,cacheback:dynamic=false:tdl=8", timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    assert list(summary["overall"]) == ["none", "cacheback", "cacheback:frozen=false", "cacheback:dynamic=false:tdl=8"]
    assert "| cacheback:frozen=false " in r.stdout
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--drafters",
                   "cacheback:nope=1")
    assert_one_line_error(bad, "cacheback")
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--drafters",
                   "cacheback:frozen")
    assert_one_line_error(bad, "KEY=VALUE")



def test_bench_samples_when_given_a_temperature(tmp_path):
    """`bench --temperature T` (with --top-p, --top-k, --min-p) samples, seeded per question, and
    still checks every drafter against none; a filter without a temperature, or sampling with a
    recording, is a one-line error."""
    import json

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["what is it?"]}) + "\n")
    r = cli("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--prompts", "spec_bench",
            "--per-category", "1", "--max-tokens", "8", "--warmup", "0", "--drafters", "ngram",
            "--temperature", "0.8", "--top-p", "0.9", "--min-p", "0.02", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sampling=temperature 0.8, top_p 0.9, top_k 0, min_p 0.02" in r.stdout and "| mlx-lm " in r.stdout
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--top-p", "0.9")
    assert_one_line_error(bad, "--temperature")
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--forced", str(tmp_path), "--temperature", "1")
    assert_one_line_error(bad, "greedy")
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--temperature", "1",
                   "--top-p", "1.5")
    assert_one_line_error(bad, "top_p")
    bad = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--temperature", "1",
                   "--min-p", "2")
    assert_one_line_error(bad, "min_p")


def test_generate_keeps_to_a_json_schema_or_a_grammar(tmp_path):
    import json

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}  # bounded: it ends within -n on any CPU
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for run, value in ((cli, json.dumps(schema)), (cli_here, str(tmp_path / "s.json"))):
        r = run("generate", "abc", "--raw", "--model", str(tmp_path / "t.gguf"), "-n", "96", "--json-schema", value)
        assert r.returncode == 0, r.stderr
        assert set(json.loads(r.stdout)) == {"n"}
    r = cli_here("generate", "abc", "--raw", "--model", str(tmp_path / "t.gguf"), "-n", "8", "--grammar",
                 'root ::= "yes" | "no"')
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stderr
    assert_one_line_error(cli_here("generate", "abc", "--model", str(tmp_path / "t.gguf"), "--json-schema", "{oops"),
                          "grammar")
    assert_one_line_error(cli_here("generate", "abc", "--model", str(tmp_path / "t.gguf"), "--grammar", "root ::= ("),
                          "grammar")


def test_a_repetition_penalty_from_the_command_line_gives_mlx_lm_s_tokens(tmp_path):
    """`--repetition-penalty` (with its window) goes to every drafter and to mlx-lm's row of `bench`,
    whose lossless check then holds against mlx-lm with the same penalty; bad values: one line."""
    import json

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["abc abc abc abc abc", "and again?"]}) + "\n")
    r = cli("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--prompts", "spec_bench",
            "--per-category", "1", "--max-tokens", "24", "--warmup", "0", "--drafters", "none,pld,auto",
            "--repetition-penalty", "3", "--repetition-context-size", "64", "--json", str(tmp_path / "p.json"),
            timeout=300)
    assert r.returncode == 0, r.stderr
    assert "repetition_penalty=3.0 over 64 tokens" in r.stdout and "| mlx-lm " in r.stdout
    assert "differ from mlx-lm" not in r.stderr, r.stderr
    plain = cli_here("bench", "--model", str(tmp_path / "t.gguf"), "--data", str(tmp_path), "--prompts", "spec_bench",
                     "--per-category", "1", "--max-tokens", "24", "--warmup", "0", "--drafters", "none",
                     "--json", str(tmp_path / "n.json"))
    assert plain.returncode == 0, plain.stderr
    tokens = [{r["drafter"]: r["tokens"] for r in json.loads((tmp_path / f).read_text())["runs"]}
              for f in ("p.json", "n.json")]
    assert tokens[0]["none"] == tokens[0]["mlx-lm"] != tokens[1]["mlx-lm"]  # the penalty changed the text
    assert_one_line_error(cli_here("generate", "hi", "--model", str(tmp_path / "t.gguf"), "--repetition-penalty", "-1"),
                          "repetition_penalty")
    assert_one_line_error(cli_here("generate", "hi", "--model", str(tmp_path / "t.gguf"), "--repetition-penalty", "1.2",
                                   "--repetition-context-size", "-2"), "window")


def test_bench_of_plain_decoding_alone_measures_no_pass_cost(tmp_path):
    """`bench --drafters none` sizes no passes, so it starts at once: no pass-cost measurement (on a
    GPU that is a minute of compiling and timing passes). A drafter's row still measures it."""
    import json
    import os

    write_tiny_gguf(tmp_path / "t.gguf", context=512)
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["what is it?"]}) + "\n")
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text(
        json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n"}) + "\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    costs = tmp_path / "cache" / "cacheback-mlx" / "verify-cost"

    def bench(drafters):
        return subprocess.run([sys.executable, "-m", "cacheback_mlx.cli", "bench", "--model", str(tmp_path / "t.gguf"),
                               "--data", str(tmp_path), "--per-category", "1", "--max-tokens", "4", "--warmup", "0",
                               "--no-mlx-lm", "--drafters", drafters],
                              capture_output=True, text=True, timeout=300, env=env)

    r = bench("none")
    assert r.returncode == 0, r.stderr
    assert "| overall" in r.stdout and "measuring the cost" not in r.stderr
    assert not costs.exists() or not any(costs.iterdir())
    r = bench("none,ngram")
    assert r.returncode == 0, r.stderr
    assert "measuring the cost" in r.stderr and any(costs.iterdir())


def test_serve_refuses_a_bad_infill_extra_before_loading_anything():
    """--infill-extra takes -1 (all that fit) or more: anything else is click's usage error (exit 2),
    its last line naming the option, with no traceback and no model loaded."""
    r = cli("serve", "--infill-extra", "-5", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: Invalid value for '--infill-extra'"), r.stderr


def test_serve_refuses_fewer_than_one_slot_before_loading_anything():
    r = cli("serve", "--slots", "0", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: Invalid value for '--slots'"), r.stderr


def test_an_unreadable_scores_file_for_auto(tmp_path):
    missing, bad = tmp_path / "missing.json.gz", tmp_path / "scores.json.gz"
    assert_one_line_error(cli("generate", "hi", "--max-tokens", "2", "--drafter-arg", f"scores={missing}"),
                          "cannot read scores", str(missing))
    bad.write_bytes(b"not gzip")  # the same path in this process (a process of its own only adds its start-up)
    assert_one_line_error(cli_here("generate", "hi", "--max-tokens", "2", "--drafter-arg", f"scores={bad}"),
                          "cannot read scores", str(bad))


def test_an_extra_end_token_ends_the_answer_where_mlx_lm_s_would(tiny_gguf):
    """--extra-eos-token (the vocabulary's spelling or an id, as mlx-lm's; a one-token text too) ends
    the answer before that token, with drafts too; --min-p goes to the sampler (its draws: test_host_sampling.py);
    bad values: one line."""
    from cacheback_mlx.api import Session

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    session = Session(tiny_gguf, "none")
    ids = session.encode("hello", chat=False)
    truth = [int(t) for t, _ in generate_step(mx.array(ids), session.loaded.model, max_tokens=16)]
    k = next(i for i in range(3, len(truth)) if truth[i] not in truth[:i])  # a token first seen at k >= 3
    spelled = session.tokenizer._tokenizer.convert_ids_to_tokens(truth[k])
    want = session.tokenizer.decode(truth[:k])
    for token, drafter in ((spelled, "none"), (str(truth[k]), "ngram")):
        r = cli_here("generate", "hello", "--model", tiny_gguf, "--raw", "-n", "16", "--drafter", drafter,
                     "--extra-eos-token", token, "--stats")
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == want and f"| {k} tokens" in r.stderr, (token, r.stdout, r.stderr)
    r = cli_here("generate", "hello", "--model", tiny_gguf, "--raw", "-n", "8", "--temp", "1", "--min-p", "0.5",
                 "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert_one_line_error(cli_here("generate", "hi", "--model", tiny_gguf, "--extra-eos-token", "no such words here"),
                          "not one token")
    assert_one_line_error(cli_here("generate", "hi", "--model", tiny_gguf, "--temp", "1", "--min-p", "2"), "min_p")


def test_a_system_prompt_and_no_template_by_either_name(tiny_gguf):
    """--system, or mlx-lm's --system-prompt, goes before the question in the chat template;
    --raw, or mlx-lm's --ignore-chat-template, leaves the template out."""
    import re

    def prompt_tokens(*args):
        r = cli_here("generate", "hi", "--model", tiny_gguf, "--chat", "-n", "2", "--stats", *args)
        assert r.returncode == 0, r.stderr
        return int(re.search(r"prompt (\d+) tok", r.stderr).group(1))

    plain = prompt_tokens()
    assert prompt_tokens("--system", "be brief") == prompt_tokens("--system-prompt", "be brief") > plain
    assert prompt_tokens("--raw") == prompt_tokens("--ignore-chat-template") < plain
