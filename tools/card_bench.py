"""CARD side by side: none / cacheback / mlx-lm / CARD sequential and parallel, self:N for a few N
and an optional draft model, on one loaded model, interleaved per prompt (cacheback_mlx.bench).
Every row's greedy tokens must equal `none`'s (the run fails otherwise).

    .venv/bin/python -m tools.card_bench --self-layers 4,8,12 --per-category 1 --max-tokens 128
    .venv/bin/python -m tools.card_bench --draft path/to/draft.gguf --self-layers 8

Prints the speed table (tok/s, ratios vs none and mlx-lm, MAT) and CARD's own figures per row
(draft passes per target pass, cache hit rate, tokens accepted from the cache). Pass sizes are
chosen per pass from the measured pass cost, as in `cacheback-mlx bench` (--fixed-budget N: N).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

from cacheback_mlx import bench as B
from cacheback_mlx.api import Session
from cacheback_mlx.budget import Sizer
from cacheback_mlx.cli import parse_value
from cacheback_mlx.costs import cpu_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the embedded default model)")
    ap.add_argument("--draft", default=None, help="a draft model with the target's tokenizer (optional)")
    ap.add_argument("--self-layers", default="4,8", help="N for draft=self:N rows, comma-separated")
    ap.add_argument("--modes", default="sequential,parallel", help="CARD modes to run")
    ap.add_argument("--card-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a CARD parameter for every CARD row (paths, top_k, depth, nodes, layers, wait_ms, threads)")
    ap.add_argument("--prompts", default="spec_bench", help="spec_bench,humaneval")
    ap.add_argument("--categories", default=None)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fixed-budget", type=int, default=None, help="a fixed draft budget per pass (default: per pass)")
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    session = Session(a.model, "none", fixed_budget=True)
    cost = session.verify_cost()
    card_args = {k.replace("-", "_"): parse_value(v) for k, _, v in (p.partition("=") for p in a.card_arg)}
    drafts = [f"self:{n}" for n in a.self_layers.split(",") if n] + ([a.draft] if a.draft else [])
    labels = {"none": ("none", {}), "cacheback": ("cacheback", {})}
    for draft in drafts:
        short = draft if draft.startswith("self:") else os.path.basename(draft.rstrip("/"))
        for mode in a.modes.split(","):
            labels[f"card {mode[:3]} {short}"] = ("card", dict(card_args, draft=draft, parallel=mode == "parallel"))
    rows = {}
    for label, (name, params) in labels.items():
        sizer = None if a.fixed_budget else Sizer(cost)
        rows[label] = B.Row(session.make_drafter(name, **params), sizer, a.fixed_budget)
    prompts = B.load_prompts(a.prompts.split(","), B.DATA, a.per_category,
                             a.categories.split(",") if a.categories else None)
    try:
        runs = B.run_bench(session, prompts, rows, a.max_tokens, with_mlx_lm=not a.no_mlx_lm)
    finally:
        stats = {label: row.drafter.stats() for label, row in rows.items() if label.startswith("card")}
        for row in rows.values():
            row.drafter.close()
    summary = B.summarize(runs)
    print(f"date={datetime.date.today()} machine={platform.machine()} {cpu_name()} model={session.loaded.name} "
          f"dtype={session.loaded.dtype} max_tokens={a.max_tokens} prompts={len(prompts)} "
          f"budget={a.fixed_budget or 'per pass'} card_args={card_args or 'defaults'} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')} cores={os.cpu_count()}")
    print(B.format_table({"overall": summary["overall"]}))
    print()
    print("| CARD row | draft passes / target pass | cache hit rate | tokens from cache | tree |")
    print("|---|---:|---:|---:|---|")
    for label, s in stats.items():
        print(f"| {label} | {s['draft passes/target pass']:.2f} | {s['cache hit rate']:.3f} | "
              f"{s['tokens from cache']} | "
              f"{s['tree']}{' (' + s['draft process'] + ')' if 'draft process' in s else ''} |")
    if a.json:
        B.save_json(runs, summary, a.json, {"card_stats": stats})
    bad = B.mismatches(runs)
    for m in bad:
        print(f"LOSSLESS CHECK FAILED: {m}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
