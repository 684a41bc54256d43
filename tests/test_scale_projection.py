"""tools.scale_projection --cost: projections priced by a verify-cost file brought from elsewhere (a
GPU run's), without measuring here; anything but a measured table is a one-line error."""

import json
import subprocess
import sys
from pathlib import Path

from cacheback_mlx.costs import CostTable, PriorCost

ROOT = Path(__file__).parent.parent
REC = ROOT / "tools" / "data" / "streams_seed101"


def run(*args):
    return subprocess.run([sys.executable, "-m", "tools.scale_projection", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_a_cost_file_that_is_no_measured_table_is_a_one_line_error(tmp_path):
    prior = tmp_path / "prior.json"
    prior.write_text(json.dumps(PriorCost(0.01, 0.001).to_json()))
    for path, words in ((tmp_path / "absent.json", "cannot read a verify cost"), (prior, "not a measured table")):
        r = run("--model", "random:smollm2-135m:f32:layers=1", "--cost", str(path))
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_a_flat_cost_file_projects_the_mat_as_the_speedup_and_rows_take_drafter_parameters(tmp_path):
    """Passes of any rows priced as one row (a flat curve): the projected speedup is the MAT.
    "auto:budget=7:scores=false" is auto with those parameters (a fixed 7, starting from PRIOR);
    a parameter the drafter does not take is a one-line error, not silently dropped."""
    flat = CostTable({256: {r: 0.01 for r in (1, 2, 4, 8, 16, 64)}, 1024: {r: 0.01 for r in (1, 2, 4, 8, 16, 64)}})
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({**flat.to_json(), "model": "m", "device": "Device(gpu, 0)", "mlx": "0"}))
    r = run("--model", "random:smollm2-135m:f32:layers=1", "--cost", str(path), "--rows",
            "auto:budget=7,auto:budget=7:scores=false", "--max-tokens", "16", str(REC))
    assert r.returncode == 0, r.stderr
    assert f"from {path} (m, Device(gpu, 0), 0)" in r.stdout and "measured in" not in r.stdout
    rows = [row for row in (line.split("|") for line in r.stdout.splitlines())
            if row[0] == "" and len(row) > 5 and row[1].strip() == "streams_seed101"]
    assert {row[3].strip() for row in rows} == {"auto:budget=7", "auto:budget=7:scores=false"}
    assert {row[2].strip() for row in rows} == {"spec_bench", "humaneval"}
    for row in rows:
        mat, speedup = float(row[4]), float(row[5].strip().rstrip("x"))
        assert mat > 1 and abs(speedup - mat) < 0.01
    r = run("--model", "random:smollm2-135m:f32:layers=1", "--cost", str(path), "--rows", "auto:nonsense=1",
            "--max-tokens", "16", str(REC))
    assert r.returncode != 0 and "nonsense" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
