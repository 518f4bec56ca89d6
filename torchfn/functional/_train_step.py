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
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation
from torchopt.typing import OptState, Schedule

from torchfn._checks import (
    STEP_INDUCTOR_OPTIONS,
    _call_model,
    _call_translated,
    _part,
    check_model_fn,
    check_state_type,
)
from torchfn.functional._core import (
    DynamicLossScaler,
    LossScaleState,
    StepOptions,
    Trainable,
    apply_gradients,
    check_optimizer,
    split_batch,
)

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


class TrainState(NamedTuple):
    """Everything a training run carries from step to step, as tensors (a pytree).

    Fields:
        params: ``dict[str, Tensor]`` keyed like ``named_parameters()``.
        buffers: ``dict[str, Tensor]`` keyed like ``named_buffers()`` (BatchNorm stats, ...).
        opt_state: the torchopt optimizer state (``optimizer.init(params)``).
        step: int64 0-d CPU tensor, the number of steps taken (skipped fp16 steps included).
        seed: int64 0-d CPU tensor; step ``t``'s randomness comes from ``derive(seed, t)``.
        loss_scale: :class:`LossScaleState`, used by ``amp='fp16'`` only.
        skipped: int64 0-d tensor on the params' device, the number of steps skipped for a
            non-finite loss or gradient (``None`` in states built by hand; then not counted).
    """

    params: TensorDict
    buffers: TensorDict
    opt_state: OptState
    step: Tensor
    seed: Tensor
    loss_scale: LossScaleState
    skipped: Tensor | None = None


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
    trainable: Trainable | None = None,
) -> TrainState:
    """Return the initial :class:`TrainState` (``step`` = 0) for ``params``/``buffers``.

    Params and buffers are detached (the step's out-of-place updates must not chain autograd
    graphs across steps). ``seed`` is an int in ``[0, 2**63)`` or an int64 0-d tensor.
    ``loss_scale`` is the initial fp16 loss scale (ignored unless the step uses ``amp='fp16'``).
    ``trainable`` (a callable ``name -> bool`` or a collection of names; default all) selects
    the params the optimizer state covers; give it the step's trainable set (for a model with
    ``requires_grad=False`` params: ``trainable=model_fn.trainable``), so weight decay and
    momentum cannot reach frozen params.

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
    check_optimizer(optimizer, "init_train_state")
    params = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.detach() for k, v in buffers.items()}
    device = _first_device(params)
    names = StepOptions(trainable=trainable, where="init_train_state").trainable_names(params)
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init({k: params[k] for k in names}),
        step=torch.zeros((), dtype=torch.int64),
        seed=torch.tensor(seed, dtype=torch.int64),
        loss_scale=LossScaleState(
            scale=torch.tensor(loss_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int64, device=device),
        ),
        skipped=torch.zeros((), dtype=torch.int64, device=device),
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

        compiled = torchfn.compile.compile_step(make_train_step(...))
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
    clip_value: float | None = None,
    trainable: Trainable | None = None,
    skip_nonfinite: bool = True,
) -> StepFn:
    """Return a pure ``step(state, batch) -> (new_state, metrics)`` for one optimizer update.

    ``batch = (inputs, targets)``; ``outputs, new_buffers = model_fn(params, buffers, inputs)``
    and ``loss = loss_fn(outputs, targets)`` (a 0-d tensor, mean-reduced). ``inputs`` and
    ``targets`` are tensors or pytrees of tensors with batch dim 0 of size ``B``. A dict of
    inputs is passed as keywords, ``model_fn(params, buffers, **inputs)`` (Hugging Face style:
    ``{"input_ids": (B, L), "attention_mask": (B, L)}``), like every torchfn step; a
    ``model_fn`` that cannot take those keywords gets a ``TypeError`` saying so.

    - ``grad_accum_steps=k`` splits the batch into ``k`` micro-batches of ``B // k`` (``B`` must
      be divisible by ``k``) and averages their gradients, so for a loss that is a mean over
      the samples the update equals one step on the whole batch; buffers thread through the
      micro-batches in order. A mean over a varying number of terms per micro-batch is not
      such a loss: a token mean with padding (``ignore_index``) averages each micro-batch over
      its own real tokens, so micro-batches with few real tokens weigh as much as full ones
      and the update differs from the whole batch's. For those, have ``loss_fn`` return the
      micro-batch's SUM over tokens divided by the average real-token count per micro-batch
      (the whole batch's count over ``k``, e.g. read from the targets before the step), or use
      ``grad_accum_steps=1``.
    - ``max_grad_norm`` clips the averaged gradients to that global L2 norm
      (``torch.nn.utils.clip_grad_norm_``'s rule); ``clip_value`` clamps every element to
      ``[-clip_value, clip_value]`` (``clip_grad_value_``'s rule) before that.
    - Frozen params: ``trainable`` (a callable ``name -> bool`` or a collection of names)
      selects the trained params; by default every param but those ``model_fn.frozen`` names
      (:func:`make_functional` records the module's ``requires_grad=False`` params there). No
      gradient is computed for the others and they never change; build the state with the same
      set (``init_train_state(..., trainable=...)``) so the optimizer state covers only the
      trained params (a state over all params also works: the frozen params' updates are
      discarded; any other set raises ``ValueError``).
    - ``skip_nonfinite`` (default on; it costs no host sync): a step whose loss or gradients
      are not finite keeps params, buffers and optimizer state (``torch.where``) and counts in
      ``metrics["skipped"]`` and ``state.skipped``.
    - ``amp='bf16'`` runs model and loss under ``torch.autocast`` (device type of the params) in
      bfloat16. ``amp='fp16'`` uses float16 with a dynamic loss scale (``loss_scaler`` settings,
      state in ``state.loss_scale``): on inf/nan gradients params, buffers and optimizer state
      keep their old values through ``torch.where`` (no host sync) and the scale backs off.
      Unlike ``torch.amp.GradScaler``, a skipped step also drops the forward's buffer updates, so
      a non-finite forward cannot poison BatchNorm running stats.
    - ``lr_schedule`` (optional, the float or schedule given to the optimizer) adds
      ``metrics["lr"]``: the lr this step applies, the schedule at the optimizer's count
      (``state.step - state.skipped``: skipped steps leave the optimizer state, and so the
      schedule, where it was).
    - ``seed_rng`` (eager only): seed this step's randomness from ``(state.seed, state.step)``
      (:func:`step_rng`); pass ``False`` to use the global generators as they are (e.g. under
      ``vmap`` over states).
    - ``grad_transform`` (optional) maps the averaged gradient dict to a new dict with the same
      keys and shapes before fp16 unscaling, clipping and the update; it must be pure, as the
      compiled step traces it. :func:`torchfn.distributed.make_data_parallel_train_step` uses
      it to average the gradients across ranks, so ``grad_norm`` and clipping see the global
      gradient.

    ``metrics`` holds 0-d tensors: ``loss`` (mean over micro-batches), ``grad_norm`` (global
    norm before clipping), ``skipped`` (bool, unless ``skip_nonfinite=False`` without fp16),
    ``lr`` if asked, and for fp16 ``loss_scale`` (after this step). The gradients are applied
    by :func:`apply_gradients`, the core every torchfn step kind shares.

    Compiling: ``torchfn.compile.compile_step(step)`` is ``torch.compile(step, fullgraph=True)``
    with the Inductor options in ``step.inductor_options`` (buffer reuse off); with a bare
    ``torch.compile`` pass ``options=dict(step.inductor_options)``. On CUDA, Inductor's buffer
    reuse otherwise can hand a kernel a CPU buffer and the launch fails with "CUDA driver error:
    invalid argument" (torch 2.11: the philox outputs of memory-efficient attention reused for
    an Adam step count; see ``docs/design.md``).

    CUDA graphs: :func:`make_graphed_step` captures the step as one graph with the state
    updated in place (the fastest form; it applies ``step.inductor_options`` too). With
    ``torch.compile(step, mode="reduce-overhead")`` instead, the returned tensors live in the
    graphs' memory pool, which the next call reuses, yet the state is the next call's input;
    clone it after each call
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
        (1, ['grad_norm', 'loss', 'skipped'])
    """
    where = "make_train_step"
    check_model_fn(model_fn, where)
    check_optimizer(optimizer, where)
    options = StepOptions(trainable=trainable, amp=amp, loss_scaler=loss_scaler,
                          grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
                          clip_value=clip_value, lr_schedule=lr_schedule,
                          skip_nonfinite=skip_nonfinite, where=where)
    frozen = tuple(getattr(model_fn, "frozen", ()))
    fp16 = options.fp16
    k = grad_accum_steps

    def micro_step(
        params: TensorDict, names: tuple[str, ...], buffers: TensorDict, x: Any, y: Any,
        scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        device_type = _first_device(params).type
        fixed = {n: v for n, v in params.items() if n not in names}

        def objective(p: TensorDict) -> tuple[Tensor, tuple[Tensor, TensorDict]]:
            merged = {n: p[n] if n in p else fixed[n] for n in params}
            with options.autocast(device_type):
                outputs, new_buffers = _call_model(model_fn, merged, buffers, x, "train step")
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
            {n: params[n] for n in names}
        )
        return grads, loss, new_buffers

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Tensor]]:
        check_state_type(state, TrainState, "train step(state, batch)", "init_train_state")
        inputs, targets = _check_batch(batch)
        micro_batches = split_batch((inputs, targets), k, "train step")
        names = options.trainable_names(state.params, frozen)
        scale = state.loss_scale.scale if fp16 else None
        use_rng = seed_rng and not torch.compiler.is_compiling()
        ctx = step_rng(state) if use_rng else contextlib.nullcontext()
        buffers = state.buffers
        grads: TensorDict | None = None
        losses = []
        with ctx:
            for x, y in micro_batches:
                with _part("torchfn.forward_backward"):
                    g, loss, buffers = _call_translated(
                        "train step", micro_step, state.params, names, buffers, x, y, scale)
                grads = g if grads is None else optree.tree_map(torch.add, grads, g)
                losses.append(loss)
        assert grads is not None
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        if k > 1:
            grads = optree.tree_map(lambda t: t / k, grads)
        if grad_transform is not None:
            grads = grad_transform(grads)
        with _part("torchfn.apply_gradients"):
            return apply_gradients(optimizer, grads, state, options=options, trainable=names,
                                   loss=loss, buffers=buffers, where="train step")

    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step

