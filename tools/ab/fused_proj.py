"""Fewer kernels a step: a llama-like layer's q/k/v projections as one matmul over their weights
end to end, and the MLP's gate/up likewise; bits and time against the model as loaded.

    python -m tools.ab.fused_proj [--model M] [--dtype float16] [--rows 1,2,8] [--cached 256] [--repeats 20]

On MLX's CUDA backend a small model's step is bound by launching its ~500 kernels (docs/BENCHMARKS.md
§15): fusing saves 3 of ~17 a layer. Worth building into the engine only where every row keeps the
bits of the separate products (the one-row step must stay mlx-lm's) and the step gets faster: this
prints both, per rows. An experiment: the model is changed in this process only.
"""

from __future__ import annotations

import statistics
import time

import cacheback_mlx  # noqa: F401 - first: it sets MLX's environment (blas.py, TF32)

import click


class Fused:
    """Projections of one input as one product: `take(i)` returns the i-th part of x @ W.T, the
    product computed once per input array (the layer calls its projections on the same x)."""

    def __init__(self, mx, weights):
        self.mx = mx
        self.w = mx.concatenate(weights, axis=0)
        self.bounds, at = [], 0
        for w in weights:
            self.bounds.append((at, at + w.shape[0]))
            at += w.shape[0]
        self.x = self.out = None

    def take(self, i: int):
        def project(x):
            if x is not self.x:
                self.x, self.out = x, x @ self.w.T
            a, b = self.bounds[i]
            return self.out[..., a:b]
        return project


def fuse(mx, model) -> int:
    """Swap each layer's q/k/v and gate/up projections for parts of one product; returns layers."""
    n = 0
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))]
        for module, parts in names:
            if module is None or not all(hasattr(module, p) and "bias" not in getattr(module, p) for p in parts):
                continue
            fused = Fused(mx, [getattr(module, p).weight for p in parts])
            for i, p in enumerate(parts):
                object.__setattr__(module, p, fused.take(i))  # a plain callable in place of the Linear
        n += 1
    return n


def step_times(mx, model, prompt, rows: int, repeats: int):
    """(logits, build ms, run ms) of a pass of `rows` rows after the prompt, medians."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    x = mx.array([list(range(11, 11 + rows))])
    builds, runs, out = [], [], None
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = model(x, cache=cache)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        for c in cache:
            c.offset -= rows
        if i >= 2:
            builds.append(t1 - t0)
            runs.append(t2 - t1)
    return out, 1e3 * statistics.median(builds), 1e3 * statistics.median(runs)


@click.command()
@click.option("--model", default=None)
@click.option("--dtype", default=None)
@click.option("--rows", default="1,2,8")
@click.option("--cached", default=256, show_default=True)
@click.option("--repeats", default=20, show_default=True)
def main(model, dtype, rows, cached, repeats):
    from cacheback_mlx.loader import load

    import mlx.core as mx

    loaded = load(model, dtype=dtype)
    inner = getattr(loaded.model, "model", loaded.model)
    prompt = [(7 * i + 3) % 1000 + 5 for i in range(cached)]
    rows = [int(r) for r in rows.split(",")]
    before = {r: step_times(mx, loaded.model, prompt, r, repeats) for r in rows}
    layers = fuse(mx, inner)
    print(f"{loaded.name}, {loaded.dtype}, {mx.default_device()}; {layers} layers fused, {cached} cached\n")
    print("| rows | build ms | run ms | fused build ms | fused run ms | logits bit-equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        out, b, t = before[r]
        fused_out, fb, ft = step_times(mx, loaded.model, prompt, r, repeats)
        same = mx.array_equal(out, fused_out).item()
        print(f"| {r} | {b:.2f} | {t:.2f} | {fb:.2f} | {ft:.2f} | {same} |")


if __name__ == "__main__":
    main()
