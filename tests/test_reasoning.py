"""Reasoning: a thinking model's text between its think markers comes back apart from its answer
(reasoning.py), by OpenAI's and Ollama's names, streamed or not."""

import json
import random

from cacheback_mlx.api import Session
from cacheback_mlx.reasoning import Reasoning

import httpx
import pytest

from conftest import write_tiny_gguf
from test_server import sse_events
from test_tool_calls import WritesACall

pytestmark = pytest.mark.serial  # starts servers

# a template that opens a think block for the model unless told not to (as Qwen3's thinking variants do)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}")


@pytest.mark.parametrize("inside, text, thought, said", [
    (False, "<think>plan it</think>The answer.", "plan it", "The answer."),
    (True, "plan it</think>The answer.", "plan it", "The answer."),
    (False, "No thinking at all, a < b.", "", "No thinking at all, a < b."),
    (True, "cut off while still thinking </thi", "cut off while still thinking </thi", ""),
    (False, "before<think>a</think>mid<think>b</think>after", "ab", "beforemidafter"),
])
def test_text_splits_into_reasoning_and_content_however_it_is_cut(inside, text, thought, said):
    def fed(cuts):
        mind, parts, at = Reasoning("<think>", "</think>", inside), [], 0
        for cut in [*cuts, len(text)]:
            parts.append(mind.feed(text[at:cut], final=cut == len(text)))
            at = cut
        return "".join(t for t, _ in parts), "".join(s for _, s in parts), parts

    assert fed([])[:2] == (thought, said)
    rng = random.Random(len(text))
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(10, len(text) - 1))))
        got_thought, got_said, parts = fed(cuts)
        assert (got_thought, got_said) == (thought, said)
        assert not any("<th" in t or "</" in s for t, s in parts if thought)  # no marker leaks, even in part


class Thinks(WritesACall):
    answer = "first, the colors</think>Red, blue and green."


def test_openai_chat_gives_the_reasoning_apart(thinking_server):
    session, url = thinking_server
    assert session.tokenizer.has_thinking
    body = {"messages": [{"role": "user", "content": "Three colors?"}], "max_tokens": 32}
    msg = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["content"] == "Red, blue and green."
    assert msg["reasoning_content"] == msg["reasoning"] == "first, the colors"
    chunks = sse_events(httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60))
    deltas = [c["delta"] for ch in chunks for c in ch.get("choices", [])]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "first, the colors"
    assert "".join(d.get("content", "") for d in deltas) == "Red, blue and green."
    # the template's own variables: no think block opened, so the same text is all answer
    plain = httpx.post(f"{url}/v1/chat/completions", json=body | {"chat_template_kwargs": {"enable_thinking": False}},
                       timeout=60).json()["choices"][0]["message"]
    assert "<think>" not in session.tokenizer.decode(session.prompts[-1])
    assert plain["content"] == Thinks.answer and "reasoning_content" not in plain
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=60).json()
    assert text["choices"][0]["text"] == Thinks.answer  # a plain completion is left as the model wrote it


def test_ollama_gives_the_thinking_apart(thinking_server):
    session, url = thinking_server
    body = {"messages": [{"role": "user", "content": "Three colors?"}], "stream": False}
    msg = httpx.post(f"{url}/api/chat", json=body, timeout=60).json()["message"]
    assert msg["thinking"] == "first, the colors" and msg["content"] == "Red, blue and green."
    lines = [json.loads(x) for x in httpx.post(f"{url}/api/chat", json=body | {"stream": True},
                                               timeout=60).text.splitlines()]
    assert "".join(x["message"].get("thinking", "") for x in lines) == "first, the colors"
    assert "".join(x["message"]["content"] for x in lines) == "Red, blue and green."
    r = httpx.post(f"{url}/api/generate", json={"prompt": "Three colors?", "stream": False}, timeout=60).json()
    assert r["thinking"] == "first, the colors" and r["response"] == "Red, blue and green."
    r = httpx.post(f"{url}/api/chat", json=body | {"think": False}, timeout=60).json()
    assert "<think>" not in session.tokenizer.decode(session.prompts[-1])
    assert r["message"]["content"] == Thinks.answer and "thinking" not in r["message"]


def test_a_model_without_think_markers_is_left_alone(tmp_path):
    path = tmp_path / "plain.gguf"
    write_tiny_gguf(path, chat_template=TEMPLATE)
    session = Session(str(path), "none")
    assert Reasoning.of(session.tokenizer, session.encode("hi", chat=True)) is None
