"""Structured output (constrained.py): the grammar's mask runs at every row of a pass, so greedy
output with it equals mlx-lm's generate_step with the same processor whatever is drafted, and the
text keeps to the grammar; the server takes each protocol's names for it."""

import json

from cacheback_mlx.api import Session
from cacheback_mlx.constrained import Constrained, check, grammar_of
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.sampling import SamplingParams

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import zoo
from adversarial import OracleDrafter, RandomTreeDrafter, WrongDrafter
from conftest import write_tiny_gguf
from test_server import serving, sse_events

N = 160
# bounded (digits, letters, whitespace), so a random model's answer ends within N tokens on any CPU
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "t.gguf"
    write_tiny_gguf(path, context=512)
    return Session(str(path), "none")


def reference(session, ids, grammar, n):
    processor = Constrained(grammar, session.tokenizer, session.engine.eos_ids, len(ids))
    out = []
    for t, _ in generate_step(mx.array(ids), session.loaded.model, max_tokens=n, logits_processors=[processor]):
        if int(t) in session.engine.eos_ids:
            break
        out.append(int(t))
    return out


WORD = 'root ::= ("yes" | "no") " " [a-z] [a-z] [a-z]? [a-z]? [a-z]? "."'


@pytest.mark.parametrize("grammar", [grammar_of(json_schema=SCHEMA), grammar_of(gbnf=WORD)], ids=["json", "gbnf"])
def test_constrained_greedy_equals_mlx_lm_s_with_any_drafts(tiny, grammar):
    ids = tiny.encode("abcabc abc", chat=False)
    eos = tiny.engine.eos_ids
    truth = reference(tiny, ids, grammar, N)
    free = [int(t) for t, _ in generate_step(mx.array(ids), tiny.loaded.model, max_tokens=N)]
    assert 0 < len(truth) < N and free[: len(truth)] != truth  # the grammar changed the text, and ended it
    for drafter in (NoDrafter(), OracleDrafter(ids, truth), OracleDrafter(ids, truth, extra_wrong_branches=2),
                    RandomTreeDrafter(ids, truth, seed=4, vocab=259),
                    WrongDrafter(lambda h: (truth + [0])[len(h) - len(ids)])):
        eng = Engine(tiny.loaded.model, eos, drafter, 512, draft_budget=8)
        processor = Constrained(grammar, tiny.tokenizer, eos, len(ids))
        out = [t for s in eng.generate(ids, N, SamplingParams(logits_processors=(processor,))) for t in s]
        assert out == truth, type(drafter).__name__
        if isinstance(drafter, OracleDrafter):
            assert eng.stats.passes < len(truth)  # drafts were accepted
    text = tiny.tokenizer.decode(truth)
    if "json" in grammar:
        value = json.loads(text)
        assert set(value) == {"a", "b"} and isinstance(value["a"], int) and len(value["b"]) <= 5
    else:
        assert text.split(" ")[0] in ("yes", "no") and text.endswith(".")


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_constrained_greedy_equals_mlx_lm_s_on_every_family(tiny, family):
    """Sliding windows, shared KV, MoE, hybrids and Mamba (partly accepted passes undone and fed
    again), with the tiny byte-level tokenizer's view: words of a-z and a full stop (ids below the
    zoo's vocabulary of 128)."""
    model = zoo.tiny_model(family)
    grammar = grammar_of(lark=r'start: /[a-z]{2,6}( [a-z]{2,6}){1,4}\./')
    eos = tiny.engine.eos_ids
    prompt = [5, 9, 5, 9, 17, 23, 17, 23, 40, 41]

    def processor():
        return Constrained(grammar, tiny.tokenizer, eos, len(prompt))

    truth = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, logits_processors=[processor()]):
        if int(t) in eos:
            break
        truth.append(int(t))
    text = tiny.tokenizer.decode(truth)
    assert text.endswith(".") and all(c.islower() or c in " ." for c in text), (family, text)
    for drafter in (NoDrafter(), OracleDrafter(prompt, truth), OracleDrafter(prompt, truth, extra_wrong_branches=2),
                    RandomTreeDrafter(prompt, truth, seed=6, vocab=zoo.VOCAB)):
        eng = Engine(model, eos, drafter, 4096, draft_budget=8)
        out = [t for s in eng.generate(prompt, 40, SamplingParams(logits_processors=(processor(),))) for t in s]
        assert out == truth, (family, type(drafter).__name__)


