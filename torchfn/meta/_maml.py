"""The MAML family as one pure object: MAML, first-order MAML, ANIL, Meta-SGD, Reptile.

Every algorithm is the same inner loop -- ``k`` steps of a torchopt transformation on the
support loss, out-of-place -- seen from a different outer objective:

- MAML: the query loss of the adapted params, differentiated *through* the inner loop (the
  inner gradients come from ``torch.func.grad``, so an outer ``grad`` is second order).
- first-order MAML: the same, with the inner gradients detached.
- ANIL: MAML adapting only the params a name predicate selects (the head).
- Meta-SGD: MAML whose per-parameter inner learning rates are meta-params too; they are stored
  in the same flat dict under ``"inner_lr:" + name`` and scale the inner updates elementwise.
- Reptile: no outer gradient; the outer "gradient" is ``params - mean_t(adapted_t)``, so an
  outer ``torchopt.sgd(lr=eps)`` is exactly Reptile's ``params + eps * (mean_t phi_t - params)``.

Tasks are vmapped (task dim 0); ``chunk_size`` splits them into chunks whose gradients are
summed one after another, so the memory of the backward is that of one chunk. ``randomness``
is that task ``vmap``'s (dropout in training mode needs ``"different"`` or ``"same"``).

Second order: torch's fused ``scaled_dot_product_attention`` kernels have no double backward,
and ``layer_norm`` gives wrong gradients inside ``grad(vmap(grad(...)))``, so the second-order
variants (MAML, ANIL, Meta-SGD) run their inner loop and meta-gradient with the math attention
kernel and a composite layer norm (``_second_order.py`` says why); first-order MAML and Reptile
keep the fused kernels.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any

import optree
import torch
import torchopt
from torch import Tensor
from torch.func import grad, grad_and_value, vmap
from torchopt.base import GradientTransformation

from torchfn._checks import (
    _call_model,
    _call_translated,
    _check_randomness,
    _part,
    check_model_fn,
)
from torchfn.functional import FunctionalModel
from torchfn.meta import _regions
from torchfn.meta._auto_unfold import check_unfold_convs, compiled_model_fn
from torchfn.meta._regions import (
    REGIONS_MIN_TORCH,
    make_region_step,
    region_chunk_grad,
    regions_available,
    regions_supported,
)
from torchfn.meta._remat import remat_task_grad
from torchfn.meta._second_order import may_use_layer_norm, second_order_context
from torchfn.meta._tasks import Task, check_task_batch, n_tasks, wrt_names

__all__ = ["LR_PREFIX", "MetaLearner", "anil", "fomaml", "maml", "meta_sgd", "reptile"]

LR_PREFIX = "inner_lr:"
_DEFAULT_INNER_LR = 0.01

TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Tensor], Tensor]


class MetaLearner:
    """A MAML-family meta-learner: pure ``init``/``adapt``/``meta_loss``/``meta_grad`` functions.

    Build it with :func:`maml`, :func:`fomaml`, :func:`anil`, :func:`meta_sgd` or
    :func:`reptile`. ``model_fn`` follows torchfn's stateless contract
    (``model_fn(params, buffers, x) -> (outputs, new_buffers)``, see
    :func:`torchfn.functional.make_functional`); ``loss_fn(outputs, targets)`` returns a
    scalar mean loss. A model in training mode normalises with each task's own batch
    statistics (transductive BatchNorm, per task, as in the MAML paper). Task fields may be
    tensors or dicts (pytrees) of tensors, e.g. Hugging Face inputs
    ``{"input_ids": (T, K, L), "attention_mask": (T, K, L)}``; like every torchfn step,
    ``model_fn`` gets one task's dict field as keywords, ``model_fn(p, b, **x)`` (so a
    Hugging Face model's ``make_functional`` ``model_fn`` takes it as it is), and any other
    field (a tensor, a tuple) as one positional argument.

    ``randomness`` is the task ``vmap``'s (as in :func:`torch.func.vmap` and
    :func:`torchfn.ensembles.ensemble_apply`): ``"error"`` (default: refuse random ops such as
    dropout in training mode, with an error naming this keyword), ``"different"`` (each task
    draws its own dropout masks from the global generator, like a loop over tasks) or
    ``"same"`` (one set of masks shared by all tasks).

    ``inner_lr`` (default 0.01) is the learning rate of the default inner optimizer
    ``torchopt.sgd(inner_lr)``; with ``inner_opt`` given, pass the rate to it instead
    (``ValueError`` otherwise), except for Meta-SGD, where ``inner_lr`` is the initial value of
    the learned rates.

    ``remat=True`` (second-order MAML, ANIL, Meta-SGD with the default SGD inner step)
    checkpoints the inner loop in :meth:`meta_grad`: it keeps the ``inner_steps`` parameter
    iterates instead of the unrolled loop's activations and walks the loop backwards with
    Hessian-vector products, recomputing each inner step (one extra forward+backward of the
    support loss per step), so the activation memory is one inner step's whatever
    ``inner_steps`` is; the numbers are those of ``remat=False``. :meth:`meta_loss` is not
    checkpointed (an outer ``grad`` of it differentiates the unrolled loop). ``chunk_size``
    trades the other way: it bounds the memory in the number of tasks, at no recompute.
    First-order MAML and Reptile hold no inner-loop activations, so ``remat=True`` with them
    is refused (``ValueError``), as are ``inner_opt`` and random ops (``randomness`` other
    than ``"error"``), which the recompute cannot reproduce.

    ``compile_regions=True`` (first-order MAML) cuts the compile time of
    a compiled :meth:`meta_grad` or meta train step: one inner step of the task chunk is a
    :func:`torch.compiler.nested_compile_region`, traced, differentiated and built once and
    called ``inner_steps`` times, instead of ``inner_steps`` unrolled copies in the graph; the
    outer gradient is ``torch.autograd.grad`` traced into the graph. It needs Dynamo's
    ``torch._dynamo.config.trace_autograd_ops = True`` (:func:`torchfn.compile.compile_step`
    sets it for its calls; ``RuntimeError`` otherwise) and a side-effect-free ``model_fn``
    (a pure function of ``(params, buffers, x)``): torch 2.13 cannot trace the module-slot
    swap of :func:`torchfn.functional.make_functional`'s ``model_fn`` inside a region, so
    that combination is refused (``ValueError``). Same numbers as the unrolled graph; eager
    calls ignore it. In torch 2.13 second order through the region is refused (``ValueError``):
    exact under ``backend="aot_eager"``, but Inductor miscompiles it for conv nets once the
    region runs twice (``benchmarks/results/meta-compile-time-cpu.md``), so only first-order
    MAML takes ``compile_regions=True``. For a compile time flat in ``inner_steps`` with any of
    MAML, first-order MAML, ANIL and Meta-SGD (second order exact, ``make_functional`` models
    included), build the train step with
    ``make_meta_train_step(learner, optimizer, compile="inner")``.

    Speed, for conv nets compiled on CUDA (``unfold_convs="auto"``, the default): when
    ``torch.compile`` traces the learner (your ``torch.compile`` of a meta train step,
    ``make_meta_train_step(compile="inner")``), the convolutions whose weights the inner loop
    adapts run as unfold + matmul -- per-task convolutions as batched GEMMs over the tasks
    instead of grouped cuDNN convolutions, several times faster for the 4-block few-shot conv
    net's step in fp32 (see ``benchmarks/README.md``); a whole-step ``torch.compile`` keeps the
    unfolded inputs (``kh * kw`` times each conv's input) for the backward, ``compile="inner"``
    recomputes them there (less peak memory than JAX's on that net). Eager calls keep
    ``nn.Conv2d`` (there the unfolded path is slower). It needs a
    :func:`torchfn.functional.make_functional` ``model_fn`` (it swaps layers of the private
    module copy; ``learner.model_fn``, the param names and checkpoints are unchanged);
    ``unfold_convs=False`` opts out. For every layer unfolded (the 1-channel first one too),
    build the model from :func:`torchfn.compile.unfold_convs` ``(net, min_patch=1)``; for
    convolutions left as they are, pass ``torch.compile`` the options of
    :func:`torchfn.compile.inductor_options`.
    """

    def __init__(
        self,
        model_fn: Callable[..., tuple[Any, TensorDict]],
        loss_fn: LossFn,
        *,
        inner_steps: int = 1,
        inner_lr: float | None = None,
        inner_opt: GradientTransformation | None = None,
        first_order: bool = False,
        adapt_filter: Callable[[str], bool] | None = None,
        learn_inner_lr: bool = False,
        reptile: bool = False,
        chunk_size: int | None = None,
        randomness: str = "error",
        remat: bool = False,
        compile_regions: bool = False,
        unfold_convs: str | bool = "auto",
    ) -> None:
        check_model_fn(model_fn, "MetaLearner")
        _check_randomness(randomness, "MetaLearner(randomness=...)")
        check_unfold_convs(unfold_convs, "MetaLearner")
        _check_compile_regions(compile_regions, model_fn, reptile=reptile, remat=remat,
                               randomness=randomness, first_order=first_order)
        _check_remat(remat, inner_opt=inner_opt, first_order=first_order, reptile=reptile,
                     randomness=randomness)
        if not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"MetaLearner(inner_steps=...): expected an int >= 1, got {inner_steps!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(
                f"MetaLearner(chunk_size=...): expected None or an int >= 1, got {chunk_size!r}"
            )
        if learn_inner_lr and reptile:
            raise ValueError("MetaLearner(learn_inner_lr=True, reptile=True): Reptile has no "
                             "outer gradient to learn inner learning rates with")
        if inner_lr is not None and inner_opt is not None and not learn_inner_lr:
            raise ValueError(
                f"MetaLearner(inner_lr={inner_lr!r}, inner_opt=...): inner_opt makes the inner "
                "steps and would ignore inner_lr; pass the learning rate to inner_opt instead "
                f"(e.g. inner_opt=torchopt.sgd(lr={inner_lr!r}))"
            )
        if inner_lr is None:
            inner_lr = _DEFAULT_INNER_LR
        if (isinstance(inner_lr, bool) or not isinstance(inner_lr, numbers.Real)
                or not math.isfinite(inner_lr) or inner_lr <= 0):
            raise ValueError(f"MetaLearner(inner_lr=...): expected a finite number > 0 (the "
                             f"inner SGD step size), got {inner_lr!r}")
        self.model_fn = model_fn
        self._layer_norm = may_use_layer_norm(model_fn)
        self.loss_fn = loss_fn
        self.inner_steps = inner_steps
        self.inner_lr = inner_lr
        if inner_opt is None:  # Meta-SGD: the learned rates are the step sizes
            inner_opt = torchopt.sgd(lr=1.0 if learn_inner_lr else inner_lr)
        self.inner_opt = inner_opt
        self.first_order = first_order or reptile
        self.adapt_filter = adapt_filter
        self.learn_inner_lr = learn_inner_lr
        self.reptile = reptile
        self.chunk_size = chunk_size
        self.randomness = randomness
        self.remat = remat
        self.compile_regions = compile_regions
        self.unfold_convs = unfold_convs
        # what the inner and outer loops call: model_fn, or under torch.compile its twin with
        # unfolded convolutions (_auto_unfold.py)
        # adapt_filter=None adapts every param but the model's frozen ones
        frozen = frozenset(getattr(model_fn, "frozen", ()))
        self._adapts: Callable[[str], bool] = (
            adapt_filter if adapt_filter is not None else (lambda k: k not in frozen))
        self._model_call = compiled_model_fn(model_fn, unfold_convs, self._adapts)
        self._region_step = torch.compiler.nested_compile_region(make_region_step(
            self._model_call, loss_fn, inner_opt, model_names=self._model_names,
            first_order=self.first_order, lr_prefix=LR_PREFIX if learn_inner_lr else None,
            randomness=randomness))

    def __repr__(self) -> str:
        kind = ("reptile" if self.reptile else "meta_sgd" if self.learn_inner_lr
                else "fomaml" if self.first_order else "maml")
        extra = "" if self.randomness == "error" else f", randomness={self.randomness!r}"
        extra += ", remat=True" if self.remat else ""
        extra += ", compile_regions=True" if self.compile_regions else ""
        extra += "" if self.unfold_convs == "auto" else f", unfold_convs={self.unfold_convs}"
        return (f"MetaLearner({kind}, inner_steps={self.inner_steps}, "
                f"chunk_size={self.chunk_size}, adapt_filter={self.adapt_filter is not None}"
                f"{extra})")

    def _attention_backend(self) -> contextlib.AbstractContextManager[None]:
        """Second order: the math SDPA backend and a composite layer norm (_second_order.py)."""
        if self.first_order:
            return contextlib.nullcontext()
        return second_order_context(layer_norm=self._layer_norm)

    def _task_vmap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return vmap(fn, in_dims=(None, None, 0), randomness=self.randomness)

    # -- names -----------------------------------------------------------------------------------

    def _model_names(self, meta_params: Mapping[str, Tensor]) -> list[str]:
        return [k for k in meta_params if not k.startswith(LR_PREFIX)]

    def adapted_names(self, meta_params: Mapping[str, Tensor]) -> list[str]:
        """Return the names of the params the inner loop adapts: those ``adapt_filter`` keeps,
        by default all but the model's frozen ones (``model_fn.frozen``)."""
        names = self._model_names(meta_params)
        kept = [k for k in names if self._adapts(k)]
        if not kept:
            what = ("adapt_filter=...): it keeps" if self.adapt_filter is not None
                    else "model_fn=...): every param is frozen (model_fn.frozen), so it adapts")
            raise ValueError(f"MetaLearner({what} none of the params {names}")
        return kept

    def init(self, params: Mapping[str, Tensor]) -> TensorDict:
        """Return the meta-params: ``params`` plus, for Meta-SGD, ``inner_lr:<name>`` tensors.

        The learned rates start at ``inner_lr`` with the shape of their param. Detached copies.

        Example:
            >>> import torch.nn.functional as F
            >>> learner = meta_sgd(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.1)
            >>> sorted(learner.init({"w": torch.zeros(3, 1)}))
            ['inner_lr:w', 'w']
        """
        bad = [k for k in params if k.startswith(LR_PREFIX)]
        if bad:
            raise ValueError(f"MetaLearner.init(params): names may not start with "
                             f"{LR_PREFIX!r}, got {bad}")
        meta = {k: v.detach().clone() for k, v in params.items()}
        adapted = self.adapted_names(meta)  # checks adapt_filter
        if self.learn_inner_lr:
            for k in adapted:
                meta[LR_PREFIX + k] = torch.full_like(meta[k], self.inner_lr)
        return meta

    # -- one task ----------------------------------------------------------------------------------

    def _merge(self, meta_params: Mapping[str, Tensor], fast: Mapping[str, Tensor]) -> TensorDict:
        return {k: fast[k] if k in fast else meta_params[k] for k in self._model_names(meta_params)}

    def adapt(
        self,
        meta_params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        support_x: Any,
        support_y: Any,
    ) -> tuple[TensorDict, TensorDict]:
        """Return ``(fast_params, new_buffers)`` after ``inner_steps`` steps on one task's support.

        ``fast_params`` has every model param (those not adapted are the meta-params
        themselves); it is differentiable w.r.t. ``meta_params`` (second order unless
        first-order). One task: ``support_x (K, ...)`` (or a dict of such tensors); ``vmap``
        it for a task batch. :meth:`meta_grad` and :meth:`meta_loss` run it with the math
        attention kernel and a composite layer norm in second order (module docstring); an
        outer ``grad`` of your own around a ``vmap`` of it needs the same for attention or
        LayerNorm models.

        Example:
            >>> import torch.nn.functional as F
            >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.5)
            >>> x, y = torch.ones(4, 1), torch.full((4, 1), 2.0)
            >>> fast, _ = learner.adapt({"w": torch.zeros(1, 1)}, {}, x, y)
            >>> fast["w"]
            tensor([[2.]])
        """
        names = self.adapted_names(meta_params)
        if self.learn_inner_lr:
            missing = [LR_PREFIX + k for k in names if LR_PREFIX + k not in meta_params]
            if missing:
                raise ValueError(f"meta_sgd: meta_params lack the learned inner rates {missing}; "
                                 "build them with learner.init(params) (init_meta_state does)")
        fast = {k: meta_params[k] for k in names}

        def support_loss(f: TensorDict, bufs: TensorDict) -> tuple[Tensor, TensorDict]:
            out, new_bufs = _call_model(self._model_call, self._merge(meta_params, f), bufs,
                                        support_x, "meta-learner (support_x)")
            return self.loss_fn(out, support_y), new_bufs

        bufs = dict(buffers)
        state = None
        with _part("torchfn.inner_loop"):
            for _ in range(self.inner_steps):
                g, bufs = grad(support_loss, has_aux=True)(fast, bufs)
                if self.first_order:
                    g = {k: v.detach() for k, v in g.items()}
                if state is None:
                    state = init_inner_state(self.inner_opt, fast, g)
                updates, state = self.inner_opt.update(g, state, params=fast, inplace=False)
                if self.learn_inner_lr:
                    fast = {k: fast[k] + meta_params[LR_PREFIX + k] * updates[k] for k in fast}
                else:
                    fast = {k: fast[k] + updates[k] for k in fast}
        return self._merge(meta_params, fast), bufs

    def task_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task
    ) -> tuple[Tensor, TensorDict]:
        """Return ``(query loss after adaptation, new_buffers)`` for one task (no task dim)."""
        fast, bufs = self.adapt(meta_params, buffers, task.support_x, task.support_y)
        out, bufs = _call_model(self._model_call, fast, bufs, task.query_x,
                                "meta-learner (query_x)")
        return self.loss_fn(out, task.query_y), bufs

    def _reptile_delta(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], task: Task
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        fast, bufs = self.adapt(meta_params, buffers, task.support_x, task.support_y)
        # the buffers after the query forward, as the other learners return them
        out, bufs = _call_model(self._model_call, fast, bufs, task.query_x,
                                "meta-learner (query_x)")
        delta = {k: (meta_params[k] - fast[k]).detach() for k in self._model_names(meta_params)}
        return delta, self.loss_fn(out, task.query_y).detach(), bufs

    # -- task batches ------------------------------------------------------------------------------

    def _chunks(self, tasks: Task) -> list[Task]:
        n = n_tasks(tasks)
        c = n if self.chunk_size is None else min(self.chunk_size, n)
        return [Task(*(optree.tree_map(lambda t, i=i: t[i:i + c], f) for f in tasks))
                for i in range(0, n, c)]

    def _replay_draws(self, n_chunks: int) -> Callable[[], None]:
        """Return ``before_chunk()``, called before each of ``n_chunks`` task chunks. With
        ``randomness="same"`` and more than one chunk it restores the generator states (CPU and
        CUDA) of the first chunk, so all tasks share one set of random draws as they do
        unchunked (torch's chunked ``vmap`` does the same; the generators end where one chunk's
        draws leave them); otherwise it does nothing."""
        if self.randomness != "same" or n_chunks == 1:
            return lambda: None
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"MetaLearner(randomness='same', chunk_size={self.chunk_size}) under "
                "torch.compile: every chunk must replay the same random draws, which needs the "
                "generator state restored between chunks (not traceable); use chunk_size=None "
                "or run eagerly")
        cpu_state = torch.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

        def before_chunk() -> None:
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)

        return before_chunk

    def meta_loss(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task
    ) -> tuple[Tensor, TensorDict]:
        """Return ``(mean over tasks of the post-adaptation query loss, new_buffers)``.

        ``tasks`` is a :class:`Task` batch with task dim 0 (``support_x (T, K, ...)``); the
        tasks are vmapped (in chunks of ``chunk_size``). ``new_buffers`` are the buffers after
        each task's query forward, averaged over tasks (integer buffers: task 0's).
        Differentiate it with ``torch.func.grad`` (or use :meth:`meta_grad`).

        Example:
            >>> import torch.nn.functional as F
            >>> from torchfn.meta import sinusoid_tasks
            >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_lr=0.01)
            >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
            >>> loss, _ = learner.meta_loss({"w": torch.zeros(1, 1)}, {}, tasks)
            >>> loss.shape
            torch.Size([])
        """
        if self.reptile:
            raise ValueError("MetaLearner.meta_loss: Reptile has no meta-loss to differentiate; "
                             "use meta_grad (its outer 'gradient' is params - mean(adapted))")
        where = "MetaLearner.meta_loss(meta_params, buffers, tasks)"
        check_task_batch(tasks, where)

        def run() -> tuple[Tensor, TensorDict]:
            losses, bufs = [], []
            with self._attention_backend():
                chunks = self._chunks(tasks)
                before_chunk = self._replay_draws(len(chunks))
                for chunk in chunks:
                    before_chunk()
                    loss_t, buf_t = self._task_vmap(self.task_loss)(meta_params, buffers, chunk)
                    losses.append(loss_t)
                    bufs.append(buf_t)
            return torch.cat(losses).mean(), _mean_buffers(bufs, buffers)

        return _call_translated(where, run)

    def meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        *, wrt: Collection[str] | None = None, loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Return ``(meta_grads, meta_loss, new_buffers)`` for a task batch (task dim 0).

        ``wrt`` (default: all) names the meta-params to differentiate (frozen ones are left
        out: no gradient is computed for them; the inner loop still adapts what
        ``adapt_filter`` selects); ``meta_grads`` then has exactly those keys. ``loss_scale``
        (fp16 training) multiplies the differentiated meta-loss (Reptile: the outer
        "gradient"), not the returned ``meta_loss``.

        ``meta_grads`` has the keys of ``meta_params``: the gradient of :meth:`meta_loss`,
        accumulated chunk by chunk (``chunk_size`` tasks at a time, so the backward holds one
        chunk), or for Reptile ``meta_params - mean_t(adapted_t)`` (zero for params that are
        not adapted) with the post-adaptation query loss for reporting.

        Example:
            >>> import torch.nn.functional as F
            >>> from torchfn.meta import sinusoid_tasks
            >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, chunk_size=2)
            >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
            >>> g, loss, _ = learner.meta_grad({"w": torch.zeros(1, 1)}, {}, tasks)
            >>> g["w"].shape
            torch.Size([1, 1])
        """
        where = "MetaLearner.meta_grad(meta_params, buffers, tasks)"
        check_task_batch(tasks, where)
        with self._attention_backend():
            return _call_translated(where, self._meta_grad, meta_params, buffers, tasks, wrt,
                                    loss_scale)

    def _meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        wrt: Collection[str] | None, loss_scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        names = wrt_names(meta_params, wrt, "MetaLearner.meta_grad")

        def chunk_grad(chunk: Task) -> tuple[TensorDict, Tensor, TensorDict]:
            if self._use_regions(meta_params):
                return region_chunk_grad(self, meta_params, buffers, chunk, names, loss_scale)
            if self.remat:
                return self._remat_chunk_grad(meta_params, buffers, chunk, names, loss_scale)
            if self.reptile:
                delta, loss_t, buf_t = self._task_vmap(self._reptile_delta)(
                    meta_params, buffers, chunk
                )
                g = {k: v.sum(0) for k, v in delta.items() if k in names}
                if loss_scale is not None:
                    g = {k: v * loss_scale.to(v.dtype) for k, v in g.items()}
                return g, loss_t.sum(), buf_t

            return task_loss_grad(
                meta_params, names,
                lambda merged: self._task_vmap(self.task_loss)(merged, buffers, chunk),
                loss_scale)

        return self._sum_over_chunks(meta_params, buffers, tasks, names, chunk_grad)

    def _sum_over_chunks(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        names: list[str], chunk_grad: Callable[[Task], tuple[TensorDict, Tensor, TensorDict]],
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Run ``chunk_grad(chunk) -> (summed grads, summed loss, per-task buffers)`` over
        ``chunk_size`` task chunks; return the task means (names a chunk left out: zeros)
        and the post-query buffers averaged over tasks (integer buffers: task 0's)."""
        n = n_tasks(tasks)
        total: TensorDict | None = None
        loss_sum: Tensor | None = None
        bufs = []
        chunks = self._chunks(tasks)
        before_chunk = self._replay_draws(len(chunks))
        for chunk in chunks:
            before_chunk()
            g, lsum, buf_t = chunk_grad(chunk)
            bufs.append(buf_t)
            total = g if total is None else {k: total[k] + g[k] for k in total}
            loss_sum = lsum if loss_sum is None else loss_sum + lsum
        assert total is not None and loss_sum is not None
        grads = {k: total[k] / n if k in total else torch.zeros_like(meta_params[k])
                 for k in names}
        return grads, loss_sum / n, _mean_buffers(bufs, buffers)

    def _use_regions(self, meta_params: Mapping[str, Tensor]) -> bool:
        """Whether this meta_grad runs the inner step as a nested compile region (compiling
        with ``compile_regions=True``); raise where that cannot give the right numbers."""
        if not (self.compile_regions and torch.compiler.is_compiling()):
            return False
        if not regions_supported():
            raise RuntimeError(
                f"MetaLearner(compile_regions=True).meta_grad under torch.compile: the region "
                f"path needs torch >= {'.'.join(map(str, REGIONS_MIN_TORCH))} (Dynamo of torch "
                f"{torch.__version__} cannot trace its requires_grad_ and autograd.grad); use "
                "compile_regions=False or make_meta_train_step(..., compile='inner')"
            )
        if not regions_available():
            raise RuntimeError(
                "MetaLearner(compile_regions=True).meta_grad under torch.compile: the outer "
                "gradient is torch.autograd.grad traced into the graph, which Dynamo refuses "
                "with torch._dynamo.config.trace_autograd_ops=False; set "
                "torch._dynamo.config.trace_autograd_ops = True before compiling (or compile "
                "through torchfn.compile.compile_step, which does), or use compile_regions=False"
            )
        if any(v.requires_grad for v in meta_params.values()):
            raise ValueError(
                "MetaLearner(compile_regions=True).meta_grad under torch.compile: meta_params "
                "require grad, but the region path differentiates detached copies of them and "
                "would cut an outer autograd graph; pass detached meta_params or use "
                "compile_regions=False"
            )
        return True

    def _remat_chunk_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], chunk: Task,
        names: list[str], loss_scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        """Sum over the chunk's tasks of the checkpointed meta-gradient (``_remat.py``)."""
        adapted = self.adapted_names(meta_params)

        def one_task(p: Mapping[str, Tensor], b: Mapping[str, Tensor], task: Task) -> Any:
            rates: dict[str, Tensor | float] = (
                {k: p[LR_PREFIX + k] for k in adapted} if self.learn_inner_lr
                else dict.fromkeys(adapted, self.inner_lr))
            return remat_task_grad(self._model_call, self.loss_fn, self._model_names(p), adapted,
                                   rates, self.inner_steps, p, b, task, loss_scale)

        g_model, g_rate, loss_t, buf_t = self._task_vmap(one_task)(meta_params, buffers, chunk)
        g = {**g_model, **{LR_PREFIX + k: v for k, v in g_rate.items()}}
        return {k: g[k].sum(0) for k in names}, loss_t.sum(), buf_t


