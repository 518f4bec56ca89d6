"""The step matrix: {step kind} x {feature}, every cell against a plain reference loop.

Step kinds: ``train`` (make_train_step), ``ensemble`` (make_ensemble_train_step, reference: a
loop of separately trained members), ``meta`` (make_meta_train_step with MAML / first-order
MAML, reference: a per-task loop with ``torch.autograd.grad(create_graph=True)``), ``dp``
(make_dp_train_step, reference: a per-sample loop of ``torch.autograd.grad`` with clipping and
``noise_multiplier=0``) and ``dist`` (make_data_parallel_train_step on a world of one gloo
process, reference: torch.optim).

Features: frozen params (``requires_grad=False`` in the module, and a ``trainable=`` filter; with
AdamW weight decay so that a leak would show), bf16, fp16 with a dynamic loss scale (including
an overflow step that is skipped and backs the scale off), gradient accumulation, global-norm
clipping, value clipping, the lr-schedule metric, the non-finite guard (a NaN in the input skips
the step) and the error for an object-oriented optimizer.

Non-AMP cells run in float64 and compare at tight tolerances. AMP cells run a float32 model and
compare with the same reference run under the same ``torch.autocast`` (float32 master weights,
bf16/fp16 compute), at a looser tolerance.

Cells that do not exist, and why:
- dp x accumulation: DP-SGD's accumulation is its physical batches (``clipped_sum`` / ``add``
  / ``apply``), tested in the dp row as ``accum`` against one physical batch.
- dp x global-norm clipping: per-sample clipping to ``max_grad_norm`` *is* DP-SGD's mechanism
  (tested as the reference itself); the noisy mean is not clipped again.
- dp x value clipping: an elementwise clamp after the noise would be post-processing of the
  noisy gradient (allowed by DP) but changes nothing a researcher asks for; not offered.
- dist x ensemble: the distributed ensemble has no step of its own (each rank runs
  make_ensemble_train_step on its members, no communication); the ensemble row covers it.
- dist rows run the distributed twins (data-parallel train step, distributed meta step,
  DistributedDPStep) on a world of one gloo process, in-process; the sharded DP row
  (make_sharded_dp_train_step) too, where frozen, trainable, bf16 and fp16 are refused with
  an error (tested as such).
- meta x fp16 overflow uses first-order MAML (the scaled outer loss; the inner loop runs
  unscaled in fp16).
"""

from __future__ import annotations

import copy
import math

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchopt
from torch import nn

from torchfn.distributed import (
    DistributedDPStep,
    ShardLayout,
    init_sharded_dp_state,
    make_data_parallel_train_step,
    make_distributed_meta_train_step,
    make_sharded_dp_train_step,
)
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import (
    StepOptions,
    apply_gradients,
    init_train_state,
    make_functional,
    make_train_step,
)
from torchfn.meta import Task, fomaml, init_meta_state, make_meta_train_step, maml
from torchfn.optim import adamw, per_member_optimizer
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

LR, WD = 0.05, 0.1
KINDS = ["local", "dist"]


@pytest.fixture
def world(request: pytest.FixtureRequest):
    """For ``kind == "dist"``: a world of one gloo process, in this process (no spawning)."""
    if request.node.callspec.params.get("kind") not in ("dist", "sharded"):
        yield None
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
STEPS = 3
FEATURES = ["frozen", "trainable", "bf16", "fp16", "accum", "clip_norm", "clip_value", "lr",
            "nonfinite"]


