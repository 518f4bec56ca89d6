"""Scaling of torchfn.distributed: 1 vs 2 processes for the four workloads, plus equality checks.

For each workload the same per-process work runs on 1 process (the plain single-process step,
no torch.distributed) and on 2 processes (the distributed step; weak scaling: every rank keeps
the 1-process local batch / tasks / members, so the global work doubles):

- ``data_parallel``: ``make_data_parallel_train_step`` on an MLP (bucketed all-reduce of the
  gradient, 25 MB buckets), examples/s;
- ``meta``: ``make_distributed_meta_train_step``, second-order MAML on sinusoid tasks, tasks/s;
- ``ensemble``: each rank trains its own members with ``make_ensemble_train_step`` (no
  communication), member-examples/s; the all-gather of predictions is timed separately;
- ``dpsgd``: ``DistributedDPStep`` (ghost clipping, sum all-reduce, noise once), examples/s.

scaling efficiency = throughput(2 processes) / (2 x throughput(1 process)).

Then, on the 2 processes, every workload's distributed step is checked against the
single-process step over the same global batch in float64 (run on rank 0 of the same job), and
the data-parallel step once more compiled (``torch.compile(fullgraph=True)``, graph count
recorded). NCCL on CUDA, gloo on the CPU; nothing here changes NCCL's environment (NVLink
multicast stays as the machine has it).

Run::

    python benchmarks/distributed.py --out benchmarks/results/distributed-h200x2.json   # 2 GPUs
    python benchmarks/distributed.py --small --device cpu --out /tmp/dist.json           # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchopt
from _bench import time_calls
from torch import nn

from torchfn import distributed as tdist
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import init_train_state, make_functional, make_train_step
from torchfn.meta import init_meta_state, make_meta_train_step, maml, sinusoid_tasks
from torchfn.optim import adam
from torchfn.persample import PoissonSampler, init_dp_state, make_dp_train_step, make_ghost_model

F64 = torch.float64


def _sizes(small: bool) -> dict[str, Any]:
    if small:
        return {"dp_dims": (32, 64, 64, 10), "dp_batch": 32, "meta_tasks": 4, "meta_hidden": 20,
                "meta_inner": 1, "ens_members": 2, "ens_dims": (16, 32, 4), "ens_batch": 32,
                "dpsgd_dims": (32, 64, 10), "dpsgd_batch": 32, "steps": 5, "warmup": 2}
    return {"dp_dims": (1024, 4096, 4096, 1024, 10), "dp_batch": 512, "meta_tasks": 32,
            "meta_hidden": 40, "meta_inner": 5, "ens_members": 8, "ens_dims": (256, 512, 10),
            "ens_batch": 256, "dpsgd_dims": (784, 1024, 1024, 10), "dpsgd_batch": 512,
            "steps": 30, "warmup": 5}


def _mlp(dims: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _time(fn: Any, state: Any, steps: int, warmup: int, device: torch.device,
          distributed: bool) -> float:
    """Return seconds per step (slowest rank) of ``state = fn(state)`` after ``warmup``."""
    box = [state]

    def call() -> None:
        box[0] = fn(box[0])

    t = time_calls(call, device, warmup=warmup, repeats=1, inner=steps,
                   before_repeats=dist.barrier if distributed else None)
    elapsed = torch.tensor(t.median_s, dtype=F64, device=device)
    if distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


# -- throughput ----------------------------------------------------------------------------------


def _bench(world: int, rank: int, device: torch.device, sz: dict[str, Any]) -> dict[str, Any]:
    distributed = world > 1
    steps, warmup = sz["steps"], sz["warmup"]
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1000 + rank)

    # data parallel
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(_mlp(sz["dp_dims"]).to(device))
    opt = adam(1e-3)
    state = init_train_state(params, buffers, opt, seed=0)
    b = sz["dp_batch"]
    x = torch.randn(b, sz["dp_dims"][0], generator=g).to(device)
    y = torch.randint(0, sz["dp_dims"][-1], (b,), generator=g).to(device)
    step = (tdist.make_data_parallel_train_step(model_fn, F.cross_entropy, opt)
            if distributed else make_train_step(model_fn, F.cross_entropy, opt))
    sec = _time(lambda s: step(s, (x, y))[0], state, steps, warmup, device, distributed)
    n_params = sum(p.numel() for p in params.values())
    out["data_parallel"] = {"unit": "examples/s", "throughput": world * b / sec,
                            "step_ms": 1e3 * sec, "local_batch": b, "params": n_params,
                            "grad_MB": 4 * n_params / 2**20}
    if distributed:  # bucket size: one tensor per bucket ... everything in one bucket
        sweep = {}
        for mb in (1.0, 4.0, 25.0, 1e6):
            s_mb = tdist.make_data_parallel_train_step(model_fn, F.cross_entropy, opt,
                                                       bucket_mb=mb)
            sweep[f"{mb:g}"] = 1e3 * _time(lambda s, f=s_mb: f(s, (x, y))[0], state, steps,
                                           warmup, device, distributed)
        out["data_parallel"]["step_ms_by_bucket_mb"] = sweep

    # meta
    torch.manual_seed(0)
    h = sz["meta_hidden"]
    mfn, mparams, mbuffers = make_functional(_mlp((1, h, h, 1)).to(device))
    learner = maml(mfn, F.mse_loss, inner_lr=0.01, inner_steps=sz["meta_inner"])
    mopt = adam(1e-3)
    mstate = init_meta_state(learner, mparams, mbuffers, mopt)
    tasks = sinusoid_tasks(sz["meta_tasks"], 10, 10, generator=g, device=device)[0]
    mstep = (tdist.make_distributed_meta_train_step(learner, mopt) if distributed
             else make_meta_train_step(learner, mopt))
    sec = _time(lambda s: mstep(s, tasks)[0], mstate, steps, warmup, device, distributed)
    out["meta"] = {"unit": "tasks/s", "throughput": world * sz["meta_tasks"] / sec,
                   "step_ms": 1e3 * sec, "local_tasks": sz["meta_tasks"],
                   "inner_steps": sz["meta_inner"]}

    # ensemble: this rank's members (world 2: members [r n, (r+1) n) of 2n)
    n = sz["ens_members"]
    # members built on the device: an ensemble's model_fn checks where its params live
    ens = Ensemble.from_seeds(lambda: _mlp(sz["ens_dims"]).to(device),
                              seeds=range(rank * n, rank * n + n))
    eopt = adam(1e-3)
    estate = init_ensemble_state(ens, eopt, seed=0)
    estate = estate._replace(params={k: v.to(device) for k, v in estate.params.items()},
                             buffers={k: v.to(device) for k, v in estate.buffers.items()},
                             opt_state=eopt.init({k: v.to(device)
                                                  for k, v in estate.params.items()}))
    eb = sz["ens_batch"]
    ex = torch.randn(n, eb, sz["ens_dims"][0], generator=g).to(device)
    ey = torch.randint(0, sz["ens_dims"][-1], (n, eb), generator=g).to(device)
    estep = make_ensemble_train_step(ens.model_fn, F.cross_entropy, eopt)
    sec = _time(lambda s: estep(s, (ex, ey))[0], estate, steps, warmup, device, distributed)
    out["ensemble"] = {"unit": "member-examples/s", "throughput": world * n * eb / sec,
                       "step_ms": 1e3 * sec, "local_members": n, "batch_per_member": eb}
    if distributed:
        xt = ex[0]

        def predict(s: Any) -> Any:
            tdist.sharded_ensemble_apply(ens.model_fn, s.params, s.buffers, xt)
            return s

        out["ensemble"]["gathered_predict_ms"] = 1e3 * _time(predict, estate, steps, warmup,
                                                             device, distributed)

    # DP-SGD: local physical batch fully valid; global dataset sized so q N = global batch
    torch.manual_seed(0)
    ghost, dparams, dbuffers = make_ghost_model(_mlp(sz["dpsgd_dims"]).to(device))
    dopt = torchopt.sgd(0.1)
    db = sz["dpsgd_batch"]
    dataset_size = 100 * world * db
    dpstep = make_dp_train_step(ghost, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                                dopt, noise_multiplier=1.0, max_grad_norm=1.0,
                                sample_rate=0.01, dataset_size=dataset_size)
    dstate = init_dp_state(dparams, dbuffers, dopt, seed=0)
    dx = torch.randn(db, sz["dpsgd_dims"][0], generator=g).to(device)
    dy = torch.randint(0, sz["dpsgd_dims"][-1], (db,), generator=g).to(device)
    valid = torch.ones(db, dtype=torch.bool, device=device)
    run = tdist.DistributedDPStep(dpstep) if distributed else dpstep
    sec = _time(lambda s: run(s, (dx, dy), valid)[0], dstate, steps, warmup, device,
                distributed)
    out["dpsgd"] = {"unit": "examples/s", "throughput": world * db / sec, "step_ms": 1e3 * sec,
                    "local_batch": db}
    return out


# -- equality (float64, distributed vs one process over the global batch) -----------------------


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = math.sqrt(sum(float((a[k] - b[k]).double().square().sum()) for k in a))
    den = math.sqrt(sum(float(b[k].double().square().sum()) for k in b))
    return num / max(den, 1e-300)


def _check(rank: int, world: int, device: torch.device, compile_check: bool) -> dict[str, Any]:
    """Run each distributed step on float64 data; rank 0 compares with the one-process step."""
    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)

    def split(t: torch.Tensor) -> torch.Tensor:
        per = t.shape[0] // world
        return t[rank * per:(rank + 1) * per]

    # data parallel (eager, and compiled)
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(_mlp((8, 32, 4)).to(device, F64))
    opt = adam(1e-2)
    batches = [(torch.randn(32, 8, generator=g, dtype=F64).to(device),
                torch.randint(0, 4, (32,), generator=g).to(device)) for _ in range(3)]
    kw = {"max_grad_norm": 0.5, "grad_accum_steps": 2}
    variants = {"data_parallel": False} | ({"data_parallel_compiled": True}
                                            if compile_check else {})
    for name, compiled in variants.items():
        step = tdist.make_data_parallel_train_step(model_fn, F.cross_entropy, opt, **kw)
        frames = None
        if compiled:
            from torch._dynamo.testing import CompileCounterWithBackend

            counter = CompileCounterWithBackend("inductor")
            step = torch.compile(step, fullgraph=True, backend=counter)
        state = init_train_state(params, buffers, opt, seed=0)
        for x, y in batches:
            state, _ = step(state, (split(x), split(y)))
        if compiled:
            frames = counter.frame_count
        ref_step = make_train_step(model_fn, F.cross_entropy, opt, **kw)
        ref = init_train_state(params, buffers, opt, seed=0)
        for batch in batches:
            ref, _ = ref_step(ref, batch)
        res[name] = {"rel_err": _rel_err(state.params, ref.params), "graphs": frames}

    # meta
    mfn, mparams, mbuffers = make_functional(_mlp((1, 16, 1)).to(device, F64))
    learner = maml(mfn, F.mse_loss, inner_lr=0.05, inner_steps=2)
    tasks = sinusoid_tasks(4 * world, 5, 5, generator=g, dtype=F64, device=device)[0]
    mstate = ref = init_meta_state(learner, mparams, mbuffers, adam(1e-2))
    mstep = tdist.make_distributed_meta_train_step(learner, adam(1e-2))
    ref_step = make_meta_train_step(learner, adam(1e-2))
    for _ in range(2):
        mstate, _ = mstep(mstate, tdist.shard_tasks(tasks, rank=rank, world_size=world))
        ref, _ = ref_step(ref, tasks)
    res["meta"] = {"rel_err": _rel_err(mstate.params, ref.params)}

    # ensemble: gather trained members + checkpoint round trip on the job's world size
    ens = Ensemble.from_seeds(lambda: _mlp((6, 16, 3)).to(device, F64), seeds=range(2 * world))
    eopt = adam(1e-2)
    full = init_ensemble_state(ens, eopt, seed=0)
    full = full._replace(params={k: v.to(device) for k, v in full.params.items()},
                         opt_state=eopt.init({k: v.to(device) for k, v in full.params.items()}))
    local = tdist.shard_members(full, rank=rank, world_size=world)
    ex = torch.randn(2 * world, 8, 6, generator=g, dtype=F64).to(device)
    ey = torch.randint(0, 3, (2 * world, 8), generator=g).to(device)
    estep = make_ensemble_train_step(ens.model_fn, F.cross_entropy, eopt)
    r = tdist.member_range(2 * world, rank=rank, world_size=world)
    for _ in range(2):
        local, _ = estep(local, (ex[r.start:r.stop], ey[r.start:r.stop]))
        full, _ = estep(full, (ex, ey))
    gathered = tdist.gather_members(local)
    res["ensemble"] = {"rel_err": _rel_err(gathered.params, full.params)}
    path = os.path.join(tempfile.gettempdir(), f"torchfn_bench_ens_{os.getppid()}.pt")
    tdist.save_ensemble_gathered(path, local)
    back, _ = tdist.load_ensemble_shard(path, rank=rank, world_size=world, map_location=device)
    res["ensemble"]["checkpoint_rel_err"] = _rel_err(back.params, local.params)
    dist.barrier()
    if rank == 0:
        os.unlink(path)

    # DP-SGD
    torch.manual_seed(0)
    ghost, dparams, dbuffers = make_ghost_model(_mlp((6, 16, 3)).to(device, F64))
    dopt = torchopt.sgd(0.5)
    dstep = make_dp_train_step(ghost, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                               dopt, noise_multiplier=0.7, max_grad_norm=0.5,
                               sample_rate=0.25, dataset_size=64)
    sampler_x = torch.randn(64, 6, generator=g, dtype=F64).to(device)
    sampler_y = torch.randint(0, 3, (64,), generator=g).to(device)
    sampler = PoissonSampler(64, 0.25, 32, seed=3)
    dist_state = ref = init_dp_state(dparams, dbuffers, dopt, seed=4)
    dd = tdist.DistributedDPStep(dstep)
    for t in range(3):
        chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                            physical_batch_size=8)
        dist_state, _ = dd.run(dist_state, chunks, lambda i: (sampler_x[i], sampler_y[i]))
        ref, _ = dstep.run(ref, sampler.sample(t), lambda i: (sampler_x[i], sampler_y[i]))
    res["dpsgd"] = {"rel_err": _rel_err(dist_state.params, ref.params)}
    return res


# -- driver --------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    use_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:  # one thread per process: the CPU analogue of one GPU per process
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        kw = {"device_id": device} if use_cuda else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                **kw)
    try:
        result: dict[str, Any] = {"bench": _bench(world, rank, device, _sizes(args.small))}
        if world > 1:
            result["checks"] = _check(rank, world, device, not args.no_compile_check)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        if world > 1:
            dist.barrier()  # no rank tears the process group down while another uses it
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(world: int, args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--no-compile-check", action="store_true",
                   help="skip the compiled data-parallel equality check")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"benchmarks/distributed.py: needs 2 GPUs, found {torch.cuda.device_count()}")
    t0 = time.time()
    one = _spawn(1, args)
    two = _spawn(2, args)
    rows = {}
    for name, r1 in one["bench"].items():
        r2 = two["bench"][name]
        eff = r2["throughput"] / (2 * r1["throughput"])
        rows[name] = {"one": r1, "two": r2, "scaling_efficiency": eff}
    tol = 1e-9
    checks = {k: v | {"ok": v["rel_err"] < tol and v.get("checkpoint_rel_err", 0.0) < tol
                      and v.get("graphs") in (None, 1)}
              for k, v in two["checks"].items()}
    report = {
        "benchmark": "torchfn.distributed scaling (weak: fixed per-process work)",
        "device": (torch.cuda.get_device_name(0) if args.device == "cuda" else
                   platform.processor() or "cpu"),
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "torch": torch.__version__, "small": args.small,
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "workloads": rows, "equality_float64": checks, "wall_s": time.time() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    lines = [f"# torchfn.distributed scaling: {report['device']} ({report['backend']}, torch "
             f"{report['torch']}{', --small' if args.small else ''})", "",
             "Weak scaling (each process keeps the 1-process work); efficiency = "
             "throughput(2) / (2 x throughput(1)).", "",
             "| workload | unit | 1 process | 2 processes | efficiency | step ms (1 / 2) |",
             "|---|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['one']['unit']} | {r['one']['throughput']:.1f} | "
                     f"{r['two']['throughput']:.1f} | {r['scaling_efficiency']:.3f} | "
                     f"{r['one']['step_ms']:.2f} / {r['two']['step_ms']:.2f} |")
    sweep = rows["data_parallel"]["two"].get("step_ms_by_bucket_mb", {})
    if sweep:
        lines += ["", "Data-parallel step (2 processes), ms by bucket size (MB): "
                  + ", ".join(f"{k}: {v:.2f}" for k, v in sweep.items())]
    lines += ["", "| float64 check (2 processes vs 1, same global batch) | relative error | "
              "graphs | ok |", "|---|---:|---:|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {c['rel_err']:.2e} | {c.get('graphs') or '-'} | "
                     f"{'yes' if c['ok'] else 'FAILED'} |")
    lines += ["", f"NCCL environment: {report['env'] or 'no NCCL_* variables set'}"]
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out} and {md} ({report['wall_s']:.0f}s)")
    if not all(c["ok"] for c in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
