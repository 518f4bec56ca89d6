"""The meta-gradient with only the inner step compiled: ``make_meta_train_step(compile="inner")``.

``torch.compile(step, fullgraph=True)`` of a meta train step unrolls the inner loop: Dynamo,
AOTAutograd and Inductor see ``inner_steps`` copies of the inner step (its forward, backward and
second-order backward), so compile time grows with ``inner_steps``. Here three small functions
are compiled, each once, whatever ``inner_steps`` is:

- the inner step of a task chunk (``vmap`` over tasks of support forward, ``torch.func.grad``,
  inner optimizer update; ``_regions.make_region_step``), called ``inner_steps`` times from
  Python;
- the query loss of the chunk at the adapted params;
- the outer update (``apply_gradients``: clipping, the optimizer, the non-finite guard).

The outer gradient is an eager ``torch.autograd.grad`` from the query loss back to leaf copies
of the meta-params, through the AOTAutograd backward of each compiled call. That backward is a
single backward of a compiled function -- for a second-order learner it holds the
Hessian-vector products of the inner step -- so no compiled function is differentiated twice,
and the numbers are those of the ``torch.func`` path. The cost is Python between the calls
(no one graph, no CUDA graph over the whole step).

iMAML (:class:`ImplicitMetaLearner`) needs no gradient through its inner loop, so its pieces
are two forward-only compiled functions: the proximal inner step of a task chunk (detached,
called ``inner_steps`` times) and the implicit solve (the query gradient at the inner solution
and the ``cg_steps`` CG iterations over Hessian-vector products, one graph: ``cg_steps`` is
fixed and small), plus the same outer update.

The compiled inner step and query loss are compiled (and called) under
``torch._functorch.config.aggressive_recomputation``: what they save for the outer backward
lives until the end of the step, ``inner_steps`` times over, so the min-cut partitioner
recomputes cheap ops (pointwise, views, pads, max-pool indices; never a matmul or a
convolution) in the backward instead of saving their outputs. For the unfolded convolutions of
``unfold_convs`` it keeps the inputs, not the ``kh * kw`` times larger patches (on the
4-block conv net of ``benchmarks/meta.py`` about 4x fewer saved bytes a step:
``benchmarks/meta.py --saved-bytes``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from torchfn._checks import _call_translated, _compile_kwargs
from torchfn.meta._imaml import ImplicitMetaLearner
from torchfn.meta._maml import LR_PREFIX, MetaLearner
from torchfn.meta._regions import make_region_query, make_region_step, region_chunk_grad
from torchfn.meta._tasks import Task, check_task_batch, wrt_names

__all__: list[str] = []

TensorDict = dict[str, Tensor]
COMPILE_MODES = (None, "inner")
_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
# AOTAutograd settings for the compiled pieces with a backward (module docstring); read when a
# call compiles (its cache key holds them), so every call of the piece runs under them
RECOMPUTE_CONFIG = {"aggressive_recomputation": True}


class _Recomputing:
    """``fn(*args)`` (a ``torch.compile``d piece) called under ``RECOMPUTE_CONFIG``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        with torch._functorch.config.patch(RECOMPUTE_CONFIG):
            return self.fn(*args)


def check_inner_compile(learner: MetaLearner, *, amp: str | None, where: str) -> None:
    """Raise unless ``learner`` (and the step's ``amp``) fit ``compile="inner"``."""
    call = f"{where}(learner={learner!r}, compile='inner')"
    if type(learner).meta_grad not in (MetaLearner.meta_grad, ImplicitMetaLearner.meta_grad):
        raise ValueError(
            f"{call}: compile='inner' compiles the inner step of MAML, first-order MAML, ANIL, "
            f"Meta-SGD and iMAML (maml, fomaml, anil, meta_sgd, imaml); a "
            f"{type(learner).__name__} computes its meta-gradient its own way (MAML++: "
            "per-step BatchNorm and a multi-step loss), so it does not fit; use compile=None "
            "and torch.compile the whole step"
        )
    refusals = [
        (learner.reptile, "reptile=True",
         "Reptile has no outer gradient through the inner loop"),
        (learner.remat, "remat=True",
         "remat walks the inner loop backwards by hand and cannot go through compiled steps; "
         "compile='inner' keeps each compiled step's saved activations like remat=False"),
        (learner.compile_regions, "compile_regions=True",
         "compile_regions is the other way to compile the inner step once; pick one"),
        (learner.randomness != "error", f"randomness={learner.randomness!r}",
         "random ops inside the compiled inner step are not checked against the eager draws"),
        (amp is not None, f"amp={amp!r}",
         "mixed precision through the compiled inner steps is not checked yet"),
    ]
    for bad, what, why in refusals:
        if bad:
            raise ValueError(f"{call} with {what}: {why}; use compile=None (then "
                             "torch.compile the whole step) or drop " + what.split("=")[0])


