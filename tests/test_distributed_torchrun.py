"""The torchrun story: the distributed examples on 2 gloo processes, resumed or compared on 1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _torchrun(nproc: int, *args: str, example: str = "distributed_train.py",
              tmpdir: Path | None = None) -> str:
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="")
    if tmpdir is not None:  # the examples' temporary files go there
        env["TMPDIR"] = str(tmpdir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", str(EXAMPLES / example), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow  # two torchrun launches, ~30 s on 2 CPU cores
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")
def test_torchrun_two_processes_then_resume_on_one(tmp_path: Path):
    out = _torchrun(2, "--epochs", "1", "--dir", str(tmp_path))
    assert "epoch 0: 32 steps of 64 on 2 gloo rank(s)" in out
    assert "replicas identical" in out
    out = _torchrun(1, "--epochs", "1", "--resume", "--dir", str(tmp_path))
    assert "epoch 1: 32 steps of 64 on 1 gloo rank(s)" in out


@pytest.mark.slow  # two torchrun launches per example, ~10 s each on 2 CPU cores
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")
@pytest.mark.parametrize(("example", "args", "expect"), [
    ("distributed_dpsgd.py", ["--steps", "20"], "read from 8 shards"),
    ("distributed_ensemble.py", ["--epochs", "1"], "epoch 0: members 8"),
    ("distributed_meta.py", ["--steps", "100", "--data", "digits-shards"], "cross-entropy"),
])
def test_shard_reading_examples_print_the_same_numbers_on_two_processes_as_on_one(
        tmp_path: Path, example: str, args: list[str], expect: str):
    outs = [_torchrun(n, *args, example=example, tmpdir=tmp_path) for n in (2, 1)]
    assert expect in outs[0]
    assert "2 gloo rank(s)" in outs[0] or "over 2 rank(s)" in outs[0]
    # the same output once the world size is masked: every printed number agrees
    masked = [re.sub(r"(over |on )[12]( gloo)? rank\(s\)", "RANKS", o) for o in outs]
    assert masked[0] == masked[1]
    left = [p.name for p in tmp_path.glob("torchfn_*") if p.is_dir()]
    assert not left, f"temporary shard directories left behind: {left}"
