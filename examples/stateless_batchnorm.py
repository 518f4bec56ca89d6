"""MAML meta-gradient over a batch of tasks with a BatchNorm CNN, in one vmapped function.

make_functional turns the module into ``model_fn(params, buffers, x) -> (out, new_buffers)``
and swaps nn.BatchNorm2d for torchfn's BatchNorm, so ``grad(vmap(grad(...)))`` gives the
same meta-gradient as a per-task autograd loop. Run: ``python examples/stateless_batchnorm.py``
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from torchfn.functional import make_functional

torch.manual_seed(0)
n_tasks, shots, inner_lr = 4, 5, 0.1
net = nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
    nn.Flatten(), nn.Linear(4 * 8 * 8, 3),
).double()
support_x, query_x = torch.randn(2, n_tasks, shots, 1, 8, 8, dtype=torch.float64)
support_y, query_y = torch.randint(0, 3, (2, n_tasks, shots))

model_fn, params, buffers = make_functional(net)


def loss(p, b, x, y):
    logits, new_b = model_fn(p, b, x)
    return F.cross_entropy(logits, y), new_b


def task_loss(p, xs, ys, xq, yq):
    g, b = grad(loss, has_aux=True)(p, buffers, xs, ys)  # inner step; BN stats come back new
    fast = {k: p[k] - inner_lr * g[k] for k in p}
    return loss(fast, b, xq, yq)[0]


def meta_loss(p):
    per_task = vmap(task_loss, in_dims=(None, 0, 0, 0, 0))
    return per_task(p, support_x, support_y, query_x, query_y).sum()


meta_grad = grad(meta_loss)(params)

# The same thing with plain autograd, one task at a time, on the ordinary module.
ref = copy.deepcopy(net)
names, leaves = zip(*ref.named_parameters(), strict=True)
total = 0
for t in range(n_tasks):
    inner = F.cross_entropy(ref(support_x[t]), support_y[t])
    g = torch.autograd.grad(inner, leaves, create_graph=True)
    fast = {k: w - inner_lr * gi for k, w, gi in zip(names, leaves, g, strict=True)}
    total = total + F.cross_entropy(functional_call(ref, fast, (query_x[t],)), query_y[t])
ref_grad = torch.autograd.grad(total, leaves)

flat = torch.cat([meta_grad[k].flatten() for k in names])
ref_flat = torch.cat([r.flatten() for r in ref_grad])
print(f"meta-gradient: {flat.numel()} numbers, relative error vs loop "
      f"{float((flat - ref_flat).norm() / ref_flat.norm()):.1e}")

# The module and the dicts were not touched; new running stats come back from model_fn.
_, new_buffers = model_fn(params, buffers, support_x[0])
print("num_batches_tracked: given", int(buffers["1.num_batches_tracked"]),
      "-> returned", int(new_buffers["1.num_batches_tracked"]),
      "| module still", int(net[1].num_batches_tracked))
