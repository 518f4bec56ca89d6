"""MAML++ (Antoniou, Edwards, Storkey 2019, "How to train your MAML") as composable options.

Each piece is an option of :func:`maml_plus_plus`; with every piece off the learner *is*
second-order MAML (same inner loop, same numbers, checked bitwise in the tests):

- ``lslr`` (learned per-step, per-layer inner learning rates): one meta-parameter
  ``"lslr:<name>"`` of shape ``(inner_steps,)`` per adapted parameter tensor (MAML++'s
  "layer" is a parameter tensor: a weight and its bias each have their own rates), all
  initialised at ``inner_lr``. Inner step ``i`` is ``theta - lslr:<name>[i] * grad``.
- ``multi_step_loss`` (MSL): the query loss after *every* inner step, weighted by
  :func:`msl_weights`: uniform at outer step 0, the non-final weights decaying linearly to
  ``msl_floor`` over ``msl_anneal_steps`` outer steps (the final weight takes the rest, the
  weights always sum to 1), as in the paper's code.
- ``first_order_until=N`` (derivative-order annealing): first order for outer steps
  ``0..N-1``, second order from step ``N`` on.
- ``per_step_bn=names``: per-step copies of the named parameters and buffers (BatchNorm
  weights/biases and running statistics: :func:`batchnorm_names`); inner step ``i`` and
  the query after it use row ``i`` of each ``(inner_steps, ...)`` stack.

The outer step counter lives in the buffers under :data:`STEP_KEY` (an int64 0-d tensor,
incremented by every :meth:`MamlPlusPlus.meta_grad`), so the MSL weights and the order
switch are tensors computed from it inside the step: a compiled step never recompiles while
the weights change. :meth:`MamlPlusPlus.init_buffers` adds it (and stacks per-step buffers);
pass its result to :func:`torchfn.meta.init_meta_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from torchfn._checks import _call_model, _call_translated, _part
from torchfn.functional import BatchNorm
from torchfn.meta._maml import LR_PREFIX, MetaLearner, init_inner_state, task_loss_grad
from torchfn.meta._tasks import Task, check_task_batch, n_tasks, wrt_names

__all__ = ["LSLR_PREFIX", "STEP_KEY", "MamlPlusPlus", "batchnorm_names", "maml_plus_plus",
           "msl_weights"]

LSLR_PREFIX = "lslr:"
STEP_KEY = "mamlpp:step"

TensorDict = dict[str, Tensor]


def msl_weights(
    step: Tensor, inner_steps: int, anneal_steps: int, *, floor: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Return the multi-step-loss weights ``(inner_steps,)`` at outer step ``step`` (a tensor).

    With ``n = inner_steps`` and ``t = min(step / anneal_steps, 1)`` (``t = 1`` when
    ``anneal_steps == 0``), each of the first ``n - 1`` weights is ``max((1 - t) / n, floor)``
    and the last is ``1 - (n - 1) * that``: uniform ``1/n`` at step 0, then moving linearly
    toward the last step, the earlier ones kept at ``floor`` (default ``0.03 / n``, the MAML++
    code's). Only tensor ops on ``step``, so a compiled step does not recompile as it changes.

    Example:
        >>> msl_weights(torch.tensor(0), 4, 100)
        tensor([0.2500, 0.2500, 0.2500, 0.2500])
        >>> msl_weights(torch.tensor(100), 4, 100)
        tensor([0.0075, 0.0075, 0.0075, 0.9775])
    """
    _check_msl(inner_steps, anneal_steps, floor, "msl_weights")
    n = inner_steps
    floor = 0.03 / n if floor is None else floor
    step = torch.as_tensor(step)
    if anneal_steps > 0:
        t = (step.to(dtype) / anneal_steps).clamp(max=1.0)
    else:
        t = torch.ones((), dtype=dtype, device=step.device)
    early = ((1.0 - t) / n).clamp(min=floor)
    return torch.cat([early.reshape(1).expand(n - 1), (1.0 - (n - 1) * early).reshape(1)])


