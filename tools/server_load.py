"""Concurrent clients against a server: ours (`serve --parallel N`, `auto` and `none`) and mlx-lm's
(`mlx_lm.server` on the same weights exported as a folder, `--decode-concurrency 8`), one server
at a time on this machine.

    .venv/bin/python -m tools.server_load --clients 1,2,4,8 --max-tokens 128 --seeds 301,302,303

Each client sends one chat completion (greedy) at the same moment: a Spec-Bench first turn or a
HumanEval prompt (a seeded sample, alternating); with `--rounds K`, K of them one after another
(a steady load at a fixed concurrency); with `--kind infill`, llama.vim's /infill requests on
click's core.py instead (our servers only); with `--vs-solo`, each request again alone (every
server starting from the same state); with `--costs DIR`, each of our servers starts with the pass
costs measured into the cache folder DIR (`XDG_CACHE_HOME=DIR cacheback-mlx bench --verify-cost`),
as a server does that has run on this machine before or been idle a while (a fresh server prices
passes from a fitted line until it measures its table when idle, which a run of this tool never
leaves it). `--servers` names ours by drafter, with its parameters if any ("ours auto:scores=true").
With `--temperature T [--top-p P]` the chat completions are sampled, each with a seed made from its
text for our servers (so ours give the same text with any drafter); mlx-lm's server gets no seed, as
it runs a seeded request alone, outside its batch.
Per server and client count: aggregate completion
tokens per second (all clients' tokens / wall time until the last answer), median and worst
latency, and whether every answer equals mlx-lm's server's (sampled, or without it: ours `none`'s),
text for text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import httpx

from tools.batch_bench import prompt_texts  # the same prompt sample as batch_bench

EXE = str(Path(sys.executable).with_name("cacheback-mlx"))
WARM_UP = ["Say hello.", "Count to three."]  # every server's first requests, before any is timed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, folder: Path, port: int, parallel: int, cache: str) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    if kind == "mlx-lm":
        # cacheback_mlx first: MLX's CPU matmuls then run on OpenBLAS, as ours do (blas.py)
        cmd = [sys.executable, "-c", "import sys, cacheback_mlx; from mlx_lm.server import main; sys.argv[0] = "
               "'mlx_lm.server'; main()", "--model", str(folder), "--port", str(port),
               "--decode-concurrency", "8", "--prompt-concurrency", "8"]
        env.pop("XDG_CACHE_HOME")
    else:
        drafter, *args = kind.split()[1].split(":")  # "ours auto:scores=true": --drafter-arg scores=true
        cmd = [EXE, "serve", "--port", str(port), "--drafter", drafter, "--parallel", str(parallel)]
        cmd += [x for arg in args for x in ("--drafter-arg", arg)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < seconds:
        if proc.poll() is not None:
            raise SystemExit(f"server ended: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not ready")


SAMPLING = {"temperature": 0.0}  # what every chat completion asks for (--temperature, --top-p)
OURS = "default"  # the model name requests to our servers give (mlx-lm's server: the folder it loads)


def chat(url: str, text: str, max_tokens: int, model: str) -> tuple[str, int, float, int]:
    """(the answer, its tokens, seconds, the prompt's tokens)."""
    t0 = time.perf_counter()
    sampling = dict(SAMPLING)
    if sampling["temperature"] > 0 and model == OURS:  # ours (mlx-lm's server runs a seeded request
        sampling["seed"] = zlib.crc32(text.encode())  # alone, outside its batch: it gets none)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=1200,
                   json={"model": model, "messages": [{"role": "user", "content": text}],
                         "max_tokens": max_tokens, **sampling})
    r.raise_for_status()
    body = r.json()
    return (body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"], time.perf_counter() - t0,
            body["usage"]["prompt_tokens"])


def infill_bodies(n: int, seed: int) -> list[dict]:
    """n llama.vim completion bodies (tools/editor/replay.fim_body), each with the cursor at the start
    of a line of click's core.py that is cut out (about to be typed); a seeded sample of lines."""
    from tools.editor.replay import default_file, fim_body

    doc = default_file().read_text().splitlines()
    rng = random.Random(seed)
    lines = rng.sample([y for y, line in enumerate(doc) if line.strip() and y > 20], n)
    return [fim_body(doc[:y] + [""] + doc[y + 1:], y, [], 600_000) for y in lines]


