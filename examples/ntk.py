"""The empirical neural tangent kernel of an nn.Module, and kernel regression with it.

``empirical_ntk(f, params, x1, x2)`` gives Θ[n, m, a, b] = <∂f_a(x1_n)/∂θ, ∂f_b(x2_m)/∂θ>;
``mode="trace"`` sums over the output pair. Run: ``python examples/ntk.py``
"""

import torch
from torch import nn

from torchfn.functional import empirical_ntk, make_functional, single_sample_fn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                    nn.Linear(64, 3)).double()
model_fn, params, buffers = make_functional(net)
f = single_sample_fn(model_fn, buffers)  # f(params, x_i) -> (3,) outputs of one sample

x_train = torch.randn(20, 2, dtype=torch.float64)
x_test = torch.randn(5, 2, dtype=torch.float64)

full = empirical_ntk(f, params, x_test, x_train)  # (5, 20, 3, 3)
print(f"full NTK between test and train: {tuple(full.shape)}")
k_train = empirical_ntk(f, params, x_train, mode="trace")  # (20, 20)
k_test = empirical_ntk(f, params, x_test, x_train, mode="trace")  # (5, 20)
eig = torch.linalg.eigvalsh(k_train)
print(f"trace-NTK on train: {tuple(k_train.shape)}, eigenvalues {eig.min():.2e} .. "
      f"{eig.max():.2e}")

# Linearised training to convergence on y = sin(x0) + x1 (squared loss, trace kernel):
# f_lin(x*) = f0(x*) + K(x*, X) K(X, X)^-1 (y - f0(X)), applied to each output column.
y_train = (torch.sin(x_train[:, 0]) + x_train[:, 1])[:, None].expand(-1, 3)
y_test = (torch.sin(x_test[:, 0]) + x_test[:, 1])[:, None].expand(-1, 3)
f0_train, f0_test = model_fn(params, buffers, x_train)[0], model_fn(params, buffers, x_test)[0]
ridge = 1e-6 * torch.eye(20, dtype=torch.float64) * eig.max()
pred = f0_test + k_test @ torch.linalg.solve(k_train + ridge, y_train - f0_train)
print(f"test MSE at init {((f0_test - y_test) ** 2).mean():.3f}, "
      f"after NTK regression {((pred - y_test) ** 2).mean():.2e}")
