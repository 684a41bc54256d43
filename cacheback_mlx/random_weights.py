"""Seeded random weight values for random_models.py, fast enough for models of billions of
parameters: one random byte per value, as float or already packed at 4 or 8 bits.

A byte b stands for the value (b - 127.5) * step. The bytes come from two streams of numpy's
PCG64 per (seed, parameter path): the high nibbles (packed two to a byte, the first value's in
the low half: mx.quantize's 4-bit packing) and the low nibbles. So 4-bit weights are the high
stream as it is (half the bytes, no packing), 8-bit weights are the bytes as they are, and both
are the float weights quantized: q8 exactly, q4 to the nearest of 16 levels. The byte arithmetic
runs a cache-sized chunk at a time: big fresh temporaries cost more in page faults than in work.
"""

from __future__ import annotations

import functools
import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np

BYTE_STD = float(np.sqrt((256**2 - 1) / 12))  # std of a uniform byte, in steps
CHUNK = 1 << 18  # values per step of the byte arithmetic


def _stream(seed: int, path: str, which: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(path.encode()), which])
    return rng.integers(0, 256, n, dtype=np.uint8)


def weight_bytes(seed: int, path: str, shape, high_only: bool = False) -> np.ndarray:
    """One random byte per value of a `shape` matrix; with `high_only`, the high nibbles only,
    two to a byte: the matrix packed at 4 bits."""
    n = int(np.prod(shape))
    high = _stream(seed, path, 0, (n + 1) // 2)
    if high_only:
        return high
    low = _stream(seed, path, 1, len(high))
    pairs = np.empty(len(high), "<u2")  # two values' bytes each
    for i in range(0, len(high), CHUNK):
        h, lo = high[i:i + CHUNK].astype("<u2"), low[i:i + CHUNK].astype("<u2")
        pairs[i:i + CHUNK] = ((h & 0x0F) << 4) | (lo & 0x0F) | ((h & 0xF0) << 8) | ((lo & 0xF0) << 4)
    return pairs.view(np.uint8)[:n].reshape(shape)


def transposed(b: np.ndarray, rows: int = 64) -> np.ndarray:
    """b.T, contiguous, `rows` rows of b at a time: eight bytes at a time, then within each 8 x 8
    block (numpy's byte-by-byte transpose is ~5x slower)."""
    r, c = b.shape
    if c % 8:
        return np.ascontiguousarray(b.T)
    out = np.empty((c, r), np.uint8)
    for j in range(0, r, rows):
        block = b[j:j + rows]
        words = np.ascontiguousarray(block.view("<u8").T)  # word (k, i): block[i, 8k : 8k + 8]
        out[:, j:j + len(block)] = words.view(np.uint8).reshape(c // 8, len(block), 8).transpose(0, 2, 1).reshape(c, -1)
    return out


def own_arrays(m: nn.Module) -> list[tuple[str, mx.array]]:
    """The arrays module `m` holds itself (not its submodules')."""
    return [(k, v) for k, v in m.items() if isinstance(v, mx.array)]


@functools.lru_cache(maxsize=None)
def _to_float(dtype: mx.Dtype):
    return mx.compile(lambda b, step: ((b.astype(mx.float32) - 127.5) * step).astype(dtype))


def fill(m: nn.Module, path: str, seed: int, dtype: mx.Dtype, std: float, rows: int | None = None,
         layout: bool = False, keep_float32=lambda name: False) -> dict:
    """New values for the arrays module `m` holds itself: its weight matrix random with std
    `std` (rows from `rows` on zero), in `dtype`, or packed as `m` is quantized (scales and biases
    in `dtype`); biases zero; other vectors (norm gains, SSM constants) as constructed, in `dtype`
    unless `keep_float32(name)`. `layout`: a float32 Linear / Embedding weight is stored as the
    transposed view of an [in, out] matrix, the layout blas.transpose_weights gives (built so, it
    costs a transpose of the bytes instead of one of the floats)."""
    new = {}
    quantized = "scales" in m
    if quantized and m.bits not in (4, 8):
        raise ValueError(f"{path}: {m.bits}-bit layers are not built (only 4 and 8)")
    for name, a in own_arrays(m):
        full = (*a.shape[:-1], a.shape[-1] * 32 // m.bits) if quantized and name == "weight" else a.shape
        if name == "weight" and len(full) >= 2:
            step = np.full((full[0],) + (1,) * (len(full) - 1), std / BYTE_STD, np.float32)
            if rows is not None:
                step[rows:] = 0.0
            b = weight_bytes(seed, f"{path}.{name}", full, high_only=quantized and m.bits == 4)
            if quantized:  # q8: v * step - 127.5 step; q4: v * 16 step - 120 step (bucket centres)
                level, centre = (1.0, 127.5) if m.bits == 8 else (16.0, 120.0)
                new["weight"] = mx.array(np.ascontiguousarray(b).view("<u4").reshape(a.shape))
                new["scales"] = mx.contiguous(mx.broadcast_to(mx.array(step * level), m.scales.shape).astype(dtype))
                new["biases"] = mx.contiguous(mx.broadcast_to(mx.array(step * -centre), m.scales.shape).astype(dtype))
            elif layout and len(full) == 2 and dtype == mx.float32 and isinstance(m, (nn.Linear, nn.Embedding)):
                new["weight"] = _to_float(dtype)(mx.array(transposed(b)), mx.array(step.T)).T
            else:
                new["weight"] = _to_float(dtype)(mx.array(b), mx.array(step))
        elif name == "bias":
            new[name] = mx.zeros(a.shape, dtype)
        elif mx.issubdtype(a.dtype, mx.floating) and not (quantized and name in ("scales", "biases")):
            new[name] = a.astype(mx.float32 if keep_float32(name) else dtype)
    return new
