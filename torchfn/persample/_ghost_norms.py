"""Per-sample gradient norms without per-sample gradients ("ghost" norms), hook-free.

How it works (no module hooks, so it runs under ``torch.compile(fullgraph=True)``):

1. :func:`make_ghost_model` deep-copies the module (``nn.RNN``/``nn.GRU``/``nn.LSTM`` swapped
   for torchfn's transform-safe twins) and wraps every *layer* in a tap: a built-in layer
   torchfn has a rule for (``nn.Linear``, HF's ``Conv1D``, ``nn.Conv1d/2d``, ``nn.Embedding``,
   ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, eval ``nn.BatchNorm*``,
   ``nn.MultiheadAttention(batch_first=True)``, torchfn's recurrent layers); a module that
   owns parameters directly and has no parameterised children, or reads its children's
   weights itself, or ties parameters inside its subtree: one vmap-fallback layer with its
   whole subtree; and the *direct* parameters of any other module (a ViT root's
   ``pos_embed``/``cls_token``, a ConvNeXt block's layer scale): a ``"direct"`` layer of
   those parameters only, while its children keep their own layers and taps (taps nest). A
   tap shares the layer's parameter/buffer/child dicts, so names and
   :func:`make_functional`'s slot swapping are unchanged, forwards attribute reads to the
   layer (``nn.TransformerEncoder`` reads ``self_attn.batch_first``), and calls the layer as
   usual. The copy then goes through :func:`make_functional`.
2. :meth:`GhostModel.per_sample` runs ``torch.func.grad`` of ``sum_i loss_i`` with respect to
   zero "probe" tensors only (parameters are constants: no weight gradients are formed). In
   that pass every tap records its call's inputs on a tape (a plain Python object; Dynamo
   replays the writes) and returns ``layer(x) + probe``. So one backward yields each layer's
   output gradient ``g``, which for a sum of per-sample losses holds each sample's own
   gradient in its batch row. The probes' shapes come from a shape pass (under grad, with a
   0-d zero added at every tap, so grad-dependent branches match): cached per input
   signature in eager mode, traced (and dead-code-eliminated) under ``torch.compile``. A
   call of a layer on data shared by the batch (leading dim 1, e.g. HF position ids
   ``(1, T)``) has its output expanded to the batch ``B`` before the probe is added and its
   inputs recorded expanded (:mod:`torchfn.persample._ghost_tape`).
3. :class:`GhostGrads` applies each layer's rule (:mod:`torchfn.persample._ghost_layers`)
   to the recorded ``(x, g)``: squared norms, weighted sums (book-keeping DP-SGD) or the
   materialised per-sample gradients. A direct layer's rule is a per-sample ``vjp`` of its
   module's own forward with respect to the direct parameters only (children untapped).

Inputs: one tensor or tuple (the module's single positional argument) or a dict of keyword
inputs (HF style, ``module(**inputs)``); every tensor in it has the batch in dim 0 (or 1, for
a tensor shared by the batch, e.g. HF ``position_ids`` ``(1, T)``).

Limits: the batch is dim 0 of every layer input and output, or dim 0 is 1 for a call shared
by the batch whose output is then only broadcast against the batch; a parameter must be used
only inside the forward of layers that hold it (a weight tied between two layers, e.g.
GPT-2's ``wte.weight is lm_head.weight``, is exact: its uses are summed and the norms get the
cross terms; a weight read by a parent as ``F.linear(x, self.head.weight)`` makes the norms
wrong, which :func:`check_ghost_coverage` detects, as it detects a shared output indexed over
dim 0); layers must not mix samples (BatchNorm in training mode is refused); fallback and
direct layers are recomputed per sample, so they must be deterministic (dropout inside them
is refused in training mode: set it to 0 or use eval).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchfn._checks import _call_model, _call_translated
from torchfn.functional import FunctionalModel, make_functional, replace_recurrent
from torchfn.ops import ensure_gram_op_registered
from torchfn.persample._ghost_grads import GhostGrads, GhostResult, Layer
from torchfn.persample._ghost_instantiated import (
    DirectRule,
    refuse_batchnorm_training,
    rule_for,
)
from torchfn.persample._ghost_layers import (
    CONV_METHODS,
    Calls,
    GhostLayerError,
    Prepared,
    local,
)
from torchfn.persample._ghost_tape import (
    Tap,
    Tape,
    batch_size_of,
    fill_slots,
    input_signature,
    lift_inputs,
    template_of,
    tensors_of,
    to_meta_,
)
from torchfn.persample._ghost_tied import tied_groups

__all__ = [
    "GhostGrads",
    "GhostLayerError",
    "GhostModel",
    "GhostResult",
    "check_ghost_coverage",
    "ghost_grad_norms",
    "make_ghost_model",
]

TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Any], Tensor]
_SHAPE_CACHE_SIZE = 64  # eager probe-shape entries kept per GhostModel (oldest dropped)
_WHERE = "GhostModel.per_sample"
# modules whose forward reads their children's weights without calling the children: never
# split into a "direct" layer plus child layers (the whole module is one fallback layer)
_WHOLE_TYPES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


class GhostModel:
    """A stateless model instrumented for ghost per-sample gradients (see the module doc).

    Built by :func:`make_ghost_model`. ``ghost(params, buffers, *args, **kwargs)`` is the
    plain forward, ``(outputs, new_buffers)``, exactly like :func:`make_functional`'s
    ``model_fn`` (so it also serves for evaluation and non-private training).
    :meth:`per_sample` runs one forward and one backward and returns :class:`GhostGrads`.

    ``inputs`` of :meth:`per_sample` (and of :func:`ghost_grad_norms`,
    :func:`check_ghost_coverage`, the DP step) is one tensor or tuple, passed as the single
    positional argument, or a dict of batched tensors, passed as keywords
    (``module(**inputs)``, HF style); every tensor in it has the batch in dim 0 (or 1: a
    tensor shared by the batch).

    Attributes: ``layer_names`` (tuple), ``layer_kinds`` (``{layer: "linear" | "conv" |
    "embedding" | "norm" | "attention" | "recurrent" | "fallback" | "direct"}``),
    ``layer_params`` (``{layer: (param names)}``), ``clip_groups`` (``{first layer: (layers)}``:
    layers linked by a tied parameter form one group, whose norm the per-layer norms report at
    its first layer -- zeros at the others -- and which per-layer clipping clips as one),
    ``frozen`` (names of parameters with ``requires_grad=False``: zero gradient, never
    noised), ``trainable`` (the other parameter names), ``param_names``, ``buffer_names``,
    ``training``.
    """

    def __init__(self, model_fn: FunctionalModel, tape: Tape, layers: dict[str, Layer],
                 frozen: tuple[str, ...]) -> None:
        self._model_fn, self._tape, self._layers, self.frozen = model_fn, tape, layers, frozen
        self._shape_cache: dict[Any, Any] = {}
        self.layer_names = tuple(layers)
        self.layer_kinds = {n: lay.rule.kind for n, lay in layers.items()}
        self.layer_params = {n: tuple(lay.params.values()) for n, lay in layers.items()}
        groups: dict[str, list[str]] = {}
        for n, head in tied_groups({n: lay.params for n, lay in layers.items()}).items():
            groups.setdefault(head, []).append(n)
        self.clip_groups = {head: tuple(members) for head, members in groups.items()}
        self.param_names = model_fn.param_names
        self.buffer_names = model_fn.buffer_names
        self.trainable = tuple(k for k in self.param_names if k not in frozen)

    @property
    def training(self) -> bool:
        """Whether the model is in training mode."""
        return self._model_fn.training

    def train(self, mode: bool = True) -> GhostModel:
        """Return a new GhostModel in training mode ``mode`` (``self`` is unchanged)."""
        layers = {}
        for n, lay in self._layers.items():
            module = copy.deepcopy(lay.module).train(mode)
            refuse_batchnorm_training(module, n)
            layers[n] = lay._replace(module=module)
        return GhostModel(self._model_fn.train(mode), self._tape, layers, self.frozen)

    def eval(self) -> GhostModel:
        """Return a new GhostModel in eval mode."""
        return self.train(False)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{n or '<root>'}: {k}" for n, k in self.layer_kinds.items())
        return f"GhostModel(training={self.training}, layers={{{kinds}}})"

    def __call__(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], /,
                 *args: Any, **kwargs: Any) -> tuple[Any, TensorDict]:
        """Return ``(module(*args, **kwargs), new_buffers)``: the plain forward."""
        return self._model_fn(params, buffers, *args, **kwargs)

    def _probe_specs(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                     inputs: Any) -> dict[str, list[list[tuple[torch.Size, torch.dtype, Any]]]]:
        compiling = torch.compiler.is_compiling()
        key = None if compiling else input_signature(params, inputs, self.training)
        if key is not None and key in self._shape_cache:
            return self._shape_cache[key]
        tape = self._tape
        tape.reset()
        tape.mode, tape.batch = "shape", batch_size_of(inputs, _WHERE)

        def shape_pass(dummy: Tensor) -> Tensor:
            # under grad, with a zero added to every tapped output like the probes: code that
            # branches on grad mode (torch's fused TransformerEncoder inference path reads its
            # layers' weights without calling them) takes the recording pass's branch
            tape.dummy = dummy
            _call_model(self._model_fn, params, buffers, lift_inputs(inputs, dummy), _WHERE)
            return dummy

        like = next(iter(params.values()), None)
        dummy = (torch.zeros(()) if like is None
                 else torch.zeros((), dtype=like.dtype, device=like.device))
        try:
            if compiling:  # traced, then dead code
                torch.func.grad(shape_pass)(dummy)
            else:  # a real forward: keep the random streams as they were
                with torch.random.fork_rng(devices=_cuda_devices(params)):
                    _call_translated(_WHERE, torch.func.grad(shape_pass), dummy)
            shapes = tape.shapes
        finally:
            tape.reset()
        if key is not None:
            if len(self._shape_cache) >= _SHAPE_CACHE_SIZE:  # e.g. many sequence lengths
                self._shape_cache.pop(next(iter(self._shape_cache)))
            self._shape_cache[key] = shapes
        return shapes

    def per_sample(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                   inputs: Any, targets: Any, loss_fn: LossFn, *,
                   bookkeeping: bool = False) -> GhostResult:
        """Run one forward and one backward; return per-sample gradients in ghost form.

        ``outputs, new_buffers = ghost(params, buffers, inputs)``; ``loss_fn(outputs,
        targets)`` must return the ``(B,)`` per-sample losses (e.g. ``F.cross_entropy(...,
        reduction="none")``); sample ``i``'s gradient is that of ``losses[i]``. ``inputs``: a
        tensor or tuple (one positional argument) or a dict (keywords), every tensor with the
        batch ``B`` in dim 0 (else ``ValueError`` naming it). Works under
        ``torch.compile(fullgraph=True)``. ``bookkeeping=True`` says a ``weighted_sum`` will
        follow the norms (DP-SGD's clipped sum): sequence layers may then keep the per-sample
        gradients the norms materialise, where that makes norms plus sum cheaper (same
        numbers either way, up to rounding).

        Example::

            >>> import torch.nn.functional as F
            >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
            >>> ghost, params, buffers = make_ghost_model(net)
            >>> x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
            >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
            >>> res = ghost.per_sample(params, buffers, x, y, loss_fn)
            >>> res.grads.sq_norms().shape, res.losses.shape
            (torch.Size([6]), torch.Size([6]))
            >>> res.grads.weighted_sum(torch.ones(6))["0.weight"].shape  # the summed gradient
            torch.Size([8, 4])
        """
        batch = batch_size_of(inputs, _WHERE)
        specs = self._probe_specs(params, buffers, inputs)
        probes = {name: [[torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in call]
                         for call in calls] for name, calls in specs.items()}
        tape = self._tape
        static: dict[str, Any] = {}

        like = next(iter(params.values()), None)
        lift = (torch.zeros(()) if like is None
                else torch.zeros((), dtype=like.dtype, device=like.device))

        def objective(probes_and_lift: tuple[dict[str, list[list[Tensor]]], Tensor]
                      ) -> tuple[Tensor, Any]:
            probes, lift = probes_and_lift
            tape.reset()
            tape.mode, tape.probes, tape.batch = "record", probes, batch
            try:
                outputs, new_buffers = _call_model(self._model_fn, params, buffers,
                                                   lift_inputs(inputs, lift), _WHERE)
                calls = tape.calls
            finally:
                tape.reset()
            losses = loss_fn(outputs, targets)
            if not isinstance(losses, Tensor) or losses.dim() != 1:
                seen = (f"shape {tuple(losses.shape)}" if isinstance(losses, Tensor)
                        else type(losses).__name__)
                raise ValueError(
                    "GhostModel.per_sample: loss_fn(outputs, targets) must return the (B,) "
                    f"per-sample losses (e.g. reduction='none'), got {seen}"
                )
            if losses.shape[0] != batch:
                raise ValueError(
                    f"GhostModel.per_sample: loss_fn(outputs, targets) returned "
                    f"{losses.shape[0]} per-sample losses, but the inputs have batch size "
                    f"{batch} (dim 0); return one loss per example"
                )
            saved = {}
            for name, cs in calls.items():
                static[name] = template_of(cs)
                saved[name] = tensors_of(cs, [])
            return losses.sum(), (losses, outputs, new_buffers, saved)

        try:
            (grads, _), (losses, outputs, new_buffers, saved) = _call_translated(
                _WHERE, torch.func.grad(objective, has_aux=True), (probes, lift))
        except RuntimeError as e:
            if "Expected tensors, got unsupported type" not in str(e):
                raise
            raise ValueError(
                "GhostModel.per_sample: the model's outputs hold an object that is neither a "
                f"tensor nor a pytree of tensors ({e}); return tensors (HF models: pass "
                "use_cache=False in inputs or the config, so no cache object is returned)"
            ) from e
        prepared = prepare_layers(self._layers, params, buffers, static, saved, grads, batch,
                                  bookkeeping)
        like = losses.detach()
        ghost_grads = GhostGrads(prepared, self._layers, params, self.frozen, batch, like)
        return GhostResult(ghost_grads, losses, outputs, new_buffers)


def prepare_layers(layers: Mapping[str, Layer], params: Mapping[str, Tensor],
                   buffers: Mapping[str, Tensor], static: Mapping[str, Any],
                   saved: Mapping[str, list[Tensor]], grads: Mapping[str, Any], batch: int,
                   bookkeeping: bool) -> dict[str, Prepared]:
    """Each recorded layer's :class:`Prepared` ``(a, g)`` state, the end of a ghost pass.

    ``static[name]`` / ``saved[name]``: the layer's recorded calls as a template and its
    tensors (``template_of`` / ``tensors_of``); ``grads[name]``: the probes' gradients (the
    layer outputs' gradients) for those calls; ``batch``: ``B``. ``bookkeeping``: a
    ``weighted_sum`` follows (see :meth:`GhostModel.per_sample`). Raises
    :class:`GhostLayerError` naming a layer whose inputs or outputs lack the batch in dim 0.
    """
    prepared: dict[str, Prepared] = {}
    for name, tensors in saved.items():
        calls: Calls = fill_slots(static[name], iter(tensors))
        layer = layers[name]
        bad = layer.rule.batch_dims_ok(layer.module, calls, grads[name], batch)
        if bad is not None:
            raise GhostLayerError(
                f"ghost layer {name!r}: {bad}, but the batch size (of the inputs) is "
                f"{batch}; ghost per-sample gradients need the batch in dim 0 of every "
                "layer input and output (or dim 0 of size 1 for a call shared by the "
                "batch, e.g. a positional embedding of arange(T)[None])"
            )
        consts = local(buffers, layer.buffers)
        if layer.consts:
            consts.update(local(params, layer.consts))
        prepared[name] = layer.rule.prepare(
            layer.module, name, local(params, layer.params), consts, calls, grads[name])
    if bookkeeping:
        for p in prepared.values():
            p.expect_weighted_sum()
    return prepared


def _cuda_devices(params: Mapping[str, Tensor]) -> list[int]:
    return sorted({t.device.index or 0 for t in params.values() if t.device.type == "cuda"})


def _direct_params(m: nn.Module) -> list[tuple[str, Tensor]]:
    return [(k, p) for k, p in m._parameters.items() if p is not None]


def _dedup(named: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    seen: set[int] = set()
    return [(k, p) for k, p in named if not (id(p) in seen or seen.add(id(p)))]


def make_ghost_model(
    module: nn.Module, *, fallback_chunk_size: int | None = None, conv_method: str = "unfold"
) -> tuple[GhostModel, TensorDict, TensorDict]:
    """Return ``(ghost, params, buffers)``: ``module`` instrumented for ghost per-sample grads.

    ``params``/``buffers`` are those of ``make_functional(module)`` (same keys, detached
    clones), so one dict serves both. Layers: the built-in ``nn.Linear``, ``nn.Conv1d``,
    ``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm`` get
    exact closed-form rules, and so does ``nn.BatchNorm1d/2d/3d`` in eval mode (subclasses are
    treated as unknown); ``nn.MultiheadAttention(batch_first=True)`` with fused QKV weights
    is one layer whose four projections get the linear forms (its attention core recomputed
    once, batched). ``nn.RNN``/``nn.GRU``/``nn.LSTM`` are swapped for torchfn's
    transform-safe twins (:func:`torchfn.functional.replace_recurrent`; same keys) and get an
    exact rule too: each weight is a linear map applied at every step, whose per-sample
    gradient is a sum over time of outer products (inter-layer dropout in training mode is
    refused: the rule recomputes the layer). Another module that owns parameters directly
    becomes one layer handled by the vmap fallback, together with all its submodules
    (``"fallback"``), when it has no parameterised children, when it reads its children's
    weights itself (e.g. ``nn.MultiheadAttention(add_bias_kv=True)``) or when parameters are
    tied inside it; otherwise only its direct parameters form a layer (``"direct"``: a
    per-sample vjp of its own forward, e.g. a ViT root's ``pos_embed``), and its children are
    layers of their own, ghost where they have rules. Modules without direct parameters are
    looked through. ``fallback_chunk_size`` bounds how many samples the fallback and direct
    layers map over at once.
    ``conv_method`` picks how conv layers get their per-sample gradients: ``"unfold"`` (patches,
    then the linear-layer forms; the default, faster on the benchmark CNN) or ``"grouped"``
    (weight-gradient convolutions with the batch folded into the groups: no ``k x k``-times
    larger patches in memory).

    HF transformers' ``Conv1D`` (GPT-2's projections) gets the linear rule with its weight
    transposed. A parameter tied across layers (``lm_head.weight is wte.weight``) is exact:
    its per-sample gradient is the sum of its uses', its norms include the cross terms, and
    the layers sharing it form one per-layer clipping group named after the first of them
    (the others report zero norms and take its coefficient).

    Refused with :class:`GhostLayerError`: BatchNorm in training mode, ``nn.Embedding`` with
    ``max_norm``/``scale_grad_by_freq``, ``nn.MultiheadAttention(batch_first=False)``, a layer
    whose parameters are partly frozen, a recurrent layer with inter-layer dropout in training
    mode or an unbatched input.

    Example::

        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
        >>> ghost, params, buffers = make_ghost_model(net)
        >>> ghost.layer_kinds
        {'0': 'conv', '2': 'linear'}
        >>> class WithPos(nn.Module):  # owns pos itself: a "direct" layer beside the linear
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.pos, self.lin = nn.Parameter(torch.zeros(1, 3, 4)), nn.Linear(4, 2)
        ...     def forward(self, x):
        ...         return self.lin(x + self.pos)
        >>> make_ghost_model(WithPos())[0].layer_kinds
        {'lin': 'linear', '': 'direct'}
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"make_ghost_model(module): expected an nn.Module, got "
                        f"{type(module).__name__}")
    if conv_method not in CONV_METHODS:
        raise ValueError(f"make_ghost_model(conv_method=...): expected one of {CONV_METHODS}, "
                         f"got {conv_method!r}")
    ensure_gram_op_registered()  # the fused Gram-norm op, where Triton is installed
    tape = Tape()
    root_holder = nn.Module()
    # a deep copy, with nn.RNN/GRU/LSTM swapped for torchfn's (exact "recurrent" ghost rule)
    root_holder.root = replace_recurrent(module)
    # the primary (first, as in make_functional) name of every parameter and buffer tensor
    primary: dict[int, str] = {}
    for n, t in [*root_holder.root.named_parameters(remove_duplicate=False),
                 *root_holder.root.named_buffers(remove_duplicate=False)]:
        primary.setdefault(id(t), n)

    layers: dict[str, Layer] = {}
    frozen: list[str] = []

    def adopt(parent: nn.Module, attr: str, m: nn.Module, name: str,
              direct: bool = False) -> None:
        # direct: a layer of m's own parameters only (its children are layers of their own)
        rule = (DirectRule(fallback_chunk_size) if direct
                else rule_for(m, fallback_chunk_size, conv_method))
        rule.check(m, name)
        refuse_batchnorm_training(m, name)
        named = _dedup(_direct_params(m)) if direct else list(m.named_parameters())
        # parameters tied across layers are allowed: GhostGrads sums their uses
        # and adds the cross terms to the norms (torchfn.persample._ghost_tied)
        trainable = [p.requires_grad for _, p in named]
        if not any(trainable):
            frozen.extend(n for n in (primary[id(p)] for _, p in named) if n not in frozen)
            return
        if not all(trainable):
            raise GhostLayerError(
                f"make_ghost_model: layer {name!r} has trainable and frozen parameters "
                f"({[n for n, p in named if not p.requires_grad]} are frozen); freeze whole "
                "layers only"
            )
        params = {loc: primary[id(p)] for loc, p in named}
        buffers = {loc: primary[id(b)] for loc, b in m.named_buffers()}
        consts = {loc: primary[id(p)] for loc, p in m.named_parameters(remove_duplicate=False)
                  if direct and "." in loc}
        layers[name] = Layer(m, rule, params, buffers, consts)
        parent._modules[attr] = Tap(m, name, tape, expand_shared=rule.expands_shared_calls,
                                    cast_input=rule.casts_input_under_autocast)

    def visit(parent: nn.Module, attr: str, m: nn.Module, name: str) -> None:
        if not any(True for _ in m.parameters()):
            return
        direct = _direct_params(m)
        nested = any(True for c in m.children() for _ in c.parameters())
        tied = direct and (len(list(m.named_parameters(remove_duplicate=False)))
                           != len(list(m.named_parameters())))
        if (rule_for(m).kind != "fallback" or isinstance(m, _WHOLE_TYPES)
                or (direct and not nested) or tied):
            adopt(parent, attr, m, name)  # one layer with its whole subtree
            return
        for child_attr, child in list(m._modules.items()):
            if child is not None:
                visit(m, child_attr, child, f"{name}.{child_attr}" if name else child_attr)
        if direct:
            adopt(parent, attr, m, name, direct=True)

    visit(root_holder, "root", root_holder.root, "")
    tapped = root_holder.root
    model_fn, params, buffers = make_functional(tapped, replace_batchnorm=False)
    memo: dict[int, Tensor] = {}
    for lay in layers.values():  # keep structure and settings only
        to_meta_(lay.module, memo)
    return GhostModel(model_fn, tape, layers, tuple(frozen)), params, buffers


