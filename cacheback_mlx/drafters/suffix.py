"""Suffix-array retrieval shared by the REST and SSD drafters.

The suffix array is built over the REVERSED token sequence (pydivsufsort, O(n)). A query context
read backwards from its last token then matches suffixes of the reversed text, and taking one
more token of context only narrows the current range: the longest match costs one pair of
binary searches per context token, O(n_max log n), with no re-search from scratch per length.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

SEP = np.iinfo(np.int32).max  # document separator: never a token, never continued across


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    from pydivsufsort import divsufsort

    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    return divsufsort(tokens) if len(tokens) else np.zeros(0, np.int32)


def padded_length(n: int) -> int:
    """n rounded up to one of ~8 sizes per doubling. pydivsufsort makes a new ctypes type for every
    input length and ctypes keeps each one for good, so an index rebuilt after every request (SSD)
    would otherwise grow a server's memory by a few KB per request, without bound."""
    step = max(1024, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _ints(a: np.ndarray) -> memoryview:
    """A memoryview of native int32s (some arrays carry an explicit '<i' format it can't index)."""
    a = np.ascontiguousarray(a, dtype=np.int32)
    return memoryview(a) if memoryview(a).format == "i" else memoryview(a.astype(np.int32))


class SuffixIndex:
    """Longest-suffix queries over a token sequence, kept only in reversed order (so a datastore's
    arrays can be memory-mapped as they are on disk, with no copy)."""

    def __init__(self, tokens: np.ndarray | None = None, sa: np.ndarray | None = None,
                 reversed_tokens: np.ndarray | None = None):
        """Give `tokens`, or `reversed_tokens` (tokens[::-1]) as stored; `sa` is the suffix array
        of the reversed sequence (built when None)."""
        if reversed_tokens is None:
            reversed_tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32)[::-1])
        self.n = len(reversed_tokens)  # tokens indexed
        if sa is None:  # SEPs past the start of the text: never matched, never read as a continuation
            pad = padded_length(self.n) - self.n
            reversed_tokens = np.concatenate([reversed_tokens, np.full(pad, SEP, np.int32)])
        self.rev = reversed_tokens
        self.sa = suffix_array(self.rev) if sa is None else sa
        self._rev = _ints(self.rev)  # fast scalar reads in the binary searches
        self._sa = _ints(self.sa)
        self._end = len(self.rev)  # the padding's SEPs included

    @property
    def nbytes(self) -> int:
        return int(self.rev.nbytes + self.sa.nbytes)

    def _key(self, i: int, k: int) -> int:
        p = self._sa[i] + k
        return self._rev[p] if p < self._end else -1  # a suffix that ends sorts first

    def _bound(self, lo: int, hi: int, k: int, token: int, upper: bool) -> int:
        while lo < hi:
            mid = (lo + hi) // 2
            v = self._key(mid, k)
            if v < token or (upper and v == token):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def longest_match(self, context: Sequence[int], max_n: int = 16) -> tuple[int, int, int]:
        """(n, lo, hi): the longest n <= max_n such that the last n context tokens occur, and the
        suffix-array range [lo, hi) of their occurrences."""
        lo, hi, best = 0, self._end, (0, 0, 0)
        for k in range(min(max_n, len(context))):
            t = int(context[-1 - k])
            lo, hi = self._bound(lo, hi, k, t, False), self._bound(lo, hi, k, t, True)
            if lo >= hi:
                break
            best = (k + 1, lo, hi)
        return best

    def continuations(self, lo: int, hi: int, length: int, max_count: int = 64) -> list[tuple[int, ...]]:
        """The tokens after up to max_count occurrences in [lo, hi) (evenly sampled), cut at SEP.
        One numpy gather for all occurrences, not a Python slice per occurrence."""
        count = hi - lo
        picks = np.arange(lo, hi) if count <= max_count else np.linspace(lo, hi - 1, max_count).astype(np.int64)
        ends = np.asarray(self.sa[picks], dtype=np.int64)  # a match starts here in the reversed sequence;
        where = ends[:, None] - 1 - np.arange(length)  # what follows it lies just before, backwards
        conts = np.asarray(self.rev[np.maximum(where, 0)])
        conts[(where < 0) | (np.cumsum(conts == SEP, axis=1) > 0)] = SEP  # cut at the text's start or a SEP
        lengths = (conts != SEP).sum(axis=1).tolist()  # everything from the first SEP on is SEP now
        return [tuple(row[:n]) for row, n in zip(conts.tolist(), lengths) if n]


def trie_tree(continuations: Sequence[Sequence[int]], budget: int, weights: Sequence[float] | None = None,
              chain: bool = False):
    """Merge continuations into a trie weighted by how many pass through each node; keep the
    `budget` heaviest nodes (ties: shallower, then first seen; ancestors weigh at least as much as
    descendants, so the kept set is a tree) and return them as a DraftTree in BFS order. With
    `chain`, only the heaviest path (the heaviest child at each level, `budget` deep at most)."""
    from ..tree import DraftTree

    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    weight: list[float] = []
    grouped: dict[tuple, float] = {}  # identical continuations (cut to the budget's depth) merge
    for j, cont in enumerate(continuations):
        key = tuple(cont[:budget])
        grouped[key] = grouped.get(key, 0.0) + (1.0 if weights is None else float(weights[j]))
    for cont, w in grouped.items():
        node = -1
        for t in cont:
            nxt = child.get((node, t))
            if nxt is None:
                nxt = child[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
                depth.append(1 if node < 0 else depth[node] + 1)
                weight.append(0.0)
            weight[nxt] += w
            node = nxt
    if chain:
        path, node = [], -1
        while len(path) < budget:
            kids = [i for i in range(len(tokens)) if parents[i] == node]
            if not kids:
                break
            node = min(kids, key=lambda i: (-weight[i], i))
            path.append(tokens[node])
        return DraftTree.chain(path)
    keep = heapq.nsmallest(max(budget, 0), range(len(tokens)), key=lambda i: (-weight[i], depth[i], i))
    keep.sort(key=lambda i: (depth[i], -weight[i], i))  # BFS; parents (shallower, heavier) first
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep])
