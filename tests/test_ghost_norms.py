"""Ghost per-sample gradients (make_ghost_model) against a loop of torch.autograd.grad.

For every supported layer (with and without sequence dims) and for whole models: the
materialised per-sample gradients, the squared norms (total and per layer) and weighted sums
equal what a per-sample loop of ``torch.autograd.grad`` gives, in float64. Plus compiled ==
eager with no recompiles, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.persample import (
    GhostLayerError,
    check_ghost_coverage,
    ghost_grad_norms,
    make_ghost_model,
)

F64 = torch.float64
B = 5


def sq_loss(out: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss: a weighted squared error summed over every non-batch dim."""
    w = torch.linspace(0.5, 1.5, out[0].numel(), dtype=out.dtype, device=out.device)
    w = w.reshape(out.shape[1:])
    return ((out - target) ** 2 * w).flatten(1).sum(1)


def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def loop_grads(ghost, params, buffers, x, y, loss_fn) -> dict[str, Tensor]:
    """Per-sample gradients by a loop of torch.autograd.grad: {name: (B, *shape)}."""
    out: dict[str, list[Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = loss_fn(ghost(p, buffers, x[i : i + 1])[0], y[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
        for k, g in zip(p, grads, strict=True):
            out[k].append(torch.zeros_like(p[k]) if g is None else g)
    return {k: torch.stack(v) for k, v in out.items()}


def assert_matches_loop(module: nn.Module, x: Tensor, y: Tensor, loss_fn=sq_loss,
                        device: str = "cpu", dtype: torch.dtype = F64,
                        conv_method: str = "unfold") -> None:
    x = x.to(device, dtype) if x.is_floating_point() else x.to(device)
    y = y.to(device, dtype) if y.is_floating_point() else y.to(device)
    ghost, params, buffers = make_ghost_model(module.to(device, dtype), conv_method=conv_method)
    tol = {"rtol": 1e-9, "atol": 1e-11} if dtype == F64 else {"rtol": 2e-4, "atol": 1e-5}
    ref = loop_grads(ghost, params, buffers, x, y, loss_fn)
    res = ghost.per_sample(params, buffers, x, y, loss_fn)
    mat = res.grads.materialize()
    assert set(mat) == set(params)
    for k in params:
        torch.testing.assert_close(mat[k], ref[k], **tol, msg=k)
    ref_sq = sum(g.flatten(1).square().sum(1) for g in ref.values())
    torch.testing.assert_close(res.grads.sq_norms(), ref_sq, **tol)
    per_layer = res.grads.sq_norms(per_layer=True)
    for layer, names in ghost.layer_params.items():
        expect = sum(ref[k].flatten(1).square().sum(1) for k in names)
        torch.testing.assert_close(per_layer[layer], expect, **tol, msg=layer)
    coef = torch.rand(x.shape[0], dtype=dtype, device=device) + 0.1
    summed = res.grads.weighted_sum(coef)
    for k in params:
        torch.testing.assert_close(summed[k], torch.tensordot(coef, ref[k], dims=1), **tol,
                                   msg=k)
    torch.testing.assert_close(res.losses, loss_fn(ghost(params, buffers, x)[0], y))


class Scale(nn.Module):
    """A custom layer with parameters (hits the vmap fallback)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale + self.shift)


def _bn_eval(bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A BatchNorm in eval mode with non-trivial running statistics and affine parameters."""
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn.eval()


def _x(*shape: int) -> Tensor:
    return torch.randn(B, *shape, dtype=F64)


RMSNORM = [pytest.param(lambda: nn.RMSNorm(6), (3, 6), id="rmsnorm-seq")] if hasattr(
    nn, "RMSNorm") else []

LAYERS = [
    pytest.param(lambda: nn.Linear(5, 3), (5,), id="linear-2d"),
    pytest.param(lambda: nn.Linear(5, 3), (4, 5), id="linear-seq-materialize"),
    pytest.param(lambda: nn.Linear(8, 8), (2, 8), id="linear-seq-gram"),
    pytest.param(lambda: nn.Linear(5, 3, bias=False), (2, 3, 5), id="linear-4d-nobias"),
    pytest.param(lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (3, 11),
                 id="conv1d-stride-pad-dil"),
    pytest.param(lambda: nn.Conv1d(4, 6, 4, padding="same", padding_mode="reflect", groups=2),
                 (4, 9), id="conv1d-same-reflect-groups"),
    pytest.param(lambda: nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 2),
                                   dilation=(1, 2)), (2, 7, 6), id="conv2d-stride-pad-dil"),
    pytest.param(lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False, padding=1,
                                   padding_mode="circular"), (4, 5, 5), id="conv2d-groups"),
    pytest.param(lambda: nn.Conv2d(3, 3, 3, groups=3, padding="valid"), (3, 5, 6),
                 id="conv2d-depthwise"),
    pytest.param(lambda: nn.LayerNorm(6), (6,), id="layernorm-2d"),
    pytest.param(lambda: nn.LayerNorm((3, 4)), (2, 3, 4), id="layernorm-seq"),
    pytest.param(lambda: nn.LayerNorm(6, bias=False), (3, 6), id="layernorm-nobias"),
    *RMSNORM,
    pytest.param(lambda: nn.GroupNorm(2, 4), (4, 3, 3), id="groupnorm"),
    pytest.param(lambda: nn.GroupNorm(3, 6), (6,), id="groupnorm-2d"),
    pytest.param(lambda: _bn_eval(nn.BatchNorm2d(3)), (3, 4, 4), id="batchnorm2d-eval"),
    pytest.param(lambda: _bn_eval(nn.BatchNorm1d(4)), (4,), id="batchnorm1d-eval"),
    pytest.param(lambda: nn.PReLU(4), (4, 3), id="fallback-prelu"),
    pytest.param(lambda: Scale(6), (6,), id="fallback-custom"),
    pytest.param(lambda: Scale(6), (3, 6), id="fallback-custom-seq"),
]


def check_layer(make, shape, conv_method: str = "unfold") -> None:
    """One layer alone on random float64 inputs and noisy targets, against the loop."""
    torch.manual_seed(0)
    layer = make()
    x = _x(*shape)
    y = layer.to(F64)(x).detach() + 0.3 * torch.randn_like(layer(x))
    assert_matches_loop(layer, x, y, conv_method=conv_method)


@pytest.mark.parametrize(("make", "shape"), LAYERS)
def test_layer_matches_loop(make, shape) -> None:
    check_layer(make, shape)


CONV_LAYERS = [p for p in LAYERS if p.id.startswith("conv")]


@pytest.mark.parametrize(("make", "shape"), CONV_LAYERS)
def test_conv_grouped_route_matches_loop(make, shape) -> None:
    """The opt-in batch-as-groups weight-gradient route (no unfold)."""
    check_layer(make, shape, "grouped")


@pytest.mark.parametrize("bias", [True, False])
def test_bookkeeping_keeps_materialised_grads_where_cheaper(bias) -> None:
    """DP-SGD's hint: a float32 sequence linear whose norms alone favour the Gram form (T=100 <=
    256*256/512) but whose norms plus weighted sum favour materialising, keeps ``G_i``."""
    torch.manual_seed(3)
    lin = nn.Linear(256, 256, bias=bias)
    x = torch.randn(3, 100, 256)
    y = torch.randn(3, 100, 256)
    ghost, params, buffers = make_ghost_model(lin)
    coef = torch.rand(3) + 0.1
    ghost64, params64, _ = make_ghost_model(lin.to(F64))
    ref = ghost64.per_sample(params64, {}, x.double(), y.double(), sq_loss).grads
    expect_sq, expect = ref.sq_norms(), ref.weighted_sum(coef.double())
    for bookkeeping in (False, True):
        res = ghost.per_sample(params, buffers, x, y, sq_loss, bookkeeping=bookkeeping).grads
        sq, summed = res.sq_norms(), res.weighted_sum(coef)
        assert (res._layers[""]._kept is not None) == bookkeeping  # the path taken
        torch.testing.assert_close(sq.double(), expect_sq, rtol=1e-4, atol=0)
        for k in params:
            torch.testing.assert_close(summed[k].double(), expect[k], rtol=1e-4, atol=1e-3)

    def f(params, x, y, coef):  # the choice reads the matmul precision: must trace
        res = ghost.per_sample(params, buffers, x, y, sq_loss, bookkeeping=True).grads
        return res.sq_norms(), res.weighted_sum(coef)

    sq_c, summed_c = torch.compile(f, fullgraph=True)(params, x, y, coef)
    torch.testing.assert_close(sq_c.double(), expect_sq, rtol=1e-4, atol=0)
    for k in params:
        torch.testing.assert_close(summed_c[k].double(), expect[k], rtol=1e-4, atol=1e-3)


def test_conv_method_is_checked() -> None:
    with pytest.raises(ValueError, match=r"conv_method=.*expected one of.*'grouped'.*got 'fast'"):
        make_ghost_model(nn.Conv2d(1, 2, 3), conv_method="fast")


@pytest.mark.parametrize("padding_idx", [None, 0], ids=["plain", "padding_idx"])
@pytest.mark.parametrize("ids_shape", [(), (6,), (2, 3)], ids=["2d", "seq", "4d"])
def test_embedding_matches_loop(padding_idx, ids_shape) -> None:
    torch.manual_seed(1)
    emb = nn.Embedding(4, 3, padding_idx=padding_idx)  # 4 ids: repeats within a sample
    ids = torch.randint(0, 4, (B, *ids_shape))
    ids.view(B, -1)[:, 0] = 0  # padding appears
    target = torch.randn(B, *ids_shape, 3, dtype=F64)
    assert_matches_loop(emb, ids, target)


def test_layer_called_twice_and_unused_layer() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.conv = nn.Conv1d(4, 4, 3, padding=1)
            self.emb = nn.Embedding(5, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, ids: Tensor) -> Tensor:
            h = self.emb(ids) + self.emb(ids.flip(1))
            h = self.lin(torch.tanh(self.lin(h)))
            return self.conv(self.conv(h.transpose(1, 2))).mean(2)

    torch.manual_seed(2)
    ids = torch.randint(0, 5, (B, 6))
    for conv_method in ("unfold", "grouped"):
        assert_matches_loop(Twice(), ids, torch.randn(B, 4, dtype=F64), conv_method=conv_method)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2)
        self.fc1 = nn.Linear(6 * 3 * 3, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.gn(self.conv1(x)))
        h = F.relu(self.conv2(h)).flatten(1)
        return self.fc2(F.relu(self.fc1(h)))


