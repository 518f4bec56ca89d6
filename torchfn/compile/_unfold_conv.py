"""Convolutions as unfold + matmul: batched GEMMs over tasks instead of grouped cuDNN convs.

Under ``vmap`` over tasks every task has its own conv weights, so ``F.conv2d`` becomes one
convolution with the tasks as groups, and in float32 (TF32 off) cuDNN runs grouped
convolutions slowly (e.g. the benchmark's layer 2: 32 groups of 64 -> 64 channels over 75
images of 14x14). Written as ``weight.flatten(1) @ unfold(x)``, the same convolution is a
matmul whose task dim ``vmap`` turns into a batched GEMM, and so are its backward and double
backward (``fold`` / ``unfold`` in between). Compiled, this is several times faster than
``F.conv2d`` for second-order blocks of such layers, and makes the whole MAML step of
``benchmarks/meta.py`` (4-block 64-channel conv net, 32 tasks, 5 inner steps, second order)
several times faster in fp32 with the default ``min_patch`` (layers 2-4; ``min_patch=1``,
all four layers, is about the same), and faster than JAX's, with TF32 on both sides too. It
also compiles faster. Eager it does not pay (the step is host-bound), and it holds
``prod(kernel_size)`` times the input in memory per call while it runs; the patches are views
of the input, which compiled backwards can recompute instead of saving (``_patches``).
Measurements and how to rerun them: ``benchmarks/README.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["UnfoldConv2d", "unfold_convs"]


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _patches(x: Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...],
             padding: tuple[int, ...], stride: tuple[int, ...], out_size: tuple[int, int],
             ) -> Tensor:
    """The ``(C kh kw, B H_out W_out)`` patches of a ``(B, C, H, W)`` input (zero padding):
    ``F.unfold``'s numbers, rows in its order, the batch moved into the columns.

    Built as ``kh * kw`` strided slices of the (padded) input, stacked, rather than by
    ``F.unfold`` (``aten.im2col``), which AOTAutograd's min-cut partitioner never recomputes:
    it saved the patches -- ``kh * kw`` times the input -- of every call for the backward (in
    a MAML step, for the second-order backward of every inner step). Slices, pads and stacks it
    may recompute (it does under ``torch._functorch.config.aggressive_recomputation``, which
    ``compile="inner"`` of the meta train step sets for its compiled pieces). Slices rather
    than ``Tensor.unfold``: ``unfold_backward`` has no ``vmap`` batching rule (torch 2.13), so
    an eager double backward under ``vmap`` would loop over the batch. Channels and taps first,
    so that ``weight.flatten(1) @ patches`` is one GEMM over the whole batch, and under
    ``vmap`` over tasks a batched GEMM with the per-task weights as they are (``F.unfold``'s
    ``(B, C kh kw, L)`` made vmapped weights ``(C_out, C kh kw)`` broadcast, materialised,
    once per image).
    """
    (kh, kw), (dh, dw), (ph, pw), (sh, sw), (h_out, w_out) = (kernel, dilation, padding,
                                                              stride, out_size)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    x = x.transpose(0, 1)                                       # (C, B, H, W), a view
    taps = [x[:, :, i * dh:i * dh + sh * (h_out - 1) + 1:sh,
              j * dw:j * dw + sw * (w_out - 1) + 1:sw] for i in range(kh) for j in range(kw)]
    return torch.stack(taps, 1).flatten(0, 1).flatten(1)      # (C kh kw, B H_out W_out)


class UnfoldConv2d(nn.Module):
    """``nn.Conv2d`` (zero padding, ``groups=1``) computed as ``weight.flatten(1) @ unfold(x)``.

    Holds the parameters of the conv it replaces under the same names (``weight``
    ``(C_out, C_in, kh, kw)``, ``bias`` ``(C_out,)`` or ``None``), so parameter dicts of the
    original module fit it. Input ``(B, C_in, H, W)`` or ``(C_in, H, W)``; output
    ``(B, C_out, H_out, W_out)`` (or without ``B``), as ``nn.Conv2d``'s.

    Example:
        >>> import torch
        >>> conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        >>> x = torch.randn(2, 3, 5, 5)
        >>> torch.allclose(UnfoldConv2d(conv)(x), conv(x), atol=1e-6)
        True
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if type(conv) is not nn.Conv2d:
            raise TypeError(f"UnfoldConv2d(conv): expected an nn.Conv2d, got "
                            f"{type(conv).__name__}")
        if conv.groups != 1 or conv.padding_mode != "zeros" or conv.padding == "same":
            raise ValueError(
                f"UnfoldConv2d(conv): expected groups=1, padding_mode='zeros' and numeric or "
                f"'valid' padding, got groups={conv.groups}, padding_mode="
                f"{conv.padding_mode!r}, padding={conv.padding!r}")
        self.weight = conv.weight
        self.bias = conv.bias
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.dilation = tuple(conv.stride), tuple(conv.dilation)
        self.padding = (0, 0) if conv.padding == "valid" else tuple(conv.padding)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"bias={self.bias is not None}")

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 3:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"UnfoldConv2d: expected input (B, {self.in_channels}, H, W) or "
                             f"({self.in_channels}, H, W), got shape {tuple(x.shape)}")
        h_out, w_out = (_out_size(n, k, s, p, d) for n, k, s, p, d in zip(
            x.shape[2:], self.kernel_size, self.stride, self.padding, self.dilation,
            strict=True))
        cols = _patches(x, self.kernel_size, self.dilation, self.padding, self.stride,
                        (h_out, w_out))
        out = self.weight.flatten(1) @ cols                     # (C_out, B L)
        if self.bias is not None:  # in out's dtype, as a conv under autocast adds it
            out = out + self.bias[:, None].to(out.dtype)
        # contiguous, as nn.Conv2d's output (callers may .view it); fused with the bias add
        return out.unflatten(1, (x.shape[0], h_out, w_out)).transpose(0, 1).contiguous()