def ghost_grad_norms(
    ghost: GhostModel, loss_fn: LossFn, *, per_layer: bool = False
) -> Callable[..., Tensor | TensorDict]:
    """Return ``fn(params, buffers, inputs, targets)`` -> per-sample gradient norms ``(B,)``.

    The L2 norm of each sample's gradient over all parameters, from ghost norms (no
    per-sample gradient of a linear/conv/embedding layer is formed). ``loss_fn(outputs,
    targets)`` returns the ``(B,)`` per-sample losses; ``inputs`` is a tensor, a tuple or a
    dict of keyword inputs (see :meth:`GhostModel.per_sample`). ``per_layer=True`` returns
    ``{layer_name: (B,)}`` norms instead. Works under ``torch.compile(fullgraph=True)``.

    Example::

        >>> import torch.nn.functional as F
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 3))
        >>> norms = ghost_grad_norms(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"))
        >>> norms(params, buffers, torch.randn(5, 4), torch.randint(0, 3, (5,))).shape
        torch.Size([5])
    """

    def fn(params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], inputs: Any,
           targets: Any) -> Tensor | TensorDict:
        sq = ghost.per_sample(params, buffers, inputs, targets, loss_fn).grads.sq_norms(
            per_layer=per_layer)
        if isinstance(sq, dict):
            return {k: v.clamp_min(0).sqrt() for k, v in sq.items()}
        return sq.clamp_min(0).sqrt()

    return fn


