"""Replay an editing session against the completion server, the way llama.vim sends it.

    .venv/bin/python -m tools.editor.replay                       # 16 blocks of 15 lines, kept vs fresh (~8 min)
    .venv/bin/python -m tools.editor.replay --blocks 1 --block-lines 6 --every 3   # smoke test

A benchmark, not a test: it prints markdown tables for docs/BENCHMARKS.md. The server runs in this
process (`create_app` behind FastAPI's TestClient, no network). The edited file is one that no
shipped table was built from (the frozen table comes from the CPython stdlib): by default the
installed `click` package's core.py (`--file` to change). `--blocks` blocks of `--block-lines`
lines, spread over the file (seeded), are cut out and re-typed line by line, top to bottom; every
`--every` lines (from 0) the editor asks for a completion with the cursor at the start of the next
line to type: prefix = the document above it, suffix = the file after the cut block. The blocks
not typed yet are cut out too (`--later-blocks kept` leaves them in, as the earlier protocol
did: a block's suffix or a chunk picked below it then showed a kept drafter some of the next
block's lines before they were typed).

Bodies are llama.vim's (ggml-org/llama.vim a1c8e6e: s:fim_ctx_local, llama#fim): the last 256 lines
above the cursor, the cursor line split at the cursor, the next 64 lines, the ring buffer of extra
chunks, its sampling fields and `response_fields`, to which this tool ADDS timings/cache_n,
timings/passes, timings/mat, timings/draft_n, timings/draft_n_accepted and tokens_evaluated
(llama.cpp ignores paths it lacks). As llama.vim does, a completion asks for t_max_predict_ms 250 and,
once its hint is shown, a speculative follow-up is sent: the same position as if the hint had been
accepted (a:prev = the hint's lines, s:fim_render's rules for what is shown), t_max_predict_ms 1000.
The user types meanwhile, so follow-ups are counted and timed apart from completions; the next
completion is at the lines really typed, not the hint. `--no-follow-ups` replays the protocol of the
runs before 2026-11-25 (no follow-ups; 250 ms for a block's first request, 1000 after). The ring
buffer is modelled simply and deterministically: when the cursor has moved more than 32 lines since
the last pick (a block's first request), one chunk of up to 32 lines is queued from [cursor-1024,
cursor-256] and one from [cursor+64, cursor+128] (s:pick_chunk, seeded instead of random; exact
duplicates skipped); between two requests one queued chunk enters the ring (16 at most, oldest out)
and llama.vim's warm-up request (n_predict 0) is sent for it (s:ring_update). Warm-ups are counted
and timed apart from completions. Not modelled: the eviction of ring chunks similar to the cursor's
surroundings (s:chunk_sim > 0.5 in llama#fim), the editor's completion cache (a hint typed as shown
comes from it) and typing pauses.

Per completion: prompt tokens (tokens_evaluated, else prompt_n + timings/cache_n), prefilled
(prompt_n), reused = timings/cache_n / prompt tokens (llama.cpp's tokens_cached is NOT the reused
count but n_past, prompt and reply together: used only when the others are missing), latency (the
HTTP call's wall time), and the time to the first completed line, an ESTIMATE: the latency less the
decode time after the first newline of the reply, decode time being shared over tokens in
proportion (the whole latency when the reply has no complete line). `--state both` runs the same
request sequence on two Sessions: kept (the drafter keeps what it learned) and fresh (a fresh
drafter every request; the KV prefix is still reused). Tokens per pass are given over the
completions and over them and the follow-ups sent after them. Quality: whether the reply's first
line is the line then typed ("right"), and how much of that line it gets right from its start
("match", the share of its characters after the indentation). `--record FILE` writes the first
state's engine requests for tools/editor/mat.py, which replays the drafting offline.
`--flip FILE` edits a second file by turns with the first (one completion in each in turn, each
file with its own blocks and ring): an editor flipping between two files, where the server's
slots (`--slots`, serve's option) keep each file's cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

N_PREFIX, N_SUFFIX, RING_CHUNK, RING_SCOPE = 256, 64, 64, 1024  # llama.vim's defaults
CHUNK_LINES, RING_MAX, QUEUE_MAX, PICK_MOVE = RING_CHUNK // 2, 16, 16, 32
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
OUR_FIELDS = ["timings/cache_n", "timings/passes", "timings/mat", "timings/draft_n", "timings/draft_n_accepted",
              "tokens_evaluated"]
EPOCH = 1_700_000_000  # the simulated reltime() clock starts here and ticks 2 s per completion


def default_file() -> Path:
    import click
    return Path(click.__file__).parent / "core.py"


def pick_blocks(lines: list[str], n: int, length: int, rng: random.Random) -> list[int]:
    """Start lines (0-based) of n blocks, one in each nth of the file, each on a non-blank line."""
    span = len(lines) // n
    if span < length + 1:
        sys.exit(f"file of {len(lines)} lines is too short for {n} blocks of {length} lines")
    starts = []
    for i in range(n):
        lo, hi = i * span, (i + 1) * span - length
        good = [s for s in range(lo, hi + 1) if lines[s].strip()]
        starts.append(rng.choice(good or [lo]))
    return starts


def below(lines: list[str], starts: list[int], b: int, length: int, cut_later: bool = True) -> list[str]:
    """The file below block b (cut out at starts[b]). cut_later: the blocks not typed yet are cut
    out of it too, so no request shows the drafter a line before it is typed (a session writing
    new code in several places of a file); else they stay (`--later-blocks kept`: as in
    the earlier protocol, where a block's suffix or a chunk picked below it could hold the
    next block's lines, seen by a kept drafter before they were typed)."""
    at = starts[b] + length
    if not cut_later:
        return lines[at:]
    out = []
    for s in starts[b + 1:]:
        out += lines[at:s]
        at = s + length
    return out + lines[at:]


class Ring:
    """llama.vim's extra context: queued chunks move into the ring one per ring update."""

    def __init__(self, rng: random.Random, filename: str):
        self.rng, self.filename, self.queued, self.chunks = rng, filename, [], []

    def pick(self, text: list[str], now: float) -> None:  # s:pick_chunk, no similarity eviction
        if len(text) < 3:
            return
        if len(text) + 1 < RING_CHUNK:
            chunk = text
        else:
            l0 = self.rng.randint(0, max(0, len(text) - CHUNK_LINES))
            chunk = text[l0:l0 + CHUNK_LINES]
        if any(c["data"] == chunk for c in self.chunks + self.queued):
            return
        if len(self.queued) == QUEUE_MAX:
            self.queued.pop(0)
        self.queued.append({"data": chunk, "time": [EPOCH + int(now), int(now % 1 * 1e6)]})

    def update(self) -> bool:  # s:ring_update: True when a chunk moved in (send a warm-up)
        if not self.queued:
            return False
        if len(self.chunks) == RING_MAX:
            self.chunks.pop(0)
        self.chunks.append(self.queued.pop(0))
        return True

    def extra(self) -> list[dict]:  # s:ring_get_extra
        return [{"text": "\n".join(c["data"]) + "\n", "time": c["time"], "filename": self.filename}
                for c in self.chunks]


def fim_body(doc: list[str], y: int, extra: list[dict], t_max_predict_ms: int, prev: list[str] | None = None) -> dict:
    """llama#fim's body for the cursor at the start of the empty line doc[y] (0-based); with `prev`
    (the lines of the hint shown there), its speculative follow-up: the context as if the hint had
    been accepted (s:fim_ctx_local with a:prev)."""
    lines, middle = doc[max(0, y - N_PREFIX):y], ""
    if prev:
        lines = doc[max(0, y - N_PREFIX + len(prev) - 1):y] + ([prev[0]] + prev[1:-1] if len(prev) > 1 else [])
        middle = prev[-1]
    return {"id_slot": 0, "input_prefix": "\n".join(lines) + "\n",
            "input_suffix": "" + "\n" + "\n".join(doc[y + 1:y + 1 + N_SUFFIX]) + "\n",
            "input_extra": extra, "prompt": middle, "n_predict": 128, "stop": [], "n_indent": 0,
            "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": t_max_predict_ms,
            "response_fields": VIM_FIELDS + OUR_FIELDS}


def hint_lines(content: str, doc: list[str], y: int) -> list[str]:
    """The lines llama.vim shows for a reply at the empty line doc[y] (s:fim_render's rules: trailing
    empty lines dropped; nothing shown when the reply only repeats the lines below the cursor)."""
    lines = content.split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines or lines == [""] or (lines[0] == "" and lines[1:] == doc[y + 1:y + len(lines)]):
        return []
    cmp = y + 1
    while cmp < len(doc) - 1 and not doc[cmp].strip():
        cmp += 1
    if cmp < len(doc) and lines[0] == doc[cmp]:
        n = len(lines)
        if (n == 1 or (n == 2 and doc[cmp + 1:cmp + 2] and lines[1] == doc[cmp + 1][:len(lines[1])])
                or (n > 2 and lines[1:] == doc[cmp + 1:cmp + n])):
            return []
    return [] if "".join(lines).strip() == "" else lines


def warm_body(extra: list[dict]) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def plan(lines: list[str], filename: str, args) -> list[tuple[str, dict, dict | None]]:
    """The session's requests in order: ("fim", body, where) and ("warm", body, None)."""
    rng = random.Random(args.seed)
    ring, events, pos_pick, n = Ring(rng, filename), [], -9999, 0
    starts = pick_blocks(lines, args.blocks, args.block_lines, rng)
    for b, s in enumerate(starts):
        before, block = lines[:s], lines[s:s + args.block_lines]
        after = below(lines, starts, b, args.block_lines, args.later_blocks == "cut")
        for typed in range(0, args.block_lines, args.every):
            if ring.update():
                events.append(("warm", warm_body(ring.extra()), None))
            doc, y = before + block[:typed] + [""] + after, s + typed
            extra = [] if args.no_extra else ring.extra()
            t_max = 250 if typed == 0 or getattr(args, "follow_ups", False) else 1000
            events.append(("fim", fim_body(doc, y, extra, t_max),
                           {"block": b + 1, "typed": typed, "line": y + 1, "first": typed == 0, "doc": doc, "y": y,
                            "truth": block[typed]}))
            n += 1
            if not args.no_extra and abs(y - pos_pick) > PICK_MOVE:  # vim lines are 1-based: y + 1
                last = len(doc)
                ring.pick(doc[max(1, y + 1 - RING_SCOPE) - 1:max(1, y + 1 - N_PREFIX)], 2.0 * n)
                ring.pick(doc[min(last, y + 1 + N_SUFFIX) - 1:min(last, y + 1 + N_SUFFIX + RING_CHUNK)], 2.0 * n)
                pos_pick = y
    return events


def interleave(a: list, b: list, blocks: int) -> list:
    """Two files' requests by turns, one completion (with the warm-ups before it and the follow-up
    after it) from each in turn: an editor flipping between two files. b's blocks are numbered
    after a's."""
    def turns(events, shift):
        out, turn = [], []
        for kind, body, where in events:
            turn.append((kind, body, where if where is None else where | {"block": where["block"] + shift}))
            if kind == "fim":
                out, turn = out + [turn], []
        return out + ([turn] if turn else [])

    merged = []
    for x, y in itertools.zip_longest(turns(a, 0), turns(b, blocks), fillvalue=[]):
        merged += x + y
    return merged


def field(resp: dict, path: str):
    """A response_fields value: llama.cpp returns the flat key "timings/x"; a full body nests it."""
    if path in resp:
        return resp[path]
    for key in path.split("/"):
        resp = resp.get(key) if isinstance(resp, dict) else None
    return resp


def record_engine(engine, log: list[dict], tag: dict) -> None:
    """Log every request the engine runs (prompt, context, max_tokens and the tokens it produced),
    tagged with tag's current value, for tools/editor/mat.py's offline replay of the drafters."""
    from cacheback_mlx.learning import segments
    from cacheback_mlx.sampling import SamplingParams

    generate, prefill_only = engine.generate, engine.prefill_only

    def gen(prompt, max_tokens, sampling=SamplingParams(), context=(), slot=None):
        rec = dict(tag) | {"prompt": [int(t) for t in prompt], "context": segments(context),
                           "max_tokens": max_tokens, "out": []}
        log.append(rec)
        try:
            for out in generate(prompt, max_tokens, sampling, context, slot):
                rec["out"].extend(int(t) for t in out)
                yield out
        finally:
            rec["slot"] = engine.slots.active

    def pre(prompt, context=(), slot=None):
        prefill_only(prompt, context, slot)
        log.append(dict(tag) | {"prompt": [int(t) for t in prompt], "context": segments(context),
                                "max_tokens": 0, "out": [], "slot": engine.slots.active})

    engine.generate, engine.prefill_only = gen, pre


def run_state(events, session, keep: bool, args, infill_extra: int | None = None, slots: int | None = None,
              batch: int | None = None) -> dict:
    from cacheback_mlx.server import create_app

    from fastapi.testclient import TestClient

    opts = {"max_body": args.max_body} | ({} if keep else {"keep_drafter": False})
    opts |= {"stable_prefix": False} if args.sliding_prefix else {}
    if infill_extra is not None:
        opts["infill_extra"] = None if infill_extra < 0 else infill_extra
    if slots is not None:
        opts["slots"] = slots
    if batch is not None:
        opts["batch"] = batch
    engine = session.engine
    encode = lambda t: len(session.tokenizer.encode(t, add_special_tokens=False))
    out = {"rows": [], "warm_n": 0, "warm_ms": 0.0, "follow": [], "failures": [], "log": []}
    tag: dict = {}
    if getattr(args, "record", None):
        record_engine(engine, out["log"], tag)
    with TestClient(create_app(session, **opts), raise_server_exceptions=False) as client:

        def post(kind: str, body: dict, where: dict | None = None) -> tuple[dict | None, float]:
            tag.clear()
            tag.update({"kind": kind} | {k: v for k, v in (where or {}).items() if k in ("block", "typed", "first")})
            t0 = time.perf_counter()
            r = client.post("/infill", json=body)
            ms = 1e3 * (time.perf_counter() - t0)
            if r.status_code == 200:
                return r.json(), ms
            try:
                msg = r.json().get("error", {}).get("message") or r.text
            except ValueError:
                msg = r.text
            out["failures"].append(f"{kind} {r.status_code}: {str(msg)[:160]}")
            return None, ms

        for kind, body, where in events:
            resp, ms = post(kind, body, where)
            if resp is None:
                continue
            if kind == "warm":
                out["warm_n"], out["warm_ms"] = out["warm_n"] + 1, out["warm_ms"] + ms
                continue
            num = lambda p: field(resp, p) or 0
            prompt_n, predicted, pred_ms = (num("timings/prompt_n"), num("timings/predicted_n"),
                                            num("timings/predicted_ms"))
            cached, total = field(resp, "timings/cache_n"), field(resp, "tokens_evaluated")
            if total is None:  # llama.cpp's tokens_cached is n_past: the prompt and the reply
                total = prompt_n + cached if cached is not None else num("tokens_cached") - predicted
            cached = total - prompt_n if cached is None else cached
            content = resp.get("content") or ""
            first_line = first_line_ms(content, ms, predicted, pred_ms, encode)
            doc, y = where["doc"], where["y"]
            # the hint's first line is the line the user then typed (None: a blank line was typed next)
            right = content.split("\n", 1)[0].rstrip() == where["truth"].rstrip() if where["truth"].strip() else None
            match = line_match(content.split("\n", 1)[0], where["truth"]) if where["truth"].strip() else None
            out["rows"].append({k: v for k, v in where.items() if k not in ("doc", "y", "truth")}
                               | {"right": right, "match": match, "prompt": total, "prefilled": prompt_n,
                                  "cached": cached,
                                  "reused": 100 * cached / total if total else 0.0, "ms": ms,
                                  "first_line": first_line, "predicted": predicted,
                                  "passes": num("timings/passes"), "chars": len(content)})
            hint = hint_lines(content, doc, y) if getattr(args, "follow_ups", False) else []
            if hint:  # llama.vim's speculative follow-up, sent once the hint is shown (the user types meanwhile)
                resp, ms = post("follow-up", fim_body(doc, y, body["input_extra"], 1000, hint), where)
                out["rows"][-1]["followed"] = True
                if resp is not None:
                    out["follow"].append({"ms": ms, "predicted": field(resp, "timings/predicted_n") or 0,
                                          "passes": field(resp, "timings/passes") or 0})
                    out["rows"][-1]["follow"] = out["follow"][-1]
    return out


def first_line_ms(content: str, ms: float, predicted: int, pred_ms: float, encode) -> float:
    """The time to the reply's first completed line, an estimate: the latency less the decode time
    after its first newline (decode time shared over tokens in proportion; encode(text) -> tokens)."""
    nl = content.find("\n", len(content) - len(content.lstrip()))
    if nl < 0 or not predicted:
        return ms
    return ms - pred_ms * (1 - min(1.0, encode(content[:nl + 1]) / predicted))


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def tpp(rows) -> float:
    passes = sum(r["passes"] for r in rows)
    return sum(r["predicted"] for r in rows) / passes if passes else float("nan")


def tpp_served(rows) -> float:
    """Tokens per pass over the completions and the follow-ups sent after them."""
    return tpp(rows + [r["follow"] for r in rows if "follow" in r])


def line_match(hint: str, truth: str) -> float:
    """How much of the typed line the hint's first line gets right from its start: the share of
    the line's characters after its indentation (0 when the indentation differs)."""
    hint, truth = hint.rstrip(), truth.rstrip()
    indent = len(truth) - len(truth.lstrip())
    if hint[:indent] != truth[:indent] or hint[indent:indent + 1].isspace():
        return 0.0
    same = next((i for i, (a, b) in enumerate(zip(hint, truth)) if a != b), min(len(hint), len(truth)))
    return (same - indent) / (len(truth) - indent)


def match_pct(rows) -> float:
    """Mean line_match over the replies (blank lines typed next left out), in %."""
    known = [r["match"] for r in rows if r.get("match") is not None]
    return 100 * sum(known) / len(known) if known else float("nan")


def right_pct(rows) -> float:
    """Share of replies whose first line is the line typed next (blank lines typed next left out)."""
    known = [r["right"] for r in rows if r["right"] is not None]
    return 100 * sum(known) / len(known) if known else float("nan")


def thirds(rows):
    n = len(rows)
    cuts = [0, (n + 2) // 3, (2 * n + 1) // 3, n]  # contiguous, sizes within one of each other
    return [rows[cuts[i]:cuts[i + 1]] for i in range(3)]


def table(head: list[str], rows: list[list]) -> None:
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(cell(v).replace("nan", "-") for v in r) + " |")
    print()


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def extra_in_prompt(infill_extra: int | None) -> str:
    if infill_extra is None:
        return "the default number of their tokens"
    return "all that fit" if infill_extra < 0 else f"at most {infill_extra} tokens of them"


def header(args, path: Path, session) -> None:
    import mlx.core as mx
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    print("## Editor replay (llama.vim requests)\n")
    print("`" + " ".join([".venv/bin/python -m tools.editor.replay", shlex.join(sys.argv[1:])]).strip() + "`\n")
    print(f"- machine: {cpu} ({platform.system()} {platform.machine()}), MLX {mx.__version__} on {mx.default_device()}")
    print(f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; model: {session.loaded.name}; "
          f"drafter: {args.drafter}")
    where = path.relative_to(path.parents[1]) if len(path.parents) > 1 else path
    if args.file is None:
        where = f"{where} (click {metadata.version('click')})"
    print(f"- file: {where} ({args.blocks} blocks of {args.block_lines} lines, a request every {args.every} lines, "
          f"seed {args.seed}, extra chunks {'off' if args.no_extra else 'sent'} "
          f"(server: {' / '.join(extra_in_prompt(x) for x in args.infill_extra)} in a prefix-only prompt), "
          f"follow-ups {'on' if args.follow_ups else 'off'}, "
          f"prefix {'sliding' if args.sliding_prefix else 'stable start'})")
    if args.flip:
        print(f"- flipping by turns with {args.flip.name} ({args.blocks} blocks of its own, seed {args.seed + 1}): "
              f"one completion in each file in turn")
    if args.batch_size != [None]:
        print(f"- server batch size: {' / '.join('default' if n is None else str(n) for n in args.batch_size)}")
    if args.slots != [None]:
        print(f"- server slots: {' / '.join('default' if n is None else str(n) for n in args.slots)}")
    print("- first line ms is an estimate: latency less the decode time after the reply's first newline\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, help="source file to edit (default: click's core.py)")
    ap.add_argument("--blocks", type=int, default=16,
                    help="default 16 (of 15 lines: 80 completions; the learning needs a session that long, "
                         "docs/BENCHMARKS.md §8)")
    ap.add_argument("--block-lines", type=int, default=15)
    ap.add_argument("--every", type=int, default=3, help="a completion request every K lines typed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--later-blocks", choices=["cut", "kept"], default="cut",
                    help="cut (default): the blocks not typed yet are cut out of the file too, so no request "
                         "shows a line before it is typed; kept: they stay (the earlier protocol)")
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--draft-budget", type=int, default=None, help="draft tokens per pass (default: the engine's)")
    ap.add_argument("--state", choices=["kept", "fresh", "both"], default="both")
    ap.add_argument("--no-extra", action="store_true", help="no ring-buffer chunks (input_extra empty, no warm-ups)")
    ap.add_argument("--infill-extra", type=int_list, default=[None],
                    help="server option infill_extra (serve --infill-extra): tokens of extra chunks in a "
                         "prefix-only prompt; -1: all that fit (the layout before 2026-11-25); several, "
                         "comma-separated: each state is run with each, side by side")
    ap.add_argument("--no-follow-ups", dest="follow_ups", action="store_false",
                    help="no speculative follow-ups (the protocol of the runs before 2026-11-25)")
    ap.add_argument("--max-body", type=int, default=64 << 20)
    ap.add_argument("--sliding-prefix", action="store_true",
                    help="server option stable_prefix=False: the prefix is the last lines that fit "
                         "(no kept start line)")
    ap.add_argument("--slots", type=int_list, default=[None],
                    help="server option slots (serve --slots): sequences whose caches are kept at once "
                         "(default: serve's, 4); several, comma-separated: side by side")
    ap.add_argument("--batch-size", type=int_list, default=[None],
                    help="server option batch (serve --batch-size): bounds the prompt, prefix <= 3/4 of it "
                         "(default: serve's); several, comma-separated: side by side")
    ap.add_argument("--flip", type=Path, default=None,
                    help="a second file, edited by turns with --file: one completion in each in turn (an "
                         "editor flipping between two files; its blocks are picked with seed + 1)")
    ap.add_argument("--verbose", action="store_true", help="also print every request")
    ap.add_argument("--record", type=Path, default=None,
                    help="write the first state's engine requests (prompt, context, output ids) to this JSON "
                         "file, for tools/editor/mat.py")
    args = ap.parse_args(argv)
    if min(args.blocks, args.block_lines, args.every) < 1:
        ap.error("--blocks, --block-lines and --every must be >= 1")
    import tempfile

    from cacheback_mlx.api import Session
    from cacheback_mlx.drafters import drafter_parameters

    path = args.file or default_file()
    lines = path.read_text(encoding="utf-8").split("\n")
    events = plan(lines, f"{path.parent.name}/{path.name}", args)
    if args.flip:
        other = argparse.Namespace(**{**vars(args), "seed": args.seed + 1})
        flip = plan(args.flip.read_text(encoding="utf-8").split("\n"), f"{args.flip.parent.name}/{args.flip.name}",
                    other)
        events = interleave(events, flip, args.blocks)
    states = ["kept", "fresh"] if args.state == "both" else [args.state]
    results = {}
    variants = [(e, n, b) for e in args.infill_extra for n in args.slots for b in args.batch_size]
    with tempfile.TemporaryDirectory(prefix="replay-") as root:  # the drafters' stores, removed after
        for extra, slots, batch in variants:
            for state in states:
                # SSD starts from an empty store of its own, not from what this machine served before
                store = {k: tempfile.mkdtemp(prefix="ssd-", dir=root) for k in ("ssd_path", "path")
                         if k in drafter_parameters(args.drafter)}
                session = Session(args.model, args.drafter, draft_budget=args.draft_budget, **store)
                if not results:
                    header(args, path, session)
                label = ", ".join([state] + ([f"infill-extra {extra}"] if len(args.infill_extra) > 1 else [])
                                  + ([f"slots {slots}"] if len(args.slots) > 1 else [])
                                  + ([f"batch {batch}"] if len(args.batch_size) > 1 else []))
                results[label] = run_state(events, session, state == "kept", args, extra, slots, batch)
                if args.record and len(results) == 1:
                    args.record.write_text(json.dumps({"command": shlex.join(sys.argv[1:]), "state": label,
                                                       "model": session.loaded.name,
                                                       "requests": results[label]["log"]}))
                session.engine.drafter.close()  # its last write lands before the folder goes
                del session

    cols = ["state", "third", "requests", "prompt tok", "reused %", "latency ms", "first line ms", "tok/pass",
            "tok/pass with follow-ups", "first line right %", "first line match %"]
    summary = []
    for state, res in results.items():
        if args.verbose:
            print(f"### Requests, drafter {state}\n")
            table(["block", "line typed", "prompt tok", "prefilled", "reused %", "latency ms", "first line ms",
                   "predicted", "passes", "tok/pass", "right"],
                  [[r["block"], f"{r['line']} ({r['typed']}/{args.block_lines})", r["prompt"], r["prefilled"],
                    r["reused"], r["ms"], r["first_line"], r["predicted"], r["passes"], tpp([r]),
                    {True: "yes", False: "no", None: "-"}[r["right"]]] for r in res["rows"]])
        for name, part in zip(("first", "middle", "last"), thirds(res["rows"])):
            summary.append([state, name, len(part), med([r["prompt"] for r in part]),
                            med([r["reused"] for r in part if not r["first"]]), med([r["ms"] for r in part]),
                            med([r["first_line"] for r in part]), tpp(part), tpp_served(part), right_pct(part),
                            match_pct(part)])
    print("### By third of the session\n")
    print("reused %: requests after a block's first; tok/pass: tokens predicted per verify pass (over the "
          "completions, and over them and the follow-ups sent after them)\n")
    table(cols, summary)
    for state, res in results.items():
        fol = res["follow"]
        print(f"- {state}: {len(res['rows'])} completions (median first line "
              f"{med([r['first_line'] for r in res['rows']]):.0f} ms), "
              f"{res['warm_n']} warm-ups in {res['warm_ms']:.0f} ms, "
              f"{len(fol)} follow-ups in {sum(f['ms'] for f in fol):.0f} ms ({tpp(fol):.2f} tok/pass), "
              f"{len(res['failures'])} failed"
              + (" (fresh: server option keep_drafter=False)" if state == "fresh" else ""))
        for f in sorted(set(res["failures"]))[:5]:
            print(f"  - {f} (x{res['failures'].count(f)})")
    print("\n### Headline\n")
    head = results.get("kept") or next(iter(results.values()))
    reused = med([r["reused"] for r in head["rows"] if not r["first"]])
    first_line = med([r["first_line"] for r in head["rows"]])
    def learning(rate):
        if "kept" not in results or "fresh" not in results:
            return None, "- (needs --state both)"
        kept, fresh = (rate(thirds(results[s]["rows"])[2]) for s in ("kept", "fresh"))
        ok = kept / fresh - 1 >= 0.15 if fresh == fresh and fresh and kept == kept else None
        return ok, "-" if ok is None else f"{100 * (kept / fresh - 1):+.1f}% ({kept:.2f} vs {fresh:.2f} tok/pass)"

    ok, gain = learning(tpp)
    ok_all, gain_all = learning(tpp_served)
    check = lambda ok: "" if ok is None else (" ✅" if ok else " ❌")
    show = lambda v, fmt: "-" if v != v else format(v, fmt)  # nan: no request to measure
    print(f"- median tokens reused after a block's first request: {show(reused, '.1f')}% (target >= 80%)"
          f"{check(reused >= 80 if reused == reused else None)}")
    print(f"- learning across requests, tok/pass in the last third, kept vs fresh: {gain} (target >= +15%){check(ok)}")
    if any(res["follow"] for res in results.values()):
        print(f"  - over completions and their follow-ups: {gain_all}{check(ok_all)}")
    print(f"- median time to the first completed line (estimate): {show(first_line, '.0f')} ms (target < 1000 ms)"
          f"{check(first_line < 1000 if first_line == first_line else None)}")
    print(f"- the hint's first line is the line typed next: {show(right_pct(head['rows']), '.0f')}% of replies; "
          f"it gets {show(match_pct(head['rows']), '.0f')}% of that line right from its start, on average")


if __name__ == "__main__":
    main()
