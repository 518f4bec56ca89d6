"""Shared machinery for testing torchfn custom ops against their reference twins.

The transform matrix: {eager, compiled} x {``.backward()``, ``torch.func.grad``,
``vmap(grad)``, ``grad(grad)``} x device, each compared with the twin run eagerly in float64.
It is the test that catches the silent zero-gradient bug of ``torch.compile(torch.func.grad)``
over an ``autograd.Function`` (pytorch #193279), so besides equality it asserts the
derivatives are not all zero.

Usage from an op's test file::

    CASES = [OpCase("sigmoid", torchfn.ops.sigmoid, reference.sigmoid, _SigmoidFn.apply)]

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("diff", DIFFS)
    def test_matrix(case, mode, diff, device):
        assert_matrix_case(case, mode, diff, device)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MODES = ("eager", "compiled")
DIFFS = ("backward", "grad", "vmap_grad", "grad_grad")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
        ],
    ),
]

# Tolerances for kernel-vs-twin comparisons, per dtype (the kernels compute half/bfloat16 in
# float and round once, like torch; float32 may differ from torch's own kernel by a few ulp).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-14},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
    torch.float16: {"rtol": 4e-3, "atol": 1e-3},  # up to ~2 ulp: torch rounds mid-way
}


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op under test, with its extra arguments bound.

    ``op``: the public, dispatching function; ``twin``: the pure-PyTorch reference;
    ``function``: the ``autograd.Function``'s ``apply`` (kernel, no dispatch rule).
    """

    name: str
    op: Callable[[Tensor], Tensor]
    twin: Callable[[Tensor], Tensor]
    function: Callable[[Tensor], Tensor]

    def __str__(self) -> str:
        return self.name


def _loss(fn: Callable[[Tensor], Tensor], weight: Tensor) -> Callable[[Tensor], Tensor]:
    # Squared output: second derivatives are non-zero even for piecewise-linear ops.
    return lambda x: (weight * fn(x) ** 2).sum()


def derivative(
    diff: str,
    fn: Callable[[Tensor], Tensor],
    x: Tensor,
    weight: Tensor,
    direction: Tensor,
    compiled: bool = False,
    backend: str = "aot_eager",
) -> Tensor:
    """Return d/dx of ``sum(weight * fn(x)**2)`` the way ``diff`` names.

    ``backward``: ``loss.backward()``; ``grad``: ``torch.func.grad``; ``vmap_grad``: per-row
    gradients ``vmap(grad)`` over dim 0 of ``x``; ``grad_grad``: the Hessian-vector product
    ``grad(<grad(loss), direction>)``. ``compiled`` wraps the whole step in
    ``torch.compile(fullgraph=True)``. ``weight``/``direction`` have the shape of ``x[0]``.
    """
    loss = _loss(fn, weight)
    if diff == "backward":
        def step(x: Tensor) -> Tensor:
            return loss(x)

        if compiled:
            step = torch.compile(step, backend=backend, fullgraph=True)
        leaf = x.detach().clone().requires_grad_(True)
        step(leaf).backward()
        assert leaf.grad is not None
        return leaf.grad
    if diff == "grad":
        transform = torch.func.grad(loss)
    elif diff == "vmap_grad":
        transform = torch.func.vmap(torch.func.grad(loss))
    elif diff == "grad_grad":
        inner = torch.func.grad(loss)
        transform = torch.func.grad(lambda x: (inner(x) * direction).sum())
    else:
        raise ValueError(f"derivative(diff={diff!r}): expected one of {DIFFS}")
    if compiled:
        transform = torch.compile(transform, backend=backend, fullgraph=True)
    return transform(x)


def matrix_inputs(device: str, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Return float64 ``(x (4, 5), weight (5,), direction (5,))`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    weight = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    direction = torch.randn(5, generator=gen, dtype=torch.float64)
    return x.to(device), weight.to(device), direction.to(device)


def assert_matrix_case(
    case: OpCase,
    mode: str,
    diff: str,
    device: str,
    backend: str | None = None,
    use: str = "op",
) -> None:
    """Assert that ``case.<use>`` differentiated per ``(mode, diff)`` equals the twin.

    ``use="op"`` tests the public op (with its dispatch rule); ``use="function"`` the raw
    ``autograd.Function``. ``backend`` defaults to ``aot_eager``: AOTAutograd is where the
    bug lives (it reproduces with it), and it skips Inductor's slow code generation.
    """
    if mode not in MODES:
        raise ValueError(f"assert_matrix_case(mode={mode!r}): expected one of {MODES}")
    x, weight, direction = matrix_inputs(device)
    backend = backend or "aot_eager"
    fn = case.op if use == "op" else case.function
    got = derivative(diff, fn, x, weight, direction, compiled=mode == "compiled",
                     backend=backend)
    want = derivative(diff, case.twin, x, weight, direction)
    assert want.abs().sum() > 0, "the reference derivative is all zeros; the test is too weak"
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def assert_close_for_dtype(got: Tensor, want: Tensor) -> None:
    """Assert kernel output ``got`` equals twin output ``want`` within the dtype's tolerance."""
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOLERANCES[want.dtype])


def need_device(kernels: dict, device: str) -> None:
    """Fail (not skip) when the kernels were built but not for ``device``."""
    assert device in kernels["devices"], (
        f"no {device} kernels were built ({kernels['cuda_reason']})"
    )


class OpLog(TorchDispatchMode):
    """Records ``(op name, largest numel among its tensor arguments and results)`` per op run."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, Tensor)]
        self.ops.append((func._schema.name, max(sizes, default=0)))
        return out
