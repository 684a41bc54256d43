"""What running plain steps ahead costs the drafter: passes and plain steps on the default model's
recorded prompts, run-ahead off and on after Q quiet passes (engine.Engine.RUN_AHEAD_QUIET).

    python -m tools.ab.run_ahead [--quiet 1,2,4,8] [--every 8] [--max-tokens 96] [--drafter auto]

Each step run ahead saves what building its graph would have cost the device (on Metal); each
time the drafter drafts again after one, that step costs it a pass. The passes are sized by a
GPU-like cost table (2-64 rows 1.5-1.8x a step), every prompt greedy on this machine's model;
exact outputs, so only the counts matter. Prompts: every --every-th of the recorded set
(data/smollm2_greedy), the parameter's choosing ground, not a benchmark's.
"""

from __future__ import annotations

import json

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

GPU_LIKE = {256: {1: 1.0, 2: 1.5, 4: 1.5, 8: 1.55, 16: 1.6, 32: 1.7, 64: 1.8}}


@click.command()
@click.option("--quiet", default="1,2,4,8", help="Quiet passes before running ahead, comma-separated.")
@click.option("--every", default=8, show_default=True, help="Take every n-th recorded prompt.")
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--drafter", default="auto", show_default=True)
def main(quiet, every, max_tokens, drafter):
    from cacheback_mlx.api import Session
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.costs import CostTable
    from cacheback_mlx.drafters import make_drafter
    from cacheback_mlx.engine import Engine
    from cacheback_mlx.replay import SHARED_STREAMS

    model = Session(drafter="none").loaded.model
    prompts = json.loads((SHARED_STREAMS / "prompts_ids.json").read_text())[::every]
    print(f"{len(prompts)} prompts, {max_tokens} tokens, {drafter}\n")
    print("| run ahead | passes | MAT | plain passes | steps run ahead | tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for q in [None] + [int(x) for x in quiet.split(",")]:
        engine_class = type("Quiet", (Engine,), {"RUN_AHEAD_QUIET": q or 1})
        d = make_drafter(drafter, **({"persist": False} if drafter in ("auto", "ssd") else {}))
        tokens = passes = plain = ahead = 0
        for p in prompts:
            engine = engine_class(model, [], d, 8192, sizer=Sizer(CostTable(GPU_LIKE)), run_ahead=q is not None)
            rows = []
            engine.watch(lambda e: rows.append(e.rows) if e.kind == "verify" else None)
            tokens += sum(len(x) for x in engine.generate(list(p["ids"]), max_tokens))
            passes, ahead = passes + engine.stats.passes, ahead + engine.stats.ahead
            plain += rows.count(1)
            d.reset()
        label = "off" if q is None else f"after {q} quiet"
        print(f"| {label} | {passes} | {tokens / passes:.3f} | {plain} | {ahead} | {tokens} |")


if __name__ == "__main__":
    main()
