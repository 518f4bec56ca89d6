"""Inverse-HVPs (CG, LiSSA), EK-FAC and influence scores against dense float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn
from torch.func import hessian, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchfn.functional import hessian_matrix, make_functional, tree_ravel
from torchfn.persample import (
    EKFAC,
    ekfac_inverse_hvp,
    fit_ekfac,
    influence_scores,
    inverse_hvp,
    make_ghost_model,
    self_influence,
)
from torchfn.persample._influence import _dot_train, _dot_train_reverse

D = torch.float64


def xent(out, y):
    return F.cross_entropy(out, y, reduction="none")


def half_sq(out, y):
    return 0.5 * (out - y).square().flatten(1).sum(1)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(D)


def _data(n: int, seed: int, d: int = 3, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=D), torch.randint(0, classes, (n,), generator=g)


def _flat_rows(tree, names):
    """``{name: (k, *shape)}`` -> ``(k, P)`` in tree_ravel's (sorted-key) order."""
    return torch.cat([tree[n].reshape(tree[n].shape[0], -1) for n in sorted(names)], 1)


def _ref_grads(net: nn.Module, loss_fn, x, y) -> torch.Tensor:
    """``(N, P)``: per-sample gradients by a loop of torch.autograd.grad (sorted names)."""
    named = dict(net.named_parameters())
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(net(x[i:i + 1]), y[i:i + 1])[0]
        g = torch.autograd.grad(loss, [named[k] for k in sorted(named)])
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    return torch.stack(rows)


def _dense_h(model_fn, params, buffers, loss_fn, x, y) -> torch.Tensor:
    return hessian_matrix(lambda p: loss_fn(model_fn(p, buffers, x)[0], y).mean(), params)


def _damping_for(h: torch.Tensor) -> float:
    """A damping that makes H + damping I comfortably positive definite."""
    return max(0.1, -2 * torch.linalg.eigvalsh(h)[0].item())


# -- inverse_hvp --------------------------------------------------------------------------------


def test_cg_matches_dense_solve_batched_and_single():
    net = _mlp()
    model_fn, params, buffers = make_functional(net)
    x, y = _data(20, 1)
    h = _dense_h(model_fn, params, buffers, xent, x, y)
    lam = _damping_for(h)
    f = lambda p, x, y: xent(model_fn(p, buffers, x)[0], y).mean()  # noqa: E731
    g = torch.Generator().manual_seed(2)
    v = {k: torch.randn(4, *t.shape, generator=g, dtype=D) for k, t in params.items()}
    res = inverse_hvp(f, params, v, x, y, damping=lam, stacked=True, tol=1e-12)
    ref = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=D), _flat_rows(v, v).T).T
    torch.testing.assert_close(_flat_rows(res.x, v), ref, rtol=1e-8, atol=1e-10)
    assert res.converged.all() and res.residual.shape == (4,) and (res.residual <= 1e-12).all()
    assert (res.iterations > 0).all() and (res.iterations <= h.shape[0]).all()
    one = inverse_hvp(f, params, {k: t[1] for k, t in v.items()}, x, y, damping=lam,
                      tol=1e-12)
    assert one.residual.shape == () and bool(one.converged)
    torch.testing.assert_close(tree_ravel(one.x)[0], ref[1], rtol=1e-8, atol=1e-10)


