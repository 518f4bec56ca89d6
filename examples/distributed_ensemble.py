"""An ensemble split over processes: rank r trains members [r N/W, (r+1) N/W).

Training needs no communication (each rank runs the ordinary vmapped ensemble step on its
slice); predictions all-gather the members' outputs, and the checkpoint gathers the members
to rank 0, which writes one ordinary ensemble file. ``--resume`` reads it back on any world
size (N must be divisible by it), each rank keeping its own members.

Run::

    torchrun --nproc_per_node 2 examples/distributed_ensemble.py
    torchrun --nproc_per_node 4 examples/distributed_ensemble.py --resume
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchfn.distributed import (
    init_from_env,
    load_ensemble_shard,
    member_range,
    save_ensemble_gathered,
    shard_members,
    sharded_ensemble_apply,
)
from torchfn.ensembles import (
    Ensemble,
    ensemble_metrics,
    init_ensemble_state,
    make_ensemble_train_step,
    member_batches,
    member_orders,
)
from torchfn.functional import adam

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--members", type=int, default=8)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "torchfn_dist_ens.pt"))
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

info = init_from_env()
g = torch.Generator().manual_seed(0)  # same data everywhere; each member its own order
x = torch.randn(1024, 10, generator=g)
y = ((x[:, :2].sum(1) + 0.5 * torch.randn(1024, generator=g)) > 0).long()
x_test, y_test = x[768:].to(info.device), y[768:].to(info.device)
x, y = x[:768], y[:768]

mine = member_range(args.members, rank=info.rank, world_size=info.world_size)
ens = Ensemble.from_seeds(lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)),
                          seeds=range(args.members))
ens = Ensemble(ens.model_fn, {k: v.to(info.device) for k, v in ens.params.items()},
               {k: v.to(info.device) for k, v in ens.buffers.items()})
opt = adam(1e-2)
if args.resume:
    state, extra = load_ensemble_shard(args.ckpt, rank=info.rank, world_size=info.world_size,
                                       optimizer=opt, map_location=info.device)
    start = extra["epoch"] + 1
else:  # build all N (cheap), keep this rank's members
    state = shard_members(init_ensemble_state(ens, opt, seed=0), rank=info.rank,
                          world_size=info.world_size)
    start = 0
step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)

for epoch in range(start, start + args.epochs):
    orders = member_orders(len(x), seeds=list(mine), epoch=epoch)  # this rank's members
    for xb, yb in member_batches((x, y), orders, 64):
        state, metrics = step(state, (xb.to(info.device), yb.to(info.device)))
    logits = sharded_ensemble_apply(ens.model_fn, state.params, state.buffers, x_test)
    m = ensemble_metrics(logits, y_test)  # (N, B, classes) gathered on every rank
    if info.rank == 0:
        print(f"epoch {epoch}: members {args.members} over {info.world_size} rank(s); "
              + ", ".join(f"{k} {float(v):.3f}" for k, v in m.items() if v.ndim == 0))
    save_ensemble_gathered(args.ckpt, state, extra={"epoch": epoch})
if info.rank == 0:
    print(f"checkpoint (all {args.members} members) at {args.ckpt}")
dist.destroy_process_group()
