"""The mlx-lm-shaped API (cacheback_mlx.lm) against mlx-lm's own stream_generate."""

import copy
import json
import random

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


def test_mlx_lm_s_make_sampler_is_read_back_into_its_settings(tiny):
    """A sampler from mlx-lm's make_sampler samples as the same settings given by name: the same
    tokens for the same seed (greedy: mlx-lm's tokens); one of one's own, or XTC, is refused."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = tiny
    settings = dict(temperature=0.8, top_p=0.9, min_p=0.05, top_k=20)
    made = make_sampler(temp=0.8, top_p=0.9, min_p=0.05, top_k=20)
    assert lm.sampler_settings(made) == settings
    assert lm.sampler_settings(make_sampler(temp=0.5)) == {"temperature": 0.5}
    xtc = make_sampler(temp=0.8, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[2])
    assert lm.sampler_settings(xtc) == dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05,
                                            xtc_special=(2,))
    prompt = "abcabcabc abc"
    by_name = [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=24, seed=3, **settings)]
    assert [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=24, seed=3,
                                                sampler=made)] == by_name
    assert by_name != [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    assert (responses(lm.stream_generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0)))
            == responses(mlx_stream(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))))
    ids = [tokenizer.encode(prompt)]
    assert (lm.batch_generate(model, tokenizer, ids, max_tokens=24, seed=3, sampler=made, return_token_ids=True)
            .token_ids == lm.batch_generate(model, tokenizer, ids, max_tokens=24, seed=3, return_token_ids=True,
                                            **settings).token_ids)
    with_xtc = [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=24, seed=3, sampler=xtc)]
    assert with_xtc != [r.token for r in lm.stream_generate(model, tokenizer, prompt, max_tokens=24, seed=3,
                                                            sampler=make_sampler(temp=0.8))]
    for bad, why in ((make_sampler(temp=0.8, min_p=0.1, min_tokens_to_keep=3), "of your own"),
                     (lambda x: x, "of your own")):
        with pytest.raises(CachebackError, match=why):
            next(lm.stream_generate(model, tokenizer, prompt, sampler=bad))
    with pytest.raises(CachebackError, match="not both"):
        next(lm.stream_generate(model, tokenizer, prompt, sampler=made, temperature=0.5))


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
        lm.batch_generate(model, tokenizer, ids, max_tokens=4, frobnicate=None)


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


def conversation(gen, model, tokenizer, cache, turns, trim=None, **kw):
    """Each turn's (token, finish_reason, prompt_tokens) from `gen` with one prompt cache: turn 1
    is read for its first 3 tokens only (the caller stops early); before the last turn the cache
    is trimmed with `trim` (returns what it dropped, appended to the output)."""
    out = []
    for i, (prompt, n) in enumerate(turns):
        if i == len(turns) - 1 and trim is not None:
            out.append(("trimmed", trim(cache, 5)))
        got = []
        for r in gen(model, tokenizer, prompt, max_tokens=n, prompt_cache=cache, **kw):
            got.append((r.token, r.finish_reason, r.prompt_tokens))
            if i == 1 and len(got) == 3:
                break
        out.append(got)
    return out


@pytest.mark.parametrize("drafter", ["auto", "pld", "none"])
def test_a_conversation_in_a_prompt_cache_continues_as_in_mlx_lm(tiny, drafter):
    """mlx-lm's prompt_cache: each call sends only its new tokens and the cache carries the rest
    (earlier prompts, replies with their stop token, what a caller read before it stopped); the
    tokens equal mlx-lm's at every turn, and a trim drops what mlx-lm's drops."""
    from mlx_lm import generate as mlx_generate
    from mlx_lm.models.cache import make_prompt_cache as mlx_make
    from mlx_lm.models.cache import trim_prompt_cache as mlx_trim

    model, tokenizer = tiny
    turns = [("abcabcabc abc", 20), ("hello hello", 7), ([3 + ord(c) for c in "x = 1\nx = 2\n"], 30), ("abc", 10)]
    theirs_cache_at_end = mlx_make(model)
    theirs = conversation(mlx_stream, model, tokenizer, theirs_cache_at_end, turns, trim=mlx_trim)
    cache = lm.make_prompt_cache(model)
    ours = conversation(lm.stream_generate, model, tokenizer, cache, turns, trim=lm.trim_prompt_cache,
                        drafter=drafter)
    assert ours == theirs
    assert theirs[0][-1][1] == "stop" and theirs[2][-1][1] == "length"  # both ways a turn ends
    assert len(lm.prompt_cache.held(model, cache)) == sum(len(x) for x in ours if isinstance(x, list)) + sum(
        len(tokenizer.encode(p)) if isinstance(p, str) else len(p) for p, _ in turns) - 5
    copies = [copy.deepcopy(c) for c in (cache, cache)]  # one conversation, two ways on from here
    want = [mlx_generate(model, tokenizer, p, max_tokens=8, prompt_cache=mlx_copy) for p, mlx_copy in
            zip(("abc", "xyz"), [copy.deepcopy(theirs_cache_at_end) for _ in range(2)])]
    assert [lm.generate(model, tokenizer, p, max_tokens=8, prompt_cache=c, drafter=drafter)
            for p, c in zip(("abc", "xyz"), copies)] == want
    mine, theirs_cache = lm.make_prompt_cache(model), mlx_make(model)
    for prompt in ("abcabc", "hello"):  # generate() takes it too
        assert (lm.generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=mine, drafter=drafter)
                == mlx_generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=theirs_cache))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "qwen3_next", "falcon_h1"])
def test_a_prompt_cache_conversation_equals_mlx_lm_s_on_other_families(tiny, family):
    """Sliding windows (a trim past the window drops nothing, as in mlx-lm) and recurrent layers
    (nothing trims)."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_make
    from mlx_lm.models.cache import trim_prompt_cache as mlx_trim

    import zoo

    model, tokenizer = zoo.tiny_model(family), tiny[1]
    rng = random.Random(7)
    turns = [([rng.randrange(3, zoo.VOCAB) for _ in range(k)], n) for k, n in ((9, 12), (5, 8), (3, 10), (4, 6))]
    theirs = conversation(mlx_stream, model, tokenizer, mlx_make(model), turns, trim=mlx_trim)
    ours = conversation(lm.stream_generate, model, tokenizer, lm.make_prompt_cache(model), turns,
                        trim=lm.trim_prompt_cache, drafter="auto")
    assert ours == theirs
    assert family not in zoo.HYBRID + zoo.SLIDING or theirs[-2] == ("trimmed", 0)


