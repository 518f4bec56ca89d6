"""A compiled step that says when it compiles and how long that took.

The first call of a compiled step can take minutes (Dynamo traces, AOTAutograd builds the
joint graph, Inductor generates and builds kernels) and prints nothing. :func:`compile_step`
wraps ``torch.compile`` so the wait is announced before it starts and timed when it ends.

Which calls compile is read from Dynamo's compile-start callback (``torch._dynamo``'s
``callback_handler``; torch 2.13 has no ``torch.compiler`` equivalent), registered only for
the duration of each call and only for compiles in the calling thread, so a recompile (a new
input shape, dtype or guarded value) is reported too. Without that hook the first call is
still announced and timed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchfn._checks import _compile_kwargs

__all__ = ["CompiledStep", "compile_step"]

_LOGGER = logging.getLogger("torchfn.compile")


def _callback_handler() -> Any:
    """Return Dynamo's compile callback handler, or ``None`` where this torch has none."""
    dynamo = getattr(torch, "_dynamo", None)
    handler = getattr(dynamo, "callback_handler", None)
    needed = ("register_start_callback", "remove_start_callback")
    return handler if all(hasattr(handler, n) for n in needed) else None


def _trace_autograd_ops() -> Any:
    """Return a context in which Dynamo traces ``torch.autograd.grad`` into the graph instead of
    refusing it (``torch._dynamo.config.trace_autograd_ops``, off by default in torch 2.13; a
    null context where this torch has no such switch). The compiled meta-gradient of
    ``MetaLearner(compile_regions=True)`` needs it; other steps never call autograd.grad."""
    config = torch._dynamo.config
    if not hasattr(config, "trace_autograd_ops"):
        return contextlib.nullcontext()
    return config.patch(trace_autograd_ops=True)


class CompiledStep:
    """``torch.compile(step)`` that logs each compile: ``compiling <name> ...``, then the time.

    Built by :func:`compile_step`. Calling it returns exactly what the compiled step returns.
    ``__wrapped__`` is the uncompiled step, ``compiled`` the ``torch.compile`` object,
    ``compile_seconds`` the wall time of each compile so far (first call first).
    """

    def __init__(self, step: Callable[..., Any], compiled: Callable[..., Any], name: str,
                 log: logging.Logger | Callable[[str], Any] | None) -> None:
        self.__wrapped__ = step
        self.__name__ = name
        self.__qualname__ = name
        self.__doc__ = getattr(step, "__doc__", None)
        self.compiled = compiled
        self.compile_seconds: list[float] = []
        self._log = log
        self._calls = 0

    def _say(self, msg: str) -> None:
        if self._log is None:
            return
        if isinstance(self._log, logging.Logger):
            self._log.info(msg)
        else:
            self._log(msg)

    def _announce(self) -> None:
        if self._calls == 1:
            self._say(f"compiling {self.__name__} (first call; this can take minutes)...")
        else:
            self._say(f"recompiling {self.__name__} (call {self._calls}: an input's shape, "
                      f"dtype or a guarded value changed)...")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        handler = _callback_handler()
        started: list[float] = []
        if handler is None:
            if self._calls == 1:
                self._announce()
                started.append(time.perf_counter())
            with _trace_autograd_ops():
                return self._timed(self.compiled(*args, **kwargs), started)
        caller = threading.get_ident()

        def on_start(_: Any) -> None:
            if threading.get_ident() == caller and not started:
                self._announce()
                started.append(time.perf_counter())

        handler.register_start_callback(on_start)
        try:
            with _trace_autograd_ops():
                out = self.compiled(*args, **kwargs)
        finally:
            handler.remove_start_callback(on_start)
        return self._timed(out, started)

    def _timed(self, out: Any, started: list[float]) -> Any:
        if started:
            seconds = time.perf_counter() - started[0]
            self.compile_seconds.append(seconds)
            verb = "compiled" if len(self.compile_seconds) == 1 else "recompiled"
            self._say(f"{verb} {self.__name__} in {seconds:.1f} s")
        return out

    def __repr__(self) -> str:
        return f"CompiledStep({self.__name__}, compiles={len(self.compile_seconds)})"


def compile_step(step: Callable[..., Any], *, name: str | None = None,
                 log: logging.Logger | Callable[[str], Any] | None = _LOGGER,
                 **compile_kwargs: Any) -> CompiledStep:
    """Return ``torch.compile(step, fullgraph=True, **compile_kwargs)`` that logs its compiles.

    Before a call compiles, it logs ``compiling <name> (first call; this can take
    minutes)...`` (``recompiling <name> ...`` for a later compile), and after it
    ``compiled <name> in 12.3 s``. Results are the compiled step's, unchanged.
    ``name`` defaults to the step's ``__name__`` (or its type's name). ``log`` is a
    ``logging.Logger`` (default ``logging.getLogger("torchfn.compile")`` at INFO level: call
    ``logging.basicConfig(level=logging.INFO)`` to see it), any ``print``-like callable, or
    ``None`` for silence. ``compile_kwargs`` go to ``torch.compile``; a step with an
    ``inductor_options`` attribute gets those options unless a mode, options or another
    backend is given (as :func:`make_graphed_step` does).

    :func:`make_graphed_step` compiles its step itself: give it the plain step (its first
    call is not announced), or a ``compile_step`` result with ``compile=False``.

    Example:
        >>> import torch
        >>> from torchfn.compile import compile_step
        >>> def step(x):
        ...     return torch.sin(x) * 2
        >>> cstep = compile_step(step, log=print, backend="eager")
        >>> x = torch.randn(3)
        >>> y = cstep(x)  # doctest: +ELLIPSIS
        compiling step (first call; this can take minutes)...
        compiled step in ... s
        >>> torch.equal(cstep(x), y), cstep.__wrapped__ is step
        (True, True)
        >>> torch.compiler.reset()  # frees the compiled code (and its guards on these globals)
    """
    if not callable(step):
        raise TypeError(f"compile_step(step=...): expected a callable step, got "
                        f"{type(step).__name__}")
    if log is not None and not (isinstance(log, logging.Logger) or callable(log)):
        raise TypeError(f"compile_step(log=...): expected a logging.Logger, a callable taking "
                        f"a string, or None, got {type(log).__name__}")
    if name is None:
        name = getattr(step, "__name__", None) or type(step).__name__
    kwargs = _compile_kwargs(compile_kwargs, getattr(step, "inductor_options", None))
    return CompiledStep(step, torch.compile(step, **kwargs), name, log)
