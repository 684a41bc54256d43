"""Tool calls: the tools a chat request offers go to the model's chat template, and the calls the
model writes come back as the protocol's `tool_calls`, as mlx-lm's server does it.

The markup is the model's own (between `tokenizer.tool_call_start` and `tool_call_end`, e.g.
Qwen's <tool_call>...</tool_call>; Mistral's [TOOL_CALLS] runs to the end), found by mlx-lm for
the chat template (mlx_lm.tool_parsers; tokenizer.tool_markup for GGUF files), and each call is
read by mlx-lm's parser for that family. Text outside the markup stays the message's content. A
call that does not parse (bad JSON, or cut off by the token limit) stays text, markup and all: the
client sees what the model wrote, never a call it did not make. Decoding is not touched: the
tokens are the model's, drafted or not.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Literal, Sequence

from ..errors import CachebackError
from ..reasoning import marker_prefix
from .fields import Lenient

log = logging.getLogger(__name__)


class Function(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    """A tool offered (OpenAI's and Ollama's shape)."""

    type: Literal["function"] = "function"
    function: Function


class Called(Lenient):
    name: str
    arguments: str | dict[str, Any] = {}  # OpenAI sends a JSON string, Ollama an object


class ToolCall(Lenient):
    """A call an assistant's message carries."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: Called


def as_dicts(items: Sequence[Lenient] | None) -> list[dict] | None:
    return [i.model_dump(exclude_none=True) for i in items] if items is not None else None


def check_choice(choice: Any) -> bool:
    """Whether a request's tool_choice lets the tools reach the model: "auto" (or none given) does,
    "none" does not; a call the model must make is refused (nothing here can force one)."""
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    raise CachebackError(f"tool_choice {json.dumps(choice)} is not supported: use \"auto\" or \"none\" "
                         "(the model decides whether to call a tool)")


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates read them: a call's arguments as an object, not a JSON string."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_arguments_as_object(c) for c in calls])
        out.append(m)
    return out


def _arguments_as_object(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return call  # left as the client sent it
    return dict(call, function=dict(call["function"], arguments=args))


class ToolCalls:
    """One answer's text split into content and calls, piece by piece as it streams."""

    def __init__(self, start: str, end: str, parse, tools: Sequence[dict]):
        self.start, self.end, self.parse, self.tools = start, end or "", parse, list(tools)
        self.made = 0  # calls given out so far
        self._held = ""  # text not given out yet: it may begin a marker, or be inside a call
        self._inside = False

    @classmethod
    def of(cls, tokenizer, tools: Sequence[dict] | None) -> ToolCalls | None:
        """The splitter for a request offering `tools` (None when it offers none); a model whose
        chat template has no tool calls cannot take them: a one-line error."""
        if not tools:
            return None
        if not getattr(tokenizer, "has_tool_calling", False):
            raise CachebackError("this model does not support tool calling (its chat template has no tool-call "
                                 "markup that mlx-lm knows)")
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        """After `piece`: the text that can be shown now and the calls completed, each as
        {"name": ..., "arguments": {...}}. `final`: the answer ended, nothing is held back."""
        self._held += piece
        text, calls = [], []
        while True:
            if not self._inside:
                at = self._held.find(self.start)
                if at < 0:
                    keep = 0 if final else marker_prefix(self._held, self.start)
                    cut = len(self._held) - keep
                    text.append(self._held[:cut])
                    self._held = self._held[cut:]
                    break
                text.append(self._held[:at])
                self._held, self._inside = self._held[at + len(self.start):], True
                continue
            at = self._held.find(self.end) if self.end else -1
            if at < 0:
                if final:  # the answer ended inside a call: a call only where its markup runs to the end
                    text.append(self._take(self._held, closed=not self.end, calls=calls))
                    self._held, self._inside = "", False
                break
            body = self._held[:at]
            self._held, self._inside = self._held[at + len(self.end):], False
            text.append(self._take(body, closed=True, calls=calls))
        self.made += len(calls)
        return "".join(text), calls

    def _take(self, body: str, closed: bool, calls: list[dict]) -> str:
        """Parse one call's text into `calls`; "" when it parsed, else the text as the model wrote it."""
        parsed = self._parse(body) if closed else None
        if parsed is None:
            return self.start + body + (self.end if closed else "")
        calls.extend(parsed)
        return ""

    def _parse(self, body: str) -> list[dict] | None:
        try:
            parsed = self.parse(body, self.tools)
        except Exception as e:  # noqa: BLE001 (each family's parser raises its own errors on bad text)
            log.info("a tool call did not parse (%s: %s); it stays text", type(e).__name__, e)
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not parsed or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed):
            return None
        return [{"name": c["name"], "arguments": c.get("arguments", {})}
                | ({"id": c["id"]} if isinstance(c.get("id"), str) else {}) for c in parsed]


def answer_parts(mind, split: ToolCalls | None, piece: str, final: bool = False) -> list[tuple[str, Any]]:
    """One piece of an answer as its parts, in order: ("thinking", text) from the reasoning
    splitter `mind` (reasoning.Reasoning, or None), ("text", text), then ("call", call) for each
    call the tool-call splitter `split` completed (None: no tools offered)."""
    thought, said = mind.feed(piece, final) if mind is not None else ("", piece)
    text, calls = split.feed(said, final) if split is not None else (said, [])
    return ([("thinking", thought)] if thought else []) + ([("text", text)] if text else []) + [
        ("call", c) for c in calls]


def call_arguments(call: dict) -> dict:
    """A call's arguments as an object (a parser that gave a JSON string: parsed; anything else
    kept under "arguments")."""
    args = call["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return {"arguments": args}
    return args if isinstance(args, dict) else {"arguments": args}


def openai_calls(calls: list[dict], first: int = 0, stream: bool = False) -> list[dict]:
    """OpenAI's shape: arguments as a JSON string, an id per call (the model's own where it wrote
    one), and its index in a stream."""
    out = []
    for i, c in enumerate(calls, first):
        args = c["arguments"] if isinstance(c["arguments"], str) else json.dumps(c["arguments"], ensure_ascii=False)
        call = {"id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": c["name"], "arguments": args}}
        out.append({"index": i} | call if stream else call)
    return out


def ollama_calls(calls: list[dict]) -> list[dict]:
    """Ollama's shape: arguments as an object."""
    out = []
    for c in calls:
        args = c["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({"function": {"name": c["name"], "arguments": args}})
    return out
