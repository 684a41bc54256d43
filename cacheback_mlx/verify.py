"""One batched forward pass over the uncached lead tokens and a draft tree.

Input rows: first the lead, the accepted tokens not yet in the cache (usually just the root, the
last accepted token; after an undone pass on a recurrent model, also the tokens accepted in it),
then tree node i at row len(lead) + i. A chain uses the model's plain causal path. A tree sets the
model's TreePass: a node sees the cache, the lead and its own ancestors, at position
cache offset + len(lead) - 1 + depth (positions.TreeRoPE, kvcache.pass_mask).
Passes can be padded to a few fixed sizes (`buckets`) so GPU backends compile few shapes: padded
rows see only the cache and the lead, nobody sees them, and they are rolled back with the rejects.
"""

from __future__ import annotations

import bisect
import time
from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from . import activations, kernels
from .kvcache import ModelCache
from .tree import DraftTree


def padded_size(n: int, buckets: tuple[int, ...] | None) -> int:
    """The smallest bucket that holds n rows (n itself when no buckets or n is past the largest)."""
    if not buckets:
        return n
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def tree_layout(tree: DraftTree, lead: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions relative to the cache offset [rows] and the in-pass mask [rows, rows] for
    lead + tree + padding."""
    n = lead + len(tree)
    rel = np.zeros(rows, np.int32)
    rel[:lead] = np.arange(lead)
    rel[lead:n] = lead - 1 + tree.depths()
    rel[n:] = lead - 1
    mask = np.zeros((rows, rows), dtype=bool)
    mask[:lead, :lead] = np.tril(np.ones((lead, lead), dtype=bool))
    anc = tree.ancestor_mask()  # over (root, nodes): the root is the lead's last row
    mask[lead:n, :lead] = True
    mask[lead:n, lead:n] = anc[1:, 1:]
    mask[n:, :lead] = True  # padding rows see the lead (and themselves), so softmax is defined
    mask[np.arange(n, rows), np.arange(n, rows)] = True
    return rel, mask


def verify_pass(model, cache: ModelCache, lead: list[int], tree: DraftTree,
                buckets: tuple[int, ...] | None = None, rows: int | None = None) -> mx.array:
    """Run lead + tree through the model in ONE pass; return logits [1 + len(tree), vocab] for the
    lead's last row (the root) and each node. The pass is padded to `rows` rows when given (at
    least lead + tree), else to its bucket.

    Afterwards each cache holds `rows` new entries past its old length; the caller keeps the
    accepted ones with ModelCache.finish_pass."""
    lead_n = len(lead)
    n = lead_n + len(tree)
    rows = padded_size(n, buckets) if rows is None else max(rows, n)
    tokens = np.zeros(rows, np.int32)
    tokens[:lead_n] = lead
    tokens[lead_n:n] = tree.tokens
    tree_pass = cache.tree_pass
    if not tree.is_chain():
        rel, in_pass = tree_layout(tree, lead_n, rows)
        tree_pass.set(mx.array(rel), mx.array(in_pass), host=in_pass)
    cache.begin_pass()
    try:
        # a pass of one row is a plain step: no kernel takes it, and asking in every layer cost 3-7% of
        # building a step's graph (the default model on a CPU, the kernels' layers in: tools.ab.step_build)
        with activations.engine_pass(), kernels.rows_pass(real=n) if rows > 1 else nullcontext():
            logits = model(mx.array(tokens)[None], cache=cache.layers)
    finally:
        tree_pass.clear()
    return logits[0, lead_n - 1 : n]


def step_pass(model, cache: ModelCache, token: mx.array) -> mx.array:
    """A plain decoding step over one token that may still be computing (an mx.array [1], the pick
    of the pass before it): the graph verify_pass builds for a one-token lead and no draft, built
    before that token is known, so the device runs it right after the pass before (the engine's
    steps run ahead, as mlx-lm's loop does). Returns logits [1, vocab]; the caller keeps or drops
    its row with ModelCache.finish_pass."""
    cache.begin_pass()
    with activations.engine_pass():  # one row: no kernel takes it (verify_pass)
        logits = model(token.astype(mx.int32).reshape(1, 1), cache=cache.layers)
    return logits[0, -1:]


PREFILL_CHUNK = 512
MLX_LM_PREFILL_CHUNK = 2048  # mlx_lm.generate.generate_step's prefill_step_size


def cpu_prefill_chunk(cached: int, left: int | None = None) -> int:
    """The CPU's prefill chunk after `cached` tokens: 128, and 64 past 4,096. Per token these run
    about as fast as chunks of 512 (docs/BENCHMARKS.md §9: within 10% at 8k, faster at 1k), and a
    chunk's time bounds how long a cancelled or stopped prefill goes on (on a 2-core CPU, the
    default model: ~1.8 s at 4k cached tokens, ~3 s at 8k). With `left`, the tokens still to
    prefill: a last piece of at most half a chunk joins the chunk before it, so no chunk reads all
    the weights for a few tokens (a mixture-of-experts model's chunk reads every expert). Fixed by
    the position and the prompt, never by the clock: the same prompt is always cut the same way,
    so it always gives the same output."""
    size = 64 if cached > 4096 else 128
    return left if left is not None and left <= size + size // 2 else size


def prefill(model, cache: ModelCache, tokens: list[int], chunk=PREFILL_CHUNK, timed=None, stop=None) -> int:
    """Put tokens into the caches (in chunks, to bound memory on long prompts); returns how many.
    chunk: tokens a chunk takes at most, or a function of the cached tokens and the tokens left
    that gives it (cpu_prefill_chunk).
    timed(rows, cached, seconds), if given, hears what each chunk took; stop(), if given, is asked
    before each chunk but the first, and True ends the prefill there (the chunks done stay)."""
    i = 0
    while i < len(tokens):
        if i and stop is not None and stop():
            return i
        t0, cached = time.perf_counter(), cache.length
        part = tokens[i : i + (chunk(cached, len(tokens) - i) if callable(chunk) else chunk)]
        cache.begin_pass()
        with activations.engine_pass():
            model(mx.array(part, dtype=mx.int32)[None], cache=cache.layers)
        cache.advance(len(part))
        mx.eval(cache.arrays())
        i += len(part)
        if timed is not None:
            timed(len(part), cached, time.perf_counter() - t0)
    return len(tokens)


def warm_up(model, buckets: tuple[int, ...] | None = None, tree_ok: bool = True, vocab: int = 32,
            cached: tuple[int, ...] = (8, 300)) -> None:
    """Run once, on caches of its own, what decoding runs, so that a backend that compiles kernels
    at their first use does it here rather than in the middle of a reply. MLX's CUDA backend
    compiles its gathers and scatters per dtype with NVRTC (seconds each on a machine that never
    ran them, kept on disk after): a bench on an H200 stalled 4-7 s in one pass of `auto` where a
    pass first kept tree rows that were not its first ones (the caches move them into place).
    At each length of `cached`: a pass over a branching tree (a chain where `tree_ok` is False:
    recurrent layers, position code a tree cannot run) keeping a path off its first branch, then
    a plain step; past 256 cached keys a step's attention and a pass's rows take other kernels."""
    cache = ModelCache(model)
    tree = DraftTree([1, 2, 3], [-1, -1, 1]) if tree_ok else DraftTree.chain([1, 2, 3])
    keep = [0, 2, 3] if tree_ok else [0, 1, 2, 3]  # the root, then node 1 and its child: rows moved
    for length in cached:
        prefill(model, cache, [(100 + i) % vocab for i in range(cache.length, length - 1)])
        mx.eval(verify_pass(model, cache, [5], tree, buckets))
        cache.finish_pass(keep, whole=not tree_ok)
        mx.eval(cache.arrays())
        mx.eval(step_pass(model, cache, mx.array([4])))
        cache.finish_pass([0], whole=True)
        mx.eval(cache.arrays())
