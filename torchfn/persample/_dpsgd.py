"""DP-SGD as a pure, compile-friendly step: Poisson sampling, ghost clipping, seeded noise.

One logical step of DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy")::

    B_t  = {i : u_it < q}                      Poisson sampling, u_it ~ U[0, 1) i.i.d.
    g    = sum_{i in B_t} clip_C(grad l_i)     clip_C(v) = v * min(1, C / (||v|| + 1e-6))
    g~   = (g + N(0, sigma^2 C^2 I)) / (q N)   noise, then divide by the EXPECTED batch size
    theta <- optimizer(theta, g~)

is the sampled Gaussian mechanism that :class:`torchfn.persample.RDPAccountant` analyses
(``noise_multiplier = sigma``, ``sample_rate = q``), provided the implementation matches it:

- **Sampling** (:class:`PoissonSampler`): every step draws the Bernoulli(q) mask over the
  whole dataset from a counter-based generator keyed by ``(seed, step)`` -- never from the
  data -- and packs the selected indices into fixed-size *physical* batches: the first
  ``physical_batch_size`` selected examples, then the next, ..., the last one padded with
  index 0 and ``valid = False``. Nothing is truncated, so the sampled set is exactly Poisson;
  a draw larger than one physical batch simply spans several (an extra physical batch, not
  a different distribution). Shapes are static: the compiled step never recompiles.
- **Masking**: a padded entry (``valid = False``) is computed like any other and then gets
  clipping coefficient 0, so it adds nothing to ``g``.
- **Clipping**: per-sample norms are ghost norms (:mod:`torchfn.persample._ghost_norms`);
  flat (one ``C`` for the whole gradient) or per layer (``C_l`` per layer, so the total
  sensitivity is ``C = sqrt(sum_l C_l^2)`` and the noise std is ``sigma * C``). The clipped
  sum is book-keeping style: one weighted GEMM per linear/conv layer from the activations
  and output gradients the single backward left behind. Automatic (normalised) clipping and
  adaptive quantile clipping (the threshold ``C_t`` in ``state.clip_norm``, a noisy count of
  unclipped examples paid for by a raised gradient noise) are in
  :mod:`torchfn.persample._dp_clipping`.
- **Noise**: ``sigma * C`` times standard normals from :mod:`torchfn.persample._dp_random`:
  one flat draw over all trainable parameters (in ``params`` order) under ``state.key``, the
  step's key, which the step then advances (``fold_in(key, "next")``). A pure function of
  the state, identical eager and compiled, resumable from a checkpoint of the state. With
  ``secure_noise=True`` the draw is ChaCha20 under a 256-bit key from the OS CSPRNG held in
  ``state.key`` (:mod:`torchfn.persample._dp_secure`: what it protects, what it costs).
- **Division** by ``q N`` (not by the realised batch size, which would leak it).

Not covered by the guarantee: buffers updated from data (refused), frozen parameters (no
noise, they never change), and floating-point attacks on the noise (see ``_dp_random``;
``secure_noise=True`` mitigates them, see ``_dp_secure``).

Privacy accounting is host-side: :meth:`DPTrainStep.run` steps the accountant and, with
``make_dp_train_step(..., delta=...)``, reports ``metrics["epsilon"]`` (a Python float) from
it, so the compiled step stays pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torchopt.base import GradientTransformation
from torchopt.typing import OptState, Schedule

from torchfn import _checks
from torchfn._checks import (
    STEP_INDUCTOR_OPTIONS,
    _compile_kwargs,
    _foreach_map,
    _part,
    _replace,
    check_state_type,
)
from torchfn.functional import (
    DynamicLossScaler,
    LossScaleState,
    StepOptions,
    apply_gradients,
    check_optimizer,
)
from torchfn.persample._accountant import RDPAccountant, _check_delta
from torchfn.persample._accountant_pld import PLDAccountant
from torchfn.persample._accountant_prv import PRVAccountant
from torchfn.persample._dp_clipping import (
    AUTOMATIC_GAMMA,
    AdaptiveClipping,
    adaptive_grad_noise_multiplier,
    clip_coefficients,
    next_clip_norm,
)
from torchfn.persample._dp_random import _normal_ranges, fold_in, key_from_seed, normal
from torchfn.persample._dp_secure import next_secure_key, secure_key, secure_normal
from torchfn.persample._ghost_norms import GhostModel

__all__ = [
    "ClippedSum",
    "DPState",
    "DPTrainStep",
    "init_dp_state",
    "make_dp_train_step",
]

Tensor = torch.Tensor
TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Any], Tensor]
Trainable = Callable[[str], bool] | Collection[str]

_NOISE_SALT = 0x6E6F6973  # "nois"
# the sharded step's noise is drawn for groups of params of up to this many elements at once
_NOISE_GROUP = 1 << 24
_NEXT_SALT = 0x6E657874  # "next"
_COUNT_SALT = 0x636E7421  # "cnt!": the noise of adaptive clipping's unclipped count
_CLIPPINGS = ("flat", "per_layer", "automatic", "automatic_per_layer")


class DPState(NamedTuple):
    """Everything a DP-SGD run carries from step to step (a pytree of tensors).

    Fields: ``params``, ``buffers`` (dicts keyed like ``named_parameters()`` /
    ``named_buffers()``), ``opt_state`` (torchopt), ``step`` (int64 0-d, logical steps
    taken) and ``key`` (int64 ``(2,)``, this step's noise key; each step replaces it by
    ``fold_in(key, "next")``; with ``secure_noise=True`` an int64 ``(8,)`` secret ChaCha20
    key that each step ratchets forward), both on the parameters' device; ``loss_scale``
    (:class:`LossScaleState`, ``amp='fp16'``) and ``skipped`` (int64 0-d, steps skipped for a
    non-finite loss or gradient), ``None`` in states built by hand; ``clip_norm`` (float64 0-d,
    the current threshold ``C_t`` of adaptive clipping, ``init_dp_state(max_grad_norm=C_0)``;
    ``None`` otherwise, and in states saved before the field existed).
    """

    params: TensorDict
    buffers: TensorDict
    opt_state: OptState
    step: Tensor
    key: Tensor
    loss_scale: LossScaleState | None = None
    skipped: Tensor | None = None
    clip_norm: Tensor | None = None


class ClippedSum(NamedTuple):
    """The clipped (not yet noised) gradient sum of one or more physical batches.

    Fields: ``grads`` (``sum_i coef_i grad_i``, like ``params``), ``count`` (number of
    valid examples), ``loss_sum`` (sum of their losses), ``clipped`` (valid examples -- or
    example-layer pairs with per-layer clipping -- whose gradient was scaled down),
    ``norm_sum`` (sum of their unclipped gradient norms); all float 0-d tensors. Two
    ``ClippedSum`` add up leaf by leaf (:meth:`DPTrainStep.add`).
    """

    grads: TensorDict
    count: Tensor
    loss_sum: Tensor
    clipped: Tensor
    norm_sum: Tensor


def _first(params: Mapping[str, Tensor]) -> Tensor:
    if not params:
        raise ValueError("DP-SGD: the model has no parameters")
    return next(iter(params.values()))


def _noisy_sums(gs: list[Tensor], zs: list[Tensor], std: float | Tensor,
                denom: float | Tensor) -> list[Tensor]:
    """Return ``[(g + std * z) / denom]`` over the leaves (same shapes and dtypes pairwise).

    As multi-tensor ops (``torch._foreach_*``: the same multiply, add and divide per element
    as the per-leaf loop) when the step is being compiled -- Inductor then lowers them to a few
    grouped kernels with the optimizer update fused in, where the per-leaf loop gives one
    kernel per leaf -- or in eager mode where :func:`_foreach_map` allows: in place there (one
    kernel per op and dtype group on CUDA, no memory beyond the noise), so ``zs`` (the noise:
    disjoint tensors the caller owns) may be overwritten with the results. The DP step's
    update part is never run under a ``torch.func`` transform, which the foreach ops do not
    support; otherwise the per-leaf loop."""
    scalars = [t for t in (std, denom) if isinstance(t, Tensor)]
    devices = {t.device for t in gs}
    if gs and len(devices) == 1 and all(t.ndim == 0 and t.device in devices for t in scalars):
        if torch.compiler.is_compiling() and _checks._USE_FOREACH:
            # out of place: in-place ops on the views of one noise draw would make
            # functionalization scatter each result back into it
            return torch._foreach_div(torch._foreach_add(gs, torch._foreach_mul(zs, std)),
                                      denom)

        def in_place(g: list[Tensor], z: list[Tensor]) -> tuple[list[Tensor]]:
            torch._foreach_mul_(z, std)
            torch._foreach_add_(z, g)  # std z + g: the same sum as g + std z
            torch._foreach_div_(z, denom)
            return (z,)

        res = _foreach_map(in_place, [gs, zs])
        if res is not None:
            return res[0]
    return [(g + std * z) / denom for g, z in zip(gs, zs, strict=True)]


def _noise_dtype(state: DPState, noised: list[str]) -> torch.dtype:
    """The dtype to draw the seeded noise in: the noised params' one dtype, else float64."""
    dtypes = {state.params[k].dtype for k in noised}
    return dtypes.pop() if len(dtypes) == 1 else torch.float64


