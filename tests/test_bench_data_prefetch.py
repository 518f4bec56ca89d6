"""CPU smoke test of benchmarks/data_prefetch.py (tiny sizes), and its GPU-gap arithmetic on
made-up profiler events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_load import load_bench

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_bench("data_prefetch", "data_prefetch")


def test_gpu_gaps_merge_overlapping_activity():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(dev, s, e):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=s, end=e))

    prof = SimpleNamespace(events=lambda: [
        ev(cuda, 10, 20), ev(cpu, 0, 100), ev(cuda, 15, 30),  # overlap: busy 10..30
        ev(cuda, 40, 50), ev(cuda, 42, 45),  # gap 10, nested interval
        ev(cuda, 55, 60),  # gap 5
    ])
    assert _module()._gpu_gaps(prof) == (15.0, 50, 5)
    assert _module()._gpu_gaps(SimpleNamespace(events=lambda: [ev(cpu, 0, 1)])) is None


def test_cpu_smoke_run(tmp_path):
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_prefetch.py"), "--device", "cpu",
         "--n", "128", "--size", "8", "--batch", "16", "--workers", "2", "--width", "4",
         "--warmup", "1", "--steps", "2", "--profile-steps", "1", "--stream-batches", "2",
         "--json", str(out), "--md", str(md)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["rows"]] == ["resident", "plain", "pinned", "prefetch",
                                                "pinned+prefetch"]
    for r in res["rows"]:
        assert r["step_ms"] > 0 and r["idle_fraction"] is None and r["last_loss"] > 0
        assert r["vs_resident"] > 0
    assert res["rows"][0]["vs_resident"] == 1.0 and res["stream_alone"]["plain"] > 0
    # the same batches in the same order reach the model in every stream mode: the same loss
    assert len({r["last_loss"] for r in res["rows"][1:]}) == 1
    text = md.read_text()
    assert "| prefetch |" in text and "Command: `python benchmarks/data_prefetch.py" in text
    assert "| resident |" in text and "Stream alone (no model): plain" in text
