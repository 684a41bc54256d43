"""Anthropic's Messages protocol: /v1/messages and /v1/messages/count_tokens, as llama.cpp's and
vLLM's servers speak it, so Claude Code and Anthropic's SDKs can run on a local model.

A request's `system` and `messages` (text, tool_use and tool_result blocks, the assistant's earlier
thinking) go to the model's chat template as the OpenAI route's messages do; `tools` (custom tools
with an `input_schema`) too, with `tool_choice` "auto" or "none". The answer comes back as content
blocks: the model's reasoning as a `thinking` block (its markers as mlx-lm finds them, ../reasoning.py),
its text, and each call it writes as a `tool_use` block (tool_calls.py), with stop_reason "end_turn",
"max_tokens", "stop_sequence" (and which) or "tool_use". Streamed, the events are Anthropic's
(message_start, content_block_start / _delta / _stop, message_delta, message_stop), each named on
its `event:` line as the SDKs read them. A prompt that leaves the reply too little of the
context is refused ("prompt is too long", as Anthropic's API says it), never cut; a reply that
fills the context stops with "model_context_window_exceeded". `thinking` {"type": "enabled"} or
{"type": "disabled"} reaches the template as `enable_thinking`; `output_config.format` (a JSON
schema) keeps the answer to it (constrained.py). Images and documents are refused with a 400: the
models here read text; inside a tool_result (an agent's tool that read a picture or a PDF) each is a
line saying so, so the conversation, which carries it on, can go on.
Sampling defaults to greedy decoding, as on every route of this server (give `temperature`).
Errors have Anthropic's shape ({"type": "error", "error": {"type", "message"}}), which the other
protocols' clients read too.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator

from ..errors import CachebackError
from ..reasoning import Reasoning
from .core import Context, Job, encode_text
from .fields import TOKEN_LIMIT, Lenient, Sampling
from .tool_calls import ToolCalls, answer_parts, call_arguments, template_messages


class Block(Lenient):
    """One content block of a message (the kinds a text model can take; others are refused)."""

    type: str
    text: str | None = None
    thinking: str | None = None  # an assistant's earlier reasoning
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool = False


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web search, ...) are typed


class Choice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # not enforced: the model thinks as its template lets it


class Counted(Sampling):
    """What /v1/messages/count_tokens reads: the prompt's parts."""

    model: str | None = None
    system: str | list[Block] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Choice | None = None
    thinking: Thinking | None = None

    def offered(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape); none with tool_choice "none"."""
        kind = self.tool_choice.type if self.tool_choice else "auto"
        if kind in ("any", "tool"):
            raise CachebackError(f'tool_choice {{"type": "{kind}"}} is not supported: use "auto" or "none" '
                                 "(the model decides whether to call a tool)")
        if kind == "none" or not self.tools:
            return None
        for t in self.tools:
            if t.input_schema is None:
                raise CachebackError(f"tool {t.name!r}{f' ({t.type})' if t.type else ''}: only custom tools with "
                                     "an input_schema are supported (server tools run at Anthropic)")
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools]

    def template_args(self) -> dict | None:
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    def plain(self) -> list[dict]:
        """The conversation as chat templates read it (OpenAI-style messages)."""
        out = []
        if self.system:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else "\n".join(_text(b) for b in self.system)})
        names: dict[str, str] = {}  # tool_use id -> its tool's name (templates name a result's tool)
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text, thought, calls = [], [], []
            for b in m.content:
                if b.type == "text":
                    text.append(b.text or "")
                elif b.type == "thinking" and m.role == "assistant":
                    thought.append(b.thinking or "")
                elif b.type == "redacted_thinking" and m.role == "assistant":
                    continue
                elif b.type == "tool_use" and m.role == "assistant":
                    if not b.id or not b.name:
                        raise CachebackError("a tool_use block needs its id and name")
                    names[b.id] = b.name
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": b.input or {}}})
                elif b.type == "tool_result" and m.role == "user":
                    result = (b.content if isinstance(b.content, str)
                              else "\n".join(_text(c, NOT_READ) for c in b.content or []))
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result}
                               | ({"name": names[b.tool_use_id]} if b.tool_use_id in names else {}))
                    if b.is_error and not result.startswith("Error"):
                        out[-1]["content"] = f"Error: {result}"
                else:
                    raise CachebackError(_refused(b.type, f"{m.role} messages"))
            if text or thought or calls or not m.content:
                msg = {"role": m.role, "content": "".join(text)}
                out.append(msg | ({"reasoning_content": "".join(thought)} if thought else {})
                           | ({"tool_calls": calls} if calls else {}))
        return out

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        """Anthropic's stop_sequences are the stop strings."""
        if isinstance(data, dict) and "stop_sequences" in data:
            data = {k: v for k, v in data.items() if k != "stop_sequences"} | {"stop": data["stop_sequences"]}
        return data


