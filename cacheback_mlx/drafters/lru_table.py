"""Cacheback's tables: leader (LL tokens) -> followers (FL tokens).

LruTable is the dynamic table: at most LC leaders and FC followers per leader, both evicted
least-recently-used. Querying or inserting a leader refreshes it; a follower is refreshed only
when it is inserted again, and only among its own leader's followers. OrderedDict gives O(1)
lookup, insert and eviction, and bounds memory to LL*LC*FL*FC tokens.

FrozenTable is read-only, built offline from a corpus (table_builder.py): the LC most frequent
LL-grams with their FC most frequent following FL-grams. It is stored as numpy arrays in an .npz
(never pickle) together with a fingerprint of the tokenizer it was built with.
"""

from __future__ import annotations

import json
import zipfile
from collections import OrderedDict
from itertools import islice
from pathlib import Path

import numpy as np

from ..errors import CachebackError

Tokens = tuple[int, ...]
FORMAT = "cacheback-frozen-table/1"


class LruTable:
    def __init__(self, ll: int = 1, fl: int = 3, lc: int = 1 << 20, fc: int = 128):
        if min(ll, fl, lc, fc) < 1:
            raise ValueError("ll, fl, lc and fc must be >= 1")
        self.ll, self.fl, self.lc, self.fc = ll, fl, lc, fc
        self._leaders: OrderedDict[Tokens, OrderedDict[Tokens, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leaders)

    def put(self, leader: Tokens, follower: Tokens) -> None:
        followers = self._leaders.get(leader)
        if followers is None:
            followers = self._leaders[leader] = OrderedDict()
            if len(self._leaders) > self.lc:
                self._leaders.popitem(last=False)
        else:
            self._leaders.move_to_end(leader)
        if follower in followers:
            followers.move_to_end(follower)
        else:
            followers[follower] = None
            if len(followers) > self.fc:
                followers.popitem(last=False)

    def get(self, leader: Tokens, limit: int | None = None) -> list[Tokens]:
        """Followers of `leader`, most recently inserted first, at most `limit` of them
        (refreshes the leader)."""
        followers = self._leaders.get(leader)
        if followers is None:
            return []
        self._leaders.move_to_end(leader)
        return list(reversed(followers) if limit is None else islice(reversed(followers), limit))

    def leaders(self) -> list[Tokens]:
        """Leaders from least to most recently used (for tests and inspection)."""
        return list(self._leaders)

    def token_count(self) -> int:
        return sum(self.ll + self.fl * len(f) for f in self._leaders.values())

    def clear(self) -> None:
        self._leaders.clear()


class FrozenTable:
    """Read-only leader -> followers (most frequent first), looked up by binary search."""

    def __init__(self, leaders: np.ndarray, followers: np.ndarray, offsets: np.ndarray, fingerprint: str = ""):
        self.leaders = np.ascontiguousarray(leaders, dtype=np.int32)  # [n, LL], sorted rows
        self.followers = np.ascontiguousarray(followers, dtype=np.int32)  # [m, FL]
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)  # [n + 1]
        self.ll, self.fl = self.leaders.shape[1], self.followers.shape[1]
        self.fingerprint = fingerprint
        self._keys = pack(self.leaders)
        if len(self._keys) > 1 and np.any(np.diff(self._keys) <= 0):
            raise CachebackError("frozen table leaders are not sorted and unique")
        self._memo: dict[Tokens, list[Tokens]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, leader: Tokens) -> list[Tokens]:
        hit = self._memo.get(leader)
        if hit is not None:
            return hit
        key = pack(np.asarray([leader], np.int64))[0]
        i = int(np.searchsorted(self._keys, key))
        out: list[Tokens] = []
        if i < len(self._keys) and self._keys[i] == key:
            out = [tuple(r) for r in self.followers[self.offsets[i] : self.offsets[i + 1]].tolist()]
        if len(self._memo) > 65536:
            self._memo.clear()
        self._memo[leader] = out
        return out

    def save(self, path: str | Path) -> None:
        meta = {"format": FORMAT, "ll": self.ll, "fl": self.fl, "fingerprint": self.fingerprint}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, leaders=self.leaders, followers=self.followers, offsets=self.offsets,
                                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path, fingerprint: str | None = None) -> "FrozenTable":
        """Load a table; refuse one that is corrupt or was built for another tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise CachebackError(f"frozen table not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                leaders, followers, offsets = z["leaders"], z["followers"], z["offsets"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, json.JSONDecodeError) as e:
            raise CachebackError(f"cannot read frozen table {path} (truncated or corrupt?): {e}") from None
        if meta.get("format") != FORMAT:
            raise CachebackError(f"{path} is not a Cacheback frozen table")
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise CachebackError(f"frozen table {path} was built for another tokenizer "
                                 f"({meta.get('fingerprint')} != {fingerprint}); rebuild it with build-table")
        ok = (leaders.ndim == 2 and followers.ndim == 2 and offsets.shape == (len(leaders) + 1,)
              and leaders.shape[1] == meta["ll"] and followers.shape[1] == meta["fl"]
              and (len(offsets) == 0 or (offsets[0] == 0 and offsets[-1] == len(followers)))
              and np.all(np.diff(offsets) >= 0))
        if not ok:
            raise CachebackError(f"frozen table {path} is inconsistent (corrupt?)")
        return FrozenTable(leaders, followers, offsets, meta.get("fingerprint", ""))


def pack(rows: np.ndarray) -> np.ndarray:
    """One int64 key per row of up to 3 token ids (< 2^21 each), ordered like the rows."""
    rows = np.asarray(rows, np.int64)
    if rows.shape[1] > 3:
        raise CachebackError("frozen tables support leaders of at most 3 tokens")
    key = np.zeros(len(rows), np.int64)
    for j in range(rows.shape[1]):
        key = (key << 21) | rows[:, j]
    return key
