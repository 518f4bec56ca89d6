"""A pure, compile-friendly training step over an explicit ``TrainState``.

``step(state, batch) -> (new_state, metrics)`` does gradient accumulation over micro-batches,
global-norm clipping, bf16/fp16 autocast with a dynamic loss scale kept in the state, and one
torchopt update, with no ``.item()`` and no data-dependent Python branching, so
``torch.compile(step, fullgraph=True)`` traces it once and never recompiles as ``state.step``
advances (it is a tensor).

Randomness: ``TrainState`` holds an int64 ``seed``; each step's randomness (dropout) is drawn
from the global generators re-seeded with ``derive(seed, step)`` inside a fork that restores them
afterwards (:func:`step_rng`). ``step`` and ``seed`` stay on the CPU, so reading them is no
device sync. In eager mode the step does this itself, so a run resumed from a checkpoint
reproduces dropout bitwise. A graph cannot seed a generator, so under ``torch.compile`` the
step leaves the generators alone: call the compiled step inside ``with step_rng(state):`` and
compiled runs are reproducible and resumable too (bitwise against the same compiled code; the
compiled random stream differs from the eager one -- Inductor draws its own seeds from the
seeded generator).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation
from torchopt.typing import OptState, Schedule
from torchopt.update import apply_updates

__all__ = [
    "DynamicLossScaler",
    "LossScaleState",
    "TrainState",
    "init_train_state",
    "make_train_step",
    "step_rng",
]

Tensor = torch.Tensor
TensorDict = dict[str, Tensor]
ModelFn = Callable[[TensorDict, TensorDict, Any], tuple[Any, TensorDict]]
LossFn = Callable[[Any, Any], Tensor]
Batch = tuple[Any, Any]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", dict[str, Tensor]]]

_MASK64 = (1 << 64) - 1
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleState(NamedTuple):
    """Dynamic loss-scale state: ``scale`` (float32 0-d) and ``growth_tracker`` (int64 0-d).

    ``growth_tracker`` counts consecutive finite-gradient steps since the scale last changed.
    """

    scale: Tensor
    growth_tracker: Tensor


class TrainState(NamedTuple):
    """Everything a training run carries from step to step, as tensors (a pytree).

    Fields:
        params: ``dict[str, Tensor]`` keyed like ``named_parameters()``.
        buffers: ``dict[str, Tensor]`` keyed like ``named_buffers()`` (BatchNorm stats, ...).
        opt_state: the torchopt optimizer state (``optimizer.init(params)``).
        step: int64 0-d CPU tensor, the number of steps taken (skipped fp16 steps included).
        seed: int64 0-d CPU tensor; step ``t``'s randomness comes from ``derive(seed, t)``.
        loss_scale: :class:`LossScaleState`, used by ``amp='fp16'`` only.
    """

    params: TensorDict
    buffers: TensorDict
    opt_state: OptState
    step: Tensor
    seed: Tensor
    loss_scale: LossScaleState


@dataclasses.dataclass(frozen=True)
class DynamicLossScaler:
    """Settings of the fp16 dynamic loss scale (the state lives in ``TrainState.loss_scale``).

    On a step with inf/nan gradients the update is skipped and the scale is multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive finite steps it is multiplied by
    ``growth_factor`` -- the rule of ``torch.amp.GradScaler``.

    Example:
        >>> from torchfn.functional import DynamicLossScaler
        >>> DynamicLossScaler(growth_interval=100).growth_factor
        2.0
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.growth_factor > 1.0:
            raise ValueError(
                f"DynamicLossScaler(growth_factor=...): expected > 1, got {self.growth_factor!r}"
            )
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                "DynamicLossScaler(backoff_factor=...): expected in (0, 1), "
                f"got {self.backoff_factor!r}"
            )
        if not (isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(
                "DynamicLossScaler(growth_interval=...): expected an int >= 1, "
                f"got {self.growth_interval!r}"
            )


def _first_device(tree: Any) -> torch.device:
    leaves = optree.tree_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def init_train_state(
    params: TensorDict,
    buffers: TensorDict,
    optimizer: GradientTransformation,
    *,
    seed: int | Tensor,
    loss_scale: float = 2.0**16,
) -> TrainState:
    """Return the initial :class:`TrainState` (``step`` = 0) for ``params``/``buffers``.

    Params and buffers are detached (the step's out-of-place updates must not chain autograd
    graphs across steps). ``seed`` is an int in ``[0, 2**63)`` or an int64 0-d tensor.
    ``loss_scale`` is the initial fp16 loss scale (ignored unless the step uses ``amp='fp16'``).

    Example:
        >>> import torch
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state
        >>> params = {"weight": torch.zeros(2, 3)}
        >>> state = init_train_state(params, {}, adam(1e-3), seed=0)
        >>> state.step
        tensor(0)
    """
    if not isinstance(params, dict) or not isinstance(buffers, dict):
        raise TypeError(
            "init_train_state(params, buffers, ...): expected two dict[str, Tensor], got "
            f"{type(params).__name__} and {type(buffers).__name__}"
        )
    if isinstance(seed, Tensor):
        if seed.numel() != 1 or seed.is_floating_point() or seed.is_complex():
            raise ValueError(
                f"init_train_state(seed=...): expected an integer 0-d tensor, got dtype "
                f"{seed.dtype} and shape {tuple(seed.shape)}"
            )
        seed = int(seed)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"init_train_state(seed=...): expected an int in [0, 2**63), got {seed!r}")
    if not loss_scale > 0.0:
        raise ValueError(f"init_train_state(loss_scale=...): expected > 0, got {loss_scale!r}")
    params = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.detach() for k, v in buffers.items()}
    device = _first_device(params)
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(params),
        step=torch.zeros((), dtype=torch.int64),
        seed=torch.tensor(seed, dtype=torch.int64),
        loss_scale=LossScaleState(
            scale=torch.tensor(loss_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int64, device=device),
        ),
    )


