"""An Inductor graph pass: grouped convolutions (vmapped per-task conv weights) in channels-last.

Under ``vmap`` over tasks, a conv with per-task weights is one *grouped* convolution
(``groups = tasks``). In the NCHW layout cuDNN runs these with a slow generic kernel: in
float32 (TF32 off) a 32-task, 64->64-channel 3x3 conv is many times faster forward, and several
times faster forward+backward, in channels-last (NHWC). With one input channel per group (a
first layer on grey images) NHWC is the slow one, so the choice is per convolution, by channels
per group -- Inductor's own layout optimisation is all or nothing, and skips grouped
convolutions.

:func:`channels_last_grouped_convs` rewrites an FX graph of aten ops (Inductor's post-grad
graph): every 2-D ``convolution`` and ``convolution_backward`` with ``groups > 1`` and at least
``min_group_channels`` input channels per group gets its activation inputs (input and, for the
backward, the output gradient) as channels-last copies (``permute -> contiguous -> permute``,
the same values); cuDNN then picks its NHWC kernels and returns channels-last results, which
the following convolutions take without another copy where Inductor can fuse it.

End to end (the whole compiled MAML step) the rewrite pays only with cuDNN TF32 on, where it
is much faster than the step without it in float32 (the NCHW grouped kernel has no TF32 path
-- eager, which uses it, was no faster with TF32). In float32 with TF32 off the rewritten step
got slower: the profile shows cuDNN converting layouts inside its fp32 grouped kernels (many
small conversion kernels a step) and the support-set (5-image) convolutions and the weight
gradients slower than in NCHW (see ``benchmarks/README.md``) -- so
``torchfn.compile.inductor_options()`` applies it only where :func:`channels_last_pays` (float32
on CUDA with cuDNN TF32 allowed, torch's default).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["channels_last_grouped_convs", "channels_last_pays"]

aten = torch.ops.aten

_TO_NHWC = [0, 2, 3, 1]
_TO_NCHW = [0, 3, 1, 2]


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _is_channels_last(val: torch.Tensor) -> bool:
    return val.is_contiguous(memory_format=torch.channels_last) and not val.is_contiguous()


def _channels_last(graph: fx.Graph, before: fx.Node, x: fx.Node,
                   cache: dict[fx.Node, fx.Node]) -> fx.Node:
    """Return a node holding ``x`` (N, C, H, W) with channels-last strides (one per ``x``)."""
    if x in cache:
        return cache[x]
    val = _val(x)
    assert val is not None
    with graph.inserting_before(before):
        nhwc = graph.call_function(aten.permute.default, (x, _TO_NHWC))
        dense = graph.call_function(aten.clone.default, (nhwc,),
                                    {"memory_format": torch.contiguous_format})
        out = graph.call_function(aten.permute.default, (dense, _TO_NCHW))
    fake = getattr(val, "fake_mode", None)
    if fake is not None:
        with fake:
            nhwc.meta["val"] = val.permute(_TO_NHWC)
            dense.meta["val"] = nhwc.meta["val"].clone(memory_format=torch.contiguous_format)
            out.meta["val"] = dense.meta["val"].permute(_TO_NCHW)
    cache[x] = out
    return out


def channels_last_pays(x: torch.Tensor) -> bool:
    """Whether cuDNN's channels-last grouped convolutions are the fast ones for input ``x``.

    True for float32 CUDA tensors while ``torch.backends.cudnn.allow_tf32`` is on (torch's
    default): cuDNN then has tensor-core NHWC kernels (the whole MAML step is much faster than
    unrewritten in float32). False otherwise: with TF32 off the fp32 NHWC
    grouped kernels were slower than NCHW, float64 has no such kernels, and half precision is
    not measured here (pass ``channels_last=True`` to try it), nor is anything off CUDA.
    """
    return x.is_cuda and x.dtype == torch.float32 and bool(torch.backends.cudnn.allow_tf32)


def channels_last_grouped_convs(graph: fx.Graph, min_group_channels: int = 16, *,
                                auto: bool = False) -> int:
    """Give grouped 2-D convolutions channels-last activations; return how many were changed.

    ``convolution(x, w, ..., groups)`` and ``convolution_backward(gO, x, w, ..., groups, mask)``
    nodes with ``groups > 1``, 4-D tensors, not transposed, and ``C_in / groups >=
    min_group_channels`` get ``x`` (and ``gO``) through a channels-last copy unless they are
    channels-last already. With ``auto=True`` only where :func:`channels_last_pays` for ``x``
    (read when the pass runs, i.e. at compile time). Values are unchanged (a layout copy);
    nodes need ``meta["val"]``.
    """
    changed = 0
    cache: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.convolution.default:
            positions, groups, transposed, x = (0,), node.args[8], node.args[6], node.args[0]
        elif node.target is aten.convolution_backward.default:
            positions, groups, transposed, x = (0, 1), node.args[9], node.args[7], node.args[1]
        else:
            continue
        xv = _val(x)
        if (transposed or not isinstance(groups, int) or groups <= 1 or xv is None
                or xv.ndim != 4 or xv.shape[1] // groups < min_group_channels
                or (auto and not channels_last_pays(xv))):
            continue
        args = list(node.args)
        for i in positions:
            v = _val(args[i])
            if v is not None and v.ndim == 4 and not _is_channels_last(v):
                args[i] = _channels_last(graph, node, args[i], cache)
        if args != list(node.args):
            node.args = tuple(args)
            _refresh_val(node)
            changed += 1
    return changed


def _refresh_val(node: fx.Node) -> None:
    """Recompute ``node.meta["val"]`` from its (new) inputs: the outputs' strides change."""
    old = node.meta.get("val")
    leaves = old if isinstance(old, (tuple, list)) else [old]
    fake = next((getattr(v, "fake_mode", None) for v in leaves if isinstance(v, torch.Tensor)),
                None)
    if fake is None:
        return
    args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    with fake:
        node.meta["val"] = node.target(*args, **node.kwargs)
