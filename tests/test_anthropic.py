"""Anthropic's Messages protocol (server/anthropic.py), checked with Anthropic's own SDK as a client:
conversations reach the chat template as the OpenAI route's do, answers come back as content blocks
(thinking, text, tool_use) and as the stream's named events, bad input is a 4xx in Anthropic's shape."""

import json
import random

from cacheback_mlx.errors import CachebackError
from cacheback_mlx.reasoning import Reasoning
from cacheback_mlx.server.anthropic import Blocks, Counted, MessagesRequest
from cacheback_mlx.server.tool_calls import ToolCalls

import anthropic
import httpx
import openai
import pytest
from mlx_lm.tool_parsers import json_tools

from test_reasoning import Thinks
from test_tool_calls import CALL, WEATHER, WritesACall

pytestmark = pytest.mark.serial  # starts servers

TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def as_openai(messages, system=None) -> list[dict]:
    return Counted(messages=messages, system=system).plain()


def test_a_conversation_becomes_the_template_s_messages():
    words = [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]
    messages = [{"role": "user", "content": words},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look it up", "signature": "x"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                     "content": [{"type": "text", "text": "timed out"}]},
                    {"type": "text", "text": "And Oslo?"}]}]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Use tools."}]
    assert as_openai(messages, system) == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "look it up",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timed out", "name": "get_weather"},
        {"role": "user", "content": "And Oslo?"}]
    req = MessagesRequest(messages=ASK, max_tokens=8, tools=[TOOL], stop_sequences=["\n"],
                          thinking={"type": "disabled"})
    assert req.stops() == ["\n"] and req.template_args() == {"enable_thinking": False}
    assert req.offered() == [WEATHER]
    assert MessagesRequest(messages=ASK, max_tokens=8, tools=[TOOL], tool_choice={"type": "none"}).offered() is None


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f"}]}]}, "'tool_use'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}, "id and name"),
    ({"system": [{"type": "image"}]}, "image blocks"),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tools"),
])
def test_what_a_text_model_cannot_take_is_a_one_line_error(body, words):
    req = MessagesRequest(**({"messages": ASK, "max_tokens": 8} | body))
    with pytest.raises(CachebackError, match=words) as e:
        req.plain()
        req.offered()
    assert "\n" not in str(e.value)


def rebuilt(events: list[dict]) -> list[dict]:
    """The content blocks a client builds from the stream's events (as Anthropic's SDK does)."""
    blocks, open_ = [], set()
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks) and not open_
            blocks.append(dict(e["content_block"]))
            open_.add(e["index"])
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"], blocks[-1]["_json"] = {}, ""
        elif e["type"] == "content_block_delta":
            assert e["index"] in open_
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
            else:
                kind = d["type"].removesuffix("_delta")
                b[kind] += d[kind]
        elif e["type"] == "content_block_stop":
            open_.remove(e["index"])
            b = blocks[e["index"]]
            if b["type"] == "tool_use":
                b["input"] = json.loads(b.pop("_json"))
    assert not open_
    return blocks


def test_an_answer_s_blocks_however_its_text_is_cut():
    text = f"<think>plan</think>I will look it up.{CALL}{CALL.replace('Paris', 'Oslo')}"
    def fresh() -> Blocks:
        return Blocks(Reasoning("<think>", "</think>"), ToolCalls("<tool_call>", "</tool_call>",
                                                                  json_tools.parse_tool_call, [WEATHER]))
    whole = fresh()
    whole.feed(text, final=True)
    assert [b["type"] for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"] and whole.called
    assert whole.content[0]["thinking"] == "plan" and whole.content[1]["text"] == "I will look it up."
    assert [b["input"] for b in whole.content[2:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    rng = random.Random(3)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 15)))
        b, events, at = fresh(), [], 0
        for cut in [*cuts, len(text)]:
            events += b.feed(text[at:cut], final=cut == len(text))
            at = cut
        strip = lambda blocks: [{k: v for k, v in x.items() if k != "id"} for x in blocks]
        assert strip(rebuilt(events)) == strip(b.content) == strip(whole.content)


