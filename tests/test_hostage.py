"""No request holds the server hostage: a prefill stops within one chunk when its client goes
away or the server stops, and lets waiting requests go first between its chunks; the chunks done
stay cached for a retry; editors' warm-ups work as a fresh server's first request."""

import os
import signal
import subprocess
import sys
import threading
import time

from cacheback_mlx.api import Session
from cacheback_mlx.budget import Sizer
from cacheback_mlx.engine import Engine

import httpx
import pytest

from conftest import write_tiny_gguf
from test_server import free_port, start, wait_for_health

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

LONG = [5, 6, 7, 8] * 1500  # 6,000 prompt tokens
CHUNK = 64
CHUNK_S = 0.05


class SlowPrefill(Sizer):
    """A sizer that also makes every prefill chunk take CHUNK_S longer: a 6,000-token prefill
    takes ~5 s on a model that would do it in well under a second."""

    def prefilled(self, rows, context, seconds):
        time.sleep(CHUNK_S)
        super().prefilled(rows, context, seconds)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostage") / "long.gguf"
    write_tiny_gguf(path, context=8192, fim=True, seed=3)
    mp = pytest.MonkeyPatch()
    mp.setattr(Engine, "prefill_chunk", CHUNK)
    session = Session(str(path), "ngram")
    session.engine.set_sizer(SlowPrefill(session.pass_cost()))
    server, thread, url = start(session)
    yield url, session
    server.should_exit = True
    thread.join(5)
    mp.undo()


def completion(url, prompt, n=4, timeout=60, **kw):
    return httpx.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n, **kw}, timeout=timeout)


def test_an_abandoned_prefill_frees_the_model_and_a_retry_goes_on_from_its_chunks(long_server):
    url, session = long_server
    with pytest.raises(httpx.TimeoutException):
        completion(url, LONG, timeout=1.0)
    t0 = time.perf_counter()
    r = completion(url, [9, 10, 11], n=2)
    assert r.status_code == 200 and time.perf_counter() - t0 < 1.5  # the whole prefill: ~5 s
    done = max(len(s.cached) for s in session.engine.slots.slots if s is not None)
    assert CHUNK <= done < len(LONG) - 10 * CHUNK  # it stopped, keeping what it did
    r = completion(url, LONG)
    assert r.status_code == 200 and r.json()["timings"]["cache_n"] >= done - CHUNK


def test_a_short_request_goes_between_the_chunks_of_a_long_one(long_server):
    url, session = long_server
    prompt = [7, 8, 9, 5] * 1500  # shares nothing with the other tests' prompts
    solo = Session(session.loaded, "none", fixed_budget=True)
    expected = "".join(text for text, _ in solo.stream_ids(prompt, 8))
    ends = {}

    def long():
        r = completion(url, prompt, n=8)
        ends["long"] = (time.perf_counter(), r.json()["content"])

    t = threading.Thread(target=long)
    t.start()
    time.sleep(0.8)
    r = completion(url, [12, 13, 14], n=2)
    ends["short"] = time.perf_counter()
    t.join(60)
    assert r.status_code == 200 and ends["short"] < ends["long"][0] - 1.0
    assert ends["long"][1] == expected  # the long one, interrupted and resumed, answers the same


def test_health_reports_the_queue(long_server):
    url, _ = long_server
    h = httpx.get(f"{url}/health", timeout=5).json()
    assert h["status"] == "ok" and h["requests_waiting"] == 0 and h["busy"] is False


@pytest.mark.parametrize("fim", [True, False])
def test_llama_vim_warm_up_as_the_first_request(tmp_path, fim):
    path = tmp_path / "warm.gguf"
    write_tiny_gguf(path, context=2048, fim=fim)
    server, thread, url = start(Session(str(path), "ngram"))
    try:
        r = httpx.post(f"{url}/infill", json={"input_prefix": "", "input_suffix": "", "n_predict": 8}, timeout=60)
        assert r.status_code == 200 if fim else "nothing to complete" in r.json()["error"]["message"]
        chunk = {"text": "".join(f"line_{i} = {i}\n" for i in range(32)), "filename": "a.py", "time": 1}
        r = httpx.post(f"{url}/infill", json={"input_prefix": "", "input_suffix": "", "input_extra": [chunk],
                                              "n_predict": 0}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/infill", json={"input_prefix": "x = 1\n", "input_suffix": "", "input_extra": [chunk],
                                              "prompt": "y", "n_predict": 4}, timeout=60)
        assert r.status_code == 200, r.text
        if fim:  # the chunk leads a FIM prompt: the warm-up prefilled it
            assert r.json()["timings"]["cache_n"] >= 32 * 4
    finally:
        server.should_exit = True
        thread.join(5)


def test_a_seed_is_validated_the_same_way_streaming_or_not(long_server):
    url, _ = long_server
    for stream in (False, True):
        r = completion(url, [9, 10], n=2, seed=1 << 64, stream=stream)
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
        r = completion(url, [9, 10], n=2, seed=(1 << 64) - 1, temperature=0.5, stream=stream)
        assert r.status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_long_prefill_ends_serve(tmp_path, sig):
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "cacheback_mlx.cli", "serve",
                             "--model", "random:smollm2-135m:layers=4",
                             "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url)
        assert completion(url, "hello there", n=8).status_code == 200  # one request into the SSD store
        threading.Thread(target=lambda: completion(url, [100 + i % 500 for i in range(7000)], timeout=120),
                         daemon=True).start()
        time.sleep(2.0)
        assert httpx.get(f"{url}/health", timeout=5).json()["busy"]
        t0 = time.perf_counter()
        proc.send_signal(sig)
        proc.wait(20)
        assert time.perf_counter() - t0 < 5
    finally:
        proc.kill()
    from cacheback_mlx.drafters.ssd_store import SsdStore

    stores = [p.parent for p in tmp_path.rglob("log-*.bin")] + [p.parent for p in tmp_path.rglob("base.npz")]
    assert stores and all(len(SsdStore(folder, 1 << 20).load()) > 0 for folder in set(stores))
