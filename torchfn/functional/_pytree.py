"""Pytree helpers over param dicts (and any pytree of tensors), built on optree.

What comes from where:

- ``tree_map``, ``tree_add``, ``tree_sub``, ``tree_scalar_mul`` are re-exported unchanged from
  :mod:`torchopt.pytree` (``tree_map`` is optree's). They already trace under
  ``torch.compile(fullgraph=True)`` and accept a 0-d tensor scalar, so torchfn adds no second name.
- ``tree_add_scaled`` exists because torchopt's ``tree_add_scalar_mul(x, y, alpha)`` passes
  ``alpha`` to ``Tensor.add(alpha=...)``, which needs a Python number: a 0-d tensor ``alpha`` is
  read back to the host and one with ``requires_grad`` (a learned step size) raises.
- ``tree_dot`` exists because torchopt's ``tree_vdot_real`` returns a Python float through
  ``.item()`` (a host sync, not differentiable, not compilable); ``tree_dot`` returns a 0-d tensor.

Everything here is out-of-place, differentiable, works under ``torch.func.vmap``/``grad``, and
does no host syncs. Dict keys are visited in optree's (sorted) order; output dicts keep the
input's insertion order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch
from torchopt.pytree import tree_add, tree_map, tree_scalar_mul, tree_sub

__all__ = [
    "tree_add",
    "tree_add_scaled",
    "tree_dot",
    "tree_global_norm",
    "tree_map",
    "tree_numel",
    "tree_ones_like",
    "tree_ravel",
    "tree_scalar_mul",
    "tree_sub",
    "tree_zeros_like",
]

PyTree = Any


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in path) if path else "<root>"


def _check_same_structure(
    fn_name: str,
    names: tuple[str, str],
    tree_x: PyTree,
    tree_y: PyTree,
    *,
    check_shapes: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[Any, ...]]]:
    """Return ``(leaves_x, leaves_y, paths)`` or raise a ValueError naming what differs."""
    spec_x = optree.tree_structure(tree_x)
    spec_y = optree.tree_structure(tree_y)
    if torch.compiler.is_compiling():
        # Dynamo (torch 2.11 with optree 0.20) cannot trace PyTreeSpec.__eq__; compare the
        # leaf paths (plain tuples) while tracing -- eager calls compare the full specs
        differ = optree.tree_paths(tree_x) != optree.tree_paths(tree_y)
    else:
        differ = spec_x != spec_y
    if differ:
        paths_x = {_path_str(p) for p in optree.tree_paths(tree_x)}
        paths_y = {_path_str(p) for p in optree.tree_paths(tree_y)}
        missing = sorted(paths_x - paths_y)
        extra = sorted(paths_y - paths_x)
        if missing or extra:
            detail = f"missing keys {missing}, extra keys {extra}"
        else:
            detail = f"same keys but different containers: {spec_x} vs {spec_y}"
        raise ValueError(
            f"{fn_name}: `{names[1]}` must have the same structure as `{names[0]}`; "
            f"{names[1]} has {detail} (relative to {names[0]})."
        )
    leaves_x = optree.tree_leaves(tree_x)
    leaves_y = spec_x.flatten_up_to(tree_y)
    paths = optree.tree_paths(tree_x)
    if check_shapes:
        for path, lx, ly in zip(paths, leaves_x, leaves_y, strict=True):
            both = isinstance(lx, torch.Tensor) and isinstance(ly, torch.Tensor)
            if both and lx.shape != ly.shape:
                raise ValueError(
                    f"{fn_name}: leaf '{_path_str(path)}' has shape {tuple(lx.shape)} in "
                    f"`{names[0]}` but {tuple(ly.shape)} in `{names[1]}`; shapes must match."
                )
    return leaves_x, leaves_y, paths


def _tensor_leaves(fn_name: str, tree: PyTree) -> tuple[list[torch.Tensor], list[tuple[Any, ...]]]:
    leaves = optree.tree_leaves(tree)
    paths = optree.tree_paths(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{fn_name}: every leaf must be a torch.Tensor, but leaf '{_path_str(path)}' is "
                f"a {type(leaf).__name__}."
            )
    return leaves, paths


def tree_add_scaled(tree_x: PyTree, tree_y: PyTree, alpha: float | torch.Tensor) -> PyTree:
    """Return ``tree_x + alpha * tree_y`` leaf by leaf (same structure and shapes as ``tree_x``).

    ``alpha`` is a Python number or a tensor that broadcasts against every leaf (usually 0-d); a
    tensor ``alpha`` stays in the graph, so gradients flow into it (a learned step size) and
    nothing is read back to the host.

    Example::

        >>> p = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
        >>> g = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        >>> tree_add_scaled(p, g, torch.tensor(-0.1))["b"]
        tensor([-0.1000, -0.1000, -0.1000])
    """
    leaves_x, leaves_y, _ = _check_same_structure("tree_add_scaled", ("tree_x", "tree_y"),
                                                  tree_x, tree_y)
    out = [x + alpha * y for x, y in zip(leaves_x, leaves_y, strict=True)]
    return optree.tree_unflatten(optree.tree_structure(tree_x), out)


def tree_dot(tree_x: PyTree, tree_y: PyTree) -> torch.Tensor:
    """Return the 0-d tensor ``sum over leaves of sum(conj(x) * y)`` (the flat inner product).

    Equals ``torch.vdot(tree_ravel(tree_x)[0], tree_ravel(tree_y)[0])``; leaves may differ in
    dtype (the result is promoted). Differentiable, no host sync. An empty tree gives ``0.``.

    Example::

        >>> a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
        >>> tree_dot(a, a)
        tensor(14.)
    """
    leaves_x, leaves_y, _ = _check_same_structure("tree_dot", ("tree_x", "tree_y"), tree_x, tree_y)
    parts = [
        torch.sum(x.conj() * y) if x.is_complex() else torch.sum(x * y)
        for x, y in zip(leaves_x, leaves_y, strict=True)
    ]
    if not parts:
        return torch.zeros(())
    return functools.reduce(torch.add, parts)


def tree_global_norm(tree: PyTree, p: float = 2.0) -> torch.Tensor:
    """Return the 0-d ``p``-norm of all leaves taken together, as if raveled into one vector.

    ``p`` is any number ``> 0`` or ``math.inf``. Computed as the ``p``-norm of the per-leaf
    ``p``-norms (exact for every such ``p``), so no flat copy of the tree is made. The result has
    the promoted real dtype of the leaves; an empty tree gives ``0.``.

    Example::

        >>> tree_global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        raise ValueError(f"tree_global_norm: `p` must be a number > 0 or math.inf, got {p!r}.")
    leaves, _ = _tensor_leaves("tree_global_norm", tree)
    if not leaves:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(leaf, ord=p) for leaf in leaves]
    dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms])
    stacked = torch.stack([n.to(dtype) for n in norms])
    return torch.linalg.vector_norm(stacked, ord=p)


