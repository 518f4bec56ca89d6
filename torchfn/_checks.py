"""Shared private validators and small helpers: the one torchfn module every package may import.

It imports only ``torch`` and the standard library, so ``torchfn.data`` (which stands alone)
and ``torchfn.ops`` (at the bottom of the dependency order) may use it too; a helper belongs
here when more than one package needs it. Nothing here is public API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_LOW = (torch.float16, torch.bfloat16)


def _fmt(shape: Any) -> str:
    return str(tuple(shape))


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """Return the compute dtype of the stacked-optimizer ops: float64 or float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _resolve_seed(seed: int | torch.Generator, owner: str) -> int:
    """Return an int seed: ``seed`` itself, or one 63-bit draw from the given generator."""
    if isinstance(seed, torch.Generator):
        return int(torch.randint(0, 2**62, (1,), generator=seed, device=seed.device).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"{owner}(seed=...): expected an int or a torch.Generator, got {type(seed).__name__}"
        )
    return seed


def _check_rank(world_size: int, rank: int, owner: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{owner}(world_size={world_size!r}): expected an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"{owner}(rank={rank!r}, world_size={world_size}): expected 0 <= rank < world_size"
        )


def _compile_kwargs(kwargs: Mapping[str, Any], options: Mapping[str, Any] | None
                   ) -> dict[str, Any]:
    """Return ``torch.compile`` ``kwargs`` (``fullgraph=True`` by default) with Inductor
    ``options`` a step needs added, unless the caller picked a mode, options or another
    backend (``torch.compile`` takes a mode or options, not both)."""
    out = {"fullgraph": True, **kwargs}
    if (options is not None and "mode" not in out and "options" not in out
            and out.get("backend", "inductor") == "inductor"):
        out["options"] = dict(options)
    return out


def check_float_tensor(op: str, arg: str, x: object) -> None:
    """Raise a clear error unless ``x`` is a float16/bfloat16/float32/float64 tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(
            f"torchfn.ops.{op}({arg}=...): expected {arg} to be a torch.Tensor, "
            f"got {type(x).__name__}"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"torchfn.ops.{op}({arg}=...): expected a floating-point tensor (float32, "
            f"float64, float16 or bfloat16), got {arg}.dtype={x.dtype} on device "
            f"{x.device}; convert it first, e.g. {arg}.float()"
        )


def _check_like(op: str, arg: str, t: object, grad: Tensor, state: bool) -> Tensor:
    """``t`` must have grad's shape and device; grad's dtype (or float32 for a state)."""
    check_float_tensor(op, arg, t)
    assert isinstance(t, Tensor)
    if t.shape != grad.shape:
        raise ValueError(
            f"torchfn.ops.{op}({arg}=...): expected {arg} of grad's shape {_fmt(grad.shape)}, "
            f"got {_fmt(t.shape)}"
        )
    if t.device != grad.device:
        raise ValueError(
            f"torchfn.ops.{op}({arg}=...): expected {arg} on grad's device {grad.device}, got "
            f"{t.device}"
        )
    ok = t.dtype == grad.dtype or (state and grad.dtype in _LOW and t.dtype == torch.float32)
    if not ok:
        extra = " (or float32)" if state and grad.dtype in _LOW else ""
        raise TypeError(
            f"torchfn.ops.{op}({arg}=...): expected {arg}.dtype={grad.dtype}{extra} like grad, "
            f"got {t.dtype}"
        )
    return t


def _member_tensor(op: str, arg: str, value: object, grad: Tensor) -> Tensor:
    """Return ``value`` (a float, a 0-d or (N,) tensor) as a tensor in the compute dtype."""
    work = _opmath(grad.dtype)
    n = grad.shape[0]
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(
                f"torchfn.ops.{op}({arg}=...): expected a floating-point tensor, got "
                f"{arg}.dtype={value.dtype}"
            )
        if not (value.ndim == 0 or (value.ndim == 1 and value.shape[0] == n)):
            raise ValueError(
                f"torchfn.ops.{op}({arg}=...): expected a float, a 0-d tensor or a tensor of "
                f"shape (N,) = ({n},) (one value per member; N = grad.shape[0]), got shape "
                f"{_fmt(value.shape)}"
            )
        if value.device != grad.device:
            raise ValueError(
                f"torchfn.ops.{op}({arg}=...): expected {arg} on grad's device {grad.device}, "
                f"got {value.device}; move it once, e.g. {arg}.to({str(grad.device)!r})"
            )
        return value.to(work)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"torchfn.ops.{op}({arg}=...): expected a float or a tensor, got "
            f"{type(value).__name__}"
        )
    return torch.full((), float(value), dtype=work, device=grad.device)


def _n_members(params: Mapping[str, Tensor], where: str) -> int:
    """Return N, the size of dim 0 shared by every leaf of stacked ``params`` (see
    ``torchfn.ensembles.n_members``)."""
    seen: tuple[str, int] | None = None
    for key, value in params.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            raise ValueError(f"{where}: every stacked leaf must be a tensor of shape (N, ...), "
                             f"got {type(value).__name__} "
                             f"{_fmt(value.shape) if isinstance(value, Tensor) else ''} at {key!r}")
        if seen is None:
            seen = (key, value.shape[0])
        elif value.shape[0] != seen[1]:
            raise ValueError(f"{where}: every stacked leaf must have the same N along dim 0; "
                             f"got N={seen[1]} for {seen[0]!r} and N={value.shape[0]} for {key!r}")
    if seen is None:
        raise ValueError(f"{where}: expected at least one stacked parameter, got none")
    return seen[1]


def _replace(state: Any, **changes: Any) -> Any:
    """Return a copy of the NamedTuple ``state`` with ``changes`` applied (like ``_replace``).

    Built field by field, because ``NamedTuple._replace`` inside ``torch.compile`` fails on
    torch 2.11 (Dynamo raises a TypeError while tracing it, or returns an empty tuple) -- and
    every step state is replaced inside a compiled step.
    """
    fields = type(state)._fields
    unknown = set(changes) - set(fields)
    if unknown:
        raise TypeError(f"{type(state).__name__} has no fields {sorted(unknown)}")
    return type(state)(*[changes[f] if f in changes else getattr(state, f) for f in fields])


def _moved_getattr(module: str, moved: Mapping[str, str]) -> Any:
    """Return a module ``__getattr__`` whose AttributeError names the new home of a moved name."""

    def __getattr__(name: str) -> Any:
        if name in moved:
            raise AttributeError(f"{module}.{name} moved to {moved[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
