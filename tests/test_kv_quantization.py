"""K/V cache quantization (mlx-lm's --kv-bits, --kv-group-size, --quantized-kv-start): the caches
turn quantized where mlx-lm's do, on every family mlx-lm can quantize, and whatever is drafted the
engine's output equals mlx-lm's generate_step with the same settings on these tiny shapes (where a
pass's keys and values quantize as a one-row step's do, with OpenBLAS and with MLX's own BLAS): a
strict check of the point and of rollback over quantized caches. At real sizes a pass's keys and
values can differ from a step's in the last bits and round to another step (README, "K/V cache
quantization"; docs/BENCHMARKS.md §23). The rest is a one-line error."""

from cacheback_mlx import lm
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.kvcache import quantize_point

import mlx.core as mx
import pytest
from mlx_lm import stream_generate as mlx_stream
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter
from conftest import write_tiny_gguf

PROMPT = [(7 * i + 3) % 97 + 1 for i in range(24)]
N = 24
# families whose keys and values mlx-lm quantizes (full-attention caches through its shared attention)
QUANTIZED = ["llama", "qwen2", "qwen3", "phi3", "starcoder2", "qwen3_moe", "olmo2", "smollm3", "granite",
             "llama4_text", "qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "jamba"]


def reference(model, prompt, n, bits, start, group_size=32, cache=None):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                                             kv_bits=bits, kv_group_size=group_size, quantized_kv_start=start)]


def engine(model, drafter, bits, start, group_size=32):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=16)
    eng.set_kv_quantization(bits, group_size, start)
    return eng


def run(eng, prompt=PROMPT, n=N):
    return [t for step in eng.generate(prompt, n) for t in step]


def mlx_lm_call_ends(start: int, cached: int, prompt_length: int, chunk: int) -> int:
    """generate_step's model calls, simulated: the cache length after the first that leaves at least `start`."""
    length, left = cached, prompt_length - cached
    while left > 1:  # its prefill: chunks up to the prompt's last token
        length += min(chunk, left - 1)
        left -= min(chunk, left - 1)
        if length >= start:
            return length
    length += 1  # the last prompt token alone, then a token a step
    while length < start:
        length += 1
    return length


