"""examples/dp_clipping_digits.py runs end to end in its smoke mode and reports what it claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dp_clipping_digits.py"


def test_dp_clipping_example_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="", TORCHFN_PROGRESS="0")
    cmd = [sys.executable, str(EXAMPLE), "--smoke", "--epsilon", "3", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    res = json.loads((tmp_path / "dp_clipping_digits.json").read_text())
    rows = {r["setting"]: r for r in res["rows"]}
    assert list(rows) == ["fixed C=1", "fixed C=0.1", "adaptive (C_0=0.1, median)",
                          "adaptive (C_0=0.1, q=0.1)", "adaptive normalised (C_0=0.1, median)",
                          "adaptive normalised (C_0=0.1, median, sigma_b=qN/5)",
                          "automatic C=1"]
    for r in rows.values():  # every setting spent the target epsilon, within 1%
        assert abs(r["epsilon"] - 3.0) < 0.03
        assert 0.0 <= r["test_accuracy"] <= 1.0
    adaptive = rows["adaptive (C_0=0.1, median)"]
    # the count is paid for by a raised gradient noise; the threshold moved from C_0
    assert adaptive["grad_noise_multiplier"] > res["sigma"] == rows["fixed C=1"][
        "grad_noise_multiplier"]
    assert adaptive["final_clip_norm"] != 0.1 and adaptive["final_clip_norm"] > 0
    assert rows["fixed C=1"]["final_clip_norm"] is None
    # 4x the count noise spends less of the budget on the count: a smaller raise
    cheap = rows["adaptive normalised (C_0=0.1, median, sigma_b=qN/5)"]
    assert res["sigma"] < cheap["grad_noise_multiplier"] < adaptive["grad_noise_multiplier"]
    assert rows["adaptive normalised (C_0=0.1, median)"]["final_clip_norm"] != 0.1
