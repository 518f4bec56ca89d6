"""The torchrun story: examples/distributed_train.py on 2 gloo processes, resumed on 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed_train.py"


def _torchrun(nproc: int, *args: str) -> str:
    env = dict(os.environ, TORCHFN_OPS="reference", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", str(EXAMPLE), *args]
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
