"""Sampling on the host (host_sampling.py): mlx-lm's filters by their rules, draws from exactly the
kept tokens' distribution, seeded draws fixed by position, and where it is used."""

from __future__ import annotations

import math
from collections import Counter

import cacheback_mlx  # noqa: F401 - first (OpenBLAS before mlx)
from cacheback_mlx import host_sampling as H
from cacheback_mlx import sampling
from cacheback_mlx.sampling import SamplingParams, token_picker
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, apply_xtc

SETTINGS = [(0.95, 0.0, 0), (0.9, 0.0, 0), (0.5, 0.0, 0), (0.99, 0.0, 0), (0.0, 0.05, 0), (0.0, 0.0, 40),
            (0.9, 0.05, 40), (0.95, 0.0, 3), (0.0, 0.0, 0)]


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=3000).astype(np.float32) * s for s in (0.3, 1.0, 3.0, 10.0)]
    peaked = rng.normal(size=49152).astype(np.float32) * 2.0  # a language model's shape: a few far ahead
    peaked[rng.choice(49152, 12, replace=False)] += np.linspace(8, 14, 12).astype(np.float32)
    return rows + [peaked]


def _reference(logits: np.ndarray, top_p: float, min_p: float, top_k: int) -> np.ndarray:
    """mlx-lm's filters' rules in float64 on softmax(logits): top-p keeps a token while the mass
    strictly above it is below top_p (ties with the last kept stay), min-p the tokens within
    log(min_p) of the best, top-k the k best of those left."""
    lp = logits.astype(np.float64)
    p = np.exp(lp - lp.max())
    p /= p.sum()
    keep = np.ones(len(lp), bool)
    if 0 < top_p < 1:
        order = np.argsort(-lp, kind="stable")
        above = np.cumsum(p[order]) - p[order]
        keep &= lp >= lp[order[int((above < top_p).sum()) - 1]]
    if min_p:
        keep &= lp >= lp.max() + math.log(min_p)
    if top_k:
        left = np.where(keep, lp, -np.inf)
        keep &= left >= np.sort(left)[-top_k]
    return keep


def _mlx_lm(logits: np.ndarray, top_p: float, min_p: float, top_k: int, xtc: tuple | None = None) -> np.ndarray:
    """What mlx-lm's make_sampler chain keeps; `xtc`: (threshold, special ids) with its XTC applied."""
    x = mx.array(logits)[None]
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        x = apply_top_p(x, top_p)
    if min_p:
        x = apply_min_p(x, min_p, 1)
    if xtc is not None:
        x = apply_xtc(x, 1.0, xtc[0], list(xtc[1]))
    if top_k:
        x = apply_top_k(x, top_k)
    return np.array(x[0]) > -np.inf


@pytest.mark.parametrize("top_p,min_p,top_k", SETTINGS)
def test_the_filters_keep_what_mlx_lm_s_rules_keep(top_p, min_p, top_k):
    """The kept tokens are those of mlx-lm's rules computed exactly (float64); against mlx-lm's own
    functions, min-p and top-k agree token for token, and top-p differs only at its boundary, by
    what mlx-lm's float32 running sum leaves out (the smallest probabilities' mass): at most a
    few tokens holding under 0.2% of the probability."""
    for logits in _rows():
        lowest = H.cut(logits, top_p, min_p, top_k)
        kept = logits >= lowest
        assert (kept == _reference(logits, top_p, min_p, top_k)).all()
        theirs = _mlx_lm(logits, top_p, min_p, top_k)
        if 0 < top_p < 1:
            p = np.exp(logits.astype(np.float64) - logits.max())
            assert (p / p.sum())[kept != theirs].sum() < 2e-3
        else:
            assert (kept == theirs).all()
        assert (lowest == -math.inf) == (top_p in (0.0, 1.0) and not min_p and not top_k)