class TinyTransformer(nn.Module):
    """Embedding + nn.MultiheadAttention (fallback) + LayerNorm + hand-written attention."""

    def __init__(self, vocab: int = 7, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(6, d) * 0.1)  # owned by the root: fallback
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = self.ln1(h + self.mha(h, h, h, need_weights=False)[0])
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.ln2(h + self.proj(a.transpose(1, 2).flatten(2)))
        return self.head(h.mean(1))


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        h = self.ln(h + self.mha(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


def test_small_cnn_matches_loop() -> None:
    torch.manual_seed(3)
    net = SmallCNN()
    x = torch.randn(B, 1, 8, 8, dtype=F64)
    assert_matches_loop(net, x, torch.randint(0, 3, (B,)), xent)
    ghost, _, _ = make_ghost_model(net)
    assert ghost.layer_kinds == {"conv1": "conv", "gn": "norm", "conv2": "conv",
                                 "fc1": "linear", "fc2": "linear"}


def test_transformer_with_multihead_attention_matches_loop() -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, 7, (B, 6))
    assert_matches_loop(TinyBlock(), ids, torch.randint(0, 3, (B,)), xent)
    ghost, _, _ = make_ghost_model(TinyBlock())
    assert ghost.layer_kinds["mha"] == "attention"


def test_root_owning_parameters_keeps_its_children_ghost() -> None:
    """TinyTransformer owns ``pos`` itself: ``pos`` is a "direct" layer, the rest stay ghost."""

    class WithPos(TinyTransformer):
        def forward(self, ids: Tensor) -> Tensor:
            h = self.emb(ids) + self.pos
            return self.head(self.ln2(self.proj(h)).mean(1))

    torch.manual_seed(5)
    net = WithPos()
    ghost, _, _ = make_ghost_model(net)
    assert ghost.layer_kinds == {"emb": "embedding", "mha": "attention", "ln1": "norm",
                                 "qkv": "linear", "proj": "linear", "ln2": "norm",
                                 "head": "linear", "": "direct"}
    assert ghost.layer_params[""] == ("pos",)
    assert_matches_loop(net, torch.randint(0, 7, (B, 6)), torch.randint(0, 3, (B,)), xent)


def test_weights_tied_inside_one_fallback_layer() -> None:
    class TiedPair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(4))
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.tanh(self.a(x) * self.scale))

    torch.manual_seed(9)
    net = nn.Sequential(TiedPair(), nn.Linear(4, 3))
    ghost, params, _ = make_ghost_model(net)
    assert ghost.layer_kinds == {"0": "fallback", "1": "linear"} and "0.b.weight" not in params
    assert_matches_loop(net, torch.randn(B, 4, dtype=F64), torch.randint(0, 3, (B,)), xent)


