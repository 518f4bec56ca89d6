"""The compiled meta-gradient with one inner step traced once: a nested compile region.

Under ``torch.compile`` the unrolled inner loop of :class:`MetaLearner` is traced, differentiated
and code-generated ``inner_steps`` times over, so compile time grows with ``inner_steps``. Here
one inner step of the whole task chunk -- ``vmap`` over tasks of (support forward,
``torch.func.grad``, optimizer update) -- is a :func:`torch.compiler.nested_compile_region`:
Dynamo traces it once, AOTAutograd builds its forward and backward once, Inductor compiles each
once, and the ``inner_steps`` calls reuse them. Compile time then scales with one inner step.

A region cannot run under a ``torch.func`` transform in torch 2.13 (Dynamo's speculation of
the region body fails with ``AssertionError: Expected FakeTensor, got <class 'torch.Tensor'>``:
its inputs are functorch-wrapped), so the outer gradient is not ``torch.func.grad`` here but
``torch.autograd.grad`` on fresh leaf copies of the meta-params, traced into the graph by
Dynamo's ``trace_autograd_ops`` (off by default in torch 2.13; :func:`regions_available`).
The task axis is dim 0 of every region input: the meta-params are broadcast to
``(T, ...)`` copies before the first step (autograd sums their gradients back), and the
buffers and the inner optimizer state are per task from the start, so every call of the
region sees the same input layout and reuses one trace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad, vmap

from torchfn._checks import _call_model

__all__: list[str] = []

# Second order through a region is exact under the aot_eager and aot_eager_decomp_partition
# backends, but torch 2.13's Inductor (CPU) miscompiles it for conv nets once the region is
# called twice or more (benchmarks/results/meta-compile-time-cpu.md): refused until a torch
# release where benchmarks/meta_compile_time.py shows it equal to eager. Tests switch it on
# to check the graph semantics with aot_eager.
SECOND_ORDER_REGIONS = False

TensorDict = dict[str, Tensor]


#: the first torch whose Dynamo traces the region path (``requires_grad_`` on detached leaves
#: and ``torch.autograd.grad`` under ``trace_autograd_ops``); torch 2.11 refuses
#: ``requires_grad_`` ("Unsupported Tensor.requires_grad_() call")
REGIONS_MIN_TORCH = (2, 13)


_SUPPORTED = torch.torch_version.TorchVersion(torch.__version__) >= ".".join(
    map(str, REGIONS_MIN_TORCH))  # at import: Dynamo cannot trace the version parse


def regions_supported() -> bool:
    """Return whether this torch can compile the region path at all (>= :data:`REGIONS_MIN_TORCH`)."""
    return _SUPPORTED


def regions_available() -> bool:
    """Return whether Dynamo traces ``torch.autograd.grad`` into the graph (the region path
    needs it): a torch that supports it and ``torch._dynamo.config.trace_autograd_ops``,
    which :func:`torchfn.compile.compile_step` turns on for its calls."""
    return regions_supported() and bool(getattr(torch._dynamo.config, "trace_autograd_ops",
                                                False))


def _fresh(out: Any, inp: Any) -> Any:
    """Return ``out`` with every tensor that *is* its input twin cloned (a region output may
    not alias a region input: e.g. buffers a model in eval mode hands back unchanged)."""
    return optree.tree_map(lambda o, i: o.clone() if o is i else o, out, inp)


def _canonical_grads(tree: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return ``tree`` through ``* 1``: an identity whose backward gives the gradient the
    canonical contiguous strides.

    The region's backward is traced once per distinct layout of its incoming gradients
    (strides of size-1 dims included). The query loss's backward hands the last inner step
    gradients whose size-1 dims have other strides than the ones the region's own backward
    hands the step before it (e.g. ``(6, 1, 6)`` for ``(6, 1, 1)``), which would trace the
    region's backward a second time; the elementwise ``* 1`` re-strides them.
    """
    return {k: v * 1 for k, v in tree.items()}


