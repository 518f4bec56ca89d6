"""The one step core: every step kind computes and applies its gradients through this module.

A step kind (the train step, DP-SGD, the ensemble step, the meta outer step, their distributed
twins) differs in how it gets its gradients; what happens afterwards is shared, so a feature
exists in every step kind or in none:

- :class:`StepOptions`: the shared settings (frozen/trainable params, AMP, accumulation,
  clipping, the lr metric, the non-finite guard), validated once.
- :meth:`StepOptions.autocast`, :meth:`StepOptions.trainable_names` and :func:`split_batch`:
  what a step kind needs while computing its gradients.
- :func:`apply_gradients`: grads + state -> new state + metrics (fp16 unscale, non-finite guard,
  value and global-norm clipping, the update of the trainable params only, keep-if-skipped,
  loss-scale update, lr metric).
- :func:`check_optimizer`: a clear ``TypeError`` for ``torch.optim`` / torchopt's object-oriented
  optimizers.

Everything here is pure and free of host syncs (``torch.where`` instead of Python branches on
tensor values), so a step built on it compiles with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation
from torchopt.typing import Schedule
from torchopt.update import apply_updates

from torchfn._checks import _foreach_map, _leaves_with_paths, _part, _replace, lr_metric

__all__ = [
    "DynamicLossScaler",
    "LossScaleState",
    "StepOptions",
    "apply_gradients",
    "check_optimizer",
    "split_batch",
]

Tensor = torch.Tensor
TensorDict = dict[str, Tensor]
Trainable = Callable[[str], bool] | Collection[str]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleState(NamedTuple):
    """Dynamic loss-scale state: ``scale`` (float32) and ``growth_tracker`` (int64).

    0-d for one model; ``(N,)`` for an ensemble of ``N`` members (one scale per member).
    ``growth_tracker`` counts consecutive finite-gradient steps since the scale last changed.
    """

    scale: Tensor
    growth_tracker: Tensor


@dataclasses.dataclass(frozen=True)
class DynamicLossScaler:
    """Settings of the fp16 dynamic loss scale (the state lives in the step state's ``loss_scale``).

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


def update_loss_scale(
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


def _positive(where: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0.0:
        raise ValueError(f"{where}({name}=...): expected None or a number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The settings every step kind shares, validated; pass one to :func:`apply_gradients`.

    Fields:
        trainable: which params are trained: ``None`` (all but the model's frozen ones), a
            callable ``name -> bool`` or a collection of names. Frozen params get no gradient,
            no optimizer state, no update, no weight decay and (DP) no noise.
        amp: ``None``, ``'bf16'`` (autocast in bfloat16) or ``'fp16'`` (float16 with a dynamic
            loss scale kept in the state's ``loss_scale``).
        loss_scaler: :class:`DynamicLossScaler` settings (``amp='fp16'`` only).
        grad_accum_steps: micro-batches per step (gradients averaged), an int >= 1.
        max_grad_norm: clip the gradient to this global L2 norm (per member for ensembles).
        clip_value: clamp every gradient element to ``[-clip_value, clip_value]``; applied
            before the global-norm clip.
        lr_schedule: the float or schedule given to the optimizer, for ``metrics["lr"]`` (at
            the optimizer's count: ``state.step`` minus the state's ``skipped``).
        skip_nonfinite: skip a step whose loss or gradients are not finite (params, buffers,
            optimizer state keep their old values; counted in ``metrics["skipped"]`` and the
            state's ``skipped``). Costs no host sync. fp16 always skips such steps.
        where: the call named in error messages (e.g. ``"make_train_step"``).

    Example:
        >>> from torchfn.functional import StepOptions
        >>> opts = StepOptions(trainable=lambda name: name.startswith("head."), amp="bf16")
        >>> opts.trainable_names({"body.w": 0, "head.w": 0})
        ('head.w',)
        >>> StepOptions(amp="fp32")
        Traceback (most recent call last):
        ...
        ValueError: StepOptions(amp=...): expected None, 'bf16' or 'fp16', got 'fp32'
    """

    trainable: Trainable | None = None
    amp: str | None = None
    loss_scaler: DynamicLossScaler | None = None
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    clip_value: float | None = None
    lr_schedule: float | Schedule | None = None
    skip_nonfinite: bool = True
    where: str = dataclasses.field(default="StepOptions", compare=False, repr=False)

    def __post_init__(self) -> None:
        w = self.where
        k = self.grad_accum_steps
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"{w}(grad_accum_steps=...): expected an int >= 1, got {k!r}")
        if k < 1:
            raise ValueError(f"{w}(grad_accum_steps=...): expected an int >= 1, got {k!r}")
        _positive(w, "max_grad_norm", self.max_grad_norm)
        _positive(w, "clip_value", self.clip_value)
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f"{w}(amp=...): expected None, 'bf16' or 'fp16', got {self.amp!r}")
        if self.loss_scaler is not None:
            if self.amp != "fp16":
                raise ValueError(
                    f"{w}(loss_scaler=...): a loss scaler needs amp='fp16', got amp={self.amp!r}"
                )
            if not isinstance(self.loss_scaler, DynamicLossScaler):
                raise TypeError(f"{w}(loss_scaler=...): expected a DynamicLossScaler, got "
                                f"{type(self.loss_scaler).__name__}")
        if not isinstance(self.skip_nonfinite, bool):
            raise TypeError(f"{w}(skip_nonfinite=...): expected a bool, got "
                            f"{self.skip_nonfinite!r}")
        t = self.trainable
        if t is not None and not callable(t) and (
                isinstance(t, (str, bytes)) or not isinstance(t, Collection)
                or not all(isinstance(n, str) for n in t)):
            raise TypeError(f"{w}(trainable=...): expected None, a callable name -> bool or "
                            f"a collection of param names, got {t!r}")
        if self.lr_schedule is not None and not callable(self.lr_schedule) and not isinstance(
                self.lr_schedule, (int, float, Tensor)):
            raise TypeError(f"{w}(lr_schedule=...): expected None, a float or a schedule "
                            f"(step -> lr), got {type(self.lr_schedule).__name__}")

    @property
    def fp16(self) -> bool:
        """Whether the options use fp16 with a dynamic loss scale."""
        return self.amp == "fp16"

    @property
    def scaler(self) -> DynamicLossScaler:
        """The loss-scaler settings (defaults when none were given)."""
        return self.loss_scaler if self.loss_scaler is not None else DynamicLossScaler()

    @property
    def guard(self) -> bool:
        """Whether non-finite steps are skipped (``skip_nonfinite`` or fp16)."""
        return self.skip_nonfinite or self.fp16

    def trainable_names(self, params: Iterable[str], frozen: Collection[str] = ()
                        ) -> tuple[str, ...]:
        """Return the names of ``params`` (in order) that are trained.

        ``frozen`` are names the model froze (``requires_grad=False``, e.g.
        ``FunctionalModel.frozen``); they are excluded unless ``trainable`` names them
        explicitly. A collection naming unknown params raises ``ValueError``.
        """
        names = list(params)
        t = self.trainable
        if t is None:
            return tuple(n for n in names if n not in frozen)
        alias = ("a tied weight (one tensor under several names, e.g. an LM head tied to the "
                 "embedding) is keyed by its first name only")
        if callable(t):
            out = tuple(n for n in names if t(n))
            if not out:  # a filter matching nothing would silently train nothing
                raise ValueError(f"{self.where}(trainable=...): the filter selects none of the "
                                 f"params {names}; {alias}")
            return out
        unknown = sorted(set(t) - set(names))
        if unknown:
            raise ValueError(f"{self.where}(trainable=...): names {unknown} are not params; "
                             f"the params are {names} ({alias})")
        return tuple(n for n in names if n in t)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """Return the autocast context of ``amp`` on ``device_type`` (a null context without)."""
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=AMP_DTYPES[self.amp])


def split_batch(tree: Any, k: int, where: str = "step", dim: int = 0) -> list[Any]:
    """Return ``k`` equal micro-batches of the pytree ``tree``, split along ``dim``.

    Every leaf must be a tensor with the same size ``B`` along ``dim``, divisible by ``k``.

    Example:
        >>> import torch
        >>> from torchfn.functional import split_batch
        >>> parts = split_batch((torch.zeros(6, 2), torch.zeros(6)), 3)
        >>> len(parts), parts[0][0].shape
        (3, torch.Size([2, 2]))
    """
    if k == 1:
        return [tree]
    leaves, spec = optree.tree_flatten(tree)
    labels = [label for label, _ in _leaves_with_paths(tree, "batch")]
    if len(labels) != len(leaves):  # a pytree node the walker does not know: optree's paths
        paths = optree.tree_paths(tree)
        labels = ["batch" + "".join(f"[{p!r}]" for p in path) for path in paths]
    seen: dict[int, str] = {}  # batch size -> the first leaf with it
    for label, leaf in zip(labels, leaves, strict=True):
        if not isinstance(leaf, Tensor) or leaf.ndim <= dim:
            raise TypeError(
                f"{where} with grad_accum_steps={k}: every leaf of the batch must be "
                f"a tensor with a batch dim {dim} to split, got {type(leaf).__name__}"
                + (f" of shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else "")
                + f" at {label}"
            )
        seen.setdefault(leaf.shape[dim], label)
    if len(seen) != 1:
        detail = ", ".join(f"{size} for {label}" for size, label in seen.items())
        raise ValueError(
            f"{where} with grad_accum_steps={k}: the batch tensors must share the batch "
            f"size (dim {dim}), got sizes {sorted(seen)} ({detail})"
        )
    ((batch_size, batch_label),) = seen.items()
    if batch_size % k != 0:
        raise ValueError(
            f"{where}: batch size {batch_size} is not divisible by grad_accum_steps={k} "
            f"(split along dim {dim}, size read from {batch_label}); use a batch size that is "
            f"a multiple of {k}"
        )
    micro = batch_size // k
    parts = [leaf.split(micro, dim=dim) for leaf in leaves]
    return [spec.unflatten([p[i] for p in parts]) for i in range(k)]


# -- optimizer checks --------------------------------------------------------------------------

_FUNCTIONAL = {"adam": "torchfn.optim.adam(lr)", "adamw": "torchfn.optim.adamw(lr)"}


def check_optimizer(optimizer: Any, where: str) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a torchopt ``GradientTransformation``.

    A ``torch.optim.Optimizer`` or torchopt's object-oriented ``torchopt.Optimizer`` /
    ``torchopt.MetaOptimizer`` (instance or class) gets an error naming the functional
    equivalent (``torch.optim.Adam`` -> ``torchfn.optim.adam(lr)``).

    Example:
        >>> import torch
        >>> from torchfn.functional import check_optimizer
        >>> check_optimizer(torch.optim.SGD, "my_step")
        Traceback (most recent call last):
        ...
        TypeError: my_step(optimizer=...): got torch.optim.SGD, an object-oriented optimizer that updates parameters in place; pass a functional torchopt GradientTransformation instead: torchopt.sgd(lr)
    """
    import torchopt  # local: torchopt's optim classes are only needed here

    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    oo_bases: tuple[type, ...] = (torch.optim.Optimizer, torchopt.Optimizer,
                                  torchopt.MetaOptimizer)
    if isinstance(cls, type) and issubclass(cls, oo_bases):
        name = cls.__name__
        if name.startswith("Meta") and issubclass(cls, torchopt.MetaOptimizer):
            name = name[len("Meta"):]
        key = name.lower()
        if key in _FUNCTIONAL:
            fix = f"{_FUNCTIONAL[key]} (or torchopt.{key}(lr))"
        elif hasattr(torchopt, key):
            fix = f"torchopt.{key}(lr)"
        else:
            fix = "e.g. torchfn.optim.adam(lr) or torchopt.sgd(lr)"
        module = "torch.optim" if issubclass(cls, torch.optim.Optimizer) else "torchopt"
        raise TypeError(
            f"{where}(optimizer=...): got {module}.{cls.__name__}, an object-oriented optimizer "
            "that updates parameters in place; pass a functional torchopt "
            f"GradientTransformation instead: {fix}"
        )
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
        raise TypeError(
            f"{where}(optimizer=...): expected a torchopt GradientTransformation (init/update, "
            f"e.g. torchfn.optim.adam(lr) or torchopt.sgd(lr)), got {type(optimizer).__name__}"
        )


# -- applying gradients ------------------------------------------------------------------------


def _opt_state_key_sets(opt_state: Any) -> set[frozenset[str]]:
    """Return the key sets of the dicts keyed by param names inside a torchopt state."""
    found: set[frozenset[str]] = set()

    def walk(x: Any) -> None:
        if isinstance(x, Mapping):
            if x and all(isinstance(k, str) for k in x):
                found.add(frozenset(x))
        elif isinstance(x, (tuple, list)):
            for item in x:
                walk(item)

    walk(opt_state)
    return found


# id(optimizer) -> (optimizer, {(state layout, trainable names, param shapes): covers all}):
# the eager answers of _flat_state_covers_all (the optimizer is kept alive by its entry, so
# its id names no other object while cached; at most 16 optimizers, the oldest dropped first)
_COVERS_CACHE: dict[int, tuple[Any, dict[Any, bool]]] = {}


def _meta_init(optimizer: GradientTransformation, params: Mapping[str, Tensor],
               keys: Collection[str]) -> Any:
    """``optimizer.init`` of the ``keys`` params as meta tensors: the state's structure and
    shapes, no memory, nothing left in a compiled graph."""
    return optimizer.init({k: torch.empty_like(params[k], device="meta") for k in keys})


def _flat_state_covers_all(optimizer: GradientTransformation, opt_state: Any,
                           params: Mapping[str, Tensor], names: tuple[str, ...],
                           where: str) -> bool:
    """:func:`_opt_covers_all` for a state with no name-keyed dicts (torchopt's own
    transformations keep lists of leaves): compare its tree structure and leaf shapes with
    ``optimizer.init`` of the trainable params and of all params, on the meta device."""
    def layout(tree: Any) -> tuple[Any, list[Any]]:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        return spec, [tuple(t.shape) if isinstance(t, Tensor) else None for t in leaves]

    got = layout(opt_state)
    eager = not torch.compiler.is_compiling()
    if eager:  # an eager step asks every call: answer from the cache, no meta init
        key = (got[0], tuple(got[1]), names,
               tuple((k, tuple(v.shape), v.dtype) for k, v in params.items()))
        hit = _COVERS_CACHE.get(id(optimizer))
        if hit is not None and key in hit[1]:
            return hit[1][key]
    answer = None
    if got == layout(_meta_init(optimizer, params, names)):
        answer = False
    elif len(names) < len(params) and got == layout(_meta_init(optimizer, params, params)):
        answer = True
    if answer is not None:
        if eager:
            if len(_COVERS_CACHE) >= 16 and id(optimizer) not in _COVERS_CACHE:
                _COVERS_CACHE.pop(next(iter(_COVERS_CACHE)))
            _COVERS_CACHE.setdefault(id(optimizer), (optimizer, {}))[1][key] = answer
        return answer
    frozen = sorted(set(params) - set(names))
    raise ValueError(
        f"{where}: the optimizer state does not match the trainable params. The step trains "
        f"{sorted(names)} (frozen: {frozen}), but the state's opt_state is not "
        "optimizer.init of those params (nor of all params). Build the state with the same "
        "trainable set, e.g. init_train_state(params, buffers, optimizer, seed=..., "
        "trainable=...) / init_dp_state(..., trainable=ghost.trainable) with the step's "
        "trainable=/frozen params"
    )


def _state_kinds(tree: Any) -> str:
    """The state's node types, e.g. ``(ScaleByAdamState, EmptyState)``, for an error."""
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return "(" + ", ".join(type(t).__name__ for t in tree) + ")"
    return type(tree).__name__


def _other_optimizer_state(optimizer: GradientTransformation, opt_state: Any,
                           params: Mapping[str, Tensor]) -> str | None:
    """After ``optimizer.update`` raised: a message if ``opt_state`` is not the state this
    optimizer builds for ``params`` (another optimizer's, say), by comparing tree structures
    with ``optimizer.init`` on meta tensors; None if it is (the error was something else)."""
    try:
        want = _meta_init(optimizer, params, params)
    except Exception:  # an init that cannot run on meta tensors: nothing to compare
        return None
    spec = optree.tree_structure(opt_state, none_is_leaf=True)
    if spec == optree.tree_structure(want, none_is_leaf=True):
        return None
    return (f"the state's opt_state is not this optimizer's state: it holds "
            f"{_state_kinds(opt_state)}, the step's optimizer builds {_state_kinds(want)}. "
            "Build the state with the optimizer the step uses (init_train_state(params, "
            "buffers, optimizer, ...) / init_ensemble_state / init_dp_state with the same "
            "optimizer), or rebuild opt_state with optimizer.init(params) when switching "
            "optimizers")


def _opt_covers_all(opt_state: Any, params: Mapping[str, Tensor], names: tuple[str, ...],
                    where: str, optimizer: GradientTransformation | None = None) -> bool:
    """Return True if ``opt_state`` covers every param (frozen ones too), False if it covers
    only the trainable ``names``; raise ``ValueError`` for any other set. A state without
    name-keyed dicts is checked against ``optimizer.init`` (on meta tensors: no memory, and
    nothing left in a compiled graph) where some params are frozen."""
    key_sets = _opt_state_key_sets(opt_state)
    want, everything = frozenset(names), frozenset(params)
    if not key_sets and optimizer is not None and want != everything:
        return _flat_state_covers_all(optimizer, opt_state, params, names, where)
    if not key_sets or key_sets == {want}:
        return False
    if key_sets == {everything}:
        return True
    seen = sorted(sorted(s) for s in key_sets)
    raise ValueError(
        f"{where}: the optimizer state does not match the trainable params. The step trains "
        f"{sorted(want)} (frozen: {sorted(everything - want)}), but the state's opt_state holds "
        f"entries for {seen[0] if len(seen) == 1 else seen}. Build the state with the same "
        "trainable set, e.g. init_train_state(params, buffers, optimizer, seed=..., "
        "trainable=...) with the step's trainable=/frozen params"
    )


def _member_view(flag: Tensor, like: Tensor) -> Tensor:
    """Return ``flag`` (0-d or ``(N,)``) shaped to broadcast against ``like``."""
    if flag.ndim == 0:
        return flag
    if like.ndim == 0:
        return flag.all() if flag.dtype == torch.bool else flag
    return flag.reshape(flag.shape + (1,) * (like.ndim - 1))


def _keep_if(ok: Tensor, new: Any, old: Any) -> Any:
    def one(n: Any, o: Any) -> Any:
        if not isinstance(n, Tensor):
            return n
        if ok.ndim and n.ndim == 0:  # a state shared by the members advances if any does
            return torch.where(ok.any(), n, o)
        return torch.where(_member_view(ok, n), n, o)

    return optree.tree_map(one, new, old, none_is_leaf=False)


def _norm_dtype(leaves: list[Tensor]) -> torch.dtype:
    dtype = torch.float32
    for leaf in leaves:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return dtype


def _norm(leaves: list[Tensor], per_member: bool) -> Tensor:
    """Global L2 norm of ``leaves`` (``(N,)`` per member with ``per_member``)."""
    if not leaves:
        return torch.zeros(())
    return _norm_and_finite(leaves, per_member)[0]


def _eager_multi_tensor(leaves: list[Tensor]) -> bool:
    """Whether the multi-tensor (``torch._foreach_*``) kernels may replace a per-leaf loop: in
    eager mode only (see :func:`torchfn._checks._foreach_ok` for compiled steps), outside
    every ``torch.func`` transform (the foreach ops have no batching rules), on one device."""
    if not leaves or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    device = leaves[0].device
    return all(t.device == device for t in leaves)


def _norm_and_finite(leaves: list[Tensor], per_member: bool = False
                     ) -> tuple[Tensor, Tensor]:
    """Return ``(global L2 norm, all elements finite)`` of ``leaves`` (0-d, or ``(N,)`` per
    member with ``per_member``) from norms accumulated in float64: a float64 norm is finite
    exactly when all its elements are (no float32, bf16 or fp16 value can overflow it; a
    float64 leaf whose norm overflows float64, above about 1e154 per element, counts as
    non-finite). So one read of every gradient gives both the ``grad_norm`` metric and the
    non-finite guard. In eager mode the per-leaf norms of one model are one multi-tensor kernel
    (``torch._foreach_norm``)."""
    # compiled: one reduction per leaf (a torch.cat of the leaves under one norm looks like
    # fewer kernels, but Inductor materialises the cat as a copy instead of reading in place)
    dtype = _norm_dtype(leaves)
    if not per_member and _eager_multi_tensor(leaves):
        norms = torch._foreach_norm(leaves, 2, dtype=torch.float64)
    elif per_member:
        n = leaves[0].shape[0]
        norms = [torch.linalg.vector_norm(g.reshape(n, -1), dim=1, dtype=torch.float64)
                 for g in leaves]
    else:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in leaves]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), dim=0)
    return total.to(dtype), torch.isfinite(total)


def _scale_tree(tree: TensorDict, factor: Tensor, per_member: bool) -> TensorDict:
    leaves = list(tree.values())
    if (not per_member and factor.ndim == 0 and _eager_multi_tensor(leaves)
            and factor.device == leaves[0].device
            and all(t.dtype == leaves[0].dtype for t in leaves)):
        return dict(zip(tree, torch._foreach_mul(leaves, factor.to(leaves[0].dtype)),
                        strict=True))
    return {k: t * (_member_view(factor, t) if per_member else factor).to(t.dtype)
            for k, t in tree.items()}


def _apply_updates(params: TensorDict, updates: Any) -> Any:
    """``torchopt.apply_updates(params, updates, inplace=False)``: ``p + u`` per leaf, as one
    ``torch._foreach_add`` per (device, dtype) group where :func:`_foreach_map` allows."""
    if type(updates) is dict and type(params) is dict and updates.keys() == params.keys():
        ps, us = list(params.values()), [updates[k] for k in params]
        res = _foreach_map(lambda a, b: (torch._foreach_add(a, b),), [ps, us])
        if res is not None:
            return dict(zip(params, res[0], strict=True))
    return apply_updates(params, updates, inplace=False)


def apply_gradients(
    optimizer: GradientTransformation,
    grads: Mapping[str, Tensor],
    state: Any,
    *,
    options: StepOptions | None = None,
    trainable: Collection[str] | None = None,
    loss: Tensor | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    per_member: bool = False,
    unscale: bool = True,
    grads_finite: Tensor | None = None,
    where: str = "apply_gradients",
) -> tuple[Any, dict[str, Tensor]]:
    """Return ``(new_state, metrics)``: ``grads`` applied to ``state`` by ``optimizer``.

    ``state`` is any NamedTuple with fields ``params``, ``buffers``, ``opt_state``, ``step``
    and optionally ``loss_scale`` (:class:`LossScaleState`, needed for fp16) and ``skipped``
    (int64 count of skipped steps), e.g. :class:`TrainState`. ``grads`` holds at least the
    ``trainable`` params (default ``options.trainable_names(state.params)``), as computed on
    the *scaled* loss for fp16. In order: fp16 unscale; the non-finite guard (``loss`` and
    grads, when ``options.guard``); ``metrics["grad_norm"]``; value clipping; global-norm
    clipping; ``optimizer.update`` of the trainable params only (frozen params are never
    touched, and an ``opt_state`` over all params gets zero gradients for the frozen ones and
    their updates discarded; any other ``opt_state`` key set raises ``ValueError``); then on a
    skipped step params, ``buffers`` (the forward's new buffers, default ``state.buffers``)
    and ``opt_state`` keep their old values, ``loss_scale`` backs off, ``skipped`` counts it.
    ``step`` advances either way. With ``per_member=True`` every leaf has a member axis dim 0
    (ensembles): norms, clipping, the guard and the loss scale are per member (``(N,)``).
    ``unscale=False``: the grads are unscaled already (DP-SGD unscales per sample, before
    clipping); the loss scale is still updated.
    ``grads_finite`` (one model only): a 0-d bool the caller guarantees is False whenever some
    gradient element is not finite (DP-SGD derives it from the per-sample norms: finite norms
    bound the clipped, noised sum). With it, and no ``max_grad_norm``/``clip_value`` to apply,
    the guard uses it instead of reading every gradient, and ``metrics`` has no ``grad_norm``.

    ``metrics`` (0-d, or ``(N,)`` per member): ``grad_norm`` (before clipping), ``loss`` if
    given, ``skipped`` (bool) if guarded, ``loss_scale`` for fp16, ``lr`` if
    ``options.lr_schedule``.

    Example:
        >>> import torch
        >>> from torchfn.functional import StepOptions, apply_gradients, init_train_state
        >>> from torchfn.optim import adam
        >>> opt = adam(0.1)
        >>> state = init_train_state({"w": torch.ones(2)}, {}, opt, seed=0)
        >>> new, metrics = apply_gradients(opt, {"w": torch.tensor([1.0, float("nan")])}, state,
        ...                                options=StepOptions(max_grad_norm=1.0))
        >>> new.params["w"], bool(metrics["skipped"]), int(new.skipped)
        (tensor([1., 1.]), True, 1)
    """
    opts = options if options is not None else StepOptions()
    params = state.params
    names = tuple(trainable) if trainable is not None else opts.trainable_names(params)
    missing = [k for k in names if k not in grads]
    if missing:
        raise ValueError(f"{where}: grads lack the trainable params {missing}")
    g: TensorDict = {k: grads[k] for k in names}
    loss_scale = getattr(state, "loss_scale", None)
    skipped = getattr(state, "skipped", None)
    if opts.amp is not None and all(t.dtype == torch.float64 for t in params.values()
                                    if t.is_floating_point()) and params:
        raise ValueError(
            f"{where}: amp={opts.amp!r} with float64 params: autocast leaves float64 ops in "
            "float64, so nothing would run in reduced precision; convert the model to float32 "
            "(module.float()) or drop amp")
    if opts.fp16 and loss_scale is None:
        raise ValueError(f"{where}: amp='fp16' needs a loss_scale in the state; build the "
                         "state with its init function (init_train_state, init_dp_state, ...)")
    if opts.fp16 and unscale:
        assert loss_scale is not None
        g = _scale_tree(g, 1.0 / loss_scale.scale, per_member)

    leaves = list(g.values())
    finite: Tensor | None = None
    grad_norm: Tensor | None = None
    zeroed: Tensor | None = None  # per member: False where the grads were set to zero
    if grads_finite is not None and per_member:
        raise ValueError(f"{where}: grads_finite is for one model (per_member=False)")
    if (grads_finite is not None and opts.max_grad_norm is None and opts.clip_value is None
            and leaves):
        # the caller proved finiteness more cheaply than a pass over every gradient
        if opts.guard:
            finite = grads_finite.to(device=leaves[0].device, dtype=torch.bool)
    elif not leaves:
        grad_norm = _norm(leaves, per_member)
    else:
        # one float64 norm per member says whether all its elements are finite too
        with _part("torchfn.clip"):
            grad_norm, all_finite = _norm_and_finite(leaves, per_member)
        if opts.guard:
            finite = all_finite
            if per_member:  # one member's non-finite grads must not reach the others
                zeroed = all_finite
                g = {k: torch.where(_member_view(zeroed, t), t, torch.zeros_like(t))
                     for k, t in g.items()}
        # one model: a non-finite step is discarded whole below (params, buffers and
        # optimizer state kept), so its grads need no zeroing first
    if finite is not None and loss is not None:
        finite = finite & torch.isfinite(loss.detach())
    with _part("torchfn.clip"):
        if opts.clip_value is not None:
            v = float(opts.clip_value)
            g = {k: t.clamp(-v, v) for k, t in g.items()}
        if opts.max_grad_norm is not None and leaves:
            if opts.clip_value is not None:
                norm = _norm(list(g.values()), per_member)
            elif zeroed is not None:
                # the zeroed members' grads have norm 0; the others are as measured
                norm = torch.where(zeroed, grad_norm, torch.zeros_like(grad_norm))
            else:
                norm = grad_norm  # nothing changed the grads since it was taken
            coef = torch.clamp(opts.max_grad_norm / (norm + 1e-6), max=1.0)
            g = _scale_tree(g, coef, per_member)

    if _opt_covers_all(state.opt_state, params, names, where, optimizer):
        g_in = {k: g[k] if k in g else torch.zeros_like(v) for k, v in params.items()}
        p_in = dict(params)
    else:
        g_in, p_in = g, {k: params[k] for k in names}
    with _part("torchfn.optimizer"):
        try:
            updates, opt_state = optimizer.update(g_in, state.opt_state, params=p_in,
                                                  inplace=False)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            other = _other_optimizer_state(optimizer, state.opt_state, p_in)
            if other is None:
                raise
            raise ValueError(f"{where}: {other}") from exc
        updated = _apply_updates(p_in, updates)
    new_params = {k: updated[k] if k in g else v for k, v in params.items()}
    new_buffers = dict(buffers) if buffers is not None else state.buffers

    metrics: dict[str, Tensor] = {} if grad_norm is None else {"grad_norm": grad_norm.detach()}
    if loss is not None:
        metrics["loss"] = loss.detach()
    fields: dict[str, Any] = {}
    if finite is not None:
        with _part("torchfn.nonfinite_guard"):
            new_params = _keep_if(finite, new_params, params)
            new_buffers = _keep_if(finite, new_buffers, state.buffers)
            opt_state = _keep_if(finite, opt_state, state.opt_state)
        metrics["skipped"] = ~finite
        if skipped is not None:
            fields["skipped"] = skipped + (~finite).to(skipped.dtype)
    if opts.fp16:
        assert loss_scale is not None and finite is not None
        fields["loss_scale"] = update_loss_scale(loss_scale, finite, opts.scaler)
        metrics["loss_scale"] = fields["loss_scale"].scale
    if opts.lr_schedule is not None:
        metrics["lr"] = lr_metric(opts.lr_schedule, state)
    new_state = _replace(state, params=new_params, buffers=new_buffers, opt_state=opt_state,
                               step=state.step + 1, **fields)
    return new_state, metrics
