"""make_graphed_step: the donated in-place step (CUDA graph on CUDA) equals the plain step.

References are the plain pure steps, called step after step: the train step, the ensemble step
and the DP-SGD step. On the CPU nothing is captured (the in-place step runs, compiled or not);
the CUDA cases (``-m gpu``) capture a graph and replay it.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.compile import make_graphed_step
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import adam, stacked_adam
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

F64 = torch.float64
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")]),
]


def mlp(device: str, dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(device, dtype)


def batches(n: int, device: str, lead: tuple[int, ...] = (), dtype: torch.dtype = F64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*lead, 12, 5, generator=g, dtype=dtype).to(device),
             torch.randint(0, 3, (*lead, 12), generator=g).to(device)) for _ in range(n)]


def assert_trees_close(a, b, **kw) -> None:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x.to(y.device), y, **kw)


def train_setup(device: str):
    module = mlp(device)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def model_fn(p, b, x):
        return torch.func.functional_call(module, p, (x,)), b

    opt = adam(1e-2)
    # seed_rng=False: an eager step would read the step counter on the host to seed its
    # randomness, which a CUDA graph cannot capture (the compiled step never does)
    step = make_train_step(model_fn, F.cross_entropy, opt, seed_rng=False)
    return step, init_train_state(params, {}, opt, seed=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", [False, True])
def test_train_step_equals_plain_steps(device, compile) -> None:
    step, state = train_setup(device)
    data = batches(5, device)
    graphed = make_graphed_step(step, state, data[0], compile=compile)
    assert graphed.graphed == (device == "cuda")
    ref, mine = state, state
    for b in data:
        ref, m_ref = step(ref, b)
        mine, m = graphed(mine, b)
        torch.testing.assert_close(m["loss"], m_ref["loss"].to(m["loss"].device))
    assert_trees_close(mine.params, ref.params, rtol=1e-12, atol=1e-12)
    assert_trees_close(mine.opt_state, ref.opt_state, rtol=1e-12, atol=1e-12)
    assert int(mine.step) == 5
    # the example state was not stepped by the warm-up, and the state is donated: the same
    # object comes back each call
    assert int(state.step) == 0
    again, _ = graphed(mine, data[0])
    assert again is mine


@pytest.mark.parametrize("device", DEVICES)
def test_batches_written_into_inputs_are_used_in_place(device) -> None:
    step, state = train_setup(device)
    data = batches(3, device)
    graphed = make_graphed_step(step, state, data[0])
    (x_own, y_own), = graphed.inputs
    assert x_own.data_ptr() != data[0][0].data_ptr()  # the step's own buffers
    ref, mine = state, state
    for b in data:
        ref, m_ref = step(ref, b)
        x_own.copy_(b[0])
        y_own.copy_(b[1])
        mine, m = graphed(mine, *graphed.inputs)
        torch.testing.assert_close(m["loss"], m_ref["loss"].to(m["loss"].device))
        assert graphed.inputs[0][0] is x_own  # never replaced
    assert_trees_close(mine.params, ref.params, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_another_state_is_loaded_like_a_resume(device) -> None:
    step, state = train_setup(device)
    data = batches(4, device)
    graphed = make_graphed_step(step, state, data[0], compile=False)
    s = state
    for b in data[:2]:
        s, _ = graphed(s, b)
    saved = optree.tree_map(lambda t: t.clone(), s)
    s, _ = graphed(s, data[2])
    s, _ = graphed(s, data[3])
    # resume from the copy taken after two steps: the same two steps again
    r, _ = graphed(saved, data[2])
    r, _ = graphed(r, data[3])
    ref = state
    for b in data:
        ref, _ = step(ref, b)
    assert_trees_close(r.params, ref.params, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_ensemble_step_compiled_graphed_equals_eager_without_recompiles(device) -> None:
    ens = Ensemble.from_seeds(lambda: mlp(device), seeds=range(4))
    opt = stacked_adam(lr=torch.tensor([1e-2, 3e-3, 1e-3, 3e-2], dtype=F64, device=device))
    step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    data = batches(4, device, lead=(4,))
    counter = CompileCounterWithBackend("inductor")
    graphed = make_graphed_step(step, state, data[0], compile={"backend": counter})
    ref, mine = state, state
    for b in data:
        ref, m_ref = step(ref, b)
        mine, m = graphed(mine, b)
        torch.testing.assert_close(m["loss"], m_ref["loss"], rtol=1e-10, atol=1e-12)
    assert_trees_close(mine.params, ref.params, rtol=1e-10, atol=1e-12)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_dp_step_graphed_equals_plain_including_noise(device) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(device, F64)
    ghost, params, buffers = make_ghost_model(net)
    opt = torchopt.sgd(0.1, momentum=0.9)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"),
                              opt, noise_multiplier=1.0, max_grad_norm=0.5, sample_rate=0.2,
                              dataset_size=60)
    state = init_dp_state(params, buffers, opt, seed=3)
    data = batches(3, device)
    valid = [(torch.arange(12) % (t + 2) != 0).to(device) for t in range(3)]
    graphed = make_graphed_step(step, state, data[0], valid[0])
    ref, mine = state, state
    for b, v in zip(data, valid, strict=True):
        ref, m_ref = step(ref, b, v)
        mine, m = graphed(mine, b, v)
        for k in m_ref:
            torch.testing.assert_close(m[k], m_ref[k], rtol=1e-10, atol=1e-12, msg=k)
    assert_trees_close(mine.params, ref.params, rtol=1e-10, atol=1e-12)
    assert torch.equal(mine.key, ref.key)


def test_bad_arguments_are_named() -> None:
    step, state = train_setup("cpu")
    b = batches(1, "cpu")[0]
    with pytest.raises(TypeError, match=r"make_graphed_step\(step=...\)"):
        make_graphed_step(3, state, b)
    with pytest.raises(ValueError, match=r"make_graphed_step\(warmup=...\): expected an int"):
        make_graphed_step(step, state, b, warmup=0)
    with pytest.raises(TypeError, match=r"make_graphed_step\(compile=...\)"):
        make_graphed_step(step, state, b, compile="yes")
    graphed = make_graphed_step(step, state, b, compile=False)
    with pytest.raises(ValueError, match=r"args\[0\]\[0\] must be \(12, 5\) torch.float64"):
        graphed(state, (b[0][:3], b[1]))
    with pytest.raises(ValueError, match=r"structure of the example arguments"):
        graphed(state, (b[0], b[1], b[1]))
    with pytest.raises(ValueError, match=r"state\.params\['0.weight'\]|state\[0\]\['0.weight'\]"):
        graphed(state._replace(params={**state.params, "0.weight": state.params["0.weight"].T}),
                b)


@pytest.mark.parametrize("compile", [False, True])
def test_step_that_changes_the_state_shape_is_refused_clearly(compile) -> None:
    def step(state, x):
        return {"w": state["w"][:2]}, {"loss": x.sum()}

    with pytest.raises(ValueError, match=r"state\['w'\] was \(3,\) torch.float32, the step "
                                         r"returned \(2,\) torch.float32"):
        make_graphed_step(step, {"w": torch.zeros(3)}, torch.ones(2), compile=compile)


@pytest.fixture
def compile_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``torch.compile`` call made in the test, in order."""
    seen: list[dict] = []
    real = torch.compile

    def spy(fn, **kwargs):
        seen.append(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    return seen


def test_dp_step_inductor_options_are_applied(compile_calls) -> None:
    seen = compile_calls
    net = nn.Linear(5, 3).to(F64)
    ghost, params, buffers = make_ghost_model(net)
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=0.5, sample_rate=0.2,
                              dataset_size=60)
    b = batches(1, "cpu")[0]
    valid = torch.ones(12, dtype=torch.bool)
    make_graphed_step(step, init_dp_state(params, buffers, opt, seed=0), b, valid)
    assert seen[-1]["options"] == {"allow_buffer_reuse": False} == dict(step.inductor_options)
    make_graphed_step(step, init_dp_state(params, buffers, opt, seed=0), b, valid,
                      compile={"mode": "default"})
    assert "options" not in seen[-1]


