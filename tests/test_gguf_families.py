"""GGUF loader beyond llama: tiny random qwen2 / qwen3 / gemma2 / gemma3 / phi3 models written the
way llama.cpp's converter lays them out load back as the same mlx-lm model, with the same logits."""

from cacheback_mlx.errors import CachebackError
from cacheback_mlx.loader import load

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, gemma3_text, phi3, qwen2, qwen3

from conftest import write_tiny_gguf
from gguf_writer import vocab_size, write_family_gguf

CONTEXT = 64
WINDOW = 8
EPS = 2.0**-16  # exact in float32, so the args compare equal after the round trip
PROMPT = mx.array([list(range(5, 5 + 3 * WINDOW))])  # longer than the sliding window


def families():
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=EPS, vocab_size=vocab_size())
    return {
        "qwen2": (qwen2, dict(base, num_hidden_layers=2, max_position_embeddings=CONTEXT, rope_theta=1e6,
                              tie_word_embeddings=False,
                              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
        "qwen3": (qwen3, dict(base, num_hidden_layers=2, head_dim=32, max_position_embeddings=CONTEXT,
                              rope_theta=1e6, tie_word_embeddings=True)),
        "gemma2": (gemma2, dict(base, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
        "gemma3": (gemma3_text, dict(base, num_hidden_layers=7, head_dim=32, query_pre_attn_scalar=32,
                                     sliding_window=WINDOW, sliding_window_pattern=6, rope_theta=1e6,
                                     rope_local_base_freq=10000.0, max_position_embeddings=CONTEXT,
                                     rope_scaling={"type": "linear", "factor": 8.0})),
        "phi3": (phi3, dict(base, num_hidden_layers=2, max_position_embeddings=CONTEXT,
                            original_max_position_embeddings=16, tie_word_embeddings=False,
                            rope_scaling={"type": "longrope", "long_factor": [1.0 + i / 4 for i in range(8)],
                                          "short_factor": [1.0 + i / 8 for i in range(8)]})),
    }


def tiny(arch, seed=0):
    module, config = families()[arch]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(model_type=module.__name__.rsplit(".", 1)[-1], **config))
    if arch == "gemma3":
        model.sanitize({})  # no lm_head: tied embeddings, as the Gemma 3 checkpoints are
    # norms away from their init so that a wrong (1 + w) offset shows in the logits
    params = [(k, 1.0 + 0.3 * mx.random.normal(v.shape) if k.endswith("norm.weight") else v)
              for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return module, model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_family_gguf_loads_with_the_same_logits(tmp_path, arch):
    module, ref = tiny(arch)
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch, ref, CONTEXT, sliding_window=None if arch.startswith("qwen") else WINDOW)
    loaded = load(path, dtype="float32")
    assert type(loaded.model) is module.Model
    assert loaded.model.args == ref.args
    assert loaded.context_length == CONTEXT
    got, want = np.array(loaded.model(PROMPT)), np.array(ref(PROMPT))
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    assert got[0, -1].std() > 0.05  # not a degenerate model


def test_gemma3_window_and_tied_embeddings_are_live(tmp_path):
    """The sliding window changes gemma3's logits on this prompt, and the file has no output tensor."""
    _, ref = tiny("gemma3")
    write_family_gguf(tmp_path / "g.gguf", "gemma3", ref, CONTEXT, sliding_window=WINDOW)
    loaded = load(tmp_path / "g.gguf", dtype="float32").model
    assert loaded.tie_word_embeddings and "lm_head" not in loaded
    assert loaded.args.sliding_window == WINDOW and loaded.args.sliding_window_pattern == 6
    wide = gemma3_text.Model(gemma3_text.ModelArgs(**{**vars(ref.args), "sliding_window": 10 * WINDOW}))
    wide.sanitize({})
    wide.load_weights(tree_flatten(ref.parameters()))
    assert np.abs(np.array(wide(PROMPT)) - np.array(loaded(PROMPT))).max() > 1e-3


def test_unsupported_architecture_is_one_line(tmp_path):
    write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(CachebackError) as e:
        load(tmp_path / "mamba.gguf", dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and "unsupported architecture 'mamba'" in msg
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"):
        assert arch in msg
