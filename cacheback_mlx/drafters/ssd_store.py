"""SSD's buffer on disk, shared by every process that uses the same tokenizer.

A store is a folder (one per tokenizer fingerprint) holding
- `base.npz`: the compacted buffer (int32 tokens, SEP between requests) and the generation G of
  the log that continues it;
- `log-G.bin`: the requests served since, appended one record each (magic, length, CRC32, then
  the int32 tokens), under a lock file, flushed and fsynced.
A process appends its own finished request and reads what other processes appended meanwhile,
so every request of every process ends up in the store, in the order they finished. Loading
reads the base and the log up to its first incomplete or corrupt record: a process killed
mid-append loses only that record (the next writer cuts it off). When the log grows past
`compact_bytes`, one writer folds it into a new base (written to a temporary file and renamed)
and starts log G+1; a reader that finds its log gone reloads from the new base. A corrupt base
is moved aside with a warning and the store starts over.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from filelock import FileLock

log = logging.getLogger(__name__)

MAGIC = 0x53534431  # "SSD1"
HEADER = struct.Struct("<III")  # magic, token count, crc32 of the token bytes


class SsdStore:
    def __init__(self, folder: str | Path, capacity: int, compact_bytes: int = 16 << 20):
        self.folder = Path(folder)
        self.capacity, self.compact_bytes = capacity, compact_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock = FileLock(str(self.folder / "lock"))
        self.gen = 0
        self.pos = 0  # bytes of the current log already read
        self.base_id: tuple | None = None  # the base file this process read (inode, mtime)

    # -- reading ---------------------------------------------------------------------------
    def _base_stat(self) -> tuple | None:
        try:
            st = os.stat(self.folder / "base.npz")
            return st.st_ino, st.st_mtime_ns, st.st_size
        except FileNotFoundError:
            return None

    def _base(self) -> np.ndarray:
        path = self.folder / "base.npz"
        self.gen = 0
        self.base_id = self._base_stat()
        if not path.is_file():
            return np.zeros(0, np.int32)
        try:
            with np.load(path, allow_pickle=False) as z:
                tokens, gen = z["tokens"], int(z["gen"])
            if tokens.ndim != 1 or tokens.dtype != np.int32:
                raise ValueError(f"unexpected array {tokens.dtype} {tokens.shape}")
            self.gen = gen
            return tokens
        except (OSError, ValueError, KeyError, EOFError, zipfile_error()) as e:
            aside = path.with_suffix(".corrupt")
            log.warning("ssd: %s is unreadable (%s); moved aside to %s", path, e, aside)
            os.replace(path, aside)
            self.base_id = None
            return np.zeros(0, np.int32)

    def _log_path(self, gen: int | None = None) -> Path:
        return self.folder / f"log-{self.gen if gen is None else gen}.bin"

    def _read_log(self, repair: bool) -> list[np.ndarray]:
        """Records from self.pos on, up to the first incomplete or corrupt one (cut off when
        `repair`: only under the lock, where no writer can be mid-record)."""
        path = self._log_path()
        out: list[np.ndarray] = []
        try:
            with open(path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return out
        at = 0
        while at + HEADER.size <= len(data):
            magic, n, crc = HEADER.unpack_from(data, at)
            body = data[at + HEADER.size : at + HEADER.size + 4 * n]
            if magic != MAGIC or len(body) < 4 * n or zlib.crc32(body) != crc:
                break
            out.append(np.frombuffer(body, dtype="<i4").astype(np.int32))
            at += HEADER.size + 4 * n
        if at < len(data) and repair:
            log.warning("ssd: %s has an incomplete last record (a writer was killed); cut off", path)
            with open(path, "r+b") as f:
                f.truncate(self.pos + at)
        self.pos += at
        return out

    def load(self) -> np.ndarray:
        """The whole buffer: base + log, the last `capacity` tokens."""
        with self.lock:
            return self._reload_locked()

    def _reload_locked(self) -> np.ndarray:
        base = self._base()
        self.pos = 0
        for old in self.folder.glob("log-*.bin"):  # folded into the base by a compaction that
            if old.stem[4:].isdigit() and int(old.stem[4:]) < self.gen:  # was killed before
                old.unlink(missing_ok=True)  # it could delete them
        parts = [base] + self._read_log(repair=True)
        return np.concatenate(parts)[-self.capacity:]

    # -- writing ---------------------------------------------------------------------------
    def append(self, record: np.ndarray, buffer: np.ndarray) -> np.ndarray:
        """Append one request's tokens; return `buffer` extended with everything appended to the
        store since this process last looked (other processes' requests and this one), or the
        whole store again when another process compacted it meanwhile."""
        record = np.ascontiguousarray(record, dtype="<i4")
        body = record.tobytes()
        with self.lock:
            if self._base_stat() != self.base_id:  # another process compacted (or set aside) the
                buffer, new = self._reload_locked(), []  # store: our log position means nothing now
            else:
                new = self._read_log(repair=True)
            with open(self._log_path(), "ab") as f:
                f.write(HEADER.pack(MAGIC, len(record), zlib.crc32(body)) + body)
                f.flush()
                os.fsync(f.fileno())
            self.pos += HEADER.size + len(body)
            buffer = np.concatenate([buffer, *new, record])[-self.capacity:]
            if self.pos > self.compact_bytes:
                self._compact_locked(buffer)
        return buffer

    def _compact_locked(self, buffer: np.ndarray) -> None:
        """Fold the log into a new base (atomic rename), then start the next log."""
        old = self._log_path()
        tmp = self.folder / f"base.{os.getpid()}.tmp.npz"
        with open(tmp, "wb") as f:
            np.savez(f, tokens=np.asarray(buffer, np.int32), gen=np.int64(self.gen + 1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / "base.npz")
        self.gen += 1
        self.pos = 0
        self.base_id = self._base_stat()
        old.unlink(missing_ok=True)


def zipfile_error():
    import zipfile

    return zipfile.BadZipFile
