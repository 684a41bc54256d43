"""GGUF's quantized weights (MLX's affine layout: 4 or 8 bits, groups of 32, float16 scales and
biases) to float32 on the CPU: bit for bit what `mx.dequantize(...).astype(mx.float32)` gives,
in a third of the time, and laid out [in, out] when the caller stores weights so (blas.py).

mx.dequantize computes `q * scale + bias` in float16 on MLX's CPU, rounding after the product
and after the sum. Here the same two roundings happen in float32 on numpy (in place, one tensor
per core): a float16 product of 11-bit numbers is exact in float32, and rounding a float32 sum to
float16 rounds once as float16 would (24 >= 2 * 11 + 2 bits). Float16's subnormals need no case of
their own: a product or sum below 2**-14 is a multiple of 2**-24 with at most 10 bits, exact in
float32 and left alone by the rounding. A check of a slice of each width against mx.dequantize
guards the rest (a CPU whose float16 arithmetic fuses the multiply-add rounds once): where it
differs, MLX's own dequantize runs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

GROUP = 32


def _round_to_half(x: np.ndarray, scratch: np.ndarray) -> None:
    """Round float32 values in place to float16's 10 fraction bits, ties to even."""
    bits = x.view(np.uint32)
    np.right_shift(bits, 13, out=scratch)
    scratch &= 1
    scratch += 0xFFF
    bits += scratch
    bits &= np.uint32(0xFFFFE000)


def _float32(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, in_out: bool) -> np.ndarray:
    """The float32 weight [out, in], or its [in, out] transpose, a band of groups at a time (the
    temporaries stay small, in cache)."""
    packed = w.view(np.uint8)  # 4 bits: two values a byte, the low one first
    rows, groups = scales.shape
    per_byte = 8 // bits
    x = np.empty((groups, GROUP, rows) if in_out else (rows, groups, GROUP), np.float32)
    band = max(1, (1 << 16) // rows)  # groups a band: ~2M values
    for g0 in range(0, groups, band):
        g1 = min(groups, g0 + band)
        p = packed[:, g0 * GROUP // per_byte: g1 * GROUP // per_byte]
        if bits == 8:
            q = p
        else:
            q = np.empty((rows, p.shape[1] * 2), np.uint8)
            np.bitwise_and(p, 0xF, out=q[:, 0::2])
            np.right_shift(p, 4, out=q[:, 1::2])
        s, b = scales[:, g0:g1].astype(np.float32), biases[:, g0:g1].astype(np.float32)
        if in_out:  # each group of 32 runs down a column
            out = x[g0:g1]
            out[...] = q.T.reshape(g1 - g0, GROUP, rows)
            s, b = s.T[:, None, :], b.T[:, None, :]
        else:
            out = x[:, g0:g1]
            out[...] = q.reshape(rows, g1 - g0, GROUP)
            s, b = s[..., None], b[..., None]
        scratch = np.empty(out.shape, np.uint32)
        out *= s
        _round_to_half(out, scratch)
        out += b
        _round_to_half(out, scratch)
    return x.reshape(groups * GROUP, rows) if in_out else x.reshape(rows, groups * GROUP)


def applies(w: mx.array, scales: mx.array, biases: mx.array, bits: int) -> bool:
    """On MLX's CPU, float16 scales and biases, and no value past float16's range (where float16
    gives inf and this path would not)."""
    if not (mx.default_device() == mx.cpu and scales.dtype == biases.dtype == mx.float16 and bits in (4, 8)
            and w.ndim == 2 and w.shape[-1] * 32 // bits == scales.shape[-1] * GROUP):
        return False
    largest = mx.abs(scales).max().astype(mx.float32) * (2**bits - 1) + mx.abs(biases).max().astype(mx.float32)
    return bool(largest < 65000)  # (False for a nan or inf)


def _agrees(w: mx.array, scales: mx.array, biases: mx.array, bits: int) -> bool:
    """This CPU's mx.dequantize gives what _float32 gives, on a slice of a real tensor."""
    n = min(64, w.shape[0])
    w, scales, biases = w[:n], scales[:n], biases[:n]
    theirs = np.asarray(mx.dequantize(w, scales, biases, group_size=GROUP, bits=bits).astype(mx.float32))
    ours = _float32(np.asarray(w), np.asarray(scales), np.asarray(biases), bits, in_out=False)
    return np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))


def to_float32(tensors: dict[str, tuple[mx.array, mx.array, mx.array, int]], in_out: bool) -> dict[str, mx.array]:
    """{name: (weight, scales, biases, bits)} -> {name: float32 weight [out, in]} (with `in_out`, the
    transposed view of an [in, out] copy); the tensors this path does not take are left out."""
    fast = {k: v for k, v in tensors.items() if applies(*v)}
    if not fast or not all(_agrees(*v) for v in {v[3]: v for v in fast.values()}.values()):  # each width
        return {}
    arrays = {k: tuple(np.asarray(a) for a in v[:3]) + (v[3],) for k, v in fast.items()}

    def one(name: str) -> mx.array:
        w, s, b, bits = arrays.pop(name)
        return mx.array(_float32(w, s, b, bits, in_out))

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        out = dict(zip(fast, pool.map(one, list(fast))))
    return {k: (v.T if in_out else v) for k, v in out.items()}
