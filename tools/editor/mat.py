"""Offline replay of an editing session's drafting: exact tokens per pass, kept vs fresh, no model.

    .venv/bin/python -m tools.editor.replay --state kept --record /tmp/session.json   # record once
    .venv/bin/python -m tools.editor.mat /tmp/session.json --budget 7                 # then replay

(`python -m tools.editor.typist --record` writes the same kind of file, for llama.vim's requests key by key.)

A benchmark, not a test. `tools.editor.replay --record` logs every request its server's engine ran
(completions, llama.vim's follow-ups and warm-ups) with the prompt, the text given to the drafter
beside it, and the greedy tokens the model produced. This tool runs the drafters over that log as
the engine would (replay.replay_requests: the same start-of-request rule, learning.start_request),
with a fixed draft budget: greedy verification is deterministic, so each pass accepts the longest
draft path the recorded output agrees with, plus one token. It prints tokens per pass (MAT) over
the completions by third of the session, for a drafter kept across requests and for a fresh one
per request, which is the live replay's learning target without the timing noise (the live run
also sizes each pass by its cost; here every pass may take `--budget` draft tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from cacheback_mlx.drafters.auto import AutoDrafter
from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.replay import replay_requests


def make_auto(persist: bool, root: str, made: list):
    """auto as a server makes it (the shipped frozen table and datastore), SSD in a temporary store
    of its own under `root` (persist=False: nothing on disk, as the fresh baseline); each drafter
    made is appended to `made` (to be closed)."""
    def make():
        d = AutoDrafter(ssd_path=tempfile.mkdtemp(prefix="ssd-", dir=root), persist=persist)
        made.append(d)
        return Waiting(d)
    return make


class Waiting:
    """The drafter with SSD's background index brought up to date after each request, as it is
    by the time the user has typed the next lines."""

    def __init__(self, d):
        self.d = d

    def __getattr__(self, name):
        return getattr(self.d, name)

    def end_request(self):
        self.d.end_request()
        ssd = getattr(self.d, "ssd", None)
        if ssd is not None and hasattr(ssd, "wait"):
            ssd.wait()


def thirds(rows: list) -> list[list]:
    n = len(rows)
    cuts = [0, (n + 2) // 3, (2 * n + 1) // 3, n]
    return [rows[cuts[i]:cuts[i + 1]] for i in range(3)]


def mat(results) -> float:
    steps = sum(r.steps for r in results)
    return sum(r.tokens for r in results) / steps if steps else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", type=Path, help="a JSON file written by tools.editor.replay --record")
    ap.add_argument("--budget", type=int, default=7, help="draft tokens per pass (default 7: an 8-row pass)")
    args = ap.parse_args(argv)
    try:
        log = json.loads(args.record.read_text())
        requests = log["requests"]
        kinds = [r["kind"] for r in requests]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"editor_mat: {args.record}: not a record of tools.editor.replay --record ({e})")
    made: list = []
    with tempfile.TemporaryDirectory(prefix="editor-mat-") as root:  # every drafter's store, removed after
        states = {"kept": replay_requests(make_auto(True, root, made), requests, args.budget),
                  "fresh": replay_requests(make_auto(False, root, made), requests, args.budget, fresh=True),
                  "none": replay_requests(NoDrafter, requests, args.budget)}
        for d in made:  # their last writes land before the folder goes
            d.close()
    print(f"## Editor session, drafting replayed offline (budget {args.budget})\n")
    print(f"`.venv/bin/python -m tools.editor.mat {args.record.name} --budget {args.budget}`; "
          f"recorded by `{log.get('tool', '.venv/bin/python -m tools.editor.replay')} {log.get('command', '')}`\n")
    print(f"- {kinds.count('fim')} completions, {kinds.count('follow-up')} follow-ups, "
          f"{kinds.count('warm')} warm-ups\n")
    print("| state | first third | middle | last third | all completions | follow-ups | last third with follow-ups |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    last = {}
    for state, res in states.items():
        groups = served(res, kinds)
        comp = [g[0] for g in groups]
        follow = [r for g in groups for r in g[1:]]
        last[state] = (mat(thirds(comp)[2]), mat([r for g in thirds(groups)[2] for r in g]))
        cells = [mat(t) for t in thirds(comp)] + [mat(comp), mat(follow), last[state][1]]
        print(f"| {state} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    print()
    for i, what in enumerate(("completions", "completions and their follow-ups")):
        kept, fresh = last["kept"][i], last["fresh"][i]
        print(f"- learning across requests, last third, {what}: {100 * (kept / fresh - 1):+.1f}% "
              f"(kept {kept:.3f} vs fresh {fresh:.3f})")


def served(results, kinds) -> list[list]:
    """Per completion: its result, then those of the follow-ups sent after it."""
    groups = []
    for r, k in zip(results, kinds):
        if k == "fim":
            groups.append([r])
        elif k == "follow-up" and groups and r is not None:
            groups[-1].append(r)
    return groups


if __name__ == "__main__":
    main()