def test_the_caches_turn_quantized_where_mlx_lm_s_calls_do():
    for chunk in (4, 7, 2048):
        for prompt_length in range(1, 30):
            for cached in range(prompt_length):
                for start in range(0, 40):
                    assert quantize_point(start, cached, prompt_length, chunk) == \
                        mlx_lm_call_ends(start, cached, prompt_length, chunk), (start, cached, prompt_length, chunk)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_greedy_tokens_equal_mlx_lm(name):
    model = zoo.tiny_model(name, **zoo.wide_heads(name))
    full = reference(model, PROMPT, N, None, 0)
    truths = {start: reference(model, PROMPT, N, 4, start) for start in (23, 30)}
    # the caches turn at the prompt's last chunk, then in the middle of decoding; quantizing changes the
    # answer (but where one attention layer sits among many recurrent ones)
    assert any(truth != full for truth in truths.values()) or name in ("lfm2", "jamba"), name
    for start, truth in truths.items():
        drafters = {"none": NoDrafter(), "oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
                    "random": RandomTreeDrafter(PROMPT, truth, seed=start),
                    "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)])}
        for label, drafter in drafters.items():
            eng = engine(model, drafter, 4, start)
            assert run(eng) == truth, (name, start, label)
            assert eng.seq.cache.quantized, (name, start, label)
            if label == "oracle-tree" and not eng.seq.cache.recurrent:
                assert eng.stats.passes <= N // 2, (name, eng.stats.passes)  # it did speculate


def test_every_point_of_turning_and_every_width_equal_mlx_lm():
    model = zoo.tiny_model("llama", **zoo.wide_heads("llama"))
    for bits, start in ((4, 0), (4, 24), (4, 25), (4, 33), (8, 31), (2, 26), (4, 100)):
        truth = reference(model, PROMPT, N, bits, start)
        for drafter in (NoDrafter(), OracleDrafter(PROMPT, truth), RandomTreeDrafter(PROMPT, truth, seed=bits)):
            eng = engine(model, drafter, bits, start)
            assert run(eng) == truth, (bits, start, type(drafter).__name__)
            assert eng.seq.cache.quantized == (start <= len(PROMPT) + N - 1), (bits, start)
    wide = zoo.tiny_model("llama", head_dim=64)  # groups of 64 and 128
    for group_size in (64,):
        truth = reference(wide, PROMPT, N, 4, 26, group_size)
        assert run(engine(wide, OracleDrafter(PROMPT, truth, extra_wrong_branches=1), 4, 26, group_size)) == truth


def test_a_prompt_longer_than_mlx_lm_s_prefill_chunk_turns_where_its_chunks_end():
    model = zoo.tiny_model("qwen3", **zoo.wide_heads("qwen3"))
    prompt = [(13 * i + 5) % 97 + 1 for i in range(2100)]
    for start in (1000, 2060):  # turned at the end of the first 2,048-token chunk; at the prompt's last token
        truth = reference(model, prompt, 12, 4, start)
        eng = engine(model, RandomTreeDrafter(prompt, truth, seed=3), 4, start)
        assert run(eng, prompt, 12) == truth, start
        assert eng.seq.cache.quantized_at == (2048 if start == 1000 else 2099)


def test_a_second_turn_continues_on_the_quantized_cache_as_mlx_lm_does():
    """A next request on the cache the last one left, as mlx-lm's chat and server reuse a prompt
    cache: against generate_step on mlx-lm's cache of the same tokens."""
    model = zoo.tiny_model("llama", **zoo.wide_heads("llama"))
    for start in (10, 60):  # quantized in the first turn; in the second
        first = reference(model, PROMPT, N, 4, start)
        eng = engine(model, OracleDrafter(PROMPT, first, extra_wrong_branches=1), 4, start)
        assert run(eng) == first
        follow = PROMPT + first + [5, 9, 11, 3]
        theirs_cache = make_prompt_cache(model)
        reference(model, PROMPT, N, 4, start, cache=theirs_cache)
        fed = len(PROMPT) + N - 1  # what our cache keeps (the last token was never fed)
        trim_prompt_cache(theirs_cache, theirs_cache[0].offset - fed)
        truth = reference(model, follow[fed:], N, 4, start, cache=theirs_cache)
        eng.set_drafter(RandomTreeDrafter(follow, truth, seed=start))
        assert run(eng, follow) == truth, start
        assert eng.stats.prefill_tokens == len(follow) - 1 - fed  # the cache was reused


def test_a_request_sharing_less_than_the_quantized_part_starts_afresh():
    """A next request whose prompt parts from the cached tokens before the point where the caches
    turned quantized: those positions are full precision in a fresh request's caches, so its output
    is generate_step's on a fresh cache, not on the quantized one cut back (mlx-lm's own output
    differs on that one). (Parting after the point, it is reused: the test above.)"""
    model = zoo.tiny_model("llama", **zoo.wide_heads("llama"))
    start = 30
    first = reference(model, PROMPT, N, 4, start)
    eng = engine(model, OracleDrafter(PROMPT, first), 4, start)
    assert run(eng) == first and eng.seq.cache.quantized_at == start
    other = PROMPT[:12] + [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    truth = reference(model, other, N, 4, start)
    cut = make_prompt_cache(model)  # mlx-lm's quantized cache cut back to the shared part
    reference(model, PROMPT, N, 4, start, cache=cut)
    trim_prompt_cache(cut, cut[0].offset - 12)
    assert reference(model, other[12:], N, 4, start, cache=cut) != truth  # the cut-back cache would mislead
    eng.set_drafter(RandomTreeDrafter(other, truth, seed=1))
    assert run(eng, other) == truth
    assert eng.stats.prefill_tokens == len(other) - 1  # nothing reused


def test_models_mlx_lm_cannot_quantize_get_one_line_errors():
    cases = {"gemma3_text": "sliding-window", "gemma2": "attention", "mistral": "sliding-window"}
    for name, needle in cases.items():
        eng = Engine(zoo.tiny_model(name), eos_ids=[], drafter=NoDrafter(), context_length=512)
        with pytest.raises(CachebackError, match=needle) as e:
            eng.set_kv_quantization(4, 32, 0)
        assert "\n" not in str(e.value)
    eng = Engine(zoo.tiny_model("llama"), eos_ids=[], drafter=NoDrafter(), context_length=512)
    with pytest.raises(CachebackError, match="does not divide its head size \\(16\\)"):
        eng.set_kv_quantization(4, 32, 0)
    for bits, group_size in ((7, 32), (4, 48)):
        with pytest.raises(CachebackError, match="--kv-bits must be one of"):
            eng.set_kv_quantization(bits, group_size, 0)
    with pytest.raises(CachebackError, match="--quantized-kv-start"):
        engine(zoo.tiny_model("llama", **zoo.wide_heads("llama")), NoDrafter(), 4, -1)
    # recurrent only: nothing mlx-lm would quantize; it runs as it is, as with mlx-lm
    mamba = zoo.tiny_model("mamba2")
    eng = engine(mamba, NoDrafter(), 4, 0)
    assert run(eng) == reference(mamba, PROMPT, N, 4, 0) and not eng.seq.cache.quantized


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "t.gguf"
    write_tiny_gguf(path, context=512, heads=2, kv_heads=1)  # heads of 32
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return lm.load(tiny_path)


def test_stream_generate_takes_mlx_lm_s_kv_arguments(tiny):
    model, tokenizer = tiny
    prompt = "abcabcabc abc abcab"
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=8)
    theirs = [r.token for r in mlx_stream(model, tokenizer, prompt, max_tokens=32, **kv)]
    assert theirs != [r.token for r in mlx_stream(model, tokenizer, prompt, max_tokens=32)]
    for drafter in ("auto", "pld"):
        assert [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=32, drafter=drafter,
                                                    **kv)] == theirs, drafter
    plain = [r.token for r in mlx_stream(model, tokenizer, prompt, max_tokens=32)]
    assert [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=32)] == plain  # off again
    with pytest.raises(CachebackError, match="max_kv_size"):
        next(lm.stream_generate(model, tokenizer, prompt, max_kv_size=64))


