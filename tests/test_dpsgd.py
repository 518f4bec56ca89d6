"""DP-SGD (make_dp_train_step, PoissonSampler, the counter-based noise) against references.

The clipped sum equals a naive clip-then-sum of per-sample gradients from a loop of
torch.autograd.grad (flat and per-layer clipping, with masked examples), a whole step equals
the textbook update with the same noise draw, the noise has std ``sigma * C / (q N)`` and is
reproducible from the seed, compiled == eager (noise included) with no recompiles, and
Poisson sampling is exact and reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.persample import (
    ClippedSum,
    DPTrainStep,
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)
from torchfn.persample._dp_random import normal

F64 = torch.float64
B = 10


def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 4),
    ).to(F64)


def data(seed: int = 0, n: int = B) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, dtype=F64, generator=g), torch.randint(0, 4, (n,), generator=g)


def loop_grads(ghost, params, buffers, x, y) -> dict[str, Tensor]:
    out: dict[str, list[Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = xent(ghost(p, buffers, x[i : i + 1])[0], y[i : i + 1]).sum()
        for k, g in zip(p, torch.autograd.grad(loss, list(p.values())), strict=True):
            out[k].append(g)
    return {k: torch.stack(v) for k, v in out.items()}


def naive_clipped_sum(ghost, psg, valid, max_grad_norm, clipping) -> dict[str, Tensor]:
    """Clip each per-sample gradient (flat or per layer), zero masked ones, sum."""
    mask = valid.to(F64)
    coef = {}
    if clipping == "flat":
        norm = sum(g.flatten(1).square().sum(1) for g in psg.values()).sqrt()
        c = mask * torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        coef = dict.fromkeys(psg, c)
    else:
        c_layer = max_grad_norm / math.sqrt(len(ghost.layer_names))
        for names in ghost.layer_params.values():
            norm = sum(psg[k].flatten(1).square().sum(1) for k in names).sqrt()
            for k in names:
                coef[k] = mask * torch.clamp(c_layer / (norm + 1e-6), max=1.0)
    return {k: torch.einsum("b,b...->...", coef[k], g) for k, g in psg.items()}


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_step_equals_naive_clip_then_sum_plus_same_noise(clipping) -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=0.8, max_grad_norm=0.5,
                              sample_rate=0.2, dataset_size=50, clipping=clipping)
    assert step.expected_batch_size == pytest.approx(10.0) and step.noise_std == 0.8 * 0.5
    state = init_dp_state(params, buffers, opt, seed=11)
    x, y = data()
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    psg = loop_grads(ghost, params, buffers, x, y)
    expect = naive_clipped_sum(ghost, psg, valid, 0.5, clipping)

    total = step.clipped_sum(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(total.grads[k], expect[k], rtol=1e-9, atol=1e-12, msg=k)
    assert float(total.count) == 8.0
    # a big threshold clips nothing: the sum is the plain summed gradient of valid examples
    loose = make_dp_train_step(ghost, xent, opt, noise_multiplier=0.8, max_grad_norm=1e6,
                               sample_rate=0.2, dataset_size=50, clipping=clipping)
    plain = loose.clipped_sum(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(plain.grads[k], psg[k][valid].sum(0), msg=k)

    new_state, metrics = step(state, (x, y), valid)
    sizes = [p.numel() for p in params.values()]
    noise = normal(state.key, (sum(sizes),), F64).split(sizes)
    for (k, p), z in zip(params.items(), noise, strict=True):
        noisy = (expect[k] + 0.4 * z.reshape(p.shape)) / 10.0
        torch.testing.assert_close(new_state.params[k], p - 0.1 * noisy, rtol=1e-9, atol=1e-12)
    assert int(new_state.step) == 1 and not torch.equal(new_state.key, state.key)
    losses = xent(ghost(params, buffers, x)[0], y)
    torch.testing.assert_close(metrics["loss"], losses[valid].mean())
    assert float(metrics["batch_size"]) == 8.0


def test_masked_examples_contribute_nothing() -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=1.0,
                              sample_rate=0.2, dataset_size=50)
    state = init_dp_state(params, buffers, opt, seed=0)
    x, y = data()
    valid = torch.arange(B) % 3 != 0
    x2, y2 = x.clone(), y.clone()
    x2[~valid] = 100 * torch.randn_like(x2[~valid])
    y2[~valid] = (y2[~valid] + 1) % 4
    a, b = step.clipped_sum(state, (x, y), valid), step.clipped_sum(state, (x2, y2), valid)
    for k in params:
        torch.testing.assert_close(a.grads[k], b.grads[k], rtol=0, atol=1e-13)
    none = step.clipped_sum(state, (x, y), torch.zeros(B, dtype=torch.bool))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in none.grads.values())


def _noise_only(step: DPTrainStep, state) -> dict[str, Tensor]:
    """The update of an all-zero clipped sum under SGD(lr=1): minus the scaled noise."""
    zeros = {k: torch.zeros_like(v) for k, v in state.params.items()}
    z0 = torch.zeros((), dtype=F64)
    new_state, _ = step.apply(state, ClippedSum(zeros, z0, z0, z0, z0))
    return {k: state.params[k] - new_state.params[k] for k in zeros}


def test_noise_std_and_reproducibility() -> None:
    ghost, params, buffers = make_ghost_model(nn.Linear(200, 100).to(F64))
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.3, max_grad_norm=2.0,
                              sample_rate=0.01, dataset_size=500)  # q N = 5
    state = init_dp_state(params, buffers, opt, seed=42)
    noise = torch.cat([v.flatten() for v in _noise_only(step, state).values()])
    assert noise.numel() == 20100
    target = 1.3 * 2.0 / 5.0
    assert abs(float(noise.mean())) < 4 * target / math.sqrt(noise.numel())
    assert float(noise.std()) == pytest.approx(target, rel=0.03)  # ~7 standard errors
    kurtosis = float(((noise - noise.mean()) ** 4).mean() / noise.var() ** 2)
    assert kurtosis == pytest.approx(3.0, abs=0.15)
    # reproducible from the seed; a different seed or the next step gives other noise
    again = _noise_only(step, init_dp_state(params, buffers, opt, seed=42))
    other = _noise_only(step, init_dp_state(params, buffers, opt, seed=43))
    advanced = state._replace(key=step.apply(state, ClippedSum(
        {k: torch.zeros_like(v) for k, v in params.items()},
        *(torch.zeros((), dtype=F64),) * 4))[0].key)
    nxt = _noise_only(step, advanced)
    assert torch.equal(torch.cat([v.flatten() for v in again.values()]), noise)
    corr = torch.corrcoef(torch.stack([noise, torch.cat([v.flatten() for v in other.values()])]))
    assert abs(float(corr[0, 1])) < 0.05
    assert not torch.equal(torch.cat([v.flatten() for v in nxt.values()]), noise)


def test_frozen_parameters_get_no_noise() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(F64)
    net[0].requires_grad_(False)
    ghost, params, buffers = make_ghost_model(net)
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=1.0,
                              sample_rate=0.1, dataset_size=100)
    delta = _noise_only(step, init_dp_state(params, buffers, opt, seed=0))
    assert torch.equal(delta["0.weight"], torch.zeros(4, 3, dtype=F64))
    assert float(delta["1.weight"].abs().sum()) > 0


def test_compiled_equals_eager_including_noise_without_recompiles() -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1, momentum=0.9)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=0.5,
                              sample_rate=0.2, dataset_size=50, clipping="per_layer")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_state = compiled_state = init_dp_state(params, buffers, opt, seed=5)
    for t in range(3):
        x, y = data(seed=t)
        valid = torch.rand(B, generator=torch.Generator().manual_seed(t)) < 0.7
        eager_state, m_e = step(eager_state, (x, y), valid)
        compiled_state, m_c = compiled(compiled_state, (x, y), valid)
        for k in params:
            torch.testing.assert_close(compiled_state.params[k], eager_state.params[k],
                                       rtol=1e-9, atol=1e-12, msg=k)
        for k in m_e:
            torch.testing.assert_close(m_c[k], m_e[k], msg=k)
    assert torch.equal(compiled_state.key, eager_state.key)
    assert int(compiled_state.step) == 3
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])])
@pytest.mark.parametrize("tensor_scalars", [False, True])
def test_noisy_sums_multi_tensor_equals_the_per_leaf_loop(device, tensor_scalars) -> None:
    """``(g + std z) / denom`` as foreach ops (eager and compiled) == the per-leaf loop, bit for
    bit, over mixed dtypes and shapes; under vmap (no foreach batching rules) the loop runs."""
    from torchfn.persample._dpsgd import _noisy_sums

    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (), (2, 3, 2), (7,)]
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32, torch.bfloat16]
    gs = [torch.randn(s, generator=gen).to(device, d) for s, d in zip(shapes, dtypes, strict=True)]
    zs = [torch.randn(s, generator=gen).to(device, d) for s, d in zip(shapes, dtypes, strict=True)]
    std, denom = (torch.tensor(0.7, device=device), torch.tensor(3.0, device=device)) \
        if tensor_scalars else (0.7, 3.0)
    def loop(gs, zs, std, denom):
        return [(g + std * z) / denom for g, z in zip(gs, zs, strict=True)]

    # eager against eager, compiled against the compiled loop; a bf16 leaf within 2 ulps
    # (Inductor may compute a bf16 expression in float32 and round once, or round each op)
    def copies():  # _noisy_sums may overwrite the noise
        return [z.clone() for z in zs]

    noise = copies()
    eager = _noisy_sums(gs, noise, std, denom)
    assert all(a is b for a, b in zip(eager, noise, strict=True))  # in place: multi-tensor ops
    for got, want in ((eager, loop(gs, zs, std, denom)),
                      (torch.compile(_noisy_sums, fullgraph=True)(gs, copies(), std, denom),
                       torch.compile(loop, fullgraph=True)(gs, zs, std, denom))):
        assert [t.dtype for t in got] == dtypes
        for a, b in zip(got, want, strict=True):
            if a.dtype == torch.bfloat16:
                torch.testing.assert_close(a, b, rtol=2 ** -6, atol=0)
            else:
                assert torch.equal(a, b)
    want = loop(gs, zs, std, denom)
    batched = torch.func.vmap(lambda g, z: _noisy_sums([g], [z], 0.7, 3.0)[0])(gs[0],
                                                                               copies()[0])
    assert torch.equal(batched, want[0] if not tensor_scalars else (gs[0] + 0.7 * zs[0]) / 3.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_cuda_clipped_sum_and_compiled_step(clipping) -> None:
    """CUDA: clipped sum == naive (eager kernels), and compiled == eager incl. noise."""
    ghost, params, buffers = make_ghost_model(small_net().cuda())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=0.8, max_grad_norm=0.5,
                              sample_rate=0.2, dataset_size=50, clipping=clipping)
    state = init_dp_state(params, buffers, opt, seed=11)
    x, y = (t.cuda() for t in data())
    valid = (torch.arange(B) % 4 != 2).cuda()
    psg = loop_grads(ghost, params, buffers, x, y)
    expect = naive_clipped_sum(ghost, psg, valid, 0.5, clipping)
    total = step.clipped_sum(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(total.grads[k], expect[k], rtol=1e-9, atol=1e-12, msg=k)
    eager, _ = step(state, (x, y), valid)
    compiled, _ = torch.compile(step, fullgraph=True)(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-9, atol=1e-12)


def test_poisson_sampler_is_exact_reproducible_and_packs_without_truncation() -> None:
    n, q = 400, 0.05
    sampler = PoissonSampler(n, q, 16, seed=3)
    counts, hits = [], torch.zeros(n)
    for t in range(300):
        mask = sampler.mask(t)
        chunks = sampler.sample(t)
        idx = torch.cat([i[v] for i, v in chunks])
        assert torch.equal(idx, torch.nonzero(mask).flatten())  # every selected index, once
        assert all(i.shape == (16,) and v.shape == (16,) for i, v in chunks)
        assert len(chunks) == max(1, math.ceil(int(mask.sum()) / 16))
        counts.append(int(mask.sum()))
        hits += mask.double()
    counts_t = torch.tensor(counts, dtype=F64)
    assert float(counts_t.mean()) == pytest.approx(n * q, abs=4 * math.sqrt(n * q / 300))
    assert float(counts_t.var()) == pytest.approx(n * q * (1 - q), rel=0.25)
    assert max(counts) > 16  # some draws spanned two physical batches
    assert float(hits.mean()) == pytest.approx(300 * q, rel=0.05)
    assert torch.equal(PoissonSampler(n, q, 16, seed=3).mask(7), sampler.mask(7))
    assert not torch.equal(PoissonSampler(n, q, 16, seed=4).mask(7), sampler.mask(7))


def test_run_over_several_physical_batches_equals_one() -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=0.5,
                              sample_rate=0.2, dataset_size=50)
    x, y = data(n=50)
    small, big = PoissonSampler(50, 0.2, 4, seed=1), PoissonSampler(50, 0.2, 50, seed=1)
    chunks_small, chunks_big = small.sample(0), big.sample(0)
    assert len(chunks_small) > 1 and len(chunks_big) == 1
    acct = RDPAccountant()
    state = init_dp_state(params, buffers, opt, seed=0)
    s1, m1 = step.run(state, chunks_small, lambda i: (x[i], y[i]), acct)
    s2, m2 = step.run(state, chunks_big, lambda i: (x[i], y[i]), acct)
    for k in params:
        torch.testing.assert_close(s1.params[k], s2.params[k], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m1["loss"], m2["loss"])
    assert acct.history == ((1.0, 0.2, 2),)


def test_argument_errors() -> None:
    ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    opt = torchopt.sgd(0.1)
    common = {"noise_multiplier": 1.0, "sample_rate": 0.1, "dataset_size": 100}
    with pytest.raises(ValueError, match=r"missing \['1'\]"):
        make_dp_train_step(ghost, xent, opt, max_grad_norm={"0": 1.0},
                           clipping="per_layer", **common)
    with pytest.raises(ValueError, match="needs clipping='per_layer'"):
        make_dp_train_step(ghost, xent, opt, max_grad_norm={"0": 1.0, "1": 1.0}, **common)
    with pytest.raises(ValueError, match="sample_rate"):
        make_dp_train_step(ghost, xent, opt, max_grad_norm=1.0, noise_multiplier=1.0,
                           sample_rate=1.5, dataset_size=10)
    with pytest.raises(TypeError, match="GhostModel"):
        make_dp_train_step(nn.Linear(2, 2), xent, opt, max_grad_norm=1.0, **common)
    step = make_dp_train_step(ghost, xent, opt, max_grad_norm={"0": 1.0, "1": 2.0},
                              clipping="per_layer", **common)
    assert step.max_grad_norm == pytest.approx(math.sqrt(5.0))
    state = init_dp_state(params, buffers, opt, seed=0)
    with pytest.raises(ValueError, match="valid must have shape"):
        step(state, (torch.randn(4, 3), torch.randint(0, 2, (4,))), torch.ones(3, dtype=bool))
    # a non-bool mask would weight the clipped gradients (indices: weights 0..B-1) and break
    # the sensitivity the noise is calibrated to: refused, naming the dtype seen
    batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    for bad in (torch.arange(4), torch.full((4,), 3.0), torch.ones(4, dtype=torch.uint8)):
        with pytest.raises(TypeError, match=f"valid must be a torch.bool tensor.*{bad.dtype}"):
            step(state, batch, bad)


def test_forward_that_updates_buffers_is_refused() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.seen = self.seen + x.shape[0]
            return self.lin(x)

    ghost, params, buffers = make_ghost_model(Counter())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=1.0,
                              sample_rate=0.1, dataset_size=100)
    state = init_dp_state(params, buffers, opt, seed=0)
    with pytest.raises(ValueError, match="updated buffer 'seen'"):
        step(state, (torch.randn(4, 3), torch.randint(0, 2, (4,))), torch.ones(4, dtype=bool))


def _sqrt_abs_loss(out: Tensor, y: Tensor) -> Tensor:
    """Per-sample loss that is finite at ``out == 0`` while its gradient there is NaN."""
    return out.abs().sqrt().sum(-1) + 0.0 * y


@pytest.mark.parametrize("where", ["valid", "padding"])
@pytest.mark.parametrize("compiled", [False, True])
def test_nonfinite_gradient_with_finite_loss_skips_the_step(where, compiled) -> None:
    """The guard reads finiteness off the per-sample norms (norm_sum), not a pass over the
    noisy gradient: a sample whose loss is finite but whose gradient is NaN -- a padding one
    too, whose zero coefficient times NaN would poison the clipped sum -- skips the step."""
    from torchfn.optim import adam

    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(4, 3, bias=False)).to(F64))
    opt = adam(1e-2)  # torchopt's adam does not trace (docs/design.md)
    step = make_dp_train_step(ghost, _sqrt_abs_loss, opt, noise_multiplier=1.0,
                              max_grad_norm=1.0, sample_rate=0.2, dataset_size=50)
    run = step.compile(backend="aot_eager") if compiled else step
    state = init_dp_state(params, buffers, opt, seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 4, dtype=F64, generator=g), torch.zeros(6, dtype=F64)
    valid = torch.tensor([False, True, True, True, True, True])
    x[1 if where == "valid" else 0] = 0.0  # output exactly 0: finite loss, NaN gradient
    new, metrics = run(state, (x, y), valid)
    assert torch.isfinite(metrics["loss"])
    assert bool(metrics["skipped"]) and int(new.skipped) == 1
    assert "grad_norm" not in metrics
    for k in params:
        assert torch.equal(new.params[k], state.params[k]), k
    x[x.abs().sum(1) == 0] = 1.0
    new, metrics = run(state, (x, y), valid)
    assert not bool(metrics["skipped"])
    assert all(torch.isfinite(v).all() and not torch.equal(v, state.params[k])
               for k, v in new.params.items())
    torch.compiler.reset()


def test_apply_gradients_grads_finite_replaces_the_norm_pass_only_without_clipping() -> None:
    from torchfn.functional import StepOptions, apply_gradients, init_train_state

    opt = torchopt.sgd(0.1)
    state = init_train_state({"w": torch.ones(3, dtype=F64)}, {}, opt, seed=0)
    g = {"w": torch.tensor([1.0, 2.0, 2.0], dtype=F64)}
    yes, no = torch.tensor(True), torch.tensor(False)
    new, m = apply_gradients(opt, g, state, grads_finite=yes)
    assert "grad_norm" not in m and not bool(m["skipped"])
    torch.testing.assert_close(new.params["w"], torch.ones(3, dtype=F64) - 0.1 * g["w"])
    new, m = apply_gradients(opt, g, state, grads_finite=no)
    assert bool(m["skipped"]) and torch.equal(new.params["w"], state.params["w"])
    # global-norm clipping needs the norm: measured as without the hint
    new, m = apply_gradients(opt, g, state, grads_finite=yes,
                             options=StepOptions(max_grad_norm=1.0))
    torch.testing.assert_close(m["grad_norm"], torch.tensor(3.0, dtype=F64))
    torch.testing.assert_close(new.params["w"], torch.ones(3, dtype=F64) - 0.1 * g["w"] / 3,
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="grads_finite is for one model"):
        apply_gradients(opt, {"w": g["w"][None]}, state._replace(
            params={"w": state.params["w"][None]}), grads_finite=yes, per_member=True)
