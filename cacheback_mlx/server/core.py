"""What every protocol shares: errors, the body guard, and generation jobs (request fields: fields.py).

One Session serves every request, so the KV prefix and the drafter's tables carry over from request
to request. One generation runs on the model at a time: the others wait for `turn`, an asyncio lock,
so a waiting request never blocks the model's worker thread. A client that goes away (streaming or
not), or a server told to stop (SIGINT, SIGTERM), ends its generation at the next step and its
prefill at the next chunk; a long prefill also lets waiting requests go first between its chunks
and then goes on from the chunks done (Generator.pieces). Everything a request can get
wrong is checked before a response starts, so errors are 4xx with a JSON body, never a 200
followed by an error event (only a failure of the model itself could still end a stream that way).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import anyio
import mlx.core as mx
from fastapi import Request
from fastapi.responses import JSONResponse

from .. import constrained
from ..api import Session
from ..engine import Interrupted
from ..errors import CachebackError
from ..fim import CompletionRules, InfillBuilder
from ..sampling import SamplingParams, xtc_special
from .batching import BatchRunner
from .fields import Sampling
from .logprobs import TokenLog, token_entries
from .metrics import Metrics


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """llama.cpp's and OpenAI's error shape, which Anthropic's clients read too (its top-level type)."""
    return JSONResponse({"type": "error", "error": {"code": status, "message": message, "type": kind}},
                        status_code=status)


class BodyGuard:
    """ASGI middleware: bodies over max_body bytes get a 413 whether or not they say their length
    (chunked uploads are counted as they arrive), and a wrong API key a 401 (the key comes as
    `Authorization: Bearer KEY`, or as Anthropic's clients send it, `x-api-key: KEY`). A body is
    JSON whatever its Content-Type says, as llama.cpp and Ollama read it (`curl -d '{...}'` sends it
    as a form)."""

    def __init__(self, app, max_body: int, api_key: str | None):
        self.app, self.max_body, self.api_key = app, max_body, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            return await error(413, f"request body over {self.max_body} bytes")(scope, receive, send)
        given = headers.get("authorization") == f"Bearer {self.api_key}" or headers.get("x-api-key") == self.api_key
        if self.api_key and scope["path"] not in ("/health", "/") and not given:
            return await error(401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                               "authentication_error")(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return await error(413, f"request body over {self.max_body} bytes")(scope, receive, send)
        if not headers.get("content-type", "").startswith("application/json"):
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                         + [(b"content-type", b"application/json")])
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the client's disconnect

        await self.app(scope, replay, send)


@dataclass
class Job:
    """One generation: token ids in, text out, with everything that may end it early."""

    ids: list[int]
    max_tokens: int  # 0: prefill only
    sampling: Sampling
    rules: CompletionRules | None = None
    t_max_predict_ms: float | None = None  # llama.cpp: once a new line is out, stop when generation has taken this long
    context: list = field(default_factory=list)  # ids beside the prompt for the drafter: one list or several
    # (learning.start_request)
    text: str = ""
    stop_type: str = "none"  # llama.cpp's: eos, word (a stop string), limit (tokens, time, indent)
    stop_word: str | None = None  # the stop string that ended it (stop_type "word")
    hit_max: bool = False  # the token limit or the context's end ended it (OpenAI's finish_reason "length")
    timings: dict = field(default_factory=dict)
    truncated: bool = False
    slot: int = 0  # the engine slot it ran in (slots.py), reported as llama.cpp's id_slot
    log: TokenLog | None = None  # its tokens' log-probabilities, when asked for (TextOut makes it)
    grammar: str | None = None  # the structured output's grammar (Generator.check sets it)

    @property
    def finish_reason(self) -> str:
        return "length" if self.hit_max else "stop"


