"""Compile helpers: a whole step as one CUDA graph, Inductor options with torchfn's conv
passes, the unfold rewrite of convolutions for meta-gradients, and profiling of a step
(:func:`profile_step`, :func:`memory_snapshot`)."""

from torchfn.compile._conv_pass import inductor_options as inductor_options
from torchfn.compile._graphed import make_graphed_step as make_graphed_step
from torchfn.compile._profile import OpTime as OpTime
from torchfn.compile._profile import StepProfile as StepProfile
from torchfn.compile._profile import memory_snapshot as memory_snapshot
from torchfn.compile._profile import profile_step as profile_step
from torchfn.compile._unfold_conv import unfold_convs as unfold_convs

__all__ = [
    "OpTime",
    "StepProfile",
    "inductor_options",
    "make_graphed_step",
    "memory_snapshot",
    "profile_step",
    "unfold_convs",
]
