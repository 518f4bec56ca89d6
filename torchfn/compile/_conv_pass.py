"""An Inductor graph pass for second-order MAML on conv nets: one grouped weight-gradient.

Under ``vmap`` over tasks, a conv whose weights are adapted per task becomes a *grouped*
convolution (``groups = tasks``). Differentiating its backward again (MAML's outer gradient)
runs ATen's ``_convolution_double_backward``, which computes the weight-gradient term
``gW = wgrad(ggI, gO)`` as one ordinary convolution *per group*, with the feature map as the
kernel::

    cat([conv(ggI.T[g*Ci:(g+1)*Ci], gO.T[g*Co:(g+1)*Co]) for g in range(groups)], 1).T

That is 32 small convolutions with 14x14-style kernels per layer and inner step for 32 tasks
(and, for the first inner step, where the weights are still shared, one such convolution with
the whole batch reduced inside a feature-map-sized kernel).
:func:`fuse_grouped_conv_double_backward` finds these patterns in an FX graph of aten ops
(stride 1, dilation 1, no output padding) and replaces each by the weight-gradient it equals,
``convolution_backward(gO, ggI, ..., groups, mask=[F, T, F])[1]`` -- cuDNN's weight-gradient
kernels, as XLA does when it rewrites such convolutions into backward-filter calls.
Without this pass the benchmark's compiled MAML step did not finish compiling within a
benchmark call; with it, it compiles and runs (see ``benchmarks/README.md``).
:func:`inductor_options` returns ``torch.compile`` options that install it as a post-grad
pass: ``torch.compile(step, fullgraph=True, options=inductor_options())``.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from typing import Any, Literal

import torch
from torch import fx

from torchfn.compile import _conv_layout
from torchfn.compile._conv_layout import channels_last_grouped_convs

# (also GroupedConvDoubleBackwardPass, defined on first use: see _pass_class)
__all__ = ["fuse_grouped_conv_double_backward", "inductor_options"]

aten = torch.ops.aten


def _swapped01(node: Any) -> fx.Node | None:
    """Return ``x`` if ``node`` is ``x.transpose(0, 1)`` (or the 4-D permute [1, 0, 2, 3])."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.transpose.int and sorted(node.args[1:3]) == [0, 1]:
        return node.args[0]
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0, 2, 3]:
        return node.args[0]
    return None


