"""Batch normalization written from elementary ops, safe under nested ``torch.func`` transforms.

Why not ``nn.BatchNorm*``: under ``vmap`` + second-order gradients (MAML-style
``grad(vmap(grad(...)))``) torch's fused batch-norm kernels give wrong meta-gradients
(measured on torch 2.13 CPU, float64: ~5e-3 relative error in the meta-gradient, see
``tests/test_batchnorm.py``), and their in-place running-stat updates cannot run
under ``vmap`` with unbatched buffers. :func:`functional_batch_norm` uses only ``mean``,
``var`` and arithmetic, whose batching and double-backward rules are exact, and returns
new running statistics instead of writing into the old ones.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from torchfn.functional._swap import restore_modules_, swap_modules_

__all__ = ["BatchNorm", "functional_batch_norm", "replace_batchnorm"]

_TORCH_BATCHNORMS: dict[type[nn.Module], int] = {
    nn.BatchNorm1d: 1,
    nn.BatchNorm2d: 2,
    nn.BatchNorm3d: 3,
}
_TORCH_BY_DIM: dict[int, type[nn.Module]] = {v: k for k, v in _TORCH_BATCHNORMS.items()}
_INPUT_NDIMS: dict[int, tuple[int, ...]] = {1: (2, 3), 2: (4,), 3: (5,)}


def functional_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    training: bool,
    momentum: float | None,
    eps: float,
    num_batches_tracked: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Return ``(y, new_running_mean, new_running_var, new_num_batches_tracked)``, y shaped like x.

    ``x`` is ``(N, C, *spatial)`` (``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``, ...); the
    statistics are per channel ``C``, reduced over every other dim. Semantics follow
    ``torch.nn.functional.batch_norm`` plus ``nn.BatchNorm``'s ``num_batches_tracked``:

    - batch statistics are used when ``training`` is true or ``running_mean`` is ``None``;
      otherwise ``running_mean``/``running_var`` normalize.
    - when ``training`` and running statistics are given, new ones are returned:
      ``(1 - m) * running + m * batch`` with the *unbiased* batch variance, where
      ``m = momentum``, or ``m = 1 / new_num_batches_tracked`` (cumulative average) when
      ``momentum is None``. ``num_batches_tracked`` (if given) comes back incremented.
      The batch statistics enter the running ones detached, as in torch (no gradient flows
      into running statistics). New statistics keep the dtype of the old ones.
    - otherwise the given running tensors come back unchanged (the same objects).

    Nothing is written in place, so it runs under ``vmap`` with batched or unbatched
    running statistics, ``grad``, ``grad`` of ``grad`` and ``torch.compile(fullgraph=True)``.
    ``weight``/``bias`` may be ``None`` (``affine=False``).

    Per-sample use is refused: batch statistics (``training``, or no running statistics) of an
    ``x`` with ``N == 1`` under ``vmap`` (eagerly; what ``per_sample_grads`` over
    ``single_sample_fn`` does) would normalise every sample by itself, so ``ValueError`` is
    raised; eval mode with running statistics works under any ``vmap``.

    Example::

        >>> x = torch.randn(8, 3, 5, 5)
        >>> rm, rv = torch.zeros(3), torch.ones(3)
        >>> y, rm2, rv2, _ = functional_batch_norm(
        ...     x, rm, rv, torch.ones(3), torch.zeros(3), training=True, momentum=0.1, eps=1e-5)
        >>> y.shape, rm2.shape
        (torch.Size([8, 3, 5, 5]), torch.Size([3]))
    """
    if x.dim() < 2:
        raise ValueError(
            f"functional_batch_norm(x, ...): expected x of shape (N, C, *spatial) with at least "
            f"2 dims, got shape {tuple(x.shape)}"
        )
    if (running_mean is None) != (running_var is None):
        raise ValueError(
            "functional_batch_norm(...): running_mean and running_var must both be tensors or "
            f"both None, got running_mean={_kind(running_mean)}, running_var={_kind(running_var)}"
        )
    channels = x.shape[1]
    stat_shape = [1, channels] + [1] * (x.dim() - 2)
    reduce_dims = [0, *range(2, x.dim())]
    use_batch_stats = training or running_mean is None
    update = training and running_mean is not None

    if use_batch_stats:
        if x.shape[0] == 1 and _under_vmap(x):
            raise ValueError(
                "functional_batch_norm(x, ...): batch norm "
                + ("in training mode" if training else "without running statistics")
                + f" got one sample (x of shape {tuple(x.shape)}) per call under vmap, as in "
                "per-sample gradients (per_sample_grads over single_sample_fn): it normalises "
                "with statistics of the whole batch, so per-sample gradients are undefined, and "
                "each sample would be normalised by its own statistics. Use GroupNorm/LayerNorm, "
                "or call .eval() on the model (with track_running_stats=True) to use fixed "
                "running statistics"
            )
        count = x.numel() // max(channels, 1)
        if training and count <= 1:
            raise ValueError(
                "functional_batch_norm(x, ...): expected more than 1 value per channel when "
                f"training, got input of shape {tuple(x.shape)} (per-example shape if under vmap)"
            )
    # float16/bfloat16 inputs (autocast, or a half model) are normalised in float32, as torch's
    # batch norm kernels do, and y comes back in the input's dtype
    out_dtype = x.dtype
    h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if use_batch_stats:
        mean = h.mean(dim=reduce_dims)
        var = h.var(dim=reduce_dims, correction=0)
    else:
        mean, var = running_mean, running_var  # type: ignore[assignment]

    invstd = torch.rsqrt(var + eps)
    y = (h - mean.reshape(stat_shape)) * invstd.reshape(stat_shape)
    if weight is not None:
        y = y * weight.reshape(stat_shape)
    if bias is not None:
        y = y + bias.reshape(stat_shape)
    if h is not x:
        y = y.to(out_dtype)

    new_mean, new_var, new_count = running_mean, running_var, num_batches_tracked
    if update:
        assert running_mean is not None and running_var is not None
        if num_batches_tracked is not None:
            new_count = num_batches_tracked + 1
        if momentum is None:
            if new_count is None:
                raise ValueError(
                    "functional_batch_norm(..., momentum=None): the cumulative moving average "
                    "needs num_batches_tracked (a scalar integer tensor), got None"
                )
            factor: Tensor | float = 1.0 / new_count.to(running_mean.dtype)
        else:
            factor = momentum
        unbiased = var.detach() * (count / (count - 1))
        new_mean = ((1 - factor) * running_mean + factor * mean.detach()).to(running_mean.dtype)
        new_var = ((1 - factor) * running_var + factor * unbiased).to(running_var.dtype)
    return y, new_mean, new_var, new_count