def test_a_prompt_cache_it_cannot_continue_is_a_one_line_error(tiny):
    from mlx_lm.models.cache import RotatingKVCache
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    import zoo

    model, tokenizer = tiny
    filled = mlx_make(model)
    list(mlx_stream(model, tokenizer, "abc", max_tokens=2, prompt_cache=filled))
    other = zoo.tiny_model("qwen3_next")  # (an empty list of as many plain caches would do)
    for cache, why in ((filled, "mlx-lm's own"), (mlx_make(other), "not this model's"),
                       ([RotatingKVCache(64, keep=4) for _ in filled], "not this model's"), ("abc", "must be a list")):
        with pytest.raises(CachebackError, match=why) as e:
            next(lm.stream_generate(model, tokenizer, "abc", max_tokens=4, prompt_cache=cache))
        assert "\n" not in str(e.value)
    with pytest.raises(CachebackError, match="max_kv_size"):
        lm.make_prompt_cache(model, max_kv_size=64)
    kept = lm.make_prompt_cache(model)
    list(lm.stream_generate(model, tokenizer, "abc", max_tokens=4, prompt_cache=kept))
    before = lm.prompt_cache.held(model, kept)
    with pytest.raises(CachebackError, match="does not fit"):  # a prompt past the context leaves it as it was
        list(lm.stream_generate(model, tokenizer, [5] * 600, max_tokens=4, prompt_cache=kept))
    assert lm.prompt_cache.held(model, kept) == before
    fresh = lm.make_prompt_cache(model)
    assert lm.can_trim_prompt_cache(fresh) and lm.trim_prompt_cache(fresh, 3) == 0