def test_cg_reports_no_convergence_and_lissa_converges():
    net = _mlp()
    model_fn, params, buffers = make_functional(net)
    x, y = _data(16, 3)
    h = _dense_h(model_fn, params, buffers, xent, x, y)
    lam = _damping_for(h)
    f = lambda p, x, y: xent(model_fn(p, buffers, x)[0], y).mean()  # noqa: E731
    v = {k: torch.randn_like(t) for k, t in params.items()}
    ref = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=D), tree_ravel(v)[0])
    res = inverse_hvp(f, params, v, x, y, damping=lam, max_iter=2)
    assert not bool(res.converged) and int(res.iterations) == 2 and float(res.residual) > 1e-3
    top = torch.linalg.eigvalsh(h)[-1].item() + lam
    # full batch: the deterministic recursion converges geometrically
    full = inverse_hvp(f, params, v, x, y, damping=lam, method="lissa", scale=1.2 * top,
                       depth=100, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tree_ravel(full.x)[0], ref, rtol=1e-8, atol=1e-10)
    assert bool(full.converged) and int(full.iterations) == 100
    # minibatches of 8 of the 16 rows: a noisy estimate, within a loose tolerance
    mini = inverse_hvp(f, params, v, x, y, damping=lam, method="lissa", scale=1.5 * top,
                       depth=60, repeats=2, batch_size=8,
                       generator=torch.Generator().manual_seed(0))
    err = (tree_ravel(mini.x)[0] - ref).norm() / ref.norm()
    assert err < 0.25, err
    again = inverse_hvp(f, params, v, x, y, damping=lam, method="lissa", scale=1.5 * top,
                        depth=60, repeats=2, batch_size=8,
                        generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.x, mini.x, rtol=0, atol=0)  # seeded: reproducible


def test_inverse_hvp_errors():
    net = _mlp()
    model_fn, params, buffers = make_functional(net)
    x, y = _data(20, 1)
    h = _dense_h(model_fn, params, buffers, xent, x, y)
    assert torch.linalg.eigvalsh(h)[0] < 0  # random init: an indefinite Hessian
    f = lambda p, x, y: xent(model_fn(p, buffers, x)[0], y).mean()  # noqa: E731
    v = {k: torch.randn_like(t) for k, t in params.items()}
    with pytest.raises(ValueError, match=r"not positive definite.*pass a larger damping"):
        inverse_hvp(f, params, v, x, y, damping=0.0)
    with pytest.raises(ValueError, match=r"damping=\.\.\.\): expected a finite float >= 0"):
        inverse_hvp(f, params, v, x, y, damping=-1.0)
    with pytest.raises(ValueError, match=r"method=\.\.\.\): expected one of \('cg', 'lissa'\)"):
        inverse_hvp(f, params, v, x, y, damping=1.0, method="newton")
    with pytest.raises(ValueError, match=r"leaf '0.bias' has shape \(5,\), expected "
                                         r"\(k, \*param.shape\) with stacked=True"):
        inverse_hvp(f, params, v, x, y, damping=1.0, stacked=True)
    with pytest.raises(ValueError, match=r"`scale` must be a float larger than the largest"):
        inverse_hvp(f, params, v, x, y, damping=1.0, method="lissa",
                    generator=torch.Generator())
    with pytest.raises(TypeError, match=r"needs an explicit `generator`"):
        inverse_hvp(f, params, v, x, y, damping=1.0, method="lissa", scale=10.0)
    with pytest.raises(ValueError, match=r"batch_size=\.\.\.\): expected an int in \[1, 20\]"):
        inverse_hvp(f, params, v, x, y, damping=1.0, method="lissa", scale=10.0,
                    batch_size=50, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"the recursion diverged.*raise scale"):
        inverse_hvp(f, params, v, x, y, damping=1.0, method="lissa", scale=1e-8, depth=60,
                    generator=torch.Generator().manual_seed(0))


# -- influence scores ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["cg", "lissa", "identity"])
def test_influence_scores_equal_explicit_formula(method):
    net = _mlp(1)
    model_fn, params, buffers = make_functional(net)
    x, y = _data(12, 4)
    xq, yq = _data(3, 5)
    h = _dense_h(model_fn, params, buffers, xent, x, y)
    lam = _damping_for(h)
    gt, gq = _ref_grads(net, xent, x, y), _ref_grads(net, xent, xq, yq)
    curv = torch.zeros_like(h) if method == "identity" else h
    ref = -gq @ torch.linalg.solve(curv + lam * torch.eye(h.shape[0], dtype=D), gt.T)
    opts = {"cg": {"tol": 1e-12},
            "lissa": {"scale": 1.2 * (torch.linalg.eigvalsh(h)[-1].item() + lam),
                      "depth": 150, "generator": torch.Generator().manual_seed(0)},
            "identity": {}}[method]
    got = influence_scores(model_fn, params, buffers, xent, (x, y), (xq, yq), method=method,
                           damping=lam, **opts)
    assert got.shape == (3, 12)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)
    if method == "identity":  # the ghost inner products give the same numbers
        ghost, gp, gb = make_ghost_model(net)
        torch.testing.assert_close(influence_scores(ghost, gp, gb, xent, (x, y), (xq, yq),
                                                    method="identity", damping=lam), ref)


