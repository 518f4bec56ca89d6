"""`torchfn demo` runs end to end and its checks hold."""

from __future__ import annotations

import pytest

from torchfn._demo import run_demo


def test_demo_runs_and_checks_hold(capsys):
    out = run_demo(steps=20)
    printed = capsys.readouterr().out
    assert "BITWISE IDENTICAL" in printed
    assert printed.count("compiling the train step (first call; this can take minutes)...") == 1
    assert printed.count("compiled the train step in ") == 1 and "recompil" not in printed
    assert out["compiles"] == 1.0
    assert out["max_diff"] < 1e-4  # compiled vs eager params, float32
    assert out["per_sample_err"] < 1e-5
    assert out["hutchinson_rel_err"] < 0.3
    assert out["test_accuracy"] > 0.5  # 3 classes: well above chance after 20 steps


def test_demo_rejects_odd_steps():
    with pytest.raises(ValueError, match="`steps` must be an even number"):
        run_demo(steps=3)
