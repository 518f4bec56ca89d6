"""Sharded DP-SGD on gloo ranks (CPU), float64: sharded == replicated DistributedDPStep == one
process over the same global Poisson batches, noise included; a checkpoint written on 4 ranks
resumes exactly on 2.

Two ``mp.spawn`` runs share one directory: 4 ranks run STEPS logical steps of every clipping
mode sharded and replicated and save sharded checkpoints; 2 ranks load them (resharding), run
STEPS more, and check the non-finite guard. The test process computes the one-process runs.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchopt
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn import distributed as tdist
from torchfn.optim import adam
from torchfn.persample import (
    AdaptiveClipping,
    ClippedSum,
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

F64 = torch.float64
STEPS = 3
N = 64
TOL = {"rtol": 1e-10, "atol": 1e-12}
MODES = {  # name -> make_dp_train_step keywords
    "flat": {"max_grad_norm": 0.5},
    "per_layer": {"max_grad_norm": 0.5, "clipping": "per_layer"},
    "automatic": {"max_grad_norm": 0.5, "clipping": "automatic"},
    "adaptive": {"max_grad_norm": 0.5,
                 "adaptive_clipping": AdaptiveClipping(target_quantile=0.5, learning_rate=0.2)},
}
SEED = {"flat": 4, "per_layer": 5, "automatic": 7, "adaptive": 6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problem(mode: str) -> tuple[Any, dict, dict, Any]:
    """Linear(5, 8)-Tanh-Linear(8, 3): 40, 8, 24, 3 elements (uneven and empty shards on 4)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ghost, params, buffers = make_ghost_model(module)
    opt = adam(0.05)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=0.7, sample_rate=0.25, dataset_size=N,
                              delta=1e-5, **MODES[mode])
    return step, params, buffers, opt


def data() -> tuple[torch.Tensor, torch.Tensor, PoissonSampler]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 5, generator=g, dtype=F64), torch.randint(0, 3, (N,), generator=g)
    return x, y, PoissonSampler(N, 0.25, 32, seed=9)


def _state(mode: str, params: dict, buffers: dict, opt: Any, layout: Any = None) -> Any:
    c0 = 0.5 if mode == "adaptive" else None
    if layout is None:
        return init_dp_state(params, buffers, opt, seed=SEED[mode], max_grad_norm=c0)
    return tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=SEED[mode],
                                       max_grad_norm=c0)


