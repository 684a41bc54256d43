"""Tool calls: tools offered go into the chat template, the calls the model writes come back as each
protocol's tool_calls (server/tool_calls.py), parsed by mlx-lm's parser for the template."""

import json
import random

from cacheback_mlx.api import Session
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.server.tool_calls import ToolCalls, check_choice, openai_calls, template_messages

import httpx
import pytest
from mlx_lm.tool_parsers import json_tools, mistral

from conftest import write_tiny_gguf
from test_server import serving
from test_server import sse_events as sse

pytestmark = pytest.mark.serial  # starts servers

# A chat template with tools in the layout of Qwen's (mlx-lm reads it as its "json_tools" family).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- for tool_call in m.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def splitter(start="<tool_call>", end="</tool_call>", parse=json_tools.parse_tool_call) -> ToolCalls:
    return ToolCalls(start, end, parse, [WEATHER])


def fed(split: ToolCalls, text: str, cuts: list[int]) -> tuple[list[str], list[dict]]:
    """The text shown piece by piece and the calls, with `text` fed in pieces cut at `cuts`."""
    shown, calls, at = [], [], 0
    for cut in [*cuts, len(text)]:
        piece, got = split.feed(text[at:cut], final=cut == len(text))
        shown.append(piece)
        calls += got
        at = cut
    return shown, calls


@pytest.mark.parametrize("text, content, names", [
    (f"Let me look.{CALL}", "Let me look.", ["get_weather"]),
    (f"{CALL}\n{CALL.replace('Paris', 'Oslo')}", "\n", ["get_weather", "get_weather"]),
    (f"{CALL} and then some text", " and then some text", ["get_weather"]),
    ("if a <tool b: no call at all", "if a <tool b: no call at all", []),
    ("<tool_call>{not json}</tool_call> left", "<tool_call>{not json}</tool_call> left", []),  # stays text
    ('cut off: <tool_call>{"name": "get_weather", "argu', 'cut off: <tool_call>{"name": "get_weather", "argu', []),
    ("ends with <tool_ca", "ends with <tool_ca", []),
])
def test_text_splits_into_content_and_calls_however_it_is_cut(text, content, names):
    whole_shown, whole_calls = fed(splitter(), text, [])
    assert "".join(whole_shown) == content and [c["name"] for c in whole_calls] == names
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        shown, calls = fed(splitter(), text, cuts)
        assert "".join(shown) == content and calls == whole_calls
        if names:  # no piece shown before a call ever holds the start of its markup
            assert not any("<tool" in piece for piece in shown)
    for cut in range(1, len(text)):  # every single cut
        shown, calls = fed(splitter(), text, [cut])
        assert "".join(shown) == content and calls == whole_calls
    if names:
        assert whole_calls[0]["arguments"]["city"] in ("Paris", "Oslo")


def test_a_call_without_an_end_marker_runs_to_the_end_of_the_answer():
    split = splitter("[TOOL_CALLS]", "", mistral.parse_tool_call)
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    shown, calls = fed(split, text, [8, 20, 30])
    assert "".join(shown) == "Sure." and calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    shown, calls = fed(splitter("[TOOL_CALLS]", "", mistral.parse_tool_call), 'x[TOOL_CALLS]get_weather[ARGS]{"ci', [])
    assert shown == ['x[TOOL_CALLS]get_weather[ARGS]{"ci'] and calls == []  # cut off: stays text


