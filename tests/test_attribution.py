"""Per-sample gradient inner products (grad_inner_products, GhostGrads.inner, tracin_scores)
against explicit dot products of per-sample gradients from a loop of torch.autograd.grad,
float64 on CPU: an MLP (one frozen layer), a sequence model, a conv net, LayerNorm +
Embedding, a tied embedding/head and an nn.TransformerEncoder LM; per-layer sums; the ghost
form never materialises a linear layer; bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.persample import grad_inner_products, make_ghost_model, tracin_scores

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}


def sq_loss(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).flatten(1).sum(1)


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def loop_flat(ghost, params, buffers, x, y, loss_fn) -> Tensor:
    """(B, P): every sample's gradient over the trainable parameters, by autograd.grad."""
    names = [k for k in params if k not in ghost.frozen]
    rows = []
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_(k in names) for k, v in params.items()}
        loss = loss_fn(ghost(p, buffers, x[i:i + 1])[0], y[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, [p[k] for k in names], allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p[k]) if g is None else g).flatten()
                               for k, g in zip(names, grads, strict=True)]))
    return torch.stack(rows)


class Seq(nn.Module):  # nn.Linear over (B, T, d)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class EmbNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.ln(self.emb(ids)).mean(1))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(11, 5), nn.Linear(5, 5), nn.Linear(5, 11)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 13)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.enc(self.emb(ids)))


def mlp() -> nn.Module:
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))
    net[2].requires_grad_(False)  # frozen: not counted
    return net


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, groups=2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def ids(b: int, t: int, v: int) -> Tensor:
    return torch.randint(0, v, (b, t))


CASES = {  # name: (module, train x, train y, query x, query y, loss)
    "mlp": (mlp, lambda b: torch.randn(b, 5), lambda b: torch.randn(b, 3), sq_loss),
    "seq": (Seq, lambda b: torch.randn(b, 4, 4), lambda b: torch.randn(b, 4, 3), sq_loss),
    "conv": (conv, lambda b: torch.randn(b, 2, 6, 6), lambda b: torch.randn(b, 3), sq_loss),
    "emb_norm": (EmbNorm, lambda b: ids(b, 5, 11), lambda b: torch.randn(b, 2), sq_loss),
    "tied": (TiedLM, lambda b: ids(b, 4, 11), lambda b: ids(b, 4, 11), lm_loss),
    "encoder": (TinyEncoder, lambda b: ids(b, 5, 13), lambda b: ids(b, 5, 13), lm_loss),
}


def test_cases_cover_the_rules() -> None:
    kinds = {name: set(setup(name)[0].layer_kinds.values()) for name in CASES}
    assert kinds["conv"] == {"conv", "linear"} and kinds["emb_norm"] == {"embedding", "norm",
                                                                          "linear"}
    assert {"attention", "norm", "linear", "embedding"} <= kinds["encoder"], kinds["encoder"]


def setup(name: str, n_train: int = 5, n_query: int = 3):
    torch.manual_seed(0)
    make, mx, my, loss = CASES[name]
    ghost, params, buffers = make_ghost_model(make().to(F64))
    cast = lambda t: t.to(F64) if t.is_floating_point() else t  # noqa: E731
    xs, ys, xq, yq = cast(mx(n_train)), cast(my(n_train)), cast(mx(n_query)), cast(my(n_query))
    return ghost, params, buffers, xs, ys, xq, yq, loss


@pytest.mark.parametrize("name", list(CASES))
def test_inner_products_equal_explicit_dot_products(name: str) -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup(name)
    ref = loop_flat(ghost, params, buffers, xs, ys, loss) @ loop_flat(
        ghost, params, buffers, xq, yq, loss).T
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    assert got.shape == (5, 3) and got.dtype == F64
    torch.testing.assert_close(got, ref, **TOL)
    per_layer = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, per_layer=True)
    assert set(per_layer) == set(ghost.layer_kinds)
    torch.testing.assert_close(sum(per_layer.values()), ref, **TOL)
    # the self inner products have the squared norms on their diagonal, per layer too
    res = ghost.per_sample(params, buffers, xs, ys, loss).grads
    self_layers = res.inner(res, per_layer=True)
    norms = res.sq_norms(per_layer=True)
    assert set(self_layers) == set(norms)
    for k, v in norms.items():
        torch.testing.assert_close(self_layers[k].diagonal(), v, **TOL, msg=k)


