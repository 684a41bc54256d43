"""Log-probabilities: each token's as mlx-lm's generate_step gives them, through the engine (rows of
accepted drafts included), the batch's lanes, and every protocol's names (server/logprobs.py)."""

import json

from cacheback_mlx.api import Session
from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.sampling import SamplingParams
from cacheback_mlx.tree import DraftTree

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import zoo
from test_server import serving
from test_server import sse_events as events

SERIAL = pytest.mark.serial  # tools/test.sh runs these alone: they start servers

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


class Oracle(Drafter):
    """Drafts the true continuation, 4 tokens a pass, so most tokens come from accepted drafts."""

    def __init__(self, prompt, truth):
        self.prompt, self.truth = list(prompt), list(truth)

    def propose(self, history, budget, max_branching=None):
        done = len(history) - len(self.prompt)
        chain = self.truth[done: done + min(budget, 4)]
        return DraftTree(chain, list(range(-1, len(chain) - 1)))


def reference(model, ids, n):
    """mlx-lm's tokens and log-probabilities, plain greedy decoding."""
    out = [(int(t), lp) for t, lp in generate_step(mx.array(ids), model, max_tokens=n)]
    return [t for t, _ in out], [lp for _, lp in out]


def close(a, b) -> bool:
    return mx.allclose(a, b, rtol=1e-4, atol=1e-3).item()


def same(a: list[dict], b: list[dict]) -> bool:
    """The same tokens with the same log-probabilities, as far as two runs' rounding goes (a prompt
    run again is read from the cache, in passes of other shapes)."""
    return [e["token"] for e in a] == [e["token"] for e in b] and all(
        abs(x["logprob"] - y["logprob"]) < 1e-3 for x, y in zip(a, b))


def test_engine_logprobs_come_from_the_row_that_predicted_each_token(default_model):
    ids = list(default_model.tokenizer.encode("def add(a, b):\n    return"))
    truth, theirs = reference(default_model.model, ids, 24)
    eng = Engine(default_model.model, [], Oracle(ids, truth), default_model.context_length, draft_budget=8)
    steps = list(eng.generate(ids, 24, SamplingParams(logprobs=True)))
    assert [t for s in steps for t in s] == truth[: len([t for s in steps for t in s])]
    assert any(len(s) > 1 for s in steps)  # tokens from accepted drafts: rows past the root's
    ours = [lp for s in steps for lp in s.logprobs]
    assert len(ours) == sum(len(s) for s in steps) and all(close(a, b) for a, b in zip(ours, theirs))
    assert all(s.logprobs is None for s in eng.generate(ids, 4))  # only when asked for


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_logprobs_equal_mlx_lm_s_on_every_family_with_any_drafts(family):
    """Sliding windows, shared KV, MoE, hybrids and Mamba (whose partly accepted passes are undone
    and fed again): each token's log-probabilities are mlx-lm's at its position, from a batch's
    lanes too."""
    from cacheback_mlx.batch import Batch
    from cacheback_mlx.drafters.base import NoDrafter

    from adversarial import OracleDrafter, RandomTreeDrafter

    model = zoo.tiny_model(family)
    prompt = [5, 9, 5, 9, 17, 23, 17, 23, 40, 41]
    truth, theirs = reference(model, prompt, 16)
    chain = OracleDrafter(prompt, truth)
    for drafter in (NoDrafter(), chain, OracleDrafter(prompt, truth, extra_wrong_branches=1),
                    RandomTreeDrafter(prompt, truth, seed=3, vocab=zoo.VOCAB)):
        eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=8)
        steps = list(eng.generate(prompt, 16, SamplingParams(logprobs=True)))
        assert [t for s in steps for t in s] == truth, family
        ours = [lp for s in steps for lp in s.logprobs]
        assert all(close(a, b) for a, b in zip(ours, theirs)) and len(ours) == 16, (family, type(drafter).__name__)
        assert drafter is not chain or any(len(s) > 1 for s in steps)  # rows of accepted drafts among them
    eng = Engine(model, eos_ids=[], drafter=NoDrafter(), context_length=4096, draft_budget=8)
    batch = Batch(eng, 2, lambda: OracleDrafter(prompt, truth))
    lanes = batch.run([dict(prompt=prompt, max_tokens=16, sampling=SamplingParams(logprobs=True))] * 2)
    for lane in lanes:
        assert lane.tokens == truth
        assert np.allclose(lane.token_logprobs, [lp[t].item() for lp, t in zip(theirs, truth)], rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "parallel-4"])
def server(request):
    session = Session(None, "auto")
    with serving(session, parallel=request.param) as url:
        yield session, url


