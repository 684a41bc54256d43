"""activations.py: the engine's SwiGLU on the CPU is mlx-lm's within float32 rounding, is used only
while the engine builds a pass, and the engine stays lossless with it."""

from cacheback_mlx import activations
from cacheback_mlx.activations import cpu_swiglu, engine_pass

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama


def test_close_to_mlx_lm_swiglu_over_the_whole_range():
    g = np.concatenate([np.linspace(-100, 100, 400001), [0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 1e4, -1e4]])
    g = mx.array(g.astype(np.float32))
    x = mx.array(np.random.default_rng(0).standard_normal(g.shape[0]).astype(np.float32))
    got, want = np.array(cpu_swiglu(g, x)), np.array(activations.stock(g, x))
    assert np.isfinite(got).all()
    big = np.abs(want) > 1e-30
    assert np.max(np.abs(got - want)[big] / np.abs(want)[big]) < 1e-6
    assert np.max(np.abs(got - want)[~big]) < 1e-30  # far below zero: silu is ~0
    assert activations._compiled is not None  # the compiled kernels, not the fallback
    for n in (5, 4097, 12288):  # one shapeless graph serves every shape
        g = mx.linspace(-9, 9, n)
        np.testing.assert_allclose(np.array(cpu_swiglu(g, g)), np.array(activations.stock(g, g)), rtol=1e-6, atol=1e-30)


def test_used_only_inside_an_engine_pass_in_float32(monkeypatch):
    monkeypatch.setattr(activations, "MIN_SIZE", 4096)  # conftest takes it away for the other tests
    g = mx.array(np.random.default_rng(1).standard_normal((1, 8, 1024)).astype(np.float32)) * 4
    x = mx.ones_like(g)
    stock, fast = np.array(activations.stock(g, x)), np.array(cpu_swiglu(g, x))
    assert not np.array_equal(stock, fast)  # so the checks below can tell which one ran
    assert np.array_equal(np.array(activations.swiglu(g, x)), stock)  # outside a pass: mlx-lm's
    with engine_pass():
        assert np.array_equal(np.array(activations.swiglu(g, x)), fast)
        small = g[:, :1, :100]
        assert np.array_equal(np.array(activations.swiglu(small, small)), np.array(activations.stock(small, small)))
        half = g.astype(mx.float16)
        assert activations.swiglu(half, half).dtype == mx.float16
    assert np.array_equal(np.array(activations.swiglu(g, x)), stock)  # the flag is restored


def test_installed_in_the_model_modules_the_engine_builds_a_cache_for():
    from cacheback_mlx.kvcache import ModelCache

    from conftest import tiny_llama

    ModelCache(tiny_llama())
    assert llama.swiglu is activations.swiglu


def test_engine_is_lossless_with_it_on_every_pass(monkeypatch):
    """A tiny model's MLP is too small for the size threshold: without it (as conftest sets for
    every test) every pass goes through cpu_swiglu; compare with mlx-lm's own greedy decoding."""
    from cacheback_mlx.drafters.base import NoDrafter
    from cacheback_mlx.engine import Engine

    from mlx_lm.generate import generate_step

    from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter
    from conftest import tiny_llama

    model = tiny_llama(seed=3, hidden=96, heads=6, kv_heads=2, layers=3, vocab=150)
    prompt = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8, 77, 140]
    truth = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
    monkeypatch.setattr(activations, "MIN_SIZE", 1)
    calls = []
    real = activations.cpu_swiglu
    monkeypatch.setattr(activations, "cpu_swiglu", lambda g, x: calls.append(g.shape) or real(g, x))
    for drafter in (NoDrafter(), OracleDrafter(prompt, truth, extra_wrong_branches=2),
                    WrongDrafter(lambda h: (truth + [0])[len(h) - len(prompt)]),
                    RandomTreeDrafter(prompt, truth, seed=4, vocab=150)):
        eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096)
        assert [t for step in eng.generate(prompt, 40) for t in step] == truth, type(drafter).__name__
    assert len(calls) > 40 and max(s[1] for s in calls) > 1  # used, on passes of several rows
