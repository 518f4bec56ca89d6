"""Profiling helpers (torchfn.compile.profile_step, memory_snapshot) and the steps' annotations.

profile_step on a small train, DP-SGD, MAML and ensemble step reports the step's named parts, positive
times and a valid Chrome trace at the given path (the part names in its events); a compiled
step profiles without graph breaks or recompiles; the annotations are null contexts when no
profiler runs; bad arguments give errors naming the argument; memory_snapshot refuses without
CUDA; on CUDA (gpu mark) peak memory and the snapshot file are checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn._checks import _part
from torchfn.compile import StepProfile, memory_snapshot, profile_step
from torchfn.compile._profile import _summarise
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import init_train_state, make_train_step
from torchfn.meta import init_meta_state, make_meta_train_step, maml, sinusoid_tasks
from torchfn.optim import adam
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

TRAIN_PARTS = {"torchfn.forward_backward", "torchfn.apply_gradients", "torchfn.clip",
               "torchfn.optimizer", "torchfn.nonfinite_guard"}
DP_PARTS = {"torchfn.ghost_pass", "torchfn.clipped_sum", "torchfn.noise",
            "torchfn.apply_gradients", "torchfn.clip", "torchfn.optimizer"}
META_PARTS = {"torchfn.inner_loop", "torchfn.outer_grad", "torchfn.apply_gradients",
              "torchfn.optimizer"}


def linear_fn(p: dict[str, Tensor], b: dict[str, Tensor], x: Tensor):
    return x @ p["w"] + p["b"], b


def train_setup(device: str = "cpu"):
    opt = adam(0.1)
    step = make_train_step(linear_fn, F.mse_loss, opt, max_grad_norm=1.0, grad_accum_steps=2)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 2, generator=g), "b": torch.zeros(2)}
    state = init_train_state({k: v.to(device) for k, v in params.items()}, {}, opt, seed=0)
    batch = (torch.randn(8, 4, generator=g).to(device), torch.randn(8, 2, generator=g).to(device))
    return step, state, batch


def trace_names(path: str) -> set[str]:
    with open(path) as f:
        doc = json.load(f)
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    return {e.get("name") for e in doc["traceEvents"]}


def check_profile(prof: StepProfile, parts: set[str], steps: int) -> None:
    assert isinstance(prof, StepProfile)
    assert prof.steps == steps and prof.device == "cpu"
    assert prof.wall_ms > 0 and prof.host_ms > 0
    assert prof.host_ms <= prof.wall_ms * 1.5  # op time is part of the step's time
    assert prof.device_ms is None and prof.peak_memory_bytes is None
    names = {p.name for p in prof.parts}
    assert parts <= names, sorted(parts - names)
    for p in prof.parts:
        assert p.host_ms > 0 and p.calls > 0, p
    assert prof.top and all(op.host_ms >= 0 for op in prof.top)
    assert prof.top == tuple(sorted(prof.top, key=lambda op: -op.host_ms))
    table = str(prof)
    assert table == prof.table()
    for name in parts:
        assert name in table
    assert "wall" in table and "host (ops)" in table and "not tracked on the CPU" in table


def test_train_step_profile_table_and_trace(tmp_path) -> None:
    step, state, batch = train_setup()
    before = {k: v.clone() for k, v in state.params.items()}
    path = str(tmp_path / "train.json")
    prof = profile_step(step, state, batch, warmup=1, steps=2, trace=path, top_k=5)
    check_profile(prof, TRAIN_PARTS, 2)
    assert len(prof.top) == 5
    fb = next(p for p in prof.parts if p.name == "torchfn.forward_backward")
    assert fb.calls == 2  # grad_accum_steps=2 micro-batches per step
    assert prof.trace == path and path in str(prof)
    assert TRAIN_PARTS | {"torchfn.profile_step"} <= trace_names(path)
    assert not [f for f in os.listdir(tmp_path) if f != "train.json"]  # no temp file left
    for k, v in before.items():  # the caller's state is not modified
        assert torch.equal(state.params[k], v)


def test_dp_step_profile_shows_ghost_pass_clipping_and_noise(tmp_path) -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(5, 4), nn.Tanh(),
                                                            nn.Linear(4, 3)))
    opt = torchopt.sgd(0.1)
    dp = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                            noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1,
                            dataset_size=80)
    state = init_dp_state(params, buffers, opt, seed=3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    valid = torch.ones(8, dtype=torch.bool)
    path = str(tmp_path / "dp.json")
    prof = profile_step(lambda s, b: dp(s, b, valid), state, (x, y), warmup=1, steps=1,
                        trace=path)
    check_profile(prof, DP_PARTS, 1)
    assert trace_names(path) >= DP_PARTS


def test_meta_step_profile_shows_inner_loop_and_outer_grad() -> None:
    learner = maml(linear_fn, F.mse_loss, inner_lr=0.1, inner_steps=2)
    opt = adam(0.01)
    params = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
    step = make_meta_train_step(learner, opt)
    state = init_meta_state(learner, params, {}, opt)
    tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
    prof = profile_step(step, state, tasks, warmup=0, steps=1)
    check_profile(prof, META_PARTS, 1)
    inner = next(p for p in prof.parts if p.name == "torchfn.inner_loop")
    outer = next(p for p in prof.parts if p.name == "torchfn.outer_grad")
    assert outer.host_ms >= inner.host_ms  # the outer gradient runs the inner loop inside it


def test_ensemble_step_profile_shows_its_parts() -> None:
    ens = Ensemble.from_seeds(lambda: nn.Linear(3, 1), seeds=range(2))
    opt = torchopt.sgd(0.1)
    state = init_ensemble_state(ens, opt, seed=0)
    step = make_ensemble_train_step(ens.model_fn, F.mse_loss, opt, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 8, 3, generator=g), torch.randn(2, 8, 1, generator=g))
    prof = profile_step(step, state, batch, warmup=1, steps=1)
    check_profile(prof, TRAIN_PARTS, 1)


def test_compiled_step_profiles_without_graph_breaks_or_recompiles() -> None:
    step, state, batch = train_setup()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    prof = profile_step(compiled, state, batch, warmup=1, steps=2)
    assert counter.frame_count == 1  # the profiler's state does not change the graph
    assert prof.wall_ms > 0 and prof.host_ms > 0
    assert prof.parts == ()  # compiled: no eager annotations
    assert "none recorded" in prof.table()


# torch 2.11's profiler warns on leaving a profile without a schedule (acc_events)
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_annotations_are_null_without_a_profiler() -> None:
    assert isinstance(_part("torchfn.x"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert isinstance(_part("torchfn.x"), torch.profiler.record_function)
    assert isinstance(_part("torchfn.x"), contextlib.nullcontext)


def _event(name, start, end, device="CPU", annotation=False, kernels=(), self_cpu=0.0,
           self_device=0.0):
    return SimpleNamespace(
        name=name, is_async=False, device_type=getattr(torch.autograd.DeviceType, device),
        is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end),
        kernels=[SimpleNamespace(duration=d) for d in kernels], cpu_time_total=end - start,
        self_cpu_time_total=self_cpu, self_device_time_total=self_device)


def test_part_device_time_counts_kernels_launched_from_other_threads() -> None:
    """CUDA bookkeeping, checked on synthetic events: a part's device time is the kernels
    launched while it is open, also by an op of autograd's device thread (not its child)."""
    events = [
        _event("torchfn.forward_backward", 0, 100, annotation=True),
        _event("aten::mm", 10, 20, kernels=[5.0], self_cpu=10),  # forward, main thread
        _event("aten::mm_backward", 50, 60, kernels=[7.0], self_cpu=10),  # device thread
        _event("torchfn.optimizer", 100, 150, annotation=True),
        _event("aten::add", 110, 120, kernels=[2.0, 1.0], self_cpu=10),
        _event("aten::sum", 200, 210, kernels=[4.0], self_cpu=10),  # outside every part
        _event("gemm_kernel", 20, 25, device="CUDA", self_device=5.0),
        _event("gemm_kernel", 60, 67, device="CUDA", self_device=7.0),
        _event("add_kernel", 120, 123, device="CUDA", self_device=3.0),
        _event("sum_kernel", 210, 214, device="CUDA", self_device=4.0),
        _event("torchfn.optimizer", 100, 150, device="CUDA", annotation=True, self_device=50),
    ]
    host_ms, device_ms, top, parts = _summarise(events, 1, True, 2)
    assert host_ms == pytest.approx(0.040) and device_ms == pytest.approx(0.019)
    assert [(op.name, op.calls, op.device_ms) for op in top] == [
        ("gemm_kernel", 2, pytest.approx(0.012)), ("sum_kernel", 1, pytest.approx(0.004))]
    by_name = {p.name: p for p in parts}
    assert by_name["torchfn.forward_backward"].device_ms == pytest.approx(0.012)
    assert by_name["torchfn.forward_backward"].host_ms == pytest.approx(0.1)
    assert by_name["torchfn.optimizer"].device_ms == pytest.approx(0.003)


