"""Bucketed all-reduce of a gradient dict with functional collectives (eager and compiled).

The tensors of a dict are packed into flat buckets of about ``bucket_mb`` megabytes, grouped
by dtype and device (a bucket holds one dtype on one device), and every bucket's all-reduce is
*launched* before any result is read (each waited only when its gradients are unpacked), so
bucket ``k``'s communication runs while bucket ``k+1`` is packed and sent. Eagerly a bucket is
reduced in place (``_c10d_functional.all_reduce_`` on the flat buffer that packing made; the
out-of-place op would clone it first) and divided in place. The same functions trace under
``torch.compile(fullgraph=True)`` (Dynamo turns them into ``_c10d_functional`` ops and Inductor
places the waits as late as it can). c10d's in-place ``dist.all_reduce`` compiles as well on
torch 2.13 (checked), but it mutates its argument; the functional ones keep the step pure.

A functional step computes all gradients at once (``torch.func.grad``), so these reductions
start after the backward; the overlap is between buckets (and, compiled, whatever Inductor
schedules around the waits: ``torch._inductor.config.reorder_for_compute_comm_overlap`` moves
each bucket's all-reduce up to where its gradients are ready). :class:`BackwardOverlapReducer`
starts them during an eager backward instead, from per-parameter ``Tensor.register_hook``
hooks on the params traced by ``torch.func.grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

from torchfn.distributed._env import world_info

__all__ = ["all_gather_tree", "all_reduce_tree", "make_grad_reducer"]

DEFAULT_BUCKET_MB = 25.0
# newer torch deprecates all_gather_tensor in favour of all_gather_single (same op)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _group(group: ProcessGroup | None) -> ProcessGroup:
    import torch.distributed as dist

    return group if group is not None else dist.group.WORLD


def _buckets(tree: Mapping[str, Tensor], bucket_bytes: int) -> list[list[str]]:
    """Return lists of keys, each a bucket of one dtype/device of at most ``bucket_bytes``."""
    open_: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[list[str]] = []
    for k, t in tree.items():
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key in open_ and size[key] + nbytes > bucket_bytes:
            done.append(open_.pop(key))
        if key not in open_:
            open_[key], size[key] = [], 0
        open_[key].append(k)
        size[key] += nbytes
    return done + list(open_.values())


def all_reduce_tree(tree: Mapping[str, Tensor], *, op: str = "mean",
                    group: ProcessGroup | None = None,
                    bucket_mb: float = DEFAULT_BUCKET_MB) -> dict[str, Tensor]:
    """Return ``tree`` (a ``dict[str, Tensor]``) summed or averaged over the ranks of ``group``.

    Every rank must pass the same keys with the same shapes and dtypes (shapes as they are,
    e.g. ``(out, in)`` weights). ``op`` is ``"mean"`` (sum divided by the world size) or
    ``"sum"``. Tensors go in flat buckets of ``bucket_mb`` MB per dtype/device, each bucket one
    all-reduce, all launched before any is waited on. Pure: inputs are not modified. Works
    eagerly and inside ``torch.compile(fullgraph=True)``.

    Example::

        grads = {"w": torch.ones(3, 2) * (rank + 1)}   # 2 ranks
        all_reduce_tree(grads)["w"][0, 0]
        # tensor(1.5000)
    """
    if op not in ("mean", "sum"):
        raise ValueError(f"all_reduce_tree(op=...): expected 'mean' or 'sum', got {op!r}")
    if not bucket_mb > 0:
        raise ValueError(f"all_reduce_tree(bucket_mb=...): expected > 0, got {bucket_mb!r}")
    _, world = world_info(group, "all_reduce_tree")
    pg = _group(group)
    keys = list(tree)
    for k in keys:
        if not isinstance(tree[k], Tensor):
            raise TypeError(f"all_reduce_tree(tree): expected a dict of tensors, got "
                            f"{type(tree[k]).__name__} at {k!r}")
    launched = []
    for bucket in _buckets(tree, int(bucket_mb * 2**20)):
        flat = torch.cat([tree[k].reshape(-1) for k in bucket])
        # eager: the bucket is ours (cat made it), so it is reduced in place -- the functional
        # all_reduce would first clone it (one more pass over the gradient)
        owned = _in_place_ok(flat)
        launched.append((bucket, owned, torch.ops._c10d_functional.all_reduce_(
            flat, "sum", pg.group_name) if owned else funcol.all_reduce(flat, "sum", pg)))
    out: dict[str, Tensor] = {}
    for bucket, owned, red in launched:
        # eager: wait here, bucket by bucket (compiled: Inductor places the waits)
        red = torch.ops._c10d_functional.wait_tensor(red) if owned else _materialise(red)
        if op == "mean":
            red = red.div_(world) if owned else red / world  # (the same quotient)
        parts = red.split([tree[k].numel() for k in bucket])
        for k, part in zip(bucket, parts, strict=True):
            out[k] = part.view(tree[k].shape)
    return {k: out[k] for k in keys}


def make_grad_reducer(*, group: ProcessGroup | None = None,
                      bucket_mb: float = DEFAULT_BUCKET_MB):
    """Return ``reduce(grads) -> grads`` averaging a gradient dict over ``group``'s ranks.

    A ready ``grad_transform`` for :func:`torchfn.functional.make_train_step`: all ranks hold
    equal-size local batches of a mean-reduced loss, so the average of their gradients is the
    gradient of the global batch. Checks that the process group exists now, at build time.

    Example::

        step = make_train_step(model_fn, loss_fn, opt, grad_transform=make_grad_reducer())
    """
    world_info(group, "make_grad_reducer")

    def reduce(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return all_reduce_tree(grads, op="mean", group=group, bucket_mb=bucket_mb)

    return reduce


def all_gather_tree(tree: Mapping[str, Tensor], *,
                    group: ProcessGroup | None = None) -> dict[str, Tensor]:
    """Return ``tree`` with every tensor concatenated over the ranks along dim 0.

    Rank ``r``'s ``(n, ...)`` tensor becomes rows ``[r n, (r+1) n)`` of the ``(W n, ...)``
    result (every rank passes the same shapes). 0-d tensors are returned unchanged (they are
    taken as the same on every rank). Works eagerly and compiled.

    Example::

        all_gather_tree({"w": torch.full((2, 3), float(rank))})["w"][:, 0]   # 2 ranks
        # tensor([0., 0., 1., 1.])
    """
    world_info(group, "all_gather_tree")
    pg = _group(group)
    out = {}
    for k, t in tree.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"all_gather_tree(tree): expected a dict of tensors, got "
                            f"{type(t).__name__} at {k!r}")
        out[k] = t if t.ndim == 0 else _all_gather(t.contiguous(), 0, pg)
    return {k: _materialise(v) for k, v in out.items()}


def _materialise(t: Tensor) -> Tensor:
    """Return ``t``, the result of an eager functional collective, waited for: the collective's
    work is released, and with it the buffers the backend keeps until the wait (NCCL's stashed
    input, gloo's copy). Eagerly the result is a lazily-waiting ``AsyncCollectiveTensor``; under
    a ``torch.func`` transform (the blocked steps' backward runs inside ``torch.func.grad``)
    that subclass is hidden inside a functorch wrapper of plain type, so ``isinstance`` misses
    it and ``wait_tensor`` is called on the wrapper (it reaches the inner tensor; a no-op when
    nothing is pending). Without it, views of the result (``split``) keep the work pending
    until their first compute op -- after the whole backward for reduce-scattered gradients,
    one extra copy of them held meanwhile."""
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    if (not torch.compiler.is_compiling() and not t.requires_grad
            and torch._C._functorch.is_functorch_wrapped_tensor(t)):
        return torch.ops._c10d_functional.wait_tensor(t)
    return t


def _in_place_ok(t: Tensor) -> bool:
    """Whether ``t``, a tensor the caller just made, may be updated in place: eagerly, and not
    tracked by autograd or a ``torch.func`` transform (grad, vmap, functionalize) -- those,
    and compiled code, take the out-of-place ops."""
    return (not torch.compiler.is_compiling() and not t.requires_grad
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _is_traced(t: Tensor) -> bool:
    """Whether ``t`` is an input that ``torch.func.grad`` differentiates (a wrapped tensor)."""
    return bool(torch._C._functorch.is_gradtrackingtensor(t)) and t.requires_grad


class BackwardOverlapReducer:
    """Eager gradient all-reduce started by per-parameter hooks while the backward runs.

    :meth:`wrap` returns ``model_fn`` with a ``Tensor.register_hook`` on every parameter it is
    called with that ``torch.func.grad`` differentiates (the traced, trainable params).
    The parameters are put in buckets of about ``bucket_mb`` MB in reverse order (the backward
    produces the last layers' gradients first). A tensor hook fires once that tensor's whole
    gradient is known; when the last gradient of a bucket arrives, the hook packs the bucket
    and launches its sum all-reduce (a functional collective, not waited), so bucket ``k``'s
    communication runs while the backward computes the earlier layers' gradients. The hooks
    return the gradients unchanged. :meth:`reduce`, used as the step's ``grad_transform``,
    waits for the launched buckets and divides by the world size; parameters of buckets that
    never completed (frozen or unused params, whose hooks do not fire) go through
    :func:`all_reduce_tree`. Under ``torch.compile`` no hook is registered and :meth:`reduce`
    is the bucketed :func:`all_reduce_tree` (Inductor schedules the collectives itself). The
    result equals ``all_reduce_tree(grads, op="mean")`` elementwise (the same sums over
    ranks, then the same division).
    """

    def __init__(self, *, group: ProcessGroup | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        _, self.world = world_info(group, "BackwardOverlapReducer")
        if not bucket_mb > 0:
            raise ValueError(f"BackwardOverlapReducer(bucket_mb=...): expected > 0, got "
                             f"{bucket_mb!r}")
        self.group, self.bucket_mb = group, bucket_mb
        self._group_name = _group(group).group_name
        self.last_launched: tuple[str, ...] = ()  # the last step's buckets, in launch order
        self.begin()

    def begin(self) -> None:
        """Forget the last step's hooks and buckets (call at the start of every step)."""
        self._bucket_of: dict[str, tuple[str, ...]] = {}
        self._ready: dict[str, Tensor] = {}
        self._pending: list[tuple[tuple[str, ...], Tensor]] = []

    def wrap(self, model_fn: Any) -> Any:
        """Return ``model_fn`` with the gradient hooks (``frozen`` names kept)."""

        def hooked(params: Mapping[str, Any], buffers: Any, *args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                # only the params torch.func.grad traces (a hook on a plain tensor, e.g. a
                # frozen param, would stay on it across steps); once per step: a second hook
                # on the same tensor would reduce it twice
                new = {n: p for n, p in reversed(list(params.items()))
                       if isinstance(p, Tensor) and _is_traced(p) and n not in self._bucket_of}
                for bucket in _buckets(new, int(self.bucket_mb * 2**20)):
                    for n in bucket:
                        self._bucket_of[n] = tuple(bucket)
                for n, p in new.items():
                    p.register_hook(functools.partial(self._on_grad, n))
            return model_fn(params, buffers, *args, **kwargs)

        hooked.frozen = tuple(getattr(model_fn, "frozen", ()))  # type: ignore[attr-defined]
        return hooked

    def _on_grad(self, name: str, grad: Tensor) -> Tensor:
        # no_grad + detach: the op's autograd formula is not functorch-ready, and the reduced
        # gradient needs none; the raw op returns an un-waited tensor (waited in reduce)
        with torch.no_grad():
            self._ready[name] = grad.detach()
            bucket = self._bucket_of[name]
            if all(n in self._ready for n in bucket):
                flat = torch.cat([self._ready.pop(n).reshape(-1) for n in bucket])
                red = torch.ops._c10d_functional.all_reduce(flat, "sum", self._group_name)
                self._pending.append((bucket, red))
        return grad

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Return ``grads`` averaged over the ranks (waiting for the hooks' all-reduces)."""
        pending = self._pending
        self.last_launched = tuple(n for bucket, _ in pending for n in bucket)
        self.begin()
        out: dict[str, Tensor] = {}
        for bucket, red in pending:
            red = torch.ops._c10d_functional.wait_tensor(red) / self.world
            parts = red.split([grads[k].numel() for k in bucket])
            for k, part in zip(bucket, parts, strict=True):
                out[k] = part.view(grads[k].shape)
        rest = {k: v for k, v in grads.items() if k not in out}
        if rest:
            out.update(all_reduce_tree(rest, op="mean", group=self.group,
                                       bucket_mb=self.bucket_mb))
        return {k: out[k] for k in grads}
