"""Editor clients against the in-process app, with request bodies exactly as each client sends them.

Sources (read for the facts): llama.vim a1c8e6e (FIM request, ring warm-up, instruct warm-up),
llama.vscode 3938fb3 (src/llama-server.ts createRequestPayload, src/extra-context.ts chunks),
Continue (core/llm/llms/LlamaCpp.ts, Ollama.ts; packages/openai-adapters OpenAI.fimStream; the
autocomplete options: temperature 0.01, maxTokens 4096, stops from getStopTokens), Tabby
(crates/http-api-bindings/src/completion/llama.rs; defaults: 64 tokens, temperature 0.1,
presence_penalty 0.5, seed = time in ms). Each test checks the fields that client reads.

Two tiny random models: one with FIM tokens, one without (standing in for the embedded default,
which completes infill requests in the prefix-only layout and says `"fim": false`).
"""

import json
import re

from cacheback_mlx.api import Session
from cacheback_mlx.server import create_app

import pytest
from fastapi.testclient import TestClient

from conftest import write_tiny_gguf

CONTEXT = 256
CONTINUE_STOPS = ["/src/", "#- coding: utf-8", "```"]  # Continue's getStopTokens for a plain model name
PREFIX, MIDDLE, SUFFIX = "def add(a, b):\n", "    return ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("clients")
    write_tiny_gguf(d / "fim.gguf", context=CONTEXT, fim=True)
    write_tiny_gguf(d / "plain.gguf", context=CONTEXT, fim=False)
    write_tiny_gguf(d / "wide.gguf", context=1024, fim=True)  # llama.vim's instruct prompt needs ~600 tokens
    return {True: str(d / "fim.gguf"), False: str(d / "plain.gguf"), "wide": str(d / "wide.gguf")}


@pytest.fixture(scope="module", params=[True, False], ids=["fim", "no_fim"])
def client(request, paths):
    """(TestClient, whether the model has FIM tokens)."""
    with TestClient(create_app(Session(paths[request.param], "ngram"))) as c:
        yield c, request.param


@pytest.fixture(scope="module")
def fim_client(paths):
    with TestClient(create_app(Session(paths[True], "ngram"))) as c:
        yield c


def sse(text: str) -> list:
    """The data payloads of a server-sent event stream ("[DONE]" kept as a string)."""
    out = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.split("\n") if line.strip()]


# --- llama.vim ----------------------------------------------------------------------------------

def vim_chunk(text: str, filename: str = "util.py") -> dict:
    return {"text": text, "time": [1732000000, 123456], "filename": filename}  # time: Vim's reltime()


def vim_fim(extra: list[dict], response_fields: bool = True) -> dict:
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": MIDDLE,
            "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                                "tokens_cached"]}
    if not response_fields:
        del body["response_fields"]
    return body


def vim_ring_warmup(extra: list[dict]) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def vim_inst_warmup(preamble: str, extra: list[str]) -> dict:
    """llama#inst's warm-up while the user types the instruction (inst_build with an empty inst)."""
    system = preamble + "\n"
    system += "--- CONTEXT     " + "-" * 40 + "\n" + "\n".join(extra) + "\n"
    system += "--- PREFIX      " + "-" * 40 + "\n" + PREFIX.rstrip("\n") + "\n"
    system += "--- SELECTION   " + "-" * 40 + "\n" + "    return a + b" + "\n"
    system += "--- SUFFIX      " + "-" * 40 + "\n" + "print(add(1, 2))" + "\n"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ""}]
    return {"id_slot": 1, "messages": messages, "samplers": [], "n_predict": 0, "stream": False,
            "cache_prompt": True, "response_fields": [""]}


VIM_PREAMBLE = ("You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to "
                "SELECTION given the CONTEXT. Maintain the existing text indentation. Do not add extra code "
                "blocks. Respond only with the modified block. If the INSTRUCTION is a question, answer it "
                "directly. Do not output any extra separators. Consider the local context before (PREFIX) and "
                "after (SUFFIX) the SELECTION.\n")
VIM_FIELDS = {"content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"}