def test_hand_written_attention_is_all_ghost_layers() -> None:
    torch.manual_seed(6)
    net = TinyTransformer()
    del net.pos
    ghost, _, _ = make_ghost_model(net)
    assert {ghost.layer_kinds[k] for k in ("qkv", "proj", "head", "emb", "ln1")} == {
        "linear", "embedding", "norm"}
    assert_matches_loop(net, torch.randint(0, 7, (B, 6)), torch.randint(0, 3, (B,)), xent)


def test_ghost_grad_norms_and_frozen_layers() -> None:
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    net[0].requires_grad_(False)
    ghost, params, buffers = make_ghost_model(net)
    assert ghost.frozen == ("0.weight", "0.bias") and ghost.layer_names == ("2",)
    x, y = torch.randn(B, 4, dtype=F64), torch.randint(0, 3, (B,))
    ref = loop_grads(ghost, params, buffers, x, y, xent)
    norms = ghost_grad_norms(ghost, xent)(params, buffers, x, y)
    expect = (ref["2.weight"].flatten(1).square().sum(1) + ref["2.bias"].square().sum(1)).sqrt()
    torch.testing.assert_close(norms, expect)
    per_layer = ghost_grad_norms(ghost, xent, per_layer=True)(params, buffers, x, y)
    torch.testing.assert_close(per_layer["2"], expect)
    summed = ghost.per_sample(params, buffers, x, y, xent).grads.weighted_sum(torch.ones(B))
    assert torch.equal(summed["0.weight"], torch.zeros(6, 4, dtype=F64))
    check_ghost_coverage(ghost, xent, params, buffers, x, y)