def test_argument_errors(tmp_path) -> None:
    step, state, batch = train_setup()
    with pytest.raises(TypeError, match=r"profile_step\(step=...\): expected a callable.*got int"):
        profile_step(3, state, batch)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"profile_step\(warmup=...\): expected an int >= 0"):
            profile_step(step, state, batch, warmup=bad)
    for bad in (0, 2.0, False):
        with pytest.raises(ValueError, match=r"profile_step\(steps=...\): expected an int >= 1"):
            profile_step(step, state, batch, steps=bad)
    with pytest.raises(ValueError, match=r"profile_step\(top_k=...\): expected an int >= 1, "
                                         r"got 0"):
        profile_step(step, state, batch, top_k=0)
    missing = str(tmp_path / "no_such_dir" / "t.json")
    with pytest.raises(FileNotFoundError, match=r"profile_step\(trace=.*no_such_dir.*\): the "
                                                r"directory .* does not exist"):
        profile_step(step, state, batch, trace=missing)
    with pytest.raises(TypeError, match=r"profile_step\(trace=...\): expected a file path"):
        profile_step(step, state, batch, trace=3)
    with pytest.raises(TypeError, match=r"profile_step\(step=...\): step\(state, batch\) "
                                        r"returned Tensor; expected a pair \(new_state, metrics"):
        profile_step(lambda s, b: b[0], state, batch, warmup=1)
    with pytest.raises(ValueError, match=r"profile_step\(device=...\): expected a torch.device "
                                         r"or a device string.*got 'gpu0'"):
        profile_step(step, state, batch, device="gpu0")
    with pytest.raises(ValueError, match=r"profile_step\(device=...\): expected a CUDA or CPU "
                                         r"device, got meta"):
        profile_step(step, state, batch, device="meta")
    prof = profile_step(step, state, batch, warmup=0, steps=1, device="cpu")
    assert prof.device == "cpu" and prof.device_ms is None


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CUDA is available: test_cuda_peak_memory_and_snapshot covers it")
def test_memory_snapshot_needs_cuda(tmp_path) -> None:
    with pytest.raises(RuntimeError, match=r"memory_snapshot: recording CUDA memory history "
                                           r"needs CUDA.*profile_step"):
        memory_snapshot(str(tmp_path / "s.pickle"), torch.ones, 3)
    assert not os.listdir(tmp_path)
    with pytest.raises(TypeError, match=r"memory_snapshot\(path, fn, ...\): fn must be callable"):
        memory_snapshot(str(tmp_path / "s.pickle"), 3)
    with pytest.raises(FileNotFoundError, match=r"memory_snapshot\(path=.*\): the directory"):
        memory_snapshot(str(tmp_path / "nope" / "s.pickle"), torch.ones, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_peak_memory_and_snapshot(tmp_path) -> None:
    step, state, batch = train_setup("cuda")
    path = str(tmp_path / "cuda.json")
    prof = profile_step(step, state, batch, warmup=1, steps=2, trace=path)
    assert prof.device.startswith("cuda")
    assert prof.peak_memory_bytes is not None and prof.peak_memory_bytes > 0
    assert prof.device_ms is not None and prof.device_ms > 0
    assert prof.top and all(op.device_ms is not None for op in prof.top)
    assert {p.name for p in prof.parts} >= TRAIN_PARTS
    parts = {p.name: p for p in prof.parts}
    assert all(p.device_ms is not None and p.device_ms >= 0 for p in prof.parts)
    # the two top-level parts hold (nearly) all of the step's kernels, the backward ones
    # (launched from autograd's device thread) included, and never more than all of them
    top_level = parts["torchfn.forward_backward"].device_ms + parts["torchfn.apply_gradients"
                                                                    ].device_ms
    assert 0.75 * prof.device_ms <= top_level <= 1.01 * prof.device_ms
    assert parts["torchfn.optimizer"].device_ms > 0
    assert "peak memory" in str(prof) and "device (kernels)" in str(prof)
    assert trace_names(path) >= TRAIN_PARTS

    snap = str(tmp_path / "step.pickle")
    out = memory_snapshot(snap, step, state, batch)
    assert int(out[0].step) == 1
    with open(snap, "rb") as f:
        data = pickle.load(f)
    assert "segments" in data and "device_traces" in data
    assert any(data["device_traces"])  # the step's allocations were recorded

    # a step holding its CUDA tensors in a closure: device= says where it runs
    box = [state]

    def closed(s, b):
        box[0], _ = step(box[0], batch)
        return s, None

    prof = profile_step(closed, None, None, warmup=1, steps=1, device="cuda")
    assert prof.device.startswith("cuda") and prof.device_ms is not None and prof.device_ms > 0
    assert prof.peak_memory_bytes is not None and prof.peak_memory_bytes > 0
