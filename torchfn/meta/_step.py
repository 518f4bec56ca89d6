"""The outer step of meta-training: meta-gradient plus an outer optimizer update, compile-ready."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import Tensor
from torchopt.base import GradientTransformation
from torchopt.typing import Schedule

from torchfn._checks import STEP_INDUCTOR_OPTIONS, _part
from torchfn.functional import (
    DynamicLossScaler,
    StepOptions,
    TrainState,
    apply_gradients,
    check_optimizer,
    init_train_state,
    split_batch,
    step_rng,
)
from torchfn.meta._inner_compile import (
    COMPILE_MODES,
    InnerCompiledMetaGrad,
    check_inner_compile,
    make_outer_update,
)
from torchfn.meta._maml import MetaLearner
from torchfn.meta._tasks import Task

__all__ = ["init_meta_state", "make_meta_train_step"]

Trainable = Callable[[str], bool] | Collection[str]


def _frozen(learner: MetaLearner) -> tuple[str, ...]:
    return tuple(getattr(learner.model_fn, "frozen", ()))


def init_meta_state(
    learner: MetaLearner,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    optimizer: GradientTransformation,
    *,
    seed: int | Tensor = 0,
    loss_scale: float = 2.0**16,
    trainable: Trainable | None = None,
) -> TrainState:
    """Return the initial :class:`torchfn.functional.TrainState` of meta-training.

    ``state.params`` are ``learner.init(params)`` (Meta-SGD's learned rates included) and
    ``state.buffers`` are ``learner.init_buffers(buffers, params)`` for a learner that has one
    (MAML++: per-step BatchNorm stacks and the outer-step counter), else ``buffers``: pass the
    model's own params and buffers. The state saves and loads with
    :func:`torchfn.functional.save_checkpoint`. The optimizer state
    covers the meta-params that are trained: ``trainable`` (a callable ``name -> bool`` or a
    collection of names), by default all but the model's frozen params
    (``learner.model_fn.frozen``, recorded by :func:`torchfn.functional.make_functional` for
    ``requires_grad=False``). ``loss_scale`` is the initial fp16 loss scale.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from torchfn.optim import adam
        >>> from torchfn.meta import maml
        >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        >>> state = init_meta_state(learner, {"w": torch.zeros(1, 1)}, {}, adam(1e-3))
        >>> int(state.step)
        0
    """
    check_optimizer(optimizer, "init_meta_state")
    meta = learner.init(params)
    init_buffers = getattr(learner, "init_buffers", None)
    buffers = init_buffers(buffers, params) if init_buffers is not None else dict(buffers)
    names = StepOptions(trainable=trainable, where="init_meta_state").trainable_names(
        meta, _frozen(learner))
    return init_train_state(meta, buffers, optimizer, seed=seed, loss_scale=loss_scale,
                            trainable=names)


def _mean_buffers(parts: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    out = {}
    for k, b in parts[0].items():
        out[k] = (torch.stack([p[k] for p in parts]).mean(0).to(b.dtype)
                  if b.is_floating_point() else b)
    return out


def make_meta_train_step(
    learner: MetaLearner,
    optimizer: GradientTransformation,
    *,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_value: float | None = None,
    amp: str | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    lr_schedule: float | Schedule | None = None,
    trainable: Trainable | None = None,
    skip_nonfinite: bool = True,
    grad_transform: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    seed_rng: bool = True,
    compile: str | None = None,
    compile_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[TrainState, Task], tuple[TrainState, dict[str, Tensor]]]:
    """Return ``step(state, tasks) -> (new_state, metrics)``: one outer update.

    The step computes :meth:`MetaLearner.meta_grad` over the task batch ``tasks`` (task dim
    0), applies ``optimizer`` (e.g. :func:`torchfn.functional.adam`, compile-safe) out of
    place through :func:`torchfn.functional.apply_gradients` and stores the task-averaged
    buffers. The shared step features (:class:`torchfn.functional.StepOptions`):

    - ``trainable``: the meta-params the outer update trains (default: all but
      ``learner.model_fn.frozen``); no meta-gradient is computed for the others and they
      never change (the inner loop adapts what the learner's ``adapt_filter`` selects, by
      default all but the frozen params too). Build the
      state with the same set (:func:`init_meta_state` does by default).
    - ``grad_accum_steps=k``: the ``T`` tasks run as ``k`` micro-batches of ``T // k`` tasks
      (``T`` divisible by ``k``), meta-gradients averaged (equal to one step on all tasks).
    - ``max_grad_norm`` / ``clip_value``: global-norm / elementwise clipping of the
      meta-gradient.
    - ``amp``: ``'bf16'`` runs the inner and outer passes under autocast; ``'fp16'`` also
      scales the outer loss by the dynamic loss scale in ``state.loss_scale`` (the inner
      loop's own gradients are not scaled).
    - ``lr_schedule``: ``metrics["lr"]``; ``skip_nonfinite`` (default on): a step with a
      non-finite meta-loss or meta-gradient keeps the state and counts in
      ``metrics["skipped"]`` and ``state.skipped``.
    - ``grad_transform``: maps the averaged meta-gradient dict before unscaling and clipping
      (the distributed step all-reduces there).
    - ``seed_rng`` (eager only; default on): with a learner built with ``randomness=
      "different"`` or ``"same"`` (dropout), the step seeds its randomness from
      ``(state.seed, state.step)`` (:func:`torchfn.functional.step_rng`), so a step is
      reproducible and a resumed run repeats it; wrap a compiled step in ``step_rng(state)``.

    ``metrics``: ``loss`` (the meta-loss), ``grad_norm``, ``skipped`` (unless switched off),
    ``lr`` and ``loss_scale`` when asked. It is pure, does no host syncs and compiles with
    ``torch.compile(step, fullgraph=True)`` without recompiling between steps (same shapes).

    ``compile``: ``None`` (default) returns the plain step above, for you to compile whole
    (one graph; the inner loop is unrolled in it, so compile time grows with
    ``learner.inner_steps``). ``"inner"`` returns a step that compiles its own parts, each
    once whatever ``inner_steps`` is: the inner step of a task chunk (called ``inner_steps``
    times from Python), the query loss and the outer update; the meta-gradient is an eager
    ``torch.autograd.grad`` through the compiled calls' backwards, exact for second order
    (each compiled inner step's backward holds its Hessian-vector products). Same numbers as
    the eager step; compile time flat in ``inner_steps``; the price is Python between the
    calls (no single graph, so no CUDA graph of the whole step). Call it eagerly (under
    ``torch.compile`` it raises ``RuntimeError``); ``compile_kwargs`` go to each
    ``torch.compile`` (e.g. ``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``;
    ``fullgraph=True`` unless given). It fits :func:`maml`, :func:`fomaml`, :func:`anil`,
    :func:`meta_sgd` (``chunk_size`` and BatchNorm buffers included) and :func:`imaml`, whose
    compiled parts need no gradient through them: its proximal inner step (called
    ``inner_steps`` times), its implicit solve (query gradient and the ``cg_steps`` CG
    iterations, one graph) and the outer update. It refuses with ``ValueError`` Reptile,
    MAML++, ``remat=True``, ``compile_regions=True``, ``randomness`` other than ``"error"``
    and ``amp``. With the compile cache of :func:`torchfn.compile.enable_compile_cache`, a new
    process loads the three graphs instead of building them. The compiled inner step and query
    loss recompute cheap ops in their backward (pointwise, views, pads, max-pool indices, the
    patches of unfolded convolutions) instead of keeping them for every inner step. Either way
    ``step.meta_grad`` is the meta-gradient function the step calls (``learner.meta_grad``, or
    the one with the compiled inner step).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from torchfn.optim import adam
        >>> from torchfn.meta import maml, sinusoid_tasks
        >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        >>> opt = adam(1e-2)
        >>> state = init_meta_state(learner, {"w": torch.zeros(1, 1)}, {}, opt)
        >>> step = make_meta_train_step(learner, opt, max_grad_norm=1.0)
        >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
        >>> state, metrics = step(state, tasks)
        >>> int(state.step), metrics["loss"].shape
        (1, torch.Size([]))
        >>> inner = make_meta_train_step(learner, opt, compile="inner",
        ...                              compile_kwargs={"backend": "eager"})
        >>> state, metrics = inner(state, tasks)  # compiles the inner step once
        >>> int(state.step)
        2
    """
    if not isinstance(learner, MetaLearner):
        raise TypeError(f"make_meta_train_step(learner, ...): expected a MetaLearner, "
                        f"got {type(learner).__name__}")
    check_optimizer(optimizer, "make_meta_train_step")
    options = StepOptions(trainable=trainable, amp=amp, loss_scaler=loss_scaler,
                          grad_accum_steps=grad_accum_steps, max_grad_norm=max_grad_norm,
                          clip_value=clip_value, lr_schedule=lr_schedule,
                          skip_nonfinite=skip_nonfinite, where="make_meta_train_step")
    if compile not in COMPILE_MODES:
        raise ValueError(f"make_meta_train_step(compile=...): expected one of "
                         f"{list(COMPILE_MODES)}, got {compile!r}")
    if compile_kwargs is not None and compile is None:
        raise ValueError("make_meta_train_step(compile_kwargs=...): only used with "
                         "compile='inner'; with compile=None pass them to torch.compile(step)")
    frozen = _frozen(learner)
    k = grad_accum_steps
    meta_grad: Callable[..., tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]]
    if compile == "inner":
        check_inner_compile(learner, amp=amp, where="make_meta_train_step")
        meta_grad = InnerCompiledMetaGrad(learner, compile_kwargs)
    else:
        meta_grad = learner.meta_grad

    def update(grads: dict[str, Tensor], state: TrainState, names: list[str], loss: Tensor,
               buffers: dict[str, Tensor]) -> tuple[TrainState, dict[str, Any]]:
        return apply_gradients(optimizer, grads, state, options=options, trainable=names,
                               loss=loss, buffers=buffers, where="meta train step")

    outer = make_outer_update(update, compile_kwargs) if compile == "inner" else update

    def step(state: TrainState, tasks: Task) -> tuple[TrainState, dict[str, Any]]:
        names = options.trainable_names(state.params, frozen)
        scale = state.loss_scale.scale if options.fp16 else None
        device_type = next(iter(state.params.values())).device.type
        grads: dict[str, Tensor] | None = None
        losses, bufs = [], []
        # randomness="error" refuses random ops: nothing to seed
        use_rng = (seed_rng and learner.randomness != "error"
                   and not torch.compiler.is_compiling())
        # randomness="same": one set of draws for all tasks, so every micro-batch replays the
        # step's draws from the same seed (as the learner's chunks do)
        replay = learner.randomness == "same" and k > 1
        if replay and not use_rng:
            raise RuntimeError(
                f"meta train step with randomness='same' and grad_accum_steps={k}: every "
                "micro-batch must replay the step's random draws from its seed, which the "
                "eager step does (seed_rng=True) but not a compiled step or seed_rng=False; "
                "use grad_accum_steps=1 (chunk_size= bounds memory) or run eagerly")
        with step_rng(state) if use_rng else contextlib.nullcontext():
            for part in split_batch(tasks, k, "meta train step(state, tasks)"):
                with (step_rng(state) if replay else contextlib.nullcontext(),
                      options.autocast(device_type)):
                    g, loss, buffers = meta_grad(state.params, state.buffers, part,
                                                 wrt=names, loss_scale=scale)
                grads = g if grads is None else {n: grads[n] + g[n] for n in grads}
                losses.append(loss)
                bufs.append(buffers)
        assert grads is not None
        if k > 1:
            grads = {n: v / k for n, v in grads.items()}
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        buffers = bufs[0] if k == 1 else _mean_buffers(bufs)
        if grad_transform is not None:
            grads = grad_transform(grads)
        with _part("torchfn.apply_gradients"):
            return outer(grads, state, names, loss, buffers)

    step.meta_grad = meta_grad  # type: ignore[attr-defined]
    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step
