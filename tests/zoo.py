"""A zoo of tiny random mlx-lm models, one per supported model family, for exactness tests.

    FAMILIES[name]   -> the config dict handed to that mlx-lm module's ModelArgs.from_dict
    tiny_model(name) -> a seeded, randomly initialised, float32 model in eval mode

Every model is small (vocab 128, hidden 32-64, 2-6 layers) so a forward pass costs milliseconds
on a 2-core CPU, yet each holds at least one layer of every kind its family has: sliding and
full attention (sliding_window = 8, so 20-40 token prompts cross the window), KV-shared layers,
recurrent and attention layers, dense and MoE blocks, rope and no-rope layers.  Position
thresholds (ministral3's llama-4 attention scaling, llama4's floor_scale) are set to 16 so a
40-token context crosses them, with a scaling beta large enough to move the logits.

The weight matrices (every floating parameter named ``*weight`` with ndim >= 2: Linear,
Conv1d and SwitchLinear weights; embeddings apart) and the norm gains are multiplied by
per-family factors (_SCALE) so greedy decoding gives a varied stream instead of one token
repeated.  Biases, SSM constants (A_log, D, dt_bias), attention sinks and layer scalars keep
their init values.

The family name is the mlx_lm.models module name, except where mlx-lm maps a model_type onto
another module (``mistral`` -> ``llama``): see _MODULE.

Not buildable from mlx-lm 0.32.2: none of the requested families is missing.  Note that the
``llama4_text`` module of mlx-lm 0.32.2 has no attention temperature tuning (no floor_scale,
no original_max_position_embeddings): its only position-dependent parts are rope on the layers
flagged in no_rope_layers.  The floor_scale variant lives in the ``llama4`` module (text_config,
chunked attention, ChunkedKVCache); it is built as the extra family ``llama4`` (EXTRA_FAMILIES,
not in FAMILIES).
"""

import importlib

import cacheback_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

VOCAB = 128
WINDOW = 8  # sliding_window for every sliding-window family
THRESHOLD = 16  # position threshold for attention-scaling families

# family -> mlx_lm.models module, where they differ (mlx_lm.utils.MODEL_REMAPPING)
_MODULE = {"mistral": "llama"}

_S, _F = "sliding_attention", "full_attention"

