"""torchfn's RNN/GRU/LSTM against torch's nn.RNN/GRU/LSTM, in float64 on random weights.

Forward outputs and final states equal torch's for every option (tanh/relu RNN, GRU, LSTM with
and without projection; batch_first, bidirectional, bias=False, two layers, given h0/(h0, c0),
unbatched input, inter-layer dropout with the same random stream); and every torchfn path
that used to fail on torch's layers equals a plain reference through torch's own module:
per-sample gradients (a loop of torch.autograd.grad), ghost norms (flat and per layer) of an
LSTM classifier and an Embedding->LSTM->Linear language model, one DP-SGD step (clip-and-sum
of the loop's gradients), the second-order MAML meta-gradient (a per-task loop with
create_graph=True), jvp (central differences) and torch.compile(fullgraph=True) (== eager).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call

from torchfn.functional import (
    GRU,
    LSTM,
    RNN,
    make_functional,
    per_sample_grads,
    replace_recurrent,
    restore_recurrent,
    single_sample_fn,
)
from torchfn.meta import Task, maml
from torchfn.persample import (
    GhostLayerError,
    ghost_grad_norms,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

F64 = torch.float64
KINDS = {  # name -> (torch class, constructor kwargs)
    "rnn_tanh": (nn.RNN, {}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "gru": (nn.GRU, {}),
    "lstm": (nn.LSTM, {}),
    "lstm_proj": (nn.LSTM, {"proj_size": 3}),
}
OURS = {nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _torch_layer(kind: str, seed: int = 0, **kw) -> nn.RNNBase:
    cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    return cls(4, 5, **extra, **kw).to(F64)


def _hidden(kind: str, layer: nn.RNNBase, batch: int | None, seed: int):
    g = _gen(seed)
    d = 2 if layer.bidirectional else 1
    n = layer.num_layers * d
    lead = (n, batch) if batch is not None else (n,)
    h = torch.randn(*lead, layer.proj_size or layer.hidden_size, generator=g, dtype=F64)
    if isinstance(layer, nn.LSTM):
        return h, torch.randn(*lead, layer.hidden_size, generator=g, dtype=F64)
    return h


# -- forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_forward_and_grads_equal_torch(kind) -> None:
    options = itertools.product([False, True], [False, True], [True, False], [None, "h0"])
    for batch_first, bidirectional, bias, h0 in options:
        ref = _torch_layer(kind, num_layers=2, batch_first=batch_first,
                           bidirectional=bidirectional, bias=bias)
        ours = OURS[type(ref)].from_torch(ref)
        assert [k for k, _ in ours.named_parameters()] == [k for k, _ in ref.named_parameters()]
        g = _gen(1)
        x = torch.randn(3, 6, 4, generator=g, dtype=F64)  # (B, T) or (T, B): both read it
        batch = x.shape[0] if batch_first else x.shape[1]
        hx = _hidden(kind, ref, batch, 2) if h0 else None
        want_out, want_h = ref(x, hx)
        got_out, got_h = ours(x, hx)
        msg = f"{kind} batch_first={batch_first} bidirectional={bidirectional} bias={bias} {h0}"
        torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12, msg=msg)
        torch.testing.assert_close(got_h, want_h, rtol=1e-12, atol=1e-12, msg=msg)
        # gradients too (same Parameter objects: differentiate both forwards)
        params = list(ref.parameters())
        want = torch.autograd.grad(want_out.square().sum() + sum(
            h.sum() for h in (want_h if isinstance(want_h, tuple) else (want_h,))), params)
        got = torch.autograd.grad(got_out.square().sum() + sum(
            h.sum() for h in (got_h if isinstance(got_h, tuple) else (got_h,))), params)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=msg)
    # unbatched (T, input_size), with and without a hidden state
    ref = _torch_layer(kind, num_layers=2, bidirectional=True)
    ours = OURS[type(ref)].from_torch(ref)
    x = torch.randn(6, 4, generator=_gen(3), dtype=F64)
    for hx in (None, _hidden(kind, ref, None, 4)):
        torch.testing.assert_close(ours(x, hx), ref(x, hx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_dropout_draws_what_torch_draws(kind) -> None:
    ref = _torch_layer(kind, num_layers=3, dropout=0.4, bidirectional=True)
    ours = OURS[type(ref)].from_torch(ref)
    x = torch.randn(6, 2, 4, generator=_gen(0), dtype=F64)
    torch.manual_seed(5)
    want = ref(x)
    torch.manual_seed(5)
    got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[0], ours.eval()(x)[0])  # dropout was active
    # under vmap the draw needs an explicit randomness mode
    model_fn, params, buffers = make_functional(ref)
    xs = torch.randn(3, 6, 2, 4, dtype=F64)
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(lambda x: model_fn(params, buffers, x)[0][0])(xs)
    out = torch.func.vmap(lambda x: model_fn(params, buffers, x)[0][0],
                          randomness="different")(xs)
    assert out.shape == (3, 6, 2, 10)


def test_errors_are_clear() -> None:
    lstm = LSTM(4, 5, batch_first=True)
    x = torch.randn(3, 6, 4)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 4, 2]), batch_first=True)
    with pytest.raises(TypeError, match=r"PackedSequence input is not supported.*Pad the "
                       r"sequences.*mask"):
        lstm(packed)
    with pytest.raises(ValueError, match=r"expected input.size\(-1\) == input_size=4, got input "
                       r"of shape \(3, 6, 3\)"):
        lstm(torch.randn(3, 6, 3))
    with pytest.raises(ValueError, match=r"expected c_0 of shape \(1, 3, 5\), got \(1, 3, 4\)"):
        lstm(x, (torch.zeros(1, 3, 5), torch.zeros(1, 3, 4)))
    with pytest.raises(TypeError, match=r"expected hx to be a tuple \(h_0, c_0\)"):
        lstm(x, torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match=r"expected input of 3 dims"):
        GRU(4, 5)(torch.randn(4))
    with pytest.raises(ValueError, match=r"RNN\(nonlinearity=...\): expected 'tanh' or 'relu'"):
        RNN(4, 5, nonlinearity="gelu")
    with pytest.raises(TypeError, match=r"LSTM.from_torch\(module\): expected nn.LSTM, got GRU"):
        LSTM.from_torch(nn.GRU(4, 5))


# -- conversion and make_functional -------------------------------------------------------------


class _Classifier(nn.Module):
    def __init__(self, kind: str = "lstm", **kw) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = _torch_layer(kind, batch_first=True, **kw)
        d = 2 if self.rnn.bidirectional else 1
        self.head = nn.Linear(d * (self.rnn.proj_size or self.rnn.hidden_size), 3).to(F64)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def test_conversion_keeps_values_ties_and_requires_grad() -> None:
    net = _Classifier("lstm_proj", num_layers=2, bidirectional=True)
    net.rnn.weight_hh_l1.requires_grad_(False)
    ours = replace_recurrent(net)
    assert type(ours.rnn) is LSTM and type(net.rnn) is nn.LSTM
    assert list(ours.state_dict()) == list(net.state_dict())
    assert not ours.rnn.weight_hh_l1.requires_grad and ours.rnn.weight_ih_l1.requires_grad
    for (k, a), b in zip(net.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), k  # copied, equal
    back = restore_recurrent(ours)
    assert type(back.rnn) is nn.LSTM and not back.rnn.weight_hh_l1.requires_grad
    x = torch.randn(2, 5, 4, dtype=F64)
    torch.testing.assert_close(back(x), net(x), rtol=0, atol=0)
    torch.testing.assert_close(ours(x), net(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["rnn_relu", "gru", "lstm_proj"])
def test_make_functional_swaps_and_to_module_restores(kind) -> None:
    net = _Classifier(kind, num_layers=2)
    model_fn, params, buffers = make_functional(net)
    assert list(params) == [k for k, _ in net.named_parameters()]
    x = torch.randn(3, 5, 4, dtype=F64)
    new = {k: v + 0.01 for k, v in params.items()}
    out, _ = model_fn(new, buffers, x)
    module = model_fn.to_module(new, buffers)
    assert type(module.rnn) is type(net.rnn)
    torch.testing.assert_close(module(x), out, rtol=1e-12, atol=1e-12)
    # replace_recurrent=False keeps torch's layer in the private copy
    torch_fn, _, _ = make_functional(net, replace_recurrent=False)
    assert type(torch_fn._module.rnn) is type(net.rnn)


# -- per-sample gradients, ghost norms, DP-SGD ---------------------------------------------------


def _xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _loop_grads(net: nn.Module, loss_fn, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Reference: one torch.autograd.grad per sample through torch's own module."""
    names = [k for k, _ in net.named_parameters()]
    out: dict[str, list[Tensor]] = {k: [] for k in names}
    for i in range(x.shape[0]):
        loss = loss_fn(net(x[i : i + 1]), y[i : i + 1]).sum()
        for k, g in zip(names, torch.autograd.grad(loss, list(net.parameters())), strict=True):
            out[k].append(g)
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_per_sample_grads_equal_loop(kind) -> None:
    net = _Classifier(kind, num_layers=2, bidirectional=True)
    model_fn, params, buffers = make_functional(net)
    f = single_sample_fn(model_fn, buffers)
    g = _gen(0)
    x, y = torch.randn(4, 5, 4, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)

    def loss(p, xi, yi):
        return F.cross_entropy(f(p, xi)[None], yi[None])

    got = per_sample_grads(loss)(params, x, y)
    want = _loop_grads(net, _xent, x, y)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


