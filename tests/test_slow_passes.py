"""tools/slow_passes.py: the passes of a bench JSON that stalled."""

import json

from tools import slow_passes


def test_a_stalled_pass_is_found_by_its_row_count(tmp_path, capsys):
    runs = [{"prompt": "a", "drafter": "none", "pass_log": [[1, 0, 10 + i, 8.0] for i in range(20)]},
            {"prompt": "b", "drafter": "auto", "pass_log": [[1, 0, 30, 8.5], [8, 7, 31, 24.0], [8, 7, 39, 23.0],
                                                             [8, 7, 47, 900.0], [1, 0, 55, 60.0]]},
            {"prompt": "b", "drafter": "mlx-lm", "pass_log": []}]
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"meta": {}, "summary": {}, "runs": runs}))
    found = slow_passes.slow([r for r in runs if r["pass_log"]], 5.0)
    assert [(r["prompt"], bad) for r, bad in found] == [("b", [[8, 7, 47, 900.0], [1, 0, 55, 60.0]])]
    assert slow_passes.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "b auto: 5 passes" in out and "900.00 ms  rows   8  drafts   7  cached 47" in out
    assert "median ms of a pass by rows: 1: 8.00, 8: 24.00" in out
    path.write_text(json.dumps({"meta": {}, "summary": {}, "runs": [runs[2]]}))
    assert slow_passes.main([str(path)]) == 1