@pytest.mark.parametrize("conv_method", ["unfold", "grouped"])
def test_compiled_equals_eager_without_recompiles(conv_method) -> None:
    torch.manual_seed(8)
    net = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(12, 3),
                        nn.LayerNorm(3), nn.PReLU()).to(F64)
    ghost, params, buffers = make_ghost_model(net, conv_method=conv_method)

    def f(params, buffers, x, y, coef):
        res = ghost.per_sample(params, buffers, x, y, xent)
        return res.grads.sq_norms(), res.grads.weighted_sum(coef)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for _ in range(3):
        args = (params, buffers, torch.randn(B, 2, 4, dtype=F64), torch.randint(0, 3, (B,)),
                torch.rand(B, dtype=F64))
        (sq_c, sum_c), (sq_e, sum_e) = compiled(*args), f(*args)
        torch.testing.assert_close(sq_c, sq_e)
        for k in params:
            torch.testing.assert_close(sum_c[k], sum_e[k], msg=k)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("model", ["cnn", "transformer", "grouped-conv1d", "embedding-seq"])
def test_cuda_matches_loop(model, dtype) -> None:
    """On CUDA the eager ops run torchfn's kernels: still equal to the autograd loop."""
    torch.manual_seed(10)
    if model == "cnn":
        net, x, y, loss = SmallCNN(), torch.randn(B, 1, 8, 8), torch.randint(0, 3, (B,)), xent
    elif model == "transformer":
        net = TinyTransformer()
        del net.pos
        x, y, loss = torch.randint(0, 7, (B, 6)), torch.randint(0, 3, (B,)), xent
    elif model == "grouped-conv1d":
        net, x, y, loss = nn.Conv1d(4, 6, 3, groups=2, stride=2), _x(4, 9), _x(6, 4), sq_loss
    else:
        net, x, y, loss = nn.Embedding(6, 5, padding_idx=1), torch.randint(0, 6, (B, 9)), \
            _x(9, 5), sq_loss
    assert_matches_loop(net, x, y, loss, device="cuda", dtype=dtype)


