"""An Inductor pass that computes thin matrix products as fused reductions instead of GEMMs.

A vmapped model's last layer is a batched GEMM with one tiny dimension: an ensemble of 32
classifiers with 10 classes multiplies ``(32, 128, 256) @ (32, 256, 10)`` forward and has two
more such products in its backward. cuBLAS runs each of these (fp32, TF32 off) in 13-19 us on an
H100, as long as a 50x larger product, because its kernels tile for large outputs. Written as
``(a[..., :, :, None] * b[..., None, :, :]).sum(-2)`` the same product is one Inductor reduction
(or, when the contracted dimension is the tiny one, a pointwise kernel that Inductor fuses with
its neighbours, e.g. the ReLU's backward mask): no GEMM launch, no intermediate written.

:func:`decompose_thin_matmuls` rewrites ``aten.mm`` / ``aten.bmm`` nodes of a post-grad graph
whose smallest dimension is at most ``max_dim``; :class:`ThinMatmulPass` is it as an Inductor
custom pass and :func:`thin_matmul_options` the ``torch.compile`` ``options`` installing it.
Values are the same products summed in a different order (float rounding only).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["ThinMatmulPass", "decompose_thin_matmuls", "thin_matmul_options"]

aten = torch.ops.aten

# Products bigger than this (elements of the broadcast a * b, per call) stay GEMMs: the
# reduction reads each operand once per output column/row, which only pays while it is small.
_MAX_PRODUCT = 1 << 28


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def decompose_thin_matmuls(graph: fx.Graph, max_dim: int = 16) -> int:
    """Rewrite thin ``mm``/``bmm`` nodes as broadcast-multiply + sum; return how many.

    A node ``a @ b`` with ``a: (..., M, K)``, ``b: (..., K, N)`` is rewritten when
    ``min(M, K, N) <= max_dim``, both operands are floating point of one dtype with static
    shapes, and ``M * K * N`` (per batch entry, times the batch) is at most ``2**28``.
    Nodes need ``meta["val"]`` (post-grad graphs have it); others are left alone.
    """
    if max_dim < 1:
        raise ValueError(f"decompose_thin_matmuls: max_dim must be >= 1, got {max_dim}")
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
            continue
        a, b = node.args[:2]
        av, bv, out = _val(a), _val(b), _val(node)
        if av is None or bv is None or out is None:
            continue
        shapes = (*av.shape, bv.shape[-1])
        if (not all(isinstance(s, int) for s in shapes) or not av.dtype.is_floating_point
                or av.dtype != bv.dtype or av.dtype != out.dtype):
            continue
        m, k, n = av.shape[-2], av.shape[-1], bv.shape[-1]
        batch = av.shape[0] if av.ndim == 3 else 1
        if min(m, k, n) > max_dim or batch * m * k * n > _MAX_PRODUCT:
            continue
        with graph.inserting_before(node):
            a3 = graph.call_function(aten.unsqueeze.default, (a, -1))      # (.., M, K, 1)
            b3 = graph.call_function(aten.unsqueeze.default, (b, -3))      # (.., 1, K, N)
            prod = graph.call_function(aten.mul.Tensor, (a3, b3))          # (.., M, K, N)
            red = graph.call_function(aten.sum.dim_IntList, (prod, [-2]))  # (.., M, N)
        fake = getattr(av, "fake_mode", None)
        if fake is not None:
            with fake:
                a3.meta["val"] = av.unsqueeze(-1)
                b3.meta["val"] = bv.unsqueeze(-3)
                prod.meta["val"] = a3.meta["val"] * b3.meta["val"]
                red.meta["val"] = prod.meta["val"].sum(-2)
        node.replace_all_uses_with(red)
        graph.erase_node(node)
        changed += 1
    return changed


class ThinMatmulPass(CustomGraphPass):
    """Inductor custom pass running :func:`decompose_thin_matmuls` with ``max_dim``."""

    def __init__(self, max_dim: int = 16) -> None:
        if not isinstance(max_dim, int) or isinstance(max_dim, bool) or max_dim < 1:
            raise ValueError(f"ThinMatmulPass: max_dim must be an int >= 1, got {max_dim!r}")
        self.max_dim = max_dim

    def __call__(self, graph: fx.Graph) -> None:
        decompose_thin_matmuls(graph, self.max_dim)

    def uuid(self) -> Any:
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read() + f":{self.max_dim}".encode()).hexdigest()


def thin_matmul_options(max_dim: int = 16) -> dict[str, Any]:
    """Return ``torch.compile`` ``options`` installing :class:`ThinMatmulPass`.

    Used by :func:`torchfn.ensembles.make_ensemble_train_step`'s step (its
    ``inductor_options``, applied by :func:`make_graphed_step`); pass it to ``torch.compile``
    yourself for other steps. It takes Inductor's ``post_grad_custom_post_pass`` slot.

    Example:
        >>> import torch
        >>> from torchfn.functional import thin_matmul_options
        >>> f = torch.compile(lambda a, b: a @ b, options=thin_matmul_options())
        >>> a, b = torch.randn(4, 8, 32), torch.randn(4, 32, 3)
        >>> torch.allclose(f(a, b), a @ b, atol=1e-5)
        True
    """
    return {"post_grad_custom_post_pass": ThinMatmulPass(max_dim)}
