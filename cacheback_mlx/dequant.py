"""Quantized weights (MLX's affine layout: 4 or 8 bits, float16 or bfloat16 scales and biases; a
GGUF's blocks or an mlx-lm folder's layers) to float32 on the CPU: bit for bit what
`mx.dequantize(...).astype(mx.float32)` gives, in a third to a half of the time, laid out
[in, out] when the caller stores weights so (blas.py).

mx.dequantize computes `q * scale + bias` in the scales' 16-bit type on MLX's CPU, rounding after
the product and after the sum. Here the same two roundings happen in float32 on numpy (in place,
a band at a time, one tensor per core): a product of 11-bit (8-bit) numbers is exact in float32,
and rounding a float32 sum to 16 bits rounds once as the 16-bit sum would (24 >= 2 * 11 + 2
bits). Float16's subnormals need no case of their own: a product or sum below 2**-14 is a
multiple of 2**-24 with at most 10 bits, exact in float32 and left alone by the rounding; bfloat16
shares float32's exponents. A check of a slice of each kind against mx.dequantize guards the rest
(a CPU whose 16-bit arithmetic fuses the multiply-add rounds once): where it differs, MLX's own
dequantize runs."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

DROPPED = {mx.float16: 13, mx.bfloat16: 16}  # float32 fraction bits the 16-bit type lacks
LARGEST = {mx.float16: 65000.0, mx.bfloat16: 3e38}  # past these the 16-bit sum may be inf


def _round(x: np.ndarray, scratch: np.ndarray, drop: int) -> None:
    """Round float32 values in place to `23 - drop` fraction bits, ties to even."""
    bits = x.view(np.uint32)
    np.right_shift(bits, drop, out=scratch)
    scratch &= 1
    scratch += (1 << (drop - 1)) - 1
    bits += scratch
    bits &= np.uint32(0xFFFFFFFF ^ ((1 << drop) - 1))


def _float32(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int, drop: int,
             in_out: bool) -> np.ndarray:
    """The float32 weight [out, in], or its [in, out] transpose, from float32 scales and biases
    holding 16-bit values; a band of groups at a time (the temporaries stay small, in cache)."""
    packed = w.view(np.uint8)  # 4 bits: two values a byte, the low one first
    rows, groups = scales.shape
    per_byte = 8 // bits
    x = np.empty((groups, group, rows) if in_out else (rows, groups, group), np.float32)
    band = max(1, (1 << 21) // (rows * group))  # groups a band: ~2M values
    for g0 in range(0, groups, band):
        g1 = min(groups, g0 + band)
        p = packed[:, g0 * group // per_byte: g1 * group // per_byte]
        if bits == 8:
            q = p
        else:
            q = np.empty((rows, p.shape[1] * 2), np.uint8)
            np.bitwise_and(p, 0xF, out=q[:, 0::2])
            np.right_shift(p, 4, out=q[:, 1::2])
        s, b = scales[:, g0:g1], biases[:, g0:g1]
        if in_out:  # each group runs down a column
            out = x[g0:g1]
            out[...] = q.T.reshape(g1 - g0, group, rows)
            s, b = s.T[:, None, :], b.T[:, None, :]
        else:
            out = x[:, g0:g1]
            out[...] = q.reshape(rows, g1 - g0, group)
            s, b = s[..., None], b[..., None]
        scratch = np.empty(out.shape, np.uint32)
        out *= s
        _round(out, scratch, drop)
        out += b
        _round(out, scratch, drop)
    return x.reshape(groups * group, rows) if in_out else x.reshape(rows, groups * group)


def applies(w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int) -> bool:
    """On MLX's CPU, affine 4- or 8-bit groups, 16-bit scales and biases, and nothing past the
    16-bit type's range (where its sum gives inf and this path would not)."""
    if not (mx.default_device() == mx.cpu and biases is not None and scales.dtype in DROPPED
            and biases.dtype == scales.dtype and bits in (4, 8) and w.ndim == 2 and scales.ndim == 2
            and w.shape[-1] * 32 // bits == scales.shape[-1] * group):
        return False
    largest = mx.abs(scales).max().astype(mx.float32) * (2**bits - 1) + mx.abs(biases).max().astype(mx.float32)
    return bool(largest < LARGEST[scales.dtype])  # (False for a nan or inf)


def _numpy(w: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int) -> tuple:
    f32 = lambda a: np.asarray(a.astype(mx.float32))  # (numpy has no bfloat16; the cast is exact)
    return np.asarray(w), f32(scales), f32(biases), bits, group, DROPPED[scales.dtype]


def _agrees(w: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int) -> bool:
    """This CPU's mx.dequantize gives what _float32 gives, on a slice of a real tensor."""
    n = min(64, w.shape[0])
    w, scales, biases = w[:n], scales[:n], biases[:n]
    theirs = np.asarray(mx.dequantize(w, scales, biases, group_size=group, bits=bits).astype(mx.float32))
    ours = _float32(*_numpy(w, scales, biases, bits, group), in_out=False)
    return np.array_equal(theirs.view(np.uint32), ours.view(np.uint32))


def to_float32(tensors: dict[str, tuple[mx.array, mx.array, mx.array | None, int, int]],
               in_out: bool) -> dict[str, mx.array]:
    """{name: (weight, scales, biases, bits, group size)} -> {name: float32 weight [out, in]} (with
    `in_out`, the transposed view of an [in, out] copy); the tensors this path does not take are
    left out."""
    fast = {k: v for k, v in tensors.items() if applies(*v)}
    kinds = {(v[1].dtype, v[3], v[4]): v for v in fast.values()}  # one of each type, width and group
    if not fast or not all(_agrees(*v) for v in kinds.values()):
        return {}
    arrays = {k: _numpy(*v) for k, v in fast.items()}
    one = lambda name: mx.array(_float32(*arrays.pop(name), in_out))
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        out = dict(zip(fast, pool.map(one, list(fast))))
    return {k: (v.T if in_out else v) for k, v in out.items()}
