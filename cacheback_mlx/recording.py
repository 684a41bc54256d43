"""Recorded greedy streams, and runs that accept along them (forced acceptance).

A model with random weights accepts no drafts, so its speed with speculation says nothing. A
recording of a real model's greedy streams (`bench --record DIR`) lets any model on the same
tokenizer run at the real model's acceptance (`bench --forced DIR`): every pass runs on the model
at its real rows and cache length, the planner prices it from this model's measured costs, and
only the accept step follows the recording (engine.forced_picks). Such speeds are projections:
the acceptance is the recorded model's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .api import Session
from .bench import MLX_LM, Prompt, Row, Run, logging_passes
from .errors import CachebackError

RECORD_FORMAT = "cacheback-streams/1"


def record_prompt(session: Session, prompt: Prompt, max_tokens: int) -> dict:
    """One question's greedy streams, turn by turn: each turn's prompt ids and output ids (EOS
    excluded), as bench's runs see them (turn 2 after turn 1's reply)."""
    eng = session.engine
    eng.reset()
    turns, messages = [], []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = session.encode(messages if prompt.chat else turn, chat=prompt.chat)
        out = [t for step in eng.generate(ids, max_tokens) for t in step]
        turns.append({"prompt": ids, "out": out})
        messages.append({"role": "assistant", "content": session.tokenizer.decode(out)})
    return {"id": prompt.id, "column": prompt.column, "turns": turns}


def save_recording(folder: str | Path, records: list[dict], meta: dict) -> Path:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    out = path / "streams.json"
    info = {k: v for k, v in meta.items() if k != "prompts"}
    out.write_text(json.dumps({"format": RECORD_FORMAT, **info, "prompt_sets": meta.get("prompts"),
                               "prompts": records}))
    return out


def load_recording(folder: str | Path) -> dict:
    """A `bench --record` folder: {"model", "fingerprint", "max_tokens", "prompts": [{id, column,
    turns: [{prompt, out}]}], ...}; a one-line error for anything else."""
    path = Path(folder) / "streams.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CachebackError(f"cannot read recorded streams {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or not data.get("prompts"):
        raise CachebackError(f"{path} is not a `bench --record` folder's streams")
    return data


def cut_recording(records: list[dict], max_tokens: int) -> list[dict]:
    """Each turn's output cut to its first max_tokens tokens (a shorter forced run)."""
    return [{**r, "turns": [{**t, "out": t["out"][:max_tokens]} for t in r["turns"]]} for r in records]


def requests_of(record: dict) -> list[dict]:
    """A recorded question's turns as replay.replay_requests takes them (one sequence, in order)."""
    return [{"prompt": t["prompt"], "out": t["out"], "max_tokens": len(t["out"])} for t in record["turns"]]


def run_forced(session: Session, row, record: dict, label: str) -> Run:
    """One recorded question with one drafter (or Row), accepting along the recorded streams."""
    row = row if isinstance(row, Row) else Row(row, session.engine.sizer, session.engine.draft_budget)
    eng = session.engine
    eng.set_sizer(row.sizer, row.budget)
    eng.reset(row.drafter)
    run = Run(record["id"], record["column"], label)
    for turn in record["turns"]:
        if not turn["out"]:
            continue
        with logging_passes(run, eng):
            t0 = time.perf_counter()
            out = [t for step in eng.generate(turn["prompt"], len(turn["out"]), forced=turn["out"]) for t in step]
            run.add(out, time.perf_counter() - t0, eng.stats)
    return run


def no_eos(tokenizer):
    """The tokenizer with no EOS, for mlx-lm's stream_generate: it then generates exactly
    max_tokens tokens, a recorded stream's count (random weights pick an EOS at random)."""
    import copy

    out = copy.copy(tokenizer)
    out.eos_token_ids = []
    return out


def run_mlx_lm_forced(session: Session, record: dict) -> Run:
    """mlx-lm's stream_generate on the same prompts and the same token counts as the recording."""
    from mlx_lm import stream_generate

    run = Run(record["id"], record["column"], MLX_LM)
    tokenizer = no_eos(session.tokenizer)
    for turn in record["turns"]:
        if not turn["out"]:
            continue
        t0 = time.perf_counter()
        out = [int(r.token) for r in stream_generate(session.loaded.model, tokenizer, turn["prompt"],
                                                      max_tokens=len(turn["out"]))]
        run.add(out, time.perf_counter() - t0)
    return run


def run_forced_bench(session: Session, records: list[dict], drafters: dict, warmup: int = 1,
                     with_mlx_lm: bool = True, progress: bool = True) -> list[Run]:
    """run_bench over recorded questions, every drafter accepting along the recording."""
    from tqdm import tqdm

    names = list(drafters) + ([MLX_LM] if with_mlx_lm else [])
    def one(name, rec):
        return run_mlx_lm_forced(session, rec) if name == MLX_LM else run_forced(session, drafters[name], rec, name)

    for rec in records[:warmup]:  # compiles and warms every path; not counted. The prompt's own
        ids = rec["turns"][0]["prompt"]  # tokens, so no drafter sees a recorded answer early
        half = max(1, len(ids) // 2)
        short = {**rec, "turns": [{"prompt": ids[:half], "out": ids[half : half + 16]}]}
        for n in names:
            one(n, short)
    runs = []
    for i, rec in enumerate(tqdm(records, desc="bench (forced)", unit=" prompt", disable=not progress)):
        order = names[i % len(names):] + names[: i % len(names)]
        runs += [one(n, rec) for n in order]
    return runs
