"""The auto drafter against each single drafter on the recorded greedy streams (exact MAT, no model).

Two protocols, both printed:
- fresh: a new drafter for every stream (nothing learned across requests);
- in order: one drafter serves the 64 streams in order and is reset between them, as the bench and
  a chat's /reset do: what it learned across requests stays (SSD's buffer, auto's scores), the
  request's own state (history, Cacheback's dynamic table) goes.
With --cost (a verify-cost JSON, as `cacheback-mlx bench --verify-cost` saves it) it also replays
auto and cacheback with the per-step budget and reports tokens per second of pass time (by that
cost table) plus drafting time (measured here), next to the fixed budget of 7. With --truth
(another verify-cost JSON) the sizer decides with --cost but each pass is priced by --truth and
reported to the sizer with --noise (lognormal sigma) as a measured pass, as the engine reports
its passes: how a sizer fares when its table is off. With --calibration it prints how often
auto's nodes were accepted against their scores. With --bench-json (a `cacheback-mlx bench --json`
run on the default model) it replays on that run's own greedy streams instead of the recorded ones:
the live run's MAT, offline (the bench's rows serve their prompts in order, as "in order" does).

    .venv/bin/python -m tools.auto_sweep [--budgets 7,15,63] [--cost FILE [--truth FILE --noise 0.08]] [--calibration]
        [--bench-json FILE]
"""

import argparse
import json
import random

from cacheback_mlx.budget import Sizer
from cacheback_mlx.costs import CostTable, from_json
from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.auto import AutoDrafter
from cacheback_mlx.replay import load_streams, longest_match, replay

import numpy as np

FROZEN = None  # --frozen: a table in place of the shipped one

DRAFTERS = {
    "auto": lambda b: AutoDrafter(persist=False, frozen=FROZEN),
    "auto:scores=true": lambda b: AutoDrafter(persist=False, frozen=FROZEN, scores=True),  # the shipped scores
    "ssd": lambda b: make_drafter("ssd", persist=False),
    "cacheback": lambda b: make_drafter("cacheback", frozen=FROZEN),
    "pld": lambda b: make_drafter("pld", max_draft=b),
    "ngram (chain up to budget)": lambda b: make_drafter("ngram", max_draft=b),
}


def run(make, streams, budget, in_order, sizer=None, clock=None):
    totals = {"sb": [0, 0], "he": [0, 0]}
    draft_s = pass_s = 0.0
    d = None
    for s in streams:
        if d is None or not in_order:
            d = make()
        d.reset()
        r = replay(d, s["prompt"], s["out"], budget, sizer=sizer, clock=clock)
        d.end_request()
        wait = getattr(getattr(d, "ssd", d), "wait", None)
        if wait:
            wait()  # the index of the streams served so far, as a server would have it by now
        t = totals["he" if s["cat"] == "humaneval" else "sb"]
        t[0], t[1] = t[0] + r.tokens, t[1] + r.steps
        draft_s, pass_s = draft_s + r.draft_seconds, pass_s + r.pass_seconds
    tok, steps = sum(t[0] for t in totals.values()), sum(t[1] for t in totals.values())
    mat = lambda t: t[0] / t[1] if t[1] else float("nan")  # nan: no stream of that kind
    return [mat(totals["sb"]), mat(totals["he"]), tok / steps,
            1e6 * draft_s / steps, tok / pass_s if pass_s else 0.0]


