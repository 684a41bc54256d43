"""The speculative decoding loop, top to bottom: draft -> verify -> accept -> rollback -> update.

The engine owns a model's caches (kvcache.ModelCache; a set per slot when it keeps several
sequences at once, slots.py) and knows no particular drafter: any Drafter proposes a DraftTree,
which goes through the model in one pass (verify.verify_pass); the longest root path whose tokens
the model itself picks is accepted, plus the model's own token after it (the bonus); the rest of
the cache is rolled back (ModelCache.finish_pass); the drafter then learns the accepted tokens.
A step with an empty draft is a plain one-token decoding step. On Metal such a step starts the
next plain step over its token before that token is read, as mlx-lm's loop does, so the device
does not wait while this loop reads it, updates the drafter and builds the next graph
(`run_ahead`); where the drafter drafts again, the step already started leads the drafted pass.

Models with recurrent layers get chain drafts, and so do models with position-dependent code the
engine cannot place in a tree (positions.py). A recurrent state cannot be cut back: where every
recurrent layer captures each row's state during a pass (recurrent.py), finish_pass keeps the
accepted prefix like any other pass; elsewhere (and on passes too long to capture) a pass is kept
only when accepted whole; otherwise it is undone and its accepted tokens lead the next pass
(`self.seq.lead`, `stats.undone`), whose draft budget shrinks by as many rows.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import cores, kernels
from .budget import Sizer
from .drafters.base import Drafter
from .errors import CachebackError
from .head import prepare_head
from .kvcache import ModelCache
from .learning import start_request
from .planner import CostPlanner, FixedPlanner
from .positions import prepare_positions
from .run_ahead import RunAhead
from .sampling import SamplingParams, accepted_logprobs, processed_rows, token_picker, top_tokens
from .slots import SLOT_BYTES, Sequence, Slots
from .tree import DraftTree, common_prefix, forced_picks
from .verify import MLX_LM_PREFILL_CHUNK, PREFILL_CHUNK, cpu_prefill_chunk, prefill, step_pass, verify_pass, warm_up

GPU_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def prompt_as_mlx_lm_default(model) -> bool:
    """Whether a prompt goes through the model as mlx-lm's generate_step puts it (chunks of 2,048
    from the first uncached token, the last token alone in the first step) rather than in the
    engine's own layout (smaller chunks; up to LEAD_TAIL uncached tokens in the first pass, with
    its drafts: planner.lead_tail): on a GPU in float16/bfloat16, where a product's bits depend on
    how many rows it runs, so that only mlx-lm's layout leaves mlx-lm's bits in the caches. On the
    CPU, and in float32, the layout changes no token (tests/test_families.py against
    generate_step)."""
    from .footprint import compute_dtype

    return on_gpu() and compute_dtype(model) in (mx.float16, mx.bfloat16)


RUN_AHEAD_ENV = "CACHEBACK_MLX_RUN_AHEAD"


def run_ahead_default() -> bool:
    """Whether plain steps run ahead by default here (Engine.set_run_ahead): on a GPU, unless
    CACHEBACK_MLX_RUN_AHEAD says 0 or 1."""
    env = os.environ.get(RUN_AHEAD_ENV, "")
    return env == "1" if env in ("0", "1") else on_gpu()


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


def kv_quantization_refusal(model, cache: ModelCache, group_size: int, sharded: bool) -> str | None:
    """Why this model's K/V cannot be quantized as mlx-lm's generate_step would (None: it can):
    its quantized caches go through mlx-lm's shared attention function only, and mlx-lm cannot
    quantize a sliding-window cache. A model with no full-attention cache of its own at the
    top level (recurrent only; layers keeping a CacheList) keeps its caches as they are, as with
    mlx-lm."""
    from .attention import scaled_dot_product_attention, stock
    from .kvcache import TreeKVCache, WindowKVCache
    from .positions import model_modules

    if sharded:
        return "a model sharded over processes"
    if any(isinstance(c, WindowKVCache) for c in cache.layers):
        return "sliding-window layers (mlx-lm cannot quantize them either)"
    if not any(type(c) is TreeKVCache for c in cache.layers):
        return None
    modules = [sys.modules.get(name) for name in model_modules(model)]
    if not any(getattr(m, "scaled_dot_product_attention", None) in (stock, scaled_dot_product_attention)
               for m in modules if m is not None):
        return "its attention does not go through mlx-lm's shared attention, which reads quantized caches"
    probe = ModelCache(model)  # one token through caches of its own: the keys' and values' sizes
    model(mx.array([[0]], dtype=mx.int32), cache=probe.layers)
    sizes = sorted({a.shape[-1] for c in probe.layers if type(c) is TreeKVCache for a in (c.keys, c.values)})
    if any(size % group_size for size in sizes):
        fits = [g for g in KV_GROUP_SIZES if all(size % g == 0 for size in sizes)]
        return (f"--kv-group-size {group_size} does not divide its head size ({', '.join(map(str, sizes))})"
                + (f"; try {fits[-1]}" if fits else ""))
    return None


MAX_DRAFT = 63  # the most draft tokens a per-step budget may choose (63 + the root = one GPU bucket)


def default_draft_budget() -> int:
    """The fixed draft tokens per pass, used when no measured cost is given (budget.Sizer): on a
    GPU a pass is ~flat up to ~256 tokens; on this CPU 8 tokens cost ~1.15x one token and 16
    tokens ~1.6x, so 7 draft tokens (+ the root) is the sweet spot there
    (`cacheback-mlx bench --verify-cost`; docs/BENCHMARKS.md)."""
    return 63 if on_gpu() else 7  # GPU: 63 + the root = 64 rows, one shape bucket (GPU_BUCKETS)


class Accepted(list):
    """The tokens one step accepted (a list of ids) and, when the request asked for them
    (SamplingParams.logprobs), their log-probabilities: `logprobs` [tokens, vocab], each row from
    the pass row that predicted its token, after the logits processors, as mlx-lm's generate_step
    gives them (logits - logsumexp(logits)); the rows are copied out at once, the rest runs when
    they are read (sampling.accepted_logprobs)."""

    logprobs: mx.array | None = None

    def own_logprobs(self) -> mx.array:
        """Each token's own log-probability ([tokens]; needs `logprobs`)."""
        return mx.take_along_axis(self.logprobs, mx.array(self, dtype=mx.int32)[:, None], axis=1)[:, 0]