# --- refusals ----------------------------------------------------------------------------


def test_accepts_tied_parameters() -> None:  # exact: tests/test_ghost_rules_zoo.py
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    net[1].weight = net[0].weight
    ghost, _, _ = make_ghost_model(net)
    assert ghost.layer_params == {"0": ("0.weight", "0.bias"), "1": ("0.weight", "1.bias")}


def test_refuses_batchnorm_in_training_mode_but_accepts_eval() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(GhostLayerError, match="BatchNorm1d in training mode"):
        make_ghost_model(net)
    ghost, params, buffers = make_ghost_model(net.eval())
    assert ghost.layer_kinds["1"] == "norm"
    with pytest.raises(GhostLayerError, match="training mode"):
        ghost.train()
    with pytest.raises(GhostLayerError, match="without running statistics"):
        make_ghost_model(nn.BatchNorm1d(4, track_running_stats=False).eval())
    x, y = torch.randn(B, 3), torch.randn(B, 4)
    assert ghost.per_sample(params, buffers, x, y, sq_loss).grads.sq_norms().shape == (B,)


@pytest.mark.parametrize(("layer", "match"), [
    (nn.Embedding(5, 3, max_norm=1.0), "max_norm"),
    (nn.Embedding(5, 3, scale_grad_by_freq=True), "scale_grad_by_freq"),
    (nn.MultiheadAttention(4, 2), "batch_first=False"),
])
def test_refuses_unsupported_settings(layer, match) -> None:
    with pytest.raises(GhostLayerError, match=match):
        make_ghost_model(nn.Sequential(layer))


def test_refuses_partly_frozen_layer_and_bad_losses() -> None:
    net = nn.Linear(3, 2)
    net.bias.requires_grad_(False)
    with pytest.raises(GhostLayerError, match="trainable and frozen"):
        make_ghost_model(net)
    ghost, params, buffers = make_ghost_model(nn.Linear(3, 2))
    x, y = torch.randn(B, 3), torch.randn(B, 2)
    with pytest.raises(ValueError, match=r"\(B,\) per-sample losses"):
        ghost.per_sample(params, buffers, x, y, lambda o, t: ((o - t) ** 2).mean())


def test_fallback_with_randomness_is_refused() -> None:
    class Noisy(Scale):
        def forward(self, x: Tensor) -> Tensor:
            return F.dropout(super().forward(x), 0.5, training=True)

    ghost, params, buffers = make_ghost_model(Noisy(3))
    with pytest.raises(GhostLayerError, match="deterministic"):
        ghost.per_sample(params, buffers, torch.randn(B, 3), torch.randn(B, 3), sq_loss)


def test_coverage_check_catches_weight_used_outside_its_layer() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)

        def forward(self, ids: Tensor) -> Tensor:  # output head reuses the embedding
            return F.linear(self.emb(ids), self.emb.weight)

    ghost, params, buffers = make_ghost_model(Tied().to(F64))
    ids = torch.randint(0, 5, (B,))
    with pytest.raises(ValueError, match=r"'emb.weight'.*outside their own layer"):
        check_ghost_coverage(ghost, xent, params, buffers, ids, torch.randint(0, 5, (B,)))


def test_batch_not_in_dim_zero_is_refused() -> None:
    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:  # (T, B, d) inside
            return self.lin(x.transpose(0, 1)).transpose(0, 1)

    ghost, params, buffers = make_ghost_model(SeqFirst())
    with pytest.raises(GhostLayerError, match="batch in dim 0"):
        ghost.per_sample(params, buffers, torch.randn(B, 4, 3), torch.randn(B, 4, 2), sq_loss)


