"""Prompt lookup decoding: find the last n tokens (n = max_ngram .. min_ngram) earlier in the
prompt and output, and draft what followed their most recent occurrence, as a chain."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..tree import DraftTree
from .base import Drafter


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10):
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft
        self.reset()

    def reset(self) -> None:
        self._buf = np.zeros(1024, np.int32)
        self._len = 0

    def observe(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if self._len + n > len(self._buf):
            self._buf = np.resize(self._buf, max(2 * len(self._buf), self._len + n))
        self._buf[self._len : self._len + n] = tokens
        self._len += n

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        seq = self._buf[: self._len]
        want = min(self.max_draft, budget)
        if want <= 0:
            return DraftTree.empty()
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent earlier occurrence
                return DraftTree.chain(seq[start : start + want])
        return DraftTree.empty()
