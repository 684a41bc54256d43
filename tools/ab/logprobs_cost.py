"""What asking for log-probabilities costs a generation: tokens per second with none asked, asked
and never read, read (each step's [tokens, vocab] to the host), and made into the server's entries
with N alternatives (server/logprobs.token_entries), side by side in rounds.

    .venv/bin/python -m tools.ab.logprobs_cost [--model M] [--drafter pld] [--rounds 3] [--max-tokens 96]
        [--top 5] [--prompt P ...]

Each mode of each round runs in a fresh Session with a drafter that keeps nothing across requests
(`pld` by default), so every mode drafts alike; the modes alternate within a round.
"""

from __future__ import annotations

import statistics
import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

PROMPTS = ("Write a Python function that returns the fibonacci numbers up to n.",
           "Explain why the sky is blue in three sentences.", "List five uses of a paperclip.",
           "What is the boiling point of water?", "Describe a cat.")
MODES = ("none", "asked", "read", "entries")


@click.command()
@click.option("--model", default=None, help="a model as `--model` takes it (default: the embedded one)")
@click.option("--drafter", default="pld", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--max-tokens", default=96, show_default=True)
@click.option("--top", default=5, show_default=True, help="alternatives per token in the entries mode")
@click.option("--prompt", "prompts", multiple=True, help="a prompt (repeatable; default: five short ones)")
def main(model, drafter, rounds, max_tokens, top, prompts):
    from cacheback_mlx.api import Session
    from cacheback_mlx.sampling import SamplingParams
    from cacheback_mlx.server.logprobs import token_entries

    prompts = prompts or PROMPTS
    speed = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            s = Session(model, drafter)
            ids = [s.encode(p) for p in prompts]
            list(s.engine.generate(ids[0], 8))  # warm-up
            t0, n = time.perf_counter(), 0
            for p in ids:
                for step in s.engine.generate(p, max_tokens, SamplingParams(logprobs=mode != "none")):
                    n += len(step)
                    if mode == "read":
                        step.logprobs.tolist()
                    elif mode == "entries":
                        token_entries(s.tokenizer, step, top)
            speed[mode].append(n / (time.perf_counter() - t0))
    base = statistics.median(speed["none"])
    click.echo(f"{'mode':<8} {'tok/s by round':<28} {'median':>7} {'vs none':>8}")
    for mode in MODES:
        med = statistics.median(speed[mode])
        click.echo(f"{mode:<8} {' / '.join(f'{x:.1f}' for x in speed[mode]):<28} {med:7.1f} {med / base:7.2f}x")


if __name__ == "__main__":
    main()
