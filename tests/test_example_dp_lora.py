"""examples/dp_lora_digits.py runs end to end in its smoke mode and reports what it claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dp_lora_digits.py"


def test_dp_lora_example_smoke(tmp_path: Path):
    # the generated stand-in data: scikit-learn (the `examples` extra) is optional here
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="", TORCHFN_PROGRESS="0",
               PYTHONWARNINGS="ignore::FutureWarning")
    cmd = [sys.executable, str(EXAMPLE), "--smoke", "--data", "synthetic", "--epsilons", "1,8",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "1) pretraining a tiny ViT" in proc.stdout
    res = json.loads((tmp_path / "dp_lora_digits.json").read_text())
    rows = {r["setting"]: r for r in res["rows"]}
    assert list(rows) == ["DP LoRA, eps=1", "DP LoRA, eps=8", "non-private LoRA",
                          "DP LoRA, eps=8, no pretraining"]
    for target in (1, 8):  # the accountant spent what was asked, within 1%
        assert abs(rows[f"DP LoRA, eps={target}"]["epsilon"] - target) < 0.01 * target
    assert rows["DP LoRA, eps=1"]["sigma"] > rows["DP LoRA, eps=8"]["sigma"] > 0
    assert rows["non-private LoRA"]["epsilon"] is None
    for r in rows.values():
        assert 0.0 <= r["test_accuracy"] <= 1.0
    # only the adapters and the new head train: far fewer than the ViT's ~60k parameters
    assert 0 < res["trained_params"] < 5000
