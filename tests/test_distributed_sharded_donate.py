"""Donated sharded steps (``donate=True`` of ``make_sharded_train_step`` and
``make_sharded_dp_train_step``) on gloo ranks, float64.

One ``mp.spawn`` run on 2 ranks trains 4 steps with the pure and the donated step from the same
state: the train step with Adam (value and norm clipping, 2 micro-batches; and per-block
gathering) and SGD with momentum (norm clipping, an lr schedule), the DP step with Adam and
adaptive clipping and with SGD; step 2 holds a NaN, so it is skipped. The tests check that every
step's params, optimizer state, buffers, counters and metrics are equal bit for bit, that the
skipped step left the donated tensors exactly as they were, and, in a world of one, AdamW with
a schedule, that passing a donated state again raises, that the live optimizer-state elements
at each update peak at one copy plus one param's (not two copies), and the refusals. A GPU
test measures the allocated memory of the update.
"""

from __future__ import annotations

import os
import socket
import weakref
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchopt
from torch import nn
from torchopt.base import GradientTransformation

from torchfn import distributed as tdist
from torchfn.functional import make_functional
from torchfn.optim import adam, adamw, sgd
from torchfn.persample import AdaptiveClipping, make_dp_train_step, make_ghost_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

F64 = torch.float64
STEPS, SKIP = 4, 2
CONFIGS: dict[str, dict[str, Any]] = {
    "adam": {"opt": lambda: adam(1e-2), "kw": {"max_grad_norm": 0.3, "clip_value": 0.05,
                                               "grad_accum_steps": 2}},
    "adam_blocks": {"opt": lambda: adam(1e-2), "kw": {"max_grad_norm": 0.3, "blocks": "auto"}},
    "sgd": {"opt": lambda: sgd(lambda c: 0.1 / (1.0 + c), momentum=0.9),
            "kw": {"max_grad_norm": 0.5, "lr_schedule": lambda c: 0.1 / (1.0 + c)}},
}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))


class Net(nn.Module):
    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(2))
        self.out = nn.Linear(d, 2)
        self.register_buffer("m", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.m = 0.9 * self.m + 0.1 * x.mean(0)
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = [(torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, 2, generator=g, dtype=F64))
           for _ in range(STEPS)]
    out[SKIP][1][0, 0] = float("nan")  # a NaN target: the loss is NaN, the step is skipped
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clone(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree,
                           none_is_leaf=False, namespace="torchopt")


