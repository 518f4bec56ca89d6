"""Data-parallel training on streaming shards with torchrun; checkpoint once, resume anywhere.

Each rank reads its own share of the shards (``StreamingDataset`` takes rank and world size
from ``torch.distributed``), computes gradients on its local batch, and
``make_data_parallel_train_step`` averages them over the ranks (bucketed all-reduce) before
clipping and the AdamW update, so every rank holds the same parameters. Rank 0 writes the
checkpoint once; ``--resume`` loads it on any number of processes.

Run (gloo on the CPU, NCCL when CUDA is available)::

    torchrun --standalone --nproc-per-node=2 examples/distributed_train.py
    torchrun --standalone --nproc-per-node=1 examples/distributed_train.py --resume  # other W
    torchrun --standalone --nproc-per-node=2 examples/distributed_train.py --overlap-backward
    python examples/distributed_train.py                                 # a world of one

Several nodes: see torchfn/distributed/README.md ("Launching"), e.g. on every node
``torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400
--rdzv-id=job42 examples/distributed_train.py``.
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchfn.compile import compile_step
from torchfn.data import ShardWriter, StreamingDataset, StreamingLoader
from torchfn.distributed import init_from_env, make_data_parallel_train_step, save_checkpoint_once
from torchfn.functional import init_train_state, load_checkpoint, make_functional
from torchfn.optim import adamw

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "torchfn_dist_example"))
parser.add_argument("--resume", action="store_true", help="continue from --dir/ckpt.pt")
parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
parser.add_argument("--overlap-backward", action="store_true",
                    help="eager: start each gradient's all-reduce during the backward")
args = parser.parse_args()

info = init_from_env()  # nccl + cuda:LOCAL_RANK with CUDA, else gloo on the CPU
shards, ckpt = os.path.join(args.dir, "shards"), os.path.join(args.dir, "ckpt.pt")
if info.rank == 0 and not os.path.exists(os.path.join(shards, "manifest.json")):
    g = torch.Generator().manual_seed(0)  # a synthetic 4-class problem, written once
    centers = torch.randn(4, 16, generator=g) * 2
    with ShardWriter(shards, samples_per_shard=256) as w:
        for i in range(2048):
            label = i % 4
            w.write({"x": centers[label] + torch.randn(16, generator=g)}, label=label)
dist.barrier()

if args.global_batch % info.world_size:
    raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size "
                     f"{info.world_size}")
local_batch = args.global_batch // info.world_size
dataset = StreamingDataset(shards, batch_size=local_batch, seed=1, policy="drop")
loader = StreamingLoader(dataset, num_workers=0)

torch.manual_seed(0)  # same initial parameters on every rank
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(info.device)
model_fn, params, buffers = make_functional(model)
opt = adamw(3e-3, weight_decay=1e-4)
state = init_train_state(params, buffers, opt, seed=0)
start_epoch = 0
if args.resume:  # written on any world size: the state is replicated
    state, extra = load_checkpoint(ckpt, map_location=info.device, optimizer=opt)
    start_epoch = extra["epoch"] + 1

step = make_data_parallel_train_step(model_fn, F.cross_entropy, opt, max_grad_norm=1.0,
                                     overlap_backward=args.overlap_backward)
if args.compile:
    # rank 0 logs 'compiling the step (first call; ...)...' and how long it took
    step = compile_step(step, name="the step", log=(lambda m: print(m, flush=True)) if info.rank == 0 else None)

for epoch in range(start_epoch, start_epoch + args.epochs):
    dataset.set_epoch(epoch)
    t0, n = time.perf_counter(), 0
    for batch in loader:
        x, y = batch["x"].to(info.device), batch["label"].to(info.device)
        state, metrics = step(state, (x, y))
        n += 1
    if info.rank == 0:
        print(f"epoch {epoch}: {n} steps of {args.global_batch} on {info.world_size} "
              f"{info.backend} rank(s), loss {float(metrics['loss']):.4f}, "
              f"grad_norm {float(metrics['grad_norm']):.3f}, {time.perf_counter() - t0:.2f}s")
    save_checkpoint_once(ckpt, state, extra={"epoch": epoch})

# every rank holds the same parameters (checked, not assumed)
flat = torch.cat([p.flatten() for p in state.params.values()])
spread = flat.clone()
dist.all_reduce(spread, op=dist.ReduceOp.MAX)
assert torch.equal(spread, flat), "replicas diverged"
if info.rank == 0:
    print(f"replicas identical; checkpoint at {ckpt}")
dist.barrier()  # no rank tears the process group down while another still uses it
dist.destroy_process_group()
