"""Tests for torchfn.functional._transforms against plain torch.autograd loops, in float64."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from torchfn.functional._pytree import tree_ravel
from torchfn.functional._transforms import (
    empirical_ntk,
    hessian_diagonal,
    hessian_matrix,
    hvp,
    per_sample_grad_norms,
    per_sample_grads,
    single_sample_fn,
)

DT = torch.float64

# torch 2.13 itself warns (DeprecationWarning from torch.jit.script/script_method) the first time
# forward-mode AD or Inductor is imported; not ours to fix. See the report to the coordinator.
Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# models and plain references
# ---------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp_params(seed: int = 0, d: int = 4, h: int = 5, c: int = 3) -> Params:
    g = _gen(seed)
    return {
        "fc1.weight": torch.randn(h, d, generator=g, dtype=DT) / math.sqrt(d),
        "fc1.bias": torch.randn(h, generator=g, dtype=DT) * 0.1,
        "fc2.weight": torch.randn(c, h, generator=g, dtype=DT) / math.sqrt(h),
        "fc2.bias": torch.randn(c, generator=g, dtype=DT) * 0.1,
    }


def mlp(params: Params, x: torch.Tensor) -> torch.Tensor:
    """Works for one sample ``(d,)`` or a batch ``(B, d)``."""
    hidden = torch.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    return hidden @ params["fc2.weight"].T + params["fc2.bias"]


def mlp_loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(mlp(params, x), y)


def cnn_params(seed: int = 0) -> Params:
    g = _gen(seed)
    return {
        "conv.weight": torch.randn(3, 2, 3, 3, generator=g, dtype=DT) / 4,
        "conv.bias": torch.randn(3, generator=g, dtype=DT) * 0.1,
        "head.weight": torch.randn(4, 3 * 4 * 4, generator=g, dtype=DT) / 7,
        "head.bias": torch.zeros(4, dtype=DT),
    }


def cnn_model_fn(params: Params, buffers: Params, x: torch.Tensor) -> tuple[torch.Tensor, Params]:
    """Shared-contract model_fn: ``x`` is ``(B, 2, 6, 6)``; a normalising buffer is read."""
    x = (x - buffers["mean"]) / buffers["std"]
    z = F.relu(F.conv2d(x, params["conv.weight"], params["conv.bias"]))
    out = z.flatten(1) @ params["head.weight"].T + params["head.bias"]
    return out, {k: v.clone() for k, v in buffers.items()}


CNN_BUFFERS = {"mean": torch.tensor(0.1, dtype=DT), "std": torch.tensor(1.3, dtype=DT)}


def loop_grads(loss_fn: Any, params: Params, *batch: torch.Tensor) -> Params:
    """Reference: one torch.autograd.grad call per sample, stacked."""
    keys = list(params)
    rows: list[tuple[torch.Tensor, ...]] = []
    for i in range(batch[0].shape[0]):
        p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(p, *(b[i] for b in batch))
        rows.append(torch.autograd.grad(loss, [p[k] for k in keys]))
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(keys)}


def assert_trees_close(got: Params, expected: Params, **kw: Any) -> None:
    assert set(got) == set(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], **kw)


def batch_data(seed: int, n: int, d: int = 4, c: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, c, (n,), generator=g)


# ---------------------------------------------------------------------------------------------
# per-sample gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_per_sample_grads_mlp_matches_loop(chunk_size: int | None) -> None:
    params = mlp_params()
    x, y = batch_data(1, 7)
    got = per_sample_grads(mlp_loss, chunk_size=chunk_size)(params, x, y)
    assert got["fc1.weight"].shape == (7, 5, 4)
    assert_trees_close(got, loop_grads(mlp_loss, params, x, y))


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_per_sample_grads_cnn_model_fn_matches_loop(chunk_size: int | None) -> None:
    params = cnn_params()
    x = torch.randn(5, 2, 6, 6, generator=_gen(2), dtype=DT)
    y = torch.randint(0, 4, (5,), generator=_gen(3))
    f = single_sample_fn(cnn_model_fn, CNN_BUFFERS)

    def loss_fn(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(f(p, xi), yi)

    def batch_of_one_loss(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(cnn_model_fn(p, CNN_BUFFERS, xi[None])[0], yi[None])

    got = per_sample_grads(loss_fn, chunk_size=chunk_size)(params, x, y)
    assert_trees_close(got, loop_grads(batch_of_one_loss, params, x, y))
    # and the per-sample grads sum to the gradient of the summed batch loss
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    total = F.cross_entropy(cnn_model_fn(p, CNN_BUFFERS, x)[0], y, reduction="sum")
    batch_grads = dict(zip(p, torch.autograd.grad(total, list(p.values())), strict=True))
    assert_trees_close({k: v.sum(0) for k, v in got.items()}, batch_grads)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_per_sample_grads_has_aux(chunk_size: int | None) -> None:
    params = mlp_params(1)
    x, y = batch_data(4, 7)

    def loss_with_logits(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> tuple:
        logits = mlp(p, xi)
        return F.cross_entropy(logits, yi), {"logits": logits}

    grads, aux = per_sample_grads(loss_with_logits, has_aux=True, chunk_size=chunk_size)(
        params, x, y)
    assert_trees_close(grads, loop_grads(mlp_loss, params, x, y))
    torch.testing.assert_close(aux["logits"], mlp(params, x))


def test_per_sample_grads_tuple_argnums_and_in_dims() -> None:
    """Gradients with respect to params AND each sample's input; a shared scale via in_dims."""
    params = mlp_params(2)
    x, y = batch_data(5, 6)
    scale = torch.tensor(0.7, dtype=DT)

    def loss_fn(p: Params, xi: torch.Tensor, s: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(mlp(p, s * xi), yi)

    g_params, g_x = per_sample_grads(loss_fn, argnums=(0, 1), in_dims=(None, 0, None, 0))(
        params, x, scale, y)
    assert_trees_close(g_params, loop_grads(lambda p, xi, yi: loss_fn(p, xi, scale, yi),
                                            params, x, y))
    ref_x = []
    for i in range(6):
        xi = x[i].clone().requires_grad_(True)
        ref_x.append(torch.autograd.grad(loss_fn(params, xi, scale, y[i]), xi)[0])
    torch.testing.assert_close(g_x, torch.stack(ref_x))


@pytest.mark.parametrize(("p", "chunk_size"), [(2.0, None), (1.0, 2), (math.inf, None)])
def test_per_sample_grad_norms_matches_loop(p: float, chunk_size: int | None) -> None:
    params = mlp_params(3)
    x, y = batch_data(6, 7)
    ref = loop_grads(mlp_loss, params, x, y)
    flat = torch.cat([ref[k].flatten(1) for k in ref], dim=1)
    expected = torch.linalg.vector_norm(flat, ord=p, dim=1)
    got = per_sample_grad_norms(mlp_loss, p=p, chunk_size=chunk_size)(params, x, y)
    assert got.shape == (7,)
    torch.testing.assert_close(got, expected)

    def with_aux(pp: Params, xi: torch.Tensor, yi: torch.Tensor) -> tuple:
        loss = mlp_loss(pp, xi, yi)
        return loss, loss.detach()

    norms, losses = per_sample_grad_norms(with_aux, p=p, has_aux=True)(params, x, y)
    torch.testing.assert_close(norms, expected)
    torch.testing.assert_close(losses, F.cross_entropy(mlp(params, x), y, reduction="none"))


def test_per_sample_grads_compiled_fullgraph_matches_eager_without_recompiling() -> None:
    params = {"w": torch.randn(3, 2, generator=_gen(0), dtype=DT)}

    def loss_fn(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(p["w"] @ xi) - yi).pow(2).sum()

    graphs = []

    def counting_inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    eager = per_sample_grads(loss_fn, chunk_size=2)
    compiled = torch.compile(eager, fullgraph=True, backend=counting_inductor)
    for seed in (1, 2):
        g = _gen(seed)
        x, y = torch.randn(5, 2, generator=g, dtype=DT), torch.randn(5, 3, generator=g, dtype=DT)
        assert_trees_close(compiled(params, x, y), eager(params, x, y))
        assert_trees_close(compiled(params, x, y), loop_grads(loss_fn, params, x, y))
    assert len(graphs) == 1, "the second call with new data of the same shape recompiled"


# ---------------------------------------------------------------------------------------------
# Hessian-vector products, Hessians, Hessian diagonals
# ---------------------------------------------------------------------------------------------


def _batch_loss_setup(seed: int = 0) -> tuple[Params, torch.Tensor, torch.Tensor]:
    params = mlp_params(seed, d=3, h=4, c=2)  # 12 + 4 + 8 + 2 = 26 parameters
    x, y = batch_data(seed + 10, 8, d=3, c=2)
    return params, x, y


def batch_loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(mlp(params, x), y) + 0.05 * sum((v**4).sum() for v in params.values())


def _flat_hessian(params: Params, *args: Any) -> torch.Tensor:
    """Reference dense Hessian via torch.autograd.functional.hessian over the raveled params."""
    flat, unravel = tree_ravel(params)
    return torch.autograd.functional.hessian(lambda v: batch_loss(unravel(v), *args), flat)


@pytest.mark.parametrize("mode", ["forward_over_reverse", "reverse_over_reverse"])
def test_hvp_matches_double_backward_and_autograd_functional(mode: str) -> None:
    params, x, y = _batch_loss_setup()
    g = _gen(7)
    v = {k: torch.randn(t.shape, generator=g, dtype=DT) for k, t in params.items()}
    got = hvp(batch_loss, params, v, x, y, mode=mode)

    keys = list(params)
    p = {k: params[k].clone().requires_grad_(True) for k in keys}
    grads = torch.autograd.grad(batch_loss(p, x, y), [p[k] for k in keys], create_graph=True)
    gv = sum((gi * v[k]).sum() for gi, k in zip(grads, keys, strict=True))
    double_backward = dict(zip(keys, torch.autograd.grad(gv, [p[k] for k in keys]), strict=True))
    assert_trees_close(got, double_backward)

    _, ref = torch.autograd.functional.hvp(
        lambda *ts: batch_loss(dict(zip(keys, ts, strict=True)), x, y),
        tuple(params[k] for k in keys), tuple(v[k] for k in keys))
    assert_trees_close(got, dict(zip(keys, ref, strict=True)))


def test_hvp_of_mse_loss_reverse_mode_and_forward_mode_error() -> None:
    """F.mse_loss breaks forward-over-reverse on torch 2.13 (pytorch #123996); rev-rev works."""
    params, x, _ = _batch_loss_setup(5)
    target = torch.randn(8, 2, generator=_gen(9), dtype=DT)
    v = {k: torch.randn(t.shape, generator=_gen(10), dtype=DT) for k, t in params.items()}

    def mse(p: Params) -> torch.Tensor:
        return F.mse_loss(mlp(p, x), target)

    def written_out(p: Params) -> torch.Tensor:
        return ((mlp(p, x) - target) ** 2).mean()

    expected = hvp(written_out, params, v)  # forward-over-reverse without mse_loss
    keys = list(params)
    _, ref = torch.autograd.functional.hvp(lambda *ts: mse(dict(zip(keys, ts, strict=True))),
                                           tuple(params[k] for k in keys),
                                           tuple(v[k] for k in keys))
    assert_trees_close(expected, dict(zip(keys, ref, strict=True)))
    assert_trees_close(hvp(mse, params, v, mode="reverse_over_reverse"), expected)
    try:
        forward = hvp(mse, params, v)
    except RuntimeError as e:  # until torch fixes #123996: our message names the way out
        assert "mode='reverse_over_reverse'" in str(e) and "#123996" in str(e)
    else:  # fixed in this torch: then it must be right
        assert_trees_close(forward, expected)


def test_hessian_matrix_matches_autograd_functional() -> None:
    params, x, y = _batch_loss_setup(1)
    got = hessian_matrix(batch_loss, params, x, y)
    assert got.shape == (26, 26)
    torch.testing.assert_close(got, _flat_hessian(params, x, y))


@pytest.mark.parametrize(("chunk_size", "hvp_mode"),
                         [(None, "forward_over_reverse"), (7, "reverse_over_reverse")])
def test_exact_hessian_diagonal_matches_diag_of_hessian(chunk_size: int | None,
                                                        hvp_mode: str) -> None:
    params, x, y = _batch_loss_setup(2)
    got = hessian_diagonal(batch_loss, params, x, y, exact=True, chunk_size=chunk_size,
                           hvp_mode=hvp_mode)
    _, unravel = tree_ravel(params)
    assert_trees_close(got, unravel(torch.diagonal(_flat_hessian(params, x, y))))


def test_hutchinson_equals_its_formula_on_the_same_probes() -> None:
    """mean_k z_k * (H z_k) with z drawn exactly as documented, H from autograd.functional."""
    params, x, y = _batch_loss_setup(3)
    n = 64
    got = hessian_diagonal(batch_loss, params, x, y, n_samples=n, generator=_gen(11))
    z = torch.randint(0, 2, (n, 26), generator=_gen(11), dtype=DT) * 2 - 1
    hess = _flat_hessian(params, x, y)
    _, unravel = tree_ravel(params)
    assert_trees_close(got, unravel((z * (z @ hess)).mean(0)))


@pytest.mark.parametrize("chunk_size", [None, 700])
def test_hutchinson_is_unbiased_and_reproducible(chunk_size: int | None) -> None:
    params, x, y = _batch_loss_setup(4)
    n = 3000
    hess = _flat_hessian(params, x, y)
    diag = torch.diagonal(hess)
    # entry i of the mean over n probes has std sqrt(sum_{j != i} H_ij^2 / n)
    std = torch.sqrt(((hess**2).sum(1) - diag**2) / n)
    assert 5 * std.max() < 0.05 * diag.abs().max()  # the bound below is a real constraint

    est = hessian_diagonal(batch_loss, params, x, y, n_samples=n, generator=_gen(5),
                           chunk_size=chunk_size)
    flat_est = tree_ravel(est)[0]
    assert torch.all((flat_est - diag).abs() <= 5 * std + 1e-12), (flat_est - diag) / std

    again = hessian_diagonal(batch_loss, params, x, y, n_samples=n, generator=_gen(5),
                             chunk_size=chunk_size)
    other = hessian_diagonal(batch_loss, params, x, y, n_samples=n, generator=_gen(6),
                             chunk_size=chunk_size)
    assert all(torch.equal(est[k], again[k]) for k in est)
    assert not all(torch.equal(est[k], other[k]) for k in est)


# ---------------------------------------------------------------------------------------------
# empirical NTK
# ---------------------------------------------------------------------------------------------


def loop_jacobian(f: Any, params: Params, x: torch.Tensor) -> torch.Tensor:
    """Reference ``(N, O, P)``: one torch.autograd.grad per (sample, output)."""
    keys = list(params)
    rows = []
    for i in range(x.shape[0]):
        p = {k: params[k].clone().requires_grad_(True) for k in keys}
        out = f(p, x[i]).reshape(-1)
        per_output = []
        for a in range(out.shape[0]):
            g = torch.autograd.grad(out[a], [p[k] for k in keys], retain_graph=True)
            per_output.append(torch.cat([gi.reshape(-1) for gi in g]))
        rows.append(torch.stack(per_output))
    return torch.stack(rows)


def reference_ntk(f: Any, params: Params, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    j1, j2 = loop_jacobian(f, params, x1), loop_jacobian(f, params, x2)
    (n1, o, p), n2 = j1.shape, j2.shape[0]
    full = j1.reshape(n1 * o, p) @ j2.reshape(n2 * o, p).T
    return full.reshape(n1, o, n2, o).permute(0, 2, 1, 3)


@pytest.mark.parametrize("same_inputs", [False, True])
def test_empirical_ntk_all_modes_match_jacobian_products(same_inputs: bool) -> None:
    params = mlp_params(5)
    x1 = torch.randn(4, 4, generator=_gen(1), dtype=DT)
    x2 = x1 if same_inputs else torch.randn(3, 4, generator=_gen(2), dtype=DT)
    ref = reference_ntk(mlp, params, x1, x2)
    arg2 = None if same_inputs else x2
    full = empirical_ntk(mlp, params, x1, arg2)
    assert full.shape == (4, x2.shape[0], 3, 3)
    torch.testing.assert_close(full, ref)
    torch.testing.assert_close(empirical_ntk(mlp, params, x1, arg2, mode="trace", chunk_size=3),
                               torch.diagonal(ref, dim1=2, dim2=3).sum(-1))
    torch.testing.assert_close(empirical_ntk(mlp, params, x1, arg2, mode="diagonal"),
                               torch.diagonal(ref, dim1=2, dim2=3))


def test_empirical_ntk_of_model_fn_contract() -> None:
    params = cnn_params(1)
    f = single_sample_fn(cnn_model_fn, CNN_BUFFERS)
    x1 = torch.randn(3, 2, 6, 6, generator=_gen(3), dtype=DT)
    x2 = torch.randn(2, 2, 6, 6, generator=_gen(4), dtype=DT)
    torch.testing.assert_close(empirical_ntk(f, params, x1, x2),
                               reference_ntk(f, params, x1, x2))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argnums", ["0", -1, (), (0, 0), 1.5, True])
def test_bad_argnums(argnums: Any) -> None:
    with pytest.raises(ValueError, match=r"per_sample_grads: `argnums` must be a non-negative"):
        per_sample_grads(mlp_loss, argnums=argnums)


def test_argnums_out_of_range_at_call() -> None:
    x, y = batch_data(0, 4)
    with pytest.raises(ValueError, match=r"argnums=3 refers to argument position 3, but the "
                                         r"function was called with 3 positional"):
        per_sample_grads(mlp_loss, argnums=3)(mlp_params(), x, y)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.0])
