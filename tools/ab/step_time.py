"""Where a decoding step's time goes: building its graph in Python against running it, for
mlx-lm's plain step and the engine's passes by rows, and what running steps ahead gives.

    python -m tools.ab.step_time [--model M] [--dtype float16] [--cached 256,1024] [--rows 1,2,8,16,64]
        [--steps 64]

1. Per cached length and pass: ms to build the graph (the model called, nothing evaluated), ms
   to run it after (mx.eval), the median of --repeats. mlx-lm's step is its model over one token
   with its own cache; the engine's passes are verify_pass over a chain of R rows and over a tree
   (half the rows under the root, the rest under its first child). "same" repeats each pass at
   one cached length; "growing" keeps one row of each, so every pass sees one key more, as in
   decoding (a backend that plans a kernel per shape plans it again for each).
2. --steps plain steps one after another, tokens per second: mlx-lm's generate_step (which builds
   each step while the one before runs), the engine's steps with run-ahead off (build, run, read
   in turn) and on (engine.Engine.set_run_ahead), and on with the engine's work on a stream of
   its own (mx.new_stream, as mlx-lm's generate_step runs on one); --rounds rounds, each in
   another order, their median and each round's figure.

On a GPU at the default model's size a step is bound by its build, not the device: what makes
it matter there (docs/BENCHMARKS.md, the GPU section). Runs on any backend.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import cacheback_mlx  # noqa: F401 - first: it sets MLX's environment (blas.py, TF32)

import click
import numpy as np


def _median_ms(xs) -> float:
    return 1e3 * statistics.median(xs)


def _tree(rows: int):
    from cacheback_mlx.tree import DraftTree

    n = rows - 1  # the root leads
    parents = [-1] * (n // 2) + [0] * (n - n // 2)
    return DraftTree(np.arange(10, 10 + n, dtype=np.int32), np.array(parents, np.int32))


def build_and_run(mx, fn, undo, repeats: int) -> tuple[float, float]:
    """ms to build fn()'s graph and ms to evaluate it, medians; undo() after each."""
    builds, runs = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        undo()
        if i >= 2:
            builds.append(t1 - t0)
            runs.append(t2 - t1)
    return _median_ms(builds), _median_ms(runs)


def pass_table(mx, loaded, cached_lengths, rows_list, repeats):
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model
    print("| cached | pass | rows | length | build ms | run ms | build share |")
    print("|---:|---|---:|---|---:|---:|---:|")
    for cached in cached_lengths:
        prompt = [(7 * i + 3) % 1000 + 5 for i in range(cached)]
        ref = make_prompt_cache(model)
        mx.eval(model(mx.array(prompt)[None], cache=ref), [c.state for c in ref])
        y = mx.array([[11]])

        def undo_ref():
            for c in ref:
                c.offset -= 1

        b, r = build_and_run(mx, lambda: mx.argmax(model(y, cache=ref)[:, -1, :], axis=-1), undo_ref, repeats)
        print(f"| {cached} | mlx-lm step | 1 | same | {b:.2f} | {r:.2f} | {b / (b + r):.0%} |")
        cache = ModelCache(model)
        prefill(model, cache, prompt)
        start = cache.length

        def undo():
            cache.finish_pass([], False)

        def keep_one():
            cache.finish_pass([0], True)

        for rows in rows_list:
            kinds = [("chain", DraftTree.chain(list(range(10, 9 + rows))))]
            if rows > 2:
                kinds.append(("tree", _tree(rows)))
            for kind, tree in kinds:
                def one():
                    return mx.argmax(verify_pass(model, cache, [11], tree, rows=rows), axis=-1)
                for length, after in (("same", undo), ("growing", keep_one)):
                    b, r = build_and_run(mx, one, after, repeats)
                    cache.trim(start)
                    print(f"| {cached} | engine {kind if rows > 1 else 'step'} | {rows} | {length} | {b:.2f} | "
                          f"{r:.2f} | {b / (b + r):.0%} |")


def steps_table(mx, loaded, steps: int, cached: int, rounds: int):
    from cacheback_mlx.drafters.base import NoDrafter
    from cacheback_mlx.engine import Engine

    from mlx_lm.generate import generate_step

    prompt = [(7 * i + 3) % 1000 + 5 for i in range(cached)]
    labels = ("mlx-lm generate_step", "engine, run-ahead off", "engine, run-ahead on",
              "engine, run-ahead on, own stream")
    seen = {label: [] for label in labels}
    own = mx.new_stream(mx.default_device())
    for rnd in range(rounds):  # each round in another order: a machine warming up favours none
        for label in labels[rnd % len(labels):] + labels[: rnd % len(labels)]:
            if label.startswith("mlx-lm"):
                gen = generate_step(mx.array(prompt), loaded.model, max_tokens=steps + 1)
                next(gen)  # the prefill and the first token
                t0 = time.perf_counter()
                n = sum(1 for _ in gen)
            else:
                engine = Engine(loaded.model, eos_ids=[], drafter=NoDrafter(), context_length=cached + steps + 8,
                                draft_budget=0, run_ahead="run-ahead on" in label)
                with mx.stream(own) if label.endswith("own stream") else nullcontext():
                    gen = engine.generate(prompt, steps + 1)
                    next(gen)
                    t0 = time.perf_counter()
                    n = sum(len(x) for x in gen)
            seen[label].append(n / (time.perf_counter() - t0))
    print("| plain steps | tok/s, median | each round |")
    print("|---|---:|---|")
    for label, rates in seen.items():
        print(f"| {label} | {statistics.median(rates):.1f} | {' / '.join(f'{r:.1f}' for r in rates)} |")


@click.command()
@click.option("--model", default=None, help="Model (default: the embedded default model).")
@click.option("--dtype", default=None, help="Weights' dtype (default: the backend's).")
@click.option("--cached", default="256,1024", help="Cached tokens before the passes, comma-separated.")
@click.option("--rows", default="1,2,8,16,64", help="Rows of the engine's passes, comma-separated.")
@click.option("--repeats", default=15, show_default=True, help="Timed repeats per pass (after two warm-ups).")
@click.option("--steps", default=64, show_default=True, help="Plain steps for the tokens-per-second table.")
@click.option("--rounds", default=3, show_default=True,
              help="Rounds of the tokens-per-second table, each in another order.")
def main(model, dtype, cached, rows, repeats, steps, rounds):
    from cacheback_mlx.loader import load

    import mlx.core as mx

    loaded = load(model, dtype=dtype)
    print(f"{loaded.name}, {loaded.dtype}, {mx.default_device()}\n")
    pass_table(mx, loaded, [int(c) for c in cached.split(",")], [int(r) for r in rows.split(",")], repeats)
    print()
    steps_table(mx, loaded, steps, int(cached.split(",")[0]), rounds)


if __name__ == "__main__":
    main()
