"""Shared fixtures: tiny random llama models (fast), and the real default model (slow)."""

import cacheback_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core, as the package does)
import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama


def tiny_llama(seed: int = 0, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, traditional: bool = True):
    """A randomly initialised mlx-lm llama; GQA when kv_heads < heads."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=vocab,
                           rope_traditional=traditional, tie_word_embeddings=False)
    model = llama.Model(args)
    # larger weights than the default init give peaked, varied next-token distributions
    model.update(tree_map(lambda w: w * 3.0, model.parameters()))
    mx.eval(model.parameters())
    return model


TINY_CONFIGS = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "mqa-wide": dict(hidden=96, heads=6, kv_heads=1, layers=3, vocab=150, traditional=False),
}


@pytest.fixture(params=list(TINY_CONFIGS))
def tiny_model(request):
    return tiny_llama(seed=list(TINY_CONFIGS).index(request.param), **TINY_CONFIGS[request.param])


@pytest.fixture(scope="session")
def default_model():
    from cacheback_mlx.loader import load

    return load()
