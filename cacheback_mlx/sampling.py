"""Choosing the target model's token at every row of a verify pass.

Greedy is argmax. Sampling reuses mlx-lm's sampler (temperature, top-p, top-k, min-p) and draws
one token per row; the engine then follows the tree child that holds the row's token and stops at
the first miss (sample-and-match). Each emitted token is thus a draw from the target model's own
distribution at that position, so sampled output keeps exactly the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .errors import CachebackError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise CachebackError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise CachebackError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise CachebackError("top_k must be >= 0")
        if self.seed is not None and self.seed < 0:  # llama.cpp's convention: -1 = a random seed
            object.__setattr__(self, "seed", None)
        if self.seed is not None and self.seed >= 2**64:
            raise CachebackError("seed must be < 2^64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def token_picker(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A function from logits [T, vocab] to one token per row [T]."""
    if params.greedy:
        return lambda logits: mx.argmax(logits, axis=-1)
    top_p = params.top_p if params.top_p < 1 else 0.0
    with_k = make_sampler(temp=params.temperature, top_p=top_p, min_p=params.min_p, top_k=params.top_k)
    without_k = make_sampler(temp=params.temperature, top_p=top_p, min_p=params.min_p)

    def pick(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        sampler = with_k if 0 < params.top_k < logits.shape[-1] else without_k  # k >= vocab: no cut
        return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return pick
