"""Sharded (ZeRO-3 style) training: params and optimizer state split over the ranks.

Every parameter is flattened and padded to ``W * c`` elements (``c = ceil(numel / W)``); rank
``r`` keeps elements ``[r c, (r + 1) c)`` -- the chunking of ``torch.chunk`` and of DTensor's
``Shard(0)`` -- and the optimizer state of that slice only. A step all-gathers the params
(one collective per dtype), computes the gradient of its local batch on the full params,
reduce-scatters it (sum, then ``/ W``; one collective per dtype), and updates its own slice
through the one step core :func:`torchfn.functional.apply_gradients`. Global-norm clipping and
the non-finite guard need the whole gradient: one small all-reduce carries the squared norms,
the loss and the buffers, so every rank clips and skips alike. With ``blocks=`` the params of
each block are gathered only while the block runs and its gradient is reduce-scattered as soon
as its backward (a recomputation) is done (``_blocks.py``), so no rank holds the whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup
from torchopt.base import GradientTransformation

from torchfn._checks import STEP_INDUCTOR_OPTIONS, _replace
from torchfn.distributed._blocks import make_blocked_model
from torchfn.distributed._donate import (
    DonationPlan,
    check_not_donated,
    refuse_compile,
)
from torchfn.distributed._env import world_info
from torchfn.distributed._reduce import _group, _in_place_ok, _materialise, all_reduce_tree
from torchfn.functional import (
    StepOptions,
    TrainState,
    apply_gradients,
    check_optimizer,
    init_train_state,
    split_batch,
    step_rng,
)

__all__ = ["ShardLayout", "gather_sharded_state", "init_sharded_state",
           "load_sharded_checkpoint", "make_sharded_train_step", "save_sharded_checkpoint"]

TensorDict = dict[str, Tensor]
Batch = tuple[Any, Any]
_RANK_SALT = 1_000_003
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How each parameter is split over the ranks of ``group``: names, shapes, dtypes, chunks.

    Build it with :meth:`from_params` (a collective-free call; every rank passes params of the
    same names, shapes and dtypes). Param ``name`` of shape ``shape`` (``n`` elements) becomes a
    flat ``(chunk(name),)`` shard per rank, ``chunk = ceil(n / world_size)``; the last ranks'
    shards are zero-padded past ``n``.

    Example::

        layout = ShardLayout.from_params({"w": torch.zeros(3, 5)})   # 2 ranks
        layout.chunk("w"), layout.shard({"w": torch.arange(15.).view(3, 5)})["w"]
        # (8, tensor([0., 1., ..., 7.]))  on rank 0; rank 1: [8., ..., 14., 0.]
    """

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    rank: int
    world_size: int
    group: ProcessGroup | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Tensor], *,
                    group: ProcessGroup | None = None) -> ShardLayout:
        """Return the layout of ``params`` (a ``dict[str, Tensor]``, full shapes) over ``group``."""
        rank, world = world_info(group, "ShardLayout.from_params")
        if not isinstance(params, Mapping) or not params:
            raise TypeError("ShardLayout.from_params(params): expected a non-empty dict of "
                            f"tensors, got {params!r:.80}")
        for k, v in params.items():
            if not isinstance(v, Tensor) or not v.is_floating_point():
                raise TypeError(f"ShardLayout.from_params(params): expected floating-point "
                                f"tensors, got {type(v).__name__} "
                                f"{getattr(v, 'dtype', '')} at {k!r}")
        return cls({k: tuple(v.shape) for k, v in params.items()},
                   {k: v.dtype for k, v in params.items()}, rank, world, group)

    def numel(self, name: str) -> int:
        """Return the number of elements of the full param ``name``."""
        return math.prod(self.shapes[name])

    def chunk(self, name: str) -> int:
        """Return the length of every rank's flat shard of ``name``: ``ceil(numel / world)``."""
        return -(-self.numel(name) // self.world_size)

    def valid(self, name: str, rank: int | None = None) -> int:
        """Return how many of ``rank``'s shard elements of ``name`` are real (not padding)."""
        r = self.rank if rank is None else rank
        c = self.chunk(name)
        return max(0, min(c, self.numel(name) - r * c))

    def shard(self, params: Mapping[str, Tensor]) -> TensorDict:
        """Return this rank's flat ``(chunk,)`` shard of every full param in ``params``."""
        self._check_full(params, "ShardLayout.shard(params)")
        out = {}
        for k, v in params.items():
            c = self.chunk(k)
            flat = torch.nn.functional.pad(v.detach().reshape(-1),
                                           (0, c * self.world_size - v.numel()))
            out[k] = flat[self.rank * c:(self.rank + 1) * c].clone()
        return out

    def gather(self, shards: Mapping[str, Tensor]) -> TensorDict:
        """Return the full params (their shapes) from every rank's shards; a collective."""
        self.check_shards(shards, "ShardLayout.gather(shards)")
        pg = _group(self.group)
        out: TensorDict = {}
        for names in self._by_dtype():
            flat = torch.cat([shards[k] for k in names])
            gathered = _materialise(_all_gather(flat, 0, pg)).view(self.world_size, -1)
            for k, part in zip(names, gathered.split([self.chunk(k) for k in names], dim=1),
                               strict=True):
                out[k] = part.reshape(-1)[:self.numel(k)].view(self.shapes[k])
        return {k: out[k] for k in self.shapes}

    def reduce_scatter_mean(self, grads: Mapping[str, Tensor]) -> TensorDict:
        """Return this rank's shard of the mean over ranks of full-shaped ``grads``."""
        return self._reduce_scatter(grads, self.world_size)

    def reduce_scatter_sum(self, grads: Mapping[str, Tensor]) -> TensorDict:
        """Return this rank's flat ``(chunk,)`` shard of the sum over ranks of full ``grads``."""
        return self._reduce_scatter(grads, None)

    def _reduce_scatter(self, grads: Mapping[str, Tensor], divide: int | None) -> TensorDict:
        pg = _group(self.group)
        out: TensorDict = {}
        for names in self._by_dtype():
            # a param whose numel divides by W needs no padding: its rows are a view (the one
            # copy is the cat)
            rows = []
            for k in names:
                row, pad = grads[k].reshape(-1), self.chunk(k) * self.world_size - self.numel(k)
                rows.append((torch.nn.functional.pad(row, (0, pad)) if pad else row)
                            .view(self.world_size, -1))
            flat = torch.cat(rows, dim=1).reshape(-1)
            mine = _materialise(_reduce_scatter(flat, "sum", 0, pg))
            if divide is not None:  # one division of the flat shard, not one per param
                mine = mine.div_(divide) if _in_place_ok(mine) else mine / divide
            for k, part in zip(names, mine.split([self.chunk(k) for k in names]), strict=True):
                out[k] = part
        return {k: out[k] for k in self.shapes}

    def subset(self, names: list[str] | tuple[str, ...]) -> ShardLayout:
        """Return the layout of the params ``names`` only (same ranks, same chunks)."""
        return dataclasses.replace(self, shapes={k: self.shapes[k] for k in names},
                                   dtypes={k: self.dtypes[k] for k in names})

    def check_shards(self, shards: Mapping[str, Tensor], where: str) -> None:
        """Raise ``ValueError`` unless ``shards`` are this layout's flat shards."""
        if list(shards) != list(self.shapes):
            raise ValueError(f"{where}: expected shards of the params {list(self.shapes)} "
                             f"(in that order), got {list(shards)}")
        for k, v in shards.items():
            if tuple(v.shape) != (self.chunk(k),) or v.dtype != self.dtypes[k]:
                raise ValueError(
                    f"{where}: param {k!r} should be a flat shard of shape ({self.chunk(k)},) "
                    f"and dtype {self.dtypes[k]} (full shape {self.shapes[k]} over "
                    f"{self.world_size} ranks), got shape {tuple(v.shape)} and dtype "
                    f"{v.dtype}; build the state with init_sharded_state and the same layout")

    def _check_full(self, params: Mapping[str, Tensor], where: str) -> None:
        seen = {k: tuple(v.shape) for k, v in params.items()}
        if seen != self.shapes:
            raise ValueError(f"{where}: expected full params of shapes {self.shapes}, got {seen}")

    def _by_dtype(self) -> list[list[str]]:
        groups: dict[torch.dtype, list[str]] = {}
        for k in self.shapes:
            groups.setdefault(self.dtypes[k], []).append(k)
        return list(groups.values())


def init_sharded_state(params: TensorDict, buffers: TensorDict,
                       optimizer: GradientTransformation, layout: ShardLayout, *,
                       seed: int | Tensor) -> TrainState:
    """Return a :class:`TrainState` whose ``params`` and ``opt_state`` are this rank's shards.

    ``params`` are the full params (the same on every rank, e.g. from one seed), ``layout``
    is ``ShardLayout.from_params(params)``. The state's ``params[name]`` is the flat
    ``(layout.chunk(name),)`` shard, ``opt_state`` is ``optimizer.init`` of those shards (Adam's
    moments are sharded alike; the count is replicated); ``buffers``, ``step`` and ``seed``
    are replicated. Memory per rank: about ``1 / W`` of the params and the optimizer state.

    Example::

        layout = ShardLayout.from_params(params)
        state = init_sharded_state(params, {}, adam(1e-3), layout, seed=0)
        state.params["w"].shape   # (ceil(numel(w) / W),)
    """
    check_optimizer(optimizer, "init_sharded_state")
    return init_train_state(layout.shard(params), buffers, optimizer, seed=seed)


def _call(model_fn: Callable[..., Any], params: TensorDict, buffers: TensorDict,
          x: Any) -> Any:
    if isinstance(x, Mapping):
        return model_fn(params, buffers, **x)
    return model_fn(params, buffers, x)


_REFUSED = {
    "amp": "mixed precision is not sharded yet (the fp16 loss scale and bf16 autocast are "
           "untested here); use make_data_parallel_train_step(amp=...)",
    "trainable": "frozen params are not sharded yet; every param is trained",
    "grad_transform": "the sharded step sets its own gradient reduction (reduce-scatter)",
    "loss_scaler": "mixed precision is not sharded yet",
}


def make_sharded_train_step(
    model_fn: Callable[..., Any],
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: GradientTransformation,
    layout: ShardLayout,
    *,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_value: float | None = None,
    lr_schedule: Any = None,
    skip_nonfinite: bool = True,
    sync_buffers: bool = True,
    seed_rng: bool = True,
    blocks: Any = None,
    donate: bool = False,
    **unsupported: Any,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Tensor]]]:
    """Return ``step(state, local_batch) -> (new_state, metrics)`` with sharded params and state.

    The same update as :func:`make_data_parallel_train_step` (and as one process over the
    global batch), with ``state`` from :func:`init_sharded_state`: ``state.params[name]`` is
    this rank's flat ``(layout.chunk(name),)`` shard. Each rank passes its own ``local_batch``
    of ``B / W`` examples. Per step and per dtype: one all-gather of the params (``P``
    elements in all), one reduce-scatter of the gradient (``P``), and one small all-reduce
    (loss, two squared norms, the float buffers). ``model_fn(params, buffers, x)`` sees the
    full params in their shapes; ``loss_fn`` is mean-reduced.

    - ``grad_accum_steps``, ``max_grad_norm``, ``clip_value`` (elementwise, before the norm
      clip), ``lr_schedule``, ``skip_nonfinite``: as in :func:`torchfn.functional.make_train_step`;
      the norm and the non-finite guard are those of the whole averaged gradient, so every rank
      clips by the same factor and skips the same steps.
    - ``sync_buffers`` averages float buffers over the ranks (as the data-parallel step).
    - ``seed_rng`` (eager): rank ``r`` draws its randomness from ``seed + r * 1000003``.
    - ``blocks`` (per-block gathering, ZeRO-3 / FSDP style; eager only): ``None`` (default)
      gathers every param at the start of the step, so each rank holds the full params and
      the full gradient. With ``blocks`` the params of each block (a submodule, e.g. a
      transformer layer) are all-gathered only while the block runs and dropped after; the
      backward gathers them again, recomputes the block (its activations are not kept either)
      and reduce-scatters the block's gradient as soon as its backward is done. Peak memory per
      rank: the shards with their optimizer state and gradient, the params outside every block
      (gathered whole, e.g. embeddings and the head), one gathered block (two during a
      recomputation) and the activations at the block boundaries. ``model_fn`` must then be an
      ``nn.Module`` or a :func:`torchfn.functional.make_functional` model (the blocks are its
      submodules; an ``nn.Module`` may live on the ``meta`` device, so the full model is never
      materialised). ``blocks`` is ``"auto"`` (the children of the ``nn.ModuleList`` holding
      the most params), a list of submodule names (``["layers.0", "layers.1"]``) or a callable
      ``(name, module) -> bool`` over ``named_modules()``. Same numbers as ``blocks=None``
      (float round-off); dropout inside a block replays its random numbers in the
      recomputation. Refused with a ``ValueError``: a name that is no submodule, overlapping
      or repeated blocks, a block without params, a param tied across blocks or between a
      block and the rest, a block whose forward assigns its buffers (BatchNorm in training
      mode: keep it outside the blocks); ``torch.compile`` of the step raises (eager only).
    - ``donate=True`` (eager only): the state is donated, as for
      :func:`torchfn.compile.make_graphed_step`: the step writes the new params and optimizer
      state into ``state``'s own tensors, one param at a time (``optimizer.update`` of that
      param's single-leaf tree, then a copy into its shard and its optimizer-state leaves;
      its gradient shard is dropped), so at the update a rank holds one copy of its state plus
      one param's new leaves instead of two copies (Adam: ~16 instead of ~32 bytes/param / W
      at the peak). Feed the returned state back and do not keep the old one: its tensors now
      hold the new values, and passing it again raises ``ValueError`` (clone a state before
      the call to keep it). Same numbers as ``donate=False`` bit for bit, skipped steps
      included (they write the old values back). The optimizer's update must be per param
      (Adam, AdamW, SGD with momentum, schedules): one mixing params (a global-norm clip
      inside the chain) raises ``ValueError`` at the first call -- use ``max_grad_norm=``.
      ``torch.compile`` of a donating step raises.
    - Not supported (``TypeError`` at build time): ``amp``, ``loss_scaler``, ``trainable``,
      ``grad_transform``.

    ``metrics``: ``loss`` (mean over ranks), ``grad_norm`` (global, before clipping),
    ``skipped`` (when guarded), ``lr`` if asked.

    Example::

        layout = ShardLayout.from_params(params)
        state = init_sharded_state(params, {}, opt, layout, seed=0)
        step = make_sharded_train_step(model_fn, loss_fn, opt, layout, max_grad_norm=1.0)
        state, metrics = step(state, (x_local, y_local))
        full = layout.gather(state.params)          # the whole params, on every rank
        # per-block gathering: model_fn from make_functional(net), net.layers an nn.ModuleList
        step = make_sharded_train_step(model_fn, loss_fn, opt, layout, blocks="auto")
        # in-place update (the old state is consumed): feed the returned state back
        step = make_sharded_train_step(model_fn, loss_fn, opt, layout, donate=True)
    """
    where = "make_sharded_train_step"
    for key in unsupported:
        if key in _REFUSED:
            raise TypeError(f"{where}({key}=...): {_REFUSED[key]}")
        raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
    check_optimizer(optimizer, where)
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"{where}(layout=...): expected a ShardLayout "
                        f"(ShardLayout.from_params(params)), got {type(layout).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"{where}(donate=...): expected True or False, got {donate!r}")
    plans: dict[Any, DonationPlan] = {}
    # validates the shared settings; the clipping itself happens here (it needs the global norm)
    StepOptions(grad_accum_steps=grad_accum_steps, lr_schedule=lr_schedule,
                max_grad_norm=max_grad_norm, clip_value=clip_value,
                skip_nonfinite=skip_nonfinite, where=where)
    core = StepOptions(lr_schedule=lr_schedule, skip_nonfinite=skip_nonfinite, where=where)
    rank, world = world_info(layout.group, where)
    k = grad_accum_steps
    blocked = make_blocked_model(model_fn, blocks, layout, where) if blocks is not None else None
    outside = blocked.outside if blocked is not None else tuple(layout.shapes)
    in_blocks = tuple(n for n in layout.shapes if n not in outside)
    outside_layout = layout.subset(outside)
    if blocked is not None:  # the blocks' shard gradients arrive as the mean over ranks and
        blocked.grad_scale = 1.0 / (world * k)  # micro-batches: no whole-shard copy here

    def run_model(p: TensorDict, buffers: TensorDict, x: Any) -> Any:
        if blocked is None:
            return _call(model_fn, p, buffers, x)
        full, shards = {n: p[n] for n in outside}, {n: p[n] for n in in_blocks}
        if isinstance(x, Mapping):
            return blocked(full, shards, buffers, **x)
        return blocked(full, shards, buffers, x)

    def forward_backward(full: TensorDict, buffers: TensorDict, x: Any, y: Any):
        def objective(p: TensorDict) -> tuple[Tensor, TensorDict]:
            out, new_buffers = run_model(p, buffers, x)
            loss = loss_fn(out, y)
            if not isinstance(loss, Tensor) or loss.ndim != 0:
                raise ValueError(f"sharded train step: loss_fn(outputs, targets) must return "
                                 f"a 0-d tensor, got {getattr(loss, 'shape', type(loss))}")
            return loss, new_buffers

        return torch.func.grad_and_value(objective, has_aux=True)(full)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Tensor]]:
        if donate and torch.compiler.is_compiling():
            refuse_compile()
        if not torch.compiler.is_compiling():
            check_not_donated(state, "sharded train step")
        layout.check_shards(state.params, "sharded train step: state.params")
        plan = _plan(state) if donate else None
        if not isinstance(batch, tuple) or len(batch) != 2:
            raise TypeError("sharded train step: batch must be a tuple (inputs, targets)")
        # per-block: the params outside every block gathered whole, the blocks' stay shards
        full = outside_layout.gather({n: state.params[n] for n in outside}) if outside else {}
        full.update({n: state.params[n] for n in in_blocks})
        use_rng = seed_rng and not torch.compiler.is_compiling()
        rng_state = _replace(state, seed=state.seed + _RANK_SALT * rank) if rank else state
        ctx = step_rng(rng_state) if use_rng else contextlib.nullcontext()
        buffers, grads, losses = state.buffers, None, []
        with ctx:
            for x, y in split_batch(batch, k, "sharded train step"):
                g, (loss, buffers) = forward_backward(full, buffers, x, y)
                grads = g if grads is None else {n: grads[n] + g[n] for n in g}
                losses.append(loss)
        assert grads is not None
        # drop what is no longer needed (rebinding, not del: some are closure cells, which
        # Dynamo cannot delete): the whole-gather step's full params, the last micro-batch's
        # gradients, then the summed gradients and the unclipped shard
        full = g = None  # type: ignore[assignment]
        # the blocks' gradients come back as shards, already averaged over ranks and
        # micro-batches (blocked.grad_scale); the rest are full gradients summed over the
        # micro-batches
        shard = outside_layout.reduce_scatter_mean(
            {n: grads[n] / k if k > 1 else grads[n] for n in outside}) if outside else {}
        shard.update({n: grads[n] for n in in_blocks})
        shard = {n: shard[n] for n in layout.shapes}
        grads = None  # type: ignore[assignment]
        clipped = ({n: t.clamp(-clip_value, clip_value) for n, t in shard.items()}
                   if clip_value is not None else shard)

        def sumsq(tree: TensorDict) -> Tensor:
            return torch.stack([t.double().square().sum() for t in tree.values()]).sum()

        norm_sq = sumsq(shard)  # without clip_value, clipped is shard: one pass, not two
        small = {"loss": torch.stack(losses).mean().detach().double(), "sumsq": norm_sq,
                 "sumsq_clipped": norm_sq if clipped is shard else sumsq(clipped)}
        shard = None  # type: ignore[assignment]  (clipped is it without clip_value)
        if sync_buffers:
            small.update({f"buffer/{n}": v for n, v in buffers.items()
                          if torch.is_floating_point(v)})
        red = all_reduce_tree(small, op="sum", group=layout.group)
        loss = (red["loss"] / world).to(losses[0].dtype)
        if sync_buffers:
            buffers = {n: red[f"buffer/{n}"] / world if f"buffer/{n}" in red else v
                       for n, v in buffers.items()}
        grad_norm = red["sumsq"].sqrt()
        coef = None
        if max_grad_norm is not None:
            coef = torch.clamp(max_grad_norm / (red["sumsq_clipped"].sqrt() + 1e-6), max=1.0)
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
        if plan is not None:  # param by param, into the state's tensors: no second copy
            def grad(n: str) -> Tensor:
                t = clipped.pop(n)  # this param's gradient shard dies after its update
                return t * coef.to(t.dtype) if coef is not None else t

            new_state, metrics = plan.apply(optimizer, state, grad,
                                            finite if core.guard else None, buffers,
                                            core.lr_schedule, "sharded train step")
            return new_state, {**metrics, "loss": loss, "grad_norm": grad_norm.to(loss.dtype)}
        if coef is not None:
            clipped = {n: t * coef.to(t.dtype) for n, t in clipped.items()}
        # the guard inside apply_gradients sees this rank's shard only: a non-finite global
        # norm (or loss) is passed as a NaN loss, so every rank skips the same steps
        guard_loss = torch.where(finite, loss, torch.full_like(loss, float("nan")))
        new_state, metrics = apply_gradients(optimizer, clipped, state, options=core,
                                             loss=guard_loss, buffers=buffers,
                                             where="sharded train step")
        metrics = {**metrics, "loss": loss, "grad_norm": grad_norm.to(loss.dtype)}
        return new_state, metrics

    def _plan(state: TrainState) -> DonationPlan:
        _, _, owners, spec = _opt_leaves(state.opt_state, layout, optimizer, where)
        if spec not in plans:
            plans[spec] = DonationPlan.build(optimizer, state.params, state.opt_state, owners,
                                             spec, where)
        return plans[spec]

    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step