def test_bf16_autocast_norms_run_in_bf16_and_match_the_autocast_loop(monkeypatch) -> None:
    """Under bf16 autocast a Linear/Conv records its fp32 input but computes in bf16: the
    per-sample work runs in bf16 too (the half-precision GEMM path, as autograd's own weight
    gradient), and the norms (float32) match a loop of torch.autograd.grad of the same
    autocast model within bf16 rounding."""
    import torchfn.persample._ghost_layers as gl

    seen: list[torch.dtype] = []
    init = gl._LinearLike.__init__

    def spy(self, a, g, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, a, g, *args, **kwargs)
        seen.append(self.a.dtype)

    monkeypatch.setattr(gl._LinearLike, "__init__", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(1, 2), nn.Linear(6, 16), nn.Tanh(),
                          nn.Linear(16, 5))  # (B, 8, 6, 6) -> (B, 48, 6) -> Linear over T=48
    x = torch.randn(6, 3, 8, 8)
    y = torch.randint(0, 5, (6,))

    def loss_fn(out: Tensor, t: Tensor) -> Tensor:
        return F.cross_entropy(out.float().mean(1), t, reduction="none")

    ghost, params, buffers = make_ghost_model(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms = ghost_grad_norms(ghost, loss_fn)(params, buffers, x, y)
        ref = []
        for i in range(x.shape[0]):
            loss = loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            ref.append(torch.sqrt(sum(g.float().square().sum() for g in grads)))
    assert seen and set(seen) == {torch.bfloat16}
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, torch.stack(ref), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "hf_conv1d"])
def test_compiled_sum_shares_the_gram_padding(transposed, monkeypatch) -> None:
    """While compiling, a layer whose feature width is not a multiple of 8 pads ``a`` and ``g``
    once for the Gram norms and computes the weighted sum from those padded copies, sliced back
    (CUDA half only in practice; forced here, in float64, on any device): norms and sum equal
    an autograd loop's, for ``nn.Linear`` and HF's transposed ``Conv1D``, odd T and widths."""
    import torchfn.ops.reference as reference

    calls: list[tuple[int, ...]] = []

    def pad_always(x: Tensor) -> Tensor:
        calls.append(tuple(x.shape))
        return F.pad(x, (0, -x.shape[2] % 8, 0, -x.shape[1] % 8))

    monkeypatch.setattr(reference, "pad_for_tensor_cores", pad_always)
    torch.manual_seed(5)
    if transposed:  # HF's Conv1D(nf=d_out, nx=d_in)
        layer = pytest.importorskip("transformers.pytorch_utils").Conv1D(13, 10)
    else:
        layer = nn.Linear(10, 13)  # d_out 13, d_in 10
    net = nn.Sequential(layer, nn.Tanh(), nn.Linear(13, 3)).double()
    ghost, params, buffers = make_ghost_model(net)
    assert ghost.layer_kinds["0"] == "linear"
    x, y = torch.randn(3, 5, 10, dtype=F64), torch.randn(3, 5, 3, dtype=F64)  # T = 5
    coef = torch.rand(3, dtype=F64) + 0.1
    expect = loop_grads(ghost, params, buffers, x, y, sq_loss)
    expect_sq = sum(v.square().flatten(1).sum(1) for v in expect.values())
    expect_sum = {k: torch.tensordot(coef, v, dims=1) for k, v in expect.items()}

    def f(params, x, y, coef):
        res = ghost.per_sample(params, buffers, x, y, sq_loss, bookkeeping=True).grads
        return res.sq_norms(), res.weighted_sum(coef)

    sq, summed = torch.compile(f, fullgraph=True)(params, x, y, coef)
    assert (3, 5, 13) in calls  # the padded route was traced (layer "0": Gram form)
    torch.testing.assert_close(sq, expect_sq, rtol=1e-10, atol=0)
    for k, v in expect_sum.items():
        assert summed[k].shape == v.shape and summed[k].is_contiguous(), k
        torch.testing.assert_close(summed[k], v, rtol=1e-10, atol=1e-12)


