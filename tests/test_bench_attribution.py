"""CPU smoke test of benchmarks/attribution.py: tiny models and sizes, one timed call per row.

Every torchfn and materialised row runs; their score matrices agree (fp32) and the float64
check of both routes is at rounding level; absent packages (kronfluence, TRAK) are recorded
as such; the markdown file starts with date, device, torch and the command.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from bench_load import load_bench


def _load():
    return load_bench("attribution")


def test_tiny_run_every_row_and_scores_agree(tmp_path: Path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    mod = _load()
    assert mod.main(["--tiny", "--device", "cpu", "--repeats", "1", "--warmup", "1",
                     "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["workload"], r["method"]): r for r in res["results"]}
    # cnn, transformer x ghost, materialized, projected, kronfluence (2), trak
    assert len(rows) == 2 * 6
    for w in ("cnn", "transformer"):
        for m in ("torchfn-ghost", "materialized"):
            r = rows[w, m]
            assert "error" not in r, r
            assert r["median_s"] > 0 and r["first_call_s"] > 0 and r["params"] > 1000
        g = rows[w, "torchfn-ghost"]
        assert g["max_rel_diff_vs_materialized"] < 1e-4, g
        assert g["fp64_max_rel_diff"] < 1e-12, g
        assert g["speedup_vs_materialized"] > 0
        assert "fallback" not in g["layers"]
        p = rows[w, "torchfn-projected"]
        assert "error" not in p, p
        assert p["proj_k"] == mod.DEFAULT_PROJ_K and p["features"] > 0 and p["exact_row"] == "torchfn-ghost"
        assert p["proj_factored"] is True and p["factored_features"] > 0
        assert p["features"] == p["projected_features"] + p["factored_features"]
        assert 0 <= p["top_m_overlap"] <= 1 and p["top_m"] == 4 and -1 <= p["spearman"] <= 1
        assert p["rel_fro_err"] < 1 and p["speedup_vs_materialized"] > 0
        assert p["stored_train_median_s"] > 0 and p["train_features_s"] > 0
        for m in ("kronfluence", "kronfluence-identity", "trak"):
            if importlib.util.find_spec(m.split("-")[0]) is None:
                assert rows[w, m]["error"].startswith("not installed"), rows[w, m]
            else:
                assert "median_s" in rows[w, m] or "installed" in rows[w, m]["error"]
    # the cost rule at these sizes: convs materialised (784 and 196 positions), dense layers ghost
    routes = rows["cnn", "torchfn-ghost"]["routes"]
    assert routes == {"9x4 T=784 S=784: materialize": 1, "36x8 T=196 S=196: materialize": 1,
                      "392x16 T=1 S=1: ghost": 1, "16x10 T=1 S=1: ghost": 1}, routes
    text = md.read_text()
    assert text.startswith("# Attribution scores")
    for needle in ("- Date: ", "- Device: cpu", "torch ", "- Command: `python benchmarks/"
                   "attribution.py --tiny", "TF32 off", "| cnn | 6,794 | torchfn-ghost | 16 |",
                   "not installed"):
        assert needle in text, needle


def test_bad_names_and_time_budget(tmp_path: Path):
    mod = _load()
    with pytest.raises(SystemExit, match=r"--methods: unknown \['ghost'\]"):
        mod.main(["--tiny", "--device", "cpu", "--methods", "ghost"])
    with pytest.raises(SystemExit, match=r"--proj-k 0,x: expected positive ints"):
        mod.main(["--tiny", "--device", "cpu", "--proj-k", "0,x"])
    out = tmp_path / "r.json"
    assert mod.main(["--tiny", "--device", "cpu", "--budget-s", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["error"].startswith("skipped: time budget") for r in rows)


def test_projected_row_with_k_above_every_dimension_is_exact(tmp_path: Path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert _load().main(["--tiny", "--device", "cpu", "--repeats", "1", "--warmup", "1",
                         "--methods", "materialized,torchfn-projected", "--proj-k", "4,100000",
                         "--proj-factored", "both", "--json", str(out), "--md", str(md)]) == 0
    rows = json.loads(out.read_text())["results"]
    for w in ("cnn", "transformer"):
        small_off, small, off, p = (r for r in rows if r["workload"] == w
                                    and r["method"] == "torchfn-projected")
        assert [r["proj_factored"] for r in (small_off, small, off, p)] == [False, True] * 2
        for r in (small_off, small):
            assert r["proj_k"] == 4 and r["max_rel_diff_vs_exact"] > 1e-3, r
        # every map projected by the identity: one feature per parameter
        assert off["factored_features"] == 0 and off["features"] == off["params"], off
        assert small_off["factored_maps"] == {} and small["factored_maps"], small
        for r in (off, p):
            assert r["proj_k"] == 100000 and r["exact_row"] == "materialized", r
            assert r["max_rel_diff_vs_exact"] < 1e-4, r
            assert r["spearman"] > 0.999 and r["top_m_overlap"] == 1, r
        # the rank-one dense layers are stored as d_in + 1 + d_out numbers, not d_out (d_in + 1)
        assert p["features"] < p["params"] and p["factored_features"] > 0, p
    cnn = next(r for r in rows if r["workload"] == "cnn" and r.get("proj_k") == 4
               and r["proj_factored"])
    assert cnn["factored_maps"] == {"fc1#0": "393+16", "fc2#0": "17+10"}, cnn
    assert "| cnn | 6,794 | torchfn-projected | 16 |" in md.read_text()
