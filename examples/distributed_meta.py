"""MAML with the meta-batch's tasks split over processes; meta-gradients averaged.

Every rank draws the same meta-batch of sinusoid tasks (same generator seed per step) and
keeps its ``T / W`` tasks (``shard_tasks``); ``make_distributed_meta_train_step`` averages the
meta-gradients (and the meta-loss) over the ranks in one all-reduce, so the update is the one
of a single process over all ``T`` tasks. Rank 0 checkpoints once at the end.

Run::

    torchrun --nproc_per_node 2 examples/distributed_meta.py
    python examples/distributed_meta.py --compile
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
    make_distributed_meta_train_step,
    save_checkpoint_once,
    shard_tasks,
)
from torchfn.functional import adam, make_functional
from torchfn.meta import init_meta_state, maml, sinusoid_tasks

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--meta-batch", type=int, default=16)
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

info = init_from_env()
torch.manual_seed(0)
model_fn, params, buffers = make_functional(
    nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
    .to(info.device))
learner = maml(model_fn, F.mse_loss, inner_lr=0.01, inner_steps=1)
opt = adam(1e-3)
state = init_meta_state(learner, params, buffers, opt)
step = make_distributed_meta_train_step(learner, opt)
if args.compile:
    step = torch.compile(step, fullgraph=True)

for t in range(args.steps):
    tasks, _, _ = sinusoid_tasks(args.meta_batch, 10, 10,
                                 generator=torch.Generator().manual_seed(t), device=info.device)
    state, metrics = step(state, shard_tasks(tasks, rank=info.rank, world_size=info.world_size))
    if info.rank == 0 and (t + 1) % 100 == 0:
        print(f"step {t + 1}: post-adaptation query MSE {float(metrics['loss']):.3f} "
              f"({args.meta_batch} tasks over {info.world_size} {info.backend} rank(s))")
save_checkpoint_once(os.path.join(tempfile.gettempdir(), "torchfn_dist_maml.pt"), state)
dist.destroy_process_group()
