"""Per-sample conv weight-gradient norms, several ways: which is fastest on this device?

The DP-SGD CNN step (``benchmarks/persample.py``) spends its extra time over the non-private
step in the conv layers' per-sample norms ``||dW_i||^2`` (issue 4: 1.42-1.45x vs the 1.3x goal).
This times the candidates for both conv layers of that CNN at batch 256, and for a ConvNeXt-T
stage-1 depthwise 7x7 conv (``groups = C``) at batch 64, from the layer's input ``x``
(B, C_in, H, W) and output gradient ``g`` (B, C_out, H, W) that the ghost tape stores:

- ``unfold-auto``: what torchfn does now -- ``F.unfold`` patches, then
  :func:`torchfn.ops.linear_grad_norms_sq` (Gram or materialised form, whichever is cheaper;
  grouped convs: every group's per-sample gradient in one batched GEMM from the patches);
- ``unfold-materialize`` / ``unfold-gram``: the same with the form forced (grouped convs:
  the groups folded into the batch);
- ``cudnn-groups``: cuDNN's weight-gradient convolution with the batch as groups
  (``convolution_backward`` of ``(1, B*C_out, H, W)`` w.r.t. a ``(B*C_out, C_in, k, k)``
  weight, ``groups=B``): the per-sample gradients without im2col, then their squared sums;
- ``cudnn-groups-cl``: the same with channels-last activations.

Each eager and under ``torch.compile`` (Inductor). Every method is checked against the
float64 materialised reference first. Kernel time: CUDA events around 50 back-to-back calls,
median of 5; TF32 off. ``--small`` is a CPU smoke test (tiny shapes, correctness only).

    python benchmarks/conv_norms.py
    python benchmarks/conv_norms.py --small
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from torchfn.ops import linear_grad_norms_sq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import back_to_back_ms

# (batch, C_in, C_out, H=W, kernel, padding, groups): conv1 and conv2 of the persample.py
# CNN, and a depthwise 7x7 conv of ConvNeXt-T's first stage
LAYERS = {"conv1": (256, 1, 32, 28, 3, 1, 1), "conv2": (256, 32, 64, 14, 3, 1, 1),
          "dw7": (64, 96, 96, 56, 7, 3, 96)}
SMALL = {"conv1": (4, 1, 3, 6, 3, 1, 1), "conv2": (4, 3, 5, 4, 3, 1, 1),
         "dw7": (4, 4, 4, 9, 7, 3, 4)}


def unfold_norms(x: Tensor, g: Tensor, k: int, pad: int, groups: int, method: str) -> Tensor:
    u = F.unfold(x, k, padding=pad)                               # (B, C_in k k, L)
    b, n = x.shape[0], groups
    if n == 1:
        return linear_grad_norms_sq(u.transpose(1, 2), g.flatten(2).transpose(1, 2),
                                    method=method)
    ug, gg = u.reshape(b, n, -1, u.shape[-1]), g.reshape(b, n, -1, u.shape[-1])
    if method == "auto":  # torchfn's grouped-conv route: one batched GEMM, no copies
        return torch.matmul(gg, ug.mT).flatten(1).square().sum(1)
    norms = linear_grad_norms_sq(ug.flatten(0, 1).mT, gg.flatten(0, 1).mT, method=method)
    return norms.reshape(b, n).sum(1)


def grouped_norms(x: Tensor, g: Tensor, k: int, pad: int, groups: int,
                  channels_last: bool) -> Tensor:
    b, c_in, h, w = x.shape
    c_out = g.shape[1]
    xs, gs = x.reshape(1, b * c_in, h, w), g.reshape(1, b * c_out, *g.shape[2:])
    if channels_last:
        xs, gs = (t.contiguous(memory_format=torch.channels_last) for t in (xs, gs))
    weight = x.new_empty(b * c_out, c_in // groups, k, k)
    _, dw, _ = torch.ops.aten.convolution_backward(
        gs, xs, weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], b * groups,
        [False, True, False])
    return dw.reshape(b, -1).square().sum(1)


def reference(x: Tensor, g: Tensor, k: int, pad: int, groups: int) -> Tensor:
    a = F.unfold(x.double(), k, padding=pad)                      # (B, C_in k k, L)
    b, n = x.shape[0], groups
    per_sample = torch.einsum("bnol,bnkl->bnok", g.double().reshape(b, n, -1, a.shape[-1]),
                              a.reshape(b, n, -1, a.shape[-1]))
    return per_sample.flatten(1).square().sum(1)


Method = Callable[[Tensor, Tensor, int, int, int], Tensor]
METHODS: dict[str, Method] = {
    "unfold-auto": lambda x, g, k, p, n: unfold_norms(x, g, k, p, n, "auto"),
    "unfold-materialize": lambda x, g, k, p, n: unfold_norms(x, g, k, p, n, "materialize"),
    "unfold-gram": lambda x, g, k, p, n: unfold_norms(x, g, k, p, n, "gram"),
    "cudnn-groups": lambda x, g, k, p, n: grouped_norms(x, g, k, p, n, False),
    "cudnn-groups-cl": lambda x, g, k, p, n: grouped_norms(x, g, k, p, n, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny CPU smoke test")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__} on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}"
          ", float32, TF32 off")
    gen = torch.Generator().manual_seed(0)
    for layer, (b, c_in, c_out, hw, k, pad, n) in (SMALL if args.small else LAYERS).items():
        x = torch.randn(b, c_in, hw, hw, generator=gen).to(device)
        g = torch.randn(b, c_out, hw, hw, generator=gen).to(device)
        want = reference(x, g, k, pad, n)
        print(f"== {layer}: x {tuple(x.shape)}, g {tuple(g.shape)}, kernel {k}, groups {n}")
        for name, method in METHODS.items():
            row = f"  {name:20s}"
            for compiled in (False,) if args.no_compile else (False, True):
                torch._dynamo.reset()
                fn = torch.compile(method, fullgraph=True) if compiled else method
                try:
                    got = fn(x, g, k, pad, n)
                    err = float(((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max())
                    if err > 1e-4:
                        raise AssertionError(f"max relative error {err:.1e} vs the float64 "
                                             "reference")
                    ms = back_to_back_ms(lambda fn=fn, x=x, g=g, k=k, p=pad, n=n:
                                         fn(x, g, k, p, n), device)
                    row += f"  {'compiled' if compiled else 'eager'} {ms:8.3f} ms"
                except Exception as e:  # record and go on: one method failing is a result
                    row += f"  {'compiled' if compiled else 'eager'} failed: {type(e).__name__}: "
                    row += str(e).splitlines()[0][:120]
            print(row, flush=True)


if __name__ == "__main__":
    main()
