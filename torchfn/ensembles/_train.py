"""Train all members of an ensemble in one pure step: vmapped loss and grad, one stacked update.

The state is a :class:`torchfn.functional.TrainState` whose params, buffers and optimizer state
are stacked ``(N, ...)``, so checkpoints, :func:`torchfn.functional.step_rng` and
``torch.compile`` work as for one model.

Randomness (dropout): the step runs the members under ``vmap(randomness=...)``. With
``"different"`` every member draws its own masks from the global generator; in eager mode the
step seeds that generator from ``(state.seed, state.step)`` inside a fork
(:func:`torchfn.functional.step_rng`), so a step is reproducible and a resumed run repeats it
bitwise. A compiled step cannot seed a generator: call it inside ``with step_rng(state):``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchopt.base import GradientTransformation
from torchopt.typing import Schedule

from torchfn._checks import (
    STEP_INDUCTOR_OPTIONS,
    _call_model,
    _call_translated,
    _part,
    _replace,
    check_model_fn,
)
from torchfn.ensembles._build import _RANDOMNESS, Ensemble, _fmt, n_members
from torchfn.functional import (
    DynamicLossScaler,
    LossScaleState,
    StepOptions,
    TrainState,
    apply_gradients,
    check_optimizer,
    init_train_state,
    split_batch,
    step_rng,
)
from torchfn.ops import functorch_stack

__all__ = [
    "init_ensemble_state",
    "make_ensemble_train_step",
    "member_batches",
    "member_orders",
]

Batch = tuple[Any, Any]


def init_ensemble_state(ensemble: Ensemble, optimizer: GradientTransformation, *,
                        seed: int, loss_scale: float = 2.0**16,
                        trainable: Callable[[str], bool] | Sequence[str] | None = None
                        ) -> TrainState:
    """Return the initial stacked :class:`TrainState` of ``ensemble`` for ``optimizer``.

    ``optimizer`` works on stacked ``(N, ...)`` leaves: :func:`torchfn.ops.stacked_adam` /
    :func:`torchfn.ops.stacked_sgd` (per-member ``(N,)`` lr and weight decay),
    :func:`per_member_adam` / :func:`per_member_sgd` (also per-member betas, eps, momentum,
    dampening), an elementwise torchopt transformation with shared hyperparameters, or
    :func:`per_member_optimizer`.
    ``seed`` seeds the step randomness (dropout), see :func:`make_ensemble_train_step`.
    The optimizer state covers the trained params only: ``trainable`` (callable or names), by
    default ``ensemble.trainable`` (the modules' ``requires_grad=False`` params are frozen).
    ``loss_scale`` (fp16 only) and the ``skipped`` count are ``(N,)``, one per member.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn.ensembles import Ensemble, init_ensemble_state
        >>> from torchfn.optim import stacked_adam
        >>> ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=range(4))
        >>> state = init_ensemble_state(ens, stacked_adam(lr=torch.full((4,), 1e-3)), seed=0)
        >>> state.opt_state.mu["weight"].shape
        torch.Size([4, 2, 3])
    """
    check_optimizer(optimizer, "init_ensemble_state")
    state = init_train_state(ensemble.params, ensemble.buffers, optimizer, seed=seed,
                             loss_scale=loss_scale,
                             trainable=ensemble.trainable if trainable is None else trainable)
    n = ensemble.n_members
    scale = state.loss_scale
    return _replace(state,
                    loss_scale=LossScaleState(scale=scale.scale.expand(n).clone(),
                                              growth_tracker=scale.growth_tracker.expand(n).clone()),
                    skipped=state.skipped.expand(n).clone())


def _check_batch(where: str, batch: Any, n: int, shared: bool) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"{where}: batch must be a pair (inputs, targets), got "
                        f"{type(batch).__name__}")
    x, y = batch
    if not shared and not (isinstance(x, Tensor) and isinstance(y, Tensor) and x.ndim > 0
                           and y.ndim > 0 and x.shape[0] == n and y.shape[0] == n):
        paths, leaves, _ = optree.tree_flatten_with_path((x, y))
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf, Tensor) and (leaf.ndim == 0 or leaf.shape[0] != n):
                name = ("inputs", "targets")[path[0]] + "".join(f"[{p!r}]" for p in path[1:])
                raise ValueError(
                    f"{where}: with shared_batch=False every batch tensor must have the N={n} "
                    f"members along dim 0, shape ({n}, B, ...); got {_fmt(leaf.shape)} for "
                    f"{name}. Use member_batches(...) to build per-member batches, or "
                    "shared_batch=True to give every member the same batch (B, ...)"
                )
    return x, y


def make_ensemble_train_step(
    model_fn: Callable[..., tuple[Any, dict[str, Tensor]]],
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: GradientTransformation,
    *,
    shared_batch: bool = False,
    randomness: str = "error",
    chunk_size: int | None = None,
    seed_rng: bool = True,
    grad_norm: bool = True,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_value: float | None = None,
    amp: str | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    lr_schedule: float | Schedule | None = None,
    trainable: Callable[[str], bool] | Sequence[str] | None = None,
    skip_nonfinite: bool = True,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Tensor]]]:
    """Return a pure ``step(state, batch) -> (new_state, metrics)`` training all N members.

    ``state`` comes from :func:`init_ensemble_state` (every leaf ``(N, ...)``);
    ``batch = (inputs, targets)``, by default one batch per member, every tensor
    ``(N, B, ...)``; with ``shared_batch=True`` all members see the same ``(B, ...)``. Per
    member: ``outputs, new_buffers = model_fn(params, buffers, inputs)`` (a dict of inputs
    goes in as keywords, ``model_fn(params, buffers, **inputs)``, Hugging Face style),
    ``loss = loss_fn(outputs, targets)`` (0-d), its gradient (``vmap`` of ``grad``, members in
    chunks of ``chunk_size`` if given; an eager unchunked step outside other ``torch.func``
    transforms vmaps only the forward and runs one plain backward of the summed losses: the
    same numbers, less overhead); then ONE ``optimizer.update`` over the stacked
    gradients -- :func:`torchfn.ops.stacked_adam` / :func:`torchfn.ops.stacked_sgd` give every
    member its own lr and weight decay as ``(N,)`` tensors. ``randomness`` is ``vmap``'s
    (``"error"``, ``"different"``: per-member dropout masks, ``"same"``); ``seed_rng`` seeds
    eager steps from ``(state.seed, state.step)`` (module docstring).

    The shared step features (:class:`torchfn.functional.StepOptions`, applied by
    :func:`torchfn.functional.apply_gradients`) work per member, on the member axis dim 0:
    ``trainable`` (default: every param but ``model_fn.frozen``; frozen params get no
    gradient and never change), ``grad_accum_steps`` (micro-batches along every member's
    batch dim, gradients averaged: the whole batch's for a per-sample mean loss; token means
    with padding need the normalisation :func:`torchfn.functional.make_train_step` describes),
    ``max_grad_norm`` (each member clipped by its own global
    norm), ``clip_value``, ``amp`` (``'bf16'``, or ``'fp16'`` with a per-member dynamic loss
    scale), ``lr_schedule`` (``metrics["lr"]``) and ``skip_nonfinite`` (default on: a member
    whose loss or gradients are not finite keeps its params, buffers and optimizer state;
    ``metrics["skipped"]`` and ``state.skipped`` are ``(N,)``; an optimizer state shared by
    the members, e.g. a stacked optimizer's step count, advances if any member does).

    ``metrics``: ``loss``, ``skipped`` and (unless ``grad_norm=False``) ``grad_norm``, all
    ``(N,)``. The non-finite guard and the norms share one read of every gradient (a float64
    norm per member is finite exactly when all its elements are); with ``skip_nonfinite=False``
    and ``grad_norm=False`` that read goes too, and the optimizer can follow the backward
    directly: on sub-millisecond GPU steps that pass is measurable (``benchmarks/README.md``:
    the sweep's SGD ensembles). No host syncs: ``torch.compile(step, fullgraph=True)`` traces
    once and does not recompile across steps. For the fastest GPU steps use
    :func:`torchfn.functional.make_graphed_step` (compiled, one CUDA graph, state updated in
    place). With
    ``mode="reduce-overhead"`` instead, the returned tensors live in the graphs' memory pool,
    which the next call reuses, yet they are the next call's inputs: clone the state after each
    call (``state = optree.tree_map(torch.clone, state)``, kept metrics too) and keep
    ``state.step``/``state.seed`` on the GPU (an op on the CPU keeps the graph out of CUDA
    graphs).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn.ensembles import (Ensemble, init_ensemble_state,
        ...                                make_ensemble_train_step)
        >>> from torchfn.optim import stacked_sgd
        >>> ens = Ensemble.from_seeds(lambda: nn.Linear(3, 1), seeds=range(2))
        >>> opt = stacked_sgd(lr=torch.tensor([0.1, 0.01]))
        >>> state = init_ensemble_state(ens, opt, seed=0)
        >>> step = make_ensemble_train_step(ens.model_fn, nn.functional.mse_loss, opt)
        >>> state, metrics = step(state, (torch.randn(2, 8, 3), torch.randn(2, 8, 1)))
        >>> metrics["loss"].shape
        torch.Size([2])
    """
    where = "ensemble train step(state, batch)"
    check_model_fn(model_fn, "make_ensemble_train_step")
    check_optimizer(optimizer, "make_ensemble_train_step")
    if randomness not in _RANDOMNESS:
        raise ValueError(f"make_ensemble_train_step(randomness=...): expected one of "
                         f"{_RANDOMNESS}, got {randomness!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"make_ensemble_train_step(chunk_size=...): expected None or an int "
                         f">= 1, got {chunk_size!r}")
    options = StepOptions(trainable=trainable, amp=amp, loss_scaler=loss_scaler,
                          grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
                          clip_value=clip_value, lr_schedule=lr_schedule,
                          skip_nonfinite=skip_nonfinite, where="make_ensemble_train_step")
    frozen = tuple(getattr(model_fn, "frozen", ()))
    k = grad_accum_steps
    batch_dim = None if shared_batch else 0

    def checked_loss(outputs: Any, y: Any) -> Tensor:
        loss = loss_fn(outputs, y)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise ValueError(f"{where}: loss_fn(outputs, targets) must return a 0-d tensor "
                             "per member; reduce it, e.g. with .mean()")
        if amp is not None:
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        return loss

    def member_grad(params: dict[str, Tensor], fixed: dict[str, Tensor],
                    buffers: dict[str, Tensor], x: Any, y: Any, scale: Tensor
                    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        def objective(p: dict[str, Tensor]) -> tuple[Tensor, tuple[Tensor, dict[str, Tensor]]]:
            with options.autocast(_device_type(p, fixed)):
                outputs, new_buffers = _call_model(model_fn, {**fixed, **p}, buffers, x, where)
                loss = checked_loss(outputs, y)
            return loss * scale, (loss, new_buffers)

        grads, (_, (loss, new_buffers)) = torch.func.grad_and_value(objective, has_aux=True)(
            params)
        return grads, loss, new_buffers

    vmapped = torch.func.vmap(member_grad, in_dims=(0, 0, 0, batch_dim, batch_dim, 0),
                              randomness=randomness, chunk_size=chunk_size)

    def member_loss(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Any,
                    y: Any) -> tuple[Tensor, dict[str, Tensor]]:
        outputs, new_buffers = _call_model(model_fn, params, buffers, x, where)
        return checked_loss(outputs, y), new_buffers

    vmapped_loss = torch.func.vmap(member_loss, in_dims=(0, 0, batch_dim, batch_dim),
                                   randomness=randomness)

    def autograd_grads(params: dict[str, Tensor], fixed: dict[str, Tensor],
                       buffers: dict[str, Tensor], x: Any, y: Any, scale: Tensor
                       ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        # Eager fast path: vmap only the forward and let plain autograd run one backward of
        # the summed member losses (member n's loss depends on member n's slice only, so the
        # gradient of the sum is every member's own gradient). Same numbers as vmap(grad),
        # less Python overhead per step (no functorch grad level to wrap and unwrap).
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            # attention through the math kernel: the fused CUDA kernels' backward cannot take
            # the batched layout vmap leaves on their saved tensors ("LSE is not correctly
            # aligned"), and the CPU flash kernel has no batching rule (a per-member loop)
            with (options.autocast(_device_type(params, fixed)),
                  sdpa_kernel(SDPBackend.MATH)):
                losses, new_buffers = vmapped_loss({**fixed, **leaves}, buffers, x, y)
            gs = torch.autograd.grad((losses * scale).sum(), list(leaves.values()),
                                     allow_unused=True)
        # a weight's gradient comes back transposed (x^T g) from the batched matmul's
        # backward: one contiguous copy here instead of one in every consumer
        grads = {k: torch.zeros_like(v) if g is None else g.contiguous()
                 for (k, v), g in zip(leaves.items(), gs, strict=True)}
        return grads, losses.detach(), {k: v.detach() for k, v in new_buffers.items()}

    def plain_autograd_ok(params: dict[str, Tensor]) -> bool:
        """True where the eager fast path gives what vmap(grad) gives: eager, unchunked, no
        enclosing torch.func transform, no autograd graph through the params to keep."""
        return (chunk_size is None and not torch.compiler.is_compiling()
                and not torch.is_inference_mode_enabled() and not functorch_stack()
                and not any(v.requires_grad for v in params.values()))

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Tensor]]:
        n = n_members(state.params, where)
        x, y = _check_batch(where, batch, n, shared_batch)
        names = options.trainable_names(state.params, frozen)
        train = {k: state.params[k] for k in names}
        fixed = {k: v.detach() for k, v in state.params.items() if k not in train}
        device = _first(state.params).device
        if options.fp16:
            scale = state.loss_scale.scale.expand(n)
        else:
            scale = torch.ones(n, dtype=torch.float32, device=device)
        micro = split_batch((x, y), k, where, dim=0 if shared_batch else 1)
        # randomness="error" refuses random ops, so there is nothing to seed (and no need to
        # save/restore the generators every step)
        use_rng = seed_rng and randomness != "error" and not torch.compiler.is_compiling()
        grads: dict[str, Tensor] | None = None
        losses: list[Tensor] = []
        buffers = state.buffers
        with step_rng(state) if use_rng else contextlib.nullcontext():
            grad_fn = autograd_grads if plain_autograd_ok(state.params) else vmapped
            for mx, my in micro:
                with _part("torchfn.forward_backward"):
                    g, loss, buffers = _call_translated(where, grad_fn, train, fixed, buffers,
                                                        mx, my, scale)
                grads = g if grads is None else {kk: grads[kk] + g[kk] for kk in grads}
                losses.append(loss)
        assert grads is not None
        loss = losses[0] if k == 1 else torch.stack(losses).mean(0)
        if k > 1:
            grads = {kk: v / k for kk, v in grads.items()}
        with _part("torchfn.apply_gradients"):
            new_state, metrics = apply_gradients(optimizer, grads, state, options=options,
                                                 trainable=names, loss=loss, buffers=buffers,
                                                 per_member=True, where=where)
        if not grad_norm:
            del metrics["grad_norm"]
        return new_state, metrics

    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step


def _first(tree: dict[str, Tensor]) -> Tensor:
    return next(iter(tree.values()))


def _device_type(*trees: dict[str, Tensor]) -> str:
    for tree in trees:
        for v in tree.values():
            return v.device.type
    return "cpu"


def member_orders(n_samples: int, seeds: Sequence[int], *, epoch: int = 0,
                  bootstrap: bool = False) -> Tensor:
    """Return per-member sample orders, int64 ``(N, n_samples)``, one row per seed.

    Row ``n`` is a permutation of ``range(n_samples)`` (``bootstrap=False``) or
    ``n_samples`` draws with replacement (``bootstrap=True``), from a ``torch.Generator``
    seeded with ``seeds[n] * 1_000_003 + epoch``: explicit, reproducible, a new order per
    epoch. Feed it to :func:`member_batches`.

    Example:
        >>> from torchfn.ensembles import member_orders
        >>> member_orders(5, seeds=[0, 1]).shape
        torch.Size([2, 5])
    """
    if n_samples < 1 or not seeds:
        raise ValueError(f"member_orders(n_samples={n_samples}, seeds=...): expected "
                         "n_samples >= 1 and at least one seed")
    rows = []
    for s in seeds:
        g = torch.Generator().manual_seed(int(s) * 1_000_003 + int(epoch))
        rows.append(torch.randint(n_samples, (n_samples,), generator=g) if bootstrap
                    else torch.randperm(n_samples, generator=g))
    return torch.stack(rows)


def member_batches(tensors: Sequence[Tensor], orders: Tensor, batch_size: int, *,
                   drop_last: bool = True) -> Iterator[tuple[Tensor, ...]]:
    """Yield tuples of per-member batches ``(N, batch_size, ...)``, one per tensor given.

    ``tensors`` share dim 0 (the samples); ``orders`` is ``(N, n_samples)`` from
    :func:`member_orders`; batch ``i`` of member ``n`` is
    ``t[orders[n, i*batch_size:(i+1)*batch_size]]``. ``drop_last`` drops a final short batch.

    Example:
        >>> import torch
        >>> from torchfn.ensembles import member_batches, member_orders
        >>> x, y = torch.randn(10, 3), torch.arange(10)
        >>> xb, yb = next(member_batches((x, y), member_orders(10, seeds=[0, 1, 2]), 4))
        >>> xb.shape, yb.shape
        (torch.Size([3, 4, 3]), torch.Size([3, 4]))
    """
    if orders.ndim != 2:
        raise ValueError(f"member_batches(orders=...): expected (N, n_samples), got "
                         f"{_fmt(orders.shape)}")
    for i, t in enumerate(tensors):
        if t.shape[0] <= int(orders.max()):
            raise ValueError(f"member_batches(tensors[{i}]): has {t.shape[0]} samples, but "
                             f"orders index sample {int(orders.max())}")
    total = orders.shape[1]
    stop = total - total % batch_size if drop_last else total
    for start in range(0, stop, batch_size):
        idx = orders[:, start:start + batch_size]
        yield tuple(t[idx.to(t.device)] for t in tensors)