def init_dp_state(
    params: TensorDict, buffers: TensorDict, optimizer: GradientTransformation, *,
    seed: int | None = None, trainable: Trainable | None = None, loss_scale: float = 2.0**16,
    max_grad_norm: float | None = None, secure_noise: bool = False,
) -> DPState:
    """Return the initial :class:`DPState` (``step`` = 0) with a noise key from ``seed``.

    ``seed`` (an int in ``[0, 2**63)``) determines all the noise of the run; keep it secret
    like any DP randomness. With ``secure_noise=True`` (for a step made with
    ``make_dp_train_step(..., secure_noise=True)``) there is no seed: ``state.key`` is a
    256-bit ChaCha20 key, int64 ``(8,)``, fresh from the OS CSPRNG (``secrets.token_bytes``)
    at every call. Then the state and its checkpoints hold a secret (whoever reads the key
    can regenerate the noise of the steps from there on: publish parameters, never the
    state); a resumed run still continues exactly; in a distributed run build it on one rank
    and broadcast ``state.key`` (``torch.distributed.broadcast(state.key, src=0)``) so every
    rank adds the same noise. Params/buffers are detached. The optimizer state covers the
    ``trainable`` params (a callable ``name -> bool`` or names; default all): pass
    ``ghost.trainable`` for a model with frozen params, so weight decay cannot reach them.
    ``loss_scale`` is the initial fp16 loss scale. ``max_grad_norm`` (needed by a step with
    ``adaptive_clipping``: pass the same ``C_0`` as to :func:`make_dp_train_step`) becomes the
    state's ``clip_norm``, the adaptive threshold (float64 0-d); ``None`` leaves it out.

    Example:
        >>> import torchopt
        >>> state = init_dp_state({"w": torch.zeros(3)}, {}, torchopt.sgd(0.1), seed=0)
        >>> int(state.step), state.key.shape
        (0, torch.Size([2]))
    """
    check_optimizer(optimizer, "init_dp_state")
    if secure_noise and seed is not None:
        raise ValueError(f"init_dp_state(seed={seed!r}, secure_noise=True): a secure noise key "
                         "comes from the OS CSPRNG, never from a seed; drop seed (it would not "
                         "be used)")
    if not secure_noise and seed is None:
        raise ValueError("init_dp_state(seed=None): pass seed=<int in [0, 2**63)> for the "
                         "seeded noise, or secure_noise=True for a key from the OS CSPRNG")
    params = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.detach() for k, v in buffers.items()}
    device = _first(params).device
    names = StepOptions(trainable=trainable, where="init_dp_state").trainable_names(params)
    return DPState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init({k: params[k] for k in names}),
        step=torch.zeros((), dtype=torch.int64, device=device),
        key=(secure_key(device) if secure_noise
             else fold_in(key_from_seed(seed, device), _NOISE_SALT)),
        loss_scale=LossScaleState(
            scale=torch.tensor(loss_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int64, device=device)),
        skipped=torch.zeros((), dtype=torch.int64, device=device),
        clip_norm=None if max_grad_norm is None else torch.tensor(
            _positive(max_grad_norm, "init_dp_state(max_grad_norm=...)"), dtype=torch.float64,
            device=device),
    )


def _positive(value: Any, what: str) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if not (ok and math.isfinite(value) and value > 0):
        raise ValueError(f"{what}: expected a finite number > 0, got {value!r}")
    return float(value)