class _LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 4).to(F64)
        self.rnn = nn.LSTM(4, 6, num_layers=2, batch_first=True).to(F64)
        self.out = nn.Linear(6, 11).to(F64)

    def forward(self, ids: Tensor) -> Tensor:
        h, _ = self.rnn(self.emb(ids))
        return self.out(h)  # (B, T, V)


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)


def _loop_norms(net, loss_fn, x, y, layers: dict[str, tuple[str, ...]]) -> dict[str, Tensor]:
    psg = _loop_grads(net, loss_fn, x, y)
    return {name: sum(psg[k].flatten(1).square().sum(1) for k in keys).sqrt()
            for name, keys in layers.items()}


def _models():
    g = _gen(3)
    clf = _Classifier("lstm", num_layers=2, bidirectional=True)
    x, y = torch.randn(5, 4, 4, generator=g, dtype=F64), torch.randint(0, 3, (5,), generator=g)
    lm = _LanguageModel()
    ids = torch.randint(0, 11, (5, 6), generator=g)
    return {"lstm_classifier": (clf, _xent, x, y),
            "language_model": (lm, _lm_loss, ids[:, :-1], ids[:, 1:])}


@pytest.mark.parametrize("model", ["lstm_classifier", "language_model"])
def test_ghost_norms_equal_loop(model) -> None:
    net, loss_fn, x, y = _models()[model]
    ghost, params, buffers = make_ghost_model(net)
    assert ghost.layer_kinds["rnn"] == "recurrent"
    want = _loop_norms(net, loss_fn, x, y, ghost.layer_params)
    per_layer = ghost_grad_norms(ghost, loss_fn, per_layer=True)(params, buffers, x, y)
    for name in want:
        torch.testing.assert_close(per_layer[name], want[name], rtol=1e-10, atol=1e-12)
    flat = ghost_grad_norms(ghost, loss_fn)(params, buffers, x, y)
    total = sum(v.square() for v in want.values()).sqrt()
    torch.testing.assert_close(flat, total, rtol=1e-10, atol=1e-12)
    psg = _loop_grads(net, loss_fn, x, y)
    got = ghost.per_sample(params, buffers, x, y, loss_fn).grads.materialize()
    for k in psg:
        torch.testing.assert_close(got[k], psg[k], rtol=1e-10, atol=1e-12, msg=k)


