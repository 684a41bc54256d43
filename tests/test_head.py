"""The output head over only the rows a pass reads (head.py): what a riding prompt chunk skips."""

from cacheback_mlx.head import KeptRowsEmbedding, KeptRowsLinear, keep_rows, prepare_head

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import zoo


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gemma2", "qwen3_next"])
def test_the_head_runs_on_the_kept_rows_only_and_gives_them_their_logits(family):
    """Untied (llama: lm_head), tied (qwen2: the embedding's as_linear) and soft-capped heads:
    inside keep_rows the logits hold the kept rows in order, as the whole pass gives them (to
    rounding: a matrix product of fewer rows may round otherwise); outside it nothing changes; the
    parameters keep their names and values, and preparing twice changes nothing more."""
    model = zoo.tiny_model(family)
    names = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    x = mx.array([[3, 4, 5, 6, 7, 8, 9]])
    full = model(x)
    n = prepare_head(model)
    assert n >= 1 and prepare_head(model) == n
    heads = [m for _, m in model.named_modules() if isinstance(m, (KeptRowsLinear, KeptRowsEmbedding))]
    assert len(heads) == n
    assert {k: np.array(v) for k, v in tree_flatten(model.parameters())}.keys() == names.keys()
    assert all(np.array_equal(np.array(v), names[k]) for k, v in tree_flatten(model.parameters()))
    rows = mx.array([1, 4, 6])
    with keep_rows(rows):
        part = model(x)
    assert part.shape == (1, 3, full.shape[-1])
    assert np.allclose(np.array(part[0]), np.array(full[0, rows]), rtol=1e-4, atol=1e-4)
    again = model(x)
    assert again.shape == full.shape and np.allclose(np.array(again), np.array(full), rtol=1e-5, atol=1e-5)
