"""Compile helpers: a whole step as one CUDA graph, Inductor options with torchfn's conv
passes, and the unfold rewrite of convolutions for meta-gradients."""

from torchfn.compile._conv_pass import inductor_options as inductor_options
from torchfn.compile._graphed import make_graphed_step as make_graphed_step
from torchfn.compile._unfold_conv import unfold_convs as unfold_convs

__all__ = ["inductor_options", "make_graphed_step", "unfold_convs"]