FAMILIES: dict[str, dict] = {
    "llama": dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        model_type="phi3", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, original_max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "starcoder2": dict(
        model_type="starcoder2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, norm_epsilon=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    # model_type "mistral" loads through the llama module.  Its layer_types mix sliding and
    # full layers so the llama module's sliding path (RotatingKVCache) is covered too.
    "mistral": dict(
        model_type="mistral", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        layer_types=[_S, _F, _S], sliding_window=WINDOW,
    ),
    # llama-4 style attention scaling: q *= 1 + beta * log(1 + floor(pos / original_max_pos))
    "ministral3": dict(
        model_type="ministral3", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False,
        layer_types=[_S, _F, _S], sliding_window=WINDOW,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=2.0,
            original_max_position_embeddings=THRESHOLD, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=1.0,
        ),
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000,
        sliding_window=WINDOW, layer_types=[_S, _F],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
        moe_intermediate_size=32, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False,
    ),
    # mlx-lm's gemma2 has no sliding-window layers: every layer is full attention (KVCache).
    "gemma2": dict(
        model_type="gemma2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    # layer i is full when (i + 1) % sliding_window_pattern == 0: S S F S
    "gemma3_text": dict(
        model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=16, sliding_window=WINDOW, sliding_window_pattern=3,
        max_position_embeddings=512, rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # S F S F S F; the last 2 layers (S, F) own no cache and reuse the K/V of layers 2 and 3.
    # Full layers use global_head_dim with proportional (partial) rope.
    "gemma4_text": dict(
        model_type="gemma4_text", vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
        hidden_size=64, num_hidden_layers=6, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, rms_norm_eps=1e-6, sliding_window=WINDOW,
        sliding_window_pattern=2, layer_types=[_S, _F] * 3, max_position_embeddings=512,
        final_logit_softcapping=30.0, use_double_wide_mlp=True,
        rope_parameters={
            _F: {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                 "rope_type": "proportional"},
            _S: {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0, "rope_type": "default"},
        },
    ),
    # S S F S F; the last 2 layers (S, F) are KV-shared: they read the caches of layers 1 and 2.
    # Without a cache (model(x)) mlx-lm's shared layers project their own K/V instead, so the
    # uncached forward is NOT the cached model: compare cached runs with cached runs.
    "gemma3n": dict(
        model_type="gemma3n",
        text_config=dict(
            model_type="gemma3n_text", vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
            hidden_size=64, num_hidden_layers=5, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_kv_shared_layers=2, rms_norm_eps=1e-6,
            sliding_window=WINDOW, max_position_embeddings=512, rope_local_base_freq=10_000.0,
            rope_theta=1_000_000.0, final_logit_softcapping=30.0,
            layer_types=[_S, _S, _F, _S, _F],
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0],
            hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=120.0,
            altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
        ),
    ),
    # layer i is full when (i + 1) % sliding_window_pattern == 0: S F S F.  Full layers: no rope.
    "cohere2": dict(
        model_type="cohere2", vocab_size=VOCAB, hidden_size=64, head_dim=16, num_hidden_layers=4,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=10000.0, layer_norm_eps=1e-5, logit_scale=0.25, sliding_window=WINDOW,
        sliding_window_pattern=2,
    ),
    "olmo2": dict(
        model_type="olmo2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    # every 4th layer is NoPE (no_rope_layer_interval = 4): rope rope rope NoPE
    "smollm3": dict(
        model_type="smollm3", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, no_rope_layer_interval=4,
    ),
    "granite": dict(
        model_type="granite", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        logits_scaling=4.0, attention_multiplier=0.0625, embedding_multiplier=4.0,
        residual_multiplier=0.5, max_position_embeddings=512, attention_bias=False,
        mlp_bias=False, rope_theta=10000.0, tie_word_embeddings=True,
    ),
    # rope on layers flagged 1 in no_rope_layers: rope rope rope NoPE
    "llama4_text": dict(
        model_type="llama4_text", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        intermediate_size=64, intermediate_size_mlp=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
    ),
    # gated-delta (linear) layers and full-attention layers: L F L F; MoE except layer 1
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
        mlp_only_layers=[1], moe_intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=512, norm_topk_prob=True,
        tie_word_embeddings=False, full_attention_interval=2,
    ),
    # gated-delta (linear) layers and full-attention layers: L F L F (dense MLPs)
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            max_position_embeddings=512, tie_word_embeddings=False, full_attention_interval=2,
            rope_parameters={"type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
        ),
    ),
    # M = mamba2 mixer (cache), * = attention without rope (cache), - = MLP, E = MoE (no cache)
    "nemotron_h": dict(
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M", "E"],
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1,
        n_routed_experts=4, n_shared_experts=1, topk_group=1, num_experts_per_tok=2,
        norm_topk_prob=True, routed_scaling_factor=1.0,
    ),
    # every layer runs a mamba2 mixer and attention in parallel (CacheList per layer)
    "falcon_h1": dict(
        model_type="falcon_h1", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_d_conv=4, mamba_chunk_size=16, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # short-conv layers and attention layers: C C F C
    "lfm2": dict(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        rope_theta=10000.0, layer_types=["conv", "conv", _F, "conv"],
    ),
    "mamba": dict(
        model_type="mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=4, tie_word_embeddings=True,
    ),
    "mamba2": dict(
        model_type="mamba2", vocab_size=VOCAB, num_heads=8, head_dim=16, hidden_size=64,
        intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
        tie_word_embeddings=True, time_step_limit=(0.0, float("inf")), time_step_rank="auto",
    ),
    # mamba and attention (no rope) layers M A M A; MoE feed-forward on layers 1 and 3
    "jamba": dict(
        model_type="jamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
        mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
    ),
}

# Buildable by tiny_model but kept out of FAMILIES.
EXTRA_FAMILIES: dict[str, dict] = {
    # llama4 (text_config): chunked attention (ChunkedKVCache, chunk 8) on rope layers, and on
    # every 4th (NoPE, global, KVCache) layer attention temperature tuning:
    # q *= 1 + attn_scale * log(1 + floor((pos + 1) / floor_scale)).  MoE on odd layers (top-1).
    "llama4": dict(
        model_type="llama4",
        text_config=dict(
            model_type="llama4_text", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            intermediate_size=64, intermediate_size_mlp=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, attention_bias=False,
            attention_chunk_size=WINDOW, interleave_moe_layer_step=2, num_local_experts=4,
            num_experts_per_tok=1, max_position_embeddings=512, rms_norm_eps=1e-5,
            rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, attn_temperature_tuning=True,
            floor_scale=THRESHOLD, attn_scale=1.0,
        ),
    ),
}

# Which families hold which kinds of layers.
SLIDING = ("mistral", "ministral3", "gpt_oss", "gemma3_text", "gemma4_text", "gemma3n", "cohere2")
SHARED_KV = ("gemma4_text", "gemma3n")  # layers that own no cache and reuse an earlier layer's
HYBRID = ("qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1", "lfm2", "mamba", "mamba2", "jamba")

# Weight multipliers per family: (matrices, embeddings, norm gains).  The default init gives
# near-uniform logits and greedy streams that collapse onto one token.  Families whose
# embeddings are multiplied up inside the model (gemma: * sqrt(hidden)) keep smaller
# embeddings, or the residual stream drowns what the layers add.
_DEFAULT_SCALE = (3.0, 3.0, 3.0)
_SCALE: dict[str, tuple[float, float, float]] = {
    "gemma2": (3.0, 1.0, 3.0),
    "gemma4_text": (3.0, 1.0, 3.0),
    "gemma3n": (12.0, 0.3, 3.0),
    "falcon_h1": (2.0, 3.0, 1.0),
    "mamba2": (2.0, 0.3, 3.0),
    "llama4": (5.0, 1.0, 1.0),
}


def module_for(family: str):
    """The mlx_lm.models module that builds `family`."""
    return importlib.import_module(f"mlx_lm.models.{_MODULE.get(family, family)}")


def _config(family: str) -> dict:
    if family in FAMILIES:
        return FAMILIES[family]
    if family in EXTRA_FAMILIES:
        return EXTRA_FAMILIES[family]
    raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES) + sorted(EXTRA_FAMILIES)}")


