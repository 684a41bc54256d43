"""Exact accepted-token counts (MAT) of drafters on the recorded greedy streams, with no model.

Prints the Cacheback ablation (dual tables / dynamic only / frozen only), an LL x FL sweep, and
every drafter at CPU-sized and GPU-sized draft budgets, split into Spec-Bench and HumanEval
streams. Numbers are MAT (mean tokens per verify pass, bonus included); they do not depend on the
machine, only on the drafters. Draft time per step is measured here (this CPU).

    .venv/bin/python -m tools.replay_sweep
"""

from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.ssd import SsdDrafter
from cacheback_mlx.replay import load_streams, replay_all

BUDGETS = (7, 95)  # CPU default 7 draft tokens; 95 = what TDL 96 allows (the GPU default is 63)


def row(label, make, groups, budget):
    cells = []
    for streams in groups.values():
        r = replay_all(make, streams, budget=budget)
        cells.append(f"{r.mat:6.3f}")
    r = replay_all(make, [s for g in groups.values() for s in g], budget=budget)
    print(f"| {label:<34} | {budget:>6} | {' | '.join(cells)} | {r.mat:6.3f} | "
          f"{1e6 * r.draft_seconds / r.steps:7.0f} |")


def main():
    streams = load_streams()
    groups = {"spec_bench": [s for s in streams if s["cat"] != "humaneval"],
              "humaneval": [s for s in streams if s["cat"] == "humaneval"]}
    head = "| drafter | budget | Spec-Bench MAT | HumanEval MAT | all MAT | draft us/step |"
    sep = "|---|---:|---:|---:|---:|---:|"
    print("## Drafters\n\n" + head + "\n" + sep)
    for budget in BUDGETS:
        row("ngram (4 drafts)", lambda: make_drafter("ngram"), groups, budget)
        row("ngram (chain up to budget)", lambda: make_drafter("ngram", max_draft=budget), groups, budget)
        row("pld", lambda: make_drafter("pld"), groups, budget)
        row("ssd (fresh per request)", lambda: SsdDrafter(persist=False), groups, budget)
        row("cacheback (dual tables)", lambda: make_drafter("cacheback"), groups, budget)
    print("\n## Cacheback ablation\n\n" + head + "\n" + sep)
    for budget in BUDGETS:
        row("dual (dynamic + frozen)", lambda: make_drafter("cacheback"), groups, budget)
        row("no frozen (dynamic only)", lambda: make_drafter("cacheback", frozen=False), groups, budget)
        row("only frozen", lambda: make_drafter("cacheback", dynamic=False), groups, budget)
    print("\n## Cacheback LL x FL (dynamic table only)\n\n" + head + "\n" + sep)
    for budget in BUDGETS:
        for ll in (1, 2, 3):
            for fl in (1, 2, 3, 4):
                row(f"LL={ll} FL={fl}", lambda: make_drafter("cacheback", frozen=False, ll=ll, fl=fl), groups, budget)


if __name__ == "__main__":
    main()
