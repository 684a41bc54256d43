"""The server's requests, several at once, in one batch (batch.py; `serve --parallel N`).

Each request's job waits for a free lane, then runs as a lane of the session's batch: the model's
worker thread runs one loop (BatchRunner.run) that admits waiting jobs as lanes free, steps every
lane in one pass, and hands each job the tokens its lane produced; the job's own coroutine turns
them into text (core.TextOut: stop strings, editor rules, time limits). A joining job's prefill
goes one chunk per pass while other lanes run, so they keep producing. A client that goes away
leaves its lane before the next pass; the others' outputs are what they would be alone.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request

from ..engine import Interrupted, Stats
from .logprobs import token_entries

if TYPE_CHECKING:
    from .core import Generator, Job


@dataclass
class Entry:
    """A job handed to the batch loop, and the queue its coroutine reads: (tokens, lane, their
    log-probability entries or None) per pass, an exception, or None at the end."""

    job: "Job"
    offset: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: bool = False  # the loop: leave the lane (or never join)
    gone: bool = False  # the client went away or the server stops: no answer
    lane: object = None
    stats: object = None

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class BatchRunner:
    """Runs a Generator's jobs as lanes of one batch of `lanes` lanes."""

    def __init__(self, gen: "Generator", lanes: int):
        self.gen, self.lanes = gen, lanes
        self.pending: collections.deque[Entry] = collections.deque()
        self.mutex = threading.Lock()
        self.running = False  # the loop is on the worker
        self.active = 0  # lanes running now

    @property
    def waiting(self) -> int:
        return len(self.pending)

    async def pieces(self, request: Request, job: "Job", offset: int = 0) -> AsyncIterator[str]:
        """The job's text pieces as its lane produces them; ends early when the client goes away
        or the server stops (its lane leaves before the next pass)."""
        from .core import TextOut

        gen = self.gen
        gen.last_request = time.monotonic()
        entry = Entry(job, offset, asyncio.get_running_loop())
        with self.mutex:
            self.pending.append(entry)
            start = not self.running
            self.running = True
        if start:
            asyncio.get_running_loop().run_in_executor(gen.worker, self.run)
        detok = gen.session.tokenizer.detokenizer
        out = TextOut(job) if job.max_tokens else None
        ended, lane, checked = False, None, time.monotonic()
        try:
            while True:
                item = await self._get(request, entry)
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                if time.monotonic() - checked >= gen.POLL_S:  # passes come fast: look now and then
                    checked = time.monotonic()
                    if gen.stopping.is_set() or await request.is_disconnected():
                        entry.cancel = entry.gone = True
                        return
                tokens, lane, entries = item
                for t in tokens:
                    detok.add_token(t)
                new, ended = out.add(detok.last_segment, lane.stats.decode_s, entries)
                if ended:
                    break
                if new:
                    yield new
            stats = entry.stats or (lane.stats if lane is not None else None)
            if entry.gone or stats is None:
                return  # the client went away, or the server is stopping
            if out is None:  # a warm-up: prefill only
                job.stop_type = "limit"
                gen.finished(job, prefill_only=True, stats=stats)
                job.slot = entry.lane or 0
                return
            if not ended:
                detok.finalize()
                new, ended = out.add(detok.last_segment, stats.decode_s)
            rest = out.finish(ended, stats.tokens, gen.session.loaded.context_length)
            job.slot = lane.index if lane is not None else 0
            gen.finished(job, stats=stats)
            if rest:
                yield rest
        finally:
            entry.cancel = True  # a lane still running leaves before the next pass

    async def _get(self, request: Request, entry: Entry):
        """The next item for the entry; None once its client went away or the server stops."""
        while True:
            try:
                return await asyncio.wait_for(entry.queue.get(), self.gen.POLL_S)
            except asyncio.TimeoutError:
                if self.gen.stopping.is_set() or await request.is_disconnected():
                    entry.cancel = entry.gone = True
                    return None

    def run(self) -> None:
        """The batch loop, on the model's worker thread, until no job is waiting or running."""
        gen = self.gen
        running: dict[int, Entry] = {}
        batch = None
        try:
            batch = gen.session.batch(self.lanes)
            while True:
                with self.mutex:
                    joining = []
                    while self.pending and len(batch.lanes) + len(joining) < batch.n:
                        joining.append(self.pending.popleft())
                    if not joining and not batch.lanes:
                        self.running = False
                        self.active = 0
                        return
                for e in sorted(joining, key=lambda e: len(e.job.ids)):  # short prompts first: they start at
                    self._join(batch, e, running)  # once, and a long one then prefills a chunk per pass
                for e in list(running.values()):  # clients that went away, a server that stops
                    if e.cancel or gen.stopping.is_set():
                        batch.leave(e.lane)
                        running.pop(e.lane.index)
                        e.send(None)
                self.active = len(batch.lanes)
                if not batch.lanes:
                    continue
                for lane, produced in batch.step():
                    if not produced and not lane.done:  # a chunk of its prompt went in
                        continue
                    e = running[lane.index]
                    lane.stats.decode_s = lane.stats.verify_s + lane.stats.draft_s
                    top = e.job.sampling.alternatives()  # (MLX arrays are read on this thread)
                    e.send((produced, lane, token_entries(gen.session.tokenizer, produced, top) if top is not None
                            else None))
                    if lane.done:
                        e.stats = lane.stats
                        running.pop(lane.index)
                        e.send(None)
        except BaseException as err:  # a failure of the model: every job hears it, the loop ends
            with self.mutex:
                left = list(self.pending) + list(running.values())
                self.pending.clear()
                self.running = False
            for e in left:
                e.send(err)
                if batch is not None and e.lane is not None and not isinstance(e.lane, int):
                    batch.leave(e.lane)
            raise

    def _join(self, batch, e: Entry, running: dict) -> None:
        """Admit one job: its prompt is prefilled a chunk a step beside the running lanes (batch.py).
        An editor's warm-up (no tokens asked) prefills at once, between chunks giving way to
        running lanes and waiting jobs (interrupted, it waits at the head of the queue and goes on
        from the chunks done)."""
        gen, job = self.gen, e.job

        def stop() -> bool:
            return e.cancel or gen.stopping.is_set() or bool(batch.lanes) or bool(self.pending)

        if e.cancel or gen.stopping.is_set():
            e.send(None)
            return
        try:
            if job.max_tokens == 0:
                e.lane, e.stats = batch.warm(job.ids, job.context, stop) if job.ids else (None, None)
                e.stats = e.stats or Stats(prompt_tokens=len(job.ids))
                e.send(None)
                return
            e.lane = batch.join(job.ids, job.max_tokens, gen.params(job, e.offset), job.context,
                                fresh=not gen.keep_drafter)
        except Interrupted:
            if e.cancel or gen.stopping.is_set():
                e.send(None)
            else:
                with self.mutex:
                    self.pending.appendleft(e)
            return
        except Exception as err:  # a bad request the checks let through: this job's error only
            e.send(err)
            return
        running[e.lane.index] = e

