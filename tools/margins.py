"""How close greedy decoding comes to a tie, against how far a verify pass rounds from a step.

    .venv/bin/python -m tools.margins [--model M] [--dtype float32|float16|bfloat16] [--streams 64]

A verify pass of several rows computes the same logits as one-token steps in another order of
additions, so they differ by rounding; a greedy pick can differ only where the model's top two
logits are closer than that. This measures both on the machine it runs on, for a model and dtype:

- rounding: from a few recorded streams, the prompt prefilled, then the stream's next r tokens in
  one chain pass and again one token at a time, each from the same cache (rounding.py, as
  `doctor --rounding` measures it): the largest difference of any logit, by r, and whether any
  row's argmax differs;
- margins: every position of the recorded greedy streams (../shared/data/smollm2_greedy, the
  default model's; for another model its own top two at the same text), the gap between the top
  two logits of one forward pass over prompt and output, and how many positions have a gap below
  the largest rounding difference seen, and below 10x it.
"""

from __future__ import annotations

import argparse

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)
from cacheback_mlx import loader
from cacheback_mlx.replay import load_streams
from cacheback_mlx.rounding import as_f32, pass_against_steps

import mlx.core as mx
import numpy as np


def rounding(model, stream: dict, rows: int, at: int) -> tuple[float, bool]:
    """Max |logit difference| between a chain pass of `rows` stream tokens and as many steps,
    after the prompt and `at` output tokens; and whether some row's argmax differs."""
    return pass_against_steps(model, stream["prompt"] + stream["out"], len(stream["prompt"]) + at, rows)


def margins(model, streams: list[dict]) -> np.ndarray:
    """The top-two gap at every output position of every stream (one forward pass each)."""
    out = []
    for s in streams:
        ids = s["prompt"] + s["out"]
        logits = model(mx.array(ids)[None])[0, len(s["prompt"]) - 1 : len(ids) - 1].astype(mx.float32)
        top = mx.topk(logits, 2, axis=-1)
        out.append(np.abs(as_f32(top[:, 1] - top[:, 0])))
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model as `--model` takes it (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=64, help="recorded streams for the margins (of 64)")
    ap.add_argument("--rows", default="2,4,8,16", help="pass sizes for the rounding")
    ap.add_argument("--samples", type=int, default=8, help="streams (and positions) the rounding is taken at")
    args = ap.parse_args()
    model = loader.load(args.model, dtype=args.dtype).model
    streams = load_streams()[: args.streams]
    print(f"model {args.model or 'default'}, {args.dtype}, {mx.default_device()}")
    worst = 0.0
    for r in [int(x) for x in args.rows.split(",")]:
        diffs, flips = [], 0
        for k in range(args.samples):
            s = streams[(k * 7) % len(streams)]
            at = (k * 13) % max(1, len(s["out"]) - r)
            if len(s["out"]) - at < r:
                continue
            d, flip = rounding(model, s, r, at)
            diffs.append(d)
            flips += flip
        worst = max([worst] + diffs)
        print(f"rounding, pass of {r:>2} rows against {r} steps: largest logit difference "
              f"{max(diffs):.3g} (median of {len(diffs)} samples {np.median(diffs):.3g}); "
              f"samples with a row's pick changed: {flips}")
    gaps = margins(model, streams)
    print(f"margins over {len(gaps)} positions of {len(streams)} streams: smallest top-two gap {gaps.min():.3g}; "
          f"quantiles 0.1% {np.quantile(gaps, 0.001):.3g}, 1% {np.quantile(gaps, 0.01):.3g}")
    for bound in (worst, 10 * worst):
        print(f"positions whose top-two gap is below {bound:.3g}: {int((gaps < bound).sum())} "
              f"({100 * (gaps < bound).mean():.2f}%)")


if __name__ == "__main__":
    main()
