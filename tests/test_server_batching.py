"""`serve --parallel N`: concurrent requests run as lanes of one batch (server/batching.py).
Every client gets what it gets alone; a client that goes away never disturbs the others; a long
prefill lets the running lanes go on between its chunks."""

import threading
import time

from cacheback_mlx.api import Session

import httpx
import pytest

from conftest import write_tiny_gguf
from test_server import start

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

PROMPTS = ["def add(a, b):", "x = [1, 2, 3]\nfor", "class Stack:\n    def", "import os\nprint(",
           "while True:", "# sum of squares\n"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The same model served one request at a time and with 3 lanes."""
    path = tmp_path_factory.mktemp("batching") / "m.gguf"
    write_tiny_gguf(path, context=2048, fim=True, seed=5, hidden=128, layers=3)
    solo = start(Session(str(path), "ngram"), parallel=1)
    lanes = start(Session(str(path), "ngram"), parallel=3)
    yield solo[2], lanes[2]
    for server, thread, _ in (solo, lanes):
        server.should_exit = True
        thread.join(5)


def ask(url, prompt, n=24, **kw):
    r = httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def together(fn, items):
    out = [None] * len(items)

    def run(i):
        out[i] = fn(items[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_clients_get_their_solo_outputs(servers):
    solo, lanes = servers
    alone = [ask(solo, p)["content"] for p in PROMPTS]
    replies = together(lambda p: ask(lanes, p), PROMPTS)  # 6 clients, 3 lanes: some wait for a lane
    assert [r["content"] for r in replies] == alone
    assert all(r["timings"]["predicted_n"] > 0 for r in replies)
    assert httpx.get(f"{lanes}/props").json()["total_slots"] == 3
    health = httpx.get(f"{lanes}/health").json()
    assert health["requests_waiting"] == 0 and health["busy"] is False


def test_every_protocol_runs_in_lanes(servers):
    solo, lanes = servers
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    want = httpx.post(f"{solo}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]
    r = httpx.post(f"{lanes}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == want
    r = httpx.post(f"{lanes}/api/generate", json={"prompt": "a = ", "stream": False,
                                                  "options": {"num_predict": 8}}, timeout=120)
    assert r.status_code == 200 and r.json()["done"] is True
    with httpx.stream("POST", f"{lanes}/v1/completions", timeout=120,
                      json={"prompt": "x = ", "max_tokens": 8, "stream": True}) as r:
        text = "".join(line for line in r.iter_lines())
    assert text.strip().endswith("data: [DONE]")
    r = httpx.post(f"{lanes}/infill", timeout=120, json={"input_prefix": "def f(", "input_suffix": "\n",
                                                        "n_predict": 0})  # an editor's warm-up
    assert r.status_code == 200


def test_stop_strings_and_sampled_completions_in_lanes(servers):
    solo, lanes = servers
    want = ask(solo, PROMPTS[0], stop=["\n"])
    got = ask(lanes, PROMPTS[0], stop=["\n"])
    assert got["content"] == want["content"] and got["stop_type"] == want["stop_type"]
    r = httpx.post(f"{lanes}/completion", timeout=120,
                   json={"prompt": PROMPTS[1], "n_predict": 8, "n_cmpl": 3, "temperature": 0.9, "seed": 4})
    assert r.status_code == 200 and len(r.json()) == 3  # three lanes side by side


def test_a_client_that_goes_away_never_disturbs_the_others(servers):
    solo, lanes = servers
    alone = [ask(solo, p, n=40)["content"] for p in PROMPTS[:2]]

    def leave():  # streams, reads its first piece, and hangs up
        with httpx.stream("POST", f"{lanes}/completion", timeout=120,
                          json={"prompt": PROMPTS[2], "n_predict": 1500, "stream": True}) as r:
            next(r.iter_lines())

    threads = [threading.Thread(target=leave)]
    threads[0].start()
    replies = together(lambda p: ask(lanes, p, n=40), PROMPTS[:2])
    threads[0].join()
    assert [r["content"] for r in replies] == alone
    t0 = time.perf_counter()
    while httpx.get(f"{lanes}/health").json()["busy"] and time.perf_counter() - t0 < 30:
        time.sleep(0.1)  # the abandoned lane leaves at the next pass
    assert httpx.get(f"{lanes}/health").json()["busy"] is False


def test_bad_requests_in_lanes_are_4xx(servers):
    _, lanes = servers
    r = httpx.post(f"{lanes}/completion", json={"prompt": "", "n_predict": 4}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{lanes}/completion", json={"prompt": [99999], "n_predict": 4}, timeout=60)
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_a_long_prefill_in_lanes_holds_no_one_hostage(tmp_path):
    """A 6,000-token prompt prefills a chunk at a time: a short request sent meanwhile is answered
    long before it ends, and the long one then finishes as it would alone."""
    from cacheback_mlx.engine import Engine

    from test_hostage import CHUNK, LONG, SlowPrefill

    path = tmp_path / "long.gguf"
    write_tiny_gguf(path, context=8192, fim=True, seed=3)
    mp = pytest.MonkeyPatch()
    mp.setattr(Engine, "prefill_chunk", CHUNK)
    try:
        session = Session(str(path), "ngram")
        session.engine.set_sizer(SlowPrefill(session.pass_cost()))
        server, thread, url = start(session, parallel=2)
        done = {}

        def long():
            done["long"] = httpx.post(f"{url}/completion", json={"prompt": LONG, "n_predict": 4}, timeout=120)
            done["long_at"] = time.perf_counter()

        t = threading.Thread(target=long)
        t0 = time.perf_counter()
        t.start()
        time.sleep(0.5)
        short = httpx.post(f"{url}/completion", json={"prompt": [9, 10, 11], "n_predict": 2}, timeout=120)
        short_at = time.perf_counter()
        t.join()
        assert short.status_code == 200 and done["long"].status_code == 200
        assert short_at - t0 < (done["long_at"] - t0) / 2  # answered while the long prefill went on
        server.should_exit = True
        thread.join(5)
    finally:
        mp.undo()
