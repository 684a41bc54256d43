"""Side-by-side speed runs: several drafters and plain mlx-lm on ONE loaded model, interleaved per
prompt so machine noise hits all alike. Every drafter's output must equal `none`'s: greedy, or
sampled with a seed per question (`sampled`: a seeded request draws each position's token from
its own key, so every drafter samples the same text; mlx-lm's sampler draws its own).

Speed is tokens / wall time of the whole request (prefill + decoding), the same definition for
every row, mlx-lm included. The KV cache and the drafter are reset between questions; the two
turns of an MT-Bench question share both (turn 2 reuses turn 1's cache and drafter state).
"""

from __future__ import annotations

import json
import random
import re
import time
import zlib
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .api import Session
from .engine import on_gpu
from .errors import CachebackError
from .sampling import SamplingParams

DATA = Path(__file__).resolve().parent / "data" / "bench"  # Spec-Bench and HumanEval, shipped with their licences
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
COLUMNS = ["multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval"]
MLX_LM = "mlx-lm"


@dataclass
class Prompt:
    id: str
    column: str
    turns: list[str]
    chat: bool = True


@dataclass
class Run:
    prompt: str
    column: str
    drafter: str
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    passes: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0  # forward passes (the rest of a step: accept, rollback, bookkeeping)
    turns: list[int] = field(default_factory=list)  # tokens of each turn's reply (tokens holds them all)
    # each verify pass as [rows run, drafts sent, cached tokens, ms] (a slow pass is found in the JSON)
    pass_log: list[list] = field(default_factory=list)

    def add(self, out: list[int], seconds: float, stats=None) -> None:
        """One turn's reply and time; `stats`: the engine's counters for it (None: one token a pass)."""
        self.seconds += seconds
        self.tokens += out
        self.turns.append(len(out))
        self.passes += stats.passes if stats is not None else len(out)
        self.accepted += stats.accepted if stats is not None else len(out)
        if stats is not None:
            self.draft_s += stats.draft_s
            self.verify_s += stats.verify_s


@contextmanager
def logging_passes(run: Run, engine):
    """While it lasts, every verify pass the engine runs goes into run.pass_log."""
    def heard(e):
        if e.kind == "verify":
            run.pass_log.append([e.rows, e.drafts, e.cached, round(e.seconds * 1000, 3)])

    stop = engine.watch(heard)
    try:
        yield
    finally:
        stop()


def pass_medians(logs: list[list]) -> dict[int, float]:
    """Median ms of a verify pass of each row count, over the pass logs given (Run.pass_log)."""
    times = defaultdict(list)
    for log in logs:
        for rows, _, _, ms in log:
            times[rows].append(ms)
    return {rows: float(np.median(v)) for rows, v in sorted(times.items())}


def stalls(logs: list[list], factor: float = 5.0) -> list[list]:
    """Per pass log, its passes that took more than `factor` times the median of passes of as many
    rows in all of them (a stall: a kernel compiled in the middle of a decoding, another process)."""
    median = pass_medians(logs)
    return [[p for p in log if p[3] > factor * median[p[0]]] for log in logs]


def column_of(category: str) -> str:
    return "multi-turn conversation" if category in MT_BENCH else category


def load_prompts(sets: list[str], data: Path = DATA, per_category: int = 2, categories: list[str] | None = None,
                 seed: int | None = None) -> list[Prompt]:
    """`per_category` prompts of each category (Spec-Bench categories, or 'humaneval'): the first
    ones, or with a seed a random sample of each category (file order kept)."""
    out: list[Prompt] = []
    seen: dict[str, int] = defaultdict(int)
    rng = random.Random(seed)
    for name in sets:
        if name == "spec_bench":
            path = data / "spec_bench" / "question.jsonl"
            rows = [json.loads(line) for line in _read(path).splitlines() if line.strip()]
            items = [(str(r["question_id"]), r["category"], r["turns"], True) for r in rows]
        elif name == "humaneval":
            path = data / "humaneval" / "HumanEval.jsonl"
            rows = [json.loads(line) for line in _read(path).splitlines() if line.strip()]
            items = [(r["task_id"], "humaneval", [r["prompt"]], False) for r in rows]
        else:
            raise CachebackError(f"unknown prompt set {name!r} (spec_bench, humaneval)")
        if categories:
            items = [it for it in items if it[1] in categories or column_of(it[1]) in categories]
        if seed is not None:
            by_cat = defaultdict(list)
            for i, it in enumerate(items):
                by_cat[it[1]].append(i)
            picked = {i for idx in by_cat.values() for i in rng.sample(idx, min(per_category, len(idx)))}
            items = [it for i, it in enumerate(items) if i in picked]
        for pid, cat, turns, chat in items:
            if seen[cat] < per_category:
                seen[cat] += 1
                out.append(Prompt(pid, column_of(cat), list(turns), chat))
    return out


