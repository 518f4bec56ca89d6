"""Shared private validators and small helpers: the one torchfn module every package may import.

It imports only ``torch`` and the standard library, so ``torchfn.data`` (which stands alone)
and ``torchfn.ops`` (at the bottom of the dependency order) may use it too; a helper belongs
here when more than one package needs it. Nothing here is public API.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from types import MappingProxyType
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


def compute_once(t: Tensor) -> Tensor:
    """Return ``t`` itself; while compiling, as a buffer Inductor computes once.

    For the small tensors that every element of a large elementwise kernel reads, such as
    Adam's bias corrections ``1 / (1 - beta**count)``: Inductor inlines a cheap-looking
    pointwise producer into each consumer kernel, so without this the float64 ``pow`` and
    division run once per parameter element (compute-bound at a GPU's float64 throughput).
    ``as_strided`` with the tensor's own layout is an identity whose lowering materialises its
    input (an undocumented Inductor behaviour; ``tests/test_optim.py`` pins it on the CPU).
    Eager calls return ``t`` unchanged, so eager results are the same bits.
    """
    if not torch.compiler.is_compiling():
        return t
    return torch.as_strided(t, t.shape, t.stride())


def _resolve_seed(seed: int | torch.Generator, owner: str) -> int:
    """Return an int seed: ``seed`` itself, or one 63-bit draw from the given generator."""
    if isinstance(seed, torch.Generator):
        return int(torch.randint(0, 2**62, (1,), generator=seed, device=seed.device).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"{owner}(seed=...): expected an int or a torch.Generator, got {type(seed).__name__}"
        )
    return seed


_NO_PART = contextlib.nullcontext()


def _part(name: str) -> contextlib.AbstractContextManager[Any]:
    """Return a ``torch.profiler.record_function(name)`` context that names a part of a step
    in profiler traces (``"torchfn.clip"``, ``"torchfn.inner_loop"``, ...), or a null context.

    Null while compiling (Dynamo ignores ``record_function`` and logs that it does; a compiled
    step shows as its compiled regions instead) and while no profiler runs: a
    ``record_function`` costs a dispatcher call (several microseconds) even then, so the
    check keeps the annotations free. ``torch._C._autograd._profiler_enabled`` is private; no
    public query of the profiler state exists in torch 2.13, and this is its one use.
    """
    if torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled():
        return _NO_PART
    return torch.profiler.record_function(name)


# Off only to compare the multi-tensor fast paths with the per-leaf loops they replace (tests,
# benchmarks/optim_overhead.py); never needed for correctness.
_USE_FOREACH = True

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _foreach_ok(*lists: Any) -> bool:
    """Whether ``torch._foreach_*`` multi-tensor ops may replace a per-leaf loop of the same
    single-tensor ops over the tensors in ``lists`` (each a sequence of tensors).

    True only in eager mode (while compiling, Dynamo cannot tell whether a ``torch.func``
    transform is active; Inductor fuses each leaf's loop body into one kernel per leaf, and a
    caller that knows it runs outside every transform may use the multi-tensor ops there too,
    which Inductor groups across leaves: see the DP step's ``_noisy_sums``), outside every
    ``torch.func`` transform (the foreach ops have no batching or functorch
    grad rules) and when no tensor is tracked by autograd (grad mode on and
    ``requires_grad``: meta-learning differentiates through an update with
    ``create_graph=True`` or ``torch.func.grad``), and when every item is a plain dense strided
    tensor (``Tensor`` or ``Parameter``: no ``None``, subclass such as ``DTensor``, sparse,
    nested, quantized or functorch-wrapped tensor). The foreach ops then compute exactly what
    the per-leaf loop computes: on CPU they run that loop in C++; on CUDA one kernel per
    (device, dtype) group where shapes allow, which callers group for.
    """
    if not _USE_FOREACH or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    grad_on = torch.is_grad_enabled()
    for ts in lists:
        for t in ts:
            if (type(t) not in _PLAIN or t.layout is not torch.strided or t.is_nested
                    or t.is_quantized or (grad_on and t.requires_grad) or wrapped(t)):
                return False
    return True


def _foreach_map(fn: Any, lists: Any, scalars: Any = ()) -> tuple[list[Any], ...] | None:
    """Run a multi-tensor ``fn`` once per (device, dtypes) group of leaves, or return ``None``.

    ``lists`` are equally long sequences of tensors whose ``i``-th items have one shape;
    ``scalars`` are sequences of 0-d tensors, one per leaf. ``fn(*group_lists, *group_scalars)``
    gets the items of one group (one device, one dtype per list: one kernel each on CUDA) and
    returns a tuple of output lists; the result scatters them back into leaf order. ``None``
    (the caller then runs its per-leaf loop) unless :func:`_foreach_ok` holds and each leaf's
    items agree in shape and device.
    """
    every = (*lists, *scalars)
    if not every or not _foreach_ok(*every):
        return None
    n = len(every[0])
    if n == 0 or any(len(ts) != n for ts in every):
        return None
    firsts = every[0]
    for ts in lists[1:]:
        for a, b in zip(firsts, ts, strict=True):
            if a.shape != b.shape:
                return None
    for ts in every[1:]:
        for a, b in zip(firsts, ts, strict=True):
            if a.device != b.device:
                return None
    for ts in scalars:
        for t in ts:
            if t.ndim != 0:
                return None
    keys = zip([t.device for t in firsts], *([t.dtype for t in ts] for ts in every), strict=True)
    groups: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    if len(groups) == 1:
        return tuple(list(r) for r in fn(*every))
    out: list[list[Any]] | None = None
    for idx in groups.values():
        res = fn(*([ts[i] for i in idx] for ts in every))
        if out is None:
            out = [[None] * n for _ in res]
        for full, part in zip(out, res, strict=True):
            for i, r in zip(idx, part, strict=True):
                full[i] = r
    assert out is not None
    return tuple(out)


def _check_rank(world_size: int, rank: int, owner: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{owner}(world_size={world_size!r}): expected an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"{owner}(rank={rank!r}, world_size={world_size}): expected 0 <= rank < world_size"
        )


#: Inductor options every compiled torchfn step gets from :func:`torchfn.compile.compile_step`,
#: :func:`torchfn.compile.make_graphed_step` and the steps' own ``compile`` methods (the
#: ``inductor_options`` attribute of each step). Inductor's pooled buffer reuse can hand a
#: CUDA kernel a buffer that lives on the CPU at run time, and the launch then fails ("CUDA
#: driver error: invalid argument"; Triton: "Pointer argument ... cannot be accessed from
#: Triton (cpu tensor?)"). Seen on torch 2.11: the 0-d int64 philox seed/offset outputs of
#: ``_scaled_dot_product_efficient_attention`` (CPU tensors at run time) reused for an Adam
#: step count in a 117M decoder's train step, and a reused buffer in the DP step's noise-key
#: kernel. Without reuse the caching allocator still recycles freed memory.
STEP_INDUCTOR_OPTIONS: Mapping[str, Any] = MappingProxyType({"allow_buffer_reuse": False})


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


# -- errors that models raise inside torch.func transforms ----------------------------------------
# torchfn's entry points that run a user's model under vmap/grad (per-sample gradients, the meta
# learners, the train steps, DP/ghost) turn these raw torch errors into messages that name the
# torchfn keyword or function that fixes them. Match on the exception text: torch raises plain
# RuntimeErrors (under torch.compile wrapped in other types with the same text).

_RANDOMNESS = ("error", "different", "same")

# vmap(randomness="error") meeting a random op (dropout in training mode)
_VMAP_RANDOMNESS_TEXT = "called random operation while in randomness error mode"
# torch.utils.checkpoint(use_reentrant=False) under torch.func.grad/vjp
_SAVED_HOOKS_TEXT = "don't yet support saved tensor hooks"
# torch.utils.checkpoint(use_reentrant=True): an old-style autograd.Function under any transform
_SETUP_CONTEXT_TEXT = "it must override the setup_context staticmethod"
# torch.utils.checkpoint(use_reentrant=False) in a forward under vmap whose backward runs in plain
# autograd afterwards (the eager ensemble step): the recomputation in the unpack hook replays the
# forward outside vmap on tensors saved inside it
_ESCAPED_TEXT = "escaped from inside a function being vmapped"


def _check_randomness(randomness: object, where: str) -> str:
    """Return ``randomness`` if it is one of vmap's modes, else raise naming the call."""
    if randomness not in _RANDOMNESS:
        raise ValueError(f"{where}: randomness must be one of {_RANDOMNESS}, got {randomness!r}")
    return str(randomness)


def _is_vmap_randomness_error(exc: BaseException) -> bool:
    """Return True if ``exc`` is vmap's refusal of a random op under ``randomness="error"``."""
    return _VMAP_RANDOMNESS_TEXT in str(exc)


# torch 2.11 under vmap: checkpoint's own autograd.Function (defined in torch/utils/checkpoint.py)
_NOOP_SAVE_INPUTS_TEXT = "You tried to vmap over _NoopSaveInputs"


def _is_torch_checkpoint_error(exc: BaseException) -> bool:
    """Return True if ``exc`` is torch.utils.checkpoint failing inside a torch.func transform.

    Non-reentrant checkpointing (``use_reentrant=False``, the default) fails under
    ``torch.func.grad``/``vjp`` with "torch.func.{grad, vjp, jacrev, hessian} don't yet support
    saved tensor hooks"; the reentrant form fails under any transform with "In order to use an
    autograd.Function with functorch transforms ... it must override the setup_context
    staticmethod", which any old-style autograd.Function raises too, so that one counts only
    when torch/utils/checkpoint.py is on the traceback. A forward run under ``vmap`` with a
    plain-autograd backward afterwards fails in the recomputation with "Either your tensor may
    have escaped from inside a function being vmapped ..." (``gen_vmap_plumbing``), which any
    escaped tensor raises too, so that one also counts only with checkpoint.py on the traceback.
    Under ``vmap`` torch 2.11 says "You tried to vmap over _NoopSaveInputs" (checkpoint's own
    Function).
    """
    text = str(exc)
    if _SAVED_HOOKS_TEXT in text or _NOOP_SAVE_INPUTS_TEXT in text:
        return True
    if _SETUP_CONTEXT_TEXT not in text and _ESCAPED_TEXT not in text:
        return False
    return _on_traceback(exc, "torch/utils/checkpoint.py")


# vmap refusing a data-dependent check, here inside transformers' mask creation
# (`padding_mask.all()` in masking_utils) when the 2D attention mask is per-sample. torch words
# it "vmap: It looks like you're either (1) calling .item() on a Tensor ..." or "vmap: It looks
# like you're attempting to use a Tensor in some data-dependent control flow ..." by the path.
_VMAP_ITEM_TEXT = "vmap: It looks like you're"


def _on_traceback(exc: BaseException, suffix: str) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(suffix):
            return True
        tb = tb.tb_next
    return False


def _is_hf_mask_vmap_error(exc: BaseException) -> bool:
    """Return True if ``exc`` is vmap refusing transformers' data-dependent mask check."""
    return _VMAP_ITEM_TEXT in str(exc) and _on_traceback(exc, "transformers/masking_utils.py")


def _hf_mask_message(where: str, exc: BaseException) -> str:
    return (
        f"{where}: the Hugging Face model builds its attention mask with a data-dependent check "
        "(`padding_mask.all()` in transformers/masking_utils.py), which vmap cannot run on a "
        "mask that differs per sample, task or member. Pass the mask in 4D additive form, which "
        "transformers uses as given: attention_mask = (1.0 - mask[..., None, None, :].to(dtype)) "
        "* torch.finfo(dtype).min (shape (B, 1, 1, L); dtype the model's float dtype) -- the same "
        f"numbers as the 2D 0/1 mask. (torch: {str(exc)[:120]}...)"
    )


def _randomness_message(where: str, exc: BaseException) -> str:
    return (
        f"{where}: the model draws random numbers (dropout in training mode?) inside vmap, "
        "which randomness='error' (the default) refuses. Pass randomness='different' (each "
        "sample/task/member draws its own mask, like a plain loop), randomness='same' (one "
        "mask shared by the whole batch), or call eval() / set dropout to 0. "
        f"(torch: {exc})"
    )


def _checkpoint_message(where: str, exc: BaseException) -> str:
    return (
        f"{where}: the model calls torch.utils.checkpoint.checkpoint, which does not work "
        "inside torch.func transforms (vmap/grad). Use torchfn.functional.checkpoint(fn, *args) "
        "instead: the same numbers, and recomputation where the transforms allow it. Hugging "
        "Face models: call model.gradient_checkpointing_disable() before make_functional. "
        f"(torch: {exc})"
    )


def _translate_model_error(exc: BaseException, where: str) -> BaseException | None:
    """Return a clearer error for a raw torch error a model raised inside a torch.func
    transform (dropout under randomness='error', torch's activation checkpointing, transformers'
    data-dependent attention-mask check under vmap), or None.

    Entry points call the model through :func:`_call_translated`, which applies it.
    """
    if _is_vmap_randomness_error(exc):
        return RuntimeError(_randomness_message(where, exc))
    if _is_torch_checkpoint_error(exc):
        return RuntimeError(_checkpoint_message(where, exc))
    if _is_hf_mask_vmap_error(exc):
        return RuntimeError(_hf_mask_message(where, exc))
    return None


def _call_translated(where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Return ``fn(*args, **kwargs)``; re-raise a raw torch error that
    :func:`_translate_model_error` recognises as the clearer error (the raw one chained as
    its cause). Under ``torch.compile`` it only calls ``fn`` (no try block to trace)."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        new = _translate_model_error(e, where)
        if new is None:
            raise
        raise new from e


# -- how a step calls the model with its inputs ---------------------------------------------------
# One convention for every step kind and transform that calls ``model_fn`` with a batch (the
# train step, ensembles, DP/ghost, the meta learners): a Mapping of batched tensors is passed as
# keywords, ``model_fn(params, buffers, **inputs)`` (Hugging Face style, ``module(**inputs)``);
# anything else (a tensor, a tuple, any other pytree) as one positional argument.


def _keyword_mismatch(model_fn: Any, params: Any, buffers: Any, inputs: Mapping[str, Any]
                      ) -> str | None:
    """Return why ``model_fn(params, buffers, **inputs)`` cannot bind, or None if it can (or
    the signature is unknown)."""
    try:
        sig = inspect.signature(model_fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(params, buffers, **inputs)
    except TypeError as e:
        return str(e)
    return None


def _call_model(model_fn: Any, params: Any, buffers: Any, inputs: Any,
                where: str = "step") -> Any:
    """Return ``model_fn(params, buffers, **inputs)`` for a Mapping ``inputs``, else
    ``model_fn(params, buffers, inputs)`` (the convention above).

    A ``model_fn`` whose signature cannot take the keys of a dict as keywords (one written as
    ``model_fn(params, buffers, inputs)``) gets a ``TypeError`` naming the keys and the fix.
    """
    if not isinstance(inputs, Mapping):
        return model_fn(params, buffers, inputs)
    if not torch.compiler.is_compiling():
        why = _keyword_mismatch(model_fn, params, buffers, inputs)
        if why is not None:
            raise TypeError(
                f"{where}: the inputs are a dict with keys {sorted(map(str, inputs))}, which "
                "torchfn passes to the model as keywords, model_fn(params, buffers, **inputs) "
                f"(Hugging Face style), but model_fn does not take them ({why}). Accept them "
                "as keywords (def model_fn(params, buffers, **inputs)), or pass the inputs as "
                "a tuple or a tensor, which go in as one positional argument"
            )
    return model_fn(params, buffers, **inputs)


def _leaves_with_paths(tree: Any, root: str) -> list[tuple[str, Any]]:
    """Return ``(label, leaf)`` for every leaf of a nest of dicts/tuples/lists, depth first
    (labels like ``inputs['input_ids']`` or ``inputs[0]``)."""
    out: list[tuple[str, Any]] = []

    def walk(x: Any, label: str) -> None:
        if isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, f"{label}[{k!r}]")
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                walk(v, f"{label}[{i}]")
        else:
            out.append((label, x))

    walk(tree, root)
    return out


def _leading_size(tree: Any, where: str, what: str = "inputs") -> int:
    """Return dim 0 of the first tensor leaf of ``tree`` (a tensor or a dict/pytree of them);
    raise ``ValueError`` naming ``what`` if it holds no tensor with a dim 0."""
    for label, leaf in _leaves_with_paths(tree, what):
        if isinstance(leaf, Tensor):
            if leaf.ndim == 0:
                raise ValueError(f"{where}: {label} is a 0-d tensor; expected a leading "
                                 "(batch/task) dim 0")
            return int(leaf.shape[0])
    raise ValueError(f"{where}: {what} holds no tensor (got {type(tree).__name__}); expected a "
                     "tensor or a dict of tensors with a leading dim 0")


def math_attention(fn: Any) -> Any:
    """Decorate ``fn`` to run with ``scaled_dot_product_attention`` on its math kernel.

    For transforms that differentiate twice or in forward mode (Hessian-vector products,
    influence functions, NTKs): the fused kernels (flash, memory-efficient, the CPU flash
    kernel) have no double backward and no forward-mode rule, so attention models failed
    deep inside torch. The math kernel computes the same attention from matmuls and softmax.
    """
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return fn(*args, **kwargs)

    return wrapped


def check_model_fn(model_fn: Any, where: str) -> None:
    """Raise ``TypeError`` unless ``model_fn`` is a functional model (a callable
    ``model_fn(params, buffers, inputs) -> (outputs, new_buffers)``), naming the fix for an
    ``nn.Module`` passed as it (which failed later with "forward() takes 2 positional
    arguments but 4 were given")."""
    if isinstance(model_fn, torch.nn.Module):
        raise TypeError(
            f"{where}(model_fn=...): got the nn.Module {type(model_fn).__name__}; torchfn's "
            "steps take a functional model: model_fn, params, buffers = "
            "torchfn.functional.make_functional(module) (make_ghost_model for DP-SGD)")
    if not callable(model_fn):
        raise TypeError(f"{where}(model_fn=...): expected a callable model_fn(params, buffers, "
                        f"inputs) -> (outputs, new_buffers), got {type(model_fn).__name__}")


def check_state_type(state: Any, expected: type, where: str, init: str) -> None:
    """Raise ``TypeError`` unless ``state`` is an ``expected`` (a step's state NamedTuple),
    naming the ``init`` function that builds it (a DPState given to a train step, or the
    reverse, failed with a bare AttributeError)."""
    if not isinstance(state, expected):
        raise TypeError(f"{where}: expected state to be a {expected.__name__} (built by "
                        f"{init}), got {type(state).__name__}")


def lr_metric(lr_schedule: Any, state: Any) -> Tensor:
    """``metrics["lr"]``: the lr a step applies, float32. A schedule is evaluated at the
    optimizer's count, ``state.step`` minus the state's ``skipped`` steps: a skipped step keeps
    the optimizer state, so its schedule count does not advance (per member for ensembles)."""
    skipped = getattr(state, "skipped", None)
    count = state.step if skipped is None else state.step - skipped
    value = lr_schedule(count) if callable(lr_schedule) else lr_schedule
    return torch.as_tensor(value, dtype=torch.float32)
