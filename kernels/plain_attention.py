"""A verify pass's attention on CUDA in float16/bfloat16 without cuDNN: MLX's own composition.

For several query rows in half precision, MLX's CUDA backend runs cuDNN's attention, and cuDNN
builds an execution plan for every new shape it sees (MLX keys its plan cache on the exact
lengths). Decoding grows the cache by the tokens each pass accepts, so nearly every verify pass
has a new key length and pays a new plan: on an H100, at the default model's size, a pass of 2-64
rows over a cache that grows cost 54-94 ms, against 9-13 ms at one length and 8-13 ms without
cuDNN (docs/BENCHMARKS.md, the GPU section). Prefill and one-row decoding keep MLX's choice (the
one-row step plans per 256 keys; a prompt is planned once a chunk).

`attention` is what MLX runs when it does not take a fused kernel (mlx/fast.cpp's fallback): the
scaled queries against the keys, the mask (causal, boolean with the dtype's lowest value, or
added), a softmax in float32 (precise), against the values; grouped-query heads by reshaping. On
MLX's CPU backend it gives the bits of `mx.fast.scaled_dot_product_attention` (which runs the same
composition there), which tests/test_kernels.py checks.
"""

from __future__ import annotations

import mlx.core as mx


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """[B, H, T, D] queries over [B, Hk, S, D] keys and values (H a multiple of Hk); `mask`: None,
    "causal" (the last T of the S positions are the queries'), or an array broadcastable to
    [B, H, T, S] (boolean: True attends; else added to the scores)."""
    B, H, T, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    r = H // Hk
    q = queries * mx.array(scale, dtype=queries.dtype)
    k, v = keys, values
    if r > 1:
        q = q.reshape(B, Hk, r, T, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            mask = mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]
        elif mask.dtype != mx.bool_:
            mask = mask.astype(scores.dtype)
        if r > 1 and mask.ndim >= 3:  # per head: split them as the queries' (as MLX does)
            mask = mx.broadcast_to(mask, (B, H, T, S)).reshape(B, Hk, r, T, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(B, H, T, -1) if r > 1 else out
