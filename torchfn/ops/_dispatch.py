"""The rule that picks, per call, a torchfn kernel or its pure-PyTorch reference twin.

A call goes to the twin when

1. ``TORCHFN_OPS=reference``, or the kernels could not be built (warned once), or no kernel
   was compiled for the tensor's device type (e.g. CUDA without a toolkit, MPS, meta);
2. ``torch.compiler.is_compiling()``: Dynamo inlines the ``autograd.Function`` that wraps a
   kernel and, under ``torch.func.grad``, drops its backward -- the C++ guard in
   ``csrc/ops.cpp`` (its Autograd block) turns what would be silently zero gradients into an error,
   and routing to the twin avoids both (Inductor then fuses the twin with its neighbours,
   which for elementwise ops is also the faster choice). An op that is proven safe and faster
   under compile can opt out with ``set_rule(op, compile_ok=True)``;
3. inside two or more ``torch.func`` forward-mode levels (``jacfwd(jacfwd(f))``): torch
   differentiates an ``autograd.Function``'s ``jvp`` rule wrongly there, silently (the outer
   level misses the rule's dependence on the primal; pytorch #197867, reproduced for every
   torchfn op in its tests), so every op uses its twin;
4. a per-op, per-device rule says the twin is faster at this input in eager mode
   (``set_rule(op, device, min_numel=..., min_numel_grad=...)``; ``None``: always the
   twin). ``min_numel_grad`` applies when autograd records the call (the Function's Python
   overhead is paid twice), ``min_numel`` otherwise. The defaults are set next to each op
   from ``benchmarks/ops.py`` runs. Under ``vmap`` the size compared is the whole vmapped
   batch (the kernel runs once on all of it), see :func:`vmapped_numel`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor

from torchfn._checks import check_float_tensor as check_float_tensor
from torchfn.ops import _build

__all__ = [
    "Function",
    "OpRule",
    "functorch_stack",
    "get_rule",
    "nested_forward_ad",
    "plain_backward",
    "set_rule",
    "use_kernel",
    "vmapped_numel",
]



@dataclasses.dataclass(frozen=True)
class OpRule:
    """When one op uses its kernel on one device type.

    ``min_numel``: eager inputs with fewer elements go to the twin (Python and launch
    overhead dominate); ``None``: eager calls always go to the twin (it is faster at every
    size measured). ``min_numel_grad``: the same for calls that autograd records (input
    requires grad and grad mode is on). ``compile_ok``: use the kernel while
    ``torch.compile`` traces (only for ops whose Function is proven correct there by the test
    matrix; none is so far).
    """

    min_numel: int | None = 0
    min_numel_grad: int | None = 0
    compile_ok: bool = False


_RULES: dict[tuple[str, str], OpRule] = {}
_COMPILE_OK: set[tuple[str, str]] = set()  # mirror of compile_ok, cheap to test while tracing


try:  # what torch.autograd.Function.apply itself calls (NOTE: [functorch vjp and autograd ...])
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers
except ImportError:  # pragma: no cover - a torch without it: Function.fast_nargs stays -1
    _unwrap_dead_wrappers = None


class Function(torch.autograd.Function):
    """``torch.autograd.Function`` whose eager ``apply`` skips a per-call ``inspect.signature``.

    ``torch.autograd.Function.apply`` binds every call's arguments to ``forward``'s signature
    (``inspect.signature(...).bind(...).apply_defaults()``, a noticeable host cost per call) to
    fill in defaults. For a ``forward`` whose parameters are all plain positional ones without
    defaults, a call that passes all of them positionally binds to exactly its arguments, so
    this ``apply`` goes straight to the C++ ``apply`` (after the same dead-functorch-wrapper
    unwrapping) in that case outside ``torch.func`` transforms and Dynamo tracing; anything else
    (keyword or missing arguments, transforms, compiling) takes ``torch.autograd.Function.apply``
    unchanged. Dynamo treats every ``autograd.Function`` subclass's ``apply`` itself, so this
    override never runs while compiling.
    """

    fast_nargs: int = -1  # forward's parameter count when the fast path applies, else -1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        params = list(inspect.signature(cls.forward).parameters.values())
        plain = all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params)
        cls.fast_nargs = len(params) if plain and _unwrap_dead_wrappers is not None else -1

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if (kwargs or len(args) != cls.fast_nargs or torch._C._are_functorch_transforms_active()
                or torch.compiler.is_compiling()):
            return super().apply(*args, **kwargs)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))


def set_rule(op: str, device_type: str, **fields: object) -> OpRule:
    """Set (replace fields of) the dispatch rule of ``op`` on ``device_type``; return it.

    Example:
        >>> set_rule("sigmoid", "cuda", min_numel=1 << 16)  # doctest: +SKIP
        OpRule(min_numel=65536, min_numel_grad=0, compile_ok=False)
    """
    rule = dataclasses.replace(get_rule(op, device_type), **fields)  # type: ignore[arg-type]
    _RULES[(op, device_type)] = rule
    if rule.compile_ok:
        _COMPILE_OK.add((op, device_type))
    else:
        _COMPILE_OK.discard((op, device_type))
    return rule


def get_rule(op: str, device_type: str) -> OpRule:
    """Return the dispatch rule of ``op`` on ``device_type`` (the default if none was set)."""
    return _RULES.get((op, device_type), OpRule())


def functorch_stack() -> tuple:
    """Return the active ``torch.func`` interpreters, outermost first (empty outside them).

    torch has no public API for this; the private one is guarded, and a torch without it
    reports no transforms (the ops' own vmap/jvp rules still apply).

    Example:
        >>> import torch
        >>> from torchfn.ops import functorch_stack
        >>> functorch_stack()
        ()
        >>> torch.func.vmap(lambda x: x * len(functorch_stack()))(torch.ones(2))
        tensor([1., 1.])
    """
    if not torch._C._are_functorch_transforms_active():
        return ()
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:  # pragma: no cover - a torch without these internals
        return ()
    return tuple(retrieve_all_functorch_interpreters())


def nested_forward_ad(stack: tuple | None = None) -> bool:
    """Return True inside two or more ``torch.func`` forward-mode levels (``jacfwd(jacfwd)``).

    There torch mis-differentiates an ``autograd.Function``'s ``jvp`` rule (pytorch #197867),
    so the public ops use their twins. Reverse-over-forward and forward-over-reverse
    (``torch.func.hessian``, ``jvp(grad(f))``) are correct and keep the kernels.
    """
    stack = functorch_stack() if stack is None else stack
    if not stack:
        return False
    from torch._C._functorch import TransformType

    return sum(i.key() == TransformType.Jvp for i in stack) >= 2


def vmapped_numel(x: Tensor, stack: tuple | None = None) -> int:
    """Return ``x.numel()`` times the batch size of every enclosing ``vmap`` level.

    Inside ``vmap`` a tensor shows its per-sample shape, but the kernel runs once on the whole
    batch: this is the size that decides whether the kernel pays for its overhead.
    """
    stack = functorch_stack() if stack is None else stack
    numel = x.numel()
    if stack:
        from torch._C._functorch import TransformType

        for interpreter in stack:
            if interpreter.key() == TransformType.Vmap:
                numel *= interpreter.batch_size()
    return numel


def plain_backward() -> bool:
    """Return True inside a plain first-order ``backward`` of an ``autograd.Function``.

    That is: grad mode is off (``backward()``/``autograd.grad`` without ``create_graph``), no
    ``torch.func`` transform and no ``torch.autograd.forward_ad`` level is active, and Dynamo is
    not tracing (compiled autograd). Nothing can then differentiate the backward itself, so a
    Function whose backward is a second Function around a library op (for double backward, vmap
    and jvp) may call that library op directly: the same kernel on the same inputs, without the
    second Function's host overhead (``Function.apply`` binds its arguments with
    ``inspect.signature``, builds a ctx, saves tensors). That overhead is what separates the
    public ops from their raw kernels in ``benchmarks/ops.py`` / ``ops_ghost.py`` (the same
    full-size kernels run in both; the host's Python time is the difference).
    """
    if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return False
    # forward_ad keeps its current level in a module global (-1: no dual level open). A torch
    # without it is treated as "maybe inside one": the Function path, whose jvp rule is right.
    if getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0:
        return False
    return not torch.compiler.is_compiling()


def use_kernel(op: str, x: Tensor) -> bool:
    """Return True when ``op`` should run its compiled kernel on ``x`` (see module doc)."""
    if torch.compiler.is_compiling():
        # Decided from plain Python state only: nothing is built while Dynamo traces.
        return (op, x.device.type) in _COMPILE_OK and _build.is_loaded_for(x.device.type)
    if _build.mode() == "reference":  # also validates TORCHFN_OPS on every eager call
        return False
    stack = functorch_stack()
    if nested_forward_ad(stack):
        return False
    rule = get_rule(op, x.device.type)
    recorded = x.requires_grad and torch.is_grad_enabled()
    min_numel = rule.min_numel_grad if recorded else rule.min_numel
    if min_numel is None or vmapped_numel(x, stack) < min_numel:
        return False
    return _build.has_kernels(x.device.type)


def check_float_scalar(op: str, arg: str, value: object) -> float:
    """Return ``value`` as a float; raise a clear error unless it is a real Python number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"torchfn.ops.{op}({arg}=...): expected {arg} to be a Python float, got "
            f"{type(value).__name__}" + (" (pass a float, e.g. float(t))"
                                         if isinstance(value, Tensor) else "")
        )
    return float(value)
