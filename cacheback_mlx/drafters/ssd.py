"""SSD, suffix speculative decoding (../shared/seeds/ssd.md): drafts from everything served before.

Every finished request's tokens (prompt + output) go into one bounded circular buffer shared by
all requests, and kept on disk between runs (ssd_store.py: one store per tokenizer, shared by
every process using it), so the runtime drafts better the more it is used. A
suffix array over the buffer is rebuilt in a background thread after each request; queries use
the last finished index and never wait for a rebuild. The request in progress is searched too
(its own history), since it is not in the index yet. Drafts: the most frequent continuations of
the longest matching context, merged into a small tree.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from ..tree import DraftTree
from .base import Drafter
from .ssd_store import SsdStore
from .suffix import SEP, SuffixIndex, trie_tree

log = logging.getLogger(__name__)


def default_path(fingerprint: str | None = None) -> Path:
    """One store per tokenizer: token ids mean nothing under another vocabulary."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheback-mlx" / "ssd" / (fingerprint[:16] if fingerprint else "unknown-tokenizer")


class SsdDrafter(Drafter):
    name = "ssd"

    def __init__(self, path: str | Path | None = None, capacity: int = 4_000_000, max_n: int = 16,
                 length: int = 10, top_k: int = 16, max_count: int = 64, persist: bool = True,
                 fingerprint: str | None = None):
        """path: the store's folder (default: one per tokenizer `fingerprint` under the user's
        cache); persist=False keeps the buffer in memory only."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token (got {capacity})")
        self.path = Path(path) if path else default_path(fingerprint)
        self.capacity, self.max_n, self.length = capacity, max_n, length
        self.top_k, self.max_count, self.persist = top_k, max_count, persist
        self.store = SsdStore(self.path, capacity) if persist else None
        self.buffer = self._load()  # chronological tokens, at most `capacity`
        self.index: SuffixIndex | None = None
        self._lock = threading.Lock()
        self._rebuild: threading.Thread | None = None
        self._request: list[int] = []
        self._start_rebuild()

    # -- persistence ---------------------------------------------------------------------
    def _load(self) -> np.ndarray:
        if self.store is None:
            return np.zeros(0, np.int32)
        try:
            return self.store.load()
        except OSError as e:
            log.warning("ssd: cannot read the store %s: %s; starting empty", self.path, e)
            return np.zeros(0, np.int32)

    # -- the buffer and its index --------------------------------------------------------
    def _start_rebuild(self) -> None:
        buf = self.buffer
        if not len(buf) or (self._rebuild is not None and self._rebuild.is_alive()):
            return

        def work():
            index = SuffixIndex(buf)
            with self._lock:
                self.index = index

        self._rebuild = threading.Thread(target=work, daemon=True, name="ssd-index")
        self._rebuild.start()

    def wait(self) -> None:
        """Block until a background rebuild finishes (tests, and before exit)."""
        if self._rebuild is not None:
            self._rebuild.join()

    def observe(self, tokens: Sequence[int]) -> None:
        self._request.extend(int(t) for t in tokens)

    def end_request(self) -> None:
        """The request is done: add its tokens to the shared buffer and re-index in the background."""
        if not self._request:
            return
        new = np.asarray(self._request + [SEP], np.int32)
        self._request = []
        if self.store is not None:
            try:  # also brings in what other processes served meanwhile
                self.buffer = self.store.append(new, self.buffer)
                self._start_rebuild()
                return
            except OSError as e:
                log.warning("ssd: cannot write the store %s: %s", self.path, e)
        self.buffer = np.concatenate([self.buffer, new])[-self.capacity:]
        self._start_rebuild()

    def reset(self) -> None:
        """A new conversation: forget the request in progress (the shared buffer is kept)."""
        self._request = []

    # -- drafting ------------------------------------------------------------------------
    def continuations(self, history: Sequence[int], max_n: int, length: int,
                      max_count: int) -> tuple[int, list[tuple[int, ...]]]:
        """What the shared buffer holds after the end of `history`: (n, continuations), n the
        longest context (at most `max_n` tokens) found in the last finished index, and up to
        `max_count` of its occurrences' continuations (`length` tokens at most, evenly sampled);
        (0, []) when nothing matches or no index is built yet. Never waits for a rebuild, and
        does not search the request in progress (it is not in the buffer yet)."""
        with self._lock:
            index = self.index
        if index is None:
            return 0, []
        n, lo, hi = index.longest_match(history, max_n)
        return (n, index.continuations(lo, hi, length, max_count)) if n else (0, [])

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        _, conts = self.continuations(history, self.max_n, self.length, self.max_count)
        own = self._own_matches(history, 1)
        conts = own * 4 + conts  # the request in progress is the best predictor of itself
        if not conts:
            return DraftTree.empty()
        return trie_tree(conts, min(self.top_k, budget), chain=max_branching == 1)

    def _own_matches(self, history: Sequence[int], min_n: int) -> list[tuple[int, ...]]:
        """Continuations of the longest context (>= min_n tokens) found earlier in this request."""
        seq = np.asarray(self._request[-4096:], np.int32)
        for n in range(min(self.max_n, len(seq) - 1, 4), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                return [tuple(seq[h + n : h + n + self.length].tolist()) for h in hits[-4:] if h + n < len(seq)]
        return []
