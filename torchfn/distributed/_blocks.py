"""Per-block gathering for the sharded steps (ZeRO-3 / FSDP style).

A *block* is a submodule (a transformer layer). Its params stay sharded in the step; when the
block runs, :class:`_GatherBlock` (an ``autograd.Function`` with ``setup_context``, so it
composes with ``torch.func.grad``) all-gathers the block's flat shards, runs the block's
forward under ``no_grad`` and drops the gathered params. Autograd saves only the shards (state
anyway) and the block's inputs (the activations at the block boundary). The backward gathers
the shards again, recomputes the block with grad enabled (rematerialisation, with the RNG state
of the forward so dropout replays), takes the vector-Jacobian product with ``torch.autograd``,
and reduce-scatters the params' full gradient into a gradient of the shards (sum over the
ranks) before the next block's backward runs. Peak memory per rank: the shards, their optimizer
state and gradients, the params outside every block (gathered whole), one gathered block (two
while the backward recomputes one) and the block-boundary activations.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn

from torchfn.functional import FunctionalModel

TensorDict = dict[str, Tensor]

# a test hook: called with each dict of gathered block params (forward and recompute)
_ON_GATHER: Callable[[TensorDict], None] | None = None


@dataclasses.dataclass
class _Block:
    """One block: its module path, its module in the private copy, its own params."""

    name: str
    module: nn.Module
    forward: Callable[..., Any]  # the block's original bound forward
    params: tuple[str, ...]  # full names (keys of the step's params)
    slots: tuple[tuple[str, str], ...]  # (full param name, name inside the block) incl. ties
    layout: Any  # the ShardLayout of ``params``


class _Call:
    """One call of a block: what the Function needs besides tensors."""

    def __init__(self, block: _Block, in_spec: Any, in_leaves: list[Any],
                 tensor_pos: list[int], grad_scale: float) -> None:
        self.block, self.in_spec, self.in_leaves, self.tensor_pos = (block, in_spec, in_leaves,
                                                                      tensor_pos)
        self.grad_scale = grad_scale
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_pos: list[int] = []
        self.rng: tuple[Tensor, Tensor | None, torch.device | None] | None = None
        # the block's buffers as placed at call time (the backward runs after the call returns)
        self.buffers = dict(block.module.named_buffers(remove_duplicate=False))

    def run(self, full: Mapping[str, Tensor], tensors: Sequence[Tensor],
            keep: bool = True) -> list[Tensor]:
        """Return the block's tensor outputs on ``full`` params and input ``tensors``; ``keep``
        records the output structure (the forward), the recompute keeps nothing."""
        leaves = list(self.in_leaves)
        for pos, t in zip(self.tensor_pos, tensors, strict=True):
            leaves[pos] = t
        args, kwargs = optree.tree_unflatten(self.in_spec, leaves)
        blk = self.block
        owners = {local: _owner(blk.module, local) for _, local in blk.slots}
        saved = {local: o._parameters[a] for local, (o, a) in owners.items()}
        b_owners = {local: _owner(blk.module, local) for local in self.buffers}
        b_saved = {local: o._buffers[a] for local, (o, a) in b_owners.items()}
        try:
            for full_name, local in blk.slots:
                o, a = owners[local]
                o._parameters[a] = full[full_name]
            for local, (o, a) in b_owners.items():
                o._buffers[a] = self.buffers[local]
            out = blk.forward(*args, **kwargs)
            after = dict(blk.module.named_buffers(remove_duplicate=False))
        finally:
            for local, (o, a) in owners.items():
                o._parameters[a] = saved[local]
            for local, (o, a) in b_owners.items():
                o._buffers[a] = b_saved[local]
        changed = [n for n, b in after.items() if b is not self.buffers.get(n)]
        if changed:
            raise ValueError(
                f"sharded step (blocks=...): block {blk.name!r} assigned its buffers "
                f"{changed} in its forward (e.g. BatchNorm in training mode); a gathered block "
                "is recomputed in the backward, so its buffers must be read-only. Leave that "
                "module outside every block")
        leaves, spec = optree.tree_flatten(out, none_is_leaf=False)
        pos = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
        if keep:  # non-tensor outputs are constants; the tensor slots are filled by outputs()
            self.out_spec, self.out_pos = spec, pos
            self.out_leaves = [None if i in pos else v for i, v in enumerate(leaves)]
        return [leaves[i] for i in pos]

    def outputs(self, tensors: Sequence[Tensor]) -> Any:
        leaves = list(self.out_leaves)
        for pos, t in zip(self.out_pos, tensors, strict=True):
            leaves[pos] = t
        return optree.tree_unflatten(self.out_spec, leaves)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return module.get_submodule(prefix), attr


def _gather(call: _Call, shards: Sequence[Tensor]) -> TensorDict:
    full = call.block.layout.gather(dict(zip(call.block.params, shards, strict=True)))
    if _ON_GATHER is not None:
        _ON_GATHER(full)
    return full


class _GatherBlock(torch.autograd.Function):
    """``(call, n, *shards, *inputs) -> block outputs``: gather, run, drop; backward recomputes."""

    @staticmethod
    def forward(call: _Call, n: int, *flat: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        shards, inputs = flat[:n], flat[n:]
        call.rng = captured_rng(flat)
        with torch.no_grad():
            full = _gather(call, shards)
            outs = call.run(full, inputs)
        del full
        # a fresh tensor per output: an output that is an input (or a view of one) would alias
        return tuple(o.clone() if o._is_view() or any(o is t for t in flat) else o
                     for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        call, n, *flat = inputs
        ctx.call, ctx.n = call, n
        ctx.save_for_backward(*flat)  # the shards (state anyway) and the block's inputs
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grad_outs: Tensor) -> tuple[Tensor | None, ...]:
        call, n = ctx.call, ctx.n
        flat = ctx.saved_tensors
        shards, inputs = flat[:n], flat[n:]
        with torch.no_grad():
            full = _gather(call, shards)
        names = list(full)
        float_pos = [i for i, t in enumerate(inputs) if t.is_floating_point()]
        out_float: list[bool] = []

        def block_fn(p: TensorDict, xs: list[Tensor]) -> list[Tensor]:
            ins = [t.detach() for t in inputs]
            for i, t in zip(float_pos, xs, strict=True):
                ins[i] = t
            with replayed_rng(call.rng):
                outs = call.run(p, ins, keep=False)
            out_float[:] = [o.is_floating_point() for o in outs]
            return [o for o in outs if o.is_floating_point()]

        # the recompute runs inside torch.func's grad level: differentiate it with vjp (a new
        # level; requires_grad_ is refused under a functorch transform). Grad mode stays off
        # (once_differentiable): the outer level records nothing, so the gathered params die
        # with this function instead of living on in a graph behind the input gradients
        _, vjp_fn = torch.func.vjp(block_fn, full, [inputs[i] for i in float_pos])
        del full, _
        g_full, g_in = vjp_fn([g for g, f in zip(grad_outs, out_float, strict=True) if f])
        del vjp_fn
        full_grads = {k: g_full[k] for k in names}
        del g_full
        shard_grads = call.block.layout.reduce_scatter_sum(full_grads)
        del full_grads
        if call.grad_scale != 1.0:  # the step's 1 / (ranks x micro-batches), block by block
            shard_grads = {k: v * call.grad_scale for k, v in shard_grads.items()}
        in_grads = dict(zip(float_pos, g_in, strict=True))
        return (None, None, *[shard_grads[k] for k in call.block.params],
                *[in_grads.get(i) for i in range(len(inputs))])


_COMPILE_MSG = (
    "sharded step (blocks=...): per-block gathering runs eagerly only; torch.compile of a "
    "torch.func.grad over its autograd.Function (gather, recompute and reduce-scatter in the "
    "backward) is not supported. Call the step without torch.compile, or compile the "
    "whole-gather step (blocks=None)")


@torch.compiler.disable(reason=_COMPILE_MSG)
def captured_rng(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor | None, Any]:
    """The random state a block's forward starts from: ``(cpu_state, cuda_state | None,
    device | None)``, the CUDA part for the first CUDA device among ``tensors``."""
    dev = next((t.device for t in tensors if t.device.type == "cuda"), None)
    return torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev is not None else None, dev


@contextlib.contextmanager
def replayed_rng(rng: Any) -> Iterator[None]:
    """Runs the body with the random state ``rng = (cpu_state, cuda_state | None, device |
    None)`` captured before a block's first forward, so its recompute draws the same dropout
    masks; the caller's random state is restored afterwards."""
    cpu_rng, cuda_rng, dev = rng
    with torch.random.fork_rng(devices=[dev] if dev is not None else [],
                               device_type=dev.type if dev is not None else "cuda"):
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)
        yield


