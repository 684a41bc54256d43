"""What the engine and the drafters produce on the default model, kept as a reference so a change
meant to move code (not behaviour) can be checked bit for bit (tests/test_golden_outputs.py).

    .venv/bin/python -m tests.golden_outputs tests/data/golden_outputs.json

writes it again: greedy outputs with every drafter at a fixed budget (tokens, passes, drafted and
accepted counts), and the offline replay's accepted tokens per stream on the recorded streams."""

from __future__ import annotations

import json
import sys
from pathlib import Path

DRAFTERS = {"none": {}, "ngram": {}, "cacheback": {}, "pld": {}, "rest": {},
            "auto": {"persist": False}}  # auto: its cross-request buffer in memory only
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "List three facts about the Moon."]
MAX_TOKENS = 32
STREAMS = 6  # recorded streams replayed offline
BUDGET = 7


def live(names=tuple(DRAFTERS)) -> dict:
    from cacheback_mlx.api import Session

    out = {}
    session = None
    for name in names:
        params = DRAFTERS[name]
        if session is None:
            session = Session(drafter=name, fixed_budget=True, draft_budget=BUDGET, **params)
        else:
            session.set_drafter(name, **params)
        rows = []
        for prompt in PROMPTS:
            session.reset()
            ids = session.encode(prompt)
            toks = [t for _, step in session.stream_ids(ids, MAX_TOKENS) for t in step]
            s = session.stats
            rows.append({"tokens": toks, "passes": s.passes, "drafted": s.drafted, "accepted": s.accepted})
        out[name] = rows
    return out


def offline() -> dict:
    from cacheback_mlx.drafters import make_drafter
    from cacheback_mlx.replay import load_streams, replay

    streams = load_streams()[:STREAMS]
    out = {}
    for name, params in DRAFTERS.items():
        if name == "none":
            continue
        drafters = (make_drafter(name, **params) for _ in streams)  # a fresh one per stream
        out[name] = [replay(d, s["prompt"], s["out"], BUDGET).steps for d, s in zip(drafters, streams)]  # passes
    return out


def compute() -> dict:
    return {"live": live(), "offline": offline()}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(compute(), indent=1) + "\n")