def test_influence_hessian_data_and_self_influence():
    net = _mlp(2)
    model_fn, params, buffers = make_functional(net)
    x, y = _data(10, 6)
    xh, yh = _data(30, 7)
    h = _dense_h(model_fn, params, buffers, xent, xh, yh)
    lam = _damping_for(h)
    gt = _ref_grads(net, xent, x, y)
    inv = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=D), gt.T)
    got = influence_scores(model_fn, params, buffers, xent, (x, y), (x, y), damping=lam,
                           hessian_data=(xh, yh), tol=1e-12)
    torch.testing.assert_close(got, -gt @ inv, rtol=1e-7, atol=1e-10)
    selfs = self_influence(model_fn, params, buffers, xent, (x, y), method="cg", damping=lam,
                           hessian_data=(xh, yh), tol=1e-12)
    torch.testing.assert_close(selfs, (gt * inv.T).sum(1), rtol=1e-7, atol=1e-10)
    assert (selfs > 0).all()
    ident = self_influence(model_fn, params, buffers, xent, (x, y), method="identity",
                           damping=0.5)
    torch.testing.assert_close(ident, gt.square().sum(1) / 0.5)
    ghost, gp, gb = make_ghost_model(net)
    torch.testing.assert_close(self_influence(ghost, gp, gb, xent, (x, y), method="identity",
                                              damping=0.5), ident)
    later = {k: t + 0.05 for k, t in params.items()}
    net2 = _mlp(2)
    with torch.no_grad():
        for p in net2.parameters():
            p.add_(0.05)
    ref = 0.1 * gt.square().sum(1) + 0.02 * _ref_grads(net2, xent, x, y).square().sum(1)
    for fn, p0 in ((model_fn, params), (ghost, gp)):
        tr = self_influence(fn, p0, buffers, xent, (x, y), method="tracin",
                            checkpoints=[params, later], lrs=[0.1, 0.02])
        torch.testing.assert_close(tr, ref)


def test_directional_derivatives_forward_equals_reverse():
    model_fn, params, buffers = make_functional(_mlp(3))
    x, y = _data(7, 8)

    def losses(p, inputs, targets):
        return xent(model_fn({**params, **p}, buffers, inputs)[0], targets)

    g = torch.Generator().manual_seed(0)
    v = {k: torch.randn(2, *t.shape, generator=g, dtype=D) for k, t in params.items()}
    fwd = _dot_train(losses, params, v, x, y)
    rev = _dot_train_reverse(losses, params, v, x, y)
    gt = jacrev(losses)(params, x, y)
    ref = _flat_rows(v, v) @ _flat_rows(gt, gt).T
    torch.testing.assert_close(fwd, ref)
    torch.testing.assert_close(rev, ref)


def test_influence_on_zoo_lstm_classifier():
    row = zoo.build("lstm_cls")
    model_fn, params, buffers = make_functional(row.module)
    x, y = row.batch(6, 0)
    xq, yq = row.batch(2, 1)
    h = _dense_h(model_fn, params, buffers, row.loss_fn, x, y)
    lam = _damping_for(h)
    gt = _ref_grads(row.module, row.loss_fn, x, y)
    gq = _ref_grads(row.module, row.loss_fn, xq, yq)
    ref = -gq @ torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=D), gt.T)
    got = influence_scores(model_fn, params, buffers, row.loss_fn, (x, y), (xq, yq),
                           damping=lam, tol=1e-12)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-10)