def init_inner_state(inner_opt: Any, fast: Mapping[str, Tensor], g: Mapping[str, Tensor]
                     ) -> Any:
    """``inner_opt.init`` of the adapted params ``fast``, given the first inner gradient ``g``.

    Under the task ``vmap`` the meta-params are not batched but the gradients are: a state
    built from ``fast`` alone is one state for all tasks, and optimizers that update their
    state in place (torchopt's ``adam`` moments: ``m.mul(b).add_(g)``) then fail ("output
    with shape [...] doesn't match the broadcast shape [T, ...]"). Built from ``fast`` plus
    zeros shaped like ``g`` (batched where ``g`` is; same values, no dependence on ``g``),
    each task gets its own state.
    """
    return inner_opt.init({k: fast[k] + torch.zeros_like(g[k]) for k in fast})


def _check_remat(remat: Any, *, inner_opt: Any, first_order: bool, reptile: bool,
                 randomness: str) -> None:
    if not isinstance(remat, bool):
        raise ValueError(f"MetaLearner(remat=...): expected a bool, got {remat!r}")
    if not remat:
        return
    if reptile or first_order:
        kind = "reptile" if reptile else "first_order"
        raise ValueError(
            f"MetaLearner(remat=True, {kind}=True): remat checkpoints the second-order "
            "meta-gradient through the inner loop; first-order MAML and Reptile keep no "
            "inner-loop activations already, so there is nothing to rematerialise; drop remat"
        )
    if inner_opt is not None:
        raise ValueError(
            "MetaLearner(remat=True, inner_opt=...): remat's reverse pass is written for the "
            "default plain-SGD inner step (theta - lr * grad); leave inner_opt out and pass "
            "inner_lr=..., or use remat=False with this inner_opt"
        )
    if randomness != "error":
        raise ValueError(
            f"MetaLearner(remat=True, randomness={randomness!r}): remat recomputes each inner "
            "step's forward, where random ops (dropout in training mode) would draw new masks "
            "and give a wrong meta-gradient; use remat=False, or a model without random ops "
            "(eval-mode dropout) and randomness='error'"
        )


