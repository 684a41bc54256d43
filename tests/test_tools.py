"""The measuring tools' own inputs (tools/): what they take, and a one-line exit on a bad one."""

import subprocess
import sys
from pathlib import Path

import click
import pytest
from tools.ab.lane_pass import parse
from tools.server_load import measured_costs, new_cache


def test_the_pass_timing_tool_places_a_layout_in_the_lanes_it_names():
    """tools.ab.lane_pass: "1x2@0,7" is two lanes of one row in the batch's lanes 0 and 7 (what
    PassPlan.segments is measured with); a layout without lanes takes the first ones."""
    assert parse("1x2@0,7") == ([1, 1], [0, 7])
    assert parse("9+1x3") == ([9, 1, 1, 1], [0, 1, 2, 3])
    for bad in ("1x2@0", "1x2@3,3", "1x2@-1,2"):
        with pytest.raises(click.BadParameter):
            parse(bad)


def test_server_load_starts_servers_with_the_costs_it_is_given_and_refuses_a_folder_without(tmp_path):
    """tools.server_load --costs DIR: each server's cache gets DIR's measured pass costs; a folder
    holding none stops the tool at once with one line, before any server runs."""
    given = tmp_path / "given" / "cacheback-mlx" / "verify-cost"
    given.mkdir(parents=True)
    (given / "abc.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    folder = new_cache(work, str(tmp_path / "given"))
    assert (work / folder / "cacheback-mlx" / "verify-cost" / "abc.json").read_text() == "{}"
    assert list((work / new_cache(work, None)).iterdir()) == []
    with pytest.raises(SystemExit, match="no measured pass costs"):
        measured_costs(str(tmp_path / "empty"))
    out = subprocess.run([sys.executable, "-m", "tools.server_load", "--costs", str(tmp_path / "empty")],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode != 0 and "no measured pass costs" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_server_load_samples_chat_seeded_for_our_servers_only(monkeypatch):
    """tools.server_load --temperature T --top-p P: every chat completion asks for them; ours with a
    seed made from the text (the same in every run), mlx-lm's server with none (it runs a seeded
    request outside its batch); greedy sends temperature 0 and no seed; infill: a one-line exit."""
    import tools.server_load as S

    sent = []

    class Answer:
        def raise_for_status(self):
            pass

        def json(self):
            return {"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 1, "prompt_tokens": 2}}

    monkeypatch.setattr(S.httpx, "post", lambda url, timeout, json: sent.append(json) or Answer())
    monkeypatch.setitem(S.SAMPLING, "temperature", 0.7)
    monkeypatch.setitem(S.SAMPLING, "top_p", 0.95)
    S.chat("http://x", "hello", 8, S.OURS)
    S.chat("http://x", "hello", 8, S.OURS)
    S.chat("http://x", "hello", 8, "/some/folder")
    assert sent[0] == sent[1] and sent[0]["temperature"] == 0.7 and sent[0]["top_p"] == 0.95
    assert isinstance(sent[0]["seed"], int) and "seed" not in sent[2] and sent[2]["temperature"] == 0.7
    monkeypatch.setitem(S.SAMPLING, "temperature", 0.0)
    S.chat("http://x", "hello", 8, S.OURS)
    assert sent[3]["temperature"] == 0.0 and "seed" not in sent[3]
    with pytest.raises(SystemExit, match="chat completions only"):
        S.main(["--kind", "infill", "--temperature", "0.7"])
    for bad in (["--temperature", "-1"], ["--temperature", "0.7", "--top-p", "1.5"]):
        with pytest.raises(SystemExit, match="--temperature must be >= 0"):
            S.main(bad)


def test_the_step_build_tool_times_the_three_steps(capsys):
    from tools.ab import step_build

    with pytest.raises(SystemExit) as done:
        step_build.main(["--cached", "16", "--rounds", "2"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(row in out for row in ("| mlx-lm's step |", "in the kernels' pass context |", "outside it |"))


def test_the_lane_simulator_runs_a_group_the_same_every_time():
    """tools.ab.lane_sim: lanes over recorded streams and a cost table, no model: every lane ends
    with its stream's tokens, the batch ends with its last lane, two runs give the same times (no
    timing and no thread decides anything), and a lane among others takes longer than alone here
    (every pass of two lanes costs more than a pass of one of them); an unknown policy is refused."""
    from cacheback_mlx.costs import CostTable

    from tools.ab.lane_sim import run

    table = CostTable({256: {r: 0.05 + 0.001 * r for r in range(1, 257)}})
    loop = [5, 6, 7, 8, 9, 10, 11, 12]
    streams = [{"prompt": loop * 4 + [40 + k], "out": (loop * 8)[k : k + 40]} for k in range(2)]
    served = [{"prompt": [1, 2, 3], "out": loop * 2}]
    first = run(streams, served, "favour=2", table, 32)
    assert first == run(streams, served, "favour=2", table, 32)
    finished, total = first
    assert all(t is not None and 0 < t <= total for t in finished) and total == max(finished)
    alone = [run([s], served, "favour=2", table, 32)[0][0] for s in streams]
    assert all(f > a for f, a in zip(finished, alone))
    assert run(streams, served, "own", table, 32)[1] > 0
    with pytest.raises(click.BadParameter, match="not a policy"):
        run(streams, served, "fair", table, 32)


def test_the_lane_simulator_refuses_a_folder_without_costs_in_one_line(tmp_path):
    """tools.ab.lane_sim --costs DIR: a folder holding no measured pass costs stops it at once
    with one line and a non-zero exit, as tools.server_load does."""
    out = subprocess.run([sys.executable, "-m", "tools.ab.lane_sim", "--costs", str(tmp_path), "--groups", "1"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode != 0 and "no measured pass costs" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