def _refuse_compile() -> None:
    raise RuntimeError(_COMPILE_MSG)


class BlockedModel:
    """Calls a module with block params kept sharded: ``(outside_full, shards, buffers, *args)``.

    Built by :func:`make_blocked_model` from the root module; owns a private copy whose block
    modules' ``forward`` go through :class:`_GatherBlock`.
    """

    def __init__(self, root: nn.Module, blocks: list[_Block], outside: tuple[str, ...],
                 param_slots: dict[str, tuple[str, ...]],
                 buffer_slots: dict[str, tuple[str, ...]]) -> None:
        self.root, self.blocks, self.outside = root, blocks, outside
        self._param_slots, self._buffer_slots = param_slots, buffer_slots
        self._shards: Mapping[str, Tensor] | None = None
        # the shard gradients come back multiplied by this (the step sets 1 / (W k)), so the
        # step never copies the whole gradient shard to scale it
        self.grad_scale = 1.0
        for blk in blocks:
            blk.module.forward = self._make_forward(blk)  # type: ignore[method-assign]

    def _make_forward(self, blk: _Block) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                _refuse_compile()
            if self._shards is None:
                raise RuntimeError(f"block {blk.name!r} called outside a sharded step")
            leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=False)
            pos = [i for i, v in enumerate(leaves) if isinstance(v, Tensor)]
            call = _Call(blk, spec, leaves, pos, self.grad_scale)
            shards = [self._shards[k] for k in blk.params]
            outs = _GatherBlock.apply(call, len(shards), *shards, *[leaves[i] for i in pos])
            return call.outputs(outs)

        return forward

    def __call__(self, outside_full: Mapping[str, Tensor], shards: Mapping[str, Tensor],
                 buffers: Mapping[str, Tensor], *args: Any, **kwargs: Any
                 ) -> tuple[Any, TensorDict]:
        """Return ``(outputs, new_buffers)``."""
        saved_p: list[tuple[nn.Module, str, Any]] = []
        saved_b: list[tuple[nn.Module, str, Any]] = []
        self._shards = shards
        try:
            for name, aliases in self._param_slots.items():
                if name in outside_full:
                    for alias in aliases:
                        o, a = _owner(self.root, alias)
                        saved_p.append((o, a, o._parameters[a]))
                        o._parameters[a] = outside_full[name]
            for name, aliases in self._buffer_slots.items():
                for alias in aliases:
                    o, a = _owner(self.root, alias)
                    saved_b.append((o, a, o._buffers[a]))
                    o._buffers[a] = buffers[name]
            try:
                out = self.root(*args, **kwargs)
            except (RuntimeError, NotImplementedError) as e:
                if "meta" not in str(e):
                    raise
                raise RuntimeError(
                    f"sharded step (blocks=...): the model read a block's param outside the "
                    f"block's forward (it touched a meta placeholder: {e}). A block's params "
                    "are only gathered while module(...) of the block runs: pick blocks whose "
                    "forward is called (e.g. a transformer layer), not containers whose children "
                    f"are called directly (ModuleList, ModuleDict). Blocks: "
                    f"{[b.name for b in self.blocks]}") from e
            new_buffers = {name: _owner(self.root, aliases[0])[0]._buffers[
                _owner(self.root, aliases[0])[1]] for name, aliases in self._buffer_slots.items()}
        finally:
            self._shards = None
            for o, a, v in reversed(saved_p):
                o._parameters[a] = v
            for o, a, v in reversed(saved_b):
                o._buffers[a] = v
        return out, new_buffers


