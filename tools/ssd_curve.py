"""SSD gets faster the more it is used: MAT vs number of requests served, as a table and a PNG.

Replays the 64 recorded greedy streams in order with ONE persistent SSD drafter (each finished
request goes into its buffer), against a fresh drafter per request, and plots the MAT of each
block of 8 requests. MAT is the speedup bound: a pass's tokens over a plain step's one.

    .venv/bin/python tools/ssd_curve.py docs/ssd_curve.png
"""

import sys

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, fresh, "o-", label="fresh drafter per request")
    ax.plot(xs, used, "o-", label="one SSD drafter across requests")
    ax.plot(xs, [u / f for u, f in zip(used, fresh)], "s--", label="ratio (persistent / fresh)")
    ax.set_xlabel("requests served (blocks of %d recorded streams)" % block)
    ax.set_ylabel("mean accepted tokens per pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"-> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
