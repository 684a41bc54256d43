"""SSD gets faster the more it is used: MAT vs number of requests served, as a table and a PNG.

Replays the 64 recorded greedy streams in order with ONE persistent SSD drafter (each finished
request goes into its buffer), against a fresh drafter per request, and plots the MAT of each
block of 8 requests. MAT is the speedup bound: a pass's tokens over a plain step's one.

    .venv/bin/python -m tools.ssd_curve docs/ssd_curve.png

`--live` measures the real speedup on the default model instead: the same prompts in the same
order, each generated three times side by side (plain decoding, a fresh SSD drafter, the one SSD
drafter that has served every earlier request), and plots tokens/s over plain decoding per block.

    .venv/bin/python -m tools.ssd_curve docs/ssd_curve_live.png --live [MAX_TOKENS]
"""

import sys
import time

from cacheback_mlx.drafters.ssd import SsdDrafter
from cacheback_mlx.replay import load_streams, replay, replay_all


def main(out: str = "docs/ssd_curve.png", block: int = 8, budget: int = 95) -> None:
    streams = load_streams()
    shared = SsdDrafter(persist=False)
    xs, fresh, used = [], [], []
    for start in range(0, len(streams), block):
        part = streams[start : start + block]
        fresh.append(replay_all(lambda: SsdDrafter(persist=False), part, budget=budget).mat)
        tokens = steps = 0
        for s in part:
            r = replay(shared, s["prompt"], s["out"], budget)
            shared.end_request()
            shared.wait()
            tokens, steps = tokens + r.tokens, steps + r.steps
        used.append(tokens / steps)
        xs.append(start + len(part))
    print("| requests served | fresh MAT | persistent MAT |\n|---:|---:|---:|")
    for x, f, u in zip(xs, fresh, used):
        print(f"| {x} | {f:.3f} | {u:.3f} |")
    plot(out, xs, {"fresh drafter per request": fresh, "one SSD drafter across requests": used,
                   "ratio (persistent / fresh)": [u / f for u, f in zip(used, fresh)]},
         "requests served (blocks of %d recorded streams)" % block, "mean accepted tokens per pass")


def plot(out: str, xs: list, curves: dict, xlabel: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, ys in curves.items():
        ax.plot(xs, ys, "s--" if label.startswith("ratio") else "o-", label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"-> {out}")


def live(out: str = "docs/ssd_curve_live.png", max_tokens: int = 64, block: int = 8) -> None:
    from cacheback_mlx.api import Session
    from cacheback_mlx.sampling import SamplingParams

    streams = load_streams()
    session = Session(None, "none")
    shared = SsdDrafter(persist=False)
    rows = []  # per request: seconds for (none, fresh, persistent), MAT for (fresh, persistent)
    for i, s in enumerate(streams):
        secs, mats, outs = [], [], []
        for drafter in (session.make_drafter("none"), SsdDrafter(persist=False), shared):
            session.engine.set_drafter(drafter)
            session.reset()  # no KV prefix reuse between the three runs (SSD keeps its buffer)
            t0 = time.perf_counter()
            outs.append([t for _, step in session.stream_ids(s["prompt"], max_tokens, SamplingParams()) for t in step])
            secs.append(time.perf_counter() - t0)
            mats.append(session.stats.mat)
        shared.wait()
        if not outs[0] == outs[1] == outs[2]:
            raise SystemExit(f"request {i}: SSD output differs from plain decoding")
        rows.append((len(outs[0]), *secs, mats[1], mats[2]))
        print(f"request {i + 1}/{len(streams)}: {rows[-1]}", file=sys.stderr)
    report(rows, out, block)


def report(rows: list, out: str, block: int = 8) -> None:
    """Table and plot of the live rows, per block of requests: time ratios, so the speedup is
    tokens/s over plain decoding on the same prompts in the same minutes."""
    xs, fresh, used = [], [], []
    print("| requests served | tokens | fresh SSD speedup | persistent SSD speedup | persistent / fresh | fresh MAT "
          "| persistent MAT |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for start in range(0, len(rows), block):
        part = rows[start : start + block]
        t_none, t_fresh, t_used = (sum(r[k] for r in part) for k in (1, 2, 3))
        xs.append(start + len(part))
        fresh.append(t_none / t_fresh)
        used.append(t_none / t_used)
        print(f"| {xs[-1]} | {sum(r[0] for r in part)} | {fresh[-1]:.2f}x | {used[-1]:.2f}x | {t_fresh / t_used:.2f}x "
              f"| {sum(r[4] for r in part) / len(part):.2f} | {sum(r[5] for r in part) / len(part):.2f} |")
    t_none, t_fresh, t_used = (sum(r[k] for r in rows) for k in (1, 2, 3))
    print(f"| all {len(rows)} | {sum(r[0] for r in rows)} | {t_none / t_fresh:.2f}x | {t_none / t_used:.2f}x "
          f"| {t_fresh / t_used:.2f}x | | |")
    plot(out, xs, {"fresh SSD drafter per request": fresh, "one SSD drafter across requests": used,
                   "ratio (persistent / fresh)": [u / f for u, f in zip(used, fresh)]},
         "requests served (blocks of %d)" % block, "speedup vs plain decoding (live)")


if __name__ == "__main__":
    if "--live" in sys.argv:
        args = [a for a in sys.argv[1:] if a != "--live"]
        live(args[0] if args else "docs/ssd_curve_live.png", *(int(a) for a in args[1:2]))
    else:
        main(*sys.argv[1:2])