def _dim0_slice(node: Any) -> tuple[fx.Node, int, int] | None:
    """Return ``(source, start, end)`` if ``node`` is ``source[start:end]`` along dim 0."""
    if not isinstance(node, fx.Node) or node.target is not aten.slice.Tensor:
        return None
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    src, dim, start, end, step = args[:5]
    if dim != 0 or step != 1 or not isinstance(start, int) or not isinstance(end, int):
        return None
    shape = _shape(src) if isinstance(src, fx.Node) else None
    if shape is None:
        return None
    return src, start, min(end, shape[0])


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def fuse_grouped_conv_double_backward(graph: fx.Graph) -> int:
    """Rewrite weight-gradient-as-forward convolutions into ``convolution_backward``; count them.

    Two patterns: the per-group loop described above (one grouped weight-gradient replaces
    ``groups`` convolutions and their ``cat``), and its ``groups == 1`` form -- a single
    ``conv(ggI.T, gO.T)``, where the feature map is the kernel, as the double backward of a conv
    with shared (unbatched) weights produces. Works on a graph of aten ops whose nodes carry
    ``meta["val"]`` (``make_fx``, AOTAutograd, Inductor's post-grad graphs). Only exact matches
    (stride 1, dilation 1, no bias, no output padding) are rewritten; the result is the same
    tensor up to floating-point summation order.
    """
    rewrites = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.cat.default:
            convs = node.args[0]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            match = _match(convs) if dim == 1 and len(convs) >= 2 else None
        elif node.target is aten.convolution.default and node.args[8] == 1:
            convs = [node]
            match = _match_single(node)
        else:
            continue
        if match is None:
            continue
        ggi, go, padding, kernel = match
        groups = len(convs)
        shapes = [_shape(n) for n in (ggi, go, node)]
        if any(s is None or len(s) != 4 for s in shapes):
            continue
        (n, gci, _, _), (n2, gco, _, _), out_shape = shapes
        if n != n2 or gci % groups or gco % groups:
            continue
        weight_shape = [gco, gci // groups, *kernel]
        if tuple(out_shape) != (gci // groups, gco, *kernel):
            continue
        out = _insert_wgrad(graph, node, ggi, go, padding, weight_shape, groups)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        for conv in convs:
            if conv is not node and not conv.users:
                graph.erase_node(conv)
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
    return rewrites


def _insert_wgrad(graph: fx.Graph, before: fx.Node, ggi: fx.Node, go: fx.Node,
                  padding: list[int], weight_shape: list[int], groups: int) -> fx.Node:
    """Insert ``convolution_backward(go, ggi, ...)[1].permute(1, 0, 2, 3)``; return its node."""
    val = ggi.meta["val"]
    with graph.inserting_before(before):
        weight = graph.call_function(
            aten.empty.memory_format, (weight_shape,),
            {"dtype": val.dtype, "device": val.device},
        )
        back = graph.call_function(
            aten.convolution_backward.default,
            (go, ggi, weight, None, [1, 1], list(padding), [1, 1], False, [0, 0], groups,
             [False, True, False]),
        )
        gw = graph.call_function(operator.getitem, (back, 1))
        out = graph.call_function(aten.permute.default, (gw, [1, 0, 2, 3]))
    fake = getattr(val, "fake_mode", None)
    if fake is not None:
        with fake:  # shapes only: the inputs may come from other fake modes (make_fx)
            weight.meta["val"] = torch.empty(weight_shape, dtype=val.dtype, device=val.device)
            gw.meta["val"] = torch.empty(weight_shape, dtype=val.dtype, device=val.device)
            back.meta["val"] = (None, gw.meta["val"], None)
            out.meta["val"] = gw.meta["val"].permute(1, 0, 2, 3)
    return out


def _plain_conv(conv: Any) -> list[int] | None:
    """Return the padding of ``conv`` if it is a stride-1, dilation-1, bias-free, ungrouped conv."""
    if not isinstance(conv, fx.Node) or conv.target is not aten.convolution.default:
        return None
    _, _, bias, stride, pad, dilation, transposed, out_pad, groups = conv.args
    if (bias is not None or transposed or groups != 1 or list(stride) != [1, 1]
            or list(dilation) != [1, 1] or list(out_pad) != [0, 0]):
        return None
    return list(pad)


def _match_single(conv: fx.Node) -> tuple[fx.Node, fx.Node, list[int], list[int]] | None:
    """Return ``(ggI, gO, padding, kernel)`` if ``conv`` is ``conv(ggI.T, gO.T)``."""
    padding = _plain_conv(conv)
    ggi, go = _swapped01(conv.args[0]), _swapped01(conv.args[1])
    shape = _shape(conv)
    if padding is None or ggi is None or go is None or shape is None:
        return None
    return ggi, go, padding, list(shape[2:])


def _match(convs: Any) -> tuple[fx.Node, fx.Node, list[int], list[int]] | None:
    """Return ``(ggI, gO, padding, kernel)`` if ``convs`` are the per-group wgrad convolutions."""
    src_i = src_o = None
    padding: list[int] | None = None
    kernel: list[int] | None = None
    ci = co = None
    for g, conv in enumerate(convs):
        pad = _plain_conv(conv)
        if pad is None or len(conv.users) != 1:
            return None
        x, w = conv.args[:2]
        sx, so = _dim0_slice(x), _dim0_slice(w)
        if sx is None or so is None:
            return None
        if g == 0:
            src_i, src_o, padding = sx[0], so[0], pad
            ci, co = sx[2] - sx[1], so[2] - so[1]
            shape = _shape(conv)
            if shape is None:
                return None
            kernel = list(shape[2:])
        if (sx[0] is not src_i or so[0] is not src_o or pad != padding
                or (sx[1], sx[2]) != (g * ci, (g + 1) * ci)
                or (so[1], so[2]) != (g * co, (g + 1) * co)):
            return None
    ggi, go = _swapped01(src_i), _swapped01(src_o)
    if ggi is None or go is None or padding is None or kernel is None:
        return None
    return ggi, go, padding, kernel


@functools.cache
def _pass_class() -> type:
    """Define :class:`GroupedConvDoubleBackwardPass` on first use: its base class lives in
    ``torch._inductor``, whose import (with ``torch._dynamo``) takes seconds, and a program
    that never compiles -- or a data-loader worker -- should not pay for it."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GroupedConvDoubleBackwardPass(CustomGraphPass):
        """Inductor post-grad pass running :func:`fuse_grouped_conv_double_backward`.

        With ``channels_last=True`` it then runs
        :func:`channels_last_grouped_convs` (grouped convolutions with at least
        ``min_group_channels`` input channels per group in channels-last); with ``"auto"`` only
        where :func:`channels_last_pays` when the graph is compiled.
        """

        def __init__(self, channels_last: bool | Literal["auto"] = "auto",
                     min_group_channels: int = 16) -> None:
            if channels_last not in (True, False, "auto"):
                raise ValueError(f"channels_last: expected True, False or 'auto', got "
                                 f"{channels_last!r}")
            self.channels_last, self.min_group_channels = channels_last, min_group_channels

        def __call__(self, graph: fx.Graph) -> None:
            fuse_grouped_conv_double_backward(graph)
            if self.channels_last:
                channels_last_grouped_convs(graph, self.min_group_channels,
                                            auto=self.channels_last == "auto")

        def uuid(self) -> Any:
            h = hashlib.sha256()
            for path in (__file__, _conv_layout.__file__):
                with open(path, "rb") as f:
                    h.update(f.read())
            # "auto" reads the cuDNN TF32 switch when the pass runs: part of the cache key
            tf32 = bool(torch.backends.cudnn.allow_tf32) if self.channels_last == "auto" else None
            h.update(f"{self.channels_last}:{self.min_group_channels}:{tf32}".encode())
            return h.hexdigest()

    GroupedConvDoubleBackwardPass.__module__ = __name__
    return GroupedConvDoubleBackwardPass


def __getattr__(name: str) -> Any:
    if name == "GroupedConvDoubleBackwardPass":
        return _pass_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def inductor_options(channels_last: bool | Literal["auto"] = "auto") -> dict[str, Any]:
    """Return ``torch.compile`` ``options`` that install :class:`GroupedConvDoubleBackwardPass`.

    ``channels_last`` picks the layout of the grouped convolutions of vmapped per-task conv
    weights (see :func:`channels_last_grouped_convs`): ``"auto"`` (default)
    channels-last exactly where :func:`channels_last_pays` -- float32 on CUDA with
    ``torch.backends.cudnn.allow_tf32`` on (torch's default), read at compile time -- ``True``
    everywhere, ``False`` never. Why (end to end on the MAML benchmark,
    ``benchmarks/meta_profile.py``; see ``benchmarks/README.md``): with cuDNN TF32 on the
    rewritten step is much faster (tensor-core NHWC kernels; the unrewritten NCHW grouped kernel
    has no TF32 path), with TF32 off it is **slower** than unrewritten (cuDNN's fp32
    channels-last grouped kernels convert layouts internally and lose on the small support
    batches). It also makes compiling take somewhat longer.

    Example:
        >>> sorted(inductor_options())
        ['post_grad_custom_pre_pass']
    """
    return {"post_grad_custom_pre_pass": _pass_class()(channels_last)}
