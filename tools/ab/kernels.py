"""The engine's SwiGLU (activations.py) and MLX's buffer cache (malloc.py), each on and off.

    .venv/bin/python -m tools.ab.kernels [--contexts 256,1050] [--rows 1,2,4,8,16,33,64] [--repeats 11]
    .venv/bin/python -m tools.ab.kernels --prefill 1050 --rounds 3     # separate processes

Passes (the default): one process, the default model, a chain pass of r rows after c cached
tokens with the SwiGLU of activations.py and with mlx-lm's, interleaved (the median of --repeats
rounds; the first round is dropped); whether both give the same argmax on every row, and how far
apart their logits are. Then a prefill of --prefill tokens, both ways, interleaved.

--rounds N: prefills of --prefill tokens in separate processes, one after the other, N rounds of
the four settings (MLX's buffer cache 32 MB, its default here, or raised; SwiGLU off or on), as a
new user's process would run: the median of three prefills in each process, and its peak RSS.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click


def passes(contexts, rows, repeats, prefill_n):
    from cacheback_mlx import activations
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.loader import load
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    import mlx.core as mx
    import numpy as np

    model = load().model
    cache = ModelCache(model)
    print(f"ms per pass (median of {repeats}); SwiGLU: mlx-lm's (off) or activations.py's (on)\n")
    print("| cached | rows | off ms | on ms | ratio | same argmax | max logit diff |\n"
          "|---:|---:|---:|---:|---:|:---:|---:|")
    done = 0
    for c in contexts:
        prefill(model, cache, [(100 + i) % 5000 for i in range(done, c)])
        done = c
        for r in rows:
            lead = [(7 + 13 * i) % 5000 for i in range(r)]
            times, logits = {False: [], True: []}, {}
            for i in range(repeats + 1):
                for on in ((False, True) if i % 2 else (True, False)):
                    activations.enabled = on
                    t0 = time.perf_counter()
                    out = verify_pass(model, cache, lead, DraftTree.empty())
                    mx.eval(out)
                    if i:
                        times[on].append(time.perf_counter() - t0)
                    logits[on] = np.array(out)
                    cache.trim(c)
            a, b = (statistics.median(times[k]) * 1e3 for k in (False, True))
            same = np.array_equal(logits[False].argmax(-1), logits[True].argmax(-1))
            diff = float(np.abs(logits[False] - logits[True]).max())
            print(f"| {c} | {r} | {a:.1f} | {b:.1f} | {b / a:.2f} | {'yes' if same else 'NO'} | {diff:.1e} |",
                  flush=True)
    times = {False: [], True: []}
    tokens = [(100 + i) % 5000 for i in range(prefill_n)]
    for i in range(5):
        for on in ((False, True) if i % 2 else (True, False)):
            activations.enabled = on
            fresh = ModelCache(model)
            t0 = time.perf_counter()
            prefill(model, fresh, tokens)
            if i:
                times[on].append(time.perf_counter() - t0)
    a, b = (statistics.median(times[k]) * 1e3 for k in (False, True))
    print(f"\nprefill of {prefill_n} tokens (median of 4): off {a:.0f} ms, on {b:.0f} ms ({b / a:.2f}x)")
    activations.enabled = True


CHILD = """
import json, os, resource, statistics, sys, time
import cacheback_mlx
import mlx.core as mx
from cacheback_mlx.kvcache import ModelCache
from cacheback_mlx.loader import load
from cacheback_mlx.verify import prefill
model = load().model
if sys.argv[2] == "32":
    mx.set_cache_limit(32 << 20); mx.clear_cache()
tokens = [(100 + i) % 5000 for i in range(int(sys.argv[1]))]
ts = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    cache = ModelCache(model)
    t0 = time.perf_counter(); prefill(model, cache, tokens); ts.append(time.perf_counter() - t0)
print(json.dumps({"ms": statistics.median(ts) * 1e3, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
                  "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 3}))
"""


def processes(prefill_n, rounds):
    settings = [(cache, silu) for cache in ("32", "raised") for silu in ("0", "1")]
    got = {s: [] for s in settings}
    for _ in range(rounds):
        for cache, silu in settings:
            out = subprocess.run([sys.executable, "-c", CHILD, str(prefill_n), cache], capture_output=True, text=True,
                                 env={**os.environ, "CACHEBACK_MLX_FAST_SILU": silu}, timeout=600)
            if out.returncode:
                raise click.ClickException(out.stderr.strip().splitlines()[-1])
            got[(cache, silu)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"prefill of {prefill_n} tokens, a new process each "
          f"({rounds} rounds; ms: median of 3 prefills in a process)\n")
    print("| MLX buffer cache | SwiGLU | prefill ms, each round | median | peak RSS MB | page faults a prefill |\n"
          "|---|---|---|---:|---:|---:|")
    for (cache, silu), runs in got.items():
        ms = [r["ms"] for r in runs]
        print(f"| {'32 MB (MLX default)' if cache == '32' else 'raised (malloc.py)'} | "
              f"{'on' if silu == '1' else 'mlx-lm'} | "
              f"{', '.join(f'{m:.0f}' for m in ms)} | {statistics.median(ms):.0f} | {max(r['rss_mb'] for r in runs)} | "
              f"{statistics.median(r['faults'] for r in runs):.0f} |")


@click.command()
@click.option("--contexts", default="256,1050", help="cached tokens before the passes")
@click.option("--rows", default="1,2,4,8,16,33,64", help="rows per pass")
@click.option("--repeats", default=11, type=click.IntRange(1))
@click.option("--prefill", "prefill_n", default=1050, type=click.IntRange(1), help="tokens to prefill")
@click.option("--rounds", default=0, type=click.IntRange(0),
              help="prefills in separate processes instead (rounds of 4)")
def main(contexts, rows, repeats, prefill_n, rounds):
    if rounds:
        return processes(prefill_n, rounds)
    ints = lambda s: [int(x) for x in s.split(",")]
    passes(ints(contexts), ints(rows), repeats, prefill_n)


if __name__ == "__main__":
    main()
