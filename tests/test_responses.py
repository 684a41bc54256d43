"""OpenAI's Responses protocol (server/responses.py), checked with OpenAI's own SDK and its stream
helper (which refuses events out of order): conversations reach the chat template as the chat
route's do, answers come back as output items (reasoning, message, function_call), bad input is a
one-line 4xx."""

import json
import random

from cacheback_mlx.errors import CachebackError
from cacheback_mlx.reasoning import Reasoning
from cacheback_mlx.server.responses import Items, ResponsesRequest
from cacheback_mlx.server.tool_calls import ToolCalls

import httpx
import openai
import pytest
from mlx_lm.tool_parsers import json_tools

from test_reasoning import Thinks
from test_tool_calls import CALL, WEATHER, WritesACall

pytestmark = pytest.mark.serial  # starts servers

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_input_items_become_the_template_s_messages():
    req = ResponsesRequest(instructions="Be brief.", tools=[TOOL], input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9 C"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "18 C in Paris, 9 C in Oslo."}]}])
    call = lambda i, city: {"id": f"call_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    assert req.plain() == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "Paris"), call(2, "Oslo")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "9 C", "name": "get_weather"},
        {"role": "assistant", "content": "18 C in Paris, 9 C in Oslo."}]
    assert req.offered() == [WEATHER]
    assert ResponsesRequest(input="hi", tools=[TOOL], tool_choice="none").offered() is None
    assert ResponsesRequest(input="hi", reasoning={"effort": "none"}).template_args() == {
        "reasoning_effort": "none", "enable_thinking": False}
    assert ResponsesRequest(input="hi").plain() == [{"role": "user", "content": "hi"}]


def test_a_picture_in_a_function_s_output_is_a_line_saying_so():
    """A function's output may hold a picture or a file (an agent's tool read one): the model reads
    text only, so each is a line saying it is not shown and the conversation goes on; one the user
    sends is still refused."""
    req = ResponsesRequest(input=[
        {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [
            {"type": "input_text", "text": "shot.png:"}, {"type": "input_image", "image_url": "data:,"},
            {"type": "input_file", "file_data": "AA=="}]}])
    assert req.plain()[-1] == {"role": "tool", "tool_call_id": "call_1", "name": "read",
                               "content": "shot.png:\n[an image, not shown: this model reads text only]\n"
                                          "[a file, not shown: this model reads text only]"}
    with pytest.raises(CachebackError, match="input_file"):
        ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_file", "file_data": "AA=="}]}]).plain()


@pytest.mark.parametrize("body, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": [{"type": "web_search_call", "id": "1"}]}, "web_search_call"),
    ({"tools": [{"type": "web_search"}]}, "function tools"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
])
def test_what_a_stateless_text_server_cannot_take_is_a_one_line_error(body, words):
    req = ResponsesRequest(**({"input": "hi"} | body))
    with pytest.raises(CachebackError, match=words) as e:
        req.plain()
        req.offered()
    assert "\n" not in str(e.value)


def test_an_answer_s_items_however_its_text_is_cut():
    text = f"<think>plan</think>I will look it up.{CALL}{CALL.replace('Paris', 'Oslo')}"

    def fresh() -> Items:
        return Items(Reasoning("<think>", "</think>"),
                     ToolCalls("<tool_call>", "</tool_call>", json_tools.parse_tool_call, [WEATHER]))

    whole = fresh()
    whole.feed(text, final=True)
    assert [i["type"] for i in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    assert whole.output[0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
    assert whole.output[1]["content"][0]["text"] == "I will look it up."
    assert [json.loads(i["arguments"]) for i in whole.output[2:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    rng = random.Random(5)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 15)))
        items, events, at = fresh(), [], 0
        for cut in [*cuts, len(text)]:
            events += items.feed(text[at:cut], final=cut == len(text))
            at = cut
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
        assert strip(done) == strip(items.output) == strip(whole.output)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == "I will look it up."


def test_openai_s_sdk_gets_the_model_s_function_calls(agent_server):
    session, url = agent_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit")
    r = client.responses.create(model="local", input=ASK, tools=[TOOL], max_output_tokens=64)
    assert r.status == "completed" and [i.type for i in r.output] == ["message", "function_call"]
    assert r.output_text == "I will look it up."
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_weather", {"city": "Paris"})
    assert session.prompts[-1] == session.encode(ASK, chat=True, tools=[WEATHER])  # as the chat route's prompt
    with client.responses.stream(model="local", input=ASK, tools=[TOOL], max_output_tokens=64) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [i.type for i in streamed.output] == ["message", "function_call"]
    assert streamed.output_text == r.output_text and streamed.output[1].arguments == r.output[1].arguments
    assert streamed.usage.input_tokens == len(session.prompts[-1])
    # the call's output goes back: the template sees the call and its result as the chat route's
    follow = [*ASK, r.output[1].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "18 C, sunny"}]
    client.responses.create(model="local", input=follow, tools=[TOOL], max_output_tokens=8)
    prompt = session.tokenizer.decode(session.prompts[-1])
    assert CALL in prompt and "<|im_start|>tool\n18 C, sunny" in prompt
    r = client.responses.create(model="local", input=ASK, tools=[TOOL], tool_choice="none", max_output_tokens=64)
    assert [i.type for i in r.output] == ["message"] and r.output_text == WritesACall.answer
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.responses.create(model="local", input=ASK, tools=[{"type": "web_search"}])
    for body in ({}, {"input": 5}, {"input": "hi", "max_output_tokens": 0}, {"input": [{"role": "x"}]},
                 {"input": "hi", "text": {"format": {"type": "xml"}}}, {"input": "hi", "text": {"format": "json"}},
                 {"input": "hi", "tools": [{"name": "f"}]}):
        r = httpx.post(f"{url}/v1/responses", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=60)
        assert 400 <= r.status_code < 500 and "\n" not in r.json()["error"]["message"], (body, r.text)


def test_the_reasoning_comes_back_as_a_reasoning_item(thinking_server):
    session, url = thinking_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.responses.create(model="m", input="Three colors?", max_output_tokens=32)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "first, the colors" and r.output_text == "Red, blue and green."
    with client.responses.stream(model="m", input="Three colors?", max_output_tokens=32) as stream:
        reasoning = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert reasoning == "first, the colors" and final.output_text == r.output_text
    r = client.responses.create(model="m", input="Three colors?", max_output_tokens=32, reasoning={"effort": "none"})
    assert "<think>" not in session.tokenizer.decode(session.prompts[-1])
    assert [i.type for i in r.output] == ["message"] and r.output_text == Thinks.answer


def test_the_answer_is_the_chat_route_s_and_says_when_it_was_cut(plain_server):
    url = plain_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    ask = [{"role": "user", "content": "Count: one two three"}]
    chat = client.chat.completions.create(model="m", messages=ask, max_tokens=24)
    r = client.responses.create(model="m", input=ask, max_output_tokens=24)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens and r.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model="m", input=ask, max_output_tokens=24) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == r.output_text
    r = client.responses.create(model="m", input=ask, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = [json.loads(x[5:]) for x in httpx.post(f"{url}/v1/responses", json={
        "input": ask, "max_output_tokens": 3, "stream": True}, timeout=60).text.splitlines() if x.startswith("data:")]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    r = client.responses.create(model="m", input=[{"role": "user", "content": "y" * 160}])  # no limit: as many as fit
    assert r.status == "incomplete" and r.usage.input_tokens + r.usage.output_tokens == 256
    with pytest.raises(openai.BadRequestError, match="context window"):  # never cut from the left
        client.responses.create(model="m", input=[{"role": "user", "content": "z" * 300}])
