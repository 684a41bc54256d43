"""GGUF files of the llama, qwen2, qwen3, gemma2, gemma3 and phi3 families as mlx-lm models.

`mx.load(path, return_metadata=True)` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX
quantized triples (weight, scales, biases; group size 32), f16/f32 as plain arrays. ARCHS maps each
`general.architecture` to an mlx-lm model module, its tensor names and the args llama.cpp fixes for
it. Layouts follow llama.cpp's convert_hf_to_gguf.py: only llama-family q/k are permuted to the
interleaved RoPE layout (rope_traditional=True); the others keep the NeoX layout. Gemma norms are
stored as (1 + w) and mlx-lm's Gemma RMSNorm adds the 1 itself, so we subtract it.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma2, gemma3_text, llama, phi3, qwen2, qwen3

from . import dequant
from .errors import CachebackError

# GGUF block tensor -> mlx-lm module path, per family
LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA_NAMES = {**LLAMA_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# module, layer names, fixed args; norm_shift: norms stored as 1 + w; big: block count of the 27B
# model, whose attention scale is 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim) (llama.cpp)
ARCHS = {
    "llama": dict(module=llama, names=LLAMA_NAMES, args=dict(rope_traditional=True)),
    "mistral": dict(module=llama, names=LLAMA_NAMES, args=dict(rope_traditional=True)),
    "qwen2": dict(module=qwen2, names=LLAMA_NAMES, args={}),
    "qwen3": dict(module=qwen3, names={**LLAMA_NAMES, **QK_NORM}, args={}),
    "gemma2": dict(module=gemma2, names=GEMMA_NAMES, args={}, norm_shift=True, big=46),
    # llama.cpp hard-codes gemma3's pattern (5 sliding layers, then 1 global) and local RoPE base
    "gemma3": dict(module=gemma3_text, names={**GEMMA_NAMES, **QK_NORM}, norm_shift=True, big=62,
                   args=dict(sliding_window_pattern=6, rope_local_base_freq=10000.0)),
    "phi3": dict(module=phi3, names=PHI3_NAMES, args={}),
}


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


def rope_scaling(get, weights: dict) -> dict | None:
    """RoPE scaling as mlx-lm's config dict: phi3's long-rope factor tensors, else linear/yarn keys."""
    if "rope_factors_long.weight" in weights:
        short = weights.get("rope_factors_short.weight", weights["rope_factors_long.weight"])
        return {"type": "longrope", "long_factor": weights["rope_factors_long.weight"].tolist(),
                "short_factor": short.tolist()}
    kind = get("rope.scaling.type")
    if kind in (None, "none") or float(get("rope.scaling.factor", 1.0)) == 1.0:
        return None
    if kind not in ("linear", "yarn"):
        raise CachebackError(f"unsupported RoPE scaling {kind!r} in GGUF metadata (supported: linear, yarn)")
    out = {"type": kind, "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn" and get("rope.scaling.original_context_length") is not None:
        out["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    return out


def model_args(meta: dict, weights: dict):
    """The mlx-lm ModelArgs of the file's family, from its metadata (llama.cpp's key names)."""
    arch = architecture(meta)
    spec = ARCHS.get(arch)
    if spec is None:
        raise CachebackError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHS)})")

    def get(key, default=None):
        return meta_value(meta, f"{arch}.{key}", default)

    def need(key):
        v = get(key)
        if v is None:
            raise CachebackError(f"GGUF metadata lacks {arch}.{key}")
        return v

    hidden, heads, layers = int(need("embedding_length")), int(need("attention.head_count")), int(need("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    embed_rows = (weights.get("token_embd.scales", weights.get("token_embd.weight"))).shape[0]
    args = dict(
        model_type=spec["module"].__name__.rsplit(".", 1)[-1],
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=int(need("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(get("vocab_size", embed_rows)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling(get, weights),
        partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim,
        tie_word_embeddings="output.weight" not in weights,
        max_position_embeddings=int(get("context_length", 4096)),
        query_pre_attn_scalar=hidden / heads if layers == spec.get("big") else head_dim,
    )
    # keys the converter writes only when set: leave the others to the module's defaults
    optional = {"sliding_window": "attention.sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping",
                "original_max_position_embeddings": "rope.scaling.original_context_length"}
    args.update({k: get(key) for k, key in optional.items() if get(key) is not None})
    args.update(spec["args"])
    if arch == "gemma3" and args.get("final_logit_softcapping"):
        raise CachebackError("gemma3 final_logit_softcapping is not supported (mlx-lm's gemma3_text has none)")
    return spec["module"].ModelArgs.from_dict(args)  # keeps the fields this family's args have


def mlx_name(gguf_name: str, arch: str) -> str:
    stem, kind = gguf_name.rsplit(".", 1)  # kind: weight / scales / biases / bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    names = ARCHS[arch]["names"]
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{kind}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    raise CachebackError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")


def quant_bits(weight: mx.array, scales: mx.array, group_size: int = 32) -> int:
    """Bits per weight of an MLX-quantized matrix, from the packed and unpacked widths."""
    cols = scales.shape[-1] * group_size
    return weight.shape[-1] * 32 // cols


def load_gguf_model(path: str | Path, dtype: str, in_out: bool = False) -> tuple[nn.Module, dict]:
    """An mlx-lm Model of the file's family with its weights, in `dtype` ("native" keeps quantization);
    with `in_out`, float32 weights dequantized on the CPU come as transposed views of [in, out]
    copies (the layout blas.transpose_weights stores)."""
    weights, meta = read_gguf(path)
    args = model_args(meta, weights)
    arch = architecture(meta)
    model = ARCHS[arch]["module"].Model(args)
    shift = ARCHS[arch].get("norm_shift", False)
    named = {}
    for k, v in weights.items():
        if k.startswith("rope_factors_"):  # phi3 long-rope factors, already in args.rope_scaling
            continue
        if shift and k.rsplit(".", 1)[0].endswith("norm"):
            v = v.astype(mx.float32) - 1.0
        named[mlx_name(k, arch)] = v
    if hasattr(model, "sanitize"):  # drops lm_head when tied (gemma3_text removes the module too)
        named = model.sanitize(named)
    quantized = {k[: -len(".scales")] for k in named if k.endswith(".scales")}
    if dtype == "native":
        bits = {p: quant_bits(named[p + ".weight"], named[p + ".scales"]) for p in quantized}
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: p in bits and {"group_size": 32, "bits": bits[p]})
        target = mx.float16
    else:
        target = getattr(mx, dtype)
        parts = {}
        for p in quantized:
            w, s, b = named.pop(p + ".weight"), named.pop(p + ".scales"), named.pop(p + ".biases")
            parts[p] = (w, s, b, quant_bits(w, s), 32)
        fast = dequant.to_float32(parts, in_out) if target == mx.float32 else {}
        for p, (w, s, b, bits, group) in parts.items():
            named[p + ".weight"] = fast[p] if p in fast else mx.dequantize(w, s, b, group_size=group, bits=bits)
    named = {k: (v.astype(target) if v.dtype in (mx.float32, mx.float16, mx.bfloat16) and v.dtype != target else v)
             for k, v in named.items()}
    try:
        model.load_weights(list(named.items()), strict=True)
    except ValueError as e:
        raise CachebackError(f"GGUF tensors do not match a {arch} model: {str(e).splitlines()[0]}") from None
    mx.eval(model.parameters())
    return model, meta
