"""GGUF's quantized weights to float32 on the CPU (dequant.py): bit for bit what
mx.dequantize(...).astype(float32) gives, in both layouts, on random and awkward values and on
the default model's own tensors; values it cannot give exactly are left to MLX."""

from cacheback_mlx import dequant
from cacheback_mlx.gguf import quant_bits

import mlx.core as mx
import numpy as np
import pytest


def quantized(rows, cols, bits, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * scale).astype(mx.float16)
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    return q, s.astype(mx.float16), b.astype(mx.float16)


def theirs(q, s, b, bits):
    return np.asarray(mx.dequantize(q, s, b, group_size=32, bits=bits).astype(mx.float32))


def same(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def awkward(q, s, b):
    """Scales down to float16's subnormals and zero, negative ones, biases that cancel a product
    (sums below 2**-14) and products that round half way."""
    s, b = np.array(s), np.array(b)
    s[0, :] = np.float16(6e-8) * np.arange(1, s.shape[1] + 1)  # subnormal scales
    s[1, 0], b[1, 0] = 0, 0
    s[2, :] = -s[2, :]
    b[3, :] = -s[3, :] * np.float16(7)  # q * s + b crosses zero within the group
    b[4, :] = np.float16(2.0 ** -15)  # a subnormal bias
    return q, mx.array(s), mx.array(b)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_out", [False, True])
def test_float32_weights_are_mlx_s_bit_for_bit(bits, in_out):
    tensors = {"a": quantized(64, 256, bits, 1), "b": awkward(*quantized(48, 96, bits, 2, scale=1e-3)),
               "c": quantized(8, 32, bits, 3, scale=300.0)}
    out = dequant.to_float32({k: (*v, bits) for k, v in tensors.items()}, in_out)
    assert set(out) == set(tensors)
    for name, (q, s, b) in tensors.items():
        assert same(np.asarray(out[name]), theirs(q, s, b, bits)), name
        if in_out:  # the transposed view of an [in, out] copy, as blas.transpose_weights stores it
            assert out[name].shape == (q.shape[0], q.shape[1] * 32 // bits)
            assert memoryview(out[name]).strides[0] < memoryview(out[name]).strides[1]


def test_values_past_float16_s_range_and_other_layouts_are_left_to_mlx():
    q, s, b = quantized(8, 64, 4, 4)
    big = mx.array(np.full(s.shape, 6e3, np.float16))  # 15 * 6e3: float16 gives inf, float32 would not
    tensors = {"big": (q, big, b, 4), "bfloat16": (q, s.astype(mx.bfloat16), b.astype(mx.bfloat16), 4),
               "nan": (q, mx.array(np.full(s.shape, np.nan, np.float16)), b, 4), "fine": (q, s, b, 4)}
    assert set(dequant.to_float32(tensors, False)) == {"fine"}


def test_a_cpu_that_rounds_otherwise_gets_mlx_s_own_dequantize(monkeypatch):
    """The check on a slice finds a difference (here: one rounding, a fused multiply-add's) and
    hands every tensor back to MLX."""
    tensors = {"a": (*quantized(64, 256, 4, 5), 4), "b": (*quantized(64, 256, 8, 6), 8)}
    assert set(dequant.to_float32(tensors, False)) == {"a", "b"}
    with monkeypatch.context() as m:
        m.setattr(dequant, "_round_to_half", lambda x, scratch: None)
        assert dequant.to_float32(tensors, False) == {}
    exact = dequant._float32  # one width off is enough, even when the first tensor has the other
    monkeypatch.setattr(dequant, "_float32", lambda w, s, b, bits, in_out: exact(w, s, b, bits, in_out)
                        + (bits == 8) * np.float32(1e-3))
    assert dequant.to_float32(tensors, False) == {}


@pytest.mark.slow
def test_the_default_model_s_tensors():
    from cacheback_mlx.loader import default_model_path

    weights = mx.load(str(default_model_path()))
    names = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    tensors = {n: (weights[n + ".weight"], weights[n + ".scales"], weights[n + ".biases"]) for n in names}
    tensors = {n: (*v, quant_bits(v[0], v[1])) for n, v in tensors.items()}
    picked = sorted({bits: n for n, (*_, bits) in tensors.items()}.values())[:2] + names[:2]  # 4 and 8 bits
    out = dequant.to_float32({n: tensors[n] for n in picked}, True)
    assert set(out) == set(picked) and {tensors[n][3] for n in picked} == {4, 8}
    for n in picked:
        assert same(np.asarray(out[n]), theirs(*tensors[n])), n
