"""Replay typing key by key against the completion server, with llama.vim's own timing and cache.

    .venv/bin/python -m tools.editor.typist                                   # 4 blocks of 8 lines
    .venv/bin/python -m tools.editor.typist --blocks 1 --block-lines 2 --state kept   # smoke test
    .venv/bin/python -m tools.editor.typist --client llama.vscode                     # llama.vscode's pattern

A benchmark, not a test: it prints markdown tables for docs/BENCHMARKS.md. tools/editor/replay.py
sends a completion every few lines; llama.vim (ggml-org/llama.vim a1c8e6e, autoload/llama.vim)
asks at every key, and this tool emulates its client on a simulated clock. The user re-types blocks
cut out of a file no shipped table comes from (click's core.py by default; the blocks not typed yet
are cut out too, unless `--later-blocks kept`: see replay.below), `--cps` keys a second:
a line starts with its indentation at once (Enter with autoindent), then one key per character.
What llama.vim does at each key (CursorMovedI), emulated from its source (clients.Vim):
- s:on_move: the hint is hidden, then s:fim_try_hint looks the cursor's context up in the
  client's completion cache (250 entries, LRU), or a completion cached up to 128 characters back
  whose start is what was typed since; a hint found is rendered (s:fim_render's rules) and a
  speculative follow-up is asked for (llama#fim with the hint as a:prev);
- llama#fim: while a request is in flight it retries 100 ms later (one timer, the last call's
  arguments); no request when the context, or it less up to 3 of its first lines, is cached;
  otherwise the request (t_max_predict_ms 250, 1000 for a follow-up), and chunks are picked when
  the cursor is more than 32 lines from the last pick;
- s:fim_on_response: the reply is cached under the request's hashes; if no acceptable hint is
  shown, the cursor's context is tried again (which may ask for a follow-up, 100 ms later as a
  request is still current then).
The user accepts a hint when it is exactly right: all its lines (Tab, llama#fim_accept 'full') if
they are the next lines of the block, else its first line (Shift-Tab, 'line') if that ends the line
as typed; an accept is one key. Between blocks the user pauses `--pause` seconds (the ring of extra
chunks takes one queued chunk a second then, each with its warm-up request, s:ring_update); while
typing no chunk moves in, as llama.vim waits for 3 s without a move. Not modelled: the eviction of
ring chunks similar to the cursor's surroundings, chunks picked on yank, save and buffer switches,
typing mistakes and pauses inside a block, byte-wise (not character-wise) string slicing in Vim.

`--client llama.vscode` emulates llama.vscode's provider instead (clients.VSCode: no follow-ups,
a 150 ms poll, answers from its cache whenever a reply cached for fewer typed characters starts
with the rest, n_cmpl 3 and t_max_predict_ms 500).

The requests are served in this process (FastAPI's TestClient) one at a time: a request takes its
measured wall time on the simulated clock while the keys go on. The kept state (the server's
default: the drafter keeps what it learned) runs live; the fresh state (a fresh drafter every
request, KV prefix still reused) is sent the SAME request bodies in the same order, so tokens per
pass compare drafting on identical requests. `--record FILE` writes the kept state's engine
requests for tools/editor/mat.py (exact offline tokens per pass).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from .clients import CLIENTS, Vim, indent
from .mat import served
from .replay import (
    Ring,
    below,
    default_file,
    field,
    first_line_ms,
    med,
    pick_blocks,
    record_engine,
    table,
    thirds,
    tpp,
    warm_body,
)


class Typist:
    """Re-types one block at `cps` keys a second, accepting hints that are exactly right."""

    def __init__(self, vim: Vim, block: list[str], start: int, cps: float):
        self.vim, self.block, self.start, self.dt = vim, block, start, 1.0 / cps
        self.typed = self.accepted = self.accepts = 0

    def accept(self) -> bool:
        vim, s = self.vim, self.vim.shown
        if s is None or not s["can_accept"] or (s["x"], s["y"]) != (vim.x, vim.y):
            return False
        i, content = vim.y - self.start, s["content"]
        pre = s["line_cur"] if s["x"] == 0 else s["line_cur"][:s["x"]]  # llama#fim_accept's l:line_cur[:(pos_x - 1)]
        lines = [pre + content[0]] + content[1:]
        old = len(vim.lines[vim.y])
        if len(lines) > 1 and lines == self.block[i:i + len(lines)]:  # Tab: the whole hint
            vim.lines[vim.y:vim.y + 1] = lines
            vim.y, vim.x = vim.y + len(lines) - 1, len(lines[-1])
            self.accepted += sum(map(len, lines)) + len(lines) - 1 - old  # with the new lines' newlines
        elif content[0] and lines[0] == self.block[i]:  # Shift-Tab: its first line
            vim.lines[vim.y] = lines[0]
            vim.x = len(lines[0])
            self.accepted += len(lines[0]) - old
        else:
            return False
        self.accepts += 1
        return True

    def key(self) -> bool:
        """One key: an accept, the next character, or Enter to the next line (the indentation
        comes with it); False when the block is typed."""
        vim = self.vim
        i = vim.y - self.start
        if vim.x < len(self.block[i]) and self.accept():
            return True
        if vim.x < len(self.block[i]):
            vim.lines[vim.y] += self.block[i][vim.x]
            vim.x += 1
        elif i + 1 < len(self.block):
            line = self.block[i + 1]
            vim.lines.insert(vim.y + 1, line[:indent(line)])
            vim.y, vim.x = vim.y + 1, indent(line)
        else:
            return False
        self.typed += 1
        return True

    def run(self) -> float:
        vim, t = self.vim, self.vim.now
        first = self.block[0]
        vim.lines.insert(self.start, first[:indent(first)])  # the cursor lands on the block's first line
        vim.y, vim.x = self.start, indent(first)
        vim.on_move()
        while True:
            t += self.dt
            vim.run_until(t)
            if not self.key():
                return t
            vim.on_move()


def session(lines: list[str], filename: str, args, post) -> dict:
    """Type every block; returns counts for the report."""
    rng = random.Random(args.seed)
    ring, stats = Ring(rng, filename), {"keys": 0, "chars": 0, "accepted": 0, "accepts": 0, "warm": 0, "lines": 0}
    vim = CLIENTS[args.client](post, ring)
    starts = pick_blocks(lines, args.blocks, args.block_lines, rng)
    for b, s in enumerate(starts):
        block = lines[s:s + args.block_lines]
        vim.lines = lines[:s] + below(lines, starts, b, args.block_lines, args.later_blocks == "cut")
        vim.shown, vim.timer = None, None
        typist = Typist(vim, block, s, args.cps)
        end = typist.run()
        vim.run_until(end + args.pause)  # the pause: replies land, follow-ups go
        vim.timer = None
        for _ in range(int(args.pause)):  # the ring takes a queued chunk a second, with a warm-up
            if ring.update():
                post("warm", warm_body(ring.extra()))
                stats["warm"] += 1
        vim.run_until(vim.now + 1.0)
        if vim.job is not None:
            vim.run_until(vim.job[0])
        stats["keys"] += typist.typed + typist.accepts
        stats["chars"] += sum(len(l) for l in block) + len(block) - 1
        stats["accepted"] += typist.accepted
        stats["accepts"] += typist.accepts
        stats["lines"] += len(block)
    return stats


def serve(session_, keep: bool, record: list | None):
    """A poster on an in-process server, and the rows it logs."""
    from cacheback_mlx.server import create_app

    from fastapi.testclient import TestClient

    tag: dict = {}
    if record is not None:
        record_engine(session_.engine, record, tag)
    client = TestClient(create_app(session_, **({} if keep else {"keep_drafter": False})),
                        raise_server_exceptions=False)
    rows, sent = [], []
    encode = lambda text: len(session_.tokenizer.encode(text, add_special_tokens=False))

    def post(kind: str, body: dict):
        tag.clear()
        tag["kind"] = kind
        sent.append((kind, body))
        t0 = time.perf_counter()
        r = client.post("/infill", json=body)
        secs = time.perf_counter() - t0
        resp = r.json() if r.status_code == 200 else None
        if isinstance(resp, list):  # n_cmpl: one result per completion (greedy: the same one)
            resp = resp[0] if resp else None
        num = lambda p: (field(resp, p) or 0) if resp else 0
        content, predicted = (resp or {}).get("content") or "", num("timings/predicted_n")
        first_line = first_line_ms(content, 1e3 * secs, predicted, num("timings/predicted_ms"), encode)
        rows.append({"kind": kind, "ok": resp is not None, "ms": 1e3 * secs, "first_line": first_line,
                     "predicted": predicted, "passes": num("timings/passes"), "prompt": num("tokens_evaluated"),
                     "cached": num("timings/cache_n")})
        return resp, secs

    return client, post, rows, sent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, help="source file to edit (default: click's core.py)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-lines", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--later-blocks", choices=["cut", "kept"], default="cut",
                    help="cut (default): the blocks not typed yet are cut out of the file too; kept: they stay "
                         "(the earlier protocol)")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="llama.vim")
    ap.add_argument("--cps", type=float, default=5.0, help="keys a second (default 5: ~60 words a minute)")
    ap.add_argument("--pause", type=float, default=4.0, help="seconds between blocks")
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--state", choices=["kept", "both"], default="both",
                    help="both: the fresh drafter is then sent the kept run's requests")
    ap.add_argument("--record", type=Path, default=None,
                    help="the kept state's engine requests, for tools/editor/mat.py")
    args = ap.parse_args(argv)
    if min(args.blocks, args.block_lines) < 1 or args.cps <= 0 or args.pause < 0:
        ap.error("--blocks and --block-lines must be >= 1, --cps > 0, --pause >= 0")
    from cacheback_mlx.api import Session
    from cacheback_mlx.drafters import drafter_parameters

    path = args.file or default_file()
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"vim_typing: cannot read {path}: {e}")
    print(f"## {args.client}, key by key\n")
    print("`" + " ".join([".venv/bin/python -m tools.editor.typist", shlex.join(sys.argv[1:])]).strip() + "`\n")
    results, sent, log = {}, None, [] if args.record else None
    with tempfile.TemporaryDirectory(prefix="typing-") as root:
        for state in ["kept", "fresh"][:2 if args.state == "both" else 1]:
            store = {k: tempfile.mkdtemp(prefix="ssd-", dir=root) for k in ("ssd_path", "path")
                     if k in drafter_parameters(args.drafter)}
            sess = Session(args.model, args.drafter, **store)
            client, post, rows, bodies = serve(sess, state == "kept", log if state == "kept" else None)
            t0 = time.perf_counter()
            with client:
                if state == "kept":
                    stats = session(lines, f"{path.parent.name}/{path.name}", args, post)
                    sent = bodies
                else:
                    for kind, body in sent:
                        post(kind, body)
            results[state] = {"rows": rows, "wall": time.perf_counter() - t0}
            if log is not None and state == "kept":
                args.record.write_text(json.dumps({"tool": ".venv/bin/python -m tools.editor.typist",
                                                   "command": shlex.join(sys.argv[1:]), "state": "kept",
                                                   "model": sess.loaded.name, "requests": log}))
            sess.engine.drafter.close()
            del sess

    kinds = [r["kind"] for r in results["kept"]["rows"]]
    print(f"- client: {args.client}; file: {path.name}, "
          f"{args.blocks} blocks of {args.block_lines} lines (seed {args.seed}), "
          f"{args.cps:g} keys a second, {args.pause:g} s between blocks; drafter {args.drafter}")
    print(f"- typed: {stats['chars']} characters in {stats['keys']} keys; {stats['accepts']} hints accepted "
          f"({stats['accepted']} characters, {100 * stats['accepted'] / max(stats['chars'], 1):.1f}%)")
    print(f"- requests: {kinds.count('fim')} completions, {kinds.count('follow-up')} follow-ups, "
          f"{kinds.count('warm')} warm-ups ({len(kinds) / stats['lines']:.1f} a line typed); "
          f"failed: {sum(not r['ok'] for r in results['kept']['rows'])}\n")
    cols = ["state", "third", "completions", "latency ms", "first line ms", "reused %", "tok/pass",
            "tok/pass with follow-ups"]
    body, last = [], {}
    for state, res in results.items():
        g = served(res["rows"], [r["kind"] for r in res["rows"]])
        for name, part in zip(("first", "middle", "last"), thirds(g)):
            comp, every = [x[0] for x in part], [r for x in part for r in x]
            body.append([state, name, len(comp), med([r["ms"] for r in comp]), med([r["first_line"] for r in comp]),
                         med([100 * r["cached"] / r["prompt"] for r in comp if r["prompt"]]), tpp(comp), tpp(every)])
        last[state] = body[-1][-2:]
    table(cols, body)
    for state, res in results.items():
        comp = [r for r in res["rows"] if r["kind"] == "fim"]
        print(f"- {state}: median latency {med([r['ms'] for r in comp]):.0f} ms, median first line "
              f"{med([r['first_line'] for r in comp]):.0f} ms (an estimate: the latency less the decode time after "
              f"the reply's first newline), {res['wall']:.0f} s in all")
    if "fresh" in last:
        for i, what in enumerate(("completions", "completions and their follow-ups")):
            k, f = last["kept"][i], last["fresh"][i]
            print(f"- learning across requests, last third, {what}: {100 * (k / f - 1):+.1f}% "
                  f"({k:.2f} vs {f:.2f} tok/pass)")


if __name__ == "__main__":
    main()
