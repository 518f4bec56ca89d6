"""Sharded params and optimizer state on gloo ranks (CPU), float64: sharded == replicated == one
process, and a checkpoint written on 4 ranks resumes exactly on 2 ranks and on 1.

Three ``mp.spawn`` runs share one directory: 4 ranks train 3 steps sharded and 3 steps with the
replicated data-parallel step, and save a sharded checkpoint (torch.distributed.checkpoint);
2 ranks and then 1 rank load it (resharding) and train 3 more steps. The tests compare what
the ranks saved with one process over the same global batches, computed in the test process.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchopt
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn import distributed as tdist
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import adam

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

F64 = torch.float64
STEPS = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}
KW = {"grad_accum_steps": 2, "max_grad_norm": 0.3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_fn(params: dict, buffers: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A tanh MLP plus a running mean of the inputs (a float buffer, like BatchNorm's)."""
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"], {"m": 0.9 * buffers["m"] + 0.1 * x.mean(0)}


def init_params() -> dict[str, torch.Tensor]:
    """Sizes 28, 7, 14, 2: uneven shards (and empty ones for b2 on 4 ranks)."""
    g = torch.Generator().manual_seed(1)
    return {"w1": torch.randn(4, 7, generator=g, dtype=F64) / 2,
            "b1": torch.randn(7, generator=g, dtype=F64) / 10,
            "w2": torch.randn(7, 2, generator=g, dtype=F64) / math.sqrt(7),
            "b2": torch.zeros(2, dtype=F64)}