def _derive_seed(seed: int, step: int) -> int:
    """Return a 63-bit seed mixing ``seed`` and ``step`` (splitmix64 finalizer)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@contextlib.contextmanager
def step_rng(state: TrainState) -> Iterator[int]:
    """Return a context in which the CPU and the params' CUDA generators are seeded for this step.

    Inside, the generators are seeded with ``derive(state.seed, state.step)`` (yielded, an int);
    on exit their previous states are restored, so the global random stream outside is
    untouched. The eager train step enters it itself; wrap a *compiled* step in it::

        compiled = torch.compile(make_train_step(...), fullgraph=True)
        with step_rng(state):
            state, metrics = compiled(state, batch)

    Example:
        >>> import torch
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state, step_rng
        >>> state = init_train_state({"w": torch.zeros(2)}, {}, adam(), seed=3)
        >>> with step_rng(state):
        ...     a = torch.rand(2)
        >>> with step_rng(state):
        ...     b = torch.rand(2)
        >>> torch.equal(a, b)
        True
    """
    derived = _derive_seed(int(state.seed), int(state.step))
    cuda_indices = sorted(
        {
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in optree.tree_leaves((state.params, state.buffers))
            if t.device.type == "cuda"
        }
    )
    gens = [torch.default_generator]
    gens += [torch.cuda.default_generators[i] for i in cuda_indices]
    saved = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(derived)
        yield derived
    finally:
        for g, s in zip(gens, saved, strict=True):
            g.set_state(s)


def _split_batch(inputs: Any, targets: Any, k: int) -> list[tuple[Any, Any]]:
    """Return ``k`` equal micro-batches of ``(inputs, targets)`` split along dim 0."""
    if k == 1:
        return [(inputs, targets)]
    leaves, spec = optree.tree_flatten((inputs, targets))
    sizes = set()
    for leaf in leaves:
        if not isinstance(leaf, Tensor) or leaf.ndim == 0:
            raise TypeError(
                f"train step with grad_accum_steps={k}: every leaf of (inputs, targets) must be "
                f"a tensor with a batch dim 0 to split, got {type(leaf).__name__}"
                + (f" of shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else "")
            )
        sizes.add(leaf.shape[0])
    if len(sizes) != 1:
        raise ValueError(
            f"train step with grad_accum_steps={k}: inputs and targets must share the batch "
            f"size (dim 0), got sizes {sorted(sizes)}"
        )
    (batch_size,) = sizes
    if batch_size % k != 0:
        raise ValueError(
            f"train step: batch size {batch_size} is not divisible by grad_accum_steps={k}; "
            f"use a batch size that is a multiple of {k}"
        )
    micro = batch_size // k
    parts = [leaf.split(micro) for leaf in leaves]
    return [spec.unflatten([p[i] for p in parts]) for i in range(k)]


def _global_norm(leaves: list[Tensor]) -> Tensor:
    """Return the L2 norm of all ``leaves`` together, like ``clip_grad_norm_``'s total norm."""
    if not leaves:
        return torch.zeros(())
    dtype = torch.promote_types(leaves[0].dtype, torch.float32)
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    norms = [torch.linalg.vector_norm(g).to(dtype) for g in leaves]
    return torch.linalg.vector_norm(torch.stack(norms))


