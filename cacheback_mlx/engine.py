"""The speculative decoding loop, top to bottom: draft -> verify -> accept -> rollback -> update.

The engine owns a model's KV cache and knows no particular drafter: any Drafter proposes a
DraftTree, which goes through the model in one pass (verify.verify_pass); the longest root path
whose tokens the model itself picks is accepted, plus the model's own token after it (the bonus);
the rest of the cache is rolled back by its length counter (kvcache.keep_rows); the drafter then
learns the accepted tokens. A step with an empty draft is a plain one-token decoding step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx

from .drafters.base import Drafter
from .errors import CachebackError
from .kvcache import keep_rows, make_caches, trim_to
from .sampling import SamplingParams, token_picker
from .tree import DraftTree
from .verify import prefill, verify_pass

GPU_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def default_draft_budget() -> int:
    """Draft tokens per pass, from the measured cost of a B-token pass relative to one token:
    on a GPU it is flat up to ~256 tokens (wide trees are free); on this CPU a pass of 8 tokens
    costs ~1.15x one token and 16 tokens ~1.6x, so 7 draft tokens (+ the root) is the sweet spot
    (`cacheback-mlx bench --verify-cost`; docs/BENCHMARKS.md)."""
    return 63 if on_gpu() else 7  # GPU: 63 + the root = 64 rows, one shape bucket (GPU_BUCKETS)


@dataclass
class Stats:
    """Counters for one generation."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the cache)
    tokens: int = 0  # tokens produced (EOS excluded)
    accepted: int = 0  # tokens the passes produced, a final EOS included
    passes: int = 0  # verify (forward) passes after prefill
    drafted: int = 0  # draft tokens sent for verification
    prefill_s: float = 0.0
    decode_s: float = 0.0  # time of all steps, drafting included
    draft_s: float = 0.0  # time inside the drafter (propose + observe)
    verify_s: float = 0.0  # time of the forward passes (graph building included), until the picks are read

    @property
    def mat(self) -> float:
        """Mean accepted tokens per pass, bonus token included (Spec-Bench's accept length)."""
        return self.accepted / self.passes if self.passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def draft_us_per_pass(self) -> float:
        """Drafter time per step (the issue's budget: well under 5% of a verify pass)."""
        return 1e6 * self.draft_s / self.passes if self.passes else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(mat=round(self.mat, 3), tokens_per_s=round(self.tokens_per_s, 2),
                 draft_us_per_pass=round(self.draft_us_per_pass, 1))
        return d


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def accept(tree: DraftTree, picks: list[int]) -> tuple[list[int], int]:
    """Follow the child holding the model's token from the root down; stop at the first miss.

    picks[r] is the model's token at row r (row 0 = root, row i+1 = node i). Returns the accepted
    node indices and the bonus token (the model's token after the last accepted node).
    """
    kids = tree.children()
    path: list[int] = []
    want = picks[0]
    node = -1
    while True:
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
        want = picks[nxt + 1]


class Engine:
    """A model with its KV cache and a drafter. Keeps the cache across calls, so a prompt that
    extends the last one (the next chat turn) only prefills its new tokens."""

    def __init__(self, model, eos_ids: Sequence[int], drafter: Drafter, context_length: int,
                 draft_budget: int | None = None, buckets: tuple[int, ...] | None = None):
        self.model = model
        self.eos_ids = set(int(t) for t in eos_ids)
        self.drafter = drafter
        self.context_length = context_length
        self.draft_budget = default_draft_budget() if draft_budget is None else draft_budget
        self.buckets = (GPU_BUCKETS if on_gpu() else None) if buckets is None else buckets
        self.caches = make_caches(model)
        self.vocab_size = int(getattr(getattr(model, "args", None), "vocab_size", 1 << 30))
        self.cached: list[int] = []  # tokens whose K/V are in the caches
        self.history: list[int] = []  # the sequence the drafter has seen: prompts + outputs
        self.stats = Stats()

    def set_drafter(self, drafter: Drafter) -> None:
        """Switch drafters; the new one learns the current sequence so it can draft at once."""
        self.drafter = drafter
        drafter.observe(self.history)

    def reset(self) -> None:
        """Forget the conversation: empty the cache and the drafter's state."""
        trim_to(self.caches, 0)
        self.cached, self.history = [], []
        self.drafter.reset()

    def _start(self, prompt: list[int]) -> None:
        """Prefill what the cache lacks of prompt[:-1]; prompt[-1] is the first step's root."""
        t0 = time.perf_counter()
        keep = common_prefix(self.cached, prompt[:-1])
        trim_to(self.caches, keep)  # also repairs a cache left ahead by an interrupted pass
        prefill(self.model, self.caches, prompt[keep:-1])
        self.cached = prompt[:-1]
        self.stats.prefill_tokens = len(prompt) - 1 - keep
        self.stats.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.drafter.observe(prompt[common_prefix(self.history, prompt):])
        self.history = list(prompt)
        self.stats.draft_s += time.perf_counter() - t0

    def generate(self, prompt: Sequence[int], max_tokens: int,
                 sampling: SamplingParams = SamplingParams()) -> Iterator[list[int]]:
        """Yield the tokens accepted at each step (EOS excluded) until EOS or max_tokens."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise CachebackError("empty prompt")
        if max_tokens <= 0:
            raise CachebackError(f"max_tokens must be > 0 (got {max_tokens})")
        if len(prompt) >= self.context_length:
            raise CachebackError(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                                 f"{self.context_length} tokens")
        max_tokens = min(max_tokens, self.context_length - len(prompt))
        self.stats = stats = Stats(prompt_tokens=len(prompt))
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        pick = token_picker(sampling)
        self._start(prompt)
        t_start = time.perf_counter()
        root = prompt[-1]
        try:
            while stats.tokens < max_tokens:
                # draft
                budget = min(self.draft_budget, max_tokens - stats.tokens - 1,
                             self.context_length - len(self.cached) - 2)
                t0 = time.perf_counter()
                tree = self.drafter.propose(self.history, budget) if budget > 0 else DraftTree.empty()
                tree = tree.truncate(max(budget, 0)).keep_valid(self.vocab_size)
                stats.draft_s += time.perf_counter() - t0
                # verify: root + draft in one pass
                base = len(self.cached)
                t0 = time.perf_counter()
                logits = verify_pass(self.model, self.caches, root, tree, self.buckets)
                picks = pick(logits).tolist()
                stats.verify_s += time.perf_counter() - t0
                # accept the longest path the model agrees with, plus its bonus token
                path, bonus = accept(tree, picks)
                # rollback: keep root + accepted nodes, compacted, drop the rest
                keep_rows(self.caches, base, [0] + [i + 1 for i in path])
                accepted = [int(tree.tokens[i]) for i in path] + [int(bonus)]
                self.cached.extend([root] + accepted[:-1])
                stats.passes += 1
                stats.drafted += len(tree)
                # stop at EOS or the token limit
                stop = next((i for i, t in enumerate(accepted) if t in self.eos_ids), None)
                out = accepted[:stop][: max_tokens - stats.tokens]
                # update the drafter
                t0 = time.perf_counter()
                self.history.extend(out)
                self.drafter.observe(out)
                stats.draft_s += time.perf_counter() - t0
                stats.tokens += len(out)
                stats.accepted += len(out) + (stop is not None and len(out) == stop)
                stats.decode_s = time.perf_counter() - t_start
                if out:
                    yield out
                if stop is not None or len(out) < len(accepted):
                    break
                root = bonus
        finally:
            stats.decode_s = time.perf_counter() - t_start
            self.drafter.end_request()