def test_a_draw_takes_each_token_with_its_weight():
    """draw() inverts the weights' running sum (by blocks past 4 x BLOCK): evenly spread uniforms
    land on each index in proportion to its weight, never on a weight of 0, also at 1 - 2^-53."""
    rng = np.random.default_rng(1)
    for n in (5, 3 * H.BLOCK, 11 * H.BLOCK + 17):
        weights = rng.random(n).astype(np.float32) ** 4
        weights[rng.choice(n, n // 3, replace=False)] = 0.0
        weights[-1] = 0.0  # the last token can never be drawn, even at the very top
        grid = 40_000
        counts = np.bincount([H.draw(weights, (j + 0.5) / grid) for j in range(grid)], minlength=n)
        expected = grid * weights.astype(np.float64) / weights.sum(dtype=np.float64)
        assert (counts[weights == 0] == 0).all()
        assert np.abs(counts - expected).max() <= 2.0
        assert weights[H.draw(weights, 1.0 - 2.0**-53)] > 0 and weights[H.draw(weights, 0.0)] > 0


def test_sampled_tokens_follow_the_filtered_distribution():
    """choose(): over many uniforms, each kept token's frequency is its probability at the
    temperature among the kept ones (a chi-square test); nothing outside is drawn."""
    logits = _rows()[1][:300]
    rng = np.random.default_rng(2)
    for temperature, top_p, min_p, top_k in ((0.7, 0.9, 0.0, 0), (1.5, 0.0, 0.0, 20), (1.0, 0.0, 0.1, 0)):
        kept = _reference(logits, top_p, min_p, top_k)
        w = np.where(kept, np.exp((logits.astype(np.float64) - logits.max()) / temperature), 0.0)
        probs = w / w.sum()
        n = 20_000
        counts = Counter(H.choose(logits, float(u), temperature, top_p, min_p, top_k) for u in rng.random(n))
        assert all(kept[t] for t in counts)
        top = np.argsort(-probs)[:6]
        expected = np.append(probs[top], 1 - probs[top].sum()) * n
        observed = np.append([counts.get(int(t), 0) for t in top], n - sum(counts.get(int(t), 0) for t in top))
        chi2 = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
        assert chi2 < 24.3, (temperature, top_p, min_p, top_k, chi2)  # 6 dof, p ~ 0.0005


def test_the_picker_runs_on_the_host_on_the_cpu_unless_turned_off(monkeypatch):
    """On MLX's CPU device a sampled picker is host_sampling's; seeded, its draw at a position is
    the one fixed by the seed and that position (whatever the rows beside it); unseeded, it follows
    MLX's global random state. CACHEBACK_MLX_HOST_SAMPLING=0 (HOST_SAMPLING) gives mlx-lm's."""
    logits = mx.array(np.stack(_rows()[:4])[:, :1000])
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    tree = DraftTree([1, 2, 3], [-1, 0, -1])  # rows at positions 10, 11, 12 and 11
    picks = token_picker(params)(logits, 10, tree).tolist()
    assert picks == [H.choose(np.array(row), H.position_uniform(7, p), 0.8, 0.95)
                     for row, p in zip(logits, [10, 11, 12, 11])]
    unseeded = token_picker(SamplingParams(temperature=0.8))
    mx.random.seed(3)
    first = [unseeded(logits[:1]).item() for _ in range(20)]
    mx.random.seed(3)
    assert [unseeded(logits[:1]).item() for _ in range(20)] == first and len(set(first)) > 1
    monkeypatch.setattr(sampling, "HOST_SAMPLING", False)
    monkeypatch.setattr(H, "choose", None)  # not called: mlx-lm's filters and Gumbel draws instead
    assert token_picker(params)(logits, 10, tree).shape == (4,)


def test_degenerate_rows_still_give_a_token():
    """A temperature whose inverse overflows, or a row without a finite best logit, gives the best
    token (the limit of a vanishing temperature) rather than failing."""
    logits = np.array([0.5, 3.0, -1.0, 2.0], np.float32)
    assert H.choose(logits, 0.9, 1e-320) == 1
    assert H.choose(logits, 0.9, 1e-320, top_p=0.9, top_k=2) == 1
    assert H.choose(np.full(4, -np.inf, np.float32), 0.5, 1.0) in range(4)
    assert H.choose(np.array([1.0, np.nan, 0.0], np.float32), 0.5, 0.7) in range(3)
    assert H.choose(np.full(4, -np.inf, np.float32), 0.5, 1.0, top_p=0.9, min_p=0.1, top_k=2) in range(4)