def _check_msl(inner_steps: int, anneal_steps: Any, floor: Any, where: str) -> None:
    if not isinstance(anneal_steps, int) or isinstance(anneal_steps, bool) or anneal_steps < 0:
        raise ValueError(f"{where}(msl_anneal_steps=...): expected an int >= 0 (outer steps "
                         f"over which the weights move to the last step), got {anneal_steps!r}")
    if floor is not None and not (0.0 <= floor <= 1.0 / inner_steps):
        raise ValueError(f"{where}(msl_floor=...): expected a float in [0, 1/inner_steps] = "
                         f"[0, {1.0 / inner_steps:g}], got {floor!r}")


def batchnorm_names(module: nn.Module) -> list[str]:
    """Return the names of ``module``'s BatchNorm parameters and buffers (for ``per_step_bn``).

    Covers ``nn.BatchNorm1d/2d/3d`` and :class:`torchfn.functional.BatchNorm`: their
    ``weight``, ``bias``, ``running_mean``, ``running_var`` and ``num_batches_tracked``
    (those that exist), named as in ``named_parameters()``/``named_buffers()``.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        >>> batchnorm_names(net)
        ['1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, BatchNorm)
    out = []
    for path, m in module.named_modules():
        if isinstance(m, kinds):
            prefix = f"{path}." if path else ""
            out += [prefix + n for n, _ in m.named_parameters(recurse=False)]
            out += [prefix + n for n, b in m.named_buffers(recurse=False) if b is not None]
    return out


class MamlPlusPlus(MetaLearner):
    """A MAML++ :class:`MetaLearner`; build it with :func:`maml_plus_plus` (options there).

    Meta-params: ``init(params)`` (per-step params stacked ``(inner_steps, ...)``, plus the
    ``"lslr:<name>"`` rates). Buffers: ``init_buffers(buffers)`` (per-step buffers stacked,
    plus the outer step counter :data:`STEP_KEY` when MSL or ``first_order_until`` need it).
    :meth:`adapt` returns the model's own shapes (row ``inner_steps - 1`` of each per-step
    stack), so ``model_fn(*learner.adapt(...), query_x)`` evaluates an adapted task.
    """

    def __init__(
        self,
        model_fn: Callable[..., tuple[Any, TensorDict]],
        loss_fn: Callable[[Any, Tensor], Tensor],
        *,
        inner_steps: int,
        inner_lr: float | None,
        lslr: bool,
        multi_step_loss: bool,
        msl_anneal_steps: int | None,
        msl_floor: float | None,
        first_order: bool,
        first_order_until: int | None,
        per_step_bn: Collection[str] | None,
        adapt_filter: Callable[[str], bool] | None,
        randomness: str,
        unfold_convs: str | bool = "auto",
    ) -> None:
        where = "maml_plus_plus"
        for name, value in (("lslr", lslr), ("multi_step_loss", multi_step_loss),
                            ("first_order", first_order)):
            if not isinstance(value, bool):
                raise ValueError(f"{where}({name}=...): expected a bool, got {value!r}")
        super().__init__(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                         first_order=first_order, adapt_filter=adapt_filter,
                         randomness=randomness, unfold_convs=unfold_convs)
        if multi_step_loss:
            if msl_anneal_steps is None:
                raise ValueError(
                    f"{where}(multi_step_loss=True): pass msl_anneal_steps=N, the outer steps "
                    "over which the loss weights move from uniform to the last inner step "
                    "(the paper anneals over its first 10 of 100 epochs), or "
                    "multi_step_loss=False")
            _check_msl(inner_steps, msl_anneal_steps, msl_floor, where)
        elif msl_anneal_steps is not None or msl_floor is not None:
            raise ValueError(f"{where}(multi_step_loss=False, msl_anneal_steps="
                             f"{msl_anneal_steps!r}, msl_floor={msl_floor!r}): the MSL options "
                             "need multi_step_loss=True; drop them or switch it on")
        if first_order_until is not None:
            if (not isinstance(first_order_until, int) or isinstance(first_order_until, bool)
                    or first_order_until < 0):
                raise ValueError(f"{where}(first_order_until=...): expected None or an int >= 0 "
                                 f"(outer steps run first order), got {first_order_until!r}")
            if first_order:
                raise ValueError(f"{where}(first_order=True, first_order_until="
                                 f"{first_order_until}): first_order=True is first order for "
                                 "every step already; pass one of the two")
        if per_step_bn is not None and (isinstance(per_step_bn, str) or not all(
                isinstance(n, str) for n in per_step_bn)):
            raise ValueError(f"{where}(per_step_bn=...): expected a collection of parameter/"
                             f"buffer names (e.g. batchnorm_names(module)), got {per_step_bn!r}")
        self.lslr = lslr
        self.multi_step_loss = multi_step_loss
        self.msl_anneal_steps = msl_anneal_steps
        self.msl_floor = msl_floor
        self.first_order_until = first_order_until
        self.per_step = frozenset(per_step_bn or ())
        self.needs_step = multi_step_loss or first_order_until is not None

    def __repr__(self) -> str:
        on = [k for k, v in (("lslr", self.lslr), ("multi_step_loss", self.multi_step_loss),
                             ("per_step_bn", bool(self.per_step)),
                             ("first_order", self.first_order)) if v]
        if self.first_order_until is not None:
            on.append(f"first_order_until={self.first_order_until}")
        return f"MamlPlusPlus(inner_steps={self.inner_steps}, {', '.join(on) or 'all off'})"

    # -- names and state -------------------------------------------------------------------------

    def _model_names(self, meta_params: Mapping[str, Tensor]) -> list[str]:
        return [k for k in meta_params
                if not (k.startswith(LSLR_PREFIX) or k.startswith(LR_PREFIX))]

    def init(self, params: Mapping[str, Tensor]) -> TensorDict:
        """Return the meta-params: ``params`` (per-step ones stacked), plus ``lslr:<name>``.

        A per-step parameter ``p`` becomes ``(inner_steps, *p.shape)``, every row ``p``;
        ``lslr:<name>`` is ``(inner_steps,)`` filled with ``inner_lr``, one per adapted
        parameter. Detached copies.

        Example:
            >>> import torch.nn.functional as F
            >>> learner = maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss,
            ...                          inner_steps=3, inner_lr=0.1, multi_step_loss=False)
            >>> {k: tuple(v.shape) for k, v in learner.init({"w": torch.zeros(2, 1)}).items()}
            {'w': (2, 1), 'lslr:w': (3,)}
        """
        bad = [k for k in params if k.startswith((LSLR_PREFIX, LR_PREFIX))]
        if bad:
            raise ValueError(f"MamlPlusPlus.init(params): names may not start with "
                             f"{LSLR_PREFIX!r} or {LR_PREFIX!r}, got {bad}")
        meta = self._stack_per_step(params)
        if self.lslr:
            for k in self.adapted_names(meta):
                meta[LSLR_PREFIX + k] = torch.full((self.inner_steps,), float(self.inner_lr),
                                                   dtype=meta[k].dtype, device=meta[k].device)
        return meta

    def init_buffers(self, buffers: Mapping[str, Tensor], params: Mapping[str, Tensor] | None = None,
                     ) -> TensorDict:
        """Return the buffers: per-step ones stacked ``(inner_steps, ...)``, plus the step counter.

        The counter :data:`STEP_KEY` (int64, 0) is added when ``multi_step_loss`` or
        ``first_order_until`` need it, on the device of the first buffer (or of ``params``,
        else the CPU). ``params`` (the model's, optional) lets it check that every
        ``per_step_bn`` name is a parameter or a buffer.

        Example:
            >>> import torch.nn.functional as F
            >>> learner = maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss,
            ...                          inner_steps=2, msl_anneal_steps=10)
            >>> learner.init_buffers({})
            {'mamlpp:step': tensor(0)}
        """
        if STEP_KEY in buffers:
            raise ValueError(f"MamlPlusPlus.init_buffers(buffers): buffers hold {STEP_KEY!r} "
                             "already (init_buffers was applied twice? init_meta_state applies "
                             "it); pass the model's own buffers")
        if params is not None:
            missing = sorted(self.per_step - set(params) - set(buffers))
            if missing:
                raise ValueError(f"maml_plus_plus(per_step_bn=...): {missing} are neither "
                                 f"parameters {sorted(params)} nor buffers {sorted(buffers)}")
        out = self._stack_per_step(buffers)
        if self.needs_step:
            devs = [v.device for v in (*buffers.values(), *(params or {}).values())]
            out[STEP_KEY] = torch.zeros((), dtype=torch.long,
                                        device=devs[0] if devs else None)
        return out

    def _stack_per_step(self, tree: Mapping[str, Tensor]) -> TensorDict:
        """Detached copies of ``tree``; the per-step entries repeated ``(inner_steps, ...)``."""
        out = {k: v.detach().clone() for k, v in tree.items()}
        for k in self.per_step & set(out):
            out[k] = out[k].unsqueeze(0).repeat(self.inner_steps, *([1] * out[k].dim()))
        return out

    def _check_state(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                     where: str) -> None:
        if self.needs_step and STEP_KEY not in buffers:
            raise ValueError(
                f"{where}: buffers have no {STEP_KEY!r} (the outer step counter that "
                "multi_step_loss / first_order_until read); build them with "
                "init_meta_state(learner, params, buffers, ...) (it applies learner.init_buffers) or "
                "learner.init_buffers(buffers)")
        if self.lslr:
            missing = [LSLR_PREFIX + k for k in self.adapted_names(meta_params)
                       if LSLR_PREFIX + k not in meta_params]
            if missing:
                raise ValueError(f"{where}: meta_params lack the learned rates {missing}; "
                                 "build them with learner.init(params)")
        for k in self.per_step:
            t = meta_params.get(k, buffers.get(k))
            if t is None:
                raise ValueError(f"{where}: per_step_bn name {k!r} is neither a meta-param nor "
                                 "a buffer")
            if t.dim() == 0 or t.shape[0] != self.inner_steps:
                raise ValueError(
                    f"{where}: per-step {k!r} has shape {tuple(t.shape)}; expected "
                    f"(inner_steps={self.inner_steps}, ...); build the state with "
                    "learner.init(params) and learner.init_buffers(buffers)")

    # -- one task --------------------------------------------------------------------------------

    def _view(self, tree: Mapping[str, Tensor], i: int) -> TensorDict:
        return {k: v[i] if k in self.per_step else v for k, v in tree.items() if k != STEP_KEY}

    def _put(self, stacked: Mapping[str, Tensor], new: Mapping[str, Tensor], i: int) -> TensorDict:
        out = {}
        for k, v in stacked.items():
            if k in self.per_step:
                rows = [new[k] if j == i else v[j] for j in range(self.inner_steps)]
                out[k] = torch.stack(rows)
            else:
                out[k] = new[k]
        return out

    def _inner_loop(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
        support_x: Any, support_y: Any, alpha: Tensor | None,
    ) -> tuple[list[TensorDict], list[TensorDict]]:
        """Return the full params and stacked buffers after each inner step of one task."""
        model_names = self._model_names(meta_params)
        fast = {k: meta_params[k] for k in self.adapted_names(meta_params)}
        bufs = {k: v for k, v in buffers.items() if k != STEP_KEY}

        def merged(f: Mapping[str, Tensor]) -> TensorDict:
            return {k: f[k] if k in f else meta_params[k] for k in model_names}

        opt_state = None  # built at the first step, per task (init_inner_state)
        params_after, bufs_after = [], []
        with _part("torchfn.inner_loop"):
            for i in range(self.inner_steps):
                def support_loss(f: TensorDict, b: TensorDict, i: int = i) -> Any:
                    out, nb = _call_model(self._model_call, self._view(merged(f), i),
                                          self._view(b, i), support_x,
                                          "maml_plus_plus (support_x)")
                    return self.loss_fn(out, support_y), self._put(b, nb, i)

                g, bufs = grad(support_loss, has_aux=True)(fast, bufs)
                if self.first_order:
                    g = {k: v.detach() for k, v in g.items()}
                elif alpha is not None:  # derivative-order annealing: alpha is 0. or 1.
                    g = {k: v.detach() + alpha * (v - v.detach()) for k, v in g.items()}
                if self.lslr:
                    fast = {k: fast[k] - meta_params[LSLR_PREFIX + k][i] * g[k] for k in fast}
                else:
                    if opt_state is None:
                        opt_state = init_inner_state(self.inner_opt, fast, g)
                    updates, opt_state = self.inner_opt.update(g, opt_state, params=fast,
                                                               inplace=False)
                    fast = {k: fast[k] + updates[k] for k in fast}
                params_after.append(merged(fast))
                bufs_after.append(bufs)
        return params_after, bufs_after

    def adapt(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
        support_x: Any, support_y: Any,
    ) -> tuple[TensorDict, TensorDict]:
        """Return ``(fast_params, buffers)`` of one task in the model's own shapes.

        Per-step stacks are cut at row ``inner_steps - 1`` (the row the last inner step and
        the query after it use), the step counter is dropped, so ``model_fn(fast, bufs,
        query_x)`` evaluates the adapted model (support only: no query forward here).

        Example:
            >>> import torch.nn.functional as F
            >>> learner = maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss,
            ...                          inner_lr=0.5, multi_step_loss=False)
            >>> meta = learner.init({"w": torch.zeros(1, 1)})
            >>> fast, _ = learner.adapt(meta, {}, torch.ones(4, 1), torch.full((4, 1), 2.0))
            >>> fast["w"]
            tensor([[2.]])
        """
        params_after, bufs_after = self._inner_loop(meta_params, buffers, support_x, support_y,
                                                    None)
        last = self.inner_steps - 1
        return self._view(params_after[last], last), self._view(bufs_after[last], last)

    # -- schedules -------------------------------------------------------------------------------

    def _schedule(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                  ) -> tuple[Tensor | None, Tensor | None]:
        """Return ``(msl weights or None, order switch alpha or None)`` from the step counter."""
        dtype = next(v.dtype for k, v in meta_params.items() if v.is_floating_point())
        weights = alpha = None
        if self.multi_step_loss:
            assert self.msl_anneal_steps is not None
            weights = msl_weights(buffers[STEP_KEY], self.inner_steps, self.msl_anneal_steps,
                                  floor=self.msl_floor, dtype=dtype)
        if self.first_order_until is not None:
            alpha = (buffers[STEP_KEY] >= self.first_order_until).to(dtype)
        return weights, alpha

    def _objective(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task,
        weights: Tensor | None, alpha: Tensor | None,
    ) -> tuple[Tensor, TensorDict]:
        params_after, bufs_after = self._inner_loop(meta_params, buffers, task.support_x,
                                                    task.support_y, alpha)
        last = self.inner_steps - 1
        steps = range(self.inner_steps) if weights is not None else [last]
        losses = []
        for i in steps:  # the query after inner step i (row i of per-step stacks)
            out, nb = _call_model(self._model_call, self._view(params_after[i], i),
                                  self._view(bufs_after[i], i), task.query_x,
                                  "maml_plus_plus (query_x)")
            losses.append(self.loss_fn(out, task.query_y))
        bufs = self._put(bufs_after[last], nb, last)  # buffers of the last query forward
        if weights is None:
            return losses[-1], bufs
        return sum(w * loss for w, loss in zip(weights.unbind(), losses, strict=True)), bufs

    def task_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task,
    ) -> tuple[Tensor, TensorDict]:
        """Return ``(MAML++ objective of one task, new stacked buffers)`` (no task dim).

        The objective is the MSL-weighted sum of the query losses (weights from the counter
        in ``buffers``) or, without MSL, the query loss after the last inner step.
        """
        weights, alpha = self._schedule(meta_params, buffers)
        return self._objective(meta_params, buffers, task, weights, alpha)

    def _vmapped(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                 tasks: Task) -> tuple[Tensor, TensorDict]:
        weights, alpha = self._schedule(meta_params, buffers)
        fn = vmap(self._objective, in_dims=(None, None, 0, None, None),
                  randomness=self.randomness)
        return fn(meta_params, buffers, tasks, weights, alpha)

    def _new_buffers(self, buffers: Mapping[str, Tensor], buf_t: Mapping[str, Tensor],
                     ) -> TensorDict:
        out = {}
        for k, b in buffers.items():
            if k == STEP_KEY:
                out[k] = b + 1
            elif b.is_floating_point():
                out[k] = buf_t[k].mean(0).to(b.dtype)
            else:
                out[k] = buf_t[k][0]
        return out

    def meta_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
    ) -> tuple[Tensor, TensorDict]:
        """Return ``(mean over tasks of the MAML++ objective, new_buffers)``; counter + 1.

        Example:
            >>> import torch.nn.functional as F
            >>> from torchfn.meta import sinusoid_tasks
            >>> learner = maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss,
            ...                          inner_steps=2, msl_anneal_steps=10)
            >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
            >>> meta, bufs = learner.init({"w": torch.zeros(1, 1)}), learner.init_buffers({})
            >>> loss, bufs = learner.meta_loss(meta, bufs, tasks)
            >>> loss.shape, int(bufs["mamlpp:step"])
            (torch.Size([]), 1)
        """
        where = "MamlPlusPlus.meta_loss(meta_params, buffers, tasks)"
        check_task_batch(tasks, where)
        self._check_state(meta_params, buffers, where)

        def run() -> tuple[Tensor, TensorDict]:
            with self._attention_backend():
                loss_t, buf_t = self._vmapped(meta_params, buffers, tasks)
            return loss_t.mean(), self._new_buffers(buffers, buf_t)

        return _call_translated(where, run)

    def meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        *, wrt: Collection[str] | None = None, loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Return ``(meta_grads, meta_loss, new_buffers)`` for a task batch (task dim 0).

        As :meth:`MetaLearner.meta_grad`: the gradient of :meth:`meta_loss` with respect to
        the meta-params ``wrt`` (default all: model params, per-step stacks, ``lslr:*``
        rates); ``loss_scale`` multiplies the differentiated loss only. ``new_buffers`` are
        the task-averaged buffers with the step counter incremented.

        Example:
            >>> import torch.nn.functional as F
            >>> from torchfn.meta import sinusoid_tasks
            >>> learner = maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss,
            ...                          inner_steps=2, msl_anneal_steps=10)
            >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
            >>> meta, bufs = learner.init({"w": torch.zeros(1, 1)}), learner.init_buffers({})
            >>> g, loss, bufs = learner.meta_grad(meta, bufs, tasks)
            >>> sorted(g), tuple(g["lslr:w"].shape)
            (['lslr:w', 'w'], (2,))
        """
        where = "MamlPlusPlus.meta_grad(meta_params, buffers, tasks)"
        check_task_batch(tasks, where)
        self._check_state(meta_params, buffers, where)
        n = n_tasks(tasks)
        names = wrt_names(meta_params, wrt, "maml_plus_plus.meta_grad")

        def run() -> tuple[TensorDict, Tensor, TensorDict]:
            with self._attention_backend():
                g, lsum, buf_t = task_loss_grad(
                    meta_params, names,
                    lambda merged: self._vmapped(merged, buffers, tasks), loss_scale)
            return ({k: g[k] / n for k in names}, lsum / n, self._new_buffers(buffers, buf_t))

        return _call_translated(where, run)


