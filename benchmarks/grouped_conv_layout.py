"""Grouped 3x3 convolutions (vmapped per-task conv weights) in NCHW vs channels-last (NHWC).

The shapes of the MAML benchmark (``benchmarks/meta.py``): 32 tasks as groups, 64 output
channels per group, query (75 images) and support (5) batches, float32 with cuDNN TF32 off.
Prints the median of 10 synchronised calls of the forward and of forward + backward (gradients
of input and weight) per layout, with and without ``cudnn.benchmark``. CUDA only.

    python benchmarks/grouped_conv_layout.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from _bench import time_calls

GROUPS = 32
SHAPES = [(75, 64, 14), (75, 1, 28), (5, 64, 14), (75, 64, 7)]  # (batch, C_in/group, H=W)


def median_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median of ``repeats`` synchronised calls of ``fn`` after one warm-up call, in ms."""
    return time_calls(fn, "cuda", warmup=1, repeats=repeats).median_ms


def measure(batch: int, cin: int, hw: int, fmt: torch.memory_format) -> tuple[float, float]:
    x = torch.randn(batch, GROUPS * cin, hw, hw, device="cuda")
    x = x.contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(GROUPS * 64, cin, 3, 3, device="cuda")
    w = w.contiguous(memory_format=fmt).requires_grad_()

    def forward() -> torch.Tensor:
        return F.conv2d(x, w, padding=1, groups=GROUPS)

    gy = torch.randn_like(forward())

    def forward_backward() -> object:
        return torch.autograd.grad(forward(), (x, w), gy)

    return median_ms(forward), median_ms(forward_backward)


def main() -> None:
    torch.backends.cudnn.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN TF32 off")
    for batch, cin, hw in SHAPES:
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for name, fmt in (("NCHW", torch.contiguous_format), ("NHWC", torch.channels_last)):
                fwd, both = measure(batch, cin, hw, fmt)
                print(f"b={batch} cin={cin} hw={hw} bench={bench} {name}: fwd {fwd:.3f} ms  "
                      f"fwd+bwd {both:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
