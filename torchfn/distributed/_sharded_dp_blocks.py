"""Per-block gathering for sharded DP-SGD: ghost per-sample norms one gathered block at a time.

``make_sharded_dp_train_step(step, layout, blocks=...)`` runs the ghost pass of
:meth:`torchfn.persample.GhostModel.per_sample` over a private copy of the ghost model whose
blocks (submodules, e.g. decoder layers) are opaque :class:`_GhostBlock` calls. One physical
batch of ``B`` examples on rank ``r`` (``valid`` ``(B,)``, ``m = valid`` as 0/1)::

    forward   outside layers record (x, probe) as usual; block k: all-gather its params, run it
              under no_grad (its layers log their output shapes only), drop the params
    backward  block k (reverse order): all-gather again, recompute it with its layers' probes
              (RNG replayed), vjp with the block's output gradient -> each layer's (x, g);
              the block's ghost norms s_k (B,) (per layer: s_{k,l}); drop the params
    norms     s = sum_k s_k + s_outside               (flat: the norm over ALL params)
    coefs     c_i = m_i min(1, C / (sqrt(s_i) + 1e-6)) (automatic / adaptive C_t likewise)
    sums      block k: all-gather, recompute, vjp with the KEPT output gradient, clipped sum
              sum_i c_i grad_i over the block's params, reduce-scatter it at once
              outside: the clipped sum of the outside layers, reduce-scatter

Per-layer clipping needs only each layer's own norm, so a block's clipped sum is formed and
reduce-scattered inside its backward (one recomputation per block); flat clipping (and
automatic, adaptive) keeps each block's input and output gradient (two boundary activations
per block) for the second recomputation. The result is a :class:`ClippedSum` whose ``grads``
are already this rank's flat shards of the sum over ranks; :class:`ShardedDPStep` adds the
shard's slice of the one noise draw and updates, as without blocks.

Peak gathered params per rank: the params outside every block (gathered whole) and ONE block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from torchfn._checks import _call_translated
from torchfn.distributed._blocks import (
    BlockedModel,
    _Block,
    _Call,
    _gather,
    _refuse_compile,
    captured_rng,
    make_blocked_model,
    replayed_rng,
)
from torchfn.distributed._sharded import ShardLayout
from torchfn.persample import ClippedSum, DPTrainStep, GhostGrads
from torchfn.persample.extension import (
    Layer,
    Tape,
    batch_size_of,
    check_batch,
    check_buffers_unchanged,
    check_valid,
    clip_coefficients,
    input_signature,
    lift_inputs,
    prepare_layers,
    template_of,
    tensors_of,
)

__all__ = ["BlockedDP"]

TensorDict = dict[str, Tensor]
_WHERE = "sharded DP-SGD step (blocks=...)"
_TAPE_FIELDS = ("mode", "batch", "dummy", "shapes", "probes", "calls")


def _save_tape(tape: Tape) -> tuple[Any, ...]:
    return tuple(getattr(tape, f) for f in _TAPE_FIELDS)


def _restore_tape(tape: Tape, saved: tuple[Any, ...]) -> None:
    for f, v in zip(_TAPE_FIELDS, saved, strict=True):
        setattr(tape, f, v)


class _Pass:
    """One ghost pass over one physical batch: what the block calls report into."""

    def __init__(self, owner: BlockedDP, buffers: Mapping[str, Tensor], batch: int,
                 anchor: Tensor, record: bool) -> None:
        self.owner, self.buffers, self.batch, self.anchor = owner, buffers, batch, anchor
        self.record = record  # False: the shape pass (no backward follows)
        self.called: set[str] = set()
        self.runs: list[_BlockRun] = []  # backward order (flat clipping: the second pass)
        self.like: Tensor | None = None  # (B,) zeros of the losses' dtype and device
        self.mask: Tensor | None = None  # (B,) valid as the losses' dtype
        self.sq: Tensor | None = None  # flat: sum of the blocks' (B,) squared norms
        self.per_layer_sq: Tensor | None = None  # per layer: sum over the blocks' layers
        self.clipped: Tensor | None = None
        self.shards: TensorDict = {}  # per layer: the blocks' clipped shard sums


class _BlockRun:
    """One call of one block in a pass: forward (gather, run, shapes), ghost backward."""

    def __init__(self, owner: BlockedDP, pass_: _Pass, call: _Call,
                 shards: Sequence[Tensor]) -> None:
        self.owner, self.pass_, self.call, self.shards = owner, pass_, call, shards
        self.shapes: dict[str, Any] = {}
        self.rng: tuple[Tensor, Tensor | None, torch.device | None] | None = None
        self.inputs: tuple[Tensor, ...] = ()
        self.grad_outs: tuple[Tensor, ...] = ()

    def forward(self, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
        self.rng = captured_rng((*self.shards, *inputs))
        tape = self.owner.tape
        saved = _save_tape(tape)
        with torch.no_grad():
            full = _gather(self.call, self.shards)
            tape.reset()
            tape.mode, tape.batch = "shape", self.pass_.batch  # the block's layers: shapes only
            try:
                outs = self.call.run(full, inputs)
                self.shapes = tape.shapes
            finally:
                _restore_tape(tape, saved)
        del full
        name = self.call.block.name
        stray = [n for n in self.shapes if n not in self.owner.block_layers[name]]
        if stray:
            raise ValueError(f"{_WHERE}: block {name!r} called the ghost layers {stray}, which "
                             "are not inside it; a block may only call its own layers (move "
                             "the shared module into the block or make it part of no block)")
        return tuple(o.clone() if o._is_view() or any(o is t for t in inputs) else o
                     for o in outs)

    def ghost(self, inputs: Sequence[Tensor], grad_outs: Sequence[Tensor],
              bookkeeping: bool) -> tuple[GhostGrads, list[Tensor | None]]:
        """Regather, recompute with the probes, vjp: ``(the block's GhostGrads, input grads)``."""
        owner, pass_, call = self.owner, self.pass_, self.call
        tape, batch = owner.tape, pass_.batch
        with torch.no_grad():
            full = _gather(call, self.shards)
        probes = {n: [[torch.zeros(s, dtype=dt, device=dv) for s, dt, dv in c] for c in cs]
                  for n, cs in self.shapes.items()}
        float_pos = [i for i, t in enumerate(inputs) if t.is_floating_point()]
        static: dict[str, Any] = {}
        out_float: list[bool] = []

        def block_fn(probes: dict[str, list[list[Tensor]]], xs: list[Tensor]
                     ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
            ins = [t.detach() for t in inputs]
            for i, t in zip(float_pos, xs, strict=True):
                ins[i] = t
            saved = _save_tape(tape)
            tape.reset()
            tape.mode, tape.probes, tape.batch = "record", probes, batch
            try:
                with replayed_rng(self.rng):
                    outs = call.run(full, ins, keep=False)
                calls = tape.calls
            finally:
                _restore_tape(tape, saved)
            aux = {}
            for n, cs in calls.items():
                static[n] = template_of(cs)
                aux[n] = tensors_of(cs, [])
            out_float[:] = [o.is_floating_point() for o in outs]
            return [o for o in outs if o.is_floating_point()], aux

        # the recompute runs inside the outer ghost pass's grad level: vjp opens a new one
        _, vjp_fn, saved = _call_translated(
            _WHERE, lambda: torch.func.vjp(block_fn, probes, [inputs[i] for i in float_pos],
                                           has_aux=True))
        g_probes, g_in = vjp_fn([g for g, f in zip(grad_outs, out_float, strict=True) if f])
        del vjp_fn
        assert pass_.like is not None
        grads = owner.ghost_grads(owner.block_layers[call.block.name], full, pass_.buffers,
                                  static, saved, g_probes, batch, pass_.like, bookkeeping)
        in_grads = dict(zip(float_pos, g_in, strict=True))
        return grads, [in_grads.get(i) for i in range(len(inputs))]

    def backward(self, inputs: tuple[Tensor, ...],
                 grad_outs: tuple[Tensor, ...]) -> list[Tensor | None]:
        owner, pass_ = self.owner, self.pass_
        per_layer = owner.step.layer_thresholds is not None
        grads, g_in = self.ghost(inputs, grad_outs, bookkeeping=per_layer)
        if per_layer:  # the block's clipped sum now: each layer's coefficient is its own
            shard = owner.clip_per_layer(pass_, grads, self.call.block.layout)
            owner.add_shards(pass_.shards, shard)
        else:  # its norms now, its clipped sum once every norm is known
            sq = grads.sq_norms()
            assert isinstance(sq, Tensor)
            pass_.sq = sq if pass_.sq is None else pass_.sq + sq
            self.inputs, self.grad_outs = inputs, grad_outs
            pass_.runs.append(self)
        return g_in


class _GhostBlock(torch.autograd.Function):
    """``(run, anchor, *inputs) -> block outputs``: gather, run, drop; backward = ghost pass.

    ``anchor`` is the ghost pass's differentiated 0-d zero: it makes every block's backward
    run even when no block input needs a gradient (its own gradient is None)."""

    @staticmethod
    def forward(run: _BlockRun, anchor: Tensor, *inputs: Tensor  # type: ignore[override]
                ) -> tuple[Tensor, ...]:
        return run.forward(inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        run, _, *flat = inputs
        ctx.run = run
        ctx.save_for_backward(*flat)
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grad_outs: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.run.backward(ctx.saved_tensors, grad_outs))


class _GhostBlocked(BlockedModel):
    """A :class:`BlockedModel` of the ghost model's tapped copy whose blocks run as
    :class:`_GhostBlock` inside the current :class:`_Pass`."""

    owner: BlockedDP
    pass_: _Pass | None = None

    def _make_forward(self, blk: _Block) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                _refuse_compile()
            pass_, shards = self.pass_, self._shards
            if pass_ is None or shards is None:
                raise RuntimeError(f"block {blk.name!r} called outside a sharded DP step")
            if blk.name in pass_.called:
                raise ValueError(f"{_WHERE}: block {blk.name!r} was called twice in one "
                                 "forward; a block's per-sample gradient is formed from one "
                                 "call (a module reused across the depth cannot be a block: "
                                 "leave it outside every block)")
            pass_.called.add(blk.name)
            leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=False)
            pos = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
            call = _Call(blk, spec, leaves, pos, 1.0)
            run = _BlockRun(self.owner, pass_, call, [shards[k] for k in blk.params])
            outs = _GhostBlock.apply(run, pass_.anchor, *[leaves[i] for i in pos])
            return call.outputs(outs)

        return forward


class BlockedDP:
    """The blocked clipped sum of a :class:`DPTrainStep` over a :class:`ShardLayout`.

    Built by ``make_sharded_dp_train_step(step, layout, blocks=...)``;
    :meth:`clipped_sum` ``(state, batch, valid)`` returns a :class:`ClippedSum` whose ``grads``
    are this rank's flat ``(layout.chunk(name),)`` shards of the clipped sum over every rank's
    batch (a collective: every rank calls it once per physical batch).
    """

    def __init__(self, step: DPTrainStep, layout: ShardLayout, blocks: Any, where: str) -> None:
        ghost = step._ghost
        self.step, self.layout, self.ghost = step, layout, ghost
        self.tape: Tape = ghost._tape
        model = make_blocked_model(ghost._model_fn, blocks, layout, where, cls=_GhostBlocked)
        assert isinstance(model, _GhostBlocked)
        model.owner = self
        self.model = model
        self.outside = model.outside
        self.in_blocks = tuple(n for n in layout.shapes if n not in self.outside)
        self.outside_layout = layout.subset(self.outside)
        home = {n: b.name for b in model.blocks for n in b.params}
        self.block_layers: dict[str, dict[str, Layer]] = {b.name: {} for b in model.blocks}
        self.outside_layers: dict[str, Layer] = {}
        for name, lay in ghost._layers.items():
            reads = list(lay.params.values()) + list(lay.consts.values())
            homes = sorted({home.get(p, "") for p in reads})
            inside = [b.name for b in model.blocks
                      if name == "" or b.name.startswith(name + ".")]
            if len(homes) > 1 or (homes == [""] and inside):
                raise ValueError(
                    f"{where}(blocks=...): ghost layer {name or '<root>'!r} "
                    f"({lay.rule.kind}) reads the params of "
                    f"{[h or '<outside every block>' for h in homes]}"
                    f"{f' and contains the blocks {inside}' if inside else ''}; its per-sample "
                    "gradient cannot be formed one block at a time. Pick blocks that contain "
                    "whole ghost layers (ghost.layer_params), e.g. transformer layers whose "
                    "parent owns no parameter directly")
            if homes and homes[0]:
                blk = homes[0]
                if not (name == blk or name.startswith(blk + ".")):
                    raise ValueError(f"{where}(blocks=...): ghost layer {name or '<root>'!r} "
                                     f"holds params of block {blk!r} but is not inside it")
                self.block_layers[blk][name] = lay
            else:
                self.outside_layers[name] = lay
        self._shape_cache: dict[Any, Any] = {}

    # -- helpers used by the block runs -----------------------------------------------------

    def ghost_grads(self, layers: dict[str, Layer], params: Mapping[str, Tensor],
                    buffers: Mapping[str, Tensor], static: dict[str, Any],
                    saved: dict[str, list[Tensor]], grads: dict[str, Any], batch: int,
                    like: Tensor, bookkeeping: bool) -> GhostGrads:
        """The :class:`GhostGrads` of ``layers`` from their recorded calls (``per_sample``'s end)."""
        prepared = prepare_layers(layers, params, buffers, static, saved, grads, batch,
                                  bookkeeping)
        own = {k: params[k] for lay in layers.values() for k in lay.params.values()}
        return GhostGrads(prepared, layers, own, (), batch, like)

    def clip_per_layer(self, pass_: _Pass, grads: GhostGrads,
                       layout: ShardLayout | None) -> TensorDict:
        """Per-layer clipping of one group of layers: the clipped sum (reduce-scattered to
        shards with ``layout``, else full); counts go into ``pass_``."""
        step, mask = self.step, pass_.mask
        assert step.layer_thresholds is not None and mask is not None
        sq_layers = grads.sq_norms(per_layer=True)
        assert isinstance(sq_layers, dict)
        coefs = {}
        for name, c in step.layer_thresholds.items():
            if name not in sq_layers:
                continue
            sq = sq_layers[name].to(mask.dtype)
            n = sq.clamp_min(0).sqrt()
            coefs[name] = mask * clip_coefficients(n, c, step.automatic_gamma)
            clipped = (mask * (n > c).to(mask.dtype)).sum()
            pass_.clipped = clipped if pass_.clipped is None else pass_.clipped + clipped
            pass_.per_layer_sq = sq if pass_.per_layer_sq is None else pass_.per_layer_sq + sq
        sums = grads.weighted_sum(coefs)
        return layout.reduce_scatter_sum(sums) if layout is not None else sums

    @staticmethod
    def add_shards(into: TensorDict, shard: Mapping[str, Tensor]) -> None:
        for k, v in shard.items():
            into[k] = into[k] + v if k in into else v

    # -- the pass ---------------------------------------------------------------------------

    def _run_model(self, pass_: _Pass, outside_full: TensorDict, shards: TensorDict,
                   buffers: Mapping[str, Tensor], inputs: Any) -> tuple[Any, TensorDict]:
        self.model.pass_ = pass_
        try:
            if isinstance(inputs, Mapping):
                return self.model(outside_full, shards, buffers, **inputs)
            return self.model(outside_full, shards, buffers, inputs)
        finally:
            self.model.pass_ = None

    def _probe_specs(self, outside_full: TensorDict, shards: TensorDict,
                     buffers: Mapping[str, Tensor], inputs: Any, batch: int,
                     like: Tensor) -> dict[str, Any]:
        """The outside layers' probe shapes (``GhostModel._probe_specs`` on the blocked copy)."""
        key = input_signature({**outside_full, **shards}, inputs, self.ghost.training)
        if key is not None and key in self._shape_cache:
            return self._shape_cache[key]
        tape = self.tape
        dummy = torch.zeros((), dtype=like.dtype, device=like.device)

        def shape_pass(d: Tensor) -> Tensor:
            tape.reset()
            tape.mode, tape.batch, tape.dummy = "shape", batch, d
            pass_ = _Pass(self, buffers, batch, d, record=False)
            try:
                self._run_model(pass_, outside_full, shards, buffers, lift_inputs(inputs, d))
                self._shapes = tape.shapes
            finally:
                tape.reset()
            return d

        devices = sorted({t.device.index or 0 for t in shards.values()
                          if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):  # keep the random streams as they were
            _call_translated(_WHERE, torch.func.grad(shape_pass), dummy)
        shapes = self._shapes
        del self._shapes
        if key is not None:
            if len(self._shape_cache) >= 64:
                self._shape_cache.pop(next(iter(self._shape_cache)))
            self._shape_cache[key] = shapes
        return shapes

    def clipped_sum(self, state: Any, batch: tuple[Any, Any], valid: Tensor) -> ClippedSum:
        """Return this physical batch's :class:`ClippedSum`; ``grads`` are flat shards.

        ``state.params`` are this rank's flat shards, ``batch = (inputs, targets)`` with
        ``B`` examples in dim 0, ``valid`` ``(B,)`` bool. ``grads[name]`` is this rank's
        ``(layout.chunk(name),)`` shard of the clipped sum over EVERY rank's batch (already
        reduce-scattered); ``count``, ``loss_sum``, ``clipped``, ``norm_sum`` are this rank's
        (0-d, the losses' dtype).
        """
        if torch.compiler.is_compiling():
            _refuse_compile()
        inputs, targets = check_batch(batch)
        step, lay = self.step, self.layout
        outside_full = (self.outside_layout.gather({n: state.params[n] for n in self.outside})
                        if self.outside else {})
        shards = {n: state.params[n] for n in self.in_blocks}
        buffers = state.buffers
        n_batch = batch_size_of(inputs, _WHERE)
        first = next(iter(state.params.values()))
        like0 = torch.zeros((), dtype=first.dtype, device=first.device)
        specs = self._probe_specs(outside_full, shards, buffers, inputs, n_batch, like0)
        probes = {n: [[torch.zeros(s, dtype=dt, device=dv) for s, dt, dv in c] for c in cs]
                  for n, cs in specs.items()}
        tape, loss_fn = self.tape, step._loss_fn
        static: dict[str, Any] = {}
        pass_ = _Pass(self, buffers, n_batch, like0, record=True)

        def objective(probes_and_lift: tuple[dict[str, Any], Tensor]) -> tuple[Tensor, Any]:
            probes, lift = probes_and_lift
            pass_.anchor = lift
            tape.reset()
            tape.mode, tape.probes, tape.batch = "record", probes, n_batch
            try:
                outputs, new_buffers = self._run_model(pass_, outside_full, shards, buffers,
                                                       lift_inputs(inputs, lift))
                calls = tape.calls
            finally:
                tape.reset()
            losses = loss_fn(outputs, targets)
            if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != n_batch:
                seen = (f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor)
                        else type(losses).__name__)
                raise ValueError(f"{_WHERE}: loss_fn(outputs, targets) must return the "
                                 f"({n_batch},) per-sample losses (reduction='none'), got {seen}")
            check_valid(valid, losses)
            # the blocks' backward (during this grad's backward) needs the mask and dtype
            pass_.like = torch.zeros(n_batch, dtype=losses.dtype, device=losses.device)
            pass_.mask = valid.to(losses.dtype)
            saved = {}
            for name, cs in calls.items():
                static[name] = template_of(cs)
                saved[name] = tensors_of(cs, [])
            return losses.sum(), (losses, new_buffers, saved)

        (grads, _), (losses, new_buffers, saved) = _call_translated(
            _WHERE, torch.func.grad(objective, has_aux=True), (probes, like0))
        check_buffers_unchanged(new_buffers, buffers)
        losses = losses.detach()
        mask = pass_.mask
        assert mask is not None
        per_layer = step.layer_thresholds is not None
        outer = self.ghost_grads(self.outside_layers, outside_full, buffers, static, saved,
                                 grads, n_batch, pass_.like, bookkeeping=True)
        shard: TensorDict = dict(pass_.shards)
        if per_layer:
            out_sums = self.clip_per_layer(pass_, outer, None)
            norm_sq = pass_.per_layer_sq if pass_.per_layer_sq is not None else mask * 0
            clipped = pass_.clipped if pass_.clipped is not None else mask.new_zeros(())
            norm = norm_sq.clamp_min(0).sqrt()
        else:
            sq = outer.sq_norms()
            assert isinstance(sq, Tensor)
            sq = sq.to(mask.dtype) + (pass_.sq.to(mask.dtype) if pass_.sq is not None else 0)
            norm = sq.clamp_min(0).sqrt()
            c = step._clip_norm(state)
            coef = mask * clip_coefficients(norm, c, step.automatic_gamma)
            clipped = (mask * (norm > c).to(mask.dtype)).sum()
            out_sums = outer.weighted_sum(coef)
            for run in pass_.runs:  # the second recomputation: the clipped sums, block by block
                g, _ = run.ghost(run.inputs, run.grad_outs, bookkeeping=False)
                run.inputs = run.grad_outs = ()
                self.add_shards(shard, run.call.block.layout.reduce_scatter_sum(
                    g.weighted_sum(coef)))
                del g
            pass_.runs = []
        if self.outside:
            self.add_shards(shard, self.outside_layout.reduce_scatter_sum(
                {n: out_sums[n] for n in self.outside}))
        del out_sums
        full_shard = {n: shard[n] if n in shard else
                      torch.zeros(lay.chunk(n), dtype=lay.dtypes[n], device=first.device)
                      for n in lay.shapes}  # a block this batch never called: zero
        return ClippedSum(grads=full_shard, count=mask.sum(), loss_sum=(losses * mask).sum(),
                          clipped=clipped, norm_sum=(norm * mask).sum())

