"""Metric meta-learners: prototypical networks (Snell et al. 2017) and a matching-network baseline.

No inner loop: an embedding ``embed_fn(params, buffers, x) -> (embeddings (N, D), buffers)``
is meta-trained so that query points are classified by their distances to the support set:

- :func:`protonet`: the logit of class ``c`` is ``-scale * d(embed(q), proto_c)``, where
  ``proto_c`` is the mean support embedding of class ``c`` and ``d`` the squared Euclidean
  or the cosine distance (``1 - cos``).
- :func:`matching_net`: ``p(c | q) = sum_{j: y_j = c} softmax_j(scale * cos(embed(q),
  embed(s_j)))``, an attention over the support points, without the full-context
  embeddings (the bidirectional LSTM over the support set and the attention LSTM of Vinyals
  et al. 2016): the embedding of a point does not depend on the rest of the episode. Its
  "logits" are ``log p``, so cross-entropy on them is the matching-net loss.

The learners run on the same :class:`torchfn.meta.Task` batches as MAML (support labels
are class ids ``0..n_way-1``, every class present in every task's support set), vmapped over
tasks, and train with :func:`torchfn.meta.make_meta_train_step`. The support and the query
set are embedded by two calls (a BatchNorm in training mode normalises each with its own
batch statistics); the new buffers are those of the query call, averaged over tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn._checks import _call_model, _call_translated
from torchfn.meta._maml import MetaLearner, task_loss_grad
from torchfn.meta._tasks import Task, check_task_batch, n_tasks, wrt_names

__all__ = ["MetricLearner", "matching_net", "protonet"]

TensorDict = dict[str, Tensor]
_DISTANCES = ("sqeuclidean", "cosine")


class MetricLearner(MetaLearner):
    """A metric meta-learner (ProtoNet or matching net): build it with :func:`protonet` or
    :func:`matching_net`.

    ``logits(params, buffers, task)`` classifies one task's queries; ``meta_loss`` and
    ``meta_grad`` are the mean query cross-entropy over a task batch and its gradient, so
    :func:`torchfn.meta.make_meta_train_step` and :func:`torchfn.meta.init_meta_state` take
    it as they take a MAML learner. There is no inner loop: :meth:`adapt` raises.
    """

    def __init__(self, embed_fn: Callable[..., Any], *, kind: str, n_way: int, distance: str,
                 scale: float, randomness: str) -> None:
        where = kind
        if not isinstance(n_way, int) or isinstance(n_way, bool) or n_way < 2:
            raise ValueError(f"{where}(n_way=...): expected an int >= 2 (classes per episode, "
                             f"support labels 0..n_way-1), got {n_way!r}")
        if distance not in _DISTANCES:
            raise ValueError(f"{where}(distance=...): expected one of {_DISTANCES}, "
                             f"got {distance!r}")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise ValueError(f"{where}(scale=...): expected a float > 0 multiplying the "
                             f"negative distances (a temperature), got {scale!r}")
        # first_order: no inner loop, so no second-order attention/layer-norm context needed
        super().__init__(embed_fn, F.cross_entropy, first_order=True, randomness=randomness)
        self.kind = kind
        self.n_way = n_way
        self.distance = distance
        self.scale = float(scale)

    def __repr__(self) -> str:
        dist = f", distance={self.distance!r}" if self.kind == "protonet" else ""
        return f"MetricLearner({self.kind}, n_way={self.n_way}{dist}, scale={self.scale:g})"

    def adapt(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.kind} has no inner loop to adapt with; classify a task's "
                        "queries with learner.logits(params, buffers, task)")

    def logits(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task,
               ) -> tuple[Tensor, TensorDict]:
        """Return ``(query logits (Q, n_way), new_buffers)`` of one task (no task dim).

        ProtoNet: ``-scale * d(embed(query), prototype_c)``; matching net: ``log p(c | q)``
        (module docstring). ``vmap`` it over a task batch.

        Example:
            >>> learner = protonet(lambda p, b, x: (x, b), n_way=2)
            >>> task = Task(torch.tensor([[0.0], [2.0]]), torch.tensor([0, 1]),
            ...             torch.tensor([[0.5]]), torch.tensor([0]))
            >>> learner.logits({}, {}, task)[0]
            tensor([[-0.2500, -2.2500]])
        """
        zs, bufs = _call_model(self.model_fn, params, buffers, task.support_x,
                               f"{self.kind} (support_x)")
        zq, bufs = _call_model(self.model_fn, params, bufs, task.query_x,
                               f"{self.kind} (query_x)")
        for name, z in (("support", zs), ("query", zq)):
            if not isinstance(z, Tensor) or z.dim() != 2:
                shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
                raise ValueError(f"{self.kind}: embed_fn returned {shape} for one task's "
                                 f"{name} set; expected embeddings (n_samples, dim) "
                                 "(flatten them in embed_fn)")
        classes = torch.arange(self.n_way, device=zs.device)
        onehot = (task.support_y[:, None] == classes).to(zs.dtype)  # (K, n_way)
        if self.kind == "matching_net":
            cos = F.normalize(zq, dim=-1) @ F.normalize(zs, dim=-1).T  # (Q, K)
            attention = torch.softmax(self.scale * cos, dim=-1)
            return torch.log(attention @ onehot), bufs
        protos = (onehot.T @ zs) / onehot.sum(0)[:, None]  # (n_way, D)
        if self.distance == "sqeuclidean":
            dist = (zq[:, None, :] - protos[None, :, :]).pow(2).sum(-1)
        else:
            dist = 1.0 - F.normalize(zq, dim=-1) @ F.normalize(protos, dim=-1).T
        return -self.scale * dist, bufs

    def task_loss(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                  task: Task) -> tuple[Tensor, TensorDict]:
        """Return ``(query cross-entropy of one task, new_buffers)`` (no task dim)."""
        logits, bufs = self.logits(meta_params, buffers, task)
        return F.cross_entropy(logits, task.query_y), bufs

    def _check_labels(self, tasks: Task, where: str) -> None:
        for name in ("support_y", "query_y"):
            y = getattr(tasks, name)
            if not isinstance(y, Tensor) or y.dtype not in (torch.int32, torch.int64):
                seen = y.dtype if isinstance(y, Tensor) else type(y).__name__
                raise ValueError(f"{where}: tasks.{name} must be int64 class ids (T, n), "
                                 f"got {seen}")
            if y.ndim != 2:  # e.g. one-hot rows (T, n, n_way)
                raise ValueError(f"{where}: tasks.{name} must be class ids of shape (T, n), "
                                 f"got shape {tuple(y.shape)}")
        if torch.compiler.is_compiling():  # value checks are host syncs: eager only
            return
        for kind in ("support", "query"):  # a query id >= n_way: an out-of-bounds gather
            y = getattr(tasks, f"{kind}_y")
            if y.numel() and (bool((y < 0).any()) or bool((y >= self.n_way).any())):
                raise ValueError(f"{where}: {kind} labels must be class ids in "
                                 f"0..{self.n_way - 1} (n_way={self.n_way}), got values in "
                                 f"{int(y.min())}..{int(y.max())}")
        y = tasks.support_y
        counts = (y[..., None] == torch.arange(self.n_way, device=y.device)).sum(1)  # (T, n)
        empty = (counts == 0).nonzero()
        if len(empty):
            t, c = (int(v) for v in empty[0])
            raise ValueError(f"{where}: task {t} has no support example of class {c}; every "
                             f"class 0..{self.n_way - 1} needs at least one (a prototype is a "
                             "mean of support embeddings)")

    def _new_buffers(self, buffers: Mapping[str, Tensor], buf_t: Mapping[str, Tensor],
                     ) -> TensorDict:
        return {k: buf_t[k].mean(0).to(b.dtype) if b.is_floating_point() else buf_t[k][0]
                for k, b in buffers.items()}

    def meta_loss(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                  tasks: Task) -> tuple[Tensor, TensorDict]:
        """Return ``(mean over tasks of the query cross-entropy, new_buffers)``.

        Example:
            >>> learner = protonet(lambda p, b, x: (x @ p["w"], b), n_way=2)
            >>> y = torch.tensor([[0, 1, 0, 1]] * 3)
            >>> tasks = Task(torch.randn(3, 4, 5), y, torch.randn(3, 4, 5), y)
            >>> learner.meta_loss({"w": torch.randn(5, 8)}, {}, tasks)[0].shape
            torch.Size([])
        """
        where = f"{self.kind}.meta_loss(params, buffers, tasks)"
        check_task_batch(tasks, where)
        self._check_labels(tasks, where)

        def run() -> tuple[Tensor, TensorDict]:
            loss_t, buf_t = self._task_vmap(self.task_loss)(meta_params, buffers, tasks)
            return loss_t.mean(), self._new_buffers(buffers, buf_t)

        return _call_translated(where, run)

    def meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        *, wrt: Collection[str] | None = None, loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Return ``(grads, meta_loss, new_buffers)``: the gradient of :meth:`meta_loss`.

        ``wrt`` (default all) names the params to differentiate; ``loss_scale`` multiplies
        the differentiated loss only (fp16), as in :meth:`MetaLearner.meta_grad`.

        Example:
            >>> learner = matching_net(lambda p, b, x: (x @ p["w"], b), n_way=2)
            >>> y = torch.tensor([[0, 1, 0, 1]] * 3)
            >>> tasks = Task(torch.randn(3, 4, 5), y, torch.randn(3, 4, 5), y)
            >>> g, loss, _ = learner.meta_grad({"w": torch.randn(5, 8)}, {}, tasks)
            >>> tuple(g["w"].shape)
            (5, 8)
        """
        where = f"{self.kind}.meta_grad(params, buffers, tasks)"
        check_task_batch(tasks, where)
        self._check_labels(tasks, where)
        n = n_tasks(tasks)
        names = wrt_names(meta_params, wrt, "meta_grad")

        def run() -> tuple[TensorDict, Tensor, TensorDict]:
            g, lsum, buf_t = task_loss_grad(
                meta_params, names,
                lambda merged: self._task_vmap(self.task_loss)(merged, buffers, tasks),
                loss_scale)
            return {k: g[k] / n for k in names}, lsum / n, self._new_buffers(buffers, buf_t)

        return _call_translated(where, run)