def test_protocol_shapes_and_messages_for_templates():
    calls = [{"name": "f", "arguments": {"x": "é"}}, {"name": "g", "arguments": {}, "id": "own"}]
    out = openai_calls(calls, first=2, stream=True)
    assert [c["index"] for c in out] == [2, 3] and out[1]["id"] == "own" and out[0]["id"].startswith("call_")
    assert json.loads(out[0]["function"]["arguments"]) == {"x": "é"} and out[0]["type"] == "function"
    sent = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    got = template_messages(sent)
    assert got[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert got[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert sent[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not changed
    assert check_choice(None) and check_choice("auto") and not check_choice("none")
    for forced in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(CachebackError, match="tool_choice"):
            check_choice(forced)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.gguf"
    write_tiny_gguf(path, context=512, chat_template=TOOLS_TEMPLATE)
    return str(path)


def test_a_gguf_template_with_tool_markup_gets_mlx_lm_s_parser(tool_model, tmp_path):
    tok = Session(tool_model, "none").tokenizer
    assert tok.has_tool_calling and (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tok.tool_parser is json_tools.parse_tool_call
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain)
    assert not Session(str(plain), "none").tokenizer.has_tool_calling


class WritesACall(Session):
    """The model's side replaced at its boundary: the prompt runs through the engine (one token),
    then the answer is the text given, as if the model wrote it; the prompts are kept."""

    answer = f"I will look it up.{CALL}"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts = []

    def stream_ids(self, prompt_ids, max_tokens=256, sampling=None, context=(), truncate=False, stop=None):
        self.prompts.append(list(prompt_ids))
        for _ in super().stream_ids(prompt_ids, 1, sampling, context, truncate, stop):
            pass
        for i in range(0, len(self.answer), 5):
            yield self.answer[i:i + 5], []


@pytest.fixture(scope="module")
def tool_server(tool_model):
    session = WritesACall(tool_model, "ngram")
    with serving(session) as url:
        yield session, url


def test_openai_chat_offers_tools_and_answers_the_call(tool_server):
    session, url = tool_server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"messages": messages, "tools": [WEATHER], "max_tokens": 64}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will look it up."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert session.prompts[-1] == session.encode(messages, chat=True, tools=[WEATHER])
    assert '"name": "get_weather"' in session.tokenizer.decode(session.prompts[-1])  # the schema reached the model

    r = httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60)
    chunks = sse(r)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    calls = [t for c in chunks if c.get("choices") for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert text == "I will look it up." and [c["index"] for c in calls] == [0]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "tool_calls"

    r = httpx.post(f"{url}/v1/chat/completions", json=body | {"tool_choice": "none"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == WritesACall.answer
    assert session.prompts[-1] == session.encode(messages, chat=True)  # no tools offered: none parsed either
    r = httpx.post(f"{url}/v1/chat/completions", json=body | {"tool_choice": "required"}, timeout=60)
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]


class CallsAfterBlankLines(WritesACall):
    answer = f"\n\n{CALL}"


def test_a_call_after_the_reasoning_leaves_no_blank_content(tool_model):
    """Qwen3's way: a think block, blank lines, then the call: the message is the call alone."""
    with serving(CallsAfterBlankLines(tool_model, "ngram")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Paris?"}],
                                                           "tools": [WEATHER]}, timeout=60).json()
    msg = r["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_conversation_with_calls_and_their_results_reaches_the_template(tool_server):
    session, url = tool_server
    r = httpx.post(f"{url}/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.json() == {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}  # llama.cpp's route
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 200, r.text
    prompt = session.tokenizer.decode(session.prompts[-1])
    assert CALL in prompt and "<|im_start|>tool\n18 C, sunny" in prompt  # arguments as an object, as templates read

    r = httpx.post(f"{url}/api/chat", json={"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}], "tools": [WEATHER],
        "stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    assert CALL in session.tokenizer.decode(session.prompts[-1])


def test_ollama_chat_answers_calls_with_arguments_as_objects(tool_server):
    session, url = tool_server
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    r = httpx.post(f"{url}/api/chat", json=body | {"stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    msg = r.json()["message"]
    assert msg["content"] == "I will look it up." and r.json()["done"]
    assert msg["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    lines = [json.loads(x) for x in httpx.post(f"{url}/api/chat", json=body, timeout=60).text.splitlines()]
    assert "".join(x["message"]["content"] for x in lines) == "I will look it up."
    assert [c for x in lines for c in x["message"].get("tool_calls", [])] == msg["tool_calls"]
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"
    assert "tools" in httpx.post(f"{url}/api/show", json={"model": "m"}, timeout=60).json()["capabilities"]


@pytest.fixture(scope="module")
def no_tools_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("notools") / "plain.gguf"
    write_tiny_gguf(path, context=256)
    with serving(Session(str(path), "ngram")) as url:
        yield url


def test_tools_for_a_model_without_tool_calls_are_a_one_line_400(no_tools_server):
    url = no_tools_server
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and "does not support tool calling" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/api/chat", json={"messages": messages, "tools": [WEATHER], "stream": False}, timeout=60)
    assert r.status_code == 400 and "does not support tool calling" in r.json()["error"]
    assert "tools" not in httpx.post(f"{url}/api/show", json={"model": "m"}, timeout=60).json()["capabilities"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": "nope"}, timeout=60)
    assert r.status_code in (400, 422)
    # without tools, or with tool_choice "none", the same model answers
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                       "tool_choice": "none", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}],
                                                       "max_tokens": 4}, timeout=60)
    assert r.status_code == 200  # a tool's message goes to the template as any other


@pytest.mark.parametrize("body", [
    {"tools": [1]},
    {"tools": [{"type": "function", "function": "get_weather"}]},
    {"tools": [{"type": "function", "function": {"name": {"a": 1}}}]},
    {"extra": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
    {"extra": [{"role": "assistant", "tool_calls": [{}]}]},
    {"extra": [{"role": "assistant", "tool_calls": [{"function": {"name": 1, "arguments": "{}"}}]}]},
    {"tool_choice": 5},
])
def test_malformed_tools_and_calls_are_4xx_by_both_protocols(tool_server, body):
    _, url = tool_server
    messages = [{"role": "user", "content": "hi"}, *body.get("extra", [])]
    sent = {k: v for k, v in body.items() if k != "extra"} | {"messages": messages, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=sent, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text
    if "tool_choice" not in body:
        r = httpx.post(f"{url}/api/chat", json=sent | {"stream": False}, timeout=60)
        assert 400 <= r.status_code < 500, r.text