def test_frozen_layer_is_left_out() -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup("mlp")
    assert ghost.frozen == ("2.weight", "2.bias")
    per_layer = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, per_layer=True)
    assert set(per_layer) == {"0", "4"}


def test_mlp_per_layer_equals_each_layers_dot_products() -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup("mlp")
    per_layer = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, per_layer=True)
    for layer in ("0", "4"):
        keep = {f"{layer}.weight", f"{layer}.bias"}
        # reference: the explicit gradients restricted to this layer's parameters
        full = loop_flat(ghost, params, buffers, xs, ys, loss), loop_flat(
            ghost, params, buffers, xq, yq, loss)
        sizes = [params[k].numel() for k in params if k not in ghost.frozen]
        names = [k for k in params if k not in ghost.frozen]
        cols = torch.cat([torch.full((n,), k in keep) for k, n in zip(names, sizes, strict=True)])
        ref = full[0][:, cols] @ full[1][:, cols].T
        torch.testing.assert_close(per_layer[layer], ref, **TOL, msg=layer)


@pytest.mark.parametrize("name", ["mlp", "seq"])
def test_linear_layers_are_never_materialised(name: str, monkeypatch) -> None:
    """Dense layers take the ghost form by the cost rule; sequence linears when it is forced."""
    from torchfn.persample import _ghost_grads, _ghost_layers

    ghost, params, buffers, xs, ys, xq, yq, loss = setup(name)
    expect = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    if name == "seq":  # T = 4 positions: materialising is cheaper at these sizes
        monkeypatch.setattr(_ghost_grads, "inner_route", lambda x, y: "ghost")

    def refuse(self):
        raise AssertionError("materialize called")

    monkeypatch.setattr(_ghost_layers._LinearLike, "materialize", refuse)
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    torch.testing.assert_close(got, expect, **TOL)


def test_ghost_form_blocks_over_train_rows(monkeypatch) -> None:
    """The (rows, B2, T, S) Gram blocks: one train row at a time gives the same numbers."""
    from torchfn.persample import _ghost_grads

    ghost, params, buffers, xs, ys, xq, yq, loss = setup("seq")
    expect = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    monkeypatch.setattr(_ghost_grads, "inner_route", lambda x, y: "ghost")
    torch.testing.assert_close(grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq),
                               expect, **TOL)
    monkeypatch.setattr(_ghost_grads, "_GHOST_INNER_BLOCK", 1)
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    torch.testing.assert_close(got, expect, **TOL)


def test_tracin_sums_lr_weighted_checkpoints() -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup("emb_norm")
    later = {k: v + 0.1 * torch.randn_like(v) for k, v in params.items()}
    lrs = [0.3, 0.05]
    ref = sum(lr * loop_flat(ghost, w, buffers, xs, ys, loss)
              @ loop_flat(ghost, w, buffers, xq, yq, loss).T
              for w, lr in zip([params, later], lrs, strict=True))
    got = tracin_scores(ghost, loss, [params, later], lrs, buffers, xs, ys, xq, yq)
    torch.testing.assert_close(got, ref, **TOL)
    per_layer = tracin_scores(ghost, loss, [params, later], lrs, buffers, xs, ys, xq, yq,
                              per_layer=True)
    torch.testing.assert_close(sum(per_layer.values()), ref, **TOL)


