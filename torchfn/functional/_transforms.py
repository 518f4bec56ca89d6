"""Per-sample gradients, Hessian-vector products, Hessian diagonals and the empirical NTK.

Every function here takes functions of ONE sample and adds the batching itself:

- ``loss_fn(params, *sample_args) -> 0-d loss`` for :func:`per_sample_grads` and
  :func:`per_sample_grad_norms` (each ``sample_arg`` without its batch dim);
- ``f(params, *args) -> 0-d value`` for :func:`hvp`, :func:`hessian_matrix`,
  :func:`hessian_diagonal` (``args`` held constant; a whole batch is fine here);
- ``f(params, x) -> (O,) outputs`` of one sample for :func:`empirical_ntk`.

A ``model_fn`` that follows torchfn's stateless contract (``out, new_buffers = model_fn(params,
buffers, x_batch)``) becomes such a function of one sample with :func:`single_sample_fn`.

For plain ``jvp``/``vjp``/``jacrev``/``hessian`` use :mod:`torch.func` directly; nothing here
wraps them without adding something.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import optree
import torch
from torch import nn
from torch.func import grad, jacrev, jvp, vjp, vmap

from torchfn._checks import _call_translated, _check_randomness, math_attention
from torchfn.functional._batchnorm import BatchNorm
from torchfn.functional._pytree import (
    _check_same_structure,
    _path_str,
    tree_global_norm,
    tree_map,
    tree_ravel,
)

__all__ = [
    "empirical_ntk",
    "hessian_diagonal",
    "hessian_matrix",
    "hvp",
    "per_sample_grad_norms",
    "per_sample_grads",
    "single_sample_fn",
]

PyTree = Any
HvpMode = Literal["forward_over_reverse", "reverse_over_reverse"]
_HVP_MODES = ("forward_over_reverse", "reverse_over_reverse")
_NTK_MODES = ("full", "trace", "diagonal")


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------


def _check_argnums(fn_name: str, argnums: int | tuple[int, ...]) -> tuple[int, ...]:
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    ok = len(nums) > 0 and all(isinstance(a, int) and not isinstance(a, bool) for a in nums)
    if not ok or any(a < 0 for a in nums) or len(set(nums)) != len(nums):
        raise ValueError(
            f"{fn_name}: `argnums` must be a non-negative int or a non-empty tuple of distinct "
            f"non-negative ints (positions of the arguments to differentiate), got {argnums!r}."
        )
    return nums


def _check_positive_int(fn_name: str, name: str, value: Any, *, allow_none: bool) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        none = "None or " if allow_none else ""
        raise ValueError(f"{fn_name}: `{name}` must be {none}a positive int, got {value!r}.")
    return value


def _scalar_output(
    fn_name: str, f: Callable[..., Any], has_aux: bool, per_sample: bool = True
) -> Callable[..., Any]:
    """Wrap ``f`` so that a non-scalar output fails with the shape that was seen."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        out = f(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(
                    f"{fn_name}: with has_aux=True the function must return a tuple "
                    f"(loss, aux), got {type(out).__name__}."
                )
            value = out[0]
        else:
            value = out
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            seen = (
                f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}"
            )
            hint = (
                " for ONE sample, got {seen}. It sees each sample without its batch dim: reduce "
                "the loss (e.g. `.sum()`) or index a batched model's output (`model(x[None])[0]`)."
                if per_sample
                else ", got {seen}; reduce it (e.g. `.mean()`)."
            )
            raise ValueError(
                f"{fn_name}: the function must return a 0-d (scalar) tensor"
                + hint.format(seen=seen)
            )
        return out

    return checked


def _resolve_in_dims(
    fn_name: str, nums: tuple[int, ...], in_dims: tuple[Any, ...] | None, n_args: int
) -> tuple[Any, ...]:
    if max(nums) >= n_args:
        raise ValueError(
            f"{fn_name}: argnums={nums if len(nums) > 1 else nums[0]} refers to argument "
            f"position {max(nums)}, but the function was called with {n_args} positional "
            "argument(s)."
        )
    if in_dims is None:
        return tuple(None if i in nums else 0 for i in range(n_args))
    if not isinstance(in_dims, tuple) or len(in_dims) != n_args:
        raise ValueError(
            f"{fn_name}: `in_dims` must be a tuple with one entry per positional argument "
            f"({n_args} here; None = not batched, 0 = batched along dim 0), got {in_dims!r}."
        )
    return in_dims


