"""torchfn.distributed on two real gloo ranks (CPU): every workload equals one process, float64.

One module-scoped ``mp.spawn`` runs all four workloads (data parallel, meta, ensembles,
DP-SGD) plus the checkpoint round trips on 2 ranks and saves what each rank ends with; the
tests below then compare it with the single-process run over the same global batch, computed
here in the test process. The custom-op kernels are not used (``TORCHFN_OPS=reference``): the
subject is the distribution, and a parallel kernel build would only cost time.
"""

from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path
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
from torchfn.distributed._reduce import BackwardOverlapReducer
from torchfn.ensembles import (
    Ensemble,
    ensemble_apply,
    init_ensemble_state,
    load_ensemble,
    make_ensemble_train_step,
    save_ensemble,
)
from torchfn.functional import init_train_state, load_checkpoint, make_train_step, save_checkpoint
from torchfn.meta import init_meta_state, make_meta_train_step, maml, sinusoid_tasks
from torchfn.optim import adam
from torchfn.persample import (
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

WORLD = 2
STEPS = 3
F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the problems, identical in the ranks and in the reference -----------------------------------


def mlp_fn(params: dict, buffers: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"], buffers


def dp_model_fn(params: dict, buffers: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The MLP plus a running mean of the inputs (a float buffer, like BatchNorm's)."""
    out, _ = mlp_fn(params, {}, x)
    return out, {"m": 0.9 * buffers["m"] + 0.1 * x.mean(0)}


def mlp_params(n_in: int, hidden: int, n_out: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(n_in, hidden, generator=g, dtype=F64) / math.sqrt(n_in),
            "b1": torch.zeros(hidden, dtype=F64),
            "w2": torch.randn(hidden, n_out, generator=g, dtype=F64) / math.sqrt(hidden),
            "b2": torch.zeros(n_out, dtype=F64)}


def dp_problem() -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Data parallel: 3 global batches of 16 (MSE), step with accumulation and clipping."""
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(16, 4, generator=g, dtype=F64), torch.randn(16, 2, generator=g,
                                                                       dtype=F64))
               for _ in range(STEPS)]
    return batches


DP_KW = {"grad_accum_steps": 2, "max_grad_norm": 0.3}
DP_BUFFERS = {"m": torch.zeros(4, dtype=F64)}
OVERLAP_KW = {"max_grad_norm": 0.3, "trainable": ("w1", "b1", "w2", "u")}  # b2 frozen
OVERLAP_EXTRA = {"u": torch.ones(3, dtype=F64)}


def meta_problem() -> tuple[Any, list]:
    learner = maml(mlp_fn, F.mse_loss, inner_lr=0.05, inner_steps=2)
    tasks = [sinusoid_tasks(8, 5, 5, generator=torch.Generator().manual_seed(100 + t),
                            dtype=F64)[0] for t in range(2)]
    return learner, tasks


def ens_problem() -> tuple[Ensemble, list, torch.Tensor]:
    def member() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()

    ens = Ensemble.from_seeds(member, seeds=range(4))
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 6, 3, generator=g, dtype=F64), torch.randint(0, 2, (4, 6),
                                                                           generator=g))
               for _ in range(STEPS)]
    return ens, batches, torch.randn(7, 3, generator=g, dtype=F64)


def dpsgd_problem() -> tuple[Any, dict, dict, Any, PoissonSampler, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ghost, params, buffers = make_ghost_model(module)
    opt = torchopt.sgd(0.5)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=0.7, max_grad_norm=0.5, sample_rate=0.25,
                              dataset_size=64)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 5, generator=g, dtype=F64), torch.randint(0, 3, (64,), generator=g)
    return step, params, buffers, opt, PoissonSampler(64, 0.25, 32, seed=9), x, y


def noise_problem() -> tuple[Any, dict, dict, Any]:
    """A step whose clipped sum is zero: the update is the noise alone (std sigma C / (q N))."""
    torch.manual_seed(1)
    ghost, params, buffers = make_ghost_model(nn.Linear(100, 50).double())
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.01,
                              dataset_size=100)
    return step, params, buffers, opt


# -- what each rank runs -------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        # data parallel: start from the checkpoint the single process wrote (load on W=2)
        batches = dp_problem()
        opt = adam(1e-2)
        state, _ = load_checkpoint(os.path.join(root, "dp_init.pt"), optimizer=opt)
        step = tdist.make_data_parallel_train_step(dp_model_fn, F.mse_loss, opt, bucket_mb=1e-3,
                                                   **DP_KW)
        losses = []
        for x, y in batches:
            half = x.shape[0] // world
            sl = slice(rank * half, (rank + 1) * half)
            state, metrics = step(state, (x[sl], y[sl]))
            losses.append(metrics["loss"])
        out["dp"] = {"params": state.params, "loss": torch.stack(losses),
                     "grad_norm": metrics["grad_norm"], "buffers": state.buffers}
        tdist.save_checkpoint_once(os.path.join(root, "dp_final.pt"), state,
                                   extra={"steps": STEPS})

        # overlap_backward: bucket all-reduces launched from the gradient hooks; buckets of
        # ~200 bytes, reversed: [u, w2], [b1], [w1]; u is unused by the model (its hook never
        # fires), so [u, w2] never completes and falls back to the all-reduce after the backward
        ostate = init_train_state({**mlp_params(4, 8, 2, seed=1), **OVERLAP_EXTRA}, DP_BUFFERS,
                                  opt, seed=0)
        ostep = tdist.make_data_parallel_train_step(dp_model_fn, F.mse_loss, opt,
                                                    overlap_backward=True, bucket_mb=2e-4,
                                                    **OVERLAP_KW)
        plain = tdist.make_data_parallel_train_step(dp_model_fn, F.mse_loss, opt, **OVERLAP_KW)
        # compiled, the flag changes nothing (no hooks; the bucketed all-reduce is traced)
        ocounter = CompileCounterWithBackend("aot_eager")
        cstep = torch.compile(tdist.make_data_parallel_train_step(
            dp_model_fn, F.mse_loss, opt, overlap_backward=True, **OVERLAP_KW),
            fullgraph=True, backend=ocounter)
        pstate = cstate = ostate
        for x, y in batches:
            half = x.shape[0] // world
            sl = slice(rank * half, (rank + 1) * half)
            ostate, ometrics = ostep(ostate, (x[sl], y[sl]))
            pstate, _ = plain(pstate, (x[sl], y[sl]))
            cstate, _ = cstep(cstate, (x[sl], y[sl]))
        try:
            tdist.make_data_parallel_train_step(dp_model_fn, F.mse_loss, opt,
                                                overlap_backward=True, grad_accum_steps=2)
            accum_error = ""
        except ValueError as e:
            accum_error = str(e)
        # the hooks fire during the backward, last layer first; u (unused) and b2 (frozen) not
        hooks = BackwardOverlapReducer(bucket_mb=1e-6)  # one param per bucket
        hstep = make_train_step(hooks.wrap(dp_model_fn), F.mse_loss, opt,
                                grad_transform=hooks.reduce, **OVERLAP_KW)
        hooks.begin()
        hstep(init_train_state({**mlp_params(4, 8, 2, seed=1), **OVERLAP_EXTRA},
                               DP_BUFFERS, opt, seed=0), batches[0])
        out["dp_overlap"] = {"params": ostate.params, "plain": pstate.params,
                             "grad_norm": ometrics["grad_norm"], "accum_error": accum_error,
                             "order": hooks.last_launched, "compiled": cstate.params,
                             "frames": ocounter.frame_count}

        # eager dropout: each rank draws its own masks (seed folded with the rank)
        def drop_fn(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
            return x @ p["w"], {"mask": F.dropout(torch.ones(64, dtype=F64), 0.5)}

        dstate = init_train_state({"w": torch.zeros(4, 2, dtype=F64)},
                                  {"mask": torch.ones(64, dtype=F64)}, opt, seed=5)
        drop_step = tdist.make_data_parallel_train_step(drop_fn, F.mse_loss, opt,
                                                        sync_buffers=False)
        after, _ = drop_step(dstate, (batches[0][0][:8], batches[0][1][:8]))
        out["dropout"] = {"mask": after.buffers["mask"], "seed": after.seed}

        # meta-learning: tasks of each meta-batch split over the ranks
        learner, metabatches = meta_problem()
        mstate = init_meta_state(learner, mlp_params(1, 16, 1, seed=2), {}, adam(1e-2))
        mstep = tdist.make_distributed_meta_train_step(learner, adam(1e-2))
        for tasks in metabatches:
            mstate, mmetrics = mstep(mstate, tdist.shard_tasks(tasks, rank=rank,
                                                               world_size=world))
        out["meta"] = {"params": mstate.params, "loss": mmetrics["loss"]}

        # ensembles: members split over the ranks, no communication while training
        ens, ebatches, xtest = ens_problem()
        eopt = adam(1e-2)
        full = init_ensemble_state(ens, eopt, seed=0)
        local = tdist.shard_members(full, rank=rank, world_size=world)
        mine = tdist.member_range(ens.n_members, rank=rank, world_size=world)
        estep = make_ensemble_train_step(ens.model_fn, F.cross_entropy, eopt)
        for x, y in ebatches:
            local, _ = estep(local, (x[mine.start:mine.stop], y[mine.start:mine.stop]))
        logits = tdist.sharded_ensemble_apply(ens.model_fn, local.params, local.buffers, xtest)
        tdist.save_ensemble_gathered(os.path.join(root, "ens_w2.pt"), local)
        loaded, extra = tdist.load_ensemble_shard(os.path.join(root, "ens_w1.pt"), rank=rank,
                                                  world_size=world, optimizer=eopt)
        out["ens"] = {"local": local.params, "logits": logits, "loaded": loaded.params,
                      "loaded_mu": loaded.opt_state[0].mu, "extra": extra}

        # DP-SGD: global Poisson draw dealt over the ranks, several physical batches each
        step_dp, params, buffers, opt_dp, sampler, xs, ys = dpsgd_problem()
        dstep = tdist.DistributedDPStep(step_dp, bucket_mb=1e-3)
        dstate = init_dp_state(params, buffers, opt_dp, seed=4)
        acct = RDPAccountant()
        n_chunks = []
        for t in range(STEPS):
            chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                                physical_batch_size=4)
            n_chunks.append(len(chunks))
            dstate, dmetrics = dstep.run(dstate, chunks, lambda i: (xs[i], ys[i]), acct)
        out["dpsgd"] = {"params": dstate.params, "metrics": dmetrics, "n_chunks": n_chunks,
                        "eps": acct.get_epsilon(1e-5)}

        # DP-SGD noise: a step with nothing valid on any rank moves the params by noise alone
        nstep, nparams, nbuffers, nopt = noise_problem()
        nstate = init_dp_state(nparams, nbuffers, nopt, seed=8)
        x0 = torch.zeros(3, 100, dtype=F64)
        after, _ = tdist.DistributedDPStep(nstep)(nstate, (x0, torch.zeros(3, dtype=torch.long)),
                                                  torch.zeros(3, dtype=torch.bool))
        out["noise"] = {k: after.params[k] - nparams[k] for k in nparams}

        # the bucketed all-reduce traces into one graph (functional collectives), == eager;
        # aot_eager keeps CI fast, the slow test_distributed_compile.py runs Inductor
        counter = CompileCounterWithBackend("aot_eager")
        reduce = torch.compile(tdist.all_reduce_tree, fullgraph=True, backend=counter)
        tree = {"a": torch.full((3, 2), rank + 1.0, dtype=F64),
                "b": torch.arange(5, dtype=torch.float32) * (rank + 1)}
        out["compiled_reduce"] = (reduce(tree, bucket_mb=1e-5), tdist.all_reduce_tree(tree),
                                  counter.frame_count)

        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
        # no rank tears gloo down while the other may still be finishing its last collective
        # (that race aborted a rank: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def _reference_ops() -> Any:
    """Use the custom ops' pure-PyTorch twins here and in the ranks (module docstring)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHFN_OPS", "reference")
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Run the workloads on 2 gloo ranks; return ``(root, [rank0 results, rank1 results])``."""
    root = tmp_path_factory.mktemp("dist")
    opt = adam(1e-2)
    save_checkpoint(root / "dp_init.pt",
                    init_train_state(mlp_params(4, 8, 2, seed=1), DP_BUFFERS, opt, seed=0))
    ens, ebatches, _ = ens_problem()
    trained = _ens_reference(ens, ebatches)
    save_ensemble(root / "ens_w1.pt", trained, extra={"by": "one process"})
    mp.spawn(_rank_main, args=(WORLD, _free_port(), str(root)), nprocs=WORLD, join=True)
    return root, [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- single-process references -------------------------------------------------------------------


def _ens_reference(ens: Ensemble, batches: list) -> Any:
    opt = adam(1e-2)
    state = init_ensemble_state(ens, opt, seed=0)
    step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)
    for batch in batches:
        state, _ = step(state, batch)
    return state


def _assert_tree_close(a: dict, b: dict, **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **(tol or TOL), msg=lambda m, k=k: f"{k}: {m}")


def _assert_replicated(res: list[dict], *path: str) -> None:
    a, b = res[0], res[1]
    for p in path:
        a, b = a[p], b[p]
    for k in a:
        assert torch.equal(a[k], b[k]), f"ranks differ at {'/'.join(path)}/{k}"


# -- the tests -----------------------------------------------------------------------------------


def test_data_parallel_equals_one_process(ranks):
    root, res = ranks
    batches = dp_problem()
    opt = adam(1e-2)
    state = init_train_state(mlp_params(4, 8, 2, seed=1), DP_BUFFERS, opt, seed=0)
    step = make_train_step(dp_model_fn, F.mse_loss, opt, **DP_KW)
    losses = []
    m = DP_BUFFERS["m"]
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        # sync_buffers: the mean over ranks of what each rank's micro-batches (4 + 4) gave
        x = batch[0]
        m = torch.stack([0.9 * (0.9 * m + 0.1 * x[r:r + 4].mean(0)) + 0.1 * x[r + 4:r + 8].mean(0)
                         for r in (0, 8)]).mean(0)
    _assert_replicated(res, "dp", "params")
    _assert_replicated(res, "dp", "buffers")
    torch.testing.assert_close(res[0]["dp"]["buffers"]["m"], m, **TOL)
    _assert_tree_close(res[0]["dp"]["params"], state.params)
    torch.testing.assert_close(res[0]["dp"]["loss"], torch.stack(losses), **TOL)
    torch.testing.assert_close(res[0]["dp"]["grad_norm"], metrics["grad_norm"], **TOL)
    assert float(metrics["grad_norm"]) > DP_KW["max_grad_norm"]  # clipping was exercised
    # saved once by rank 0, loaded here in a world of one
    loaded, extra = load_checkpoint(root / "dp_final.pt", optimizer=opt)
    assert extra == {"steps": STEPS} and int(loaded.step) == STEPS
    _assert_tree_close(loaded.params, res[0]["dp"]["params"], rtol=0, atol=0)


def test_data_parallel_overlap_backward_equals_one_process(ranks):
    _, res = ranks
    opt = adam(1e-2)
    state = init_train_state({**mlp_params(4, 8, 2, seed=1), **OVERLAP_EXTRA}, DP_BUFFERS, opt,
                             seed=0)
    step = make_train_step(dp_model_fn, F.mse_loss, opt, **OVERLAP_KW)
    for batch in dp_problem():
        state, metrics = step(state, batch)
    _assert_replicated(res, "dp_overlap", "params")
    got = res[0]["dp_overlap"]
    _assert_tree_close(got["params"], state.params)
    torch.testing.assert_close(got["grad_norm"], metrics["grad_norm"], **TOL)
    assert not torch.equal(got["params"]["w1"], mlp_params(4, 8, 2, seed=1)["w1"])  # trained
    assert torch.equal(got["params"]["b2"], state.params["b2"])  # frozen, untouched
    # the same elementwise sums as the bucketed all-reduce: bitwise equal to the plain step
    for k, v in got["plain"].items():
        assert torch.equal(got["params"][k], v), k
    _assert_tree_close(got["compiled"], got["params"])
    assert got["frames"] == 1
    # w2 is the last layer: its gradient is ready first (b1/w1 in either order)
    assert got["order"][0] == "w2" and set(got["order"]) == {"w1", "b1", "w2"}
    assert re.search(r"overlap_backward=True, grad_accum_steps=2\): the gradient hooks would "
                     r"all-reduce every micro-batch", got["accum_error"])


def test_data_parallel_dropout_differs_per_rank(ranks):
    _, res = ranks
    a, b = res[0]["dropout"], res[1]["dropout"]
    assert not torch.equal(a["mask"], b["mask"])
    assert int(a["seed"]) == int(b["seed"]) == 5  # the state's seed is left as it was


def test_meta_equals_one_process(ranks):
    _, res = ranks
    learner, metabatches = meta_problem()
    state = init_meta_state(learner, mlp_params(1, 16, 1, seed=2), {}, adam(1e-2))
    step = make_meta_train_step(learner, adam(1e-2))
    for tasks in metabatches:
        state, metrics = step(state, tasks)
    _assert_replicated(res, "meta", "params")
    _assert_tree_close(res[0]["meta"]["params"], state.params)
    torch.testing.assert_close(res[0]["meta"]["loss"], metrics["loss"], **TOL)


def test_ensemble_equals_one_process_and_gathers(ranks):
    root, res = ranks
    ens, batches, xtest = ens_problem()
    ref = _ens_reference(ens, batches)
    local = {k: torch.cat([res[0]["ens"]["local"][k], res[1]["ens"]["local"][k]])
             for k in ref.params}
    _assert_tree_close(local, ref.params)
    logits, _ = ensemble_apply(ens.model_fn, ref.params, ref.buffers, xtest)
    for r in range(WORLD):
        assert res[r]["ens"]["logits"].shape == (4, 7, 2)
        torch.testing.assert_close(res[r]["ens"]["logits"], logits, **TOL)
    # written once on 2 ranks, read back in one process: the whole (N, ...) stack
    saved, _ = load_ensemble(root / "ens_w2.pt", optimizer=adam(1e-2), n_members=4)
    _assert_tree_close(saved.params, ref.params)
    _assert_tree_close(saved.opt_state[0].mu, ref.opt_state[0].mu)
    # written by one process, read on 2 ranks: each rank gets its own members
    for r in range(WORLD):
        mine = slice(2 * r, 2 * r + 2)
        _assert_tree_close(res[r]["ens"]["loaded"], {k: v[mine] for k, v in ref.params.items()},
                           rtol=0, atol=0)
        _assert_tree_close(res[r]["ens"]["loaded_mu"],
                           {k: v[mine] for k, v in ref.opt_state[0].mu.items()}, rtol=0, atol=0)
        assert res[r]["ens"]["extra"] == {"by": "one process"}


def test_dpsgd_equals_one_process(ranks):
    _, res = ranks
    step, params, buffers, opt, sampler, xs, ys = dpsgd_problem()
    state = init_dp_state(params, buffers, opt, seed=4)
    acct = RDPAccountant()
    for t in range(STEPS):
        state, metrics = step.run(state, sampler.sample(t), lambda i: (xs[i], ys[i]), acct)
    _assert_replicated(res, "dpsgd", "params")
    _assert_tree_close(res[0]["dpsgd"]["params"], state.params)
    for k in ("loss", "batch_size", "clip_fraction", "grad_norm_mean"):
        torch.testing.assert_close(res[0]["dpsgd"]["metrics"][k], metrics[k], **TOL)
    assert max(res[0]["dpsgd"]["n_chunks"]) > 1  # several physical batches on a rank
    assert res[0]["dpsgd"]["eps"] == res[1]["dpsgd"]["eps"] == acct.get_epsilon(1e-5)


def test_dpsgd_noise_is_added_once(ranks):
    _, res = ranks
    step, params, buffers, opt = noise_problem()
    state = init_dp_state(params, buffers, opt, seed=8)
    x0 = torch.zeros(3, 100, dtype=F64)
    after, _ = step(state, (x0, torch.zeros(3, dtype=torch.long)),
                    torch.zeros(3, dtype=torch.bool))
    single = {k: after.params[k] - params[k] for k in params}
    _assert_replicated(res, "noise")
    _assert_tree_close(res[0]["noise"], single)
    # lr 1, sigma C = 1, q N = 1: the update is one N(0, 1) draw per parameter; noising on
    # each rank and summing would give std sqrt(2)
    flat = torch.cat([v.flatten() for v in res[0]["noise"].values()])
    assert flat.numel() == 5050
    assert 0.95 < float(flat.std()) < 1.05


# -- in-process checks (no process group) --------------------------------------------------------


def test_compiled_all_reduce_equals_eager(ranks):
    _, res = ranks
    for r in range(WORLD):
        compiled, eager, frames = res[r]["compiled_reduce"]
        assert frames == 1
        assert compiled.keys() == eager.keys() == {"a", "b"}
        for k in eager:
            assert compiled[k].dtype == eager[k].dtype and torch.equal(compiled[k], eager[k])
        torch.testing.assert_close(eager["a"], torch.full((3, 2), 1.5, dtype=F64))
        torch.testing.assert_close(eager["b"], torch.arange(5.0) * 1.5)


def test_clear_errors_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"make_grad_reducer: torch.distributed is not "
                                           r"initialised.*torchrun"):
        tdist.make_data_parallel_train_step(mlp_fn, F.mse_loss, adam(1e-2))
    with pytest.raises(RuntimeError, match=r"make_distributed_meta_train_step: torch\.distributed"):
        tdist.make_distributed_meta_train_step(meta_problem()[0], adam(1e-2))
    with pytest.raises(RuntimeError, match=r"DistributedDPStep: torch\.distributed"):
        tdist.DistributedDPStep(noise_problem()[0])
    with pytest.raises(RuntimeError, match=r"all_reduce_tree: torch\.distributed"):
        tdist.all_reduce_tree({"w": torch.ones(2)})


def test_clear_errors_for_uneven_splits():
    with pytest.raises(ValueError, match=r"member_range\(n=5, world_size=2\): 5 members cannot"):
        tdist.member_range(5, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"0 <= rank < world_size"):
        tdist.member_range(4, rank=2, world_size=2)
    tasks = sinusoid_tasks(6, 2, 2, generator=torch.Generator().manual_seed(0))[0]
    with pytest.raises(ValueError, match=r"has 6 tasks, not divisible by the world size"):
        tdist.shard_tasks(tasks, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"dim-0 sizes \[2, 3\]"):
        tdist.shard_members({"a": torch.zeros(2), "b": torch.zeros(3)}, rank=0, world_size=1)


def test_shard_poisson_sample_partitions_the_draw():
    sampler = PoissonSampler(500, 0.1, 16, seed=3)
    for t in range(3):
        parts = [tdist.shard_poisson_sample(sampler, t, rank=r, world_size=3) for r in range(3)]
        got = sorted(int(i) for chunks in parts for idx, v in chunks for i in idx[v])
        assert got == torch.nonzero(sampler.mask(t)).flatten().tolist()
        sizes = [sum(int(v.sum()) for _, v in chunks) for chunks in parts]
        assert max(sizes) - min(sizes) <= 1
        assert all(idx.shape == (16,) for chunks in parts for idx, _ in chunks)
