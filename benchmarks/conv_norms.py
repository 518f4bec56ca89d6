"""Per-sample conv weight-gradient norms, several ways: which is fastest on this device?

The DP-SGD CNN step (``benchmarks/persample.py``) spends its extra time over the non-private
step in the conv layers' per-sample norms ``||dW_i||^2`` (issue 4: 1.42-1.45x vs the 1.3x goal).
This times the candidates for both conv layers of that CNN at batch 256, from the layer's input
``x`` (B, C_in, H, W) and output gradient ``g`` (B, C_out, H, W) that the ghost tape stores:

- ``unfold-auto``: what torchfn does now -- ``F.unfold`` patches, then
  :func:`torchfn.ops.linear_grad_norms_sq` (Gram or materialised form, whichever is cheaper);
- ``unfold-materialize`` / ``unfold-gram``: the same with the form forced;
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

# (batch, C_in, C_out, H=W, kernel, padding): conv1 and conv2 of the persample.py CNN
LAYERS = {"conv1": (256, 1, 32, 28, 3, 1), "conv2": (256, 32, 64, 14, 3, 1)}
SMALL = {"conv1": (4, 1, 3, 6, 3, 1), "conv2": (4, 3, 5, 4, 3, 1)}


def unfold_norms(x: Tensor, g: Tensor, k: int, pad: int, method: str) -> Tensor:
    a = F.unfold(x, k, padding=pad).transpose(1, 2)              # (B, L, C_in k k)
    return linear_grad_norms_sq(a, g.flatten(2).transpose(1, 2), method=method)


def grouped_norms(x: Tensor, g: Tensor, k: int, pad: int, channels_last: bool) -> Tensor:
    b, c_in, h, w = x.shape
    c_out = g.shape[1]
    xs, gs = x.reshape(1, b * c_in, h, w), g.reshape(1, b * c_out, *g.shape[2:])
    if channels_last:
        xs, gs = (t.contiguous(memory_format=torch.channels_last) for t in (xs, gs))
    weight = x.new_empty(b * c_out, c_in, k, k)
    _, dw, _ = torch.ops.aten.convolution_backward(
        gs, xs, weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], b,
        [False, True, False])
    return dw.reshape(b, -1).square().sum(1)


def reference(x: Tensor, g: Tensor, k: int, pad: int) -> Tensor:
    a = F.unfold(x.double(), k, padding=pad)                      # (B, C_in k k, L)
    per_sample = torch.einsum("bol,bkl->bok", g.double().flatten(2), a)
    return per_sample.flatten(1).square().sum(1)


METHODS: dict[str, Callable[[Tensor, Tensor, int, int], Tensor]] = {
    "unfold-auto": lambda x, g, k, p: unfold_norms(x, g, k, p, "auto"),
    "unfold-materialize": lambda x, g, k, p: unfold_norms(x, g, k, p, "materialize"),
    "unfold-gram": lambda x, g, k, p: unfold_norms(x, g, k, p, "gram"),
    "cudnn-groups": lambda x, g, k, p: grouped_norms(x, g, k, p, False),
    "cudnn-groups-cl": lambda x, g, k, p: grouped_norms(x, g, k, p, True),
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
    for layer, (b, c_in, c_out, hw, k, pad) in (SMALL if args.small else LAYERS).items():
        x = torch.randn(b, c_in, hw, hw, generator=gen).to(device)
        g = torch.randn(b, c_out, hw, hw, generator=gen).to(device)
        want = reference(x, g, k, pad)
        print(f"== {layer}: x {tuple(x.shape)}, g {tuple(g.shape)}, kernel {k}")
        for name, method in METHODS.items():
            row = f"  {name:20s}"
            for compiled in (False,) if args.no_compile else (False, True):
                torch._dynamo.reset()
                fn = torch.compile(method, fullgraph=True) if compiled else method
                try:
                    got = fn(x, g, k, pad)
                    err = float(((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max())
                    if err > 1e-4:
                        raise AssertionError(f"max relative error {err:.1e} vs the float64 "
                                             "reference")
                    ms = back_to_back_ms(lambda fn=fn, x=x, g=g, k=k, p=pad: fn(x, g, k, p),
                                         device)
                    row += f"  {'compiled' if compiled else 'eager'} {ms:8.3f} ms"
                except Exception as e:  # record and go on: one method failing is a result
                    row += f"  {'compiled' if compiled else 'eager'} failed: {type(e).__name__}: "
                    row += str(e).splitlines()[0][:120]
            print(row, flush=True)


if __name__ == "__main__":
    main()