def _root_of(model_fn: Any, where: str) -> nn.Module:
    if isinstance(model_fn, nn.Module):
        return model_fn
    if isinstance(model_fn, FunctionalModel):
        return next(iter(model_fn.modules()))  # its private copy's root (meta placeholders)
    raise TypeError(f"{where}(model_fn, ..., blocks=...): per-block gathering needs the model's "
                    f"modules: pass an nn.Module or the model_fn of "
                    f"torchfn.functional.make_functional(module), got {type(model_fn).__name__}")


def _select(root: nn.Module, blocks: Any, where: str) -> list[str]:
    """Return the block module names ``blocks`` selects in ``root``."""
    names = [n for n, _ in root.named_modules() if n]
    if isinstance(blocks, str) and blocks == "auto":
        lists = [(sum(p.numel() for p in m.parameters()), n) for n, m in root.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m)]
        if not lists:
            raise ValueError(f"{where}(blocks='auto'): the model has no nn.ModuleList to take "
                             "its children as blocks; pass blocks=[module names] (e.g. "
                             "['layers.0', 'layers.1']) or a callable (name, module) -> bool")
        _, best = max(lists)
        chosen = [f"{best}.{i}" if best else str(i) for i in range(len(root.get_submodule(best)))]
    elif callable(blocks):
        chosen = [n for n, m in root.named_modules() if n and blocks(n, m)]
        if not chosen:
            raise ValueError(f"{where}(blocks=<callable>): the callable selected no submodule "
                             f"(it is called as blocks(name, module) on {len(names)} modules)")
    elif isinstance(blocks, Sequence) and not isinstance(blocks, str) and blocks and all(
            isinstance(b, str) for b in blocks):
        chosen = list(blocks)
        for b in chosen:
            if b not in names:
                close = difflib.get_close_matches(b, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{where}(blocks=...): {b!r} names no submodule of the model"
                                 f"{hint}; blocks are names from model.named_modules(), e.g. "
                                 f"{names[:3]}")
        dup = sorted({b for b in chosen if chosen.count(b) > 1})
        if dup:
            raise ValueError(f"{where}(blocks=...): {dup} listed more than once")
    else:
        raise TypeError(f"{where}(blocks=...): expected 'auto', a non-empty list of module names "
                        f"or a callable (name, module) -> bool, got {blocks!r:.80}")
    for a in chosen:
        for b in chosen:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"{where}(blocks=...): blocks {a!r} and {b!r} overlap ({b!r} "
                                 "is inside it); pick disjoint submodules")
    return chosen


