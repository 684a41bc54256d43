"""What one shared pass over a batch's lanes costs, by how its rows are spread over the lanes,
against the sizer's price of a solo pass of as many rows (what batch_plan.LaneCosts scales).

    .venv/bin/python -m tools.ab.lane_pass [--model M] [--context 400] [--layouts "1x8;2x8;9+1x7;16+1x7"] [--ride 128]
        [--turns]

A layout lists each lane's rows: "2x8" is 8 lanes of 2 rows, "9+1x7" one lane of 9 beside 7 of 1;
"1x2@0,7" is 2 lanes of one row held in the batch's lanes 0 and 7 (by default a layout's lanes are
the first ones; the batch's other lanes sit idle in its caches). Every lane holds `--context`
cached tokens (random ids); each layout's pass (chains) is timed --repeats times after two
warm-ups and the median printed, with how attention ran it (shared_pass.PassPlan: the stacked
width, the runs of the batch's lanes stacked, and the lanes in calls of their own). A model with
recurrent layers runs its lanes side by side (chains padded to the longest). --turns also times
each layout as the lanes' passes of their own, one after another (lanes that take turns).
"""

from __future__ import annotations

import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click


def parse(layout: str) -> tuple[list[int], list[int]]:
    """"9+1x7" -> ([9, 1, 1, 1, 1, 1, 1, 1], [0, 1, ..., 7]); "1x2@0,7" -> ([1, 1], [0, 7])."""
    layout, _, at = layout.partition("@")
    rows = []
    for part in layout.split("+"):
        n, _, times = part.partition("x")
        rows += [int(n)] * int(times or 1)
    lanes = [int(x) for x in at.split(",")] if at else list(range(len(rows)))
    if len(lanes) != len(rows) or len(set(lanes)) != len(lanes) or min(lanes) < 0:
        raise click.BadParameter(f"{layout}@{at}: name a distinct lane (0 or more) for each lane's rows")
    return rows, lanes


@click.command()
@click.option("--model", "-m", default=None)
@click.option("--context", default=400)
@click.option("--layouts", default="1x8;2x8;3x8;9+1x7;16+1x7;5x2+1x6;3x5+1x3")
@click.option("--repeats", default=7)
@click.option("--ride", default=0, help="also time a prefill chunk of this many tokens riding in each layout's pass, "
              "against the chunk in a pass of its own plus the layout's pass (batch_plan.Riding's two ways), and "
              "riding with the output head on every row, the chunk's too (as before head.py)")
@click.option("--turns", is_flag=True, help="also time the lanes' passes of their own, one after another")
def main(model, context, layouts, repeats, ride, turns):
    from cacheback_mlx.api import Session
    from cacheback_mlx.positions import TreePass
    from cacheback_mlx.shared_pass import PassPlan, batch_pass
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    import mlx.core as mx
    import numpy as np

    shapes = [parse(x) for x in layouts.split(";")]
    session = Session(model, "none")
    batch = session.batch(max(max(at) + 1 for _, at in shapes) + (1 if ride else 0))  # the last lane takes the chunk
    rng = np.random.default_rng(0)
    vocab = min(session.engine.vocab_size, 20000)
    lanes = [batch.join(rng.integers(100, vocab, context).tolist(), 10**6) for _ in range(batch.n)]
    while any(lane.prefilling for lane in lanes):  # joins prefill a chunk a step
        batch.step()
    sizer = batch.engine.sizer

    def chain(rows: int) -> DraftTree:
        return DraftTree(list(range(5, 4 + rows)), list(range(-1, rows - 2)))

    print(f"{batch.n} lanes, {context} cached tokens each; median of {repeats}")
    print("| rows by lane | lanes | rows | shared pass ms | solo price ms | ratio | stacked width | stacked runs "
          "| own calls |" + (" turns ms | turns / shared |" if turns else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if turns else ""))
    for rows, at in shapes:
        times, apart = [], []
        for _ in range(repeats + 2):
            passes = [(lanes[k].seq.cache, lanes[k].seq.lead, chain(r), r) for k, r in zip(at, rows)]
            t0 = time.perf_counter()
            mx.eval(batch_pass(batch.model, passes, batch.packed))
            times.append(time.perf_counter() - t0)
            for k in at:
                lanes[k].seq.cache.finish_pass([0], False)
            if turns:
                t0 = time.perf_counter()
                for c, lead, tree, r in passes:
                    mx.eval(verify_pass(batch.model, c, lead, tree, rows=r))
                    c.finish_pass([0], False)
                apart.append(time.perf_counter() - t0)
        spans = list(zip(np.cumsum([0] + rows[:-1]).tolist(), np.cumsum(rows).tolist()))
        plan = PassPlan([lanes[k].seq.cache for k in at], spans, [TreePass() for _ in rows])
        ms = float(np.median(times[2:])) * 1e3
        price = sizer.price(sum(rows), context) * 1e3
        width, runs, own = ((plan.width, len(plan.segments), len(plan.wide)) if plan.rows_of is not None
                            else ("-", "-", "-"))
        if batch.side_by_side:  # lanes as batch rows, each as wide as the widest
            width, runs, own = f"side by side, {max(rows)}", "-", 0
        line = (f"| {rows} | {','.join(map(str, at))} | {sum(rows)} | {ms:.1f} | {price:.1f} | {ms / price:.2f} | "
                f"{width} | {runs} | {own} |")
        if turns:
            own_ms = float(np.median(apart[2:])) * 1e3
            line += f" {own_ms:.1f} | {own_ms / ms:.2f} |"
        print(line, flush=True)
    if not ride:
        return
    rider, chunk = lanes[-1].seq.cache, rng.integers(100, vocab, ride).tolist()
    print(f"\nA {ride}-token prefill chunk (a lane with {context} cached tokens); median of {repeats}")
    print("| rows by lane | riding in the pass ms | riding, the head on every row ms | chunk alone + the pass ms "
          "| riding / apart | head on the lanes' rows / on every row |")
    print("|---|---:|---:|---:|---:|---:|")
    ways = ("riding", "riding, head on all", "apart")  # the second: batch_pass as before head.py skipped the chunk
    for rows, at in shapes:
        times = {w: [] for w in ways}
        for _ in range(repeats + 2):
            for way in ways:
                passes = [(lanes[k].seq.cache, lanes[k].seq.lead, chain(r), r) for k, r in zip(at, rows)]
                t0 = time.perf_counter()
                if way != "apart":
                    riders = [(rider, chunk, DraftTree([], []), ride)]
                    read = len(passes) if way == "riding" else None  # None: every row's logits, the chunk's too
                    mx.eval(batch_pass(batch.model, passes + riders, batch.packed, read=read), rider.arrays())
                else:
                    mx.eval(batch_pass(batch.model, passes, batch.packed))
                    prefill(batch.model, rider, chunk, ride)
                times[way].append(time.perf_counter() - t0)
                for k in at:
                    lanes[k].seq.cache.finish_pass([0], False)
                if way != "apart":
                    rider.finish_pass([], False)
                else:
                    rider.trim(rider.length - ride)
        on, all_rows, apart = (float(np.median(times[w][2:])) * 1e3 for w in ways)
        print(f"| {rows} | {on:.1f} | {all_rows:.1f} | {apart:.1f} | {on / apart:.2f} | {on / all_rows:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
