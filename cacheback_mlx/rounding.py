"""How far a verify pass's logits lie from one-token steps' on this machine, for a model and dtype.

A pass of several rows adds the same products as one-token steps, but a backend may run another
kernel for several rows (another order of additions), so the pass's logits can differ from the
steps' by rounding. A greedy pick can then differ from plain decoding only where the model's top
two logits are closer than that difference. `cacheback-mlx doctor --model M --rounding` measures
it where it runs (docs/BENCHMARKS.md §17: on our CPU, float32 passes differ by up to ~8e-5 at the
default model, bfloat16 ones not at all in the samples taken); `tools/margins.py` measures how close
the top two logits come over recorded text.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .kvcache import ModelCache
from .tree import DraftTree
from .verify import prefill, step_pass, verify_pass

TEXT = ("The kettle clicked off while the report was still loading. She poured the water, checked the "
        "numbers again, and wrote:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
        "    return total / len(xs)\n\nThe average held steady at 41.7 over the last three weeks.")
ROWS = (2, 4, 8, 16)


def as_f32(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32))


def pass_against_steps(model, ids: list[int], start: int, rows: int) -> tuple[float, bool]:
    """ids[:start - 1] prefilled, then ids[start - 1 : start - 1 + rows] in one chain pass and
    again one token at a time, each from a cache of its own: the largest difference of any logit
    of any row, and whether some row's argmax differs."""
    tokens = [int(t) for t in ids[start - 1 : start - 1 + rows]]
    if len(tokens) != rows or start < 2:
        raise ValueError(f"{rows} rows from position {start} need {start - 1 + rows} ids, got {len(ids)}")
    caches = []
    for _ in range(2):
        cache = ModelCache(model)
        prefill(model, cache, ids[: start - 1], 512)
        caches.append(cache)
    chain = DraftTree(np.array(tokens[1:], np.int32), np.arange(-1, rows - 2, dtype=np.int32))
    passed = verify_pass(model, caches[0], tokens[:1], chain, rows=rows)
    mx.eval(passed)
    stepped = []
    for t in tokens:
        logits = step_pass(model, caches[1], mx.array([t]))
        mx.eval(logits)
        caches[1].finish_pass([0], True)
        stepped.append(logits)
    a, b = as_f32(passed), as_f32(mx.concatenate(stepped))
    return float(np.abs(a - b).max()), bool((a.argmax(-1) != b.argmax(-1)).any())


def measure(model, tokenizer, rows=ROWS) -> dict[int, tuple[float, bool]]:
    """pass_against_steps for each row count, after the start of TEXT (its last 16 tokens are the
    rows), on this machine and in the model's own dtype."""
    ids = [int(t) for t in tokenizer.encode(TEXT)]
    start = len(ids) - max(rows) + 1
    return {r: pass_against_steps(model, ids, start, r) for r in rows}


def describe(result: dict[int, tuple[float, bool]]) -> str:
    """One line for `doctor`."""
    parts = [f"{r} rows " + ("bit for bit" if d == 0 else f"up to {d:.2g}") + (" (a pick changed)" if flip else "")
             for r, (d, flip) in sorted(result.items())]
    worst = max(d for d, _ in result.values())
    tail = ("the same logits, bit for bit, in these chains" if worst == 0 else
            f"greedy output can differ from plain decoding only where the top two logits come within ~{worst:.2g}")
    return f"a verify pass's logits against one-token steps, largest difference: {', '.join(parts)}; {tail}"
