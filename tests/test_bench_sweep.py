"""CPU smoke test of benchmarks/sweep.py (the torchfn-vs-JAX sweep) without a GPU.

The first config of each family runs end to end on its torchfn side (its own process, eager
steps at ``--small`` sizes: the compiled recipes are the GPU run's), the JAX side is recorded
as skipped when this interpreter has no jax (or timed when it has), and the JSON / markdown
files have the structure the lead's GPU run reports from. A budget too small for anything
records every config as skipped; ``--merge`` combines result files.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from bench_load import load_bench


def _load():
    return load_bench("sweep")


def test_six_configs_per_family():
    sweep = _load()
    assert set(sweep.CONFIGS) == {"maml", "ensembles", "dp"}
    for family, cfgs in sweep.CONFIGS.items():
        assert len(cfgs) >= 6 and len({c["name"] for c in cfgs}) == len(cfgs), family
        for cfg in cfgs:  # the smoke sizes keep every config's shape of the work
            assert sweep.shrink(family, cfg)["name"] == cfg["name"]


def test_small_torchfn_side_runs_and_files_have_their_structure(tmp_path: Path):
    sweep = _load()
    out, md = tmp_path / "sweep.json", tmp_path / "sweep.md"
    assert sweep.main(["--small", "--configs", "0", "--jobs", "2", "--repeats", "2",
                       "--warmup", "1", "--jax-python", sys.executable, "--out", str(out),
                       "--md", str(md), "--plot", str(tmp_path / "sweep.png")]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["small"] and res["meta"]["tf32"]["torch.backends.cudnn.allow_tf32"] is False
    rows = {(r["family"], r["config"]): r for r in res["rows"]}
    assert set(rows) == {("maml", "5w1s-c32-k1"), ("ensembles", "n8-w256-adam"),
                         ("dp", "mlp-b256")}
    for (family, _), row in rows.items():
        t = row["torchfn"]
        assert t["median_ms"] > 0 and t["first_call_s"] > 0 and t["repeats"] == 2, row
        assert "(eager)" in t["recipe"] or family == "maml"
        if family != "ensembles":
            assert math.isfinite(t["loss"])
        j = row["jax"]
        if "skipped" in j:
            assert "jax not installed" in j["skipped"] and row["ratio"] is None
        else:  # jax here: same weights and batch, same first loss
            assert row["ratio"] == j["median_ms"] / t["median_ms"]
            if family != "ensembles":
                assert row["loss_rel_diff"] < 1e-4
    text = md.read_text()
    assert text.startswith("# Sweep: torchfn default steps vs JAX")
    assert "| family | config | torchfn ms | JAX ms | JAX / torchfn |" in text
    assert "| maml | 5w1s-c32-k1 |" in text and "| dp | mlp-b256 |" in text


def test_budget_too_small_skips_everything_and_merge(tmp_path: Path):
    sweep = _load()
    out = tmp_path / "a.json"
    assert sweep.main(["--small", "--families", "maml,dp", "--configs", "1,5", "--no-jax",
                       "--budget-s", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["family"], r["config"]) for r in res["rows"]] == [
        ("maml", "5w5s-c32-k1"), ("maml", "5w1s-c64-k5"), ("dp", "mlp-b1024"),
        ("dp", "tfm4-d256-b64")]
    assert all("budget" in r["torchfn"]["skipped"] for r in res["rows"])
    # a second run (fake: one timed row) replaces the first's row in the merge
    row = {"family": "dp", "config": "mlp-b1024", "params": {},
           "torchfn": {"median_ms": 2.0, "first_call_s": 1.0, "peak_bytes": 2**20},
           "jax": {"median_ms": 3.0, "first_call_s": 1.0, "peak_bytes": 2**21}}
    sweep.add_ratio(row)
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"meta": {**res["meta"], "command": "second", "device": "GPU B",
                                      "date": "2026-01-02 03:04"}, "rows": [row]}))
    merged = tmp_path / "m.md"
    assert sweep.main(["--merge", str(out), str(b), "--md", str(merged)]) == 0
    text = merged.read_text()
    assert "| dp | mlp-b1024 | 2.000 | 3.000 | **1.50** | 1.0 / 1.0 | 1 / 2 |" in text
    assert "1 of 1 timed configs (4 selected)" in text
    # rows from runs on different machines: each names its run, the title both devices
    assert "| - | GPU B, 2026-01-02 03:04 |" in text
    first = res["meta"].get("device", "?")  # no device in a CPU run's meta
    assert f"| - | {first}, {res['meta']['date']} |" in text
    assert f"({' / '.join(sorted([first, 'GPU B']))})" in text


def test_a_first_call_out_of_memory_is_retried_alone(tmp_path: Path, monkeypatch, capsys):
    # on the GPU, configs compiling side by side can exhaust its memory together (seen: two
    # MAML configs beside five processes holding 50 GiB); such a config gets one more try
    # with nothing else compiling, instead of an error row
    sweep = _load()
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("TORCHFN_SWEEP_TEST_OOM", str(marks))
    out = tmp_path / "o.json"
    assert sweep.main(["--small", "--families", "dp", "--configs", "0,1", "--no-jax",
                       "--jobs", "2", "--repeats", "2", "--warmup", "1",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["torchfn"]["median_ms"] > 0 for r in res["rows"]] == [True, True], res["rows"]
    assert sorted(p.name for p in marks.iterdir()) == ["dp_mlp-b1024_torchfn",
                                                       "dp_mlp-b256_torchfn"]
    printed = capsys.readouterr().out
    assert printed.count("will be retried alone") == 2