BUFFERS = {"m": torch.zeros(4, dtype=F64)}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """2 * STEPS global batches of 16 (MSE)."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 4, generator=g, dtype=F64), torch.randn(16, 2, generator=g,
                                                                     dtype=F64))
            for _ in range(2 * STEPS)]


def _local(batch: tuple, rank: int, world: int) -> tuple:
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def _rank_main(rank: int, world: int, port: int, root: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        opt = adam(1e-2)
        params = init_params()
        layout = tdist.ShardLayout.from_params(params)
        step = tdist.make_sharded_train_step(model_fn, F.mse_loss, opt, layout, **KW)
        data = batches()
        if phase == "first":
            state = tdist.init_sharded_state(params, BUFFERS, opt, layout, seed=0)
            out["shard_shapes"] = {k: tuple(v.shape) for k, v in state.params.items()}
            out["mu_shapes"] = {k: tuple(v.shape) for k, v in state.opt_state[0].mu.items()}
            rep = init_train_state(params, BUFFERS, opt, seed=0)
            rep_step = tdist.make_data_parallel_train_step(model_fn, F.mse_loss, opt, **KW)
            losses, rep_losses = [], []
            for batch in data[:STEPS]:
                state, metrics = step(state, _local(batch, rank, world))
                rep, rep_metrics = rep_step(rep, _local(batch, rank, world))
                losses.append(metrics["loss"])
                rep_losses.append(rep_metrics["loss"])
            tdist.save_sharded_checkpoint(os.path.join(root, "ckpt"), state, layout, opt)
            out["full_opt"] = tdist.gather_sharded_state(state, layout, opt).opt_state
            out["rep_opt"] = rep.opt_state
            out.update(params=layout.gather(state.params), loss=torch.stack(losses),
                       grad_norm=metrics["grad_norm"], buffers=state.buffers,
                       rep_params=rep.params, rep_loss=torch.stack(rep_losses),
                       rep_grad_norm=rep_metrics["grad_norm"], rep_buffers=rep.buffers,
                       mu=layout.gather(state.opt_state[0].mu))
            try:
                step(rep, _local(data[0], rank, world))
            except ValueError as e:
                out["replicated_state_error"] = str(e)
        else:  # resume from the checkpoint written on 4 ranks
            template = tdist.init_sharded_state({k: torch.zeros_like(v) for k, v in params.items()},
                                                BUFFERS, opt, layout, seed=123)
            state = tdist.load_sharded_checkpoint(os.path.join(root, "ckpt"), template, layout,
                                                  opt)
            out["loaded"] = layout.gather(state.params)
            out["loaded_mu"] = layout.gather(state.opt_state[0].mu)
            out["loaded_step"], out["loaded_seed"] = int(state.step), int(state.seed)
            out["loaded_buffers"] = state.buffers
            loaded, losses = state, []
            for batch in data[STEPS:]:
                state, metrics = step(state, _local(batch, rank, world))
                losses.append(metrics["loss"])
            out.update(params=layout.gather(state.params), loss=torch.stack(losses))
            if world == 2:  # compiled (aot_eager keeps CI fast): one graph, == eager
                counter = CompileCounterWithBackend("aot_eager")
                cstep = torch.compile(step, fullgraph=True, backend=counter)
                for batch in data[STEPS:]:
                    loaded, cmetrics = cstep(loaded, _local(batch, rank, world))
                out["compiled"] = {"params": loaded.params, "eager": state.params,
                                   "loss": cmetrics["loss"], "eager_loss": metrics["loss"],
                                   "frames": counter.frame_count}
        # torchopt's own AdamW keeps its moments as tuples in params order (no names); (not
        # torchopt.sgd(momentum=...): its trace keeps a `first_call` flag in a closure, outside
        # the state, so no checkpoint of it resumes exactly)
        adamw = torchopt.adamw(1e-2, weight_decay=0.1)
        sstep = tdist.make_sharded_train_step(model_fn, F.mse_loss, adamw, layout, **KW)
        if phase == "first":
            sstate = tdist.init_sharded_state(params, BUFFERS, adamw, layout, seed=0)
        else:
            sstate = tdist.load_sharded_checkpoint(
                os.path.join(root, "ckpt_adamw"), tdist.init_sharded_state(
                    params, BUFFERS, adamw, layout, seed=0), layout, adamw)
            out["adamw_loaded"] = tdist.gather_sharded_state(sstate, layout, adamw)
        for batch in data[:STEPS] if phase == "first" else data[STEPS:]:
            sstate, _ = sstep(sstate, _local(batch, rank, world))
        out["adamw"] = tdist.gather_sharded_state(sstate, layout, adamw)
        if phase == "first":
            tdist.save_sharded_checkpoint(os.path.join(root, "ckpt_adamw"), sstate, layout, adamw)
        if phase == "resume" and world == 2:
            # an infinite gradient in rank 0's shard only, the loss finite: every rank skips
            zeros = {"a": torch.zeros(8, dtype=F64)}
            lay = tdist.ShardLayout.from_params(zeros)
            sopt = adam(0.1)
            st = tdist.init_sharded_state(zeros, {}, sopt, lay, seed=0)

            def sqrt_fn(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
                return x * p["a"].sum() + p["a"][0].sqrt(), b

            inf_step = tdist.make_sharded_train_step(sqrt_fn, lambda o, y: (o - y).mean(), sopt,
                                                     lay)
            after, m = inf_step(st, (torch.ones(2, dtype=F64), torch.zeros(2, dtype=F64)))
            out["inf"] = {"skipped": bool(m["skipped"]), "changed": bool(
                (after.params["a"] != st.params["a"]).any()), "grad_norm": float(m["grad_norm"])}
        torch.save(out, os.path.join(root, f"{phase}_w{world}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict]]:
    root = tmp_path_factory.mktemp("sharded")
    plan = [("first", 4), ("resume", 2), ("resume", 1)]
    res = {}
    for phase, world in plan:
        mp.spawn(_rank_main, args=(world, _free_port(), str(root), phase), nprocs=world,
                 join=True)
        res[phase, world] = [torch.load(root / f"{phase}_w{world}_rank{r}.pt",
                                        weights_only=False) for r in range(world)]
    return res


def _reference(opt: Any = None) -> tuple[list, list, list, list]:
    """One process, 2 * STEPS steps over the global batches: params, losses, norms, states."""
    opt = adam(1e-2) if opt is None else opt
    state = init_train_state(init_params(), BUFFERS, opt, seed=0)
    step = make_train_step(model_fn, F.mse_loss, opt, **KW)
    params, losses, norms, states = [], [], [], []
    for batch in batches():
        state, metrics = step(state, batch)
        params.append(state.params)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        states.append(state)
    return params, losses, norms, states


def _close(a: dict, b: dict, **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TOL), msg=lambda m, k=k: f"{k}: {m}")


def test_sharded_equals_replicated_and_one_process(runs):
    res = runs["first", 4]
    params, losses, norms, _ = _reference()
    for r, out in enumerate(res):
        assert out["shard_shapes"] == {"w1": (7,), "b1": (2,), "w2": (4,), "b2": (1,)}, r
        assert out["mu_shapes"] == out["shard_shapes"]  # Adam's moments sharded too
        _close(out["params"], res[0]["params"], rtol=0, atol=0)  # the same on every rank
        _close(out["params"], out["rep_params"])
        _close(out["buffers"], out["rep_buffers"])
        torch.testing.assert_close(out["loss"], out["rep_loss"], **TOL)
        torch.testing.assert_close(out["grad_norm"], out["rep_grad_norm"], **TOL)
    _close(res[0]["params"], params[STEPS - 1])
    torch.testing.assert_close(res[0]["loss"], torch.stack(losses[:STEPS]), **TOL)
    torch.testing.assert_close(res[0]["grad_norm"], norms[STEPS - 1], **TOL)
    assert float(norms[STEPS - 1]) > KW["max_grad_norm"]  # clipping was exercised


@pytest.mark.parametrize("world", [2, 1])
def test_checkpoint_from_4_ranks_resumes_exactly(runs, world):
    first, res = runs["first", 4][0], runs["resume", world]
    params, losses, _, _ = _reference()
    for out in res:
        _close(out["loaded"], first["params"], rtol=0, atol=0)  # bit-exact round trip
        _close(out["loaded_mu"], first["mu"], rtol=0, atol=0)
        _close(out["loaded_buffers"], first["buffers"], rtol=0, atol=0)
        assert (out["loaded_step"], out["loaded_seed"]) == (STEPS, 0)
        _close(out["params"], res[0]["params"], rtol=0, atol=0)
        # 3 more steps continue the one-process run of 6
        _close(out["params"], params[-1])
        torch.testing.assert_close(out["loss"], torch.stack(losses[STEPS:]), **TOL)


def _close_leaves(a: Any, b: Any, **tol: float) -> None:
    la, sa = optree.tree_flatten(a, none_is_leaf=False, namespace="torchopt")
    lb, sb = optree.tree_flatten(b, none_is_leaf=False, namespace="torchopt")
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, **(tol or TOL))


def test_gathered_optimizer_state_equals_one_process(runs):
    _, _, _, states = _reference()
    for out in runs["first", 4]:
        _close_leaves(out["full_opt"], out["rep_opt"])
        _close_leaves(out["full_opt"], states[STEPS - 1].opt_state)


@pytest.mark.parametrize("world", [4, 2, 1])
def test_torchopt_adamw_tuple_state_shards_and_reshards(runs, world):
    _, _, _, states = _reference(torchopt.adamw(1e-2, weight_decay=0.1))
    res = runs["first" if world == 4 else "resume", world]
    first = runs["first", 4][0]["adamw"]
    for out in res:
        if world != 4:  # the moments written on 4 ranks, read back bit for bit
            _close(out["adamw_loaded"].params, first.params, rtol=0, atol=0)
            _close_leaves(out["adamw_loaded"].opt_state, first.opt_state, rtol=0, atol=0)
        want = states[STEPS - 1 if world == 4 else -1]
        _close(out["adamw"].params, want.params)
        _close_leaves(out["adamw"].opt_state, want.opt_state)


def test_compiled_sharded_step_equals_eager(runs):
    for out in runs["resume", 2]:
        c = out["compiled"]
        assert c["frames"] == 1  # fullgraph, no recompiles over 3 steps
        _close(c["params"], c["eager"])
        torch.testing.assert_close(c["loss"], c["eager_loss"], **TOL)


def test_nonfinite_in_one_shard_skips_on_every_rank(runs):
    res = runs["resume", 2]
    for out in res:
        assert out["inf"]["skipped"] and not out["inf"]["changed"]
        assert math.isinf(out["inf"]["grad_norm"])


def test_replicated_state_in_sharded_step_is_refused(runs):
    msg = runs["first", 4][0]["replicated_state_error"]
    assert "param 'w1' should be a flat shard of shape (7,)" in msg
    assert "got shape (4, 7)" in msg and "init_sharded_state" in msg


@pytest.mark.parametrize(("key", "value", "match"), [
    ("amp", "bf16", r"make_sharded_train_step\(amp=\.\.\.\): mixed precision is not sharded"),
    ("trainable", ["w1"], r"make_sharded_train_step\(trainable=\.\.\.\): frozen params"),
    ("grad_transform", lambda g: g, r"grad_transform=\.\.\.\): the sharded step sets its own"),
    ("bucket", 1, r"unexpected keyword argument 'bucket'"),
])
def test_unsupported_options_raise(key, value, match):
    with pytest.raises(TypeError, match=match):
        tdist.make_sharded_train_step(model_fn, F.mse_loss, adam(1e-2), None, **{key: value})


def test_layout_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"ShardLayout.from_params: torch.distributed is not "
                                           r"initialised"):
        tdist.ShardLayout.from_params(init_params())


@pytest.mark.parametrize("n", [1, 2, 11, 12, 1001])
def test_normal_slice_is_the_slice_of_the_global_draw(n):
    """The building block of a sharded DP-SGD step: each shard draws its part of one noise."""
    from torchfn.persample._dp_random import key_from_seed, normal, normal_slice

    key = key_from_seed(7)
    full = normal(key, (n,), F64)
    world = 4
    c = -(-n // world)
    parts = [normal_slice(key, n, r * c, max(0, min(c, n - r * c)), F64) for r in range(world)]
    assert torch.equal(torch.cat(parts), full)
    assert torch.equal(normal_slice(key, n, n // 3, n - n // 3, F64), full[n // 3:])
    with pytest.raises(ValueError, match=r"normal_slice\(n=5, start=3, length=3\)"):
        normal_slice(key, 5, 3, 3)
