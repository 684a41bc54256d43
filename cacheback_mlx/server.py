"""`cacheback-mlx serve`: a completion server for editors and OpenAI-style clients.

Speaks llama.cpp's /infill and /completion (llama.vim, llama.vscode, Continue, Tabby) and OpenAI's
/v1/completions (with `suffix` for fill-in-the-middle), /v1/chat/completions and /v1/models, plus
/health. One Session serves every request, so the KV prefix and the drafter's tables carry over
from request to request (repeated completions in one file get faster). One request runs on the
model at a time; the others wait their turn (an asyncio lock held for the whole generation, so a
waiting request never blocks the model's worker thread). A streaming client that disconnects stops
its generation at the next step. Bad input gets a 4xx with a JSON error, never a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Iterator, Literal

import anyio
import mlx.core as mx

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .api import Session
from .errors import CachebackError
from .fim import fim_prompt
from .sampling import SamplingParams

MAX_TOKENS = 4096


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # editors send many fields we do not use


class Sampling(Lenient):
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False


class InfillRequest(Sampling):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, str]] = []
    prompt: str = ""
    n_predict: int = Field(128, ge=0, le=MAX_TOKENS)


class CompletionRequest(Sampling):
    prompt: str
    n_predict: int = Field(128, ge=0, le=MAX_TOKENS)


class OpenAICompletionRequest(Sampling):
    model: str | None = None
    prompt: str
    suffix: str | None = None
    max_tokens: int = Field(128, ge=1, le=MAX_TOKENS)


class Message(Lenient):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(512, ge=1, le=MAX_TOKENS)


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class Generator:
    """Runs generations one at a time on the shared Session, step by step, all on ONE worker
    thread (MLX arrays and streams belong to the thread that made them). `turn` is held by the
    request handler for a whole generation: waiting requests wait on the event loop, never on
    the worker, so a suspended stream cannot starve the one thread that would resume it."""

    def __init__(self, session: Session):
        self.session = session
        self.turn = asyncio.Lock()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def close(self):
        """Free the worker's MLX streams before the thread ends: MLX needs this from any thread
        that ran it, or the process may abort at exit ("terminate called ...", exit 134)."""
        async with self.turn:
            await self.call(mx.clear_streams)
        self.worker.shutdown(wait=True)

    def steps(self, ids: list[int], max_tokens: int, req: Sampling) -> Iterator[tuple[str, bool]]:
        """(text piece, finished) per step, with stop strings applied; call it holding `turn`."""
        stops = [req.stop] if isinstance(req.stop, str) else [s for s in req.stop or [] if s]
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        text, sent = "", 0
        for piece, _ in self.session.stream_ids(ids, max_tokens, sampling):
            text += piece
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                yield text[sent:cut], True
                return
            keep = max((len(s) - 1 for s in stops), default=0)  # hold back a possible stop prefix
            safe = max(len(text) - keep, sent)
            if safe > sent:
                yield text[sent:safe], False
                sent = safe
        yield text[sent:], True

    def timings(self, prompt_tokens: int) -> dict:
        s = self.session.stats
        return {"prompt_n": s.prefill_tokens, "prompt_ms": 1e3 * s.prefill_s, "predicted_n": s.tokens,
                "predicted_ms": 1e3 * s.decode_s, "predicted_per_second": s.tokens_per_s,
                "cache_n": prompt_tokens - 1 - s.prefill_tokens, "draft_n": s.drafted,
                "draft_n_accepted": max(s.accepted - s.passes, 0), "passes": s.passes, "mat": round(s.mat, 3)}


def create_app(session: Session, api_key: str | None = None, max_body: int = 1 << 20) -> FastAPI:
    gen = Generator(session)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await gen.close()

    app = FastAPI(title="cacheback-mlx", version="0.1.0", lifespan=lifespan)
    model_id = session.loaded.name

    @app.middleware("http")
    async def limits(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body):
            return error(413, f"request body over {max_body} bytes")
        if api_key and request.url.path not in ("/health",) and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(CachebackError)
    async def user_error(request: Request, exc: CachebackError):
        return error(400, str(exc))

    def encode(text: str, chat: bool = False, messages=None) -> list[int]:
        ids = session.encode(messages if messages is not None else text, chat=chat) if (text or messages) else []
        if not ids:
            raise CachebackError("empty prompt")
        if len(ids) >= session.loaded.context_length:
            raise CachebackError(f"prompt of {len(ids)} tokens does not fit the context of {session.loaded.context_length}")
        return ids

    async def run(request: Request, ids, max_tokens, req: Sampling, shape):
        """Non-streaming: the whole text; streaming: server-sent events, cancelled on disconnect."""
        if max_tokens == 0:
            return JSONResponse(shape("", True, None) | {"timings": {}})
        if not req.stream:
            async with gen.turn:
                text = await gen.call(lambda: "".join(p for p, _ in gen.steps(ids, max_tokens, req)))
                return JSONResponse(shape(text, True, gen.timings(len(ids))))

        async def events():
            async with gen.turn:
                it = gen.steps(ids, max_tokens, req)
                try:
                    while True:
                        item = await gen.call(next, it, None)
                        if item is None or await request.is_disconnected():
                            break
                        piece, done = item
                        yield f"data: {json.dumps(shape(piece, done, gen.timings(len(ids)) if done else None))}\n\n"
                        if done:
                            break
                except Exception as e:  # the response has started: report in the stream, then end it
                    yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
                finally:
                    with anyio.CancelScope(shield=True):  # a disconnect cancels us: still end the generation
                        await gen.call(it.close)
            if shape is not llama_shape:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def llama_shape(text, done, timings):
        out: dict[str, Any] = {"content": text, "stop": done, "model": model_id}
        if done:
            out.update(tokens_predicted=(timings or {}).get("predicted_n", 0), timings=timings or {},
                       truncated=False, tokens_cached=(timings or {}).get("cache_n", 0))
        return out

    @app.get("/health")
    def health():
        return {"status": "ok", "model": model_id, "drafter": session.drafter_name}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "cacheback-mlx",
                                            "created": 0}]}

    @app.post("/infill")
    async def infill(req: InfillRequest, request: Request):
        text = fim_prompt(session.loaded.fim, req.input_prefix, req.input_suffix, req.input_extra, req.prompt)
        ids = list(session.tokenizer.encode(text, add_special_tokens=False))
        return await run(request, ids, req.n_predict, req, llama_shape)

    @app.post("/completion")
    async def completion(req: CompletionRequest, request: Request):
        return await run(request, encode(req.prompt), req.n_predict, req, llama_shape)

    @app.post("/v1/completions")
    async def v1_completions(req: OpenAICompletionRequest, request: Request):
        if req.suffix is not None:
            text = fim_prompt(session.loaded.fim, req.prompt, req.suffix)
            ids = list(session.tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = encode(req.prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())

        def shape(text, done, timings):
            out = {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                   "choices": [{"index": 0, "text": text, "finish_reason": "stop" if done else None, "logprobs": None}]}
            if done and timings is not None:
                out["usage"] = {"prompt_tokens": len(ids), "completion_tokens": timings["predicted_n"],
                                "total_tokens": len(ids) + timings["predicted_n"]}
                out["timings"] = timings
            return out

        return await run(request, ids, req.max_tokens, req, shape)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        ids = encode("", chat=True, messages=[m.model_dump() for m in req.messages])
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())

        def shape(text, done, timings):
            if req.stream:
                choice = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": "stop" if done else None}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                        "choices": [choice]}
            out = {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
            if timings is not None:
                out["usage"] = {"prompt_tokens": len(ids), "completion_tokens": timings["predicted_n"],
                                "total_tokens": len(ids) + timings["predicted_n"]}
                out["timings"] = timings
            return out

        return await run(request, ids, req.max_tokens, req, shape)

    return app


def serve(session: Session, host: str = "127.0.0.1", port: int = 8012, api_key: str | None = None, max_body: int = 1 << 20):
    import uvicorn

    uvicorn.run(create_app(session, api_key, max_body), host=host, port=port, log_level="warning")
