"""DP-SGD over several processes: clip on each rank, reduce the clipped sums, noise once.

Every rank draws the same global Poisson sample (same seed) and takes every W-th selected
example (``shard_poisson_sample``); each clips its examples' gradients and sums them, the sums
are all-reduced, and the noise -- drawn from the replicated state's key, so the same on every
rank -- is added once: the global noise std is ``sigma * C``, and the privacy accounting is
that of one process with sampling rate ``q`` over the whole dataset.

The data lives in shard files: rank 0 writes the synthetic dataset once with ``ShardWriter``
(``--data DIR``, else a temporary directory) and every rank memory-maps the shards with
``ShardReader``. Poisson sampling needs random access by global index, so ``get_batch`` maps
each sampled index to (shard, position) through the manifest and reads only the examples
dealt to this rank; the final accuracy is counted on each rank's own shards and summed.

Run::

    torchrun --nproc_per_node 2 examples/distributed_dpsgd.py
    python examples/distributed_dpsgd.py            # one process: the same numbers
"""

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchopt
from torch import nn

from torchfn.data import ShardReader, ShardWriter, read_manifest
from torchfn.distributed import DistributedDPStep, init_from_env, shard_poisson_sample
from torchfn.persample import (
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sigma", type=float, default=1.0)
parser.add_argument("--data", default=None, help="shard directory (written if it has no manifest)")
args = parser.parse_args()

info = init_from_env()
N, q = 4096, 0.05
root = [args.data or (tempfile.mkdtemp(prefix="torchfn_dpsgd_") if info.rank == 0 else None)]
dist.broadcast_object_list(root)  # rank 0's temporary directory, on every rank
root = root[0]
if info.rank == 0 and not os.path.exists(os.path.join(root, "manifest.json")):
    g = torch.Generator().manual_seed(0)  # a synthetic 4-class problem, written once
    centers = torch.randn(4, 20, generator=g) * 0.3
    ys = torch.arange(N) % 4
    xs = centers[ys] + torch.randn(N, 20, generator=g)
    with ShardWriter(root, samples_per_shard=512) as w:
        for xi, yi in zip(xs, ys.tolist(), strict=True):
            w.write({"x": xi}, label=yi)
dist.barrier()

manifest = read_manifest(root)["shards"]  # global index i lives in shard k: starts[k] <= i
files = [os.path.join(root, s["file"]) for s in manifest]
starts = torch.tensor([0] + [s["num_samples"] for s in manifest]).cumsum(0)
if int(starts[-1]) != N:
    raise SystemExit(f"--data {root}: has {int(starts[-1])} samples, this example needs {N}")
readers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # opened on first use


def shard(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns shard ``k``'s ``(x, y)``: a zero-copy ``(n, 20)`` memory-mapped view, ``(n,)``."""
    if k not in readers:
        r = ShardReader(files[k])
        readers[k] = (r.fixed("x"), torch.tensor(r.labels))
    return readers[k]


def get_batch(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(x, y)`` of global indices ``idx``: ``(n, 20)`` float32 and ``(n,)`` int64."""
    k = torch.searchsorted(starts, idx, right=True) - 1  # shard of each index
    local = idx - starts[k]
    x, y = torch.empty(len(idx), 20), torch.empty(len(idx), dtype=torch.int64)
    for s in k.unique().tolist():
        m = k == s
        xs, ys = shard(s)
        x[m], y[m] = xs[local[m]], ys[local[m]]
    return x.to(info.device), y.to(info.device)


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
    state, metrics = step.run(state, chunks, get_batch, accountant)
    if info.rank == 0 and (t + 1) % 20 == 0:
        print(f"step {t + 1}: loss {float(metrics['loss']):.3f}, global batch "
              f"{int(metrics['batch_size'])}, clip fraction {float(metrics['clip_fraction']):.2f}, "
              f"epsilon {accountant.get_epsilon(1e-5):.2f} (delta 1e-5)")

correct = torch.zeros(2, dtype=torch.int64, device=info.device)  # (correct, seen)
with torch.no_grad():
    for k in range(info.rank, len(files), info.world_size):  # this rank's shards
        x, y = get_batch(torch.arange(int(starts[k]), int(starts[k + 1])))
        out, _ = ghost(state.params, state.buffers, x)
        correct += torch.stack([(out.argmax(1) == y).sum(), torch.tensor(len(y), device=x.device)])
dist.all_reduce(correct)
if info.rank == 0:
    print(f"train accuracy {int(correct[0]) / int(correct[1]):.3f} on "
          f"{info.world_size} {info.backend} rank(s), read from {len(files)} shards")
dist.barrier()  # everyone is done reading before the temporary shards go
readers.clear()
if info.rank == 0 and args.data is None:
    shutil.rmtree(root)
dist.destroy_process_group()
