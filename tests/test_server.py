"""The completion server, with a real HTTP client against a running uvicorn on 127.0.0.1."""

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

from cacheback_mlx.api import Session
from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.fim import CompletionRules, InfillBuilder, fim_prompt
from cacheback_mlx.tree import DraftTree

import httpx
import pytest

from conftest import write_tiny_gguf

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, seconds: float = 60.0) -> float:
    """Seconds until a server just started answers /health."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer /health within {seconds} s")


def start(session, **kw):
    from cacheback_mlx.server import create_app

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(session, **kw), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(session, **kw):
    """A server on `session` for the block: its URL."""
    server, thread, url = start(session, **kw)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(5)


def sse_events(r) -> list[dict]:
    """A server-sent event stream's JSON events ([DONE] left out)."""
    return [json.loads(x[5:]) for x in r.text.splitlines() if x.startswith("data:") and "[DONE]" not in x]


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "parallel-4"])
def tiny_server(tmp_path_factory, request):
    """The server one request at a time, and with requests run as lanes of one batch."""
    path = tmp_path_factory.mktemp("srv") / "fim.gguf"
    write_tiny_gguf(path, context=256, fim=True)
    server, thread, url = start(Session(str(path), "ngram"), api_key="sekrit", max_body=4096, parallel=request.param)
    yield url
    server.should_exit = True
    thread.join(5)


AUTH = {"Authorization": "Bearer sekrit"}


def test_fim_prompt_layout():
    fim = {"prefix": "<P>", "suffix": "<S>", "middle": "<M>", "file_sep": "<F>"}
    out = fim_prompt(fim, "def f(", "):\n", [{"filename": "a.py", "text": "x = 1\n"}], "x")
    assert out == "<F>a.py\nx = 1\n<P>def f(<S>):\n<M>x"
    assert fim_prompt({"prefix": "<P>", "suffix": "<S>", "middle": "<M>"}, "a", "b") == "<P>a<S>b<M>"
    with pytest.raises(CachebackError, match="fill-in-the-middle"):
        fim_prompt(None, "a", "b")


def test_health_models_and_api_key(tiny_server):
    assert httpx.get(f"{tiny_server}/health").json()["status"] == "ok"
    r = httpx.get(f"{tiny_server}/v1/models")
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(f"{tiny_server}/v1/models", headers=AUTH).json()["data"][0]["object"] == "model"
    assert httpx.get(f"{tiny_server}/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200  # Anthropic's
    for wrong in ({"x-api-key": "nope"}, {"Authorization": "sekrit"}, {"Authorization": "Bearer None"}):
        assert httpx.get(f"{tiny_server}/v1/models", headers=wrong).status_code == 401


def test_an_api_key_is_compared_as_given(tmp_path):
    from cacheback_mlx.server import create_app

    from starlette.testclient import TestClient

    write_tiny_gguf(tmp_path / "t.gguf")
    with TestClient(create_app(Session(str(tmp_path / "t.gguf"), "none"), api_key="None")) as client:
        assert client.get("/v1/models").status_code == 401  # a missing key is no key named "None"
        assert client.get("/v1/models", headers={"x-api-key": "None"}).status_code == 200


def test_infill_exactly_as_llama_vim_sends_it(tiny_server):
    body = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n",
                             "time": [1732000000, 12]}],
            "prompt": "    return ", "n_predict": 12, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]}
    r = httpx.post(f"{tiny_server}/infill", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert '"content":"' in r.text  # what llama.vim looks for before it parses a reply
    out = r.json()
    assert set(out) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"}
    assert isinstance(out["content"], str) and out["timings/predicted_n"] <= 12 and out["truncated"] is False


def test_streaming_infill_and_v1_completions_with_suffix(tiny_server):
    with httpx.stream("POST", f"{tiny_server}/infill", headers=AUTH, timeout=60,
                      json={"input_prefix": "a = ", "input_suffix": "\n", "n_predict": 8, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1]["stop"] is True and "timings" in events[-1]
    r = httpx.post(f"{tiny_server}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "x = ", "suffix": "\n", "max_tokens": 6})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = httpx.post(f"{tiny_server}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "x = ", "max_tokens": 6, "stream": True})
    assert r.text.strip().endswith("data: [DONE]")


def test_bad_requests_get_4xx_json_errors(tiny_server):
    post = lambda path, **kw: httpx.post(f"{tiny_server}{path}", headers={**AUTH, **kw.pop("headers", {})},
                                         timeout=30, **kw)
    cases = [
        post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
        post("/v1/completions", json={"prompt": 5, "max_tokens": "many"}),
        post("/v1/completions", json={"max_tokens": 4}),
        post("/v1/completions", json={"prompt": "", "max_tokens": 4}),
        post("/v1/chat/completions", json={"messages": []}),
        post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]}),
        post("/completion", json={"prompt": "hi", "n_predict": -3}),
        post("/infill", json={"input_prefix": "a", "temperature": -1}),
        post("/v1/completions", content=b"x" * 5000, headers={"content-type": "application/json"}),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert r.json()["error"]["message"]
    assert cases[-1].status_code == 413


