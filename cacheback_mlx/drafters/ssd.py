"""SSD, suffix speculative decoding (../shared/seeds/ssd.md): drafts from everything served before.

Every finished request's tokens (prompt + output) go into one bounded circular buffer shared by
all requests (SharedBuffer: every drafter on a store in a process, such as a server's lanes), and
kept on disk between runs (ssd_store.py: one store per tokenizer, shared by every process using
it), so the runtime drafts better the more it is used. A
suffix array over the buffer is rebuilt in a background thread after each request; queries use
the last finished index and never wait for a rebuild. The request in progress is searched too
(its own history), since it is not in the index yet. Drafts: the most frequent continuations of
the longest matching context, merged into a small tree.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
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


class SharedBuffer:
    """A store's buffer and its suffix index, one per store in a process: every SsdDrafter on
    that store (a server's lanes, each with a drafter of its own) drafts from what any of them
    served as soon as that request ends. Appends go to the store on disk, which also brings in
    what other processes served meanwhile (ssd_store.py). The index is rebuilt in a background
    thread after each append, again while appends arrived during a rebuild; queries take the last
    finished index."""

    _open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (folder, capacity) -> buffer
    _open_lock = threading.Lock()

    @classmethod
    def of(cls, path: Path, capacity: int, persist: bool) -> "SharedBuffer":
        """The buffer of the store at `path` (a new one while no drafter holds it; one of its own
        without persist)."""
        if not persist:
            return cls(None, capacity)
        key = (str(Path(path).resolve()), capacity)
        with cls._open_lock:
            shared = cls._open.get(key)
            if shared is None:
                shared = cls._open[key] = cls(SsdStore(path, capacity), capacity)
            return shared

    def __init__(self, store: SsdStore | None, capacity: int):
        self.store, self.capacity = store, capacity
        self.buffer = self._load()  # chronological tokens, at most `capacity`
        self.index: SuffixIndex | None = None
        self._lock = threading.Lock()  # guards index, buffer and the rebuild's state
        self._append_lock = threading.Lock()
        self._dirty, self._thread = False, None
        self._start_rebuild()

    def _load(self) -> np.ndarray:
        if self.store is None:
            return np.zeros(0, np.int32)
        try:
            return self.store.load()
        except OSError as e:
            log.warning("ssd: cannot read the store %s: %s; starting empty", self.store.folder, e)
            return np.zeros(0, np.int32)

    def append(self, record: np.ndarray) -> None:
        with self._append_lock:
            if self.store is not None:
                try:  # also brings in what other processes served meanwhile
                    buffer = self.store.append(record, self.buffer)
                except OSError as e:
                    log.warning("ssd: cannot write the store %s: %s", self.store.folder, e)
                    buffer = np.concatenate([self.buffer, record])[-self.capacity:]
            else:
                buffer = np.concatenate([self.buffer, record])[-self.capacity:]
            with self._lock:
                self.buffer = buffer
        self._start_rebuild()

    def _start_rebuild(self) -> None:
        with self._lock:
            if not len(self.buffer):
                return
            self._dirty = True
            if self._thread is not None:  # it indexes the new buffer when it is done
                return
            self._thread = threading.Thread(target=self._rebuild, daemon=True, name="ssd-index")
            thread = self._thread
        thread.start()

    def _rebuild(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._dirty:
                        self._thread = None
                        return
                    self._dirty, buf = False, self.buffer
                index = SuffixIndex(buf)
                with self._lock:
                    self.index = index
        except Exception:  # the last index stays; the next append tries again
            log.exception("ssd: indexing the buffer failed")
            with self._lock:
                self._thread = None

    def wait(self) -> None:
        """Block until the index covers the whole buffer."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()


class SsdDrafter(Drafter):
    name = "ssd"

    def __init__(self, path: str | Path | None = None, capacity: int = 4_000_000, max_n: int = 16,
                 length: int = 10, top_k: int = 16, max_count: int = 64, persist: bool = True,
                 fingerprint: str | None = None):
        """path: the store's folder (default: one per tokenizer `fingerprint` under the user's
        cache); persist=False keeps the buffer in memory only, this drafter's own."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token (got {capacity})")
        self.path = Path(path) if path else default_path(fingerprint)
        self.capacity, self.max_n, self.length = capacity, max_n, length
        self.top_k, self.max_count, self.persist = top_k, max_count, persist
        self.shared = SharedBuffer.of(self.path, capacity, persist)
        self._request: list[int] = []

    store = property(lambda self: self.shared.store, doc="The store on disk (None without persist).")
    buffer = property(lambda self: self.shared.buffer, doc="Every token served (the last `capacity`).")

    def wait(self) -> None:
        """Block until a background rebuild finishes (tests, and before exit)."""
        self.shared.wait()

    def observe(self, tokens: Sequence[int]) -> None:
        self._request.extend(int(t) for t in tokens)

    def end_request(self) -> None:
        """The request is done: add its tokens to the shared buffer and re-index in the background."""
        if not self._request:
            return
        new = np.asarray(self._request + [SEP], np.int32)
        self._request = []
        self.shared.append(new)

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
        with self.shared._lock:
            index = self.shared.index
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