def _net(dtype: torch.dtype, seed: int = 0, freeze: bool = False,
         whole_layer: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    if freeze:
        net[0].weight.requires_grad_(False)
        if whole_layer:  # ghost clipping freezes whole layers only
            net[0].bias.requires_grad_(False)
    return net


def _sched(count: torch.Tensor) -> torch.Tensor:
    return LR * 0.5 ** torch.as_tensor(count, dtype=torch.float64)


def _setup(feature: str) -> dict:
    """Settings of one feature cell: dtype, step kwargs, reference settings."""
    amp = feature if feature in ("bf16", "fp16") else None
    cfg = {
        "dtype": torch.float32 if amp else torch.float64,
        "freeze": feature == "frozen",
        "trainable": (lambda n: not n.startswith("2.")) if feature == "trainable" else None,
        "amp": amp,
        "accum": 2 if feature == "accum" else 1,
        "max_norm": 0.05 if feature == "clip_norm" else None,
        "clip_value": 0.02 if feature == "clip_value" else None,
        "sched": feature == "lr",
        "nan_step": 1 if feature == "nonfinite" else None,
        "overflow_step": 1 if feature == "fp16" else None,
    }
    return cfg


def _batches(cfg: dict, lead: tuple[int, ...] = (), seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(STEPS):
        x = torch.randn(*lead, 8, 4, generator=g, dtype=cfg["dtype"])
        y = torch.randn(*lead, 8, 3, generator=g, dtype=cfg["dtype"])
        if t == cfg["nan_step"]:
            x = x.clone()
            x.view(-1)[0] = float("nan")
        if t == cfg["overflow_step"]:
            y = y * 1e6
        out.append((x, y))
    return out


def _step_kwargs(cfg: dict) -> dict:
    kw = {"grad_accum_steps": cfg["accum"], "max_grad_norm": cfg["max_norm"],
          "clip_value": cfg["clip_value"], "amp": cfg["amp"]}
    if cfg["trainable"] is not None:
        kw["trainable"] = cfg["trainable"]
    if cfg["sched"]:
        kw["lr_schedule"] = _sched
    return kw


def _optimizer(cfg: dict):
    return adamw(_sched if cfg["sched"] else LR, weight_decay=WD)


# -- the plain reference: torch.optim over a copied nn.Module ------------------------------------


def _reference(module: nn.Module, batches: list, cfg: dict) -> tuple[nn.Module, list[bool]]:
    """torch.optim.AdamW over a copy of ``module``; returns it and which steps were skipped."""
    m = copy.deepcopy(module)
    if cfg["trainable"] is not None:
        for n, p in m.named_parameters():
            p.requires_grad_(cfg["trainable"](n))
    ps = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD)
    scale = 2.0**8
    skipped = []
    for t, (x, y) in enumerate(batches):
        opt.zero_grad()
        k = cfg["accum"]
        for mx, my in zip(x.chunk(k), y.chunk(k), strict=True):
            with (torch.autocast("cpu", dtype={"bf16": torch.bfloat16,
                                                "fp16": torch.float16}[cfg["amp"]])
                  if cfg["amp"] else torch.autocast("cpu", enabled=False)):
                loss = F.mse_loss(m(mx), my).float() if cfg["amp"] else F.mse_loss(m(mx), my)
            (loss * (scale if cfg["amp"] == "fp16" else 1.0) / k).backward()
        if cfg["amp"] == "fp16":
            for p in ps:
                p.grad /= scale
        finite = all(torch.isfinite(p.grad).all() for p in ps) and bool(torch.isfinite(loss))
        skipped.append(not finite)
        if not finite:
            scale /= 2
            continue
        if cfg["clip_value"] is not None:
            torch.nn.utils.clip_grad_value_(ps, cfg["clip_value"])
        if cfg["max_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(ps, cfg["max_norm"])
        if cfg["sched"]:
            for group in opt.param_groups:
                group["lr"] = float(_sched(torch.tensor(t - sum(skipped))))
        opt.step()
    return m, skipped


def _close(cfg: dict) -> dict:
    return ({"rtol": 1e-3, "atol": 1e-4} if cfg["amp"] else {"rtol": 1e-7, "atol": 1e-9})


def _close_batched(cfg: dict) -> dict:
    """Tolerance where torchfn batches (vmap over members / tasks) what the reference loops:
    batched half-precision matmuls round differently, so AMP cells compare within bf16/fp16
    tolerance (the float64 cells stay tight)."""
    return {"rtol": 1e-2, "atol": 5e-3} if cfg["amp"] else _close(cfg)


def _check_metrics(cfg: dict, metrics_per_step: list, skipped_ref: list, member=None) -> None:
    for t, m in enumerate(metrics_per_step):
        sk = m["skipped"] if member is None else m["skipped"][member]
        assert bool(sk) == skipped_ref[t], (t, m)
        if cfg["sched"]:  # the lr applied: the schedule at the optimizer's count
            lr = m["lr"] if member is None or m["lr"].dim() == 0 else m["lr"][member]
            applied = t - sum(skipped_ref[:t])
            torch.testing.assert_close(lr, torch.tensor(float(_sched(torch.tensor(applied))),
                                                        dtype=torch.float32))
    if cfg["amp"] == "fp16":
        scale = metrics_per_step[-1]["loss_scale"]
        scale = scale if member is None else scale[member]
        assert float(scale) == 2.0**8 / 2 ** sum(skipped_ref)


# -- train --------------------------------------------------------------------------------------


def _fp16_state(state, cfg):
    if cfg["amp"] == "fp16":
        ls = state.loss_scale
        state = state._replace(loss_scale=ls._replace(scale=torch.full_like(ls.scale, 2.0**8)))
    return state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("feature", FEATURES)
def test_train(feature: str, kind: str, world) -> None:
    cfg = _setup(feature)
    net = _net(cfg["dtype"], freeze=cfg["freeze"])
    batches = _batches(cfg)
    model_fn, params, buffers = make_functional(net)
    opt = _optimizer(cfg)
    trainable = cfg["trainable"] if cfg["trainable"] is not None else model_fn.trainable
    state = _fp16_state(init_train_state(params, buffers, opt, seed=0, trainable=trainable), cfg)
    if kind == "dist":
        step = make_data_parallel_train_step(model_fn, F.mse_loss, opt, group=world,
                                             **_step_kwargs(cfg))
    else:
        step = make_train_step(model_fn, F.mse_loss, opt, **_step_kwargs(cfg))
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    ref, skipped = _reference(net, batches, cfg)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(state.params[n], p.detach(), **_close(cfg), msg=n)
        assert torch.isfinite(state.params[n]).all()
    _check_metrics(cfg, metrics, skipped)
    assert int(state.skipped) == sum(skipped)
    if feature in ("frozen", "trainable"):
        frozen = ["0.weight"] if feature == "frozen" else ["2.weight", "2.bias"]
        for n in frozen:
            assert torch.equal(state.params[n], params[n])  # bitwise: weight decay never touched
            assert n not in state.opt_state[0].mu


def test_train_frozen_state_over_all_params_and_mismatch() -> None:
    net = _net(torch.float64, freeze=True)
    model_fn, params, buffers = make_functional(net)
    assert model_fn.frozen == ("0.weight",)
    opt = adamw(LR, weight_decay=WD)
    step = make_train_step(model_fn, F.mse_loss, opt)
    (x, y), = _batches(_setup("frozen"))[:1]
    # a state whose optimizer covers every param still never moves the frozen one
    full = init_train_state(params, buffers, opt, seed=0)
    new, _ = step(full, (x, y))
    assert torch.equal(new.params["0.weight"], params["0.weight"])
    # a state built for another trainable set is refused, naming both sets
    other = init_train_state(params, buffers, opt, seed=0, trainable=["2.weight"])
    with pytest.raises(ValueError, match=r"does not match the trainable params.*'2.weight'"):
        step(other, (x, y))


@pytest.mark.parametrize("kind", ["train", "dp"])
def test_torchopt_list_state_over_all_params_with_a_frozen_same_shape_layer(kind: str) -> None:
    """torchopt's own transformations keep lists of leaves (no names): a momentum state over
    all params, with a frozen layer of the same shape as its neighbours (a misaligned list
    would pair buffers with the wrong params without any shape error), steps exactly like the
    state over the trainable params; a list state of another param set is refused clearly."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4),
                              torch.nn.Linear(4, 4)).to(torch.float64)
    net[1].requires_grad_(False)
    opt = torchopt.sgd(0.1, momentum=0.9)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    if kind == "train":
        model_fn, params, buffers = make_functional(net)
        step = make_train_step(model_fn, F.mse_loss, opt)
        full = init_train_state(params, buffers, opt, seed=0)
        part = init_train_state(params, buffers, opt, seed=0, trainable=model_fn.trainable)
        other = init_train_state(params, buffers, opt, seed=0, trainable=["0.weight"])
        args: tuple = ((x, y),)
    else:
        ghost, params, buffers = make_ghost_model(net)
        step = make_dp_train_step(ghost, lambda o, t: ((o - t) ** 2).mean(1), opt,
                                  noise_multiplier=1.0, max_grad_norm=0.5, sample_rate=0.1,
                                  dataset_size=60)
        full = init_dp_state(params, buffers, opt, seed=0)
        part = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)
        other = init_dp_state(params, buffers, opt, seed=0, trainable=["0.weight"])
        args = ((x, y), torch.ones(6, dtype=torch.bool))
    assert len(full.opt_state[0].trace) == 6 and len(part.opt_state[0].trace) == 4
    for _ in range(3):
        full, _ = step(full, *args)
        part, _ = step(part, *args)
        for k in params:
            assert torch.equal(full.params[k], part.params[k]), k
    assert torch.equal(full.params["1.weight"], params["1.weight"])
    assert not torch.equal(full.params["2.weight"], params["2.weight"])
    with pytest.raises(ValueError, match=r"opt_state is not optimizer.init of those params"):
        step(other, *args)
    if kind == "train":  # compiled too (the check runs on meta tensors while tracing)
        got, _ = torch.compile(step, fullgraph=True)(full, *args)
        want, _ = step(full, *args)
        for k in params:
            torch.testing.assert_close(got.params[k], want.params[k], rtol=1e-13, atol=1e-15)


def test_torchopt_list_state_check_is_cached_for_eager_steps() -> None:
    """The eager step checks a list state against ``optimizer.init`` on meta tensors once per
    (optimizer, state layout, trainable set, param shapes), not every call; a state of another
    layout is still checked (and refused)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.float64)
    net[1].requires_grad_(False)
    base = torchopt.sgd(0.1, momentum=0.9)
    inits = []

    def counting_init(params):
        inits.append(len(params))
        return base.init(params)

    opt = torchopt.base.GradientTransformation(counting_init, base.update)
    model_fn, params, buffers = make_functional(net)
    step = make_train_step(model_fn, F.mse_loss, opt)
    full = init_train_state(params, buffers, base, seed=0)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    state, _ = step(full, (x, y))
    first = list(inits)
    assert first == [2, 4]  # trainable set, then all params: the state covers all
    for _ in range(3):
        state, _ = step(state, (x, y))
    assert inits == first
    other = init_train_state(params, buffers, base, seed=0, trainable=["0.weight"])
    with pytest.raises(ValueError, match=r"opt_state is not optimizer.init of those params"):
        step(other, (x, y))
    assert len(inits) == len(first) + 2


# -- ensemble -----------------------------------------------------------------------------------

N = 2


@pytest.mark.parametrize("feature", FEATURES)
def test_ensemble(feature: str) -> None:
    cfg = _setup(feature)
    nets = [_net(cfg["dtype"], seed=s, freeze=cfg["freeze"]) for s in range(N)]
    batches = _batches(cfg, lead=(N,))
    if cfg["overflow_step"] is not None or cfg["nan_step"] is not None:
        # only member 0 overflows / sees the NaN: the guard is per member
        t = cfg["overflow_step"] if cfg["overflow_step"] is not None else cfg["nan_step"]
        x, y = batches[t]
        clean = _batches(_setup("accum") | {"dtype": cfg["dtype"]}, lead=(N,), seed=7)[t]
        batches[t] = (torch.stack([x[0], clean[0][1]]), torch.stack([y[0], clean[1][1]]))
        # a skipped member must keep its own Adam step count: per-member optimizer state
        # (a stacked optimizer's shared count advances when any member steps)
        opt = per_member_optimizer(lambda lr: adamw(lambda _: lr, weight_decay=WD),
                                   {"lr": torch.full((N,), LR, dtype=cfg["dtype"])})
    else:
        opt = _optimizer(cfg)
    ens = Ensemble.from_modules(nets)
    state = _fp16_state(init_ensemble_state(ens, opt, seed=0, trainable=cfg["trainable"]), cfg)
    step = make_ensemble_train_step(ens.model_fn, F.mse_loss, opt, **_step_kwargs(cfg))
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(m)
    for i, net in enumerate(nets):
        ref, skipped = _reference(net, [(x[i], y[i]) for x, y in batches], cfg)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(state.params[n][i], p.detach(), **_close_batched(cfg),
                                       msg=f"member {i} {n}")
        _check_metrics(cfg, metrics, skipped, member=i)
        assert int(state.skipped[i]) == sum(skipped)
    if cfg["nan_step"] is not None or cfg["overflow_step"] is not None:
        assert metrics[1]["skipped"].tolist() == [True, False]
    if feature in ("frozen", "trainable"):
        frozen = ["0.weight"] if feature == "frozen" else ["2.weight", "2.bias"]
        for n in frozen:
            assert torch.equal(state.params[n], ens.params[n])


# -- meta (MAML outer step) ---------------------------------------------------------------------

INNER_LR = 0.1


def _tasks(cfg: dict, seed: int = 3) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(STEPS):
        f = [torch.randn(4, 5, d, generator=g, dtype=cfg["dtype"]) for d in (4, 3, 4, 3)]
        if t == cfg["nan_step"]:
            f[2] = f[2].clone()
            f[2][0, 0, 0] = float("nan")
        if t == cfg["overflow_step"]:
            f[3] = f[3] * 1e6
        out.append(Task(*f))
    return out


def _meta_reference(module: nn.Module, tasks: list, cfg: dict, first_order: bool
                    ) -> tuple[dict, list[bool]]:
    """Per-task MAML loop: autograd.grad(create_graph=True) inner step, torch.optim outer."""
    m = copy.deepcopy(module)
    train = {n: (cfg["trainable"](n) if cfg["trainable"] is not None else p.requires_grad)
             for n, p in m.named_parameters()}
    params = {n: p.detach().clone().requires_grad_(True) for n, p in m.named_parameters()}
    opt = torch.optim.AdamW([params[n] for n in params if train[n]], lr=LR, weight_decay=WD)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg["amp"])
    scale, skipped = 2.0**8, []
    for t, batch in enumerate(tasks):
        opt.zero_grad()
        k = cfg["accum"]
        for part in zip(*(f.chunk(k) for f in batch), strict=True):
            sx, sy, qx, qy = part
            losses = []
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                for i in range(sx.shape[0]):
                    inner = F.mse_loss(torch.func.functional_call(m, params, sx[i]), sy[i])
                    # the inner loop adapts the params the module does not freeze
                    adapted = [n for n in params if m.get_parameter(n).requires_grad]
                    gs = torch.autograd.grad(inner, [params[n] for n in adapted],
                                             create_graph=not first_order)
                    fast = {**params, **{n: params[n] - INNER_LR * g
                                         for n, g in zip(adapted, gs, strict=True)}}
                    out = torch.func.functional_call(m, fast, qx[i])
                    losses.append(F.mse_loss(out, qy[i]).float())
            loss = torch.stack(losses).mean()
            (loss * (scale if cfg["amp"] == "fp16" else 1.0) / k).backward()
        ps = [params[n] for n in params if train[n]]
        if cfg["amp"] == "fp16":
            for p in ps:
                p.grad /= scale
        finite = all(torch.isfinite(p.grad).all() for p in ps) and bool(torch.isfinite(loss))
        skipped.append(not finite)
        if not finite:
            scale /= 2
            continue
        if cfg["clip_value"] is not None:
            torch.nn.utils.clip_grad_value_(ps, cfg["clip_value"])
        if cfg["max_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(ps, cfg["max_norm"])
        if cfg["sched"]:
            for group in opt.param_groups:
                group["lr"] = float(_sched(torch.tensor(t)))
        opt.step()
    return {n: p.detach() for n, p in params.items()}, skipped


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("feature", FEATURES)
def test_meta(feature: str, kind: str, world) -> None:
    cfg = _setup(feature)
    # second-order MAML, except fp16 (the scaled outer loss, first order: the reference's
    # second-order fp16 backward and torch.func's round differently)
    first_order = feature == "fp16"
    net = _net(cfg["dtype"], freeze=cfg["freeze"])
    model_fn, params, buffers = make_functional(net)
    learner = (fomaml if first_order else maml)(model_fn, F.mse_loss, inner_lr=INNER_LR)
    opt = _optimizer(cfg)
    state = _fp16_state(init_meta_state(learner, params, buffers, opt,
                                        trainable=cfg["trainable"]), cfg)
    if kind == "dist":
        step = make_distributed_meta_train_step(learner, opt, group=world, **_step_kwargs(cfg))
    else:
        step = make_meta_train_step(learner, opt, **_step_kwargs(cfg))
    tasks = _tasks(cfg)
    metrics = []
    for b in tasks:
        state, m = step(state, b)
        metrics.append(m)
    ref, skipped = _meta_reference(net, tasks, cfg, first_order)
    for n, p in ref.items():
        torch.testing.assert_close(state.params[n], p, **_close_batched(cfg), msg=n)
        assert torch.isfinite(state.params[n]).all()
    _check_metrics(cfg, metrics, skipped)
    assert int(state.skipped) == sum(skipped)
    if feature in ("frozen", "trainable"):
        frozen = ["0.weight"] if feature == "frozen" else ["2.weight", "2.bias"]
        for n in frozen:
            assert torch.equal(state.params[n], params[n])
            assert n not in state.opt_state[0].mu


# -- dp (DP-SGD, noise_multiplier=0) -------------------------------------------------------------

DP_FEATURES = ["frozen", "trainable", "bf16", "fp16", "accum", "lr", "nonfinite"]
DP_C, DP_Q, DP_N = 0.5, 0.5, 16  # per-sample clipping norm, sample rate, dataset size


def _per_sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(-1)


def _dp_reference(module: nn.Module, batches: list, cfg: dict) -> tuple[dict, list[bool]]:
    """Per-sample loop of torch.autograd.grad, clipped to DP_C, summed, / (q N), AdamW."""
    m = copy.deepcopy(module)
    ghost_trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    train = [n for n in ghost_trainable if cfg["trainable"] is None or cfg["trainable"](n)]
    params = dict(m.named_parameters())
    opt = torch.optim.AdamW([params[n] for n in train], lr=LR, weight_decay=WD)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg["amp"])
    scale, skipped = 2.0**8, []
    for t, (x, y) in enumerate(batches):
        total = {n: torch.zeros_like(params[n]) for n in train}
        losses = []
        for i in range(x.shape[0]):
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = _per_sample_loss(m(x[i:i + 1]), y[i:i + 1])[0]
                loss = loss.float() if amp is not None else loss
            s = scale if cfg["amp"] == "fp16" else 1.0
            # the per-sample norm covers every param the ghost model differentiates
            gs = torch.autograd.grad(loss * s, [params[n] for n in ghost_trainable])
            gs = [(g.float() if amp is not None else g) / s for g in gs]
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in gs))
            coef = torch.clamp(DP_C / (norm + 1e-6), max=1.0)
            for n, g in zip(ghost_trainable, gs, strict=True):
                if n in total:
                    total[n] += (coef * g).to(total[n].dtype)
            losses.append(loss.detach())
        finite = all(torch.isfinite(g).all() for g in total.values()) and bool(
            torch.isfinite(torch.stack(losses)).all())
        skipped.append(not finite)
        if not finite:
            scale /= 2
            continue
        for n in train:
            params[n].grad = total[n] / (DP_Q * DP_N)
        if cfg["sched"]:
            for group in opt.param_groups:
                group["lr"] = float(_sched(torch.tensor(t)))
        opt.step()
    return {n: p.detach() for n, p in params.items()}, skipped


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("feature", DP_FEATURES)
def test_dp(feature: str, kind: str, world) -> None:
    cfg = _setup(feature)
    net = _net(cfg["dtype"], freeze=cfg["freeze"], whole_layer=True)
    ghost, params, buffers = make_ghost_model(net)
    opt = _optimizer(cfg)
    trainable = cfg["trainable"] if cfg["trainable"] is not None else ghost.trainable
    state = _fp16_state(init_dp_state(params, buffers, opt, seed=0, trainable=trainable), cfg)
    kw = {"amp": cfg["amp"], "lr_schedule": _sched if cfg["sched"] else None}
    if cfg["trainable"] is not None:
        kw["trainable"] = cfg["trainable"]
    step = make_dp_train_step(ghost, _per_sample_loss, opt, noise_multiplier=0.0,
                              max_grad_norm=DP_C, sample_rate=DP_Q, dataset_size=DP_N, **kw)
    run = DistributedDPStep(step, group=world) if kind == "dist" else step
    batches = _batches(cfg)
    valid = torch.ones(8, dtype=torch.bool)
    metrics = []
    for x, y in batches:
        if cfg["accum"] > 1:  # two physical batches of one logical step
            parts = [step.clipped_sum(state, (x[i:i + 4], y[i:i + 4]), valid[:4])
                     for i in (0, 4)]
            state, m = run.apply(state, step.add(*parts))
        else:
            state, m = run(state, (x, y), valid)
        metrics.append(m)
    ref, skipped = _dp_reference(net, batches, cfg)
    for n, p in ref.items():
        torch.testing.assert_close(state.params[n], p, **_close_batched(cfg), msg=n)
        assert torch.isfinite(state.params[n]).all()
    _check_metrics(cfg, metrics, skipped)
    assert int(state.skipped) == sum(skipped)
    if feature in ("frozen", "trainable"):
        frozen = ["0.weight", "0.bias"] if feature == "frozen" else ["2.weight", "2.bias"]
        for n in frozen:
            assert torch.equal(state.params[n], params[n])
            assert n not in state.opt_state[0].mu