def test_bad_chunk_size(chunk_size: Any) -> None:
    with pytest.raises(ValueError, match=r"`chunk_size` must be None or a positive int, got "
                                         + str(chunk_size)):
        per_sample_grads(mlp_loss, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"per_sample_grad_norms: `chunk_size`"):
        per_sample_grad_norms(mlp_loss, chunk_size=chunk_size)


def test_non_scalar_loss_names_the_shape() -> None:
    x, y = batch_data(0, 4)
    per_class = per_sample_grads(lambda p, xi, yi: mlp(p, xi))
    with pytest.raises(ValueError, match=r"0-d \(scalar\) tensor for ONE sample, got a tensor "
                                         r"of shape \(3,\)"):
        per_class(mlp_params(), x, y)
    batched_by_mistake = per_sample_grads(
        lambda p, xi, yi: F.cross_entropy(mlp(p, xi[None]), yi[None], reduction="none"))
    with pytest.raises(ValueError, match=r"got a tensor of shape \(1,\)"):
        batched_by_mistake(mlp_params(), x, y)
    with pytest.raises(ValueError, match=r"with has_aux=True the function must return a tuple"):
        per_sample_grads(mlp_loss, has_aux=True)(mlp_params(), x, y)
    with pytest.raises(ValueError, match=r"hvp: .*got a tensor of shape \(4, 3\)"):
        hvp(lambda p: mlp(p, x), mlp_params(), mlp_params(1))


