"""Compiled distributed steps on two gloo ranks: compiled == eager, one graph, no recompiles.

``torch.compile(fullgraph=True)`` over the data-parallel train step and the distributed meta
step, and :meth:`DistributedDPStep.compile`, each run for 3 steps next to the eager step on the
same rank; the functional collectives must trace (a graph break would fail ``fullgraph``) and
the second and third calls must reuse the first graph.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn import distributed as tdist
from torchfn.functional import init_train_state
from torchfn.meta import init_meta_state
from torchfn.optim import adam
from torchfn.persample import init_dp_state

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

WORLD = 2
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    from tests.test_distributed import (
        DP_KW,
        dp_problem,
        dpsgd_problem,
        meta_problem,
        mlp_fn,
        mlp_params,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    try:
        opt = adam(1e-2)
        step = tdist.make_data_parallel_train_step(mlp_fn, F.mse_loss, opt, bucket_mb=1e-3,
                                                   **DP_KW)
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, fullgraph=True, backend=counter)
        eager_state = comp_state = init_train_state(mlp_params(4, 8, 2, seed=1), {}, opt, seed=0)
        for x, y in dp_problem():
            half = x.shape[0] // world
            batch = (x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
            eager_state, _ = step(eager_state, batch)
            comp_state, _ = compiled(comp_state, batch)
        out["dp"] = (eager_state.params, comp_state.params, counter.frame_count)

        learner, metabatches = meta_problem()
        mstep = tdist.make_distributed_meta_train_step(learner, adam(1e-2))
        counter = CompileCounterWithBackend("inductor")
        mcompiled = torch.compile(mstep, fullgraph=True, backend=counter)
        e = c = init_meta_state(learner, mlp_params(1, 16, 1, seed=2), {}, adam(1e-2))
        for tasks in metabatches + metabatches[:1]:
            local = tdist.shard_tasks(tasks, rank=rank, world_size=world)
            e, _ = mstep(e, local)
            c, _ = mcompiled(c, local)
        out["meta"] = (e.params, c.params, counter.frame_count)

        step_dp, params, buffers, opt_dp, sampler, xs, ys = dpsgd_problem()
        dstep = tdist.DistributedDPStep(step_dp)
        counter = CompileCounterWithBackend("inductor")
        dcompiled = dstep.compile(backend=counter)
        e = c = init_dp_state(params, buffers, opt_dp, seed=4)
        frames = []
        for t in range(4):  # steps 0, 1: one physical batch; 2, 3: several (1 + 2 graphs)
            chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                                physical_batch_size=24 if t < 2 else 4)
            assert (len(chunks) > 1) == (t >= 2)
            e, _ = dstep.run(e, chunks, lambda i: (xs[i], ys[i]))
            c, _ = dcompiled.run(c, chunks, lambda i: (xs[i], ys[i]))
            frames.append(counter.frame_count)
        # no recompiles within a path (the multi-chunk path may add an empty Dynamo frame)
        assert frames[1] == frames[0] == 1 and frames[3] == frames[2] >= 3, frames
        out["dpsgd"] = (e.params, c.params, 1)
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other finishes (see test_distributed)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~2 min on 2 CPU cores (three Inductor compiles per rank)
def test_compiled_distributed_steps_equal_eager_without_recompiles(tmp_path: Path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHFN_OPS", "reference")  # the ops' twins: no kernel build in the ranks
        mp.spawn(_rank_main, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for name in ("dp", "meta", "dpsgd"):  # dpsgd's graph counts are asserted in the ranks
        for r in range(WORLD):
            eager, compiled, frames = res[r][name]
            assert frames == 1, f"{name}: {frames} graphs, expected one (a recompile or break)"
            for k in eager:
                torch.testing.assert_close(compiled[k], eager[k], **TOL,
                                           msg=lambda m, k=k, n=name: f"{n}/{k}: {m}")
        for k in res[0][name][1]:
            assert torch.equal(res[0][name][1][k], res[1][name][1][k]), f"{name}/{k}: ranks differ"
