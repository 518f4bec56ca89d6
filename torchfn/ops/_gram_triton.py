"""Fused ghost Gram norms on CUDA: ``<a_i a_i^T, g_i g_i^T>`` per sample in one Triton kernel.

For a linear layer fed a sequence (``a (B, T, d_in)``, output gradients ``g (B, T, d_out)``) the
squared norm of sample ``i``'s weight gradient is ``<a_i a_i^T, g_i g_i^T>`` (the Gram form of
:func:`torchfn.ops.linear_grad_norms_sq`), and its bias gradient's is the sum of all entries
of ``g_i g_i^T``. Done in plain torch ops this is two batched ``(B, T, T)`` GEMMs written to
memory and a reduction that reads both back. For the short sequences of DP fine-tuning
(``T`` a few hundred) each GEMM is one partial wave of small tiles, so a step over many layers
is launch- and latency-bound.

The kernel here computes, per sample and per ``(BT, BT)`` tile pair ``(ti, tj)`` with
``ti <= tj``, the tile of both Gram matrices in registers (float32 accumulation of the
tensor-core products), multiplies them and reduces the tile to one number, doubled off the
diagonal (both Gram matrices are symmetric): half the multiply-adds of the plain form, no
``(B, T, T)`` tensor in memory, one launch per layer. The ``(B, NT * NT)`` tile partials are
summed afterwards (a fixed order: the result is deterministic).

It is registered as the custom op ``torchfn::ghost_gram_norms_sq`` through
``torch.library.triton_op`` so ``torch.compile`` sees the kernel (no graph break) and
``torch.func.vmap`` folds a vmapped dim into the batch. It has no derivative: callers use it
only where the norms are not differentiated (the DP step's clipping coefficients), through
:func:`fused_gram_norms_sq`, which returns None wherever it does not apply (no Triton, torch
before 2.11, not CUDA, not float16/bfloat16, 2-D inputs, gradients needed,
``d_in + d_out`` above :data:`MAX_WIDTH` with small tiles, empty inputs,
``TORCHFN_OPS=reference``). More than 65535 samples (CUDA's limit on a grid's third
dimension) run as several launches.

The op is registered on first use outside a compiled function
(:func:`ensure_gram_op_registered`: :func:`torchfn.persample.make_ghost_model` calls it, and so
does an eager call here), not at
import: registering a ``triton_op`` imports Dynamo and Inductor (seconds), which a program that
never compiles -- or each data-loader worker -- need not pay. Dynamo cannot register it while
tracing, so a compiled function whose first call reaches :func:`fused_gram_norms_sq` before any
eager use gets ``None`` (the plain form) until :func:`ensure_gram_op_registered` has run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.ops import _build

__all__ = [
    "MAX_WIDTH", "ensure_gram_op_registered", "fused_gram_norms_sq", "gram_norms_config",
]

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]

_HALF = (torch.float16, torch.bfloat16)
_MAX_GRID_Z = 65535  # CUDA's limit on a launch grid's third dimension: samples per launch
_OP = "torchfn::ghost_gram_norms_sq"


# Widths (d_in + d_out) above this go to the plain Gram form when the kernel would run
# 64-wide tiles: each program contracts a whole row of width, and with 64-wide tiles one long
# wave is slower than cuBLAS's GEMMs (GPT-2's tied LM head, 768 + 50257 wide, at B=8: 2.5x
# slower fused; 768 + 3072 ran faster). With 128-wide tiles (B=32) the LM head ran faster fused.
MAX_WIDTH = 16384


def gram_norms_config(batch: int, time: int) -> dict[str, int]:
    """Return the kernel's tile sizes and launch settings for ``B = batch``, ``T = time``:
    ``BT`` (Gram tile side), ``BK`` (contraction step), ``num_warps``, ``num_stages``.

    ``128``-wide tiles when they alone give about a wave of programs on a large GPU (``B``
    times the upper-triangle tile count at least 96), else ``64`` (``32`` for ``T <= 32``)
    with a longer contraction step; the best of a grid of configs in
    ``benchmarks/ghost_gram.py`` for GPT-2 and ViT-B layer shapes at B = 8 and 32.

    Example:
        >>> gram_norms_config(8, 256)["BT"], gram_norms_config(32, 256)["BT"]
        (64, 128)
    """
    n128 = -(-time // 128)
    if time > 64 and batch * n128 * (n128 + 1) // 2 >= 96:
        return {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
    return {"BT": 64 if time > 32 else 32, "BK": 128, "num_warps": 4, "num_stages": 3}


if triton is not None:

    @triton.jit
    def _gram_tile(base, rows, cols, rmask, cmask, end, D, s_t, s_d,
                   BT: tl.constexpr, BK: tl.constexpr):
        """The ``(rows, cols)`` tile of ``x x^T`` for one sample's ``x`` at ``base`` (float32),
        contracting over ``[0, end)`` of its ``D`` columns (``end`` 0: a zero tile)."""
        kk = tl.arange(0, BK)
        acc = tl.zeros((BT, BT), dtype=tl.float32)
        for k in range(0, end, BK):
            km = (k + kk) < D
            x = tl.load(base + rows[:, None] * s_t + (k + kk)[None, :] * s_d,
                        mask=rmask[:, None] & km[None, :], other=0.0)
            y = tl.load(base + cols[:, None] * s_t + (k + kk)[None, :] * s_d,
                        mask=cmask[:, None] & km[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(y), acc)
        return acc

    @triton.jit
    def _gram_norms_kernel(a_ptr, g_ptr, part_ptr, T, DA, DG,
                           s_ab, s_at, s_ad, s_gb, s_gt, s_gd,
                           BIAS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
        ti = tl.program_id(0)
        tj = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        nt = tl.num_programs(0)
        rows = ti * BT + tl.arange(0, BT)
        cols = tj * BT + tl.arange(0, BT)
        rmask = rows < T
        cmask = cols < T
        # tiles below the diagonal mirror those above it: they run no contraction step
        active = tj >= ti
        da_end = tl.where(active, DA, 0)
        dg_end = tl.where(active, DG, 0)
        acc_a = _gram_tile(a_ptr + b * s_ab, rows, cols, rmask, cmask, da_end, DA, s_at, s_ad,
                           BT, BK)
        acc_g = _gram_tile(g_ptr + b * s_gb, rows, cols, rmask, cmask, dg_end, DG, s_gt, s_gd,
                           BT, BK)
        total = tl.sum(tl.sum(acc_a * acc_g, axis=1), axis=0)
        if BIAS:
            total += tl.sum(tl.sum(acc_g, axis=1), axis=0)
        total = total * tl.where(tj > ti, 2.0, 1.0)
        tl.store(part_ptr + (b * nt + ti) * nt + tj, total)


def _launch(a: Tensor, g: Tensor, bias: bool, config: dict[str, int], launcher) -> Tensor:
    """Run the kernel on ``a (B, T, d_in)``, ``g (B, T, d_out)``; return ``(B,)`` float32
    (one launch per ``_MAX_GRID_Z`` samples)."""
    b, t, d_in = a.shape
    if b > _MAX_GRID_Z:
        return torch.cat([_launch(a[i:i + _MAX_GRID_Z], g[i:i + _MAX_GRID_Z], bias, config,
                                  launcher) for i in range(0, b, _MAX_GRID_Z)])
    d_out = g.shape[2]
    bt = config["BT"]
    nt = triton.cdiv(t, bt)
    parts = torch.empty((b, nt * nt), dtype=torch.float32, device=a.device)
    launcher(_gram_norms_kernel)[(nt, nt, b)](
        a, g, parts, t, d_in, d_out, *a.stride(), *g.stride(),
        BIAS=bias, BT=bt, BK=config["BK"], num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    return parts.sum(1)


def _direct(kernel):
    return kernel


# The kernel takes its inputs' strides as arguments, fixed when a graph is traced; Inductor
# gives a user Triton kernel's inputs exactly the traced strides (its "eager_input_vals"
# constraint) on torch 2.11, the version this was built and tested on. Older versions are left
# to the plain form rather than trusted to keep the strides (a padded layout would be misread).
_STRIDES_KEPT = torch.torch_version.TorchVersion(torch.__version__) >= "2.11"


def _register() -> bool:
    """Register ``torchfn::ghost_gram_norms_sq``; False where this torch or install cannot."""
    if not _AVAILABLE:
        return False
    from torch.library import triton_op, wrap_triton

    @triton_op(_OP, mutates_args=())
    def ghost_gram_norms_sq(a: Tensor, g: Tensor, bias: bool) -> Tensor:
        config = gram_norms_config(a.shape[0], a.shape[1])
        return _launch(a, g, bias, config, wrap_triton)

    def vmap_rule(info, in_dims, a, g, bias):  # type: ignore[no-untyped-def]
        n = info.batch_size
        a, g = (x.unsqueeze(0).expand(n, *x.shape) if d is None else x.movedim(d, 0)
                for x, d in zip((a, g), in_dims[:2], strict=True))
        out = ghost_gram_norms_sq(a.reshape(-1, *a.shape[2:]), g.reshape(-1, *g.shape[2:]),
                                  bias)
        return out.reshape(n, -1), 0

    torch.library.register_vmap(_OP, vmap_rule)
    return True


# whether this install can run the op at all (no import of Dynamo or Inductor to find out)
_AVAILABLE = (triton is not None and hasattr(torch.library, "triton_op") and _STRIDES_KEPT)
_REGISTERED = False  # set by ensure_gram_op_registered


def ensure_gram_op_registered() -> bool:
    """Register the fused Gram-norm Triton op now, where this install can run it (Triton, as
    CUDA builds of torch ship it, and torch >= 2.11); return whether it is registered.

    Idempotent. Call it before compiling a function that calls :func:`fused_gram_norms_sq`
    (Dynamo cannot trace the registration; a compiled call reaching the op unregistered uses
    the plain form). :func:`torchfn.persample.make_ghost_model` calls it, so DP and ghost-norm
    steps need nothing. It is not done at import because registering imports Dynamo and
    Inductor (seconds).

    Example:
        >>> import torchfn
        >>> registered = torchfn.ops.ensure_gram_op_registered()  # False on CPU-only installs
    """
    global _REGISTERED
    if not _REGISTERED and _AVAILABLE:
        _REGISTERED = _register()
    return _REGISTERED


def fused_gram_norms_sq(a: Tensor, g: Tensor, bias: bool = False) -> Tensor | None:
    """``(B,)`` float32 ``<a_i a_i^T, g_i g_i^T>`` (``+ ||sum_t g_it||^2`` with ``bias``) in one
    Triton kernel, or None where the kernel does not apply (see the module doc).

    ``a (B, T, d_in)`` and ``g (B, T, d_out)``: float16/bfloat16 CUDA tensors of one dtype,
    any strides; ``d_in + d_out <= MAX_WIDTH`` unless 128-wide tiles apply (see
    :func:`gram_norms_config`). Not differentiable: None whenever autograd
    would record the call. Where it returns None, :func:`torchfn.ops.linear_grad_norms_sq`
    gives the same quantity (its Gram form, ``method="gram"``; rounded to the inputs' dtype
    there, float32 here).

    Example:
        >>> import torch, torchfn
        >>> a, g = torch.randn(2, 5, 3), torch.randn(2, 5, 4)
        >>> torchfn.ops.fused_gram_norms_sq(a, g) is None  # CPU float32: not for the kernel
        True
    """
    if (triton is None or a.dim() != 3 or g.dim() != 3 or not a.is_cuda
            or g.device != a.device or a.dtype not in _HALF or g.dtype != a.dtype
            or a.shape[:2] != g.shape[:2]):
        return None
    if a.numel() == 0 or g.numel() == 0:
        return None  # nothing to launch
    if (a.shape[2] + g.shape[2] > MAX_WIDTH
            and gram_norms_config(a.shape[0], a.shape[1])["BT"] < 128):
        return None
    if torch.is_grad_enabled() and (a.requires_grad or g.requires_grad):
        return None
    if not _AVAILABLE or _build.mode() == "reference":
        return None
    if not _REGISTERED and (torch.compiler.is_compiling() or not ensure_gram_op_registered()):
        return None  # first reached while tracing: cannot register here (module doc)
    return torch.ops.torchfn.ghost_gram_norms_sq(a, g, bool(bias))