def test_influence_errors():
    net = _mlp()
    model_fn, params, buffers = make_functional(net)
    x, y = _data(20, 1)
    data = (x, y)
    with pytest.raises(ValueError, match=r"method=\.\.\.\): expected one of"):
        influence_scores(model_fn, params, buffers, xent, data, data, method="tracin",
                         damping=1.0)
    with pytest.raises(ValueError, match=r"not positive definite.*larger damping"):
        influence_scores(model_fn, params, buffers, xent, data, data, damping=0.0)
    with pytest.raises(ValueError, match=r"CG did not reach tol.*raise max_iter or damping"):
        influence_scores(model_fn, params, buffers, xent, data, data,
                         damping=1.0, max_iter=1)
    with pytest.raises(TypeError, match=r"method='cg'\): unexpected options \['fisher'\]"):
        influence_scores(model_fn, params, buffers, xent, data, data, damping=1.0,
                         fisher="ggn")
    with pytest.raises(ValueError, match=r"curvature=\.\.\.\): expected one of \('hessian', "
                                         r"'ggn'\)"):
        influence_scores(model_fn, params, buffers, xent, data, data, damping=1.0,
                         curvature="fisher")
    with pytest.raises(TypeError, match=r"model_fn must be a GhostModel"):
        influence_scores(model_fn, params, buffers, xent, data, data, method="ekfac",
                         damping=1.0)
    with pytest.raises(ValueError, match=r"method='ekfac'\): needs damping > 0"):
        influence_scores(model_fn, params, buffers, xent, data, data, method="ekfac",
                         damping=0.0)
    with pytest.raises(ValueError, match=r"must return the \(B,\) per-sample losses.*shape \(\)"):
        influence_scores(model_fn, params, buffers, lambda o, t: xent(o, t).mean(), data, data,
                         damping=1.0)
    with pytest.raises(TypeError, match=r"query=\.\.\.\): expected a pair \(inputs, targets\)"):
        influence_scores(model_fn, params, buffers, xent, data, x, damping=1.0)
    with pytest.raises(ValueError, match=r"method='tracin'\): expected one learning rate per"):
        self_influence(model_fn, params, buffers, xent, data, method="tracin",
                       checkpoints=[params], lrs=[])


# -- EK-FAC -------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_out", [1, 3])
def test_ekfac_exact_for_one_linear_layer_with_squared_error(d_out):
    # y = W a + b, loss 0.5 ||y - t||^2: H = GGN = I_out (x) E[[a, 1][a, 1]^T], one Kronecker
    # product, which EK-FAC represents exactly (fisher="ggn")
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(4, d_out).to(D))
    x, t = torch.randn(30, 4, dtype=D), torch.randn(30, d_out, dtype=D)
    h = _dense_h(ghost, params, buffers, half_sq, x, t)
    ek = fit_ekfac(ghost, params, buffers, half_sq, x, t)
    assert isinstance(ek, EKFAC) and ek.n_samples == 30 and ek.identity == ()
    v = {k: torch.randn(2, *p.shape, dtype=D) for k, p in params.items()}
    got = ekfac_inverse_hvp(ek, v, damping=0.1, stacked=True)
    ref = torch.linalg.solve(h + 0.1 * torch.eye(h.shape[0], dtype=D), _flat_rows(v, v).T).T
    torch.testing.assert_close(_flat_rows(got, v), ref)
    # the empirical Fisher (true-label gradients) is a different matrix here
    emp = fit_ekfac(ghost, params, buffers, half_sq, x, t, fisher="empirical")
    assert not torch.allclose(_flat_rows(ekfac_inverse_hvp(emp, v, damping=0.1, stacked=True),
                                         v), ref)


def _ggn(ghost, params, buffers, x, y, loss_one):
    flat, unravel = tree_ravel(params)

    def outs(vec):
        return ghost(unravel(vec), buffers, x)[0]

    jac = jacrev(outs)(flat)  # (N, O, P)
    h_out = vmap(hessian(loss_one))(outs(flat).detach(), y)  # (N, O, O)
    return torch.einsum("nap,nab,nbq->pq", jac, h_out, jac) / x.shape[0]