def test_bad_arguments() -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup("mlp")
    with pytest.raises(ValueError, match=r"train_inputs has batch 5 but train_targets has batch 4"):
        grad_inner_products(ghost, loss, params, buffers, xs, ys[:4], xq, yq)
    with pytest.raises(ValueError, match=r"query_inputs has batch 3 but query_targets has batch 2"):
        grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq[:2])
    with pytest.raises(ValueError, match=r"loss_fn\(outputs, targets\) must return the \(B,\)"):
        grad_inner_products(ghost, lambda o, t: sq_loss(o, t).sum(), params, buffers,
                            xs, ys, xq, yq)
    with pytest.raises(TypeError, match=r"ghost=\.\.\.\): expected a GhostModel"):
        grad_inner_products(nn.Linear(5, 3), loss, params, buffers, xs, ys, xq, yq)
    with pytest.raises(TypeError, match=r"loss_fn=\.\.\.\): expected a callable"):
        grad_inner_products(ghost, None, params, buffers, xs, ys, xq, yq)
    other, p2, b2 = make_ghost_model(Seq().to(F64))
    a = ghost.per_sample(params, buffers, xs, ys, loss).grads
    b = other.per_sample(p2, b2, torch.randn(2, 4, 4, dtype=F64), torch.randn(2, 4, 3, dtype=F64),
                         loss).grads
    with pytest.raises(ValueError, match=r"other comes from a different model"):
        a.inner(b)
    with pytest.raises(TypeError, match=r"expected a GhostGrads, got Tensor"):
        a.inner(xs)
    with pytest.raises(ValueError, match=r"one learning rate per checkpoint.*2 checkpoints and 1"):
        tracin_scores(ghost, loss, [params, params], [0.1], buffers, xs, ys, xq, yq)


class ConvZoo(nn.Module):
    """Conv1d and Conv2d with stride, padding (also 'same' and a non-zero mode), dilation and
    groups, two calls of one conv, and a dense head. ``c3`` (groups 3, 3 output positions)
    keeps its patches (a grouped linear part); the depthwise ``dw`` materialises its per-sample
    gradients already for the norms (``L (k + o) > k o``), so its inner products use them."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 6, 3, padding="same", dilation=2, padding_mode="reflect")
        self.c3 = nn.Conv2d(6, 12, 3, stride=3, padding=(0, 2), groups=3, bias=False)
        self.dw = nn.Conv2d(12, 12, 3, padding=1, groups=12)
        self.c4 = nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=2)
        self.head = nn.Linear(12 + 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.c1(x))
        h = torch.tanh(self.c2(h))
        h = self.dw(torch.tanh(self.c3(h)))
        seq = h.flatten(2)[:, :3]  # (B, 3, L): a 1-D signal for the Conv1d, called twice
        s = torch.tanh(self.c4(seq)).mean(2) + torch.tanh(self.c4(seq.flip(2))).mean(2)
        return self.head(torch.cat([h.mean((2, 3)), s], 1))


CASES["conv_zoo"] = (ConvZoo, lambda b: torch.randn(b, 2, 9, 9), lambda b: torch.randn(b, 3),
                     sq_loss)


@pytest.mark.parametrize("route", ["auto", "ghost", "materialize"])
@pytest.mark.parametrize("name", ["conv_zoo", "conv", "seq", "encoder"])
def test_each_inner_route_equals_explicit_dot_products(name: str, route: str,
                                                       monkeypatch) -> None:
    """Both forms of every linear part (convs with stride/padding/dilation/groups, Conv1d,
    sequence linears, attention projections), and the cost rule's mix, equal the loop."""
    from torchfn.persample import _ghost_grads

    ghost, params, buffers, xs, ys, xq, yq, loss = setup(name)
    ref = loop_flat(ghost, params, buffers, xs, ys, loss) @ loop_flat(
        ghost, params, buffers, xq, yq, loss).T
    chosen: list[str] = []
    rule = _ghost_grads.inner_route

    def spy(x, y):
        chosen.append(rule(x, y) if route == "auto" else route)
        return chosen[-1]

    monkeypatch.setattr(_ghost_grads, "inner_route", spy)
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    torch.testing.assert_close(got, ref, **TOL)
    assert chosen and set(chosen) == ({route} if route != "auto" else set(chosen))
    if name == "conv_zoo":  # c1, c2, c3 (grouped), c4 (Conv1d), head: linear parts
        assert len(chosen) == 5


