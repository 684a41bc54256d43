"""N-gram drafter (akunu's predictor, ../shared/seeds/ngram-predictor.md).

Count tables for orders 2, 3 and 4 map an FNV-1a hash of the last 1, 2 or 3 tokens to the counts
of the token that followed. A draft is a chain: look up the longest context first, back off to
shorter ones, take its most frequent continuation, append it to the context and repeat. As in the
seed, only the context history is windowed (512 tokens); the count tables keep every count, up to
`max_contexts` contexts per order (a server runs for hours: past that, the half first seen is
dropped). Among equally frequent continuations the most recently counted one wins.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from ..tree import DraftTree
from .base import Drafter

FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211
MASK64 = (1 << 64) - 1


def fnv1a(tokens: Sequence[int]) -> int:
    """FNV-1a 64-bit over token ids (each id is XORed in whole, as akunu does)."""
    h = FNV_OFFSET
    for t in tokens:
        h = ((h ^ t) * FNV_PRIME) & MASK64
    return h


class NGramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_draft: int = 4, min_order: int = 2, max_order: int = 4, window: int = 512,
                 max_contexts: int = 1 << 17):
        if not 2 <= min_order <= max_order:
            raise ValueError("need 2 <= min_order <= max_order")
        if max_contexts < 2:
            raise ValueError(f"max_contexts must be >= 2 (got {max_contexts})")
        self.max_draft = max_draft
        self.orders = range(max_order, min_order - 1, -1)  # longest context first
        self.window = window
        self.max_contexts = max_contexts
        self.reset()

    def reset(self) -> None:
        self.history: deque[int] = deque(maxlen=self.window)
        # per order: context hash -> [counts {token: n}, best token, best count]
        self.tables: dict[int, dict[int, list]] = {n: {} for n in self.orders}

    def _count(self, order: int, context: Sequence[int], token: int) -> None:
        table = self.tables[order]
        h = fnv1a(context)
        entry = table.get(h)
        if entry is None:
            table[h] = [{token: 1}, token, 1]
            if len(table) > self.max_contexts:  # keep the newer half (dicts keep insertion order)
                keep = list(table.items())[len(table) // 2 :]
                table.clear()
                table.update(keep)
            return
        counts = entry[0]
        n = counts.get(token, 0) + 1
        counts[token] = n
        if n >= entry[2]:
            entry[1], entry[2] = token, n

    def observe(self, tokens: Sequence[int]) -> None:
        hist = self.history
        for t in tokens:
            t = int(t)
            for order in self.orders:
                k = order - 1
                if len(hist) >= k:
                    self._count(order, [hist[i] for i in range(len(hist) - k, len(hist))], t)
            hist.append(t)

    def predict_next(self, context: list[int]) -> int | None:
        """The most frequent continuation of the longest known context, or None."""
        for order in self.orders:
            k = order - 1
            if len(context) >= k:
                entry = self.tables[order].get(fnv1a(context[-k:]))
                if entry is not None:
                    return entry[1]
        return None

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        context = list(history[-(max(self.orders) - 1):])
        draft: list[int] = []
        for _ in range(min(self.max_draft, budget)):
            nxt = self.predict_next(context)
            if nxt is None:
                break
            draft.append(nxt)
            context.append(nxt)
        return DraftTree.chain(draft)
