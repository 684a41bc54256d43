"""Speculative decoding on a sharded model vs one process, side by side in one run.

    python -m tools.dist_bench [--model FOLDER] [--mode pipeline|tensor] [--drafter cacheback]
                               [--per-category 1] [--max-tokens 64] [--threads-per-rank 1]
                               [--link-us 60]

Rows: single-process plain and speculative decoding, then 2-rank sharded plain and speculative
decoding (two local processes over the ring backend on 127.0.0.1, started here). Each rank is
pinned to its own cores (os.sched_setaffinity where the OS has it) with --threads-per-rank BLAS
threads; the single process gets all those cores and threads. Every speculative row is checked
token for token against plain decoding in the same setup.

The default model is the embedded SmolLM2-135M, exported as an mlx-lm folder in mlx-lm's qwen2
layout (llama + zero q/k/v biases: the same function), because mlx-lm's llama module has no
pipeline() and its 9 heads do not split over 2 ranks; --mode tensor needs a model whose heads do.

The last lines estimate two Macs on a link of --link-us microseconds per collective (a stated
assumption, not a measurement): per verify pass, t_mac = t_local - C * l_local + C * l_link, with
t_local the measured 2-rank time per pass, C the collectives per pass (the model's own plus our
one message), l_local the measured latency of one small all_sum between the local ranks. Compute
stays this machine's; tokens per pass stay as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pin(rank: int, threads: int) -> None:
    """This process on cores [rank*threads, (rank+1)*threads) where the OS allows it."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        mine = cores[rank * threads : (rank + 1) * threads] or cores
        os.sched_setaffinity(0, mine)


def export_default(path: Path) -> Path:
    """The embedded default model (llama) as an mlx-lm qwen2 folder with zero q/k/v biases."""
    from cacheback_mlx.loader import LoadedModel, load, save_folder

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen2

    src = load(dtype="float32")
    a = src.model.args
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                           intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
                           rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size,
                           num_key_value_heads=a.num_key_value_heads,
                           max_position_embeddings=src.context_length, rope_theta=a.rope_theta,
                           rope_traditional=a.rope_traditional, rope_scaling=a.rope_scaling,
                           tie_word_embeddings=a.tie_word_embeddings)
    model = qwen2.Model(args)
    weights = dict(tree_flatten(src.model.parameters()))
    for name, w in tree_flatten(model.parameters()):
        if name not in weights:  # the q/k/v biases llama has not: zero, so the function is the same
            weights[name] = mx.zeros_like(w)
    model.update(tree_unflatten(list(weights.items())))
    x = mx.array([[1, 2, 3, 4, 5]])
    if not mx.allclose(model(x), src.model(x), atol=1e-4):
        raise SystemExit("the qwen2 export of the default model does not compute the same logits")
    return save_folder(LoadedModel(model, src.tokenizer, "SmolLM2-135M-qwen2", "", src.context_length, "float32", None),
                       path)


def worker(args) -> None:
    """One setup (single or one rank of a group): every prompt with plain and speculative
    decoding; rank 0 (or the single process) prints a JSON line."""
    pin(int(os.environ.get("MLX_RANK", 0)) if args.mode != "single" else 0,
        args.threads_per_rank * (1 if args.mode != "single" else args.ranks))
    from cacheback_mlx import bench as B
    from cacheback_mlx.cli import open_session

    session = open_session(args.model, "float32", "none", args.draft_budget, True, (),
                           None if args.mode == "single" else args.mode)
    rows = {"plain": B.Row(session.make_drafter("none"), None, args.draft_budget),
            "speculative": B.Row(session.make_drafter(args.drafter), None, args.draft_budget)}
    prompts = B.load_prompts(["spec_bench"], B.DATA, args.per_category)[: args.limit]
    runs = B.run_bench(session, prompts, rows, args.max_tokens, warmup=1, with_mlx_lm=False, progress=False)
    out = {}
    for name in rows:
        mine = [r for r in runs if r.drafter == name]
        out[name] = {"tokens": sum(len(r.tokens) for r in mine), "seconds": sum(r.seconds for r in mine),
                     "passes": sum(r.passes for r in mine), "accepted": sum(r.accepted for r in mine),
                     "ids": [r.tokens for r in mine]}
    out["collectives"] = model_collectives(session.loaded.model, args.mode, args.ranks)
    print(json.dumps(out), flush=True)


def model_collectives(model, mode: str, ranks: int) -> int:
    """Collectives in one forward pass of the sharded model: one all_sum per sharded-to-all
    linear (tensor); a send per stage boundary plus the final all_gather (pipeline)."""
    if mode == "single":
        return 0
    if mode == "pipeline":
        return ranks - 1 + 1
    return sum(1 for _, m in model.named_modules() if "ShardedToAll" in type(m).__name__)


