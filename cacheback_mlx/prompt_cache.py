"""A conversation carried in mlx-lm's prompt cache: `stream_generate(..., prompt_cache=cache)`.

mlx-lm's scripts keep a conversation in a list of layer caches (`make_prompt_cache(model)`) and
send each turn's new tokens only: the list holds every token before them, the earlier prompts and
replies, a reply's stop token included (and, when a caller stopped reading early, the tokens it
was given). Here the keys and values stay in the engine's own caches, reused by prefix as for any
request, and this module keeps the tokens each list holds (on its first cache object, so that
`copy.deepcopy(cache)`, which mlx-lm's users take to ask several questions of one long prompt,
copies them), so a turn runs on those tokens followed by the new ones: the output equals mlx-lm's
on the same list.

The list's own cache objects stay empty. `trim_prompt_cache` here trims what a list holds as
mlx-lm's would (a recurrent layer's cache cannot be trimmed; a sliding window's only while it has
not wrapped); mlx-lm's own `trim_prompt_cache` and `save_prompt_cache` do not see it. A list whose
caches hold keys and values of mlx-lm's (filled by its generate, or read by `load_prompt_cache`)
is refused in one line: the tokens they stand for are not known here.
"""

from __future__ import annotations

from typing import Sequence

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as _mlx_lm_make

from .errors import CachebackError
from .kvcache import cache_leaves

TOKENS = "cacheback_tokens"  # the attribute of a list's first cache that holds the list's tokens


def _tokens(prompt_cache) -> list[int]:
    first = next(cache_leaves(prompt_cache), None)
    return list(getattr(first, TOKENS, ()))


def _kind(c) -> tuple:
    return type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)


def make_prompt_cache(model, max_kv_size: int | None = None) -> list:
    """mlx-lm's make_prompt_cache (a list that stands for a new conversation). `max_kv_size`
    (mlx-lm's rotating caches that keep the first tokens) is not supported."""
    if max_kv_size is not None:
        raise CachebackError("max_kv_size is not supported (a rotating cache drops the tokens a draft is checked on)")
    return _mlx_lm_make(model)


def held(model, prompt_cache) -> list[int]:
    """The tokens `prompt_cache` holds from earlier calls (none for a new one), checked to be a
    list of `model`'s caches that mlx-lm has not filled."""
    if not isinstance(prompt_cache, (list, tuple)):
        raise CachebackError("prompt_cache must be a list of layer caches, as make_prompt_cache(model) makes")
    mine, want = list(cache_leaves(prompt_cache)), list(cache_leaves(_mlx_lm_make(model)))
    if not mine or [_kind(c) for c in mine] != [_kind(c) for c in want]:
        raise CachebackError(f"prompt_cache is not this model's (make_prompt_cache(model) makes {len(want)} layer "
                             f"caches: {', '.join(sorted({k[0] for k in map(_kind, want)}))}; max_kv_size not set)")
    if any(not c.empty() for c in mine):
        raise CachebackError("prompt_cache holds keys and values of mlx-lm's own (its generate, or load_prompt_cache): "
                             "the tokens behind them are not known here; start from make_prompt_cache(model)")
    return _tokens(prompt_cache)


def hold(prompt_cache, tokens: Sequence[int]) -> None:
    """Record that `prompt_cache` now holds `tokens` (on its first cache object, so a copy of the
    list, as mlx-lm's users make with copy.deepcopy to ask several questions of one long prompt,
    holds them too)."""
    setattr(next(cache_leaves(prompt_cache)), TOKENS, [int(t) for t in tokens])


def can_trim_prompt_cache(prompt_cache) -> bool:
    """Whether mlx-lm could trim the list, were its caches filled with what it holds."""
    n = len(_tokens(prompt_cache))
    for c in cache_leaves(prompt_cache):
        if isinstance(c, ArraysCache) or (isinstance(c, RotatingKVCache) and n >= c.max_size):
            return False
        if not isinstance(c, (KVCache, RotatingKVCache)) and not c.is_trimmable():
            return False
    return True


def trim_prompt_cache(prompt_cache, num_tokens: int) -> int:
    """Drop the last `num_tokens` tokens the list holds, as mlx-lm's trim_prompt_cache: the number
    dropped (0 where the caches cannot be trimmed)."""
    if not prompt_cache or not can_trim_prompt_cache(prompt_cache):
        return 0
    tokens = _tokens(prompt_cache)
    n = max(0, min(int(num_tokens), len(tokens)))
    hold(prompt_cache, tokens[: len(tokens) - n])
    return n
