"""CPU smoke test of benchmarks/data_sources.py: tiny sizes, one timed epoch per row.

Every row that runs delivers the same epoch as the in-memory loader (sample count, label sum,
sum of x, and sum of x.sum() * (label + 1), which pairs each sample with its label); rows
whose library is missing say "not installed"; the markdown starts with date, device, torch
and the command and marks the goals ok/MISS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_load import load_bench

ROOT = Path(__file__).resolve().parents[1]


def _installed(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def test_tiny_run_every_row_agrees(tmp_path: Path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_sources.py"), "--small", "700",
         "--large", "0", "--per-shard-small", "100", "--repeats", "1", "--json", str(out),
         "--md", str(md)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    (case,) = res["results"]
    rows = {(r["format"], r["loader"]): r for r in case["rows"]}
    base = rows["in-memory", "TensorDataset"]
    assert base["sums"]["samples"] == 700
    assert base["sums"]["label_sum"] > 0 and base["sums"]["x_label_sum"] != 0
    arrow = _installed("pyarrow")
    expected = {"tfs", "numpy", "tar"} | ({"parquet", "hf"} if arrow else set())
    streamed = {f for (f, loader), r in rows.items()
                if loader == "StreamingDataset" and r["status"] == "ok"}
    if arrow:  # Parquet also streams in file order, the like-for-like row beside iter_batches
        assert rows["parquet", "StreamingDataset shuffle=False"]["status"] == "ok"
    assert streamed == expected
    own = {"numpy": None, "tar": "webdataset", "parquet": "pyarrow", "hf": "datasets"}
    for fmt, mod in own.items():
        if fmt not in expected:
            continue
        (r,) = [r for (f, loader), r in rows.items()
                if f == fmt and not loader.startswith("StreamingDataset")]
        assert r["status"] == ("ok" if mod is None or _installed(mod) else "not installed")
    for key, r in rows.items():
        if r["status"] != "ok":
            continue
        assert r["agree"], (key, r["sums"], base["sums"])
        assert r["sums"]["samples"] == 700, key
        for k in ("label_sum", "x_sum", "x_label_sum"):
            assert abs(r["sums"][k] - base["sums"][k]) <= 1e-6 * max(1.0, abs(base["sums"][k]))
        if r["loader"] == "StreamingDataset":
            assert r["goal_vs_memory"] in ("ok", "MISS")
    assert sorted((c["source"], c["workers"]) for c in case["convert"]) == sorted(
        (s, w) for s in ({"numpy", "tar"} | ({"parquet", "hf"} if arrow else set()))
        for w in (1, 2))
    assert all(c["samples_per_s"] > 0 for c in case["convert"])
    text = md.read_text()
    assert text.startswith("# torchfn.data readers")
    for needle in ("- Date: ", "- Device: ", "torch ", "- Command: `python benchmarks/"
                   "data_sources.py --small 700", "| tfs | StreamingDataset |"):
        assert needle in text, needle


def test_agree_catches_a_mismatch():
    mod = load_bench("data_sources")
    a = {"samples": 10, "label_sum": 45.0, "x_sum": 1.5, "x_label_sum": 7.25}
    assert mod._agree(a, dict(a))
    assert not mod._agree(a, {**a, "samples": 9})
    assert not mod._agree(a, {**a, "x_label_sum": 7.5})  # a sample paired with another label