def _copy(x):
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


def wide_heads(family: str) -> dict:
    """Changes to `family`'s config giving its attention heads 32 dimensions (16 in FAMILIES), so
    its keys and values can be quantized in groups of 32 (mx.quantize's smallest)."""
    config = _config(family)
    inner = config.get("text_config", config)
    if "head_dim" in inner:
        return {"head_dim": 32}
    return {"num_attention_heads": inner["hidden_size"] // 32, "num_key_value_heads": 1}


def tiny_model(family: str, seed: int = 0, **changes) -> nn.Module:
    """A tiny randomly initialised mlx-lm model of `family` (float32, eval mode, params evaluated);
    `changes` to its config (to its text_config where it has one)."""
    config = _copy(_config(family))  # ModelArgs.__post_init__ may mutate nested dicts
    config.get("text_config", config).update(changes)
    mx.random.seed(seed)
    module = module_for(family)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    matrix_scale, embed_scale, norm_scale = _SCALE.get(family, _DEFAULT_SCALE)

    def scaled(path, w):
        if not (path.endswith("weight") and mx.issubdtype(w.dtype, mx.floating)):
            return w  # biases, SSM constants (A_log, D, dt_bias), sinks, scalars
        if w.ndim == 1:
            return w * norm_scale if "norm" in path else w
        if "embed" in path:
            return w * embed_scale
        if family == "nemotron_h" and path.endswith("gate.weight"):
            # the MoE router is zero-initialised: give it random rows so routing varies
            return mx.random.normal(w.shape, dtype=w.dtype) * (w.shape[-1] ** -0.5) * matrix_scale
        return w * matrix_scale

    model.update(tree_map_with_path(scaled, model.parameters()))
    if family == "gpt_oss":
        # attention sinks start at zero; make them non-trivial
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    model.eval()
    mx.eval(model.parameters())
    return model


def tree_logits_error(model, tree, prompt) -> float:
    """One engine pass over `tree` after `prompt` vs mlx-lm's logits along each row's root path,
    fed token by token into the model's own cache: the worst row's max abs difference, relative
    to that row's largest logit (at least 1)."""
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.verify import prefill, verify_pass

    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = ModelCache(model)
    prefill(model, cache, prompt[:-1])
    logits = np.array(verify_pass(model, cache, [prompt[-1]], tree))
    worst = 0.0
    for row in range(len(tree) + 1):
        path, p = [], row - 1
        while p >= 0:
            path.append(int(tree.tokens[p]))
            p = tree.parents[p]
        ref_cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=ref_cache)
        for t in [prompt[-1]] + path[::-1]:
            ref = np.array(model(mx.array([[t]]), cache=ref_cache)[0, -1])
        worst = max(worst, float(np.abs(logits[row] - ref).max() / max(1.0, float(np.abs(ref).max()))))
    return worst