@dataclass
class Stats:
    """Counters for one generation."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from the cache)
    tokens: int = 0  # tokens produced (EOS excluded)
    accepted: int = 0  # tokens the passes produced, a final EOS included
    passes: int = 0  # verify (forward) passes after prefill
    drafted: int = 0  # draft tokens sent for verification
    undone: int = 0  # passes undone whole (recurrent models: their accepted tokens lead the next pass)
    ahead: int = 0  # plain steps started before the token they read was known (Engine.set_run_ahead)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # time of all steps, drafting included
    draft_s: float = 0.0  # time inside the drafter (propose + observe) while no pass runs
    learn_s: float = 0.0  # the drafter's and planner's learning done while a pass ran (catch_up): not in draft_s
    verify_s: float = 0.0  # time of the forward passes (graph building included), until the picks are read
    stop_token: int | None = None  # the EOS token that ended the generation (None: a token limit)
    stop_logprobs: mx.array | None = None  # its log-probabilities, when the request asked for them

    @property
    def mat(self) -> float:
        """Mean accepted tokens per pass, bonus token included (Spec-Bench's accept length)."""
        return self.accepted / self.passes if self.passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def draft_us_per_pass(self) -> float:
        """Drafter time per step (the aim: well under 5% of a verify pass)."""
        return 1e6 * self.draft_s / self.passes if self.passes else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(mat=round(self.mat, 3), tokens_per_s=round(self.tokens_per_s, 2),
                 draft_us_per_pass=round(self.draft_us_per_pass, 1))
        return d


def accept(tree: DraftTree, picks: list[int]) -> tuple[list[int], int]:
    """Follow the child holding the model's token from the root down; stop at the first miss.

    picks[r] is the model's token at row r (row 0 = root, row i+1 = node i). Returns the accepted
    node indices and the bonus token (the model's token after the last accepted node).
    """
    if not len(tree):  # a plain step
        return [], picks[0]
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


def model_vocab_size(model) -> int:
    """Rows of the model's token embedding (ids past it would read outside the table)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    for v in (getattr(args, "vocab_size", None), text.get("vocab_size") if isinstance(text, dict)
              else getattr(text, "vocab_size", None)):
        if v:
            return int(v)
    sizes = [m.weight.shape[0] for _, m in model.named_modules()
             if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    if not sizes:
        raise CachebackError(f"{type(model).__module__}: cannot find the model's vocabulary size")
    return int(sizes[0])


@dataclass(frozen=True)
class PassEvent:
    """One pass the engine ran, as its watchers hear it (Engine.watch)."""

    kind: str  # "prefill" (one chunk of a prompt) or "verify" (lead + drafts)
    rows: int  # rows the pass ran, padding included
    cached: int  # tokens in the caches before it
    seconds: float
    lead: int = 0  # verify: accepted tokens not yet cached that lead it (the root last)
    drafts: int = 0  # verify: draft tokens sent


class Interrupted(Exception):
    """A prefill stopped between chunks because its caller asked (engine.generate's `stop`)."""


class Engine:
    """A model with its KV cache and a drafter. Keeps the cache across calls, so a prompt that
    extends the last one (the next chat turn) only prefills its new tokens."""

    prefill_chunk: int | None = None  # tokens a prefill pass takes at most (None: per backend);
    # a stop is heard between chunks
    RUN_AHEAD_QUIET = 8  # plain passes in a row before a step runs ahead while drafts are common (run_ahead.py)

    def __init__(self, model, eos_ids: Seq[int], drafter: Drafter, context_length: int,
                 draft_budget: int | None = None, buckets: tuple[int, ...] | None = None,
                 sizer: Sizer | None = None, peers=None, slots: int = 1, slot_bytes: int = SLOT_BYTES,
                 run_ahead: bool | None = None):
        """sizer: chooses each pass's draft size from measured pass costs (budget.py), with
        draft_budget (default MAX_DRAFT) as a cap; without one every pass drafts up to
        draft_budget (default: per backend).
        peers: for a model sharded over processes, the other ranks (distributed.Leader): each
        cache operation below is announced to them first, so every rank does the same.
        slots: sequences kept at once, each with its own caches (slots.py; one with peers).
        run_ahead: see set_run_ahead."""
        self.model = model
        self.peers = peers
        self.eos_ids = set(int(t) for t in eos_ids)
        self.drafter = drafter
        self.context_length = context_length
        self.seq = Sequence(ModelCache(model))  # the sequence the engine runs (its slot's)
        unplaced = prepare_positions(model)
        prepare_head(model)  # a batch's pass runs the head on the rows it reads only (head.py)
        if kernels.on_cuda() and kernels.enabled:
            kernels.attach(model)  # verify passes' linear layers: the one-row step's bits (kernels/)
        self.position_code = unplaced[0] if unplaced else None  # a line no tree position fix covers
        self.chain_reason = ("recurrent layers" if self.seq.cache.recurrent else
                             f"position-dependent code: {self.position_code}" if unplaced else None)
        buckets = (GPU_BUCKETS if on_gpu() else None) if buckets is None else buckets
        self.buckets = None if self.seq.cache.recurrent else buckets  # padding would run the recurrence
        self.set_sizer(sizer, draft_budget)
        self.max_branching = 1 if self.chain_reason else None  # what drafters are told
        self.vocab_size = model_vocab_size(model)
        if kernels.on_cuda() and peers is None:  # MLX compiles its gathers and scatters at first use there
            warm_up(model, self.buckets, tree_ok=self.chain_reason is None, vocab=min(32, self.vocab_size),
                    cached=tuple(c for c in (8, 300) if c + 8 < context_length))
        self.slots = Slots(1 if peers is not None else slots, self.seq, slot_bytes)
        self.stats = Stats()
        self.watchers: list = []  # called with each PassEvent (watch)
        self.set_run_ahead(run_ahead)
        self.set_prompt_layout()
        self.kv_quant: tuple[int, int, int] | None = None  # set_kv_quantization

    def set_kv_quantization(self, bits: int | None, group_size: int = 64, start: int = 5000) -> None:
        """Quantize the keys and values as mlx-lm's generate_step does with kv_bits, kv_group_size and
        quantized_kv_start (its --kv-bits, --kv-group-size, --quantized-kv-start): once a request's
        caches hold `start` positions they are kept in `bits` bits, at the same point as mlx-lm's.
        Up to that point the output is mlx-lm's; past it, only where the engine's keys and values
        quantize as mlx-lm's do: a pass's differ from a one-row step's in their last bits, and
        rounding to a few bits can put them a step apart (README, "K/V cache quantization").
        None: full precision (the default). A model whose K/V mlx-lm would not quantize so (sliding
        windows, an attention of its own, a head size the group does not divide) gets a one-line
        CachebackError."""
        if (None if bits is None else (bits, group_size, start)) == self.kv_quant:
            return
        if bits is not None:
            if bits not in KV_BITS or group_size not in KV_GROUP_SIZES:
                raise CachebackError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))} and --kv-group-size "
                                     f"one of {', '.join(map(str, KV_GROUP_SIZES))} (got {bits}, {group_size})")
            if start < 0:
                raise CachebackError(f"--quantized-kv-start must be >= 0 (got {start})")
            why = kv_quantization_refusal(self.model, self.seq.cache, group_size, self.peers is not None)
            if why:
                raise CachebackError(f"{self.seq.cache.family}: K/V quantization is not supported here: {why}")
        self.kv_quant = None if bits is None else (bits, group_size, start)  # each request's caches take it (_start)

    def set_eos(self, ids: Seq[int]) -> None:
        """The tokens that end a generation (the model's own end-of-sequence tokens, and any more)."""
        self.eos_ids = {int(t) for t in ids}

    def set_prompt_layout(self, as_mlx_lm: bool | None = None) -> None:
        """Put prompts through the model as mlx-lm does (True) or in the engine's own layout
        (False); None: prompt_as_mlx_lm_default."""
        self.prompt_as_mlx_lm = prompt_as_mlx_lm_default(self.model) if as_mlx_lm is None else bool(as_mlx_lm)

    def set_run_ahead(self, on: bool | None = None) -> None:
        """Whether a plain step starts the next one before its token is read (see generate). It
        pays where the device runs a step while Python builds the next one (mlx-lm's loop does the
        same): on an H200 the default model's plain steps went from 0.86x mlx-lm's speed to 1.00x
        (docs/BENCHMARKS.md §15); on the CPU at real sizes it gains nothing measurable. It starts
        after RUN_AHEAD_QUIET plain passes in a row, or after one where drafts are rare
        (run_ahead.RunAhead). None: run_ahead_default()."""
        self.run_ahead = run_ahead_default() if on is None else bool(on)
        self.ahead_rule = RunAhead(self.RUN_AHEAD_QUIET)

    def watch(self, fn) -> "callable":
        """Call fn(PassEvent) after every pass from now on (tools and tests that look at what the
        engine runs); returns a function that stops it."""
        self.watchers.append(fn)
        return lambda: self.watchers.remove(fn)

    def _ran(self, event: PassEvent) -> None:
        for fn in self.watchers:
            fn(event)

    def set_sizer(self, sizer: Sizer | None, draft_budget: int | None = None) -> None:
        """Choose each pass's draft size with `sizer` (None: a fixed budget), capped at draft_budget."""
        if sizer is None:
            budget = default_draft_budget() if draft_budget is None else draft_budget
            self.set_planner(FixedPlanner(budget, self.buckets))
        else:
            budget = MAX_DRAFT if draft_budget is None else draft_budget
            self.set_planner(CostPlanner(sizer, budget, self.buckets, recurrent=bool(self.seq.cache.recurrent)))

    def set_planner(self, planner: FixedPlanner | CostPlanner) -> None:
        """Size each pass with `planner` (planner.py) from now on."""
        self.planner = planner

    # the running sequence's state, for callers that read it (the loop reads and writes self.seq)
    cache = property(lambda self: self.seq.cache, doc="The running sequence's caches.")
    cached = property(lambda self: self.seq.cached, doc="Tokens whose effect is in the caches.")
    history = property(lambda self: self.seq.history, doc="The sequence the drafter has seen.")

    @property
    def sizer(self) -> Sizer | None:
        """The cost-based planner's sizer (None with a fixed budget)."""
        return self.planner.sizer

    @property
    def draft_budget(self) -> int:
        """The most draft tokens a pass may take."""
        return self.planner.budget

    def describe(self) -> dict:
        """What this model gets: its layer caches by kind and the verify path (`doctor --model`)."""
        verify = f"chain drafts only ({self.chain_reason})" if self.chain_reason else "draft trees"
        prompt = ("as mlx-lm's generate_step puts it (chunks of 2,048, the last token alone), "
                  "for its bits in half precision on a GPU" if self.prompt_as_mlx_lm else
                  "the engine's layout (smaller chunks; a short tail shares the first pass)")
        return {"family": self.seq.cache.family, "caches": self.seq.cache.describe(), "verify": verify,
                "shape buckets": list(self.buckets) if self.buckets else "off", "prompt": prompt}

    def set_drafter(self, drafter: Drafter) -> None:
        """Switch drafters; the new one learns the current sequence so it can draft at once."""
        if drafter is not self.drafter:
            self.drafter.close()
        self.drafter, self.seq.learned = drafter, set()
        self.slots.clear(keep_caches=True)  # the new drafter saw none of the idle slots' sequences
        drafter.observe(self.seq.history)

    def reset_drafter(self, drafter: Drafter | None = None) -> None:
        """A fresh drafter state (or `drafter`, a new one, in place of the current); the caches
        stay. The drafter relearns the next prompt whole."""
        self.seq.history, self.seq.learned = [], set()
        self.slots.clear(keep_caches=True)
        if drafter is None:
            self.drafter.reset()
        else:
            self.set_drafter(drafter)

    def reset(self, drafter: Drafter | None = None) -> None:
        """Forget the conversation: empty the cache and the drafter's state. `drafter`: run this
        one from now on, from its reset state (the one it replaces stays open: bench rows take
        turns with theirs)."""
        if drafter is not None:
            self.drafter = drafter
        self._trim(0)
        self.slots.clear()
        self.seq.cached, self.seq.history, self.seq.lead, self.seq.learned = [], [], [], set()
        self.drafter.reset()

    def _start(self, prompt: list[int], context=(), slot: int | None = None, stop=None, tail: bool = False) -> None:
        """Prefill what the cache lacks of the prompt but its last token, which leads the first
        pass (prompt[-1] is its root), or with `tail` its last tokens as many as the planner says
        (planner.lead_tail): a short uncached tail, a new chat turn or the text typed since an
        editor's last request, then shares a pass with the first drafts instead of taking a
        prefill pass of its own.
        `context`: text beside the prompt for the drafter to learn (start_request).
        `slot`: the slot to run in (None or -1: the one that reuses most, slots.Slots.choose).
        `stop`: asked between prefill chunks; True stops the prefill there (Interrupted), the
        chunks done kept in the slot's cache, so the same prompt later goes on from them."""
        t0 = time.perf_counter()
        self.seq = self.slots.take(self.slots.choose(prompt, slot), self.model)
        self.seq.cache.set_kv_quantization(*(self.kv_quant or (None,)))
        # also repairs a cache left ahead by an interrupted pass; 0 if the cache cannot cut back
        keep = self._trim(common_prefix(self.seq.cached, prompt[:-1]))
        self.seq.cache.plan_quantization(len(prompt), MLX_LM_PREFILL_CHUNK)
        tail = tail and self.seq.cache.rows_before_quantizing() is None  # mlx-lm's last prompt token goes alone
        n = self.planner.lead_tail(len(prompt) - keep, keep) if tail else 1
        split = len(prompt) - max(1, min(n, len(prompt) - keep))
        done = self._prefill(prompt[keep:split], stop)
        if n > 1 and keep + done == split and self.planner.lead_tail(len(prompt) - keep, keep) == 1:
            done += self._prefill(prompt[split:-1], stop)  # this prefill has just shown the tail's rows
            split = len(prompt) - 1  # cost more in a pass than in prefill
        if keep + done < split:
            self.seq.cached, self.seq.lead = prompt[: keep + done], []
            raise Interrupted(f"prefill stopped after {keep + done} of {split} tokens")
        self.seq.cached = prompt[:split]
        self.seq.lead = prompt[split:]
        self.stats.prefill_tokens = len(prompt) - 1 - keep
        self.stats.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.seq.history = start_request(self.drafter, self.seq.history, prompt, context, self.seq.learned)
        self.stats.draft_s += time.perf_counter() - t0

    # The cache operations. With peers (a model sharded over processes) each is announced to the
    # other ranks first, and a pass runs here while they run it on their shards.
    def _trim(self, length: int) -> int:
        kept = self.seq.cache.trim(length)
        if self.peers is not None:
            self.peers.trim(length, kept)
        return kept

    def _prefilled(self, rows: int, cached: int, seconds: float) -> None:
        self.planner.prefilled(rows, cached, seconds)  # a point of the pass cost's prior (costs.PriorCost)
        self._ran(PassEvent("prefill", rows, cached, seconds))

    def chunk_rule(self, beside_others: bool = False):
        """Tokens a prefill chunk takes: a number, or a function of the cached tokens.
        `beside_others`: a chunk of a request that shares passes with others (batch.py), whose
        tokens no prompt layout keeps exact, so the engine's own chunks."""
        if self.prefill_chunk:
            return self.prefill_chunk
        if self.prompt_as_mlx_lm and not beside_others:
            return MLX_LM_PREFILL_CHUNK
        return PREFILL_CHUNK if on_gpu() else cpu_prefill_chunk

    def _prefill(self, tokens: list[int], stop=None) -> int:
        chunk = self.chunk_rule()
        if self.seq.cache.rows_before_quantizing() is not None:  # no chunk spans the point (set_kv_quantization)
            chunk = self._chunk_to_quantize(chunk)
        if self.peers is None:
            return prefill(self.model, self.seq.cache, tokens, chunk, timed=self._prefilled, stop=stop)
        i = 0
        while i < len(tokens):  # one announced pass per chunk
            if i and stop is not None and stop():
                return i
            part = tokens[i : i + (chunk(self.seq.cache.length, len(tokens) - i) if callable(chunk) else chunk)]
            i += len(part)
            t0, cached = time.perf_counter(), self.seq.cache.length
            with self.peers.prefill(part):
                prefill(self.model, self.seq.cache, part)
            self._ran(PassEvent("prefill", len(part), cached, time.perf_counter() - t0))
        return len(tokens)

    def _chunk_to_quantize(self, rule):
        cache = self.seq.cache

        def chunk(cached: int, left: int) -> int:
            size = rule(cached, left) if callable(rule) else rule
            room = cache.rows_before_quantizing()
            return size if room is None or room <= 0 else min(size, room)
        return chunk

    def _verify(self, lead: list[int], tree: DraftTree, size: int) -> mx.array:
        """One pass over lead + tree, padded to `size` rows."""
        if self.peers is None:
            return verify_pass(self.model, self.seq.cache, lead, tree, rows=size)
        with self.peers.verify(lead, tree, size):
            logits = verify_pass(self.model, self.seq.cache, lead, tree, rows=size)
            mx.eval(logits)  # the pass's collectives run now, under the peers' watch
        return logits

    def _finish(self, rows: list[int], whole: bool) -> bool:
        if self.peers is not None:
            self.peers.finish(rows, whole)
        return self.seq.cache.finish_pass(rows, whole)

    def set_slots(self, n: int, max_bytes: int = SLOT_BYTES) -> None:
        """Keep up to n sequences' caches at once (slots.py); a sharded model keeps one."""
        if self.peers is not None or n == self.slots.n:
            return
        self.slots.clear()
        self.slots = Slots(n, self.seq, max_bytes)

    def _room_to_quantize(self, lead: int) -> int:
        """Drafts a pass may take so that none of its rows lies past the point where the caches turn
        quantized (set_kv_quantization); on a model whose pass may be undone, none of its
        accepted tokens either (they would lead the next pass across it)."""
        room = self.seq.cache.rows_before_quantizing()
        if room is None:
            return MAX_DRAFT
        return max(0, room - lead - (1 if self.seq.cache.recurrent else 0))

    def draft(self, drafter: Drafter, history: list[int], budget: int) -> DraftTree:
        """The drafter's tree after `history`: at most `budget` nodes, ids this model has, a chain
        where the model takes only chains."""
        if budget <= 0:
            return DraftTree.empty()
        tree = drafter.propose(history, budget, max_branching=self.max_branching)
        tree = tree.truncate(budget).keep_valid(self.vocab_size)
        return tree.first_path() if self.chain_reason and not tree.is_chain() else tree

    def check(self, prompt: Seq[int], max_tokens: int = 1) -> list[int]:
        """The prompt as ints, or a one-line CachebackError saying why it cannot run."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise CachebackError("empty prompt")
        if max_tokens < 0:
            raise CachebackError(f"max_tokens must be >= 0 (got {max_tokens})")
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise CachebackError(f"prompt token ids must be in [0, {self.vocab_size}) for this model")
        if len(prompt) >= self.context_length:
            raise CachebackError(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                                 f"{self.context_length} tokens")
        return prompt

    def prefill_only(self, prompt: Seq[int], context=(), slot: int | None = None, stop=None) -> None:
        """Bring the caches up to the prompt and generate nothing (editors' warm-up requests), so
        the next request that starts with this prompt only prefills what follows it. An empty
        prompt prefills nothing: the drafter only learns the context (a warm-up of an editor's
        chunks that the prompt layout leaves out). `stop`: see _start."""
        self.stats = Stats(prompt_tokens=len(prompt))
        if not prompt:
            seq = self.seq  # nothing to prefill: the drafter learns the context
            seq.history = start_request(self.drafter, seq.history, seq.history, context, seq.learned)
            return
        prompt = self.check(prompt, 0)
        with cores.share.busy():
            self._start(prompt, context, slot=slot, stop=stop)

    def generate(self, prompt: Seq[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
                 context=(), slot: int | None = None, forced: Seq[int] | None = None,
                 stop=None) -> Iterator[Accepted]:
        """Yield the tokens accepted at each step (EOS excluded) until EOS or max_tokens, with their
        log-probabilities when `sampling.logprobs` (Accepted; the EOS token's: stats.stop_logprobs).
        `context`: ids beside the prompt the drafter may draft from, one list or several (an
        editor's chunks and the code below the cursor; start_request). `slot`: see _start.
        `forced`: a recorded stream to accept along instead of the model's own picks (at most
        its length is generated): every pass still runs on this model with its real rows and
        cache, only the accept step reads the recording (forced_picks; `bench --forced`).
        `stop`: asked between prefill chunks (see _start)."""
        prompt = self.check(prompt, max_tokens)
        if max_tokens == 0:
            raise CachebackError("max_tokens must be > 0 (use prefill_only to only prefill)")
        max_tokens = min(max_tokens, self.context_length - len(prompt))
        if forced is not None:
            forced = [int(t) for t in forced]
            if not forced:
                raise CachebackError("the forced stream is empty")
            max_tokens = min(max_tokens, len(forced))
        self.stats = stats = Stats(prompt_tokens=len(prompt))
        pick = token_picker(sampling)  # a seeded one draws from its own key
        plan = self.planner
        ahead_ok = self.run_ahead and self.peers is None and forced is None  # see `ahead` below
        with cores.share.busy():  # other processes of ours run fewer BLAS threads meanwhile (cores.py)
            self._start(prompt, context, slot, stop, tail=not self.prompt_as_mlx_lm)
            seq = self.seq  # the sequence this request runs in (its slot's)
            ahead = None  # a plain step already running over seq.lead: its logits
            self.ahead_rule.start()  # counts passes in a row the drafter had nothing worth sending for
            t_start = time.perf_counter()
            try:
                while stats.tokens < max_tokens:
                    cores.share.adjust()  # another process may have started or ended
                    # draft: as many tokens as the planner asks for, within the tokens and context left
                    lead = seq.lead
                    budget = plan.draft_cap(len(lead), len(seq.cached),
                                            min(max_tokens - stats.tokens - 1,
                                                self.context_length - len(seq.cached) - len(lead) - 1,
                                                self._room_to_quantize(len(lead))))
                    t0 = time.perf_counter()
                    tree = self.draft(self.drafter, seq.history, budget)
                    plan.drafted(budget, time.perf_counter() - t0)
                    tree, size = plan.plan(tree, len(lead), len(seq.cached))  # the nodes sent, the rows run
                    stats.draft_s += time.perf_counter() - t0
                    drafts = len(tree) > 0 or size > len(lead)  # worth more than a plain step
                    self.ahead_rule.passed(drafts)
                    # verify: lead + draft in one pass (or the plain step over lead that already runs)
                    t0 = time.perf_counter()
                    ran_ahead = ahead is not None  # this pass is the plain step started at the last one
                    if ran_ahead:
                        logits, tree, size, ahead = ahead, DraftTree.empty(), len(lead), None
                    else:
                        logits = self._verify(lead, tree, size)
                    # pick: penalties and biases first, each row after its own tokens; then each row's token
                    logits = processed_rows(sampling.logits_processors, logits, seq.history, tree)
                    picks = pick(logits, len(seq.cached) + len(lead), tree)
                    # the model's best tokens at each row, for the drafter (Drafter.alternatives); not in
                    # a forced run, whose drafter hears only what a replay of the recording knows
                    best = self.drafter.alternatives if forced is None else 0
                    tops = top_tokens(logits, 1 + best) if best > 0 else None
                    read = [picks] if tops is None else [picks, tops]
                    if (ahead_ok and self.ahead_rule.ready() and size == len(lead) == 1  # (no drafts)
                            and stats.tokens + 1 < max_tokens):
                        # a plain step after quiet ones: keep its row, and start the next plain step
                        # over its token before that token is read, so the device never waits for
                        # this loop (as in mlx-lm's). The drafter speaks again at the next token:
                        # if it drafts there, that step's token leads the drafted pass after it.
                        mx.async_eval(*read)
                        self._finish([0], True)
                        ahead = step_pass(self.model, seq.cache, picks)
                        mx.async_eval(ahead)
                        stats.ahead += 1
                    mx.async_eval(*read)  # the pass: the drafter and the planner learn from the last one meanwhile
                    t1 = time.perf_counter()
                    self.drafter.catch_up()
                    plan.catch_up()
                    stats.learn_s += time.perf_counter() - t1
                    mx.eval(*read)
                    picks, tops = picks.tolist(), None if tops is None else tops.tolist()
                    if forced is not None:
                        picks = forced_picks(tree, forced[stats.tokens :])
                    seconds = time.perf_counter() - t0
                    stats.verify_s += seconds
                    # accept the longest path the model agrees with, plus its bonus token
                    path, bonus = accept(tree, picks)
                    accepted = [int(tree.tokens[i]) for i in path] + [int(bonus)]
                    plan.record(size, len(seq.cached), seconds, tree, path, accepted, ran_ahead)
                    self._ran(PassEvent("verify", size, len(seq.cached), seconds, len(lead), len(tree)))
                    # rollback: keep lead + accepted nodes, compacted, drop the rest (or undo it all);
                    # a plain step that started the next one kept its row already
                    rows = list(range(len(lead))) + [len(lead) + i for i in path]
                    whole = len(path) == len(tree) and size == len(rows)
                    if ahead is not None or self._finish(rows, whole):
                        seq.cached.extend(lead + accepted[:-1])
                        seq.lead = [bonus]
                    else:
                        seq.lead = lead + accepted
                        stats.undone += 1
                    stats.passes += 1
                    stats.drafted += len(tree)
                    # stop at EOS or the token limit
                    eos = next((i for i, t in enumerate(accepted) if t in self.eos_ids), None)
                    out = Accepted(accepted[:eos][: max_tokens - stats.tokens])
                    if sampling.logprobs:  # each token's, from the row that predicted it
                        logprobs = accepted_logprobs(logits, path)
                        out.logprobs = logprobs[: len(out)]
                        stats.stop_logprobs = logprobs[eos] if eos is not None and len(out) == eos else None
                    # update the drafter
                    t0 = time.perf_counter()
                    seq.history.extend(out)
                    self.drafter.observe(out)
                    self.drafter.recycle(tree.picked(lead[-1], picks, tops))  # every row's, accepted or not
                    stats.draft_s += time.perf_counter() - t0
                    stats.tokens += len(out)
                    stats.accepted += len(out) + (eos is not None and len(out) == eos)
                    if eos is not None and len(out) == eos:
                        stats.stop_token = accepted[eos]
                    stats.decode_s = time.perf_counter() - t_start
                    if out:
                        yield out
                    if eos is not None or len(out) < len(accepted):
                        break
            finally:
                if ahead is not None:  # a step started past the last token (EOS, or the caller stopped)
                    self._finish([], False)
                plan.catch_up()  # the last pass's record
                # the cache keeps what plain decoding fed (the prompt and every token out but the last;
                # all of them before an EOS), whatever was drafted past it: a next turn then prefills
                # the same tokens in the same chunks with any drafter, as the bits of half precision on
                # a GPU need (a product's bits depend on its rows)
                fed = len(prompt) + stats.tokens - (stats.stop_token is None)
                if seq.cache.quantized_past(fed):  # turned quantized where plain decoding did not
                    seq.cached.clear()
                    self._trim(0)
                elif len(seq.cached) > fed and not seq.cache.recurrent:
                    del seq.cached[fed:]
                    self._trim(fed)
                stats.decode_s = time.perf_counter() - t_start
                self.drafter.end_request()