def test_conv_ghost_form_never_materialises(monkeypatch) -> None:
    from torchfn.persample import _ghost_grads, _ghost_layers

    ghost, params, buffers, xs, ys, xq, yq, loss = setup("conv_zoo")
    assert set(ghost.layer_kinds.values()) == {"conv", "linear"}
    ref = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    monkeypatch.setattr(_ghost_grads, "inner_route", lambda x, y: "ghost")

    def refuse(self):
        raise AssertionError("materialize called")

    monkeypatch.setattr(_ghost_layers._LinearLike, "materialize", refuse)
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("kernel", [(3, 3), (1, 1), (2, 3)])
@pytest.mark.parametrize("stride", [(1, 1), (2, 3)])
@pytest.mark.parametrize("dilation", [(1, 1), (2, 1)])
@pytest.mark.parametrize("padding", [(0, 0), (1, 2)])
def test_conv_patches_equal_f_unfold(kernel, stride, dilation, padding) -> None:
    """The conv rule's batched patches (one strided copy for the batch) are ``F.unfold``'s,
    the same numbers in the same layout, also for non-contiguous inputs and an empty batch."""
    from torchfn.persample._ghost_layers import _unfold2d

    x = torch.randn(3, 4, 11, 10, dtype=F64)
    for inp in (x, x.transpose(2, 3), x.to(memory_format=torch.channels_last), x[:0]):
        ref = F.unfold(inp, kernel, dilation=dilation, padding=padding, stride=stride)
        got = _unfold2d(inp, kernel, dilation, padding, stride)
        assert got.shape == ref.shape and torch.equal(got, ref)


def test_conv_rule_never_calls_per_sample_im2col(monkeypatch) -> None:
    """``F.unfold`` runs one im2col kernel per sample; the conv rule forms the patches of the
    whole batch at once, and the scores still equal the explicit dot products (float64)."""
    from torchfn.persample import _ghost_layers

    def refuse(*args, **kwargs):
        raise AssertionError("F.unfold called")

    ghost, params, buffers, xs, ys, xq, yq, loss = setup("conv_zoo")
    ref = loop_flat(ghost, params, buffers, xs, ys, loss) @ loop_flat(
        ghost, params, buffers, xq, yq, loss).T
    monkeypatch.setattr(_ghost_layers.F, "unfold", refuse)
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, chunk_size=2)
    torch.testing.assert_close(got, ref, **TOL)


def test_inner_route_cost_rule() -> None:
    """Ghost iff B1 B2 T S (k + o) <= (B1 T + B2 S + B1 B2) o k (k, o per group)."""
    from torchfn.persample._ghost_grads import inner_route
    from torchfn.persample._ghost_layers import _LinearLike

    def lin(b: int, t: int | None, k: int, o: int, groups: int = 1) -> _LinearLike:
        shape = (b, k * groups) if t is None else (b, t, k * groups)
        gshape = (b, o * groups) if t is None else (b, t, o * groups)
        return _LinearLike(torch.zeros(shape), torch.zeros(gshape), groups,
                           torch.Size((o * groups, k)), True)

    assert inner_route(lin(1000, None, 3136, 128), lin(100, None, 3136, 128)) == "ghost"
    # the benchmark CNN's conv2: 196 positions, 288-entry patches, 64 channels
    assert inner_route(lin(1000, 196, 288, 64), lin(1000, 196, 288, 64)) == "materialize"
    # a late strided conv: 4 positions, 4608-entry patches, 512 channels
    assert inner_route(lin(1000, 4, 4608, 512), lin(1000, 4, 4608, 512)) == "ghost"
    # boundary: B = 2, T = S = 2, k = 2, o = 4: 16 * 6 = 96 = (4 + 4 + 4) * 8 -> ghost (ties
    # go to the ghost form); T = S = 3: 36 * 6 = 216 > (6 + 6 + 4) * 8 = 128 -> materialise
    assert inner_route(lin(2, 2, 2, 4), lin(2, 2, 2, 4)) == "ghost"
    assert inner_route(lin(2, 3, 2, 4), lin(2, 3, 2, 4)) == "materialize"
    # T and S may differ (two batches of different sequence lengths)
    assert inner_route(lin(2, 2, 2, 4), lin(2, 3, 2, 4)) == "materialize"  # 144 > 112
    # groups cancel out: depthwise (k = 9, o = 1) is materialised even at one position,
    # a grouped conv with k = 18, o = 4 takes the ghost form at one position, not at three
    assert inner_route(lin(50, 1, 9, 1, groups=8), lin(50, 1, 9, 1, groups=8)) == "materialize"
    assert inner_route(lin(50, 1, 18, 4, groups=3), lin(50, 1, 18, 4, groups=3)) == "ghost"
    assert inner_route(lin(50, 3, 18, 4, groups=3), lin(50, 3, 18, 4, groups=3)) == "materialize"


