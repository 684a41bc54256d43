"""Projected speed of drafters on a model, from its measured pass costs and a recording's acceptance.

A model with random weights accepts no drafts; `cacheback-mlx bench --forced DIR` runs it live at
the acceptance of the recorded model. This does the same offline, for many shapes at the cost of
one cost table each: every recorded question is replayed as the engine serves it (a fresh drafter
per question, its turns in order: learning.start_request, then replay.decode), each pass priced by
the model's measured cost table and reported
to the planner as a measured pass. Plain decoding is priced the same way (one row per token), so
the ratio is the projected speedup over plain decoding on this machine; MAT is exact. The cost
table is measured here (at --contexts; it is also printed, relative to one row) and not kept, or
read from --cost: a verify-cost file as the engine keeps it (under
~/.cache/cacheback-mlx/verify-cost/, e.g. one a GPU run brought back: tools/cuda_checks.sh keeps
them), which projects that machine's speed here; --model then only gives the drafters their
vocabulary (any size of the shape will do, e.g. layers=1).

    .venv/bin/python -m tools.scale_projection --model random:llama-3.2-1b [REC_DIR ...]
        [--rows auto,auto:budget=7,cacheback] [--contexts 512,2048] [--max-tokens N] [--cost FILE]
"""

import argparse
import json
import time
from pathlib import Path

from cacheback_mlx import recording as R
from cacheback_mlx.api import Session
from cacheback_mlx.budget import Sizer
from cacheback_mlx.cli import parse_drafter_args
from cacheback_mlx.costs import CostTable, from_json, measure
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.learning import start_request
from cacheback_mlx.replay import decode

import numpy as np


def project(session: Session, records: list[dict], label: str, cost) -> dict:
    """{"tokens", "passes", "seconds", "plain_seconds"} of one row over the recorded questions."""
    name, *variant = label.split(":")
    args = parse_drafter_args(variant)  # e.g. auto:budget=7, auto:scores=false
    budget = args.pop("budget", None)
    params = {"persist": False} if name in ("auto", "ssd") else {}
    params.update(args)
    tokens = passes = 0
    seconds = plain = 0.0
    sizer = None if budget is not None else Sizer(cost)  # one per row, as bench's rows keep theirs
    for rec in records:
        drafter = session.make_drafter(name, **params)
        history: list[int] = []
        for turn in rec["turns"]:
            if not turn["out"]:
                continue
            history = start_request(drafter, history, turn["prompt"])
            base = len(history)
            r = decode(drafter, history, turn["out"], budget if budget is not None else 63, sizer, cost.cost)
            tokens += r.tokens
            passes += r.steps
            seconds += r.pass_seconds
            plain += sum(cost.cost(1, base + i) for i in range(len(turn["out"])))
            drafter.end_request()
    return {"tokens": tokens, "passes": passes, "seconds": seconds, "plain_seconds": plain}


def cost_lines(cost) -> list[str]:
    """The measured table, relative to one row at each context (Markdown rows)."""
    sizes = [r for r in cost.sizes if r in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64)]
    lines = ["| cached tokens | one row | " + " | ".join(f"{r}" for r in sizes[1:]) + " |",
             "|---:|---:|" + "---:|" * (len(sizes) - 1)]
    for c in cost.contexts:
        one = cost.table[c][1]
        lines.append(f"| {c} | {1e3 * one:.0f} ms | "
                     + " | ".join(f"{cost.table[c][r] / one:.2f}" for r in sizes[1:]) + " |")
    return lines


def read_cost(path: str) -> CostTable:
    """A measured table from a verify-cost file; a one-line error for anything else."""
    try:
        cost = from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CachebackError(f"cannot read a verify cost from {path}: {e}") from None
    if not isinstance(cost, CostTable):
        raise CachebackError(f"{path} holds a cost learned from passes, not a measured table")
    return cost


def cost_origin(path: str) -> str:
    """What the file says it was measured on: model, device, machine, MLX."""
    data = json.loads(Path(path).read_text())
    return ", ".join(str(data[k]) for k in ("model", "device", "cpu", "mlx") if k in data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="*", help="`cacheback-mlx bench --record` folders")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="auto,auto:budget=7")
    ap.add_argument("--contexts", default="512,2048", help="cached tokens the pass cost is measured at")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the measurement (the fastest is kept)")
    ap.add_argument("--max-tokens", type=int, default=None, help="cut each recorded turn to this many tokens")
    ap.add_argument("--cost", default=None, help="a verify-cost file to price passes by, instead of measuring")
    a = ap.parse_args()
    session = Session(a.model, "none", fixed_budget=True)
    t0 = time.perf_counter()
    if a.cost:
        cost = read_cost(a.cost)
        print(f"pass cost by rows, x one row, from {a.cost} ({cost_origin(a.cost)}):")
    else:
        cost = measure(session.loaded.model, contexts=tuple(int(c) for c in a.contexts.split(",")),
                       repeats=a.repeats, vocab=session.engine.vocab_size)
        print(f"model {session.loaded.name} ({session.loaded.dtype}); pass cost by rows, x one row "
              f"(measured in {time.perf_counter() - t0:.0f} s):")
    print("\n".join(cost_lines(cost)))
    if not a.recordings:
        return
    print("\n| recording | column | row | MAT | projected speedup vs plain |")
    print("|---|---|---|---:|---:|")
    per_row: dict[str, list[float]] = {}
    for folder in a.recordings:
        rec = R.load_recording(folder)
        records = rec["prompts"] if a.max_tokens is None else R.cut_recording(rec["prompts"], a.max_tokens)
        for col, part in (("spec_bench", [r for r in records if r["column"] != "humaneval"]),
                          ("humaneval", [r for r in records if r["column"] == "humaneval"])):
            if not part:
                continue
            for label in a.rows.split(","):
                r = project(session, part, label, cost)
                x = r["plain_seconds"] / r["seconds"]
                per_row.setdefault(f"{col} {label}", []).append(x)
                print(f"| {Path(folder).name} | {col} | {label} | {r['tokens'] / r['passes']:.2f} | {x:.2f}x |",
                      flush=True)
    for key, xs in per_row.items():
        print(f"{key}: mean {np.mean(xs):.2f}x, range {min(xs):.2f}-{max(xs):.2f} over {len(xs)} recordings")


if __name__ == "__main__":
    try:
        main()
    except CachebackError as e:
        raise SystemExit(f"error: {e}") from None
