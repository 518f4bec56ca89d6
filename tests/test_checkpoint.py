"""Atomic checkpoints of TrainState: round trip, crash safety, bitwise resume, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import NamedTuple

import optree
import pytest
import torch
import torchopt
from torch import nn
from torchopt.base import GradientTransformation
from torchopt.transform.scale_by_adam import ScaleByAdamState

import torchfn.functional._checkpoint as ckpt_mod
from torchfn.functional._checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from torchfn.functional._train_step import (
    TrainState,
    init_train_state,
    make_train_step,
    step_rng,
)
from torchfn.optim import adam, adamw


def mse(outputs, targets):
    return ((outputs - targets) ** 2).mean()


def dropout_model(dtype=torch.float32):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    module = module.to(dtype)
    params = {k: v.detach().clone() for k, v in module.named_parameters()}

    def model_fn(p, b, x):
        return torch.func.functional_call(module, p, (x,)), b

    # a buffer that the model passes through unchanged, to check buffers round-trip too
    buffers = {"counter": torch.arange(3)}
    return model_fn, params, buffers


def batch_for(t, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 2, generator=g, dtype=dtype)


def assert_states_equal(a: TrainState, b: TrainState):
    """Bitwise equality of every leaf and equal pytree structure (NamedTuple types included)."""
    leaves_a, spec_a = optree.tree_flatten(a)
    leaves_b, spec_b = optree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def test_round_trip_rebuilds_types(tmp_path):
    _, params, buffers = dropout_model()
    sched = torchopt.schedule.linear_schedule(0.1, 0.01, 10)
    for opt in (adamw(lr=sched, weight_decay=0.1), torchopt.sgd(0.1, momentum=0.9), adam()):
        state = init_train_state(params, buffers, opt, seed=11, loss_scale=512.0)
        state = state._replace(step=torch.tensor(7))
        path = tmp_path / "state.pt"
        extra = {"loader": {"epoch": 2, "offsets": [1, 2, 3], "pair": (4, "x")}, "note": None}
        save_checkpoint(path, state, extra=extra)
        loaded, loaded_extra = load_checkpoint(path)
        assert_states_equal(loaded, state)
        assert isinstance(loaded, TrainState)
        assert loaded_extra == extra
        assert isinstance(loaded_extra["loader"]["pair"], tuple)
        with_template, _ = load_checkpoint(path, optimizer=opt)
        assert_states_equal(with_template, state)
    assert any(isinstance(s, ScaleByAdamState) for s in loaded.opt_state)


def test_file_records_versions_and_loads_weights_only(tmp_path):
    _, params, buffers = dropout_model()
    path = tmp_path / "c.pt"
    save_checkpoint(path, init_train_state(params, buffers, adam(), seed=0))
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "torchfn.checkpoint"
    assert raw["format_version"] == ckpt_mod.FORMAT_VERSION
    assert raw["torch_version"] == str(torch.__version__)


def _failing_save(nbytes):
    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + b"\x00" * nbytes)  # the start of a zip, then the "crash"
        raise OSError("disk full (simulated)")

    return save


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _, params, buffers = dropout_model()
    opt = adam()
    first = init_train_state(params, buffers, opt, seed=1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, first, extra={"n": 1})
    second = first._replace(params={k: v + 1 for k, v in params.items()}, step=torch.tensor(5))
    monkeypatch.setattr(ckpt_mod.torch, "save", _failing_save(1000))
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, second, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left behind
    loaded, extra = load_checkpoint(path)
    assert_states_equal(loaded, first)
    assert extra == {"n": 1}
    save_checkpoint(path, second, extra={"n": 2})  # and a later save works
    loaded, extra = load_checkpoint(path)
    assert_states_equal(loaded, second)
    assert extra == {"n": 2}


def test_killed_process_mid_write_keeps_previous_checkpoint(tmp_path):
    _, params, buffers = dropout_model()
    first = init_train_state(params, buffers, adam(), seed=1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, first)
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import torchfn.functional._checkpoint as m
        from torchfn.optim import adam
        from torchfn.functional._train_step import init_train_state

        def save(obj, f, *args, **kwargs):
            f.write(b"PK\\x03\\x04" + b"\\x00" * 4096)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        m.torch.save = save
        state = init_train_state({{"w": torch.zeros(3)}}, {{}}, adam(), seed=2)
        m.save_checkpoint({str(path)!r}, state)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    litter = sorted(set(os.listdir(tmp_path)) - {"ckpt.pt"})
    assert len(litter) == 1 and litter[0].startswith(".ckpt.pt.") and litter[0].endswith(".tmp")
    assert os.path.getsize(tmp_path / litter[0]) > 4096
    loaded, _ = load_checkpoint(path)  # the half-written file is never read
    assert_states_equal(loaded, first)
    # regression: the next save of the target removes the killed save's temporary file
    save_checkpoint(path, first)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True, timeout=60)
    return int(proc.stdout)


def _litter(directory, names, age_s=0.0):
    for name in names:
        (directory / name).write_bytes(b"PK\x03\x04" + b"\x00" * 64)
        if age_s:
            t = os.stat(directory / name).st_mtime - age_s
            os.utime(directory / name, (t, t))


def test_save_removes_only_stale_temporary_files_of_its_own_target(tmp_path):
    """Regression: temporary files of killed saves piled up forever. A save removes those of its
    own target: this host's files of dead processes, and any not modified for an hour."""
    _, params, buffers = dropout_model()
    state = init_train_state(params, buffers, adam(), seed=1)
    host, dead, live = ckpt_mod._host(), _dead_pid(), os.getpid()
    stale = [
        f".ckpt.pt.{dead}@{host}.0123abcd.tmp",  # killed save on this host
        f".ckpt.pt.{dead}@{host}.ffff0000.tmp",
    ]
    stale_old = [
        f".ckpt.pt.{dead}@other-host.0123abcd.tmp",  # another host, untouched for 2 hours
        f".ckpt.pt.{live}@{host}.0123abcd.tmp",  # a live pid (reused?), untouched for 2 hours
        ".ckpt.pt.k3_x9abq.tmp",  # tempfile.mkstemp's name (older torchfn), 2 hours old
    ]
    kept = [
        f".ckpt.pt.{live}@{host}.abcdef01.tmp",  # a save of this process running right now
        f".ckpt.pt.{dead}@other-host.abcdef01.tmp",  # another host: maybe a live save there
        ".ckpt.pt.k3_x9abz.tmp",  # recent, of unknown origin
        "ckpt.pt.bak", ".ckpt.pt.tmp", "notes.txt",  # not temporary files of a save
    ]
    kept_old = [  # temporary files of other targets, however old or dead
        f".ckpt.pt.1.{dead}@{host}.0123abcd.tmp",  # of target "ckpt.pt.1"
        ".ckpt.pt.1.k3_x9abq.tmp",
        f".other.pt.{dead}@{host}.0123abcd.tmp",
        f".ckpt.{dead}@{host}.0123abcd.tmp",  # of target "ckpt"
    ]
    _litter(tmp_path, stale + kept)
    _litter(tmp_path, stale_old + kept_old, age_s=2 * 3600)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt", *kept, *kept_old])
    loaded, _ = load_checkpoint(path)
    assert_states_equal(loaded, state)