def cli(*args, input=None):
    from cacheback_mlx.cli import main

    from click.testing import CliRunner

    return CliRunner().invoke(main, list(args), input=input)


def test_generate_and_chat_take_mlx_lm_s_kv_options(tiny_path, tiny):
    model, tokenizer = tiny
    prompt = "abcabcabc abc abcab"
    kv = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8"]
    theirs = "".join(r.text for r in mlx_stream(model, tokenizer, prompt, max_tokens=32, kv_bits=4,
                                                  kv_group_size=32, quantized_kv_start=8))
    for drafter in ("auto", "ngram"):
        r = cli("generate", prompt, "--model", tiny_path, "--raw", "-n", "32", "--drafter", drafter, *kv)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.rstrip("\n") == theirs, drafter
    turns = "abcab abcab\nabc abcabc abc\n"
    replies = {d: cli("chat", "--model", tiny_path, "-n", "24", "--drafter", d, *kv, input=turns)
               for d in ("none", "auto")}
    assert all(r.exit_code == 0 for r in replies.values()), [r.stderr for r in replies.values()]
    answers = {d: [line for line in r.stdout.split(">>> ")[1:-1]] for d, r in replies.items()}
    assert len(answers["none"]) == 2 and "reused" in replies["none"].stdout
    # drafts change nothing, turn after turn (the second on the cache the first left, quantized)
    assert [a.rsplit("\n[", 1)[0] for a in answers["none"]] == [a.rsplit("\n[", 1)[0] for a in answers["auto"]]
    for bad, needle in ((["--kv-bits", "7"], "--kv-bits must be one of"),
                        (["--kv-bits", "4", "--kv-group-size", "128"], "does not divide its head size")):
        r = cli("generate", "hi", "--model", tiny_path, *bad)
        assert r.exit_code == 1 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_bench_quantizes_the_engine_s_and_mlx_lm_s_caches_alike(tiny_path, tiny, tmp_path):
    """`bench --kv-bits`: the engine's rows and mlx-lm's row run with the same K/V quantization."""
    import json

    model, tokenizer = tiny
    (tmp_path / "humaneval").mkdir()
    prompt = "abcabcabc abc abcab"
    (tmp_path / "humaneval" / "HumanEval.jsonl").write_text(
        json.dumps({"task_id": "HumanEval/0", "prompt": prompt}) + "\n")
    r = cli("bench", "--model", tiny_path, "--data", str(tmp_path), "--prompts", "humaneval", "--per-category", "1",
            "-n", "32", "--warmup", "0", "--drafters", "none,ngram", "--json", str(tmp_path / "b.json"),
            "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8")
    assert r.exit_code == 0, r.stderr
    assert "kv_cache=4 bits, group 32, from 8 tokens" in r.stdout
    runs = {run["drafter"]: run["tokens"] for run in json.loads((tmp_path / "b.json").read_text())["runs"]}
    ids = tokenizer.encode(prompt)
    theirs = [r.token for r in mlx_stream(model, tokenizer, ids, max_tokens=32, kv_bits=4, kv_group_size=32,
                                          quantized_kv_start=8)]
    assert theirs != [r.token for r in mlx_stream(model, tokenizer, ids, max_tokens=32)]
    assert runs["mlx-lm"] == runs["none"] == runs["ngram"] == theirs[:len(runs["none"])] and len(runs["none"]) > 8
    bad = cli("bench", "--model", tiny_path, "--verify-cost", "--kv-bits", "4")
    assert bad.exit_code == 1 and "--kv-bits goes with a plain bench" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_the_default_model_s_tokens_are_mlx_lm_s_up_to_the_point(default_model):
    """On the real default model the caches turn where mlx-lm's do and every token computed before
    that equals mlx-lm's, drafts or not (past it, README "K/V cache quantization")."""
    from cacheback_mlx.drafters import make_drafter

    model, tok = default_model.model, default_model.tokenizer
    ids = list(tok.encode("def bubble_sort(items):\n    \"\"\"Sort a list in place.\"\"\"\n    n = len(items)\n"))
    start, n = len(ids) + 12, 20
    theirs = reference(model, ids, n, 4, start, group_size=64)
    exact = start - len(ids) + 1  # tokens computed before the caches turned
    for name in ("auto", "ngram"):
        eng = Engine(model, [], make_drafter(name), default_model.context_length)
        eng.set_kv_quantization(4, 64, start)
        assert run(eng, ids, n)[:exact] == theirs[:exact], name
        assert eng.seq.cache.quantized_at == start, name


