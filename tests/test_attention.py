"""attention.py: the CPU attention for passes of several rows equals MLX's fused kernel."""

from cacheback_mlx import attention
from cacheback_mlx.attention import _fused_exp, cpu_attention

import mlx.core as mx
import numpy as np
import pytest


def test_exp_close_to_exp_and_exact_zero_for_masked():
    x = mx.array(np.concatenate([np.linspace(-10, 0, 200001), [-1e-7, 0.0]]).astype(np.float32))
    got, want = _fused_exp(x), mx.exp(x)
    assert float((mx.abs(got - want) / want).max()) < 3e-7  # the softmax's weights that count
    x = mx.array(np.linspace(-87, -10, 200001).astype(np.float32))  # float32 normals below that
    assert float((mx.abs(_fused_exp(x) - mx.exp(x)) / mx.exp(x)).max()) < 1e-5
    tiny = mx.array(np.linspace(-120, -87.5, 1001).astype(np.float32))
    assert float(_fused_exp(tiny).max()) < 2e-38  # denormals flush to (near) 0
    assert float(_fused_exp(mx.array([-mx.inf, -200.0])).abs().max()) == 0.0
    assert float(_fused_exp(mx.array([0.0]))[0]) == 1.0
    assert attention._compiled_parts is not attention.exp_parts  # the compiled kernel, not the fallback
    for n in (5, 517, 3001):  # one shapeless graph serves every shape
        x = -mx.arange(n) * (10 / n)
        np.testing.assert_allclose(np.array(_fused_exp(x)), np.exp(np.array(x, dtype=np.float64)), rtol=6e-7)


def test_exp_with_a_shift_equals_exp_of_the_difference_and_rounds_like_mx_round():
    rng = np.random.default_rng(0)
    x = mx.array((rng.standard_normal((3, 5, 700)) * 1.5).astype(np.float32))  # x - max >= -10
    m = x.max(-1, keepdims=True)
    assert np.array_equal(np.array(_fused_exp(x, m)), np.array(_fused_exp(x - m)))  # the shift is fused in
    np.testing.assert_allclose(np.array(_fused_exp(x, m)), np.exp(np.array(x - m, dtype=np.float64)), rtol=6e-7)
    y = mx.array(np.arange(-127, 1, 0.25, dtype=np.float32))  # halves included: ties go to even
    assert np.array_equal(np.array((y + attention.MAGIC) - attention.MAGIC), np.array(mx.round(y)))


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool2", "add2", "bool4_1", "bool4_h"])
def test_cpu_attention_equals_fused_kernel(T, mask_kind):
    rng = np.random.default_rng(T)
    B, H, Hk, S, D, Dv = 1, 6, 2, T + 21, 16, 24
    q = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hk, S, D)).astype(np.float32) * 2)
    v = mx.array(rng.standard_normal((B, Hk, S, Dv)).astype(np.float32))
    seen = rng.random((T, S)) < 0.7
    seen[:, 0] = True  # every row sees something
    mask = {None: None, "causal": "causal" if T > 1 else None, "bool2": mx.array(seen),
            "add2": mx.array(np.where(seen, 0.0, -1e9).astype(np.float32)),
            "bool4_1": mx.array(seen)[None, None],
            "bool4_h": mx.array(np.broadcast_to(seen, (B, H, T, S)).copy())}[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    got = cpu_attention(q, k, v, 0.3, mask)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


class _Ours:
    fast_attention = True


def test_used_only_for_our_caches_several_rows_float32_no_sinks(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "cpu_attention", lambda *a: calls.append("ours") or a[0])
    monkeypatch.setattr(attention, "stock", lambda q, *a, **k: calls.append("stock") or q)
    q8, k = mx.zeros((1, 4, 8, 8)), mx.zeros((1, 2, 16, 8))
    sdpa = attention.scaled_dot_product_attention
    sdpa(q8, k, k, _Ours(), 1.0, "causal")
    sdpa(q8[:, :, :1], k, k, _Ours(), 1.0, None)  # one row over a short cache: the fused kernel
    sdpa(q8, k, k, object(), 1.0, "causal")  # mlx-lm's own cache: untouched
    sdpa(q8, k, k, _Ours(), 1.0, "causal", sinks=mx.zeros((4,)))
    sdpa(q8.astype(mx.float16), k, k, _Ours(), 1.0, "causal")
    monkeypatch.setattr(attention, "enabled", False)
    sdpa(q8, k, k, _Ours(), 1.0, "causal")
    assert calls == ["ours"] + ["stock"] * 5


def test_prefill_sized_passes_go_in_blocks_and_equal_the_fused_kernel():
    """Many rows (prefill chunks) are taken a block of rows at a time, each a whole softmax over
    every key: the same result as MLX's kernel, for causal, bool and additive masks."""
    rng = np.random.default_rng(3)
    for T, S in ((40, 40), (37, 1100), (9, 1009)):  # several blocks, a partial last one, 8 and 16 rows
        assert T > attention.block_rows(S)
        q = mx.array(rng.standard_normal((1, 6, T, 16)).astype(np.float32))
        k = mx.array(rng.standard_normal((1, 2, S, 16)).astype(np.float32) * 2)
        v = mx.array(rng.standard_normal((1, 2, S, 16)).astype(np.float32))
        seen = rng.random((T, S)) < 0.7
        seen[:, 0] = True
        for mask in ("causal", mx.array(seen), mx.array(seen)[None, None],
                     mx.array(np.where(seen, 0.0, -1e9).astype(np.float32))):
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
            np.testing.assert_allclose(np.array(cpu_attention(q, k, v, 0.3, mask)), np.array(want),
                                       atol=2e-6, rtol=1e-5)


def test_prefill_sized_passes_use_ours(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "cpu_attention", lambda *a: calls.append("ours") or a[0])
    monkeypatch.setattr(attention, "stock", lambda q, *a, **k: calls.append("stock") or q)
    sdpa = attention.scaled_dot_product_attention
    for rows, keys in ((8, 4000), (32, 256), (16, 3000), (512, 600)):
        sdpa(mx.zeros((1, 4, rows, 8)), mx.zeros((1, 2, keys, 8)), mx.zeros((1, 2, keys, 8)), _Ours(), 1.0, "causal")
    assert calls == ["ours"] * 4


def test_one_row_over_a_long_cache_uses_ours(monkeypatch):
    """MLX's CPU kernel is ~2x slower for one query row over thousands of keys (decoding steps in
    an editor's long context)."""
    calls = []
    monkeypatch.setattr(attention, "cpu_attention", lambda *a: calls.append("ours") or a[0])
    monkeypatch.setattr(attention, "stock", lambda q, *a, **k: calls.append("stock") or q)
    sdpa = attention.scaled_dot_product_attention
    for keys in (100, attention.MIN_KEYS_ONE_ROW, 3000):
        sdpa(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, keys, 8)), mx.zeros((1, 2, keys, 8)), _Ours(), 1.0, None)
    sdpa(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 3000, 8)), mx.zeros((1, 2, 3000, 8)), object(), 1.0, None)
    assert calls == ["stock", "ours", "ours", "stock"]