def _train(step, state, start, stop):
    for t in range(start, stop):
        state, _ = step(state, batch_for(t))
    return state


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_resumed_run_is_bitwise_identical(tmp_path, opt_name):
    model_fn, params, buffers = dropout_model()
    opt = adam(lr=0.01, weight_decay=0.01) if opt_name == "adam" else torchopt.sgd(0.05, 0.9)
    step = make_train_step(model_fn, mse, opt, grad_accum_steps=2, max_grad_norm=1.0)
    init = init_train_state(params, buffers, opt, seed=1234)
    straight = _train(step, init, 0, 6)

    interrupted = _train(step, init, 0, 3)
    path = tmp_path / "ckpt.pt"
    loader_state = {"position": 3, "order": torch.randperm(10)}
    save_checkpoint(path, interrupted, extra={"loader": loader_state})
    del interrupted
    torch.manual_seed(999)  # the resumed process starts from another global RNG state
    resumed, extra = load_checkpoint(path)
    assert extra["loader"]["position"] == 3
    assert torch.equal(extra["loader"]["order"], loader_state["order"])
    resumed = _train(step, resumed, extra["loader"]["position"], 6)
    assert_states_equal(resumed, straight)
    assert int(resumed.step) == 6
    # dropout made a difference: a run with another seed ends elsewhere
    other = _train(step, init._replace(seed=torch.tensor(1235)), 0, 6)
    assert not torch.equal(other.params["0.weight"], straight.params["0.weight"])


def test_compiled_resume_with_step_rng_is_bitwise_identical(tmp_path):
    model_fn, params, buffers = dropout_model()
    opt = adam(lr=0.01)
    compiled = torch.compile(make_train_step(model_fn, mse, opt), fullgraph=True)

    def train(state, start, stop):
        for t in range(start, stop):
            with step_rng(state):
                state, _ = compiled(state, batch_for(t))
        return state

    init = init_train_state(params, buffers, opt, seed=77)
    straight = train(init, 0, 4)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, train(init, 0, 2))
    torch.manual_seed(5)
    resumed, _ = load_checkpoint(path)
    assert_states_equal(train(resumed, 2, 4), straight)


