"""How a batch's lanes share out their passes, with no model and no timing noise: groups of the
recorded greedy streams (the default model's) run as lanes of one batch, all joining at once, with
`auto` drafting as in a server (one store and one scorer for every lane), the pass's rows shared
out by batch_plan.share over batch_plan.LaneCosts, and each lane accepting along its recorded
stream. A pass is priced by a measured cost table (its rows in all, at the lanes' mean context)
times a lane factor (lane_factor: 4 lanes of one row 1.17x the solo price of 4 rows, as measured here,
docs/BENCHMARKS.md §10), which LaneCosts learns as in a server; a prompt goes in chunks of CHUNK
tokens, each a pass of its own at the table's price, the fewest tokens left first (Batch's rule;
on a CPU a chunk riding in the lanes' pass costs about what the two cost apart, 7-9% less since
the output head skips its rows: §10). Each request's finish
time in the batch over its finish time alone (the same state: the store holds the same served
streams), per group: the worst and the median request, and the batch's tokens per second.

    .venv/bin/python -m tools.ab.lane_sim --costs DIR --policies "favour=2,favour=0,own" --groups 30 [--first 1]

Policies, what a lane's expected tokens are worth when rows are shared out: favour=P, its tokens
per pass so far to the power P (Batch.lane_weights; P = Batch.FAVOUR is the default); own, level
weights, each lane's drafts' chances scaled by how its own offered drafts have fared against
their calibrated chances (recent passes). A simulation: prefill is priced by the table, drafting
and the per-pass Python are left out, and streams end at --max-tokens as the recorded text goes.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile

import click
import numpy as np

CHUNK = 128  # prompt tokens in a prefill chunk
SERVED = 8  # streams the store holds before a group starts (its requests served earlier)


def lane_factor(lanes: int, rows: int) -> float:
    """A shared pass's cost over the solo price of as many rows: ~0.055 a lane beyond the first at
    one row a lane, growing with the rows each lane brings."""
    return 1.0 + 0.055 * (lanes - 1) * (1.0 + 0.1 * (rows / lanes - 1.0))


class SimLane:
    def __init__(self, stream: dict, drafter, sizer, max_tokens: int):
        self.out = stream["out"][:max_tokens]
        self.history = list(stream["prompt"])
        self.pending = len(stream["prompt"]) - 1  # prompt tokens still to prefill
        self.drafter, self.sizer = drafter, sizer
        self.pos = self.passes = 0
        self.hits = self.told = 0.0  # `own`: its offered drafts' acceptances and calibrated chances (recent)
        self.done_at: float | None = None

    def factor(self) -> float:
        return (self.hits + 2.0) / (self.told + 2.0)


def run(streams: list[dict], served: list[dict], policy: str, cost, max_tokens: int) -> tuple[list[float], float]:
    """Every stream a lane of one batch from time 0: (each one's finish time, the last one's)."""
    from cacheback_mlx.batch_plan import LaneCosts, share
    from cacheback_mlx.budget import Sizer, known_outcomes
    from cacheback_mlx.drafters.auto import AutoDrafter
    from cacheback_mlx.replay import forced_picks, longest_match
    from cacheback_mlx.tree import DraftTree

    kind, _, power = policy.partition("=")
    with tempfile.TemporaryDirectory() as store:
        drafters = [AutoDrafter(ssd_path=store) for _ in streams]  # one store: one buffer and one scorer
        for s in served:
            d = drafters[0]
            d.reset()
            d.observe(s["prompt"])
            d.observe(s["out"])
            d.end_request()
        drafters[0].ssd.wait()
        sizer = Sizer(cost, learn=False)
        costs = LaneCosts(sizer)
        lanes = []
        for s, d in zip(streams, drafters):
            d.reset()
            d.observe(s["prompt"])
            lanes.append(SimLane(s, d, sizer.lane(), max_tokens))
        clock = 0.0
        while any(lane.done_at is None for lane in lanes):
            live = [lane for lane in lanes if lane.done_at is None]
            feeding = min((lane for lane in live if lane.pending), key=lambda lane: lane.pending, default=None)
            if feeding is not None:  # a chunk in a pass of its own
                n = min(CHUNK, feeding.pending)
                clock += sizer.price(n, len(feeding.history) - feeding.pending)
                feeding.pending -= n
            lanes_now = [lane for lane in live if not lane.pending]
            if not lanes_now:
                continue
            context = sum(len(lane.history) for lane in lanes_now) // len(lanes_now)
            offers = []
            for lane in lanes_now:
                limit = len(lane.out) - lane.pos - 1
                cap = min(limit, sizer.cap(limit, len(lane.history)))
                tree = lane.drafter.propose(lane.history, cap).truncate(cap) if cap > 0 else DraftTree.empty()
                offers.append(lane.sizer.offer(tree, 1) if len(tree) else (tree, np.zeros(0), None))
            asked = [(1, s) for _, s, _ in offers]
            weights = None
            if kind == "favour":
                weights = [((lane.pos + 2.0) / (lane.passes + 2.0)) ** float(power) for lane in lanes_now]
            elif kind == "own":
                asked = [(1, np.clip(s * lane.factor(), 0.0, 1.0)) for (_, s), lane in zip(asked, lanes_now)]
            else:
                raise click.BadParameter(f"{policy}: not a policy (favour=P or own)")
            counts = share(asked, costs.costs(len(lanes_now), context), weights)
            trees = [lane.sizer.send(t, cells, k) for lane, (t, _, cells), k in zip(lanes_now, offers, counts)]
            rows = sum(1 + len(t) for t in trees)
            seconds = sizer.price(rows, context) * lane_factor(len(lanes_now), rows)
            costs.timed(len(lanes_now), context, rows, seconds)
            clock += seconds
            for lane, tree, (offered, chances, _) in zip(lanes_now, trees, offers):
                path = longest_match(tree, lane.out[lane.pos :])
                accepted = [int(tree.tokens[i]) for i in path]
                if lane.pos + len(accepted) < len(lane.out):
                    accepted.append(int(lane.out[lane.pos + len(accepted)]))
                if len(chances):  # what `own` learns: every offered node's outcome against its chance
                    known = known_outcomes(offered.truncate(len(chances)), accepted)
                    places = np.flatnonzero(known >= 0)
                    lane.hits = 0.95 * lane.hits + float((known[places] == 1).sum())
                    lane.told = 0.95 * lane.told + float(chances[places].sum())
                lane.sizer.update(tree, path, accepted)
                picks = tree.picked(lane.history[-1], forced_picks(tree, lane.out[lane.pos :]))
                lane.history.extend(accepted)
                lane.pos += len(accepted)
                lane.passes += 1
                lane.drafter.observe(accepted)
                lane.drafter.recycle(picks)
                if lane.pos >= len(lane.out):
                    lane.done_at = clock
                    lane.drafter.end_request()
                    lane.drafter.ssd.wait()  # its answer in the store now, not when a thread gets to it
        for d in drafters:
            d.close()
    return [lane.done_at for lane in lanes], clock


@click.command()
@click.option("--costs", required=True, help="a cache folder holding a measured pass-cost table "
              "(XDG_CACHE_HOME=DIR cacheback-mlx bench --verify-cost)")
@click.option("--policies", default="favour=2,favour=0,own", show_default=True)
@click.option("--groups", default=30, show_default=True, help="groups, drawn with seeds first..first + N - 1")
@click.option("--first", default=1, show_default=True)
@click.option("--clients", default=4, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--max-prompt", default=250, show_default=True, help="streams with longer prompts are left out "
              "(tools.server_load's sample: first turns of 50-200 tokens)")
def main(costs: str, policies: str, groups: int, first: int, clients: int, max_tokens: int, max_prompt: int) -> None:
    from cacheback_mlx.costs import from_json
    from cacheback_mlx.replay import load_streams

    from tools.server_load import measured_costs

    table = from_json(json.loads(next(iter(sorted(measured_costs(costs).glob("*.json")))).read_text()))
    streams = [s for s in load_streams() if len(s["prompt"]) <= max_prompt]
    names = policies.split(",")
    results: dict[str, list[tuple[float, float, float]]] = {p: [] for p in names}
    print("| group | " + " | ".join(f"{p}: worst / median / tok/s" for p in names) + " |")
    print("|---:|" + "---|" * len(names))
    for seed in range(first, first + groups):
        drawn = random.Random(seed).sample(streams, clients + SERVED)
        group, served = drawn[:clients], drawn[clients:]
        alone = [run([s], served, names[0], table, max_tokens)[0][0] for s in group]
        cells = []
        for p in names:
            finished, total = run(group, served, p, table, max_tokens)
            ratios = [a / b for a, b in zip(finished, alone)]
            tokens = sum(min(len(s["out"]), max_tokens) for s in group)
            results[p].append((max(ratios), statistics.median(ratios), tokens / total))
            cells.append(f"{max(ratios):.2f}x / {statistics.median(ratios):.2f}x / {tokens / total:.1f}")
        print(f"| {seed} | " + " | ".join(cells) + " |", flush=True)
    print("\n| policy | worst, mean | worst of all | groups with a request above 2x | median, mean | tok/s, mean |")
    print("|---|---:|---:|---:|---:|---:|")
    for p, rows in results.items():
        worst, median, speed = ([r[k] for r in rows] for k in range(3))
        print(f"| {p} | {statistics.mean(worst):.3f}x | {max(worst):.2f}x | {sum(w > 2 for w in worst)} of "
              f"{len(worst)} | {statistics.mean(median):.3f}x | {statistics.mean(speed):.2f} |")


if __name__ == "__main__":
    main()
