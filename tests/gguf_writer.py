"""Write an mlx-lm model of the qwen2 / qwen3 / gemma2 / gemma3 / phi3 families to a GGUF file laid
out the way llama.cpp's convert_hf_to_gguf.py lays it out (tensor names, Gemma's 1 + w norms, phi3's
fused tensors, metadata keys), for loader tests. The tables here are written from the converter's
side on purpose, independently of cacheback_mlx.gguf."""

import functools
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from conftest import write_tiny_gguf

# mlx-lm (= Hugging Face) module path -> GGUF tensor name, as gguf-py's tensor_mapping.py maps them
LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up stay fused, gate first
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@functools.cache
def tokenizer_meta() -> dict:
    """conftest's byte-level tokenizer metadata (specials + 256 byte symbols, no merges)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tok.gguf"
        write_tiny_gguf(path, layers=1, hidden=32, heads=2, kv_heads=1)
        _, meta = mx.load(str(path), return_metadata=True)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def vocab_size() -> int:
    return len(tokenizer_meta()["tokenizer.ggml.tokens"])


def family_meta(arch: str, args, context: int, sliding_window: int | None) -> dict:
    """The architecture keys convert_hf_to_gguf.py writes for `arch`."""
    u32 = lambda x: mx.array(x, dtype=mx.uint32)
    f32 = lambda x: mx.array(x, dtype=mx.float32)
    k = lambda key: f"{arch}.{key}"
    meta = {
        "general.architecture": arch, "general.name": f"tiny-{arch}",
        k("context_length"): u32(context), k("embedding_length"): u32(args.hidden_size),
        k("block_count"): u32(args.num_hidden_layers), k("feed_forward_length"): u32(args.intermediate_size),
        k("attention.head_count"): u32(args.num_attention_heads),
        k("attention.head_count_kv"): u32(args.num_key_value_heads),
        k("attention.layer_norm_rms_epsilon"): f32(args.rms_norm_eps),
    }
    if arch != "gemma2":  # Gemma2Model.set_gguf_parameters writes no rope base (llama.cpp: 10000)
        meta[k("rope.freq_base")] = f32(args.rope_theta)
    if getattr(args, "head_dim", None) is not None:
        meta[k("attention.key_length")] = u32(args.head_dim)
        meta[k("attention.value_length")] = u32(args.head_dim)
    if sliding_window is not None:  # gemma2/gemma3/phi3 (llama.cpp ignores phi3's, as mlx-lm does)
        meta[k("attention.sliding_window")] = u32(sliding_window)
    if arch == "gemma2":
        meta[k("attn_logit_softcapping")] = f32(args.attn_logit_softcapping)
        meta[k("final_logit_softcapping")] = f32(args.final_logit_softcapping)
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("type") in ("linear", "yarn"):
        meta[k("rope.scaling.type")] = scaling["type"]
        meta[k("rope.scaling.factor")] = f32(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            meta[k("rope.scaling.original_context_length")] = u32(scaling["original_max_position_embeddings"])
    if arch == "phi3":
        rope_dims = int(args.partial_rotary_factor * args.hidden_size) // args.num_attention_heads
        meta[k("rope.dimension_count")] = u32(rope_dims)
        meta[k("rope.scaling.original_context_length")] = u32(args.original_max_position_embeddings)
    return meta


def write_family_gguf(path, arch: str, model, context: int, sliding_window: int | None = None) -> None:
    """Write `model` (an mlx-lm model of `arch`'s family, float32) as llama.cpp's converter would."""
    names = GEMMA_LAYER if arch.startswith("gemma") else LAYER
    arrays = {}
    for key, value in tree_flatten(model.parameters()):
        module, kind = key.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, i, rest = module.split(".", 3)
            name = f"blk.{i}.{names[rest]}"
        else:
            name = TOP[module]
        if arch.startswith("gemma") and name.endswith("norm"):
            value = value + 1.0  # the converter stores Gemma RMSNorm weights as 1 + w
        arrays[f"{name}.{kind}"] = value
    scaling = getattr(model.args, "rope_scaling", None) or {}
    if arch == "phi3" and scaling.get("type") == "longrope":  # generate_extra_tensors
        arrays["rope_factors_long.weight"] = mx.array(scaling["long_factor"], dtype=mx.float32)
        arrays["rope_factors_short.weight"] = mx.array(scaling["short_factor"], dtype=mx.float32)
    mx.save_gguf(str(path), arrays, {**family_meta(arch, model.args, context, sliding_window), **tokenizer_meta()})
