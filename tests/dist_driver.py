"""Run on every rank by test_distributed.py (and once alone, without --distributed): greedy token
ids from each drafter on one session, printed as JSON by rank 0 (other ranks follow inside
open_session and never get past it).

    python dist_driver.py FOLDER MODE(tensor|pipeline|single) MAX_TOKENS PROMPT_IDS_JSON
"""

import json
import sys

from cacheback_mlx.cli import open_session
from cacheback_mlx.sampling import SamplingParams

from adversarial import OracleDrafter, RandomTreeDrafter


def ids(session, prompt, n, sampling=SamplingParams()):
    out = [t for _, tokens in session.stream_ids(prompt, n, sampling) for t in tokens]
    return {"ids": out, "passes": session.stats.passes}


def main():
    folder, mode, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    session = open_session(folder, "float32", "none", 12, True, (), None if mode == "single" else mode)
    out = {"none": ids(session, prompt, n)}
    plain = out["none"]["ids"]
    for name in ("ngram", "cacheback"):
        session.set_drafter(name)
        session.reset()
        out[name] = ids(session, prompt, n)
    vocab = session.engine.vocab_size
    for name, drafter in (("oracle-tree", OracleDrafter(prompt, plain, extra_wrong_branches=1)),
                          ("random-trees", RandomTreeDrafter(prompt, plain, seed=1, vocab=vocab))):
        session.engine.set_drafter(drafter)
        session.reset()
        out[name] = ids(session, prompt, n)
    # the next turn extends this one: only its new tokens are prefilled (a trim that keeps a prefix)
    turn = prompt + plain[: n // 2] + [7, 8]
    out["next-turn"] = ids(session, turn, n)
    # a prompt longer than one prefill chunk (512), from scratch; then sampling, drawn on rank 0 only
    session.set_drafter("cacheback")
    session.reset()
    out["long"] = ids(session, (prompt * 10)[:600], 8)
    out["sampled"] = ids(session, prompt, n, SamplingParams(temperature=0.8, seed=3))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
