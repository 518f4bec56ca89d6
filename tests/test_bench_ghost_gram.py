"""CPU smoke test of benchmarks/ghost_gram.py: the plain form is timed and checked against
float64, the fused kernel is recorded as absent off CUDA, and both files are written."""

from __future__ import annotations

import json
from pathlib import Path

from bench_load import load_bench


def test_small_run_writes_checked_rows(tmp_path: Path) -> None:
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    assert load_bench("ghost_gram").main(["--small", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["twin_ms"] > 0 and row["twin_err"] < 2e-2  # bf16 Gram entries, float64 truth
    assert "fused_ms" not in row  # no CUDA: the kernel declines
    text = md.read_text()
    assert "| small | 2 | 24 | 16 | 40 |" in text and "plain" in text
    assert res["command"].startswith("python3 benchmarks/ghost_gram.py --small")