def test_llama_vim_fim(client):
    c, _ = client
    r = c.post("/infill", json=vim_fim([vim_chunk("def sub(a, b):\n    return a - b\n")]))
    assert r.status_code == 200, r.text
    assert re.search(r'"content"\s*:"', r.text) and r.text.lstrip().startswith("{")  # llama.vim's fast check
    out = r.json()
    assert set(out) == VIM_FIELDS  # flat "a/b" keys, nothing else
    assert isinstance(out["content"], str) and 0 <= out["timings/predicted_n"] <= 128
    assert out["truncated"] is False and out["tokens_cached"] >= out["timings/prompt_n"] > 0


def test_llama_vim_ring_warmup_then_fim_reuses_it(client):
    c, fim = client
    chunk = vim_chunk("class Ring:\n    size = 16\n    chunks = []\n", "ring.py")  # new: not cached yet
    r = c.post("/infill", json=vim_ring_warmup([chunk]))
    assert r.status_code == 200, r.text
    assert r.json() == {}  # response_fields [""]: nothing asked for
    r = c.post("/infill", json=vim_fim([chunk], response_fields=False))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["fim"] is fim
    # FIM: the chunk (one token per byte here) sits first in the prompt, prefilled by the warm-up;
    # prefix-only: chunks are left out of the prompt (fim.InfillBuilder.extra_budget), so the
    # warm-up had nothing new to prefill and the request reuses the last one's text
    assert out["timings"]["cache_n"] >= (len(chunk["text"]) if fim else len(PREFIX))


def vim_follow_up(first: dict, hint: list[str]) -> dict:
    """llama.vim's speculative follow-up once a hint is shown (llama#fim with a:prev = the hint's
    lines): the context as if the hint were accepted (s:fim_ctx_local), t_max_predict_ms 1000."""
    line_cur = first["prompt"] + hint[0]
    if len(hint) == 1:
        prefix, middle = first["input_prefix"], line_cur
    else:
        prefix, middle = first["input_prefix"] + "\n".join([line_cur] + hint[1:-1]) + "\n", hint[-1]
    suffix = "\n" + first["input_suffix"].split("\n", 1)[1]  # the rest of the cursor line is gone
    return first | {"input_prefix": prefix, "prompt": middle, "input_suffix": suffix, "t_max_predict_ms": 1000}


def test_llama_vim_speculative_follow_up_reuses_the_first_request(client):
    c, fim = client
    first = vim_fim([vim_chunk("def sub(a, b):\n    return a - b\n")], response_fields=False)
    first |= {"t_max_predict_ms": 250, "n_predict": 16}  # llama.vim: a quick first request
    r = c.post("/infill", json=first)
    assert r.status_code == 200, r.text
    hint = ["a + b", "", "def mul(a, b):", "    return a * b"]  # as if the reply had been these lines
    follow = vim_follow_up(first, hint) | {"n_predict": 16}
    r = c.post("/infill", json=follow)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["fim"] is fim and isinstance(out["content"], str)
    # everything before the cursor line (the chunk and the prefix, one token per byte here) comes
    # from the first request's cache; only the hint's lines are new
    chunk_n = len(first["input_extra"][0]["text"]) if fim else 0  # prefix-only prompts leave chunks out
    assert out["timings"]["cache_n"] >= len(first["input_prefix"]) + chunk_n
    new = follow["input_prefix"][len(first["input_prefix"]):] + follow["input_suffix"] + follow["prompt"]
    assert out["timings"]["prompt_n"] <= len(new) + 8


