"""Building and loading torchfn's op library: cache keys, concurrent builds, fallbacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from torchfn import ops
from torchfn.ops import _build

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process state in which no build was attempted, building into an empty temp dir."""
    monkeypatch.setattr(_build, "_STATE", _build._State())
    monkeypatch.setenv("TORCHFN_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("TORCHFN_OPS", raising=False)
    return tmp_path / "build"


def test_library_name_changes_when_a_source_changes(monkeypatch, tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(_build.csrc_dir(), csrc)
    monkeypatch.setenv("TORCHFN_CSRC", str(csrc))
    compiled, hashed = _build._sources(with_cuda=False)
    before = _build._library_name(False, compiled, hashed)
    assert before == _build._library_name(False, compiled, hashed)  # deterministic
    header = csrc / "common.h"
    header.write_text(header.read_text() + "\n// an edit\n")
    assert _build._library_name(False, compiled, hashed) != before  # headers count too
    assert _build._library_name(True, compiled, hashed) != _build._library_name(
        False, compiled, hashed
    )


def test_sources_compile_cuda_files_only_with_cuda():
    cpu_only, hashed = _build._sources(with_cuda=False)
    with_cuda, _ = _build._sources(with_cuda=True)
    assert not any(p.suffix == ".cu" for p in cpu_only)
    assert any(p.suffix == ".cu" for p in with_cuda)
    assert any(p.suffix == ".cuh" for p in hashed) and any(p.suffix == ".h" for p in hashed)
    assert (REPO / "csrc").resolve() == _build.csrc_dir().resolve()


def test_no_compiler_warns_once_and_uses_the_twins(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    x = torch.randn(5)
    with pytest.warns(ops.TorchfnOpsWarning, match="no C\\+\\+ compiler found") as record:
        first = ops.leaky_relu(x, 0.1)  # tries to build: sigmoid's CPU rule never does
        second = ops.leaky_relu(x, 0.3)
    assert len(record) == 1
    torch.testing.assert_close(first, torch.nn.functional.leaky_relu(x, 0.1))
    torch.testing.assert_close(second, torch.nn.functional.leaky_relu(x, 0.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.leaky_relu(x)  # no second warning
    status = ops.ops_status()
    assert status["backend"]["cpu"] == "reference"
    assert "no C++ compiler found" in status["reason"]
    assert not fresh_state.exists() or not any(fresh_state.iterdir())


def test_kernels_mode_raises_when_the_build_is_impossible(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TORCHFN_OPS", "kernels")
    with pytest.raises(RuntimeError, match="TORCHFN_OPS=kernels but the kernels could not be "
                                           "built: no C\\+\\+ compiler found"):
        ops.leaky_relu(torch.randn(3))  # sigmoid's default CPU rule never tries the kernel


def test_reference_mode_builds_nothing(fresh_state, monkeypatch):
    monkeypatch.setenv("TORCHFN_OPS", "reference")
    x = torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(ops.sigmoid(x), torch.sigmoid(x))
    report = ops.build_ops()
    assert not report["ok"] and not fresh_state.exists()
    status = ops.ops_status()
    assert status["reason"] == "TORCHFN_OPS=reference" and status["mode"] == "reference"


def test_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHFN_OPS", "fast")
    with pytest.raises(ValueError, match="TORCHFN_OPS='fast': expected 'auto'"):
        ops.sigmoid(torch.randn(2))


def test_build_report_and_status_keys():
    status = ops.ops_status()
    assert set(status) >= {"mode", "built", "backend", "reason", "toolchain", "build_root"}
    report = ops.build_ops()
    assert set(report) >= {"ok", "library", "devices", "action", "seconds", "reason"}
    if report["ok"]:
        assert report["action"] in ("built", "loaded", "waited")
        assert ops.ops_status()["backend"]["cpu"] == "kernel"


_BUILD_SCRIPT = textwrap.dedent(
    """
    import json, time
    from torchfn import ops
    start = time.perf_counter()
    report = ops.build_ops()
    import torch
    x = torch.linspace(-3, 3, 11)
    ok = bool((torch.ops.torchfn.sigmoid(x) - torch.sigmoid(x)).abs().max() < 1e-6)
    print(json.dumps({"report": report, "correct": ok, "wall": time.perf_counter() - start}))
    """
)


def test_two_processes_build_at_once_into_a_fresh_dir(tmp_path):
    """Two processes race to build; exactly one compiles, both load the same .so.

    A stale ``lock`` file of cpp_extension's baton (what a killed build leaves) is planted
    first: the fcntl lock makes it safe to remove, so nobody hangs on it. (~10-30 s on 2 cores,
    more where CUDA sources are compiled too.)
    """
    root = tmp_path / "build"
    env = {**os.environ, "TORCHFN_BUILD_DIR": str(root), "TORCHFN_OPS": "auto"}
    compiled, hashed = _build._sources(with_cuda=_build._cuda_toolkit() is None)
    name = _build._library_name(_build._cuda_toolkit() is None, compiled, hashed)
    (root / name).mkdir(parents=True)
    (root / name / "lock").write_text("")
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT], env=env, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    results = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["report"]["ok"] and r["correct"] for r in results), results
    actions = sorted(r["report"]["action"] for r in results)
    assert actions in (["built", "waited"], ["built", "loaded"]), results
    assert results[0]["report"]["library"] == results[1]["report"]["library"]
    assert (root / name / "done").is_file()
    print("fresh build wall time (s):", [round(r["wall"], 1) for r in results])
