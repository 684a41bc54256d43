"""Rebuild the shipped default frozen table (cacheback_mlx/data/frozen_smollm2_ll1_fl3.npz) and the
shipped datastore of the default model's own answers (cacheback_mlx/data/self_answers_smollm2.npz).

Corpus, two parts:
- the CPython standard library sources of the running interpreter (site-packages and test data
  excluded): code plus English docstrings and comments, available offline on every machine
  (580 files, 11 MB, 3.1M tokens with Python 3.11.7; another Python version gives a slightly
  different table);
- the default model's own greedy output (tools/self_corpus.py), each file counted SELF_WEIGHT
  times so its pairs are not drowned by the code's:
  - tools/data/self_corpus_smollm2.jsonl.gz: answers to 640 template questions
    (`python -m tools.self_corpus OUT --prompts 480`: 480 questions, then 160 about its own answers;
    ~0.1M tokens, 18 min on 2 cores): how the chat model phrases its answers;
  - tools/data/self_code_smollm2.jsonl.gz: raw completions of 640 standard-library function heads
    (`python -m tools.self_corpus OUT --code --prompts 640 --max-tokens 128`; ~80K tokens, 20 min): how
    it goes on from a `def` line and a docstring, without the chat template;
  - tools/data/self_qa_smollm2.jsonl.gz: answers to 480 factual and how-to questions, then a
    follow-up turn in 160 of those chats (`python -m tools.self_corpus OUT --qa --prompts 480 --seed 1`).
Not the benchmark data in ../shared/data, which is the test set. Takes ~30 s on 2 cores.

The datastore holds the self-corpora alone (each answer once, ~0.25M tokens, 0.2 MB compressed):
`auto` retrieves from it as a REST source (drafters/rest.py, shipped_datastore). With the
standard library added (3.4M tokens, ~30 MB) it drafted no better (docs/BENCHMARKS.md §4).

    .venv/bin/python -m tools.build_default_table
"""

import sys
import sysconfig
from pathlib import Path

import cacheback_mlx  # noqa: F401  (OpenBLAS before mlx)
from cacheback_mlx.drafters.cacheback import DEFAULT_TABLE
from cacheback_mlx.drafters.rest import SHIPPED, save_shipped
from cacheback_mlx.loader import load
from cacheback_mlx.table_builder import build_table_from_files, encode, file_texts, tokenizer_fingerprint


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


DATA = Path(__file__).resolve().parent / "data"
SELF_CORPORA = [DATA / "self_corpus_smollm2.jsonl.gz", DATA / "self_code_smollm2.jsonl.gz",
                DATA / "self_qa_smollm2.jsonl.gz"]
SELF_WEIGHT = 16  # docs/BENCHMARKS.md §4: 4, 16 and 64 gave MAT within 1% of each other (chat answers)


def main() -> None:
    std = stdlib_files()
    files = std + [f for f in SELF_CORPORA for _ in range(SELF_WEIGHT)]
    print(f"{len(std)} files from {sysconfig.get_paths()['stdlib']} (Python {sys.version.split()[0]}), "
          + ", ".join(f"{f.name} x {SELF_WEIGHT}" for f in SELF_CORPORA))
    DEFAULT_TABLE.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = load().tokenizer
    table = build_table_from_files(files, tokenizer, DEFAULT_TABLE, ll=1, fl=3, lc=1 << 20, fc=128)
    print(f"{len(table)} leaders, {len(table.followers)} followers -> {DEFAULT_TABLE} "
          f"({DEFAULT_TABLE.stat().st_size / 1e6:.1f} MB)")
    answers = (encode(tokenizer, text) for f in SELF_CORPORA for text in file_texts(f))
    n = save_shipped(answers, SHIPPED, tokenizer_fingerprint(tokenizer))
    print(f"{n} tokens of the model's own answers -> {SHIPPED} ({SHIPPED.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