class _TimeMajor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru", "lstm_proj"])
def test_ghost_rule_every_option(kind) -> None:
    for batch_first, bidirectional, bias in itertools.product([False, True], repeat=2 + 1):
        torch.manual_seed(0)
        cls, extra = KINDS[kind]
        # the model takes the batch in dim 0 (as ghost norms require of inputs); a time-major
        # layer gets its input transposed inside the model
        rnn = cls(4, 5, num_layers=2, batch_first=batch_first, bidirectional=bidirectional,
                  bias=bias, **extra).to(F64)
        net = nn.Sequential(rnn) if batch_first else nn.Sequential(_TimeMajor(), rnn)
        x = torch.randn(3, 5, 4, generator=_gen(1), dtype=F64)

        def loss_fn(out, y, batch_first=batch_first):
            seq, h = out
            h = h[0] if isinstance(h, tuple) else h
            seq = seq if batch_first else seq.transpose(0, 1)
            return seq.square().sum((1, 2)) + (h.transpose(0, 1) * y[:, None]).sum((1, 2))

        ghost, params, buffers = make_ghost_model(net)
        y = torch.randn(3, 3 if kind == "lstm_proj" else 5, dtype=F64)  # like h_n's rows
        got = ghost.per_sample(params, buffers, x, y, loss_fn).grads.materialize()
        names = list(params)
        for i in range(3):
            xi = x[i : i + 1]
            loss = loss_fn(net(xi), y[i : i + 1]).sum()
            for k, gk in zip(names, torch.autograd.grad(loss, list(net.parameters())),
                             strict=True):
                torch.testing.assert_close(got[k][i], gk, rtol=1e-10, atol=1e-12,
                                           msg=f"{kind} {batch_first} {bidirectional} {k}")