def test_llama_vim_instruct_warmup(paths):
    with TestClient(create_app(Session(paths["wide"], "ngram"))) as c:
        r = c.post("/v1/chat/completions", json=vim_inst_warmup(VIM_PREAMBLE, ["x = 1"]))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"] == {"role": "assistant", "content": ""}
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] > 0
        # llama#inst_send: the instruction, streamed; it starts with the warmed-up system message
        messages = vim_inst_warmup(VIM_PREAMBLE, ["x = 1"])["messages"]
        messages[-1]["content"] = "INSTRUCTION: rename b to c"
        body = {"id_slot": 1, "messages": messages, "min_p": 0.1, "temperature": 0.1,
                "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        assert all(isinstance(e["choices"][0]["delta"].get("content", ""), str) for e in events[:-1])
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > len(VIM_PREAMBLE)


def test_llama_vim_flipping_between_files_and_instruct_keeps_each_cache(paths):
    """Slots: llama.vim sends id_slot 0 for every FIM request and 1 for its instruct prompts; the
    server picks the slot by what each prompt reuses, so two files edited alternately and an
    instruct warm-up in between each keep their own cache. With one slot each switch re-prefills."""
    files = {f: "".join(f"{f}_{i} = {f}_{i - 1} + {i}\n" if i else f"{f}_0 = 0\n" for i in range(12))
             for f in ("ab", "cd")}
    reused = {}
    for n_slots in (1, 3):
        with TestClient(create_app(Session(paths["wide"], "ngram"), slots=n_slots)) as c:
            assert c.get("/props").json()["total_slots"] == n_slots
            cache_n, used = [], set()
            for step in range(3):
                for f, text in files.items():
                    body = vim_fim([], response_fields=False) | {
                        "input_prefix": text + f"{f}_x{step} = 1\n", "input_suffix": "\n", "prompt": "",
                        "n_predict": 4}
                    r = c.post("/infill", json=body)
                    assert r.status_code == 200, r.text
                    cache_n.append(r.json()["timings"]["cache_n"])
                    used.add((f, r.json()["id_slot"]))
                r = c.post("/v1/chat/completions", json=vim_inst_warmup(VIM_PREAMBLE, [f"x = {step}"]))
                assert r.status_code == 200, r.text
            reused[n_slots] = cache_n[2:]  # each file's later requests
            if n_slots == 3:
                assert len(used) == 2 and len({s for _, s in used}) == 2  # a slot per file, kept
    assert min(reused[3]) >= len(files["ab"]) and max(reused[1]) < 8  # one token per byte here


# --- llama.vscode -------------------------------------------------------------------------------

def vscode_chunk(text: str, filename: str = "/home/u/proj/util.py") -> dict:
    return {"text": text, "time": 1732000000123, "filename": filename}  # Date.now()


def vscode_fim(chunks: list[dict], nindent: int = 4) -> dict:
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": chunks, "prompt": MIDDLE,
            "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True}
    if nindent:
        body["n_indent"] = nindent
    return body | {"t_max_prompt_ms": 500, "t_max_predict_ms": 500}


def vscode_warmup(chunks: list[dict]) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "",
            "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}


def test_llama_vscode_fim_several_completions(client):
    c, fim = client
    r = c.post("/infill", json=vscode_fim([vscode_chunk("def mul(a, b):\n    return a * b\n")]))
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3  # n_cmpl: an array, read as such by getComplFromContent
    assert all(isinstance(x["content"], str) and x["fim"] is fim for x in out)
    assert [x["index"] for x in out] == [0, 1, 2]


def test_llama_vscode_warmup_then_fim_reuses_it(client):
    c, _ = client
    chunk = vscode_chunk("VSCODE_RING = [1, 2, 3]\n", "/home/u/proj/ring.py")
    r = c.post("/infill", json=vscode_warmup([chunk]))
    assert r.status_code == 200, r.text
    r = c.post("/infill", json=vscode_fim([chunk]) | {"n_cmpl": 1})
    assert r.status_code == 200, r.text
    assert r.json()["timings"]["cache_n"] >= len(chunk["text"])


# --- Continue -----------------------------------------------------------------------------------

def test_continue_llama_cpp_completion(fim_client):
    # LlamaCpp.ts: autocomplete without FIM support sends its own template's prompt with raw=true
    prompt = f"<fim_prefix>{PREFIX}{MIDDLE}<fim_suffix>{SUFFIX}<fim_middle>"
    body = {"model": "starcoder2-3b", "prompt": prompt, "stream": True, "n_predict": 4096,
            "stop": CONTINUE_STOPS, "temperature": 0.01}
    r = fim_client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events and all(isinstance(e["content"], str) for e in events)  # streamSse -> value.content
    assert events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])


