"""Build Cacheback frozen tables from a corpus, in bounded memory.

Every window of LL+FL tokens is one (leader, follower) observation. Windows are packed into two
int64 keys and counted with numpy per chunk; chunk counts are merged into one sorted array of
distinct pairs. If that array outgrows `max_pairs`, pairs seen once are dropped (lossy counting),
which keeps memory bounded on any corpus at a small cost in accuracy for rare pairs. At the end the
LC leaders with the most observations keep their FC most frequent followers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from .drafters.lru_table import FrozenTable, pack
from .errors import CachebackError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".html", ".toml", ".yaml", ".yml"}


def unpack(keys: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(keys), width), np.int32)
    for j in range(width - 1, -1, -1):
        out[:, j] = keys & ((1 << 21) - 1)
        keys = keys >> 21
    return out


class PairCounter:
    """Counts (leader, follower) windows; memory bounded by max_pairs distinct pairs."""

    def __init__(self, ll: int, fl: int, max_pairs: int = 20_000_000):
        if ll > 3 or fl > 3:
            raise CachebackError("frozen tables support LL and FL of at most 3 tokens")
        self.ll, self.fl, self.max_pairs = ll, fl, max_pairs
        self.lead = np.zeros(0, np.int64)
        self.follow = np.zeros(0, np.int64)
        self.count = np.zeros(0, np.int64)
        self.windows = 0

    def add(self, documents: Iterable) -> None:
        """Count the windows of each document (windows never span two documents)."""
        span = self.ll + self.fl
        leads, follows = [], []
        for tokens in documents:
            tokens = np.asarray(tokens, np.int64)
            if len(tokens) < span:
                continue
            if tokens.max(initial=0) >= (1 << 21):
                raise CachebackError("token ids must be < 2^21 for frozen tables")
            win = np.lib.stride_tricks.sliding_window_view(tokens, span)
            leads.append(pack(win[:, : self.ll]))
            follows.append(pack(win[:, self.ll :]))
        if leads:
            lead, follow = np.concatenate(leads), np.concatenate(follows)
            self.windows += len(lead)
            self._merge(lead, follow, np.ones(len(lead), np.int64))

    def _merge(self, lead, follow, count) -> None:
        lead = np.concatenate([self.lead, lead])
        follow = np.concatenate([self.follow, follow])
        count = np.concatenate([self.count, count])
        order = np.lexsort((follow, lead))
        lead, follow, count = lead[order], follow[order], count[order]
        starts = np.flatnonzero(np.r_[True, (lead[1:] != lead[:-1]) | (follow[1:] != follow[:-1])])
        self.lead, self.follow = lead[starts], follow[starts]
        self.count = np.add.reduceat(count, starts) if len(count) else count
        if len(self.lead) > self.max_pairs:
            keep = self.count > 1
            self.lead, self.follow, self.count = self.lead[keep], self.follow[keep], self.count[keep]

    def table(self, lc: int, fc: int, fingerprint: str = "") -> FrozenTable:
        """The top-LC leaders (by observations), each with its top-FC followers."""
        if not len(self.lead):
            raise CachebackError("the corpus produced no leader-follower windows")
        starts = np.flatnonzero(np.r_[True, self.lead[1:] != self.lead[:-1]])
        per_leader = np.add.reduceat(self.count, starts)
        top = np.sort(np.argsort(-per_leader, kind="stable")[:lc])  # keep key order
        ends = np.r_[starts[1:], len(self.lead)]
        leaders, followers, offsets = [], [], [0]
        for i in top:
            s, e = starts[i], ends[i]
            best = s + np.argsort(-self.count[s:e], kind="stable")[:fc]
            leaders.append(self.lead[s])
            followers.append(self.follow[best])
            offsets.append(offsets[-1] + len(best))
        return FrozenTable(unpack(np.array(leaders, np.int64), self.ll),
                           unpack(np.concatenate(followers), self.fl), np.array(offsets, np.int64), fingerprint)


def build_frozen_table(token_streams: Iterable, ll: int = 1, fl: int = 3, lc: int = 1 << 20, fc: int = 128,
                       fingerprint: str = "", max_pairs: int = 20_000_000) -> FrozenTable:
    counter = PairCounter(ll, fl, max_pairs)
    counter.add(token_streams)
    return counter.table(lc, fc, fingerprint)


def corpus_texts(paths: Iterable[str | Path]) -> Iterator[tuple[Path, str]]:
    """(file, text) for text files, folders (recursively) and JSONL files ("text" field, or every
    string field)."""
    paths = [Path(p) for p in paths]
    for p in paths:  # fail before any output
        if not p.exists():
            raise CachebackError(f"corpus path not found: {p}")
    for p in paths:
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES) if p.is_dir() else [p]
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if f.suffix.lower() == ".jsonl":
                for line in text.splitlines():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(rec, dict):
                        texts = [rec["text"]] if isinstance(rec.get("text"), str) else [v for v in rec.values() if isinstance(v, str)]
                        for t in texts:
                            yield f, t
            else:
                yield f, text


def build_table_from_files(paths, tokenizer, out: str | Path, ll: int = 1, fl: int = 3, lc: int = 1 << 20,
                           fc: int = 128, max_pairs: int = 20_000_000, progress: bool = True) -> FrozenTable:
    """Tokenize a corpus with `tokenizer` and save its frozen table to `out` (.npz)."""
    from .tokenizer import vocab_fingerprint

    paths = [Path(p) for p in paths]
    for p in paths:  # fail before any progress output
        if not p.exists():
            raise CachebackError(f"corpus path not found: {p}")
    counter = PairCounter(ll, fl, max_pairs)
    texts = tqdm(corpus_texts(paths), desc="tokenizing", unit=" docs", disable=not progress)
    batch, size = [], 0
    for _, text in texts:
        batch.append(tokenizer.encode(text, add_special_tokens=False))
        size += len(batch[-1])
        if size > 2_000_000:  # count in chunks: memory stays bounded by the chunk + the counts
            counter.add(batch)
            batch, size = [], 0
            texts.set_postfix(windows=counter.windows, pairs=len(counter.lead))
    counter.add(batch)
    table = counter.table(lc, fc, vocab_fingerprint(tokenizer))
    table.save(out)
    return table