def _check_batch(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        what = (
            f"{type(batch).__name__} of length {len(batch)}"
            if isinstance(batch, (tuple, list))
            else type(batch).__name__
        )
        raise TypeError(
            f"train step(state, batch): batch must be a pair (inputs, targets), got {what}"
        )
    return batch[0], batch[1]


def make_train_step(
    model_fn: ModelFn,
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    *,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    amp: str | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    lr_schedule: float | Schedule | None = None,
    seed_rng: bool = True,
    grad_transform: Callable[[TensorDict], TensorDict] | None = None,
) -> StepFn:
    """Return a pure ``step(state, batch) -> (new_state, metrics)`` for one optimizer update.

    ``batch = (inputs, targets)``; ``outputs, new_buffers = model_fn(params, buffers, inputs)``
    and ``loss = loss_fn(outputs, targets)`` (a 0-d tensor, mean-reduced). ``inputs`` and
    ``targets`` are tensors or pytrees of tensors with batch dim 0 of size ``B``.

    - ``grad_accum_steps=k`` splits the batch into ``k`` micro-batches of ``B // k`` (``B`` must
      be divisible by ``k``) and averages their gradients, so for a mean-reduced loss the update
      equals one step on the whole batch; buffers thread through the micro-batches in order.
    - ``max_grad_norm`` clips the averaged gradients to that global L2 norm
      (``torch.nn.utils.clip_grad_norm_``'s rule).
    - ``amp='bf16'`` runs model and loss under ``torch.autocast`` (device type of the params) in
      bfloat16. ``amp='fp16'`` uses float16 with a dynamic loss scale (``loss_scaler`` settings,
      state in ``state.loss_scale``): on inf/nan gradients params, buffers and optimizer state
      keep their old values through ``torch.where`` (no host sync) and the scale backs off.
      Unlike ``torch.amp.GradScaler``, a skipped step also drops the forward's buffer updates, so
      a non-finite forward cannot poison BatchNorm running stats.
    - ``lr_schedule`` (optional, the float or schedule given to the optimizer) adds
      ``metrics["lr"]``, evaluated at ``state.step``.
    - ``seed_rng`` (eager only): seed this step's randomness from ``(state.seed, state.step)``
      (:func:`step_rng`); pass ``False`` to use the global generators as they are (e.g. under
      ``vmap`` over states).
    - ``grad_transform`` (optional) maps the averaged gradient dict to a new dict with the same
      keys and shapes before fp16 unscaling, clipping and the update; it must be pure, as the
      compiled step traces it. :func:`torchfn.distributed.make_data_parallel_train_step` uses
      it to average the gradients across ranks, so ``grad_norm`` and clipping see the global
      gradient.

    ``metrics`` holds 0-d tensors: ``loss`` (mean over micro-batches), ``grad_norm`` (global
    norm before clipping), ``lr`` if asked, and for fp16 ``loss_scale`` (after this step) and
    ``skipped`` (bool).

    CUDA graphs: :func:`make_graphed_step` captures the step as one graph with the state
    updated in place (the fastest form). With ``torch.compile(step, mode="reduce-overhead")``
    instead, the returned tensors live in the graphs' memory pool, which the next call reuses,
    yet the state is the next call's input; clone it after each call
    (``state = optree.tree_map(torch.clone, state)``, kept metrics too) and move
    ``state.step``/``state.seed`` to the GPU (an op on the CPU keeps the graph out of CUDA
    graphs; ``step_rng`` then syncs to read them).

    Example:
        >>> import torch
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state, make_train_step
        >>> def model_fn(params, buffers, x):
        ...     return x @ params["w"], buffers
        >>> def loss_fn(out, y):
        ...     return ((out - y) ** 2).mean()
        >>> opt = adam(1e-2)
        >>> state = init_train_state({"w": torch.zeros(3, 1)}, {}, opt, seed=0)
        >>> step = make_train_step(model_fn, loss_fn, opt, grad_accum_steps=2, max_grad_norm=1.0)
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> state, metrics = step(state, (x, y))
        >>> int(state.step), sorted(metrics)
        (1, ['grad_norm', 'loss'])
    """
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int):
        raise TypeError(
            f"make_train_step(grad_accum_steps=...): expected an int >= 1, got {grad_accum_steps!r}"
        )
    if grad_accum_steps < 1:
        raise ValueError(
            f"make_train_step(grad_accum_steps=...): expected an int >= 1, got {grad_accum_steps}"
        )
    if max_grad_norm is not None and not max_grad_norm > 0.0:
        raise ValueError(
            f"make_train_step(max_grad_norm=...): expected None or > 0, got {max_grad_norm!r}"
        )
    if amp is not None and amp not in _AMP_DTYPES:
        raise ValueError(
            f"make_train_step(amp=...): expected None, 'bf16' or 'fp16', got {amp!r}"
        )
    if loss_scaler is not None and amp != "fp16":
        raise ValueError(
            f"make_train_step(loss_scaler=...): a loss scaler needs amp='fp16', got amp={amp!r}"
        )
    fp16 = amp == "fp16"
    scaler = loss_scaler if loss_scaler is not None else DynamicLossScaler()
    k = grad_accum_steps

    def micro_step(
        params: TensorDict, buffers: TensorDict, x: Any, y: Any, scale: Tensor | None
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        device_type = _first_device(params).type

        def objective(p: TensorDict) -> tuple[Tensor, tuple[Tensor, TensorDict]]:
            ctx = (
                torch.autocast(device_type=device_type, dtype=_AMP_DTYPES[amp])
                if amp is not None
                else contextlib.nullcontext()
            )
            with ctx:
                outputs, new_buffers = model_fn(p, buffers, x)
                loss = loss_fn(outputs, y)
            if not isinstance(loss, Tensor) or loss.ndim != 0:
                seen = (
                    f"a tensor of shape {tuple(loss.shape)}"
                    if isinstance(loss, Tensor)
                    else type(loss).__name__
                )
                raise ValueError(
                    f"train step: loss_fn(outputs, targets) must return a scalar (0-d) tensor, "
                    f"got {seen}; reduce it, e.g. with .mean()"
                )
            if amp is not None:
                loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
            scaled = loss * scale if scale is not None else loss
            return scaled, (loss, new_buffers)

        grads, (_, (loss, new_buffers)) = torch.func.grad_and_value(objective, has_aux=True)(
            params
        )
        return grads, loss, new_buffers

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Tensor]]:
        inputs, targets = _check_batch(batch)
        micro_batches = _split_batch(inputs, targets, k)
        scale = state.loss_scale.scale if fp16 else None
        use_rng = seed_rng and not torch.compiler.is_compiling()
        ctx = step_rng(state) if use_rng else contextlib.nullcontext()
        buffers = state.buffers
        grads: TensorDict | None = None
        losses = []
        with ctx:
            for x, y in micro_batches:
                g, loss, buffers = micro_step(state.params, buffers, x, y, scale)
                grads = g if grads is None else optree.tree_map(torch.add, grads, g)
                losses.append(loss)
        assert grads is not None
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        if k > 1:
            grads = optree.tree_map(lambda t: t / k, grads)
        if grad_transform is not None:
            grads = grad_transform(grads)

        finite: Tensor | None = None
        if fp16:
            assert scale is not None
            inv = 1.0 / scale
            grads = optree.tree_map(lambda t: t * inv.to(t.dtype), grads)
            leaves = optree.tree_leaves(grads)
            finite = torch.stack([torch.isfinite(t).all() for t in leaves]).all()
            grads = optree.tree_map(lambda t: torch.where(finite, t, torch.zeros_like(t)), grads)
            grad_norm = _global_norm(leaves)
            clean_norm = torch.where(finite, grad_norm, torch.zeros_like(grad_norm))
        else:
            grad_norm = _global_norm(optree.tree_leaves(grads))
            clean_norm = grad_norm

        if max_grad_norm is not None:
            coef = torch.clamp(max_grad_norm / (clean_norm + 1e-6), max=1.0)
            grads = optree.tree_map(lambda t: t * coef.to(t.dtype), grads)

        updates, opt_state = optimizer.update(
            grads, state.opt_state, params=state.params, inplace=False
        )
        params = apply_updates(state.params, updates, inplace=False)

        metrics: dict[str, Tensor] = {"loss": loss.detach(), "grad_norm": grad_norm.detach()}
        loss_scale = state.loss_scale
        if fp16:
            assert finite is not None

            def keep_if_finite(new: Any, old: Any) -> Any:
                return torch.where(finite, new, old)

            params = optree.tree_map(keep_if_finite, params, state.params)
            buffers = optree.tree_map(keep_if_finite, buffers, state.buffers)
            opt_state = optree.tree_map(keep_if_finite, opt_state, state.opt_state)
            loss_scale = _update_loss_scale(state.loss_scale, finite, scaler)
            metrics["loss_scale"] = loss_scale.scale
            metrics["skipped"] = ~finite
        if lr_schedule is not None:
            lr = lr_schedule(state.step) if callable(lr_schedule) else lr_schedule
            metrics["lr"] = torch.as_tensor(lr, dtype=torch.float32)

        new_state = TrainState(
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            step=state.step + 1,
            seed=state.seed,
            loss_scale=loss_scale,
        )
        return new_state, metrics

    return step


def _update_loss_scale(
    state: LossScaleState, finite: Tensor, scaler: DynamicLossScaler
) -> LossScaleState:
    """Return the next loss-scale state (``torch.amp.GradScaler``'s update rule, as tensors)."""
    tracker = torch.where(finite, state.growth_tracker + 1, torch.zeros_like(state.growth_tracker))
    grow = tracker >= scaler.growth_interval
    grown = torch.where(grow, state.scale * scaler.growth_factor, state.scale)
    # like GradScaler, never grow into inf
    grown = torch.where(torch.isfinite(grown), grown, state.scale)
    scale = torch.where(finite, grown, state.scale * scaler.backoff_factor)
    tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
    return LossScaleState(scale=scale, growth_tracker=tracker)