# -- checkpoints through torch.distributed.checkpoint -------------------------------------------


def _mesh(layout: ShardLayout, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(_group(layout.group), device_type)


def _dtensor(t: Tensor, name: str, layout: ShardLayout, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    n = layout.numel(name)
    return DTensor.from_local(t[:layout.valid(name)], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([n]), stride=(1,))


def _opt_leaves(opt_state: Any, layout: ShardLayout, optimizer: GradientTransformation,
                where: str) -> tuple[list[str], list[Any], list[str | None], Any]:
    """Return ``(keys, leaves, owners, treespec)`` of ``opt_state``: ``owners[i]`` is the param
    whose shard leaf ``i`` is, or ``None`` for a replicated leaf (a step count).

    The owners come from the structure, not from names (torchopt's own transforms keep tuples
    in params order): ``optimizer.init`` of meta tensors of distinct lengths, one per param,
    shows which leaves follow which param."""
    tags = {n: 1_000_003 + i for i, n in enumerate(layout.shapes)}
    probe = optimizer.init({n: torch.zeros(tags[n], dtype=layout.dtypes[n], device="meta")
                            for n in layout.shapes})
    by_tag = {(t,): n for n, t in tags.items()}
    p_leaves, p_spec = optree.tree_flatten(probe, none_is_leaf=False, namespace="torchopt")
    paths, leaves, spec = optree.tree_flatten_with_path(opt_state, none_is_leaf=False,
                                                        namespace="torchopt")
    if p_spec != spec:
        raise ValueError(f"{where}: the state's opt_state is not optimizer.init of the shards "
                         f"(structure {spec} vs {p_spec}); pass the optimizer the state was "
                         "built with (init_sharded_state)")
    keys, owners = [], []
    for path, leaf, p_leaf in zip(paths, leaves, p_leaves, strict=True):
        keys.append("/".join(str(p) for p in path))
        name = by_tag.get(tuple(p_leaf.shape)) if isinstance(p_leaf, Tensor) else None
        if name is not None and tuple(leaf.shape) != (layout.chunk(name),):
            raise ValueError(f"{where}: opt_state leaf {keys[-1]} of param {name!r} has shape "
                             f"{tuple(leaf.shape)}, expected the shard shape "
                             f"({layout.chunk(name)},)")
        owners.append(name)
    return keys, leaves, owners, spec


def gather_sharded_state(state: TrainState, layout: ShardLayout,
                         optimizer: GradientTransformation) -> TrainState:
    """Return the whole (unsharded) :class:`TrainState` on every rank; a collective.

    ``params`` get their full shapes back and every optimizer-state leaf of a param (Adam's
    ``mu``/``nu``, momentum) its param's shape: the state a single process (or the replicated
    data-parallel step) would hold. Save it with :func:`save_checkpoint_once` for an ordinary
    checkpoint; ``layout.shard`` / :func:`init_sharded_state` go the other way for params.

    Example::

        full = gather_sharded_state(state, layout, opt)
        save_checkpoint_once("ckpt.pt", full)
    """
    where = "gather_sharded_state"
    params = layout.gather({k: v for k, v in state.params.items()})
    _, leaves, owners, spec = _opt_leaves(state.opt_state, layout, optimizer, where)
    pg = _group(layout.group)

    def full(leaf: Any, name: str | None) -> Any:
        if name is None:
            return leaf
        whole = _materialise(_all_gather(leaf.contiguous(), 0, pg))
        return whole[:layout.numel(name)].view(layout.shapes[name])

    opt_state = optree.tree_unflatten(spec, [full(leaf, name)
                                             for leaf, name in zip(leaves, owners, strict=True)])
    return _replace(state, params=params, opt_state=opt_state)


def _state_dict(state: TrainState, layout: ShardLayout, optimizer: GradientTransformation,
                where: str) -> dict[str, Any]:
    layout.check_shards(state.params, f"{where}: state.params")
    mesh = _mesh(layout, next(iter(state.params.values())).device.type)
    keys, leaves, owners, _ = _opt_leaves(state.opt_state, layout, optimizer, where)
    opt = {key: (_dtensor(leaf, name, layout, mesh) if name is not None else leaf)
           for key, leaf, name in zip(keys, leaves, owners, strict=True)
           if isinstance(leaf, Tensor)}
    sd: dict[str, Any] = {
        "params": {n: _dtensor(t, n, layout, mesh) for n, t in state.params.items()},
        "opt_state": opt}
    # every other field is replicated (TrainState: buffers, step, seed, loss_scale, skipped;
    # DPState: buffers, step, key, loss_scale, skipped, clip_norm); None fields are left out
    for name in state._fields:
        value = getattr(state, name)
        if name in ("params", "opt_state") or value is None:
            continue
        sd[name] = dict(value._asdict()) if name == "loss_scale" else value
        if name == "buffers":
            sd[name] = dict(value)
    return sd


def save_sharded_checkpoint(path: str | os.PathLike[str], state: TrainState,
                            layout: ShardLayout, optimizer: GradientTransformation) -> None:
    """Write a sharded ``state`` to the directory ``path`` with ``torch.distributed.checkpoint``.

    ``optimizer`` is the one the state was built with (it tells which optimizer-state leaves
    are shards). A collective: every rank calls it and writes its own shards. Params and sharded optimizer
    leaves are saved as DTensors of their full flat ``(numel,)`` length (``Shard(0)``), so
    :func:`load_sharded_checkpoint` reads them back at any world size (resharding); replicated
    leaves (buffers, step, seed, Adam's count) are saved once. ``state`` may also be a sharded
    :class:`torchfn.persample.DPState` (:func:`init_sharded_dp_state`): every field other than
    ``params`` and ``opt_state`` -- its noise ``key``, ``step``, ``skipped``, ``clip_norm`` --
    is saved as a replicated value, so a resumed DP run continues exactly. Returns ``None``.

    Example::

        save_sharded_checkpoint("ckpt/", state, layout, opt)               # on 4 ranks
        state = load_sharded_checkpoint("ckpt/", template, layout2, opt)    # on 2 ranks
    """
    import torch.distributed.checkpoint as dcp

    sd = _state_dict(state, layout, optimizer, "save_sharded_checkpoint")
    dcp.save(sd, checkpoint_id=os.fspath(path),
             process_group=layout.group)


def load_sharded_checkpoint(path: str | os.PathLike[str], template: TrainState,
                            layout: ShardLayout, optimizer: GradientTransformation) -> TrainState:
    """Return the sharded state stored in ``path``, resharded to ``layout``'s world size.

    ``template`` is any state of this layout built with ``optimizer`` (e.g.
    ``init_sharded_state(params, buffers, opt, layout, seed=0)``, or
    :func:`init_sharded_dp_state` for a DP state); its values are not used,
    only its structure, shapes and devices. A collective: every rank calls it. The checkpoint
    may come from any world size (:func:`save_sharded_checkpoint`).

    Example::

        template = init_sharded_state(params, buffers, opt, layout, seed=0)
        state = load_sharded_checkpoint("ckpt/", template, layout, opt)
    """
    import torch.distributed.checkpoint as dcp

    template = optree.tree_map(torch.clone, template, none_is_leaf=False, namespace="torchopt")
    sd = _state_dict(template, layout, optimizer, "load_sharded_checkpoint")
    dcp.load(sd, checkpoint_id=os.fspath(path), process_group=layout.group)

    def local(x: Any, name: str, like: Tensor) -> Tensor:
        out = torch.zeros_like(like)
        v = x.to_local() if hasattr(x, "to_local") else x
        out[:v.numel()] = v
        return out

    params = {n: local(sd["params"][n], n, t) for n, t in template.params.items()}
    keys, leaves, owners, spec = _opt_leaves(template.opt_state, layout, optimizer,
                                             "load_sharded_checkpoint")
    new_leaves = [leaf if not isinstance(leaf, Tensor) else
                  local(sd["opt_state"][key], name, leaf) if name is not None else
                  sd["opt_state"][key]
                  for key, leaf, name in zip(keys, leaves, owners, strict=True)]
    opt_state = optree.tree_unflatten(spec, new_leaves)
    fields: dict[str, Any] = {"params": params, "opt_state": opt_state}
    for name in template._fields:
        if name in sd and name not in fields:
            fields[name] = (template.loss_scale._replace(**sd[name]) if name == "loss_scale"
                            else sd[name])
    return _replace(template, **fields)