def make_blocked_model(model_fn: Any, blocks: Any, layout: Any, where: str,
                       cls: type[BlockedModel] | None = None) -> BlockedModel:
    """Return a :class:`BlockedModel` (or ``cls``, a subclass with its own block forward) of
    ``model_fn``'s module with the selected blocks."""
    src = _root_of(model_fn, where)
    # a private copy with meta placeholders (costs no memory; the module is never modified)
    memo: dict[int, Any] = {}
    for t in list(src.parameters()) + list(src.buffers()):
        memo.setdefault(id(t), nn.Parameter(torch.empty_like(t, device="meta"),
                                            requires_grad=t.requires_grad)
                        if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
    root = copy.deepcopy(src, memo)
    chosen = _select(root, blocks, where)

    def slots(named: list[tuple[str, Tensor]]) -> dict[str, tuple[str, ...]]:
        groups: dict[int, list[str]] = {}
        for n, t in named:
            groups.setdefault(id(t), []).append(n)
        return {v[0]: tuple(v) for v in groups.values()}

    param_slots = slots(list(root.named_parameters(remove_duplicate=False)))
    buffer_slots = slots(list(root.named_buffers(remove_duplicate=False)))
    if list(param_slots) != list(layout.shapes):
        raise ValueError(f"{where}(blocks=...): the layout's params {list(layout.shapes)} are "
                         f"not the model's params {list(param_slots)} (named_parameters() order)")

    def block_of(alias: str) -> str | None:
        return next((b for b in chosen if alias.startswith(b + ".")), None)

    owned: dict[str, list[str]] = {b: [] for b in chosen}
    for name, aliases in param_slots.items():
        homes = {block_of(a) for a in aliases}
        if len(homes) > 1:
            raise ValueError(f"{where}(blocks=...): param {name!r} is tied across blocks or "
                             f"between a block and the rest of the model (aliases "
                             f"{list(aliases)}); tied params must lie in one block or outside "
                             "every block")
        home = homes.pop()
        if home is not None:
            owned[home].append(name)
    empty = [b for b, ps in owned.items() if not ps]
    if empty:
        raise ValueError(f"{where}(blocks=...): blocks {empty} hold no parameter; pass blocks "
                         "that own params (e.g. the layers of the model)")
    made = []
    for b in chosen:
        module = root.get_submodule(b)
        slot_list = tuple((name, alias[len(b) + 1:]) for name in owned[b]
                          for alias in param_slots[name])
        made.append(_Block(b, module, module.forward, tuple(owned[b]), slot_list,
                           layout.subset(owned[b])))
    in_blocks = {n for ps in owned.values() for n in ps}
    outside = tuple(n for n in param_slots if n not in in_blocks)
    return (cls or BlockedModel)(root, made, outside, param_slots, buffer_slots)