_SHARDED_REFUSED = {"frozen": r"make_dp_train_step\(ghost=\.\.\.\) .*frozen params",
                    "trainable": r"make_dp_train_step\(trainable=\.\.\.\)",
                    "bf16": r"make_dp_train_step\(amp=\.\.\.\) .*got 'bf16'",
                    "fp16": r"make_dp_train_step\(amp=\.\.\.\) .*got 'fp16'"}


def _sharded_dp_setup(feature: str, world) -> tuple:
    cfg = _setup(feature)
    net = _net(cfg["dtype"], freeze=cfg["freeze"], whole_layer=True)
    ghost, params, buffers = make_ghost_model(net)
    opt = _optimizer(cfg)
    kw = {"amp": cfg["amp"], "lr_schedule": _sched if cfg["sched"] else None}
    if cfg["trainable"] is not None:
        kw["trainable"] = cfg["trainable"]
    step = make_dp_train_step(ghost, _per_sample_loss, opt, noise_multiplier=0.0,
                              max_grad_norm=DP_C, sample_rate=DP_Q, dataset_size=DP_N, **kw)
    return cfg, net, params, buffers, opt, step, ShardLayout.from_params(params, group=world)


@pytest.mark.parametrize("kind", ["sharded"])
@pytest.mark.parametrize("feature", list(_SHARDED_REFUSED))
def test_dp_sharded_refuses(feature: str, kind: str, world) -> None:
    *_, step, layout = _sharded_dp_setup(feature, world)
    with pytest.raises(ValueError, match=_SHARDED_REFUSED[feature]):
        make_sharded_dp_train_step(step, layout)


