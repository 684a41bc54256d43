"""Prefill speed at long prompts: ours (the engine's chunked prefill, by chunk size) vs mlx-lm's
generate_step on the same weights, side by side in one run.

    .venv/bin/python -m tools.prefill_bench [--lengths 1024,4096,8000] [--chunks auto,128,256,512] [--model M]
        [--llama-bench PATH]

Each length: a prompt of that many tokens (a Python file repeated, so the tokens are real text),
prefilled into an empty cache; the median of --repeats runs. mlx-lm's side is
`mlx_lm.generate.generate_step` (its default prefill step, 2048 tokens) up to its first token,
which also runs one forward pass for that token; so one decode step is added to ours too.
Also prints the longest chunk time of each length: what a cancelled prefill waits at most.
--llama-bench: llama.cpp's `llama-bench` binary (build it from llama.cpp's sources: `cmake -B build
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON && cmake --build build --target
llama-bench`; a native build can use instructions a VM advertises but lacks); a GGUF model (the
default is one) is then also timed there, at the same lengths, in the model file's own quantization.
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


def llama_bench(binary: str, path: str, lengths: list[int], repeats: int) -> dict[int, float]:
    """Prompt tokens/s llama.cpp's own `llama-bench` reports for each length (prefill from an
    empty context, batch 512, every core)."""
    import json
    import os
    import subprocess

    cmd = [binary, "-m", path, "-p", ",".join(map(str, lengths)), "-n", "0", "-t", str(os.cpu_count()),
           "-b", "512", "-ub", "512", "-r", str(repeats), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return {int(t["n_prompt"]): float(t["avg_ts"]) for t in json.loads(r.stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--chunks", default="auto,128,256,512", help="chunk sizes of ours; auto: the engine's own")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary (GGUF models)")
    a = ap.parse_args(argv)
    from cacheback_mlx.loader import load

    loaded = load(a.model)
    from cacheback_mlx.verify import cpu_prefill_chunk

    # "auto": the engine's own CPU chunks (verify.cpu_prefill_chunk: 128 tokens, 64 past 4,096 cached)
    chunks = [c if c == "auto" else int(c) for c in a.chunks.split(",")]
    print(f"model {loaded.name} ({loaded.dtype}), device {mx.default_device()}\n")
    lengths = [int(x) for x in a.lengths.split(",")]
    cpp: dict[int, float] = {}
    if a.llama_bench:
        if not str(loaded.source).endswith(".gguf"):
            raise SystemExit("--llama-bench needs a GGUF model")
        cpp = llama_bench(a.llama_bench, loaded.source, lengths, a.repeats)
    print("| prompt tokens | " + " | ".join(f"ours, chunk {c}: tok/s (longest chunk s)" for c in chunks)
          + " | mlx-lm tok/s | best ours / mlx-lm |" + (" llama.cpp tok/s | best ours / llama.cpp |" if cpp else ""))
    print("|---:|" + "---:|" * (len(chunks) + 2 + 2 * bool(cpp)))
    for n in lengths:
        if n >= loaded.context_length:
            print(f"| {n} | past the model's context of {loaded.context_length} |")
            continue
        ids = prompt_ids(loaded.tokenizer, n)
        ours_runs = {c: [ours(loaded.model, ids, cpu_prefill_chunk if c == "auto" else c) for _ in range(a.repeats)]
                     for c in chunks}
        mlx = statistics.median(theirs(loaded.model, ids) for _ in range(a.repeats))
        rate = {c: n / statistics.median(r[0] for r in runs) for c, runs in ours_runs.items()}
        cells = [f"{rate[c]:.0f} ({max(r[1] for r in ours_runs[c]):.2f})" for c in chunks]
        extra = f" {cpp[n]:.0f} | {max(rate.values()) / cpp[n]:.2f}x |" if cpp else ""
        print(f"| {n} | " + " | ".join(cells) + f" | {n / mlx:.0f} | {max(rate.values()) * mlx / n:.2f}x |" + extra,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
