"""examples/dp_clipping_digits.py runs end to end in its smoke mode and reports what it claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dp_clipping_digits.py"


def run_example(tmp_path: Path, *extra: str) -> dict:
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="", TORCHFN_PROGRESS="0")
    cmd = [sys.executable, str(EXAMPLE), "--smoke", "--epsilon", "3", "--out", str(tmp_path),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads((tmp_path / "dp_clipping_digits.json").read_text())


def test_dp_clipping_example_smoke(tmp_path: Path) -> None:
    res = run_example(tmp_path)
    rows = {r["setting"]: r for r in res["rows"]}
    assert list(rows) == ["fixed C=1", "fixed C=0.1", "adaptive (C_0=0.1, median)",
                          "adaptive (C_0=0.1, q=0.1)", "adaptive normalised (C_0=0.1, median)",
                          "adaptive normalised (C_0=0.1, median, sigma_b=qN/5)",
                          "automatic C=1",
                          "adaptive normalised (C_0=0.1, quantile picked on validation)",
                          "adaptive normalised (C_0=0.1, median, lr picked on validation)"]
    assert res["split"] == "test" and (res["n_train"], res["n_eval"]) == (240, 60)
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
    # the row picked on validation uses the median at epsilon 3: the same run as the median row
    picked = rows["adaptive normalised (C_0=0.1, quantile picked on validation)"]
    assert picked["accuracies"] == rows["adaptive normalised (C_0=0.1, median)"]["accuracies"]
    assert picked["final_clip_norm"] == rows["adaptive normalised (C_0=0.1, median)"][
        "final_clip_norm"]
    # the learning rate picked on validation at epsilon 3 is the example's 0.5: the median run
    assert rows["adaptive normalised (C_0=0.1, median, lr picked on validation)"][
        "accuracies"] == rows["adaptive normalised (C_0=0.1, median)"]["accuracies"]
    # paired differences against fixed C=1 (same seeds), with their standard errors
    assert rows["fixed C=1"]["diff_vs_fixed_C1"] == 0.0 and "diff_se" in picked
    assert abs(picked["diff_vs_fixed_C1"] - (picked["test_accuracy"]
                                             - rows["fixed C=1"]["test_accuracy"])) < 1e-12


def test_dp_clipping_example_validation_sweep(tmp_path: Path) -> None:
    # --validation trains on 80% of the training split and evaluates on the rest (the test split
    # is not read): the quantile sweep the example's choice comes from
    res = run_example(tmp_path, "--validation")
    assert res["split"] == "validation" and (res["n_train"], res["n_eval"]) == (192, 48)
    names = [r["setting"] for r in res["rows"]]
    assert names == ["fixed C=1", "automatic C=1"] + [
        f"adaptive normalised (C_0=0.1, q={q})" for q in ("0.1", "0.15", "0.2", "0.3", "0.5")] + [
        f"adaptive normalised (C_0=0.1, median, lr {lr})" for lr in ("0.25", "0.35")] + [
        f"fixed C={c}" for c in ("0.5", "0.7", "1.5", "2")]


def test_dp_clipping_example_quantile_ramp(tmp_path: Path) -> None:
    res = run_example(tmp_path, "--quantile-ramp", "0.02,0.4", "--only",
                      "fixed C=1|adaptive normalised (C_0=0.1, ramp 0.02->0.4)")
    ramp = res["rows"][1]
    assert ramp["setting"] == "adaptive normalised (C_0=0.1, ramp 0.02->0.4)"
    assert abs(ramp["epsilon"] - 3.0) < 0.03 and ramp["final_clip_norm"] != 0.1
