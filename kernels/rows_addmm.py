"""A biased linear layer's rows in a verify pass, each through the very call a one-row step makes.

MLX runs a linear layer with a bias (`mx.addmm`) through cuBLAS even for a single row (a decoding
step: cuBLASLt with the bias as its epilogue), and cuBLAS picks another algorithm, summing in
another order, for a pass of several rows. No kernel of ours can follow cuBLAS's order, so here each
row of the pass goes through its own one-row call, [1, 1, K] as the step's, which gives the step's
bits at the cost of reading the weight once a row (the planner prices passes from their measured
cost, so it sends fewer rows where that costs too much). Not a kernel: plain MLX, on CUDA in
float16/bfloat16, and float32 (whose products MLX's CUDA backend runs without TF32 here), where `check`
finds the step's bits on the machine (Qwen2's and gpt-oss's attention projections carry biases).
"""

from __future__ import annotations

import mlx.core as mx

MAX_ROWS = 64
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def rows_addmm(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    """x [R, K] @ w.T + b -> [R, N], each row as its own [1, 1, K] call."""
    rows = x[None]
    return mx.concatenate([mx.addmm(b, rows[:, i : i + 1], w.T) for i in range(x.shape[0])], axis=1)[0]


def reference(x: mx.array, w: mx.array, b: mx.array) -> mx.array:
    """The definition: each row, in a buffer of its own, through the layer's one-row call."""
    return mx.concatenate([mx.addmm(b, (x[i : i + 1] * 1)[None], w.T)[0] for i in range(x.shape[0])], axis=0)


CHECK_SHAPES = ((384, 512), (197, 640), (1536, 1536))
CHECK_ROWS = (2, 5, 12)


def check(dtype, rows=CHECK_ROWS, shapes=CHECK_SHAPES, seed: int = 0) -> tuple[bool, str]:
    """On this machine: do rows taken in place from a pass's activations get the bits of the
    one-row step's call? (ok, reason) No speed condition: it is never faster than MLX's own."""
    for n, k in shapes:
        w = (mx.random.normal((n, k), key=mx.random.key(seed + n * 7919 + k)) * k**-0.5).astype(dtype)
        b = mx.random.normal((n,), key=mx.random.key(seed + n)).astype(dtype)
        for r in rows:
            x = mx.random.normal((r, k), key=mx.random.key(seed + n * 7919 + k + 100 + r)).astype(dtype)
            bits = mx.uint32 if dtype == mx.float32 else mx.uint16
            if not mx.all(rows_addmm(x, w, b).view(bits) == reference(x, w, b).view(bits)).item():
                return False, f"{r} rows of [{n}, {k}] differ from the one-row step's bits"
    return True, "rows taken one at a time have the one-row step's bits"