def tree_zeros_like(tree: PyTree) -> PyTree:
    """Return a tree of zeros with the structure, shapes, dtypes and devices of ``tree``.

    Example::

        >>> tree_zeros_like({"w": torch.ones(2)})
        {'w': tensor([0., 0.])}
    """
    return tree_map(torch.zeros_like, tree)


def tree_ones_like(tree: PyTree) -> PyTree:
    """Return a tree of ones with the structure, shapes, dtypes and devices of ``tree``.

    Example::

        >>> tree_ones_like({"w": torch.zeros(2)})
        {'w': tensor([1., 1.])}
    """
    return tree_map(torch.ones_like, tree)


def tree_numel(tree: PyTree) -> int:
    """Return the total number of elements over all leaves (a Python int; shapes are static).

    Example::

        >>> tree_numel({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
        9
    """
    leaves, _ = _tensor_leaves("tree_numel", tree)
    return sum(leaf.numel() for leaf in leaves)


def tree_ravel(tree: PyTree) -> tuple[torch.Tensor, Callable[[torch.Tensor], PyTree]]:
    """Return ``(vector, unravel)``: all leaves flattened into one 1-D vector, and its inverse.

    ``vector`` has shape ``(P,)`` with ``P = tree_numel(tree)``, leaves concatenated in optree's
    leaf order (``optree.tree_leaves(tree)``; dict keys sorted), in the promoted dtype of the
    leaves. ``unravel(vector)`` splits a ``(P,)`` vector back into a tree with the original
    structure, shapes and per-leaf dtypes. Both directions are differentiable and work under
    ``torch.func.vmap`` (e.g. ``vmap(unravel)`` on a ``(B, P)`` batch) and ``torch.func.grad``.
    All leaves must be on one device.

    Example::

        >>> params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
        >>> vec, unravel = tree_ravel(params)
        >>> vec.shape
        torch.Size([9])
        >>> unravel(vec)["w"].shape
        torch.Size([2, 3])
    """
    leaves, paths = _tensor_leaves("tree_ravel", tree)
    spec = optree.tree_structure(tree)
    shapes = [leaf.shape for leaf in leaves]
    dtypes = [leaf.dtype for leaf in leaves]
    sizes = [leaf.numel() for leaf in leaves]
    total = sum(sizes)
    devices = {leaf.device for leaf in leaves}
    if len(devices) > 1:
        where = ", ".join(
            f"'{_path_str(p)}': {leaf.device}" for p, leaf in zip(paths, leaves, strict=True)
        )
        raise ValueError(f"tree_ravel: all leaves must be on one device, got {where}.")
    if leaves:
        dtype = functools.reduce(torch.promote_types, dtypes)
        vector = torch.cat([leaf.reshape(-1).to(dtype) for leaf in leaves])
    else:
        vector = torch.zeros(0)

    def unravel(vec: torch.Tensor) -> PyTree:
        if not isinstance(vec, torch.Tensor) or vec.dim() != 1 or vec.shape[0] != total:
            seen = tuple(vec.shape) if isinstance(vec, torch.Tensor) else type(vec).__name__
            raise ValueError(
                f"tree_ravel's unravel: expected a 1-D tensor of shape ({total},), got {seen}. "
                "To unravel a batch of vectors use torch.func.vmap(unravel)."
            )
        chunks = torch.split(vec, sizes) if sizes else []
        out = [
            c.reshape(s) if c.dtype == d else c.reshape(s).to(d)
            for c, s, d in zip(chunks, shapes, dtypes, strict=True)
        ]
        return optree.tree_unflatten(spec, out)

    return vector, unravel