def _step_kinds():
    """Each public step kind built on a tiny model: ``(name, step)``."""
    import torchfn.distributed as tdist
    from torchfn.functional import make_functional
    from torchfn.meta import make_meta_train_step, maml

    net = mlp("cpu")
    model_fn, _, _ = make_functional(net)
    opt = adam(1e-2)
    ens = Ensemble.from_seeds(lambda: mlp("cpu"), seeds=range(2))
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=1)
    return [("train", make_train_step(model_fn, F.cross_entropy, opt)),
            ("ensemble", make_ensemble_train_step(ens.model_fn, F.cross_entropy,
                                                  stacked_adam(lr=1e-2))),
            ("meta", make_meta_train_step(learner, opt)),
            ("data parallel", tdist.make_data_parallel_train_step(model_fn, F.cross_entropy,
                                                                    opt)),
            ("distributed meta", tdist.make_distributed_meta_train_step(learner, opt)),
            ("sharded", tdist.make_sharded_train_step(
                model_fn, F.cross_entropy, opt, tdist.ShardLayout.from_params(
                    {k: v.detach() for k, v in net.named_parameters()})))]


def test_every_step_kind_carries_the_inductor_options_compile_step_applies(compile_calls) -> None:
    """Buffer reuse off for every step kind (docs/design.md: Inductor reused a CPU philox
    buffer of memory-efficient attention for a CUDA output), applied by compile_step."""
    from torchfn._checks import STEP_INDUCTOR_OPTIONS
    from torchfn.compile import compile_step

    seen = compile_calls
    assert dict(STEP_INDUCTOR_OPTIONS) == {"allow_buffer_reuse": False}
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kinds = _step_kinds()
    finally:
        dist.destroy_process_group()
    for name, step in kinds:
        assert dict(step.inductor_options) == {"allow_buffer_reuse": False}, name
        compile_step(step, log=None)
        assert seen[-1] == {"fullgraph": True, "options": {"allow_buffer_reuse": False}}, name
        compile_step(step, log=None, mode="max-autotune-no-cudagraphs")
        assert "options" not in seen[-1], name


