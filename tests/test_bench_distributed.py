"""benchmarks/distributed.py's bookkeeping: the median over fresh process groups per row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_distributed",
                                                      ROOT / "benchmarks" / "distributed.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _run(ms: dict[str, float | None], tag: str) -> dict:
    bench = {name: ({"step_ms": t, "throughput": 1e3 / t, "tag": tag} if t is not None
                    else {"error": "boom"}) for name, t in ms.items()}
    return {"bench": bench, "checks": {"tag": tag}}


def test_median_run_keeps_each_rows_median_process_and_lists_all(bench):
    runs = [_run({"a": 3.0, "b": 10.0}, "r0"), _run({"a": 1.0, "b": 30.0}, "r1"),
            _run({"a": 2.0, "b": 20.0}, "r2")]
    merged = bench._median_run(runs)
    assert merged["bench"]["a"]["step_ms"] == 2.0 and merged["bench"]["a"]["tag"] == "r2"
    assert merged["bench"]["b"]["step_ms"] == 20.0 and merged["bench"]["b"]["tag"] == "r2"
    assert merged["bench"]["a"]["step_ms_processes"] == [3.0, 1.0, 2.0]
    assert merged["checks"] == {"tag": "r0"}  # checks etc. from the first group


def test_median_run_skips_failed_runs_and_takes_the_lower_of_two_middles(bench):
    runs = [_run({"a": 4.0}, "r0"), _run({"a": None}, "r1"), _run({"a": 1.0}, "r2"),
            _run({"a": 3.0}, "r3")]
    rec = bench._median_run(runs)["bench"]["a"]
    assert rec["step_ms"] == 3.0 and rec["step_ms_processes"] == [4.0, None, 1.0, 3.0]
    assert bench._median_run(runs[:1] + runs[2:3])["bench"]["a"]["step_ms"] == 1.0
    failed = bench._median_run([_run({"a": None}, "r0")])["bench"]["a"]
    assert "error" in failed and "step_ms_processes" not in failed
