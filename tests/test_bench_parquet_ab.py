"""CPU smoke test of benchmarks/parquet_ab.py: tiny sizes, one round.

Every loader delivers the whole epoch (the script checks each epoch's sample count and fails
otherwise); the JSON has one row per loader asked for, with positive medians.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_reports_every_loader(tmp_path: Path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "BENCH_DIR": str(tmp_path)}
    loaders = ["iter", "sd", "sdns", "sd-sync", "sdns-sync"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parquet_ab.py"), "--num", "1500",
         "--rounds", "1", "--loaders", ",".join(loaders), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["num_samples"] == 1500
    assert [r["loader"] for r in res["rows"]] == loaders
    for r in res["rows"]:
        assert r["samples_per_s"] > 0 and r["cpu_ms"] > 0 and 0 < r["first_batch_ms"] <= r["wall_ms"]


def test_unknown_loader_is_refused(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parquet_ab.py"), "--loaders", "iter,nope"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 2 and "unknown ['nope']" in proc.stderr