def test_continue_openai_completions(client):
    c, _ = client
    body = {"model": "my-model", "max_tokens": 4096, "temperature": 0.01, "stop": CONTINUE_STOPS,
            "prompt": PREFIX + MIDDLE, "stream": True}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks and all(isinstance(e["choices"][0]["text"], str) for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_continue_fim_completions(client):
    c, _ = client
    # openai-adapters OpenAI.fimStream: undefined fields are dropped by JSON.stringify
    body = {"model": "my-model", "prompt": PREFIX + MIDDLE, "suffix": SUFFIX, "max_tokens": 4096,
            "temperature": 0.01, "stop": CONTINUE_STOPS, "stream": True}
    r = c.post("/v1/fim/completions", json=body)
    assert r.status_code == 200, r.text
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks and all("delta" in e["choices"][0] for e in chunks)  # read: choices[0].delta.content
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    assert isinstance(text, str) and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_continue_ollama_show_then_fim(client):
    c, fim = client
    r = c.post("/api/show", json={"name": "qwen2.5-coder:1.5b"})
    assert r.status_code == 200, r.text
    show = r.json()
    # Ollama.ts ensureModelInfo: num_ctx from `parameters`, FIM iff the template mentions .Suffix
    params = {}
    for line in show["parameters"].split("\n"):
        m = re.match(r'^(\S+)\s+((?:".*")|\S+)$', line)
        if m:
            params[m.group(1)] = m.group(2)
    assert int(params["num_ctx"]) == CONTEXT
    assert ".Suffix" in show["template"]
    assert "insert" in show["capabilities"] and "completion" in show["capabilities"]
    assert show["model_info"][f"{show['model_info']['general.architecture']}.context_length"] == CONTEXT
    body = {"model": "qwen2.5-coder:1.5b", "prompt": PREFIX + MIDDLE, "suffix": SUFFIX,
            "options": {"temperature": 0.01, "num_predict": 4096, "stop": CONTINUE_STOPS, "num_ctx": CONTEXT},
            "keep_alive": 1800}  # no `stream`: Ollama's default, true
    r = c.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r.text)
    assert all(x["model"] == "qwen2.5-coder:1.5b" and isinstance(x["response"], str) for x in lines)
    assert all(x["done"] is False for x in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] in ("stop", "length") and last["fim"] is fim
    assert 0 < last["eval_count"] < CONTEXT and last["prompt_eval_count"] > 0
    assert all(isinstance(last[k], int) for k in ("total_duration", "load_duration", "prompt_eval_duration",
                                                   "eval_duration"))


def test_continue_ollama_raw_completion_and_chat(fim_client):
    c = fim_client
    # autocomplete without FIM support: its own template's prompt, raw
    body = {"model": "x", "prompt": f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>", "raw": True,
            "options": {"temperature": 0.01, "num_predict": 16, "stop": CONTINUE_STOPS, "num_ctx": CONTEXT},
            "keep_alive": 1800}
    lines = ndjson(c.post("/api/generate", json=body).text)
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] <= 16 and "fim" not in lines[-1]
    body = {"model": "x", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "options": {"num_predict": 8, "num_ctx": CONTEXT}, "keep_alive": 1800, "stream": True}
    r = c.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    lines = ndjson(r.text)
    assert all(x["message"]["role"] == "assistant" and isinstance(x["message"]["content"], str) for x in lines)
    assert lines[-1]["done"] is True and lines[-1]["message"]["content"] == "" and lines[-1]["eval_count"] <= 8
    r = c.post("/api/chat", json=body | {"stream": False})
    assert r.status_code == 200 and r.json()["done"] is True
    assert len(r.json()["message"]["content"]) == len("".join(x["message"]["content"] for x in lines))


# --- Tabby --------------------------------------------------------------------------------------

def test_tabby_llama_cpp_completion(fim_client):
    body = {"seed": 1732000000123, "prompt": f"<fim_prefix>{PREFIX}{MIDDLE}<fim_suffix>{SUFFIX}<fim_middle>",
            "n_predict": 64, "temperature": 0.1, "stream": True, "penalty_last_n": 0, "presence_penalty": 0.5}
    r = fim_client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")  # reqwest_eventsource insists
    events = sse(r.text)
    # serde: every event must have a string `content` and a bool `stop` (unwrap() otherwise)
    assert events and all(isinstance(e["content"], str) and isinstance(e["stop"], bool) for e in events)
    assert events[-1]["stop"] is True


# --- Ollama's protocol beyond what Continue uses ----------------------------------------------

def test_ollama_generate_limits_and_load(client):
    c, _ = client
    base = {"model": "any", "prompt": "hello", "stream": False}
    r = c.post("/api/generate", json=base | {"options": {"num_predict": 0}})
    out = r.json()
    assert r.status_code == 200 and out["response"] == "" and out["eval_count"] == 0 and out["done"] is True
    out = c.post("/api/generate", json=base | {"raw": True, "options": {"num_predict": -1, "temperature": None}}).json()
    assert out["done"] is True and 0 < out["eval_count"] < CONTEXT
    out = c.post("/api/generate", json=base | {"raw": True, "options": {"num_predict": 3}}).json()
    assert out["done_reason"] == ("length" if out["eval_count"] == 3 else "stop") and out["eval_count"] <= 3
    out = c.post("/api/generate", json={"model": "any", "prompt": ""}).json()
    assert out["done_reason"] == "load" and out["response"] == ""
    out = c.post("/api/chat", json={"model": "any", "messages": [], "stream": False}).json()
    assert out["done_reason"] == "load"


