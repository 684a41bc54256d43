"""Ollama's protocol: /api/generate, /api/chat, /api/show, /api/tags, /api/ps, /api/version.

As Ollama's docs/api.md and Continue's Ollama provider use it: `stream` defaults to true (NDJSON
lines, `application/x-ndjson`; the last one has done=true, done_reason and the durations in ns),
sampling comes in `options` (num_predict: 0 only prefills, -1/-2 as many as fit; num_ctx and other
runner settings are ignored), any `model` name is accepted (one model is served) and echoed back.
Sampling defaults are greedy, as on the other routes, with no penalty (Ollama's own are temperature
0.8, top_k 40, repeat_penalty 1.1); `repeat_penalty`, `repeat_last_n` (64 by default),
`presence_penalty` and `frequency_penalty` in `options` apply as on the other routes (fields.Sampling).

/api/generate with `suffix` (even "") is fill-in-the-middle (prefix = prompt), in the prefix-only
layout on models without FIM tokens (the final object then says `"fim": false`); without it, `raw`
sends the prompt as is, else the chat template makes it one user message (after `system`). An
empty prompt (or no messages on /api/chat) only "loads" the model, as Ollama answers it.

/api/show advertises `insert` (suffix support) always, `num_ctx` in `parameters` and a `template`
that mentions `.Suffix`: Continue reads the context length from the former and turns FIM on only
when the template has `.Suffix` (its test for FIM support); `tools` where the chat template has
tool calls (clients offer tools only to such models). The model's own Jinja chat template is
in model_info["tokenizer.chat_template"], where GGUF files keep it. Errors are Ollama's
`{"error": "message"}` (request validation errors keep the app-wide shape).

/api/chat takes `tools` as Ollama does (OpenAI's function schemas) and answers the model's calls in
`message.tool_calls` (arguments as objects); messages may carry the assistant's calls and "tool"
messages with their results (tool_calls.py). A thinking model's reasoning comes back apart, in
`message.thinking` (/api/generate: `thinking`); `think: false` asks the template for none
(enable_thinking), `think: true` for it (../reasoning.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2.exceptions import TemplateError
from mlx.utils import tree_flatten
from pydantic import Field, field_validator, model_validator

from ..errors import CachebackError
from ..reasoning import Reasoning
from .core import Context, Job, encode_text
from .fields import Lenient, Sampling
from .logprobs import TOP_MAX, ollama
from .tool_calls import Tool, ToolCall, ToolCalls, as_dicts, ollama_calls, template_messages

VERSION = "0.6.0"  # the Ollama API version these routes follow


class Options(Sampling):
    num_predict: int | None = Field(None, ge=-2)  # -1: until EOS, -2: fill the context (both: as many as fit)

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data):
        """Clients send unset options as null: treat those as absent."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class OllamaRequest(Lenient):
    model: str = ""
    stream: bool = True
    options: Options = Options()
    keep_alive: int | float | str | None = None
    images: list[str] | None = None
    logprobs: bool = False  # Ollama has these two beside `options`
    top_logprobs: int | None = Field(None, ge=0, le=TOP_MAX)
    think: bool | None = None  # a thinking model: think first (the template's enable_thinking)
    format: str | dict[str, Any] | None = None  # structured output: "json", or a JSON schema

    @field_validator("format")
    @classmethod
    def _format(cls, value):
        if isinstance(value, str) and value not in ("", "json"):
            raise ValueError('give "json" or a JSON schema')
        return value

    def template_args(self) -> dict | None:
        return None if self.think is None else {"enable_thinking": self.think}

    def sampling(self) -> Options:
        """The options, with the request's log-probability and format fields."""
        update = {"logprobs": True, "top_logprobs": self.top_logprobs} if self.logprobs else {}
        if self.format == "json":
            update["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            update["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.format}}
        return self.options.model_copy(update=update) if update else self.options

    def limit(self, ctx: Context) -> int:
        n = self.options.num_predict
        return ctx.max_tokens(-1 if n is None or n < 0 else n, -1)  # -1 / -2: until EOS or the context ends


