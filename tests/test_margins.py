"""tools.margins: the margins are one top-two gap per output position (its rounding is
rounding.py's, tests/test_rounding.py)."""

from cacheback_mlx import loader

import numpy as np
import pytest
from tools import margins


@pytest.fixture(scope="module")
def model():
    return loader.load("random:smollm2-135m:f32:layers=2").model


def test_one_gap_per_output_position_as_a_step_sees_it(model):
    import mlx.core as mx

    rng = np.random.default_rng(4)
    streams = [{"prompt": rng.integers(0, 4000, n).tolist(), "out": rng.integers(0, 4000, m).tolist()}
               for n, m in ((12, 5), (30, 9))]
    gaps = margins.margins(model, streams)
    assert gaps.shape == (14,) and (gaps >= 0).all()
    s = streams[1]  # the last output position's gap, from the logits of its own prefix
    ids = s["prompt"] + s["out"]
    top = np.sort(np.asarray(model(mx.array(ids[:-1])[None])[0, -1]))[-2:]
    assert abs(gaps[-1] - (top[1] - top[0])) < 1e-3