def _layer_thresholds(ghost: GhostModel, max_grad_norm: float | Mapping[str, float],
                      clipping: str) -> tuple[dict[str, float] | None, float]:
    """Return ``(per-layer thresholds or None, total sensitivity C)``."""
    where = "make_dp_train_step"
    layers = list(ghost.clip_groups)  # one threshold per clipping group (tied layers: one)
    if clipping not in _CLIPPINGS:
        raise ValueError(f"{where}(clipping=...): expected one of {_CLIPPINGS}, got "
                         f"{clipping!r}")
    per_layer = clipping.endswith("per_layer")
    if isinstance(max_grad_norm, Mapping):
        if not per_layer:
            raise ValueError(f"{where}: a dict of max_grad_norm per layer needs "
                             "clipping='per_layer' or 'automatic_per_layer'")
        missing = [n for n in layers if n not in max_grad_norm]
        extra = [n for n in max_grad_norm if n not in layers]
        if missing or extra:
            raise ValueError(f"{where}(max_grad_norm=...): per-layer thresholds must name "
                             f"exactly the layers {layers} (ghost.clip_groups: layers tied by "
                             f"a shared parameter are one group); missing {missing}, unknown "
                             f"{extra}")
        thresholds = {n: float(max_grad_norm[n]) for n in layers}
    else:
        c = float(max_grad_norm)
        thresholds = ({n: c / math.sqrt(len(layers)) for n in layers}  # C_l = C / sqrt(L)
                      if per_layer else {"": c})
    if not all(math.isfinite(c) and c > 0 for c in thresholds.values()):
        raise ValueError(f"{where}(max_grad_norm=...): thresholds must be finite and > 0, got "
                         f"{max_grad_norm!r}")
    total = math.sqrt(sum(c * c for c in thresholds.values()))
    return (thresholds if per_layer else None), total


