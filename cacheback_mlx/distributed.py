"""Speculative decoding on a model sharded over several processes (several Macs) with mx.distributed.

`mlx.launch` starts the same command on every rank (ring or JACCL backend), e.g.

    mlx.launch --hostfile hosts.json -- cacheback-mlx generate --distributed tensor -m MODEL "..."

Every rank loads its shard with mlx-lm's own `sharded_load` (tensor: `model.shard(group)`,
pipeline: `model.model.pipeline(group)`). Rank 0 owns the tokenizer, the drafter and the front end
(generate, chat, serve) and runs the Engine with a Leader as its `peers`; the other ranks run
`follow`, which mirrors each of the engine's cache operations on its own shard:

    rank 0: Engine + Leader                      ranks > 0: follow()
    trim(length)      queued ------------------>  cache.trim(length)
    finish(rows)      queued ------------------>  cache.finish_pass(rows, whole)
    prefill(tokens)   sent with the queue ----->  prefill(tokens)      } the model's own collectives
    verify(lead,tree) sent with the queue ----->  verify_pass(...)     } run on every rank
    stop()            sent with the queue ----->  return

The model's forward pass has collectives of its own (tensor: an all_sum in each sharded linear;
pipeline: send/recv between stages, then an all_gather of the last hidden state), so every rank
must run the same passes in the same order: that is all a follower does. Every rank computes the
logits; rank 0 alone picks and accepts, and its accepted rows reach the others in FINISH. Only
MLX's collectives carry messages: a message is int32s broadcast by all_sum with zeros on the other
ranks, one collective of MSG ints (more only for a long prompt), so a step costs the model's own
round trips plus one.

A rank that dies closes its sockets. The ring backend then usually fails the others' collectives
within a second ("connection to a peer was lost"), reported in one line; but a collective started
after that may block for good. So everything that must finish (joining the group, the agreement
check, each announced pass on every rank) runs under a watchdog (CACHEBACK_MLX_DIST_TIMEOUT
seconds, default 60) that ends the process with a one-line error; and while rank 0 runs no pass
(a server idles, a chat waits for input) it sends an empty message every HEARTBEAT s, so a
follower whose rank 0 is gone ends after silence() s (CACHEBACK_MLX_DIST_SILENCE, default 15), and
rank 0, whose heartbeat then does not go through in as long, learns that a follower is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import models as manifests
from .errors import CachebackError
from .loader import LoadedModel, default_dtype
from .tree import DraftTree
from .verify import prefill, verify_pass

MODES = ("tensor", "pipeline")
MSG = 64  # ints per broadcast; a longer message takes a second collective
TRIM, PREFILL, VERIFY, FINISH, STOP = 1, 2, 3, 4, 5
HEARTBEAT = 1.0  # seconds between rank 0's empty messages while no pass runs
SILENCE = 15.0  # seconds without a word from rank 0 after which a follower gives up (silence())
TENSOR_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def broadcast(group, ints: list[int] | None) -> list[int]:
    """Rank 0's ints on every rank (others pass None). The first collective carries the length."""
    mine = group.rank() == 0
    head = np.zeros(MSG, np.int32)
    if mine:
        body = np.asarray([len(ints)] + list(ints), np.int32)
        head[: min(MSG, len(body))] = body[:MSG]
    head = np.array(mx.distributed.all_sum(mx.array(head), group=group, stream=mx.cpu))
    n = int(head[0])
    if n + 1 <= MSG:
        return head[1 : n + 1].tolist()
    rest = body[MSG:] if mine else np.zeros(n + 1 - MSG, np.int32)
    rest = np.array(mx.distributed.all_sum(mx.array(rest), group=group, stream=mx.cpu))
    return head[1:].tolist() + rest.tolist()


class Watchdog:
    """Ends the process with a one-line error when an armed block outlives its limit. A
    collective waiting on a rank that is gone may block for good (the ring backend does not
    always fail it), and a blocked collective cannot be interrupted otherwise."""

    def __init__(self):
        self.deadline: float | None = None
        self.why = ""
        threading.Thread(target=self._watch, daemon=True, name="cacheback-watchdog").start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                fail(self.why)

    @contextmanager
    def armed(self, why: str, seconds: float):
        self.why, self.deadline = why, time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = None


