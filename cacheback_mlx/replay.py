"""Replay a drafter on a recorded greedy stream: exact accepted-token counts with no model.

Greedy verification is deterministic, so on a stream the model is known to produce, a step accepts
the longest root path of the draft tree that matches the stream, plus one bonus token. This is the
engine's accept rule (engine.accept) run against a recording; drafter tests and tuning use it.
What the model picked at the rows of drafts it rejected is not in a recording, so a drafter
learns only the picks along the stream (Drafter.recycle), as in a forced run (tree.forced_picks);
live, it learns every row's, and drafts somewhat better than here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .drafters.base import Drafter
from .tree import DraftTree, forced_picks

SHARED_STREAMS = Path(__file__).resolve().parents[2] / "shared" / "data" / "smollm2_greedy"


def longest_match(tree: DraftTree, continuation: Sequence[int]) -> list[int]:
    """Node indices of the longest root path whose tokens equal the start of `continuation`."""
    kids = tree.children()
    path: list[int] = []
    node = -1
    while len(path) < len(continuation):
        want = continuation[len(path)]
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


@dataclass
class ReplayResult:
    tokens: int  # tokens produced
    steps: int  # verify passes
    draft_seconds: float  # time spent in propose + observe
    max_tree: int  # largest tree proposed
    pass_seconds: float = 0.0  # with a sizer: what the passes would cost by its cost table
    ahead: int = 0  # plain steps that ran ahead (replay's `ahead`)

    @property
    def mat(self) -> float:
        """Mean accepted tokens per pass (bonus included), as Spec-Bench reports it."""
        return self.tokens / max(self.steps, 1)


def replay(drafter: Drafter, prompt: Sequence[int], output: Sequence[int], budget: int = 96,
           sizer=None, clock=None, ahead=None) -> ReplayResult:
    """Run `drafter` over prompt -> output as the engine would; count passes and accepted tokens.
    sizer (budget.Sizer): size each pass as the engine's per-step budget does, `budget` the cap.
    clock(rows, context) -> seconds: what a pass "really" costs; each pass is priced by it and
    reported to the sizer as the engine reports a measured pass (default: the sizer's own price,
    nothing reported); without a sizer, each fixed-budget pass is priced by it too.
    ahead (run_ahead.RunAhead): plain steps run ahead as the engine's do where it says so (on a
    GPU): the pass after one that started a step is that plain step, whatever was drafted for it,
    and the clock prices it as clock(0, context)."""
    t0 = time.perf_counter()
    drafter.observe(prompt)
    observe_s = time.perf_counter() - t0
    r = decode(drafter, list(prompt), output, budget, sizer, clock, ahead)
    r.draft_seconds += observe_s
    return r


def decode(drafter: Drafter, history: list[int], output: Sequence[int], budget: int = 96,
           sizer=None, clock=None, ahead=None) -> ReplayResult:
    """replay() once the drafter has seen `history` (extended in place with the output)."""
    draft_s = 0.0
    pos = steps = max_tree = ran_ahead = 0
    pass_s = 0.0
    started = False  # the pass before started a plain step, which takes this pass's place
    if ahead is not None:
        ahead.start()
    while pos < len(output):
        t0 = time.perf_counter()
        limit = min(budget, len(output) - pos - 1)  # as the engine: the last token is a pass's own
        cap = limit if sizer is None else min(limit, sizer.cap(limit, len(history)))
        tree = drafter.propose(history, cap) if cap > 0 else DraftTree.empty()
        rows = 1 + len(tree)
        if sizer is not None:
            sizer.drafted(cap, time.perf_counter() - t0)  # as the engine reports it
            tree = sizer.choose(tree.truncate(cap), 1, len(history))
            rows = sizer.pass_rows(1 + len(tree), len(history))
        draft_s += time.perf_counter() - t0
        if ahead is not None:
            ahead.passed(rows > 1)
            if started:
                tree, rows, started = DraftTree.empty(), 0, False
                ran_ahead += 1
        if clock is not None:
            pass_s += (seconds := clock(rows, len(history)))
            if sizer is not None:
                sizer.timed(max(rows, 1), len(history), seconds, rows == 0)
        elif sizer is not None:
            pass_s += sizer.price(max(rows, 1), len(history))
        if len(tree) > budget:
            raise AssertionError(f"{drafter.name} proposed {len(tree)} > budget {budget} tokens")
        max_tree = max(max_tree, len(tree))
        path = longest_match(tree, output[pos:])
        accepted = [int(tree.tokens[i]) for i in path]
        if pos + len(accepted) < len(output):
            accepted.append(int(output[pos + len(accepted)]))  # the bonus token
        if sizer is not None:
            sizer.update(tree, path, accepted)
        picks = tree.picked(history[-1], forced_picks(tree, output[pos:]))  # the rows off the stream: unknown
        history.extend(accepted)
        pos += len(accepted)
        steps += 1
        started = ahead is not None and rows <= 1 and ahead.ready() and pos < len(output)
        t0 = time.perf_counter()
        drafter.observe(accepted)
        drafter.recycle(picks)
        draft_s += time.perf_counter() - t0
    return ReplayResult(pos, steps, draft_s, max_tree, pass_s, ran_ahead)


def load_streams(folder: Path = SHARED_STREAMS) -> list[dict]:
    """The recorded streams: dicts with id, cat, prompt (ids) and out (ids)."""
    prompts = {p["id"]: p for p in json.loads((folder / "prompts_ids.json").read_text())}
    outs = json.loads((folder / "greedy_outputs.json").read_text())
    return [{"id": o["id"], "cat": o["cat"], "prompt": prompts[o["id"]]["ids"], "out": o["out"]} for o in outs]


def replay_all(make, streams: list[dict], budget: int = 96, fresh_per_stream: bool = True) -> ReplayResult:
    """Total over streams; `make()` builds a drafter (a fresh one per stream unless told not to)."""
    total = ReplayResult(0, 0, 0.0, 0)
    drafter = make()
    for s in streams:
        if fresh_per_stream:
            drafter = make()
        r = replay(drafter, s["prompt"], s["out"], budget)
        total = ReplayResult(total.tokens + r.tokens, total.steps + r.steps,
                             total.draft_seconds + r.draft_seconds, max(total.max_tree, r.max_tree))
    return total


def replay_requests(make, requests: list[dict], budget: int = 7, fresh: bool = False) -> list[ReplayResult | None]:
    """A server's requests as its engine runs them: each starts as Engine._start does (learning.start_request:
    the context beside the prompt, the text before an edit again, the prompt's new tokens), then
    decodes its recorded output; a request with max_tokens 0 (an editor's warm-up) only starts
    (None in the result). Requests: dicts with prompt, context and out (ids) and max_tokens, and the
    engine slot it ran in (default 0): each slot keeps its own history and learned segments.
    fresh: a new drafter (`make()`) for every request, as the server's keep_drafter=False."""
    from .learning import start_request

    drafter, views, results = make(), {}, []
    for req in requests:
        if fresh:
            drafter, views = make(), {}
        history, learned = views.get(req.get("slot", 0), ([], set()))
        history = start_request(drafter, history, req["prompt"], req.get("context") or (), learned)
        views[req.get("slot", 0)] = (history, learned)
        if not req.get("max_tokens", len(req["out"])):
            results.append(None)
            continue
        results.append(decode(drafter, history, req["out"], budget))
        drafter.end_request()
    return results
