"""MAML with the meta-batch's tasks split over processes; meta-gradients averaged.

Every rank draws the same meta-batch of sinusoid tasks (same generator seed per step) and
keeps its ``T / W`` tasks (``shard_tasks``); ``make_distributed_meta_train_step`` averages the
meta-gradients (and the meta-loss) over the ranks in one all-reduce, so the update is the one
of a single process over all ``T`` tasks. Rank 0 checkpoints once at the end.

``--data digits-shards`` meta-trains 5-way 1-shot classification on scikit-learn's digits
(synthetic 10-class data without scikit-learn) read from shard files: rank 0 writes them once
with ``ShardWriter`` (``--shards DIR``, else a temporary directory); every rank builds an
``EpisodicBatchSampler`` over the labels (from the manifest) with its rank and world size, so
it draws its own disjoint episodes (global episodes ``r, r + W, ...``: step ``t`` covers
episodes ``tT .. tT + T - 1`` on any world size), reads only those episodes' samples from the
memory-mapped shards (``ShardReader``) and splits them with ``split_episode``.

Run::

    torchrun --nproc_per_node 2 examples/distributed_meta.py
    torchrun --nproc_per_node 2 examples/distributed_meta.py --data digits-shards
    python examples/distributed_meta.py --compile
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchfn.compile import compile_step
from torchfn.data import (
    EpisodicBatchSampler,
    ShardReader,
    ShardWriter,
    read_manifest,
    split_episode,
)
from torchfn.distributed import (
    init_from_env,
    make_distributed_meta_train_step,
    save_checkpoint_once,
    shard_tasks,
)
from torchfn.functional import make_functional
from torchfn.meta import Task, init_meta_state, maml, sinusoid_tasks
from torchfn.optim import adam

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--meta-batch", type=int, default=16)
parser.add_argument("--data", choices=("sinusoid", "digits-shards"), default="sinusoid")
parser.add_argument("--shards", default=None,
                    help="digits-shards: shard directory (written if it has no manifest)")
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

info = init_from_env()
N_WAY, K_SHOT, N_QUERY = 5, 1, 5


def write_digits(root: str) -> None:
    """Writes the digits (or a synthetic stand-in) into ``root`` as 64-feature float32 samples."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)
    except ImportError:  # 10 noisy classes of the same shape
        g = torch.Generator().manual_seed(0)
        y = torch.arange(1800) % 10
        x = torch.rand(10, 64, generator=g)[y] + 0.3 * torch.randn(1800, 64, generator=g)
    with ShardWriter(root, samples_per_shard=256) as w:
        for xi, yi in zip(x, y.tolist(), strict=True):
            w.write({"x": xi}, label=yi)


class ShardIndex:
    """Random access to a shard directory by global index; each shard memory-mapped on first use."""

    def __init__(self, root: str) -> None:
        shards = read_manifest(root)["shards"]
        self.files = [os.path.join(root, s["file"]) for s in shards]
        self.starts = torch.tensor([0] + [s["num_samples"] for s in shards]).cumsum(0)
        self.labels = torch.tensor([label for s in shards for label in s["labels"]])
        self.x: dict[int, torch.Tensor] = {}

    def __getitem__(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(x, y)`` of global indices ``idx``: ``(n, 64)`` float32, ``(n,)`` int64."""
        k = torch.searchsorted(self.starts, idx, right=True) - 1  # shard of each index
        x = torch.empty(len(idx), 64)
        for s in k.unique().tolist():
            if s not in self.x:
                self.x[s] = ShardReader(self.files[s]).fixed("x")  # zero-copy (n, 64) view
            m = k == s
            x[m] = self.x[s][idx[m] - self.starts[s]]
        return x, self.labels[idx]


if args.meta_batch % info.world_size:
    raise SystemExit(f"--meta-batch {args.meta_batch} must be divisible by the world size "
                     f"{info.world_size}")
if args.data == "sinusoid":
    n_in, n_out, loss_fn, inner_lr, what = 1, 1, F.mse_loss, 0.01, "query MSE"
else:
    n_in, n_out, loss_fn, inner_lr, what = 64, N_WAY, F.cross_entropy, 0.5, "query cross-entropy"
    root = [args.shards or (tempfile.mkdtemp(prefix="torchfn_meta_") if info.rank == 0 else None)]
    dist.broadcast_object_list(root)  # rank 0's temporary directory, on every rank
    root = root[0]
    if info.rank == 0 and not os.path.exists(os.path.join(root, "manifest.json")):
        write_digits(root)
    dist.barrier()
    data = ShardIndex(root)
    per_rank = args.meta_batch // info.world_size
    sampler = EpisodicBatchSampler(data.labels, N_WAY, K_SHOT, N_QUERY,
                                   episodes_per_epoch=args.steps * args.meta_batch, seed=0,
                                   world_size=info.world_size, rank=info.rank)
    episodes = iter(sampler)  # this rank's episodes: global ids rank, rank + W, ...

    def my_tasks() -> Task:
        """Returns this rank's ``T / W`` episodes of the next step, read from the shards."""
        parts = []
        for _ in range(per_rank):
            x, y = data[torch.tensor(next(episodes))]
            parts.append(split_episode(x.to(info.device), y.to(info.device), n_way=N_WAY,
                                       k_shot=K_SHOT, n_query=N_QUERY))
        return Task(*(torch.stack(f) for f in zip(*parts, strict=True)))

torch.manual_seed(0)
model_fn, params, buffers = make_functional(
    nn.Sequential(nn.Linear(n_in, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(),
                  nn.Linear(40, n_out)).to(info.device))
learner = maml(model_fn, loss_fn, inner_lr=inner_lr, inner_steps=1)
opt = adam(1e-3)
state = init_meta_state(learner, params, buffers, opt)
step = make_distributed_meta_train_step(learner, opt)
if args.compile:
    # rank 0 logs 'compiling the outer step (first call; ...)...' and how long it took
    step = compile_step(step, name="the outer step",
                        log=(lambda m: print(m, flush=True)) if info.rank == 0 else None)

running = torch.zeros((), device=info.device)  # meta-loss summed since the last print
for t in range(args.steps):
    if args.data == "sinusoid":
        tasks, _, _ = sinusoid_tasks(args.meta_batch, 10, 10,
                                     generator=torch.Generator().manual_seed(t), device=info.device)
        tasks = shard_tasks(tasks, rank=info.rank, world_size=info.world_size)
    else:
        tasks = my_tasks()
    state, metrics = step(state, tasks)
    running += metrics["loss"].detach()
    if (t + 1) % 100 == 0:
        if info.rank == 0:
            print(f"step {t + 1}: post-adaptation {what} {float(metrics['loss']):.3f} (mean of "
                  f"the last 100 steps {float(running) / 100:.3f}; {args.meta_batch} tasks over "
                  f"{info.world_size} {info.backend} rank(s))")
        running.zero_()
save_checkpoint_once(os.path.join(tempfile.gettempdir(), "torchfn_dist_maml.pt"), state)
if args.data == "digits-shards":
    dist.barrier()  # everyone is done reading before the temporary shards go
    del data
    if info.rank == 0 and args.shards is None:
        shutil.rmtree(root)
dist.destroy_process_group()