def _check_batch_sizes(
    fn_name: str, args: Sequence[Any], dims: Sequence[Any], names: Sequence[str] | None = None
) -> int | None:
    """Return the common batch size of the mapped arguments, or raise naming the positions."""
    seen: list[tuple[str, int]] = []
    for i, (arg, arg_dims) in enumerate(zip(args, dims, strict=True)):
        where_arg = names[i] if names is not None else f"argument {i}"
        for path, leaf, dim in _leaf_dims(fn_name, where_arg, arg, arg_dims):
            if dim is None or leaf is None:
                continue
            where = where_arg + (f" (leaf '{_path_str(path)}')" if path else "")
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"{fn_name}: {where} is mapped over dim {dim} but is a "
                                f"{type(leaf).__name__}, not a tensor.")
            if not -leaf.dim() <= dim < leaf.dim():
                raise ValueError(
                    f"{fn_name}: {where} has shape {tuple(leaf.shape)}, which has no dim {dim} "
                    "to map over (is it a per-sample argument? set its in_dims entry to None "
                    "otherwise)."
                )
            seen.append((where, leaf.shape[dim]))
    # compare with ==, not a set: under torch.compile with dynamic shapes sizes are SymInts
    if any(size != seen[0][1] for _, size in seen[1:]):
        listing = ", ".join(f"{where}: {size}" for where, size in seen)
        raise ValueError(f"{fn_name}: batched arguments have different batch sizes ({listing}); "
                         "they must all be equal.")
    return seen[0][1] if seen else None


def _leaf_dims(fn_name: str, where: str, arg: Any, dims: Any) -> list[tuple[Any, Any, Any]]:
    """Return ``(path, leaf, in_dim)`` for every leaf of ``arg``; ``dims`` is an int, None or a
    pytree prefix of ``arg`` (as ``vmap``'s ``in_dims`` entries are)."""
    paths = optree.tree_paths(arg, none_is_leaf=True)
    leaves = optree.tree_leaves(arg, none_is_leaf=True)
    if dims is None or (isinstance(dims, int) and not isinstance(dims, bool)):
        return [(p, leaf, dims) for p, leaf in zip(paths, leaves, strict=True)]
    try:
        full = optree.tree_broadcast_prefix(dims, arg, none_is_leaf=True)
    except ValueError as e:
        raise ValueError(
            f"{fn_name}: the in_dims entry of {where} must be None, an int, or a pytree with "
            f"the structure of (a prefix of) the argument, got {dims!r} for an argument of "
            f"structure {optree.tree_structure(arg, none_is_leaf=True)} ({e})"
        ) from None
    flat = optree.tree_leaves(full, none_is_leaf=True)
    for d in flat:
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise ValueError(f"{fn_name}: in_dims entries must be None or ints, got {d!r} in "
                             f"the in_dims of {where}.")
    return list(zip(paths, leaves, flat, strict=True))


# ---------------------------------------------------------------------------------------------
# per-sample gradients
# ---------------------------------------------------------------------------------------------


def _refuse_batch_statistics(model_fn: Any) -> None:
    """Raise if ``model_fn`` (a FunctionalModel) holds a batch norm that uses batch statistics."""
    module = getattr(model_fn, "_module", None)  # FunctionalModel's private module copy
    if not isinstance(module, nn.Module):
        return  # other callables: torchfn's batch norm refuses at call time under vmap
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.modules.batchnorm._BatchNorm | BatchNorm):
            continue
        if sub.training or not sub.track_running_stats:
            mode = "in training mode" if sub.training else "without running statistics"
            raise ValueError(
                f"single_sample_fn(model_fn, buffers): {name or '<root>'!r} is a "
                f"{type(sub).__name__} {mode}, which normalises with statistics of the whole "
                "batch, so per-sample gradients are undefined (under vmap each sample would be "
                "normalised by itself). Use GroupNorm/LayerNorm, or pass model_fn.eval() (with "
                "track_running_stats=True) to use fixed running statistics"
            )