class InnerCompiledMetaGrad:
    """``meta_grad(meta_params, buffers, tasks, *, wrt=None, loss_scale=None)`` of ``learner``
    with its inner step and its query loss (iMAML: its implicit solve) each
    ``torch.compile``d once (module docstring).

    Returns what :meth:`MetaLearner.meta_grad` returns, with the same numbers. Call it eagerly,
    not under ``torch.compile``. ``compile_kwargs`` go to each ``torch.compile``
    (``fullgraph=True`` by default); ``compile_query=False`` leaves the query loss (iMAML: the
    solve) eager; ``recompute=False`` compiles the inner step and the query loss with
    AOTAutograd's default partitioning instead of ``RECOMPUTE_CONFIG`` (module docstring) --
    for benchmarks only: Inductor on the CPU then returns wrong meta-gradients for conv + BN +
    ReLU + MaxPool nets (float64, relative error ~0.9 on ``benchmarks/meta.py --small``): the
    max-pool backward's ``scatter_add`` target is a saved zeros buffer, and Inductor fuses the
    ReLU backward's read of it into a kernel that runs before the scatter
    (``benchmarks/repro_inductor_maxpool_backward_fusion.py``, torch only). Recomputation
    does not save that buffer, so no public step exposes ``recompute=False``.
    """

    def __init__(self, learner: MetaLearner, compile_kwargs: Mapping[str, Any] | None = None,
                 *, compile_query: bool = True, recompute: bool = True) -> None:
        self.learner = learner
        kwargs = _compile_kwargs(dict(compile_kwargs or {}), None)
        if isinstance(learner, ImplicitMetaLearner):  # forward-only pieces (module docstring)
            self.inner_step = torch.compile(learner._chunk_proximal_step(), **kwargs)
            solve = learner._chunk_solve()
            self.solve = torch.compile(solve, **kwargs) if compile_query else solve
            return
        step = make_region_step(
            learner._model_call, learner.loss_fn, learner.inner_opt,
            model_names=learner._model_names, first_order=learner.first_order,
            lr_prefix=LR_PREFIX if learner.learn_inner_lr else None,
            randomness=learner.randomness)
        wrap = _Recomputing if recompute else (lambda fn: fn)
        self.inner_step = wrap(torch.compile(step, **kwargs))
        query = make_region_query(learner)
        self.query = wrap(torch.compile(query, **kwargs)) if compile_query else query

    def __call__(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        *, wrt: Collection[str] | None = None, loss_scale: Tensor | None = None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        where = "meta_grad(meta_params, buffers, tasks) with compile='inner'"
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"{where} under torch.compile: compile='inner' compiles its parts itself and "
                "runs the outer gradient eagerly between them; call the step without "
                "torch.compile, or build it with compile=None to compile the whole step")
        check_task_batch(tasks, where)
        if any(v.requires_grad for v in meta_params.values()):
            raise ValueError(
                f"{where}: meta_params require grad, but compile='inner' differentiates "
                "detached copies of them and would cut an outer autograd graph; pass detached "
                "meta_params (a meta train step's state.params are) or use compile=None")
        with self.learner._attention_backend(), warnings.catch_warnings():
            # Dynamo reads ``.grad`` of the compiled steps' inputs while it traces them (torch
            # 2.13); the adapted params are non-leaf, which makes torch warn about the read
            warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
            return _call_translated(where, self._meta_grad, meta_params, buffers, tasks, wrt,
                                    loss_scale)

    def _meta_grad(
        self, meta_params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], tasks: Task,
        wrt: Collection[str] | None, loss_scale: Tensor | None,
    ) -> tuple[TensorDict, Tensor, TensorDict]:
        learner = self.learner
        names = wrt_names(meta_params, wrt, "meta_grad")

        def chunk_grad(chunk: Task) -> tuple[TensorDict, Tensor, TensorDict]:
            if isinstance(learner, ImplicitMetaLearner):
                return learner._stepped_chunk_grad(self.inner_step, self.solve, meta_params,
                                                   buffers, chunk, names, loss_scale)
            return region_chunk_grad(learner, meta_params, buffers, chunk, names, loss_scale,
                                     step=self.inner_step, query=self.query)

        return learner._sum_over_chunks(meta_params, buffers, tasks, names, chunk_grad)


def make_outer_update(update: Callable[..., Any], compile_kwargs: Mapping[str, Any] | None,
                      ) -> Callable[..., Any]:
    """Return ``torch.compile(update)`` with ``compile_kwargs`` (``fullgraph=True`` default)."""
    return torch.compile(update, **_compile_kwargs(dict(compile_kwargs or {}), None))
