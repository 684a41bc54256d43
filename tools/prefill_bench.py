"""Prefill speed at long prompts: ours (the engine's chunked prefill, by chunk size) vs mlx-lm's
generate_step on the same weights, side by side in one run.

    .venv/bin/python tools/prefill_bench.py [--lengths 1024,4096,8000] [--chunks 128,256,512] [--model M]
        [--llama-cpp-python PYTHON]

Each length: a prompt of that many tokens (a Python file repeated, so the tokens are real text),
prefilled into an empty cache; the median of --repeats runs. mlx-lm's side is
`mlx_lm.generate.generate_step` (its default prefill step, 2048 tokens) up to its first token,
which also runs one forward pass for that token; so one decode step is added to ours too.
Also prints the longest chunk time of each length: what a cancelled prefill waits at most.
--llama-cpp-python: an interpreter with llama-cpp-python installed (`pip install llama-cpp-python`
builds llama.cpp from its source package); a GGUF model (the default is one) is then also timed
there, on the same token ids: `Llama.eval` of the prompt (n_batch 512, every core), as
llama.cpp's server prefills it, in the model file's own quantization.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import cacheback_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

import mlx.core as mx


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = open(__file__).read()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def ours(model, ids: list[int], chunk: int) -> tuple[float, float]:
    """(seconds to prefill all but the last token and run the last, longest chunk seconds)."""
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.tree import DraftTree
    from cacheback_mlx.verify import prefill, verify_pass

    cache = ModelCache(model)
    times: list[float] = []
    t0 = time.perf_counter()
    prefill(model, cache, ids[:-1], chunk=chunk, timed=lambda rows, cached, s: times.append(s))
    mx.eval(verify_pass(model, cache, ids[-1:], DraftTree.empty()))
    return time.perf_counter() - t0, max(times)


def theirs(model, ids: list[int]) -> float:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    for token, _ in generate_step(mx.array(ids), model, max_tokens=1):
        break
    return time.perf_counter() - t0


LLAMA_CPP = """
import json, os, sys, time
from llama_cpp import Llama
path, lengths = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(model_path=path, n_ctx=max(len(ids) for ids in lengths) + 16, n_batch=512, n_ubatch=512,
            n_threads=os.cpu_count(), verbose=False)
out = []
for ids in lengths:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def llama_cpp(python: str, path: str, prompts: list[list[int]]) -> list[float]:
    """Seconds llama.cpp takes to prefill each prompt (a separate interpreter)."""
    import json
    import subprocess

    r = subprocess.run([python, "-c", LLAMA_CPP, path, json.dumps(prompts)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-cpp-python failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--chunks", default="128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp-python", default=None, help="an interpreter with llama-cpp-python installed")
    a = ap.parse_args(argv)
    from cacheback_mlx.loader import load

    loaded = load(a.model)
    chunks = [int(c) for c in a.chunks.split(",")]
    print(f"model {loaded.name} ({loaded.dtype}), device {mx.default_device()}\n")
    lengths = [int(x) for x in a.lengths.split(",")]
    cpp: dict[int, float] = {}
    if a.llama_cpp_python:
        if not str(loaded.source).endswith(".gguf"):
            raise SystemExit("--llama-cpp-python needs a GGUF model")
        runs = [llama_cpp(a.llama_cpp_python, loaded.source, [prompt_ids(loaded.tokenizer, n) for n in lengths])
                for _ in range(a.repeats)]
        cpp = {n: n / statistics.median(r[i] for r in runs) for i, n in enumerate(lengths)}
    print("| prompt tokens | " + " | ".join(f"ours, chunk {c}: tok/s (longest chunk s)" for c in chunks)
          + " | mlx-lm tok/s | best ours / mlx-lm |" + (" llama.cpp tok/s | best ours / llama.cpp |" if cpp else ""))
    print("|---:|" + "---:|" * (len(chunks) + 2 + 2 * bool(cpp)))
    for n in lengths:
        if n >= loaded.context_length:
            print(f"| {n} | past the model's context of {loaded.context_length} |")
            continue
        ids = prompt_ids(loaded.tokenizer, n)
        ours_runs = {c: [ours(loaded.model, ids, c) for _ in range(a.repeats)] for c in chunks}
        mlx = statistics.median(theirs(loaded.model, ids) for _ in range(a.repeats))
        rate = {c: n / statistics.median(r[0] for r in runs) for c, runs in ours_runs.items()}
        cells = [f"{rate[c]:.0f} ({max(r[1] for r in ours_runs[c]):.2f})" for c in chunks]
        extra = f" {cpp[n]:.0f} | {max(rate.values()) / cpp[n]:.2f}x |" if cpp else ""
        print(f"| {n} | " + " | ".join(cells) + f" | {n / mlx:.0f} | {max(rate.values()) * mlx / n:.2f}x |" + extra,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