def single_sample_fn(
    model_fn: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    buffers: dict[str, torch.Tensor],
) -> Callable[..., Any]:
    """Return ``f(params, *sample_args, **kwargs) -> outputs`` of ONE sample from a ``model_fn``.

    ``model_fn`` follows the stateless contract ``out, new_buffers = model_fn(params, buffers,
    *args, **kwargs)`` and expects batched inputs. ``f`` adds a batch dim of 1 to every tensor
    leaf of ``sample_args`` (``x -> x[None]``), calls ``model_fn`` with the given (closed-over)
    ``buffers``, drops the batch dim from every output leaf and discards ``new_buffers``.
    ``kwargs`` pass through unchanged. Use it to build the one-sample functions that
    :func:`per_sample_grads` and :func:`empirical_ntk` expect. A dict (any pytree) sample
    argument gets the batch dim on every leaf, so Hugging Face style inputs work through a
    ``model_fn`` that unpacks them: ``lambda p, b, inputs: model_fn(p, b, **inputs)`` with
    ``inputs = {"input_ids": (L,), "attention_mask": ...}`` per sample. Under ``vmap`` a
    per-sample 2D ``attention_mask`` meets a data-dependent check in transformers' mask code;
    pass it as a 4D additive mask ``(1 - mask[..., None, None, :]) * finfo(dtype).min`` (the
    error says so).

    A model whose forward mixes samples (BatchNorm in training mode) has no per-sample meaning:
    for a ``FunctionalModel`` with a batch norm in training mode (or without running statistics)
    ``single_sample_fn`` raises ``ValueError``; pass ``model_fn.eval()`` (running statistics)
    for per-sample gradients and NTKs. torchfn's batch norm also refuses batch statistics of one
    sample under ``vmap``, whatever builds the per-sample function.

    Example::

        >>> W = torch.randn(3, 4)
        >>> def model_fn(params, buffers, x):            # x: (B, 4) -> (B, 3)
        ...     return x @ params["W"].T + buffers["shift"], buffers
        >>> f = single_sample_fn(model_fn, {"shift": torch.zeros(3)})
        >>> f({"W": W}, torch.randn(4)).shape           # one sample, no batch dim
        torch.Size([3])
    """

    _refuse_batch_statistics(model_fn)

    def f(params: PyTree, *sample_args: Any, **kwargs: Any) -> Any:
        batched = tree_map(lambda a: a.unsqueeze(0), sample_args)
        out, _ = model_fn(params, buffers, *batched, **kwargs)
        return _drop_batch_dim(out)

    return f