def _rank_main(rank: int, world: int, port: int, root: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        x, y, sampler = data()
        steps = range(STEPS) if phase == "first" else range(STEPS, 2 * STEPS)
        for mode in MODES:
            step, params, buffers, opt = problem(mode)
            layout = tdist.ShardLayout.from_params(params)
            sstep = tdist.make_sharded_dp_train_step(step, layout)
            ckpt = os.path.join(root, f"ckpt_{mode}")
            if phase == "first":
                state = _state(mode, params, buffers, opt, layout)
                rep, dstep = _state(mode, params, buffers, opt), tdist.DistributedDPStep(step)
            else:
                template = _state(mode, {k: torch.zeros_like(v) for k, v in params.items()},
                                  buffers, opt, layout)
                state = tdist.load_sharded_checkpoint(ckpt, template, layout, opt)
                out[f"{mode}/loaded"] = tdist.gather_sharded_state(state, layout, opt)
            acct, metrics, rep_metrics = RDPAccountant(), [], []
            for t in steps:
                chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                                    physical_batch_size=4)
                state, m = sstep.run(state, chunks, lambda i: (x[i], y[i]), acct)
                metrics.append(m)
                if phase == "first":
                    rep, rm = dstep.run(rep, chunks, lambda i: (x[i], y[i]))
                    rep_metrics.append(rm)
            out[mode] = {"state": tdist.gather_sharded_state(state, layout, opt),
                         "metrics": metrics, "eps": acct.get_epsilon(1e-5),
                         "shard_shapes": {k: tuple(v.shape) for k, v in state.params.items()}}
            if phase == "first":
                out[mode].update(rep=rep, rep_metrics=rep_metrics)
                tdist.save_sharded_checkpoint(ckpt, state, layout, opt)
        if phase == "first":
            # a replicated state is refused with the fix named
            step, params, buffers, opt = problem("flat")
            layout = tdist.ShardLayout.from_params(params)
            try:
                tdist.make_sharded_dp_train_step(step, layout)(
                    _state("flat", params, buffers, opt), (x[:4], y[:4]),
                    torch.ones(4, dtype=torch.bool))
            except ValueError as e:
                out["replicated_error"] = str(e)
        else:
            _nonfinite(rank, world, out)
            _noise_only(rank, world, out)
            _compiled(rank, world, root, out)
        torch.save(out, os.path.join(root, f"{phase}_w{world}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _nonfinite(rank: int, world: int, out: dict) -> None:
    """A NaN example on rank 0 only, and an inf in ONE element of rank 1's shard sent from
    rank 0 (the loss finite): every rank skips both steps."""
    x, y, _ = data()
    step, params, buffers, opt = problem("flat")
    layout = tdist.ShardLayout.from_params(params)
    sstep = tdist.make_sharded_dp_train_step(step, layout)
    state = _state("flat", params, buffers, opt, layout)
    xs = x[rank * 4:(rank + 1) * 4].clone()
    if rank == 0:
        xs[1, 2] = float("nan")
    after, m = sstep(state, (xs, y[rank * 4:(rank + 1) * 4]), torch.ones(4, dtype=torch.bool))
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    if rank == 0:
        grads["0.weight"] = grads["0.weight"].clone()
        grads["0.weight"].view(-1)[-1] = float("inf")  # element 39: rank 1's shard (20..39)
    zero = torch.zeros((), dtype=F64)
    after2, m2 = sstep.apply(after, ClippedSum(grads, zero + 1, zero, zero, zero))
    out["nonfinite"] = {
        "skipped": (bool(m["skipped"]), bool(m2["skipped"])), "count": int(after2.skipped),
        "same": all(torch.equal(after2.params[k], state.params[k]) for k in state.params),
        "opt_same": all(torch.equal(a, b) for a, b in zip(
            torch.utils._pytree.tree_leaves(after2.opt_state),
            torch.utils._pytree.tree_leaves(state.opt_state), strict=True)),
        "key": after2.key, "step": int(after2.step), "loss": float(m["loss"])}


def _compiled(rank: int, world: int, root: str, out: dict) -> None:
    """The resumed per-layer run again, compiled: == eager, one graph per part, no recompiles
    as chunk counts and steps change (Dynamo with the eager backend keeps CI fast; the
    aot/Inductor lowering of these ops is the replicated step's, tested elsewhere)."""
    x, y, sampler = data()
    step, params, buffers, opt = problem("per_layer")
    layout = tdist.ShardLayout.from_params(params)
    counter = CompileCounterWithBackend("eager")
    cstep = tdist.make_sharded_dp_train_step(step, layout).compile(backend=counter)
    template = _state("per_layer", params, buffers, opt, layout)
    state = tdist.load_sharded_checkpoint(os.path.join(root, "ckpt_per_layer"), template,
                                          layout, opt)
    n_chunks, metrics, frames_after_first = [], [], -1
    for t in range(STEPS, 2 * STEPS):
        chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                            physical_batch_size=4)
        n_chunks.append(len(chunks))
        state, m = cstep.run(state, chunks, lambda i: (x[i], y[i]))
        metrics.append(m)
        frames_after_first = counter.frame_count if t == STEPS else frames_after_first
    frames_after_run = counter.frame_count
    one, _ = cstep(state, (x[:4], y[:4]), torch.ones(4, dtype=torch.bool))
    out["compiled"] = {"state": tdist.gather_sharded_state(state, layout, opt),
                       "metrics": metrics, "frames": (frames_after_first, frames_after_run),
                       "graphs": sum(1 for g in counter.graphs if len(g.graph.nodes)),
                       "n_chunks": n_chunks, "one_step": int(one.step)}


def _noise_only(rank: int, world: int, out: dict) -> None:
    """Nothing valid on any rank: the update is the noise alone, bit for bit the one process's."""
    torch.manual_seed(1)
    ghost, params, buffers = make_ghost_model(nn.Linear(100, 50).double())
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.01,
                              dataset_size=100)
    layout = tdist.ShardLayout.from_params(params)
    state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=8)
    after, _ = tdist.make_sharded_dp_train_step(step, layout)(
        state, (torch.zeros(3, 100, dtype=F64), torch.zeros(3, dtype=torch.long)),
        torch.zeros(3, dtype=torch.bool))
    out["noise"] = layout.gather(after.params)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict]]:
    root = tmp_path_factory.mktemp("sharded_dp")
    res = {}
    for phase, world in [("first", 4), ("resume", 2)]:
        mp.spawn(_rank_main, args=(world, _free_port(), str(root), phase), nprocs=world,
                 join=True)
        res[phase, world] = [torch.load(root / f"{phase}_w{world}_rank{r}.pt",
                                        weights_only=False) for r in range(world)]
    return res


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list, list, float]]:
    """One process, 2 * STEPS logical steps per mode over the global Poisson draws."""
    x, y, sampler = data()
    out = {}
    for mode in MODES:
        step, params, buffers, opt = problem(mode)
        state, acct, states, metrics = _state(mode, params, buffers, opt), RDPAccountant(), [], []
        for t in range(2 * STEPS):
            state, m = step.run(state, sampler.sample(t), lambda i: (x[i], y[i]), acct)
            states.append(state)
            metrics.append(m)
        out[mode] = (states, metrics, acct)
    return out