def test_bad_grammars_are_one_line_errors(tiny):
    for bad in (dict(json_schema="{not json"), dict(json_schema=[1, 2]), dict(gbnf="root ::= ("),
                dict(gbnf="root ::= missing"), dict(lark="start: (")):
        with pytest.raises(CachebackError, match="grammar|schema") as e:
            check(grammar_of(**bad), tiny.tokenizer, tiny.engine.eos_ids)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "parallel-4"])
def server(request):
    session = Session(None, "auto")
    with serving(session, parallel=request.param) as url:
        yield url


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person called Ann who is 31, as JSON."}]


def test_constrained_greedy_equals_mlx_lm_s_on_the_default_model():
    s = Session(None, "auto")
    ids = s.encode("Describe a person called Ann who is 31, as JSON.")
    grammar = grammar_of(json_schema=PERSON)
    eos = s.engine.eos_ids
    truth = []
    for t, _ in generate_step(mx.array(ids), s.loaded.model, max_tokens=96,
                              logits_processors=[Constrained(grammar, s.tokenizer, eos, len(ids))]):
        if int(t) in eos:
            break
        truth.append(int(t))
    c = Constrained(grammar, s.tokenizer, eos, len(ids))
    assert [t for step in s.engine.generate(ids, 96, SamplingParams(logits_processors=(c,))) for t in step] == truth
    assert json.loads(s.tokenizer.decode(truth))["age"] == 31


@pytest.mark.serial  # starts servers
def test_each_protocol_s_structured_output(server):
    url = server

    def person(text):
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 128, "response_format": fmt},
                   timeout=120).json()
    person(r["choices"][0]["message"]["content"])
    chunks = sse_events(httpx.post(f"{url}/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 128, "response_format": fmt, "stream": True}, timeout=120))
    person("".join(c["delta"].get("content", "") for ch in chunks for c in ch.get("choices", [])))
    short = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": short, "max_tokens": 128,
                                                       "response_format": {"type": "json_object"}}, timeout=120).json()
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    r = httpx.post(f"{url}/completion", json={"prompt": "Is the sky blue? Answer:", "n_predict": 16,
                                              "grammar": 'root ::= " " ("yes" | "no")'}, timeout=120).json()
    assert r["content"].strip() in ("yes", "no")
    r = httpx.post(f"{url}/completion", json={"prompt": "Ann, 31, as JSON:", "n_predict": 128, "json_schema": PERSON},
                   timeout=120).json()
    person(r["content"])
    r = httpx.post(f"{url}/api/chat", json={"messages": ASK, "stream": False, "format": PERSON,
                                            "options": {"num_predict": 128}}, timeout=120).json()
    person(r["message"]["content"])
    r = httpx.post(f"{url}/api/generate", json={"prompt": short[0]["content"], "stream": False, "format": "json",
                                                "options": {"num_predict": 128}}, timeout=120).json()
    assert isinstance(json.loads(r["response"]), dict)
    r = httpx.post(f"{url}/v1/messages", json={"messages": ASK, "max_tokens": 128, "output_config": {
        "format": {"type": "json_schema", "schema": PERSON}}}, timeout=120).json()
    person("".join(b["text"] for b in r["content"]))
    r = httpx.post(f"{url}/v1/responses", json={"input": ASK, "max_output_tokens": 128, "text": {
        "format": {"type": "json_schema", "name": "person", "schema": PERSON}}}, timeout=120).json()
    person("".join(c["text"] for item in r["output"] if item["type"] == "message" for c in item["content"]))


@pytest.mark.serial
def test_bad_structured_output_requests_are_4xx(server):
    url = server
    for body in ({"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}},
                 {"response_format": {"type": "json_schema", "json_schema": {"schema": "nope"}}},
                 {"grammar": "root ::= ("}):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4} | body, timeout=60)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (body, r.text)
    r = httpx.post(f"{url}/api/chat", json={"messages": ASK, "stream": False, "format": "yaml"}, timeout=60)
    assert 400 <= r.status_code < 500
    r = httpx.post(f"{url}/v1/messages", json={"messages": ASK, "max_tokens": 4, "output_config": {
        "format": {"type": "json_schema", "schema": "nope"}}}, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/responses", json={"input": ASK, "max_output_tokens": 4, "text": {
        "format": {"type": "json_schema", "schema": {"type": "nope"}}}}, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
