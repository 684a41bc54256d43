"""Where a bench run's verify passes were slow: from `cacheback-mlx bench --json FILE`'s pass logs.

Per engine run (prompt x drafter): passes, their median ms, and the passes that took more than
--factor times the median of passes of as many rows in the whole file (a stall: a kernel compiled
in the middle of a decoding, a new plan, another process), with their rows, drafts and cached
tokens; then the median ms of a pass by rows over the file.

    .venv/bin/python -m tools.slow_passes FILE [--factor 5] [--top 10]
"""

from __future__ import annotations

import argparse
import json

from cacheback_mlx.bench import pass_medians, stalls


def by_rows(runs: list[dict]) -> dict[int, float]:
    """Median ms of a pass of each row count, over every run."""
    return pass_medians([r.get("pass_log", []) for r in runs])


def slow(runs: list[dict], factor: float) -> list[tuple[dict, list]]:
    """(run, its passes slower than factor x the median at their row count), for runs that have some."""
    return [(r, bad) for r, bad in zip(runs, stalls([r.get("pass_log", []) for r in runs], factor)) if bad]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--factor", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=10, help="slow passes listed per run")
    a = ap.parse_args(argv)
    runs = [r for r in json.load(open(a.file))["runs"] if r.get("pass_log")]
    if not runs:
        print("no pass logs in this file (bench --json keeps them since 429c1c8)")
        return 1
    found = slow(runs, a.factor)
    for r, bad in sorted(found, key=lambda x: -sum(p[3] for p in x[1])):
        logged = sum(p[3] for p in r["pass_log"])
        print(f"{r['prompt']} {r['drafter']}: {len(r['pass_log'])} passes, {logged:.0f} ms, {len(bad)} slow "
              f"({sum(p[3] for p in bad):.0f} ms):")
        for rows, drafts, cached, ms in sorted(bad, key=lambda p: -p[3])[: a.top]:
            print(f"    {ms:9.2f} ms  rows {rows:3d}  drafts {drafts:3d}  cached {cached}")
    if not found:
        print(f"no pass took more than {a.factor:g}x the median of its row count")
    print("median ms of a pass by rows: " + ", ".join(f"{k}: {v:.2f}" for k, v in by_rows(runs).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