class DPTrainStep:
    """A DP-SGD step: ``step(state, batch, valid) -> (new_state, metrics)`` (pure).

    Built by :func:`make_dp_train_step`. Besides the one-physical-batch step it has
    :meth:`clipped_sum` + :meth:`add` + :meth:`apply` for a logical batch spanning several
    physical batches, :meth:`run` (picks the right path for a :class:`PoissonSampler` draw and
    steps an accountant) and :meth:`compile` (the same step with its three pure functions
    wrapped in ``torch.compile(fullgraph=True)``). Attributes: ``noise_multiplier``,
    ``sample_rate``, ``dataset_size``, ``expected_batch_size``, ``max_grad_norm`` (total
    sensitivity ``C``; with adaptive clipping the initial ``C_0``), ``layer_thresholds``
    (``{layer: C_l}`` or None), ``clipping``, ``automatic_gamma`` (``gamma`` of automatic
    clipping, else None), ``adaptive_clipping`` (the :class:`AdaptiveClipping` with its
    ``count_noise_multiplier`` filled in, or None), ``grad_noise_multiplier`` (the noise
    multiplier of the gradient: ``noise_multiplier``, or the raised ``sigma_grad`` of adaptive
    clipping) and ``noise_std`` (``grad_noise_multiplier * C``; adaptive: at ``C_0``, the step
    uses ``grad_noise_multiplier * state.clip_norm``).
    """

    #: Inductor options every compiled form of this step needs (see :meth:`compile`);
    #: :func:`torchfn.compile.make_graphed_step` applies them too.
    inductor_options: ClassVar[Mapping[str, Any]] = STEP_INDUCTOR_OPTIONS

    def __init__(self, ghost: GhostModel, loss_fn: LossFn, optimizer: GradientTransformation,
                 *, noise_multiplier: float, sample_rate: float, dataset_size: int,
                 thresholds: dict[str, float] | None, total: float,
                 options: StepOptions | None = None, clipping: str = "flat",
                 automatic_gamma: float | None = None,
                 adaptive_clipping: AdaptiveClipping | None = None, secure_noise: bool = False,
                 delta: float | None = None, epsilon_every: int = 1) -> None:
        self._ghost, self._loss_fn, self._optimizer = ghost, loss_fn, optimizer
        self._options = options if options is not None else StepOptions()
        self.noise_multiplier, self.sample_rate = noise_multiplier, sample_rate
        self.dataset_size = dataset_size
        self.expected_batch_size = sample_rate * dataset_size
        self.layer_thresholds, self.max_grad_norm = thresholds, total
        self.clipping, self.automatic_gamma = clipping, automatic_gamma
        self.adaptive_clipping = adaptive_clipping
        self.grad_noise_multiplier = noise_multiplier if adaptive_clipping is None else (
            adaptive_grad_noise_multiplier(noise_multiplier,
                                           float(adaptive_clipping.count_noise_multiplier)))
        self.noise_std = self.grad_noise_multiplier * total
        self.secure_noise, self.delta, self.epsilon_every = secure_noise, delta, epsilon_every
        self._call_fn: Callable[..., Any] = self._step
        self._sum_fn: Callable[..., Any] = self._clipped_sum
        self._apply_fn: Callable[..., Any] = self._apply

    # -- the three pure functions ------------------------------------------------------------

    def _clipped_sum(self, state: DPState, batch: tuple[Any, Any], valid: Tensor) -> ClippedSum:
        inputs, targets = _check_batch(batch)
        opts = self._options
        scale = state.loss_scale.scale if opts.fp16 and state.loss_scale is not None else None
        if opts.fp16 and scale is None:
            raise ValueError("DP-SGD step with amp='fp16': the state has no loss_scale; build "
                             "it with init_dp_state")
        loss_fn = self._loss_fn
        if opts.amp is not None:
            def loss_fn(outputs: Any, targets: Any) -> Tensor:  # per-sample losses, scaled
                losses = self._loss_fn(outputs, targets).float()
                return losses * scale if scale is not None else losses
        device_type = _first(state.params).device.type
        with opts.autocast(device_type), _part("torchfn.ghost_pass"):
            res = self._ghost.per_sample(state.params, state.buffers, inputs, targets,
                                         loss_fn, bookkeeping=True)
        check_buffers_unchanged(res.new_buffers, state.buffers)
        losses = res.losses.detach()
        # fp16: the per-sample losses were multiplied by the loss scale; unscale the norms
        # before clipping and fold 1 / scale into the clipping coefficients
        inv = 1.0 / scale if scale is not None else None
        if inv is not None:
            losses = losses * inv
        check_valid(valid, losses)
        with _part("torchfn.clipped_sum"):
            mask = valid.to(losses.dtype)
            if self.layer_thresholds is None:
                norm = res.grads.sq_norms().clamp_min(0).sqrt().to(mask.dtype)
                if inv is not None:
                    norm = norm * inv
                c = self._clip_norm(state)  # a float, or adaptive clipping's 0-d C_t
                coef = mask * clip_coefficients(norm, c, self.automatic_gamma)
                clipped = (mask * (norm > c).to(mask.dtype)).sum()
                grads = res.grads.weighted_sum(coef if inv is None else coef * inv)
            else:
                per_layer = res.grads.sq_norms(per_layer=True)
                assert isinstance(per_layer, dict)
                coefs, clipped, total_sq = {}, mask.new_zeros(()), mask.new_zeros(mask.shape)
                for name, c in self.layer_thresholds.items():
                    sq = per_layer[name].to(mask.dtype)
                    if inv is not None:
                        sq = sq * inv * inv
                    n = sq.clamp_min(0).sqrt()
                    coefs[name] = mask * clip_coefficients(n, c, self.automatic_gamma)
                    if inv is not None:
                        coefs[name] = coefs[name] * inv
                    clipped = clipped + (mask * (n > c).to(mask.dtype)).sum()
                    total_sq = total_sq + sq
                norm = total_sq.clamp_min(0).sqrt()
                grads = res.grads.weighted_sum(coefs)
        return ClippedSum(grads=grads, count=mask.sum(), loss_sum=(losses * mask).sum(),
                          clipped=clipped, norm_sum=(norm * mask).sum())

    def _apply(self, state: DPState, total: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        grads, noised = self._noisy(state, total.grads)
        return self._update(state, grads, noised, total)

    def _noisy(self, state: DPState, sums: Mapping[str, Tensor],
               noise_slices: Mapping[str, tuple[int, int, int, int]] | None = None,
               ) -> tuple[TensorDict, list[str]]:
        """Return ``({name: (sum + noise) / (q N)}, noised names)`` for the trainable params.

        With adaptive clipping's ``normalize_update`` the divisor is ``q N C_t``.

        ``noise_slices`` (the sharded step): ``{name: (numel, start, length, size)}`` -- the
        param's full element count, where this shard starts in its flattened elements, how
        many of them are real and the padded shard length. Each shard then adds exactly its
        part of the one flat draw over the full params (:func:`normal_slice`), zero on padding,
        so the shards together equal the unsharded noise bit for bit."""
        frozen = set(self._ghost.frozen)
        names = self._options.trainable_names(state.params, frozen)
        noised = [k for k in sums if k in names]
        clip_norm = self._clip_norm(state)
        noise_std = self.noise_std if self.adaptive_clipping is None else (
            self.grad_noise_multiplier * clip_norm)  # sigma_grad * C_t (0-d)
        # the divisor: q N, or q N C_t for adaptive clipping's normalize_update
        denom = self.expected_batch_size
        if self.adaptive_clipping is not None and self.adaptive_clipping.normalize_update:
            denom = self.expected_batch_size * clip_norm
        with _part("torchfn.noise"):
            self._check_key(state.key)
            if noise_slices is not None:
                if self.secure_noise:
                    raise ValueError("DP-SGD step: sharded noise slices need the seeded noise "
                                     "(secure_noise=False)")
                flat = self._noise_slices(state, noised, noise_slices)
            elif self.secure_noise:  # ChaCha20; g + noise in float64, rounded once
                sizes = [sums[k].numel() for k in noised]
                flat = list(secure_normal(state.key, sum(sizes), state.step).split(sizes))
            else:
                sizes = [sums[k].numel() for k in noised]
                # drawn in the params' dtype when they share one: float64 math rounded once
                # (the same values as a float64 draw cast per leaf), and a compiled graph
                # writes and reads only that dtype
                flat = list(normal(state.key, (sum(sizes),), _noise_dtype(state, noised))
                            .split(sizes))
            gs = [sums[name].to(state.params[name].dtype) for name in noised]
            if self.secure_noise:
                outs = [((g.to(torch.float64) + noise_std * z.reshape(g.shape)) / denom)
                        .to(g.dtype) for g, z in zip(gs, flat, strict=True)]
            else:
                zs = [z.reshape(g.shape).to(g.dtype) for g, z in zip(gs, flat, strict=True)]
                outs = _noisy_sums(gs, zs, noise_std, denom)
        return dict(zip(noised, outs, strict=True)), noised

    def _noise_slices(self, state: DPState, noised: list[str],
                      slices: Mapping[str, tuple[int, int, int, int]]) -> list[Tensor]:
        missing = [k for k in noised if k not in slices]
        if missing:
            raise ValueError(f"DP-SGD step: noise_slices lack the params {missing}")
        n = sum(slices[k][0] for k in noised)
        # the pairs covering every param's shard, hashed together over groups of params of
        # up to _NOISE_GROUP elements: one pass of the ~90 elementwise ops per group instead of
        # per param (a step of many params is otherwise bound by the host launching them); a
        # bigger param goes alone, so the peak memory is that of the largest param's draw
        groups: list[list[str]] = []
        starts, offset, filled = {}, 0, 0
        for k in noised:
            numel, start, length, _ = slices[k]
            starts[k] = offset + start
            offset += numel
            if not groups or filled + length > _NOISE_GROUP:
                groups.append([])
                filled = 0
            groups[-1].append(k)
            filled += length
        out = []
        dtype = _noise_dtype(state, noised)
        for group in groups:
            parts = _normal_ranges(state.key, n, [(starts[k], slices[k][2]) for k in group],
                                   dtype)
            for k, part in zip(group, parts, strict=True):
                _, _, length, size = slices[k]
                out.append(torch.nn.functional.pad(part, (0, size - length)))
        return out

    def _update(self, state: DPState, grads: TensorDict, noised: list[str], total: ClippedSum,
                finite: Tensor | None = None, apply: Callable[..., Any] | None = None,
                ) -> tuple[DPState, dict[str, Tensor]]:
        """Apply the noisy ``grads`` through the step core; ``total``'s counts give the metrics.

        ``finite`` (a 0-d bool, the sharded step): whether the WHOLE noisy gradient and loss
        are finite; the core's guard sees only this shard, so a global ``False`` reaches it as
        a NaN loss and every rank skips alike. ``apply`` (the sharded step's donated update)
        replaces :func:`apply_gradients`, called with the same arguments."""
        clip_norm = self._clip_norm(state)
        denom = torch.clamp(total.count, min=1.0)
        loss = total.loss_sum / denom
        guard_loss = loss if finite is None else torch.where(
            finite, loss, torch.full_like(loss, float("nan")))
        kw: dict[str, Tensor] = {}
        if apply is None and finite is None:
            # finite per-sample norms (norm_sum: every sample, padding included, as 0 * nan is
            # nan) bound every clipped per-sample gradient, so the clipped sum plus the finite
            # noise is finite: the guard needs no pass over the noisy gradient
            witness = torch.isfinite(total.norm_sum)
            if isinstance(clip_norm, Tensor):
                witness = witness & torch.isfinite(clip_norm)
            kw["grads_finite"] = witness
        # the clipped sum is unscaled already (per sample, before clipping): no second unscale
        with _part("torchfn.apply_gradients"):
            new_state, core = (apply or apply_gradients)(self._optimizer, grads, state,
                                              options=self._options, trainable=noised,
                                              loss=guard_loss, unscale=False,
                                              where="DP-SGD step", **kw)
        n_layers = len(self.layer_thresholds) if self.layer_thresholds is not None else 1
        metrics = {
            "loss": loss,
            "batch_size": total.count,
            "clip_fraction": total.clipped / (denom * n_layers),
            "grad_norm_mean": total.norm_sum / denom,
        }
        metrics.update({k: v for k, v in core.items() if k in ("skipped", "loss_scale", "lr")})
        next_key = (next_secure_key(state.key, state.step) if self.secure_noise
                    else fold_in(state.key, _NEXT_SALT))
        changes: dict[str, Tensor] = {"key": next_key}
        if self.adaptive_clipping is not None:
            assert isinstance(clip_norm, Tensor)
            changes["clip_norm"], metrics["unclipped_fraction"] = self._next_clip_norm(
                state, total, clip_norm, core.get("skipped"))
            metrics["max_grad_norm"] = clip_norm
        return _replace(new_state, **changes), metrics

    def _clip_norm(self, state: DPState) -> float | Tensor:
        """Return this step's threshold: the fixed ``C``, or adaptive clipping's ``state.clip_norm``."""
        if self.adaptive_clipping is None:
            return self.max_grad_norm
        if getattr(state, "clip_norm", None) is None:
            raise ValueError(
                "DP-SGD step with adaptive_clipping: the state has no clip_norm (the adaptive "
                f"threshold C_t); build it with init_dp_state(..., max_grad_norm="
                f"{self.max_grad_norm:g})")
        return state.clip_norm

    def _next_clip_norm(self, state: DPState, total: ClippedSum, clip_norm: Tensor,
                        skipped: Tensor | None) -> tuple[Tensor, Tensor]:
        """Return ``(C_{t+1}, b_t)``: the geometric quantile update from the noisy count."""
        adaptive = self.adaptive_clipping
        assert adaptive is not None and adaptive.count_noise_multiplier is not None
        # flat clipping: ``clipped`` counts the valid examples with norm > C_t
        if self.secure_noise:  # the key's own ChaCha20 stream for the count
            z = secure_normal(state.key, 1, state.step, stream=2)[0]
        else:
            z = normal(fold_in(state.key, _COUNT_SALT), (1,), torch.float64)[0]
        new, frac = next_clip_norm(clip_norm, total.count - total.clipped, total.count, z,
                                   settings=adaptive,
                                   count_noise=float(adaptive.count_noise_multiplier),
                                   expected_batch_size=self.expected_batch_size,
                                   step=state.step)
        if skipped is not None:  # a skipped (non-finite) step keeps its threshold too
            new = torch.where(skipped, clip_norm, new)
        return new, frac

    def _check_key(self, key: Tensor) -> None:
        want = (8,) if self.secure_noise else (2,)
        if tuple(key.shape) != want:
            made = "secure_noise=True" if self.secure_noise else "seed=..."
            raise ValueError(
                f"DP-SGD step (secure_noise={self.secure_noise}): state.key must have shape "
                f"{want}, got {tuple(key.shape)}; build the state with init_dp_state(..., "
                f"{made}) to match make_dp_train_step(..., secure_noise={self.secure_noise})")

    def _step(self, state: DPState, batch: tuple[Any, Any],
              valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        return self._apply(state, self._clipped_sum(state, batch, valid))

    # -- public surface ----------------------------------------------------------------------

    def __call__(self, state: DPState, batch: tuple[Any, Any],
                 valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        """Return ``(new_state, metrics)`` for a logical batch held in ONE physical batch.

        ``batch = (inputs, targets)`` with batch dim 0 of size ``P``; ``inputs`` is a tensor, a
        tuple (the module's one positional argument) or a dict of keyword inputs (HF style:
        ``module(**inputs)``), every tensor in it with the batch (or 1, shared by the batch) in
        dim 0; ``valid`` is ``(P,)``
        bool (False for padding). ``metrics`` (0-d tensors): ``loss`` (mean over valid
        examples), ``batch_size`` (valid count), ``clip_fraction``, ``grad_norm_mean``
        (mean unclipped per-sample norm); with adaptive clipping also ``max_grad_norm`` (the
        ``C_t`` clipped to) and ``unclipped_fraction`` (the noisy ``b_t``).
        """
        check_state_type(state, DPState, "DP-SGD step(state, batch, valid)", "init_dp_state")
        return self._call_fn(state, batch, valid)

    def clipped_sum(self, state: DPState, batch: tuple[Any, Any], valid: Tensor) -> ClippedSum:
        """Return the :class:`ClippedSum` of one physical batch (no noise, no update)."""
        return self._sum_fn(state, batch, valid)

    def apply(self, state: DPState, total: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        """Add the noise to ``total``, divide by ``q N``, update: ``(new_state, metrics)``."""
        return self._apply_fn(state, total)

    @staticmethod
    def add(a: ClippedSum, b: ClippedSum) -> ClippedSum:
        """Return the leaf-by-leaf sum of two :class:`ClippedSum` (physical batches of a step)."""
        return ClippedSum(grads={k: a.grads[k] + b.grads[k] for k in a.grads},
                          count=a.count + b.count, loss_sum=a.loss_sum + b.loss_sum,
                          clipped=a.clipped + b.clipped, norm_sum=a.norm_sum + b.norm_sum)

    def compile(self, **kwargs: Any) -> DPTrainStep:
        """Return a copy whose step, clipped_sum and apply are ``torch.compile(fullgraph=True)``.

        ``kwargs`` go to ``torch.compile``. Unless ``options``, ``mode`` or a backend other than
        Inductor is given, Inductor's buffer reuse is switched off (:attr:`inductor_options`, as
        for every torchfn step): on CUDA (torch 2.11) a reused buffer can be a CPU tensor at run
        time (the philox outputs of memory-efficient attention), and the fused step of a 4-layer
        transformer then failed at launch with "CUDA driver error: invalid argument". Without
        reuse the step runs, equals eager, and was not slower in the benchmarks.
        """
        new = DPTrainStep.__new__(DPTrainStep)
        new.__dict__.update(self.__dict__)
        kwargs = _compile_kwargs(kwargs, self.inductor_options)
        new._call_fn = torch.compile(self._step, **kwargs)
        new._sum_fn = torch.compile(self._clipped_sum, **kwargs)
        new._apply_fn = torch.compile(self._apply, **kwargs)
        return new

    def run(self, state: DPState, chunks: Sequence[tuple[Tensor, Tensor]],
            get_batch: Callable[[Tensor], tuple[Any, Any]],
            accountant: RDPAccountant | PLDAccountant | PRVAccountant | None = None,
            ) -> tuple[DPState, dict[str, Any]]:
        """Take one logical step on a :meth:`PoissonSampler.sample` draw; step ``accountant``
        (an :class:`RDPAccountant` or a :class:`PLDAccountant`), if given, and report its
        epsilon.

        ``get_batch(indices)`` returns ``(inputs, targets)`` for the ``(P,)`` indices (e.g.
        ``lambda i: (X[i], Y[i])``). One chunk uses the fused step; several use
        ``clipped_sum`` per chunk, :meth:`add` and ``apply`` (the same result). Host-side
        driver: call it eagerly (after :meth:`compile` for speed). ``metrics`` are the step's
        0-d tensors plus, with an accountant and ``make_dp_train_step(..., delta=...)``,
        ``"epsilon"``: a Python float, ``accountant.get_epsilon(delta)`` after this step
        (every ``epsilon_every``-th accounted step; see :meth:`account`).

        Example::

            >>> import torchopt
            >>> from torch import nn
            >>> import torch.nn.functional as F
            >>> from torchfn.persample import PoissonSampler, RDPAccountant, make_ghost_model
            >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 2))
            >>> X, Y = torch.randn(100, 4), torch.randint(0, 2, (100,))
            >>> loss_fn = lambda o, y: F.cross_entropy(o, y, reduction="none")
            >>> opt = torchopt.sgd(0.1)
            >>> step = make_dp_train_step(ghost, loss_fn, opt, noise_multiplier=1.0,
            ...                           max_grad_norm=1.0, sample_rate=0.1, dataset_size=100,
            ...                           delta=1e-5)
            >>> sampler = PoissonSampler(100, 0.1, 24, seed=0)
            >>> state, acct = init_dp_state(params, buffers, opt, seed=1), RDPAccountant()
            >>> state, metrics = step.run(state, sampler.sample(0), lambda i: (X[i], Y[i]), acct)
            >>> int(state.step), acct.history
            (1, ((1.0, 0.1, 1),))
            >>> metrics["epsilon"] == acct.get_epsilon(1e-5)
            True
        """
        if not chunks:
            raise ValueError("DPTrainStep.run: chunks is empty; pass PoissonSampler.sample(step)")
        state, metrics = run_chunks(self, self.clipped_sum, self.apply, state, chunks, get_batch)
        if accountant is not None:
            metrics = {**metrics, **self.account(accountant)}
        return state, metrics

    def account(self, accountant: RDPAccountant | PLDAccountant) -> dict[str, float]:
        """Record one logical step in ``accountant``; return ``{"epsilon": eps}`` when due, else ``{}``.

        Steps ``accountant`` with this step's ``noise_multiplier`` and ``sample_rate``. With
        ``delta`` set (``make_dp_train_step(..., delta=...)``) and the accountant's total
        number of recorded steps a multiple of ``epsilon_every``, ``eps`` is
        ``accountant.get_epsilon(delta)``, a Python float computed on the host (nothing
        inside the compiled step). Cost per evaluation, CPU: about 2 ms for
        :class:`RDPAccountant`, about 0.3 s for :class:`PLDAccountant` (one PLD composition;
        use ``epsilon_every`` of 100 or so with PLD). :meth:`run` calls it; call it yourself
        when driving :meth:`clipped_sum` / :meth:`apply` by hand.

        Example:
            >>> from torch import nn
            >>> import torchopt
            >>> from torchfn.persample import RDPAccountant, make_ghost_model
            >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 2))
            >>> step = make_dp_train_step(ghost, lambda o, y: (o - y).square().sum(1),
            ...                           torchopt.sgd(0.1), noise_multiplier=1.0,
            ...                           max_grad_norm=1.0, sample_rate=0.1, dataset_size=100,
            ...                           delta=1e-5, epsilon_every=2)
            >>> acct = RDPAccountant()
            >>> step.account(acct), sorted(step.account(acct))
            ({}, ['epsilon'])
        """
        accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        if self.delta is None:
            return {}
        recorded = sum(entry[2] for entry in accountant.history)
        if recorded % self.epsilon_every:
            return {}
        return {"epsilon": float(accountant.get_epsilon(self.delta))}


def check_buffers_unchanged(new_buffers: Mapping[str, Tensor],
                            buffers: Mapping[str, Tensor]) -> None:
    """Raise ``ValueError`` naming a buffer the forward replaced: statistics computed from the
    private batch (BatchNorm's running stats) would escape the privacy analysis."""
    for k, v in new_buffers.items():
        if v is not buffers[k]:
            raise ValueError(
                f"DP-SGD step: the forward updated buffer {k!r}; buffers computed from the "
                "private data (BatchNorm running statistics, ...) would escape the privacy "
                "analysis. Use layers without data-dependent buffers, or eval() for them"
            )


def check_valid(valid: Tensor, losses: Tensor) -> None:
    """Raise unless ``valid`` is a ``torch.bool`` tensor of the ``(B,)`` shape of the per-sample
    losses. Bool only: the mask weights each clipped gradient by 0 or 1, so integer indices or
    float weights passed here would change the sensitivity the noise is calibrated to."""
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        what = (f"a tensor of dtype {valid.dtype}" if isinstance(valid, Tensor)
                else type(valid).__name__)
        raise TypeError(
            f"DP-SGD step: valid must be a torch.bool tensor (True for the real examples of "
            f"the batch, False for padding), got {what}; a mask from indices is e.g. "
            f"torch.zeros(B, dtype=torch.bool).index_fill_(0, idx, True)")
    if valid.shape != losses.shape:
        raise ValueError(f"DP-SGD step: valid must have shape {tuple(losses.shape)} (one "
                         f"flag per example of the batch), got {tuple(valid.shape)}")


def _check_batch(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"DP-SGD step(state, batch, valid): batch must be a pair (inputs, "
                        f"targets), got {type(batch).__name__}")
    return batch[0], batch[1]


def make_dp_train_step(
    ghost: GhostModel,
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    *,
    noise_multiplier: float,
    max_grad_norm: float | Mapping[str, float],
    sample_rate: float,
    dataset_size: int,
    clipping: str = "flat",
    amp: str | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    lr_schedule: float | Schedule | None = None,
    trainable: Trainable | None = None,
    skip_nonfinite: bool = True,
    automatic_gamma: float | None = None,
    adaptive_clipping: AdaptiveClipping | None = None,
    secure_noise: bool = False,
    delta: float | None = None,
    epsilon_every: int = 1,
) -> DPTrainStep:
    """Return a pure DP-SGD step (:class:`DPTrainStep`): ghost clipping, seeded noise, update.

    ``ghost`` comes from :func:`make_ghost_model`; ``loss_fn(outputs, targets)`` returns the
    ``(B,)`` per-sample losses; ``optimizer`` is any torchopt GradientTransformation (it
    receives the noisy averaged gradient). ``noise_multiplier`` is sigma; ``sample_rate`` q
    and ``dataset_size`` N give the expected batch size ``q N`` that the noisy sum is divided
    by (sample with a :class:`PoissonSampler` of the same q and N). ``clipping="flat"`` clips
    each example's whole gradient to ``max_grad_norm``; ``"per_layer"`` clips each layer's
    part to its own threshold: a dict ``{layer_name: C_l}`` (the keys of
    ``ghost.clip_groups``: ``ghost.layer_names``, with the layers that share a tied parameter
    as one group named after its first layer), or one float ``C`` split evenly as
    ``C / sqrt(L)`` over those ``L`` groups; the noise std is then
    ``noise_multiplier * sqrt(sum_l C_l^2)``, so the accountant sees the same sigma.

    Other clipping rules (:mod:`torchfn.persample._dp_clipping`, ``docs/dp_clipping.md``):

    - ``clipping="automatic"`` / ``"automatic_per_layer"`` (Bu et al. 2022): each example's
      gradient (or layer part) is scaled by ``C / (||g_i|| + gamma)`` instead of
      ``min(1, C / ||g_i||)``: normalised, so the sensitivity is still ``C`` (``C_l``) and the
      noise unchanged; ``automatic_gamma`` is ``gamma`` (default 0.01, > 0; only with these
      modes). ``C`` then just scales the update like a learning rate.
    - ``adaptive_clipping=AdaptiveClipping(target_quantile, learning_rate,
      count_noise_multiplier)`` (Andrew et al. 2021; flat fixed clipping only): the threshold
      ``C_t`` lives in the state (``state.clip_norm``, started at ``max_grad_norm`` by
      ``init_dp_state(..., max_grad_norm=C_0)``) and follows the ``target_quantile`` of the
      per-sample norms through a noisy count of unclipped examples; the gradient noise
      multiplier is raised to ``sigma_grad`` (:func:`adaptive_grad_noise_multiplier`) so that
      gradient and count together cost ``noise_multiplier`` -- the sigma the accountant is
      stepped with. ``AdaptiveClipping(normalize_update=True)`` divides the noisy clipped mean
      by ``C_t`` as well (post-processing, no privacy cost), so the update no longer grows with
      ``C_t`` at a fixed learning rate. Adds ``metrics["max_grad_norm"]`` (the ``C_t`` this
      step clipped to) and
      ``metrics["unclipped_fraction"]`` (the noisy ``b_t``). ``C_t`` is a 0-d tensor, so the
      compiled step does not recompile as it moves.

    The shared step features (:class:`StepOptions`, applied by :func:`apply_gradients`):
    frozen params (``ghost.frozen``, and an optional ``trainable`` filter) get no noise and no
    update -- build the state with ``init_dp_state(..., trainable=ghost.trainable)`` so weight
    decay cannot reach them either (params left out only by ``trainable`` still count in the
    per-sample norms, which is conservative for privacy; freeze them in the module,
    ``requires_grad=False``, to leave them out of the norms and the backward too); ``amp='bf16'`` runs the ghost forward/backward under
    autocast; ``amp='fp16'`` also multiplies the per-sample losses by the dynamic loss scale
    (``state.loss_scale``) and unscales the per-sample norms before clipping;
    ``lr_schedule`` adds ``metrics["lr"]``; ``skip_nonfinite`` (default on) skips a step
    whose loss or noisy gradient is not finite (state kept, ``metrics["skipped"]``,
    ``state.skipped``). Accumulation is the physical batches (:meth:`DPTrainStep.clipped_sum`
    + :meth:`DPTrainStep.add` + :meth:`DPTrainStep.apply`). Per-sample clipping to
    ``max_grad_norm`` is DP-SGD's own clipping; the noisy mean is not clipped again (no
    global-norm or value clipping after the noise).

    ``secure_noise=True`` draws the Gaussian noise from ChaCha20 (RFC 8439) under a secret
    256-bit key from the OS CSPRNG instead of the seeded counter-based hash (like Opacus'
    ``secure_mode``): build the state with ``init_dp_state(..., secure_noise=True)`` (no
    seed). Each output is the sum of four Box-Muller normals with 53-bit uniforms over 2,
    added to the gradient in float64 (Holohan and Braghin's mitigation of Mironov's
    floating-point attack, not a proof against it); the key lives in ``state.key`` and is
    ratcheted forward every step, so the state is a secret, resuming is exact and compiled
    equals eager. It costs 8 ChaCha20 words per parameter and step: on one CPU thread about
    1 us per parameter, tens of times the default noise (``benchmarks/secure_noise.py``),
    and a longer first compile; the Poisson sampling is
    not covered (keep the sampler's seed secret). The full account of what is and is not
    protected is in ``torchfn.persample._dp_secure``.

    ``delta`` (in ``(0, 1)``) makes :meth:`DPTrainStep.run` report ``metrics["epsilon"]``:
    ``accountant.get_epsilon(delta)`` computed on the host after stepping the accountant,
    every ``epsilon_every``-th accounted step (:meth:`DPTrainStep.account`).

    The step never syncs with the host and keeps every shape static, so
    ``torch.compile(step, fullgraph=True)`` (or :meth:`DPTrainStep.compile`) traces it once
    and does not recompile as ``state.step`` advances. Account privacy outside it: one
    ``RDPAccountant.step(noise_multiplier=sigma, sample_rate=q)`` per logical step
    (:meth:`DPTrainStep.run` does it).

    Example::

        >>> import torchopt
        >>> from torch import nn
        >>> import torch.nn.functional as F
        >>> from torchfn.persample import make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 2))
        >>> loss_fn = lambda o, y: F.cross_entropy(o, y, reduction="none")
        >>> opt = torchopt.sgd(0.5)
        >>> step = make_dp_train_step(ghost, loss_fn, opt, noise_multiplier=1.1,
        ...                           max_grad_norm=1.0, sample_rate=0.01, dataset_size=6400)
        >>> state = init_dp_state(params, buffers, opt, seed=0)
        >>> x, y, valid = torch.randn(96, 4), torch.randint(0, 2, (96,)), torch.rand(96) < 0.7
        >>> state, metrics = step(state, (x, y), valid)
        >>> sorted(metrics)
        ['batch_size', 'clip_fraction', 'grad_norm_mean', 'loss', 'skipped']
        >>> adaptive = make_dp_train_step(
        ...     ghost, loss_fn, opt, noise_multiplier=1.1, max_grad_norm=1.0, sample_rate=0.01,
        ...     dataset_size=6400, adaptive_clipping=AdaptiveClipping(target_quantile=0.5))
        >>> state = init_dp_state(params, buffers, opt, seed=0, max_grad_norm=1.0)  # C_0
        >>> state, metrics = adaptive(state, (x, y), valid)
        >>> float(metrics["max_grad_norm"]), state.clip_norm.shape  # C_0, then C_1 (0-d)
        (1.0, torch.Size([]))
    """
    where = "make_dp_train_step"
    check_optimizer(optimizer, where)
    options = StepOptions(trainable=trainable, amp=amp, loss_scaler=loss_scaler,
                          lr_schedule=lr_schedule, skip_nonfinite=skip_nonfinite, where=where)
    if not isinstance(ghost, GhostModel):
        raise TypeError(f"{where}(ghost, ...): expected a GhostModel from "
                        f"make_ghost_model(module), got {type(ghost).__name__}")
    sigma = float(noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"{where}(noise_multiplier=...): expected a finite number >= 0, got "
                         f"{noise_multiplier!r}")
    q = float(sample_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"{where}(sample_rate=...): expected a probability in (0, 1], got "
                         f"{sample_rate!r}")
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
        raise ValueError(f"{where}(dataset_size=...): expected an int >= 1, got "
                         f"{dataset_size!r}")
    thresholds, total = _layer_thresholds(ghost, max_grad_norm, clipping)
    gamma = _check_gamma(automatic_gamma, clipping)
    adaptive = _check_adaptive(adaptive_clipping, clipping, sigma, q * dataset_size)
    if not isinstance(secure_noise, bool):
        raise TypeError(f"{where}(secure_noise=...): expected True or False, got "
                        f"{secure_noise!r}")
    if delta is not None:
        delta = _check_delta(delta, f"{where}(delta=...)")
    if isinstance(epsilon_every, bool) or not isinstance(epsilon_every, int) or epsilon_every < 1:
        raise ValueError(f"{where}(epsilon_every=...): expected an int >= 1 (report epsilon "
                         f"every that many steps), got {epsilon_every!r}")
    return DPTrainStep(ghost, loss_fn, optimizer, noise_multiplier=sigma, sample_rate=q,
                       dataset_size=dataset_size, thresholds=thresholds, total=total,
                       options=options, clipping=clipping, automatic_gamma=gamma,
                       adaptive_clipping=adaptive, secure_noise=secure_noise, delta=delta,
                       epsilon_every=epsilon_every)


def _check_gamma(automatic_gamma: float | None, clipping: str) -> float | None:
    """Return ``gamma`` for automatic clipping (default 0.01), None for fixed clipping."""
    where = "make_dp_train_step"
    if not clipping.startswith("automatic"):
        if automatic_gamma is not None:
            raise ValueError(f"{where}(automatic_gamma=...): gamma is the stability constant of "
                             f"automatic clipping; it needs clipping='automatic' or "
                             f"'automatic_per_layer', got clipping={clipping!r}")
        return None
    if automatic_gamma is None:
        return AUTOMATIC_GAMMA
    return _positive(automatic_gamma, f"{where}(automatic_gamma=...)")


# The default count noise is at least 3.5 sigma: the count then costs the gradient noise at most
# a factor (1 - (1 / 7)^2)^-1/2 = 1.0104; Andrew et al.'s expected batch / 20 alone costs 7.9%
# at sigma 4.82 (epsilon 1 on digits), which is where adaptive clipping fell behind the fixed clip.
_COUNT_NOISE_PER_SIGMA = 3.5


def _check_adaptive(adaptive: AdaptiveClipping | None, clipping: str, sigma: float,
                    expected_batch_size: float) -> AdaptiveClipping | None:
    """Return ``adaptive`` with its count noise filled in (``max(expected batch / 20, 3.5 sigma)``),
    checked."""
    where = "make_dp_train_step(adaptive_clipping=...)"
    if adaptive is None:
        return None
    if not isinstance(adaptive, AdaptiveClipping):
        raise TypeError(f"{where}: expected an AdaptiveClipping(target_quantile=..., "
                        f"learning_rate=..., count_noise_multiplier=...), got "
                        f"{type(adaptive).__name__}")
    if clipping.startswith("automatic"):
        raise ValueError(
            f"{where}: adaptive quantile clipping needs clipping='flat', got {clipping!r}. "
            "Automatic clipping scales every example by C / (||g|| + gamma), so C is only a "
            "learning-rate factor and there is no clipped fraction to steer; use a fixed "
            "max_grad_norm with automatic clipping")
    if clipping != "flat":
        raise ValueError(
            f"{where}: adaptive quantile clipping adapts one flat threshold, got "
            f"clipping={clipping!r}. Per-layer thresholds would each need their own noisy count "
            "(and privacy budget), which is not implemented; use clipping='flat'")
    sb = adaptive.count_noise_multiplier
    default = ""
    if sb is None:
        sb = max(expected_batch_size / 20.0, _COUNT_NOISE_PER_SIGMA * sigma)
        default = " (the default, max(expected batch size / 20, 3.5 noise_multiplier))"
        adaptive = dataclasses.replace(adaptive, count_noise_multiplier=sb)
    if sigma > 0 and not sb > sigma / 2.0:  # sigma_grad^-2 = sigma^-2 - (2 sb)^-2 > 0
        raise ValueError(
            f"{where}: count_noise_multiplier must be > noise_multiplier / 2 = "
            f"{sigma / 2.0:.4g}, got {sb:.4g}{default}: the noisy count would spend the whole "
            f"privacy budget of noise_multiplier={sigma:g}. Raise count_noise_multiplier (or the "
            "expected batch size), or lower noise_multiplier")
    return adaptive


def run_chunks(one_step: Callable[..., tuple[DPState, dict[str, Tensor]]],
               clipped_sum: Callable[..., ClippedSum],
               apply: Callable[[DPState, ClippedSum], tuple[DPState, dict[str, Tensor]]],
               state: DPState, chunks: Sequence[tuple[Tensor, Tensor]],
               get_batch: Callable[[Tensor], tuple[Any, Any]]
               ) -> tuple[DPState, dict[str, Tensor]]:
    """One logical DP step over physical ``chunks`` of ``(indices, valid)``: the fused
    ``one_step(state, batch, valid)`` for a single chunk, else ``clipped_sum`` per chunk, summed
    with :meth:`DPTrainStep.add`, then ``apply`` (the same result). Shared by
    :meth:`DPTrainStep.run` and the distributed step."""
    device = state.step.device
    if len(chunks) == 1:
        idx, valid = chunks[0]
        return one_step(state, get_batch(idx.to(device)), valid.to(device))
    total = None
    for idx, valid in chunks:
        part = clipped_sum(state, get_batch(idx.to(device)), valid.to(device))
        total = part if total is None else DPTrainStep.add(total, part)
    assert total is not None
    return apply(state, total)