def test_mismatched_batch_sizes_name_positions() -> None:
    x, _ = batch_data(0, 8)
    y = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"argument 1: 8, argument 2: 5"):
        per_sample_grads(mlp_loss)(mlp_params(), x, y)
    with pytest.raises(ValueError, match=r"argument 2 has shape \(\), which has no dim 0"):
        per_sample_grads(mlp_loss)(mlp_params(), x, torch.tensor(1))
    with pytest.raises(ValueError, match=r"empirical_ntk: .*\(x1 \(leaf 'a.0'\): 8, x1 \(leaf "
                                         r"'a.1'\): 5, x1 \(leaf 'b'\): 5\)"):
        empirical_ntk(lambda p, xs: mlp(p, xs[0]), mlp_params(), {"a": (x, x[:5]), "b": y})


def test_bad_in_dims() -> None:
    x, y = batch_data(0, 4)
    with pytest.raises(ValueError, match=r"`in_dims` must be a tuple with one entry per "
                                         r"positional argument \(3 here"):
        per_sample_grads(mlp_loss, in_dims=(None, 0))(mlp_params(), x, y)


def test_second_order_argument_errors() -> None:
    params, x, y = _batch_loss_setup()
    v = {k: t for k, t in params.items() if k != "fc2.bias"}
    with pytest.raises(ValueError, match=r"hvp: `v` must have the same structure as `params`; "
                                         r"v has missing keys \['fc2.bias'\]"):
        hvp(batch_loss, params, v, x, y)
    v = dict(params, **{"fc2.bias": torch.zeros(3, dtype=DT)})
    with pytest.raises(ValueError, match=r"leaf 'fc2.bias' has shape \(2,\) in `params` but "
                                         r"\(3,\) in `v`"):
        hvp(batch_loss, params, v, x, y)
    with pytest.raises(ValueError, match=r"`mode` must be one of"):
        hvp(batch_loss, params, params, x, y, mode="reverse")
    with pytest.raises(TypeError, match=r"needs an explicit `generator`"):
        hessian_diagonal(batch_loss, params, x, y, n_samples=10)
    with pytest.raises(ValueError, match=r"`n_samples` must be a positive int, got 0"):
        hessian_diagonal(batch_loss, params, x, y, n_samples=0, generator=_gen(0))
    with pytest.raises(ValueError, match=r"exact=True takes no `n_samples`/`generator`"):
        hessian_diagonal(batch_loss, params, x, y, exact=True, generator=_gen(0))
    with pytest.raises(ValueError, match=r"empirical_ntk: `mode` must be one of"):
        empirical_ntk(mlp, params, x, mode="diag")


