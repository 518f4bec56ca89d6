"""Swapping torch layers for torchfn's transform-safe twins in a module tree, and back.

Used for batch norm (:mod:`torchfn.functional._batchnorm`) and the recurrent layers
(:mod:`torchfn.functional._recurrent`): a twin has the torch layer's parameter names and
numbers and converts with ``from_torch`` / ``to_torch``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

__all__: list[str] = []  # private to torchfn.functional


def swap_modules_(module: nn.Module, convert: Mapping[type[nn.Module], Callable[[nn.Module],
                  nn.Module]]) -> tuple[nn.Module, list[str]]:
    """Replace every module of an exact type in ``convert`` (in place) by ``convert[type](m)``.

    Returns ``(root, swapped_paths)``: ``root`` is ``module`` or, if ``module`` itself is
    swapped, its replacement (path ``""``). A module shared by two parents becomes one twin.
    """
    if type(module) in convert:
        return convert[type(module)](module), [""]
    swapped: list[str] = []
    done: dict[int, nn.Module] = {}
    for path, parent in list(module.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            if child is not None and type(child) in convert:
                if id(child) not in done:
                    done[id(child)] = convert[type(child)](child)
                parent._modules[child_name] = done[id(child)]
                swapped.append(f"{path}.{child_name}" if path else child_name)
    return module, swapped


def restore_modules_(module: nn.Module, paths: list[str],
                     twin: type[nn.Module]) -> nn.Module:
    """Inverse of :func:`swap_modules_` at ``paths``: every ``twin`` there gets ``to_torch()``.

    Returns the root (a new one if the root itself was swapped).
    """
    done: dict[int, nn.Module] = {}
    for path in paths:
        if path == "":
            assert isinstance(module, twin)
            return module.to_torch()  # type: ignore[operator]
        parent_path, _, child_name = path.rpartition(".")
        parent = module.get_submodule(parent_path)
        child = parent._modules[child_name]
        if isinstance(child, twin):
            if id(child) not in done:
                done[id(child)] = child.to_torch()  # type: ignore[operator]
            parent._modules[child_name] = done[id(child)]
    return module
