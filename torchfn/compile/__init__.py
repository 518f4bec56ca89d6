"""Compile helpers: a whole step as one CUDA graph, Inductor options with torchfn's conv
passes, the unfold rewrite of convolutions for meta-gradients, a compiled step that logs its
compiles, one lasting directory for torch's compile caches, and profiling of a step
(:func:`profile_step`, :func:`memory_snapshot`)."""

from torchfn.compile._cache import enable_compile_cache as enable_compile_cache
from torchfn.compile._cache import load_compile_cache as load_compile_cache
from torchfn.compile._cache import save_compile_cache as save_compile_cache
from torchfn.compile._compile_log import CompiledStep as CompiledStep
from torchfn.compile._compile_log import compile_step as compile_step
from torchfn.compile._conv_pass import inductor_options as inductor_options
from torchfn.compile._graphed import make_graphed_step as make_graphed_step
from torchfn.compile._profile import OpTime as OpTime
from torchfn.compile._profile import StepProfile as StepProfile
from torchfn.compile._profile import memory_snapshot as memory_snapshot
from torchfn.compile._profile import profile_step as profile_step
from torchfn.compile._unfold_conv import unfold_convs as unfold_convs

__all__ = [
    "CompiledStep",
    "OpTime",
    "StepProfile",
    "compile_step",
    "enable_compile_cache",
    "inductor_options",
    "load_compile_cache",
    "make_graphed_step",
    "memory_snapshot",
    "profile_step",
    "save_compile_cache",
    "unfold_convs",
]
