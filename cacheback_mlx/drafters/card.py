"""CARD (cache-assisted parallel speculative decoding, query-and-correct): a draft model keeps
growing a token tree of the verified sequence's likely continuations while the target verifies;
each step the target queries the tree and sends back what it accepted (a correction).

    --drafter card --drafter-arg draft=self:4          the target's own first 4 layers
    --drafter card --drafter-arg draft=MODEL           any model the loader takes, same tokenizer
    --drafter-arg parallel=false                       sequential: draft, then verify (in-process)

Parallel mode (default): the draft model runs in its own process (draft_model/worker.py), growing
the tree layer by layer (draft_model.runner.DraftRunner) as long as it has room; propose() only
reads what the process has sent (it never waits longer than `wait_ms`), re-rooted on the tokens
accepted since (card_tree.TokenTree.advance), so a draft that ran ahead of the target is still
used. Sequential mode grows the same tree in-process, up to `layers` layers per step, before
returning it. The draft model is the package cacheback_mlx/draft_model/ (the one place a drafter's
work touches a model); this module imports it lazily, when a CardDrafter is made.

Proposals carry scores (cumulative draft probabilities), so the engine's per-pass budget
(budget.Sizer) verifies as many of the best nodes as pay for their rows.

Parameters: draft (required), parallel (true), paths K (4: paths kept per layer), top_k (4: children
offered per node), depth (10: deepest node), nodes (40: tree size cap), min_score (0: stop growing
when no path's cumulative draft probability reaches it, which frees the cores), layers (4: layers per step,
sequential mode), wait_ms (0: how long propose may wait for the first tree after a miss), threads
(1: BLAS threads of the draft process), device (cpu or gpu: where the draft process runs; default:
MLX's default, e.g. the CPU cores for the draft while the target has the GPU). `target`, `dtype` and
`fingerprint` are set by the Session.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from pathlib import Path
from typing import Sequence

from ..errors import CachebackError
from ..tree import DraftTree, common_prefix
from .base import Drafter
from .card_tree import TokenTree

_open: "weakref.WeakSet[CardDrafter]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for d in list(_open):
        d.close()


class CardDrafter(Drafter):
    name = "card"

    def __init__(self, draft=None, parallel: bool = True, paths: int = 4, top_k: int = 4, depth: int = 10,
                 nodes: int = 40, min_score: float = 0.0, layers: int = 4, wait_ms: float = 0.0,
                 threads: int | None = 1,
                 device: str | None = None, target=None, dtype: str | None = None, fingerprint: str | None = None):
        if draft is None or draft == "":
            raise CachebackError("the card drafter needs a draft model: --drafter-arg draft=self:N or draft=MODEL")
        if isinstance(draft, str) and draft == "self":
            raise CachebackError("draft=self needs a layer count: draft=self:N")
        if isinstance(draft, str):
            from ..draft_model.runner import parse_self

            parse_self(draft)  # a malformed self:N fails here, before a process starts
        if not isinstance(parallel, bool):
            raise CachebackError(f"parallel must be true or false (got {parallel!r})")
        self.tree_args = dict(paths=int(paths), top_k=int(top_k), depth=int(depth), nodes=int(nodes),
                              min_score=float(min_score))
        TokenTree(**self.tree_args)  # checks the values (ValueError: one line via make_drafter)
        if layers < 1 or wait_ms < 0:
            raise ValueError("layers must be >= 1 and wait_ms >= 0")
        self.parallel, self.layers, self.wait = parallel, int(layers), float(wait_ms) / 1000
        self.draft_spec = draft if isinstance(draft, str) else getattr(draft, "name", "model")
        dtype = dtype or getattr(target, "dtype", None)
        self.seq: list[int] = []  # the verified sequence as the draft side knows it
        self.tree = TokenTree(**self.tree_args)  # the cache, rooted at seq[-1]
        self.epoch = 0  # bumped whenever the sequence is cut (a new prompt): older trees are stale
        self.proc = self.runner = None
        self.dead: str | None = None  # why the draft process stopped (parallel mode)
        self._reset_counters()
        if parallel:
            from ..draft_model.worker import DraftProcess

            if device not in (None, "cpu", "gpu"):
                raise CachebackError(f"device must be cpu or gpu (got {device!r})")
            if device == "cpu" and dtype in ("float16", "bfloat16"):
                dtype = "float32"  # the CPU runs float32 fastest (loader.default_dtype)
            spec = {"draft": _spec(draft), "target": _spec(target), "dtype": dtype, "device": device,
                    "fingerprint": fingerprint, "tree": self.tree_args}
            self.proc = DraftProcess(spec, threads=threads)
            self.chain = bool(self.proc.info.get("chain"))
            _open.add(self)
        else:
            from ..draft_model.runner import DraftRunner, load_draft

            self.runner = DraftRunner(load_draft(draft, target, dtype, fingerprint), **self.tree_args)
            self.chain = self.runner.chain

    # --- the Drafter interface -------------------------------------------------------------

    def reset(self) -> None:
        """A new conversation: the draft side drops its tree (the counters run on: stats())."""
        self._sync([])
        self.last = None

    def observe(self, tokens: Sequence[int]) -> None:
        """Count the accepted tokens the last proposal held; the correction itself is sent with
        the next propose(), which sees the whole history (prompt edits included)."""
        if self.last is not None and len(tokens):
            kids, node, n = self.last.children(), -1, 0
            for t in tokens:
                node = next((c for c in kids[node + 1] if self.last.tokens[c] == t), None)
                if node is None:
                    break
                n += 1
            self.from_cache += min(n, len(tokens) - 1)  # the last token is the target's own (bonus)
        self.last = None

    def propose(self, history: Sequence[int], budget: int, max_branching: int | None = None) -> DraftTree:
        self.queries += 1
        self._sync(history)
        if self.runner is not None:
            self._grow_here(budget)
            self.draft_passes = self.runner.passes
        elif self.proc is not None:
            self._receive(0.0)
            end = time.monotonic() + self.wait
            while not len(self.tree) and not self.dead and time.monotonic() < end:  # after a miss
                self._receive(end - time.monotonic())
        tree = self.tree.best(budget, max_branching)
        self.hits += bool(len(tree))
        self.last = tree
        return tree

    def stats(self) -> dict:
        q = max(self.queries, 1)
        out = {"mode": "parallel" if self.parallel else "sequential", "draft": self.draft_spec,
               "draft passes/target pass": round(self.draft_passes / q, 2),
               "cache hit rate": round(self.hits / q, 3), "tokens from cache": self.from_cache,
               "tree": "chain" if self.chain else "tree"}
        if self.dead:
            out["draft process"] = f"stopped ({self.dead})"
        return out

    def close(self) -> None:
        """Stop the draft process (parallel mode); later proposals are empty."""
        if self.proc is not None:
            self.proc.close()
            self.dead = self.dead or "closed"
            _open.discard(self)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- query and correct -------------------------------------------------------------------

    def _reset_counters(self) -> None:
        self.queries = self.hits = self.from_cache = self.draft_passes = 0  # since the drafter started
        self.last: DraftTree | None = None  # the last proposal (to count what was taken from it)

    def _sync(self, history: Sequence[int]) -> None:
        """Bring the draft side to `history`: re-root the local tree on the new tokens (or clear it
        when the sequence was cut) and send the same correction to the draft side."""
        n = len(self.seq)
        recent = list(history[max(0, n - 8):n]) == self.seq[max(0, n - 8):]  # cheap: most steps append
        if len(history) == n and recent:
            return
        keep = n if len(history) > n and recent else common_prefix(self.seq, history)
        tail = [int(t) for t in history[keep:]]
        cut = keep < n or not self.seq
        self.seq = self.seq[:keep] + tail
        if self.runner is not None:
            self.runner.sync(keep, tail)
            self.tree = self.runner.tree
            return
        if cut:
            self.epoch += 1
            self.tree.clear()
        else:
            self.tree.advance(tail)
        if self.proc is not None and not self.dead:
            try:
                self.proc.send(("sync", self.epoch, keep, tail))
            except (OSError, EOFError, ValueError):
                self._died("it exited")

    def _receive(self, wait: float) -> None:
        """Take the newest tree the draft process sent for this sequence, re-rooted on the tokens
        accepted since it was grown."""
        if self.dead:
            return
        try:
            msgs = self.proc.receive(wait)
        except (OSError, EOFError, ValueError):
            msgs = None
        if msgs is None or (not msgs and not self.proc.alive()):
            self._died("it exited")
            return
        for kind, *rest in reversed(msgs):  # the newest tree holds every older one's nodes
            if kind == "error":
                self._died(rest[0])
                return
            epoch, seq_len, tree, passes, *_ = rest
            self.draft_passes = max(self.draft_passes, passes)
            if epoch == self.epoch and seq_len <= len(self.seq) and tree.advance(self.seq[seq_len:]) is not None:
                self.tree = tree
                return

    def _grow_here(self, budget: int) -> None:
        """Sequential mode: up to `layers` draft passes, fewer when the tree is already deep enough."""
        for _ in range(self.layers):
            t = self.runner.tree
            if len(t) >= self.tree.max_nodes or (t.depths and max(t.depths) >= min(budget, t.max_depth)):
                break
            if not self.runner.expand():
                break
        self.tree = self.runner.tree

    def _died(self, why: str) -> None:
        if not self.dead:
            self.dead = why
            print(f"cacheback-mlx: the CARD draft process stopped ({why}); decoding goes on without drafts",
                  file=sys.stderr, flush=True)
            self.tree.clear()
            if self.proc is not None:
                self.proc.close(timeout=0.5)
            _open.discard(self)


def _spec(x):
    """A model spec that another process can load: strings as they are, a LoadedModel by its source."""
    if x is None or isinstance(x, str):
        return x
    source = getattr(x, "source", None)
    if not source or not Path(source).exists():
        raise CachebackError("parallel CARD needs a model that can be loaded from a file or folder "
                             "(this one was built in memory): use parallel=false")
    return source


__all__ = ["CardDrafter"]
