"""Build Cacheback frozen tables from a corpus, in bounded memory.

Every window of LL+FL tokens is one (leader, follower) observation. Windows are packed into two
int64 keys (21 bits per token) and counted with numpy a chunk at a time; chunk counts are merged
into one sorted array of distinct pairs. If that array outgrows `max_pairs`, the rarest pairs are
dropped (lossy counting: pairs seen once first, then twice, ...), which bounds memory on any corpus
at a small cost in accuracy for rare pairs, which would not make the table anyway. At the end the
LC leaders with the most observations keep their FC most frequent followers.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from .drafters.lru_table import FrozenTable, pack
from .errors import CachebackError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".html", ".toml", ".yaml",
                 ".yml"}
CHUNK_TOKENS = 2_000_000  # tokens counted per numpy pass


def unpack(keys: np.ndarray, width: int) -> np.ndarray:
    """Inverse of lru_table.pack: [n] int64 keys -> [n, width] token ids."""
    out = np.zeros((len(keys), width), np.int32)
    for j in range(width - 1, -1, -1):
        out[:, j] = keys & ((1 << 21) - 1)
        keys = keys >> 21
    return out


class PairCounter:
    """Counts (leader, follower) windows; memory bounded by max_pairs distinct pairs."""

    def __init__(self, ll: int, fl: int, max_pairs: int = 20_000_000):
        if not (1 <= ll <= 3 and 1 <= fl <= 3):
            raise CachebackError("frozen tables support LL and FL of 1 to 3 tokens")
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
            if tokens.min() < 0 or tokens.max() >= (1 << 21):
                raise CachebackError("token ids must be in [0, 2^21) for frozen tables")
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
        rare = 1
        while len(self.lead) > self.max_pairs:
            keep = self.count > rare
            self.lead, self.follow, self.count = self.lead[keep], self.follow[keep], self.count[keep]
            rare += 1

    def table(self, lc: int, fc: int, fingerprint: str = "") -> FrozenTable:
        """The top-LC leaders (by observations), each with its top-FC followers (ties: smaller
        ids first, so a build is deterministic)."""
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
    """A frozen table from token id sequences (documents), counted a chunk at a time."""
    counter = PairCounter(ll, fl, max_pairs)
    streams = iter(token_streams)
    while True:
        batch, size = [], 0
        for doc in streams:
            batch.append(doc)
            size += len(doc)
            if size >= CHUNK_TOKENS:
                break
        if not batch:
            break
        counter.add(batch)
    return counter.table(lc, fc, fingerprint)


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files to read: each file given, and the text files under each folder (recursively)."""
    paths = [Path(p) for p in paths]
    for p in paths:  # fail before any output
        if not p.exists():
            raise CachebackError(f"corpus path not found: {p}")
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) in TEXT_SUFFIXES))
        else:
            files.append(p)
    return files


def _kind(path: Path) -> str:
    """The suffix that says what a file holds: ".jsonl" for both a.jsonl and a.jsonl.gz."""
    return Path(path.stem).suffix.lower() if path.suffix.lower() == ".gz" else path.suffix.lower()


def file_texts(path: Path) -> Iterator[str]:
    """The documents of one file (gzipped or not): the whole text, or per JSONL record its "text"
    field (or every string field). Unreadable files and bad JSON lines are skipped."""
    try:
        if path.suffix.lower() == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError, EOFError):
        return
    if _kind(path) != ".jsonl":
        yield text
        return
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            if isinstance(rec.get("text"), str):
                yield rec["text"]
            else:
                yield from (v for v in rec.values() if isinstance(v, str))


def corpus_texts(paths: Iterable[str | Path]) -> Iterator[tuple[Path, str]]:
    """(file, text) for text files, folders (recursively) and JSONL files."""
    for f in corpus_files(paths):
        for text in file_texts(f):
            yield f, text


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no special tokens, from any tokenizer with .encode(str)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))  # tokenizers.Encoding has .ids


def tokenizer_fingerprint(tokenizer) -> str:
    """The vocab fingerprint of a tokenizer that has a vocabulary; "" (unchecked) otherwise."""
    from .tokenizer import vocab_fingerprint

    try:
        return vocab_fingerprint(tokenizer)
    except AttributeError:
        return ""


def build_table_from_files(paths, tokenizer, out: str | Path, ll: int = 1, fl: int = 3, lc: int = 1 << 20,
                           fc: int = 128, fingerprint: str | None = None, max_pairs: int = 20_000_000,
                           progress: bool = True) -> FrozenTable:
    """Tokenize a corpus (text files, folders, JSONL) with `tokenizer` and save its frozen table to
    `out` (.npz). fingerprint: the tokenizer's vocab fingerprint (computed when None)."""
    if fingerprint is None:
        fingerprint = tokenizer_fingerprint(tokenizer)
    files = corpus_files(paths)
    bar = tqdm(files, desc="tokenizing", unit=" files", disable=not progress)

    def documents():
        tokens = 0
        for f in bar:
            for text in file_texts(f):
                ids = encode(tokenizer, text)
                tokens += len(ids)
                yield ids
            bar.set_postfix(tokens=tokens, refresh=False)

    table = build_frozen_table(documents(), ll, fl, lc, fc, fingerprint, max_pairs)
    table.save(out)
    return table