def unfold_convs(module: nn.Module, *, min_patch: int = 64,
                 only: Callable[[str], bool] | None = None) -> nn.Module:
    """Return a copy of ``module`` whose eligible ``nn.Conv2d`` layers are :class:`UnfoldConv2d`.

    Eligible: exactly ``nn.Conv2d`` (not subclasses), ``groups=1``, zero padding (numeric or
    ``'valid'``), and a patch of at least ``min_patch`` numbers (``C_in * kh * kw``: the inner
    dimension of the GEMM; the default 64 leaves a first layer on 1-channel images, patch 9,
    to cuDNN). ``only``, if given, is called with each eligible conv's qualified name (as in
    ``named_modules()``, ``""`` for ``module`` itself) and keeps it a convolution when it returns
    false. Parameter and buffer names and values are unchanged (the copy shares no
    tensors with ``module``), so ``make_functional`` of the copy takes the same dicts. Meant for
    MAML-style steps compiled with ``torch.compile``, where vmapped per-task convolutions
    become batched GEMMs (see the module docstring: much faster than ``F.conv2d`` on CUDA for
    the standard 4-block few-shot conv net).

    The meta learners (:func:`torchfn.meta.maml` and the rest) do this by themselves under
    ``torch.compile`` on CUDA for the convolutions the inner loop adapts (their
    ``unfold_convs="auto"``, with this default ``min_patch``), eager calls keeping
    ``nn.Conv2d``; call this for every layer (``min_patch=1``) or for eager calls too.

    Known PyTorch issue: with ``min_patch`` low enough to unfold a 1-channel first layer,
    Inductor on CUDA (torch 2.11) failed to compile a small test net (``AssertionError: 9 v.s.
    3`` from its mix-order reduction fusion); ``torch.compile(..., options={
    "triton.mix_order_reduction": False})`` avoids it. The default leaves such layers alone.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
        >>> fast = unfold_convs(net)
        >>> [type(m).__name__ for m in fast]
        ['Conv2d', 'ReLU', 'UnfoldConv2d']
        >>> x = torch.randn(2, 1, 8, 8)
        >>> torch.allclose(fast(x), net(x), atol=1e-6)
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"unfold_convs(module): expected an nn.Module, got "
                        f"{type(module).__name__}")
    if isinstance(min_patch, bool) or not isinstance(min_patch, int) or min_patch < 1:
        raise ValueError(f"unfold_convs(min_patch=...): expected an int >= 1, got "
                         f"{min_patch!r}")
    out = copy.deepcopy(module)

    def eligible(m: nn.Module) -> bool:
        return (type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros"
                and m.padding != "same"
                and m.in_channels * m.kernel_size[0] * m.kernel_size[1] >= min_patch)

    def chosen(path: str, m: nn.Module) -> bool:
        return eligible(m) and (only is None or bool(only(path)))

    if chosen("", out):
        return UnfoldConv2d(out)  # type: ignore[arg-type]
    for path, parent in list(out.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):
            if child is not None and chosen(f"{path}.{name}" if path else name, child):
                parent._modules[name] = UnfoldConv2d(child)  # type: ignore[arg-type]
    return out