_watchdog: Watchdog | None = None


def silence() -> float:
    """Seconds without a word from rank 0 after which a follower gives up, and that rank 0's
    heartbeat may take before rank 0 gives a follower up (CACHEBACK_MLX_DIST_SILENCE, SILENCE)."""
    return _seconds("CACHEBACK_MLX_DIST_SILENCE", SILENCE)


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise CachebackError(f"{name} must be a number of seconds above 0 (got {value!r})")
    return seconds


def watch(what: str, seconds: float | None = None):
    """A block that must finish within `seconds` (default CACHEBACK_MLX_DIST_TIMEOUT, 60)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog()
    if seconds is None:
        seconds = _seconds("CACHEBACK_MLX_DIST_TIMEOUT", 60.0)
        why = (f"{what} did not finish in {seconds:.0f} s: a rank is gone or stuck "
               "(CACHEBACK_MLX_DIST_TIMEOUT sets the limit)")
    else:
        why = f"{what} for {seconds:.0f} s: gone or stuck"
    return _watchdog.armed(why, seconds)


def fail(message: str) -> None:
    """One line, then out at once: the group is broken for good (a server would otherwise fail
    every request; exit handlers would wait on collectives that never finish)."""
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Leader:
    """Rank 0's side: the Engine's `peers`. Operations that run no model pass (trim, finish) are
    queued and go out with the next one that does (prefill, verify) or with stop; those two are
    context managers around the local pass, which runs under the watchdog. While no pass runs, a
    heartbeat (an empty message every HEARTBEAT s) tells the followers that rank 0 lives, and
    rank 0 that they do."""

    def __init__(self, group):
        self.group = group
        self.queue: list[int] = []
        self.stopped = False
        self.in_pass = False  # a verify pass was announced and its finish not yet
        self.lock = threading.Lock()  # one message or pass at a time, heartbeats included
        self.last = time.monotonic()
        self.silence = silence()  # read once here, not in the heartbeat's thread
        threading.Thread(target=self._heartbeat, daemon=True, name="cacheback-heartbeat").start()

    def _post(self, op: int, ints) -> None:
        self.queue += [op, len(ints), *ints]

    def _send(self, ints: list[int], what: str, seconds: float | None = None):
        """Broadcast under watch; a lost link ends rank 0 here, in one line."""
        try:
            with watch(what, seconds):
                broadcast(self.group, ints)
        except RuntimeError as e:
            if is_link_error(e):
                fail(f"lost a rank of the distributed group ({str(e).splitlines()[0]})")
            raise
        finally:
            self.last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self.stopped:
            time.sleep(HEARTBEAT / 4)
            if time.monotonic() - self.last >= HEARTBEAT and self.lock.acquire(blocking=False):
                try:
                    if not self.stopped:
                        self._send([], "the other ranks have not answered rank 0's heartbeat", self.silence)
                finally:
                    self.lock.release()

    @contextmanager
    def _run(self, what: str):
        """Send the queue, then run the caller's block (the same pass here), all under watch."""
        with self.lock:
            if self.stopped:
                fail("the ranks are out of step after an interrupted pass; start them again")
            queue, self.queue = self.queue, []
            self._send(queue, what)
            try:
                with watch(what):
                    yield
            except BaseException as e:
                if is_link_error(e):
                    fail(f"lost a rank of the distributed group ({str(e).splitlines()[0]})")
                self.stopped = True  # the ranks may be out of step (Ctrl-C, a bug): no more messages
                raise
            finally:
                self.last = time.monotonic()

    def trim(self, length: int, kept: int) -> None:
        self._post(TRIM, [length, kept])

    def prefill(self, tokens: list[int]):
        self._post(PREFILL, tokens)
        return self._run("a prefill")

    def verify(self, lead: list[int], tree: DraftTree, rows: int):
        self._post(VERIFY, [rows, len(lead), *lead, *tree.tokens.tolist(), *tree.parents.tolist()])
        self.in_pass = True
        return self._run("a verify pass")

    def finish(self, rows: list[int], whole: bool) -> None:
        self._post(FINISH, [int(whole), *rows])
        self.in_pass = False

    def stop(self) -> None:
        """Tell the followers to return (at exit). Not in the middle of a pass (an interrupted
        reply) nor after a failure: then the followers end on their watchdog instead."""
        with self.lock:
            if self.stopped or self.in_pass:
                self.stopped = True
                return
            self.stopped = True
            self._post(STOP, [])
            try:
                self._send(self.queue, "telling the other ranks to stop")
            except RuntimeError:
                pass  # a follower already gone: nobody to tell