def _check_compile_regions(compile_regions: Any, model_fn: Any, *, reptile: bool, remat: bool,
                           randomness: str, first_order: bool) -> None:
    if not isinstance(compile_regions, bool):
        raise ValueError(f"MetaLearner(compile_regions=...): expected a bool, got "
                         f"{compile_regions!r}")
    if not compile_regions:
        return
    if reptile or remat:
        kind = "reptile=True" if reptile else "remat=True"
        raise ValueError(
            f"MetaLearner(compile_regions=True, {kind}): the compile region path is the "
            "differentiated unrolled inner loop of MAML, first-order MAML, ANIL and Meta-SGD; "
            f"drop compile_regions or {kind}"
        )
    if not first_order and not _regions.SECOND_ORDER_REGIONS:
        raise ValueError(
            "MetaLearner(compile_regions=True) for a second-order learner (MAML, ANIL, "
            "Meta-SGD): torch 2.13's Inductor miscompiles the second-order backward through a "
            "nested compile region on conv nets (meta-gradient off by ~1e4 from eager at "
            "inner_steps >= 2; exact with backend='aot_eager'), so only first-order MAML "
            "(fomaml) takes compile_regions=True; use compile_regions=False"
        )
    if randomness != "error":
        raise ValueError(
            f"MetaLearner(compile_regions=True, randomness={randomness!r}): random ops inside "
            "a nested compile region are not supported; use compile_regions=False"
        )
    if isinstance(model_fn, FunctionalModel):
        raise ValueError(
            "MetaLearner(compile_regions=True) with a make_functional model_fn: its call swaps "
            "the module's parameter slots, a side effect that torch 2.13's Dynamo cannot trace "
            "inside a nested compile region (AssertionError: Expected FakeTensor, got <class "
            "'torch.Tensor'>); write model_fn as a pure function of (params, buffers, x) "
            "(torch.nn.functional ops), or use compile_regions=False"
        )


