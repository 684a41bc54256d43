"""A fresh machine's first runs: no calibration pause, processes that share the cores.

    .venv/bin/python -m tools.startup_bench [--parts ttft,processes,first,load] [--seeds 201,202,203]
        [--load default,folder:random:llama-3.2-1b:q4:bf16:vocab=49152]

Every part runs in new cache folders (XDG_CACHE_HOME), so nothing is known of pass costs:
- ttft: the README's generate command, time from launch to its first output byte and to its end,
  on a fresh cache and then on the same cache warm (three fresh folders).
- processes: 1, 2 and 4 processes started together on one fresh cache, each a 32-token generate:
  wall time of each, and which cost file they leave (kind, how many passes it was learned from).
- first: the first requests of a fresh machine, `auto` on the prior it learns as it goes vs
  `auto` on a table measured beforehand vs `none`, interleaved per request, per seed (a seeded
  Spec-Bench sample, one prompt per category); greedy outputs must agree.
- load: loader.load(MODEL, "float32") in a fresh process, three times per model (`default`: the
  embedded model; `folder:SPEC`: a `random:` model written first as a quantized mlx-lm folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python class for a stack with push, pop and peek methods."
EXE = str(Path(sys.executable).with_name("cacheback-mlx"))


def launch(cache: str, max_tokens: int) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    return subprocess.Popen([EXE, "generate", PROMPT, "--max-tokens", str(max_tokens)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def first_byte(cache: str, max_tokens: int = 64) -> tuple[float, float, str]:
    """(seconds to the first output byte, seconds to the end, stderr)."""
    t0 = time.perf_counter()
    p = launch(cache, max_tokens)
    p.stdout.read(1)
    first = time.perf_counter() - t0
    p.stdout.read()
    err = p.stderr.read().decode()
    p.wait()
    return first, time.perf_counter() - t0, err


def cost_files(cache: str) -> list[str]:
    folder = Path(cache) / "cacheback-mlx" / "verify-cost"
    out = []
    for f in sorted(folder.glob("*.json")):
        d = json.loads(f.read_text())
        out.append(f"{d.get('kind')} ({d.get('seen', '-')} passes)")
    return out


def part_ttft() -> None:
    print("## time to first token (README command, 64 tokens)\n\n"
          "| cache | first byte s | total s | 'measuring' printed |\n|---|---:|---:|---|")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as cache:
            for label in ("fresh", "warm"):
                first, total, err = first_byte(cache)
                print(f"| {label} | {first:.2f} | {total:.2f} | {'yes' if 'measuring' in err else 'no'} |", flush=True)


def part_processes() -> None:
    print("\n## processes started together on a fresh cache (32 tokens each)\n\n"
          "| processes | wall s, each | slowest / alone | cost files left |\n|---:|---|---:|---|")
    alone = None
    for n in (1, 2, 4):
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            procs = [launch(cache, 32) for _ in range(n)]
            ends = []
            for p in procs:
                p.communicate()
                ends.append(time.perf_counter() - t0)
            alone = alone or max(ends)
            print(f"| {n} | {', '.join(f'{e:.1f}' for e in ends)} | {max(ends) / alone:.2f} | "
                  f"{'; '.join(cost_files(cache)) or 'none'} |", flush=True)


def part_first(seeds: list[int], requests: int, max_tokens: int) -> None:
    from cacheback_mlx import bench as B
    from cacheback_mlx.api import Session

    print(f"\n## the first {requests} requests of a fresh machine ({max_tokens} tokens, tok/s per request)\n")
    ratios: dict[str, list[float]] = {"auto, prior": [], "auto, measured": []}
    for seed in seeds:
        prompts = B.select_prompts(["spec_bench"], 1, seed=seed)[:requests]
        arms = {}
        for label, drafter, measured in (("none", "none", False), ("auto, prior", "auto", False),
                                         ("auto, measured", "auto", True)):
            os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cb-startup-")
            arms[label] = s = Session(None, drafter, fixed_budget=drafter == "none")
            if measured:
                s.verify_cost()
        rates: dict[str, list[float]] = {k: [] for k in arms}
        for p in prompts:
            outs = {}
            for label, s in arms.items():
                run = B.run_engine(s, s.engine.drafter, p, max_tokens, label)
                rates[label].append(len(run.tokens) / run.seconds)
                outs[label] = run.tokens
            assert all(o == outs["none"] for o in outs.values()), f"outputs differ on {p.id}"
        print(f"seed {seed}:\n\n| request | " + " | ".join(arms) + " | auto prior / none |\n|---:|"
              + "---:|" * (len(arms) + 1))
        for i in range(len(prompts)):
            print(f"| {i + 1} | " + " | ".join(f"{rates[k][i]:.1f}" for k in arms)
                  + f" | {rates['auto, prior'][i] / rates['none'][i]:.2f}x |")
        for k in ratios:
            ratios[k].append(sum(rates[k]) / sum(rates["none"]))
        print("\nmean over requests: " + ", ".join(f"{k} {statistics.fmean(v):.1f}" for k, v in rates.items()) + "\n",
              flush=True)
    for k, v in ratios.items():
        print(f"{k} / none over seeds {seeds}: mean {statistics.fmean(v):.2f}x (range {min(v):.2f}-{max(v):.2f})")


LOAD = ("import sys, time; import cacheback_mlx; from cacheback_mlx.loader import load; t = time.perf_counter(); "
        "load(None if sys.argv[1] == 'default' else sys.argv[1], 'float32'); print(time.perf_counter() - t)")


def part_load(models: list[str]) -> None:
    print("\n## loading a model as float32, in a fresh process\n\n| model | s, each |\n|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            target = model
            if model.startswith("folder:"):
                from cacheback_mlx.loader import load, save_folder

                target = str(save_folder(load(model[len("folder:"):]), Path(folder) / str(len(os.listdir(folder)))))
            times = [float(subprocess.run([sys.executable, "-c", LOAD, target], capture_output=True, text=True,
                                          check=True).stdout) for _ in range(3)]
            print(f"| {model} | {' / '.join(f'{t:.2f}' for t in times)} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="ttft,processes,first")
    ap.add_argument("--seeds", default="201,202,203")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--load", default="default", help="models for the load part, comma-separated")
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    if "ttft" in parts:
        part_ttft()
    if "processes" in parts:
        part_processes()
    if "first" in parts:
        part_first([int(s) for s in a.seeds.split(",")], a.requests, a.max_tokens)
    if "load" in parts:
        part_load(a.load.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