def maml_plus_plus(
    model_fn: Callable[..., Any],
    loss_fn: Callable[[Any, Tensor], Tensor],
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    lslr: bool = True,
    multi_step_loss: bool = True,
    msl_anneal_steps: int | None = None,
    msl_floor: float | None = None,
    first_order: bool = False,
    first_order_until: int | None = None,
    per_step_bn: Collection[str] | None = None,
    adapt_filter: Callable[[str], bool] | None = None,
    randomness: str = "error",
    unfold_convs: str | bool = "auto",
) -> MamlPlusPlus:
    """Return a MAML++ :class:`MamlPlusPlus` learner; every piece is an option (module docstring).

    With ``lslr=False, multi_step_loss=False, first_order_until=None, per_step_bn=None`` it
    computes exactly what :func:`torchfn.meta.maml` computes (the same inner loop,
    ``torchopt.sgd(inner_lr)``). Build the state with ``learner.init(params)`` (done by
    :func:`torchfn.meta.init_meta_state`) and ``learner.init_buffers(buffers)`` (pass it to
    ``init_meta_state``); train with :func:`torchfn.meta.make_meta_train_step`. The counter
    counts applied outer steps: a step skipped for a non-finite loss (``skip_nonfinite``)
    keeps the old buffers, so it does not advance the schedules; with ``grad_accum_steps``
    every micro-batch reads the same counter. The inner step is plain SGD (no ``inner_opt``),
    and ``chunk_size``/``remat`` are not offered here.

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. :func:`torchfn.functional.make_functional`).
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        inner_steps: inner SGD steps per task (an int >= 1).
        inner_lr: the inner rate (``None``: 0.01); with ``lslr`` the initial learned rates.
        lslr: learn a rate per inner step and per adapted parameter tensor: meta-params
            ``"lslr:<name>"`` of shape ``(inner_steps,)``, trained by the outer optimizer.
        multi_step_loss: the objective is ``sum_i w_i * query_loss_after_step_i`` with
            :func:`msl_weights` at the current outer step; the reported loss is that sum.
        msl_anneal_steps: outer steps over which the weights move from uniform to the last
            step (required with ``multi_step_loss``).
        msl_floor: the final value of the non-final weights (default ``0.03 / inner_steps``).
        first_order: first-order inner gradients at every step (first-order MAML++).
        first_order_until: derivative-order annealing: outer steps ``< N`` are first order,
            later ones second order. One compiled graph for both phases: the inner gradient
            is ``g.detach() + a * (g - g.detach())`` with ``a = (step >= N)`` a tensor, so
            the first-order phase gets exactly first-order numbers but pays the second-order
            cost. To save that cost, build two learners (``first_order=True`` for the first
            N steps, then ``first_order=False``), two steps (two compilations) and switch in
            Python at step N; their states are interchangeable.
        per_step_bn: names of parameters and buffers held per inner step (usually
            :func:`batchnorm_names` of the module; MAML++'s BNWB and BNRS). They are stacked
            ``(inner_steps, ...)``; inner step ``i`` and the query after it use row ``i``;
            per-step params are not adapted by the inner loop unless ``adapt_filter`` keeps
            them. Works with any module whose stacked tensors are used row by row; torch's
            and torchfn's BatchNorm are what it is meant for.
        adapt_filter: ``adapt_filter(name) -> bool`` keeps the params the inner loop adapts
            (default all but the model's frozen params, ``model_fn.frozen``; MAML++ leaves
            BatchNorm params out: ``lambda n: n not in bn``).
        randomness: the task ``vmap``'s (``"error"``, ``"different"``, ``"same"``).
        unfold_convs: as in :func:`torchfn.meta.maml`: ``"auto"`` (default) computes the
            adapted convolutions as unfold + matmul under ``torch.compile`` on CUDA
            (``nn.Conv2d`` eagerly); ``True`` on any device when compiled; ``False`` never.

    Example:
        >>> import torch.nn.functional as F
        >>> maml_plus_plus(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_steps=5,
        ...                msl_anneal_steps=100, first_order_until=50)
        MamlPlusPlus(inner_steps=5, lslr, multi_step_loss, first_order_until=50)
    """
    return MamlPlusPlus(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                        lslr=lslr, multi_step_loss=multi_step_loss,
                        msl_anneal_steps=msl_anneal_steps, msl_floor=msl_floor,
                        first_order=first_order, first_order_until=first_order_until,
                        per_step_bn=per_step_bn, adapt_filter=adapt_filter,
                        randomness=randomness, unfold_convs=unfold_convs)