def bench_streams(ap, path: str) -> list[dict]:
    """The greedy streams of a `cacheback-mlx bench --json` run on the default model (its `none`
    row), each turn encoded as the bench encoded it: replayed, they give the live run's MAT."""
    from pathlib import Path

    from cacheback_mlx import bench as B
    from cacheback_mlx.api import Session

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        meta, runs = d["meta"], {r["prompt"]: r for r in d["runs"] if r["drafter"] == "none"}
        sets, per_category = list(meta["prompts"]), int(meta["per_category"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--bench-json {path}: not a bench run with a 'none' row ({type(e).__name__}: {e})")
    session = Session(None, "none", fixed_budget=True)  # the tokenizer and chat template
    if meta.get("model") != session.loaded.name:
        ap.error(f"--bench-json {path}: a run on {meta.get('model')}; only runs on the default model can be replayed")
    cats = meta.get("categories")
    streams = []
    for p in B.select_prompts(sets, per_category, meta.get("humaneval_prompts"), cats.split(",") if cats else None,
                              meta.get("seed")):
        r = runs.get(p.id)
        if r is None:
            continue
        lengths = r.get("turns") or [meta["max_tokens"]] * len(p.turns)  # runs before turns were kept
        messages, start = [], 0
        for turn, n_out in zip(p.turns, lengths):
            messages.append({"role": "user", "content": turn})
            out = r["tokens"][start : start + n_out]
            streams.append({"id": p.id, "cat": p.column, "out": out,
                            "prompt": session.encode(messages if p.chat else turn, chat=p.chat)})
            messages.append({"role": "assistant", "content": session.tokenizer.decode(out)})
            start += n_out
    if not streams:
        ap.error(f"--bench-json {path}: no stream of its 'none' row matches the prompt sets it names")
    return streams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="7,15,63")
    ap.add_argument("--cost", default=None, help="verify-cost JSON for the per-step rows")
    ap.add_argument("--truth", default=None, help="verify-cost JSON that prices the passes (default: --cost)")
    ap.add_argument("--noise", type=float, default=0.08,
                    help="with --truth: lognormal sigma on each pass's time (priced and reported to the sizer)")
    ap.add_argument("--calibration", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="skip the MAT tables")
    ap.add_argument("--frozen", default=None, help="a frozen table for auto and cacheback (default: the shipped one)")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="which rows (comma-separated)")
    ap.add_argument("--bench-json", default=None,
                    help="replay on the greedy streams of this `cacheback-mlx bench --json` run (default model)")
    a = ap.parse_args()
    if a.truth and not a.cost:
        ap.error("--truth needs --cost (the table the sizer decides with)")
    cost, truth = (load_cost(ap, f) if f else None for f in (a.cost, a.truth))
    global FROZEN
    FROZEN = a.frozen
    streams = bench_streams(ap, a.bench_json) if a.bench_json else load_streams()
    if a.calibration:
        calibration(streams)
    if a.no_sweep:
        a.budgets = ""
    if a.budgets:
        print("| protocol | drafter | budget | Spec-Bench MAT | HumanEval MAT | all MAT | draft us/step |")
        print("|---|---|---:|---:|---:|---:|---:|")
    for in_order in (False, True):
        for b in [int(x) for x in a.budgets.split(",") if x]:
            for name, make in DRAFTERS.items():
                if name not in a.drafters.split(","):
                    continue
                r = run(lambda: make(b), streams, b, in_order)
                print(f"| {'in order' if in_order else 'fresh'} | {name} | {b} | {r[0]:.3f} | {r[1]:.3f} | "
                      f"{r[2]:.3f} | {r[3]:.0f} |", flush=True)
    if cost:
        clock = None
        if truth:
            rng = random.Random(0)
            clock = lambda rows, context: truth.cost(rows, context) * rng.lognormvariate(0.0, a.noise)
            print(f"\ndecided with {a.cost}, priced by {a.truth} (lognormal noise {a.noise} on each pass's time)")
        print("\n| protocol (in order) | drafter | budget | all MAT | draft us/step | tok/s by pass time "
              "| tok/s by pass + draft time |")
        print("|---|---|---|---:|---:|---:|---:|")
        for name in ("auto", "cacheback"):
            for label, b, sizer in (("fixed 7", 7, FixedSizer(cost, learn=False)),
                                    ("per step, cap 63", 63, Sizer(cost))):
                r = run(lambda: DRAFTERS[name](b), streams, b, True, sizer=sizer, clock=clock)
                with_draft = r[4] / (1 + r[3] * 1e-6 * r[4] / r[2])  # seconds per token + draft per token
                print(f"| in order | {name} | {label} | {r[2]:.3f} | {r[3]:.0f} | {r[4]:.2f} | {with_draft:.2f} |",
                      flush=True)


def load_cost(ap, path: str) -> CostTable:
    """A verify-cost JSON, or a one-line usage error."""
    try:
        return from_json(json.loads(open(path).read()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        ap.error(f"{path}: not a readable verify-cost file ({type(e).__name__}: {e})")


def calibration(streams, budget: int = 24):
    """Sent nodes of auto (in order, budget 24) by score bucket: mean score vs share accepted."""
    d = AutoDrafter(persist=False)
    rows, pred, actual = [], [], []
    for s in streams:
        d.reset()
        hist, out, pos = list(s["prompt"]), s["out"], 0
        d.observe(hist)
        while pos < len(out):
            tree = d.propose(hist, budget)
            path = longest_match(tree, out[pos:])
            rows += [(tree.scores[i], i in path) for i in range(len(tree))]
            pred.append(float(tree.scores.sum()) if len(tree) else 0.0)
            actual.append(len(path))
            acc = [int(tree.tokens[i]) for i in path]
            if pos + len(acc) < len(out):
                acc.append(out[pos + len(acc)])
            hist, pos = hist + acc, pos + len(acc)
            d.observe(acc)
        d.end_request()
        d.ssd.wait()
    rows = np.array(rows, dtype=float)
    print("| score | nodes | mean score | accepted |\n|---|---:|---:|---:|")
    edges = [0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01]
    for lo, hi in zip(edges, edges[1:]):
        m = (rows[:, 0] >= lo) & (rows[:, 0] < hi)
        if m.any():
            print(f"| {lo:.2f}-{min(hi, 1):.2f} | {int(m.sum())} | {rows[m, 0].mean():.3f} | {rows[m, 1].mean():.3f} |")
    print(f"\nper step: expected accepted drafts (sum of scores) {np.mean(pred):.3f}, accepted {np.mean(actual):.3f}\n")


class FixedSizer(Sizer):
    """Every pass gets the whole budget (the fixed rule), priced by the same cost table."""

    def cap(self, limit, context):
        return limit

    def choose(self, tree, lead, context):
        return tree


if __name__ == "__main__":
    main()
