"""compile_step announces and times each compile; enable_compile_cache makes a second process
start warm; save/load_compile_cache move the artifacts as one file."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from torchfn.compile import (
    CompiledStep,
    compile_step,
    enable_compile_cache,
    load_compile_cache,
)
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import adam

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train_step():
    def model_fn(params, buffers, x):
        return torch.tanh(x @ params["w"]) @ params["v"], buffers

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    opt = adam(0.1)  # torchopt's momentum sgd recompiles at call 2 (a Python first_call flag)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 8, generator=gen, dtype=torch.float64),
              "v": torch.randn(8, 1, generator=gen, dtype=torch.float64)}
    state = init_train_state(params, {}, opt, seed=0)
    batches = [(torch.randn(16, 4, generator=gen, dtype=torch.float64),
                torch.randn(16, 1, generator=gen, dtype=torch.float64)) for _ in range(3)]
    return make_train_step(model_fn, loss_fn, opt), state, batches


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torchfn.compile"]


def test_first_call_is_announced_and_timed_once_and_numbers_equal_eager(caplog) -> None:
    step, state, batches = _train_step()
    cstep = compile_step(step, name="train step", backend="aot_eager")
    assert isinstance(cstep, CompiledStep) and cstep.__wrapped__ is step
    caplog.set_level(logging.INFO, logger="torchfn.compile")
    cstate, estate = state, state
    cstate, cm = cstep(cstate, batches[0])
    first = _messages(caplog)
    assert first[0] == "compiling train step (first call; this can take minutes)..."
    assert len(first) == 2 and first[1].startswith("compiled train step in ")
    assert first[1].endswith(" s") and float(first[1].split()[-2]) >= 0
    assert len(cstep.compile_seconds) == 1
    caplog.clear()
    for b in batches[1:]:
        cstate, cm = cstep(cstate, b)
    assert _messages(caplog) == []
    for b in batches:
        estate, em = step(estate, b)
    for k in estate.params:
        torch.testing.assert_close(cstate.params[k], estate.params[k], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cm["loss"], em["loss"], rtol=1e-12, atol=1e-12)


def test_a_recompile_is_announced_with_its_call_number() -> None:
    said: list[str] = []
    cstep = compile_step(lambda x: torch.sin(x) * 2, name="f", log=said.append,
                         backend="eager", dynamic=False)
    x = torch.randn(3)
    torch.testing.assert_close(cstep(x), torch.sin(x) * 2)
    cstep(x)
    assert len(said) == 2
    y = torch.randn(5)
    torch.testing.assert_close(cstep(y), torch.sin(y) * 2)
    assert said[2] == ("recompiling f (call 3: an input's shape, dtype or a guarded value "
                       "changed)...")
    assert said[3].startswith("recompiled f in ") and len(said) == 4
    assert len(cstep.compile_seconds) == 2


def test_silent_logging_and_a_failed_compile_leave_no_callback_behind() -> None:
    cstep = compile_step(lambda x: x + 1, log=None, backend="eager")
    assert torch.equal(cstep(torch.ones(2)), torch.full((2,), 2.0))

    def breaks(x):
        if x.sum().item() > 0:  # data-dependent branch: a graph break, refused by fullgraph
            return x
        return -x

    said: list[str] = []
    bad = compile_step(breaks, log=said.append, backend="eager")
    n_callbacks = len(torch._dynamo.callback_handler.start_callbacks)
    with pytest.raises(Exception, match=r"(?i)graph break|data-dependent|item"):
        bad(torch.ones(2))
    assert len(torch._dynamo.callback_handler.start_callbacks) == n_callbacks
    assert said == ["compiling breaks (first call; this can take minutes)..."]


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"compile_step\(step=...\): expected a callable"):
        compile_step(3)
    with pytest.raises(TypeError, match=r"compile_step\(log=...\): expected a logging.Logger"):
        compile_step(lambda x: x, log="stderr")


@pytest.fixture
def cache_env(monkeypatch):
    """Let enable_compile_cache set its variables; restore them (and torch's flags) after."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHFN_COMPILE_CACHE"):
        monkeypatch.setenv(var, "unused")
        monkeypatch.delenv(var)
    # the config modules' own patch(): monkeypatch's undo would delete (hide) the entries
    with (inductor_config.patch(fx_graph_cache=inductor_config.fx_graph_cache),
          functorch_config.patch(enable_autograd_cache=functorch_config.enable_autograd_cache)):
        yield monkeypatch


def test_enable_compile_cache_sets_one_directory_idempotently(cache_env, tmp_path) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    cache_env.setenv("TORCHFN_COMPILE_CACHE", str(tmp_path / "c"))
    d = enable_compile_cache()
    assert d == (tmp_path / "c").resolve() and d.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(d)
    assert os.environ["TRITON_CACHE_DIR"] == str(d / "triton")
    assert inductor_config.fx_graph_cache is True
    assert enable_compile_cache(tmp_path / "c") == d and os.listdir(d) == []
    cache_env.delenv("TORCHFN_COMPILE_CACHE")
    cache_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert enable_compile_cache() == (tmp_path / "xdg" / "torchfn" / "compile").resolve()


def test_enable_compile_cache_refuses_a_directory_it_cannot_write(cache_env, tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match=r"compile cache directory .*a_file/c.* is not "
                                              r"writable .*set TORCHFN_COMPILE_CACHE"):
        enable_compile_cache(blocker / "c")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_load_compile_cache_refuses_missing_and_foreign_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such file .*save_compile_cache"):
        load_compile_cache(tmp_path / "none.bin")
    (tmp_path / "junk.bin").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="not a compile cache written by save_compile_cache"):
        load_compile_cache(tmp_path / "junk.bin")