def protonet(
    embed_fn: Callable[..., Any],
    *,
    n_way: int,
    distance: str = "sqeuclidean",
    scale: float = 1.0,
    randomness: str = "error",
) -> MetricLearner:
    """Return a prototypical-network :class:`MetricLearner` (logits: negative distances).

    Args:
        embed_fn: ``embed_fn(params, buffers, x) -> (embeddings (N, D), new_buffers)``
            (torchfn's stateless contract, e.g. :func:`torchfn.functional.make_functional`).
        n_way: classes per episode; support labels are ``0..n_way-1`` (a static int, so the
            step compiles without host syncs).
        distance: ``"sqeuclidean"`` (the paper's) or ``"cosine"`` (``1 - cos``).
        scale: multiplies the negative distances (a fixed temperature; cosine distances
            lie in ``[0, 2]``, so a scale around 10 helps there).
        randomness: the task ``vmap``'s (``"error"``, ``"different"``, ``"same"``).

    Example:
        >>> protonet(lambda p, b, x: (x @ p["w"], b), n_way=5, distance="cosine", scale=10.0)
        MetricLearner(protonet, n_way=5, distance='cosine', scale=10)
    """
    return MetricLearner(embed_fn, kind="protonet", n_way=n_way, distance=distance,
                         scale=scale, randomness=randomness)


def matching_net(
    embed_fn: Callable[..., Any],
    *,
    n_way: int,
    scale: float = 1.0,
    randomness: str = "error",
) -> MetricLearner:
    """Return a matching-network :class:`MetricLearner`: cosine attention over the support set.

    ``p(c | q) = sum_{j: y_j = c} softmax_j(scale * cos(embed(q), embed(s_j)))``; no
    full-context embeddings (module docstring). Arguments as in :func:`protonet`.

    Example:
        >>> matching_net(lambda p, b, x: (x @ p["w"], b), n_way=5)
        MetricLearner(matching_net, n_way=5, scale=1)
    """
    return MetricLearner(embed_fn, kind="matching_net", n_way=n_way, distance="cosine",
                         scale=scale, randomness=randomness)
