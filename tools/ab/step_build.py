"""What building a one-row step's graph costs in Python: mlx-lm's step, and the engine's with the
GPU kernels' linear layers in (kernels/linear.py), inside and outside the kernels' pass context.

    .venv/bin/python -m tools.ab.step_build [--model M] [--cached 256] [--rounds 60]

On a CUDA GPU a small model's step is bound by building its graph (docs/BENCHMARKS.md §15), and
there every linear layer of the engine's model asks the kernels first. This converts the model's
layers as `kernels.attach` does (on any backend: only the Python is timed, the kernels never run
for one row) and times building the graph of one step (nothing is evaluated inside the timing),
the three ways in turns, `--rounds` times each: the median.
"""

from __future__ import annotations

import statistics
import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)
from cacheback_mlx import kernels
from cacheback_mlx.kernels import linear
from cacheback_mlx.kvcache import ModelCache
from cacheback_mlx.loader import load
from cacheback_mlx.verify import prefill

import click
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def _engine_step(model, cache: ModelCache, in_pass: bool) -> float:
    t0 = time.perf_counter()
    cache.begin_pass()
    if in_pass:
        with kernels.rows_pass(real=1):
            out = model(mx.array([[4]]), cache=cache.layers)
    else:
        out = model(mx.array([[4]]), cache=cache.layers)
    seconds = time.perf_counter() - t0
    mx.eval(out)
    cache.finish_pass([], whole=False)
    return seconds


def _mlx_lm_step(model, cache: list) -> float:
    t0 = time.perf_counter()
    out = model(mx.array([[4]]), cache=cache)
    seconds = time.perf_counter() - t0
    mx.eval(out)
    for c in cache:
        c.trim(1)
    return seconds


@click.command()
@click.option("--model", "model_spec", default=None, help="A model (default: the embedded one).")
@click.option("--cached", default=256, show_default=True, help="Tokens in the caches before the steps.")
@click.option("--rounds", default=60, show_default=True)
def main(model_spec, cached, rounds):
    loaded = load(model_spec)
    model = loaded.model
    prompt = [(100 + i) % 1000 for i in range(cached)]
    ours = ModelCache(model)
    prefill(model, ours, prompt)
    theirs = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=theirs))
    layers = len(linear.convert(model))
    ways = {"mlx-lm's step": lambda: _mlx_lm_step(model, theirs),
            "engine's step, in the kernels' pass context": lambda: _engine_step(model, ours, True),
            "engine's step, outside it": lambda: _engine_step(model, ours, False)}
    times = {name: [] for name in ways}
    for _ in range(rounds + 3):  # the first 3 rounds warm up
        for name, step in ways.items():
            times[name].append(step())
    print(f"{loaded.name}, {mx.default_device()}, {layers} layers converted, {cached} cached, {rounds} rounds\n")
    print("| step | build ms (median) |\n|---|---:|")
    for name, ts in times.items():
        print(f"| {name} | {1e3 * statistics.median(ts[3:]):.3f} |")


if __name__ == "__main__":
    main()
