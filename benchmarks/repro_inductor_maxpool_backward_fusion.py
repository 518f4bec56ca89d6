"""Minimal reproduction of issue 18: CPU Inductor returns wrong numbers for a compiled inner step.

Only torch (no torchfn). ``inner(p, x, y)`` is one SGD step of a tiny net -- conv 3x3 (no bias),
BatchNorm (batch stats, affine), ReLU, MaxPool 2x2, linear, cross-entropy -- with the gradient
by ``torch.func.grad`` inside. ``torch.compile(inner)`` is called with float64 params that
require grad (as MAML's inner step is: the outer gradient goes through it), so AOTAutograd
builds a training graph whose forward contains the inner backward and, with its default
partitioning, saves extra tensors for the outer backward. The adapted params it returns are
wrong (relative error ~0.3 at the default sizes), and so is the outer gradient through them
(~0.8).

Seen with torch 2.13.0+cpu (CPU Inductor, C++ backend). CUDA Inductor (Triton) is right: torch
2.11.0+cu130 on an H100, ``--device cuda``: float64 3.0e-16, float32 1.6e-7 outer-gradient
relative error (and 5.1e-16 at ``--n 8 --hw 8 --c 8``). What changes the outcome on the CPU:

- right: ``--backend aot_eager`` or ``aot_eager_decomp_partition`` (so Inductor's lowering /
  scheduling, not the decompositions or the partition); params not requiring grad
  (``--no-grad``: inference graph); ``--options '{"max_fusion_size": 1}'``; dropping the
  BN affine params, the ReLU or the MaxPool; a per-channel multiply instead of the conv.
- still wrong: ``allow_buffer_reuse=False``, ``inplace_buffers=False`` (both together too),
  ``fallback_random``, ``freezing``, ``cpp.simdlen=1``, ``cpp.vec_isa_ok=False``,
  ``cpp_wrapper``, ``pattern_matcher=False``, ``epilogue_fusion=False``,
  ``prologue_fusion=False``, ``split_reductions=False``, ``loop_ordering_after_fusion=False``,
  ``cpp.max_horizontal_fusion_size=1``, ``cpp.enable_tiling_heuristics=False``; on this
  script too, ``allow_buffer_reuse=False`` with ``inplace_buffers=False`` (same numbers).
- the unfolded (unfold + matmul) convolution of torchfn is not needed: ``F.conv2d`` shows it.
  In torchfn (vmap over tasks, ``InnerCompiledMetaGrad(recompute=False)``) the unfolded conv was
  needed to trigger it on a 1-block net; there ``recompute=True`` (AOTAutograd's
  ``aggressive_recomputation``) gives eager's numbers.

Diagnosis from the generated code (``TORCH_LOGS=output_code``, default sizes): the post-grad
graph has ``z = full([N*C, H*W], 0)`` with two users, ``scatter_add(z, 1, pool_indices,
grad)`` (the decomposed ``max_pool2d_with_indices_backward``) and the graph outputs (``z`` is
saved for the outer backward). Inductor fuses, into one C++ kernel (kernel 1), the BN
statistics, the max-pool (whose indices the scatter needs), the zero fill of the scatter's
target buffer AND ``where(relu <= 0, 0, scatter_result)`` with its BN-backward reductions; the
scatter-add itself runs in a later kernel. So the ReLU backward reads the zero-filled buffer
before the scatter has written into it: a fusion that ignores the read-after-mutation
dependency (or creates a cycle through the scatter). Under aggressive recomputation the zeros
are recomputed rather than saved, and the fusion does not happen.

Usage: python benchmarks/repro_inductor_maxpool_backward_fusion.py [--n 2] [--hw 4] [--c 2]
       [--backend inductor] [--options JSON] [--no-grad]
       [--device cpu|cuda] [--dtype float64|float32]
Exit status 1 when compiled and eager differ (relative error > 1e-8; float32: 1e-4), else 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.func import grad

DT = torch.float64


def model(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = F.conv2d(x, p["w"], padding=1)
    h = F.batch_norm(h, None, None, p["bw"], p["bb"], training=True)
    h = F.max_pool2d(h.relu(), 2)
    return h.flatten(1) @ p["lw"].T


def inner(p: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    g = grad(lambda q: F.cross_entropy(model(q, x), y))(p)
    return {k: p[k] - 0.5 * g[k] for k in p}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2, help="images")
    ap.add_argument("--hw", type=int, default=4, help="image side (even)")
    ap.add_argument("--c", type=int, default=2, help="conv channels")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--options", default=None, help="Inductor options as JSON")
    ap.add_argument("--no-grad", action="store_true", help="params not requiring grad")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    feat = a.c * (a.hw // 2) ** 2
    meta = {"w": torch.randn(a.c, 1, 3, 3, generator=g, dtype=DT) / 3,
            "bw": 1 + 0.1 * torch.randn(a.c, generator=g, dtype=DT),
            "bb": 0.1 * torch.randn(a.c, generator=g, dtype=DT),
            "lw": torch.randn(5, feat, generator=g, dtype=DT) / feat ** 0.5}
    x = torch.randn(a.n, 1, a.hw, a.hw, generator=g, dtype=DT)
    y = torch.arange(a.n) % 5
    dt = getattr(torch, a.dtype)
    meta = {k: v.to(a.device, dt) for k, v in meta.items()}
    x, y = x.to(a.device, dt), y.to(a.device)
    kw: dict = {"backend": a.backend, "fullgraph": True}
    if a.options:
        kw["options"] = json.loads(a.options)
    compiled = torch.compile(inner, **kw)

    def run(fn):
        leaves = {k: v.clone().requires_grad_(not a.no_grad) for k, v in meta.items()}
        fast = fn(leaves, x, y)
        if a.no_grad:
            return fast, None
        outer = F.cross_entropy(model(fast, x), y)     # query loss = support loss here
        return fast, torch.autograd.grad(outer, list(leaves.values()))

    fe, ge = run(inner)
    fc, gc = run(compiled)

    def rel(got, want):
        num = sum(float(((u - v) ** 2).sum()) for u, v in zip(got, want, strict=True))
        return (num / sum(float((v ** 2).sum()) for v in want)) ** 0.5

    err = rel([fc[k].detach() for k in meta], [fe[k].detach() for k in meta])
    line = (f"torch {torch.__version__} {a.device} {a.dtype} {a.backend} "
            f"{kw.get('options', {})}: adapted params rel err {err:.3e}")
    if ge is not None:
        gerr = rel(gc, ge)
        line += f", outer (meta-)gradient rel err {gerr:.3e}"
        err = max(err, gerr)
    tol = 1e-8 if a.dtype == "float64" else 1e-4
    print(line + ("  WRONG" if err > tol else "  ok"))
    return int(err > tol)


if __name__ == "__main__":
    sys.exit(main())