_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torchfn.compile import (compile_step, enable_compile_cache, load_compile_cache,
                                 save_compile_cache)
    cache, mode, blob = sys.argv[1:4]
    enable_compile_cache(cache)
    loaded = load_compile_cache(blob) if mode == "load" else None
    def f(x, w):
        return torch.tanh(x @ w).sum(-1) * 2.0
    step = compile_step(f, log=lambda m: print(m, file=sys.stderr))
    x = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(8, 4)
    w = torch.linspace(0, 1, 16, dtype=torch.float64).reshape(4, 4)
    ok = torch.allclose(step(x, w), f(x, w), rtol=1e-12, atol=1e-12)
    saved = str(save_compile_cache(blob)) if mode == "save" else None
    print(json.dumps({"ok": ok, "seconds": step.compile_seconds, "loaded": loaded,
                      "saved": saved}))
""")


def _run(cache: pathlib.Path, mode: str, blob: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache), mode, str(blob)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] and "compiling f (first call" in out.stderr
    return result


def _files(d: pathlib.Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}


def _entries(d: pathlib.Path) -> set[str]:
    return {p.name for sub in ("fxgraph", "aotautograd") for p in (d / sub).rglob("*")}


def test_a_second_process_starts_warm_from_the_cache_directory(tmp_path) -> None:
    cache, blob = tmp_path / "cache", tmp_path / "artifacts.bin"
    cold = _run(cache, "save", blob)
    after_cold = _files(cache)
    assert any(k.startswith("fxgraph/") for k in after_cold), sorted(after_cold)
    assert any(k.startswith("aotautograd/") for k in after_cold), sorted(after_cold)
    warm = _run(cache, "none", blob)
    # a miss in Inductor or AOTAutograd (re)writes its entry and kernels; a hit writes nothing
    assert _files(cache) == after_cold
    # the one-file artifacts warm a process with an empty cache directory
    assert cold["saved"] == str(blob) and blob.is_file()
    fresh = tmp_path / "fresh"
    moved = _run(fresh, "load", blob)
    assert moved["loaded"]["inductor"] and moved["loaded"]["aot_autograd"]
    assert _entries(fresh) >= set(moved["loaded"]["aot_autograd"])
    print(f"compile seconds: cold {cold['seconds']}, warm directory {warm['seconds']}, "
          f"loaded artifacts {moved['seconds']}")
