"""An abuse run against `cacheback-mlx serve`: bad bodies, wrong types, huge and negative sizes,
over-long prompts, invalid Unicode, abandoned requests and concurrent streams, all at once, while
well-formed greedy requests run among them. Prints the status codes seen, any 5xx or hang, and
whether every well-formed answer equals its solo run (sent alone first).

    .venv/bin/python -m tools.abuse_run [--model M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

EXE = str(Path(sys.executable).with_name("cacheback-mlx"))
GOOD = [("/completion", {"prompt": "def add(a, b):", "n_predict": 24}),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16, "model": "m"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24}),
        ("/infill", {"input_prefix": "def mul(a, b):\n", "input_suffix": "\n", "prompt": "    ", "n_predict": 16}),
        ("/api/generate", {"model": "m", "prompt": "Count to five:", "stream": False, "options": {"num_predict": 16}})]
BAD = [b"{", b"[]", b"null", b"not json", b'{"prompt": 5}', b'{"prompt": "x", "n_predict": "many"}',
       b'{"prompt": "x", "n_predict": 1000000000}', b'{"prompt": "x", "n_predict": -5}',
       b'{"prompt": "x", "seed": 18446744073709551616}', b'{"prompt": "x", "temperature": -1}',
       b'{"prompt": "\\ud800"}', b'{"prompt": "\xff\xfe"}', b'{"messages": "hi"}', b'{"messages": [{"role": 3}]}',
       b'{"input_prefix": "", "input_suffix": "", "n_predict": 0, "input_extra": [{"text": 7}]}']
PATHS = ["/completion", "/infill", "/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat"]


def text_of(path: str, r: httpx.Response) -> str:
    d = r.json()
    if path in ("/completion", "/infill"):
        return d["content"]
    if path == "/v1/completions":
        return d["choices"][0]["text"]
    if path == "/v1/chat/completions":
        return d["choices"][0]["message"]["content"]
    return d["response"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(prefix="cb-abuse-")
    cmd = [EXE, "serve", "--port", str(port)] + (["--model", a.model] if a.model else [])
    proc = subprocess.Popen(cmd, env={**os.environ, "XDG_CACHE_HOME": cache}, stderr=subprocess.PIPE, text=True)
    codes: collections.Counter = collections.Counter()
    problems: list[str] = []
    unanswered: list[str] = []
    try:
        up = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < up:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).is_success:
                    break
            time.sleep(0.2)
        solo = {p: text_of(p, httpx.post(url + p, json=b, timeout=120)) for p, b in GOOD}

        def good(p, b):
            r = httpx.post(url + p, json=b, timeout=300)
            codes[r.status_code] += 1
            if r.status_code != 200 or text_of(p, r) != solo[p]:
                problems.append(f"{p}: {r.status_code} {r.text[:120]!r} differs from its solo run")

        def bad(p, body):
            try:
                r = httpx.post(url + p, content=body, headers={"Content-Type": "application/json"}, timeout=120)
            except httpx.TimeoutException:  # a valid request without a limit generates on: abandoned
                codes["no answer in 120 s, abandoned"] += 1
                unanswered.append(f"{p} {body.decode(errors='replace')}")
                return
            codes[r.status_code] += 1
            if r.status_code >= 500:
                problems.append(f"{p} {body[:40]!r}: {r.status_code} {r.text[:120]!r}")

        def abandoned(p):
            try:
                httpx.post(url + p, json={"prompt": "x = 1\n" * 9000, "n_predict": 4, "messages": [
                    {"role": "user", "content": "x = 1\n" * 9000}]}, timeout=0.5)
            except httpx.TimeoutException:
                codes["abandoned"] += 1

        def stream(p, b):
            with httpx.stream("POST", url + p, json={**b, "stream": True}, timeout=300) as r:
                codes[r.status_code] += 1
                for _ in r.iter_lines():
                    pass

        t0 = time.perf_counter()
        for _ in range(a.rounds):
            jobs = ([threading.Thread(target=good, args=gb) for gb in GOOD]
                    + [threading.Thread(target=bad, args=(p, body)) for p in PATHS for body in BAD]
                    + [threading.Thread(target=abandoned, args=(p,)) for p in ("/completion", "/v1/chat/completions")]
                    + [threading.Thread(target=stream, args=gb) for gb in GOOD[:3]])
            for j in jobs:
                j.start()
            for j in jobs:
                j.join(600)
                if j.is_alive():
                    problems.append("a request hung for 10 minutes")
        seconds = time.perf_counter() - t0
        alive = httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({"status codes": {str(k): v for k, v in sorted(codes.items(), key=str)},
                      "5xx or differing answers": problems, "abandoned after 120 s": sorted(set(unanswered)),
                      "seconds": round(seconds, 1),
                      "healthy after": alive}, indent=1))
    return 1 if problems or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
