"""XTC sampling ("exclude top choices"), as mlx-lm's make_sampler applies it, at every row of a pass."""

from cacheback_mlx import host_sampling, sampling
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.sampling import SamplingParams

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter
from test_host_sampling import _mlx_lm

PROMPT = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8]


def mlx_lm_kept(row: np.ndarray, top_p, min_p, top_k, threshold, special) -> set[int]:
    """The tokens mlx-lm's make_sampler chain keeps when its XTC applies (probability 1)."""
    return set(np.flatnonzero(_mlx_lm(row, top_p, min_p, top_k, (threshold, special))).tolist())


@pytest.mark.parametrize("top_p, min_p, top_k", [(0.0, 0.0, 0), (0.9, 0.0, 0), (0.0, 0.05, 0), (0.95, 0.02, 5),
                                                 (0.0, 0.0, 3)])
def test_the_tokens_xtc_keeps_are_mlx_lm_s(top_p, min_p, top_k):
    """On the host (the CPU) and in MLX (a GPU), after top-p and min-p and before top-k."""
    rng = np.random.default_rng(5)
    for trial in range(20):
        row = (rng.normal(size=300) * rng.uniform(0.5, 4)).astype(np.float32)
        threshold = [0.05, 0.1, 0.2, 0.5][trial % 4]
        special = [int(np.argmax(row))] if trial % 3 == 0 else []  # the best kept, as a new line or the EOS is
        want = mlx_lm_kept(row, top_p, min_p, top_k, threshold, special)
        got = host_sampling.kept_tokens(row, top_p, min_p, top_k, (threshold, tuple(special)))
        assert set(got.tolist()) == want, trial
        x = mx.array(row)[None]
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        x = apply_min_p(apply_top_p(x, top_p) if 0 < top_p < 1 else x, min_p, 1) if min_p else (
            apply_top_p(x, top_p) if 0 < top_p < 1 else x)
        x = sampling.xtc_rows(x, mx.array([True]), threshold, special)
        x = apply_top_k(x, top_k) if top_k else x
        assert set(np.flatnonzero(np.isfinite(np.array(x[0]))).tolist()) == want, trial


def test_xtc_draws_follow_the_mixture_it_makes():
    """With probability p a row draws from the tokens XTC keeps, else from them all: the host's
    draws over many rows (each with its own number for the coin) follow that mixture."""
    row = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))
    p, threshold, n = 0.6, 0.12, 40000
    plain = np.exp(row) / np.exp(row).sum()
    xtc = np.where([False, False, True, False, False], plain, 0.0)  # above 0.12: 0.4, 0.3, 0.15; the least stays
    xtc = xtc + np.where([False, False, False, True, True], plain, 0.0)
    want = (1 - p) * plain + p * xtc / xtc.sum()
    mx.random.seed(3)
    pick = host_sampling.host_picker(1.0, 0.0, 0.0, 0, None, (p, threshold, ()))
    got = np.bincount(np.array(pick(mx.array(np.tile(row, (n, 1))))), minlength=5) / n
    assert np.abs(got - want).max() < 0.01, (got, want)
    in_mlx = sampling.seeded_picker(SamplingParams(temperature=1.0, xtc_probability=p, xtc_threshold=threshold), 0.0)
    got = np.bincount(np.array(in_mlx(mx.array(np.tile(row, (n, 1))))), minlength=5) / n  # a GPU's, unseeded
    assert np.abs(got - want).max() < 0.01, (got, want)
    seeded = host_sampling.host_picker(1.0, 0.0, 0.0, 0, 7, (p, threshold, ()))
    counts = np.zeros(5)
    for first in range(0, 4000):
        counts[int(np.array(seeded(mx.array(row[None]), first))[0])] += 1
    assert np.abs(counts / 4000 - want).max() < 0.03, (counts / 4000, want)


