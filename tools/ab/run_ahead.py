"""When plain steps should run ahead on a GPU: `auto` and the sizer on the recorded greedy streams
(exact acceptance, no model), each pass priced by a GPU's costs, under several rules for how many
plain passes in a row to wait for (run_ahead.RunAhead).

    python -m tools.ab.run_ahead [--costs FILE --plain MS --ahead MS --passes 2=MS,4=MS] [--quiet 1,2,4,8,16]
                                 [--half even|odd|all] [--noise 0.08]

A plain step costs --plain ms of wall time, one that ran ahead --ahead (the two per-token times of
`none` with running ahead off and on in one GPU's bench); a pass of r rows the --passes ms given
for r, other counts scaled from the --costs table (a verify-cost JSON the GPU measured: what the
sizer decides with) by the largest count given. Without --costs: passes of 2-64 rows 1.5-1.8x a
plain step, a table of that shape, where drafts pay more often. The sizer learns from the prices
(lognormal --noise) as from measured passes. Rows: drafting off (`none`, the default rule),
running ahead off, waiting for each --quiet count always, and the default rule (8 while drafts are
common, 1 once they are rare). "ms a token" counts pass time; drafting is timed on this machine
and shown apart. --half chooses the streams (the even ones to choose on, the odd ones to check).
"""

from __future__ import annotations

import json
import random

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

GPU_LIKE = {1: 1.0, 2: 1.5, 4: 1.5, 8: 1.55, 16: 1.6, 32: 1.7, 64: 1.8, 128: 2.2}


def prices(costs: str | None, plain: float, passes: dict[int, float]):
    """(the sizer's table, seconds of a pass of r rows as run: {rows: s})."""
    from cacheback_mlx.costs import CostTable, from_json
    from cacheback_mlx.engine import GPU_BUCKETS

    if costs is None:
        return CostTable({256: {r: plain * f for r, f in GPU_LIKE.items()}}, GPU_BUCKETS), \
            {r: plain * f for r, f in GPU_LIKE.items()}
    data = json.loads(open(costs).read())
    table = from_json(data, GPU_BUCKETS)
    top = max(passes)
    scale = passes[top] / table.cost(top, 256)
    return table, {r: passes.get(r, table.cost(r, 256) * scale) for r in GPU_BUCKETS}


def run(streams, rule, table, truth, plain, ahead_s, noise, seed, draft=True):
    """Totals over the streams, one drafter and one sizer serving them in order (as a bench)."""
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.drafters.auto import AutoDrafter
    from cacheback_mlx.engine import GPU_BUCKETS
    from cacheback_mlx.replay import replay
    from cacheback_mlx.verify import padded_size

    rng = random.Random(seed)

    def clock(rows, context):
        base = ahead_s if rows == 0 else plain if rows == 1 else truth[padded_size(rows, GPU_BUCKETS)]
        return base * rng.lognormvariate(0.0, noise)

    drafter, sizer = AutoDrafter(persist=False), Sizer(table)
    tokens = passes = ran_ahead = 0
    seconds = draft_s = 0.0
    for s in streams:
        drafter.reset()
        r = replay(drafter, s["prompt"], s["out"], 63 if draft else 0, sizer=sizer, clock=clock, ahead=rule)
        drafter.end_request()
        tokens, passes, ran_ahead = tokens + r.tokens, passes + r.steps, ran_ahead + r.ahead
        seconds, draft_s = seconds + r.pass_seconds, draft_s + r.draft_seconds
    return tokens, passes, ran_ahead, seconds, draft_s


@click.command()
@click.option("--costs", default=None, help="A GPU's verify-cost JSON (the sizer's table); default: a GPU-like one.")
@click.option("--plain", default=5.23, show_default=True, help="ms of wall time of a plain step.")
@click.option("--ahead", "ahead_ms", default=4.69, show_default=True, help="ms of a plain step that ran ahead.")
@click.option("--passes", default="2=9.2,4=13.2", show_default=True,
              help="With --costs: ms of a pass by rows as run, rows=ms, comma-separated.")
@click.option("--quiet", default="1,2,4,8,16", show_default=True, help="Fixed waits, comma-separated.")
@click.option("--half", type=click.Choice(["even", "odd", "all"]), default="even", show_default=True)
@click.option("--noise", default=0.08, show_default=True, help="Lognormal sigma on each pass's price.")
@click.option("--seed", default=0, show_default=True)
def main(costs, plain, ahead_ms, passes, quiet, half, noise, seed):
    from cacheback_mlx.engine import Engine
    from cacheback_mlx.replay import load_streams
    from cacheback_mlx.run_ahead import RunAhead

    try:
        given = {int(k): float(v) / 1e3 for k, v in (x.split("=") for x in passes.split(","))} if costs else {}
        waits = [int(q) for q in quiet.split(",") if q]
        table, truth = prices(costs, plain / 1e3, given)
    except (ValueError, OSError, KeyError) as e:
        raise click.ClickException(f"bad --costs or --passes: {e}") from None
    streams = load_streams()
    streams = streams if half == "all" else streams[0 if half == "even" else 1 :: 2]
    q = Engine.RUN_AHEAD_QUIET
    rows = [("drafting off (none)", RunAhead(q), False), ("running ahead off", None, True)]
    rows += [(f"wait for {w}", RunAhead(w, sparse=0), True) for w in waits]
    rows += [(f"default: {q}, or 1 where drafts are rare", RunAhead(q), True)]
    print(f"{len(streams)} streams ({half}), {'costs ' + costs if costs else 'GPU-like costs'}, plain step "
          f"{plain} ms, ahead {ahead_ms} ms, passes (rows: ms) "
          + ", ".join(f"{r}: {s * 1e3:.2f}" for r, s in truth.items() if r > 1))
    print("\n| rule | tokens | MAT | steps run ahead | ms a token | vs none | drafting us a pass (here) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    for label, rule, draft in rows:
        tokens, n, ran, sec, dsec = run(streams, rule, table, truth, plain / 1e3, ahead_ms / 1e3, noise, seed, draft)
        base = base or sec / tokens
        print(f"| {label} | {tokens} | {tokens / n:.3f} | {ran} | {sec / tokens * 1e3:.3f} | "
              f"{base / (sec / tokens):.3f}x | {dsec / n * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