class TextOut:
    """A job's text as its pieces come: stop strings, an editor's rules and llama.cpp's
    t_max_predict_ms end it; what a stop string may still claim is held back."""

    def __init__(self, job: Job):
        self.job = job
        self.stops = job.sampling.stops()
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.raw = self.text = ""
        self.sent = 0
        self.first_s = None  # decode time when the first piece came (t_max_predict_ms counts from there)
        job.stop_type = "eos"
        self.log = job.log = TokenLog() if job.sampling.alternatives() is not None else None

    def add(self, piece: str, decode_s: float, entries: list[dict] | None = None) -> tuple[str, bool]:
        """After one more piece (and its tokens' log-probability entries, when asked for): the
        text newly safe to send ("" when held back), and whether the job ends here (a stop string,
        a rule, the time limit)."""
        job = self.job
        if self.log is not None:
            self.log.add(entries or [], len(self.raw), len(piece))
        self.raw += piece
        text = job.rules.visible(self.raw) if job.rules is not None else self.raw
        cut, word = min(((text.find(s), s) for s in self.stops if s in text), default=(-1, None))
        if cut >= 0:
            job.stop_type, job.stop_word = "word", word
        elif job.rules is not None and (c := job.rules.cut(text)) is not None:
            cut, job.stop_type = c, "limit"
        if cut >= 0:
            self.text = text[:cut]
            return "", True
        self.text = text
        if self.first_s is None:
            self.first_s = decode_s
        if job.t_max_predict_ms and "\n" in text and 1e3 * (decode_s - self.first_s) >= job.t_max_predict_ms:
            job.stop_type = "limit"  # as llama.cpp: timed from the first token, and only once a line
            return "", True  # is complete, so the editor never gets a reply cut inside its first line
        safe = len(text) - self.hold
        if job.rules is not None and job.rules.holds_lines():
            safe = min(safe, text.rfind("\n") + 1)
        new = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        if self.log is not None:
            self.log.show(self.sent)
        return new, False

    def finish(self, ended: bool, tokens: int, context: int) -> str:
        """The job is over (`ended`: by add's say, else its tokens or the model's `context` ran
        out, or EOS): set its text and stop type; the text not sent yet."""
        job = self.job
        if not ended and (tokens >= job.max_tokens or len(job.ids) + tokens >= context):
            job.stop_type, job.hit_max = "limit", True
        job.text = self.text
        if self.log is not None:
            self.log.show(len(self.text))
        return self.text[self.sent :]