def test_compile_step_train_step_without_buffer_reuse_equals_eager() -> None:
    from torchfn.compile import compile_step

    net = mlp("cpu")
    from torchfn.functional import make_functional

    model_fn, params, buffers = make_functional(net)
    opt = adam(1e-2)
    step = make_train_step(model_fn, F.cross_entropy, opt, max_grad_norm=1.0)
    compiled = compile_step(step, log=None)
    ref = mine = init_train_state(params, buffers, opt, seed=0)
    for b in batches(3, "cpu"):
        ref, m_ref = step(ref, b)
        mine, m = compiled(mine, b)
        torch.testing.assert_close(m["loss"], m_ref["loss"], rtol=1e-12, atol=0)
    assert_trees_close(mine.params, ref.params, rtol=1e-12, atol=1e-12)
    assert_trees_close(mine.opt_state, ref.opt_state, rtol=1e-12, atol=1e-12)
    torch.compiler.reset()


class _Attention(nn.Module):
    """One self-attention layer through ``F.scaled_dot_product_attention`` (float32 on CUDA:
    the memory-efficient kernel, whose philox outputs are CPU tensors)."""

    def __init__(self, d: int = 32, heads: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, classes)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, d).mean(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_attention_train_step_with_adam_equals_eager_on_cuda() -> None:
    from torchfn.compile import compile_step
    from torchfn.functional import make_functional

    torch.manual_seed(0)
    net = _Attention().cuda()
    model_fn, params, buffers = make_functional(net)
    # eps large enough that Adam does not turn float32 round-off of a near-zero gradient
    # component into a +-lr update (compiled and eager kernels round differently)
    opt = adam(1e-2, eps=1e-3)
    step = make_train_step(model_fn, F.cross_entropy, opt)
    compiled = compile_step(step, log=None)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 16, 32, generator=g).cuda(), torch.randint(0, 5, (8,), generator=g)
             .cuda()) for _ in range(3)]
    ref = mine = init_train_state(params, buffers, opt, seed=0)
    for b in data:
        ref, m_ref = step(ref, b)
        mine, m = compiled(mine, b)
        torch.testing.assert_close(m["loss"], m_ref["loss"], rtol=1e-4, atol=1e-5)
    assert_trees_close(mine.params, ref.params, rtol=1e-3, atol=1e-4)
    torch.compiler.reset()
