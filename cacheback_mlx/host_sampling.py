"""Sampling a pass's rows on the host, where MLX runs on the CPU.

mlx-lm's samplers sort the whole vocabulary for top-p and draw Gumbel noise for every token, and
on MLX's CPU backend a sort of 49,152 logits takes ~4 ms and an exp or a log ~12 ns an element:
a pass of 8 rows spent ~47 ms choosing its tokens at temperature 0.7 and top-p 0.95 (a pass of
the default model costs ~80 ms), and ~10 ms at a temperature alone (docs/BENCHMARKS.md §18).
Here each row is chosen with NumPy from the same filters, in mlx-lm's order and by its rules:

- top-p keeps the most probable tokens until the probability above the next one reaches top_p
  (mlx-lm's `apply_top_p`: a token stays while the mass strictly above it is below top_p, ties at
  the last one kept stay too). Only tokens whose probability is at least (1 - top_p) / vocab of
  the whole can stay (all the tokens below that hold less than 1 - top_p together), so only those
  are sorted;
- min-p keeps the tokens within log(min_p) of the best; top-k the k best (ties at the k-th stay);
- the token is drawn from the kept ones with probability proportional to exp(logit / temperature),
  by inverting their cumulative sum at one uniform number: a draw from exactly that distribution.

The uniform number of a seeded request comes from the hash of its seed and the token's position
(`position_bits`, which sampling.position_key makes its key of), so a position samples the same token however
the passes are cut; an unseeded one comes from MLX's global random state. Sums are in float64:
mlx-lm's top-p sums in float32, largest first, which loses the smallest probabilities' mass, so
at top-p 0.9-0.99 it can keep a token or a few fewer at the boundary (under 0.1% of the mass).
Used on MLX's CPU device (sampling.token_picker); CACHEBACK_MLX_HOST_SAMPLING=0 keeps mlx-lm's
samplers there too (to measure). On a GPU the samplers stay MLX's: a sort there is cheap, and
the host would wait for every pass.
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx
import numpy as np


def position_bits(seed: int | str, position: int) -> int:
    """64 random bits for one position of a seeded request: a hash of the seed and the position."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest(), "little")


def position_uniform(seed: int | str, position: int) -> float:
    """A uniform number in [0, 1) for one position of a seeded request (53 of its bits)."""
    return (position_bits(seed, position) >> 11) * 2.0**-53


def cut(logits: np.ndarray, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0) -> float:
    """The lowest logit the filters keep (top-p, min-p, top-k, in mlx-lm's order; 0 = off): every
    token at or above it stays; -inf when no filter is on."""
    vocab = logits.shape[-1]
    best = float(logits.max())
    lowest = -math.inf
    if not math.isfinite(best):  # no finite best (a broken row): nothing to filter by
        return lowest
    if 0.0 < top_p < 1.0:
        p = np.exp(logits - best)
        total = float(p.sum(dtype=np.float64))
        able = np.flatnonzero(p >= (1.0 - top_p) * total / vocab)  # the tokens that can stay
        order = able[np.argsort(-logits[able], kind="stable")]
        mass = p[order].astype(np.float64)
        above = np.cumsum(mass) - mass  # the mass strictly above each, best first
        kept = int(np.count_nonzero(above < top_p * total))
        lowest = float(logits[order[max(kept, 1) - 1]])
    if min_p > 0.0:
        lowest = max(lowest, best + math.log(min_p))
    if 0 < top_k < vocab:
        lowest = max(lowest, float(np.partition(logits, vocab - top_k)[vocab - top_k]))
    return lowest


def xtc_dropped(logits: np.ndarray, threshold: float, special=()) -> np.ndarray:
    """XTC ("exclude top choices", mlx-lm's apply_xtc) on one row (-inf: filtered out already): the
    tokens to drop, those more probable than the least probable token above `threshold`, so every
    likely choice but the least likely of them goes; `special` ids (a new line, the EOS) never."""
    with np.errstate(all="ignore"):
        p = np.exp(logits.astype(np.float64) - float(logits.max()))
    p /= p.sum()
    above = p > threshold
    if not above.any():
        return np.zeros(len(logits), dtype=bool)
    drop = p > p[above].min()
    drop[[i for i in special if 0 <= i < len(drop)]] = False
    return drop