def test_claude_s_sdk_gets_the_model_s_tool_calls(agent_server):
    session, url = agent_server
    client = anthropic.Anthropic(base_url=url, api_key="sekrit")
    m = client.messages.create(model="local", max_tokens=64, messages=ASK, tools=[TOOL])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "I will look it up."
    assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Paris"})
    assert m.content[1].id.startswith("toolu_")
    assert session.prompts[-1] == session.encode(ASK, chat=True, tools=[WEATHER])  # as the OpenAI route's prompt
    with client.messages.stream(model="local", max_tokens=64, messages=ASK, tools=[TOOL]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[0].text == m.content[0].text and streamed.content[1].input == {"city": "Paris"}
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == len(session.prompts[-1])

    # the call's result goes back: the template sees the call and its result as the OpenAI route's
    follow = [*ASK, {"role": "assistant", "content": [c.model_dump() for c in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                            "content": "18 C, sunny"}]}]
    client.messages.create(model="local", max_tokens=8, messages=follow, tools=[TOOL])
    prompt = session.tokenizer.decode(session.prompts[-1])
    assert CALL in prompt and "<|im_start|>tool\n18 C, sunny" in prompt
    n = client.messages.count_tokens(model="local", messages=follow, tools=[TOOL]).input_tokens
    assert n == len(session.prompts[-1])
    # no tools offered: the same text stays text
    m = client.messages.create(model="local", max_tokens=64, messages=ASK, tools=[TOOL], tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == WritesACall.answer


def test_a_picture_a_tool_read_is_a_line_saying_so_and_the_conversation_goes_on(agent_server):
    """An agent's tool that read a picture or a PDF returns it in its tool_result: the model reads
    text only, so each is a line saying it is not shown (the conversation carries it on, and a 400
    would end every later turn too); a picture the user sends is still refused."""
    picture = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}}
    asked = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]}
    read = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                         "content": [{"type": "text", "text": "shot.png:"}, picture, pdf]}]}
    assert as_openai([*ASK, asked, read])[-1] == {
        "role": "tool", "tool_call_id": "toolu_1", "name": "read",
        "content": "shot.png:\n[an image, not shown: this model reads text only]\n"
                   "[a document, not shown: this model reads text only]"}
    session, url = agent_server
    client = anthropic.Anthropic(base_url=url, api_key="sekrit")
    read["content"][0]["content"] = [picture]  # (a tiny model's context: one byte a token)
    m = client.messages.create(model="local", max_tokens=16, messages=[*ASK, asked, read])
    assert m.content and m.stop_reason in ("end_turn", "max_tokens")
    assert "[an image, not shown: this model reads text only]" in session.tokenizer.decode(session.prompts[-1])
    for where in ([{"role": "user", "content": [picture]}], [{"role": "user", "content": [pdf]}]):
        with pytest.raises(CachebackError, match="blocks are not supported"):
            as_openai(where)


def test_bad_requests_are_4xx_in_anthropic_s_shape(agent_server):
    _, url = agent_server
    client = anthropic.Anthropic(base_url=url, api_key="sekrit")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong").messages.create(model="m", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="image blocks"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    head = {"x-api-key": "sekrit", "anthropic-version": "2023-06-01"}
    for body in ({"messages": ASK}, {"messages": [], "max_tokens": 4}, {"max_tokens": 4},
                 {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4},
                 {"messages": ASK, "max_tokens": 0}, {"messages": ASK, "max_tokens": 4, "tools": [{"name": 1}]},
                 {"messages": ASK, "max_tokens": 4, "thinking": {"type": "sometimes"}},
                 {"messages": ASK, "max_tokens": 4, "output_config": {"format": {"type": "xml"}}},
                 {"messages": ASK, "max_tokens": 4, "output_config": {"format": {"type": "json_schema",
                                                                                 "schema": {"type": "nope"}}}},
                 {"messages": "hi", "max_tokens": 4}):
        r = httpx.post(f"{url}/v1/messages", json=body, headers=head, timeout=60)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]


def test_the_reasoning_comes_back_as_a_thinking_block(thinking_server):
    session, url = thinking_server
    client = anthropic.Anthropic(base_url=url, api_key="none")
    ask = [{"role": "user", "content": "Three colors?"}]
    m = client.messages.create(model="m", max_tokens=32, messages=ask)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", "first, the colors"), ("text", "Red, blue and green.")]
    with client.messages.stream(model="m", max_tokens=32, messages=ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    # thinking turned off reaches the template: no think block opened, the same text is all answer
    m = client.messages.create(model="m", max_tokens=32, messages=ask, thinking={"type": "disabled"})
    assert "<think>" not in session.tokenizer.decode(session.prompts[-1])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == Thinks.answer


def test_the_answer_is_the_openai_route_s_and_says_why_it_stopped(plain_server):
    url = plain_server
    client = anthropic.Anthropic(base_url=url, api_key="none")
    ask = [{"role": "user", "content": "Count: one two three"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": ask, "max_tokens": 24}, timeout=60).json()
    text, ids_n = chat["choices"][0]["message"]["content"], chat["usage"]["prompt_tokens"]
    m = client.messages.create(model="m", max_tokens=24, messages=ask)
    got = "".join(b.text for b in m.content)
    assert got == text and m.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ids_n
    assert m.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    with client.messages.stream(model="m", max_tokens=24, messages=ask) as stream:
        assert "".join(stream.text_stream) == text
    m = client.messages.create(model="m", max_tokens=3, messages=ask)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    word = next(c for c in text[1:] if c.isascii() and c.isalnum())  # a stop string cut from the answer
    m = client.messages.create(model="m", max_tokens=24, messages=ask, stop_sequences=["\u2603", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert "".join(b.text for b in m.content) == text[: text.find(word)]


def test_a_prompt_too_long_is_refused_and_a_full_context_said(plain_server):
    url = plain_server
    client = anthropic.Anthropic(base_url=url, api_key="none")
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):  # never cut from the left
        client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x" * 300}])
    m = client.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "y" * 160}])
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == 256
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 160}],
                                                       "max_tokens": 200}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length"  # the OpenAI route: cut short, as llama.cpp says it


def test_the_model_list_reads_in_both_sdks(agent_server):
    _, url = agent_server
    (model,) = anthropic.Anthropic(base_url=url, api_key="sekrit").models.list().data
    assert model.type == "model" and model.id and model.display_name == model.id
    assert [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit").models.list().data] == [model.id]