def select_prompts(sets: list[str], per_category: int, humaneval_prompts: int | None = None,
                   categories: list[str] | None = None, seed: int | None = None, data: Path = DATA) -> list[Prompt]:
    """The prompts of a bench run: `per_category` of each category of each set, HumanEval's count
    set apart (`bench --humaneval-prompts`). Also how a run's JSON is replayed (tools/auto_sweep.py)."""
    out: list[Prompt] = []
    for name in sets:
        n = humaneval_prompts if name == "humaneval" and humaneval_prompts is not None else per_category
        out += load_prompts([name], data, n, categories, seed=seed)
    return out


def _read(path: Path) -> str:
    if not path.is_file():
        raise CachebackError(f"benchmark data not found: {path} (use --data DIR)")
    return path.read_text()


@dataclass
class Row:
    """One bench row: a drafter and how its passes are sized (a Sizer: per step; None: fixed)."""

    drafter: object
    sizer: object = None
    budget: int | None = None  # the cap (per step) or the fixed budget


def sampled(sampling: SamplingParams | None, prompt: Prompt, turn: int) -> SamplingParams:
    """The sampling of one turn of a question: greedy (None), or `sampling` with a seed of its own,
    made from the question's id and the turn (the same for every drafter and every run)."""
    if sampling is None:
        return SamplingParams()
    return replace(sampling, seed=zlib.crc32(f"{prompt.id}:{turn}:{sampling.seed or 0}".encode()))


def run_engine(session: Session, row, prompt: Prompt, max_tokens: int, label: str | None = None,
               sampling: SamplingParams | None = None) -> Run:
    """One question with one drafter (or Row), from an empty cache and a fresh drafter state;
    greedy, or sampled (`sampled`)."""
    row = row if isinstance(row, Row) else Row(row, session.engine.sizer, session.engine.draft_budget)
    drafter = row.drafter
    eng = session.engine
    eng.set_sizer(row.sizer, row.budget)
    eng.reset(drafter)
    run = Run(prompt.id, prompt.column, label or drafter.name)
    messages: list[dict] = []
    for k, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        ids = session.encode(messages if prompt.chat else turn, chat=prompt.chat)
        with logging_passes(run, eng):
            t0 = time.perf_counter()
            out = [t for step in eng.generate(ids, max_tokens, sampled(sampling, prompt, k)) for t in step]
            run.add(out, time.perf_counter() - t0, eng.stats)
        messages.append({"role": "assistant", "content": session.tokenizer.decode(out)})
    return run