@pytest.mark.parametrize("host", [True, False], ids=["host", "mlx"])  # the CPU's picker, and a GPU's
@pytest.mark.parametrize("tiny_model", ["mha"], indirect=True)
def test_a_seeded_request_with_xtc_samples_the_same_text_with_any_drafter(tiny_model, host, monkeypatch):
    monkeypatch.setattr(sampling, "HOST_SAMPLING", host)
    sampling_ = SamplingParams(temperature=1.0, top_k=20, seed=99, xtc_probability=0.5, xtc_threshold=0.05)

    def sample(drafter, budget=None):
        eng = Engine(tiny_model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=budget)
        return [t for step in eng.generate(PROMPT, 24, sampling_) for t in step]

    plain = sample(NoDrafter())
    no_xtc = SamplingParams(temperature=1.0, top_k=20, seed=99)
    eng = Engine(tiny_model, eos_ids=[], drafter=NoDrafter(), context_length=4096)
    assert [t for step in eng.generate(PROMPT, 24, no_xtc) for t in step] != plain  # XTC changed the draws
    assert sample(RandomTreeDrafter(PROMPT, plain, seed=2), budget=12) == plain
    assert sample(OracleDrafter(PROMPT, plain, extra_wrong_branches=1), budget=5) == plain
    assert sample(WrongDrafter(lambda history: plain[len(history) - len(PROMPT)]), budget=8) == plain
    assert sample(NoDrafter()) == plain


def test_bad_xtc_settings_are_one_line_errors():
    for kw, why in (({"xtc_probability": 1.5}, "xtc_probability"), ({"xtc_threshold": 0.7}, "xtc_threshold")):
        with pytest.raises(CachebackError, match=why):
            SamplingParams(temperature=1.0, **kw)


def test_generate_takes_mlx_lm_s_xtc_options(tmp_path):
    """`--xtc-probability`/`--xtc-threshold` as mlx_lm.generate's (a new line and the EOS kept):
    seeded, the same text with drafts or without, and not the text without XTC."""
    from cacheback_mlx.cli import main

    from click.testing import CliRunner

    from conftest import write_tiny_gguf

    path = str(tmp_path / "t.gguf")
    write_tiny_gguf(path, context=512)

    def run(*extra):
        r = CliRunner().invoke(main, ["generate", "abcabcabc abc", "--model", path, "--raw", "-n", "32", "--temp",
                                      "1.0", "--seed", "5", *extra])
        assert r.exit_code == 0, r.stderr
        return r.stdout

    xtc = ["--xtc-probability", "0.7", "--xtc-threshold", "0.05"]
    assert run(*xtc, "--drafter", "none") == run(*xtc, "--drafter", "auto") != run("--drafter", "none")
    r = CliRunner().invoke(main, ["generate", "a", "--model", path, "--temp", "1", "--xtc-threshold", "0.7"])
    assert r.exit_code == 1 and "xtc_threshold must be in [0, 0.5]" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.serial  # starts a server
def test_the_server_takes_xtc_as_mlx_lm_s_server_does(tmp_path):
    from cacheback_mlx.api import Session
    from cacheback_mlx.sampling import xtc_special

    import httpx

    from conftest import write_tiny_gguf
    from test_server import serving

    path = str(tmp_path / "t.gguf")
    write_tiny_gguf(path, context=512)
    session = Session(path, "ngram")
    body = {"prompt": "abcabcabc abc", "n_predict": 24, "temperature": 1.0, "seed": 8, "xtc_probability": 0.7,
            "xtc_threshold": 0.05}
    ids = session.tokenizer.encode(body["prompt"])
    asked = SamplingParams(temperature=1.0, seed=8, xtc_probability=0.7, xtc_threshold=0.05,
                           xtc_special=xtc_special(session.tokenizer, session.engine.eos_ids))
    want = session.text_of([t for step in session.engine.generate(ids, 24, asked) for t in step])
    plain = session.text_of([t for step in session.engine.generate(ids, 24, SamplingParams(temperature=1.0, seed=8))
                             for t in step])
    assert want != plain
    with serving(session) as url:
        r = httpx.post(f"{url}/completion", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["content"] == want
        r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4, "xtc_threshold": 0.7}, timeout=60)
        assert 400 <= r.status_code < 500