def test_ekfac_eigenvalues_are_the_ggn_diagonal_in_the_kronecker_eigenbasis():
    # EK-FAC's defining property, per layer and exactly: Lambda = diag((Q_S (x) Q_A)^T GGN
    # (Q_S (x) Q_A)) for the [W, b] block, whatever the model
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    ghost, params, buffers = make_ghost_model(net)
    x, y = _data(32, 9, d=4)
    ggn = _ggn(ghost, params, buffers, x, y, lambda o, t: F.cross_entropy(o[None], t[None]))
    ek = fit_ekfac(ghost, params, buffers, xent, x, y, chunk_size=10)
    for lay in ek.layers.values():
        cols = []
        for o in range(lay.q_s.shape[0]):
            for i in range(lay.q_a.shape[0]):
                e = torch.outer(lay.q_s[:, o], lay.q_a[:, i])
                d = {k: torch.zeros_like(t) for k, t in params.items()}
                d[lay.weight], d[lay.bias] = e[:, :-1], e[:, -1]
                cols.append(tree_ravel(d)[0])
        u = torch.stack(cols, 1)
        diag = torch.diagonal(u.T @ ggn @ u).reshape(lay.lam.shape)
        torch.testing.assert_close(lay.lam, diag, rtol=1e-9, atol=1e-12)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ra, rb = a.argsort().argsort().to(D), b.argsort().argsort().to(D)
    return torch.corrcoef(torch.stack([ra, rb]))[0, 1]


def test_ekfac_influence_ranks_track_the_exact_ggn():
    # a small tanh MLP at initialisation, regression: EK-FAC's rankings of the training
    # samples per query agree with the exact damped-GGN influence (Spearman > 0.9) and are
    # closer to it than plain gradient similarity (method="identity"). The damping is 0.3 x
    # the GGN's mean eigenvalue (seeds 0-4: min Spearman 0.93-0.97); at 0.1 x it drops to
    # 0.75-0.87 for the worst query (EK-FAC drops cross-layer blocks and the off-diagonal of
    # each block in its eigenbasis, which matter more as damping shrinks)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(D)
    ghost, params, buffers = make_ghost_model(net)
    x, w = torch.randn(256, 4, dtype=D), torch.randn(4, 2, dtype=D)
    y = torch.sin(x @ w) + 0.1 * torch.randn(256, 2, dtype=D)
    xq = torch.randn(8, 4, dtype=D)
    yq = torch.sin(xq @ w)
    ggn = _ggn(ghost, params, buffers, x, y, lambda o, t: 0.5 * (o - t).square().sum())
    lam = 0.3 * (torch.trace(ggn) / ggn.shape[0]).item()  # 0.3 x the mean eigenvalue
    gt, gq = _ref_grads(net, half_sq, x, y), _ref_grads(net, half_sq, xq, yq)
    exact = -gq @ torch.linalg.solve(ggn + lam * torch.eye(ggn.shape[0], dtype=D), gt.T)
    cg_ggn = influence_scores(ghost, params, buffers, half_sq, (x, y), (xq, yq),
                              curvature="ggn", damping=lam, tol=1e-12)
    torch.testing.assert_close(cg_ggn, exact, rtol=1e-7, atol=1e-10)
    ek = influence_scores(ghost, params, buffers, half_sq, (x, y), (xq, yq), method="ekfac",
                          damping=lam)
    ident = influence_scores(ghost, params, buffers, half_sq, (x, y), (xq, yq),
                             method="identity", damping=lam)
    rho_ek = torch.stack([_spearman(a, b) for a, b in zip(exact, ek, strict=True)])
    rho_id = torch.stack([_spearman(a, b) for a, b in zip(exact, ident, strict=True)])
    assert (rho_ek > 0.9).all(), rho_ek
    assert (rho_ek > rho_id).all(), (rho_ek, rho_id)
    # the same EK-FAC, refitted or passed in, and its self-influence equals the diagonal
    fitted = fit_ekfac(ghost, params, buffers, half_sq, x, y)
    again = influence_scores(ghost, params, buffers, half_sq, (x, y), (xq, yq),
                             method="ekfac", damping=lam, ekfac=fitted)
    torch.testing.assert_close(again, ek)
    selfs = self_influence(ghost, params, buffers, half_sq, (x[:20], y[:20]), damping=lam,
                           ekfac=fitted)
    diag = -torch.diagonal(influence_scores(ghost, params, buffers, half_sq, (x[:20], y[:20]),
                                            (x[:20], y[:20]), method="ekfac", damping=lam,
                                            ekfac=fitted))
    torch.testing.assert_close(selfs, diag)


