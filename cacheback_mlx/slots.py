"""Several sequences kept at once: one KV cache per slot, each with what the drafter saw of it.

An editor flips between files; a chat client between conversations. With one cache, every switch
re-prefills the whole prompt (~1,000 tokens of an editor's prefix: seconds on a CPU). A slot keeps
one sequence's caches (kvcache.ModelCache), the tokens in them, and the drafter's view of that
sequence (the history it saw, the context segments it learned), so coming back to a file reuses
its cache and continues its history. The drafter's tables stay shared: what one file teaches
helps the others.

Which slot a request takes (as llama.cpp's server picks among its slots by prompt similarity):
the one asked for (the engine's `slot=`), else the slot whose cached tokens share the longest prefix with the
prompt, if that prefix is at least half of the shorter of the two (so a chat turn that pastes a
long text still continues its conversation, and a prompt that only shares a BOS token or a
system prompt does not take over another sequence's slot); else an empty slot; else the one
used longest ago. Idle slots are emptied, longest unused first, while their caches hold more
than `max_bytes`. Slots only choose which cache a request runs on: each pass is the same as
with one cache, so the output is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CachebackError
from .kvcache import ModelCache
from .tree import common_prefix

SLOT_BYTES = 2 << 30  # idle slots' caches are emptied past this many bytes


@dataclass
class Sequence:
    """One sequence the engine runs: its caches and what is known of them."""

    cache: ModelCache
    cached: list[int] = field(default_factory=list)  # tokens whose effect is in the caches
    lead: list[int] = field(default_factory=list)  # accepted tokens not yet in the caches; lead[-1] is the root
    history: list[int] = field(default_factory=list)  # the sequence the drafter saw: prompts + outputs
    learned: set = field(default_factory=set)  # context segments the drafter learned (start_request)
    used: int = 0  # when it last served a request (a counter)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache.arrays())

    def forget(self) -> None:
        """What the drafter saw of it (a new drafter saw none of it); the caches stay."""
        self.history, self.learned = [], set()


def reusable(seq: Sequence | None, prompt: list[int]) -> int:
    """The prompt's tokens that `seq`'s caches hold (their common prefix), where that is at least
    half of the shorter of the two (else 0): what choose_sequence takes a sequence for."""
    toks = seq.cached if seq is not None else []
    r = common_prefix(toks, prompt)
    return r if 2 * r >= min(len(toks), len(prompt)) else 0


def choose_sequence(seqs: list, prompt: list[int], among, prefer: int | None = None) -> int:
    """Of the sequences `among` (indices into seqs; None: empty), the one for `prompt`: the one
    whose cached tokens share the longest prefix with it, if that is at least half of the shorter
    of the two; else an empty one (`prefer` if it is empty); else the one used longest ago (never
    `prefer`). How slots and a batch's lanes (batch.py) choose."""
    best, reuse = None, 0
    for i in among:
        r = reusable(seqs[i], prompt)
        if r > reuse:
            best, reuse = i, r
    if best is not None:
        return best
    empty = [i for i in among if seqs[i] is None or not seqs[i].cached]
    if empty:
        return prefer if prefer in empty else empty[0]
    return min((i for i in among if i != prefer), key=lambda i: seqs[i].used)


class Slots:
    """The sequences of one engine, one per slot; `active` is the one the engine runs."""

    def __init__(self, n: int, first: Sequence, max_bytes: int = SLOT_BYTES):
        """first: the active sequence to start with (slot 0)."""
        if n < 1:
            raise CachebackError(f"slots must be >= 1 (got {n})")
        self.n = n
        self.max_bytes = max_bytes
        self.slots: list[Sequence | None] = [first] + [None] * (n - 1)  # None: empty (no cache made yet)
        self.active = 0
        self.clock = 0

    def choose(self, prompt: list[int], want: int | None = None) -> int:
        """The slot for `prompt`."""
        if want is not None and want >= 0:
            if want >= self.n:
                raise CachebackError(f"slot must be in [0, {self.n}) or -1 (got {want})")
            return want
        if self.n == 1:
            return 0
        return choose_sequence(self.slots, prompt, range(self.n), self.active)

    def take(self, i: int, model) -> Sequence:
        """Make slot i the active one (an empty slot gets a new sequence with fresh caches for
        `model`) and return its sequence; then empty idle slots past the byte cap."""
        self.clock += 1
        if self.slots[i] is None:
            self.slots[i] = Sequence(ModelCache(model))
        self.active = i
        self.slots[i].used = self.clock
        self._evict()
        return self.slots[i]

    def _evict(self) -> None:
        idle = sorted((s.used, i) for i, s in enumerate(self.slots) if s is not None and i != self.active)
        total = sum(self.slots[i].nbytes() for _, i in idle)
        for _, i in idle:
            if total <= self.max_bytes:
                break
            total -= self.slots[i].nbytes()
            self.slots[i] = None

    def clear(self, keep_caches: bool = False) -> None:
        """Forget the idle slots (keep_caches: keep their caches, forget what the drafter saw)."""
        for i, s in enumerate(self.slots):
            if s is None or i == self.active:
                continue
            if keep_caches:
                s.forget()
            else:
                self.slots[i] = None
