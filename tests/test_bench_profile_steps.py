"""benchmarks/profile_steps.py: profile_step's tables and gzipped traces of the MAML and DP
steps (CPU sizes)."""

from __future__ import annotations

import gzip
import json

from bench_load import load_bench


def test_tables_show_the_steps_parts_and_traces_open(tmp_path):
    script = load_bench("profile_steps")
    md = tmp_path / "p.md"
    assert script.main(["--device", "cpu", "--steps", "1", "--warmup", "1", "--md", str(md)]) == 0
    text = md.read_text()
    # the eager steps' named parts, as profile_step reports them
    for part in ("torchfn.inner_loop", "torchfn.outer_grad", "torchfn.ghost_pass",
                 "torchfn.noise", "torchfn.optimizer"):
        assert part in text, part
    for name in ("maml", "dp"):
        trace = tmp_path / f"p-{name}-trace.json.gz"
        assert f"Trace: `{trace.name}`" in text
        with gzip.open(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("name") == "torchfn.optimizer" for e in events)