def task_loss_grad(
    meta_params: Mapping[str, Tensor], names: list[str],
    task_losses: Callable[[TensorDict], tuple[Tensor, Any]], loss_scale: Tensor | None,
) -> tuple[TensorDict, Tensor, Any]:
    """Return ``(grads, loss_sum, aux)``: the gradient of ``sum_t loss_t`` w.r.t. the
    meta-params ``names`` (times ``loss_scale`` when given; fp16), the detached ``sum_t
    loss_t`` and ``aux``, for ``task_losses(all meta-params) -> ((T,) losses, aux)``; the
    meta-params not in ``names`` enter as constants."""
    fixed = {k: v for k, v in meta_params.items() if k not in names}

    def total(p: TensorDict) -> tuple[Tensor, Any]:
        merged = {k: p[k] if k in p else fixed[k] for k in meta_params}
        loss_t, aux = task_losses(merged)
        loss = loss_t.sum()
        if loss_scale is not None:
            loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
            return loss * loss_scale, (loss.detach(), aux)
        return loss, (loss.detach(), aux)

    with _part("torchfn.outer_grad"):
        g, (_, (lsum, aux)) = grad_and_value(total, has_aux=True)(
            {k: meta_params[k] for k in names})
    return g, lsum, aux


def _mean_buffers(chunks: list[Mapping[str, Tensor]], buffers: Mapping[str, Tensor]) -> TensorDict:
    out = {}
    for k, b in buffers.items():
        stacked = torch.cat([c[k] for c in chunks])
        out[k] = stacked.mean(0).to(b.dtype) if b.is_floating_point() else stacked[0]
    return out