def follow(node: "Node") -> None:
    """A rank > 0: do to this shard what rank 0 announces, until it says stop. The Engine is
    built as on rank 0 (the same caches, the same tree positions), but never drafts. Rank 0
    speaks at least every HEARTBEAT s; doing what it said runs under the watchdog."""
    from .drafters.base import NoDrafter
    from .engine import Engine

    engine = Engine(node.loaded.model, [], NoDrafter(), node.loaded.context_length)
    while True:
        with watch("rank 0 has been silent", silence()):
            msg = broadcast(node.group, None)
        with watch("a pass announced by rank 0"):
            if not run_ops(msg, engine.model, engine.cache, node.rank):
                return


def run_ops(msg: list[int], model, cache, rank: int) -> bool:
    """Do one message's operations on this rank's shard; False once told to stop."""
    i = 0
    while i < len(msg):
        op, n, args = msg[i], msg[i + 1], msg[i + 2 : i + 2 + msg[i + 1]]
        i += 2 + n
        if op == STOP:
            return False
        if op == TRIM:
            if cache.trim(args[0]) != args[1]:
                raise CachebackError(f"rank {rank}: its cache no longer matches rank 0's")
        elif op == PREFILL:
            prefill(model, cache, args)
        elif op == VERIFY:
            rows, lead_n = args[0], args[1]
            k = (len(args) - 2 - lead_n) // 2
            tree = DraftTree(args[2 + lead_n : 2 + lead_n + k], args[2 + lead_n + k :])
            # rank 0's padded size, as a one-bucket list: the same rows as there
            mx.eval(verify_pass(model, cache, args[2 : 2 + lead_n], tree, (rows,)))
        elif op == FINISH:
            cache.finish_pass(args[1:], bool(args[0]))
        else:
            raise CachebackError(f"rank {rank}: unknown message {op} from rank 0")
    return True


def init_group():
    """The group mlx.launch set up (MLX_RANK, MLX_HOSTFILE, ...), with at least two ranks."""
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise CachebackError(f"--distributed needs ranks started by mlx.launch ({str(e).splitlines()[0]})") from None
    if group.size() < 2:
        raise CachebackError("--distributed needs at least 2 ranks (e.g. mlx.launch -n 2 -- cacheback-mlx ...)")
    return group