def _close(a: dict, b: dict, **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TOL), msg=lambda m, k=k: f"{k}: {m}")


def _close_state(a: Any, b: Any, **tol: float) -> None:
    _close(a.params, b.params, **tol)
    la, lb = (torch.utils._pytree.tree_leaves(s.opt_state) for s in (a, b))
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        torch.testing.assert_close(u, v, **(tol or TOL))
    assert torch.equal(a.key, b.key) and int(a.step) == int(b.step)
    assert int(a.skipped) == int(b.skipped)
    if a.clip_norm is not None or b.clip_norm is not None:
        torch.testing.assert_close(a.clip_norm, b.clip_norm, **(tol or TOL))


METRICS = ("loss", "batch_size", "clip_fraction", "grad_norm_mean", "skipped")


@pytest.mark.parametrize("mode", list(MODES))
def test_sharded_dp_equals_replicated_and_one_process(runs, reference, mode):
    states, ref_metrics, _ = reference[mode]
    res = runs["first", 4]
    assert res[0][mode]["shard_shapes"] == {"0.weight": (10,), "0.bias": (2,),
                                            "2.weight": (6,), "2.bias": (1,)}
    for out in res:
        got = out[mode]
        _close_state(got["state"], res[0][mode]["state"], rtol=0, atol=0)  # same on all ranks
        _close_state(got["state"], got["rep"])
        _close_state(got["state"], states[STEPS - 1])
        for t in range(STEPS):
            for k in METRICS:
                torch.testing.assert_close(got["metrics"][t][k], ref_metrics[t][k], **TOL)
                torch.testing.assert_close(got["metrics"][t][k], got["rep_metrics"][t][k],
                                           **TOL)
            if mode == "adaptive":
                for k in ("max_grad_norm", "unclipped_fraction"):
                    torch.testing.assert_close(got["metrics"][t][k], ref_metrics[t][k], **TOL)
            assert got["metrics"][t]["epsilon"] == pytest.approx(ref_metrics[t]["epsilon"],
                                                                 rel=1e-12)
        # the accountant saw STEPS logical steps with the global q, as the one process did
        one = RDPAccountant()
        for _ in range(STEPS):
            one.step(noise_multiplier=0.7, sample_rate=0.25)
        assert got["eps"] == pytest.approx(one.get_epsilon(1e-5), rel=1e-12)
        assert got["metrics"][-1]["epsilon"] == pytest.approx(got["eps"], rel=1e-12)
    clip = [float(m["clip_fraction"]) for m in ref_metrics[:STEPS]]
    assert max(clip) > 0  # clipping was exercised (automatic: every norm above C)
    assert float(res[0][mode]["metrics"][0]["batch_size"]) > 4  # several chunks per rank


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_from_4_ranks_resumes_exactly_on_2(runs, reference, mode):
    states, ref_metrics, _ = reference[mode]
    first = runs["first", 4][0][mode]["state"]
    for out in runs["resume", 2]:
        _close_state(out[f"{mode}/loaded"], first, rtol=0, atol=0)  # bit-exact round trip
        _close_state(out[mode]["state"], states[-1])  # continues the one-process run of 6
        for t in range(STEPS):
            torch.testing.assert_close(out[mode]["metrics"][t]["loss"],
                                       ref_metrics[STEPS + t]["loss"], **TOL)