def check_ghost_coverage(
    ghost: GhostModel,
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    inputs: Any,
    targets: Any,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> None:
    """Raise ``ValueError`` unless ghost gradients add up to autograd's gradient on this batch.

    Compares ``GhostGrads.weighted_sum(c)`` with ``torch.func.grad`` of ``sum_i c_i loss_i``
    for every parameter, with random weights ``c_i`` in ``[1, 2)`` (so a gradient credited to
    the wrong sample is caught too, not only a missing one). A mismatch means some parameter
    is used outside the forward of the layer that owns it (a parent reading
    ``self.head.weight``, weights tied by reference in ``forward``), a layer mixes samples, or
    a call shared by the batch (leading dim 1) has its output indexed or reduced over dim 0
    rather than broadcast; per-sample norms would then be wrong. Both passes start from the
    same random state (CPU and the parameters' CUDA devices; the global state is left as it
    was), so dropout draws the same masks in both. Run it once, eagerly, on a real batch
    before training (float64 gives the sharpest check). ``inputs`` as in
    :meth:`GhostModel.per_sample` (a tensor, tuple, or dict of keyword inputs).

    Example::

        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 3))
        >>> check_ghost_coverage(ghost, lambda o, y: ((o - y) ** 2).sum(1), params, buffers,
        ...                      torch.randn(5, 4), torch.randn(5, 3))
    """
    devices = _cuda_devices(params)
    with torch.random.fork_rng(devices=devices):
        cpu_state = torch.get_rng_state()
        cuda_states = [torch.cuda.get_rng_state(d) for d in devices]

        def same_random_state() -> None:
            torch.set_rng_state(cpu_state)
            for d, st in zip(devices, cuda_states, strict=True):
                torch.cuda.set_rng_state(st, d)

        same_random_state()
        res = ghost.per_sample(params, buffers, inputs, targets, loss_fn)
        gen = torch.Generator().manual_seed(0)
        coef = 1 + torch.rand(res.losses.shape, generator=gen, dtype=torch.float64)
        coef = coef.to(res.losses.device, res.losses.dtype)
        summed = res.grads.weighted_sum(coef)

        def total(p: Mapping[str, Tensor]) -> Tensor:
            return (loss_fn(_call_model(ghost, p, buffers, inputs, "check_ghost_coverage")[0],
                            targets) * coef).sum()

        trainable = {k: v for k, v in params.items() if k not in ghost.frozen}
        same_random_state()
        ref = torch.func.grad(lambda p: total({**params, **p}))(trainable)
    bad = []
    for k, r in ref.items():
        if not torch.allclose(summed[k], r, rtol=rtol, atol=atol):
            err = (summed[k] - r).abs().max().item()
            bad.append(f"{k!r} (max abs error {err:.3g}, |grad| max {r.abs().max().item():.3g})")
    if bad:
        raise ValueError(
            "check_ghost_coverage: the ghost gradients of " + ", ".join(bad) + " do not match "
            "autograd. Those parameters are used outside their own layer's forward (e.g. a "
            "parent module reading a child's weight, or a weight tied inside forward) or a "
            "layer mixes samples; per-sample norms and DP-SGD clipping would be wrong. Move "
            "the use into the owning layer's forward, or wrap the whole computation in one "
            "module that owns a parameter directly and ties or shares the others inside it "
            "(which then becomes a single vmap-fallback layer)."
        )
    if not math.isfinite(float(res.losses.sum())):
        raise ValueError("check_ghost_coverage: the losses are not finite on this batch")
