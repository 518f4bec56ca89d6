"""Build an ensemble of N same-architecture models as one stacked ``(params, buffers)`` pair.

Every leaf of the stacked dicts is ``(N, ...)`` with the members along dim 0; one pure
``model_fn`` (:func:`torchfn.functional.make_functional`) runs all of them under ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn

from torchfn._checks import _call_model, _call_translated, _n_members
from torchfn.functional import FunctionalModel, make_functional

__all__ = ["Ensemble", "ensemble_apply", "n_members"]

_RANDOMNESS = ("error", "different", "same")


def _fmt(shape: Any) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def n_members(params: Mapping[str, Tensor], where: str = "n_members(params)") -> int:
    """Return N, the size of dim 0 shared by every leaf of stacked ``params``.

    Raises ``ValueError`` naming the first leaf whose dim 0 differs (or that is 0-d).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import n_members
        >>> n_members({"w": torch.zeros(4, 3, 2), "b": torch.zeros(4, 3)})
        4
    """
    return _n_members(params, where)


def _check_member_args(where: str, args: Any, n: int) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(args)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, Tensor):
            continue
        if leaf.ndim == 0 or leaf.shape[0] != n:
            name = ".".join(str(p) for p in path)
            raise ValueError(
                f"{where}: with per_member=True every input tensor must have the N={n} members "
                f"along dim 0, shape ({n}, B, ...); got shape {_fmt(leaf.shape)} at args[{name}]."
                " Pass per_member=False to give all members the same batch (B, ...)"
            )


def ensemble_apply(
    model_fn: Callable[..., tuple[Any, dict[str, Tensor]]],
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    *args: Any,
    per_member: bool = False,
    chunk_size: int | None = None,
    randomness: str = "error",
) -> tuple[Any, dict[str, Tensor]]:
    """Return ``(outputs, new_buffers)`` of all N members, each output ``(N, B, ...)``.

    ``params``/``buffers`` are stacked ``(N, ...)``. With ``per_member=False`` every member
    sees the same ``args`` (``(B, ...)``); with ``per_member=True`` each tensor in ``args`` is
    ``(N, B, ...)`` and member ``n`` sees slice ``n``. ``chunk_size`` runs the members in
    chunks of that many (less memory, same numbers). One dict argument is passed as keywords,
    ``model_fn(p, b, **inputs)`` (Hugging Face style, like every torchfn step). ``randomness`` is ``vmap``'s: ``"error"``
    (default: refuse random ops such as dropout in training mode), ``"different"`` (each member
    draws its own dropout masks from the global generator) or ``"same"``. Pure; compiles with
    ``torch.compile(fullgraph=True)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn.ensembles import Ensemble, ensemble_apply
        >>> ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=[0, 1, 2])
        >>> out, _ = ensemble_apply(ens.model_fn, ens.params, ens.buffers, torch.randn(5, 3))
        >>> out.shape
        torch.Size([3, 5, 2])
    """
    where = "ensemble_apply(model_fn, params, buffers, *args)"
    if randomness not in _RANDOMNESS:
        raise ValueError(f"{where}: randomness must be one of {_RANDOMNESS}, got {randomness!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{where}: chunk_size must be None or an int >= 1, got {chunk_size!r}")
    n = n_members(params, where)
    if buffers:
        n_members(buffers, where + " (buffers)")
    if per_member:
        _check_member_args(where, args, n)
    arg_dims = 0 if per_member else None

    def one(p: Mapping[str, Tensor], b: Mapping[str, Tensor], a: tuple[Any, ...]) -> Any:
        if len(a) == 1 and isinstance(a[0], Mapping):  # HF style: the dict as keywords
            return _call_model(model_fn, p, b, a[0], where)
        return model_fn(p, b, *a)

    mapped = torch.func.vmap(one, in_dims=(0, 0, arg_dims), randomness=randomness,
                             chunk_size=chunk_size)
    return _call_translated(where, mapped, dict(params), dict(buffers), args)


def _describe_mismatch(first: nn.Module, other: nn.Module) -> str | None:
    """Return a sentence naming the first difference of architecture, or None."""
    mods0, mods1 = dict(first.named_modules()), dict(other.named_modules())
    for name in list(mods0) + [k for k in mods1 if k not in mods0]:
        if name not in mods1:
            return f"submodule {name!r} is missing"
        if name not in mods0:
            return f"submodule {name!r} is unexpected"
        if type(mods0[name]) is not type(mods1[name]):
            return (f"submodule {name or '<root>'!r} is a {type(mods1[name]).__name__}, "
                    f"expected a {type(mods0[name]).__name__}")
    for kind, a, b in (("parameter", dict(first.named_parameters()),
                        dict(other.named_parameters())),
                       ("buffer", dict(first.named_buffers()), dict(other.named_buffers()))):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in b:
                return f"{kind} {key!r} is missing"
            if key not in a:
                return f"{kind} {key!r} is unexpected"
            if a[key].shape != b[key].shape:
                return (f"{kind} {key!r} has shape {_fmt(b[key].shape)}, expected "
                        f"{_fmt(a[key].shape)}")
            if a[key].dtype != b[key].dtype or a[key].device != b[key].device:
                return (f"{kind} {key!r} is {b[key].dtype} on {b[key].device}, expected "
                        f"{a[key].dtype} on {a[key].device}")
    return None


class Ensemble:
    """N same-architecture models as one pure ``model_fn`` and stacked ``(N, ...)`` dicts.

    Attributes: ``model_fn`` (a :class:`torchfn.functional.FunctionalModel`), ``params`` and
    ``buffers`` (``dict[str, Tensor]`` keyed like ``named_parameters()``, every leaf
    ``(N, ...)``), ``n_members``, ``frozen`` / ``trainable`` (param names whose
    ``requires_grad`` was False / True in the modules; training updates only ``trainable``).
    Build it with :meth:`from_modules` or :meth:`from_seeds`;
    call it on a shared batch ``(B, ...)`` or per-member batches ``(N, B, ...)``; get members
    back as ``nn.Module`` s with :meth:`member` / :meth:`members`. Training is
    :func:`make_ensemble_train_step` over ``init_ensemble_state(ens, optimizer, ...)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchfn.ensembles import Ensemble
        >>> ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=range(4))
        >>> out, _ = ens(torch.randn(5, 3))
        >>> out.shape, ens.n_members
        (torch.Size([4, 5, 2]), 4)
    """

    def __init__(self, model_fn: FunctionalModel, params: dict[str, Tensor],
                 buffers: dict[str, Tensor]) -> None:
        where = "Ensemble(model_fn, params, buffers)"
        self.n_members = n_members(params, where)
        if buffers and n_members(buffers, where + " (buffers)") != self.n_members:
            raise ValueError(f"{where}: buffers stack N={n_members(buffers)} members, params "
                             f"stack N={self.n_members}")
        self.model_fn = model_fn
        self.params = params
        self.buffers = buffers

    @property
    def frozen(self) -> tuple[str, ...]:
        """Names of the params frozen in the modules (``requires_grad=False``)."""
        return tuple(getattr(self.model_fn, "frozen", ()))

    @property
    def trainable(self) -> tuple[str, ...]:
        """Names of the params the training step updates (all but :attr:`frozen`)."""
        return tuple(k for k in self.params if k not in self.frozen)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], *,
                     replace_batchnorm: bool = True) -> Ensemble:
        """Return an :class:`Ensemble` holding detached copies of ``modules`` stacked on dim 0.

        All modules must have the same architecture (submodule types, parameter and buffer
        names, shapes, dtypes and devices); otherwise ``ValueError`` names the first member and
        key that differ. ``replace_batchnorm`` is passed to ``make_functional`` (True: vmap-safe
        BatchNorm). The modules are not modified.

        Example:
            >>> from torch import nn
            >>> from torchfn.ensembles import Ensemble
            >>> Ensemble.from_modules([nn.Linear(3, 2), nn.Linear(3, 2)]).params["weight"].shape
            torch.Size([2, 2, 3])
        """
        where = "Ensemble.from_modules(modules)"
        modules = list(modules)
        if not modules:
            raise ValueError(f"{where}: expected at least one module, got an empty sequence")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(f"{where}: expected nn.Module members, got "
                                f"{type(m).__name__} at index {i}")
        for i, m in enumerate(modules[1:], start=1):
            problem = _describe_mismatch(modules[0], m)
            if problem is not None:
                raise ValueError(f"{where}: every member must have the architecture of member "
                                 f"0, but in member {i} {problem}")
        model_fn, _, _ = make_functional(modules[0], replace_batchnorm=replace_batchnorm)
        stacked_p, stacked_b = torch.func.stack_module_state(modules)  # type: ignore[arg-type]
        params = {k: stacked_p[k].detach() for k in model_fn.param_names}
        buffers = {k: stacked_b[k].detach() for k in model_fn.buffer_names}
        return cls(model_fn, params, buffers)

    @classmethod
    def from_seeds(cls, constructor: Callable[[], nn.Module], seeds: Sequence[int] | range, *,
                   replace_batchnorm: bool = True) -> Ensemble:
        """Return an :class:`Ensemble` of ``constructor()`` called once per seed.

        Member ``n`` is built with the CPU generator seeded by ``seeds[n]`` (inside
        ``torch.random.fork_rng``, so the global random stream is untouched); the same seeds
        give the same members.

        Example:
            >>> from torch import nn
            >>> from torchfn.ensembles import Ensemble
            >>> Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=[7, 8]).n_members
            2
        """
        seeds = list(seeds)
        if not seeds:
            raise ValueError("Ensemble.from_seeds(constructor, seeds): expected at least one "
                             "seed, got none")
        modules = []
        for s in seeds:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(s))
                modules.append(constructor())
        return cls.from_modules(modules, replace_batchnorm=replace_batchnorm)

    def __call__(self, *args: Any, per_member: bool = False, chunk_size: int | None = None,
                 randomness: str = "error", params: Mapping[str, Tensor] | None = None,
                 buffers: Mapping[str, Tensor] | None = None) -> tuple[Any, dict[str, Tensor]]:
        """Return ``(outputs, new_buffers)`` of :func:`ensemble_apply` on this ensemble.

        ``params``/``buffers`` default to the ensemble's own (e.g. pass ``state.params``).
        """
        return ensemble_apply(self.model_fn, self.params if params is None else params,
                              self.buffers if buffers is None else buffers, *args,
                              per_member=per_member, chunk_size=chunk_size,
                              randomness=randomness)

    def member(self, index: int, params: Mapping[str, Tensor] | None = None,
               buffers: Mapping[str, Tensor] | None = None) -> nn.Module:
        """Return member ``index`` as an ordinary ``nn.Module`` (copies of its tensors)."""
        if not -self.n_members <= index < self.n_members:
            raise IndexError(f"Ensemble.member(index={index}): expected an index in "
                             f"[0, {self.n_members})")
        p = self.params if params is None else params
        b = self.buffers if buffers is None else buffers
        return self.model_fn.to_module({k: v[index] for k, v in p.items()},
                                       {k: v[index] for k, v in b.items()})

    def members(self, params: Mapping[str, Tensor] | None = None,
                buffers: Mapping[str, Tensor] | None = None) -> list[nn.Module]:
        """Return all N members as ordinary ``nn.Module`` s (see :meth:`member`)."""
        return [self.member(i, params, buffers) for i in range(self.n_members)]

    def __repr__(self) -> str:
        numel = sum(v[0].numel() for v in self.params.values())
        return f"Ensemble(n_members={self.n_members}, params_per_member={numel})"