def latency_worker(args) -> None:
    """Mean seconds of one small all_sum (64 int32) between the ranks."""
    pin(int(os.environ["MLX_RANK"]), args.threads_per_rank)
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    x = mx.zeros(64, mx.int32)
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    t0 = time.perf_counter()
    for _ in range(300):
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    if group.rank() == 0:
        print(json.dumps({"latency_s": (time.perf_counter() - t0) / 300}), flush=True)


def launch(args, mode: str, extra: list[str]) -> dict:
    """Run this script as a worker: alone, or as args.ranks local ranks; rank 0's JSON."""
    import socket

    cmd = [sys.executable, __file__, *extra, "--mode", mode]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads_per_rank * (args.ranks if mode == "single" else 1)))
    if mode == "single":
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)]
    else:
        socks = [socket.socket() for _ in range(args.ranks)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        hosts = [[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks]
        for s in socks:
            s.close()
        hostfile = Path(tempfile.mkdtemp()) / "hosts.json"
        hostfile.write_text(json.dumps(hosts))
        procs = [subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
                                  stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
    try:
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{mode}: a worker failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm folder (default: the embedded model, exported)")
    ap.add_argument("--mode", default="pipeline", choices=["pipeline", "tensor", "single"])
    ap.add_argument("--drafter", default="cacheback")
    ap.add_argument("--draft-budget", type=int, default=None, help="draft tokens per pass (default: per backend)")
    ap.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--limit", type=int, default=None, help="only the first N questions (a smoke run)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--link-us", type=float, default=60.0,
                    help="assumed latency of one small collective between two Macs, in microseconds")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.latency:
        return latency_worker(args)
    if args.worker:
        return worker(args)

    model = args.model or str(export_default(Path(tempfile.mkdtemp()) / "SmolLM2-135M-qwen2"))
    common = ["--worker", "--model", model, "--drafter", args.drafter, "--per-category", str(args.per_category),
              *(["--limit", str(args.limit)] if args.limit else []), "--max-tokens", str(args.max_tokens),
              "--ranks", str(args.ranks),
              "--threads-per-rank", str(args.threads_per_rank)]
    if args.draft_budget is not None:
        common += ["--draft-budget", str(args.draft_budget)]
    single = launch(args, "single", common)
    sharded = launch(args, args.mode, common)
    lat = launch(args, args.mode, ["--latency", "--ranks", str(args.ranks),
                                   "--threads-per-rank", str(args.threads_per_rank)])["latency_s"]

    cores = os.cpu_count()
    print(f"model {model} | {args.mode} over {args.ranks} local ranks, {args.threads_per_rank} BLAS thread(s) and "
          f"core(s) each; single process: {args.ranks * args.threads_per_rank} thread(s) | {cores} cores | "
          f"drafter {args.drafter} | Spec-Bench {args.per_category}/category, {args.max_tokens} tokens")
    base = single["plain"]["tokens"] / single["plain"]["seconds"]
    print(f"{'setup':<28} {'tok/s':>7} {'vs single plain':>16} {'tok/pass':>9} {'ms/pass':>8}")
    for label, res in (("single plain", single["plain"]), ("single speculative", single["speculative"]),
                       (f"{args.ranks}-rank plain", sharded["plain"]),
                       (f"{args.ranks}-rank speculative", sharded["speculative"])):
        tps = res["tokens"] / res["seconds"]
        print(f"{label:<28} {tps:7.1f} {tps / base:15.2f}x {res['accepted'] / res['passes']:9.2f} "
              f"{1e3 * res['seconds'] / res['passes']:8.2f}")
    bad = [name for name in ("speculative",) if single[name]["ids"] != single["plain"]["ids"]] + \
          [f"{args.ranks}-rank {name}" for name in ("plain", "speculative")
           if sharded[name]["ids"] != single["plain"]["ids"]]
    print("lossless: " + ("all rows equal single-process plain decoding" if not bad else "DIFFERS: " + ", ".join(bad)))

    # the estimate for two Macs (see the module docstring)
    c = sharded["collectives"] + 1
    link = args.link_us * 1e-6
    print(f"local all_sum latency {lat * 1e6:.0f} us; collectives per pass C = {c} "
          f"({sharded['collectives']} in the model + 1 message)")
    est = {}
    for name in ("plain", "speculative"):
        res = sharded[name]
        t_local = res["seconds"] / res["passes"]
        t_mac = max(t_local - c * lat + c * link, 1e-9)
        est[name] = res["tokens"] / res["passes"] / t_mac
    print(f"ESTIMATE, two machines at {args.link_us:.0f} us per collective (this machine's compute): "
          f"plain {est['plain']:.1f} tok/s, speculative {est['speculative']:.1f} tok/s, "
          f"{est['speculative'] / est['plain']:.2f}x")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
