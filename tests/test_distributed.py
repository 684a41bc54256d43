"""--distributed: a model sharded over two local processes (ring backend on 127.0.0.1).

Each test starts its ranks itself (MLX_RANK + MLX_HOSTFILE, as mlx.launch sets them; one test goes
through mlx.launch), bounds every wait and kills what is left at teardown. Greedy output of every
drafter on the sharded model must equal single-process plain decoding with mlx-lm on the same
weights; a killed rank must end the other with a one-line error; bad setups get one-line errors.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cacheback_mlx.drafters.base import NoDrafter
from cacheback_mlx.engine import Engine
from cacheback_mlx.errors import CachebackError
from cacheback_mlx.loader import LoadedModel, load, save_folder

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import zoo

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

HERE = Path(__file__).parent
PY = sys.executable
CLI = [PY, "-m", "cacheback_mlx.cli"]
PROMPT = [5, 17, 3, 3, 42, 8, 19, 3, 42, 8] * 7  # 70 tokens: the prefill message takes two collectives
WAIT = 120  # seconds any rank may take before the test kills it and fails


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Ranks:
    """Processes started as ranks of one ring group; all are killed at teardown."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self, commands: list[list[str]], stdin: bool = False, **extra: str) -> list[subprocess.Popen]:
        hostfile = self.tmp / f"hosts-{len(self.procs)}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(len(commands))]))
        procs = []
        for rank, cmd in enumerate(commands):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), CACHEBACK_MLX_DIST_TIMEOUT="10",
                       PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra)
            procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True))
        self.procs += procs
        return procs

    def run(self, commands: list[list[str]]) -> list[tuple[int, str, str]]:
        """Start the ranks and wait for all: (exit code, stdout, stderr) per rank."""
        procs = self.start(commands)
        deadline = time.monotonic() + WAIT
        out = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"a rank did not finish in {WAIT} s: {p.args}")
            out.append((p.returncode, o, e))
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.fixture
def ranks(tmp_path):
    r = Ranks(tmp_path)
    try:
        yield r
    finally:
        r.kill()


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """Skip the module when two ring ranks cannot connect on 127.0.0.1 here."""
    r = Ranks(tmp_path_factory.mktemp("ring"))
    code = ("import mlx.core as mx; g = mx.distributed.init(strict=True); "
            "print(mx.distributed.all_sum(mx.array([1])).item())")
    try:
        results = r.run([[PY, "-c", code]] * 2)
    finally:
        r.kill()
    if any(rc != 0 or out.strip() != "2" for rc, out, _ in results):
        pytest.skip(f"the ring backend cannot connect two local ranks here: {results[0][2].strip()[-200:]}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny random llama, qwen2, qwen3_moe (MoE) and qwen3_next (recurrent + attention) models
    saved as mlx-lm folders, with a byte-level tokenizer
    (ids < 128 are single bytes, so a lowercase text prompt fits the 128-token vocabulary)."""
    from conftest import write_tiny_gguf

    d = tmp_path_factory.mktemp("models")
    write_tiny_gguf(d / "t.gguf")
    tokenizer = load(d / "t.gguf").tokenizer
    out = {}
    for family in ("llama", "qwen2", "qwen3_moe", "qwen3_next"):
        model = zoo.tiny_model(family)
        out[family] = save_folder(LoadedModel(model, tokenizer, family, "", 1024, "float32", None), d / family)
    return out


def reference(folder: Path, prompt: list[int], n: int) -> list[int]:
    """Single-process plain greedy decoding, checked against mlx-lm's generate_step."""
    loaded = load(str(folder), dtype="float32")
    eos = loaded.tokenizer.eos_token_ids
    ours = [t for step in Engine(loaded.model, eos, NoDrafter(), 1024).generate(prompt, n) for t in step]
    theirs = []
    for tok, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=n):
        if int(tok) in eos:
            break
        theirs.append(int(tok))
    assert ours == theirs
    return ours


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("[ring]")]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("family,mode", [("llama", "tensor"), ("qwen2", "tensor"), ("qwen2", "pipeline"),
                                         ("qwen3_moe", "tensor"), ("qwen3_next", "pipeline")])
