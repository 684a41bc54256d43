"""The engine's layer caches keep the buffer layout plain decoding has (kvcache.py)."""

from cacheback_mlx.kvcache import TreeKVCache, WindowKVCache
from cacheback_mlx.positions import TreePass

import mlx.core as mx


def kv(n: int, start: int = 0):
    """Keys and values for positions start..start+n-1, each holding its position."""
    x = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, n, 4))
    return x, x + 0.5


def test_a_rolled_back_pass_leaves_the_buffers_plain_decoding_would_have():
    """A pass that grows the buffers past a multiple of 256 and is rolled back below it leaves
    them 256 long again, as plain decoding's at that length; what was kept is unchanged."""
    c = TreeKVCache(TreePass())
    c.update_and_fetch(*kv(250))
    assert c.keys.shape[2] == 256
    c.update_and_fetch(*kv(10, 250))  # a pass of 10 rows past 256: the buffers grow
    assert c.keys.shape[2] == 512
    c.trim_to(252)  # its first two rows accepted
    assert c.offset == 252 and c.keys.shape[2] == c.values.shape[2] == 256
    k, v = c.update_and_fetch(*kv(1, 252))  # the next step
    assert k.shape[2] == 253 and mx.array_equal(k[0, 1, :, 2], mx.arange(253, dtype=mx.float32)).item()
    assert mx.array_equal(v, k + 0.5).item()
    c.update_and_fetch(*kv(10, 253))
    c.trim_to(258)  # kept past 256: plain decoding's buffers are 512 long there too
    assert c.keys.shape[2] == 512
    c.trim_to(0)
    assert c.keys.shape[2] == 256


def test_a_window_cache_keeps_its_own_layout_when_trimmed():
    c = WindowKVCache(TreePass(), window=64, slack=256)
    c.update_and_fetch(*kv(250))
    c.update_and_fetch(*kv(10, 250))
    size = c.keys.shape[2]
    c.trim_to(252)
    assert c.offset == 252 and c.keys.shape[2] == size