# -- constructors --------------------------------------------------------------------------------


def maml(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    adapt_filter: Callable[[str], bool] | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    remat: bool = False,
    compile_regions: bool = False,
    unfold_convs: str | bool = "auto",
) -> MetaLearner:
    """Return a second-order MAML :class:`MetaLearner` (differentiates through the inner loop).

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`). Its
            ``frozen`` attribute (make_functional's record of ``requires_grad=False``) keeps
            those params out of the inner loop and the outer update; a function wrapping it
            (e.g. to return HF ``.logits``) has none, so copy it: ``wrapper.frozen =
            model_fn.frozen``.
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        inner_steps: inner-loop steps per task (an int >= 1).
        inner_lr: learning rate of the default inner optimizer ``torchopt.sgd(inner_lr)``;
            ``None`` means 0.01. Not together with ``inner_opt`` (``ValueError``): pass the
            rate to ``inner_opt`` instead.
        inner_opt: any torchopt ``GradientTransformation`` for the inner loop (used
            out-of-place; its state is built per task); default ``torchopt.sgd(inner_lr)``.
            A second-order meta-gradient differentiates through it: give Adam-like rules
            ``eps_root > 0`` (e.g. ``torchfn.optim.adam(lr, eps_root=1e-12)``), since
            ``sqrt(v)`` has an infinite derivative wherever a gradient entry is exactly 0
            (dead ReLUs, unused params), which makes the meta-gradient NaN (and a step that
            skips non-finite gradients skip every step).
        adapt_filter: ``adapt_filter(name) -> bool`` keeps the params the inner loop adapts
            (the others stay the meta-params); ``None`` adapts all but the model's frozen
            params (``model_fn.frozen``: ``requires_grad=False`` in the module, recorded by
            :func:`torchfn.functional.make_functional`; a wrapper function has none: pass
            ``adapt_filter`` then).
        chunk_size: vmap at most this many tasks at once (gradients summed chunk by chunk, so
            the backward holds one chunk); ``None`` vmaps the whole task batch.
        randomness: the task ``vmap``'s: ``"error"`` (default; refuses dropout in training
            mode), ``"different"`` (each task its own masks) or ``"same"`` (shared masks).
        unfold_convs: how a compiled step computes the convolutions whose weights the inner
            loop adapts (``nn.Conv2d`` layers of a :func:`torchfn.functional.make_functional`
            model with ``groups=1``, zero padding and ``C_in * kh * kw >= 64``). ``"auto"``
            (default): under ``torch.compile`` with the model on CUDA, as unfold + matmul
            (batched GEMMs over the tasks instead of grouped cuDNN convolutions: the fast
            compiled path); eager calls, and other devices, as ``nn.Conv2d``. ``True``: unfold
            under ``torch.compile`` on any device; ``False``: never (opt-out). Parameter names,
            shapes and checkpoints are the same either way; numbers agree up to float rounding.
        remat: checkpoint the inner steps in :meth:`MetaLearner.meta_grad`: keep only the
            inner iterates, not the activations of the unrolled loop, and recompute each
            inner step's forward and backward once more in a hand-written reverse pass
            (Hessian-vector products), so activation memory does not grow with
            ``inner_steps`` (one step's, not ``inner_steps``'), at the cost of one extra
            forward+backward of the support loss per inner step. Same numbers as
            ``remat=False``. Needs the default SGD inner step (``inner_opt`` and a
            ``randomness`` other than ``"error"`` raise ``ValueError``).

        compile_regions: under ``torch.compile``, trace and compile one inner step once and
            call it ``inner_steps`` times (a :func:`torch.compiler.nested_compile_region`),
            so compile time does not grow with ``inner_steps``; the outer gradient is then
            ``torch.autograd.grad`` traced into the graph, which needs
            ``torch._dynamo.config.trace_autograd_ops = True`` (``RuntimeError`` otherwise)
            and a side-effect-free ``model_fn`` (``ValueError`` for
            :func:`torchfn.functional.make_functional`'s, which swaps module slots: torch 2.13
            cannot trace that inside a region). Eager calls are unchanged. Default off. In
            torch 2.13 only first-order MAML takes it (second order: ``ValueError``; Inductor
            miscompiles the second-order backward through the region on conv nets).
    Example:
        >>> import torch.nn.functional as F
        >>> maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_steps=5)
        MetaLearner(maml, inner_steps=5, chunk_size=None, adapt_filter=False)
    """
    return MetaLearner(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                       inner_opt=inner_opt, adapt_filter=adapt_filter, chunk_size=chunk_size,
                       randomness=randomness, remat=remat,
                       compile_regions=compile_regions, unfold_convs=unfold_convs)