def test_compiled_sharded_dp_equals_eager(runs, reference):
    states, ref_metrics, _ = reference["per_layer"]
    for out in runs["resume", 2]:
        c = out["compiled"]
        # no recompiles over steps and chunk counts; one graph each for the clipped sum, apply
        # and the one-batch step (Dynamo's restarted first trace of apply leaves an empty one)
        assert c["frames"][0] == c["frames"][1] and c["graphs"] == 3
        assert len(set(c["n_chunks"])) > 1 or max(c["n_chunks"]) > 1  # several chunk counts
        _close_state(c["state"], out["per_layer"]["state"])
        _close_state(c["state"], states[-1])
        for t in range(STEPS):
            torch.testing.assert_close(c["metrics"][t]["loss"], ref_metrics[STEPS + t]["loss"],
                                       **TOL)
        assert c["one_step"] == 2 * STEPS + 1


def test_noise_is_the_one_process_noise_bit_for_bit(runs):
    torch.manual_seed(1)
    ghost, params, buffers = make_ghost_model(nn.Linear(100, 50).double())
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.01,
                              dataset_size=100)
    after, _ = step(init_dp_state(params, buffers, opt, seed=8),
                    (torch.zeros(3, 100, dtype=F64), torch.zeros(3, dtype=torch.long)),
                    torch.zeros(3, dtype=torch.bool))
    for out in runs["resume", 2]:
        _close(out["noise"], after.params, rtol=0, atol=0)
        moved = (out["noise"]["weight"] - params["weight"]).std()
        assert 0.8 < float(moved) < 1.2  # sigma C / (q N) = 1


def test_nonfinite_on_one_rank_skips_on_every_rank(runs):
    step, params, buffers, opt = problem("flat")
    state = init_dp_state(params, buffers, opt, seed=SEED["flat"])
    x, y, _ = data()
    xs = x[:8].clone()
    xs[1, 2] = float("nan")
    one, m = step(state, (xs, y[:8]), torch.ones(8, dtype=torch.bool))
    assert bool(m["skipped"])
    for out in runs["resume", 2]:
        nf = out["nonfinite"]
        assert nf["skipped"] == (True, True) and nf["count"] == 2
        assert nf["same"] and nf["opt_same"]
        assert nf["step"] == 2 and nf["loss"] != nf["loss"]  # the NaN loss, as one process
        assert torch.equal(nf["key"], _advance(one.key))  # key and step advance as usual


def _advance(key: torch.Tensor) -> torch.Tensor:
    from torchfn.persample._dp_random import fold_in

    return fold_in(key, 0x6E657874)


def test_replicated_state_in_sharded_dp_step_is_refused(runs):
    msg = runs["first", 4][0]["replicated_error"]
    assert "sharded DP-SGD step: state.params: param '0.weight' should be a flat shard" in msg
    assert "got shape (8, 5)" in msg


@pytest.mark.parametrize(("kw", "match"), [
    ({"secure_noise": True}, r"make_dp_train_step\(secure_noise=\.\.\.\) is not supported by "
                             r"the sharded step: expected False .*got True"),
    ({"amp": "bf16"}, r"make_dp_train_step\(amp=\.\.\.\) .*expected None, got 'bf16'"),
    ({"trainable": ["0.weight"]}, r"make_dp_train_step\(trainable=\.\.\.\) .*frozen params"),
])
def test_refused_options_raise(kw, match):
    torch.manual_seed(0)
    ghost, _, _ = make_ghost_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(),
                                                 nn.Linear(8, 3)).double())
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"),
                              adam(0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                              sample_rate=0.1, dataset_size=100, **kw)
    with pytest.raises(ValueError, match=match):
        tdist.make_sharded_dp_train_step(step, None)


def test_frozen_params_and_bad_arguments_raise():
    module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    module[0].requires_grad_(False)
    ghost, _, _ = make_ghost_model(module)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"),
                              adam(0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                              sample_rate=0.1, dataset_size=100)
    with pytest.raises(ValueError, match=r"make_dp_train_step\(ghost=\.\.\.\) .*frozen params "
                                         r"\['0.bias', '0.weight'\]"):
        tdist.make_sharded_dp_train_step(step, None)
    with pytest.raises(TypeError, match=r"expected a DPTrainStep from make_dp_train_step, got "
                                        r"function"):
        tdist.make_sharded_dp_train_step(lambda s: s, None)
    step2, _, _, _ = problem("flat")
    with pytest.raises(TypeError, match=r"expected a ShardLayout .*got NoneType"):
        tdist.make_sharded_dp_train_step(step2, None)