def test_ekfac_other_layers():
    class EmbedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, t):
            return self.head(self.embed(t).mean(1))

    torch.manual_seed(0)
    net = EmbedMLP().to(D)
    ghost, params, buffers = make_ghost_model(net)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 7, (12, 5), generator=g), torch.randint(0, 3, (12,), generator=g)
    with pytest.raises(ValueError, match=r"covers nn.Linear layers only; the model also trains "
                                         r"'embed' \(embedding\).*other_layers='identity'"):
        fit_ekfac(ghost, params, buffers, xent, x, y)
    ek = fit_ekfac(ghost, params, buffers, xent, x, y, other_layers="identity")
    assert ek.identity == ("embed.weight",) and list(ek.layers) == ["head"]
    v = {k: torch.randn_like(t) for k, t in params.items()}
    out = ekfac_inverse_hvp(ek, v, damping=0.5)
    torch.testing.assert_close(out["embed.weight"], v["embed.weight"] / 0.5)
    # self-influence: the embedding's part is ||g||^2 / damping
    selfs = self_influence(ghost, params, buffers, xent, (x, y), damping=0.5, ekfac=ek)
    gi = jacrev(lambda p: xent(ghost({**params, **p}, buffers, x)[0], y))(params)
    xs = ekfac_inverse_hvp(ek, gi, damping=0.5, stacked=True)
    ref = sum((gi[k] * xs[k]).flatten(1).sum(1) for k in gi)
    torch.testing.assert_close(selfs, ref)
    with pytest.raises(ValueError, match=r"expected the keys \['embed.weight', 'head.bias', "
                                         r"'head.weight'\]"):
        ekfac_inverse_hvp(ek, {"head.weight": v["head.weight"]}, damping=0.5)
    with pytest.raises(ValueError, match=r"EK-FAC needs damping > 0"):
        ekfac_inverse_hvp(ek, v, damping=0.0)
    with pytest.raises(ValueError, match=r"fisher=\.\.\.\): expected one of \('ggn', "
                                         r"'empirical'\)"):
        fit_ekfac(ghost, params, buffers, xent, x, y, fisher="sampled")