def test_ollama_errors_and_listing(fim_client):
    c = fim_client
    r = c.post("/api/generate", json={"model": "m", "prompt": "a", "images": ["iVBORw0KGgo="]})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)  # Ollama's error shape
    r = c.post("/api/generate", json={"model": "m", "prompt": "a", "raw": True, "system": "s"})
    assert r.status_code == 400 and "raw" in r.json()["error"]
    r = c.post("/api/generate", json={"model": "m", "prompt": "a" * (2 * CONTEXT), "raw": True, "stream": False,
                                      "options": {"num_predict": 2}})
    assert r.status_code == 200  # too long: cut from the left, as Ollama and llama.cpp do
    assert c.post("/api/show", json={}).status_code == 400
    tags = c.get("/api/tags").json()["models"]
    assert len(tags) == 1 and tags[0]["details"]["format"] == "gguf" and tags[0]["size"] > 0
    assert c.get("/api/ps").json()["models"][0]["name"] == tags[0]["name"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", c.get("/api/version").json()["version"])


# --- what every route must refuse ----------------------------------------------------------------

SURROGATES = [
    ("/infill", b'{"input_prefix":"\\ud800"}'),
    ("/infill", b'{"input_extra":[{"text":"\\ud800","filename":"a.py"}]}'),
    ("/infill", b'{"prompt":"\\ud800"}'),
    ("/completion", b'{"prompt":"\\ud800"}'),
    ("/v1/completions", b'{"prompt":"\\ud800"}'),
    ("/v1/completions", b'{"prompt":"a","suffix":"\\udc00"}'),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
    ("/api/generate", b'{"prompt":"\\ud800"}'),
    ("/api/generate", b'{"prompt":"a","suffix":"b","options":{"stop":["\\ud800"]}}'),
    ("/api/chat", b'{"messages":[{"role":"user","content":"\\ud800"}]}'),
]


@pytest.mark.parametrize("path,body", SURROGATES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(SURROGATES)])
def test_lone_surrogate_is_400(fim_client, path, body):
    r = fim_client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "error" in r.json()


def test_chunked_body_over_max_body_is_413(paths):
    with TestClient(create_app(Session(paths[True], "ngram"), max_body=4096)) as c:
        def body(n):
            yield b'{"model":"m","prompt":"'
            for _ in range(n):
                yield b"x" * 1024
            yield b'"}'

        r = c.post("/api/show", content=body(1), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text  # a small chunked body passes
        r = c.post("/infill", content=body(8), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]


def test_strict_infill_is_501_without_fim_tokens(paths):
    with TestClient(create_app(Session(paths[False], "ngram"), strict_infill=True)) as c:
        r = c.post("/infill", json=vim_fim([]))
        assert r.status_code == 501
        assert r.json()["error"]["type"] == "not_supported_error"


# --- the real default model ----------------------------------------------------------------------

@pytest.mark.slow
def test_editors_on_the_default_model(default_model):
    with TestClient(create_app(Session(default_model, "cacheback"))) as c:
        r = c.post("/infill", json=vim_fim([vim_chunk("def sub(a, b):\n    return a - b\n")]))
        assert r.status_code == 200, r.text
        assert '"content":"' in r.text and r.json()["content"].strip()
        r = c.post("/infill", json=vscode_warmup([vscode_chunk("def mul(a, b):\n    return a * b\n")]))
        assert r.status_code == 200, r.text
        r = c.post("/infill", json=vscode_fim([vscode_chunk("def mul(a, b):\n    return a * b\n")]))
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out) == 3 and all(x["content"].strip() and x["fim"] is False for x in out)
        assert out[0]["timings"]["cache_n"] > 0
        r = c.post("/v1/chat/completions", json=vim_inst_warmup(VIM_PREAMBLE, ["x = 1"]))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "" and r.json()["usage"]["completion_tokens"] == 0