class Generator:
    """Runs jobs one at a time on the shared Session, step by step, all on ONE worker thread (MLX
    arrays and streams belong to the thread that made them)."""

    IDLE_S = 2.0  # quiet this long before the model's pass costs are measured (measure_when_idle)
    POLL_S = 0.2  # while the worker runs a step, how often to look whether the client went away
    MAX_YIELDS = 32  # times one job's prefill lets waiting requests go first

    def __init__(self, session: Session, keep_drafter: bool = True, parallel: int = 1):
        """parallel: requests run at once, as lanes of one batch (server/batching.py); 1: one at
        a time on the session's engine."""
        self.session = session
        self.runner = BatchRunner(self, parallel) if parallel > 1 else None
        self.keep_drafter = keep_drafter  # False: a fresh drafter per request (measurements)
        self.turn = asyncio.Lock()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.last_request = time.monotonic()
        self.waiting = 0  # requests waiting for `turn`
        self.stopping = threading.Event()  # the server is shutting down: every job ends at its next step
        self.metrics = Metrics()  # totals over every job (/metrics)

    async def measure_when_idle(self) -> None:
        """Measure the model's pass costs in the server's idle time (api.Session.measure_step):
        one pass at a time, each holding `turn`, so a request that arrives waits one pass at most
        (a waiting request takes the lock before the next step). Until the table is complete the
        engine prices passes by the prior it learns from its own passes."""
        while True:
            await asyncio.sleep(self.IDLE_S)
            while time.monotonic() - self.last_request >= self.IDLE_S and not self.busy:
                async with self.turn:
                    more = await self.call(self.session.measure_step)
                if not more:
                    break

    @property
    def busy(self) -> bool:
        """A request is running on the model."""
        return self.turn.locked() or (self.runner is not None and self.runner.running)

    @property
    def requests_waiting(self) -> int:
        """Requests waiting for the model (or for a free lane)."""
        return self.waiting + (self.runner.waiting if self.runner is not None else 0)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    async def close(self):
        """Free the worker's MLX streams before the thread ends: MLX needs this from any thread
        that ran it, or the process may abort at exit ("terminate called ...", exit 134)."""
        async with self.turn:
            await self.call(mx.clear_streams)
        self.worker.shutdown(wait=True)

    def check(self, job: Job) -> None:
        """Refuse what the engine would refuse, before any response starts. A prompt longer than
        the context loses its oldest tokens first, as llama.cpp does (`truncated: true`). A
        warm-up with nothing to prefill is fine (the drafter learns its context)."""
        if job.max_tokens == 0 and not job.ids:
            return
        ids, cut = self.session.fit(job.ids, job.max_tokens or 1)
        if cut:
            job.ids, job.truncated = ids, True
        self.session.engine.check(job.ids, job.max_tokens)
        job.sampling.check_biases(self.session.engine.vocab_size)
        job.grammar = job.sampling.structure()
        if job.grammar is not None:
            constrained.check(job.grammar, self.session.tokenizer, self.session.engine.eos_ids)

    def params(self, job: Job, offset: int = 0) -> SamplingParams:
        """A run's sampling: the request's, with a structured output's constraint of its own."""
        constraint = None if job.grammar is None else constrained.Constrained(
            job.grammar, self.session.tokenizer, self.session.engine.eos_ids, len(job.ids))
        special = (xtc_special(self.session.tokenizer, self.session.engine.eos_ids)
                   if job.sampling.xtc_probability > 0 else ())
        return job.sampling.params(offset, constraint, special)

    def steps(self, job: Job, offset: int = 0, stop=None) -> Iterator[str]:
        """Text pieces as they become final (stop strings and rules applied), one per engine step
        ("" when a step's text is held back); call holding `turn`. `stop`: asked between prefill
        chunks (engine.Interrupted)."""
        if not self.keep_drafter:
            self.session.fresh_drafter()
        engine = self.session.engine
        if job.max_tokens == 0:
            engine.prefill_only(job.ids, job.context, stop=stop)
            job.stop_type, job.slot = "limit", engine.slots.active
            self.finished(job, prefill_only=True)
            return
        out = TextOut(job)
        pieces = self.session.stream_ids(job.ids, job.max_tokens, self.params(job, offset), job.context, stop=stop)
        ended = False
        try:
            top = job.sampling.alternatives()
            for piece, tokens in pieces:
                entries = token_entries(self.session.tokenizer, tokens, top) if top is not None else None
                new, ended = out.add(piece, self.session.stats.decode_s, entries)
                if ended:
                    break
                yield new  # "" too: callers check for a disconnect
        finally:
            pieces.close()
        rest = out.finish(ended, self.session.stats.tokens, self.session.loaded.context_length)
        job.slot = engine.slots.active
        self.finished(job)
        if rest:
            yield rest

    def finished(self, job: Job, prefill_only: bool = False, stats=None) -> None:
        """A job's generation is over: its timings, counted in the server's metrics."""
        job.timings = self.timings(job, prefill_only, stats)
        self.metrics.add(job.timings)

    def timings(self, job: Job, prefill_only: bool = False, stats=None) -> dict:
        """llama.cpp's timings (prompt_n: prompt tokens computed; cache_n: reused), plus drafting,
        from `stats` (default: the session's last generation)."""
        s = stats or self.session.stats
        cache_n = s.prompt_tokens - 1 - s.prefill_tokens
        prompt_n = s.prompt_tokens - cache_n - (1 if prefill_only else 0)
        per = lambda ms, n: (ms / n if n else 0.0, 1e3 * n / ms if ms > 0 else 0.0)
        prompt_ms, predicted_ms = 1e3 * s.prefill_s, 1e3 * s.decode_s
        p_tok, p_sec = per(prompt_ms, prompt_n)
        d_tok, d_sec = per(predicted_ms, s.tokens)
        return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": p_tok,
                "prompt_per_second": p_sec, "predicted_n": s.tokens, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": d_tok, "predicted_per_second": d_sec, "draft_n": s.drafted,
                "draft_n_accepted": max(s.accepted - s.passes, 0), "passes": s.passes, "mat": round(s.mat, 3)}

    async def _queue(self) -> None:
        """Wait for the model, counted in `waiting` (which a running prefill yields to)."""
        self.waiting += 1
        self.last_request = time.monotonic()
        try:
            await self.turn.acquire()
        finally:
            self.waiting -= 1

    async def _next(self, request: Request, it: Iterator[str], gone: threading.Event) -> str | None:
        """The next piece of `it`, run on the worker; while it runs, a client that goes away sets
        `gone`, which a prefill checks between its chunks."""
        step = asyncio.ensure_future(self.call(next, it, None))
        while not step.done():
            await asyncio.wait({step}, timeout=self.POLL_S)
            if not step.done() and not gone.is_set() and await request.is_disconnected():
                gone.set()
        return step.result()

    async def pieces(self, request: Request, job: Job, offset: int = 0) -> AsyncIterator[str]:
        """The job's text pieces (steps), run holding `turn`; it ends early when the client goes
        away or the server stops, a prefill within one chunk. A long prefill also stops between
        chunks while another request waits: this job then queues again behind it and goes on
        from the chunks done, kept in its slot (with one slot the next request would take them,
        so it does not yield there; at most MAX_YIELDS times a job)."""
        if self.runner is not None:
            async with aclosing(self.runner.pieces(request, job, offset)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        gone = threading.Event()
        yields = 0
        while True:
            await self._queue()
            try:
                if gone.is_set() or self.stopping.is_set() or await request.is_disconnected():
                    return  # gave up while waiting its turn (an editor's keystroke)
                polite = self.session.engine.slots.n > 1 and yields < self.MAX_YIELDS
                it = self.steps(job, offset,
                                lambda: gone.is_set() or self.stopping.is_set() or (polite and self.waiting > 0))
                try:
                    while (piece := await self._next(request, it, gone)) is not None:
                        yield piece
                        if self.stopping.is_set() or await request.is_disconnected():
                            return
                    return
                except Interrupted:
                    if gone.is_set() or self.stopping.is_set():
                        return
                    yields += 1  # another request waits: it runs, then this one goes on
                finally:
                    with anyio.CancelScope(shield=True):  # a disconnect cancels us: still end the generation
                        await self.call(it.close)
            finally:
                self.turn.release()

    async def complete(self, request: Request, job: Job, n: int = 1) -> list[Job]:
        """Run a job to its end (n times when sampling; greedy runs once and is repeated); stops
        early when the client goes away, freeing the model for the next request."""
        runs = [job] + [Job(**{**job.__dict__, "timings": {}}) for _ in range(n - 1)]
        if self.runner is not None and n > 1 and job.sampling.temperature > 0:  # side by side, as lanes
            async def one(run: Job, i: int) -> None:
                async with aclosing(self.pieces(request, run, offset=i)) as pieces:
                    async for _ in pieces:
                        pass

            await asyncio.gather(*(one(run, i) for i, run in enumerate(runs)))
            done = [run for run in runs if run.timings]
            return done if len(done) == n else []
        for i, run in enumerate(runs):
            if i and job.sampling.temperature == 0:
                run.text, run.stop_type, run.hit_max, run.timings = job.text, job.stop_type, job.hit_max, job.timings
                run.log = job.log
                continue
            async with aclosing(self.pieces(request, run, offset=i)) as pieces:
                async for _ in pieces:
                    pass
            if not run.timings:  # ended early: the client went away or the server is stopping
                return runs[:i]
        return runs

    async def stream(self, request: Request, job: Job, event: Callable[[str, bool], dict | list[dict]],
                     done_marker: bool, frame: Callable[[dict], str] | None = None) -> AsyncIterator[str]:
        """A stream's text: `event` makes one object or several of each piece, the last with
        done=True; `frame` writes each object out (default: a server-sent event's data line; a
        protocol's own framing: named events, NDJSON). A failure after the response started comes
        as an object {"error": {"code", "message", "type"}}. Ends on disconnect."""
        frame = frame or (lambda obj: f"data: {json.dumps(obj)}\n\n")
        each = lambda out: out if isinstance(out, list) else [out]  # noqa: E731
        try:
            async with aclosing(self.pieces(request, job)) as pieces:
                async for piece in pieces:
                    if piece:
                        for out in each(event(piece, False)):
                            yield frame(out)
            if job.timings and not await request.is_disconnected():
                for out in each(event("", True)):
                    yield frame(out)
        except CachebackError as e:
            yield frame({"error": {"code": 400, "message": str(e), "type": "invalid_request_error"}})
        except Exception as e:  # the response has started: report in the stream, then end it
            yield frame({"error": {"code": 500, "message": str(e), "type": "server_error"}})
        if done_marker:
            yield "data: [DONE]\n\n"


def encode_text(session: Session, text: str, chat: bool = False, messages=None, tools=None,
                template_args: dict | None = None) -> list[int]:
    """Token ids of a plain prompt (or chat messages, the tools offered and the template's other
    variables, through the template); empty is an error."""
    if not (text or messages):
        raise CachebackError("empty prompt")
    return session.encode(messages if messages is not None else text, chat=chat, tools=tools,
                          template_args=template_args)


@dataclass
class Context:
    """What the protocol files share: the session, its generator, the infill prompt builder."""

    session: Session
    gen: Generator
    infill: InfillBuilder
    strict_infill: bool = False  # llama.cpp's answer (501) on models without FIM tokens

    @property
    def model_id(self) -> str:
        return self.session.loaded.name

    def max_tokens(self, n: int | None, default: int) -> int:
        """A client's token limit: None -> default, -1 -> as many as fit (llama.cpp's -1); the
        engine stops at the end of the context either way."""
        return default if n is None else self.session.loaded.context_length if n < 0 else n

    def infill_job(self, sampling: Sampling, prefix: str, suffix: str, extra: list[dict], prompt: str,
                   n_predict: int, n_indent: int = 0, t_max_predict_ms: float | None = None) -> tuple[Job, bool]:
        """A fill-in-the-middle job (prefix-only on models without FIM tokens); returns it and
        whether the FIM layout was used."""
        p = self.infill.build(prefix, suffix, extra, prompt, n_predict)
        p.rules.n_indent = n_indent
        job = Job(p.ids, n_predict, sampling, p.rules, t_max_predict_ms or None, p.context, truncated=p.truncated)
        self.gen.check(job)
        return job, p.fim