class GenerateRequest(OllamaRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None  # deprecated in Ollama; ignored here


class Message(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_name: str | None = None  # a tool's result: the tool that gave it

    def plain(self) -> dict:
        out = {"role": self.role, "content": self.content or ""}
        extra = {"tool_calls": as_dicts(self.tool_calls), "name": self.tool_name}
        return out | {k: v for k, v in extra.items() if v is not None}


class ChatRequest(OllamaRequest):
    messages: list[Message] = []
    tools: list[Tool] | None = None

    def offered(self) -> list[dict] | None:
        return as_dicts(self.tools) or None


class ShowRequest(Lenient):
    model: str = ""
    name: str = ""  # the older spelling (Continue sends it)


def oerror(status: int, message: str) -> JSONResponse:
    """Ollama's error shape."""
    return JSONResponse({"error": message}, status_code=status)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def router(ctx: Context) -> APIRouter:
    api = APIRouter()
    session, loaded = ctx.session, ctx.session.loaded
    source = str(loaded.source)  # the file or folder loaded
    tool_calling = bool(getattr(session.tokenizer, "has_tool_calling", False))  # clients look for "tools"

    def tag() -> str:
        return ctx.model_id if ":" in ctx.model_id else f"{ctx.model_id}:latest"

    def arch() -> str:
        return str(getattr(loaded.model, "model_type", None) or "llama")

    def parameters() -> int:
        return sum(v.size for _, v in tree_flatten(loaded.model.parameters()))

    def details() -> dict:
        n = parameters()
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
        quant = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(loaded.dtype, loaded.dtype.upper())
        fmt = "gguf" if source.lower().endswith(".gguf") else "safetensors"  # Ollama's names
        return {"parent_model": "", "format": fmt, "family": arch(), "families": [arch()],
                "parameter_size": size, "quantization_level": quant}

    def on_disk() -> tuple[int, str, str]:
        """Size, a stable digest (of path, size and time: hashing the weights would take seconds),
        modification time."""
        try:
            path = Path(source)
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
            size, mtime = sum(f.stat().st_size for f in files), path.stat().st_mtime
        except OSError:
            size, mtime = 0, 0.0
        digest = hashlib.sha256(f"{source}:{size}:{mtime}".encode()).hexdigest()
        return size, digest, datetime.fromtimestamp(mtime, timezone.utc).isoformat()

    def listing() -> dict:
        size, digest, modified = on_disk()
        return {"name": tag(), "model": tag(), "modified_at": modified, "size": size, "digest": digest,
                "details": details()}

    def go_template() -> str:
        """What Ollama's template would say about our prompt layout (clients look for `.Suffix`)."""
        fim = loaded.fim
        infill = (f"{fim['prefix']}{{{{ .Prompt }}}}{fim['suffix']}{{{{ .Suffix }}}}{fim['middle']}" if fim
                  else "{{ .Prompt }}")  # prefix-only completion on models without FIM tokens
        return f"{{{{- if .Suffix }}}}{infill}{{{{- else }}}}{{{{ .Prompt }}}}{{{{- end }}}}"

    def final(job: Job, started: int, fim: bool | None) -> dict:
        t = job.timings
        out = {"done": True, "done_reason": job.finish_reason, "total_duration": time.perf_counter_ns() - started,
               "load_duration": 0, "prompt_eval_count": t.get("prompt_n", 0),
               "prompt_eval_duration": int(1e6 * t.get("prompt_ms", 0.0)), "eval_count": t.get("predicted_n", 0),
               "eval_duration": int(1e6 * t.get("predicted_ms", 0.0))}
        return out if fim is None else out | {"fim": fim}

    def ndjson(obj: dict) -> str:
        """The core stream's objects as NDJSON lines (errors as Ollama's {"error": "..."})."""
        if "error" in obj and isinstance(obj["error"], dict):
            obj = {"error": obj["error"].get("message", "")}
        return json.dumps(obj) + "\n"

    async def answer(request: Request, req: OllamaRequest, job: Job, started: int, chat: bool, fim: bool | None = None,
                     tools: list[dict] | None = None, thinks: bool = False):
        """`thinks`: a generate request through the chat template, whose reasoning comes apart too."""
        model = req.model or tag()
        split = ToolCalls.of(session.tokenizer, tools)
        mind = Reasoning.of(session.tokenizer, job.ids) if chat or thinks else None

        def message(piece: str, done: bool) -> dict:
            calls = []
            if split is not None:
                piece, calls = split.feed(piece, final=done)
            return {"role": "assistant", "content": piece} | ({"tool_calls": ollama_calls(calls)} if calls else {})

        def line(piece: str, done: bool, entries: list[dict] | None = None) -> dict:
            thought = ""
            if mind is not None:
                thought, piece = mind.feed(piece, final=done)
            thinking = {"thinking": thought} if thought else {}
            body = {"message": message(piece, done) | thinking} if chat else {"response": piece} | thinking
            out = {"model": model, "created_at": now()} | body
            if job.log is not None:
                out["logprobs"] = ollama(job.log.take() if entries is None else entries)
            return out | final(job, started, fim) if done else out | {"done": False}

        if req.stream:
            return StreamingResponse(ctx.gen.stream(request, job, line, done_marker=False, frame=ndjson),
                                     media_type="application/x-ndjson")
        runs = await ctx.gen.complete(request, job)
        if not runs:  # the client went away
            return JSONResponse({})
        return JSONResponse(line(job.text, True, job.log.shown if job.log else None))

    def loaded_only(req: OllamaRequest, chat: bool) -> JSONResponse:
        """An empty prompt: Ollama's answer to a load (or, with keep_alive 0, unload) request."""
        unload = str(req.keep_alive).strip() in ("0", "0s", "0m", "0h", "0.0")
        body = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return JSONResponse({"model": req.model or tag(), "created_at": now()} | body |
                            {"done": True, "done_reason": "unload" if unload else "load"})

    @api.post("/api/generate")
    async def generate(req: GenerateRequest, request: Request):
        started = time.perf_counter_ns()
        if req.images:
            return oerror(400, f"{ctx.model_id} does not accept images")
        if req.raw and (req.template or req.system or req.context):
            return oerror(400, "raw mode does not support template, system, or context")
        fim, templated = None, False
        try:
            if req.suffix is not None and (req.prompt or req.suffix):
                job, fim = ctx.infill_job(req.sampling(), req.prompt, req.suffix, [], "", req.limit(ctx))
            elif not req.prompt:
                return loaded_only(req, chat=False)
            else:
                templated = not req.raw and bool(getattr(session.tokenizer, "chat_template", None))
                if templated:
                    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
                               [{"role": "user", "content": req.prompt}]
                    ids = encode_text(session, "", chat=True, messages=messages, template_args=req.template_args())
                else:
                    ids = encode_text(session, req.prompt)
                job = Job(ids, req.limit(ctx), req.sampling())
                ctx.gen.check(job)
        except (CachebackError, TemplateError) as e:
            return oerror(400, str(e))
        return await answer(request, req, job, started, chat=False, fim=fim, thinks=templated)

    @api.post("/api/chat")
    async def chat(req: ChatRequest, request: Request):
        started = time.perf_counter_ns()
        if req.images or any(m.images for m in req.messages):
            return oerror(400, f"{ctx.model_id} does not accept images")
        if not req.messages:
            return loaded_only(req, chat=True)
        messages = template_messages([m.plain() for m in req.messages])
        try:
            ToolCalls.of(session.tokenizer, req.offered())
            ids = encode_text(session, "", chat=True, messages=messages, tools=req.offered(),
                              template_args=req.template_args())
            job = Job(ids, req.limit(ctx), req.sampling())
            ctx.gen.check(job)
        except (CachebackError, TemplateError) as e:
            return oerror(400, str(e))
        return await answer(request, req, job, started, chat=True, tools=req.offered())

    @api.post("/api/show")
    async def show(req: ShowRequest):
        if not (req.model or req.name):
            return oerror(400, "model is required")
        _, _, modified = on_disk()
        info = {"general.architecture": arch(), "general.basename": ctx.model_id,
                "general.parameter_count": parameters(),
                f"{arch()}.context_length": loaded.context_length,
                "tokenizer.chat_template": getattr(session.tokenizer, "chat_template", None) or ""}
        return {"license": "", "system": "", "modified_at": modified,
                "modelfile": f"# Modelfile of cacheback-mlx\nFROM {source}\n"
                             f"PARAMETER num_ctx {loaded.context_length}\n",
                "parameters": f"{'num_ctx':<30} {loaded.context_length}", "template": go_template(),
                "details": details(), "model_info": info,
                "capabilities": ["completion", "insert"] + (["tools"] if tool_calling else [])}

    @api.get("/api/tags")
    def tags():
        return {"models": [listing()]}

    @api.get("/api/ps")
    def ps():
        entry = listing()
        expires = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
        return {"models": [entry | {"expires_at": expires, "size_vram": entry["size"],
                                    "context_length": loaded.context_length}]}

    @api.get("/api/version")
    def version():
        return {"version": VERSION}

    return api