def test_autocast_layers_record_the_cast_input_once() -> None:
    """Under bf16 autocast a linear layer's tap casts its float32 input (a LayerNorm output
    here, float32) to bfloat16 before the call: the layer computes with exactly what autocast would give
    it, the tape records that tensor, layers reading one tensor share its cast, and the
    compiled step's graph casts each activation once (otherwise the layer's cast and the
    per-sample work's cast are two nodes, each recomputing a fused activation in a compiled
    step); norms and sum still match float32 autograd up to bf16 rounding."""
    from torch._dynamo.backends.common import aot_autograd

    class Net(nn.Module):  # an MLP, then three layers reading one LayerNorm output (q/k/v)
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"),
                                     nn.LayerNorm(16))
            self.q, self.k, self.v = nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.mlp(x).float()  # float32 (as CUDA autocast's LayerNorm gives)
            return self.q(h) * self.k(h) + self.v(h)

    torch.manual_seed(6)
    net = Net()
    seen: list[Tensor] = []

    def hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        if not torch.compiler.is_compiling():  # (copied into the ghost model with its layers)
            seen.append(args[0])

    for m in (net.q, net.k, net.v):
        m.register_forward_pre_hook(hook)
    ghost, params, buffers = make_ghost_model(net)
    x, y = torch.randn(3, 5, 8), torch.randn(3, 5, 4)
    coef = torch.rand(3) + 0.1

    def f(params, x, y, coef):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = ghost.per_sample(params, buffers, x, y, sq_loss, bookkeeping=True)
        return res.grads.sq_norms(), res.grads.weighted_sum(coef)

    sq, summed = f(params, x, y, coef)
    assert {t.dtype for t in seen} == {torch.bfloat16}  # the LayerNorm's output, cast
    assert seen[-3] is seen[-2] is seen[-1]  # the recording pass: q, k, v share one cast
    seen.clear()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=capture),
                             fullgraph=True)
    sq_c, summed_c = compiled(params, x, y, coef)
    views = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.alias.default, torch.ops.aten.reshape.default}

    def root(n):
        while n.op == "call_function" and n.target in views:
            n = n.args[0]
        return n

    casts: dict[tuple[str, object], int] = {}
    for n in graphs[0].graph.nodes:
        if n.target is torch.ops.aten._to_copy.default and n.args[0].meta["val"].dim() >= 2:
            key = (root(n.args[0]).name, n.kwargs.get("dtype"))
            casts[key] = casts.get(key, 0) + 1
    assert casts and all(v == 1 for v in casts.values()), casts
    # the same numbers as eager, and as float32 autograd up to bf16 rounding
    torch.testing.assert_close(sq_c, sq, rtol=1e-2, atol=0)
    ref = ghost.per_sample(params, buffers, x, y, sq_loss, bookkeeping=True).grads
    torch.testing.assert_close(sq.float(), ref.sq_norms(), rtol=5e-2, atol=0)
    for k, v in ref.weighted_sum(coef).items():
        scale = float(v.abs().max())  # bf16 rounding of the inputs: relative to the largest
        torch.testing.assert_close(summed[k].float(), v, rtol=0, atol=3e-2 * scale)
        torch.testing.assert_close(summed_c[k].float(), v, rtol=0, atol=3e-2 * scale)


@pytest.mark.parametrize("region", ["disabled", "float16"])
def test_shared_cast_respects_an_autocast_region(region) -> None:
    """A tensor read by a layer under bf16 autocast and by another inside a region that
    disables autocast (a float32 router, say) or switches it to float16: the second layer gets
    the float32 tensor or its own float16 cast, never the first one's bf16 cast, and both
    layers' per-sample norms match the float32 pass up to rounding."""
    inner = (torch.autocast("cpu", enabled=False) if region == "disabled"
             else torch.autocast("cpu", dtype=torch.float16))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            y = self.a(x)
            with inner:
                z = self.b(x)
            return y.float() + z.float()

    torch.manual_seed(7)
    net = Net()
    seen: list[torch.dtype] = []
    net.b.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    ghost, params, buffers = make_ghost_model(net)
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = ghost.per_sample(params, buffers, x, y, sq_loss).grads
    assert seen and set(seen) == {torch.float32 if region == "disabled" else torch.float16}
    ref = ghost.per_sample(params, buffers, x, y, sq_loss).grads
    per = res.sq_norms(per_layer=True)
    want = ref.sq_norms(per_layer=True)
    torch.testing.assert_close(per["b"].float(), want["b"], rtol=2e-2, atol=0)
    torch.testing.assert_close(per["a"].float(), want["a"], rtol=5e-2, atol=0)