@pytest.mark.parametrize("kind", ["sharded"])
@pytest.mark.parametrize("feature", [f for f in DP_FEATURES if f not in _SHARDED_REFUSED])
def test_dp_sharded(feature: str, kind: str, world) -> None:
    cfg, net, params, buffers, opt, step, layout = _sharded_dp_setup(feature, world)
    run = make_sharded_dp_train_step(step, layout)
    state = init_sharded_dp_state(params, buffers, opt, layout, seed=0)
    valid = torch.ones(8, dtype=torch.bool)
    metrics = []
    batches = _batches(cfg)
    for x, y in batches:
        if cfg["accum"] > 1:  # two physical batches of one logical step, on the full params
            full = state._replace(params=layout.gather(state.params))
            parts = [step.clipped_sum(full, (x[i:i + 4], y[i:i + 4]), valid[:4]) for i in (0, 4)]
            state, m = run.apply(state, step.add(*parts))
        else:
            state, m = run(state, (x, y), valid)
        metrics.append(m)
    ref, skipped = _dp_reference(net, batches, cfg)
    got = layout.gather(state.params)
    for n, p in ref.items():
        torch.testing.assert_close(got[n], p, **_close_batched(cfg), msg=n)
        assert torch.isfinite(got[n]).all()
    _check_metrics(cfg, metrics, skipped)
    assert int(state.skipped) == sum(skipped)


