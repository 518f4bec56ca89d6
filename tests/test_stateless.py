"""make_functional vs the module itself: forward, buffers, grad, vmap, compile, errors (float64)."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional._batchnorm import BatchNorm
from torchfn.functional._stateless import FunctionalModel, make_functional
from torchfn.optim import stacked_adam

DT = torch.float64


class CountingBackend:
    """torch.compile backend that counts compilations and runs the captured graph as is."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiles += 1
        return gm.forward


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Tied(nn.Module):
    """Autoencoder-ish model whose decoder weight *is* the encoder weight."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 4)
        self.decoder.weight = self.encoder.weight

    def forward(self, x, *, scale: float = 1.0):
        return self.decoder(torch.tanh(self.encoder(x))) * scale


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 2),
    )


MODELS = {"mlp": (mlp, (6, 5)), "cnn": (cnn, (6, 2, 4, 4)), "tied": (Tied, (6, 4))}


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    factory, x_shape = MODELS[name]
    torch.manual_seed(seed)
    module = factory().to(DT)
    x = torch.randn(x_shape, dtype=DT)
    return module, x


def snapshot(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in d.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> None:
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **(tol or {"rtol": 0, "atol": 0}))


# -- forward and buffers ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_matches_module_and_mutates_nothing(name):
    module, x = build(name)
    model_fn, params, buffers = make_functional(module)
    assert isinstance(model_fn, FunctionalModel) and model_fn.training
    assert model_fn.param_names == tuple(k for k, _ in module.named_parameters())
    assert model_fn.buffer_names == tuple(k for k, _ in module.named_buffers())
    module_before = snapshot(module.state_dict())
    params_before, buffers_before = snapshot(params), snapshot(buffers)
    buffer_objects = dict(buffers)

    ref = copy.deepcopy(module)
    want = ref(x)  # the module's own forward: updates its running stats in place
    got, new_buffers = model_fn(params, buffers, x)

    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_same(new_buffers, dict(ref.named_buffers()), rtol=1e-12, atol=1e-12)
    assert_same(module.state_dict(), module_before)
    assert_same(params, params_before)
    assert_same(buffers, buffers_before)
    assert all(buffers[k] is buffer_objects[k] for k in buffers)
    if name == "cnn":
        assert int(new_buffers["1.num_batches_tracked"]) == 1
        assert new_buffers["1.running_mean"] is not buffers["1.running_mean"]


def test_eval_mode_uses_running_stats_and_returns_buffers_unchanged():
    module, x = build("cnn")
    with torch.no_grad():
        module[1].running_mean.normal_()
        module[1].running_var.uniform_(0.5, 2.0)
    model_fn, params, buffers = make_functional(module)
    eval_fn = model_fn.eval()
    assert not eval_fn.training and model_fn.training  # train()/eval() are pure
    got, new_buffers = eval_fn(params, buffers, x)
    torch.testing.assert_close(got, module.eval()(x), rtol=1e-12, atol=1e-12)
    assert all(new_buffers[k] is buffers[k] for k in buffers)
    back = eval_fn.train()
    assert back.training and not eval_fn.training


def test_several_steps_thread_buffers_like_the_module():
    module, _ = build("cnn")
    model_fn, params, buffers = make_functional(module)
    ref = copy.deepcopy(module)
    for step in range(3):
        x = torch.randn(5, 2, 4, 4, dtype=DT) + step
        want = ref(x)
        got, buffers = model_fn(params, buffers, x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_same(buffers, dict(ref.named_buffers()), rtol=1e-12, atol=1e-12)
    assert int(buffers["1.num_batches_tracked"]) == 3


def test_torch_batchnorm_path_updates_private_clones():
    module, x = build("cnn")
    model_fn, params, buffers = make_functional(module, replace_batchnorm=False)
    before = snapshot(buffers)
    ref = copy.deepcopy(module)
    got, new_buffers = model_fn(params, buffers, x)
    torch.testing.assert_close(got, ref(x), rtol=1e-12, atol=1e-12)
    assert_same(new_buffers, dict(ref.named_buffers()), rtol=1e-12, atol=1e-12)
    assert_same(buffers, before)  # torch's in-place update went into clones


def test_kwargs_and_tied_weight_used_at_every_alias():
    module, x = build("tied")
    model_fn, params, buffers = make_functional(module)
    assert "decoder.weight" not in params and "encoder.weight" in params
    w = torch.randn(4, 4, dtype=DT)
    p = {**params, "encoder.weight": w}
    got, _ = model_fn(p, buffers, x, scale=2.0)
    want = (torch.tanh(x @ w.T + p["encoder.bias"]) @ w.T + p["decoder.bias"]) * 2.0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_to_module_gives_an_ordinary_module_back():
    module, x = build("cnn")
    model_fn, params, buffers = make_functional(module)
    params = {k: v + 0.1 for k, v in params.items()}
    _, buffers = model_fn(params, buffers, x)
    net = model_fn.eval().to_module(params, buffers)
    assert type(net[1]) is nn.BatchNorm2d and not net.training
    assert_same(dict(net.named_parameters()), params)
    assert_same(dict(net.named_buffers()), buffers)
    assert all(p.requires_grad for p in net.parameters())
    assert net[0].weight is not params["0.weight"]
    out, _ = model_fn.eval()(params, buffers, x)
    torch.testing.assert_close(net(x), out, rtol=1e-12, atol=1e-12)

    tied, _ = build("tied")
    tied_fn, tied_params, tied_buffers = make_functional(tied)
    back = tied_fn.to_module(tied_params, tied_buffers)
    assert back.decoder.weight is back.encoder.weight


def test_float64_values_for_float32_module():
    torch.manual_seed(0)
    module = mlp()  # float32
    model_fn, params, buffers = make_functional(module)
    p64 = {k: v.double() for k, v in params.items()}
    x = torch.randn(3, 5, dtype=DT)
    got, _ = model_fn(p64, buffers, x)
    assert got.dtype == DT
    torch.testing.assert_close(got, module.double()(x), rtol=1e-12, atol=1e-12)


# -- transforms ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grad_matches_autograd_on_module(name):
    module, x = build(name)
    target = torch.randn_like(module(x))
    model_fn, params, buffers = make_functional(module)

    def loss(p):
        return F.mse_loss(model_fn(p, buffers, x)[0], target)

    got = grad(loss)(params)
    ref = copy.deepcopy(module)
    names, leaves = zip(*ref.named_parameters(), strict=True)
    want = dict(zip(names, torch.autograd.grad(F.mse_loss(ref(x), target), leaves), strict=True))
    assert_same(got, want, rtol=1e-10, atol=1e-12)
    if name == "tied":  # gradient reaches both uses: it differs from the encoder-only gradient
        untied = copy.deepcopy(module)
        untied.decoder.weight = nn.Parameter(untied.encoder.weight.detach().clone())
        enc_only = torch.autograd.grad(F.mse_loss(untied(x), target), untied.encoder.weight)[0]
        dec_only = torch.autograd.grad(F.mse_loss(untied(x), target), untied.decoder.weight)[0]
        both = enc_only + dec_only
        torch.testing.assert_close(got["encoder.weight"], both, rtol=1e-10, atol=1e-12)
        assert (got["encoder.weight"] - enc_only).abs().max() > 1e-3


def test_grad_of_grad_matches_autograd():
    module, x = build("cnn")
    model_fn, params, buffers = make_functional(module)
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def loss(p):
        return model_fn(p, buffers, x)[0].square().mean()

    def gv(p):  # directional derivative of the gradient: Hessian-vector product
        g = grad(loss)(p)
        return sum((g[k] * v[k]).sum() for k in g)

    got = grad(gv)(params)
    ref = copy.deepcopy(module)
    names, leaves = zip(*ref.named_parameters(), strict=True)
    g = torch.autograd.grad(ref(x).square().mean(), leaves, create_graph=True)
    hv = torch.autograd.grad(sum((gi * v[k]).sum() for k, gi in zip(names, g, strict=True)), leaves)
    assert_same(got, dict(zip(names, hv, strict=True)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batched_buffers", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_vmap_over_task_params_equals_loop(name, batched_buffers):
    n_tasks = 3
    modules, xs = zip(*(build(name, seed=s) for s in range(n_tasks)), strict=True)
    fns = [make_functional(m) for m in modules]
    model_fn = fns[0][0]
    params = {k: torch.stack([f[1][k] for f in fns]) for k in model_fn.param_names}
    if batched_buffers:
        buffers = {k: torch.stack([f[2][k] for f in fns]) for k in model_fn.buffer_names}
    else:
        buffers = fns[0][2]
    out, new_buffers = vmap(model_fn, in_dims=(0, 0 if batched_buffers else None, 0))(
        params, buffers, torch.stack(xs)
    )
    for t in range(n_tasks):
        ref = copy.deepcopy(modules[t])
        if not batched_buffers:
            ref.load_state_dict({**ref.state_dict(), **dict(modules[0].named_buffers())})
        torch.testing.assert_close(out[t], ref(xs[t]), rtol=1e-12, atol=1e-12)
        for k, b in ref.named_buffers():
            torch.testing.assert_close(new_buffers[k][t], b, rtol=1e-12, atol=1e-12, msg=k)


def test_vmap_checks_per_example_shapes():
    module, x = build("mlp")
    model_fn, params, buffers = make_functional(module)
    bad = {**params, "0.bias": torch.zeros(3, 6, dtype=DT)}
    # per example 0.bias is (6,), expected (7,): caught with the per-example shape
    with pytest.raises(ValueError, match=r"params\['0.bias'\].*expected \(7,\), got \(6,\)"):
        vmap(model_fn, in_dims=({k: 0 if k == "0.bias" else None for k in params}, None, None))(
            bad, buffers, x
        )


def test_compile_fullgraph_equals_eager_without_recompiling(dynamo_reset):
    module, x = build("cnn")
    model_fn, params, buffers = make_functional(module)
    backend = CountingBackend()
    compiled = torch.compile(model_fn, backend=backend, fullgraph=True)
    for step in range(2):  # new values on the second call: no recompilation
        p = {k: v + 0.01 * step for k, v in params.items()}
        want, want_buffers = model_fn(p, buffers, x + step)
        got, got_buffers = compiled(p, buffers, x + step)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert_same(got_buffers, want_buffers, rtol=1e-12, atol=1e-12)
        buffers = got_buffers
    assert backend.compiles == 1


def test_compile_fullgraph_vmap_of_grad_equals_eager(dynamo_reset):
    module, x = build("cnn")
    model_fn, params, buffers = make_functional(module)

    def per_task_grad(p, b, xb):
        return grad(lambda q: model_fn(q, b, xb)[0].square().mean())(p)

    step = vmap(per_task_grad, in_dims=(None, None, 0))
    backend = CountingBackend()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for i in range(2):
        xs = torch.randn(3, *x.shape, dtype=DT) + i
        want = step(params, buffers, xs)
        assert_same(compiled(params, buffers, xs), want, rtol=1e-12, atol=1e-12)
    assert backend.compiles == 1


# -- errors ----------------------------------------------------------------------------------


@pytest.fixture
def cnn_fn():
    module, x = build("cnn")
    return (*make_functional(module), x)


def test_error_missing_and_unexpected_keys(cnn_fn):
    model_fn, params, buffers, x = cnn_fn
    p = {k: v for k, v in params.items() if k != "4.bias"}
    with pytest.raises(ValueError, match=r"params does not match.*missing keys \['4.bias'\]"):
        model_fn(p, buffers, x)
    p = {**params, "4.bais": params["4.bias"]}
    with pytest.raises(ValueError, match=r"unexpected key '4.bais' \(did you mean '4.bias'\?\)"):
        model_fn(p, buffers, x)
    p = {**params, "1.running_mean": buffers["1.running_mean"]}
    with pytest.raises(ValueError, match=r"'1.running_mean' \(it is a buffer; pass it in buffers"):
        model_fn(p, buffers, x)
    with pytest.raises(ValueError, match=r"buffers does not match.*missing keys"):
        model_fn(params, {}, x)


def test_error_tied_alias_passed():
    module, x = build("tied")
    model_fn, params, buffers = make_functional(module)
    p = {**params, "decoder.weight": params["encoder.weight"]}
    with pytest.raises(ValueError, match=r"'decoder.weight' \(it is tied to 'encoder.weight'"):
        model_fn(p, buffers, x)


def test_error_wrong_shape_dtype_device_type(cnn_fn):
    model_fn, params, buffers, x = cnn_fn
    msg = r"params\['4.weight'\] has the wrong shape: expected \(2, 48\), got \(48, 2\)"
    with pytest.raises(ValueError, match=msg):
        model_fn({**params, "4.weight": params["4.weight"].T}, buffers, x)
    stacked = params["4.bias"].expand(5, 2)
    with pytest.raises(ValueError, match=r"got \(5, 2\) \(a leading batch/member dim\? .*vmap"):
        model_fn({**params, "4.bias": stacked}, buffers, x)
    msg = r"params\['0.weight'\] has the wrong dtype: expected torch.float64, got torch.int64"
    with pytest.raises(TypeError, match=msg):
        model_fn({**params, "0.weight": params["0.weight"].long()}, buffers, x)
    nbt = buffers["1.num_batches_tracked"].double()
    msg = r"buffers\['1.num_batches_tracked'\].*expected torch.int64, got torch.float64"
    with pytest.raises(TypeError, match=msg):
        model_fn(params, {**buffers, "1.num_batches_tracked": nbt}, x)
    meta = torch.empty_like(params["0.bias"], device="meta")
    msg = r"params\['0.bias'\] is on the wrong device: expected cpu, got meta"
    with pytest.raises(ValueError, match=msg):
        model_fn({**params, "0.bias": meta}, buffers, x)
    with pytest.raises(TypeError, match=r"params\['0.bias'\] must be a Tensor, got list"):
        model_fn({**params, "0.bias": [0.0, 0.0, 0.0]}, buffers, x)
    with pytest.raises(TypeError, match=r"params must be a dict\[str, Tensor\].*got list"):
        model_fn(list(params.values()), buffers, x)
    msg = r"make_functional\(module\): expected an nn.Module, got function"
    with pytest.raises(TypeError, match=msg):
        make_functional(lambda x: x)


def test_replaced_batchnorm_is_torchfn_and_module_untouched():
    module, _ = build("cnn")
    model_fn, _, _ = make_functional(module)
    assert type(model_fn._module[1]) is BatchNorm
    assert type(module[1]) is nn.BatchNorm2d
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_error_lazy_module():
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are uninitialized"):
        make_functional(nn.Sequential(nn.LazyLinear(3)))


def test_forward_error_leaves_model_fn_usable(cnn_fn):
    model_fn, params, buffers, x = cnn_fn
    with pytest.raises(RuntimeError):
        model_fn(params, buffers, x[:, :1])  # 1 input channel instead of 2: conv raises
    assert model_fn._module[0].weight.device.type == "meta"  # placeholders restored
    out, _ = model_fn(params, buffers, x)
    assert out.shape == (6, 2)


# --- compiled model_fn / steps: ties + BatchNorm, recompiles, errors, CUDA graphs -------------


class TiedBN(nn.Module):
    """A tied weight (two names, one tensor) and a BatchNorm (buffers the forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.dec(torch.tanh(self.bn(self.enc(x))))


def mlp_4_8_8_3() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).to(DT)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_model_fn_with_ties_and_buffers_equals_eager(dynamo_reset, dynamic):
    for replace_batchnorm in (True, False):
        torch.manual_seed(0)
        model_fn, params, buffers = make_functional(TiedBN().to(DT),
                                                    replace_batchnorm=replace_batchnorm)
        given = {k: v.clone() for k, v in buffers.items()}
        backend = CountingBackend()
        compiled = torch.compile(model_fn, backend=backend, fullgraph=True, dynamic=dynamic)
        for step in range(3):
            x = torch.randn(5 + step * int(dynamic), 4, dtype=DT)
            p = {k: v + step for k, v in params.items()}
            got, got_buffers = compiled(p, buffers, x)
            want, want_buffers = model_fn(p, buffers, x)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert got_buffers.keys() == want_buffers.keys()
            for k in want_buffers:
                torch.testing.assert_close(got_buffers[k], want_buffers[k], rtol=1e-12,
                                           atol=1e-12)
        assert backend.compiles == 1
        for k, v in given.items():  # the caller's buffers are never written
            assert torch.equal(buffers[k], v)
        torch._dynamo.reset()