@pytest.mark.parametrize("make", [make_ghost_model, make_functional])
def test_frozen_parameters_are_left_out(make):
    """Frozen params (requires_grad=False) are not in the gradients or the Hessian, with a
    GhostModel and with make_functional's model_fn alike (the latter once counted them)."""
    net = _mlp(4)
    net[0].requires_grad_(False)
    ghost, params, buffers = make(net)
    assert ghost.trainable == ("2.weight", "2.bias")
    x, y = _data(10, 10)
    xq, yq = _data(2, 11)
    train = {k: params[k] for k in ghost.trainable}
    h = hessian_matrix(lambda p: xent(ghost({**params, **p}, buffers, x)[0], y).mean(), train)
    lam = _damping_for(h)

    def grads(xs, ys):  # per-sample loop over the trainable parameters only
        named = dict(net.named_parameters())
        return torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(
            xent(net(xs[i:i + 1]), ys[i:i + 1])[0], [named[k] for k in sorted(train)])])
            for i in range(xs.shape[0])])

    ref = -grads(xq, yq) @ torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=D),
                                              grads(x, y).T)
    got = influence_scores(ghost, params, buffers, xent, (x, y), (xq, yq), damping=lam,
                           tol=1e-12)
    torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-10)
    gq, gx = grads(xq, yq), grads(x, y)
    torch.testing.assert_close(  # gradient similarity: only the trainable params' gradients
        influence_scores(ghost, params, buffers, xent, (x, y), (xq, yq), damping=2.0,
                         method="identity"), -(gq @ gx.T) / 2.0, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(self_influence(ghost, params, buffers, xent, (x, y),
                                              method="identity", damping=2.0),
                               gx.square().sum(1) / 2.0, rtol=1e-9, atol=1e-12)
    if make is make_ghost_model:
        ek = fit_ekfac(ghost, params, buffers, xent, x, y)
        assert list(ek.layers) == ["2"] and ek.identity == ()
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter is frozen"):
        influence_scores(make(net)[0], params, buffers, xent, (x, y), (xq, yq), damping=1.0)


def test_cg_on_the_gauss_newton_matrix_with_cross_entropy():
    # random init: H is indefinite (CG on it fails at damping 0.01) but the GGN is not
    net = _mlp(5)
    model_fn, params, buffers = make_functional(net)
    x, y = _data(24, 12)
    xq, yq = _data(3, 13)
    ggn = _ggn(model_fn, params, buffers, x, y, lambda o, t: F.cross_entropy(o[None], t[None]))
    gt, gq = _ref_grads(net, xent, x, y), _ref_grads(net, xent, xq, yq)
    ref = -gq @ torch.linalg.solve(ggn + 0.01 * torch.eye(ggn.shape[0], dtype=D), gt.T)
    got = influence_scores(model_fn, params, buffers, xent, (x, y), (xq, yq), damping=0.01,
                           curvature="ggn", tol=1e-12)
    torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-10)
    with pytest.raises(ValueError, match=r"not positive definite"):
        influence_scores(model_fn, params, buffers, xent, (x, y), (xq, yq), damping=0.01)
    selfs = self_influence(model_fn, params, buffers, xent, (x, y), method="cg",
                           curvature="ggn", damping=0.01, tol=1e-12)
    inv = torch.linalg.solve(ggn + 0.01 * torch.eye(ggn.shape[0], dtype=D), gt.T)
    torch.testing.assert_close(selfs, (gt * inv.T).sum(1), rtol=1e-7, atol=1e-10)


def test_attention_models_run_on_the_math_attention_kernel():
    """On an nn.TransformerEncoder (SDPA inside): influence scores and Hessian-vector products
    run (the fused CPU kernel has no double backward / forward-mode rule: torch's raw error
    before) and equal references computed on the math kernel."""
    from torchfn.functional import hvp

    e = zoo.build("tfm_encoder")
    x, y = e.batch(4, 0)
    xq, yq = e.batch(2, 1)
    model_fn, params, buffers = make_functional(e.module)
    names = sorted(params)

    def grads(xs, ys):
        named = dict(e.module.named_parameters())
        return torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(
            e.loss_fn(e.forward(xs[i:i + 1]), ys[i:i + 1])[0], [named[k] for k in names])])
            for i in range(xs.shape[0])])

    got = influence_scores(model_fn, params, buffers, e.loss_fn, (x, y), (xq, yq),
                           method="identity", damping=4.0)
    torch.testing.assert_close(got, -(grads(xq, yq) @ grads(x, y).T) / 4.0)
    v = {k: torch.randn_like(t) for k, t in params.items()}

    def f(p):
        return e.loss_fn(model_fn(p, buffers, x)[0], y).mean()

    with sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jvp(torch.func.grad(f), (params,), (v,))[1]
    got_hvp = hvp(f, params, v)
    for k in params:
        torch.testing.assert_close(got_hvp[k], want[k])
    assert influence_scores(model_fn, params, buffers, e.loss_fn, (x, y), (xq, yq),
                            damping=10.0, curvature="ggn").shape == (2, 4)