def fomaml(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    adapt_filter: Callable[[str], bool] | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    compile_regions: bool = False,
    unfold_convs: str | bool = "auto",
) -> MetaLearner:
    """Return a first-order MAML :class:`MetaLearner` (inner gradients detached).

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`). Its
            ``frozen`` attribute (make_functional's record of ``requires_grad=False``) keeps
            those params out of the inner loop and the outer update; a function wrapping it
            (e.g. to return HF ``.logits``) has none, so copy it: ``wrapper.frozen =
            model_fn.frozen``.
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        inner_steps: inner-loop steps per task (an int >= 1).
        inner_lr: learning rate of the default inner optimizer ``torchopt.sgd(inner_lr)``;
            ``None`` means 0.01. Not together with ``inner_opt`` (``ValueError``): pass the
            rate to ``inner_opt`` instead.
        inner_opt: any torchopt ``GradientTransformation`` for the inner loop (used
            out-of-place; its state is built per task); default ``torchopt.sgd(inner_lr)``.
            A second-order meta-gradient differentiates through it: give Adam-like rules
            ``eps_root > 0`` (e.g. ``torchfn.optim.adam(lr, eps_root=1e-12)``), since
            ``sqrt(v)`` has an infinite derivative wherever a gradient entry is exactly 0
            (dead ReLUs, unused params), which makes the meta-gradient NaN (and a step that
            skips non-finite gradients skip every step).
        adapt_filter: ``adapt_filter(name) -> bool`` keeps the params the inner loop adapts
            (the others stay the meta-params); ``None`` adapts all but the model's frozen
            params (``model_fn.frozen``: ``requires_grad=False`` in the module, recorded by
            :func:`torchfn.functional.make_functional`; a wrapper function has none: pass
            ``adapt_filter`` then).
        chunk_size: vmap at most this many tasks at once (gradients summed chunk by chunk, so
            the backward holds one chunk); ``None`` vmaps the whole task batch.
        randomness: the task ``vmap``'s: ``"error"`` (default; refuses dropout in training
            mode), ``"different"`` (each task its own masks) or ``"same"`` (shared masks).
        unfold_convs: how a compiled step computes the convolutions whose weights the inner
            loop adapts (``nn.Conv2d`` layers of a :func:`torchfn.functional.make_functional`
            model with ``groups=1``, zero padding and ``C_in * kh * kw >= 64``). ``"auto"``
            (default): under ``torch.compile`` with the model on CUDA, as unfold + matmul
            (batched GEMMs over the tasks instead of grouped cuDNN convolutions: the fast
            compiled path); eager calls, and other devices, as ``nn.Conv2d``. ``True``: unfold
            under ``torch.compile`` on any device; ``False``: never (opt-out). Parameter names,
            shapes and checkpoints are the same either way; numbers agree up to float rounding.

        compile_regions: under ``torch.compile``, trace and compile one inner step once and
            call it ``inner_steps`` times (a :func:`torch.compiler.nested_compile_region`),
            so compile time does not grow with ``inner_steps``; the outer gradient is then
            ``torch.autograd.grad`` traced into the graph, which needs
            ``torch._dynamo.config.trace_autograd_ops = True`` (``RuntimeError`` otherwise)
            and a side-effect-free ``model_fn`` (``ValueError`` for
            :func:`torchfn.functional.make_functional`'s, which swaps module slots: torch 2.13
            cannot trace that inside a region). Eager calls are unchanged. Default off. In
            torch 2.13 only first-order MAML takes it (second order: ``ValueError``; Inductor
            miscompiles the second-order backward through the region on conv nets).
    Example:
        >>> import torch.nn.functional as F
        >>> fomaml(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        MetaLearner(fomaml, inner_steps=1, chunk_size=None, adapt_filter=False)
    """
    return MetaLearner(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                       inner_opt=inner_opt, adapt_filter=adapt_filter, chunk_size=chunk_size,
                       first_order=True, randomness=randomness,
                       compile_regions=compile_regions, unfold_convs=unfold_convs)