def test_ghost_refuses_dropout_in_training() -> None:
    net = nn.Sequential(nn.GRU(4, 5, num_layers=2, dropout=0.3, batch_first=True))
    ghost, params, buffers = make_ghost_model(net)
    x = torch.randn(3, 5, 4)

    def loss_fn(out, y):
        return out[0].sum((1, 2))

    with pytest.raises(GhostLayerError, match=r"inter-layer dropout \(dropout=0.3\) in training "
                       r"mode.*call eval\(\)"):
        ghost.per_sample(params, buffers, x, None, loss_fn)
    ghost.eval().per_sample(params, buffers, x, None, loss_fn)  # eval mode: no dropout
    with pytest.raises(GhostLayerError, match=r"ghost layer '0': call 0 has an unbatched input "
                       r"\(\(5, 4\)\)"):
        ghost.eval().per_sample(params, buffers, x[0], None, lambda out, y: out[0].sum(1))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_dp_step_equals_clip_and_sum_of_loop(clipping) -> None:
    net, loss_fn, x, y = _models()["lstm_classifier"]
    ghost, params, buffers = make_ghost_model(net)
    opt = torchopt.sgd(0.1)
    c = 0.3
    step = make_dp_train_step(ghost, loss_fn, opt, noise_multiplier=0.0, max_grad_norm=c,
                              sample_rate=0.5, dataset_size=10, clipping=clipping)
    state = init_dp_state(params, buffers, opt, seed=0)
    valid = torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool)
    psg = _loop_grads(net, loss_fn, x, y)
    coef = {}
    groups = ({"": tuple(psg)} if clipping == "flat" else ghost.layer_params)
    thresh = c if clipping == "flat" else c / len(ghost.layer_names) ** 0.5
    for keys in groups.values():
        norm = sum(psg[k].flatten(1).square().sum(1) for k in keys).sqrt()
        for k in keys:
            coef[k] = valid.to(F64) * torch.clamp(thresh / (norm + 1e-6), max=1.0)
    clipped = {k: torch.einsum("b,b...->...", coef[k], g) for k, g in psg.items()}
    assert (coef["rnn.weight_ih_l0"][valid] < 1).any()  # clipping is active
    total = step.clipped_sum(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(total.grads[k], clipped[k], rtol=1e-9, atol=1e-12, msg=k)
    new_state, _ = step(state, (x, y), valid)
    for k, p in params.items():
        torch.testing.assert_close(new_state.params[k], p - 0.1 * clipped[k] / 5.0,
                                   rtol=1e-9, atol=1e-12, msg=k)


# -- MAML, jvp, compile ----------------------------------------------------------------------------


def test_maml_meta_grad_equals_per_task_loop() -> None:
    net = _Classifier("lstm", num_layers=2)
    model_fn, params, buffers = make_functional(net)
    lr, n_tasks = 0.3, 3
    g = _gen(4)
    tasks = Task(torch.randn(n_tasks, 4, 5, 4, generator=g, dtype=F64),
                 torch.randint(0, 3, (n_tasks, 4), generator=g),
                 torch.randn(n_tasks, 4, 5, 4, generator=g, dtype=F64),
                 torch.randint(0, 3, (n_tasks, 4), generator=g))
    learner = maml(model_fn, F.cross_entropy, inner_steps=2, inner_lr=lr)
    got, loss, _ = learner.meta_grad(params, buffers, tasks)

    names = [k for k, _ in net.named_parameters()]
    meta = list(net.parameters())
    total = 0
    for t in range(n_tasks):
        fast = dict(zip(names, meta, strict=True))
        for _ in range(2):
            inner = F.cross_entropy(functional_call(net, fast, (tasks.support_x[t],)),
                                    tasks.support_y[t])
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {k: p - lr * gk for (k, p), gk in zip(fast.items(), grads, strict=True)}
        total = total + F.cross_entropy(functional_call(net, fast, (tasks.query_x[t],)),
                                        tasks.query_y[t])
    want = dict(zip(names, torch.autograd.grad(total / n_tasks, meta), strict=True))
    torch.testing.assert_close(loss, total.detach() / n_tasks, rtol=1e-12, atol=1e-12)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)