def kept_tokens(logits: np.ndarray, top_p: float = 0.0, min_p: float = 0.0, top_k: int = 0,
                xtc: tuple | None = None) -> np.ndarray | None:
    """The ids the filters keep (None: every token), XTC's (threshold, special ids) among them
    where it applies, after top-p and min-p and before top-k as mlx-lm's make_sampler orders them."""
    if xtc is None:
        lowest = cut(logits, top_p, min_p, top_k)
        return np.flatnonzero(logits >= lowest) if lowest > -math.inf else None
    lowest = cut(logits, top_p, min_p)
    row = np.where(logits >= lowest, logits, -np.inf)
    row[xtc_dropped(row, *xtc)] = -np.inf
    if 0 < top_k < int(np.count_nonzero(row > -np.inf)):
        row[row < np.partition(row, len(row) - top_k)[len(row) - top_k]] = -np.inf
    return np.flatnonzero(row > -np.inf)


def choose(logits: np.ndarray, uniform: float, temperature: float, top_p: float = 0.0, min_p: float = 0.0,
           top_k: int = 0, xtc: tuple | None = None) -> int:
    """One row's token: the tokens the filters keep (`cut`), drawn with probability proportional to
    exp(logit / temperature) where their running sum passes `uniform` of the whole (`draw`).
    `xtc`: (threshold, special ids) where XTC applies to this row: after top-p and min-p, before
    top-k, as mlx-lm's make_sampler orders them (xtc_dropped)."""
    kept = kept_tokens(logits, top_p, min_p, top_k, xtc)
    candidates = logits if kept is None else logits[kept]
    with np.errstate(all="ignore"):
        weights = np.exp((candidates - float(candidates.max())) * (1.0 / temperature))  # XTC may drop the best
    if not 0.0 < float(weights.sum(dtype=np.float64)) < math.inf:  # a temperature so small that 1 / it
        i = int(np.argmax(candidates))  # overflows, or logits without a finite best: its limit, the best
    else:
        i = draw(weights, uniform)
    return i if kept is None else int(kept[i])


BLOCK = 256  # draw(): weights summed by blocks first (NumPy's cumsum is ~3 ns an element)


def draw(weights: np.ndarray, uniform: float) -> int:
    """The index where the weights' running sum first passes `uniform` of their total: index i
    with probability weights[i] / total (a weight of 0 is never drawn)."""
    n = len(weights)
    start = 0
    if n > 4 * BLOCK:  # the block first, then the index inside it
        blocks = np.cumsum(np.pad(weights, (0, -n % BLOCK)).reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))
        target = uniform * blocks[-1]
        j = int(np.searchsorted(blocks, target, side="right"))
        if j >= len(blocks):  # rounding at the very top: the last block that can be drawn
            j = int(np.flatnonzero(np.diff(blocks, prepend=0.0) > 0)[-1])
        uniform = (target - (blocks[j - 1] if j else 0.0)) / max(blocks[j] - (blocks[j - 1] if j else 0.0), 1e-300)
        start, weights = j * BLOCK, weights[j * BLOCK : (j + 1) * BLOCK]
    running = np.cumsum(weights, dtype=np.float64)
    i = int(np.searchsorted(running, min(uniform, 1.0) * running[-1], side="right"))
    if i >= len(weights):  # rounding at the very top: the last token that can be drawn
        i = int(np.flatnonzero(weights > 0)[-1])
    return start + i


def xtc_uniform(seed: int, position: int) -> float:
    """The uniform number that decides whether XTC applies at one position of a seeded request
    (apart from the draw's own, position_uniform)."""
    return position_uniform(f"{seed}:xtc", position)


def host_picker(temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None,
                xtc: tuple[float, float, tuple] = (0.0, 0.1, ())):
    """pick(logits [rows, vocab], first, tree) -> the rows' tokens (an mx.array), each row chosen
    by `choose` on the host; positions as in sampling.token_picker. `xtc`: (probability,
    threshold, special ids): each row applies XTC with that probability, on a number of its own."""
    chance, threshold, special = xtc

    def pick(logits: mx.array, first: int = 0, tree=None) -> mx.array:
        logits = logits.astype(mx.float32)
        rows = logits.shape[0]
        if seed is None:
            uniforms = mx.random.uniform(shape=(2 if chance > 0 else 1, rows))
            mx.eval(logits, uniforms)
            uniforms, coins = uniforms[0].tolist(), (uniforms[1].tolist() if chance > 0 else [1.0] * rows)
        else:
            positions = tree.positions(first) if tree is not None else [first]
            uniforms = [position_uniform(seed, int(p)) for p in positions]
            coins = [xtc_uniform(seed, int(p)) if chance > 0 else 1.0 for p in positions]
            mx.eval(logits)
        return mx.array([choose(row, u, temperature, top_p, min_p, top_k,
                                (threshold, special) if c < chance else None)
                         for row, u, c in zip(np.asarray(logits), uniforms, coins)], dtype=mx.int32)

    return pick