def test_changed_private_module_still_recompiles(dynamo_reset):
    # The layout and module of a FunctionalModel never change through its API (train()/eval()
    # return new objects); even a poke at the private module copy is caught by the guards
    # Dynamo keeps on the module tree.
    model_fn, params, buffers = make_functional(mlp_4_8_8_3())
    x = torch.randn(5, 4, dtype=DT)
    backend = CountingBackend()
    compiled = torch.compile(model_fn, backend=backend, fullgraph=True)
    compiled(params, buffers, x)
    model_fn._module[1] = nn.Tanh()
    got, _ = compiled(params, buffers, x)
    want, _ = model_fn(params, buffers, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert backend.compiles == 2


def test_mismatched_inputs_are_still_refused_under_compile(dynamo_reset):
    model_fn, params, buffers = make_functional(mlp_4_8_8_3())
    x = torch.randn(5, 4, dtype=DT)
    compiled = torch.compile(model_fn, backend=CountingBackend())
    compiled(params, buffers, x)
    with pytest.raises(ValueError, match=r"params\['0.bias'\] has the wrong shape"):
        compiled({**params, "0.bias": torch.zeros(1, dtype=DT)}, buffers, x)
    with pytest.raises(ValueError, match="unexpected key 'extra'"):
        compiled({**params, "extra": torch.zeros(1, dtype=DT)}, buffers, x)
    with pytest.raises(TypeError, match="wrong dtype"):
        compiled({**params, "0.bias": torch.zeros(8, dtype=torch.int64)}, buffers, x)
    # another key order is fine (it takes the full check while tracing)
    reordered = dict(reversed(list(params.items())))
    torch.testing.assert_close(compiled(reordered, buffers, x)[0],
                               model_fn(params, buffers, x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
# torch 2.11's CUDA-graph tree manager captures an empty graph to set up its memory pool and
# CUDA warns that the graph is empty: a remark from inside torch, not about this step.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_reduce_overhead_ensemble_step_with_cloned_state_equals_eager():
    # CUDA graph trees return outputs that live in the graph's memory pool; a new call frees
    # or overwrites the outputs of the previous one. A train step's outputs ARE its next
    # inputs, so the state must be cloned out of the pool after each compiled call (metrics
    # too, if kept). The step counter must be on the GPU: a CPU op keeps the graph eager.
    torch._dynamo.reset()
    dev = torch.device("cuda")
    ens = Ensemble.from_seeds(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dev), range(3))
    opt = stacked_adam(lr=torch.full((3,), 1e-2, device=dev))
    step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    state = optree.tree_map(lambda t: t.to(dev), init_ensemble_state(ens, opt, seed=0))
    eager_state = state
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        batch = (torch.randn(3, 5, 4, generator=gen).to(dev),
                 torch.randint(3, (3, 5), generator=gen).to(dev))
        torch.compiler.cudagraph_mark_step_begin()
        out, metrics = compiled(state, batch)
        state = optree.tree_map(torch.clone, out)
        loss = metrics["loss"].clone()
        del out, metrics
        eager_state, eager_metrics = step(eager_state, batch)
        torch.testing.assert_close(loss, eager_metrics["loss"], rtol=1e-5, atol=1e-6)
    for k in eager_state.params:
        torch.testing.assert_close(state.params[k], eager_state.params[k], rtol=1e-4,
                                   atol=1e-5)
    assert int(state.step) == 6
    torch._dynamo.reset()
