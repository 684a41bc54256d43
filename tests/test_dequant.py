"""Quantized weights to float32 on the CPU (dequant.py): bit for bit what
mx.dequantize(...).astype(float32) gives, in both layouts, for float16 and bfloat16 scales and
groups of 32 and 64, on random and awkward values and on the default model's own tensors; values
it cannot give exactly are left to MLX."""

from cacheback_mlx import dequant
from cacheback_mlx.gguf import quant_bits

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest


def quantized(rows, cols, bits, seed, scale=1.0, dtype=mx.float16, group=32):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32) * scale).astype(dtype)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(dtype), b.astype(dtype)


def theirs(q, s, b, bits, group=32):
    return np.asarray(mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32))


def same(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def awkward(q, s, b):
    """Scales down to float16's subnormals and zero, negative ones, biases that cancel a product
    (sums below 2**-14) and products that round half way."""
    dtype = s.dtype
    s, b = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
    s[0, :] = 6e-8 * np.arange(1, s.shape[1] + 1)  # float16's subnormals
    s[1, 0], b[1, 0] = 0, 0
    s[2, :] = -s[2, :]
    b[3, :] = -s[3, :] * 7  # q * s + b crosses zero within the group
    b[4, :] = 2.0 ** -15  # a subnormal bias
    return q, mx.array(s).astype(dtype), mx.array(b).astype(dtype)


@pytest.mark.parametrize("dtype,group", [(mx.float16, 32), (mx.bfloat16, 64), (mx.float16, 64)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_out", [False, True])
def test_float32_weights_are_mlx_s_bit_for_bit(bits, in_out, dtype, group):
    kw = dict(dtype=dtype, group=group)
    tensors = {"a": quantized(64, 256, bits, 1, **kw), "b": awkward(*quantized(48, 192, bits, 2, scale=1e-3, **kw)),
               "c": quantized(8, 64, bits, 3, scale=300.0, **kw)}
    out = dequant.to_float32({k: (*v, bits, group) for k, v in tensors.items()}, in_out)
    assert set(out) == set(tensors)
    for name, (q, s, b) in tensors.items():
        assert same(np.asarray(out[name]), theirs(q, s, b, bits, group)), name
        if in_out:  # the transposed view of an [in, out] copy, as blas.transpose_weights stores it
            assert out[name].shape == (q.shape[0], q.shape[1] * 32 // bits)
            assert memoryview(out[name]).strides[0] < memoryview(out[name]).strides[1]


def test_values_past_the_16_bit_range_and_other_layouts_are_left_to_mlx():
    q, s, b = quantized(8, 64, 4, 4)
    big = mx.array(np.full(s.shape, 6e3, np.float16))  # 15 * 6e3: float16 gives inf, float32 would not
    nan = mx.array(np.full(s.shape, np.nan, np.float16))
    tensors = {"big": (q, big, b, 4, 32), "float32": (q, s.astype(mx.float32), b.astype(mx.float32), 4, 32),
               "nan": (q, nan, b, 4, 32), "no biases": (q, s, None, 4, 32), "fine": (q, s, b, 4, 32)}
    assert set(dequant.to_float32(tensors, False)) == {"fine"}


def test_a_cpu_that_rounds_otherwise_gets_mlx_s_own_dequantize(monkeypatch):
    """The check on a slice finds a difference (here: one rounding, a fused multiply-add's) and
    hands every tensor back to MLX."""
    tensors = {"a": (*quantized(64, 256, 4, 5), 4, 32), "b": (*quantized(64, 256, 8, 6), 8, 32),
               "c": (*quantized(64, 256, 4, 7, dtype=mx.bfloat16, group=64), 4, 64)}
    assert set(dequant.to_float32(tensors, False)) == {"a", "b", "c"}
    with monkeypatch.context() as m:
        m.setattr(dequant, "_round", lambda x, scratch, drop: None)
        assert dequant.to_float32(tensors, False) == {}
    exact = dequant._float32  # one kind off is enough, even when the first tensor is of another
    for off in (8, 16):  # 8 bits; bfloat16 (16 bits dropped)
        monkeypatch.setattr(dequant, "_float32", lambda w, s, b, bits, group, drop, in_out:
                            exact(w, s, b, bits, group, drop, in_out) + (off in (bits, drop)) * np.float32(1e-3))
        assert dequant.to_float32(tensors, False) == {}


@pytest.mark.slow
def test_the_default_model_s_tensors():
    from cacheback_mlx.loader import default_model_path

    weights = mx.load(str(default_model_path()))
    names = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    tensors = {n: (weights[n + ".weight"], weights[n + ".scales"], weights[n + ".biases"]) for n in names}
    tensors = {n: (*v, quant_bits(v[0], v[1]), 32) for n, v in tensors.items()}
    picked = sorted({bits: n for n, (_, _, _, bits, _) in tensors.items()}.values())[:2] + names[:2]  # 4 and 8 bits
    out = dequant.to_float32({n: tensors[n] for n in picked}, True)
    assert set(out) == set(picked) and {tensors[n][3] for n in picked} == {4, 8}
    for n in picked:
        assert same(np.asarray(out[n]), theirs(*tensors[n][:4])), n


@pytest.mark.parametrize("spec", ["random:smollm2-135m:q4:bf16:layers=2", "random:smollm2-135m:q8:f16:layers=1"])
def test_a_quantized_folder_loads_as_float32_with_mlx_s_values(spec, tmp_path, monkeypatch):
    """An mlx-lm folder of 4- or 8-bit layers (bfloat16 or float16 scales, groups of 64) loads as
    float32 through this path: every weight is mx.dequantize's, in the layout the loader stores
    weights in."""
    from cacheback_mlx import blas, loader

    from mlx.utils import tree_flatten

    src = loader.load(spec)
    loader.save_folder(src, tmp_path)
    taken, to_float32 = [], dequant.to_float32
    monkeypatch.setattr(dequant, "to_float32", lambda *a: taken.extend(to_float32(*a).items()) or dict(taken))
    loaded = loader.load(str(tmp_path), dtype="float32")
    layers = dict(tree_flatten(loaded.model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    checked = 0
    for path, m in tree_flatten(src.model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if "scales" not in m:
            continue
        w = layers[path].weight
        assert w.dtype == mx.float32 and same(np.asarray(w), theirs(m.weight, m.scales, m.biases, m.bits, 64)), path
        if blas.weight_layout_wanted():
            assert memoryview(w).strides[0] < memoryview(w).strides[1], path
        checked += 1
    assert checked >= 7 and len(taken) == checked


def test_layers_of_another_quantization_mode_are_dequantized_in_theirs():
    """An mxfp4 layer (no biases, as mlx-community's gpt-oss folders hold) is left to MLX, which
    dequantizes it in its own mode, beside affine layers that take this path."""
    from cacheback_mlx import loader

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 32))
    model.layers[0] = nn.QuantizedLinear.from_linear(model.layers[0], group_size=32, bits=4, mode="mxfp4")
    model.layers[1] = nn.QuantizedLinear.from_linear(model.layers[1], group_size=32, bits=4)
    want = [np.asarray(mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
                       .astype(mx.float32)) for m in model.layers]
    loader._dequantize(model, mx.float32)
    for layer, w in zip(model.layers, want):
        assert type(layer) is nn.Linear and same(np.asarray(layer.weight.astype(mx.float32)), w)


def test_expert_banks_are_dequantized_in_their_mode_and_keep_their_bias():
    """mlx-lm's quantized expert banks (QuantizedSwitchLinear: weight [experts, out, in]) become
    float SwitchLinear banks with MLX's values, affine and mxfp4 alike, and keep a bias."""
    from cacheback_mlx import loader

    from mlx_lm.models.switch_layers import SwitchLinear

    model = nn.Sequential(SwitchLinear(64, 32, 4, bias=True), SwitchLinear(64, 32, 4, bias=False))
    model.layers[0].bias = mx.arange(4 * 32, dtype=mx.float32).reshape(4, 32)
    model.layers[0] = model.layers[0].to_quantized(group_size=32, bits=4, mode="mxfp4")
    model.layers[1] = model.layers[1].to_quantized(group_size=64, bits=8)
    want = [np.asarray(mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode)
                       .astype(mx.float32)) for m in model.layers]
    loader._dequantize(model, mx.float32)
    for layer, w in zip(model.layers, want):
        assert type(layer) is SwitchLinear and layer.weight.shape == (4, 32, 64)
        assert same(np.asarray(layer.weight.astype(mx.float32)), w)
    assert np.array_equal(np.asarray(model.layers[0].bias), np.arange(4 * 32).reshape(4, 32))
    assert "bias" not in model.layers[1]


def test_a_saved_folder_keeps_each_layer_s_quantization_mode(tmp_path):
    """save_folder writes every quantized layer's bits, group size and mode (mxfp4 beside affine,
    as gpt-oss folders mix them) so that mlx-lm loads each layer back as it was."""
    from cacheback_mlx import loader

    src = loader.load("random:smollm2-135m:f32:layers=1")
    nn.quantize(src.model, class_predicate=lambda p, m: isinstance(m, nn.Linear) and (
        {"group_size": 32, "bits": 4, "mode": "mxfp4"} if ".mlp." in p else {"group_size": 64, "bits": 8}))
    want = {p: (m.mode, m.bits, m.group_size, np.asarray(m.weight), np.asarray(m.scales))
            for p, m in src.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert {w[0] for w in want.values()} == {"affine", "mxfp4"}
    loader.save_folder(src, tmp_path)
    back = loader.load(str(tmp_path), dtype="native").model
    got = {p: m for p, m in back.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert set(got) == set(want)
    for p, (mode, bits, group, w, s) in want.items():
        m = got[p]
        assert (m.mode, m.bits, m.group_size) == (mode, bits, group), p
        assert np.array_equal(np.asarray(m.weight), w) and np.array_equal(np.asarray(m.scales), s), p