def make_region_step(
    model_fn: Callable[..., Any],
    loss_fn: Callable[[Any, Tensor], Tensor],
    inner_opt: Any,
    *,
    model_names: Callable[[Mapping[str, Tensor]], list[str]],
    first_order: bool,
    lr_prefix: str | None,
    randomness: str,
) -> Callable[..., Any]:
    """Return ``step(fast, fixed, state, bufs, support_x, support_y) -> (fast, state, bufs)``:
    one inner step of every task of a chunk (the learner wraps it in
    :func:`torch.compiler.nested_compile_region`).

    ``fast``, ``state``, ``bufs``, ``support_x``, ``support_y`` have the task dim 0;
    ``fixed`` (all the meta-params, Meta-SGD's rates among them; the adapted ones are read from
    ``fast``) has none. ``lr_prefix`` is Meta-SGD's rate-name prefix (``None``: plain updates).
    """

    def one_task(fast: TensorDict, fixed: TensorDict, state: Any, bufs: TensorDict,
                 support_x: Any, support_y: Any) -> tuple[TensorDict, Any, TensorDict]:
        # ``fixed`` goes into ``grad`` as an argument, not a closure: Dynamo cannot lift an
        # unbatched closure tensor into a functorch transform inside a region (torch 2.13)
        def support_loss(f: TensorDict, b: TensorDict, fx: TensorDict) -> tuple[
                Tensor, TensorDict]:
            params = {k: f[k] if k in f else fx[k] for k in model_names(fx)}
            out, new_b = _call_model(model_fn, params, b, support_x, "meta-learner (support_x)")
            return loss_fn(out, support_y), new_b

        g, new_bufs = grad(support_loss, has_aux=True)(fast, bufs, fixed)
        if first_order:
            g = {k: v.detach() for k, v in g.items()}
        updates, new_state = inner_opt.update(g, state, params=fast, inplace=False)
        if lr_prefix is not None:
            new_fast = {k: fast[k] + fixed[lr_prefix + k] * updates[k] for k in fast}
        else:
            new_fast = {k: fast[k] + updates[k] for k in fast}
        return new_fast, new_state, new_bufs

    task_step = vmap(one_task, in_dims=(0, None, 0, 0, 0, 0), randomness=randomness)

    def chunk_step(fast: TensorDict, fixed: TensorDict, state: Any, bufs: TensorDict,
                   support_x: Any, support_y: Any) -> tuple[TensorDict, Any, TensorDict]:
        new = task_step(fast, fixed, state, bufs, support_x, support_y)
        return _fresh(new, (fast, state, bufs))

    return chunk_step


def make_region_query(learner: Any) -> Callable[..., Any]:
    """Return ``query(fast, fixed, bufs, query_x, query_y) -> (loss_t, new_bufs)``: each task's
    query loss at its adapted params (``fast``, ``bufs``, ``query_x``, ``query_y`` with the
    task dim 0, ``loss_t`` of shape ``(T,)``; ``fixed``, the meta-params, has none)."""

    def one_task(f: TensorDict, fx: TensorDict, b: TensorDict, x: Any, y: Any) -> tuple[
            Tensor, TensorDict]:
        params = {k: f[k] if k in f else fx[k] for k in learner._model_names(fx)}
        out, new_b = _call_model(learner._model_call, params, b, x, "meta-learner (query_x)")
        return learner.loss_fn(out, y), new_b

    return vmap(one_task, in_dims=(0, None, 0, 0, 0), randomness=learner.randomness)


def region_chunk_grad(
    learner: Any,
    meta_params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    chunk: Any,
    names: list[str],
    loss_scale: Tensor | None,
    *,
    step: Callable[..., Any] | None = None,
    query: Callable[..., Any] | None = None,
) -> tuple[TensorDict, Tensor, TensorDict]:
    """Return ``(sum over the chunk's tasks of the meta-gradient of names, summed query loss,
    per-task buffers)``: the inner loop as ``inner_steps`` calls of the region step and the
    outer gradient by ``torch.autograd.grad`` (equal to the ``torch.func`` path).

    ``step`` (default ``learner._region_step``) is the inner step of the chunk and ``query``
    (default :func:`make_region_query`'s) the per-task query loss; ``compile="inner"`` of the
    meta train step passes ``torch.compile``d ones."""
    n = chunk.support_x.shape[0] if isinstance(chunk.support_x, Tensor) else \
        optree.tree_leaves(chunk.support_x)[0].shape[0]
    adapted = learner.adapted_names(meta_params)
    with torch.enable_grad():
        leaves = {k: meta_params[k].detach().requires_grad_() for k in names}
        meta = {k: leaves[k] if k in leaves else meta_params[k] for k in meta_params}
        fixed = meta
        fast = {k: meta[k].expand(n, *meta[k].shape).contiguous() for k in adapted}
        bufs = {k: b.expand(n, *b.shape).contiguous() for k, b in buffers.items()}
        state = vmap(learner.inner_opt.init)(fast)
        step = learner._region_step if step is None else step
        for _ in range(learner.inner_steps):
            fast, state, bufs = step(fast, fixed, state, bufs, chunk.support_x, chunk.support_y)
        query = make_region_query(learner) if query is None else query
        loss_t, out_bufs = query(_canonical_grads(fast), fixed, bufs, chunk.query_x,
                                 chunk.query_y)
        loss = scaled = loss_t.sum()
        if loss_scale is not None:
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
            scaled = loss * loss_scale
        keys = list(leaves)
        gs = torch.autograd.grad(scaled, [leaves[k] for k in keys], allow_unused=True)
    grads = {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(keys, gs, strict=True)}
    return grads, loss.detach(), {k: v.detach() for k, v in out_bufs.items()}
