"""CPU smoke test of benchmarks/meta_breadth.py without JAX (CI has none).

The torch side builds and times every eager row (iMAML at two K, ProtoNet), the JAX rows are
recorded as skipped when the interpreter has no jax (or agree when it has), the weights and
tasks survive the .npz round trip to the JAX twin, a JAX output file is read back into a
gradient comparison, and a tolerance violation fails the run.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from bench_load import BENCH, load_bench


def _load():
    return load_bench("meta_breadth")


SMALL = ["--small", "--dtype", "float64", "--inner-steps", "1,2", "--repeats", "1",
         "--warmup", "1", "--imaml-variants", "eager,jax", "--protonet-variants", "eager,jax",
         "--jax-python", sys.executable]


def test_small_eager_rows_run_and_files_are_written(tmp_path: Path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert _load().main([*SMALL, "--out", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["algo"], r["inner_steps"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {("imaml", 1, "eager"), ("imaml", 1, "jax"), ("imaml", 2, "eager"),
                         ("imaml", 2, "jax"), ("protonet", None, "eager"),
                         ("protonet", None, "jax")}
    for key, r in rows.items():
        if key[2] == "eager":
            assert r["ok"] and r["rel_diff_vs_eager"] == 0.0 and r["median_s"] > 0
            assert np.isfinite(r["loss"])
        elif "skipped" in r:  # no jax in this interpreter
            assert "jax is not importable" in r["skipped"]
        else:
            assert r["ok"] and r["rel_diff_vs_eager"] < 1e-9
    # iMAML with more inner steps adapts further: a different query loss
    assert rows["imaml", 1, "eager"]["loss"] != rows["imaml", 2, "eager"]["loss"]
    text = md.read_text()
    assert text.startswith("# iMAML and ProtoNet outer steps")
    assert "| imaml | 2 | eager |" in text and "| protonet |  | eager |" in text


def test_a_difference_above_tol_fails_the_run(tmp_path: Path):
    out = tmp_path / "r.json"
    args = [*SMALL, "--algos", "protonet", "--protonet-variants", "eager", "--tol", "-1",
            "--out", str(out)]
    assert _load().main(args) == 1
    res = json.loads(out.read_text())
    assert res["mismatches"] == ["protonet eager"] and res["rows"][0]["ok"] is False


def test_a_compiled_row_that_does_not_fit_the_budget_is_skipped_not_run(tmp_path: Path):
    out = tmp_path / "r.json"
    args = [*SMALL, "--algos", "imaml", "--inner-steps", "1", "--imaml-variants",
            "eager,compiled-unfold", "--compiled-steps", "1", "--budget-s", "10", "--imaml-compile-estimate-s", "60",
            "--out", str(out)]
    assert _load().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager", "compiled-unfold"]
    assert rows[1]["skipped"].startswith("budget: ") and "> --budget-s 10" in rows[1]["skipped"]
    assert "median_s" not in rows[1]


def test_npz_round_trip_and_jax_output_comparison(tmp_path: Path):
    mb = _load()
    from meta import make_tasks, max_rel_diff

    net = mb.embed_net(4, 5, 16).double()
    names = [k for k, _ in net.named_parameters()]
    assert names == [k for k, _ in mb.conv_net(4, 5, 16).named_parameters()][:-2]  # no head
    tasks = make_tasks(2, 5, 1, 3, 16, torch.device("cpu"), torch.float64)
    mb.write_jax_input(str(tmp_path / "in.npz"), net, tasks, {"algo": "protonet", "lam": 2.0})
    data = dict(np.load(tmp_path / "in.npz"))
    assert str(data["algo"]) == "protonet" and float(data["lam"]) == 2.0
    for k, v in net.named_parameters():
        np.testing.assert_array_equal(data[f"param:{k}"], v.detach().numpy())
    np.testing.assert_array_equal(data["query_y"], tasks.query_y.numpy())
    assert data["support_x"].dtype == np.float64

    want = {k: torch.randn_like(v) for k, v in net.named_parameters()}
    grads = {f"grad:{k}": v.numpy() for k, v in want.items()}
    np.savez(tmp_path / "out.npz", loss=np.float64(1.5), times_s=np.array([0.1, 0.3]),
             median_s=0.2, compile_s=4.0, peak_bytes=-1, device="cpu:cpu", jax_version="0.x",
             **grads)
    rec = mb.read_jax_output(str(tmp_path / "out.npz"))
    assert rec["peak_bytes"] is None and rec["loss"] == 1.5 and rec["first_call_s"] == 4.0
    assert max_rel_diff(rec["grads"], want) == 0.0
    off = dict(rec["grads"], **{names[0]: rec["grads"][names[0]] * 1.1})
    assert 0.05 < max_rel_diff(off, want) < 0.2


def test_jax_twin_imports_no_torch():
    tree = ast.parse((BENCH / "meta_breadth_jax.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in modules and "torchfn" not in modules
    assert modules <= {"__future__", "collections", "typing", "os", "statistics", "sys", "time",
                       "numpy", "jax", "meta_jax"}, modules


def test_imaml_inner_rows_run_at_every_k_after_the_eager_rows(tmp_path: Path):
    out = tmp_path / "r.json"
    args = [*SMALL, "--algos", "imaml", "--imaml-variants", "inner-unfold,eager", "--backend",
            "aot_eager", "--compiled-steps", "", "--out", str(out)]
    assert _load().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["inner_steps"], r["variant"]) for r in rows] == [
        (1, "eager"), (2, "eager"), (1, "inner-unfold"), (2, "inner-unfold")]
    for r in rows[2:]:
        assert r["ok"] and r["rel_diff_vs_eager"] < 1e-9 and r["median_s"] > 0


def test_an_inner_row_that_does_not_fit_the_budget_is_skipped_and_protonet_has_none(
        tmp_path: Path):
    out = tmp_path / "r.json"
    args = [*SMALL, "--algos", "imaml", "--inner-steps", "1", "--imaml-variants",
            "eager,inner", "--budget-s", "10", "--imaml-inner-compile-estimate-s", "60",
            "--out", str(out)]
    assert _load().main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager", "inner"]
    assert rows[1]["skipped"].startswith("budget: ") and "+ 60 s compile" in rows[1]["skipped"]
    with pytest.raises(SystemExit, match="inner variants are iMAML's"):
        _load().main([*SMALL, "--algos", "protonet", "--protonet-variants", "inner"])