@pytest.mark.parametrize("name", ["conv_zoo", "encoder", "tied"])
def test_chunked_train_equals_one_pass(name: str) -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup(name, n_train=7)
    ref = loop_flat(ghost, params, buffers, xs, ys, loss) @ loop_flat(
        ghost, params, buffers, xq, yq, loss).T
    for chunk in (1, 3, 7, 100):
        got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, chunk_size=chunk)
        torch.testing.assert_close(got, ref, **TOL, msg=f"chunk_size={chunk}")
    per_layer = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, per_layer=True,
                                    chunk_size=3)
    assert all(v.shape == (7, 3) for v in per_layer.values())
    torch.testing.assert_close(sum(per_layer.values()), ref, **TOL)
    later = {k: v + 0.1 for k, v in params.items()}
    torch.testing.assert_close(
        tracin_scores(ghost, loss, [params, later], [0.5, 0.1], buffers, xs, ys, xq, yq,
                      chunk_size=2),
        tracin_scores(ghost, loss, [params, later], [0.5, 0.1], buffers, xs, ys, xq, yq), **TOL)


class TwoInputs(nn.Module):  # inputs: a tuple (one positional argument)
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        return self.b(torch.tanh(self.a(xs[0])) * xs[1])


def test_chunked_tuple_inputs() -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(TwoInputs().to(F64))
    xs = (torch.randn(7, 3, dtype=F64), torch.randn(7, 4, dtype=F64))
    xq = (torch.randn(2, 3, dtype=F64), torch.randn(2, 4, dtype=F64))
    ys, yq = torch.randn(7, 2, dtype=F64), torch.randn(2, 2, dtype=F64)

    def loop(x, y):
        rows = []
        for i in range(y.shape[0]):
            p = {k: v.clone().requires_grad_() for k, v in params.items()}
            loss = sq_loss(ghost(p, buffers, (x[0][i:i + 1], x[1][i:i + 1]))[0], y[i:i + 1])
            rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss.sum(),
                                                                            list(p.values()))]))
        return torch.stack(rows)

    ref = loop(xs, ys) @ loop(xq, yq).T
    got = grad_inner_products(ghost, sq_loss, params, buffers, xs, ys, xq, yq, chunk_size=3)
    torch.testing.assert_close(got, ref, **TOL)


def test_chunk_size_is_checked() -> None:
    ghost, params, buffers, xs, ys, xq, yq, loss = setup("mlp")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"chunk_size=.*expected a positive int"):
            grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq, chunk_size=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["conv_zoo", "encoder"])
def test_cuda_equals_cpu_loop(name: str) -> None:
    """Both routes and the chunked train set on CUDA (float64) against the CPU loop."""
    ghost, params, buffers, xs, ys, xq, yq, loss = setup(name)
    ref = loop_flat(ghost, params, buffers, xs, ys, loss) @ loop_flat(
        ghost, params, buffers, xq, yq, loss).T
    cuda = lambda d: {k: v.cuda() for k, v in d.items()}  # noqa: E731
    ghost_c, _, _ = make_ghost_model(CASES[name][0]().to(F64).cuda())
    got = grad_inner_products(ghost_c, loss, cuda(params), cuda(buffers), xs.cuda(), ys.cuda(),
                              xq.cuda(), yq.cuda(), chunk_size=2)
    assert got.is_cuda
    torch.testing.assert_close(got.cpu(), ref, **TOL)
