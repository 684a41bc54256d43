"""Each request's latency in a batch against its latency alone, in one process each, every run from
the same cache state: the batch's scheduling without a server's HTTP in the way, and (--trace)
how each pass's rows were shared out among the lanes (Batch.watch).

    .venv/bin/python -m tools.ab.lane_latency --seeds 330,331,332 [--clients 4] [--max-tokens 128] [--trace]

A first process runs the warm-up (tools.server_load's WARM_UP) into a cache folder; then per
seed, one process runs the sample's requests at once in a batch of --clients lanes and one process
per request runs it alone in such a batch, each on a copy of that folder (the measured pass costs,
and the store and scores after the warm-up), so no run drafts from another's answers. The sample is
tools.batch_bench's (Spec-Bench first turns and HumanEval prompts, alternating). Greedy; every
request's tokens must be the same in the batch as alone. Time is from the batch's first step to the
request's last token.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from tools.server_load import WARM_UP, copy_cache, measured_costs


def run(seed: int, mode: str, clients: int, max_tokens: int, trace: bool) -> dict:
    """In this process (its XDG_CACHE_HOME set by the caller): the sample's requests at once
    (mode "batch"), or request k alone (mode "k"), or the warm-up only (mode "warm")."""
    import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)
    from cacheback_mlx.api import Session

    from tools.batch_bench import sample

    session = Session(None, "auto")
    session.generate_batch(WARM_UP, 8, lanes=clients)
    if mode == "warm":
        session.reset_batch()  # its lanes' drafters keep what they learned in the folder
        return {}
    ids = [session.encode(p.turns[0], chat=p.chat) for p in sample(clients, seed)]
    ids = ids if mode == "batch" else [ids[int(mode)]]
    batch, passes = session.batch(clients), []
    if trace:
        batch.watch(lambda e: passes.append([round(e.seconds, 3), e.chunk] + [
            [x.index, x.offered, round(x.expected, 2), x.sent, x.weight and round(x.weight, 2), x.produced]
            for x in e.lanes]))
    t0 = time.perf_counter()
    running = {k: batch.join(prompt=p, max_tokens=max_tokens) for k, p in enumerate(ids)}
    done = {}
    while running:
        batch.step()
        for k, lane in list(running.items()):
            if lane.done:
                done[k] = {"seconds": time.perf_counter() - t0, "tokens": lane.tokens, "passes": lane.stats.passes,
                           "lane": lane.index}
                del running[k]
    session.reset_batch()
    return {"requests": [done[k] for k in sorted(done)], "passes": passes}


def spawn(cache: Path | str, seed: int, mode: str, clients: int, max_tokens: int, trace: bool) -> dict:
    cmd = [sys.executable, "-m", "tools.ab.lane_latency", "--run", f"{seed}:{mode}", "--clients", str(clients),
           "--max-tokens", str(max_tokens)] + (["--trace"] if trace else [])
    out = subprocess.run(cmd, env={**os.environ, "XDG_CACHE_HOME": str(cache)}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{mode} run of seed {seed} failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--seeds", default="330")
@click.option("--clients", default=4, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--trace", is_flag=True, help="print every pass of the batch runs: its seconds, the riding chunk's "
              "rows, and per lane [lane, drafts offered, their expected tokens, drafts sent, weight, tokens produced]")
@click.option("--costs", default=None, help="a cache folder whose measured pass costs every run starts with "
              "(XDG_CACHE_HOME=DIR cacheback-mlx bench --verify-cost), as tools.server_load's --costs")
@click.option("--run", "one", default=None, hidden=True)
def main(seeds: str, clients: int, max_tokens: int, trace: bool, costs: str | None, one: str | None) -> None:
    if one is not None:  # a child process
        seed, mode = one.split(":")
        print(json.dumps(run(int(seed), mode, clients, max_tokens, trace)))
        return
    work = Path(tempfile.mkdtemp(prefix="lane_latency_"))
    try:
        base = work / "base"
        if costs:
            shutil.copytree(measured_costs(costs), base / "cacheback-mlx" / "verify-cost")
        spawn(base, 0, "warm", clients, max_tokens, False)

        print("| seed | aggregate tok/s | in the batch / alone, per request | median | worst | passes, batch / alone |")
        print("|---:|---:|---|---:|---:|---|")
        for seed in [int(s) for s in seeds.split(",")]:
            loaded = spawn(copy_cache(base, work), seed, "batch", clients, max_tokens, trace)
            alone = [spawn(copy_cache(base, work), seed, str(k), clients, max_tokens, False)["requests"][0]
                     for k in range(len(loaded["requests"]))]
            reqs = loaded["requests"]
            for k, (a, b) in enumerate(zip(reqs, alone)):
                if a["tokens"] != b["tokens"]:
                    raise SystemExit(f"seed {seed}, request {k}: its tokens in the batch differ from alone")
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(reqs, alone)]
            total = sum(len(a["tokens"]) for a in reqs) / max(a["seconds"] for a in reqs)
            print(f"| {seed} | {total:.1f} | {' / '.join(f'{r:.2f}x' for r in ratios)} | "
                  f"{statistics.median(ratios):.2f}x | {max(ratios):.2f}x | "
                  f"{' / '.join(str(a['passes']) + '-' + str(b['passes']) for a, b in zip(reqs, alone))} |", flush=True)
            if trace:
                print(f"\nseed {seed}, the batch's passes: [seconds, chunk rows, [lane, offered, expected, sent, "
                      f"weight, produced]...]; requests by lane: {[a['lane'] for a in reqs]}")
                for p in loaded["passes"]:
                    print(json.dumps(p))
                print()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
