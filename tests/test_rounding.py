"""rounding.py: a verify pass against one-token steps, row for row (the same positions' logits),
on a plain and a hybrid model; `doctor --rounding` says it in one line."""

from cacheback_mlx import loader, rounding
from cacheback_mlx.cli import main

import numpy as np
import pytest
from click.testing import CliRunner

from zoo import tiny_model


@pytest.fixture(scope="module")
def model():
    return loader.load("random:smollm2-135m:f32:layers=2").model


def test_a_pass_and_its_steps_are_compared_row_for_row(model):
    ids = np.random.default_rng(3).integers(0, 4000, 60).tolist()
    for rows, start in ((2, 41), (8, 46), (16, 45)):
        diff, flipped = rounding.pass_against_steps(model, ids, start, rows)
        assert 0 <= diff < 1e-3 and not flipped  # rows out of step would differ by whole logits
    with pytest.raises(ValueError, match="need"):
        rounding.pass_against_steps(model, ids, 50, 16)


def test_a_hybrid_model_s_chain_is_compared_too():
    ids = np.random.default_rng(5).integers(0, 128, 30).tolist()  # the zoo's vocabulary: 128
    diff, flipped = rounding.pass_against_steps(tiny_model("qwen3_5"), ids, 20, 8)
    assert 0 <= diff < 1e-3 and not flipped


def test_the_line_says_each_row_count():
    line = rounding.describe({2: (0.0, False), 16: (0.0, False)})
    assert "2 rows bit for bit, 16 rows bit for bit" in line and "same logits" in line
    line = rounding.describe({2: (0.0, False), 8: (3.1e-5, False), 16: (0.02, True)})
    assert "8 rows up to 3.1e-05, 16 rows up to 0.02 (a pick changed)" in line and "within ~0.02" in line


def test_doctor_measures_it_on_the_model(monkeypatch):
    from cacheback_mlx import sharing

    monkeypatch.setattr(sharing, "check_sharing", lambda engine: sharing.Sharing("not checked here"))
    r = CliRunner().invoke(main, ["doctor", "--model", "random:smollm2-135m:f32:layers=2", "--rounding"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("rounding (float32): "))
    for n in rounding.ROWS:
        assert f"{n} rows " in line