def test_errors(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nope\.pt"):
        load_checkpoint(missing)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"corrupt.pt.*corrupt or not a torch checkpoint"):
        load_checkpoint(corrupt)
    _, params, buffers = dropout_model()
    state = init_train_state(params, buffers, adam(), seed=0)
    good = tmp_path / "good.pt"
    save_checkpoint(good, state)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: os.path.getsize(good) // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.pt"):
        load_checkpoint(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(CheckpointError, match="not a torchfn checkpoint"):
        load_checkpoint(other)
    future = tmp_path / "future.pt"
    payload = torch.load(good, weights_only=True)
    payload["format_version"] = 99
    torch.save(payload, future)
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(future)
    with pytest.raises(TypeError, match=r"cannot store extra\['fn'\] of type function"):
        save_checkpoint(tmp_path / "x.pt", state, extra={"fn": lambda: 0})
    assert not (tmp_path / "x.pt").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_checkpoint(tmp_path / "no_dir" / "x.pt", state)
    with pytest.raises(TypeError, match="expected a TrainState or a DPState, got dict"):
        save_checkpoint(tmp_path / "x.pt", {"params": params})
    with pytest.raises(CheckpointError, match=r"does not match optimizer\.init"):
        load_checkpoint(good, optimizer=torchopt.sgd(0.1, momentum=0.9))


class _CustomState(NamedTuple):
    acc: dict


def _custom_opt() -> GradientTransformation:
    """A GradientTransformation whose state class lives outside torchopt/torchfn."""

    def init(params):
        return _CustomState(acc={k: torch.zeros_like(v) for k, v in params.items()})

    def update(updates, state, *, params=None, inplace=True):
        acc = {k: state.acc[k] + updates[k] ** 2 for k in updates}
        return {k: -0.1 * u for k, u in updates.items()}, _CustomState(acc=acc)

    return GradientTransformation(init, update)


def test_foreign_state_classes_need_the_optimizer_template(tmp_path):
    _, params, buffers = dropout_model()
    opt = _custom_opt()
    state = init_train_state(params, buffers, opt, seed=0)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    _, opt_state = opt.update(grads, state.opt_state)
    state = state._replace(opt_state=opt_state)
    path = tmp_path / "c.pt"
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=r"not imported from a checkpoint.*pass optimizer="):
        load_checkpoint(path)
    loaded, _ = load_checkpoint(path, optimizer=opt)
    assert_states_equal(loaded, state)
    assert isinstance(loaded.opt_state, _CustomState)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_dp_state_checkpoint_resumes_the_dp_run_exactly(tmp_path, with_optimizer):
    """A DPState saves and loads as itself (noise key, step, adaptive clip threshold, Adam
    state); the resumed run draws the same noise and equals the uninterrupted one bitwise."""
    from torchfn.persample import (
        AdaptiveClipping,
        DPState,
        init_dp_state,
        make_dp_train_step,
        make_ghost_model,
    )

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    net[0].requires_grad_(False)  # a frozen layer: the optimizer state covers the rest

    def xent(out, y):
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    ghost, params, buffers = make_ghost_model(net)
    opt = adam(1e-2)
    step = make_dp_train_step(ghost, xent, opt, max_grad_norm=1.0, noise_multiplier=1.0,
                              sample_rate=0.1, dataset_size=80,
                              adaptive_clipping=AdaptiveClipping(0.5, 0.2))
    state = init_dp_state(params, buffers, opt, seed=3, trainable=ghost.trainable,
                          max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    valid = torch.ones(8, dtype=torch.bool)
    straight = state
    for b in batches:
        straight, _ = step(straight, b, valid)
    resumed = state
    for b in batches[:2]:
        resumed, _ = step(resumed, b, valid)
    path = os.path.join(tmp_path, "dp.pt")
    save_checkpoint(path, resumed, extra={"epoch": 2})
    kw = {"optimizer": opt, "trainable": ghost.trainable} if with_optimizer else {}
    resumed, extra = load_checkpoint(path, **kw)
    assert isinstance(resumed, DPState) and extra == {"epoch": 2}
    for b in batches[2:]:
        resumed, _ = step(resumed, b, valid)
    assert optree.tree_structure(resumed) == optree.tree_structure(straight)
    for a, b in zip(optree.tree_leaves(resumed), optree.tree_leaves(straight), strict=True):
        assert torch.equal(a, b)