def is_link_error(e: BaseException) -> bool:
    """A collective failed because a rank went away (the ring backend's words)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(w in text for w in ("[ring]", "[jaccl]", "peer", "connect"))


def model_folder(spec: str | None) -> Path:
    """A local mlx-lm folder, or a Hugging Face repo's non-weight files (weights come per shard)."""
    from mlx_lm.utils import _download

    if spec is None or spec.lower().endswith(".gguf") or Path(spec).expanduser().is_file():
        raise CachebackError("--distributed loads mlx-lm model folders or Hugging Face repos "
                             "(mlx-lm's sharded loading), not GGUF files or the embedded default")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CachebackError(f"not an mlx-lm model folder (no config.json): {path}")
        return path
    try:
        return _download(spec, allow_patterns=["*.json", "*.py", "*.txt", "*.jinja", "*.model", "*.tiktoken"])
    except Exception as e:
        raise CachebackError(f"cannot fetch {spec!r}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def check_shardable(model, mode: str, size: int, name: str) -> None:
    """A one-line error when mlx-lm cannot shard this model `mode`-wise over `size` ranks."""
    kind = getattr(model, "model_type", None) or type(model).__module__.split(".")[-1]
    can_pipe = hasattr(getattr(model, "model", None), "pipeline")
    can_tensor = hasattr(model, "shard")
    if mode == "tensor" and not can_tensor:
        other = "; try --distributed pipeline" if can_pipe else ""
        raise CachebackError(f"{name}: mlx-lm has no tensor-parallel sharding for {kind} models{other}")
    if mode == "pipeline" and not can_pipe:
        other = "; try --distributed tensor" if can_tensor else ""
        raise CachebackError(f"{name}: mlx-lm has no pipeline sharding for {kind} models{other}")
    args = getattr(model, "args", None)
    if mode == "tensor":
        for dim in TENSOR_DIMS:
            value = getattr(args, dim, None)
            if isinstance(value, int) and value % size:
                raise CachebackError(f"{name}: {dim} = {value} does not split over {size} ranks (tensor sharding)")
    else:
        layers = len(model.model.layers)
        if layers < size:
            raise CachebackError(f"{name}: {layers} layers cannot be split over {size} ranks (pipeline sharding)")


def agree(group, description: str) -> None:
    """Every rank compares what it loaded with every other rank; a one-line error where they differ."""
    raw = description.encode()[:240]
    mine = np.zeros(256, np.int32)
    mine[: len(raw)] = np.frombuffer(raw, np.uint8)
    everyone = np.array(mx.distributed.all_gather(mx.array(mine), group=group, stream=mx.cpu)).reshape(-1, 256)
    texts = [bytes(row[row > 0].astype(np.uint8)).decode(errors="replace") for row in everyone]
    bad = [r for r, t in enumerate(texts) if t != texts[0]]
    if bad:
        raise CachebackError(f"ranks disagree: rank 0 has {texts[0]}; rank {bad[0]} has {texts[bad[0]]}")


@dataclass
class Node:
    """This process's place in the group and its shard of the model."""

    group: object
    mode: str
    loaded: LoadedModel

    @property
    def rank(self) -> int:
        return self.group.rank()


def start(spec: str | None, mode: str, dtype: str | None = None, drafter: str = "") -> Node:
    """Join the group, check that every rank asks for the same thing and that the model shards
    that way, then load this rank's shard with mlx-lm's sharded_load."""
    from mlx_lm.utils import load_model, load_tokenizer, sharded_load

    from .tokenizer import vocab_fingerprint

    if mode not in MODES:
        raise CachebackError(f"--distributed must be one of {', '.join(MODES)} (got {mode!r})")
    silence()  # bad limits in the environment: every rank fails alike, before joining
    dtype = dtype or default_dtype()
    path = model_folder(spec)
    with watch("joining the distributed group (is every rank started?)"):
        group = init_group()
    name = path.name if Path(spec).expanduser().is_dir() else spec
    try:
        lazy, config = load_model(path, lazy=True, strict=False)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise CachebackError(f"cannot load model {spec}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    params = sum(v.size for _, v in tree_flatten(lazy.parameters()))
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
    with watch("comparing the ranks' models"):
        agree(group, f"model {name} ({params} params, config {config_hash}, vocab {vocab_fingerprint(tokenizer)}), "
                     f"{mode} over {group.size()} ranks, dtype {dtype}, drafter {drafter}")
    check_shardable(lazy, mode, group.size(), name)
    groups = {"tensor_group": group} if mode == "tensor" else {"pipeline_group": group}
    if mode == "pipeline" and not (path / "model.safetensors.index.json").is_file():
        raise CachebackError(f"{name}: pipeline sharding needs model.safetensors.index.json (save it with mlx_lm)")
    try:
        model, tokenizer = sharded_load(str(path), **groups)
    except (ValueError, KeyError, IndexError, OSError) as e:  # e.g. a dimension our checks do not know
        raise CachebackError(f"{name}: mlx-lm cannot load it {mode}-sharded over {group.size()} ranks: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if dtype != "native":
        model.set_dtype(getattr(mx, dtype))  # floating weights only: quantized ones stay as they are
        mx.eval(model.parameters())
    context = int(config.get("max_position_embeddings") or 4096)
    fim = manifests.fim_tokens(set(tokenizer.get_vocab()))
    return Node(group, mode, LoadedModel(model, tokenizer, name, str(path), context, dtype, fim))
