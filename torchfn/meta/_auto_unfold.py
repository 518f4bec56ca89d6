"""Unfolded convolutions by default in compiled meta-steps: ``MetaLearner(unfold_convs="auto")``.

Under ``vmap`` over tasks, a convolution whose weights the inner loop adapts has per-task
weights and becomes one grouped convolution (tasks as groups); cuDNN's float32 grouped kernels
and their double backward are slow. Written as ``weight.flatten(1) @ unfold(x)``
(:class:`torchfn.compile._unfold_conv.UnfoldConv2d`) the same convolution is a batched GEMM,
which Inductor fuses well. Eager, it does not pay (more host work and memory than cuDNN).

So a learner built on a :func:`torchfn.functional.make_functional` model keeps two views of
it: ``model_fn`` itself, and a twin whose private module copy has those convolutions as
``UnfoldConv2d`` (same parameter names and shapes, same layout, same checks). The learner
calls :class:`CompiledUnfold`, which runs the twin while ``torch.compiler.is_compiling()``
(Dynamo turns that into a constant: each compiled graph holds one path, no guard, no graph
break) and ``model_fn`` otherwise, so eager numbers are those of ``nn.Conv2d`` bit for bit and
compiled ones agree up to float rounding. Nothing the user holds changes: ``learner.model_fn``,
the params dict, its keys and checkpoints are the same with and without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn.compile import unfold_convs
from torchfn.functional import FunctionalModel

__all__: list[str] = []

# Convolutions with a smaller patch (C_in * kh * kw) stay cuDNN convolutions: the 1-channel
# first layer of a few-shot conv net (patch 9). Unfolding it too was a little faster on the
# H100 (benchmarks/results/meta-h100.md, run 4: 33.2 vs 36.8 ms) but makes Inductor (torch
# 2.11, CUDA) fail to compile small nets ("AssertionError: 9 v.s. 3", mix-order reduction), and
# a default must not break compilation. The same rule as torchfn.compile.unfold_convs' default.
AUTO_MIN_PATCH = 64

UNFOLD_MODES = ("auto", True, False)


def check_unfold_convs(value: Any, where: str) -> None:
    """Raise ``ValueError`` unless ``value`` is ``"auto"``, ``True`` or ``False``."""
    if not (value == "auto" if isinstance(value, str) else isinstance(value, bool)):
        raise ValueError(f"{where}(unfold_convs=...): expected 'auto', True or False, got "
                         f"{value!r}")


class CompiledUnfold:
    """``model_fn(params, buffers, *args, **kwargs)``, computed through ``unfolded`` (the same
    model with convolutions as unfold + matmul) while ``torch.compile`` traces the call.

    Eager calls go to ``model_fn`` untouched. Both take the same params and buffers dicts.
    """

    def __init__(self, model_fn: FunctionalModel, unfolded: FunctionalModel) -> None:
        self.model_fn = model_fn
        self.unfolded = unfolded

    def __repr__(self) -> str:
        return f"CompiledUnfold({self.model_fn!r})"

    def __call__(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], /,
                 *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
        fn = self.unfolded if torch.compiler.is_compiling() else self.model_fn
        return fn(params, buffers, *args, **kwargs)


def unfolded_twin(model_fn: FunctionalModel, adapted: Callable[[str], bool]
                  ) -> FunctionalModel | None:
    """Return ``model_fn`` with its eligible, adapted convolutions as unfold + matmul
    (:func:`torchfn.compile.unfold_convs` with ``min_patch=AUTO_MIN_PATCH``), or ``None`` when
    there are none.

    Adapted: ``adapted(name)`` is true for the primary name of the conv's weight (a conv whose
    weight the inner loop leaves alone is shared by all tasks, an ordinary batched convolution
    that cuDNN runs well). The twin shares ``model_fn``'s layout (names, shapes, checks); its
    private module is a copy of ``model_fn``'s (``meta`` placeholders: no tensor memory).
    """
    primary_of = {alias: primary for primary, names in model_fn._layout.param_aliases.items()
                  for alias in names}
    swapped: list[str] = []

    def only(path: str) -> bool:
        weight = f"{path}.weight" if path else "weight"
        if weight in primary_of and adapted(primary_of[weight]):
            swapped.append(path)
            return True
        return False

    module = unfold_convs(model_fn._module, min_patch=AUTO_MIN_PATCH, only=only)
    return FunctionalModel(module, model_fn._layout) if swapped else None


def compiled_model_fn(model_fn: Any, mode: str | bool, adapted: Callable[[str], bool]) -> Any:
    """Return what a learner calls as its model: ``model_fn`` itself, or a
    :class:`CompiledUnfold` of it when ``mode`` asks for unfolded convolutions under
    ``torch.compile`` and there are some to unfold.

    ``mode``: ``False`` never; ``True`` whenever compiled; ``"auto"`` when compiled and the
    model's params are on CUDA (where it was measured to pay). Only
    :func:`torchfn.functional.make_functional` models are rewritten (a hand-written
    ``model_fn`` has no modules to swap).
    """
    if mode is False or not isinstance(model_fn, FunctionalModel):
        return model_fn
    devices = {spec.device.type for spec in model_fn._layout.param_specs.values()}
    if mode == "auto" and devices != {"cuda"}:
        return model_fn
    twin = unfolded_twin(model_fn, adapted)
    return model_fn if twin is None else CompiledUnfold(model_fn, twin)
