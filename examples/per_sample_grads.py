"""Per-sample gradients of an nn.Module classifier, their norms, and DP-SGD-style clipping.

``per_sample_grads`` takes the loss of ONE sample and vmaps it over the batch; a ``model_fn``
from ``make_functional`` becomes a one-sample function with ``single_sample_fn``.
Run: ``python examples/per_sample_grads.py``
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchfn.functional import (
    make_functional,
    per_sample_grad_norms,
    per_sample_grads,
    single_sample_fn,
)

torch.manual_seed(0)
batch, n_features, n_classes = 32, 10, 4
net = nn.Sequential(nn.Linear(n_features, 16), nn.Tanh(), nn.Linear(16, n_classes)).double()
x = torch.randn(batch, n_features, dtype=torch.float64)
y = torch.randint(0, n_classes, (batch,))

model_fn, params, buffers = make_functional(net)
f = single_sample_fn(model_fn, buffers)  # f(params, x_i) -> logits_i of shape (n_classes,)


def loss_fn(params, x_i, y_i):
    """Loss of one sample: x_i is (n_features,), y_i is ()."""
    return F.cross_entropy(f(params, x_i), y_i)


grads = per_sample_grads(loss_fn, chunk_size=8)(params, x, y)  # every leaf: (batch, *shape)
for name, g in grads.items():
    print(f"per-sample grad {name:10s} {tuple(g.shape)}")

# check sample 3 against plain autograd on a batch of one
p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
loss_3 = F.cross_entropy(model_fn(p, buffers, x[3:4])[0], y[3:4])
ref = torch.autograd.grad(loss_3, list(p.values()))
err = max((grads[k][3] - r).abs().max().item() for k, r in zip(p, ref, strict=True))
print(f"max |per_sample_grads - autograd| for sample 3: {err:.2e}")

norms = per_sample_grad_norms(loss_fn)(params, x, y)  # (batch,)
print(f"per-sample grad norms: min {norms.min():.3f}  median {norms.median():.3f}  "
      f"max {norms.max():.3f}")

# DP-SGD step direction: clip each sample's gradient to norm <= 1, then average
max_norm = 1.0
factor = (max_norm / (norms + 1e-12)).clamp(max=1.0)  # (batch,)
clipped_mean = {k: torch.einsum("b,b...->...", factor, g) / batch for k, g in grads.items()}
print(f"clipped {(norms > max_norm).sum().item()} of {batch} samples; "
      f"mean clipped grad of 0.weight has norm {clipped_mean['0.weight'].norm():.4f}")
