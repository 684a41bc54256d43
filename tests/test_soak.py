"""The server under load: 8 concurrent clients on 127.0.0.1, mixed streaming and non-streaming
/infill, /completion and /v1/chat/completions requests, and clients that hang up mid-stream.
No 5xx, no crash, no hang, every greedy answer identical to the same request served alone, and
resident memory flat after warm-up.

The normal run has a short version (~20 s); the 10-minute soak is marked `soak` and deselected by
default: `.venv/bin/python -m pytest -m soak -s tests/test_soak.py` (it prints its figures).
"""

import json
import os
import random
import threading
import time

from cacheback_mlx.api import Session

import httpx
import pytest

from conftest import write_tiny_gguf
from test_server import start

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

CLIENTS = 8

REQUESTS = [
    ("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 12,
                 "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n",
                                  "time": [1, 2]}]}),
    ("/infill", {"input_prefix": "for i in range(10):\n    ", "input_suffix": "", "n_predict": 10}),
    ("/completion", {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown", "n_predict": 16}),
    ("/completion", {"prompt": "abc abc abc abc", "n_predict": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello twice."}], "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Count to five."}], "max_tokens": 14}),
]


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def content(path: str, body: dict, stream: bool, client: httpx.Client) -> tuple[int, str]:
    """Status and the answer's text, from a plain or a streamed (SSE) response."""
    body = {**body, "stream": stream, "temperature": 0}
    if not stream:
        r = client.post(path, json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code, r.text
        data = r.json()
        return 200, data["choices"][0]["message"]["content"] if "choices" in data else data["content"]
    text = ""
    with client.stream("POST", path, json=body, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "choices" in event:
                text += event["choices"][0].get("delta", {}).get("content") or ""
            else:
                text += event.get("content", "")
    return 200, text


def hang_up(path: str, body: dict, client: httpx.Client) -> int:
    """Open a stream, read its first bytes, and go away."""
    with client.stream("POST", path, json={**body, "stream": True, "n_predict": 64, "max_tokens": 64},
                       timeout=120) as r:
        for _ in r.iter_raw():
            break
        return r.status_code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("soak") / "fim.gguf"
    write_tiny_gguf(path, context=512, fim=True)
    # SSD's buffer grows until it holds `capacity` tokens (4M by default, ~80 MB with its index):
    # a small one is full within the warm-up, so whatever grows after it is a leak
    srv, thread, url = start(Session(str(path), "auto", ssd_path=str(path.parent / "ssd"), ssd_capacity=20_000))
    yield url
    srv.should_exit = True
    thread.join(10)


def soak(url: str, seconds: float) -> dict:
    with httpx.Client(base_url=url) as c:  # every request once, alone: the expected answers
        alone = {i: content(p, b, False, c) for i, (p, b) in enumerate(REQUESTS)}
    assert all(status == 200 for status, _ in alone.values()), alone
    errors, counts, lock = [], {"ok": 0, "hung_up": 0}, threading.Lock()
    memory = []
    deadline = time.monotonic() + seconds
    warm = time.monotonic() + min(10.0, seconds / 4)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url) as c:
            while time.monotonic() < deadline:  # bounded: each request has its own timeout
                i = rng.randrange(len(REQUESTS))
                path, body = REQUESTS[i]
                try:
                    if rng.random() < 0.15:
                        status = hang_up(path, body, c)
                        with lock:
                            counts["hung_up"] += 1
                        if status >= 500:
                            errors.append((path, status, "hang-up"))
                        continue
                    status, text = content(path, body, rng.random() < 0.5, c)
                except httpx.HTTPError as e:
                    errors.append((path, "transport", repr(e)))
                    continue
                if status >= 500 or status != 200:
                    errors.append((path, status, text[:200]))
                elif text != alone[i][1]:
                    errors.append((path, "differs", text, alone[i][1]))
                with lock:
                    counts["ok"] += 1

    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(CLIENTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if time.monotonic() > warm:
            memory.append(rss_mb())
    for t in threads:
        t.join(timeout=130)
        assert not t.is_alive(), "a client hung"
    with httpx.Client(base_url=url) as c:  # the server still answers, and still the same
        assert content(*REQUESTS[0], False, c) == alone[0]
    return {"errors": errors, **counts, "rss_first_mb": memory[0] if memory else 0.0,
            "rss_last_mb": memory[-1] if memory else 0.0, "rss_max_mb": max(memory, default=0.0)}


def check(result: dict, growth_mb: float) -> None:
    assert not result["errors"], result["errors"][:5]
    assert result["ok"] > 0 and result["hung_up"] > 0
    assert result["rss_last_mb"] - result["rss_first_mb"] < growth_mb, result


def test_short_soak(server):
    check(soak(server, 12.0), growth_mb=60)


@pytest.mark.soak
def test_ten_minute_soak(server):
    t0 = time.monotonic()
    result = soak(server, 600.0)
    print(f"\nsoak: {time.monotonic() - t0:.0f} s, {result['ok']} answers, {result['hung_up']} hang-ups, "
          f"{len(result['errors'])} errors, RSS {result['rss_first_mb']:.0f} MB after warm-up -> "
          f"{result['rss_last_mb']:.0f} MB at the end (max {result['rss_max_mb']:.0f} MB)")
    check(result, growth_mb=40)
