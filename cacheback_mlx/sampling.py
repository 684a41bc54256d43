"""Choosing the target model's token at every row of a verify pass.

Greedy is argmax. Sampling applies mlx-lm's filters (top-p, min-p, top-k) and temperature and
draws one token per row (a seeded request from keys of its seed and each token's position): with
mlx-lm's samplers on a GPU, on the host on MLX's CPU device (host_sampling.py); the engine
then follows the tree child that holds the row's token and stops at the first miss
(sample-and-match). Each emitted token is thus a draw from the target model's own
distribution at that position, so sampled output keeps exactly the target's distribution.

mlx-lm's logits processors (repetition, presence and frequency penalties, logit biases: `penalties`
builds them as mlx-lm's server does) change each row's logits before it is chosen, each row with the
tokens before its own position: the sequence so far, then the tree's path down to the row's node.
A row thus gets the logits mlx-lm's generate_step would give its sampler at that position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .errors import CachebackError
from .host_sampling import host_picker, position_bits, xtc_uniform

HOST_SAMPLING = os.environ.get("CACHEBACK_MLX_HOST_SAMPLING", "1") != "0"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logits_processors: tuple = ()  # mlx-lm's: (tokens, logits [1, vocab]) -> logits, applied in order
    logprobs: bool = False  # each token's log-probabilities too (engine.Accepted)
    # XTC, as mlx-lm's make_sampler: at each position with this probability, the tokens more probable
    # than the least probable one above the threshold are left out (host_sampling.xtc_dropped)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special: tuple = ()  # ids XTC never leaves out (mlx_lm.generate's: a new line and the EOS ids)

    def __post_init__(self):
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))
        if not all(callable(p) for p in self.logits_processors):
            raise CachebackError("logits_processors must be callables (tokens, logits) -> logits")
        if self.temperature < 0:
            raise CachebackError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise CachebackError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise CachebackError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise CachebackError("min_p must be in [0, 1]")
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise CachebackError("xtc_probability must be in [0, 1]")
        if not 0.0 <= self.xtc_threshold <= 0.5:
            raise CachebackError("xtc_threshold must be in [0, 0.5]")
        object.__setattr__(self, "xtc_special", tuple(int(t) for t in self.xtc_special or ()))
        if self.seed is not None and self.seed < 0:  # llama.cpp's convention: -1 = a random seed
            object.__setattr__(self, "seed", None)
        if self.seed is not None and self.seed >= 2**64:
            raise CachebackError("seed must be < 2^64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def xtc_special(tokenizer, eos_ids) -> tuple[int, ...]:
    """The ids XTC never leaves out, as mlx_lm.generate and mlx-lm's server give them: a new line's
    tokens and the EOS ids."""
    return tuple(tokenizer.encode("\n", add_special_tokens=False)) + tuple(sorted(eos_ids))


WHOLE = 1 << 30  # a penalty's window reaching back over the whole sequence


def penalties(repetition: float | None = None, presence: float = 0.0, frequency: float = 0.0, window: int = 20,
              logit_bias: dict[int, float] | None = None) -> tuple:
    """mlx-lm's logits processors for a request's penalties over its last `window` tokens (prompt
    included, as mlx-lm's generate_step counts them; -1: the whole sequence, 0: none) and its logit
    biases; none for a penalty that changes nothing (repetition 0 or 1, the others 0)."""
    if window < -1:
        raise CachebackError("a penalty's window must be >= -1")
    if repetition is not None and repetition < 0:
        raise CachebackError("repetition_penalty must be >= 0")
    size = WHOLE if window == -1 else window
    on = size > 0
    return tuple(make_logits_processors(
        logit_bias=logit_bias or None,
        repetition_penalty=repetition if on and repetition not in (None, 0.0, 1.0) else None,
        repetition_context_size=size,
        presence_penalty=presence if on and presence else None, presence_context_size=size,
        frequency_penalty=frequency if on and frequency else None, frequency_context_size=size))


def processed_rows(processors: Sequence[Callable], logits: mx.array, history: Sequence[int], tree) -> mx.array:
    """Every row of a pass's logits (the root's, then each node's) through the processors, each row
    with the tokens before its own next one: `history` (the sequence so far, the root's token last),
    then the tree's path down to the row's node. The logits as they are without processors."""
    if not processors:
        return logits
    paths = [np.asarray(history, np.int32)]  # row r's tokens: its node's parent's, then the node's token
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()) if tree is not None else ():
        paths.append(np.append(paths[parent + 1], np.int32(token)))
    rows = []
    for r, tokens in enumerate(paths[: logits.shape[0]]):
        row, ids = logits[r : r + 1], mx.array(tokens)
        for process in processors:
            row = process(ids, row)
        rows.append(row)
    return mx.concatenate(rows) if len(rows) > 1 else rows[0]


def accepted_logprobs(logits: mx.array, path: Sequence[int]) -> mx.array:
    """The log-probabilities of a pass's accepted tokens ([1 + len(path), vocab]): each from the row
    that predicted it (the root's for the first, then the row of each node on the accepted path),
    as mlx-lm's generate_step computes them (logits - logsumexp(logits)). The rows are copied out at
    once (so they do not keep the pass's other rows alive); the rest runs only when read (a
    logsumexp over the vocabulary costs ~0.7 ms a row on a CPU)."""
    chosen = logits[mx.array([0] + [1 + i for i in path])]
    mx.async_eval(chosen)
    return chosen - mx.logsumexp(chosen, axis=-1, keepdims=True)


def token_picker(params: SamplingParams) -> Callable[..., mx.array]:
    """A function pick(logits [1 + len(tree), vocab], first, tree) -> one token per row: the rows
    of a pass over the root (the token at position `first`) and the tree's nodes, their logits
    processed already (processed_rows). A seeded one draws each position's token from a key of
    that seed and position (seeded_picker); an unseeded one from MLX's global random state, as
    mlx-lm does."""
    if params.greedy:
        return lambda logits, first=0, tree=None: mx.argmax(logits, axis=-1)
    top_p = params.top_p if params.top_p < 1 else 0.0
    if HOST_SAMPLING and mx.default_device() == mx.cpu:  # MLX's CPU sort and exp are slow: host_sampling.py
        return host_picker(params.temperature, top_p, params.min_p, params.top_k, params.seed,
                           (params.xtc_probability, params.xtc_threshold, params.xtc_special))
    if params.seed is not None or params.xtc_probability > 0:  # XTC: a number of its own for every row
        return seeded_picker(params, top_p)
    with_k = make_sampler(temp=params.temperature, top_p=top_p, min_p=params.min_p, top_k=params.top_k)
    without_k = make_sampler(temp=params.temperature, top_p=top_p, min_p=params.min_p)

    def pick(logits: mx.array, first=0, tree=None) -> mx.array:
        logits = logits.astype(mx.float32)
        sampler = with_k if 0 < params.top_k < logits.shape[-1] else without_k  # k >= vocab: no cut
        return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return pick


TOP_BLOCK = 256  # top_tokens: logits per block


def top_tokens(logits: mx.array, k: int) -> mx.array:
    """The k highest logits' token ids in every row, best first ([rows, k]; ties in any order).
    Exact and cheap for a large vocabulary: the k best tokens lie in the k blocks of TOP_BLOCK
    logits with the highest maxima (a token outside them has k better blocks' maxima above it), so
    only those k blocks (and the last, shorter one) are sorted, where a sort or a partition of the
    whole vocabulary costs ~10x an argmax on a CPU."""
    rows, vocab = logits.shape
    k = min(k, vocab)
    n = vocab // TOP_BLOCK
    if n <= k:  # a small vocabulary: sort it whole
        return mx.argsort(-logits, axis=-1)[:, :k]
    whole = logits[:, : n * TOP_BLOCK].reshape(rows, n, TOP_BLOCK)
    blocks = mx.argpartition(-whole.max(axis=-1), k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(whole, blocks[..., None], axis=1).reshape(rows, k * TOP_BLOCK)
    if n * TOP_BLOCK < vocab:  # the last block, shorter: always a candidate
        values = mx.concatenate([values, logits[:, n * TOP_BLOCK :]], axis=1)
    best = mx.argpartition(-values, k - 1, axis=-1)[:, :k]
    best = mx.take_along_axis(best, mx.argsort(-mx.take_along_axis(values, best, axis=1), axis=-1), axis=1)
    inside = mx.take_along_axis(blocks, mx.minimum(best // TOP_BLOCK, k - 1), axis=1) * TOP_BLOCK + best % TOP_BLOCK
    return mx.where(best < k * TOP_BLOCK, inside, best - k * TOP_BLOCK + n * TOP_BLOCK)


def position_key(seed: int, position: int) -> mx.array:
    """The random key of one position of a seeded request."""
    return mx.random.key(position_bits(seed, position))


def seeded_picker(params: SamplingParams, top_p: float) -> Callable[..., mx.array]:
    """mlx-lm's filters (top-p, min-p, XTC, top-k, in its order), then a Gumbel-max draw whose noise
    for the token at position p comes from position_key(seed, p). Every position's draw is
    independent of the others', so each token still follows the model's distribution; and a seeded
    request gives the same text however its passes are cut: with any drafter, budget, or other
    requests sharing its passes (batch.py). Unseeded (a request with XTC, whose every row needs a
    number of its own where mlx-lm's sampler draws one for all), the numbers are MLX's."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    def pick(logits: mx.array, first: int = 0, tree=None) -> mx.array:
        logits = logits.astype(mx.float32)
        logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows, vocab = logits.shape
        if 0 < top_p < 1.0:
            logits = apply_top_p(logits, top_p)
        if params.min_p != 0.0:
            logits = apply_min_p(logits, params.min_p, 1)
        positions = tree.positions(first) if params.seed is not None and tree is not None else [first]
        if params.xtc_probability > 0:
            coins = (mx.array([xtc_uniform(params.seed, int(p)) for p in positions]) if params.seed is not None
                     else mx.random.uniform(shape=(rows,)))
            logits = xtc_rows(logits, coins < params.xtc_probability, params.xtc_threshold, params.xtc_special)
        if 0 < params.top_k < vocab:  # k >= vocab: no cut
            logits = apply_top_k(logits, params.top_k)
        if params.seed is None:
            noise = mx.random.gumbel((rows, vocab))
        else:
            noise = mx.stack([mx.random.gumbel((vocab,), key=position_key(params.seed, int(p))) for p in positions])
        return mx.argmax(logits * (1.0 / params.temperature) + noise, axis=-1)

    return pick


def xtc_rows(logits: mx.array, apply: mx.array, threshold: float, special: Sequence[int] = ()) -> mx.array:
    """mlx-lm's apply_xtc on the rows where `apply` ([rows] bool) holds (host_sampling.xtc_dropped)."""
    probs = mx.softmax(logits, axis=-1)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    drop = probs > least
    special = [i for i in special if 0 <= i < logits.shape[-1]]
    if special:
        keep = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
        keep[mx.array(special)] = True
        drop = drop & ~keep
    return mx.where(drop & apply[:, None], -mx.inf, logits)
