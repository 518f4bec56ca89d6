"""examples/fewshot_compare_digits.py runs end to end in its smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fewshot_compare_digits.py"


def test_fewshot_compare_example_smoke(tmp_path: Path):
    # synthetic blobs: scikit-learn (the `examples` extra) is optional here
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="", TORCHFN_PROGRESS="0")
    cmd = [sys.executable, str(EXAMPLE), "--smoke", "--data", "synthetic", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    res = json.loads((tmp_path / "results.json").read_text())
    assert list(res["results"]) == ["1", "5"]
    for shot, rows in res["results"].items():
        assert list(rows) == ["MAML", "MAML++", "ProtoNet", "matching net", "iMAML"], shot
        for name, r in rows.items():
            # separable blobs: every learner is well above 5-way chance (0.2)
            assert 0.3 < r["acc"] <= 1.0 and 0 < r["ci95"] < 0.2, (shot, name, r)
