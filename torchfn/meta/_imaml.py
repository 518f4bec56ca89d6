"""Implicit MAML (Rajeswaran, Finn, Kakade, Levine 2019): a meta-gradient without unrolling.

Per task, the inner problem is proximal: ``phi* = argmin_phi L_s(phi) + lam/2 ||phi - theta||^2``
(support loss ``L_s``). At its minimum ``grad L_s(phi*) + lam (phi* - theta) = 0``, so by the
implicit function theorem ``d phi* / d theta = (I + H / lam)^{-1}`` with ``H`` the Hessian of
``L_s`` at ``phi*``, and the meta-gradient of the query loss ``L_q(phi*)`` is

    g = (I + H / lam)^{-1} grad L_q(phi*).

The inner problem is solved approximately by ``inner_steps`` steps of an inner optimizer on the
proximal objective, detached (no autograd graph is kept, so memory does not grow with
``inner_steps``), and the linear system by ``cg_steps`` conjugate-gradient iterations over
Hessian-vector products: ``H v`` is a vector-Jacobian product of ``grad L_s`` linearised once at
``phi*`` (``torch.func.vjp``; ``H`` is symmetric), so random ops such as dropout draw one set
of masks for every product of a task. The number of CG iterations is fixed (no data-dependent
exit), so the solve vmaps over tasks and compiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad, vjp, vmap
from torchopt.base import GradientTransformation

from torchfn._checks import _call_model, _call_translated, _part
from torchfn.meta._maml import LossFn, MetaLearner, TensorDict, init_inner_state
from torchfn.meta._tasks import Task, check_task_batch, wrt_names

__all__ = ["ImplicitMetaLearner", "imaml"]


def _dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, and 0 where ``den`` is 0 (a converged CG residual, a zero right-hand side)."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)),
                       torch.zeros_like(num))


def conjugate_gradient(matvec: Callable[[TensorDict], TensorDict], b: TensorDict,
                       steps: int) -> TensorDict:
    """Return ``x ~ A^{-1} b`` after ``steps`` CG iterations from ``x = 0`` (``A`` symmetric
    positive definite, given as ``matvec(v) = A v`` on dicts of tensors). Fixed iteration count,
    no host sync; a residual that reaches exactly zero stops changing ``x`` (private)."""
    x = {k: torch.zeros_like(v) for k, v in b.items()}
    r = dict(b)
    p = dict(b)
    rr = _dot(r, r)
    for _ in range(steps):
        ap = matvec(p)
        alpha = _safe_div(rr, _dot(p, ap))
        x = {k: x[k] + alpha * p[k] for k in x}
        r = {k: r[k] - alpha * ap[k] for k in r}
        rr_new = _dot(r, r)
        beta = _safe_div(rr_new, rr)
        p = {k: r[k] + beta * p[k] for k in p}
        rr = rr_new
    return x


class ImplicitMetaLearner(MetaLearner):
    """An iMAML meta-learner: proximal inner loop, implicit meta-gradient by conjugate gradient.

    Build it with :func:`imaml`. It is a :class:`MetaLearner` (same ``model_fn``/``loss_fn``
    contract, task batches, ``chunk_size``, ``randomness``, BatchNorm buffers), so it drops
    into :func:`torchfn.meta.make_meta_train_step` (``compile="inner"`` included). Differences
    from MAML:

    - :meth:`adapt` returns ``phi*`` *detached*: no gradient flows through the inner loop.
    - :meth:`meta_grad` returns the implicit gradient (module docstring), not the gradient of
      an unrolled loop.
    - :meth:`meta_loss` raises: its autograd gradient would be zero, not the meta-gradient.
      :meth:`meta_grad` returns the meta-loss; :meth:`task_loss` evaluates one task.
    """

    def __init__(
        self,
        model_fn: Callable[..., tuple[Any, TensorDict]],
        loss_fn: LossFn,
        *,
        lam: float,
        cg_steps: int,
        cg_damping: float = 0.0,
        inner_steps: int = 10,
        inner_lr: float | None = None,
        inner_opt: GradientTransformation | None = None,
        chunk_size: int | None = None,
        randomness: str = "error",
        unfold_convs: str | bool = "auto",
    ) -> None:
        _check_imaml_args(lam=lam, cg_steps=cg_steps, cg_damping=cg_damping)
        super().__init__(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                         inner_opt=inner_opt, chunk_size=chunk_size, randomness=randomness,
                         unfold_convs=unfold_convs)
        self.lam = float(lam)
        self.cg_steps = cg_steps
        self.cg_damping = float(cg_damping)

    def __repr__(self) -> str:
        extra = "" if self.randomness == "error" else f", randomness={self.randomness!r}"
        extra += f", cg_damping={self.cg_damping}" if self.cg_damping else ""
        return (f"ImplicitMetaLearner(imaml, inner_steps={self.inner_steps}, lam={self.lam}, "
                f"cg_steps={self.cg_steps}, chunk_size={self.chunk_size}{extra})")

    # -- one task ----------------------------------------------------------------------------------

    def _support_loss(self, support_x: Any, support_y: Any, fixed: TensorDict
                      ) -> Callable[..., Any]:
        def support_loss(p: TensorDict, bufs: TensorDict) -> tuple[Tensor, TensorDict]:
            out, new_bufs = _call_model(self._model_call, {**fixed, **p}, bufs, support_x,
                                        "meta-learner (support_x)")
            return self.loss_fn(out, support_y), new_bufs

        return support_loss

    def _split(self, meta_params: Mapping[str, Tensor]) -> tuple[TensorDict, TensorDict]:
        """``(theta, fixed)``, detached: the adapted meta-params (all but the model's frozen
        ones) and the others, which every model call takes as they are."""
        adapted = set(self.adapted_names(meta_params))
        theta: TensorDict = {}
        fixed: TensorDict = {}
        for k in self._model_names(meta_params):
            (theta if k in adapted else fixed)[k] = meta_params[k].detach()
        return theta, fixed

    def adapt(
        self,
        meta_params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        support_x: Any,
        support_y: Any,
    ) -> tuple[TensorDict, TensorDict]:
        """Return ``(phi*, new_buffers)``: ``inner_steps`` steps on the proximal support loss.

        ``phi* ~ argmin_phi L_s(phi) + lam/2 ||phi - theta||^2`` from ``phi = theta``
        (``theta = meta_params``), by the inner optimizer (default ``torchopt.sgd(inner_lr)``)
        on the gradient ``grad L_s(phi) + lam (phi - theta)``. Everything is detached:
        ``phi*`` has no autograd history (memory does not grow with ``inner_steps``; a
        gradient through it is zero -- :meth:`meta_grad` gives the implicit one). One task:
        ``support_x (K, ...)``; ``vmap`` it for a task batch. ``new_buffers`` are the buffers
        after the last support forward (BatchNorm running statistics). The model's frozen
        params (``model_fn.frozen``) are not adapted: ``phi*`` holds them as given.

        Example:
            >>> import torch.nn.functional as F
            >>> learner = imaml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.25,
            ...                 inner_steps=50, lam=2.0, cg_steps=1)
            >>> x, y = torch.ones(4, 1), torch.full((4, 1), 2.0)
            >>> fast, _ = learner.adapt({"w": torch.zeros(1, 1)}, {}, x, y)
            >>> fast["w"]  # argmin (w - 2)^2 + (w - 0)^2 = 1
            tensor([[1.]])
        """
        phi, fixed, bufs = self._adapt(meta_params, buffers, support_x, support_y)
        return {**fixed, **phi}, bufs

    def _adapt(self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
               support_x: Any, support_y: Any) -> tuple[TensorDict, TensorDict, TensorDict]:
        """:meth:`adapt` as ``(phi* of the adapted params, the fixed params, buffers)``."""
        theta, fixed = self._split(meta_params)
        phi = dict(theta)
        bufs = {k: v.detach() for k, v in buffers.items()}
        state = None  # built at the first step, per task (init_inner_state)
        with _part("torchfn.inner_loop"):
            for _ in range(self.inner_steps):
                phi, state, bufs = self._proximal_step(phi, theta, state, bufs, support_x,
                                                       support_y, fixed)
        return phi, fixed, bufs

    def _proximal_step(
        self, phi: TensorDict, theta: TensorDict, state: Any, bufs: TensorDict, support_x: Any,
        support_y: Any, fixed: TensorDict,
    ) -> tuple[TensorDict, Any, TensorDict]:
        """One inner step of one task on the proximal support loss, detached:
        ``(phi, inner_opt state, buffers)`` after it (``fixed``: the params not adapted)."""
        g, bufs = grad(self._support_loss(support_x, support_y, fixed), has_aux=True)(phi,
                                                                                       bufs)
        g = {k: g[k].detach() + self.lam * (phi[k] - theta[k]) for k in phi}
        bufs = {k: v.detach() for k, v in bufs.items()}
        if state is None:
            state = init_inner_state(self.inner_opt, phi, g)
        updates, state = self.inner_opt.update(g, state, params=phi, inplace=False)
        phi = {k: (phi[k] + updates[k]).detach() for k in phi}
        return phi, state, bufs

    def task_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task
    ) -> tuple[Tensor, TensorDict]:
        """Return ``(query loss at phi*, new_buffers)`` for one task (no task dim), detached."""
        phi, bufs = self.adapt(meta_params, buffers, task.support_x, task.support_y)
        out, bufs = _call_model(self._model_call, phi, bufs, task.query_x,
                                "meta-learner (query_x)")
        return self.loss_fn(out, task.query_y).detach(), bufs

    def task_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task,
        loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Return ``(g, query loss at phi*, new_buffers)`` for one task (no task dim).

        ``g = ((1 + cg_damping) I + H / lam)^{-1} grad L_q(phi*)`` by ``cg_steps`` CG
        iterations, ``H`` the Hessian of the support loss at ``phi*`` (with the task's
        incoming ``buffers``). ``loss_scale`` multiplies ``g`` (fp16), not the loss.
        """
        phi, fixed, bufs = self._adapt(meta_params, buffers, task.support_x, task.support_y)
        return self._implicit_solve(phi, bufs, buffers, task, loss_scale, fixed)

    def _implicit_solve(
        self, phi: TensorDict, bufs: TensorDict, buffers: Mapping[str, Tensor], task: Task,
        loss_scale: Tensor | None, fixed: TensorDict,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """:meth:`task_grad` after the inner loop: the query gradient at ``phi`` (with the
        post-adaptation ``bufs``) and the CG solve on the support Hessian at ``phi`` (with the
        task's incoming ``buffers``)."""
        support_loss = self._support_loss(task.support_x, task.support_y, fixed)
        in_bufs = {k: v.detach() for k, v in buffers.items()}

        def query_loss(p: TensorDict) -> tuple[Tensor, tuple[Tensor, TensorDict]]:
            out, new_bufs = _call_model(self._model_call, {**fixed, **p}, bufs, task.query_x,
                                        "meta-learner (query_x)")
            loss = self.loss_fn(out, task.query_y)
            if loss_scale is None:
                return loss, (loss.detach(), new_bufs)
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
            return loss * loss_scale, (loss.detach(), new_bufs)

        gq, (loss, new_bufs) = grad(query_loss, has_aux=True)(phi)
        gq = {k: v.detach() for k, v in gq.items()}

        def support_grad(p: TensorDict) -> TensorDict:
            return grad(support_loss, has_aux=True)(p, in_bufs)[0]

        _, hvp_fn = vjp(support_grad, phi)
        diag, inv_lam = 1.0 + self.cg_damping, 1.0 / self.lam

        def matvec(v: TensorDict) -> TensorDict:
            (hv,) = hvp_fn(v)
            return {k: diag * v[k] + inv_lam * hv[k].detach() for k in v}

        with _part("torchfn.implicit_cg"):
            g = conjugate_gradient(matvec, gq, self.cg_steps)
        return g, loss, {k: v.detach() for k, v in new_bufs.items()}

    # -- task batches ------------------------------------------------------------------------------

    def meta_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task
    ) -> tuple[Tensor, TensorDict]:
        """Raise ``ValueError``: iMAML's meta-gradient is implicit, not the gradient of a loss.

        ``phi*`` is detached, so ``torch.func.grad`` of a meta-loss would be zero. Use
        :meth:`meta_grad` (it returns the meta-loss too) or :meth:`task_loss` under ``vmap``.
        """
        raise ValueError(
            "ImplicitMetaLearner.meta_loss: iMAML's meta-gradient is implicit (a CG solve at "
            "the detached inner solution), so a gradient of a meta-loss would be zero; use "
            "meta_grad(params, buffers, tasks), which returns (grads, meta_loss, buffers), or "
            "vmap task_loss to evaluate"
        )

    def meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        *, wrt: Collection[str] | None = None, loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Return ``(meta_grads, meta_loss, new_buffers)``: the implicit meta-gradient, task mean.

        ``tasks`` is a :class:`Task` batch with task dim 0 (``support_x (T, K, ...)``,
        ``query_x (T, Q, ...)``); the tasks are vmapped (``chunk_size`` at a time), each
        solving its inner problem and its CG system batched with the others.
        ``meta_grads[k]`` has the shape of ``meta_params[k]`` and is
        ``mean_t ((1 + cg_damping) I + H_t / lam)^{-1} grad L_q,t(phi*_t)``;
        ``meta_loss`` (0-d) is ``mean_t L_q,t(phi*_t)``; ``new_buffers`` are the
        post-query buffers averaged over tasks (integer buffers: task 0's). ``wrt`` keeps
        only those meta-params' gradients (the solve still covers all adapted params: every
        param but the model's frozen ones is adapted and in the proximal term; a frozen param's
        meta-gradient is zero). ``loss_scale`` multiplies the gradients (fp16).

        Example:
            >>> import torch.nn.functional as F
            >>> from torchfn.meta import sinusoid_tasks
            >>> learner = imaml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.01,
            ...                 lam=1.0, cg_steps=3)
            >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
            >>> g, loss, _ = learner.meta_grad({"w": torch.zeros(1, 1)}, {}, tasks)
            >>> g["w"].shape, loss.shape
            (torch.Size([1, 1]), torch.Size([]))
        """
        where = "ImplicitMetaLearner.meta_grad(meta_params, buffers, tasks)"
        check_task_batch(tasks, where)
        with self._attention_backend():
            return _call_translated(where, self._imaml_grad, meta_params, buffers, tasks, wrt,
                                    loss_scale)

    def _imaml_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        wrt: Collection[str] | None, loss_scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        names = wrt_names(meta_params, wrt, "imaml.meta_grad")

        def one_task(p: Mapping[str, Tensor], b: Mapping[str, Tensor], task: Task) -> Any:
            return self.task_grad(p, b, task, loss_scale)

        def chunk_grad(chunk: Task) -> tuple[TensorDict, Tensor, TensorDict]:
            g_t, loss_t, buf_t = self._task_vmap(one_task)(meta_params, buffers, chunk)
            # names not adapted (frozen) are absent: _sum_over_chunks gives them zeros
            return {k: g_t[k].sum(0) for k in names if k in g_t}, loss_t.sum(), buf_t

        return self._sum_over_chunks(meta_params, buffers, tasks, names, chunk_grad)

    # -- compile="inner" of make_meta_train_step (_inner_compile.py) ------------------------------

    def _chunk_proximal_step(self) -> Callable[..., Any]:
        """Return ``step(phi, theta, state, bufs, support_x, support_y, fixed) -> (phi, state,
        bufs)``: one proximal inner step of every task of a chunk, detached. Every argument but
        ``theta`` and ``fixed`` (the adapted and the other meta-params, no task dim) has the
        task dim 0."""
        return vmap(self._proximal_step, in_dims=(0, None, 0, 0, 0, 0, None),
                    randomness=self.randomness)

    def _chunk_solve(self) -> Callable[..., Any]:
        """Return ``solve(phi, bufs, buffers, chunk, loss_scale, fixed) -> (summed g, summed
        loss, per-task buffers)``: :meth:`task_grad` after the inner loop for every task of a
        chunk (``phi``, ``bufs``, ``chunk`` with the task dim 0; ``buffers``, the incoming
        ones, ``loss_scale`` and ``fixed``, the params not adapted, without)."""
        solve_t = vmap(self._implicit_solve, in_dims=(0, 0, None, 0, None, None),
                       randomness=self.randomness)

        def solve(phi: TensorDict, bufs: TensorDict, buffers: TensorDict, chunk: Task,
                  loss_scale: Tensor | None, fixed: TensorDict
                  ) -> tuple[TensorDict, Tensor, TensorDict]:
            g_t, loss_t, buf_t = solve_t(phi, bufs, buffers, chunk, loss_scale, fixed)
            return {k: v.sum(0) for k, v in g_t.items()}, loss_t.sum(), buf_t

        return solve

    def _stepped_chunk_grad(
        self, step: Callable[..., Any], solve: Callable[..., Any],
        meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], chunk: Task,
        names: list[str], loss_scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """The ``chunk_grad`` of :meth:`meta_grad` from the pieces of :meth:`_chunk_proximal_step`
        (called ``inner_steps`` times) and :meth:`_chunk_solve` (once), e.g. each compiled.

        The inner state starts with the task dim (the meta-params and buffers broadcast to
        ``(T, ...)`` copies, the optimizer state vmap-initialised), so every call of ``step``
        sees one input layout and reuses one compiled graph."""
        n = optree.tree_leaves(chunk.support_x)[0].shape[0]
        theta, fixed = self._split(meta_params)
        phi = {k: v.expand(n, *v.shape).contiguous() for k, v in theta.items()}
        in_bufs = {k: v.detach() for k, v in buffers.items()}
        bufs = {k: v.expand(n, *v.shape).contiguous() for k, v in in_bufs.items()}
        state = vmap(self.inner_opt.init)(phi)
        with _part("torchfn.inner_loop"):
            for _ in range(self.inner_steps):
                phi, state, bufs = step(phi, theta, state, bufs, chunk.support_x,
                                        chunk.support_y, fixed)
        with _part("torchfn.implicit_cg"):
            g, loss, buf_t = solve(phi, bufs, in_bufs, chunk, loss_scale, fixed)
        return {k: g[k] for k in names if k in g}, loss, buf_t


def _check_imaml_args(*, lam: Any, cg_steps: Any, cg_damping: Any) -> None:
    def is_real(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    if not is_real(lam) or lam <= 0:
        raise ValueError(
            f"imaml(lam=...): expected a finite number > 0 (the proximal strength lambda), got "
            f"{lam!r}; lam -> 0 leaves the inner problem unregularised and I + H/lam singular"
        )
    if not isinstance(cg_steps, int) or isinstance(cg_steps, bool) or cg_steps < 1:
        raise ValueError(f"imaml(cg_steps=...): expected an int >= 1 (conjugate-gradient "
                         f"iterations), got {cg_steps!r}")
    if not is_real(cg_damping) or cg_damping < 0:
        raise ValueError(f"imaml(cg_damping=...): expected a finite number >= 0 (added to the "
                         f"diagonal of I + H/lam), got {cg_damping!r}")


def imaml(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    *,
    lam: float = 1.0,
    cg_steps: int = 5,
    cg_damping: float = 0.0,
    inner_steps: int = 10,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    unfold_convs: str | bool = "auto",
) -> ImplicitMetaLearner:
    """Return an implicit-MAML :class:`ImplicitMetaLearner` (a :class:`MetaLearner`).

    Per task ``t`` (support loss ``L_s``, query loss ``L_q``, meta-params ``theta``):

    - inner: ``phi*_t ~ argmin_phi L_s(phi) + lam/2 ||phi - theta||^2``, ``inner_steps``
      steps of ``inner_opt`` (default ``torchopt.sgd(inner_lr)``) from ``phi = theta``,
      detached: memory independent of ``inner_steps``;
    - outer: ``g_t = ((1 + cg_damping) I + H_t / lam)^{-1} grad L_q(phi*_t)``, ``H_t`` the
      Hessian of ``L_s`` at ``phi*_t``, by ``cg_steps`` conjugate-gradient iterations over
      Hessian-vector products (a fixed count: vmapped over tasks, compiles with
      ``fullgraph=True``); the meta-gradient is ``mean_t g_t``, each of the shape of its param.

    Compiling: ``torch.compile(make_meta_train_step(learner, opt), fullgraph=True)`` unrolls
    the inner loop into one graph, so its compile time grows with ``inner_steps``;
    ``make_meta_train_step(learner, opt, compile="inner")`` compiles the proximal inner step of
    a task chunk and the implicit solve each once and calls the step ``inner_steps`` times
    (same numbers, compile time flat in ``inner_steps``).

    The solve is exact when the inner problem is solved (``inner_steps`` large enough for the
    inner optimizer to converge; plain SGD needs ``inner_lr < 2 / (lam + max eig H)``) and
    ``cg_steps`` reaches the number of params (much fewer in practice: the paper uses 5).
    ``I + H/lam`` must be positive definite (``lam`` above minus the smallest Hessian
    eigenvalue); ``cg_damping > 0`` adds to its diagonal for non-convex support losses.

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`).
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        lam: proximal strength ``lambda > 0``.
        cg_steps: conjugate-gradient iterations (an int >= 1).
        cg_damping: ``>= 0``, added to the diagonal of the system.
        inner_steps: inner steps per task (an int >= 1).
        inner_lr: learning rate of the default inner ``torchopt.sgd``; ``None`` means 0.01.
            Not together with ``inner_opt`` (``ValueError``).
        inner_opt: any torchopt ``GradientTransformation``, applied (out-of-place) to the
            proximal gradient ``grad L_s(phi) + lam (phi - theta)``.
        chunk_size: vmap at most this many tasks at once; ``None`` vmaps the whole batch.
        randomness: the task ``vmap``'s: ``"error"`` (default), ``"different"`` or ``"same"``
            (dropout); each task's Hessian-vector products share one set of masks.
        unfold_convs: as in :func:`torchfn.meta.maml`: ``"auto"`` (default) computes the
            adapted convolutions as unfold + matmul under ``torch.compile`` on CUDA
            (``nn.Conv2d`` eagerly); ``True`` on any device when compiled; ``False`` never.

    Example:
        >>> import torch.nn.functional as F
        >>> from torchfn.meta import sinusoid_tasks
        >>> learner = imaml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.01,
        ...                 inner_steps=5, lam=2.0, cg_steps=5)
        >>> learner
        ImplicitMetaLearner(imaml, inner_steps=5, lam=2.0, cg_steps=5, chunk_size=None)
        >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
        >>> grads, loss, _ = learner.meta_grad({"w": torch.zeros(1, 1)}, {}, tasks)
        >>> grads["w"].shape
        torch.Size([1, 1])
    """
    return ImplicitMetaLearner(model_fn, loss_fn, lam=lam, cg_steps=cg_steps,
                               cg_damping=cg_damping, inner_steps=inner_steps,
                               inner_lr=inner_lr, inner_opt=inner_opt, chunk_size=chunk_size,
                               randomness=randomness, unfold_convs=unfold_convs)
