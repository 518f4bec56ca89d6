"""Hessian-vector products and the Hessian diagonal (exact vs Hutchinson) of a training loss.

``hvp`` never forms the Hessian (forward-over-reverse); ``hessian_diagonal`` estimates
diag(H) from Rademacher probes drawn from an explicit generator, or computes it exactly.
Run: ``python examples/hvp_hessian_diag.py``
"""

import torch

from torchfn.functional import (
    hessian_diagonal,
    hessian_matrix,
    hvp,
    tree_dot,
    tree_global_norm,
    tree_numel,
    tree_ravel,
)

torch.manual_seed(0)
dt = torch.float64
params = {
    "w1": torch.randn(8, 3, dtype=dt) / 3**0.5, "b1": torch.zeros(8, dtype=dt),
    "w2": torch.randn(1, 8, dtype=dt) / 8**0.5, "b2": torch.zeros(1, dtype=dt),
}
x, y = torch.randn(64, 3, dtype=dt), torch.randn(64, 1, dtype=dt)


def loss(p, x, y):
    """Mean-squared error of a small tanh MLP on the whole batch (a 0-d tensor).

    Written out rather than F.mse_loss: torch 2.13's mse_loss fails under forward-over-reverse
    (pytorch issue #123996); with it, pass mode="reverse_over_reverse" / hvp_mode=...
    """
    pred = torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
    return ((pred - y) ** 2).mean()


print(f"{tree_numel(params)} parameters, loss {loss(params, x, y):.4f}")

v = {k: torch.randn_like(t) for k, t in params.items()}
hv = hvp(loss, params, v, x, y)
hv_rev = hvp(loss, params, v, x, y, mode="reverse_over_reverse")
print(f"|Hv| = {tree_global_norm(hv):.4f}, curvature vᵀHv/vᵀv = "
      f"{tree_dot(v, hv) / tree_dot(v, v):.4f}, "
      f"forward-over-reverse vs reverse-over-reverse: "
      f"{(tree_ravel(hv)[0] - tree_ravel(hv_rev)[0]).abs().max():.1e}")

H = hessian_matrix(loss, params, x, y)  # (P, P), tree_ravel order
exact = tree_ravel(hessian_diagonal(loss, params, x, y, exact=True))[0]
print(f"exact diag vs diag(hessian_matrix): {(exact - H.diagonal()).abs().max():.1e}")

gen = torch.Generator().manual_seed(0)
for n in (10, 100, 1000, 10000):
    est = tree_ravel(hessian_diagonal(loss, params, x, y, n_samples=n, generator=gen,
                                      chunk_size=1000))[0]
    rel = (est - exact).norm() / exact.norm()
    print(f"Hutchinson, {n:5d} probes: relative error {rel:.3f}")