def test_sharded_greedy_output_equals_single_process_plain_decoding(ring, folders, ranks, family, mode):
    n = 24
    cmd = [PY, str(HERE / "dist_driver.py"), str(folders[family]), mode, str(n), json.dumps(PROMPT)]
    (rc0, out0, err0), (rc1, out1, err1) = ranks.run([cmd, cmd])
    assert rc0 == 0 and rc1 == 0, err0[-2000:] + err1[-2000:]
    assert out1 == ""  # a follower prints nothing
    got = json.loads(out0)
    want = reference(folders[family], PROMPT, n)
    for drafter in ("none", "ngram", "cacheback", "oracle-tree", "random-trees"):
        assert got[drafter]["ids"] == want, (drafter, mode)
    turn = PROMPT + want[: n // 2] + [7, 8]
    assert got["next-turn"]["ids"] == reference(folders[family], turn, n)
    assert got["long"]["ids"] == reference(folders[family], (PROMPT * 10)[:600], 8)  # two prefill chunks
    # the sharded passes really verified several tokens at once (qwen3_next: recurrent, chains only)
    assert min(got[d]["passes"] for d in ("oracle-tree", "random-trees")) < got["none"]["passes"]
    if mode == "pipeline":  # the same floating-point ops as one process: sampling draws the same tokens
        alone = subprocess.run(cmd[:3] + ["single"] + cmd[4:], capture_output=True, text=True, timeout=WAIT, cwd=HERE)
        assert alone.returncode == 0, alone.stderr[-2000:]
        assert got["sampled"]["ids"] == json.loads(alone.stdout)["sampled"]["ids"]


def test_cli_generate_through_mlx_launch_prints_what_one_process_prints(ring, folders, tmp_path):
    """`mlx.launch -n 2 -- cacheback-mlx generate --distributed pipeline ...` on one machine."""
    args = ["generate", "--raw", "-m", str(folders["qwen2"]), "-n", "30", "hello world hello world"]
    single = subprocess.run(CLI + args + ["--drafter", "none", "--fixed-budget"], capture_output=True, text=True,
                            timeout=WAIT, cwd=HERE)
    assert single.returncode == 0, single.stderr
    launcher = Path(PY).parent / "mlx.launch"
    cmd = [str(launcher), "--hosts", "127.0.0.1", "-n", "2", "-p", str(free_ports(1)[0]), "--",
           *CLI, *args, "--drafter", "cacheback", "--distributed", "pipeline"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            cwd=HERE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    assert out == single.stdout


def chat_ranks(ranks, folder, **env: str):
    """Two chat ranks, both up: rank 0 has printed its banner and waits for input."""
    cmd = CLI + ["chat", "-m", str(folder), "--drafter", "ngram", "-n", "8", "--distributed", "tensor"]
    procs = ranks.start([cmd, cmd], stdin=True, **env)
    banner = procs[0].stdout.readline()  # the follower is in its loop once rank 0 prints this
    assert banner.startswith("cacheback-mlx chat"), (procs[0].stderr.read()[-2000:] if procs[0].poll() is not None
                                                     else banner)
    return procs


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_the_other_with_a_one_line_error(ring, folders, ranks, victim):
    """Both ranks idle (rank 0's chat waits for input): SIGKILL one; the other must notice by
    itself (rank 0's heartbeat fails or is not answered, or the follower hears nothing, for
    SILENCE s) and exit 1."""
    SILENCE = 4
    procs = chat_ranks(ranks, folders["llama"], CACHEBACK_MLX_DIST_SILENCE=str(SILENCE))
    procs[victim].kill()
    procs[victim].wait(timeout=10)
    other = procs[1 - victim]
    t0 = time.monotonic()
    try:
        other.wait(timeout=SILENCE + 30)  # stdin stays open: rank 0's chat is still waiting for input
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {1 - victim} hung after rank {victim} died")
    err = other.stderr.read()
    assert other.returncode == 1 and time.monotonic() - t0 < SILENCE + 30
    line = last_line(err)
    assert line.startswith("error: ") and ("lost a rank" in line or "gone or stuck" in line), err[-2000:]
    assert "Traceback" not in err


def test_the_watchdog_limits_from_the_environment(monkeypatch):
    from cacheback_mlx import distributed

    monkeypatch.delenv("CACHEBACK_MLX_DIST_SILENCE", raising=False)
    assert distributed.silence() == distributed.SILENCE
    monkeypatch.setenv("CACHEBACK_MLX_DIST_SILENCE", "2.5")
    assert distributed.silence() == 2.5
    for bad in ("abc", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("CACHEBACK_MLX_DIST_SILENCE", bad)
        with pytest.raises(CachebackError, match="CACHEBACK_MLX_DIST_SILENCE must be a number of seconds"):
            distributed.silence()
        monkeypatch.setenv("CACHEBACK_MLX_DIST_TIMEOUT", bad)
        with pytest.raises(CachebackError, match="CACHEBACK_MLX_DIST_TIMEOUT must be a number of seconds"):
            distributed.watch("a pass")


def test_a_model_mlx_lm_cannot_shard_that_way_is_refused_in_one_line_on_every_rank(ring, folders, ranks):
    cmd = CLI + ["generate", "--raw", "-m", str(folders["llama"]), "--distributed", "pipeline", "abc"]
    for rc, out, err in ranks.run([cmd, cmd]):
        assert rc == 1 and out == ""
        assert last_line(err) == ("error: llama: mlx-lm has no pipeline sharding for llama models; "
                                  "try --distributed tensor"), err
        assert "Traceback" not in err


def test_ranks_that_disagree_on_the_model_or_drafter_are_refused_in_one_line(ring, folders, ranks):
    base = CLI + ["generate", "--raw", "--distributed", "tensor", "abc"]
    for other in (["-m", str(folders["qwen2"]), "--drafter", "ngram"],
                  ["-m", str(folders["llama"]), "--drafter", "pld"]):
        results = ranks.run([base + ["-m", str(folders["llama"]), "--drafter", "ngram"], base + other])
        for rc, out, err in results:
            assert rc == 1 and out == ""
            line = last_line(err)
            assert line.startswith("error: ranks disagree: rank 0 has model llama") and "rank 1 has model" in line, err
            assert "Traceback" not in err


def test_tensor_sharding_needs_heads_that_split_and_pipeline_needs_a_layer_per_rank(folders):
    from cacheback_mlx.distributed import check_shardable

    from mlx_lm.utils import load_model

    lazy, _ = load_model(folders["qwen2"], lazy=True, strict=False)  # 4 heads, 2 KV heads, 2 layers
    check_shardable(lazy, "tensor", 2, "qwen2")
    check_shardable(lazy, "pipeline", 2, "qwen2")
    with pytest.raises(CachebackError, match="num_key_value_heads = 2 does not split over 4 ranks"):
        check_shardable(lazy, "tensor", 4, "qwen2")
    with pytest.raises(CachebackError, match="2 layers cannot be split over 3 ranks"):
        check_shardable(lazy, "pipeline", 3, "qwen2")


def test_distributed_without_a_launcher_or_with_a_gguf_is_a_one_line_error(folders, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    for model, want in ((str(folders["llama"]), "--distributed needs ranks started by mlx.launch"),
                        (str(tmp_path / "m.gguf"), "--distributed loads mlx-lm model folders")):
        r = subprocess.run(CLI + ["generate", "-m", model, "--distributed", "tensor", "abc"], capture_output=True,
                           text=True, timeout=WAIT, env=env, cwd=HERE)
        assert r.returncode == 1 and r.stderr.strip().startswith(f"error: {want}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(CLI + ["generate", "-m", str(folders["llama"]), "--distributed", "tensor", "abc"],
                       capture_output=True, text=True, timeout=WAIT, env={**env, "CACHEBACK_MLX_DIST_SILENCE": "soon"},
                       cwd=HERE)
    assert r.returncode == 1 and r.stderr.strip() == ("error: CACHEBACK_MLX_DIST_SILENCE must be a number of seconds "
                                                      "above 0 (got 'soon')"), r.stderr
