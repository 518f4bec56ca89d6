"""CPU smoke test of benchmarks/dp_models.py: tiny models, one timed step per row.

The script must never crash on a row: a refused layer or a missing package becomes that
row's error. The untied run checks that every torchfn row runs and that the DP step's
per-sample norms equal vmap(grad)'s (the script's own check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_load import load_bench

pytest.importorskip("transformers")
pytest.importorskip("peft")

# transformers/peft deprecation chatter, and torch's note that flash attention has no vmap
# batching rule on CPU (the vmap rows then loop; slower, same numbers)
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]
TORCHFN_ROWS = "nonprivate-eager,dpsgd-eager,torch-eager,vmap-dpsgd"


def _load(name: str = "dp_models"):
    """Import ``benchmarks/<name>.py``."""
    return load_bench(name, name)


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "r.json"
    assert _load().main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1",
                         "--json", str(out), "--md", str(tmp_path / "r.md"), *args]) == 0
    return json.loads(out.read_text())


def test_untied_every_torchfn_row_runs_and_dp_norms_equal_vmap(tmp_path: Path):
    res = _run(tmp_path, "--untie", "--variants", TORCHFN_ROWS, "--precision", "fp32,bf16")
    rows = res["results"]
    assert len(rows) == 3 * 4 * 2
    failed = [(r["workload"], r["precision"], r["variant"], r["error"]) for r in rows
              if "error" in r]
    assert not failed, failed
    for r in rows:
        assert r["median_ms"] > 0 and r["first_call_s"] > 0
    checked = [r for r in rows if r["variant"] == "dpsgd-eager" and r["precision"] == "fp32"]
    assert len(checked) == 3
    for r in checked:
        assert r["norm_max_rel_diff_vs_vmap"] < 1e-5, r
    lora = next(r for r in checked if r["workload"] == "gpt2-lora")
    full = next(r for r in checked if r["workload"] == "gpt2")
    assert 0 < lora["trained_params"] < full["trained_params"] / 4  # only the adapters train
    assert lora["layers"] == {"linear": 12}  # lora_A/lora_B of c_attn, attn and mlp c_proj
    summary = {(s["workload"], s["precision"]): s for s in res["summary"]}
    assert len(summary) == 6 and all("dp_time" in s and "vs_vmap" in s for s in summary.values())
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# DP-SGD on Hugging Face models")
    for needle in ("- Date: ", "- Device: cpu", "torch ", "- Command: `python benchmarks/dp_models.py",
                   "--untie", "TF32 off", "| gpt2-lora | 2 | bf16 | dpsgd-eager |"):
        assert needle in md, needle


def test_default_tied_gpt2_records_each_row_and_goes_on(tmp_path: Path):
    res = _run(tmp_path, "--workloads", "gpt2,vit", "--precision", "fp32",
               "--variants", "nonprivate-eager,dpsgd-eager,opacus-hooks,opacus-ghost,"
                             "dpsgd-graphed")
    rows = {(r["workload"], r["variant"]): r for r in res["results"]}
    assert len(rows) == 10
    for r in rows.values():  # exactly one of: a timing or a recorded error
        assert ("median_ms" in r) != ("error" in r), r
    assert "median_ms" in rows["gpt2", "nonprivate-eager"]
    assert "median_ms" in rows["vit", "dpsgd-eager"]
    assert rows["vit", "dpsgd-graphed"]["error"].startswith("skipped: make_graphed_step")
    dp = rows["gpt2", "dpsgd-eager"]  # tied wte/lm_head: refused today, timed once supported
    if "error" in dp:
        assert "shared by layers" in dp["error"]
    else:
        assert dp["norm_max_rel_diff_vs_vmap"] < 1e-5
    try:
        import opacus  # noqa: F401
    except ImportError:
        assert rows["vit", "opacus-hooks"]["error"].startswith("ModuleNotFoundError")
    else:
        assert "median_ms" in rows["vit", "opacus-hooks"]
        assert "median_ms" in rows["vit", "opacus-ghost"]
        # Opacus ghost clipping refuses tied parameters
        assert "Parameter tying" in rows["gpt2", "opacus-ghost"].get("error", ""), rows


def test_time_budget_skips_rows_and_bad_names_are_refused(tmp_path: Path):
    res = _run(tmp_path, "--workloads", "vit", "--budget-s", "0")
    assert res["results"] and all(r["error"].startswith("skipped: time budget")
                                  for r in res["results"])
    with pytest.raises(SystemExit, match=r"--variants: unknown \['dpsgd'\]"):
        _load().main(["--tiny", "--device", "cpu", "--variants", "dpsgd"])


def test_profile_kernel_family_diff_groups_triton_indices_and_orders_by_difference():
    mod = _load("dp_models_profile")
    from torchfn.compile import OpTime

    base = [OpTime("triton_poi_fused_add_3", 2, 0.0, 0.5), OpTime("gemm", 4, 0.0, 1.0)]
    other = [OpTime("triton_poi_fused_add_7", 1, 0.0, 0.25),
             OpTime("triton_poi_fused_add_9", 3, 0.0, 0.5),
             OpTime("gemm", 4, 0.0, 1.0),
             OpTime("noise_kernel", 1, 0.0, 0.75)]
    assert mod.kernel_families(other)["triton_poi_fused_add"] == (0.75, 4)
    lines = mod.family_diff(base, other, rows=3).splitlines()
    assert lines[1].split()[0] == "+0.750" and lines[1].endswith("noise_kernel")
    assert lines[2].split()[0] == "+0.250" and lines[2].endswith("triton_poi_fused_add")
    assert lines[3].split()[0] == "+0.000" and lines[3].endswith("gemm")
    # host time where no device was profiled
    assert mod.kernel_families([OpTime("aten::mul_1", 2, 0.3, None)]) == {"aten::mul": (0.3, 2)}


def test_noise_update_script_runs_and_restores_the_library(capsys):
    """benchmarks/dp_noise_update.py: every variant builds and runs on the tiny CPU model, and
    the internals it patches are the library's own again afterwards."""
    import torchfn.persample._dp_random as R
    import torchfn.persample._dpsgd as DPS

    before = (R._pairs, DPS.DPTrainStep._noisy, DPS._noisy_sums)
    mod = _load("dp_noise_update")
    assert mod.main(["--tiny", "--rounds", "1", "--inner", "1"]) == 0
    out = capsys.readouterr().out
    for v in mod.VARIANTS:
        assert f"  {v}: built" in out and "median" in out
    assert (R._pairs, DPS.DPTrainStep._noisy, DPS._noisy_sums) == before
    with pytest.raises(ValueError, match=r"--variants: unknown 'bogus'"):
        mod.main(["--tiny", "--variants", "current,bogus"])