def test_serve_takes_the_kv_options_and_serves_one_request_at_a_time(tiny_path, monkeypatch):
    """`serve --kv-bits`: the session's engine quantizes as asked and requests run one at a time
    (lanes of a batch keep full-precision caches); --parallel above 1 with it is a one-line error."""
    import cacheback_mlx.server

    seen = {}
    monkeypatch.setattr(cacheback_mlx.server, "serve", lambda session, host, port, **kw: seen.update(
        kv=session.engine.kv_quant, parallel=kw["parallel"]))
    kv = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8"]
    r = cli("serve", "--model", tiny_path, *kv)
    assert r.exit_code == 0, r.stderr
    assert seen == {"kv": (4, 32, 8), "parallel": 1} and "K/V cache in 4 bits from 8 tokens" in r.stderr
    r = cli("serve", "--model", tiny_path)
    assert r.exit_code == 0 and seen == {"kv": None, "parallel": 4}
    for bad, needle in ((["--parallel", "2"], "--kv-bits serves one request at a time"),
                        (["--kv-bits", "7"], "--kv-bits must be one of")):
        r = cli("serve", "--model", tiny_path, *kv, *bad)
        assert r.exit_code == 1 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.serial  # starts a server
def test_a_server_with_quantized_caches_answers_as_mlx_lm_does(tiny_path, tiny):
    from cacheback_mlx.api import Session

    import httpx

    from test_server import serving

    model, tokenizer = tiny
    prompt = "abcabcabc abc abcab"
    theirs = "".join(r.text for r in mlx_stream(model, tokenizer, prompt, max_tokens=32, kv_bits=4, kv_group_size=32,
                                                  quantized_kv_start=8))
    assert theirs != "".join(r.text for r in mlx_stream(model, tokenizer, prompt, max_tokens=32))
    session = Session(tiny_path, "auto")
    session.engine.set_kv_quantization(4, 32, 8)
    with serving(session) as url:
        for _ in range(2):  # the second request again, on the cache the first left
            r = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": 32}, timeout=120)
            assert r.status_code == 200 and r.json()["content"] == theirs


@pytest.mark.parametrize("drafter", ["none", "auto"])
def test_a_prompt_cache_conversation_quantized_is_mlx_lm_s(tiny, drafter):
    """mlx-lm's prompt_cache with its kv arguments: turn after turn on the cache the last one
    quantized, the tokens equal mlx-lm's."""
    model, tokenizer = tiny
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=12)
    theirs_cache, ours_cache = make_prompt_cache(model), lm.make_prompt_cache(model)
    for prompt in ("abcabc abc", "abcab abcab", "abc abcabc abc"):
        theirs = [r.token for r in mlx_stream(model, tokenizer, prompt, max_tokens=16, prompt_cache=theirs_cache,
                                              **kv)]
        ours = [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=16, drafter=drafter,
                                                    prompt_cache=ours_cache, **kv)]
        assert ours == theirs
    assert type(theirs_cache[0]).__name__ == "QuantizedKVCache"  # mlx-lm's turned quantized in the first turn
