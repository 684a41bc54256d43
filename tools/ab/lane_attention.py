"""What the attention of a shared pass costs: the lanes' rows stacked over their own caches (as
shared_pass.LaneView runs them) against a solo pass's as many rows over one cache, every layer
of the model, and how much of it is the two matmuls.

    .venv/bin/python -m tools.ab.lane_attention [--model M] [--context 400] [--layouts "4x1;8x1;4x2"]

A layout "4x2" is 4 lanes of 2 rows. Every lane holds `--context` cached keys (random values of the
model's head shape, float32); each layout runs attention.cpu_attention once per layer, as many
layers as the model has, timed --repeats times after two warm-ups (median). "KV MB" is what the
keys and values read come to; GB/s that over the time. A shared pass's extra time over a solo
pass of as many rows (tools.ab.lane_pass) is mostly this: every lane reads its own keys and
values, in two small matrix products per lane and key head.
"""

from __future__ import annotations

import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click


@click.command()
@click.option("--model", "-m", default=None)
@click.option("--context", default=400)
@click.option("--layouts", default="1x1;4x1;8x1;4x2;2x4")
@click.option("--repeats", default=9)
def main(model, context, layouts, repeats):
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.attention import cpu_attention

    import mlx.core as mx
    import numpy as np

    lm = load_cached(model)
    args = lm.model.args
    H, Hk = args.num_attention_heads, args.num_key_value_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // H
    L = len(lm.model.layers)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            mx.eval([fn(i) for i in range(L)])
            times.append(time.perf_counter() - t0)
        return float(np.median(times[2:])) * 1e3

    print(f"{lm.name}: {L} layers, {H} heads, {Hk} key heads of {D}; {context} cached keys a lane; "
          f"ms for every layer, median of {repeats}")
    print("| lanes x rows | stacked ms | of it matmuls ms | KV MB | GB/s | solo pass, as many rows, ms "
          "| stacked / solo |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for layout in layouts.split(";"):
        lanes, rows = (int(x) for x in layout.split("x"))
        S, cap = context + rows, context + rows + 64
        k = [mx.random.normal((lanes, Hk, cap, D)) for _ in range(L)]
        v = [mx.random.normal((lanes, Hk, cap, D)) for _ in range(L)]
        q = mx.random.normal((lanes, H, rows, D))
        mask = mx.broadcast_to(mx.arange(S)[None] <= mx.arange(context, S)[:, None], (lanes, 1, rows, S))
        solo_q = mx.random.normal((1, H, lanes * rows, D))
        solo_mask = mx.arange(context + lanes * rows)[None] <= mx.arange(context, context + lanes * rows)[:, None]
        mx.eval(k, v, q, mask, solo_q, solo_mask)
        grouped = q.reshape(lanes, Hk, H // Hk * rows, D)
        stacked = timed(lambda i: cpu_attention(q, k[i][:, :, :S], v[i][:, :, :S], D**-0.5, mask))
        matmuls = timed(lambda i: (grouped @ k[i][:, :, :S].swapaxes(-1, -2)) @ v[i][:, :, :S])
        solo = timed(lambda i: cpu_attention(solo_q, k[i][:1, :, : context + lanes * rows],
                                             v[i][:1, :, : context + lanes * rows], D**-0.5, solo_mask))
        mb = 2 * lanes * Hk * S * D * 4 * L / 1e6
        print(f"| {lanes} x {rows} | {stacked:.1f} | {matmuls:.1f} | {mb:.0f} | {mb / stacked:.1f} | {solo:.1f} | "
              f"{stacked / solo:.2f} |", flush=True)


if __name__ == "__main__":
    main()
