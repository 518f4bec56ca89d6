"""Batched fp32 GEMMs of the 32-MLP ensemble step, in every operand/output layout (cuBLAS).

The eight products of one training step of 32 MLPs 784-256-256-10 at batch 128 per member
(forward, weight gradients, input gradients), each as ``torch.bmm`` with A and B stored
row- or column-major (``AN``/``AT``, ``BN``/``BT``) and C written as C or as C^T (``CN``/``CT``,
computed as ``B^T A^T``). TF32 off. Prints, per product, the mean kernel time (CUDA events,
200 back-to-back calls, median of 5) of each layout, fastest first: which layouts cuBLAS
serves well, and what the tiny products (10-wide) cost. CUDA only.

    python benchmarks/gemm_layouts.py
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import back_to_back_ms

N = 32
SHAPES = {"fwd1": (128, 784, 256), "fwd2": (128, 256, 256), "fwd3": (128, 256, 10),
          "dW3": (10, 128, 256), "dh2": (128, 10, 256), "dW2": (256, 128, 256),
          "dh1": (128, 256, 256), "dW1": (256, 128, 784)}  # name: (M, K, N) per member


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gemm_layouts.py: needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, TF32 off, batch {N}")
    for name, (m, k, n) in SHAPES.items():
        row = []
        for ta, tb, tc in itertools.product((False, True), repeat=3):
            a = (torch.randn(N, k, m, device=dev).transpose(1, 2) if ta
                 else torch.randn(N, m, k, device=dev))
            b = (torch.randn(N, n, k, device=dev).transpose(1, 2) if tb
                 else torch.randn(N, k, n, device=dev))
            if tc:
                out = torch.empty(N, n, m, device=dev)

                def fn(a=a, b=b, out=out) -> object:
                    return torch.bmm(b.transpose(1, 2), a.transpose(1, 2), out=out)
            else:
                out = torch.empty(N, m, n, device=dev)

                def fn(a=a, b=b, out=out) -> object:
                    return torch.bmm(a, b, out=out)
            label = f"A{'T' if ta else 'N'}B{'T' if tb else 'N'}C{'T' if tc else 'N'}"
            row.append((back_to_back_ms(fn, dev, reps=200, warmup=10) * 1e3, label))
        row.sort()
        gflop = 2 * N * m * k * n / 1e9
        print(f"{name:5s} M{m} K{k} N{n} ({gflop:.2f} GFLOP): "
              + "  ".join(f"{label} {us:6.1f}" for us, label in row), flush=True)


if __name__ == "__main__":
    main()
