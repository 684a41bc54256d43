"""CARD drafter: the query-and-correct tree cache, losslessness in both modes, the draft process's
life cycle (no orphans after exit, Ctrl-C or a killed draft process) and one-line errors."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from cacheback_mlx.drafters import make_drafter
from cacheback_mlx.drafters.card import CardDrafter
from cacheback_mlx.drafters.card_tree import TokenTree
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.loader import LoadedModel, load
from cacheback_mlx.tokenizer import vocab_fingerprint

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import zoo
from conftest import tiny_llama, write_tiny_gguf

SERIAL = pytest.mark.serial  # tools/test.sh runs these alone: they start draft processes

PROMPT = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8]
N = 48


def plain(model, prompt=PROMPT, n=N):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run(model, drafter, prompt=PROMPT, n=N, budget=7):
    eng = Engine(model, eos_ids=[], drafter=drafter, context_length=4096, draft_budget=budget)
    return [t for step in eng.generate(prompt, n) for t in step], eng


def in_memory(model, name="m"):
    return LoadedModel(model, None, name, "", 4096, "float32", None)


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


# --- the tree cache (no model, no timing) ------------------------------------------------------

def grown_tree():
    """root -> A(0.6) B(0.4); A -> C(0.5*0.6) E(0.2*0.6); B -> D(0.9*0.4)."""
    t = TokenTree(paths=3, top_k=2, depth=5, nodes=20)
    t.grow([-1], np.array([[10, 11]]), np.array([[0.6, 0.4]]))
    assert t.tokens == [10, 11] and t.frontier == [0, 1]
    t.grow([0, 1], np.array([[12, 14], [13, 15]]), np.array([[0.5, 0.2], [0.9, 0.05]]))
    return t


def test_tree_layers_keep_the_best_paths_by_cumulative_probability():
    t = grown_tree()
    # candidates: 12 (0.30), 14 (0.12), 13 (0.36), 15 (0.02): the 3 best are kept
    assert sorted(zip(t.tokens[2:], t.parents[2:])) == [(12, 0), (13, 1), (14, 0)]
    assert np.allclose(sorted(t.scores[2:]), [0.12, 0.30, 0.36])
    best = t.best(3)
    assert list(best.tokens) == [10, 11, 13] and list(best.parents) == [-1, -1, 1]
    assert np.all(np.diff(best.scores) <= 0)
    chain = t.best(5, max_branching=1)
    assert chain.is_chain() and list(chain.tokens) == [10, 12]


def test_correction_after_a_rejection_continues_from_the_accepted_token():
    """The target rejected A and took B: the next proposal hangs below B, re-scored from it."""
    t = grown_tree()
    assert t.advance([11]) == [2]  # old node 2 (13, below B) is the new node 0
    assert t.tokens == [13] and t.parents == [-1] and np.isclose(t.scores[0], 0.9)
    assert t.frontier == [0]
    d = t.best(4)
    assert list(d.tokens) == [13] and list(d.parents) == [-1]
    # growth continues from the kept node, at depth 2 below the new root
    t.grow([0], np.array([[7, 8]]), np.array([[0.5, 0.5]]))
    assert t.depths == [1, 2, 2] and t.parents == [-1, 0, 0]


def test_accepted_path_deep_in_the_tree_and_a_miss():
    t = grown_tree()
    assert t.advance([10, 12]) == [] and len(t) == 0 and t.frontier == [-1]  # a leaf: regrow from it
    t = grown_tree()
    assert t.advance([10, 99]) is None and len(t) == 0 and t.frontier == [-1]  # left the tree


def test_tree_caps():
    t = TokenTree(paths=4, top_k=4, depth=2, nodes=6)
    t.grow([-1], np.array([[1, 2, 3, 4]]), np.full((1, 4), 0.25))
    t.grow(t.frontier, np.arange(16).reshape(4, 4) + 20, np.full((4, 4), 0.25))
    assert len(t) == 6 and t.full()
    t = TokenTree(paths=2, top_k=2, depth=9, nodes=50, min_score=0.2)
    t.grow([-1], np.array([[1, 2]]), np.array([[0.5, 0.3]]))
    assert not t.full()
    t.grow(t.frontier, np.array([[3, 4], [5, 6]]), np.array([[0.3, 0.1], [0.5, 0.1]]))
    assert t.full()  # best path 0.5 * 0.3 = 0.15 < 0.2: not worth another pass
    with pytest.raises(CachebackError):
        make_drafter("card", draft="self:1", parallel=False, paths=0)


def same_tree(a, b):
    assert a.tokens == b.tokens and a.parents == b.parents and a.frontier == b.frontier
    assert np.allclose(a.scores, b.scores, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kept_tree_in_the_cache_grows_what_recomputing_the_tree_grows(family):
    """Frontier-only passes over a tree kept in the caches (ancestor slots via TreePass.tail),
    with corrections that keep a subtree, give the same tree as passing the whole tree each layer."""
    from cacheback_mlx.draft_model.runner import DraftRunner

    model = zoo.tiny_model(family)
    kept, redo = DraftRunner(model, 3, 3, 6, 30), DraftRunner(model, 3, 3, 6, 30, keep_tree=False)
    assert kept.kept and not redo.kept
    for r in (kept, redo):
        r.sync(0, PROMPT)
    for step in range(4):
        for _ in range(3):
            assert kept.expand() and redo.expand()
            same_tree(kept.tree, redo.tree)
        # accept a path of the second-best child's subtree (a correction after a rejection), or a miss
        t = kept.tree
        node = max(i for i in range(len(t)) if t.parents[i] == -1) if step % 2 else len(t) - 1
        path = [t.tokens[a] for a in reversed([node] + t.ancestors(node))]
        tail = path if step < 3 else path[:1] + [127]
        for r in (kept, redo):
            r.sync(len(r.seq), tail)
        same_tree(kept.tree, redo.tree)
    assert kept.hits == redo.hits == 3 and kept.misses == redo.misses == 1
    # the verified part of the kept caches equals a fresh prefill of the sequence
    from cacheback_mlx.kvcache import ModelCache
    from cacheback_mlx.verify import prefill

    kept.expand()  # after the miss: the accepted tokens go into the caches, then the root's layer
    assert kept.cache.length == len(kept.seq) and kept.cached == kept.seq
    fresh = ModelCache(model)
    prefill(model, fresh, kept.seq)
    n = len(kept.seq)
    assert np.allclose(np.array(kept.cache.kv[0].keys[..., :n, :]), np.array(fresh.kv[0].keys[..., :n, :]), atol=1e-4)


# --- lossless, sequential (in-process) -------------------------------------------------------

def test_sequential_lossless_self_other_and_self_n(tiny_model):
    truth = plain(tiny_model)
    target = in_memory(tiny_model)
    layers = len(tiny_model.layers)
    other = tiny_llama(seed=11, vocab=tiny_model.args.vocab_size, layers=2, hidden=64)
    for draft, mat in [(target, (4.0, 9)), (in_memory(other), (1.0, 1.3)), ("self:1", (1.0, 9)),
                       (f"self:{layers}", (4.0, 9))]:
        d = CardDrafter(draft, parallel=False, target=target)
        out, eng = run(tiny_model, d)
        assert out == truth, draft
        assert mat[0] <= eng.stats.mat <= mat[1], (draft, eng.stats.mat)
        s = d.stats()
        assert s["mode"] == "sequential" and s["draft passes/target pass"] > 0
        if mat[0] >= 4:
            assert s["cache hit rate"] > 0.9 and s["tokens from cache"] > N / 2


def test_sequential_keeps_the_target_exact_across_calls_and_resets(tiny_model):
    """self:N shares the target's layers and TreePass: the target's own tree passes stay exact."""
    truth = plain(tiny_model, n=24)
    d = CardDrafter("self:1", parallel=False, target=in_memory(tiny_model))
    eng = Engine(tiny_model, eos_ids=[], drafter=d, context_length=4096, draft_budget=16)
    assert [t for s in eng.generate(PROMPT, 24) for t in s] == truth
    turn2 = PROMPT + truth + [4, 5, 6]
    assert [t for s in eng.generate(turn2, 16) for t in s] == plain(tiny_model, turn2, 16)
    eng.reset()
    assert [t for s in eng.generate(PROMPT, 24) for t in s] == truth


@pytest.mark.parametrize("family,n", [("mistral", 2), ("gemma3_text", 3), ("qwen3_next", 2), ("mamba", 1)])
def test_sequential_lossless_on_sliding_and_recurrent_families(family, n):
    """n: the fewest layers the family runs with (mlx-lm reads the first full-attention layer's cache)."""
    model = zoo.tiny_model(family)
    truth = plain(model, n=32)
    for draft in [in_memory(model), f"self:{n}"]:
        d = CardDrafter(draft, parallel=False, target=in_memory(model))
        out, eng = run(model, d, n=32)
        assert out == truth, (family, draft)
        if family in zoo.HYBRID:
            assert d.chain and eng.max_branching == 1
    assert eng.stats.passes < 32  # the self:N draft was accepted at least once


def test_self_n_that_breaks_the_family_is_a_one_line_error():
    model = zoo.tiny_model("mistral")  # S F S: its first layer alone has no full-attention layer
    with pytest.raises(CachebackError, match="self:1 does not work"):
        CardDrafter("self:1", parallel=False, target=in_memory(model))


# --- parallel: a draft process ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("card")
    paths = {"target": folder / "target.gguf", "other": folder / "other.gguf", "fim": folder / "fim.gguf"}
    write_tiny_gguf(paths["target"], context=4096, layers=3, seed=0)
    write_tiny_gguf(paths["other"], context=4096, layers=2, seed=1)
    write_tiny_gguf(paths["fim"], context=4096, layers=2, seed=2, fim=True)  # another vocabulary
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def target(ggufs):
    return load(ggufs["target"])


def card(target, **kw):
    return make_drafter("card", fingerprint=vocab_fingerprint(target.tokenizer), target=target, **kw)


@SERIAL
def test_parallel_lossless_and_clean_close(ggufs, target):
    truth = plain(target.model)
    for draft, lo, hi in [(ggufs["target"], 1.5, 9), (ggufs["other"], 1.0, 1.3), ("self:2", 1.0, 9)]:
        # wait_ms: after a miss, wait for the draft process's first layer (bounded): near-perfect
        # drafts then give >= 2 tokens per pass whatever the timing
        d = card(target, draft=draft, wait_ms=5000)
        pid = d.proc.pid
        assert not gone(pid)
        out, eng = run(target.model, d)
        assert out == truth, draft
        assert lo <= eng.stats.mat <= hi, (draft, eng.stats.mat)
        assert d.stats()["mode"] == "parallel" and d.stats()["draft passes/target pass"] > 0
        d.close()
        assert wait_gone(pid, 10)


@SERIAL
def test_parallel_sequence_edits_and_reset(ggufs, target):
    d = card(target, draft=ggufs["target"], wait_ms=5000)
    eng = Engine(target.model, eos_ids=[], drafter=d, context_length=4096, draft_budget=7)
    assert [t for s in eng.generate(PROMPT, 16) for t in s] == plain(target.model, n=16)
    edited = PROMPT[:4] + [9, 9, 1]
    assert [t for s in eng.generate(edited, 16) for t in s] == plain(target.model, edited, 16)
    eng.reset()
    assert [t for s in eng.generate(PROMPT, 16) for t in s] == plain(target.model, n=16)
    assert eng.stats.mat > 1.5
    d.close()


@SERIAL
def test_killed_draft_process_degrades_to_plain_decoding_with_one_warning(ggufs, target, capsys):
    d = card(target, draft="self:2", wait_ms=5000)
    truth = plain(target.model)
    eng = Engine(target.model, eos_ids=[], drafter=d, context_length=4096, draft_budget=7)
    steps = eng.generate(PROMPT, N)
    out = next(steps)
    os.kill(d.proc.pid, signal.SIGKILL)
    assert wait_gone(d.proc.pid, 10)
    out += [t for s in steps for t in s]
    assert out == truth
    t0 = time.monotonic()
    again = [t for s in eng.generate(PROMPT + truth, 8) for t in s]  # the next call does not hang
    assert again == plain(target.model, PROMPT + truth, 8) and time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert err.count("CARD draft process stopped") == 1, err
    assert "stopped" in d.stats()["draft process"]
    d.close()


def save_zoo_folder(family, path):
    """A zoo model as an mlx-lm model folder (weights, config, a word-level tokenizer), so that a
    draft process can load it."""
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    save_model(path, zoo.tiny_model(family))
    save_config(dict(zoo.FAMILIES[family]), path / "config.json")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(zoo.VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0").save_pretrained(path)
    return str(path)


@SERIAL
@pytest.mark.parametrize("family", ["mistral", "qwen3_next"])
def test_parallel_lossless_on_a_sliding_and_a_hybrid_family(family, tmp_path):
    """The draft process runs a windowed model (the tree recomputed each layer) and a hybrid one
    (recurrent layers: chains; the engine asks for chains too)."""
    folder = save_zoo_folder(family, tmp_path / family)
    target = load(folder)
    truth = plain(target.model, n=32)
    for draft in [folder, "self:2"]:
        d = card(target, draft=draft, wait_ms=5000)
        out, eng = run(target.model, d, n=32)
        assert out == truth, (family, draft)
        assert d.chain == (family in zoo.HYBRID)
        if draft == folder:
            assert eng.stats.mat >= 1.5, eng.stats.mat
        d.close()


SCRIPT = """
import sys
from cacheback_mlx.api import Session

def main():
    s = Session({model!r}, "card", draft="self:1", fixed_budget=True)
    print(s.engine.drafter.proc.pid, flush=True)
    n = 0
    while {forever}:
        s.reset()
        n += len(list(s.stream_ids([5, 17, 3, 42], 64)))
        print("step", n, flush=True)
    list(s.stream_ids([5, 17, 3, 42], 16))

main()  # no __main__ guard: the draft process must not re-run the user's script
"""


def start_script(tmp_path, model, forever):
    path = tmp_path / "run.py"
    path.write_text(textwrap.dedent(SCRIPT.format(model=model, forever=forever)))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    return proc, pid


@SERIAL
def test_no_orphan_after_normal_exit(tmp_path, ggufs):
    proc, child = start_script(tmp_path, ggufs["target"], False)
    assert proc.wait(120) == 0, proc.stderr.read()
    assert wait_gone(child), "draft process left behind"


@SERIAL
def test_no_orphan_after_ctrl_c(tmp_path, ggufs):
    proc, child = start_script(tmp_path, ggufs["target"], True)
    assert proc.stdout.readline().startswith("step")  # generating, draft process running
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) != 0
    assert "KeyboardInterrupt" in proc.stderr.read()
    assert wait_gone(child), "draft process left behind"


@SERIAL
def test_no_orphan_when_the_parent_is_killed(tmp_path, ggufs):
    proc, child = start_script(tmp_path, ggufs["target"], True)
    assert proc.stdout.readline().startswith("step")
    proc.kill()
    proc.wait(60)
    assert wait_gone(child), "draft process outlived its killed parent"


# --- bad input -------------------------------------------------------------------------------

@SERIAL
@pytest.mark.parametrize("parallel", [False, True])
def test_bad_draft_specs_are_one_line_errors(ggufs, target, tmp_path, parallel):
    cases = [(str(tmp_path / "missing.gguf"), "not found"), (ggufs["fim"], "another tokenizer"),
             ("self:0", "choose N from 1 to 3"), ("self:4", "choose N from 1 to 3"), ("self:x", "self:N"),
             ("self", "self:N")]
    for draft, needle in cases:
        with pytest.raises(CachebackError) as e:
            card(target, draft=draft, parallel=parallel)
        assert needle in str(e.value) and "\n" not in str(e.value), (draft, str(e.value))
    with pytest.raises(CachebackError, match="needs a draft model"):
        card(target, parallel=parallel)


@SERIAL
def test_cli_card_generate_stats_and_errors(ggufs):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cacheback_mlx.cli", "generate", "hello",
                               "--model", ggufs["target"],
                               "--raw", "-n", "12", "--fixed-budget", "--drafter", "card", *args],
                              capture_output=True, text=True, timeout=300)

    r = cli("--drafter-arg", "draft=self:2", "--stats")
    assert r.returncode == 0, r.stderr
    assert "[card] mode parallel" in r.stderr and "cache hit rate" in r.stderr
    r = cli("--drafter-arg", "draft=self:2", "--drafter-arg", "parallel=false", "--stats")
    assert r.returncode == 0 and "mode sequential" in r.stderr, r.stderr
    doctor = subprocess.run([sys.executable, "-m", "cacheback_mlx.cli", "doctor", "--model", ggufs["target"],
                             "--drafter",
                             "card", "--drafter-arg", "draft=self:2"], capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 0 and "drafter card: 16 tokens" in doctor.stdout, doctor.stderr
    assert "draft passes/target pass" in doctor.stdout and "cache hit rate" in doctor.stdout
    # the errors in this process (a process of their own would only add its start-up)
    from cacheback_mlx.cli import main

    from click.testing import CliRunner

    for args, needle in [(("--drafter-arg", "draft=self:9"), "choose N from 1 to 3"),
                         (("--drafter-arg", f"draft={ggufs['fim']}"), "another tokenizer"),
                         ((), "needs a draft model")]:
        r = CliRunner().invoke(main, ["generate", "hello", "--model", str(ggufs["target"]), "--raw", "-n", "12",
                                      "--fixed-budget", "--drafter", "card", *args])
        err = r.stderr.strip()
        assert r.exit_code == 1 and err.startswith("error: ") and "\n" not in err and needle in err, err


# --- the real default model ------------------------------------------------------------------

@SERIAL
@pytest.mark.slow
def test_default_model_self_n_lossless(default_model):
    """In a draft process (in this one: test_default_model.py, and the stats on tiny models above)."""
    prompt = list(default_model.tokenizer.encode("The three primary colors are red, yellow and"))
    truth = plain(default_model.model, prompt, 20)
    d = make_drafter("card", fingerprint=vocab_fingerprint(default_model.tokenizer), target=default_model,
                     draft="self:8", parallel=True, wait_ms=5000)
    out, eng = run(default_model.model, d, prompt, 20)
    assert out == truth
    assert eng.stats.mat > 1.0 and d.stats()["tokens from cache"] > 0
    d.close()
