"""examples/mislabel_digits.py runs end to end in its smoke mode and finds flipped labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mislabel_digits.py"


def test_mislabel_example_smoke(tmp_path: Path):
    # synthetic blobs: scikit-learn (the `examples` extra) is optional here
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="", TORCHFN_PROGRESS="0")
    cmd = [sys.executable, str(EXAMPLE), "--smoke", "--data", "synthetic", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    res = json.loads((tmp_path / "mislabel_digits.json").read_text())
    rows = {r["score"]: r for r in res["rows"]}
    assert list(rows) == ["ekfac", "tracin", "grad_norm", "loss"]
    assert res["n_flipped"] == round(0.05 * res["n_train"])
    assert res["random_hits_k"] == res["n_flipped"] ** 2 / res["n_train"]
    for name in ("ekfac", "tracin"):  # far above a random ranking's expected count
        assert rows[name]["hits_k"] >= max(3 * res["random_hits_k"], res["n_flipped"] / 2), (
            name, rows[name], res["random_hits_k"])
        assert rows[name]["hits_k"] <= rows[name]["hits_2k"] <= res["n_flipped"]