def test_jvp_equals_central_differences() -> None:
    net = nn.Sequential(nn.GRU(4, 5, num_layers=2, bidirectional=True)).to(F64)
    model_fn, params, buffers = make_functional(net)
    x = torch.randn(5, 2, 4, generator=_gen(0), dtype=F64)
    v = {k: torch.randn(p.shape, generator=_gen(1), dtype=F64) for k, p in params.items()}

    def f(p):
        return model_fn(p, buffers, x)[0][0]

    _, tangent = torch.func.jvp(f, (params,), (v,))
    eps = 1e-6
    plus = f({k: p + eps * v[k] for k, p in params.items()})
    minus = f({k: p - eps * v[k] for k, p in params.items()})
    torch.testing.assert_close(tangent, (plus - minus) / (2 * eps), rtol=1e-7, atol=1e-8)


# Inductor on CPU takes most of this file's time: one layer kind gets it; the other checks
# that Dynamo traces the whole forward + grad as one graph (aot_eager).
@pytest.mark.parametrize(("kind", "backend"), [("lstm_proj", "inductor"), ("gru", "aot_eager")])
def test_compiled_forward_and_grad_equal_eager(kind, backend) -> None:
    net = _Classifier(kind, bidirectional=True)
    model_fn, params, buffers = make_functional(net)
    g = _gen(5)
    x, y = torch.randn(3, 3, 4, generator=g, dtype=F64), torch.randint(0, 3, (3,), generator=g)

    def loss_and_grad(p, x, y):
        def loss(p):
            return F.cross_entropy(model_fn(p, buffers, x)[0], y)
        return torch.func.grad_and_value(loss)(p)

    eager = loss_and_grad(params, x, y)
    counter = CompileCounterWithBackend(backend)
    compiled_fn = torch.compile(loss_and_grad, fullgraph=True, backend=counter)
    compiled = compiled_fn(params, x, y)
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    x2 = torch.randn(3, 3, 4, generator=g, dtype=F64)
    torch.testing.assert_close(compiled_fn(params, x2, y), loss_and_grad(params, x2, y),
                               rtol=1e-10, atol=1e-12)
    assert counter.frame_count == 1  # the second call did not recompile
    want = _loop_grads(net, _xent, x, y)
    for k in want:
        torch.testing.assert_close(eager[0][k], want[k].mean(0), rtol=1e-10, atol=1e-12)


def test_compiled_ghost_norms_equal_loop() -> None:
    net = _Classifier("lstm", bidirectional=True)
    g = _gen(6)
    x, y = torch.randn(4, 3, 4, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)
    ghost, params, buffers = make_ghost_model(net)
    fn = ghost_grad_norms(ghost, _xent)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # Inductor: see above
    want = sum(v.flatten(1).square().sum(1) for v in _loop_grads(net, _xent, x, y).values())
    torch.testing.assert_close(compiled(params, buffers, x, y), want.sqrt(), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_cuda_per_sample_grads_and_ghost_norms_equal_loop(kind) -> None:
    net = _Classifier(kind, num_layers=2, bidirectional=True).cuda()
    g = _gen(0)
    x = torch.randn(4, 5, 4, generator=g, dtype=F64).cuda()
    y = torch.randint(0, 3, (4,), generator=g).cuda()
    with torch.backends.cudnn.flags(enabled=False):  # the reference: torch's own, no cuDNN
        want = _loop_grads(net, _xent, x, y)
    model_fn, params, buffers = make_functional(net)
    f = single_sample_fn(model_fn, buffers)

    def loss(p, xi, yi):
        return F.cross_entropy(f(p, xi)[None], yi[None])

    got = per_sample_grads(loss)(params, x, y)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-11, msg=k)
    ghost, gparams, gbuffers = make_ghost_model(net)
    norms = ghost_grad_norms(ghost, _xent)(gparams, gbuffers, x, y)
    total = sum(v.flatten(1).square().sum(1) for v in want.values()).sqrt()
    torch.testing.assert_close(norms, total, rtol=1e-9, atol=1e-11)
    compiled = torch.compile(ghost_grad_norms(ghost, _xent), fullgraph=True)
    torch.testing.assert_close(compiled(gparams, gbuffers, x, y), total, rtol=1e-9, atol=1e-11)
