"""OpenAI's Responses protocol: /v1/responses, as OpenAI's newer clients and agents (the Agents SDK,
Codex) speak it, stateless: every request carries its whole conversation.

`instructions` and `input` (a string, or items: messages with text parts, the assistant's
`function_call`s and their `function_call_output`s) go to the model's chat template as the chat
route's messages do, with `tools` (function tools; `tool_choice` "auto" or "none"). The answer's
output items are the model's reasoning (a `reasoning` item with its text, reasoning.py), its text
(a `message` with one `output_text` part) and each call it writes (a `function_call`,
tool_calls.py); status "incomplete" with reason max_output_tokens when the token limit or the
context's end cut it. Streamed, the events are the protocol's (response.created, output items
added and done, text and arguments deltas, response.completed or response.incomplete), each
numbered and named on its `event:` line. `text.format` (json_object, json_schema) keeps the answer
to it (constrained.py); `reasoning.effort` reaches the template (`reasoning_effort`, and
`enable_thinking` false for "none" or "minimal"). Refused with a one-line 400: stored state
(`previous_response_id`, item references), images and files (in a function's output each is a
line saying it is not shown, so an agent's conversation can go on), tools other than functions, a
call the model must make. A prompt that leaves the reply too little of the context is refused, never
cut. Decoding is greedy unless the request gives a `temperature`, as on every route here.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ..errors import CachebackError
from ..reasoning import Reasoning
from .core import Context, Job, encode_text
from .fields import TOKEN_LIMIT, Lenient, Sampling
from .tool_calls import ToolCalls, answer_parts, call_arguments, check_choice, template_messages

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class Part(Lenient):
    type: str
    text: str | None = None


class Item(Lenient):
    """One input item: a message, a function call, its output (others are refused)."""

    type: str | None = None  # "message" when absent
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class FunctionTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(Sampling):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=TOKEN_LIMIT)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool = True

    def offered(self) -> list[dict] | None:
        """The function tools as chat templates read them; none with tool_choice "none"."""
        if not check_choice(self.tool_choice) or not self.tools:
            return None
        for t in self.tools:
            if t.type != "function" or not t.name:
                raise CachebackError(f"tool type {t.type!r}: only function tools with a name are supported here")
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.parameters or {"type": "object", "properties": {}}}}
                for t in self.tools]

    def template_args(self) -> dict | None:
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return None
        return {"reasoning_effort": effort, "enable_thinking": effort not in ("none", "minimal")}

    def structure(self) -> str | None:
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            self.response_format = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        elif isinstance(fmt, dict):
            self.response_format = {"type": fmt.get("type", "text")}
        elif fmt is not None:
            raise CachebackError('text.format: give {"type": "text"}, {"type": "json_object"} or '
                                 '{"type": "json_schema", "schema": {...}}')
        return super().structure()

    def plain(self) -> list[dict]:
        """The conversation as chat templates read them (OpenAI chat messages)."""
        if self.previous_response_id:
            raise CachebackError("previous_response_id is not supported: responses are not stored here, so send the "
                                 "whole conversation as input")
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id -> the function's name
        for item in self.input:
            kind = item.type or "message"
            if kind == "message" and item.role:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": _text(item.content)})
            elif kind == "function_call" and item.call_id and item.name:
                names[item.call_id] = item.name
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output" and item.call_id:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, NOT_READ)}
                           | ({"name": names[item.call_id]} if item.call_id in names else {}))
            elif kind == "reasoning":
                continue  # earlier turns' reasoning: chat templates leave it out
            elif kind == "item_reference":
                raise CachebackError("item references are not supported: responses are not stored here")
            else:
                raise CachebackError(f"input item of type {kind!r} is not supported here (or lacks its role, "
                                     "call_id or name)")
        return out


# what a function's output says in place of a picture or a file, for a model that reads text only
NOT_READ = {"input_image": "[an image, not shown: this model reads text only]",
            "input_file": "[a file, not shown: this model reads text only]"}


def _text(content: str | list[Part] | None, instead: dict[str, str] | None = None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for p in content:
        if p.type not in TEXT_PARTS and p.type not in (instead or {}):
            raise CachebackError(f"content part {p.type!r} is not supported: this server's models read text only")
    parts = [(p.text or "") if p.type in TEXT_PARTS else instead[p.type] for p in content]
    return "".join(parts) if all(p.type in TEXT_PARTS for p in content) else "\n".join(x for x in parts if x)


class Items:
    """One answer's output items as its text comes (reasoning, message, function_call), and the
    stream's events that build them."""

    def __init__(self, mind: Reasoning | None, split: ToolCalls | None):
        self.mind, self.split = mind, split
        self.output: list[dict] = []
        self.open = False  # the last item still takes deltas

    def feed(self, piece: str, final: bool = False, status: str = "completed") -> list[dict]:
        events = []
        for kind, part in answer_parts(self.mind, self.split, piece, final):
            events += self._call(part) if kind == "call" else self._add(kind, part)
        return events + (self._close(status) if final else [])

    def _add(self, kind: str, text: str) -> list[dict]:
        item_type, part_type = ("reasoning", "reasoning_text") if kind == "thinking" else ("message", "output_text")
        events = []
        if not (self.open and self.output[-1]["type"] == item_type):
            events += self._close()
            key = uuid.uuid4().hex[:24]
            item = ({"type": "reasoning", "id": f"rs_{key}", "summary": []} if item_type == "reasoning"
                    else {"type": "message", "id": f"msg_{key}", "role": "assistant"})
            self.output.append(item | {"status": "in_progress", "content": []})
            self.open = True
            part = {"type": part_type, "text": ""} | ({"annotations": [], "logprobs": []} if kind == "text" else {})
            events += [{"type": "response.output_item.added", "output_index": self._index, "item": _copy(self._item)},
                       {"type": "response.content_part.added", **self._where, "part": dict(part)}]
            self._item["content"].append(part)
        self._item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "thinking" else "response.output_text.delta"
        return events + [{"type": delta, **self._where, "delta": text} | ({"logprobs": []} if kind == "text" else {})]

    def _call(self, call: dict) -> list[dict]:
        events = self._close()
        arguments = json.dumps(call_arguments(call), ensure_ascii=False)
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                "call_id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "name": call["name"],
                "arguments": arguments, "status": "completed"}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": self._index}
        return events + [
            {"type": "response.output_item.added", "output_index": self._index,
             "item": item | {"arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {"type": "response.function_call_arguments.done", **where, "name": item["name"], "arguments": arguments},
            {"type": "response.output_item.done", "output_index": self._index, "item": _copy(item)}]

    def _close(self, status: str = "completed") -> list[dict]:
        if not self.open:
            return []
        self.open = False
        item, part = self._item, self._item["content"][0]
        item["status"] = status
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        return [{"type": done, **self._where, "text": part["text"]} | ({"logprobs": []} if "logprobs" in part else {}),
                {"type": "response.content_part.done", **self._where, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": self._index, "item": _copy(item)}]

    @property
    def _item(self) -> dict:
        return self.output[-1]

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    @property
    def _where(self) -> dict:
        return {"item_id": self._item["id"], "output_index": self._index, "content_index": 0}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    session, gen = ctx.session, ctx.gen

    def usage(job: Job) -> dict:
        n = job.timings.get("predicted_n", 0)
        return {"input_tokens": len(job.ids), "output_tokens": n, "total_tokens": len(job.ids) + n,
                "input_tokens_details": {"cached_tokens": job.timings.get("cache_n", 0), "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        tools = req.offered()
        ToolCalls.of(session.tokenizer, tools)  # a model without tool calls: 400 before anything runs
        ids = encode_text(session, "", chat=True, messages=template_messages(req.plain()), tools=tools,
                          template_args=req.template_args())
        limit = ctx.max_tokens(req.max_output_tokens, session.loaded.context_length)  # none: as many as fit
        fitted, cut = session.fit(ids, 1 if req.max_output_tokens is None else limit)
        if cut:
            raise CachebackError(f"input exceeds the context window (context_length_exceeded): {len(ids)} tokens > "
                                 f"{len(fitted)} maximum, room for the reply kept")
        job = Job(ids, limit, req)
        gen.check(job)
        items = Items(Reasoning.of(session.tokenizer, job.ids), ToolCalls.of(session.tokenizer, tools))
        head = {"id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response", "created_at": int(time.time()),
                "model": req.model or ctx.model_id, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
                "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning, "store": False,
                "previous_response_id": None, "error": None, "metadata": {}}

        def whole(status: str) -> dict:
            done = status != "in_progress"
            short = done and job.hit_max
            return head | {"status": "incomplete" if short else status, "output": items.output if done else [],
                           "incomplete_details": {"reason": "max_output_tokens"} if short else None,
                           "usage": usage(job) if done else None}

        if not req.stream:
            runs = await gen.complete(request, job)
            if not runs:  # the client went away
                return JSONResponse({})
            items.feed(job.text, final=True, status="incomplete" if job.hit_max else "completed")
            return JSONResponse(whole("completed"))

        def event(piece: str, done: bool) -> list[dict]:
            out = items.feed(piece, final=done, status="incomplete" if done and job.hit_max else "completed")
            if done:
                final = whole("completed")
                out.append({"type": f"response.{final['status']}", "response": final})
            return out

        numbered = itertools.count()

        def frame(event: dict) -> str:
            """One event, numbered and named on its `event:` line (the core's failure as an error event)."""
            if "error" in event and "type" not in event:
                err = event["error"]
                event = {"type": "error", "code": str(err.get("code", "")), "message": err.get("message", ""),
                         "param": None}
            event = event | {"sequence_number": next(numbered)}
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        async def events():
            yield frame({"type": "response.created", "response": whole("in_progress")})
            yield frame({"type": "response.in_progress", "response": whole("in_progress")})
            async for text in gen.stream(request, job, event, done_marker=False, frame=frame):
                yield text

        return StreamingResponse(events(), media_type="text/event-stream")

    return api
