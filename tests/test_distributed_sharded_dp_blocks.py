"""Sharded DP-SGD with per-block gathering (``make_sharded_dp_train_step(..., blocks=...)``),
gloo ranks, float64.

One ``mp.spawn`` run on 2 ranks trains STEPS logical steps (several physical batches per rank,
the ranks' chunk counts may differ) of every clipping mode with the whole-gather sharded step
and with ``blocks="auto"``, counting the gathered block params alive at once; the tests compare
them with each other and with one process over the same global Poisson draws, noise included.
A world of one checks the refusals.
"""

from __future__ import annotations

import os
import socket
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from torchfn import distributed as tdist
from torchfn.distributed import _blocks
from torchfn.optim import adam
from torchfn.persample import (
    AdaptiveClipping,
    PoissonSampler,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

F64 = torch.float64
STEPS = 2
N = 48
TOL = {"rtol": 1e-10, "atol": 1e-12}
MODES = {
    "flat": {"max_grad_norm": 0.5},
    "per_layer": {"max_grad_norm": 0.5, "clipping": "per_layer"},
    "automatic": {"max_grad_norm": 0.5, "clipping": "automatic"},
    "adaptive": {"max_grad_norm": 0.5,
                 "adaptive_clipping": AdaptiveClipping(target_quantile=0.5, learning_rate=0.2)},
}


class Block(nn.Module):
    """Pre-LN residual MLP: LayerNorm, Linear, tanh, Linear (ghost layers inside the block)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(self.ln(h))))


class Net(nn.Module):
    def __init__(self, d: int = 6, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def problem(mode: str) -> tuple[Any, dict, dict, Any]:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(Net().double())
    opt = adam(0.05)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=0.7, sample_rate=0.25, dataset_size=N,
                              **MODES[mode])
    return step, params, buffers, opt


def data() -> tuple[torch.Tensor, torch.Tensor, PoissonSampler]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 5, generator=g, dtype=F64), torch.randint(0, 3, (N,), generator=g)
    return x, y, PoissonSampler(N, 0.25, 8, seed=12)  # chunks per rank: (2, 1), (2, 2)


def _c0(mode: str) -> float | None:
    return 0.5 if mode == "adaptive" else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFN_OPS="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    live, peak = [0], [0]

    def free(n: int) -> None:
        live[0] -= n

    def count(full: dict[str, torch.Tensor]) -> None:
        for t in full.values():
            live[0] += t.numel()
            weakref.finalize(t, free, t.numel())
        peak[0] = max(peak[0], live[0])

    try:
        x, y, sampler = data()
        for mode in MODES:
            step, params, buffers, opt = problem(mode)
            layout = tdist.ShardLayout.from_params(params)
            for blocks in (None, "auto"):
                sstep = tdist.make_sharded_dp_train_step(step, layout, blocks=blocks)
                state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=4,
                                                    max_grad_norm=_c0(mode))
                metrics, n_chunks = [], []
                _blocks._ON_GATHER = count if blocks else None
                try:
                    for t in range(STEPS):
                        chunks = tdist.shard_poisson_sample(sampler, t, rank=rank,
                                                            world_size=world,
                                                            physical_batch_size=4)
                        n_chunks.append(len(chunks))
                        state, m = sstep.run(state, chunks, lambda i: (x[i], y[i]))
                        metrics.append(m)
                    # the one-physical-batch call
                    state, m = sstep(state, (x[:4], y[:4]), torch.ones(4, dtype=torch.bool))
                    metrics.append(m)
                finally:
                    _blocks._ON_GATHER = None
                out[mode, blocks] = {"state": tdist.gather_sharded_state(state, layout, opt),
                                     "metrics": metrics, "n_chunks": n_chunks,
                                     "peak": peak[0], "live_after": live[0]}
                peak[0] = 0
        torch.save(out, os.path.join(root, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("sharded_dp_blocks")
    mp.spawn(_rank_main, args=(2, _free_port(), str(root)), nprocs=2, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _reference(mode: str) -> tuple[Any, list]:
    """One process: the same global draws, then the same one-batch call of 4 examples on
    each of the 2 ranks (x[:4] twice)."""
    x, y, sampler = data()
    step, params, buffers, opt = problem(mode)
    state = init_dp_state(params, buffers, opt, seed=4, max_grad_norm=_c0(mode))
    metrics = []
    for t in range(STEPS):
        state, m = step.run(state, sampler.sample(t), lambda i: (x[i], y[i]))
        metrics.append(m)
    state, m = step(state, (torch.cat([x[:4], x[:4]]), torch.cat([y[:4], y[:4]])),
                    torch.ones(8, dtype=torch.bool))
    metrics.append(m)
    return state, metrics


def _close_state(a: Any, b: Any, **tol: float) -> None:
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], **(tol or TOL),
                                   msg=lambda m, k=k: f"{k}: {m}")
    la, lb = (torch.utils._pytree.tree_leaves(s.opt_state) for s in (a, b))
    for u, v in zip(la, lb, strict=True):
        torch.testing.assert_close(u, v, **(tol or TOL))
    assert torch.equal(a.key, b.key) and int(a.step) == int(b.step)
    if a.clip_norm is not None or b.clip_norm is not None:
        torch.testing.assert_close(a.clip_norm, b.clip_norm, **(tol or TOL))


METRICS = ("loss", "batch_size", "clip_fraction", "grad_norm_mean", "skipped")


@pytest.mark.parametrize("mode", list(MODES))
def test_blocked_equals_whole_gather_and_one_process(runs, mode):
    ref_state, ref_metrics = _reference(mode)
    for out in runs:
        got, whole = out[mode, "auto"], out[mode, None]
        _close_state(got["state"], whole["state"])
        _close_state(got["state"], ref_state)
        _close_state(got["state"], runs[0][mode, "auto"]["state"], rtol=0, atol=0)
        for t in range(STEPS + 1):
            for k in METRICS:
                torch.testing.assert_close(got["metrics"][t][k], ref_metrics[t][k], **TOL)
            if mode == "adaptive":
                torch.testing.assert_close(got["metrics"][t]["max_grad_norm"],
                                           ref_metrics[t]["max_grad_norm"], **TOL)
    assert max(float(m["clip_fraction"]) for m in ref_metrics) > 0  # clipping exercised
    # several chunks per rank, and ranks that held different numbers of them
    n = [out[mode, "auto"]["n_chunks"] for out in runs]
    assert max(max(c) for c in n) > 1
    assert any(a != b for a, b in zip(n[0], n[1], strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_gathered_block_params_alive_at_once_are_one_block(runs, mode):
    module = Net()
    block = sum(p.numel() for p in module.layers[0].parameters())
    in_blocks = sum(p.numel() for p in module.layers.parameters())
    for out in runs:
        assert out[mode, "auto"]["peak"] == block < in_blocks
        assert out[mode, "auto"]["live_after"] == 0


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class RootPos(nn.Module):
    """The root owns a param directly: its ghost layer (``direct``) recomputes the root's
    forward, which calls every block."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(5))
        self.layers = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        for layer in self.layers:
            x = layer(x)
        return x


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 5)])
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers[0](self.layers[0](x)))


