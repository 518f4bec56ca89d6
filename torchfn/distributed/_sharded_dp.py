"""Sharded (ZeRO-3 style) DP-SGD: params and optimizer state split over the ranks.

One logical step over ``W`` ranks (``state`` from :func:`init_sharded_dp_state`)::

    all    theta   = all-gather(theta_r)                  full params, one collective per dtype
    rank r g_r     = sum_{i on r} clip_C(grad l_i)        DPTrainStep's clipped sum, full shapes
    all    g[r]    = reduce-scatter-sum(g_r)              this rank's flat shard of sum_r g_r
    rank r g~[r]   = (g[r] + sigma C z[r]) / (q N)        z[r]: this shard's slice of ONE draw
    all    counts  = all-reduce(count, loss, clipped, norms, non-finite)   one small collective
    rank r theta_r <- optimizer(theta_r, g~[r])           the step core, on the shard

``z`` is the flat standard-normal draw over all params (in ``params`` order) under
``state.key`` that the unsharded step adds; each rank computes only its elements of it
(``normal_slice``), so the noise is bit-identical to the unsharded step's and its std is
``sigma C`` over the whole gradient. With ``blocks=`` the first two lines run block by block
(``_sharded_dp_blocks.py``): the clipped sum of each block is reduce-scattered as soon as it
is formed, and no rank holds more than one gathered block. The non-finite flag is global, so
every rank skips the same steps; the key, the step count and adaptive clipping's threshold
are replicated. The mechanism is the single-process one over the global batch: the accountant
is stepped once per logical step with the global ``q``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchopt.base import GradientTransformation

from torchfn._checks import _compile_kwargs, _replace
from torchfn.distributed._donate import DonationPlan, check_not_donated, refuse_compile
from torchfn.distributed._reduce import all_reduce_tree
from torchfn.distributed._sharded import ShardLayout, _opt_leaves
from torchfn.distributed._sharded_dp_blocks import BlockedDP
from torchfn.persample import (
    ClippedSum,
    DPState,
    DPTrainStep,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    init_dp_state,
)

__all__ = ["ShardedDPStep", "init_sharded_dp_state", "make_sharded_dp_train_step"]

TensorDict = dict[str, Tensor]


def init_sharded_dp_state(params: TensorDict, buffers: TensorDict,
                          optimizer: GradientTransformation, layout: ShardLayout, *,
                          seed: int, max_grad_norm: float | None = None) -> DPState:
    """Return a :class:`DPState` whose ``params`` and ``opt_state`` are this rank's shards.

    ``params`` are the full params (the same on every rank), ``layout`` is
    ``ShardLayout.from_params(params)``. ``state.params[name]`` is the flat
    ``(layout.chunk(name),)`` shard and ``opt_state`` is ``optimizer.init`` of the shards;
    ``buffers``, ``step``, ``key`` (int64 ``(2,)``, from ``seed``: the same on every rank, so
    the ranks add slices of one noise draw), ``skipped`` and ``clip_norm`` (adaptive clipping's
    ``C_0``, from ``max_grad_norm``) are replicated, as :func:`torchfn.persample.init_dp_state`
    makes them.

    Example::

        layout = ShardLayout.from_params(params)
        state = init_sharded_dp_state(params, buffers, opt, layout, seed=0)
        state.params["w"].shape, state.key.shape   # (ceil(numel(w) / W),), (2,)
    """
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"init_sharded_dp_state(layout=...): expected a ShardLayout "
                        f"(ShardLayout.from_params(params)), got {type(layout).__name__}")
    return init_dp_state(layout.shard(params), buffers, optimizer, seed=seed,
                         max_grad_norm=max_grad_norm)


def _refusals(step: DPTrainStep) -> list[tuple[str, str, str]]:
    """Return ``(argument, expected, seen)`` for every setting the sharded step refuses."""
    opts = step._options
    out = []
    if step.secure_noise:
        out.append(("secure_noise", "False (the seeded noise, which each shard can slice)",
                    "True: ChaCha20 noise has no per-shard slice yet"))
    if opts.amp is not None:
        out.append(("amp", "None", f"{opts.amp!r}: mixed precision is not sharded yet"))
    if opts.trainable is not None:
        out.append(("trainable", "None (every param trained)",
                    "a filter: frozen params are not sharded yet"))
    if step._ghost.frozen:
        out.append(("ghost", "a model without frozen params",
                    f"frozen params {sorted(step._ghost.frozen)}: frozen params are not "
                    "sharded yet"))
    return out


class ShardedDPStep:
    """DP-SGD with sharded params and optimizer state, from a :class:`DPTrainStep`.

    Built by :func:`make_sharded_dp_train_step`. ``sstep(state, local_batch, valid)`` takes
    one logical step whose local share is one physical batch; :meth:`run` takes one on any
    number of physical batches per rank (:func:`shard_poisson_sample` chunks) and steps an
    accountant once; :meth:`compile` compiles its parts (``fullgraph=True``; refused with
    ``donate=True``). Attributes of the wrapped step (``noise_std``, ``sample_rate``, ...) are
    forwarded.
    """

    def __init__(self, step: DPTrainStep, layout: ShardLayout, donate: bool = False,
                 blocks: Any = None) -> None:
        self.step_fn, self.layout, self.donate = step, layout, donate
        self.blocks = blocks
        self._plans: dict[Any, DonationPlan] = {}
        self._sum: Callable[..., Any] = step.clipped_sum  # compiled if step was compiled
        self._apply: Callable[..., Any] = self._reduce_and_apply
        self._one: Callable[..., Any] = self._one_step
        # per-block gathering: the clipped sum comes back as shards (already reduce-scattered)
        self._blocked = (BlockedDP(step, layout, blocks, "make_sharded_dp_train_step")
                         if blocks is not None else None)

    def __getattr__(self, name: str) -> Any:
        if name in ("noise_multiplier", "sample_rate", "dataset_size", "expected_batch_size",
                    "max_grad_norm", "layer_thresholds", "noise_std", "clipping",
                    "automatic_gamma", "adaptive_clipping", "grad_noise_multiplier", "delta"):
            return getattr(self.step_fn, name)
        raise AttributeError(name)

    def _check_state(self, state: DPState) -> None:
        if not torch.compiler.is_compiling():
            check_not_donated(state, "sharded DP-SGD step")
        self.layout.check_shards(state.params, "sharded DP-SGD step: state.params")

    def _full(self, state: DPState) -> DPState:
        self._check_state(state)
        return _replace(state, params=self.layout.gather(state.params))

    def apply(self, state: DPState, local: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        """Reduce-scatter ``local`` (this rank's clipped sum, full shapes), add this shard's
        noise, update the shard: ``(new_state, metrics)``, metrics global."""
        return self._apply(state, local)

    def _reduce_and_apply(self, state: DPState,
                          local: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        if self.donate and torch.compiler.is_compiling():
            refuse_compile()
        if not torch.compiler.is_compiling():
            check_not_donated(state, "sharded DP-SGD step")
        return self._apply_shard(state, self.layout.reduce_scatter_sum(local.grads), local)

    def _apply_shard(self, state: DPState, shard: TensorDict,
                     local: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        """Noise and update from ``shard`` (this rank's flat shards of the clipped sum over
        all ranks) and ``local``'s counts (this rank's; all-reduced here). The callers have
        checked that ``state`` was not donated."""
        lay, dp = self.layout, self.step_fn
        slices = {n: (lay.numel(n), lay.rank * lay.chunk(n), lay.valid(n), lay.chunk(n))
                  for n in lay.shapes}
        grads, noised = dp._noisy(state, shard, slices)
        bad = torch.stack([(~torch.isfinite(g)).sum().to(torch.float64)
                           for g in grads.values()]).sum()
        small = {"count": local.count, "loss_sum": local.loss_sum, "clipped": local.clipped,
                 "norm_sum": local.norm_sum}
        red = all_reduce_tree({**{k: v.double() for k, v in small.items()}, "bad": bad},
                              op="sum", group=lay.group)
        finite = (red["bad"] == 0) & torch.isfinite(red["loss_sum"])
        if self.donate:  # (the update reads only the counts: the sum's shard dies here)
            shard = {}
        total = ClippedSum(grads=shard, **{k: red[k].to(v.dtype) for k, v in small.items()})
        shard = None  # type: ignore[assignment]
        return dp._update(state, grads, noised, total, finite=finite,
                          apply=self._donated_apply if self.donate else None)

    def _donated_apply(self, optimizer: GradientTransformation, grads: TensorDict,
                       state: DPState, *, options: Any, trainable: Any, loss: Tensor,
                       unscale: bool, where: str) -> tuple[DPState, dict[str, Tensor]]:
        """The step core's part that :meth:`DPTrainStep._update` uses, param by param into
        the donated state (``grads`` is emptied as it goes); ``loss`` is NaN on a step that
        every rank skips."""
        assert options.max_grad_norm is None and options.clip_value is None and not options.fp16
        assert set(trainable) == set(state.params) and not unscale
        _, _, owners, spec = _opt_leaves(state.opt_state, self.layout, optimizer, where)
        if spec not in self._plans:
            self._plans[spec] = DonationPlan.build(optimizer, state.params, state.opt_state,
                                                   owners, spec, "make_sharded_dp_train_step")
        finite = torch.isfinite(loss) if options.guard else None
        return self._plans[spec].apply(optimizer, state, grads.pop, finite, state.buffers,
                                       options.lr_schedule, where)

    def __call__(self, state: DPState, batch: tuple[Any, Any],
                 valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        """Return ``(new_state, metrics)``; ``batch``/``valid`` are this rank's ``(P, ...)``/``(P,)``.

        ``metrics`` are global, as :class:`DistributedDPStep`'s (``loss``: mean over every
        rank's valid examples; ``batch_size``: the global count; ``skipped``: the same on every
        rank).
        """
        return self._one(state, batch, valid)

    def _one_step(self, state: DPState, batch: tuple[Any, Any],
                  valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        if self._blocked is not None:
            return self._apply_shard(state, *self._blocked_sum(state, [(batch, valid)]))
        return self._reduce_and_apply(state, self.step_fn._clipped_sum(self._full(state), batch,
                                                                       valid))

    def _blocked_sum(self, state: DPState, batches: Iterable[tuple[Any, Tensor]],
                     ) -> tuple[TensorDict, ClippedSum]:
        """``(shard, local)``: the blocked clipped sums of ``batches`` (shards, summed) and
        their counts (this rank's)."""
        assert self._blocked is not None
        self._check_state(state)
        total = None
        for batch, valid in batches:
            part = self._blocked.clipped_sum(state, batch, valid)
            total = part if total is None else DPTrainStep.add(total, part)
        assert total is not None
        return total.grads, total

    def compile(self, **kwargs: Any) -> ShardedDPStep:
        """Return a copy whose one-batch step, per-chunk clipped sum and :meth:`apply` are
        ``torch.compile(fullgraph=True)``; ``kwargs`` go to ``torch.compile``, with
        :attr:`DPTrainStep.inductor_options` as for :meth:`DPTrainStep.compile`."""
        if self.blocks is not None:
            raise ValueError("ShardedDPStep.compile: a step with per-block gathering "
                             "(make_sharded_dp_train_step(..., blocks=...)) runs eagerly only "
                             "(torch.compile of its autograd.Function, which gathers, "
                             "recomputes and reduce-scatters in the backward, is not "
                             "supported); build it with blocks=None to compile it")
        if self.donate:
            raise ValueError("ShardedDPStep.compile: a donating step "
                             "(make_sharded_dp_train_step(..., donate=True)) runs eagerly only; "
                             "build it with donate=False to compile it")
        kwargs = _compile_kwargs(kwargs, DPTrainStep.inductor_options)
        new = ShardedDPStep.__new__(ShardedDPStep)
        new.__dict__.update(self.__dict__)
        new._sum = torch.compile(self.step_fn._clipped_sum, **kwargs)
        new._apply = torch.compile(self._reduce_and_apply, **kwargs)
        new._one = torch.compile(self._one_step, **kwargs)
        return new

    def run(self, state: DPState, chunks: Sequence[tuple[Tensor, Tensor]],
            get_batch: Callable[[Tensor], tuple[Any, Any]],
            accountant: RDPAccountant | PLDAccountant | PRVAccountant | None = None,
            ) -> tuple[DPState, dict[str, Any]]:
        """Take one logical step on this rank's ``chunks`` (:func:`shard_poisson_sample`).

        The params are gathered once; every chunk's clipped sum is taken on them and added
        (ranks may hold different numbers of chunks), then :meth:`apply`. ``accountant`` is
        stepped once with the GLOBAL ``noise_multiplier`` and ``sample_rate``; with
        ``make_dp_train_step(..., delta=...)`` ``metrics["epsilon"]`` reports its epsilon.
        """
        if not chunks:
            raise ValueError("ShardedDPStep.run: chunks is empty; pass "
                             "shard_poisson_sample(sampler, step, rank=..., world_size=...)")
        device = state.step.device
        if self._blocked is not None:
            # every chunk gathers each block: the ranks run the same number of chunks (a rank
            # short of the most gets all-padding chunks, valid = False: they add nothing)
            most = torch.tensor(len(chunks), dtype=torch.int64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.layout.group)
            n = int(most)
            idx0, valid0 = chunks[0]
            chunks = [*chunks, *[(torch.zeros_like(idx0), torch.zeros_like(valid0))
                                 for _ in range(n - len(chunks))]]
            state, metrics = self._apply_shard(state, *self._blocked_sum(
                state, ((get_batch(idx.to(device)), valid.to(device)) for idx, valid in chunks)))
            if accountant is not None:
                metrics = {**metrics, **self.step_fn.account(accountant)}
            return state, metrics
        full = self._full(state)
        total = None
        for idx, valid in chunks:
            part = self._sum(full, get_batch(idx.to(device)), valid.to(device))
            total = part if total is None else DPTrainStep.add(total, part)
        assert total is not None
        state, metrics = self.apply(state, total)
        if accountant is not None:
            metrics = {**metrics, **self.step_fn.account(accountant)}
        return state, metrics


def make_sharded_dp_train_step(step: DPTrainStep, layout: ShardLayout, *,
                               donate: bool = False, blocks: Any = None) -> ShardedDPStep:
    """Return a sharded DP-SGD step (:class:`ShardedDPStep`) equal to ``step`` over the global batch.

    ``step = make_dp_train_step(ghost, loss_fn, opt, ..., sample_rate=q, dataset_size=N)`` for
    the GLOBAL dataset (as for :class:`DistributedDPStep`); ``layout =
    ShardLayout.from_params(params)``; the state comes from :func:`init_sharded_dp_state`:
    ``state.params[name]`` is this rank's flat ``(layout.chunk(name),)`` shard and
    ``opt_state`` covers the shards only (about ``1 / W`` of the memory per rank). Per logical
    step: one all-gather of the params and one reduce-scatter of the clipped sum (one each per
    dtype, ``P`` elements in all) and one all-reduce of five scalars. Each rank's ``batch`` is
    ``(P, ...)`` with a ``(P,)`` bool ``valid`` (its share of the Poisson draw,
    :func:`shard_poisson_sample`). Flat, per-layer, automatic and adaptive clipping,
    ``lr_schedule`` and ``skip_nonfinite`` work as in ``step``; the result equals the
    unsharded step (and :class:`DistributedDPStep`) to float round-off, with the same noise.
    Save and resume with :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`
    (the noise key, step, skipped count and adaptive threshold travel with it).

    ``donate=True`` (eager only): the state is donated, as for
    ``make_sharded_train_step(..., donate=True)``: the update runs param by param and writes
    the new params and optimizer state into ``state``'s own tensors (one copy of the state plus
    one param's new leaves at the peak instead of two copies); feed the returned state back,
    the old one is invalid (passing it again raises ``ValueError``). Same numbers bit for bit,
    skipped steps included; :meth:`ShardedDPStep.compile` and an optimizer whose update mixes
    params raise ``ValueError``.

    ``blocks`` (per-block gathering, ZeRO-3 / FSDP style; eager only): ``None`` (default)
    gathers every param at the start of the step. With ``blocks`` (``"auto"``, a list of
    submodule names or a callable ``(name, module) -> bool`` over the ghost model's
    ``named_modules()``, as for ``make_sharded_train_step(..., blocks=...)``) the params of
    each block are all-gathered only while the block runs and dropped after, so a rank holds
    the shards with their optimizer state, the params outside every block (gathered whole)
    and ONE gathered block -- a model that does not fit one GPU trains with DP. The ghost pass
    treats each block as one opaque call: its forward runs the block under ``no_grad``; the
    backward gathers the block again, recomputes it with its layers' probes (the RNG of the
    forward replayed) and takes the block's per-sample ghost norms ``(B,)``. Per-layer clipping
    (and ``"automatic_per_layer"``) then forms the block's clipped sum at once (each layer's
    coefficient needs only its own norm) and reduce-scatters it. Flat clipping (and
    ``"automatic"``, adaptive) needs each example's norm over ALL params first: the backward
    keeps each block's input and output gradient (two boundary activations of ``(B, ...)`` per
    block), and once every norm is known each block is gathered a third time, recomputed, and
    its clipped sum reduce-scattered. Per physical batch: 2 (per layer) or 3 (flat)
    all-gathers and 1 reduce-scatter per block (one all-gather more on the first batch of each
    input shape: the probe-shape pass, cached), plus one all-gather and one reduce-scatter of
    the params outside the blocks. :meth:`ShardedDPStep.run` runs the same number of physical
    batches on every rank (a rank with fewer gets all-padding ones). Same numbers as
    ``blocks=None`` and one process (float round-off), every clipping mode. Refused with a
    ``ValueError``: a ghost layer that reads the params of a block and of something else, or
    contains a block (e.g. a root that owns a param directly: its ``"direct"`` layer
    recomputes the root's forward), a block called twice in one forward, a block calling a
    ghost layer outside it, and what ``make_sharded_train_step(..., blocks=...)`` refuses;
    :meth:`ShardedDPStep.compile` raises. A block's layers must be called the same way under
    ``no_grad`` as under grad (the forward logs their output shapes under ``no_grad``).

    Refused (``ValueError`` naming the argument): ``secure_noise=True``, ``amp``, a
    ``trainable`` filter, a ghost model with frozen params.

    Example (a world of one; under ``torchrun`` each rank runs the same lines on its share)::

        >>> import torch, torchopt
        >>> import torch.distributed as dist
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.distributed import ShardLayout
        >>> from torchfn.persample import make_dp_train_step, make_ghost_model
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 2))
        >>> opt = torchopt.sgd(0.1)
        >>> dp = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"),
        ...                         opt, noise_multiplier=1.0, max_grad_norm=1.0,
        ...                         sample_rate=0.1, dataset_size=80)
        >>> layout = ShardLayout.from_params(params)
        >>> sstep = make_sharded_dp_train_step(dp, layout)
        >>> state = init_sharded_dp_state(params, buffers, opt, layout, seed=0)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> state, metrics = sstep(state, (x, y), torch.ones(8, dtype=torch.bool))
        >>> state.params["weight"].shape, int(metrics["batch_size"]), int(state.step)
        (torch.Size([8]), 8, 1)
        >>> layout.gather(state.params)["weight"].shape
        torch.Size([2, 4])
        >>> dist.destroy_process_group()
    """
    where = "make_sharded_dp_train_step"
    if not isinstance(step, DPTrainStep):
        raise TypeError(f"{where}(step, layout): expected a DPTrainStep from make_dp_train_step, "
                        f"got {type(step).__name__}")
    refused = _refusals(step)
    if refused:
        arg, expected, seen = refused[0]
        raise ValueError(f"{where}: make_dp_train_step({arg}=...) is not supported by the "
                         f"sharded step: expected {expected}, got {seen}. Use "
                         "DistributedDPStep (replicated state) for it")
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"{where}(step, layout): expected a ShardLayout "
                        f"(ShardLayout.from_params(params)), got {type(layout).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"{where}(donate=...): expected True or False, got {donate!r}")
    return ShardedDPStep(step, layout, donate, blocks)
