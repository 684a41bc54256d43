"""Sampled decoding with the tokens chosen on the host (host_sampling.py) against mlx-lm's samplers
(sampling.HOST_SAMPLING off), `none` and `auto` each, and mlx-lm's stream_generate with its own
sampler: one process, the rows of each question in turns (rotating), so noise hits all alike.

    python -m tools.ab.host_sampling --seed S [--temperature 0.7] [--top-p 0.95] [--top-k 0]
        [--min-p 0] [--per-category 1] [--humaneval-prompts 2] [--max-tokens 96]

The prompts are bench's seeded sample (Spec-Bench, one question a category, and HumanEval); each
question's turns are seeded as in `bench --temperature` (bench.sampled), so `none` and `auto`
sample the same text within each way of choosing: the tool checks it. The two ways draw
different texts (their uniform numbers differ), so their MAT differs by the text too.
"""

from __future__ import annotations

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

ROWS = ("none host", "auto host", "none mlx-lm's", "auto mlx-lm's", "mlx-lm")


@click.command()
@click.option("--seed", type=int, required=True, help="bench's prompt sample seed.")
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--min-p", default=0.0, show_default=True)
@click.option("--per-category", default=1, show_default=True)
@click.option("--humaneval-prompts", default=2, show_default=True)
@click.option("--max-tokens", default=96, show_default=True)
def main(seed, temperature, top_p, top_k, min_p, per_category, humaneval_prompts, max_tokens):
    from cacheback_mlx import bench as B
    from cacheback_mlx import sampling
    from cacheback_mlx.api import Session
    from cacheback_mlx.budget import Sizer
    from cacheback_mlx.sampling import SamplingParams

    session = Session(None, "none", fixed_budget=True)
    cost = session.verify_cost()
    rows = {"none": B.Row(session.make_drafter("none")),
            "auto": B.Row(session.make_drafter("auto", persist=False), Sizer(cost))}
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    prompts = B.select_prompts(["spec_bench", "humaneval"], per_category, humaneval_prompts, seed=seed)

    def one(name, prompt, tokens):
        if name == "mlx-lm":
            return B.run_mlx_lm(session, prompt, tokens, params)
        drafter, way = name.split(" ", 1)
        sampling.HOST_SAMPLING = way == "host"
        try:
            return B.run_engine(session, rows[drafter], prompt, tokens, label=name, sampling=params)
        finally:
            sampling.HOST_SAMPLING = True

    for name in ROWS:  # warm-up, not counted
        one(name, B.WARMUP[0], 16)
    runs = []
    for i, prompt in enumerate(prompts):
        for name in ROWS[i % len(ROWS):] + ROWS[: i % len(ROWS)]:
            runs.append(one(name, prompt, max_tokens))
    print(f"seed {seed}, {len(prompts)} prompts, {max_tokens} tokens, {params}")
    print("| row | tok/s | vs none (same way) | vs mlx-lm | MAT | verify ms/pass |")
    print("|---|---:|---:|---:|---:|---:|")
    rate = {n: sum(len(r.tokens) for r in runs if r.drafter == n) / sum(r.seconds for r in runs if r.drafter == n)
            for n in ROWS}
    for n in ROWS:
        mine = [r for r in runs if r.drafter == n]
        passes = sum(r.passes for r in mine)
        base = rate["none " + n.split(" ", 1)[1]] if n != "mlx-lm" else rate[n]
        print(f"| {n} | {rate[n]:.2f} | {rate[n] / base:.2f}x | {rate[n] / rate['mlx-lm']:.2f}x | "
              f"{sum(len(r.tokens) for r in mine) / passes:.2f} | {1e3 * sum(r.verify_s for r in mine) / passes:.1f} |")
    for way in ("host", "mlx-lm's"):
        bad = B.mismatches([r for r in runs if r.drafter.endswith(way)], reference=f"none {way}")
        print(f"{way}: auto's text = none's on {len(prompts) - len(bad)} of {len(prompts)} questions"
              + "".join(f"\n  {m}" for m in bad))


if __name__ == "__main__":
    main()
