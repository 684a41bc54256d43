"""Structured output's speed: answers kept to a JSON schema (constrained.py), `auto` and `none`
against mlx-lm's generate_step with the same constraint, side by side in rounds; every answer
checked against the first run's. Each round's `auto` starts from a drafter that learned nothing
(Session.fresh_drafter), so a round does not draft from the answers of the one before.

    .venv/bin/python -m tools.ab.structured [--model M] [--rounds 3] [--max-tokens 160]
"""

from __future__ import annotations

import statistics
import time

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
BOOK = {"type": "object", "additionalProperties": False, "required": ["title", "author", "year", "genres"],
        "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                       "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
STEPS = {"type": "object", "additionalProperties": False, "required": ["task", "steps"],
         "properties": {"task": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"},
                                                               "maxItems": 5}}}
ASKS = [("Make up a person who lives in Lisbon, as JSON with name, age, city and hobbies.", PERSON),
        ("Describe a well-known novel as JSON: title, author, year and genres.", BOOK),
        ("How do I make tea? Answer as JSON with the task and a list of steps.", STEPS),
        ("Invent a retired teacher from Oslo, as JSON with name, age, city and hobbies.", PERSON)]


@click.command()
@click.option("--model", default=None, help="a model as `--model` takes it (default: the embedded one)")
@click.option("--rounds", default=3, show_default=True)
@click.option("--max-tokens", default=160, show_default=True)
def main(model, rounds, max_tokens):
    from cacheback_mlx.api import Session
    from cacheback_mlx.constrained import Constrained, grammar_of
    from cacheback_mlx.sampling import SamplingParams

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    sessions = {name: Session(model, name) for name in ("auto", "none")}
    any_session = sessions["none"]
    eos = any_session.engine.eos_ids
    work = [(any_session.encode(q), grammar_of(json_schema=schema)) for q, schema in ASKS]
    speed = {name: [] for name in ("auto", "none", "mlx-lm")}
    mats, answers, same = [], {}, 0
    for _ in range(rounds):
        sessions["auto"].fresh_drafter()  # each round from a drafter that learned nothing (none kept on disk)
        for name in ("auto", "none", "mlx-lm"):
            t0, n = time.perf_counter(), 0
            for k, (ids, grammar) in enumerate(work):
                c = Constrained(grammar, any_session.tokenizer, eos, len(ids))
                if name == "mlx-lm":
                    out = []
                    for t, _ in generate_step(mx.array(ids), any_session.loaded.model, max_tokens=max_tokens,
                                              logits_processors=[c]):
                        if int(t) in eos:
                            break
                        out.append(int(t))
                else:
                    eng = sessions[name].engine
                    out = [t for s in eng.generate(ids, max_tokens, SamplingParams(logits_processors=(c,))) for t in s]
                    if name == "auto":
                        mats.append(eng.stats.mat)
                n += len(out)
                if k in answers:
                    same += answers[k] == out
                else:
                    answers[k] = out
            speed[name].append(n / (time.perf_counter() - t0))
    base = statistics.median(speed["mlx-lm"])
    click.echo(f"{'':<8} {'tok/s by round':<24} {'median':>7} {'vs mlx-lm':>9}")
    for name, xs in speed.items():
        med = statistics.median(xs)
        click.echo(f"{name:<8} {' / '.join(f'{x:.1f}' for x in xs):<24} {med:7.1f} {med / base:8.2f}x")
    click.echo(f"auto MAT {statistics.mean(mats):.2f} (by answer {min(mats):.2f}-{max(mats):.2f}); "
               f"answers equal to the first run's: {same} of {len(work) * (3 * rounds - 1)}")
    for ids, _ in work[:1]:
        click.echo(any_session.tokenizer.decode(answers[0]))


if __name__ == "__main__":
    main()
