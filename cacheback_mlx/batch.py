"""Several requests at once (continuous batching), each with its own draft tree.

Each running request is a lane: a sequence (slots.Sequence: its caches, cached tokens, lead and
history) with a drafter of its own. At every step each lane drafts; one planner shares the pass's
rows out among all lanes' drafts (share, over LaneCosts); all lanes' rows go through ONE pass of
the model (shared_pass.batch_pass: the weights read once, attention per lane over its own caches,
mask and positions). Then each lane accepts, rolls back and updates its drafter as
engine.generate does. Lanes join and leave between passes; a joining lane takes over another
lane's cached prefix of its prompt instead of prefilling it, and prefills the rest a chunk a step
(the lane with the fewest tokens left first), so running lanes never wait for a newcomer's whole
prompt: the chunk rides in the lanes' shared pass or goes in a pass of its own, whichever has cost
less here (Riding).

A lane's output is its solo output: a shared pass is checked against passes of their own on the
model before lanes share (sharing.check_sharing). Models whose lanes cannot share a pass take
turns, one pass per lane, with the same output: code that reads positions in ways a tree cannot
place, an attention that takes neither the lanes' masks nor every lane's keys end to end (Gemma 2's
takes the latter: sharing.Sharing.packed), or a backend where a shared pass differs beyond
rounding.
Layers that attend over another layer's keys (gemma3n's and gemma4's KV-shared layers) share the
pass through that layer's view (shared_pass.LaneView, LaneMask). Lanes of a model with recurrent
layers share a pass side by side (chains; shared_pass.py): a lane not accepted whole is undone
and feeds its accepted tokens again in its next pass, a lane running alone keeps the solo path
(its states captured by row), prefill chunks go in passes of their own (riding, they would pad
every lane to the chunk's rows), and no lane takes over another's prefix (a recurrent state
holds no prefix of itself). Where the mixers run a lane's padding into its states (Mamba 1,
Jamba), a lane narrower than the pass is undone after it, as one not accepted whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .batch_plan import LaneCosts, Riding, share, share_side_by_side
from .budget import Sizer
from .drafters.base import Drafter
from .engine import Accepted, Engine, Interrupted, Stats, accept
from .errors import CachebackError
from .kvcache import KVStack, ModelCache
from .learning import start_request
from .sampling import SamplingParams, accepted_logprobs, processed_rows, token_picker, top_tokens
from .shared_pass import batch_pass
from .sharing import sharing
from .slots import Sequence, choose_sequence, reusable
from .tree import DraftTree, common_prefix
from .verify import padded_size, prefill, verify_pass


@dataclass
class LaneShare:
    """One lane's part of a pass, as Batch.watch's listeners hear it."""

    index: int  # the lane
    offered: int  # drafts its drafter offered
    expected: float  # their chances of acceptance, summed (None-scored drafts count 1 each)
    sent: int  # drafts the plan sent
    weight: float | None  # what its expected token was worth in share (None: not weighed)
    produced: int  # tokens it produced in the pass


@dataclass
class SharedPassEvent:
    """A pass of the decoding lanes (Batch.watch)."""

    seconds: float
    chunk: int  # prompt rows of a prefilling lane riding in it
    lanes: list[LaneShare]


@dataclass
class Lane:
    """One request running in a Batch."""

    index: int  # which of the batch's sequences it runs in
    seq: Sequence
    drafter: Drafter
    pick: Callable
    max_tokens: int
    sizer: Sizer | None  # scores the lane's drafts (None: a fixed budget)
    stats: Stats = field(default_factory=Stats)
    tokens: list[int] = field(default_factory=list)  # produced so far (EOS excluded)
    done: bool = False
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill, its last one included
    processors: tuple = ()  # its logits processors (SamplingParams.logits_processors)
    logprobs: bool = False  # its tokens' log-probabilities too (engine.Accepted), and in token_logprobs
    token_logprobs: list[float] = field(default_factory=list)  # each produced token's own, when logprobs

    @property
    def prefilling(self) -> bool:
        return bool(self.pending)


class Batch:
    """Up to `n` requests at once, each in its own lane, stepped together (see the module's
    docstring). A lane's sequence and drafter stay for the next request, which reuses the caches
    of the lane whose tokens share the longest prefix with its prompt."""

    def __init__(self, engine: Engine, n: int, make_drafter: Callable[[], Drafter], ride: bool | None = None):
        """ride: prefill chunks always ride in the running lanes' passes (True), never (False), or
        as measured here (None: Riding; never with a fixed budget, which prices no pass)."""
        if n < 1:
            raise CachebackError(f"a batch needs at least one lane (got {n})")
        self.engine, self.model, self.n = engine, engine.model, n
        self.seqs: list[Sequence | None] = [None] * n
        self.drafters: list[Drafter | None] = [None] * n
        self.make_drafter = make_drafter
        self.lanes: dict[int, Lane] = {}
        self.reason, self.undo_padded, self.packed = sharing(engine)  # reason None: lanes share each pass
        self.side_by_side = self.reason is None and bool(engine.seq.cache.recurrent)  # lanes as batch rows
        self.stacks = self._new_stacks()  # each layer's keys and values of every lane (None: turns)
        self.passes = 0  # passes run (shared or taken in turns)
        self.rode = 0  # prefill chunks that rode in a shared pass
        self.clock = 0  # requests started (which lane was used longest ago)
        self.costs = LaneCosts(engine.sizer) if engine.sizer is not None else None  # None: a fixed budget
        self.riding = Riding(ride if ride is not None or self.costs is not None else False)
        self.watchers: list[Callable[[SharedPassEvent], None]] = []

    def watch(self, fn: Callable[[SharedPassEvent], None]) -> Callable[[], None]:
        """Call fn(SharedPassEvent) after every pass of the decoding lanes from now on (tools and
        tests that look at how rows were shared out); returns a function that stops it."""
        self.watchers.append(fn)
        return lambda: self.watchers.remove(fn)

    def _new_stacks(self) -> list[KVStack] | None:
        return None if self.reason else [KVStack(self.n) for _ in self.engine.seq.cache.layers]

    def _free_lane(self, prompt: list[int]) -> int:
        """The free lane for `prompt`: the one whose caches hold most of it, else the one used
        longest ago, as slots are chosen (slots.choose_sequence); then, unless it was chosen for
        what it holds, the lowest free lane takes the request instead and what that lane held moves
        to the chosen one (_move), so no cache is lost that the choice kept. Busy lanes stay at the
        stack's first rows: attention over the lanes reads a run of stack rows, the idle ones in
        it too (shared_pass.PassPlan; 4 lanes of one row at rows 0, 2, 5 and 7 of 8 cost up to 1.3x
        the same at rows 0-3 on a CPU, docs/BENCHMARKS.md §10)."""
        free = [i for i in range(self.n) if i not in self.lanes]
        if not free:
            raise CachebackError(f"all {self.n} lanes are busy")
        chosen, low = choose_sequence(self.seqs, prompt, free), min(free)
        if (low == chosen or self.stacks is None or self.engine.seq.cache.recurrent or self.seqs[low] is None
                or reusable(self.seqs[chosen], prompt)):
            return chosen
        self._move(low, chosen)
        return low

    def _move(self, src: int, dst: int) -> None:
        """Lane src's cached tokens, what its drafter saw of them and the drafter itself go to lane
        dst (one copy a layer, in the stack), in place of dst's; src is left with dst's drafter and
        empty caches."""
        a, b = self.seqs[src], self.seqs[dst]
        if b is None:
            b = self.seqs[dst] = Sequence(ModelCache(self.model, self.stacks, dst))
        n = min(len(a.cached), a.cache.length)
        for stack in self.stacks:
            stack.keys[dst : dst + 1, :, :n] = stack.keys[src : src + 1, :, :n]
            stack.values[dst : dst + 1, :, :n] = stack.values[src : src + 1, :, :n]
        b.cache.take_length(n)
        a.cache.trim(0)
        b.cached, a.cached = a.cached[:n], []
        a.history, b.history = b.history, a.history
        a.learned, b.learned = b.learned, a.learned
        a.used, b.used = b.used, a.used
        self.drafters[src], self.drafters[dst] = self.drafters[dst], self.drafters[src]

    def _enter(self, prompt: list[int], context, stop, fresh: bool, now: bool = True) -> tuple[int, Stats, list[int]]:
        """Take the free lane that reuses most of the prompt and bring its caches up to it but its
        last token (which leads the first pass), now, or (`now` False) later, a chunk a pass: the
        prompt's tokens still to prefill, its last one included. The lane's drafter (a new one with
        `fresh`) learns the prompt."""
        i = self._free_lane(prompt)
        if self.seqs[i] is None or self.drafters[i] is None or fresh:
            if self.drafters[i] is not None:
                self.drafters[i].close()
            self.drafters[i] = self.make_drafter()
            self.seqs[i] = self.seqs[i] or Sequence(ModelCache(self.model, self.stacks, i))
            self.seqs[i].forget()
        seq, stats, eng = self.seqs[i], Stats(prompt_tokens=len(prompt)), self.engine
        self.clock += 1
        seq.used = self.clock
        t0 = time.perf_counter()
        keep = seq.cache.trim(common_prefix(seq.cached, prompt[:-1]))
        keep = self._copy_prefix(i, prompt[:-1], keep)
        done = 0
        if now:
            done = prefill(self.model, seq.cache, prompt[keep:-1], eng.chunk_rule(), timed=eng.planner.prefilled,
                           stop=stop)
        seq.cached = prompt[: keep + done]
        if now and keep + done < len(prompt) - 1:
            seq.lead = []
            raise Interrupted(f"prefill stopped after {keep + done} of {len(prompt) - 1} tokens")
        pending = prompt[keep + done :]
        seq.lead = pending if len(pending) == 1 else []
        stats.prefill_tokens, stats.prefill_s = len(prompt) - 1 - keep, time.perf_counter() - t0
        seq.history = start_request(self.drafters[i], seq.history, prompt, context, seq.learned)
        return i, stats, pending if len(pending) > 1 else []

    def _copy_prefix(self, i: int, prompt: list[int], keep: int) -> int:
        """Where another lane's caches hold a longer prefix of the prompt than lane i's `keep`
        tokens (a request's several completions, clients that share a system prompt), copy it
        over (one copy a layer, in the stack) instead of prefilling it; the length now held."""
        if self.stacks is None or self.engine.seq.cache.recurrent:
            return keep
        best, j = keep, None
        for k, other in enumerate(self.seqs):
            if k != i and other is not None:
                n = min(common_prefix(other.cached, prompt), other.cache.length)
                if n > best:
                    best, j = n, k
        if j is None:
            return keep
        for stack in self.stacks:
            stack.keys[i : i + 1, :, :best] = stack.keys[j : j + 1, :, :best]
            stack.values[i : i + 1, :, :best] = stack.values[j : j + 1, :, :best]
        self.seqs[i].cache.take_length(best)
        self.seqs[i].cached = prompt[:best]
        return best

    def join(self, prompt: Seq[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
             context=(), fresh: bool = False) -> Lane:
        """Start a request in a free lane and let its drafter learn the prompt (`context`: text
        beside it, learning.start_request; `fresh`: a new drafter that learned nothing). What the
        lane's caches lack of the prompt is prefilled by the next steps, a chunk each; a lane that
        leaves meanwhile keeps the chunks done, so the same prompt later goes on from them."""
        eng = self.engine
        prompt = eng.check(prompt, max_tokens)
        if max_tokens == 0:
            raise CachebackError("max_tokens must be > 0")
        i, stats, pending = self._enter(prompt, context, None, fresh, now=False)
        sizer = eng.sizer and eng.sizer.lane()
        max_tokens = min(max_tokens, eng.context_length - len(prompt))
        lane = Lane(i, self.seqs[i], self.drafters[i], token_picker(sampling), max_tokens, sizer, stats,
                    pending=pending, processors=sampling.logits_processors, logprobs=sampling.logprobs)
        self.lanes[i] = lane
        return lane

    def warm(self, prompt: Seq[int], context=(), stop=None) -> tuple[int, Stats]:
        """Bring a free lane's caches up to the prompt and generate nothing (an editor's warm-up),
        so a request that starts with it only prefills what follows; (the lane, its counters)."""
        return self._enter(self.engine.check(prompt, 0), context, stop, False)[:2]

    def close(self) -> None:
        """End every lane's request and release the lanes' drafters."""
        for lane in list(self.lanes.values()):
            self.leave(lane)
        for d in self.drafters:
            if d is not None:
                d.close()
        self.seqs, self.drafters = [None] * self.n, [None] * self.n
        self.stacks = self._new_stacks()

    def leave(self, lane: Lane) -> None:
        """End a lane's request (finished or cancelled): its rows are free from the next pass."""
        if self.lanes.get(lane.index) is lane:
            del self.lanes[lane.index]
            lane.drafter.end_request()
            if lane.sizer is not None:
                lane.sizer.catch_up()  # what its last pass taught
        lane.done = True

    def step(self) -> list[tuple[Lane, list[int]]]:
        """One pass for every running lane: (lane, the tokens it produced) per lane, in lane
        order; a lane that finished (EOS or its token limit) has left the batch. Of the lanes
        still prefilling, the one with the fewest tokens left takes a chunk: in the shared pass
        where lanes share one, else in a pass of its own."""
        eng, lanes = self.engine, [self.lanes[i] for i in sorted(self.lanes)]
        if not lanes:
            return []
        decoding = [lane for lane in lanes if not lane.prefilling]
        feeding, chunk = self._next_chunk(lanes)
        if feeding is not None:
            alone = not decoding or self.reason is not None or self.side_by_side  # nothing to ride with
            if alone or not self.riding.ride():
                t0 = time.perf_counter()
                prefill(self.model, feeding.seq.cache, chunk, len(chunk), timed=eng.planner.prefilled)
                seconds = time.perf_counter() - t0
                if not alone:
                    self.riding.timed(False, len(chunk), seconds)
                self._fed(feeding, chunk, seconds)
                feeding, chunk = None, []
        out = [(lane, []) for lane in lanes if all(lane is not d for d in decoding)]
        if decoding:
            out += self._decode(decoding, feeding, chunk)
        return sorted(out, key=lambda x: x[0].index)

    def _next_chunk(self, lanes: list[Lane]) -> tuple[Lane | None, list[int]]:
        """The prefilling lane with the fewest tokens left and its next chunk; first, a lane whose
        prompt another lane's caches now hold more of (several completions of one prompt) copies
        that instead (_copy_prefix), and one that then holds it all waits for the next pass."""
        rule = self.engine.chunk_rule(beside_others=True)
        for lane in sorted((lane for lane in lanes if lane.prefilling), key=lambda lane: len(lane.pending)):
            seq = lane.seq
            held = len(seq.cached)
            prompt = seq.cached + lane.pending
            keep = self._copy_prefix(lane.index, prompt[:-1], held)
            if keep > held:
                lane.stats.prefill_tokens -= keep - held
                self._fed(lane, [], 0.0, prompt[keep:])
            if lane.prefilling:
                size = rule(seq.cache.length) if callable(rule) else rule
                return lane, lane.pending[: min(size, len(lane.pending) - 1)]
        return None, []

    def _fed(self, lane: Lane, chunk: list[int], seconds: float, pending: list[int] | None = None) -> None:
        """A prefilling lane after a chunk of its prompt went into its caches."""
        lane.seq.cached.extend(chunk)
        lane.pending = lane.pending[len(chunk) :] if pending is None else pending
        lane.stats.prefill_s += seconds
        if len(lane.pending) == 1:  # the prompt's last token leads the lane's first pass
            lane.seq.lead, lane.pending = lane.pending, []

    # What a lane's expected token is worth when one pass's rows are shared out: its tokens per
    # pass so far to this power. The lanes whose drafts land keep their long drafts, and lanes
    # whose drafts seldom land send fewer, so each pass costs less. Chosen on seeds 312-314 (0, 1
    # and 2 tried), then on fresh seeds 324-326, 4 chat requests at once (docs/BENCHMARKS.md §10):
    # median latency under load / alone 1.61-2.05x against 1.76-2.37x, aggregate 41.1 against
    # 39.5 tok/s.
    FAVOUR = 2.0

    def lane_weights(self, lanes: list[Lane]) -> list[float]:
        """Each lane's weight in share: (tokens + 2) / (passes + 2), to the power FAVOUR."""
        return [((lane.stats.tokens + 2.0) / (lane.stats.passes + 2.0)) ** self.FAVOUR for lane in lanes]

    def _decode(self, lanes: list[Lane], feeding: Lane | None, chunk: list[int]) -> list[tuple[Lane, list[int]]]:
        """One pass for the decoding lanes (with a prefilling lane's chunk riding along)."""
        eng = self.engine
        # draft: each lane within the tokens and context it has left
        t0 = time.perf_counter()
        offers, weights = [], None
        for lane in lanes:
            seq = lane.seq
            limit = min(lane.max_tokens - len(lane.tokens) - 1,
                        eng.context_length - len(seq.cached) - len(seq.lead) - 1)
            tree = eng.draft(lane.drafter, seq.history, eng.planner.draft_cap(len(seq.lead), len(seq.cached), limit))
            offers.append(lane.sizer.offer(tree, len(seq.lead)) if lane.sizer and len(tree) else (tree, None, None))
        # plan: the pass's rows shared out among every lane's drafts
        context = sum(len(lane.seq.cached) for lane in lanes) // len(lanes)
        asked = [(len(lane.seq.lead), s if s is not None else np.ones(len(t)))
                 for lane, (t, s, _) in zip(lanes, offers)]
        if self.costs is None:
            counts = share(asked, None)
        elif self.side_by_side:  # one pass for all, each lane as wide as the widest
            counts = share_side_by_side(asked, self.costs.costs(len(lanes), context))
        elif self.reason is None:  # one pass for all
            weights = self.lane_weights(lanes)
            counts = share(asked, self.costs.costs(len(lanes), context),  # as without the chunk: its rows
                           weights)  # would make any draft look cheap, and every draft sent delays the prompt
        else:  # a pass each
            counts = [share([a], self.costs.costs(1, len(lane.seq.cached)))[0] for a, lane in zip(asked, lanes)]
        trees = [lane.sizer.send(t, cells, k) if s is not None else t.truncate(k)
                 for lane, (t, s, cells), k in zip(lanes, offers, counts)]
        draft_s = time.perf_counter() - t0
        # verify: one shared pass, or one per lane
        t0 = time.perf_counter()
        rows = [len(lane.seq.lead) + len(tree) for lane, tree in zip(lanes, trees)]
        if eng.sizer is not None and eng.sizer.pad and self.reason is None and not chunk:  # the last lane takes
            rows[-1] += eng.sizer.rows(sum(rows), context) - sum(rows)  # the padding where more rows cost less
        passes = [(lane.seq.cache, lane.seq.lead, tree, padded_size(n, eng.buckets))
                  for lane, tree, n in zip(lanes, trees, rows)]
        riding = [(feeding.seq.cache, chunk, DraftTree([], []), len(chunk))] if chunk else []
        shared = self.reason is None and not (self.side_by_side and len(passes) == 1)
        width = max(p[3] for p in passes)  # side by side, every lane's rows in the pass
        logits = (batch_pass(self.model, passes + riding, self.packed, read=len(passes)) if shared else
                  [verify_pass(self.model, c, lead, t, rows=r) for c, lead, t, r in passes])
        logits = [processed_rows(lane.processors, x, lane.seq.history, tree)  # penalties, biases
                  for lane, x, tree in zip(lanes, logits, trees)]
        picks = [lane.pick(x, len(lane.seq.cached) + len(lane.seq.lead), tree)
                 for lane, x, tree in zip(lanes, logits, trees)]
        best = [lane.drafter.alternatives for lane in lanes]  # next-best tokens at each row, for the drafter
        tops = [top_tokens(x, 1 + k) if k > 0 else None for x, k in zip(logits, best)]
        read = (picks, [t for t in tops if t is not None], feeding.seq.cache.arrays() if chunk else [])
        mx.async_eval(*read)  # the pass: the lanes' drafters and sizers learn from their last ones meanwhile
        t1 = time.perf_counter()
        for lane in lanes:
            lane.drafter.catch_up()
            if lane.sizer is not None:
                lane.sizer.catch_up()
        learn_s = time.perf_counter() - t1
        mx.eval(*read)
        seconds = time.perf_counter() - t0
        if self.costs is not None and self.reason is None:
            if chunk:
                price = self.costs.costs(len(lanes), context)
                self.riding.timed(True, len(chunk), seconds - price[min(sum(p[3] for p in passes), len(price) - 1)])
            else:
                run = len(passes) * width if self.side_by_side else sum(p[3] for p in passes)
                self.costs.timed(len(lanes), context, run, seconds)
        self.passes += 1
        if chunk:
            self.rode += 1
            feeding.seq.cache.finish_pass(list(range(len(chunk))), True)
            self._fed(feeding, chunk, seconds)
        # accept, roll back and update each lane
        out = []
        for lane, (_, lead, tree, rows), x, p, top in zip(lanes, passes, logits, picks, tops):
            if shared and self.undo_padded:  # the padding ran into a narrower lane's states
                rows = width
            produced = self._settle(lane, lead, tree, rows, p.tolist(), None if top is None else top.tolist(), x)
            lane.stats.draft_s += draft_s / len(lanes)
            lane.stats.learn_s += learn_s / len(lanes)
            lane.stats.verify_s += seconds
            out.append((lane, produced))
        if self.watchers:
            event = SharedPassEvent(seconds, len(chunk), [
                LaneShare(lane.index, len(a[1]), float(np.clip(a[1], 0.0, 1.0).sum()), len(tree),
                          None if weights is None else weights[k], len(produced))
                for k, (lane, a, tree, (_, produced)) in enumerate(zip(lanes, asked, trees, out))])
            for fn in self.watchers:
                fn(event)
        return out

    def _settle(self, lane: Lane, lead: list[int], tree: DraftTree, rows: int, picks: list[int],
                tops: list[list[int]] | None = None, logits: mx.array | None = None) -> Accepted:
        """A lane after its pass: accept the longest agreed path and its bonus token, keep those
        rows, tell the drafter; the tokens it produced (EOS and past the limit cut off), with their
        log-probabilities from the lane's `logits` when it asked for them."""
        seq, stats = lane.seq, lane.stats
        path, bonus = accept(tree, picks)
        accepted = [int(tree.tokens[i]) for i in path] + [int(bonus)]
        if lane.sizer is not None:
            lane.sizer.update(tree, path, accepted)
        kept = list(range(len(lead))) + [len(lead) + i for i in path]
        if seq.cache.finish_pass(kept, len(path) == len(tree) and rows == len(kept)):
            seq.cached.extend(lead + accepted[:-1])
            seq.lead = [bonus]
        else:  # a lane on a model that undoes a pass not accepted whole
            seq.lead = lead + accepted
            stats.undone += 1
        stats.passes += 1
        stats.drafted += len(tree)
        eos = next((i for i, t in enumerate(accepted) if t in self.engine.eos_ids), None)
        produced = Accepted(accepted[:eos][: lane.max_tokens - len(lane.tokens)])
        if lane.logprobs and logits is not None:
            logprobs = accepted_logprobs(logits, path)
            produced.logprobs = logprobs[: len(produced)]
            stats.stop_logprobs = logprobs[eos] if eos is not None and len(produced) == eos else None
            lane.token_logprobs += produced.own_logprobs().tolist() if produced else []
        seq.history.extend(produced)
        lane.drafter.observe(produced)
        lane.drafter.recycle(tree.picked(lead[-1], picks, tops))
        lane.tokens.extend(produced)
        stats.tokens = len(lane.tokens)
        stats.accepted += len(produced) + (eos is not None and len(produced) == eos)
        if eos is not None and len(produced) == eos:
            stats.stop_token, lane.finish_reason = accepted[eos], "stop"
        elif len(lane.tokens) >= lane.max_tokens:
            lane.finish_reason = "length"
        if lane.finish_reason:
            self.leave(lane)
        return produced

    def run(self, requests: list[dict]) -> list[Lane]:
        """Run requests (dicts of join's arguments) to the end, at most n at a time, each joining
        as a lane frees; the lanes in request order."""
        waiting, done = list(enumerate(requests)), {}
        running: dict[int, Lane] = {}
        while waiting or running:
            while waiting and len(self.lanes) < self.n:
                k, req = waiting.pop(0)
                running[k] = self.join(**req)
            t0 = time.perf_counter()
            decoding = [k for k, lane in running.items() if not lane.prefilling]
            self.step()
            for k in decoding:
                running[k].stats.decode_s += time.perf_counter() - t0
            for k, lane in list(running.items()):
                if lane.done:
                    done[k] = running.pop(k)
        return [done[k] for k in range(len(requests))]
