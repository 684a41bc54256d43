"""REST (../shared/seeds/rest.md): retrieval from a datastore built offline from a corpus.

The datastore is the corpus's token ids with a suffix array, saved as .npy files in a folder and
opened with memory mapping. Each step finds the longest suffix of the context (n_max=16 down to 1)
in it, merges up to `max_count` continuations of length 10 into a trie, and drafts the top-c
heaviest nodes as a tree.

One small datastore ships with the package (`shipped_datastore`): the default model's own answers
(tools/self_corpus.py), which `auto` draws from when the model's tokenizer is the one it was built
with.
"""

from __future__ import annotations

import json
import logging
import time
import zipfile
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import CachebackError
from ..tree import DraftTree
from .base import Drafter
from .suffix import SEP, SuffixIndex, suffix_array, trie_tree

FORMAT = "cacheback-rest-datastore/2"  # /2: reversed tokens on disk, mapped as they are
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "self_answers_smollm2.npz"

log = logging.getLogger(__name__)


def concatenate(token_streams: Iterable[Sequence[int]]) -> np.ndarray:
    """Documents as one int32 sequence, each followed by SEP (no continuation crosses one)."""
    parts = [np.append(np.asarray(t, np.int32), np.int32(SEP)) for t in token_streams]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def save_datastore(token_streams: Iterable[Sequence[int]], out: str | Path, fingerprint: str = "") -> dict:
    """Concatenate documents (separated by SEP), build the suffix array, write out/ (atomically)."""
    out = Path(out)
    tokens = concatenate(token_streams)
    if not len(tokens):
        raise CachebackError("the corpus produced no tokens")
    t0 = time.perf_counter()
    rev = np.ascontiguousarray(tokens[::-1])
    sa = suffix_array(rev)
    meta = {"format": FORMAT, "tokens": int(len(tokens)), "fingerprint": fingerprint,
            "build_seconds": round(time.perf_counter() - t0, 2)}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "reversed_tokens.npy", rev)
    np.save(tmp / "suffix_array.npy", sa)
    (tmp / "meta.json").write_text(json.dumps(meta))
    if out.exists():
        for f in out.iterdir():
            f.unlink()
        out.rmdir()
    tmp.rename(out)
    return meta


def load_datastore(path: str | Path, fingerprint: str | None = None) -> tuple[SuffixIndex, dict]:
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise CachebackError(f"REST datastore {path} has format {meta.get('format')!r}, not {FORMAT!r}; rebuild it")
        rev = np.load(path / "reversed_tokens.npy", mmap_mode="r")
        sa = np.load(path / "suffix_array.npy", mmap_mode="r")
    except FileNotFoundError:
        raise CachebackError(f"REST datastore not found: {path} "
                             "(build one with `cacheback-mlx build-datastore`)") from None
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise CachebackError(f"cannot read REST datastore {path} (corrupt?): {e}") from None
    if rev.dtype != np.int32 or sa.dtype != np.int32 or len(rev) != len(sa) or len(rev) != meta.get("tokens"):
        raise CachebackError(f"REST datastore {path} is inconsistent (corrupt?)")
    if fingerprint is not None and meta.get("fingerprint") not in ("", fingerprint):
        raise CachebackError(f"REST datastore {path} was built for another tokenizer; rebuild it")
    return SuffixIndex(sa=sa, reversed_tokens=rev), meta


def save_shipped(token_streams: Iterable[Sequence[int]], out: str | Path, fingerprint: str) -> int:
    """The shipped form of a small datastore: its documents' tokens (SEP between them) and the
    tokenizer's fingerprint, compressed; the suffix array is built when it is loaded (~0.03 s for
    the 0.25M tokens shipped), so the package carries no index. Returns the tokens written."""
    tokens = concatenate(token_streams)
    np.savez_compressed(out, tokens=tokens, fingerprint=np.array(fingerprint))
    return int(len(tokens))


@lru_cache(maxsize=1)
def _shipped() -> tuple[SuffixIndex, str] | None:
    if not SHIPPED.is_file():
        return None
    try:
        with np.load(SHIPPED) as f:
            tokens, fingerprint = f["tokens"], str(f["fingerprint"])
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise ValueError(f"tokens of type {tokens.dtype}, {tokens.ndim} dimensions")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        log.warning("the shipped datastore %s is unreadable (%s: %s); drafting without it",
                    SHIPPED, type(e).__name__, e)
        return None
    return SuffixIndex(tokens=tokens), fingerprint


def shipped_datastore(fingerprint: str | None = None) -> SuffixIndex | None:
    """The default model's own greedy answers to ~1,900 chat, question and code prompts (none
    from the benchmark data; tools/self_corpus.py, rebuilt by tools/build_default_table.py), as
    a REST datastore: what the model tends to say, matched on up to 16 tokens of context, where
    the frozen table keys its followers on one. Loaded once per process and shared (read-only);
    None when it is missing or was built for another tokenizer than `fingerprint`'s."""
    shipped = _shipped()
    if shipped is None or fingerprint not in (None, shipped[1]):
        return None
    return shipped[0]


class RestDrafter(Drafter):
    name = "rest"

    def __init__(self, datastore: str | Path | SuffixIndex | None = None, max_n: int = 16, length: int = 10,
                 top_c: int = 64, max_count: int = 64, fingerprint: str | None = None):
        """datastore: a folder (`cacheback-mlx build-datastore`) or an index; None = the shipped
        one of the default model's answers, for that model's tokenizer."""
        if datastore is None:
            datastore = shipped_datastore(fingerprint)
        if datastore is None:
            raise CachebackError("the rest drafter needs a datastore for this model: build one with `cacheback-mlx "
                                 "build-datastore CORPUS --out DIR`, then pass --drafter-arg datastore=DIR")
        if isinstance(datastore, SuffixIndex):
            self.index, self.meta = datastore, {"tokens": datastore.n}
        else:
            self.index, self.meta = load_datastore(datastore, fingerprint)
        self.max_n, self.length, self.top_c, self.max_count = max_n, length, top_c, max_count
        self.retrieval_s, self.retrievals = 0.0, 0

    def continuations(self, history: Sequence[int], max_n: int, length: int,
                      max_count: int) -> tuple[int, list[tuple[int, ...]]]:
        """What the datastore holds after the end of `history`: (n, continuations), n the longest
        context (at most `max_n` tokens) found in it, and up to `max_count` of its occurrences'
        continuations (`length` tokens at most, evenly sampled); (0, []) when nothing matches."""
        n, lo, hi = self.index.longest_match(history, max_n)
        return (n, self.index.continuations(lo, hi, length, max_count)) if n else (0, [])

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        t0 = time.perf_counter()
        n, conts = self.continuations(history, self.max_n, self.length, self.max_count)
        tree = DraftTree.empty()
        if n:
            tree = trie_tree(conts, min(self.top_c, budget), chain=max_branching == 1)
        self.retrieval_s += time.perf_counter() - t0
        self.retrievals += 1
        return tree

    def stats(self) -> dict:
        """Datastore size (memory-mapped) and mean retrieval time (match + trie) per step."""
        return {"datastore_tokens": int(self.index.n), "datastore_mb": round(self.index.nbytes / 1e6, 1),
                "retrievals": self.retrievals,
                "mean_retrieval_ms": round(1e3 * self.retrieval_s / max(self.retrievals, 1), 3)}