def test_noise_update_polynomial_and_elementwise_draws_equal_the_pair_draw():
    """dp_noise_update's ``poly`` pairs are the library's float64 draw to the last bits (and the
    same float32 values), and its elementwise form (``fused``) is the ``poly`` draw bit for bit,
    at odd starts too, eager and compiled -- the property a fused noise would rely on."""
    import torch

    import torchfn.persample._dp_random as R

    mod = _load("dp_noise_update")
    key = R.fold_in(R.key_from_seed(11), 4)
    p = torch.arange(0, 5000, dtype=torch.int32)
    # words near the quadrant and octant edges, and the extremes
    edges = torch.tensor([0, 1, 2**29 - 1, 2**29, 2**29 + 1, 2**30 - 1, 2**30, 2**31 - 1,
                          -(2**31), -1, -(2**30), -(2**29)], dtype=torch.int32)
    cos, sin = mod._turn_sincos(edges)
    theta = (edges.to(torch.int64) & 0xFFFFFFFF).to(torch.float64) * mod._TURN
    torch.testing.assert_close(cos, torch.cos(theta), rtol=0, atol=1e-15)
    torch.testing.assert_close(sin, torch.sin(theta), rtol=0, atol=1e-15)
    for dtype, atol in ((torch.float64, 5e-15), (torch.float32, 0)):
        c0, s0 = R._pairs(key, p, dtype)
        c1, s1 = mod._pairs_poly(key, p, dtype)
        torch.testing.assert_close(c1, c0, rtol=0, atol=atol)
        torch.testing.assert_close(s1, s0, rtol=0, atol=atol)
    flat = torch.stack(mod._pairs_poly(key, p, torch.float64), 1).reshape(-1)
    j = torch.arange(3, 2 * 5000, dtype=torch.int64)
    assert torch.equal(mod._normal_elementwise(key, j, torch.float64), flat[3:])
    # compiled: the same to the last bits of float64 (vector log/sqrt), the same float32 values
    compiled = torch.compile(mod._normal_elementwise, fullgraph=True)
    torch.testing.assert_close(compiled(key, j, torch.float64), flat[3:], rtol=0, atol=1e-14)
    assert torch.equal(compiled(key, j, torch.float32), flat[3:].float())