def run_mlx_lm(session: Session, prompt: Prompt, max_tokens: int, sampling: SamplingParams | None = None,
               kv: tuple[int, int, int] | None = None) -> Run:
    """The same question with mlx-lm's own stream_generate on the same weights: greedy, or with
    mlx-lm's sampler at the same settings (seeded per turn through MLX's global random state);
    with the same logits processors (penalties); kv: (bits, group size, start) of its K/V cache
    quantization."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    run = Run(prompt.id, prompt.column, MLX_LM)
    messages: list[dict] = []
    for k, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        ids = session.encode(messages if prompt.chat else turn, chat=prompt.chat)
        kw = {}
        params = sampled(sampling, prompt, k)
        if params.temperature:
            mx.random.seed(params.seed)
            kw["sampler"] = make_sampler(temp=params.temperature, top_p=params.top_p if params.top_p < 1 else 0.0,
                                         min_p=params.min_p, top_k=params.top_k)
        if params.logits_processors:
            kw["logits_processors"] = list(params.logits_processors)
        if kv is not None:
            kw.update(kv_bits=kv[0], kv_group_size=kv[1], quantized_kv_start=kv[2])
        t0 = time.perf_counter()
        out = []
        for r in stream_generate(session.loaded.model, session.tokenizer, ids, max_tokens=max_tokens, **kw):
            if r.finish_reason is None or r.finish_reason == "length":
                out.append(int(r.token))
        run.add(out, time.perf_counter() - t0)
        messages.append({"role": "assistant", "content": session.tokenizer.decode(out)})
    return run


# Warm-up questions are not in any prompt set, so drafters that keep state across requests (SSD)
# have not seen the answers of benchmarked questions before they are asked.
WARMUP = [Prompt("warmup-chat", "warmup", ["Name three colours and say one thing about each."], chat=True),
          Prompt("warmup-code", "warmup", ["def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"], chat=False)]


def run_bench(session: Session, prompts: list[Prompt], drafters: dict, max_tokens: int, warmup: int = 1,
              with_mlx_lm: bool = True, progress: bool = True, warm_every_prompt: bool | None = None,
              sampling: SamplingParams | None = None) -> list[Run]:
    """Every prompt with every drafter (and mlx-lm), rotating the order per prompt; greedy, or
    sampled (`sampled`); mlx-lm quantizes its K/V cache as the engine was told to
    (Engine.set_kv_quantization).
    `warm_every_prompt` (default: on a GPU): first run each prompt once with plain decoding,
    untimed. On a GPU, MLX pays once a process for what a new shape needs (cuDNN's plan for a
    prompt's prefill, for each cache length a step reads, kernels compiled at first use: 0.3-0.5 s
    each on an H200), and whichever row met a shape first paid it in its time."""
    from tqdm import tqdm

    names = list(drafters) + ([MLX_LM] if with_mlx_lm else [])
    kv = session.engine.kv_quant
    for p in WARMUP[:warmup]:
        for n in names:
            _one(session, drafters, n, p, min(max_tokens, 16), sampling, kv)
    if on_gpu() if warm_every_prompt is None else warm_every_prompt:
        for p in tqdm(prompts, desc="warm-up", unit=" prompt", disable=not progress):
            run_mlx_lm(session, p, max_tokens, sampling, kv)
    runs = []
    for i, p in enumerate(tqdm(prompts, desc="bench", unit=" prompt", disable=not progress)):
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            runs.append(_one(session, drafters, n, p, max_tokens, sampling, kv))
    return runs


def _one(session, drafters, name, prompt, max_tokens, sampling=None, kv=None) -> Run:
    if name == MLX_LM:
        return run_mlx_lm(session, prompt, max_tokens, sampling, kv)
    return run_engine(session, drafters[name], prompt, max_tokens, label=name, sampling=sampling)


def mismatches(runs: list[Run], reference: str = "none") -> list[str]:
    """Prompts where a drafter's tokens differ from the reference's."""
    ref = {r.prompt: r.tokens for r in runs if r.drafter == reference}
    out = []
    for r in runs:
        if r.drafter != reference and r.prompt in ref and r.tokens != ref[r.prompt]:
            n = next((i for i, (a, b) in enumerate(zip(r.tokens, ref[r.prompt])) if a != b),
                     min(len(r.tokens), len(ref[r.prompt])))
            turn = 1 + int(np.searchsorted(np.cumsum(r.turns), n, side="right")) if len(r.turns) > 1 else 0
            where = f" (turn {min(turn, len(r.turns))} of {len(r.turns)})" if turn else ""
            out.append(f"{r.drafter} differs from {reference} on {r.prompt} at token {n}{where}")
    return out


def later_turn_note(differences: list[str]) -> str | None:
    """A line for where mlx-lm's tokens part from the engine's after a conversation's first turn
    (mismatches' lines): there mlx-lm's stream_generate prefills the whole conversation again,
    while the engine reuses its cache."""
    if not any(MLX_LM in m and "(turn " in m and "(turn 1 " not in m for m in differences):
        return None
    return ("note: where mlx-lm differs in a later turn, mlx-lm's stream_generate prefilled the whole conversation "
            "again where the engine reused its cache; in half precision on a GPU a prefill's bits depend on its "
            "rows, so near ties may go either way there")


def summarize(runs: list[Run]) -> dict[str, dict[str, dict]]:
    """column -> drafter -> {tokens_per_s, speedup_vs_none, speedup_vs_mlx_lm, mat, draft_share,
    draft_us_per_pass, verify_share, tokens}; shares are of the whole request's time. Besides the
    columns: "overall" (every prompt) and, when HumanEval ran with Spec-Bench, "spec_bench" (all
    Spec-Bench columns, HumanEval left out)."""
    sums: dict = defaultdict(lambda: defaultdict(lambda: np.zeros(6)))
    both = {r.column == "humaneval" for r in runs} == {True, False}  # Spec-Bench's own total too
    for r in runs:
        for col in (r.column, "overall") + (("spec_bench",) if both and r.column != "humaneval" else ()):
            sums[col][r.drafter] += [len(r.tokens), r.seconds, r.passes, r.accepted, r.draft_s, r.verify_s]
    table: dict = {}
    order = list(dict.fromkeys(r.drafter for r in runs))
    for col, per in sums.items():
        per = {d: per[d] for d in order if d in per}
        tps = {d: v[0] / v[1] if v[1] else 0.0 for d, v in per.items()}
        table[col] = {d: {"tokens": int(v[0]), "tokens_per_s": tps[d],
                          "speedup_vs_none": tps[d] / tps["none"] if tps.get("none") else float("nan"),
                          "speedup_vs_mlx_lm": tps[d] / tps[MLX_LM] if tps.get(MLX_LM) else float("nan"),
                          "mat": v[3] / v[2] if v[2] else 0.0, "draft_share": v[4] / v[1] if v[1] else 0.0,
                          "draft_us_per_pass": 1e6 * v[4] / v[2] if v[2] else 0.0,
                          "verify_share": v[5] / v[1] if v[1] else 0.0}
                      for d, v in per.items()}
    ends = COLUMNS + ["spec_bench", "overall"]
    return dict(sorted(table.items(), key=lambda kv: ends.index(kv[0]) if kv[0] in ends else 99))


def format_table(summary: dict) -> str:
    """A Markdown table: one row per column and drafter (pasted as is into docs/BENCHMARKS.md)."""
    width = max([7] + [len(d) for per in summary.values() for d in per])
    lines = [f"| {'column':<24} | {'drafter':<{width}} | tok/s | vs none | vs mlx-lm | MAT | draft% | draft us/pass |",
             f"|{'-' * 26}|{'-' * (width + 2)}|------:|--------:|----------:|----:|-------:|--------------:|"]
    def ratio(x: float, w: int) -> str:
        return f"{x:{w}.2f}x" if x == x else f"{'-':>{w + 1}}"  # NaN: that baseline was not run

    for col, per in summary.items():
        for d, s in per.items():
            lines.append(f"| {col:<24} | {d:<{width}} | {s['tokens_per_s']:5.2f} | {ratio(s['speedup_vs_none'], 6)} "
                         f"| {ratio(s['speedup_vs_mlx_lm'], 8)} | {s['mat']:4.2f} | {100 * s['draft_share']:5.1f}% "
                         f"| {s['draft_us_per_pass']:13.0f} |")
    return "\n".join(lines)


def plot(summary: dict, path: str | Path) -> None:
    """Grouped bars of speedup vs plain decoding per column and drafter (like Figure 3 of the paper)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = list(summary)
    drafters = [d for d in next(iter(summary.values())) if d != "none"]
    width = 0.8 / max(len(drafters), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cols)), 4))
    for i, d in enumerate(drafters):
        ax.bar(np.arange(len(cols)) + i * width, [summary[c].get(d, {}).get("speedup_vs_none", 0) for c in cols], width,
               label=d)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(np.arange(len(cols)) + width * (len(drafters) - 1) / 2, cols, rotation=20, ha="right")
    ax.set_ylabel("speedup vs plain decoding")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: never over bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)


_NUMBERS = re.compile(r"\[\s+(-?[\d.e+-]+(?:,\s+-?[\d.e+-]+)*)\s+\]")


def save_json(runs: list[Run], summary: dict, path: str | Path, meta: dict) -> None:
    """The run as JSON: indented, each list of numbers (tokens, a pass's log) on one line."""
    text = json.dumps({"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}, indent=1)
    Path(path).write_text(_NUMBERS.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text))
