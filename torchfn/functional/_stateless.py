"""Stateless models: ``model_fn, params, buffers = make_functional(module)``.

``model_fn(params, buffers, *args, **kwargs) -> (outputs, new_buffers)`` runs ``module``'s
forward with the given tensors. How: ``model_fn`` owns a private deep copy of the module
whose parameters and buffers are placeholders on the ``meta`` device (no memory, and any
forgotten use of them fails loudly). A call points every parameter/buffer slot (including
every alias of a tied parameter) at the given tensors, runs forward, reads back the buffer
slots (a forward that *reassigns* a buffer -- torchfn's :class:`BatchNorm` does -- leaves
the new tensor there), and restores the placeholders in ``finally``. Nothing the caller
owns is written, so the same code runs eagerly, under ``vmap``/``grad``/``grad`` of
``grad`` and under ``torch.compile(fullgraph=True)`` (the slot swaps are Python side
effects Dynamo replays; no graph breaks).
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchfn.functional._batchnorm import _restore_batchnorm_, _swap_batchnorm_
from torchfn.functional._recurrent import _restore_recurrent_, _swap_recurrent_

__all__ = ["FunctionalModel", "make_functional"]


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _Layout:
    """What a FunctionalModel knows about its names; shared by its train()/eval() copies."""

    param_specs: dict[str, _Spec]
    buffer_specs: dict[str, _Spec]
    param_aliases: dict[str, tuple[str, ...]]  # primary name -> every name (primary first)
    buffer_aliases: dict[str, tuple[str, ...]]
    swapped_batchnorms: tuple[str, ...]  # module paths swapped nn.BatchNorm -> BatchNorm
    swapped_recurrent: tuple[str, ...]  # module paths swapped nn.RNN/GRU/LSTM -> torchfn's


def _alias_groups(named: list[tuple[str, Tensor]]) -> dict[str, tuple[str, ...]]:
    """Group names by tensor identity, primary (first) name first, like named_parameters()."""
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return {names[0]: tuple(names) for names in groups.values()}


def _spec(t: Tensor) -> _Spec:
    return _Spec(tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return str(dtype)


class FunctionalModel:
    """A pure callable ``(params, buffers, *args, **kwargs) -> (outputs, new_buffers)``.

    Built by :func:`make_functional`. ``new_buffers`` has the keys of ``buffers``: a buffer
    the forward reassigned comes back as the new tensor, others come back as the given
    object. Attributes: ``param_names`` and ``buffer_names`` (tuples, ``named_parameters()``
    order, tied aliases removed), ``frozen`` and ``trainable`` (the param names whose
    ``requires_grad`` was False / True in the module: torchfn's steps built from this
    ``model_fn`` train only ``trainable``), ``training``; ``train()``/``eval()`` return a new
    FunctionalModel in that mode; ``to_module(params, buffers)`` gives back an ordinary
    ``nn.Module``. One call at a time per object (the private module copy is borrowed for the
    call): give each thread its own ``copy.deepcopy(model_fn)``.
    """

    def __init__(self, module: nn.Module, layout: _Layout) -> None:
        self._module = module
        self._layout = layout
        self.param_names: tuple[str, ...] = tuple(layout.param_specs)
        self.buffer_names: tuple[str, ...] = tuple(layout.buffer_specs)
        self.frozen: tuple[str, ...] = tuple(
            k for k, spec in layout.param_specs.items() if not spec.requires_grad
        )
        self.trainable: tuple[str, ...] = tuple(
            k for k, spec in layout.param_specs.items() if spec.requires_grad
        )
        # (primary name, owner module, attribute) for every alias of every tensor.
        self._param_slots = [
            (primary, *_owner(module, name))
            for primary, names in layout.param_aliases.items()
            for name in names
        ]
        self._buffer_slots = [
            (primary, *_owner(module, name))
            for primary, names in layout.buffer_aliases.items()
            for name in names
        ]
        # torch's own norm layers (replace_batchnorm=False) update running stats in place:
        # give them private clones so the caller's tensors are never written.
        self._cloned_buffers = frozenset(
            primary
            for primary, owner, _ in self._buffer_slots
            if isinstance(owner, nn.modules.batchnorm._NormBase)
            and owner.training
            and owner.track_running_stats
        )

    @property
    def training(self) -> bool:
        """Whether the private module copy (its root) is in training mode."""
        return self._module.training

    def train(self, mode: bool = True) -> FunctionalModel:
        """Return a new FunctionalModel in training mode ``mode`` (``self`` is unchanged).

        Example::

            >>> model_fn, params, buffers = make_functional(nn.Linear(2, 2))
            >>> model_fn.eval().training, model_fn.training
            (False, True)
        """
        module = copy.deepcopy(self._module)  # meta placeholders: cheap
        module.train(mode)
        return FunctionalModel(module, self._layout)

    def modules(self) -> Iterator[nn.Module]:
        """Return an iterator over the private module copy's modules (inspection only).

        Their parameters and buffers are ``meta`` placeholders; use it to ask which layer
        types the model holds, never to compute.

        Example::

            >>> model_fn, _, _ = make_functional(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
            >>> [type(m).__name__ for m in model_fn.modules()]
            ['Sequential', 'Linear', 'ReLU']
        """
        return self._module.modules()

    def eval(self) -> FunctionalModel:
        """Return a new FunctionalModel in eval mode (``self.train(False)``)."""
        return self.train(False)

    def __repr__(self) -> str:
        return (
            f"FunctionalModel({type(self._module).__name__}, training={self.training}, "
            f"{len(self.param_names)} params, {len(self.buffer_names)} buffers)"
        )

    def __call__(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, Tensor]]:
        """Return ``(module(*args, **kwargs), new_buffers)`` computed with the given tensors."""
        self._check(params, buffers)
        placed: dict[str, Tensor] = {}
        for name in self.buffer_names:
            b = buffers[name]
            placed[name] = b.clone() if name in self._cloned_buffers else b
        saved_params = [owner._parameters[attr] for _, owner, attr in self._param_slots]
        saved_buffers = [owner._buffers[attr] for _, owner, attr in self._buffer_slots]
        try:
            for primary, owner, attr in self._param_slots:
                owner._parameters[attr] = params[primary]
            for primary, owner, attr in self._buffer_slots:
                owner._buffers[attr] = placed[primary]
            outputs = self._module(*args, **kwargs)
            new_buffers = dict(placed)
            for primary, owner, attr in self._buffer_slots:
                current = owner._buffers[attr]
                if current is not placed[primary]:
                    new_buffers[primary] = current
        finally:
            for (_, owner, attr), old in zip(self._param_slots, saved_params, strict=True):
                owner._parameters[attr] = old
            for (_, owner, attr), old in zip(self._buffer_slots, saved_buffers, strict=True):
                owner._buffers[attr] = old
        return outputs, new_buffers

    def to_module(
        self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]
    ) -> nn.Module:
        """Return a fresh ``nn.Module`` (torch's BatchNorm/RNN/GRU/LSTM back) holding copies.

        Parameters are new ``nn.Parameter`` s (detached clones; ``requires_grad`` as in the
        original module; tied names share one Parameter); buffers are detached clones.
        The module is in this FunctionalModel's training mode. Eager only (not under vmap).

        Example::

            >>> model_fn, params, buffers = make_functional(nn.Linear(2, 3))
            >>> net = model_fn.to_module({k: v + 1 for k, v in params.items()}, buffers)
            >>> torch.equal(net.bias, params["bias"] + 1)
            True
        """
        self._check(params, buffers)
        module = copy.deepcopy(self._module)
        module = _restore_batchnorm_(module, list(self._layout.swapped_batchnorms))
        module = _restore_recurrent_(module, list(self._layout.swapped_recurrent))
        for primary, names in self._layout.param_aliases.items():
            spec = self._layout.param_specs[primary]
            p = nn.Parameter(params[primary].detach().clone(), requires_grad=spec.requires_grad)
            for name in names:
                owner, attr = _owner(module, name)
                owner._parameters[attr] = p
        for primary, names in self._layout.buffer_aliases.items():
            b = buffers[primary].detach().clone()
            for name in names:
                owner, attr = _owner(module, name)
                owner._buffers[attr] = b
        return module

    # -- validation -------------------------------------------------------------------------

    def _check(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> None:
        layout = self._layout
        _check_dict("params", params, layout.param_specs, layout.param_aliases, layout.buffer_specs)
        _check_dict(
            "buffers", buffers, layout.buffer_specs, layout.buffer_aliases, layout.param_specs
        )


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return module.get_submodule(prefix), attr


def _check_dict(
    what: str,
    given: Any,
    specs: dict[str, _Spec],
    aliases: dict[str, tuple[str, ...]],
    other_specs: dict[str, _Spec],
) -> None:
    call = "model_fn(params, buffers, ...)"
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{call}: {what} must be a dict[str, Tensor] keyed like "
            f"named_{'parameters' if what == 'params' else 'buffers'}(), got {type(given).__name__}"
        )
    missing = [k for k in specs if k not in given]
    unexpected = [k for k in given if k not in specs]
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing keys {missing}")
        for key in unexpected:
            lines.append(f"unexpected key {key!r}{_hint(key, what, specs, aliases, other_specs)}")
        raise ValueError(f"{call}: {what} does not match the module: " + "; ".join(lines))
    for key, spec in specs.items():
        t = given[key]
        if not isinstance(t, Tensor):
            raise TypeError(f"{call}: {what}[{key!r}] must be a Tensor, got {type(t).__name__}")
        if tuple(t.shape) != spec.shape:
            hint = ""
            if t.dim() == len(spec.shape) + 1 and tuple(t.shape[1:]) == spec.shape:
                hint = (
                    " (a leading batch/member dim? map over it with "
                    "torch.func.vmap(model_fn, in_dims=...))"
                )
            raise ValueError(
                f"{call}: {what}[{key!r}] has the wrong shape: expected {spec.shape}, "
                f"got {tuple(t.shape)}{hint}"
            )
        if t.dtype != spec.dtype and _dtype_kind(t.dtype) != _dtype_kind(spec.dtype):
            raise TypeError(
                f"{call}: {what}[{key!r}] has the wrong dtype: expected {spec.dtype}, got "
                f"{t.dtype} (floating dtypes may differ from the module's, e.g. float64 for "
                "float32; a change of kind -- float/int/bool/complex -- is refused)"
            )
        if t.device != spec.device:
            raise ValueError(
                f"{call}: {what}[{key!r}] is on the wrong device: expected {spec.device}, got "
                f"{t.device} (move the module first, then call make_functional on it)"
            )


def _hint(
    key: str,
    what: str,
    specs: dict[str, _Spec],
    aliases: dict[str, tuple[str, ...]],
    other_specs: dict[str, _Spec],
) -> str:
    for primary, names in aliases.items():
        if key in names:
            return f" (it is tied to {primary!r}, the same tensor; pass only {primary!r})"
    if key in other_specs:
        other = "buffers" if what == "params" else "params"
        return f" (it is a {other[:-1]}; pass it in {other})"
    close = difflib.get_close_matches(key, list(specs), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def make_functional(
    module: nn.Module, *, replace_batchnorm: bool = True, replace_recurrent: bool = True
) -> tuple[FunctionalModel, dict[str, Tensor], dict[str, Tensor]]:
    """Return ``(model_fn, params, buffers)``: a pure version of ``module`` and copies of its state.

    ``params``/``buffers`` are ``dict[str, Tensor]`` keyed like ``named_parameters()`` /
    ``named_buffers()`` (a tied parameter appears once, under its first name), holding
    detached clones (``requires_grad=False``: ``torch.func.grad`` does not need it; call
    ``.requires_grad_()`` for ``torch.autograd``). Then::

        outputs, new_buffers = model_fn(params, buffers, *args, **kwargs)

    runs ``module.forward`` with those tensors (the tensor for a tied parameter is used at
    every alias). ``module`` and the given dicts are never modified; buffers the forward
    updates (batch-norm running stats, ``num_batches_tracked``) come back as new tensors in
    ``new_buffers``. Works under ``vmap`` (e.g. over tasks or ensemble members, with
    batched or unbatched buffers), ``grad``, ``grad`` of ``grad`` and
    ``torch.compile(fullgraph=True)``.

    ``replace_batchnorm=True`` swaps every ``nn.BatchNorm1d/2d/3d`` in the private copy for
    torchfn's :class:`BatchNorm` (same numbers, same keys), which is needed under ``vmap``
    in training mode and gives correct second-order gradients there (torch's fused kernel
    does not). With ``False`` torch's layers run as they are; their in-place running-stat
    updates go into private clones of those buffers, which ``vmap`` over batched inputs
    refuses in training mode. Other modules that write into buffers *in place*
    (``self.buf.add_(...)``) would write into the tensors you pass: write ``self.buf = new``.

    ``replace_recurrent=True`` swaps every ``nn.RNN``/``nn.GRU``/``nn.LSTM`` in the private copy
    for torchfn's :class:`RNN`/:class:`GRU`/:class:`LSTM` (same keys, same numbers; written from
    elementary ops, so ``vmap``, ``grad`` of ``grad``, ``jvp`` and ``torch.compile`` work, which
    torch's fused kernels and cached ``_flat_weights`` do not); ``to_module`` gives torch's
    classes back. Inter-layer ``dropout`` in training mode draws random numbers: ``vmap`` then
    needs ``randomness="different"`` or ``"same"``.

    Each call checks the dicts: missing/unexpected keys (``ValueError``, with a "did you
    mean"), shape (``ValueError``; under ``vmap`` the per-example shape is compared), device
    (``ValueError``) and dtype (``TypeError``). Floating dtypes may differ from the
    module's (float64 values for a float32 module, for precise tests); a change of kind
    (floating/integer/bool/complex) is refused. The checks are static, so ``torch.compile``
    only guards on them.

    Example::

        >>> net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        >>> model_fn, params, buffers = make_functional(net)
        >>> out, new_buffers = model_fn(params, buffers, torch.randn(8, 3))
        >>> key = "1.num_batches_tracked"
        >>> out.shape, int(new_buffers[key]), int(buffers[key])
        (torch.Size([8, 2]), 1, 0)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"make_functional(module): expected an nn.Module, got {type(module).__name__}"
        )
    named_params = list(module.named_parameters(remove_duplicate=False))
    named_buffers = list(module.named_buffers(remove_duplicate=False))
    lazy = [k for k, t in named_params + named_buffers if nn.parameter.is_lazy(t)]
    if lazy:
        raise ValueError(
            f"make_functional(module): {lazy} are uninitialized (lazy modules); run one forward "
            "on the module first so their shapes are known"
        )
    param_aliases = _alias_groups(named_params)
    buffer_aliases = _alias_groups(named_buffers)
    by_name = dict(named_params) | dict(named_buffers)

    # Deep copy with meta placeholders standing in for every parameter/buffer (the memo keeps
    # ties: one placeholder per tensor object), so the copy costs no tensor memory.
    memo: dict[int, Any] = {}
    for _, t in named_params:
        if id(t) not in memo:
            memo[id(t)] = nn.Parameter(
                torch.empty_like(t, device="meta"), requires_grad=t.requires_grad
            )
    for _, t in named_buffers:
        if id(t) not in memo:
            memo[id(t)] = torch.empty_like(t, device="meta")
    private = copy.deepcopy(module, memo)
    swapped: list[str] = []
    if replace_batchnorm:
        private, swapped = _swap_batchnorm_(private)
    swapped_rnn: list[str] = []
    if replace_recurrent:
        private, swapped_rnn = _swap_recurrent_(private)

    layout = _Layout(
        param_specs={k: _spec(by_name[k]) for k in param_aliases},
        buffer_specs={k: _spec(by_name[k]) for k in buffer_aliases},
        param_aliases=param_aliases,
        buffer_aliases=buffer_aliases,
        swapped_batchnorms=tuple(swapped),
        swapped_recurrent=tuple(swapped_rnn),
    )
    params = {k: by_name[k].detach().clone() for k in param_aliases}
    buffers = {k: by_name[k].detach().clone() for k in buffer_aliases}
    return FunctionalModel(private, layout), params, buffers
