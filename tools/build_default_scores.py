"""Rebuild the shipped starting scores of `auto` (cacheback_mlx/data/auto_scores_smollm2.json.gz), what
`auto:scores=true` starts from (not the default: docs/BENCHMARKS.md §10).

`auto` scores every candidate draft token with a logistic model it learns from the model's own
picks (drafters/scorer.py). A drafter that has learned nothing yet starts from a few hand-set
weights (auto.PRIOR) and drafts worse for its first requests. This learns other weights by
replaying `auto` over the default model's own greedy answers (the self-corpora of
tools/build_default_table.py: chat answers, answers to questions, code completions; none of the
benchmark data in ../shared/data, which is the test set), as a server serves them: one drafter
serves a half of them in order (SSD's buffer grows, the scorer learns from every pass), then
another drafter the other half, going on from the same scores.

Those answers are what the shipped datastore holds and what the shipped frozen table counts most:
replayed against them, the retrieval sources would always be right and the scorer would learn to
trust them far more than they deserve on new text. So each half is replayed with a datastore and a
frozen table built from the other half alone (and the standard library, as the shipped table).
Features seen fewer than MIN_USES times are left out and weights rounded (the file stays small).
Takes ~2 minutes on 2 cores; deterministic for a given tokenizer and Python standard library.

    .venv/bin/python -m tools.build_default_scores [--out FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import tempfile
from pathlib import Path

import cacheback_mlx  # noqa: F401  (OpenBLAS before mlx)
from cacheback_mlx.drafters.auto import SHIPPED_SCORES, AutoDrafter
from cacheback_mlx.drafters.rest import concatenate
from cacheback_mlx.drafters.suffix import SuffixIndex
from cacheback_mlx.loader import load
from cacheback_mlx.replay import replay
from cacheback_mlx.table_builder import build_table_from_files, encode, tokenizer_fingerprint

from tools.build_default_table import SELF_CORPORA, SELF_WEIGHT, stdlib_files

RAW = {"self_code_smollm2.jsonl.gz"}  # completions of raw text; the others' answers went through the chat template
BUDGET = 7  # drafts a pass while replaying (the CPU's; what is labelled depends little on it)
MIN_USES = 4  # features seen fewer times are left out (docs/BENCHMARKS.md §4: the same MAT as all of them)
SEED = 0  # which answers fall in which half


def answers(tokenizer) -> list[dict]:
    """Every self-corpus answer as a stream: its prompt's ids as the model saw them, its answer's ids."""
    out = []
    for path in SELF_CORPORA:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                p = r["prompt"]
                if path.name in RAW:
                    prompt = encode(tokenizer, p)
                else:
                    messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
                    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                out.append({"prompt": [int(t) for t in prompt], "out": encode(tokenizer, r["text"]), "text": r["text"]})
    return out


def held_out_sources(other: list[dict], tokenizer, folder: Path, name: str) -> tuple[Path, SuffixIndex]:
    """A frozen table (the standard library and `other`'s answers, weighted as the shipped table's)
    and a datastore of `other`'s answers: the sources as they would be for answers not in them."""
    corpus = folder / f"{name}.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as f:
        for r in other:
            f.write(json.dumps({"text": r["text"]}) + "\n")
    table = folder / f"{name}.npz"
    build_table_from_files(stdlib_files() + [corpus] * SELF_WEIGHT, tokenizer, table, ll=1, fl=3, lc=1 << 20,
                           fc=128, progress=False)
    return table, SuffixIndex(tokens=concatenate(r["out"] for r in other))


def learn(tokenizer) -> tuple[dict, int]:
    """The scorer's state after both halves; the passes replayed."""
    streams = answers(tokenizer)
    random.Random(SEED).shuffle(streams)
    halves = [streams[0::2], streams[1::2]]
    state, passes = None, 0
    with tempfile.TemporaryDirectory() as tmp:
        for k, half in enumerate(halves):
            table, datastore = held_out_sources(halves[1 - k], tokenizer, Path(tmp), f"half{k}")
            d = AutoDrafter(persist=False, frozen=table, datastore=datastore, scores=False)
            if state is not None:
                d.scorer.load_state(state)
            for s in half:
                d.reset()
                passes += replay(d, s["prompt"], s["out"], BUDGET).steps
                d.end_request()
                d.ssd.wait()  # SSD's index of the answers served so far, as a server would have it by now
            state = d.scorer.state(min_uses=0 if k == 0 else MIN_USES)
            print(f"half {k + 1} of 2: {len(half)} answers", flush=True)
    state["w"] = [[f, round(w, 3), n] for f, w, n in state["w"]]
    return state, passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=SHIPPED_SCORES)
    a = ap.parse_args()
    tokenizer = load().tokenizer
    state, passes = learn(tokenizer)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    saved = json.dumps({"fingerprint": tokenizer_fingerprint(tokenizer), "scores": state}).encode()
    a.out.write_bytes(gzip.compress(saved, mtime=0))  # no time or name inside: the same answers, the same bytes
    print(f"{len(state['w'])} weights learned over {passes} passes -> {a.out} ({a.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