def _train(cfg: dict[str, Any], donate: bool, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(Net().to(F64))
    opt = cfg["opt"]()
    layout = tdist.ShardLayout.from_params(params)
    step = tdist.make_sharded_train_step(model_fn, F.mse_loss, opt, layout, donate=donate,
                                         **cfg["kw"])
    state = tdist.init_sharded_state(params, buffers, opt, layout, seed=0)
    n = 8 // world
    states, metrics, before_skip, tensors = [], [], None, None
    for i, (x, y) in enumerate(batches()):
        if i == SKIP:
            before_skip = _clone(state)
            tensors = [id(t) for t in optree.tree_leaves((state.params, state.opt_state),
                                                         namespace="torchopt")]
        state, m = step(state, (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        if i == SKIP:  # the donated step wrote into the same tensors
            same = [id(t) for t in optree.tree_leaves((state.params, state.opt_state),
                                                      namespace="torchopt")]
            assert (same[:len(state.params)] == tensors[:len(state.params)]) == donate
        states.append(_clone(state))
        metrics.append(m)
    return {"states": states, "metrics": metrics, "before_skip": before_skip}


DP_CONFIGS: dict[str, dict[str, Any]] = {
    "dp_adam_adaptive": {"opt": lambda: adam(0.05), "kw": {"adaptive_clipping": AdaptiveClipping(
        target_quantile=0.5, learning_rate=0.2)}},
    "dp_sgd": {"opt": lambda: sgd(0.1, momentum=0.9), "kw": {"lr_schedule": 0.1}},
}


def _train_dp(cfg: dict[str, Any], donate: bool, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    ghost, params, buffers = make_ghost_model(module)
    opt = cfg["opt"]()
    dp = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                            noise_multiplier=0.7, max_grad_norm=0.5, sample_rate=0.25,
                            dataset_size=32, **cfg["kw"])
    layout = tdist.ShardLayout.from_params(params)
    sstep = tdist.make_sharded_dp_train_step(dp, layout, donate=donate)
    state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=3, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(7 + rank)
    states, metrics, before_skip = [], [], None
    for i in range(STEPS):
        x, y = torch.randn(4, 4, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)
        if i == SKIP and rank == 1:
            x[0, 0] = float("nan")  # one rank's NaN example: every rank skips
        if i == SKIP:
            before_skip = _clone(state)
        ids = [id(t) for t in state.params.values()]
        state, m = sstep(state, (x, y), torch.ones(4, dtype=torch.bool))
        assert (ids == [id(t) for t in state.params.values()]) == donate  # written in place
        states.append(_clone(state))
        metrics.append(m)
    return {"states": states, "metrics": metrics, "before_skip": before_skip}


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {name: {d: _train(cfg, d, rank, world) for d in (False, True)}
               for name, cfg in CONFIGS.items()}
        out.update({name: {d: _train_dp(cfg, d, rank, world) for d in (False, True)}
                    for name, cfg in DP_CONFIGS.items()})
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("sharded_donate")
    mp.spawn(_rank_main, args=(2, _free_port(), str(root)), nprocs=2, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _equal(a: Any, b: Any, what: str) -> None:
    la, sa = optree.tree_flatten(a, none_is_leaf=False, namespace="torchopt")
    lb, sb = optree.tree_flatten(b, none_is_leaf=False, namespace="torchopt")
    assert sa == sb, what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert x.dtype == y.dtype, f"{what}: leaf {i}: {x.dtype} vs {y.dtype}"
        assert torch.equal(x, y) or (  # (bitwise; a NaN loss equals a NaN loss)
            x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
            and torch.equal(x.nan_to_num(), y.nan_to_num())), f"{what}: leaf {i}: {x} vs {y}"


@pytest.mark.parametrize("name", list(CONFIGS) + list(DP_CONFIGS))
def test_donated_equals_pure_bit_for_bit(runs, name):
    for rank, out in enumerate(runs):
        pure, don = out[name][False], out[name][True]
        for i in range(STEPS):
            _equal(don["states"][i], pure["states"][i], f"rank {rank} step {i} state")
            _equal(don["metrics"][i], pure["metrics"][i], f"rank {rank} step {i} metrics")
        assert [bool(m["skipped"]) for m in don["metrics"]] == [i == SKIP for i in range(STEPS)]
        assert int(don["states"][-1].skipped) == 1 and int(don["states"][-1].step) == STEPS
        # the skipped step left the donated params and optimizer state exactly as they were
        _equal(don["states"][SKIP].params, don["before_skip"].params, "skipped params")
        _equal(don["states"][SKIP].opt_state, don["before_skip"].opt_state, "skipped opt_state")
        _equal(don["states"][SKIP].buffers, don["before_skip"].buffers, "skipped buffers")
        # and the steps around it moved them
        first = next(iter(don["states"][-1].params))
        assert not torch.equal(don["states"][-1].params[first],
                               don["before_skip"].params[first])


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _setup(opt: GradientTransformation, **kw: Any) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(Net().to(F64))
    layout = tdist.ShardLayout.from_params(params)
    step = tdist.make_sharded_train_step(model_fn, F.mse_loss, opt, layout, **kw)
    state = tdist.init_sharded_state(params, buffers, opt, layout, seed=0)
    return step, state, batches()[0]


def test_donated_state_passed_again_raises(world_of_one):
    step, state, batch = _setup(adam(0.1), donate=True)
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match=r"this state was donated to an earlier call "
                                         r"\(donate=True\).*Pass the state the last call "
                                         r"returned"):
        step(state, batch)
    newer, _ = step(new, batch)  # the returned state goes on
    assert int(newer.step) == 2
    pure, _, _ = _setup(adam(0.1))
    with pytest.raises(ValueError, match=r"this state was donated"):
        pure(new, batch)  # the pure sharded step refuses it too


def test_adamw_with_a_schedule_equal_pure_in_a_world_of_one(world_of_one):
    def opt() -> GradientTransformation:
        return adamw(lambda c: 0.05 / (1.0 + c), weight_decay=0.1)

    pure, state_p, _ = _setup(opt(), clip_value=0.1)
    don, state_d, _ = _setup(opt(), clip_value=0.1, donate=True)
    for x, y in batches():
        state_p, m_p = pure(state_p, (x, y))
        state_d, m_d = don(state_d, (x, y))
        _equal(state_d, state_p, "state")
        _equal(m_d, m_p, "metrics")
    assert int(state_d.skipped) == 1


def _counting(opt: GradientTransformation, live: list[int], peak: list[int]
              ) -> GradientTransformation:
    """``opt`` counting the elements of every optimizer-state tensor it sees (the states it
    is given and those it returns) while they are alive; ``peak`` is taken at each update."""
    seen: dict[int, weakref.ref] = {}

    def free(key: int, n: int) -> None:
        live[0] -= n
        seen.pop(key, None)

    def track(tree: Any) -> None:
        for t in optree.tree_leaves(tree, none_is_leaf=False, namespace="torchopt"):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":  # (structure probes)
                continue
            ref = seen.get(id(t))
            if ref is None or ref() is not t:
                seen[id(t)] = weakref.ref(t)
                live[0] += t.numel()
                weakref.finalize(t, free, id(t), t.numel())

    def init(params: Any) -> Any:
        state = opt.init(params)
        track(state)
        return state

    def update(updates: Any, state: Any, *, params: Any = None, inplace: bool = True) -> Any:
        track(state)
        new_updates, new_state = opt.update(updates, state, params=params, inplace=inplace)
        track(new_state)
        peak[0] = max(peak[0], live[0])
        return new_updates, new_state

    return GradientTransformation(init, update)


@pytest.mark.parametrize("donate", [False, True])
def test_update_holds_one_copy_of_the_optimizer_state_plus_one_param(world_of_one, donate):
    live, peak = [0], [0]
    opt = _counting(adam(0.1), live, peak)
    step, state, batch = _setup(opt, donate=donate)
    sizes = {n: p.numel() for n, p in state.params.items()}
    whole = live[0]  # the state's optimizer leaves: mu, nu (2 x params), a count per param
    assert whole == 2 * sum(sizes.values()) + len(sizes)
    state, _ = step(state, batch)  # (the first donated call checks the optimizer on probes)
    peak[0] = 0
    for _ in range(2):
        state, _ = step(state, batch)
    if donate:  # the state, plus one param's new mu and nu, and new 0-d counts
        bound = whole + 2 * max(sizes.values()) + 2 * len(sizes)
        assert whole < peak[0] <= bound, (peak[0], whole)
    else:  # the pure step: two whole copies at the update
        assert peak[0] >= 2 * whole - 1, (peak[0], whole)


def test_optimizer_mixing_params_is_refused(world_of_one):
    opt = torchopt.chain(torchopt.clip_grad_norm(1.0), adam(0.1))
    step, state, batch = _setup(opt, donate=True)
    with pytest.raises(ValueError, match=r"donate=True\): the optimizer's update of param "
                                         r"'inp\.weight' depends on the other params"):
        step(state, batch)


def test_compile_is_refused(world_of_one):
    step, state, batch = _setup(adam(0.1), donate=True)
    with pytest.raises(Exception, match=r"donated \(in-place, param by param\) update runs "
                                         r"eagerly only"):
        torch.compile(step, fullgraph=True, backend="eager")(state, batch)
    torch._dynamo.reset()
    new, _ = step(state, batch)
    assert int(new.step) == 1


def test_bad_donate_argument_raises(world_of_one):
    with pytest.raises(TypeError, match=r"make_sharded_train_step\(donate=\.\.\.\): expected "
                                        r"True or False, got 'yes'"):
        _setup(adam(0.1), donate="yes")


def test_sharded_dp_donated_state_reuse_and_compile_raise(world_of_one):
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(4, 3).to(F64))
    opt = adam(0.05)
    dp = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                            noise_multiplier=0.7, max_grad_norm=0.5, sample_rate=0.25,
                            dataset_size=32)
    layout = tdist.ShardLayout.from_params(params)
    sstep = tdist.make_sharded_dp_train_step(dp, layout, donate=True)
    state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=3)
    batch, valid = (torch.randn(4, 4, dtype=F64), torch.tensor([0, 1, 2, 0])), torch.ones(
        4, dtype=torch.bool)
    new, _ = sstep(state, batch, valid)
    with pytest.raises(ValueError, match=r"sharded DP-SGD step: this state was donated"):
        sstep(state, batch, valid)
    assert int(sstep(new, batch, valid)[0].step) == 2
    with pytest.raises(ValueError, match=r"ShardedDPStep\.compile: a donating step .* runs "
                                         r"eagerly only"):
        sstep.compile()
    with pytest.raises(TypeError, match=r"make_sharded_dp_train_step\(donate=\.\.\.\): "
                                        r"expected True or False, got 1"):
        tdist.make_sharded_dp_train_step(dp, layout, donate=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_of_the_update_is_one_param_not_a_second_state():
    """On one GPU (NCCL, a world of one): the memory allocated from the first
    ``optimizer.update`` call to the end of the step is several whole params with the pure
    step (new moments, updates, new params) but about one layer's with ``donate=True``."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        d, n = 512, 32
        with torch.device("cuda"):
            module = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(n)])
        model_fn, params, buffers = make_functional(module)
        p_bytes = sum(t.numel() * t.element_size() for t in params.values())
        layer = p_bytes / n
        layout = tdist.ShardLayout.from_params(params)
        start: list[int] = []
        inner = adam(1e-3)

        def update(updates: Any, state: Any, *, params: Any = None,
                   inplace: bool = True) -> Any:
            if not start:  # the first update of the step: measure from here
                torch.cuda.synchronize()
                start.append(torch.cuda.memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            return inner.update(updates, state, params=params, inplace=inplace)

        opt = GradientTransformation(inner.init, update)
        x = torch.randn(4, d, device="cuda")
        extra = {}
        for donate in (False, True):
            step = tdist.make_sharded_train_step(model_fn, F.mse_loss, opt, layout,
                                                 max_grad_norm=1.0, donate=donate)
            state = tdist.init_sharded_state(params, buffers, opt, layout, seed=0)
            state, _ = step(state, (x, torch.zeros_like(x)))  # (the first donated call probes)
            start.clear()
            state, _ = step(state, (x, torch.zeros_like(x)))
            torch.cuda.synchronize()
            extra[donate] = torch.cuda.max_memory_allocated() - start[0]
            del state
        assert extra[False] >= 3 * p_bytes, extra  # new moments, updates, new params
        # one layer's gradient, new moments, Adam's temporaries, update and new params
        assert extra[True] <= 12 * layer, extra
    finally:
        dist.destroy_process_group()
