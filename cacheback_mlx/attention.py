"""Attention for the engine's passes on MLX's CPU backend: verify passes, decoding steps over a
long cache, and prefill chunks.

On the CPU, `mx.fast.scaled_dot_product_attention` is a plain matmul -> softmax -> matmul, and it is
slow in three places (docs/BENCHMARKS.md §2): with a few query rows its exp dominates (MLX's CPU
exp runs at ~12 ns an element on the x86 wheels: 8 rows over 3,000 cached tokens spend ~2.6 ms a
layer in it); one row over thousands of keys takes ~1.2 ms a layer; and a prefill chunk's scores
(512 rows x 3,500 keys x 9 heads, 64 MB a layer) are far bigger than the CPU's caches. Here the
softmax's exp is a range-reduced polynomial (2^x = 2^n * p(f), |f| <= 1/2, degree 7: within ~1 ulp
of float32 exp) that MLX compiles into one vectorised elementwise kernel, 1.4-5x faster (by CPU and
shape; its exp is still most of an attention's time over many rows), and many query
rows are taken in blocks of 8-16, each a whole softmax over every key (the same result, with scores
that stay small); the matmuls stay MLX's (BLAS).

Used where it pays and nothing else changes: the CPU device, float32, no attention sinks, the
engine's own caches (a cache class with `fast_attention = True`), and any number of rows except one
row of one sequence over a short cache (there MLX's kernel is as fast; the lanes of a batch,
several sequences' rows in one call, are faster here). mlx-lm's own caches (so plain mlx-lm in the
same process), Metal and CUDA keep MLX's fused kernel. CACHEBACK_MLX_FAST_ATTENTION=0 turns it off
(to measure it).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
from mlx_lm.models import base

from . import kernels

LOG2E = 1.4426950408889634
# Taylor coefficients of 2^f = e^(f ln 2): ln2^k / k!, k = 1..7 (error < 1e-8 for |f| <= 1/2)
COEFFS = (0.6931471805599453, 0.2402265069591007, 0.05550410866482158, 0.009618129107628477,
          0.0013333558146428443, 0.00015403530393381608, 1.525273380405984e-05)

enabled = os.environ.get("CACHEBACK_MLX_FAST_ATTENTION", "1") != "0"
VERSION = 3  # where it is used and how fast: part of the verify-cost cache key (costs.cost_path)
stock = base.scaled_dot_product_attention


MAGIC = 12582912.0  # 1.5 * 2^23: (y + MAGIC) - MAGIC rounds y to the nearest integer in float32


def exp_parts(x: mx.array, shift) -> tuple[mx.array, mx.array]:
    """For x <= shift: p(f) and the float32 bits of 2^n, with (x - shift) * log2(e) = n + f,
    |f| <= 1/2. The rounding adds and takes away 1.5 * 2^23 (ties to even, like mx.round) so the
    whole graph compiles to one vectorised loop (MLX's CPU round is a scalar call)."""
    y = mx.maximum((x - shift) * LOG2E, -127.0)  # 2^-127 and below: 0 (the exponent bits below are 0)
    n = (y + MAGIC) - MAGIC
    f = y - n
    p = COEFFS[-1]
    for c in reversed(COEFFS[:-1]):
        p = c + f * p
    return 1.0 + f * p, (n.astype(mx.int32) + 127) << 23


# One elementwise kernel for every shape (a graph per shape would pile up in a long session).
# The bit cast stays outside: a shapeless graph cannot hold a view.
_compiled_parts = mx.compile(exp_parts, shapeless=True)


def exp_nonpositive(x: mx.array, shift=0.0, parts=None) -> mx.array:
    """exp(x - shift) for x <= shift (a softmax's numerators, shift = the row's max); -inf gives 0.
    Within ~1e-7 relative of exp for x - shift >= -10; float32 range reduction limits it to ~4e-6
    near the bottom of the normal range (~ -87), where the values are < 1e-37."""
    p, bits = (parts or exp_parts)(x, shift)
    return p * bits.view(mx.float32)


def _fused_exp(x: mx.array, shift=0.0) -> mx.array:
    """exp_nonpositive through the compiled kernel (MLX's CPU compiler needs a C++ compiler;
    without one, plain ops)."""
    global _compiled_parts
    try:
        return exp_nonpositive(x, shift, _compiled_parts)
    except Exception as e:  # noqa: BLE001 - any failure to build the kernel: the uncompiled ops
        if _compiled_parts is exp_parts:
            raise
        print(f"cacheback-mlx: no compiled exp kernel ({type(e).__name__}: {e}); using plain ops", file=sys.stderr)
        _compiled_parts = exp_parts
        return exp_nonpositive(x, shift)


def block_rows(keys: int) -> int:
    """Query rows per block: a block's scores stay small enough to be cheap to pass over several
    times (8 rows x 3,000 keys x 9 heads ~ 0.9 MB); measured on the default model, docs §2."""
    return 16 if keys < 1000 else 8


def cpu_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v for [B, H, T, D] queries over [B, Hk, S, D] keys (H a
    multiple of Hk); mask: None, "causal", a bool array (True = seen) or an additive array, either
    [T, S] or [B, 1 or H, T, S]. Many rows (prefill chunks) go in blocks of block_rows(S), each a
    softmax over every key: the same result, with scores that stay small."""
    T, S = queries.shape[2], keys.shape[2]
    if isinstance(mask, str):
        mask = mx.arange(S)[None] <= mx.arange(S - T, S)[:, None]
    rows = block_rows(S)
    if T <= rows:
        return _attend(queries, keys, values, scale, mask)
    return mx.concatenate([_attend(queries[:, :, i : i + rows], keys, values, scale,
                                   None if mask is None else mask[..., i : i + rows, :])
                           for i in range(0, T, rows)], axis=2)


def _attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    B, H, T, _ = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    r = H // Hk
    scores = ((queries * scale).reshape(B, Hk, r * T, -1) @ keys.swapaxes(-1, -2)).reshape(B, Hk, r, T, S)
    if mask is not None:
        if mask.ndim == 4:  # [B, 1 or H, T, S] -> [B, 1 or Hk, 1 or r, T, S]
            mask = (mask.reshape(mask.shape[0], 1, 1, T, S) if mask.shape[1] == 1
                    else mask.reshape(mask.shape[0], Hk, r, T, S))
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    e = _fused_exp(scores, scores.max(-1, keepdims=True))
    out = (e.reshape(B, Hk, r * T, S) @ values) / e.sum(-1).reshape(B, Hk, r * T, 1)
    return out.reshape(B, H, T, -1)


# Where it wins (tools/ab/attention.py, docs/BENCHMARKS.md §2): one row over a short cache is level
# with MLX's kernel, so that stays MLX's; everything else is faster here: 2-8 rows up to ~2x at
# long contexts, prefill chunks (in blocks) ~1.3-2x, 8 lanes of one row each ~1.7x (docs §10).
MIN_KEYS_ONE_ROW = 512  # one query row: ours from this many keys on


def _usable(queries, keys, cache, sinks, mask) -> bool:
    T, S = queries.shape[2], keys.shape[2]
    return (enabled and sinks is None and getattr(cache, "fast_attention", False)
            and (T > 1 or S >= MIN_KEYS_ONE_ROW or queries.shape[0] > 1)
            and queries.dtype == mx.float32 and queries.shape[1] % keys.shape[1] == 0
            and (mask is None or isinstance(mask, str) or mask.ndim in (2, 4))
            and mx.default_device() == mx.cpu)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with cpu_attention where it applies; a pass
    several sequences share goes to shared_pass.LaneView.attend."""
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, scale, mask, sinks)
    attend_keys = getattr(mask, "attend_keys", None)  # a shared pass's layer over another layer's keys
    if attend_keys is not None:
        return attend_keys(queries, keys, scale, sinks)
    if hasattr(cache, "bits"):  # quantized keys and values: mlx-lm's quantized attention
        return stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if queries.shape[2] > 1 and kernels.in_rows_pass():  # a verify pass on a GPU (kernels/)
        out = kernels.rows_attention(stock, queries, keys, values, cache, scale, mask, sinks)
        if out is None:
            out = kernels.pass_attention(queries, keys, values, scale, mask, sinks)
        if out is not None:
            return out
    if _usable(queries, keys, cache, sinks, mask):
        return cpu_attention(queries, keys, values, scale, mask)
    return stock(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(module_names) -> None:
    """Route the attention of these mlx-lm model modules through scaled_dot_product_attention
    above (modules that call mlx-lm's shared one; once each)."""
    for name in module_names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is stock:
            module.scaled_dot_product_attention = scaled_dot_product_attention
