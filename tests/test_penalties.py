"""Penalties and logit biases (mlx-lm's logits processors, sampling.penalties): every row of a pass
gets the logits mlx-lm's generate_step would give its sampler at that position, each row after its
own tokens, so greedy output with penalties equals mlx-lm's with the same processors, whatever is
drafted; in a batch's lanes too, and a seeded sampled request gives the same text with any drafts."""

from cacheback_mlx.batch import Batch
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.sampling import SamplingParams, penalties, processed_rows
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import zoo
from adversarial import KnownStreamsDrafter, OracleDrafter, RandomTreeDrafter, WrongDrafter

# a prompt that repeats itself: the unpenalized model repeats it too, so penalties change the text
PROMPT = [5, 9, 5, 9, 5, 9, 5, 9, 17, 23, 17, 23, 17, 23, 40, 41, 40, 41]
N = 24
PENALTIES = dict(repetition=4.0, presence=3.0, frequency=2.0, window=8, logit_bias={3: 6.0, 7: -5.0})


def reference(model, prompt, n, processors=()):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             logits_processors=list(processors))]


def run(model, drafter, sampling, prompt=PROMPT, n=N, **kw):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=16, **kw)
    return [t for step in eng.generate(prompt, n, sampling) for t in step], eng


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_greedy_with_penalties_equals_mlx_lm_with_any_drafts(family):
    model = zoo.tiny_model(family)
    processors = penalties(**PENALTIES)
    truth = reference(model, PROMPT, N, processors)
    assert truth != reference(model, PROMPT, N), f"{family}: the penalties change nothing here; test nothing"
    sampling = SamplingParams(logits_processors=processors)
    drafters = {"none": NoDrafter(), "oracle-chain": OracleDrafter(PROMPT, truth),
                "oracle-tree": OracleDrafter(PROMPT, truth, extra_wrong_branches=2),
                "wrong": WrongDrafter(lambda h: (truth + [0])[len(h) - len(PROMPT)]),
                "random": RandomTreeDrafter(PROMPT, truth, seed=5, vocab=zoo.VOCAB)}
    for label, drafter in drafters.items():
        out, eng = run(model, drafter, sampling)
        assert out == truth, (family, label)
        if label == "oracle-chain":
            assert eng.stats.passes < N // 2, (family, eng.stats.passes)  # it did accept drafts
    # the tokens the unpenalized model would pick, drafted: rejected where the penalties say so
    plain = reference(model, PROMPT, N)
    out, _ = run(model, OracleDrafter(PROMPT, plain, extra_wrong_branches=1), sampling)
    assert out == truth, family


def test_each_row_is_processed_after_its_own_path():
    """Row r of a tree pass: the history, then the path to node r-1; as a processor hears it."""
    heard = []

    def spy(tokens, logits):
        heard.append(np.asarray(tokens).tolist())
        return logits + 0.0

    tree = DraftTree([11, 12, 13, 14], [-1, 0, -1, 2])  # 11 -> 12, 13 -> 14
    logits = mx.arange(5 * 6, dtype=mx.float32).reshape(5, 6)
    out = processed_rows([spy], logits, [1, 2, 3], tree)
    assert heard == [[1, 2, 3], [1, 2, 3, 11], [1, 2, 3, 11, 12], [1, 2, 3, 13], [1, 2, 3, 13, 14]]
    assert np.array_equal(np.asarray(out), np.asarray(logits))
    assert processed_rows((), logits, [1, 2, 3], tree) is logits  # no processors: nothing to do


def test_penalties_match_mlx_lm_s_processors_and_off_means_none():
    logits = mx.random.normal((1, 50), key=mx.random.key(3))
    tokens = mx.array([4, 4, 9, 30, 4, 2])
    ours = processed_rows(penalties(repetition=1.3, presence=0.5, frequency=0.25, window=4,
                                    logit_bias={1: 3.0}), logits, tokens.tolist(), None)
    want = logits
    for p in make_logits_processors({1: 3.0}, 1.3, 4, 0.5, 4, 0.25, 4):
        want = p(tokens, want)
    assert np.array_equal(np.asarray(ours), np.asarray(want))
    assert penalties() == () and penalties(repetition=1.0) == () and penalties(repetition=1.5, window=0) == ()
    whole = penalties(frequency=1.0, window=-1)  # -1: the whole sequence
    assert float(processed_rows(whole, logits, [7] * 100, None)[0, 7]) == pytest.approx(float(logits[0, 7]) - 100)
    with pytest.raises(CachebackError, match="window"):
        penalties(repetition=1.2, window=-2)
    with pytest.raises(CachebackError, match="callables"):
        SamplingParams(logits_processors=[1.5])


def test_lanes_with_penalties_equal_their_solo_runs():
    model = zoo.tiny_model("llama")
    a = SamplingParams(logits_processors=penalties(**PENALTIES))
    b = SamplingParams(logits_processors=penalties(repetition=1.2, window=20))
    prompts = [PROMPT, PROMPT[4:] + [60, 61], PROMPT[:10]]
    kinds = [a, SamplingParams(), b]
    truths = [reference(model, p, 20, s.logits_processors) for p, s in zip(prompts, kinds)]
    known = list(zip(prompts, truths))
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    lanes = Batch(eng, 3, lambda: KnownStreamsDrafter(known, seed=2)).run(
        [dict(prompt=p, max_tokens=20, sampling=s) for p, s in zip(prompts, kinds)])
    assert [lane.tokens for lane in lanes] == truths


def test_a_seeded_sampled_request_with_penalties_gives_the_same_text_with_any_drafts():
    model = zoo.tiny_model("qwen3")
    sampling = SamplingParams(temperature=0.9, seed=11, logits_processors=penalties(**PENALTIES))
    alone, _ = run(model, NoDrafter(), sampling)
    truth = reference(model, PROMPT, N)
    for seed in range(3):
        out, _ = run(model, RandomTreeDrafter(PROMPT, alone, seed=seed, vocab=zoo.VOCAB), sampling)
        assert out == alone, seed
    out, _ = run(model, OracleDrafter(PROMPT, truth, extra_wrong_branches=2), sampling)
    assert out == alone
    unpenalized, _ = run(model, NoDrafter(), SamplingParams(temperature=0.9, seed=11))
    assert unpenalized != alone  # the penalty is in the draws