def _under_vmap(x: Tensor) -> bool:
    """Returns whether ``x`` is batched by an enclosing ``vmap`` (False while compiling).

    torch has no public API for this: it walks functorch's wrappers (grad, vmap, ...) of ``x``.
    """
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch
    t = x
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _kind(t: Tensor | None) -> str:
    return "None" if t is None else f"Tensor{tuple(t.shape)}"


class BatchNorm(nn.Module):
    """Return ``x`` ``(N, C, *spatial)`` normalized like ``nn.BatchNorm{dim}d`` (transform-safe).

    Same constructor arguments, attributes and ``state_dict`` keys as ``nn.BatchNorm1d/2d/3d``
    (``weight``, ``bias``, ``running_mean``, ``running_var``, ``num_batches_tracked``) and the
    same numbers in train and eval mode. The difference: a training-mode forward *reassigns*
    ``running_mean``/``running_var``/``num_batches_tracked`` with new tensors
    (:func:`functional_batch_norm`) instead of updating them in place, so the module works
    under ``vmap``, ``grad`` of ``grad`` and ``torch.compile`` and ``make_functional`` can
    return the new buffers. ``dim`` (1, 2 or 3) selects which input ranks are accepted (as
    ``BatchNorm1d``: 2-D or 3-D, ``2d``: 4-D, ``3d``: 5-D); ``None`` accepts any rank >= 2.

    Example::

        >>> bn = BatchNorm(3, dim=2)
        >>> y = bn(torch.randn(4, 3, 5, 5))
        >>> same_keys = list(bn.state_dict()) == list(nn.BatchNorm2d(3).state_dict())
        >>> int(bn.num_batches_tracked), same_keys
        (1, True)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        dim: int | None = None,
    ) -> None:
        super().__init__()
        if dim is not None and dim not in _INPUT_NDIMS:
            raise ValueError(f"BatchNorm(..., dim={dim!r}): expected dim in (1, 2, 3) or None")
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.dim = dim
        self.weight: nn.Parameter | None
        self.bias: nn.Parameter | None
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **factory))
            if bias:
                self.bias = nn.Parameter(torch.zeros(num_features, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.running_mean: Tensor | None
        self.running_var: Tensor | None
        self.num_batches_tracked: Tensor | None
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer(
                "num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device)
            )
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, bias={self.bias is not None}, "
            f"track_running_stats={self.track_running_stats}, dim={self.dim}"
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.dim is not None and x.dim() not in _INPUT_NDIMS[self.dim]:
            allowed = " or ".join(f"{n}D" for n in _INPUT_NDIMS[self.dim])
            raise ValueError(
                f"BatchNorm(dim={self.dim}): expected {allowed} input (got {x.dim()}D input)"
            )
        update = self.training and self.track_running_stats
        # Running stats are passed where torch's module passes them: to update them (training
        # and tracked) or to normalize with them (eval).
        pass_running = not self.training or self.track_running_stats
        y, mean, var, count = functional_batch_norm(
            x,
            self.running_mean if pass_running else None,
            self.running_var if pass_running else None,
            self.weight,
            self.bias,
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
            num_batches_tracked=self.num_batches_tracked if update else None,
        )
        if update and self.running_mean is not None:
            self.running_mean = mean
            self.running_var = var
            if self.num_batches_tracked is not None:
                self.num_batches_tracked = count
        return y

    @classmethod
    def from_torch(cls, bn: nn.Module) -> BatchNorm:
        """Return a :class:`BatchNorm` holding ``bn``'s own Parameter/buffer objects (no copy).

        ``bn`` is an ``nn.BatchNorm1d/2d/3d``; its training flag is kept.

        Example::

            >>> BatchNorm.from_torch(nn.BatchNorm1d(4)).dim
            1
        """
        dim = _TORCH_BATCHNORMS.get(type(bn))
        if dim is None:
            raise TypeError(
                "BatchNorm.from_torch(bn): expected nn.BatchNorm1d/2d/3d, got "
                f"{type(bn).__name__}"
            )
        new = cls(
            bn.num_features,
            eps=bn.eps,
            momentum=bn.momentum,
            affine=bn.affine,
            track_running_stats=bn.track_running_stats,
            device="meta",
            dim=dim,
        )
        _move_state(bn, new)
        return new

    def to_torch(self) -> nn.Module:
        """Return an ``nn.BatchNorm{dim}d`` holding this module's own Parameter/buffer objects.

        Example::

            >>> type(BatchNorm(4, dim=1).to_torch()).__name__
            'BatchNorm1d'
        """
        if self.dim is None:
            raise ValueError(
                "BatchNorm(dim=None).to_torch(): torch has no rank-agnostic batch norm module; "
                "construct the BatchNorm with dim=1, 2 or 3"
            )
        new = _TORCH_BY_DIM[self.dim](
            self.num_features,
            eps=self.eps,
            momentum=self.momentum,
            affine=self.affine,
            track_running_stats=self.track_running_stats,
            device="meta",
        )
        _move_state(self, new)
        return new


def _move_state(src: nn.Module, dst: nn.Module) -> None:
    """Point ``dst``'s parameter/buffer slots at ``src``'s objects (keeps ties); copy the mode."""
    for name in ("weight", "bias"):
        dst._parameters[name] = src._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        dst._buffers[name] = src._buffers.get(name)
    dst.train(src.training)


def _swap_batchnorm_(module: nn.Module) -> tuple[nn.Module, list[str]]:
    """Swap every exact ``nn.BatchNorm1d/2d/3d`` in ``module`` (in place) for :class:`BatchNorm`.

    Returns ``(root, swapped_paths)``: ``root`` is ``module`` or, if ``module`` itself is a
    batch norm, its replacement. Parameter/buffer objects are moved, not copied.
    """
    return swap_modules_(module, dict.fromkeys(_TORCH_BATCHNORMS, BatchNorm.from_torch))


def _restore_batchnorm_(module: nn.Module, paths: list[str]) -> nn.Module:
    """Inverse of :func:`_swap_batchnorm_` for the given module paths; returns the root."""
    return restore_modules_(module, paths, BatchNorm)


def replace_batchnorm(module: nn.Module) -> nn.Module:
    """Return a deep copy of ``module`` with each ``nn.BatchNorm1d/2d/3d`` as :class:`BatchNorm`.

    Values (parameters, running statistics, ``num_batches_tracked``), training flags and
    tied parameters carry over; ``state_dict`` keys are unchanged. ``module`` is not
    modified. Only the exact torch classes are swapped (a user subclass of
    ``nn.BatchNorm2d`` may override ``forward``, so it is left alone); ``SyncBatchNorm`` and
    ``InstanceNorm`` are left alone too. Hooks registered on a swapped batch norm are dropped.

    Example::

        >>> net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        >>> type(replace_batchnorm(net)[1]).__name__, type(net[1]).__name__
        ('BatchNorm', 'BatchNorm1d')
    """
    root, _ = _swap_batchnorm_(copy.deepcopy(module))
    return root
