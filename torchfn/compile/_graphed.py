"""A whole pure training step as one CUDA graph, its state donated and updated in place.

A compiled millisecond step spends most of its time on the host: Dynamo's guards, then the
Python wrapper launching each Inductor kernel. A CUDA graph replays all of the step's kernels
with one launch. ``torch.compile(mode="reduce-overhead")`` does that too, but its outputs live
in a memory pool that the next call reuses, while a training step's outputs are its next inputs
(the state must be cloned after each call: one extra copy of everything).

:func:`make_graphed_step` instead donates the state, as ``jax.jit(donate_argnums=...)`` does:
it owns one copy of the state on the device, the captured step writes the new state into it
(compiled, Inductor writes the updated parameters and optimizer moments straight into the old
buffers) and a call is: copy the batch into the graph's input buffers, one replay. On a CPU
state there is nothing to capture: the same in-place step runs (compiled or not), with the same
semantics, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from torchfn._checks import _compile_kwargs

__all__ = ["GraphedStep", "make_graphed_step"]

Step = Callable[..., tuple[Any, Any]]


def _path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)


def _copy_into(dst: Any, src: Any, where: str) -> None:
    """Copy the pytree ``src`` into the tensors of ``dst`` (same structure), leaf by leaf.

    Plain Python over dict/tuple/list/NamedTuple so that Dynamo traces it (optree's flatten of
    a dict does not trace); a leaf that ``src`` passes through unchanged is not copied.
    """
    if isinstance(dst, Tensor):
        if not isinstance(src, Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            got = (f"{tuple(src.shape)} {src.dtype}" if isinstance(src, Tensor)
                   else type(src).__name__)
            raise ValueError(
                f"graphed step: step(state, ...) must return a new state with the structure, "
                f"shapes and dtypes of the state; state{where} was {tuple(dst.shape)} "
                f"{dst.dtype}, the step returned {got}"
            )
        if src is not dst:
            dst.copy_(src)
    elif isinstance(dst, dict):
        if not isinstance(src, dict) or list(src) != list(dst):
            raise ValueError(f"graphed step: the new state{where} must be a dict with the keys "
                             f"{list(dst)}, got {type(src).__name__}")
        for k in dst:
            _copy_into(dst[k], src[k], f"{where}[{k!r}]")
    elif isinstance(dst, (tuple, list)):
        if type(src) is not type(dst) or len(src) != len(dst):
            raise ValueError(f"graphed step: the new state{where} must be a "
                             f"{type(dst).__name__} of length {len(dst)}, got "
                             f"{type(src).__name__}")
        for i, (a, b) in enumerate(zip(dst, src, strict=True)):
            _copy_into(a, b, f"{where}[{i}]")
    elif dst is not None and src != dst:
        raise ValueError(f"graphed step: the new state{where} must equal the constant "
                         f"{dst!r}, got {src!r}")


def _first_device(leaves: list[Any]) -> torch.device:
    return next((t.device for t in leaves if isinstance(t, Tensor) and t.device.type == "cuda"),
                torch.device("cpu"))


class GraphedStep:
    """``step(state, *args) -> (new_state, outputs)`` replayed as one CUDA graph, state donated.

    Built by :func:`make_graphed_step`. Calling it returns ``(state, outputs)`` where ``state``
    is always the same object, owned by this step, whose tensors the next call overwrites
    (pass it straight back in: that costs nothing); passing any other state copies it in first
    (resuming from a checkpoint). ``outputs`` (metrics) are overwritten by the next call too:
    clone what you keep. ``args`` are copied into the graph's input buffers each call; they
    must keep the shapes, dtypes and structure of the example args. Those buffers are
    :attr:`inputs`: a loader that writes the next batch into them in place, called as
    ``step(state, *step.inputs)``, saves that device-to-device copy.
    Attributes: ``device``, ``graphed`` (True when a CUDA graph was captured), ``inputs``.
    """

    def __init__(self, step: Step, state: Any, args: tuple[Any, ...], *,
                 compile: bool | dict[str, Any], warmup: int) -> None:
        if not callable(step):
            raise TypeError(f"make_graphed_step(step=...): expected a callable "
                            f"step(state, *args) -> (new_state, outputs), got "
                            f"{type(step).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"make_graphed_step(warmup=...): expected an int >= 1, got "
                             f"{warmup!r}")
        if not isinstance(compile, (bool, dict)):
            raise TypeError(f"make_graphed_step(compile=...): expected a bool or a dict of "
                            f"torch.compile arguments, got {type(compile).__name__}")
        s_paths, s_leaves, self._state_def = optree.tree_flatten_with_path(state)
        if not any(isinstance(t, Tensor) for t in s_leaves):
            raise ValueError("make_graphed_step(state=...): the state holds no tensors")
        self.device = _first_device(s_leaves + optree.tree_leaves(args))
        for path, t in zip(s_paths, s_leaves, strict=True):
            if isinstance(t, Tensor) and t.device != self.device and t.device.type != "cpu":
                raise ValueError(f"make_graphed_step(state=...): state{_path(path)} is on "
                                 f"{t.device}, the step runs on {self.device}")
        # the step's own copies: every tensor on the device (CPU scalars such as
        # TrainState.step too -- a CPU op would run once at capture, never at replay)
        self._state = optree.tree_map(self._own, state)
        self._s_leaves = optree.tree_leaves(self._state)
        self._a_paths, _, self._args_def = optree.tree_flatten_with_path(args)
        self._args = optree.tree_map(self._own, args)
        self._a_leaves = optree.tree_leaves(self._args)

        def inplace(state: Any, args: tuple[Any, ...]) -> Any:
            result = step(state, *args)
            if not isinstance(result, tuple) or len(result) != 2:
                raise TypeError(f"graphed step: step(state, *args) must return (new_state, "
                                f"outputs), got {type(result).__name__}")
            _copy_into(state, result[0], "")
            return result[1]

        self._eager = inplace
        if compile is False:
            self._fn: Callable[..., Any] = inplace
        else:
            needed = getattr(step, "inductor_options", None)  # e.g. DPTrainStep's
            self._fn = torch.compile(inplace, **_compile_kwargs(
                compile if isinstance(compile, dict) else {},
                needed if isinstance(needed, Mapping) else None))
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: Any = None
        if self.device.type == "cuda":
            self._capture(warmup)
        else:
            self._first_call(self._state, self._args)  # compile now, surface errors now
        self._load_state(state)  # the warm-up stepped the step's copy: restore the user's

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    @property
    def inputs(self) -> tuple[Any, ...]:
        """The graph's own input buffers, structured like the example ``args``.

        Write the next batch into them in place (``step.inputs[0].copy_(x, non_blocking=True)``)
        and call ``step(state, *step.inputs)``: arguments that are these very tensors are not
        copied again.
        """
        return self._args

    def _own(self, x: Any) -> Any:
        return x.detach().to(self.device, copy=True) if isinstance(x, Tensor) else x

    def _first_call(self, state: Any, args: tuple[Any, ...]) -> Any:
        try:
            return self._fn(state, args)
        except Exception:
            if self._fn is self._eager:
                raise
            # compile errors hide the user's mistake ("Observed exception"): run the same
            # step eagerly on the step's scratch copy to raise the plain error, if there is one
            self._eager(state, args)
            raise

    def _capture(self, warmup: int) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._first_call(self._state, self._args)
            for _ in range(warmup - 1):
                self._fn(self._state, self._args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._out = self._fn(self._state, self._args)
        except Exception as err:
            raise RuntimeError(
                "make_graphed_step: the step could not be captured as a CUDA graph. A "
                "captured step must not synchronise with the host (.item(), printing a "
                "tensor, data-dependent shapes such as nonzero or boolean masking) and must "
                "not use CPU tensors; an eager make_train_step / ensemble step reads its step "
                "counter on the host to seed randomness: pass seed_rng=False, or compile=True. "
                f"Original error: {type(err).__name__}: {err}"
            ) from err
        self._graph = graph

    def _load_state(self, state: Any) -> None:
        paths, leaves, treedef = optree.tree_flatten_with_path(state)
        if treedef != self._state_def:
            raise ValueError(f"graphed step: the state must have the structure of the example "
                             f"state, {self._state_def}; got {treedef}")
        for path, t, own in zip(paths, leaves, self._s_leaves, strict=True):
            _check_leaf("state", path, t, own)
            if isinstance(own, Tensor):
                own.copy_(t)

    def _check_args(self, args: tuple[Any, ...]) -> list[Any]:
        leaves, treedef = optree.tree_flatten(args)
        if treedef != self._args_def:
            raise ValueError(f"graphed step: the arguments after state must have the "
                             f"structure of the example arguments, {self._args_def}; got "
                             f"{treedef}")
        for path, t, own in zip(self._a_paths, leaves, self._a_leaves, strict=True):
            if t is not own:
                _check_leaf("args", path, t, own)
        return leaves

    def __call__(self, state: Any, *args: Any) -> tuple[Any, Any]:
        """Run one step: ``(state, outputs)``; ``state`` is this step's own (donated) copy."""
        if state is not self._state:
            self._load_state(state)
        leaves = self._check_args(args)
        if self._graph is None:  # nothing captured: the in-place step on the args as given
            return self._state, self._fn(self._state, args)
        for t, own in zip(leaves, self._a_leaves, strict=True):
            if isinstance(own, Tensor) and t is not own:
                own.copy_(t, non_blocking=True)
        self._graph.replay()
        return self._state, self._out


