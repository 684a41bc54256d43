"""Llama-family GGUF files as mlx-lm models.

`mx.load(path, return_metadata=True)` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX
quantized triples (weight, scales, biases; group size 32), f16/f32 as plain arrays. We map the
metadata to mlx-lm's llama ModelArgs and the tensor names to its module names. GGUF stores q/k
weights in the interleaved RoPE layout, hence rope_traditional=True.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from .errors import CachebackError

LLAMA_FAMILY = ("llama", "mistral")

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# bytes per block and values per block of ggml tensor types (for the bounds check)
GGML_BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
               9: (36, 32), 24: (1, 1), 25: (2, 1), 26: (4, 1), 27: (8, 1), 28: (8, 1), 30: (2, 1)}
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def check_gguf_structure(path: Path) -> None:
    """Walk the header, metadata and tensor table and check every tensor lies inside the file.

    MLX's GGUF reader trusts the file and can crash the process on a corrupt or truncated one, so
    we check first and raise a one-line error instead."""
    with open(path, "rb") as f:
        size = path.stat().st_size

        def read(fmt):
            n = struct.calcsize(fmt)
            b = f.read(n)
            if len(b) != n:
                raise ValueError("unexpected end of file")
            return struct.unpack("<" + fmt, b)[0]

        def string():
            n = read("Q")
            if n > size:
                raise ValueError("bad string length")
            b = f.read(n)
            if len(b) != n:
                raise ValueError("unexpected end of file")
            return b

        def value(kind):
            if kind in SCALAR:
                return read(SCALAR[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item, count = read("I"), read("Q")
                if count > size:
                    raise ValueError("bad array length")
                if item in SCALAR:
                    f.seek(count * struct.calcsize(SCALAR[item]), 1)
                    return None
                for _ in range(count):
                    value(item)
                return None
            raise ValueError(f"unknown metadata type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError("bad magic")
        version, n_tensors, n_kv = read("I"), read("Q"), read("Q")
        if version not in (2, 3) or n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ValueError(f"bad header (version {version})")
        alignment = 32
        for _ in range(n_kv):
            key, kind = string(), read("I")
            v = value(kind)
            if key == b"general.alignment" and isinstance(v, int) and v > 0:
                alignment = v
        tensors = []
        for _ in range(n_tensors):
            string()
            n_dims = read("I")
            if n_dims > 8:
                raise ValueError("bad tensor rank")
            count = 1
            for _ in range(n_dims):
                count *= read("Q")
            tensors.append((read("I"), read("Q"), count))
        start = -(-f.tell() // alignment) * alignment
        for kind, offset, count in tensors:
            nbytes, per = GGML_BLOCKS.get(kind, (0, 1))
            if start + offset + -(-count // per) * nbytes > size:
                raise ValueError("tensor data runs past the end of the file")


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """Tensors and metadata, with file problems turned into one-line errors."""
    path = Path(path)
    if not path.is_file():
        raise CachebackError(f"model file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CachebackError(f"not a GGUF file: {path}")
    try:
        check_gguf_structure(path)
    except (ValueError, struct.error, OverflowError) as e:
        raise CachebackError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from None
    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError with gguflib's message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CachebackError(f"cannot read GGUF file {path} (truncated or corrupt?): {reason}") from None


def meta_value(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        v = v.item() if v.size == 1 else np.array(v)
    return v


def architecture(meta: dict) -> str:
    return str(meta_value(meta, "general.architecture", "unknown"))


def model_args(meta: dict, weights: dict) -> llama.ModelArgs:
    arch = architecture(meta)
    if arch not in LLAMA_FAMILY:
        raise CachebackError(f"unsupported architecture {arch!r} (supported: {', '.join(LLAMA_FAMILY)})")

    def need(key):
        v = meta_value(meta, f"{arch}.{key}")
        if v is None:
            raise CachebackError(f"GGUF metadata lacks {arch}.{key}")
        return v

    heads = int(need("attention.head_count"))
    embed_rows = (weights.get("token_embd.scales", weights.get("token_embd.weight"))).shape[0]
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=int(need("embedding_length")),
        num_hidden_layers=int(need("block_count")),
        intermediate_size=int(need("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta_value(meta, f"{arch}.attention.head_count_kv", heads)),
        rms_norm_eps=float(meta_value(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(meta_value(meta, f"{arch}.vocab_size", embed_rows)),
        rope_theta=float(meta_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        rope_traditional=True,
        tie_word_embeddings="output.weight" not in weights,
        max_position_embeddings=int(meta_value(meta, f"{arch}.context_length", 4096)),
    )


def mlx_name(gguf_name: str) -> str:
    stem, kind = gguf_name.rsplit(".", 1)  # kind: weight / scales / biases
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{kind}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    raise CachebackError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def quant_bits(weight: mx.array, scales: mx.array, group_size: int = 32) -> int:
    """Bits per weight of an MLX-quantized matrix, from the packed and unpacked widths."""
    cols = scales.shape[-1] * group_size
    return weight.shape[-1] * 32 // cols


def load_gguf_model(path: str | Path, dtype: str) -> tuple[nn.Module, dict]:
    """An mlx-lm llama Model with the file's weights, in `dtype` ("native" keeps quantization)."""
    weights, meta = read_gguf(path)
    args = model_args(meta, weights)
    model = llama.Model(args)
    named = {mlx_name(k): v for k, v in weights.items()}
    quantized = {k[: -len(".scales")] for k in named if k.endswith(".scales")}
    if dtype == "native":
        bits = {p: quant_bits(named[p + ".weight"], named[p + ".scales"]) for p in quantized}
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: p in bits and {"group_size": 32, "bits": bits[p]})
        target = mx.float16
    else:
        target = getattr(mx, dtype)
        for p in quantized:
            w, s, b = named.pop(p + ".weight"), named.pop(p + ".scales"), named.pop(p + ".biases")
            named[p + ".weight"] = mx.dequantize(w, s, b, group_size=32, bits=quant_bits(w, s))
    named = {k: (v.astype(target) if v.dtype in (mx.float32, mx.float16, mx.bfloat16) else v)
             for k, v in named.items()}
    try:
        model.load_weights(list(named.items()), strict=True)
    except ValueError as e:
        raise CachebackError(f"GGUF tensors do not match a llama model: {str(e).splitlines()[0]}") from None
    mx.eval(model.parameters())
    return model, meta
