"""The mlx-lm-shaped API (cacheback_mlx.lm) against mlx-lm's own stream_generate."""

from cacheback_mlx import lm
from cacheback_mlx.errors import CachebackError

import mlx.core as mx
import pytest
from mlx_lm import stream_generate as mlx_stream

from conftest import write_tiny_gguf

FIELDS = ("text", "token", "prompt_tokens", "generation_tokens", "finish_reason")


def responses(gen):
    return [{f: getattr(r, f) for f in FIELDS} for r in gen]


def same_logprobs(ours, theirs) -> bool:
    """Each token's log-probabilities as mlx-lm's, within a pass's rounding (their passes and ours
    round differently by ~1e-5 relative here, where a row taken from a wrong position is off by
    whole units)."""
    return len(ours) == len(theirs) and all(
        a.logprobs.shape == b.logprobs.shape and mx.allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-3).item()
        for a, b in zip(ours, theirs))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "t.gguf"
    write_tiny_gguf(path, context=512)
    return lm.load(str(path))


@pytest.mark.parametrize("drafter", ["auto", "none", "pld"])
def test_stream_generate_yields_what_mlx_lm_yields(tiny, drafter):
    model, tokenizer = tiny
    prompt = "abcabcabc abc"
    ours = list(lm.stream_generate(model, tokenizer, prompt, max_tokens=24, drafter=drafter))
    theirs = list(mlx_stream(model, tokenizer, prompt, max_tokens=24))
    assert responses(ours) == responses(theirs)
    assert same_logprobs(ours, theirs) and all(mx.argmax(r.logprobs).item() == r.token for r in ours)
    assert drafter != "pld" or any(r.from_draft for r in ours)  # rows of accepted drafts among them
    assert ours[-1].passes <= len(ours)
    short = list(lm.stream_generate(model, tokenizer, prompt, max_tokens=3, drafter=drafter))
    assert responses(short) == responses(mlx_stream(model, tokenizer, prompt, max_tokens=3))
    assert short[-1].finish_reason == "length" and len(short) == 3
    assert all(r.peak_memory > 0 and r.generation_tps > 0 for r in ours)
    ids = tokenizer.encode(prompt)
    assert responses(lm.stream_generate(model, tokenizer, ids, max_tokens=24)) == responses(theirs)
    assert lm.generate(model, tokenizer, prompt, max_tokens=24) == "".join(r.text for r in theirs)


@pytest.mark.parametrize("drafter", ["auto", "pld"])
def test_logits_processors_apply_as_in_mlx_lm(tiny, drafter):
    """mlx-lm's own penalty and bias processors, passed as to mlx-lm, give mlx-lm's tokens."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = tiny
    z = 3 + ord("z")  # the tiny tokenizer's byte tokens come after its 3 special ones
    processors = make_logits_processors({z: 12.0}, repetition_penalty=50.0, repetition_context_size=64)
    prompt = "abcabcabc abc"
    theirs = responses(mlx_stream(model, tokenizer, prompt, max_tokens=24, logits_processors=processors))
    ours = responses(lm.stream_generate(model, tokenizer, prompt, max_tokens=24, drafter=drafter,
                                        logits_processors=processors))
    assert ours == theirs
    assert same_logprobs(list(lm.stream_generate(model, tokenizer, prompt, max_tokens=24, drafter=drafter,
                                                 logits_processors=processors)),
                         list(mlx_stream(model, tokenizer, prompt, max_tokens=24, logits_processors=processors)))
    assert [r["token"] for r in ours].count(z) == 1  # the bias brought z in, the penalty kept it out since
    assert ours != responses(mlx_stream(model, tokenizer, prompt, max_tokens=24))


def test_a_stop_token_ends_like_mlx_lm(tiny):
    """An EOS token added to mlx-lm's tokenizer (add_eos_token) counts from the next call on, as in
    mlx-lm, which reads the tokenizer's EOS ids at each call; taken away, it no longer does."""
    model, tokenizer = tiny
    prompt = "hello hello"
    first = [r.token for r in mlx_stream(model, tokenizer, prompt, max_tokens=12)]
    assert responses(lm.stream_generate(model, tokenizer, prompt, max_tokens=12))[-1]["finish_reason"] == "length"
    eos = first[5]  # make the 6th generated token an EOS for both
    tokenizer.add_eos_token(str(eos))
    try:
        theirs = list(mlx_stream(model, tokenizer, prompt, max_tokens=12))
        ours = list(lm.stream_generate(model, tokenizer, prompt, max_tokens=12))
    finally:
        tokenizer._eos_token_ids.discard(eos)
    assert theirs[-1].finish_reason == "stop" and theirs[-1].token == eos
    assert responses(ours) == responses(theirs)
    assert same_logprobs(ours, theirs)  # the stop token's too
    assert [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=12)] == first