@pytest.mark.slow
def test_a_chat_in_a_prompt_cache_on_the_default_model_is_mlx_lm_s():
    """mlx-lm's chat loop (each turn's messages alone through the chat template, one prompt cache)
    on the real default model, with drafts."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_make

    model, tokenizer = lm.load()
    ours, theirs = lm.make_prompt_cache(model), mlx_make(model)
    for question in ("Name three rivers in Europe.", "Which of them is the longest?"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        a = [r.token for r in lm.stream_generate(model, tokenizer, ids, max_tokens=48, prompt_cache=ours)]
        b = [r.token for r in mlx_stream(model, tokenizer, ids, max_tokens=48, prompt_cache=theirs)]
        assert a == b
    assert len(lm.prompt_cache.held(model, ours)) == theirs[0].offset


def test_batch_generate_takes_and_returns_prompt_caches_as_mlx_lm_does(tiny):
    """Each prompt continues its cache; the caches returned hold each prompt and its tokens (a stop
    token too); the ones passed in are left as they were."""
    from mlx_lm.generate import batch_generate as mlx_batch

    model, tokenizer = tiny
    first = [tokenizer.encode(p) for p in ("abcabcabc abc", "hello hello", "x = 1\nx = 2\n")]
    then = [tokenizer.encode(p) for p in ("abc", "hello", "x")]
    ours = lm.batch_generate(model, tokenizer, first, max_tokens=[20, 8, 12], return_prompt_caches=True,
                             return_token_ids=True)
    theirs = mlx_batch(model, tokenizer, first, max_tokens=[20, 8, 12], return_prompt_caches=True,
                       return_token_ids=True)
    assert ours.token_ids == theirs.token_ids
    assert len(ours.token_ids[0]) < 20  # a stop token ended it
    held = [lm.prompt_cache.held(model, c) for c in ours.caches]
    assert [len(h) for h in held] == [c[0].offset for c in theirs.caches]
    again = lm.batch_generate(model, tokenizer, then, max_tokens=10, prompt_caches=ours.caches, return_token_ids=True,
                              return_prompt_caches=True, drafter="pld")
    want = mlx_batch(model, tokenizer, then, max_tokens=10, prompt_caches=theirs.caches, return_token_ids=True)
    assert again.token_ids == want.token_ids
    assert [lm.prompt_cache.held(model, c) for c in ours.caches] == held  # the given caches as they were
    assert [len(lm.prompt_cache.held(model, c)) for c in again.caches] == [
        len(h) + len(p) + len(t) + (len(t) < 10) for h, p, t in zip(held, then, again.token_ids)]
    with pytest.raises(CachebackError, match="caches for 3 prompts"):
        lm.batch_generate(model, tokenizer, then, prompt_caches=ours.caches[:2])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny model as an mlx-lm folder whose config.json names a second EOS id, as chat models'
    do for their end of turn (Gemma 3: [1, 106]), taken from the model's own greedy output."""
    from cacheback_mlx.loader import load as load_any

    from mlx.utils import tree_flatten

    d = tmp_path_factory.mktemp("folder")
    ref = write_tiny_gguf(d / "t.gguf", context=512)
    loaded = load_any(d / "t.gguf")
    loaded.tokenizer._tokenizer.save_pretrained(d / "model")
    mx.save_safetensors(str(d / "model" / "model.safetensors"), dict(tree_flatten(ref.parameters())))
    a = ref.args
    config = {"model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
              "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
              "num_key_value_heads": a.num_key_value_heads, "rms_norm_eps": a.rms_norm_eps,
              "vocab_size": a.vocab_size, "rope_traditional": True, "tie_word_embeddings": False,
              "max_position_embeddings": 512}
    (d / "model" / "config.json").write_text(json.dumps(config))
    import mlx_lm

    first = [r.token for r in mlx_stream(*mlx_lm.load(str(d / "model")), "hello hello", max_tokens=12)]
    (d / "model" / "config.json").write_text(json.dumps(config | {"eos_token_id": [2, first[5]]}))
    return d / "model", first[5]


def test_load_takes_mlx_lm_s_arguments_and_the_config_s_eos_ids(tiny_folder, tiny):
    import mlx_lm

    folder, eos = tiny_folder
    theirs_model, theirs_tok = mlx_lm.load(str(folder))
    model, tokenizer = lm.load(str(folder))
    assert eos in tokenizer.eos_token_ids and set(tokenizer.eos_token_ids) == set(theirs_tok.eos_token_ids)
    ours = responses(lm.stream_generate(model, tokenizer, "hello hello", max_tokens=12))
    assert ours == responses(mlx_stream(theirs_model, theirs_tok, "hello hello", max_tokens=12))
    assert ours[-1]["finish_reason"] == "stop" and ours[-1]["token"] == eos and len(ours) == 6
    # mlx_lm.load's other arguments: a config changed by model_config and returned, a tokenizer's settings
    _, _, config = lm.load(str(folder), model_config={"max_position_embeddings": 64}, return_config=True, lazy=True)
    assert config == mlx_lm.load(str(folder), model_config={"max_position_embeddings": 64}, return_config=True)[2]
    assert config["max_position_embeddings"] == 64 and _sessions_context(folder) == 64
    extra = {"eos_token": tokenizer.convert_ids_to_tokens(eos)}
    assert (set(lm.load(str(folder), tokenizer_config=extra)[1].eos_token_ids)
            == set(mlx_lm.load(str(folder), tokenizer_config=extra)[1].eos_token_ids))
    # a GGUF has no folder to apply them to: one line; its config is its model's args
    gguf_model, _ = tiny
    path = str(folder.parent / "t.gguf")
    for kw in ({"tokenizer_config": extra}, {"model_config": {"vocab_size": 9}}, {"revision": "main"}):
        with pytest.raises(CachebackError, match="not a GGUF file") as e:
            lm.load(path, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(CachebackError, match="must be a dict"):
        lm.load(str(folder), model_config=[("vocab_size", 9)])
    assert lm.load(path, return_config=True)[2]["hidden_size"] == gguf_model.args.hidden_size


def _sessions_context(folder) -> int:
    from cacheback_mlx.api import load_cached
    from cacheback_mlx.loader import FolderOptions

    return load_cached(str(folder), None, None, FolderOptions.of(model_config={"max_position_embeddings": 64})
                       ).context_length