def test_penalties_and_logit_biases_by_each_protocol_s_names(tiny_server):
    """llama.cpp's, OpenAI's (mlx-lm's server's) and Ollama's names for the penalties and biases reach
    the model (tests/test_penalties.py checks them against mlx-lm's own processors)."""
    z = 7 + ord("z")  # the tiny model's byte tokens come after its 7 special ones

    def text(path, body):
        r = httpx.post(f"{tiny_server}{path}", headers=AUTH, timeout=60, json=body)
        assert r.status_code == 200, (path, r.text)
        out = r.json()
        if "choices" in out:
            return out["choices"][0]["text"]
        return out["content"] if "content" in out else out["response"]

    llama = {"prompt": "ab ab ab ab", "n_predict": 16}
    openai = {"prompt": "ab ab ab ab", "max_tokens": 16, "logit_bias": {str(z): 12.0}}
    assert "z" not in text("/completion", llama)
    biased = text("/completion", {**llama, "logit_bias": [[z, 12.0]]})
    assert biased.startswith("zzzz"), biased
    assert text("/completion", {**llama, "logit_bias": {str(z): 12.0}}) == text("/v1/completions", openai) == biased
    assert "z" not in text("/completion", {**llama, "logit_bias": [[z, 12.0], [z, False]]})  # false: never
    # the penalty over the last 64 tokens (llama.cpp's and Ollama's window) keeps z out once it is in
    penalised = text("/completion", {**llama, "logit_bias": [[z, 12.0]], "repeat_penalty": 50.0})
    assert penalised.count("z") == 1, penalised
    assert text("/v1/completions", {**openai, "repetition_penalty": 50.0, "repetition_context_size": 64}) == penalised
    ollama = {"prompt": "ab ab ab ab", "raw": True, "stream": False,
              "options": {"num_predict": 16, "repeat_penalty": 50.0, "logit_bias": {str(z): 12.0}}}
    assert text("/api/generate", ollama) == penalised
    assert text("/completion", {**llama, "logit_bias": [[z, 12.0]], "repeat_penalty": 50.0,
                                "repeat_last_n": 0}) == biased  # a window of 0: no penalty
    for path, body in (("/completion", {**llama, "logit_bias": [[10**6, 1.0]]}),
                       ("/v1/completions", {**openai, "logit_bias": {"-1": 1.0}}),
                       ("/v1/completions", {**openai, "logit_bias": {"z": 1.0}}),
                       ("/v1/completions", {**openai, "presence_penalty": 5.0}),
                       ("/completion", {**llama, "repeat_last_n": -2}),
                       ("/completion", {**llama, "repeat_penalty": -1.0})):
        r = httpx.post(f"{tiny_server}{path}", headers=AUTH, timeout=30, json=body)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (body, r.status_code, r.text)