def _describe(x: Any) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def _check_leaf(kind: str, path: tuple[Any, ...], got: Any, own: Any) -> None:
    """Raise unless ``got`` can stand for the captured leaf ``own`` (``kind``: state or args)."""
    if isinstance(own, Tensor):
        if not isinstance(got, Tensor) or got.shape != own.shape or got.dtype != own.dtype:
            raise ValueError(f"graphed step: {kind}{_path(path)} must be {tuple(own.shape)} "
                             f"{own.dtype} like the example {kind}, got {_describe(got)}")
    elif got != own:
        raise ValueError(f"graphed step: {kind}{_path(path)} must equal {own!r} (a constant "
                         f"of the captured step), got {got!r}")


def make_graphed_step(step: Step, state: Any, *args: Any, compile: bool | dict[str, Any] = True,
                      warmup: int = 2) -> GraphedStep:
    """Return ``step`` as a :class:`GraphedStep`: one CUDA graph, the state donated.

    ``step(state, *args) -> (new_state, outputs)`` is any pure step whose new state has the
    state's structure, shapes and dtypes: :func:`make_train_step`, the ensemble step,
    :class:`DPTrainStep`, a meta step. ``state`` and ``args`` are examples (their values are
    not stepped: warm-up runs on the graph's own copy, which then receives ``state``).
    ``compile``: ``True`` wraps the in-place step in ``torch.compile(fullgraph=True)`` -- then
    Inductor writes the new state straight into the old buffers -- a dict gives more
    ``torch.compile`` arguments (e.g. ``{"options": {...}}``), ``False`` captures the eager
    step (eager steps may take a slower generic path inside the capture). A step with an
    ``inductor_options`` attribute (every torchfn step: buffer reuse off) gets those options
    unless the ``compile`` dict names a mode, options or another backend.
    ``warmup`` calls run on a side stream before capture (the first compiles).

    The step must be capturable: no host synchronisation (``.item()``, printing, data-dependent
    shapes), no CPU tensor ops -- all state tensors are moved to the device of the first CUDA
    tensor in ``state``/``args`` (``TrainState.step``/``seed`` included, so an eager ensemble
    step with ``seed_rng`` cannot be captured; a compiled one can). On a state with no CUDA
    tensor nothing is captured: the in-place step runs as is (same results and semantics).

    Calls return ``(state, outputs)`` where ``state`` is the step's own copy, overwritten by the
    next call (as ``jax.jit``'s ``donate_argnums``): feed it back, clone what you keep. The
    results equal calling ``step`` (compiled) directly, step after step. Each call copies
    ``args`` into the graph's input buffers, unless they are those buffers: write the next
    batch into :attr:`GraphedStep.inputs` and call ``step(state, *step.inputs)`` to skip the
    copy (a small saving per step, visible when steps are short).

    Example:
        >>> import torch
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state, make_train_step
        >>> from torchfn.compile import make_graphed_step
        >>> def model_fn(params, buffers, x):
        ...     return x @ params["w"], buffers
        >>> def loss_fn(out, y):
        ...     return ((out - y) ** 2).mean()
        >>> opt = adam(1e-2)
        >>> state = init_train_state({"w": torch.zeros(3, 1)}, {}, opt, seed=0)
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> step = make_graphed_step(make_train_step(model_fn, loss_fn, opt), state, (x, y),
        ...                          compile=False)
        >>> for _ in range(3):
        ...     state, metrics = step(state, (x, y))
        >>> int(state.step), step.graphed
        (3, False)
    """
    return GraphedStep(step, state, args, compile=compile, warmup=warmup)