def anil(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    head: Callable[[str], bool],
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    remat: bool = False,
    compile_regions: bool = False,
    unfold_convs: str | bool = "auto",
) -> MetaLearner:
    """Return an ANIL :class:`MetaLearner`: MAML adapting only the params ``head(name)`` keeps.

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`). Its
            ``frozen`` attribute (make_functional's record of ``requires_grad=False``) keeps
            those params out of the inner loop and the outer update; a function wrapping it
            (e.g. to return HF ``.logits``) has none, so copy it: ``wrapper.frozen =
            model_fn.frozen``.
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        head: ``head(name) -> bool`` keeps the params the inner loop adapts (the head).
        inner_steps: inner-loop steps per task (an int >= 1).
        inner_lr: learning rate of the default inner optimizer ``torchopt.sgd(inner_lr)``;
            ``None`` means 0.01. Not together with ``inner_opt`` (``ValueError``): pass the
            rate to ``inner_opt`` instead.
        inner_opt: any torchopt ``GradientTransformation`` for the inner loop (used
            out-of-place; its state is built per task); default ``torchopt.sgd(inner_lr)``.
            A second-order meta-gradient differentiates through it: give Adam-like rules
            ``eps_root > 0`` (e.g. ``torchfn.optim.adam(lr, eps_root=1e-12)``), since
            ``sqrt(v)`` has an infinite derivative wherever a gradient entry is exactly 0
            (dead ReLUs, unused params), which makes the meta-gradient NaN (and a step that
            skips non-finite gradients skip every step).
        chunk_size: vmap at most this many tasks at once (gradients summed chunk by chunk, so
            the backward holds one chunk); ``None`` vmaps the whole task batch.
        randomness: the task ``vmap``'s: ``"error"`` (default; refuses dropout in training
            mode), ``"different"`` (each task its own masks) or ``"same"`` (shared masks).
        unfold_convs: how a compiled step computes the convolutions whose weights the inner
            loop adapts (``nn.Conv2d`` layers of a :func:`torchfn.functional.make_functional`
            model with ``groups=1``, zero padding and ``C_in * kh * kw >= 64``). ``"auto"``
            (default): under ``torch.compile`` with the model on CUDA, as unfold + matmul
            (batched GEMMs over the tasks instead of grouped cuDNN convolutions: the fast
            compiled path); eager calls, and other devices, as ``nn.Conv2d``. ``True``: unfold
            under ``torch.compile`` on any device; ``False``: never (opt-out). Parameter names,
            shapes and checkpoints are the same either way; numbers agree up to float rounding.
        remat: checkpoint the inner steps in :meth:`MetaLearner.meta_grad`: keep only the
            inner iterates, not the activations of the unrolled loop, and recompute each
            inner step's forward and backward once more in a hand-written reverse pass
            (Hessian-vector products), so activation memory does not grow with
            ``inner_steps`` (one step's, not ``inner_steps``'), at the cost of one extra
            forward+backward of the support loss per inner step. Same numbers as
            ``remat=False``. Needs the default SGD inner step (``inner_opt`` and a
            ``randomness`` other than ``"error"`` raise ``ValueError``).

        compile_regions: under ``torch.compile``, trace and compile one inner step once and
            call it ``inner_steps`` times (a :func:`torch.compiler.nested_compile_region`),
            so compile time does not grow with ``inner_steps``; the outer gradient is then
            ``torch.autograd.grad`` traced into the graph, which needs
            ``torch._dynamo.config.trace_autograd_ops = True`` (``RuntimeError`` otherwise)
            and a side-effect-free ``model_fn`` (``ValueError`` for
            :func:`torchfn.functional.make_functional`'s, which swaps module slots: torch 2.13
            cannot trace that inside a region). Eager calls are unchanged. Default off. In
            torch 2.13 only first-order MAML takes it (second order: ``ValueError``; Inductor
            miscompiles the second-order backward through the region on conv nets).
    Example:
        >>> import torch.nn.functional as F
        >>> anil(lambda p, b, x: (x @ p["w"], b), F.mse_loss, head=lambda n: n.startswith("3."))
        MetaLearner(maml, inner_steps=1, chunk_size=None, adapt_filter=True)
    """
    return MetaLearner(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                       inner_opt=inner_opt, adapt_filter=head, chunk_size=chunk_size,
                       randomness=randomness, remat=remat,
                       compile_regions=compile_regions, unfold_convs=unfold_convs)


