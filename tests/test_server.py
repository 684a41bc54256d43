"""The completion server, with a real HTTP client against a running uvicorn on 127.0.0.1."""

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import write_tiny_gguf

from cacheback_mlx.api import Session
from cacheback_mlx.fim import fim_prompt
from cacheback_mlx.errors import CachebackError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(session, **kw):
    import uvicorn

    from cacheback_mlx.server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(session, **kw), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("srv") / "fim.gguf"
    write_tiny_gguf(path, context=256, fim=True)
    server, thread, url = start(Session(str(path), "ngram"), api_key="sekrit", max_body=4096)
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


def test_infill_exactly_as_llama_vim_sends_it(tiny_server):
    body = {"id_slot": 0, "input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "prompt": "    return ", "n_predict": 12, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]}
    r = httpx.post(f"{tiny_server}/infill", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["content"], str) and out["stop"] is True
    assert out["timings"]["predicted_n"] <= 12 and "prompt_n" in out["timings"] and "tokens_cached" in out


def test_streaming_infill_and_v1_completions_with_suffix(tiny_server):
    with httpx.stream("POST", f"{tiny_server}/infill", headers=AUTH, timeout=60,
                      json={"input_prefix": "a = ", "input_suffix": "\n", "n_predict": 8, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1]["stop"] is True and "timings" in events[-1]
    r = httpx.post(f"{tiny_server}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "x = ", "suffix": "\n", "max_tokens": 6})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(f"{tiny_server}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "x = ", "max_tokens": 6, "stream": True})
    assert r.text.strip().endswith("data: [DONE]")


def test_bad_requests_get_4xx_json_errors(tiny_server):
    post = lambda path, **kw: httpx.post(f"{tiny_server}{path}", headers={**AUTH, **kw.pop("headers", {})}, timeout=30, **kw)
    cases = [
        post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
        post("/v1/completions", json={"prompt": 5, "max_tokens": "many"}),
        post("/v1/completions", json={"max_tokens": 4}),
        post("/v1/completions", json={"prompt": "", "max_tokens": 4}),
        post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 4}),
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
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert "Paris" in text
        r = httpx.post(f"{url}/infill", json={"input_prefix": "def f():", "input_suffix": ""}, timeout=30)
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
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
                             "--drafter", "ngram", "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for prompt in ("hello", "world"):
            r = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": prompt, "n_predict": 8}, timeout=60)
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
