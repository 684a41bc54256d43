"""`cacheback-mlx serve`: a completion server for editors and OpenAI-style clients.

One file per protocol over one shared core (core.py: request fields, errors, the body guard,
generation jobs): llama.cpp's /infill and /completion (llama_cpp.py), OpenAI's /v1/* and Mistral's
/v1/fim/completions (openai.py), OpenAI's /v1/responses (responses.py), Ollama's /api/*
(ollama.py), Anthropic's /v1/messages (anthropic.py). Bad input gets a 4xx with a JSON
error, never a 5xx.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from ..api import Session
from ..errors import CachebackError
from ..fim import InfillBuilder
from . import anthropic, llama_cpp, ollama, openai, responses
from .core import BodyGuard, Context, Generator, error


def create_app(session: Session, api_key: str | None = None, max_body: int = 1 << 20, strict_infill: bool = False,
               keep_drafter: bool = True, batch: int = 2048, stable_prefix: bool = True,
               infill_extra: int | None = 0, slots: int | None = 4, measure_idle: bool = False,
               parallel: int = 1) -> FastAPI:
    """batch bounds /infill prompts the way llama.cpp's batch size does (prefix 3/4, suffix 1/4);
    infill_extra: tokens of extra chunks in a prefix-only /infill prompt (None: all that fit; fim.py);
    slots: sequences whose caches are kept at once, e.g. one per file an editor flips between
    (slots.py; serve's default; None: as the session's engine has them);
    measure_idle: measure the model's pass costs while no request runs (core.Generator; `serve`
    does, an app embedded in a test or tool does not unless asked);
    parallel: requests run at once, as lanes of one batch, several sequences to a pass
    (server/batching.py; `serve --parallel`, default 4); 1: one at a time.
    To measure what they bring: keep_drafter=False gives every request a fresh drafter,
    stable_prefix=False cuts /infill prefixes at their last lines that fit (fim.py)."""
    loaded = session.loaded
    if slots is not None:
        session.engine.set_slots(slots)
    ctx = Context(session, Generator(session, keep_drafter, parallel),
                  InfillBuilder(session.tokenizer, loaded.fim, loaded.context_length, batch, stable_prefix,
                                infill_extra),
                  strict_infill)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        measuring = asyncio.create_task(ctx.gen.measure_when_idle()) if measure_idle else None
        yield
        if measuring is not None:
            measuring.cancel()
        await ctx.gen.close()

    app = FastAPI(title="cacheback-mlx", version="0.1.0", lifespan=lifespan)
    app.state.generator = ctx.gen
    app.add_middleware(BodyGuard, max_body=max_body, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(CachebackError)
    async def user_error(request: Request, exc: CachebackError):
        return error(400, str(exc))

    for protocol in (llama_cpp, openai, responses, ollama, anthropic):
        app.include_router(protocol.router(ctx))
    return app


def serve(session: Session, host: str = "127.0.0.1", port: int = 8012, **options):
    """Run the server until SIGINT or SIGTERM: either ends every job at its next step (a prefill
    within one chunk) and the server within a few seconds."""
    import uvicorn

    app = create_app(session, measure_idle=True, **options)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.generator.stopping.set()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
    try:
        Server(config).run()
    except KeyboardInterrupt:  # SIGINT, raised again once the server has stopped (as uvicorn.run)
        pass