def test_min_p_samples_from_the_likeliest_tokens(tiny):
    """min_p=1 keeps only the likeliest token: sampled at any temperature, greedy's tokens."""
    model, tokenizer = tiny
    greedy = [r.token for r in lm.stream_generate(model, tokenizer, "hello", max_tokens=8)]
    sampled = [r.token for r in lm.stream_generate(model, tokenizer, "hello", max_tokens=8, temperature=5.0,
                                                   min_p=1.0, seed=2)]
    assert sampled == greedy
    with pytest.raises(CachebackError, match="min_p"):
        next(lm.stream_generate(model, tokenizer, "hello", temperature=1.0, min_p=2.0))


def test_unsupported_arguments_get_a_clear_error(tiny):
    model, tokenizer = tiny
    with pytest.raises(CachebackError, match="temperature"):
        next(lm.stream_generate(model, tokenizer, "a", sampler=lambda x: x))
    with pytest.raises(CachebackError, match="unsupported"):
        next(lm.stream_generate(model, tokenizer, "a", frobnicate=1))


def test_batch_generate_gives_each_prompt_what_mlx_lm_gives_it_alone(tiny):
    model, tokenizer = tiny
    prompts = ["abcabcabc abc", "hello hello", "x = 1\nx = 2\n"]
    ids = [tokenizer.encode(p) for p in prompts]
    r = lm.batch_generate(model, tokenizer, ids, max_tokens=[16, 8, 12], return_token_ids=True)
    want = ["".join(x.text for x in mlx_stream(model, tokenizer, p, max_tokens=n))
            for p, n in zip(prompts, [16, 8, 12])]
    assert r.texts == want and all(len(t) <= n for t, n in zip(r.token_ids, [16, 8, 12]))
    assert r.stats["generation_tokens"] == sum(len(t) for t in r.token_ids)
    assert lm.batch_generate(model, tokenizer, prompts, max_tokens=[16, 8, 12]).texts == want  # text prompts
    r = lm.batch_generate(model, tokenizer, ids, max_tokens=[16, 8, 12], return_token_ids=True, return_logprobs=True,
                          drafter="pld")
    for p, n, got in zip(prompts, [16, 8, 12], r.logprobs):  # each token's own but a stop token's, as mlx-lm's
        theirs = [x.logprobs[x.token].item() for x in mlx_stream(model, tokenizer, p, max_tokens=n)
                  if x.finish_reason != "stop"]
        assert len(got) == len(theirs) and max(abs(a - b) for a, b in zip(got, theirs)) < 1e-3
    with pytest.raises(CachebackError, match="limits for"):
        lm.batch_generate(model, tokenizer, ids, max_tokens=[4, 4])
    with pytest.raises(CachebackError, match="unknown arguments"):
        lm.batch_generate(model, tokenizer, ids, max_tokens=4, sampler=None)


def test_session_generate_batch_equals_its_generate(tmp_path):
    from cacheback_mlx.api import Session

    path = tmp_path / "b.gguf"
    write_tiny_gguf(path, context=512, seed=2)
    session = Session(str(path), "ngram")
    prompts = ["abcabcabc abc", "hello hello", "x = 1\nx = 2\n"]
    alone = []
    for p in prompts:
        session.reset()
        alone.append(session.generate(p, 12, chat=False))
    assert session.generate_batch(prompts, 12, chat=False, lanes=2) == alone
