"""DP-SGD over several processes: clip on each rank, reduce the clipped sums, noise once.

Every rank draws the same global Poisson sample (same seed) and takes every W-th selected
example (``shard_poisson_sample``); each clips its examples' gradients and sums them, the sums
are all-reduced, and the noise -- drawn from the replicated state's key, so the same on every
rank -- is added once: the global noise std is ``sigma * C``, and the privacy accounting is
that of one process with sampling rate ``q`` over the whole dataset.

Run::

    torchrun --nproc_per_node 2 examples/distributed_dpsgd.py
    python examples/distributed_dpsgd.py            # one process: the same numbers
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchopt
from torch import nn

from torchfn.distributed import DistributedDPStep, init_from_env, shard_poisson_sample
from torchfn.functional import (
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sigma", type=float, default=1.0)
args = parser.parse_args()

info = init_from_env()
g = torch.Generator().manual_seed(0)  # the same synthetic dataset on every rank
N, q = 4096, 0.05
centers = torch.randn(4, 20, generator=g) * 0.3
labels = torch.arange(N) % 4
data = (centers[labels] + torch.randn(N, 20, generator=g)).to(info.device)
labels = labels.to(info.device)

torch.manual_seed(0)
ghost, params, buffers = make_ghost_model(
    nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 4)).to(info.device))
opt = torchopt.sgd(1.0)
step = DistributedDPStep(make_dp_train_step(
    ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
    noise_multiplier=args.sigma, max_grad_norm=1.0, sample_rate=q, dataset_size=N))
state = init_dp_state(params, buffers, opt, seed=1234)  # same seed everywhere: noise agrees
sampler = PoissonSampler(N, q, physical_batch_size=256, seed=99)  # the GLOBAL sampler
accountant = RDPAccountant()
local_size = int(q * N / info.world_size + 4 * (q * N / info.world_size) ** 0.5)

for t in range(args.steps):
    chunks = shard_poisson_sample(sampler, t, rank=info.rank, world_size=info.world_size,
                                  physical_batch_size=local_size)
    state, metrics = step.run(state, chunks, lambda i: (data[i], labels[i]), accountant)
    if info.rank == 0 and (t + 1) % 20 == 0:
        print(f"step {t + 1}: loss {float(metrics['loss']):.3f}, global batch "
              f"{int(metrics['batch_size'])}, clip fraction {float(metrics['clip_fraction']):.2f}, "
              f"epsilon {accountant.get_epsilon(1e-5):.2f} (delta 1e-5)")

with torch.no_grad():
    out, _ = ghost(state.params, state.buffers, data)
if info.rank == 0:
    print(f"train accuracy {float((out.argmax(1) == labels).float().mean()):.3f} on "
          f"{info.world_size} {info.backend} rank(s)")
dist.destroy_process_group()