# -- optimizer type errors, every step kind ------------------------------------------------------


def _wrong_optimizers():
    p = [nn.Parameter(torch.zeros(2))]
    return [
        (torch.optim.Adam, r"torch\.optim\.Adam.*torchfn\.optim\.adam\(lr\)"),
        (torch.optim.SGD(p, lr=0.1), r"torch\.optim\.SGD.*torchopt\.sgd\(lr\)"),
        (torch.optim.AdamW(p), r"torch\.optim\.AdamW.*torchfn\.optim\.adamw\(lr\)"),
        (torchopt.Adam(p), r"torchopt\.Adam.*torchfn\.optim\.adam\(lr\)"),
        (torchopt.MetaSGD(nn.Linear(2, 2), lr=0.1), r"torchopt\.MetaSGD.*torchopt\.sgd\(lr\)"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_wrong_optimizer_type(case: int) -> None:
    bad, match = _wrong_optimizers()[case]
    model_fn, params, buffers = make_functional(_net(torch.float64))
    ens = Ensemble.from_modules([_net(torch.float64, seed=s) for s in range(2)])
    calls = {
        "make_train_step": lambda: make_train_step(model_fn, F.mse_loss, bad),
        "init_train_state": lambda: init_train_state(params, buffers, bad, seed=0),
        "make_ensemble_train_step": lambda: make_ensemble_train_step(ens.model_fn,
                                                                     F.mse_loss, bad),
        "init_ensemble_state": lambda: init_ensemble_state(ens, bad, seed=0),
    }
    calls.update(_more_wrong_optimizer_calls(bad))
    for where, call in calls.items():
        with pytest.raises(TypeError, match=re_where(where) + match):
            call()


def re_where(where: str) -> str:
    return where.replace("(", r"\(").replace(")", r"\)") + r".*"


def _more_wrong_optimizer_calls(bad) -> dict:
    model_fn, params, buffers = make_functional(_net(torch.float64))
    learner = maml(model_fn, F.mse_loss)
    ghost, _, _ = make_ghost_model(_net(torch.float64))
    return {
        "make_meta_train_step": lambda: make_meta_train_step(learner, bad),
        "init_meta_state": lambda: init_meta_state(learner, params, buffers, bad),
        "make_dp_train_step": lambda: make_dp_train_step(
            ghost, _per_sample_loss, bad, noise_multiplier=1.0, max_grad_norm=1.0,
            sample_rate=0.1, dataset_size=10),
        "init_dp_state": lambda: init_dp_state(params, buffers, bad, seed=0),
    }


# -- the core on its own ------------------------------------------------------------------------


def test_step_options_errors() -> None:
    with pytest.raises(ValueError, match=r"clip_value=...\): expected None or a number > 0"):
        StepOptions(clip_value=0.0)
    with pytest.raises(TypeError, match=r"trainable=...\): expected None, a callable"):
        StepOptions(trainable="0.weight")
    with pytest.raises(ValueError, match=r"names \['nope'\] are not params"):
        StepOptions(trainable=["nope"]).trainable_names(["w"])
    # a filter matching nothing (e.g. "head." where the head is tied to the embedding, so keyed
    # by the embedding's name) would train nothing without a word
    with pytest.raises(ValueError, match=r"the filter selects none of the params.*tied weight"):
        StepOptions(trainable=lambda n: n.startswith("head.")).trainable_names(["embed.weight"])


def test_apply_gradients_fp16_needs_loss_scale() -> None:
    opt = adamw(LR)
    state = init_train_state({"w": torch.ones(2)}, {}, opt, seed=0)
    with pytest.raises(ValueError, match="amp='fp16' needs a loss_scale"):
        apply_gradients(opt, {"w": torch.ones(2)}, state._replace(loss_scale=None),
                        options=StepOptions(amp="fp16"))


def test_compiled_train_step_with_new_features_does_not_recompile() -> None:
    torch._dynamo.reset()
    net = _net(torch.float32, freeze=True)
    model_fn, params, buffers = make_functional(net)
    opt = adamw(LR, weight_decay=WD)
    state = init_train_state(params, buffers, opt, seed=0, trainable=model_fn.trainable)
    step = make_train_step(model_fn, F.mse_loss, opt, clip_value=0.1, max_grad_norm=1.0,
                           grad_accum_steps=2, lr_schedule=LR)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    eager = state
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    x_nan = x.clone()
    x_nan[0, 0] = math.nan
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in [(x, y), (x_nan, y), (x, y)]:
            state, m = compiled(state, batch)
            eager, _ = step(eager, batch)
            torch.testing.assert_close(state.params, eager.params)
    assert int(state.skipped) == 1 and bool(m["skipped"]) is False
    assert torch.equal(state.params["0.weight"], params["0.weight"])


def _no_recompile(step, state, batches, extra=()):
    """Run ``step`` compiled (fullgraph) and eager on ``batches``; assert equal, no recompiles."""
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    eager = state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            state, m = compiled(state, batch, *extra)
            eager, _ = step(eager, batch, *extra)
            # eager ensembles take the autograd fast path, compiled ones vmap(grad): fp16 rounds
            torch.testing.assert_close(state.params, eager.params, rtol=1e-3, atol=1e-3)
    return state, m


def test_compiled_ensemble_meta_dp_steps_with_new_features_do_not_recompile() -> None:
    cfg = _setup("nonfinite") | {"dtype": torch.float32}
    # ensemble: frozen, fp16 loss scale, per-member clipping, accumulation, NaN in member 0
    ens = Ensemble.from_modules([_net(torch.float32, seed=s, freeze=True) for s in range(N)])
    opt = adamw(LR, weight_decay=WD)
    step = make_ensemble_train_step(ens.model_fn, F.mse_loss, opt, amp="fp16", clip_value=0.5,
                                    max_grad_norm=1.0, grad_accum_steps=2)
    batches = _batches(cfg, lead=(N,))
    # loss scale 2**8: far from fp16 overflow, so both gradient paths agree on what is finite
    state = init_ensemble_state(ens, opt, seed=0, loss_scale=2.0**8)
    state, m = _no_recompile(step, state, batches)
    assert state.skipped.tolist() == [1, 0]  # the NaN is in member 0's batch only
    assert torch.equal(state.params["0.weight"], ens.params["0.weight"])
    # meta: first-order MAML, task micro-batches, clipping, lr metric, a NaN task
    model_fn, params, buffers = make_functional(_net(torch.float32, freeze=True))
    learner = fomaml(model_fn, F.mse_loss, inner_lr=INNER_LR)
    step = make_meta_train_step(learner, opt, grad_accum_steps=2, max_grad_norm=1.0,
                                lr_schedule=LR)
    state, m = _no_recompile(step, init_meta_state(learner, params, buffers, opt), _tasks(cfg))
    assert int(state.skipped) == 1 and "lr" in m
    # DP: frozen layer (no noise, no update), lr metric, a NaN example skips the step
    ghost, params, buffers = make_ghost_model(_net(torch.float32, freeze=True, whole_layer=True))
    step = make_dp_train_step(ghost, _per_sample_loss, opt, noise_multiplier=1.0,
                              max_grad_norm=DP_C, sample_rate=DP_Q, dataset_size=DP_N,
                              lr_schedule=LR)
    state = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)
    state, m = _no_recompile(step, state, [(x[0], y[0]) for x, y in batches],
                             extra=(torch.ones(8, dtype=torch.bool),))
    assert int(state.skipped) == 1
    assert torch.equal(state.params["0.weight"], params["0.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("step_kind", ["train", "ensemble", "meta", "dp"])
def test_cuda_amp_step_compiled_equals_eager(step_kind: str, amp: str) -> None:
    """CUDA autocast in every step kind: Inductor-compiled == eager, frozen params untouched,
    a NaN batch skipped and counted (the CPU matrix checks the numbers against references)."""
    torch._dynamo.reset()
    cuda = torch.device("cuda")
    to_cuda = lambda tree: optree.tree_map(lambda t: t.to(cuda), tree)  # noqa: E731
    cfg = _setup("nonfinite") | {"dtype": torch.float32}
    opt = adamw(LR, weight_decay=WD)
    kw = {"amp": amp, "max_grad_norm": 1.0}
    extra: tuple = ()
    if step_kind == "train":
        model_fn, params, buffers = make_functional(_net(torch.float32, freeze=True).to(cuda))
        step = make_train_step(model_fn, F.mse_loss, opt, grad_accum_steps=2, **kw)
        state = init_train_state(params, buffers, opt, seed=0, trainable=model_fn.trainable,
                                 loss_scale=2.0**8)
        batches, frozen = to_cuda(_batches(cfg)), params["0.weight"]
    elif step_kind == "ensemble":
        ens = Ensemble.from_modules([_net(torch.float32, seed=s, freeze=True).to(cuda)
                                     for s in range(N)])
        step = make_ensemble_train_step(ens.model_fn, F.mse_loss, opt, grad_accum_steps=2, **kw)
        state = init_ensemble_state(ens, opt, seed=0, loss_scale=2.0**8)
        batches, frozen = to_cuda(_batches(cfg, lead=(N,))), ens.params["0.weight"]
    elif step_kind == "meta":
        model_fn, params, buffers = make_functional(_net(torch.float32, freeze=True).to(cuda))
        learner = fomaml(model_fn, F.mse_loss, inner_lr=INNER_LR)
        step = make_meta_train_step(learner, opt, **kw)
        state = init_meta_state(learner, params, buffers, opt, loss_scale=2.0**8)
        batches, frozen = to_cuda(_tasks(cfg)), params["0.weight"]
    else:
        ghost, params, buffers = make_ghost_model(
            _net(torch.float32, freeze=True, whole_layer=True).to(cuda))
        step = make_dp_train_step(ghost, _per_sample_loss, opt, noise_multiplier=1.0,
                                  max_grad_norm=DP_C, sample_rate=DP_Q, dataset_size=DP_N,
                                  amp=amp)
        state = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable,
                              loss_scale=2.0**8)
        batches = to_cuda([(x[0], y[0]) for x, y in _batches(cfg, lead=(N,))])
        frozen, extra = params["0.weight"], (torch.ones(8, dtype=torch.bool, device=cuda),)
    compiled = torch.compile(step, fullgraph=True)
    eager = state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            state, _ = compiled(state, batch, *extra)
            eager, _ = step(eager, batch, *extra)
            torch.testing.assert_close(state.params, eager.params, rtol=2e-2, atol=2e-3)
    skipped = state.skipped.tolist()
    assert skipped == ([1, 0] if step_kind == "ensemble" else 1), skipped
    assert torch.equal(state.params["0.weight"], frozen)
    for k, v in state.params.items():
        assert torch.isfinite(v).all(), k


def test_a_module_or_another_steps_state_is_refused_by_name() -> None:
    """An nn.Module as model_fn, or a DPState given to a train step (and the reverse), get
    errors naming the argument and the fix (they failed inside the call: "forward() takes 2
    positional arguments but 4 were given", a bare AttributeError)."""
    net = nn.Linear(3, 2)
    for build in (lambda: make_train_step(net, F.mse_loss, adamw(LR)),
                  lambda: make_ensemble_train_step(net, F.mse_loss, adamw(LR)),
                  lambda: maml(net, F.mse_loss)):
        with pytest.raises(TypeError, match=r"model_fn=...\): got the nn.Module Linear.*"
                           r"make_functional\(module\)"):
            build()
    model_fn, params, buffers = make_functional(net)
    ghost, gp, gb = make_ghost_model(net)
    dp_state = init_dp_state(gp, gb, adamw(LR), seed=0)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(TypeError, match=r"expected state to be a TrainState .*init_train_state"
                       r".*got DPState"):
        make_train_step(model_fn, F.mse_loss, adamw(LR))(dp_state, (x, y))
    dp = make_dp_train_step(ghost, lambda o, t: ((o - t) ** 2).mean(1), adamw(LR),
                            max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1,
                            dataset_size=40)
    with pytest.raises(TypeError, match=r"expected state to be a DPState .*got TrainState"):
        dp(init_train_state(params, buffers, adamw(LR), seed=0), (x, y),
           torch.ones(4, dtype=torch.bool))


def test_another_optimizers_state_is_refused_by_name() -> None:
    """A state built with one optimizer, stepped with another (a switch from SGD to AdamW
    mid-experiment): torchopt's own message was "The number of updates and states has to be
    the same in chain!"; the step now names both states and the fix -- train, ensemble and DP
    steps (they share apply_gradients)."""
    model_fn, params, buffers = make_functional(nn.Linear(3, 2))
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    want = r"opt_state is not this optimizer's state: it holds \(EmptyState\).*builds \(Scale"
    with pytest.raises(ValueError, match=want):
        make_train_step(model_fn, F.mse_loss, adamw(LR))(
            init_train_state(params, buffers, torchopt.sgd(0.1), seed=0), (x, y))
    ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=range(2))
    with pytest.raises(ValueError, match=want):
        make_ensemble_train_step(ens.model_fn, F.mse_loss, adamw(LR))(
            init_ensemble_state(ens, torchopt.sgd(0.1), seed=0),
            (torch.randn(2, 4, 3), torch.randn(2, 4, 2)))
    ghost, gp, gb = make_ghost_model(nn.Linear(3, 2))
    dp = make_dp_train_step(ghost, lambda o, t: ((o - t) ** 2).mean(1), adamw(LR),
                            max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1,
                            dataset_size=40)
    with pytest.raises(ValueError, match=want):
        dp(init_dp_state(gp, gb, torchopt.sgd(0.1), seed=0), (x, y),
           torch.ones(4, dtype=torch.bool))
    # the right state still steps; an optimizer's own error on its own state passes through
    state = init_train_state(params, buffers, adamw(LR), seed=0)
    make_train_step(model_fn, F.mse_loss, adamw(LR))(state, (x, y))

    def refuse(updates, state, *, params=None, inplace=True):
        raise ValueError("this optimizer refuses")

    picky = torchopt.base.GradientTransformation(adamw(LR).init, refuse)
    with pytest.raises(ValueError, match=r"^this optimizer refuses$"):
        make_train_step(model_fn, F.mse_loss, picky)(state, (x, y))


def test_amp_on_a_float64_model_is_refused() -> None:
    """autocast leaves float64 alone: amp= on a float64 model changed nothing, silently."""
    model_fn, params, buffers = make_functional(nn.Linear(3, 2).double())
    step = make_train_step(model_fn, F.mse_loss, adamw(LR), amp="bf16")
    state = init_train_state(params, buffers, adamw(LR), seed=0)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"amp='bf16' with float64 params.*module.float\(\)"):
        step(state, (x, y))