def meta_sgd(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    adapt_filter: Callable[[str], bool] | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    remat: bool = False,
    compile_regions: bool = False,
    unfold_convs: str | bool = "auto",
) -> MetaLearner:
    """Return a Meta-SGD :class:`MetaLearner`: per-parameter inner rates are meta-params.

    Here ``inner_lr`` (default 0.01) is the initial value of the learned rates, so it may be
    given together with ``inner_opt``; the inner optimizer defaults to ``torchopt.sgd(1.0)``
    and its updates are multiplied elementwise by the learned rates.

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`). Its
            ``frozen`` attribute (make_functional's record of ``requires_grad=False``) keeps
            those params out of the inner loop and the outer update; a function wrapping it
            (e.g. to return HF ``.logits``) has none, so copy it: ``wrapper.frozen =
            model_fn.frozen``.
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        inner_steps: inner-loop steps per task (an int >= 1).
        inner_lr: initial value of the learned per-parameter rates; ``None`` means 0.01.
        inner_opt: any torchopt ``GradientTransformation`` for the inner loop (used
            out-of-place; its state is built per task); default ``torchopt.sgd(1.0)``, whose
            updates are scaled elementwise by the learned rates.
            A second-order meta-gradient differentiates through it: give Adam-like rules
            ``eps_root > 0`` (e.g. ``torchfn.optim.adam(lr, eps_root=1e-12)``), since
            ``sqrt(v)`` has an infinite derivative wherever a gradient entry is exactly 0
            (dead ReLUs, unused params), which makes the meta-gradient NaN (and a step that
            skips non-finite gradients skip every step).
        adapt_filter: ``adapt_filter(name) -> bool`` keeps the params the inner loop adapts
            (the others stay the meta-params); ``None`` adapts all but the model's frozen
            params (``model_fn.frozen``: ``requires_grad=False`` in the module, recorded by
            :func:`torchfn.functional.make_functional`; a wrapper function has none: pass
            ``adapt_filter`` then).
        chunk_size: vmap at most this many tasks at once (gradients summed chunk by chunk, so
            the backward holds one chunk); ``None`` vmaps the whole task batch.
        randomness: the task ``vmap``'s: ``"error"`` (default; refuses dropout in training
            mode), ``"different"`` (each task its own masks) or ``"same"`` (shared masks).
        unfold_convs: how a compiled step computes the convolutions whose weights the inner
            loop adapts (``nn.Conv2d`` layers of a :func:`torchfn.functional.make_functional`
            model with ``groups=1``, zero padding and ``C_in * kh * kw >= 64``). ``"auto"``
            (default): under ``torch.compile`` with the model on CUDA, as unfold + matmul
            (batched GEMMs over the tasks instead of grouped cuDNN convolutions: the fast
            compiled path); eager calls, and other devices, as ``nn.Conv2d``. ``True``: unfold
            under ``torch.compile`` on any device; ``False``: never (opt-out). Parameter names,
            shapes and checkpoints are the same either way; numbers agree up to float rounding.
        remat: checkpoint the inner steps in :meth:`MetaLearner.meta_grad`: keep only the
            inner iterates, not the activations of the unrolled loop, and recompute each
            inner step's forward and backward once more in a hand-written reverse pass
            (Hessian-vector products), so activation memory does not grow with
            ``inner_steps`` (one step's, not ``inner_steps``'), at the cost of one extra
            forward+backward of the support loss per inner step. Same numbers as
            ``remat=False``. Needs the default SGD inner step (``inner_opt`` and a
            ``randomness`` other than ``"error"`` raise ``ValueError``).

        compile_regions: under ``torch.compile``, trace and compile one inner step once and
            call it ``inner_steps`` times (a :func:`torch.compiler.nested_compile_region`),
            so compile time does not grow with ``inner_steps``; the outer gradient is then
            ``torch.autograd.grad`` traced into the graph, which needs
            ``torch._dynamo.config.trace_autograd_ops = True`` (``RuntimeError`` otherwise)
            and a side-effect-free ``model_fn`` (``ValueError`` for
            :func:`torchfn.functional.make_functional`'s, which swaps module slots: torch 2.13
            cannot trace that inside a region). Eager calls are unchanged. Default off. In
            torch 2.13 only first-order MAML takes it (second order: ``ValueError``; Inductor
            miscompiles the second-order backward through the region on conv nets).
    Example:
        >>> import torch.nn.functional as F
        >>> meta_sgd(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        MetaLearner(meta_sgd, inner_steps=1, chunk_size=None, adapt_filter=False)
    """
    return MetaLearner(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                       inner_opt=inner_opt, adapt_filter=adapt_filter, chunk_size=chunk_size,
                       learn_inner_lr=True, randomness=randomness, remat=remat,
                       compile_regions=compile_regions, unfold_convs=unfold_convs)


def reptile(
    model_fn: Callable[..., Any],
    loss_fn: LossFn,
    *,
    inner_steps: int = 1,
    inner_lr: float | None = None,
    inner_opt: GradientTransformation | None = None,
    adapt_filter: Callable[[str], bool] | None = None,
    chunk_size: int | None = None,
    randomness: str = "error",
    unfold_convs: str | bool = "auto",
) -> MetaLearner:
    """Return a Reptile :class:`MetaLearner`; its ``meta_grad`` is ``params - mean(adapted)``.

    With an outer ``torchopt.sgd(lr=eps)`` the outer step is Reptile's
    ``params + eps * (mean_t phi_t - params)``. Adaptation runs on each task's support set.

    Args:
        model_fn: ``model_fn(params, buffers, x) -> (outputs, new_buffers)`` (torchfn's
            stateless contract, e.g. from :func:`torchfn.functional.make_functional`). Its
            ``frozen`` attribute (make_functional's record of ``requires_grad=False``) keeps
            those params out of the inner loop and the outer update; a function wrapping it
            (e.g. to return HF ``.logits``) has none, so copy it: ``wrapper.frozen =
            model_fn.frozen``.
        loss_fn: ``loss_fn(outputs, targets) -> 0-d`` mean loss of one task's batch.
        inner_steps: inner-loop steps per task (an int >= 1).
        inner_lr: learning rate of the default inner optimizer ``torchopt.sgd(inner_lr)``;
            ``None`` means 0.01. Not together with ``inner_opt`` (``ValueError``): pass the
            rate to ``inner_opt`` instead.
        inner_opt: any torchopt ``GradientTransformation`` for the inner loop (used
            out-of-place; its state is built per task); default ``torchopt.sgd(inner_lr)``.
            A second-order meta-gradient differentiates through it: give Adam-like rules
            ``eps_root > 0`` (e.g. ``torchfn.optim.adam(lr, eps_root=1e-12)``), since
            ``sqrt(v)`` has an infinite derivative wherever a gradient entry is exactly 0
            (dead ReLUs, unused params), which makes the meta-gradient NaN (and a step that
            skips non-finite gradients skip every step).
        adapt_filter: ``adapt_filter(name) -> bool`` keeps the params the inner loop adapts
            (the others stay the meta-params); ``None`` adapts all but the model's frozen
            params (``model_fn.frozen``: ``requires_grad=False`` in the module, recorded by
            :func:`torchfn.functional.make_functional`; a wrapper function has none: pass
            ``adapt_filter`` then).
        chunk_size: vmap at most this many tasks at once (gradients summed chunk by chunk, so
            the backward holds one chunk); ``None`` vmaps the whole task batch.
        randomness: the task ``vmap``'s: ``"error"`` (default; refuses dropout in training
            mode), ``"different"`` (each task its own masks) or ``"same"`` (shared masks).
        unfold_convs: how a compiled step computes the convolutions whose weights the inner
            loop adapts (``nn.Conv2d`` layers of a :func:`torchfn.functional.make_functional`
            model with ``groups=1``, zero padding and ``C_in * kh * kw >= 64``). ``"auto"``
            (default): under ``torch.compile`` with the model on CUDA, as unfold + matmul
            (batched GEMMs over the tasks instead of grouped cuDNN convolutions: the fast
            compiled path); eager calls, and other devices, as ``nn.Conv2d``. ``True``: unfold
            under ``torch.compile`` on any device; ``False``: never (opt-out). Parameter names,
            shapes and checkpoints are the same either way; numbers agree up to float rounding.

    Example:
        >>> import torch.nn.functional as F
        >>> reptile(lambda p, b, x: (x @ p["w"], b), F.mse_loss, inner_steps=5)
        MetaLearner(reptile, inner_steps=5, chunk_size=None, adapt_filter=False)
    """
    return MetaLearner(model_fn, loss_fn, inner_steps=inner_steps, inner_lr=inner_lr,
                       inner_opt=inner_opt, adapt_filter=adapt_filter, chunk_size=chunk_size,
                       reptile=True, randomness=randomness, unfold_convs=unfold_convs)