# ---------------------------------------------------------------------------------------------
# batch norm: per-sample gradients refused in training mode (regression: silently wrong)
# ---------------------------------------------------------------------------------------------


def _bn_nets() -> dict[str, torch.nn.Module]:
    from torch import nn

    torch.manual_seed(0)
    return {
        "bn1d": nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)),
        "bn1d_seq": nn.Sequential(nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.Flatten(),
                                  nn.Linear(4 * 3, 3)),
        "bn2d": nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                              nn.Linear(4 * 2 * 2, 3)),
    }


_BN_INPUTS = {"bn1d": (4,), "bn1d_seq": (2, 5), "bn2d": (2, 4, 4)}


@pytest.mark.parametrize("name", ["bn1d", "bn1d_seq", "bn2d"])
def test_per_sample_grads_refuse_batchnorm_in_training_mode(name: str) -> None:
    from torchfn.functional import make_functional

    net = _bn_nets()[name].to(DT)
    for m in net.modules():  # non-trivial running statistics for the eval-mode reference
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5, generator=_gen(1))
            m.running_var.uniform_(0.5, 2.0, generator=_gen(2))
    x = torch.randn(5, *_BN_INPUTS[name], generator=_gen(3), dtype=DT)
    y = torch.randint(0, 3, (5,), generator=_gen(4))
    for replace in (True, False):
        model_fn, params, buffers = make_functional(net, replace_batchnorm=replace)
        with pytest.raises(ValueError, match=r"single_sample_fn\(model_fn, buffers\): '1' is a "
                                             r"BatchNorm(1d|2d)? in training mode.*model_fn\.eval"):
            single_sample_fn(model_fn, buffers)
    # a hand-written per-sample loss (no single_sample_fn): torchfn's batch norm refuses under vmap
    model_fn, params, buffers = make_functional(net)

    def loss(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model_fn(p, buffers, xi[None])[0][0], yi)

    for transform in (per_sample_grads, per_sample_grad_norms):
        with pytest.raises(ValueError, match=r"batch norm in training mode got one sample .* "
                                             r"under vmap.*\.eval\(\)"):
            transform(loss)(params, x, y)
    # eval mode (running statistics) keeps working and equals a per-sample autograd loop
    f = single_sample_fn(model_fn.eval(), buffers)
    got = per_sample_grads(lambda p, xi, yi: F.cross_entropy(f(p, xi), yi))(params, x, y)
    norms = per_sample_grad_norms(lambda p, xi, yi: F.cross_entropy(f(p, xi), yi))(params, x, y)
    net.eval()
    for i in range(5):
        want = torch.autograd.grad(F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]),
                                   list(net.parameters()))
        for (k, _), w in zip(net.named_parameters(), want, strict=True):
            torch.testing.assert_close(got[k][i], w)
        torch.testing.assert_close(norms[i], torch.cat([w.flatten() for w in want]).norm())


def test_per_sample_grads_refuse_batchnorm_without_running_stats() -> None:
    from torch import nn

    from torchfn.functional import make_functional

    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, track_running_stats=False),
                        nn.Flatten()).to(DT).eval()  # eval, but still batch statistics
    model_fn, params, buffers = make_functional(net)
    with pytest.raises(ValueError, match="'1' is a BatchNorm without running statistics"):
        single_sample_fn(model_fn, buffers)

    def loss(p: Params, xi: torch.Tensor) -> torch.Tensor:
        return model_fn(p, buffers, xi[None])[0].sum()

    with pytest.raises(ValueError, match="batch norm without running statistics got one sample"):
        per_sample_grads(loss)(params, torch.randn(3, 2, 4, 4, dtype=DT))
