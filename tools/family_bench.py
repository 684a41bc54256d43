"""Speculative decoding on sliding-window and hybrid (recurrent) families: random mlx-lm models,
tiny and mid-sized, on the current backend.

For each model: tokens/s and MAT of each drafter against plain decoding (our engine, no draft)
and mlx-lm's own generate_step on the same weights, every output checked against mlx-lm's tokens;
`oracle` (always right: the ceiling of any drafter at this budget) and `wrong` (always wrong: the
floor) bound what a real drafter can do; then the cost of one verify pass over B rows relative to
one row (B = 1..16).

    .venv/bin/python -m tools.family_bench [--models gemma3-tiny,qwen3_5-mid] [--prompts 6] [--max-tokens 96]

Random weights give no language: the streams are whatever the random model loops into, so MAT
here says how the machinery behaves (chains on hybrids, windows on sliding layers), not what a
trained model reaches. Prompts are the token ids of the recorded SmolLM2 prompts (../shared).
"""

from __future__ import annotations

import argparse
import time

import cacheback_mlx  # noqa: F401  (OpenBLAS before mlx.core)
from cacheback_mlx.costs import measure
from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.base import Drafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.replay import load_streams
from cacheback_mlx.tree import DraftTree

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text, qwen3_5


def gemma3(hidden, layers, heads, vocab, window):
    return gemma3_text, dict(model_type="gemma3_text", vocab_size=vocab, hidden_size=hidden,
                             num_hidden_layers=layers, intermediate_size=4 * hidden, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads,
                             query_pre_attn_scalar=hidden // heads, sliding_window=window,
                             sliding_window_pattern=6, max_position_embeddings=8192)


def qwen35(hidden, layers, heads, vocab):
    hd = hidden // heads
    return qwen3_5, dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=3 * hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=hd, linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=hd, linear_value_head_dim=hd, linear_conv_kernel_dim=4,
        max_position_embeddings=8192, tie_word_embeddings=True, full_attention_interval=4,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))


# name -> (module, config); "mid" is about the default model's size (~100-150M parameters)
MODELS = {
    "gemma3-tiny": gemma3(64, 6, 4, 128, 8),
    "gemma3-mid": gemma3(768, 12, 12, 32768, 64),
    "qwen3_5-tiny": qwen35(64, 4, 4, 128),
    "qwen3_5-mid": qwen35(768, 12, 12, 32768),
}


def build(name: str, scale: float, seed: int = 0):
    module, config = MODELS[name]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    # larger matrices than the default init, so greedy streams vary instead of one token repeated
    model.update(tree_map_with_path(lambda p, w: w * scale if p.endswith("weight") and w.ndim >= 2 else w,
                                    model.parameters()))
    mx.eval(model.parameters())
    return model


class Oracle(Drafter):
    """Knows the answer: a chain of the next `budget` true tokens (right=True), or of tokens the
    model never picks next (right=False). The ceiling and the floor of any real drafter."""

    def __init__(self, prompt, truth, right=True):
        self.full, self.start, self.right = list(prompt) + list(truth), len(prompt), right

    def propose(self, history, budget, max_branching=None):
        nxt = self.full[len(history):len(history) + budget]
        return DraftTree.chain(nxt if self.right else [(t + 1) % 100 for t in nxt])


def drafter_for(name, prompt, truth):
    if name in ("oracle", "wrong"):
        return Oracle(prompt, truth, right=name == "oracle")
    return make_drafter(name, **({"persist": False} if name == "ssd" else {}))


def mlx_lm_tokens(model, prompt, n):
    t0 = time.perf_counter()
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
        if len(out) == 1:
            t1 = time.perf_counter()  # decode time starts after the first token (prefill)
    return out, time.perf_counter() - t1, t1 - t0


def run_model(name, prompts, max_tokens, drafters, scale):
    model = build(name, scale)
    vocab = MODELS[name][1].get("vocab_size") or MODELS[name][1]["text_config"]["vocab_size"]
    prompts = [[t % vocab for t in p] for p in prompts]
    rows = {d: dict(tokens=0, s=0.0, passes=0, accepted=0, exact=True) for d in ["mlx-lm"] + drafters}
    for p in prompts:  # interleaved: every drafter on a prompt before the next prompt
        ref, s, _ = mlx_lm_tokens(model, p, max_tokens)
        rows["mlx-lm"]["tokens"] += len(ref) - 1
        rows["mlx-lm"]["s"] += s
        for d in drafters:
            eng = Engine(model, [], drafter_for(d, p, ref), 8192)
            out = [t for step in eng.generate(p, max_tokens) for t in step]
            r = rows[d]
            r["exact"] &= out == ref
            r["tokens"] += eng.stats.tokens
            r["s"] += eng.stats.decode_s
            r["passes"] += eng.stats.passes
            r["accepted"] += eng.stats.accepted
    eng = Engine(model, [], make_drafter("none"), 8192)
    cost = measure(eng.model, (1, 2, 4, 8, 16), (256,), repeats=5, vocab=eng.vocab_size, buckets=eng.buckets).table[256]
    return rows, cost, eng.describe()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma3-tiny,qwen3_5-tiny,gemma3-mid,qwen3_5-mid")
    ap.add_argument("--drafters", default="none,cacheback,pld,ngram,oracle,wrong")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--scale", type=float, default=3.0)
    a = ap.parse_args()
    streams = load_streams()
    prompts = [s["prompt"][-200:] for s in streams[:: max(1, len(streams) // a.prompts)][: a.prompts]]
    drafters = a.drafters.split(",")
    print(f"device {mx.default_device()}, {a.prompts} prompts, {a.max_tokens} tokens, weight scale {a.scale}")
    for name in a.models.split(","):
        rows, cost, info = run_model(name, prompts, a.max_tokens, drafters, a.scale)
        base = rows["none"]["tokens"] / rows["none"]["s"]
        print(f"\n### {name}: {', '.join(f'{k} x{v}' for k, v in info['caches'].items())}; verify: {info['verify']}\n")
        print("| drafter | tok/s | vs plain | vs mlx-lm | MAT | exact |\n|---|---:|---:|---:|---:|---|")
        mlx = rows["mlx-lm"]["tokens"] / rows["mlx-lm"]["s"]
        for d, r in rows.items():
            tps = r["tokens"] / r["s"]
            mat = f"{r['accepted'] / r['passes']:.2f}" if r["passes"] else "-"
            print(f"| {d} | {tps:.1f} | {tps / base:.2f}x | {tps / mlx:.2f}x | {mat} | "
                  f"{'yes' if r['exact'] else 'NO'} |")
        one = cost[1]
        print("\n| rows per pass | " + " | ".join(str(b) for b in cost) + " |\n|---|" + "---:|" * len(cost))
        print("| cost vs 1 row | " + " | ".join(f"{t / one:.2f}" for t in cost.values()) + " |")
        print(f"(one row: {1e3 * one:.1f} ms)")


if __name__ == "__main__":
    main()
