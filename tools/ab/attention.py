"""One verify pass with attention.py's CPU attention on and off, side by side in one process.

    .venv/bin/python -m tools.ab.attention [--model M] [--contexts 256,1024,3000] [--rows 1,2,4,8,16]

Times a chain pass of r rows after c cached tokens (the fastest of --repeats rounds, on and off
interleaved so a busy spell hits both alike) and checks that both give the same tokens.
"""

from __future__ import annotations

import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click


@click.command()
@click.option("--model", "-m", default=None)
@click.option("--contexts", default="256,1024,3000")
@click.option("--rows", default="1,2,4,8,16")
@click.option("--repeats", default=7)
def main(model, contexts, rows, repeats):
    from cacheback_mlx import attention
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    import mlx.core as mx

    lm = load_cached(model)
    cache = ModelCache(lm.model)
    done = 0
    print(f"{lm.name}, {mx.default_device()}, float32; ms per pass (fastest of {repeats}), on = attention.py")
    print("| cached | rows | MLX attention ms | ours ms | ours / MLX | same picks |\n|---:|---:|---:|---:|---:|:---:|")
    for c in (int(x) for x in contexts.split(",")):
        prefill(lm.model, cache, [(100 + i) % 5000 for i in range(done, c)])
        done = c
        for r in (int(x) for x in rows.split(",")):
            draft = DraftTree.chain([(7 + 13 * i) % 5000 for i in range(r - 1)])
            best, picks = {True: 1e9, False: 1e9}, {}
            for _ in range(repeats + 1):
                for on in (True, False):
                    attention.enabled = on
                    t0 = time.perf_counter()
                    logits = verify_pass(lm.model, cache, [5], draft)
                    picks[on] = logits.argmax(-1).tolist()
                    best[on] = min(best[on], time.perf_counter() - t0)
                    cache.finish_pass([], whole=False)
            attention.enabled = True
            print(f"| {c} | {r} | {best[False] * 1e3:.1f} | {best[True] * 1e3:.1f} | {best[True] / best[False]:.2f} | "
                  f"{'yes' if picks[True] == picks[False] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
