"""tools.margins: a pass's rounding against steps is taken row for row (the same positions'
logits), and the margins are one top-two gap per output position."""

from cacheback_mlx import loader

import numpy as np
import pytest
from tools import margins


@pytest.fixture(scope="module")
def model():
    return loader.load("random:smollm2-135m:f32:layers=2").model


def test_a_pass_and_its_steps_are_compared_row_for_row(model):
    rng = np.random.default_rng(3)
    stream = {"prompt": rng.integers(0, 4000, 40).tolist(), "out": rng.integers(0, 4000, 20).tolist()}
    for rows, at in ((2, 0), (8, 5)):
        diff, flipped = margins.rounding(model, stream, rows, at)
        assert 0 <= diff < 1e-3 and not flipped  # rows out of step would differ by whole logits


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