def _dp(module: nn.Module) -> tuple[Any, Any, dict, dict, Any]:
    ghost, params, buffers = make_ghost_model(module.double())
    opt = adam(0.1)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1,
                              dataset_size=100)
    return step, tdist.ShardLayout.from_params(params), params, buffers, opt


def test_refusals(world_of_one):
    step, layout, *_ = _dp(RootPos())
    with pytest.raises(ValueError, match=r"ghost layer '<root>' \(direct\) reads the params of "
                                         r"\['<outside every block>', 'layers\.0', 'layers\.1'\]"
                                         r" and contains the blocks"):
        tdist.make_sharded_dp_train_step(step, layout, blocks="auto")
    step, layout, params, buffers, opt = _dp(Twice())
    sstep = tdist.make_sharded_dp_train_step(step, layout, blocks="auto")
    state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=0)
    batch = (torch.randn(4, 5, dtype=F64), torch.zeros(4, dtype=torch.long))
    valid = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"block 'layers\.0' was called twice in one forward"):
        sstep(state, batch, valid)
    with pytest.raises(ValueError, match=r"per-block gathering .*runs eagerly only"):
        sstep.compile()


def test_blocked_donated_equals_whole_gather_pure(world_of_one):
    """``blocks`` with ``donate=True`` (the big-model setting): the same numbers as the pure
    whole-gather step, with a padded (invalid) example."""
    x, y, _ = data()
    valid = torch.ones(8, dtype=torch.bool)
    valid[-1] = False
    got = []
    for blocks, donate in ((None, False), ("auto", True)):
        step, params, buffers, opt = problem("flat")
        layout = tdist.ShardLayout.from_params(params)
        sstep = tdist.make_sharded_dp_train_step(step, layout, blocks=blocks, donate=donate)
        state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=1)
        for t in range(2):
            state, m = sstep(state, (x[8 * t:8 * t + 8], y[8 * t:8 * t + 8]), valid)
        got.append((state, m))
    _close_state(got[1][0], got[0][0])
    for k in METRICS:
        torch.testing.assert_close(got[1][1][k], got[0][1][k], **TOL)