@SERIAL
def test_openai_chat_logprobs_are_mlx_lm_s_and_spell_the_answer(server):
    session, url = server
    body = {"messages": CHAT, "max_tokens": 16, "logprobs": True, "top_logprobs": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    choice, n = r["choices"][0], r["usage"]["completion_tokens"]
    content = choice["logprobs"]["content"]
    assert len(content) == n and "".join(e["token"] for e in content) == choice["message"]["content"]
    _, theirs = reference(session.loaded.model, session.encode(CHAT, chat=True), n)
    ids = [int(mx.argmax(lp).item()) for lp in theirs]
    for e, lp, token in zip(content, theirs, ids):
        assert abs(e["logprob"] - lp[token].item()) < 1e-3
        tops = e["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == e["token"]  # greedy: the chosen token is the likeliest
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert bytes(e["bytes"]).decode() == e["token"]
    streamed = events(httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120))
    chunks = [(c["delta"].get("content", ""), c["logprobs"]["content"])
              for ev in streamed for c in ev.get("choices", [])]
    assert same([e for _, es in chunks for e in es], content)
    assert all("".join(e["token"] for e in es) == text for text, es in chunks)  # each chunk's tokens, its text
    plain = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=120).json()
    assert "logprobs" not in plain["choices"][0]


@SERIAL
def test_logprobs_by_the_completions_llama_cpp_and_ollama_names(server):
    session, url = server
    _, theirs = reference(session.loaded.model, session.encode(PROMPT, chat=False), 8)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "logprobs": 2}, timeout=120).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 8 and all(len(t) == 2 for t in lp["top_logprobs"])
    assert all(abs(a - b[int(mx.argmax(b).item())].item()) < 1e-3 for a, b in zip(lp["token_logprobs"], theirs))
    assert lp["text_offset"][1] == len(lp["tokens"][0])

    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 2}, timeout=120).json()
    probs = r["completion_probabilities"]
    assert [e["token"] for e in probs] == lp["tokens"] and all(len(e["top_logprobs"]) == 2 for e in probs)
    assert all(isinstance(e["id"], int) for e in probs)
    streamed = events(httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 2,
                                                            "stream": True}, timeout=120))
    assert same([e for ev in streamed for e in ev.get("completion_probabilities", [])], probs)
    k = next(i for i in range(2, 8) if lp["tokens"][i].strip() and lp["tokens"][i] not in "".join(lp["tokens"][:i]))
    cut = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 8, "n_probs": 1,
                                                "stop": [lp["tokens"][k]]}, timeout=120).json()
    assert [e["token"] for e in cut["completion_probabilities"]] == lp["tokens"][:k]  # none past the stop string

    r = httpx.post(f"{url}/api/generate", json={"prompt": PROMPT, "raw": True, "stream": False, "logprobs": True,
                                                "top_logprobs": 1, "options": {"num_predict": 8}}, timeout=120).json()
    assert [e["token"] for e in r["logprobs"]] == lp["tokens"]
    assert all(len(e["top_logprobs"]) == 1 for e in r["logprobs"])
    lines = [json.loads(x) for x in httpx.post(f"{url}/api/generate", json={
        "prompt": PROMPT, "raw": True, "logprobs": True, "options": {"num_predict": 8}}, timeout=120).text.splitlines()]
    assert [e["token"] for x in lines for e in x.get("logprobs", [])] == lp["tokens"]


@SERIAL
def test_bad_logprob_requests_are_4xx(server):
    _, url = server
    for body in ({"logprobs": 21}, {"logprobs": -1}, {"logprobs": True, "top_logprobs": 99}, {"n_probs": -2},
                 {"logprobs": [1]}):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2} | body, timeout=60)
        assert 400 <= r.status_code < 500, (body, r.text)


def spm_tokenizer():
    """A SentencePiece-style vocabulary (GGUF's "llama" tokenizer): pieces with U+2581 for a space,
    and byte pieces for what no piece spells."""
    from cacheback_mlx.tokenizer import tokenizer_from_gguf
    pieces = ["\u2581the", "\u2581cat", "\u2581caf", "\u2581", "the", "cat", "s", "."]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return tokenizer_from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                "tokenizer.ggml.scores": [0.0] * 259 + [-1.0] * len(pieces),
                                "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
                                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False})


def test_token_bytes_are_what_each_token_adds_to_the_text(tmp_path):
    from cacheback_mlx.server.logprobs import TokenLog, token_bytes

    from conftest import write_tiny_gguf
    write_tiny_gguf(tmp_path / "t.gguf")
    for tok, text in ((Session(str(tmp_path / "t.gguf"), "none").tokenizer, "the café, 日本 😀 cats."),
                      (spm_tokenizer(), "the cats café.")):
        ids = tok.encode(text, add_special_tokens=False)
        piece = token_bytes(tok)
        raw = [piece(i) for i in ids]
        assert b"".join(raw).decode().removeprefix(" ") == text  # (SentencePiece: a space in front)
        assert any(len(r) == 1 and r[0] >= 0x80 for r in raw)  # a part of a character, as it is
        log = TokenLog()  # each token placed where its text starts in the answer, parts of a character too
        entries = [{"token": r.decode("utf-8", "replace"), "bytes": list(r)} for r in raw]
        log.add(entries, 0, len(text))
        starts = [at for at, _ in log.pending]
        seen = b""
        for at, r in zip(starts, raw):
            assert at == len(seen.decode("utf-8", "ignore").removeprefix(" "))
            seen += r
    spm = spm_tokenizer()
    ids = spm.encode("the cat", add_special_tokens=False)
    assert [token_bytes(spm)(i) for i in ids] == [b" the", b" cat"]  # the space decoding alone drops
    assert spm.decode([ids[1]]) == "cat"
