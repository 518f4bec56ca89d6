"""An ensemble split over processes: rank r trains members [r N/W, (r+1) N/W).

Training needs no communication (each rank runs the ordinary vmapped ensemble step on its
slice); predictions all-gather the members' outputs, and the checkpoint gathers the members
to rank 0, which writes one ordinary ensemble file. ``--resume`` reads it back on any world
size (N must be divisible by it), each rank keeping its own members.

The data lives in shard files (rank 0 writes them once with ``ShardWriter``: ``--data DIR``,
else a temporary directory). Every member trains on the whole dataset, so every rank streams
ALL the training shards (``StreamingDataset(..., world_size=1, rank=0)``, the same seed and
epoch everywhere: the same batches on every rank) and feeds each batch to all its members
(``shared_batch=True``); the members differ by their initial parameters (``seeds``). A member
thus sees the same batches on any world size, and 1 or W processes print the same numbers.

Run::

    torchrun --nproc_per_node 2 examples/distributed_ensemble.py
    torchrun --nproc_per_node 4 examples/distributed_ensemble.py --resume
    python examples/distributed_ensemble.py                      # one process: the same numbers
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchfn.data import ShardReader, ShardWriter, StreamingDataset, read_manifest
from torchfn.distributed import (
    init_from_env,
    load_ensemble_shard,
    save_ensemble_gathered,
    shard_members,
    sharded_ensemble_apply,
)
from torchfn.ensembles import (
    Ensemble,
    ensemble_metrics,
    init_ensemble_state,
    make_ensemble_train_step,
)
from torchfn.optim import adam

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--members", type=int, default=8)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "torchfn_dist_ens.pt"))
parser.add_argument("--resume", action="store_true")
parser.add_argument("--data", default=None, help="shard directory (written if it has no manifest)")
args = parser.parse_args()

info = init_from_env()
root = [args.data or (tempfile.mkdtemp(prefix="torchfn_ens_") if info.rank == 0 else None)]
dist.broadcast_object_list(root)  # rank 0's temporary directory, on every rank
root = root[0]
train_dir, test_dir = os.path.join(root, "train"), os.path.join(root, "test")
if info.rank == 0 and not os.path.exists(os.path.join(test_dir, "manifest.json")):
    g = torch.Generator().manual_seed(0)  # a synthetic binary problem, written once
    x = torch.randn(1024, 10, generator=g)
    y = ((x[:, :2].sum(1) + 0.5 * torch.randn(1024, generator=g)) > 0).long()
    for d, part in ((train_dir, slice(0, 768)), (test_dir, slice(768, 1024))):
        with ShardWriter(d, samples_per_shard=128) as w:
            for xi, yi in zip(x[part], y[part].tolist(), strict=True):
                w.write({"x": xi}, label=yi)
dist.barrier()

# every rank streams all the training shards (world_size=1, rank=0): its members see them all
train = StreamingDataset(train_dir, batch_size=64, seed=1, policy="drop", world_size=1, rank=0)
tests = [ShardReader(os.path.join(test_dir, s["file"])) for s in read_manifest(test_dir)["shards"]]
x_test = torch.cat([r.fixed("x") for r in tests]).to(info.device)  # (256, 10), every rank
y_test = torch.tensor([label for r in tests for label in r.labels], device=info.device)

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
step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt, shared_batch=True)

for epoch in range(start, start + args.epochs):
    train.set_epoch(epoch)  # the same order on every rank
    for batch in train:  # (64, 10) and (64,), fed to all of this rank's members
        state, metrics = step(state, (batch["x"].to(info.device), batch["label"].to(info.device)))
    logits = sharded_ensemble_apply(ens.model_fn, state.params, state.buffers, x_test)
    m = ensemble_metrics(logits, y_test)  # (N, B, classes) gathered on every rank
    if info.rank == 0:
        print(f"epoch {epoch}: members {args.members} over {info.world_size} rank(s); "
              + ", ".join(f"{k} {float(v):.3f}" for k, v in m.items() if v.ndim == 0))
    save_ensemble_gathered(args.ckpt, state, extra={"epoch": epoch})
if info.rank == 0:
    print(f"checkpoint (all {args.members} members) at {args.ckpt}")
dist.barrier()  # everyone is done reading before the temporary shards go
del train, tests
if info.rank == 0 and args.data is None:
    shutil.rmtree(root)
dist.destroy_process_group()