def _drop_batch_dim(out: Any) -> Any:
    """``out`` with ``t[0]`` for every tensor, through tuples, lists and mappings of any type.

    Mappings keep their type (a Hugging Face ``ModelOutput`` -- an ``OrderedDict`` subclass
    that optree sees as one leaf -- comes back as a ``ModelOutput`` of one sample); non-tensor
    leaves are returned as they are.
    """
    if isinstance(out, torch.Tensor):
        return out[0]
    if isinstance(out, Mapping):
        items = {k: _drop_batch_dim(v) for k, v in out.items()}
        try:
            return type(out)(**items)
        except TypeError:
            return type(out)(items)
    if isinstance(out, tuple):
        items = [_drop_batch_dim(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    if isinstance(out, list):
        return [_drop_batch_dim(v) for v in out]
    return out


def per_sample_grads(
    loss_fn: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
    in_dims: tuple[Any, ...] | None = None,
    has_aux: bool = False,
    randomness: str = "error",
) -> Callable[..., Any]:
    """Return ``fn(*args)`` computing the gradient of ``loss_fn`` for every sample of a batch.

    ``loss_fn(params, *sample_args) -> 0-d loss`` computes the loss of ONE sample (no batch
    dim); ``per_sample_grads`` adds the ``vmap``. ``fn(params, *batch_args)`` returns a pytree
    like ``params`` whose every leaf has a leading batch dim: ``(B, *leaf.shape)``. With a tuple
    ``argnums`` it returns a tuple of such trees; with ``has_aux=True`` (``loss_fn`` returns
    ``(loss, aux)``) it returns ``(grads, aux)`` with every aux leaf batched as ``(B, ...)``.

    Args:
        loss_fn: loss of one sample, a pure function of its arguments.
        argnums: position(s) of the argument(s) to differentiate (like ``torch.func.grad``).
        chunk_size: map over at most this many samples at once (bounds memory; results are
            identical); ``None`` maps over the whole batch at once.
        in_dims: one entry per positional argument, as in ``torch.func.vmap``; by default the
            ``argnums`` arguments are shared (``None``) and every other argument is batched
            along dim 0 (every leaf of a dict/tuple argument, e.g. a Hugging Face batch
            ``{"input_ids": (B, L), "attention_mask": (B, L)}``). Pass e.g.
            ``(None, None, 0, 0)`` for ``(params, buffers, x, y)``; an entry may be a pytree
            prefix of its argument (``{"input_ids": 0, "lengths": None}``). Keyword arguments
            are never batched: pass batched dicts positionally.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        randomness: ``vmap``'s, for random ops in ``loss_fn`` (dropout in training mode):
            ``"error"`` (default) refuses them with an error that names this keyword;
            ``"different"`` draws independent numbers for every sample (a plain per-sample
            loop's dropout); ``"same"`` draws one set shared by all samples (with
            ``chunk_size``, torch restores only the CPU generator for every chunk, so on
            CUDA each chunk draws its own set).

    For a ``model_fn(params, buffers, x_batch)`` of the shared contract, build the one-sample
    loss with :func:`single_sample_fn` (see the example). Works under
    ``torch.compile(fullgraph=True)``.

    Example::

        >>> import torch.nn.functional as F
        >>> params = {"W": torch.randn(3, 4), "b": torch.zeros(3)}
        >>> def loss_fn(params, x, y):                  # x: (4,), y: () -- one sample
        ...     return F.cross_entropy(x @ params["W"].T + params["b"], y)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> grads = per_sample_grads(loss_fn, chunk_size=4)(params, x, y)
        >>> grads["W"].shape
        torch.Size([8, 3, 4])
        >>> # the same for a model_fn(params, buffers, x_batch) -> (logits, new_buffers):
        >>> def model_fn(params, buffers, x):
        ...     return x @ params["W"].T + params["b"], buffers
        >>> f = single_sample_fn(model_fn, buffers={})
        >>> grads = per_sample_grads(lambda p, x, y: F.cross_entropy(f(p, x), y))(params, x, y)
    """
    nums = _check_argnums("per_sample_grads", argnums)
    _check_positive_int("per_sample_grads", "chunk_size", chunk_size, allow_none=True)
    _check_randomness(randomness, "per_sample_grads(randomness=...)")
    grad_fn = grad(_scalar_output("per_sample_grads", loss_fn, has_aux),
                   argnums=argnums, has_aux=has_aux)

    def batched_grads(*args: Any, **kwargs: Any) -> Any:
        dims = _resolve_in_dims("per_sample_grads", nums, in_dims, len(args))
        _check_batch_sizes("per_sample_grads", args, dims)
        mapped = vmap(grad_fn, in_dims=dims, chunk_size=chunk_size, randomness=randomness)
        return _call_translated("per_sample_grads", mapped, *args, **kwargs)

    return batched_grads


def per_sample_grad_norms(
    loss_fn: Callable[..., Any],
    *,
    argnums: int | tuple[int, ...] = 0,
    chunk_size: int | None = None,
    in_dims: tuple[Any, ...] | None = None,
    has_aux: bool = False,
    p: float = 2.0,
    randomness: str = "error",
) -> Callable[..., Any]:
    """Return ``fn(*args) -> (B,)``: the global ``p``-norm of each sample's gradient.

    Same arguments and conventions as :func:`per_sample_grads` (``randomness`` included);
    each sample's gradient (all leaves, and all ``argnums`` together) is reduced to one norm inside the map, so only ``B``
    numbers are returned (with ``chunk_size``, at most ``chunk_size`` full gradients exist at
    once). With ``has_aux=True`` it returns ``(norms, aux)``. Useful for DP-SGD clipping and
    gradient-noise statistics.

    Example::

        >>> params = {"w": torch.randn(4)}
        >>> loss_fn = lambda p, x: (p["w"] @ x) ** 2
        >>> per_sample_grad_norms(loss_fn)(params, torch.randn(6, 4)).shape
        torch.Size([6])
    """
    nums = _check_argnums("per_sample_grad_norms", argnums)
    _check_positive_int("per_sample_grad_norms", "chunk_size", chunk_size, allow_none=True)
    _check_randomness(randomness, "per_sample_grad_norms(randomness=...)")
    grad_fn = grad(_scalar_output("per_sample_grad_norms", loss_fn, has_aux),
                   argnums=argnums, has_aux=has_aux)

    def norm_of_grad(*args: Any, **kwargs: Any) -> Any:
        if has_aux:
            g, aux = grad_fn(*args, **kwargs)
            return tree_global_norm(g, p), aux
        return tree_global_norm(grad_fn(*args, **kwargs), p)

    def batched_norms(*args: Any, **kwargs: Any) -> Any:
        dims = _resolve_in_dims("per_sample_grad_norms", nums, in_dims, len(args))
        _check_batch_sizes("per_sample_grad_norms", args, dims)
        mapped = vmap(norm_of_grad, in_dims=dims, chunk_size=chunk_size, randomness=randomness)
        return _call_translated("per_sample_grad_norms", mapped, *args, **kwargs)

    return batched_norms


# ---------------------------------------------------------------------------------------------
# second order
# ---------------------------------------------------------------------------------------------


@math_attention
def hvp(
    f: Callable[..., torch.Tensor],
    params: PyTree,
    v: PyTree,
    *args: Any,
    mode: HvpMode = "forward_over_reverse",
) -> PyTree:
    """Return the Hessian-vector product ``H v`` (a tree like ``params``), ``H = d²f/dparams²``.

    ``f(params, *args) -> 0-d tensor``; ``args`` are held constant. ``v`` has the structure and
    shapes of ``params``. ``mode="forward_over_reverse"`` (default) is ``jvp`` of ``grad``: one
    forward-mode pass over the backward, the cheapest. ``mode="reverse_over_reverse"`` is
    ``vjp`` of ``grad`` (valid because ``H`` is symmetric); use it when an op in ``f`` has no
    working forward-mode derivative of its backward: on torch 2.13 ``F.mse_loss`` (mean
    reduction, pytorch issue #123996) and ``F.huber_loss`` fail, as does an
    ``autograd.Function`` without ``jvp``; the error then says so. The Hessian is never formed.
    Works under ``vmap`` over ``v`` (many probes at once).

    Example::

        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> f = lambda p: (p["w"] ** 3).sum()          # H = diag(6 w)
        >>> hvp(f, params, {"w": torch.tensor([1.0, 1.0])})
        {'w': tensor([ 6., 12.])}
    """
    if mode not in _HVP_MODES:
        raise ValueError(f"hvp: `mode` must be one of {_HVP_MODES}, got {mode!r}.")
    _check_same_structure("hvp", ("params", "v"), params, v)
    grad_f = grad(_scalar_output("hvp", f, has_aux=False, per_sample=False))

    def g(p: PyTree) -> PyTree:
        return grad_f(p, *args)

    if mode == "forward_over_reverse":
        try:
            return jvp(g, (params,), (v,))[1]
        except (RuntimeError, NotImplementedError) as e:
            raise type(e)(
                f"hvp(mode='forward_over_reverse'): jvp of grad(f) failed: {e}\nIf this comes "
                "from an op whose forward-mode derivative of its backward is missing or broken "
                "in torch (F.mse_loss with reduction='mean': pytorch issue #123996; "
                "F.huber_loss; an autograd.Function without jvp), pass "
                "mode='reverse_over_reverse' (same result, usually somewhat slower)."
            ) from e
    _, vjp_fn = vjp(g, params)
    return vjp_fn(v)[0]


@math_attention
def hessian_matrix(f: Callable[..., torch.Tensor], params: PyTree, *args: Any) -> torch.Tensor:
    """Return the dense Hessian of ``f(params, *args)`` as a ``(P, P)`` matrix.

    ``P = tree_numel(params)``; rows and columns follow :func:`tree_ravel`'s order (optree leaf
    order, each leaf row-major). Memory is ``O(P²)``: for small models and tests. For the nested
    ``{key: {key: block}}`` form use ``torch.func.hessian(f)(params, *args)`` directly.

    Example::

        >>> params = {"a": torch.tensor(1.0), "b": torch.tensor([2.0])}
        >>> f = lambda p: p["a"] ** 2 * p["b"].sum()
        >>> hessian_matrix(f, params)
        tensor([[4., 2.],
                [2., 0.]])
    """
    flat, unravel = tree_ravel(params)
    checked = _scalar_output("hessian_matrix", f, has_aux=False, per_sample=False)
    return torch.func.hessian(lambda vec: checked(unravel(vec), *args))(flat)


@math_attention
def hessian_diagonal(
    f: Callable[..., torch.Tensor],
    params: PyTree,
    *args: Any,
    n_samples: int | None = None,
    generator: torch.Generator | None = None,
    exact: bool = False,
    chunk_size: int | None = None,
    hvp_mode: HvpMode = "forward_over_reverse",
) -> PyTree:
    """Return the diagonal of the Hessian of ``f(params, *args)`` as a tree like ``params``.

    Default: Hutchinson's estimator ``mean_k z_k ⊙ (H z_k)`` over ``n_samples`` Rademacher
    probes ``z_k ∈ {-1, +1}^P`` drawn from ``generator`` (required; it advances). The estimate
    is unbiased; entry ``i`` has variance ``sum_{j≠i} H_ij² / n_samples``. Same generator state,
    ``n_samples`` and ``chunk_size`` => the same result. ``exact=True`` instead computes every
    ``e_iᵀ H e_i`` (``P`` Hessian-vector products; for small models and checks; ``n_samples``
    and ``generator`` must then be left out). ``chunk_size`` bounds how many probes (or basis
    vectors) are in flight at once; ``hvp_mode`` is passed to :func:`hvp`. Probes are drawn
    eagerly, so call this outside ``torch.compile``.

    Example::

        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> f = lambda p: (p["w"] ** 3).sum() + p["w"].prod()
        >>> hessian_diagonal(f, params, exact=True)
        {'w': tensor([ 6., 12.])}
        >>> g = torch.Generator().manual_seed(0)
        >>> est = hessian_diagonal(f, params, n_samples=100, generator=g)   # ≈ [6., 12.]
    """
    fn_name = "hessian_diagonal"
    if hvp_mode not in _HVP_MODES:
        raise ValueError(f"{fn_name}: `hvp_mode` must be one of {_HVP_MODES}, got {hvp_mode!r}.")
    _check_positive_int(fn_name, "chunk_size", chunk_size, allow_none=True)
    flat, unravel = tree_ravel(params)
    n_params = flat.shape[0]
    checked = _scalar_output(fn_name, f, has_aux=False, per_sample=False)

    def flat_f(vec: torch.Tensor) -> torch.Tensor:
        return checked(unravel(vec), *args)

    def h_times(vec: torch.Tensor) -> torch.Tensor:
        return hvp(flat_f, flat, vec, mode=hvp_mode)

    if exact:
        if n_samples is not None or generator is not None:
            raise ValueError(f"{fn_name}: exact=True takes no `n_samples`/`generator` (got "
                             f"n_samples={n_samples!r}, generator={generator!r}).")
        index = torch.arange(n_params, device=flat.device)

        def diag_entry(i: torch.Tensor) -> torch.Tensor:
            e = (index == i).to(flat.dtype)
            return torch.dot(e, h_times(e))

        return unravel(vmap(diag_entry, chunk_size=chunk_size)(index))

    n_probes: int = _check_positive_int(fn_name, "n_samples", n_samples, allow_none=False)
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{fn_name}: the Hutchinson estimate needs an explicit `generator` (a "
            f"torch.Generator on {flat.device}, e.g. torch.Generator().manual_seed(0)); got "
            f"{generator!r}. Pass exact=True for the exact diagonal instead."
        )
    if generator.device.type != flat.device.type:
        raise ValueError(f"{fn_name}: `generator` is on {generator.device} but params are on "
                         f"{flat.device}; create it with torch.Generator(device=...).")
    step = n_probes if chunk_size is None else min(chunk_size, n_probes)
    total = torch.zeros_like(flat)
    for start in range(0, n_probes, step):
        count = min(step, n_probes - start)
        z = torch.randint(0, 2, (count, n_params), generator=generator, device=flat.device,
                          dtype=flat.dtype) * 2 - 1
        total = total + (z * vmap(h_times)(z)).sum(0)
    return unravel(total / n_probes)


# ---------------------------------------------------------------------------------------------
# neural tangent kernel
# ---------------------------------------------------------------------------------------------


@math_attention
def empirical_ntk(
    f: Callable[[PyTree, Any], torch.Tensor],
    params: PyTree,
    x1: Any,
    x2: Any = None,
    *,
    mode: Literal["full", "trace", "diagonal"] = "full",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Return the empirical NTK ``Θ(x1, x2) = J(x1) J(x2)ᵀ`` between two batches.

    ``f(params, x) -> outputs`` maps ONE sample to outputs of any shape, flattened to ``O``
    values (use :func:`single_sample_fn` for a ``model_fn`` of the shared contract). ``x1`` and
    ``x2`` are tensors (or pytrees of tensors) batched along dim 0 with ``N1`` and ``N2``
    samples; ``x2=None`` uses ``x1`` (and its Jacobian) again. ``J(x)`` is the ``(O, P)``
    Jacobian of the outputs with respect to all parameters.

    Returns, by ``mode``:
        - ``"full"``: ``(N1, N2, O, O)``, ``[n, m, a, b] = <dout_a(x1_n)/dθ, dout_b(x2_m)/dθ>``;
        - ``"trace"``: ``(N1, N2)``, the trace over the output pair ``a == b``;
        - ``"diagonal"``: ``(N1, N2, O)``, the ``a == b`` entries.

    Computed by Jacobian contraction: memory ``O((N1 + N2) · O · P)``; ``chunk_size`` bounds
    how many per-sample Jacobians are computed at once.

    Example::

        >>> params = {"W": torch.randn(3, 4), "b": torch.zeros(3)}
        >>> f = lambda p, x: torch.tanh(p["W"] @ x + p["b"])   # (4,) -> (3,)
        >>> empirical_ntk(f, params, torch.randn(5, 4), torch.randn(2, 4)).shape
        torch.Size([5, 2, 3, 3])
        >>> empirical_ntk(f, params, torch.randn(5, 4), mode="trace").shape
        torch.Size([5, 5])
    """
    fn_name = "empirical_ntk"
    if mode not in _NTK_MODES:
        raise ValueError(f"{fn_name}: `mode` must be one of {_NTK_MODES}, got {mode!r}.")
    _check_positive_int(fn_name, "chunk_size", chunk_size, allow_none=True)

    def flat_out(p: PyTree, x: Any) -> torch.Tensor:
        out = f(p, x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{fn_name}: `f` must return a tensor, got {type(out).__name__}.")
        return out.reshape(-1)

    jac_fn = vmap(jacrev(flat_out), in_dims=(None, 0), chunk_size=chunk_size)

    def jacobians(x: Any, name: str) -> list[torch.Tensor]:
        _check_batch_sizes(fn_name, [x], [0], [name])
        jac = jac_fn(params, x)  # leaves: (N, O, *leaf.shape)
        return [j.flatten(2) for j in optree.tree_leaves(jac)]

    j1 = jacobians(x1, "x1")
    j2 = j1 if x2 is None else jacobians(x2, "x2")
    equation = {"full": "naf,mbf->nmab", "trace": "naf,maf->nm", "diagonal": "naf,maf->nma"}[mode]
    if not j1:
        raise ValueError(f"{fn_name}: `params` has no tensor leaves.")
    parts = [torch.einsum(equation, a, b) for a, b in zip(j1, j2, strict=True)]
    return functools.reduce(torch.add, parts)
