"""The weights as loaded [out, in] and stored [in, out] (blas.transpose_weights), side by side in one process.

    .venv/bin/python -m tools.ab.layout [--model M] [--contexts 256,1050] [--rows 1,4,8,16,33]
    .venv/bin/python -m tools.ab.layout --record SESSION.json     # an editor session, request by request

Two copies of the model, one in each layout. Passes: a chain pass of r rows after c cached tokens
in each copy, interleaved (the median of --repeats rounds), and the logits of the two compared bit
for bit. --record: the requests of `python -m tools.editor.replay --record` (completions, follow-ups,
warm-ups) served by one engine per layout, each request by both engines in turn (the first one
alternates), with the `auto` drafter; it prints the median time to the first completed line and
the latency of the completions in each, and checks that both produced the same tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import cacheback_mlx  # noqa: F401 - first: it preloads OpenBLAS before mlx.core (blas.py)

import click

LAYOUTS = ("as loaded", "[in, out]")


def two_copies(model):
    from cacheback_mlx import blas
    from cacheback_mlx.loader import load

    os.environ[blas.LAYOUT_ENV] = "0"
    stock = load(model)
    os.environ[blas.LAYOUT_ENV] = "1"
    moved = load(model)
    if not blas.weight_layout_wanted():
        raise click.ClickException(f"the layout is not used here (openblas: {blas.status})")
    return {LAYOUTS[0]: stock, LAYOUTS[1]: moved}


def use(layout: str) -> None:
    """The cost tables are kept per layout (costs.cost_path reads the switch)."""
    from cacheback_mlx import blas

    os.environ[blas.LAYOUT_ENV] = "0" if layout == LAYOUTS[0] else "1"


def passes(models, contexts, rows, repeats):
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    import mlx.core as mx
    import numpy as np

    caches = {k: ModelCache(m.model) for k, m in models.items()}
    print(f"ms per pass (median of {repeats}); same logits: bit for bit\n")
    print("| cached | rows | as loaded ms | [in, out] ms | ratio | same logits |\n|---:|---:|---:|---:|---:|:---:|")
    done = 0
    for c in contexts:
        for k, m in models.items():
            prefill(m.model, caches[k], [(100 + i) % 5000 for i in range(done, c)])
        done = c
        for r in rows:
            lead = [(7 + 13 * i) % 5000 for i in range(r)]
            times = {k: [] for k in models}
            logits = {}
            for i in range(repeats + 1):
                for k in (LAYOUTS if i % 2 else LAYOUTS[::-1]):
                    t0 = time.perf_counter()
                    out = verify_pass(models[k].model, caches[k], lead, DraftTree.empty())
                    mx.eval(out)
                    if i:
                        times[k].append(time.perf_counter() - t0)
                    logits[k] = np.array(out)
                    caches[k].trim(c)
            a, b = (statistics.median(times[k]) for k in LAYOUTS)
            same = np.array_equal(*logits.values())
            print(f"| {c} | {r} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} | {'yes' if same else 'NO'} |",
                  flush=True)


def read_record(record: Path) -> list[dict]:
    try:
        requests = json.loads(record.read_text())["requests"]
        if not all(isinstance(r, dict) and {"kind", "prompt", "out"} <= r.keys() for r in requests):
            raise KeyError("a request without kind, prompt or out")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise click.ClickException(f"{record}: not a record of tools.editor.replay --record ({e})") from None
    return requests


def session(models, record: Path, requests: list[dict]):
    import tempfile

    from cacheback_mlx.api import Session

    with tempfile.TemporaryDirectory(prefix="layout-ab-") as root:
        sessions = {}
        for k, m in models.items():
            use(k)
            sessions[k] = Session(m, drafter="auto", ssd_path=tempfile.mkdtemp(dir=root))
            sessions[k].verify_cost()
        decode = sessions[LAYOUTS[0]].tokenizer.decode
        rows = {k: [] for k in models}
        for i, req in enumerate(requests):
            got = {}
            for k in (LAYOUTS if i % 2 else LAYOUTS[::-1]):
                use(k)
                engine, context, slot = sessions[k].engine, req.get("context") or (), req.get("slot")
                if not req.get("max_tokens") or not req["out"]:
                    engine.prefill_only(req["prompt"], context, slot=slot)
                    continue
                t0, out, line = time.perf_counter(), [], None
                for step in engine.generate(req["prompt"], len(req["out"]), context=context, slot=slot):
                    out += step
                    if line is None and "\n" in decode(out).lstrip():
                        line = time.perf_counter() - t0
                latency = time.perf_counter() - t0
                got[k] = out
                if req["kind"] == "fim":
                    rows[k].append((latency if line is None else line, latency))
            if len(set(map(tuple, got.values()))) > 1:
                raise click.ClickException(f"request {i}: the two layouts produced different tokens")
        for s in sessions.values():
            s.engine.drafter.close()
    print(f"{len(rows[LAYOUTS[0]])} completions of {record.name}, each served in both layouts (same tokens)\n")
    print("| layout | median first line ms | median latency ms | total latency s |\n|---|---:|---:|---:|")
    for k, r in rows.items():
        print(f"| {k} | {1e3 * statistics.median(x[0] for x in r):.0f} "
              f"| {1e3 * statistics.median(x[1] for x in r):.0f} "
              f"| {sum(x[1] for x in r):.1f} |")
    ratio = [b[1] / a[1] for a, b in zip(*rows.values())]
    print(f"\nlatency [in, out] / as loaded, per completion: median {statistics.median(ratio):.3f}")


@click.command()
@click.option("--model", "-m", default=None)
@click.option("--contexts", default="256,1050")
@click.option("--rows", default="1,4,8,16,33")
@click.option("--repeats", default=7)
@click.option("--record", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="a JSON file written by tools.editor.replay --record")
def main(model, contexts, rows, repeats, record):
    import mlx.core as mx

    requests = None if record is None else read_record(record)  # a bad file fails before the models load
    models = two_copies(model)
    print(f"{models[LAYOUTS[0]].name}, {mx.default_device()}, {models[LAYOUTS[0]].dtype}\n")
    if record is None:
        passes(models, [int(x) for x in contexts.split(",")], [int(x) for x in rows.split(",")], repeats)
    else:
        session(models, record, requests)


if __name__ == "__main__":
    main()