class MessagesRequest(Counted):
    max_tokens: int = Field(ge=1, le=TOKEN_LIMIT)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _formats(self):
        """Anthropic's structured output (`output_config.format`, the older `output_format`) as the
        response_format the other routes read."""
        fmt = (self.output_config or {}).get("format") or self.output_format
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ValueError('output format: give {"type": "json_schema", "schema": {...}}')
            self.response_format = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
        return self


# what a tool's result says in place of a picture or a document, for a model that reads text only
NOT_READ = {"image": "[an image, not shown: this model reads text only]",
            "document": "[a document, not shown: this model reads text only]"}


def _text(block: Block, instead: dict[str, str] | None = None) -> str:
    if block.type != "text":
        if block.type in (instead or {}):
            return instead[block.type]
        raise CachebackError(_refused(block.type, "a system prompt or a tool result"))
    return block.text or ""


def _refused(kind: str, where: str) -> str:
    if kind in ("image", "document"):
        return f"{kind} blocks are not supported: this server's models read text only"
    return f"content block type {kind!r} is not supported in {where}"


class Blocks:
    """One answer's content blocks as its text comes (thinking, text, tool_use), and the stream's
    events that build them."""

    def __init__(self, mind: Reasoning | None, split: ToolCalls | None):
        self.mind, self.split = mind, split
        self.content: list[dict] = []
        self.open = False  # the last block still takes deltas

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        events = []
        for kind, part in answer_parts(self.mind, self.split, piece, final):
            events += self._call(part) if kind == "call" else self._add(kind, part)
        return events + (self._close() if final else [])

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    def _add(self, kind: str, text: str) -> list[dict]:
        events = []
        if not (self.open and self.content[-1]["type"] == kind):
            events += self._close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            self.content.append(block)
            events.append({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)})
            self.open = True
        self.content[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def _call(self, call: dict) -> list[dict]:
        events = self._close()
        block = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "name": call["name"],
                 "input": call_arguments(call)}
        self.content.append(block)
        i = len(self.content) - 1
        arguments = json.dumps(block["input"], ensure_ascii=False)
        return events + [{"type": "content_block_start", "index": i, "content_block": block | {"input": {}}},
                         {"type": "content_block_delta", "index": i,
                          "delta": {"type": "input_json_delta", "partial_json": arguments}},
                         {"type": "content_block_stop", "index": i}]

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    session, gen = ctx.session, ctx.gen

    def encode(req: Counted) -> tuple[list[int], list[dict] | None]:
        tools = req.offered()
        ToolCalls.of(session.tokenizer, tools)  # a model without tool calls: 400 before anything runs
        ids = encode_text(session, "", chat=True, messages=template_messages(req.plain()), tools=tools,
                          template_args=req.template_args())
        return ids, tools

    def usage(job: Job, final: bool = True) -> dict:
        cached = job.timings.get("cache_n", 0) if final else 0
        return {"input_tokens": len(job.ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": job.timings.get("predicted_n", 0)}

    def stop(job: Job, blocks: Blocks) -> dict:
        full = len(job.ids) + job.timings.get("predicted_n", 0) >= session.loaded.context_length
        reason = ("stop_sequence" if job.stop_type == "word" else "model_context_window_exceeded" if full
                  else "max_tokens" if job.hit_max else "tool_use" if blocks.called else "end_turn")
        return {"stop_reason": reason, "stop_sequence": job.stop_word if reason == "stop_sequence" else None}

    @api.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        ids, tools = encode(req)
        fitted, cut = session.fit(ids, req.max_tokens)
        if cut:  # as Anthropic's API answers it, so that a client can shorten the conversation itself
            raise CachebackError(f"prompt is too long: {len(ids)} tokens > {len(fitted)} maximum (the model's "
                                 f"context of {session.loaded.context_length} tokens, less room for the reply)")
        job = Job(ids, req.max_tokens, req)
        gen.check(job)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": req.model or ctx.model_id}
        blocks = Blocks(Reasoning.of(session.tokenizer, job.ids), ToolCalls.of(session.tokenizer, tools))
        if not req.stream:
            runs = await gen.complete(request, job)
            if not runs:  # the client went away
                return JSONResponse({})
            blocks.feed(job.text, final=True)
            return JSONResponse(head | {"content": blocks.content} | stop(job, blocks) | {"usage": usage(job)})

        def event(piece: str, done: bool) -> list[dict]:
            out = blocks.feed(piece, final=done)
            if done:
                out += [{"type": "message_delta", "delta": stop(job, blocks), "usage": usage(job)},
                        {"type": "message_stop"}]
            return out

        async def events():
            start = head | {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(job, False)}
            yield _sse({"type": "message_start", "message": start})
            async for text in gen.stream(request, job, event, done_marker=False, frame=_sse):
                yield text

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(req: Counted):
        ids, _ = encode(req)
        return {"input_tokens": len(ids)}

    return api


def _sse(event: dict) -> str:
    """One event, named on its `event:` line as Anthropic's SDKs read it (the core's failure too)."""
    if "error" in event and "type" not in event:
        err = event["error"]
        kind = "invalid_request_error" if err.get("code") == 400 else "api_error"
        event = {"type": "error", "error": {"type": kind, "message": err.get("message", "")}}
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