def test_body_is_json_whatever_its_content_type(tiny_server):
    """`curl -d '{...}'` (Ollama's and llama.cpp's documented usage) sends a form Content-Type."""
    form = {**AUTH, "content-type": "application/x-www-form-urlencoded"}
    body = json.dumps({"prompt": "hello", "n_predict": 4}).encode()
    for path, headers in (("/completion", form), ("/completion", AUTH), ("/api/generate", form)):
        payload = body if path != "/api/generate" else json.dumps({"prompt": "hi", "stream": False,
                                                                  "options": {"num_predict": 4}}).encode()
        r = httpx.post(f"{tiny_server}{path}", content=payload, headers=headers, timeout=60)
        assert r.status_code == 200, (path, r.text)
    r = httpx.post(f"{tiny_server}/completion", content=b"prompt=hello", headers=form, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_concurrent_requests_queue_and_both_complete(tiny_server):
    results = []

    def one():
        results.append(httpx.post(f"{tiny_server}/completion", headers=AUTH, timeout=60,
                                  json={"prompt": "hello", "n_predict": 16}).status_code)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200, 200]


def test_two_streams_at_once_both_finish(tiny_server):
    """A streaming request waits for the model between its steps; a second stream must queue
    behind it, not wedge the single model thread."""
    results = []

    def one(prompt):
        with httpx.stream("POST", f"{tiny_server}/completion", headers=AUTH, timeout=30,
                          json={"prompt": prompt, "n_predict": 24, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        results.append(events[-1]["stop"])

    threads = [threading.Thread(target=one, args=(p,)) for p in ("hello", "world")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True, True]


def test_disconnecting_stream_frees_the_model(tiny_server):
    with httpx.stream("POST", f"{tiny_server}/completion", headers=AUTH, timeout=60,
                      json={"prompt": "hello", "n_predict": 200, "stream": True}) as r:
        next(r.iter_lines())  # read one event, then hang up
    t0 = time.perf_counter()
    r = httpx.post(f"{tiny_server}/completion", headers=AUTH, timeout=60, json={"prompt": "hi", "n_predict": 2})
    assert r.status_code == 200 and time.perf_counter() - t0 < 10


@pytest.mark.slow
def test_default_model_through_the_openai_client(default_model):
    openai = pytest.importorskip("openai")
    server, thread, url = start(Session(default_model, "cacheback"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chunks = client.chat.completions.create(model="default", stream=True, max_tokens=24,
                                                messages=[{"role": "user",
                                                           "content": "What is the capital of France?"}])
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert "Paris" in text
        r = httpx.post(f"{url}/infill", json={"input_prefix": "def f():\n", "input_suffix": "", "n_predict": 16},
                       timeout=60)
        assert r.status_code == 200 and r.json()["fim"] is False  # prefix-only completion
    finally:
        server.should_exit = True
        thread.join(5)


def test_served_process_exits_cleanly_after_requests(tmp_path):
    """`cacheback-mlx serve` stopped with Ctrl-C after generating exits 0: the model thread frees
    its MLX streams first (without that MLX can abort at exit, code 134)."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, context=256)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cacheback_mlx.cli", "serve", "--model", str(path),
                             "--drafter", "ngram", "--port", str(port), "--infill-extra", "256", "--slots", "2",
                             "--parallel", "2"],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/props", timeout=5).json()["total_slots"] == 2
        slots = []
        for prompt in ("hello", "world", "hello"):
            r = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": prompt, "n_predict": 8}, timeout=60)
            assert r.status_code == 200, r.text
            slots.append(r.json()["id_slot"])
        # two prompts that share nothing: a slot each; the second takes the lowest free one and the
        # first's caches move to the other (batch.Batch._free_lane), where the first prompt finds them again
        assert slots == [0, 0, 1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()


class SlowDrafter(Drafter):
    """Never drafts and takes 15 ms a step: generations long enough to time and to abandon."""

    name = "slow"

    def propose(self, history, budget, max_branching=None):
        time.sleep(0.015)
        return DraftTree.empty()


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("slow") / "slow.gguf"
    write_tiny_gguf(path, context=4096, fim=True, hidden=256, layers=4, seed=1)
    session = Session(str(path), "none")
    session.engine.set_drafter(SlowDrafter())
    # this prompt runs ~900 greedy tokens before EOS: ~14 s at 15 ms a step
    session.long_prompt = "x = 1\n"
    server, thread, url = start(session)
    yield url, session
    server.should_exit = True
    thread.join(5)


def test_t_max_predict_ms_stops_generation_in_time(slow_server, monkeypatch):
    url, session = slow_server
    real = session.stream_ids

    def first_line_done(*a, **kw):  # the tiny model's bytes hold no newline: its reply gets one at
        for i, (piece, x) in enumerate(real(*a, **kw)):  # once, so the time rule alone applies
            yield ("\n" if i == 0 else "") + piece, x

    monkeypatch.setattr(session, "stream_ids", first_line_done)
    body = {"prompt": session.long_prompt, "n_predict": 2000, "t_max_predict_ms": 250}
    t0 = time.perf_counter()
    out = httpx.post(f"{url}/completion", json=body, timeout=60).json()
    wall_ms = 1e3 * (time.perf_counter() - t0)
    t = out["timings"]
    # as llama.cpp, the limit counts from the first token: a slow first pass (a cold machine
    # building its kernels) neither stops the reply at one token nor counts against the limit
    assert out["stop_type"] == "limit" and 5 < t["predicted_n"] < 200
    # it stops at the first step past 250 ms after the first token, far before the whole reply
    # (~900 tokens, ~14 s); a busy machine may slow a step or two and the HTTP hand-offs
    assert 250 <= t["predicted_ms"] <= 250 + 1500
    assert wall_ms <= t["prompt_ms"] + t["predicted_ms"] + 1000


def test_abandoned_request_frees_the_model(slow_server):
    """llama.vim cancels its request at every keystroke: the model must not go on for a client
    that is gone (the full generation here takes ~14 s)."""
    url, session = slow_server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/completion", json={"prompt": session.long_prompt, "n_predict": 2000}, timeout=0.5)
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/completion", json={"prompt": "hi", "n_predict": 2}, timeout=60)
    assert r.status_code == 200 and time.perf_counter() - t0 < 3


def test_llama_vim_sized_body_is_trimmed_to_fit(slow_server):
    """llama.vim's defaults (256 prefix lines, 64 suffix lines, 16 chunks) make far more tokens
    than the context: extra chunks go first, then the oldest prefix lines; 200, truncated.
    (This model's tokenizer has no merges: a byte is a token, so the body is ~12k tokens.)"""
    url, _ = slow_server
    line = "value = compute(alpha, beta)\n"
    body = {"input_prefix": line * 200, "input_suffix": line * 64, "prompt": "    ",
            "input_extra": [{"text": line * 12, "filename": f"f{i}.py", "time": 5} for i in range(16)],
            "n_predict": 4, "response_fields": ["content", "truncated", "tokens_evaluated"]}
    assert len(json.dumps(body)) > 12000
    r = httpx.post(f"{url}/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] is True and r.json()["tokens_evaluated"] < 4096 - 4


def test_infill_builder_keeps_the_prefix_start_while_the_window_slides(default_model):
    """Exact prefill reuse: while the editor's 256-line window slides down, the prompt keeps its
    first line, so each request shares all but its last lines with the one before."""
    tok = default_model.tokenizer
    builder = InfillBuilder(tok, None, 8192)  # llama.cpp's batch 2048: prefix <= 1536 tokens
    lines = [f"row_{i} = table[{i}] * scale + offset\n" for i in range(600)]
    prompts = []
    for cursor in range(300, 360, 3):
        p = builder.build("".join(lines[max(0, cursor - 256):cursor]), "".join(lines[cursor:cursor + 64]), [], "", 32)
        prompts.append(p.ids)
        assert p.fim is False and p.truncated and len(p.ids) <= 1536 + 1
    from cacheback_mlx.engine import common_prefix

    shared = [common_prefix(a, b) / len(b) for a, b in zip(prompts, prompts[1:])]
    assert sorted(shared)[len(shared) // 2] > 0.8  # median reuse
    assert sum(s < 0.5 for s in shared) <= len(shared) // 4  # a new start now and then


def test_prefix_only_extra_budget_keeps_the_oldest_chunks_that_fit(default_model):
    """extra_budget (prefix-only layout): at most that many tokens of extra chunks, the oldest
    first, so new chunks entering the editor's ring leave the prompt's start (and its cached KV) as
    it was; none by default; None: every chunk that fits. FIM prompts keep llama.cpp's fill. The
    chunks left out go to the drafter, each as a segment, before the suffix (learning.start_request)."""
    tok = default_model.tokenizer
    chunk = lambda i: {"text": "".join(f"def helper_{i}_{j}(x):\n    return x * {j}\n" for j in range(8)),
                       "filename": f"m{i}.py"}
    ring = [chunk(i) for i in range(6)]
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    size = len(ids(ring[0]["text"]))
    prefix, suffix = "def main():\n    total = 0\n", "\n    return total\n"
    capped = InfillBuilder(tok, None, 8192, extra_budget=int(2.5 * size))
    prompts = [tok.decode(capped.build(prefix, suffix, ring[:n], "", 32).ids) for n in range(1, 7)]
    assert "helper_1_0" in prompts[-1] and "helper_2_0" not in prompts[-1]  # two chunks fit, the oldest
    assert all(p == prompts[1] for p in prompts[2:])  # later chunks change nothing
    built = capped.build(prefix, suffix, ring, "", 32)
    assert not built.truncated  # a choice, not a full context
    assert built.context == [ids(c["text"]) for c in ring[2:]] + [ids(suffix)]
    default = InfillBuilder(tok, None, 8192).build(prefix, suffix, ring, "", 32)
    assert "helper_" not in tok.decode(default.ids) and len(default.context) == 7
    whole = InfillBuilder(tok, None, 8192, extra_budget=None).build(prefix, suffix, ring, "", 32)
    assert all(f"helper_{i}_0" in tok.decode(whole.ids) for i in range(6)) and whole.context == [ids(suffix)]
    fim = {"prefix": "<PRE>", "suffix": "<SUF>", "middle": "<MID>"}
    fim_whole = tok.decode(InfillBuilder(tok, fim, 8192, extra_budget=size).build(prefix, suffix, ring, "", 32).ids)
    assert all(f"helper_{i}_0" in fim_whole for i in range(6))


def test_prefix_only_rules_end_the_block_and_stop_before_the_suffix():
    r = CompletionRules(block=True, cursor_line="    total = ", suffix="\n    return total\n")
    assert r.cut("a + b\n") is None  # the block goes on until a blank line, a dedent or the suffix
    assert r.cut("a + b\n    return total\n") == len("a + b\n")  # repeats the line below the cursor
    assert r.cut("a + b\n    x = 1\n\n") == len("a + b\n    x = 1\n")  # a blank line ends the block
    assert r.cut("a + b\nprint(1)") == len("a + b\n")  # dedent below the block's indent
    r = CompletionRules(block=True, cursor_line="f(", suffix=")\n")
    assert r.cut("x, y)") == len("x, y")  # text after the cursor: finish the line up to it
    r = CompletionRules(n_indent=4)
    assert r.cut("a\n  b") == 2 and r.cut("a\n    b") is None  # llama.cpp's n_indent


def test_request_abandoned_while_queued_never_runs(slow_server, monkeypatch):
    """Editors send a request per keystroke and drop the last one: a request whose client left
    while it waited for the model is skipped, not run."""
    url, session = slow_server
    seen = []
    real = session.stream_ids
    monkeypatch.setattr(session, "stream_ids", lambda ids, *a, **kw: (seen.append(list(ids)), real(ids, *a, **kw))[1])
    busy = threading.Thread(target=lambda: httpx.post(f"{url}/completion", timeout=60, json={
        "prompt": session.long_prompt, "n_predict": 2000, "t_max_predict_ms": 1500}))
    busy.start()
    time.sleep(0.3)
    with pytest.raises(httpx.TimeoutException):  # queued behind `busy`, then gone
        httpx.post(f"{url}/completion", json={"prompt": "queued and abandoned", "n_predict": 50}, timeout=0.3)
    busy.join(30)
    r = httpx.post(f"{url}/completion", json={"prompt": "next", "n_predict": 2}, timeout=60)
    assert r.status_code == 200
    texts = [session.tokenizer.decode(ids) for ids in seen]
    assert not any("abandoned" in t for t in texts) and any("next" in t for t in texts)


def test_prefix_only_prompt_heals_the_last_newline(default_model):
    """On an empty cursor line the prompt stops before the prefix's last newline, so the model
    writes it merged with the next line's indentation, as in its training text; the reply is shown
    from the cursor line on."""
    builder = InfillBuilder(default_model.tokenizer, None, 8192)
    p = builder.build("def f(x):\n    y = x + 1\n", "\n    return y\n", [], "", 32)
    assert default_model.tokenizer.decode(p.ids) == "def f(x):\n    y = x + 1"
    rules = p.rules
    assert rules.visible("\n    z = y") == "    z = y"
    assert rules.visible("  # note\n    z = y") == "    z = y"  # went on with the line above first
    assert rules.visible("  # not yet a new line") == ""
    typed = builder.build("def f(x):\n", "\n", [], "    y = ", 32)  # text on the cursor line: no healing
    assert default_model.tokenizer.decode(typed.ids).endswith("def f(x):\n    y = ") and typed.rules.heal == ""


def test_a_prompt_longer_than_the_context_is_cut_from_the_left(tiny_server):
    """llama.cpp semantics: the oldest tokens go, the reply says truncated, and it is what the
    engine makes of the kept tokens (the API's truncate=True does the same cut)."""
    long = "".join(f"line {i}: the quick brown fox\n" for i in range(40))  # ~1200 byte tokens > 256
    body = {"prompt": long, "n_predict": 8, "response_fields": ["content", "truncated", "tokens_evaluated"]}
    r = httpx.post(f"{tiny_server}/completion", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["truncated"] is True
    assert r.json()["tokens_evaluated"] <= 256 - 8
    r = httpx.post(f"{tiny_server}/v1/completions", json={"prompt": long, "max_tokens": 8}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    short = httpx.post(f"{tiny_server}/completion", json={"prompt": "hi", "n_predict": 4}, headers=AUTH, timeout=60)
    assert short.json()["truncated"] is False


def test_token_limits_past_the_context_are_taken_and_the_reply_stops_where_it_ends(tiny_server):
    """Clients ask for 8,192 tokens or more (agents, long answers) whatever the model's context:
    every protocol takes any limit a 32-bit int holds, and -1 (llama.cpp, Ollama), and the reply
    ends at the end of the context (256 tokens here), as llama.cpp's and mlx-lm's servers do."""
    post = lambda path, body: httpx.post(f"{tiny_server}{path}", headers=AUTH, timeout=120, json=body)
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 256
    r = post("/v1/completions", {"prompt": "x = ", "max_tokens": 2**31 - 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 256 - 4, r.text
    for n in (-1, 100_000):
        r = post("/completion", {"prompt": "x = ", "n_predict": n})
        assert r.status_code == 200, r.text
        assert r.json()["tokens_evaluated"] + r.json()["tokens_predicted"] <= 256
    r = post("/api/generate", {"prompt": "x = ", "stream": False, "options": {"num_predict": 100_000}})
    assert r.status_code == 200 and r.json()["eval_count"] <= 256, r.text
    r = post("/v1/completions", {"prompt": "x = ", "max_tokens": 2**31})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_a_stream_asked_for_its_usage_ends_with_a_chunk_of_usage_and_no_choices(tiny_server):
    """OpenAI's protocol: with stream_options.include_usage the usage comes in a chunk of its own
    after the one with the finish reason, its choices empty (clients index choices[0] of every
    other chunk); without it the finish chunk carries the usage, as before."""
    def events(path, body):
        with httpx.stream("POST", f"{tiny_server}{path}", headers=AUTH, timeout=60, json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x = ", "max_tokens": 6,
                                                                             "stream": True})):
        asked = events(path, body | {"stream_options": {"include_usage": True}})
        assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] > 0
        assert asked[-2]["choices"][0]["finish_reason"] and "usage" not in asked[-2]
        assert all(e["choices"] and "usage" not in e for e in asked[:-1])
        plain = events(path, body)
        assert plain[-1]["choices"][0]["finish_reason"]  # the same request again (its prompt now cached)
        assert all(plain[-1]["usage"][k] == asked[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens"))


def test_the_api_cuts_only_when_asked():
    from cacheback_mlx.api import truncate_left

    assert truncate_left(list(range(10)), 100, 8) == list(range(10))
    assert truncate_left(list(range(300)), 256, 8) == list(range(52, 300))  # 248 kept + 8 to generate
    assert truncate_left(list(range(300)), 256, 1000) == list(range(108, 300))  # reply room: a quarter
    assert truncate_left([1] + list(range(300)), 256, 8, keep_first=True) == [1] + list(range(53, 300))


def test_session_truncates_only_with_the_option(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", context=128)
    s = Session(str(tmp_path / "t.gguf"), "none", fixed_budget=True)
    long = "abc " * 100
    with pytest.raises(CachebackError, match="does not fit"):
        s.generate(long, 8, chat=False)
    ids, cut = s.fit(s.encode(long, chat=False), 8)
    assert cut and len(ids) == 120
    assert s.generate(long, 8, chat=False, truncate=True) == "".join(t for t, _ in s.stream_ids(ids, 8))


def test_keep_drafter_false_gives_every_request_a_drafter_that_learned_nothing(tmp_path):
    """The editor replay's baseline: nothing carried over, not even SSD's store on disk."""
    path = tmp_path / "fim.gguf"
    write_tiny_gguf(path, context=256, fim=True)
    session = Session(str(path), "auto", ssd_path=str(tmp_path / "ssd"), fixed_budget=True)
    kept = start(session)
    body = {"prompt": "abc abc abc abc", "n_predict": 12, "temperature": 0}
    answers = [httpx.post(kept[2] + "/completion", json=body, timeout=60).json()["content"] for _ in range(2)]
    kept[0].should_exit = True
    kept[1].join(5)
    server, thread, url = start(session, keep_drafter=False)
    seen = []
    for _ in range(2):
        assert httpx.post(url + "/completion", json=body, timeout=60).json()["content"] == answers[0]
        seen.append(session.engine.drafter)
    server.should_exit = True
    thread.join(5)
    assert answers[0] == answers[1]
    assert seen[0] is not seen[1]  # a new drafter per request
    fresh = seen[1]
    assert fresh.ssd.store is None  # it neither read nor wrote the store on disk
    from cacheback_mlx.drafters.ssd_store import SsdStore
    from cacheback_mlx.drafters.suffix import SEP
    assert (SsdStore(tmp_path / "ssd", 10_000).load() == SEP).sum() == 2  # the two kept requests only
    assert fresh.scorer.bias_n == fresh.labelled  # its estimates learned from this request only


class _TimedPieces:
    """A session stand-in whose every step takes 100 ms of generation time (no model)."""

    def __init__(self, pieces):
        from cacheback_mlx.engine import Stats

        self.pieces, self.stats = pieces, Stats(prompt_tokens=3)
        self.engine = SimpleNamespace(slots=SimpleNamespace(active=0))
        self.loaded = SimpleNamespace(context_length=4096)

    def stream_ids(self, ids, max_tokens, params, context, stop=None):
        for piece in self.pieces:
            self.stats.decode_s += 0.1
            self.stats.tokens += 1
            yield piece, None


@pytest.mark.parametrize("pieces, text", [
    (["def", " f", "(x", "):", "\n", "    return", " x", "\n"], "def f(x):\n"),  # stops after the line
    (["a", "b", "c", "d", "e", "\n", "f"], "abcde\n"),  # past the budget, but the first line ends first
])
def test_t_max_predict_ms_waits_for_the_first_line_as_llama_cpp(pieces, text):
    """llama.cpp stops by time only once the reply holds a new line: an editor never gets a reply
    cut inside its first line (tools/server/server.cpp, `has_new_line`)."""
    from cacheback_mlx.server.core import Generator, Job
    from cacheback_mlx.server.fields import Sampling

    gen = Generator(_TimedPieces(pieces))
    job = Job([1, 2, 3], 100, Sampling(), t_max_predict_ms=250)
    assert "".join(gen.steps(job)) == text and job.stop_type == "limit"
    gen.worker.shutdown()


def test_metrics_count_every_generation_in_prometheus_s_format(tiny_server):
    def metrics() -> dict:
        r = httpx.get(f"{tiny_server}/metrics", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        lines = r.text.splitlines()
        assert all(line.startswith("# ") or len(line.split()) == 2 for line in lines)
        return {k: float(v) for k, v in (line.split() for line in lines if not line.startswith("#"))}

    assert httpx.get(f"{tiny_server}/metrics").status_code == 401
    before = metrics()
    runs = [httpx.post(f"{tiny_server}/completion", json={"prompt": f"def f{i}(x):", "n_predict": 12}, headers=AUTH,
                       timeout=60).json()["timings"] for i in range(3)]
    after = metrics()
    gained = lambda name: after[name] - before[name]  # noqa: E731
    assert gained("llamacpp:tokens_predicted_total") == sum(t["predicted_n"] for t in runs) > 0
    assert gained("llamacpp:prompt_tokens_total") == sum(t["prompt_n"] for t in runs)
    assert gained("llamacpp:n_decode_total") == sum(t["passes"] for t in runs)
    assert gained("llamacpp:spec_decode_num_draft_tokens_total") == sum(t["draft_n"] for t in runs)
    assert gained("llamacpp:spec_decode_num_accepted_tokens_total") == sum(t["draft_n_accepted"] for t in runs)
    assert gained("cacheback_mlx:requests_total") == 3 and after["llamacpp:requests_deferred"] == 0
    assert after["cacheback_mlx:tokens_per_pass"] == after["llamacpp:tokens_predicted_total"] / after[
        "llamacpp:n_decode_total"]


def test_tokenize_detokenize_and_the_template_as_llama_cpp_answers_them(tiny_server):
    post = lambda path, body: httpx.post(f"{tiny_server}{path}", json=body, headers=AUTH, timeout=30)  # noqa: E731
    text = "def café():"
    ids = post("/tokenize", {"content": text}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert post("/detokenize", {"tokens": ids}).json() == {"content": text}
    pieces = post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) == (
        text.encode())  # parts of a character as bytes, the rest as text
    assert any(isinstance(p["piece"], list) for p in pieces)  # this tokenizer spells "é" in two tokens
    assert post("/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    r = post("/apply-template", {"messages": [{"role": "user", "content": "hi there"}]})  # (exactly: test_tool_calls)
    assert r.status_code == 200 and "hi there" in r.json()["prompt"]
    assert post("/apply-template", {"messages": []}).status_code == 400


class FailsMidway(Session):
    """A model that fails after its first piece, once the response has started."""

    def stream_ids(self, prompt_ids, max_tokens=256, sampling=None, context=(), truncate=False, stop=None):
        for _ in super().stream_ids(prompt_ids, 1, sampling, context, truncate, stop):
            pass
        yield "Hello", []
        raise RuntimeError("the device went away")


def test_a_failure_after_the_stream_started_comes_in_each_protocol_s_own_framing(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", context=256)
    ask = [{"role": "user", "content": "hi"}]
    with serving(FailsMidway(str(tmp_path / "t.gguf"), "none")) as url:
        post = lambda path, body: httpx.post(f"{url}{path}", json=body | {"stream": True}, timeout=60).text  # noqa: E731
        lines = post("/v1/chat/completions", {"messages": ask}).splitlines()
        assert [json.loads(x[5:])["error"]["message"] for x in lines if x.startswith("data: {\"error\"")] == [
            "the device went away"] and lines[-2:] == ["data: [DONE]", ""]
        last = json.loads(post("/api/chat", {"messages": ask}).splitlines()[-1])
        assert last == {"error": "the device went away"}  # Ollama's NDJSON
        text = post("/v1/messages", {"messages": ask, "max_tokens": 8})
        assert text.startswith("event: message_start") and "event: error\ndata: " in text
        error = json.loads(text.split("event: error\ndata: ")[1].split("\n")[0])
        assert error == {"type": "error", "error": {"type": "api_error", "message": "the device went away"}}
        events = [x for x in post("/v1/responses", {"input": "hi"}).split("\n\n") if x]
        (error,) = [json.loads(x.split("data: ")[1]) for x in events if x.startswith("event: error")]
        assert error["message"] == "the device went away" and error["sequence_number"] == len(events) - 1
