"""OpenAI's protocol: /v1/models, /v1/completions (with `suffix` for fill-in-the-middle),
/v1/chat/completions, and Mistral's /v1/fim/completions (Continue's FIM providers post there).

llama.cpp's extensions that editors send on these routes are honoured too: `n_predict` (0 on chat is
llama.vim's warm-up: prefill the messages and answer with an empty message), `t_max_predict_ms`.
A stream's last chunk carries the usage (as llama.cpp's did, and clients that never ask for it read
it there); with `stream_options: {"include_usage": true}` the usage comes in a chunk of its own
after it, with no choices, as OpenAI's protocol says.

Chat requests may offer `tools` (with `tool_choice` "auto" or "none"); the model's calls come back
as `tool_calls` with finish_reason "tool_calls", and the conversation may carry the assistant's
calls and "tool" messages with their results (tool_calls.py). A thinking model's reasoning comes
back apart, as `reasoning_content` and `reasoning` (../reasoning.py); `chat_template_kwargs` (e.g.
{"enable_thinking": false}) go to the chat template.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ..reasoning import Reasoning
from .core import Context, Job, encode_text
from .fields import TOKEN_LIMIT, Lenient, Sampling
from .logprobs import openai_chat, openai_text
from .tool_calls import Tool, ToolCall, ToolCalls, as_dicts, check_choice, openai_calls, template_messages


class StreamOptions(Lenient):
    include_usage: bool = False


class OpenAIParams(Sampling):
    WINDOW = 20  # mlx-lm's server's repetition_context_size by default
    model: str | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0, le=TOKEN_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=0, le=TOKEN_LIMIT)
    n_predict: int | None = Field(None, ge=-1, le=TOKEN_LIMIT)  # llama.cpp's name
    n: int = Field(1, ge=1, le=16)
    t_max_predict_ms: float | None = Field(None, ge=0)

    def limit(self, ctx: Context, default: int) -> int:
        n = next((v for v in (self.n_predict, self.max_completion_tokens, self.max_tokens) if v is not None), None)
        return ctx.max_tokens(n, default)


class CompletionRequest(OpenAIParams):
    prompt: str
    suffix: str | None = None


class FimRequest(OpenAIParams):
    prompt: str
    suffix: str = ""


class Part(Lenient):
    type: str = "text"
    text: str = ""


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = ""
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None

    def plain(self) -> dict:
        text = (self.content if isinstance(self.content, str)
                else "".join(p.text for p in self.content or [] if p.type == "text"))
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        extra = {"tool_calls": as_dicts(self.tool_calls), "tool_call_id": self.tool_call_id, "name": self.name}
        return out | {k: v for k, v in extra.items() if v is not None}


class ChatRequest(OpenAIParams):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's other variables (vLLM's, llama.cpp's)

    def offered(self) -> list[dict] | None:
        """The tools the model sees (none with tool_choice "none")."""
        return as_dicts(self.tools) if check_choice(self.tool_choice) and self.tools else None


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    session, gen = ctx.session, ctx.gen

    def usage(job: Job) -> dict:
        n = job.timings.get("predicted_n", 0)
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
                "prompt_tokens_details": {"cached_tokens": job.timings.get("cache_n", 0)}}

    async def answer(request: Request, req: OpenAIParams, job: Job, kind: str, extra: dict | None = None,
                     tools: list[dict] | None = None):
        rid, created = f"{'chatcmpl' if kind != 'text' else 'cmpl'}-{uuid.uuid4().hex[:12]}", int(time.time())
        head = {"id": rid, "created": created, "model": ctx.model_id}
        streamed = ToolCalls.of(session.tokenizer, tools)  # the stream's calls, split as its text comes
        chat = isinstance(req, ChatRequest)  # (not Mistral's FIM route, whose answers are chat-shaped too)
        thinks = Reasoning.of(session.tokenizer, job.ids) if chat else None  # the stream's reasoning, split
        offset = [0]  # where a stream's next text starts (the completions route's text_offset)

        def logprobs(run: Job, stream: bool, text: str) -> dict | None:
            """The choice's log-probabilities (None when not asked for): a stream's chunk has its own."""
            if run.log is None:
                return None
            entries = run.log.take() if stream else run.log.shown
            if kind != "text":
                return openai_chat(entries)
            out = openai_text(entries, offset[0])
            offset[0] += len(text) if stream else 0
            return out

        def choice(text: str, index: int, done: bool, run: Job, stream: bool) -> dict:
            reason = run.finish_reason if done else None
            if kind == "text":
                return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs(run, stream, text)}
            lp = {"logprobs": logprobs(run, stream, text)} if run.log is not None else {}
            thought, mind = "", thinks if stream else (Reasoning.of(session.tokenizer, run.ids) if chat else None)
            if mind is not None:
                thought, text = mind.feed(text, final=done)
            reasoning = {"reasoning_content": thought, "reasoning": thought} if thought else {}
            split = streamed if stream else ToolCalls.of(session.tokenizer, tools)
            calls = []
            if split is not None:
                text, calls = split.feed(text, final=done)
                if done and split.made and reason == "stop":
                    reason = "tool_calls"
            if stream:
                delta = reasoning | ({"content": text} if text else {}) | (
                    {"tool_calls": openai_calls(calls, split.made - len(calls), stream=True)} if calls else {})
                return {"index": index, "delta": delta, "finish_reason": reason} | lp
            message = {"role": "assistant", "content": (text if text.strip() else None) if calls else text} | reasoning
            return {"index": index, "message": message | ({"tool_calls": openai_calls(calls)} if calls else {}),
                    "finish_reason": reason} | lp

        obj = "text_completion" if kind == "text" else "chat.completion"
        if req.stream and job.max_tokens:
            chunk = obj if kind == "text" else "chat.completion.chunk"

            def event(piece: str, done: bool) -> dict | list[dict]:
                out = head | {"object": chunk, "choices": [choice(piece, 0, done, job, True)]}
                if not done:
                    return out
                stats = {"usage": usage(job), "timings": job.timings} | (extra or {})
                if req.stream_options is not None and req.stream_options.include_usage:
                    return [out, head | {"object": chunk, "choices": []} | stats]
                return out | stats

            return StreamingResponse(gen.stream(request, job, event, done_marker=True), media_type="text/event-stream")
        runs = await gen.complete(request, job, req.n)
        if not runs:
            return JSONResponse({})
        out = head | {"object": obj, "choices": [choice(r.text, i, True, r, False) for i, r in enumerate(runs)],
                      "usage": usage(job), "timings": job.timings}
        return JSONResponse(out | (extra or {}))

    @api.get("/v1/models")
    def models():
        """OpenAI's list, with the fields Anthropic's model list has beside them (its clients ask here too)."""
        model = {"id": ctx.model_id, "object": "model", "owned_by": "cacheback-mlx", "created": 0,
                 "meta": {"n_ctx_train": session.loaded.context_length},
                 "type": "model", "display_name": ctx.model_id, "created_at": "1970-01-01T00:00:00Z"}
        return {"object": "list", "data": [model], "has_more": False, "first_id": ctx.model_id,
                "last_id": ctx.model_id}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if req.suffix is not None:
            job, fim = ctx.infill_job(req, req.prompt, req.suffix, [], "", req.limit(ctx, 128),
                                      t_max_predict_ms=req.t_max_predict_ms)
            return await answer(request, req, job, "text", {"fim": fim})
        job = Job(encode_text(session, req.prompt), req.limit(ctx, 128), req, t_max_predict_ms=req.t_max_predict_ms)
        gen.check(job)
        return await answer(request, req, job, "text")

    @api.post("/v1/fim/completions")
    async def fim_completions(req: FimRequest, request: Request):
        job, fim = ctx.infill_job(req, req.prompt, req.suffix, [], "", req.limit(ctx, 128),
                                  t_max_predict_ms=req.t_max_predict_ms)
        return await answer(request, req, job, "chat", {"fim": fim})

    @api.post("/v1/chat/completions")
    @api.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        tools = req.offered()
        ToolCalls.of(session.tokenizer, tools)  # a model without tool calls: 400 before anything runs
        ids = encode_text(session, "", chat=True, messages=template_messages([m.plain() for m in req.messages]),
                          tools=tools, template_args=req.chat_template_kwargs)
        job = Job(ids, req.limit(ctx, 512), req, t_max_predict_ms=req.t_max_predict_ms)
        gen.check(job)
        return await answer(request, req, job, "chat", tools=tools)

    return api