def infill(url: str, body: dict, max_tokens: int, model: str) -> tuple[str, int, float, int]:
    """llama.vim's request (its response_fields), greedy and with no time limit: (the completion, its tokens, seconds,
    the prompt's tokens)."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/infill", timeout=1200,
                   json={**body, "n_predict": max_tokens, "temperature": 0.0, "t_max_prompt_ms": 600_000})
    r.raise_for_status()
    out = r.json()
    return out["content"], out["timings/predicted_n"], time.perf_counter() - t0, out["tokens_evaluated"]


def clients(url: str, texts: list, max_tokens: int, model: str, n: int | None = None) -> tuple[list, float]:
    """n clients (default: one per text) at once, each sending its texts (i, i + n, ...) one after
    another, the next when the last is answered; (every answer in text order, the wall time)."""
    n = n or len(texts)
    out = [None] * len(texts)

    def client(i: int) -> None:
        for k in range(i, len(texts), n):
            send = infill if isinstance(texts[k], dict) else chat
            out[k] = send(url, texts[k], max_tokens, model)

    failed = []

    def run(i: int) -> None:
        try:
            client(i)
        except Exception as e:  # noqa: BLE001 - reported once the other clients are done
            failed.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise SystemExit(f"a client's request failed: {type(failed[0]).__name__}: {failed[0]}")
    return out, time.perf_counter() - t0


def measured_costs(costs: str) -> Path:
    """The measured pass costs in the cache folder `costs` (--costs); a one-line exit if none."""
    measured = Path(costs) / "cacheback-mlx" / "verify-cost"
    if not measured.is_dir() or not any(measured.glob("*.json")):
        raise SystemExit(f"--costs {costs}: no measured pass costs in it (run XDG_CACHE_HOME={costs} "
                         "cacheback-mlx bench --verify-cost first)")
    return measured


def new_cache(work: Path, costs: str | None) -> str:
    """An empty cache folder for a server, holding only the pass costs measured into the cache
    folder `costs` (None: nothing, as on a fresh machine)."""
    folder = tempfile.mkdtemp(dir=work)
    if costs:
        shutil.copytree(measured_costs(costs), Path(folder) / "cacheback-mlx" / "verify-cost")
    return folder


def copy_cache(base: str, work: Path) -> str:
    """A new cache folder holding what `base` holds: a server's measured pass costs, and the store
    and scores its drafters kept after the warm-up. With --vs-solo every server starts from it, so
    a request alone drafts from what it would have under load (alone one after another on one
    server, a request would draft from the answers of the sample's other requests, which under
    load run beside it, unseen)."""
    folder = Path(tempfile.mkdtemp(dir=work)) / "cache"
    shutil.copytree(base, folder)
    return str(folder)


@contextlib.contextmanager
def serving(kind: str, folder: Path, port: int, parallel: int, cache: str):
    """A server of `kind` launched, ready and warmed up; the model name its requests give."""
    proc = launch(kind, folder, port, parallel, cache)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        model = str(folder) if kind == "mlx-lm" else OURS  # mlx-lm's server loads the model named
        clients(url, WARM_UP, 8, model)
        yield model
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seeds", default="301")
    ap.add_argument("--servers", default="ours auto,ours none,mlx-lm")
    ap.add_argument("--parallel", type=int, default=0, help="our lanes (0: as many as the most clients)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="requests each client sends one after another (1: the clients' requests all start at once "
                         "and the run ends with the slowest; more: a steady load, as serving benchmarks at a fixed "
                         "concurrency run it)")
    ap.add_argument("--kind", choices=["chat", "infill"], default="chat",
                    help="chat: chat completions; infill: llama.vim's /infill requests on click's core.py (our "
                         "servers only: mlx-lm's has no /infill)")
    ap.add_argument("--costs", default=None, help="a cache folder whose measured pass costs each of our servers "
                    "starts with (default: none, as a fresh server)")
    ap.add_argument("--dump", default=None, help="write every answer's text here (JSON)")
    ap.add_argument("--vs-solo", action="store_true",
                    help="run each sample on a server of its own, then send each of its requests alone to a server "
                         "of its own, every server starting from the same state (copy_cache), and report each "
                         "request's latency under load against its latency alone")
    ap.add_argument("--temperature", type=float, default=0.0, help="chat: sample at this temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="chat, with --temperature: top-p")
    args = ap.parse_args(argv)
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.temperature > 0 and args.kind != "chat":
        raise SystemExit("--temperature: chat completions only")
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)
    if args.costs:
        measured_costs(args.costs)  # before any server runs
    counts = [int(c) for c in args.clients.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    parallel = args.parallel or max(counts)
    work = Path(tempfile.mkdtemp(prefix="server_load_"))
    from tools.dist_bench import export_default

    folder = export_default(work / "model")
    if args.kind == "infill" and "mlx-lm" in args.servers.split(","):
        raise SystemExit("mlx-lm's server has no /infill: pass --servers 'ours auto,ours none'")
    sample = prompt_texts if args.kind == "chat" else infill_bodies
    samples = {(c, s): sample(c * args.rounds, s) for c in counts for s in seeds}
    results: dict[str, dict] = {}
    solo: dict = {}  # (server, (clients, seed)) -> each request's answer sent alone
    for kind in args.servers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if not args.vs_solo:  # one server for every sample
            with serving(kind, folder, port, parallel, new_cache(work, args.costs)) as model:
                for key, texts in samples.items():
                    results.setdefault(kind, {})[key] = clients(url, texts, args.max_tokens, model, key[0])
            continue
        base = new_cache(work, args.costs)
        with serving(kind, folder, port, parallel, base):
            pass  # measured pass costs, and the warm-up's store and scores: where every server below starts
        for key, texts in samples.items():
            with serving(kind, folder, port, parallel, copy_cache(base, work)) as model:
                results.setdefault(kind, {})[key] = clients(url, texts, args.max_tokens, model, key[0])
            solo[(kind, key)] = []
            for t in texts:
                with serving(kind, folder, port, parallel, copy_cache(base, work)) as model:
                    solo[(kind, key)].append(clients(url, [t], args.max_tokens, model)[0][0])
    if args.dump:
        answers = {f"{k}|{c}|{s}": [(o[0], o[3], o[1], round(o[2], 3)) for o in outs]  # (text, prompt tokens,
                   for k, runs in results.items() for (c, s), (outs, _) in runs.items()}  # tokens, seconds)
        answers.update({f"{k} alone|{c}|{s}": [(o[0], o[3], o[1], round(o[2], 3)) for o in outs]
                        for (k, (c, s)), outs in solo.items()})
        Path(args.dump).write_text(json.dumps(answers, indent=1))
    # sampled: mlx-lm's server draws its own text (unseeded), so ours are checked against ours `none`
    ref_name = "mlx-lm" if "mlx-lm" in results and not SAMPLING["temperature"] else "ours none"
    ref = results.get(ref_name, {})
    print(f"lanes (ours): {parallel}; max_tokens {args.max_tokens}; requests per client: {args.rounds}")
    print(f"| server | clients | seed | aggregate tok/s | median latency s | worst latency s | same as {ref_name} |")
    print("|---|---|---|---|---|---|---|")
    summary: dict = {}
    for kind, runs in results.items():
        for (c, s), (outs, wall) in runs.items():
            tokens = sum(o[1] for o in outs)
            lat = [o[2] for o in outs]
            same = [o[0] for o in outs] == [o[0] for o in ref[(c, s)][0]] if (c, s) in ref else "-"
            summary.setdefault((kind, c), []).append(tokens / wall)
            print(f"| {kind} | {c} | {s} | {tokens / wall:.1f} | {statistics.median(lat):.1f} | {max(lat):.1f} "
                  f"| {same} |")
    if solo:
        print("\n| server | clients | seed | latency under load / alone: median | worst | answers as alone |")
        print("|---|---|---|---|---|---|")
        for (kind, (c, s)), alone in solo.items():
            ratios = [o[2] / a[2] for o, a in zip(results[kind][(c, s)][0], alone)]
            same = [o[0] for o in results[kind][(c, s)][0]] == [a[0] for a in alone]
            print(f"| {kind} | {c} | {s} | {statistics.median(ratios):.2f}x | {max(ratios):.2f}x | {same} |")
    for c in counts:
        line = [f"{kind} {statistics.mean(summary[(kind, c)]):.1f}" for kind in results]
        if "mlx-lm" in results and "ours auto" in results:
            r = [a / b for a, b in zip(summary[("ours auto", c)], summary[("mlx-lm", c)])]
            line.append(f"auto/mlx-lm {statistics.mean(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
        print(f"{c} clients: " + ", ".join(line))
    print(json.dumps({f"{k}|{c}": v for (k, c), v in summary.items()}))


if __name__ == "__main__":
    main()
