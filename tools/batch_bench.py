"""Several requests at once, in one process: aggregate tokens per second of our batch (batch.py,
`auto` and `none`) against mlx-lm's own `batch_generate` on the same weights, and our requests one
after another, by number of concurrent requests.

    .venv/bin/python -m tools.batch_bench --clients 1,2,4,8 --max-tokens 128 --seeds 301,302,303

Per seed, a seeded sample of prompts (Spec-Bench first turns through the chat template, and
HumanEval prompts as plain text, alternating); every row of a seed runs on the same prompts, in
one process, side by side. Greedy: every row's outputs must be mlx-lm's token for token (its
`generate_step` one prompt after another where the row "mlx-lm one by one" runs, else the first
row's); the rows that differ are named. Time is wall time from the first prompt's prefill to the last token.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cacheback_mlx.api import Session
from cacheback_mlx.bench import select_prompts


def sample(n: int, seed: int):
    """n prompts: Spec-Bench first turns and HumanEval prompts, a seeded sample, alternating."""
    picked = select_prompts(["spec_bench", "humaneval"], per_category=2, humaneval_prompts=n, seed=seed)
    spec = [p for p in picked if p.chat]
    code = [p for p in picked if not p.chat]
    return [p for pair in zip(spec, code) for p in pair][:n]


def prompt_ids(session: Session, n: int, seed: int) -> list[list[int]]:
    return [session.encode(p.turns[0], chat=p.chat) for p in sample(n, seed)]


def prompt_texts(n: int, seed: int) -> list[str]:
    """The same sample as chat messages' texts (a server's clients)."""
    return [p.turns[0] for p in sample(n, seed)]


def up_to_eos(session: Session, out: list[int]) -> list[int]:
    eos = session.tokenizer.eos_token_ids
    return out[: min([out.index(t) for t in eos if t in out] or [len(out)])]


def mlx_lm_batch(session: Session, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from mlx_lm.generate import batch_generate

    out = batch_generate(session.loaded.model, session.tokenizer, ids, max_tokens=max_tokens,
                         return_token_ids=True).token_ids
    return [up_to_eos(session, o) for o in out]


def mlx_lm_one_by_one(session: Session, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own single-sequence greedy decoding (generate_step), prompt after prompt: the
    outputs every row must equal (batch_generate pads prompts, and some families' mixers run the
    padding into their states)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [up_to_eos(session, [int(t) for t, _ in generate_step(mx.array(p), session.loaded.model,
                                                                   max_tokens=max_tokens)]) for p in ids]


def ours(session: Session, ids, max_tokens: int, lanes: int) -> list[list[int]]:
    """A new batch: lanes with fresh drafters, which learned nothing of earlier rows' outputs."""
    session.reset_batch()
    return [lane.tokens for lane in session.generate_ids_batch(ids, max_tokens, lanes=lanes)]


def one_by_one(session: Session, ids, max_tokens: int) -> list[list[int]]:
    session.fresh_drafter()
    session.reset()
    return [[t for _, step in session.stream_ids(p, max_tokens) for t in step] for p in ids]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seeds", default="301")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="auto,none,auto one by one,mlx-lm")
    args = ap.parse_args(argv)
    # drafters keep nothing across rows: no cross-request store on disk (each row would draft the
    # outputs of the rows before it)
    sessions = {"auto": Session(args.model, "auto", persist=False), "none": Session(args.model, "none")}
    ref = sessions["auto"]
    rows = args.rows.split(",")
    runs = {"auto": lambda ids, c: ours(sessions["auto"], ids, args.max_tokens, c),
            "none": lambda ids, c: ours(sessions["none"], ids, args.max_tokens, c),
            "auto one by one": lambda ids, c: one_by_one(sessions["auto"], ids, args.max_tokens),
            "mlx-lm": lambda ids, c: mlx_lm_batch(ref, ids, args.max_tokens),
            "mlx-lm one by one": lambda ids, c: mlx_lm_one_by_one(ref, ids, args.max_tokens)}
    warm = prompt_ids(ref, 2, 0)
    for name in list(rows):  # compile, allocate, load tables
        try:
            runs[name]([w[:40] for w in warm], 2)
        except Exception as e:  # mlx-lm's batch_generate fails on some families (Gemma 2)
            print(f"{name}: fails on this model ({type(e).__name__}: {str(e).splitlines()[0]}), left out")
            rows.remove(name)
    batch = ref.batch(2)
    shared = batch.reason or ("yes, side by side" if batch.side_by_side else "yes") + (
        ", a lane narrower than the pass undone after it" if batch.undo_padded else "") + (
        ", every lane's keys end to end" if batch.packed else "")
    print(f"batch of shared passes: {shared}")
    print("| clients | seed | " + " | ".join(f"{r} tok/s" for r in rows)
          + " | auto / mlx-lm | rows whose outputs differ |")
    print("|---" * (len(rows) + 4) + "|")
    ratios: dict[int, list[float]] = {}
    for c in [int(x) for x in args.clients.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            ids = prompt_ids(ref, c, seed)
            for s in sessions.values():
                s.reset()
            rates, outs = {}, {}
            for name in rows:
                t0 = time.perf_counter()
                outs[name] = runs[name](ids, c)
                rates[name] = sum(len(o) for o in outs[name]) / (time.perf_counter() - t0)
            truth = outs.get("mlx-lm one by one", outs[rows[0]])
            same = ", ".join(name for name in rows if outs[name] != truth) or "none"
            ratio = rates["auto"] / rates["mlx-lm"] if {"auto", "mlx-lm"} <= set(rates) else None
            if ratio is not None:
                ratios.setdefault(c, []).append(ratio)
            print(f"| {c} | {seed} | " + " | ".join(f"{rates[r]:.1f}" for r in rows)
                  + f" | {'-' if ratio is None else f'{ratio:.2f}x'} | {same} |", flush=True)
    for c, r in ratios.items():
        print(f"{c} clients: auto / mlx-lm {statistics.mean(r):.2f}x (range {min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
