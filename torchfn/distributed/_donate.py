"""The donated update of a sharded state: one param at a time, written into the old tensors.

A pure step builds the whole new optimizer state and the new params while the old ones are
alive: at the update a rank holds two copies of its shards' state. With ``donate=True`` the
sharded steps instead run ``optimizer.update`` on one param's single-leaf tree at a time (its
shard, its gradient shard, its optimizer-state leaves and the replicated ones, e.g. Adam's
count) and copy the results into the donated state's own tensors before the next param's are
made; the gradient shard of that param is dropped too. Peak: one copy of the state plus one
param's new leaves. The numbers are those of the pure step: the same elementwise ops on the same
values, and a skipped step writes ``where(finite, new, old)`` -- the old values -- back.

This needs an optimizer whose update of a param depends on that param's leaves only (Adam,
AdamW, SGD with momentum, schedules over the replicated count). A transform mixing params, such
as a global-norm clip inside the chain, is refused: the plan checks, on small probe tensors, that
per-param updates equal the update of the whole tree.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torchopt.base import GradientTransformation
from torchopt.update import apply_updates

from torchfn._checks import _replace, lr_metric

__all__ = ["DonationPlan", "check_not_donated", "mark_donated", "refuse_compile"]

_TAG = 1_000_003
# id(step tensor) -> weakref of it, for every state donated to a donating step: passing one of
# them again is refused (their tensors hold a newer state's values)
_CONSUMED: dict[int, weakref.ref] = {}

_COMPILE_MSG = (
    "sharded step (donate=True): the donated (in-place, param by param) update runs eagerly "
    "only. Call the step without torch.compile, or compile the pure step (donate=False)")


@torch.compiler.disable(reason=_COMPILE_MSG)
def refuse_compile() -> None:
    """Raise ``RuntimeError``: the donated update is eager only."""
    raise RuntimeError(_COMPILE_MSG)


def check_not_donated(state: Any, where: str) -> None:
    """Raise ``ValueError`` if ``state`` was donated to an earlier call of a donating step."""
    step = getattr(state, "step", None)
    ref = _CONSUMED.get(id(step))
    if ref is not None and ref() is step:
        raise ValueError(
            f"{where}: this state was donated to an earlier call (donate=True), which wrote the "
            "new params and optimizer state into its tensors; it is no longer valid. Pass the "
            "state the last call returned (state, metrics = step(state, batch)), and clone a "
            "state before the call to keep it (optree.tree_map(torch.clone, state))")


def mark_donated(state: Any) -> None:
    """Record ``state`` (by its ``step`` tensor) as donated: :func:`check_not_donated` refuses it."""
    step = state.step
    key = id(step)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _CONSUMED.get(key) is ref:
            del _CONSUMED[key]

    _CONSUMED[key] = weakref.ref(step, forget)


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, none_is_leaf=False, namespace="torchopt")


@dataclasses.dataclass(frozen=True)
class DonationPlan:
    """Where each param's leaves sit in the flat ``opt_state``: built once per state structure.

    ``spec`` is the whole ``opt_state``'s treespec, ``owners[i]`` the param whose shard leaf
    ``i`` is (``None``: a replicated or 0-d leaf, e.g. a step count, replaced rather than
    written into), ``per_param[name]`` the treespec of ``optimizer.init({name: shard})`` and
    the indices of its leaves in the whole flat state (matched by their paths).
    """

    spec: Any
    owners: tuple[str | None, ...]  # the param whose shard leaf i is; None: small/replicated
    per_param: dict[str, tuple[Any, tuple[int, ...]]]

    @classmethod
    def build(cls, optimizer: GradientTransformation, params: Mapping[str, Tensor],
              opt_state: Any, owners: list[str | None], spec: Any, where: str) -> DonationPlan:
        """Return the plan for ``params`` (the shards) and ``opt_state`` (``owners``/``spec``
        from the sharded layout's structure probe); raise ``ValueError`` if the optimizer's
        state or update is not per param."""
        paths, _, _ = optree.tree_flatten_with_path(opt_state, none_is_leaf=False,
                                                    namespace="torchopt")
        at = {path: i for i, path in enumerate(paths)}
        per_param, covered = {}, set()
        for name, p in params.items():
            probe = optimizer.init({name: torch.zeros(_TAG, dtype=p.dtype, device="meta")})
            p_paths, p_leaves, p_spec = optree.tree_flatten_with_path(
                probe, none_is_leaf=False, namespace="torchopt")
            index = tuple(at.get(path, -1) for path in p_paths)
            shard = [isinstance(leaf, Tensor) and tuple(leaf.shape) == (_TAG,)
                     for leaf in p_leaves]
            if (-1 in index or any(is_shard != (owners[i] == name)
                                   for i, is_shard in zip(index, shard, strict=True))
                    or sum(o == name for o in owners) != sum(shard)):
                raise ValueError(
                    f"{where}(donate=True): the optimizer's state is not per param plus "
                    f"replicated leaves (optimizer.init of param {name!r} alone has the "
                    f"structure {p_spec}, which is not part of the whole state's {spec}); "
                    "use donate=False with this optimizer")
            per_param[name] = (p_spec, index)
            covered.update(index)
        if len(covered) != len(owners):
            raise ValueError(f"{where}(donate=True): the optimizer's state has leaves that "
                             "belong to no param's own state; use donate=False with this "
                             "optimizer")
        plan = cls(spec, tuple(owners), per_param)
        plan._check_per_param(optimizer, params, where)
        return plan

    def _check_per_param(self, optimizer: GradientTransformation,
                         params: Mapping[str, Tensor], where: str) -> None:
        """Raise unless updating param by param equals updating the whole tree (the updates
        and the new state), on probes of three elements per param (large gradients, so a clip
        inside the chain would act)."""
        g = torch.Generator().manual_seed(0)
        probe = {n: torch.randn(3, generator=g, dtype=torch.float64).to(p)
                 for n, p in params.items()}
        grads = {n: (torch.randn(3, generator=g, dtype=torch.float64) * 1e3 * (i + 1)).to(p)
                 for i, (n, p) in enumerate(params.items())}
        state = optimizer.init(probe)
        whole, whole_state = optimizer.update(grads, state, params=probe, inplace=False)
        leaves, _ = _flatten(state)
        new_leaves, _ = _flatten(whole_state)
        for n in params:
            p_spec, index = self.per_param[n]
            sub = optree.tree_unflatten(p_spec, [leaves[i] for i in index])
            one, one_state = optimizer.update({n: grads[n]}, sub, params={n: probe[n]},
                                              inplace=False)
            pairs = [(one[n], whole[n])] + [
                (a, new_leaves[i]) for a, i in zip(_flatten(one_state)[0], index, strict=True)
                if isinstance(a, Tensor)]
            if not all(torch.allclose(a, b, rtol=1e-5, atol=0.0) for a, b in pairs):
                raise ValueError(
                    f"{where}(donate=True): the optimizer's update of param {n!r} depends on "
                    "the other params (e.g. a global-norm clip inside the chain), so it cannot "
                    "be applied one param at a time; clip with the step's max_grad_norm= "
                    "instead, or use donate=False")

    def apply(self, optimizer: GradientTransformation, state: Any,
              grad: Callable[[str], Tensor], finite: Tensor | None,
              buffers: Mapping[str, Tensor], lr: Any, where: str,
              ) -> tuple[Any, dict[str, Tensor]]:
        """Return ``(new_state, metrics)`` with ``grad(name)`` applied param by param, written
        into ``state``'s own params and optimizer-state tensors (``state`` is consumed).

        ``finite`` (0-d bool or ``None`` when unguarded): a step with ``finite == False``
        writes the old values back (params and optimizer state unchanged), counts ``skipped``
        and keeps ``state.buffers``; ``step`` advances either way, as
        :func:`torchfn.functional.apply_gradients`.
        """
        leaves, spec = _flatten(state.opt_state)
        if spec != self.spec:
            raise ValueError(f"{where}: the state's opt_state has the structure {spec}, not "
                             f"{self.spec} of the state this step was first called with")
        params = state.params
        fresh: dict[int, Any] = {}  # small leaves' new values (a shared count: every param's equal)
        for name, (p_spec, index) in self.per_param.items():
            sub = optree.tree_unflatten(p_spec, [leaves[i] for i in index])
            old_p = params[name]
            updates, new_sub = optimizer.update({name: grad(name)}, sub,
                                                params={name: old_p}, inplace=False)
            new_p = apply_updates({name: old_p}, updates, inplace=False)[name]
            updates = sub = None
            new_leaves, _ = _flatten(new_sub)
            new_sub = None
            for i, new in zip(index, new_leaves, strict=True):
                if self.owners[i] is None:
                    fresh.setdefault(i, new)
                else:
                    _write(leaves[i], new, finite, where, name)
            _write(old_p, new_p, finite, where, name)
            new_leaves = new_p = None  # this param's new tensors die before the next's
        out = [_keep(fresh[i], leaf, finite) if self.owners[i] is None else leaf
               for i, leaf in enumerate(leaves)]
        fields: dict[str, Any] = {}
        metrics: dict[str, Tensor] = {}
        new_buffers = dict(buffers)
        if finite is not None:
            new_buffers = {k: torch.where(finite, v, state.buffers[k]) for k, v in buffers.items()}
            metrics["skipped"] = ~finite
            if getattr(state, "skipped", None) is not None:
                fields["skipped"] = state.skipped + (~finite).to(state.skipped.dtype)
        if lr is not None:
            metrics["lr"] = lr_metric(lr, state)
        new_state = _replace(state, params=dict(params), buffers=new_buffers,
                             opt_state=optree.tree_unflatten(self.spec, out),
                             step=state.step + 1, **fields)
        mark_donated(state)
        return new_state, metrics


def _keep(new: Any, old: Any, finite: Tensor | None) -> Any:
    if finite is None or not isinstance(new, Tensor):
        return new
    return torch.where(finite, new, old)


def _write(old: Tensor, new: Tensor, finite: Tensor | None, where: str, name: str) -> None:
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"{where}(donate=True): the optimizer made a leaf of param {name!r} "
                         f"of shape {tuple(new.shape)} and dtype {new.dtype} for one of "
                         f"{tuple(old.shape)} {old.dtype}; it cannot be written in place")
    with torch.no_grad():
        old.copy_(new if finite is None else torch.where(finite, new, old))
