"""Custom C++/CUDA ops with pure-PyTorch reference twins, composable with ``torch.func``.

Every op here equals its twin in :mod:`torchfn.ops.reference` under eager mode,
``torch.compile``, ``torch.func.grad``/``vmap``/``jvp`` and any nesting of them; the
kernels are built with ninja on first use (``build_ops()`` prebuilds; ``ops_status()``
says which backend each device uses). ``TORCHFN_OPS=reference`` forces the twins.

Example:
    >>> import torch
    >>> from torchfn import ops
    >>> ops.leaky_relu(torch.tensor([-1.0, 1.0]), 0.5)
    tensor([-0.5000,  1.0000])
"""

from torchfn._checks import _moved_getattr
from torchfn.ops import reference as reference
from torchfn.ops._activations import leaky_relu as leaky_relu
from torchfn.ops._activations import sigmoid as sigmoid
from torchfn.ops._build import TorchfnOpsWarning as TorchfnOpsWarning
from torchfn.ops._build import build_ops as build_ops
from torchfn.ops._build import ops_status as ops_status
from torchfn.ops._dispatch import functorch_stack as functorch_stack
from torchfn.ops._ghost import clipped_linear_bias_grad_sum as clipped_linear_bias_grad_sum
from torchfn.ops._ghost import clipped_linear_grad_sum as clipped_linear_grad_sum
from torchfn.ops._ghost import gram_is_cheaper as gram_is_cheaper
from torchfn.ops._ghost import linear_bias_grad_norms_sq as linear_bias_grad_norms_sq
from torchfn.ops._ghost import linear_grad_norms_sq as linear_grad_norms_sq
from torchfn.ops._gram_triton import ensure_gram_op_registered as ensure_gram_op_registered
from torchfn.ops._gram_triton import fused_gram_norms_sq as fused_gram_norms_sq
from torchfn.ops._stacked_optim import stacked_adam_update as stacked_adam_update
from torchfn.ops._stacked_optim import stacked_sgd_update as stacked_sgd_update
from torchfn.ops._stacked_optim_multi import stacked_adam_update_multi as stacked_adam_update_multi
from torchfn.ops._stacked_optim_multi import stacked_sgd_update_multi as stacked_sgd_update_multi
from torchfn.ops._xent import softmax_cross_entropy as softmax_cross_entropy

__all__ = [
    "TorchfnOpsWarning",
    "build_ops",
    "clipped_linear_bias_grad_sum",
    "clipped_linear_grad_sum",
    "ensure_gram_op_registered",
    "functorch_stack",
    "fused_gram_norms_sq",
    "gram_is_cheaper",
    "leaky_relu",
    "linear_bias_grad_norms_sq",
    "linear_grad_norms_sq",
    "ops_status",
    "reference",
    "sigmoid",
    "softmax_cross_entropy",
    "stacked_adam_update",
    "stacked_adam_update_multi",
    "stacked_sgd_update",
    "stacked_sgd_update_multi",
]


# Names that moved to another package: a clear error instead of a silent alias.
_MOVED = {
    "StackedAdamState": "torchfn.optim.StackedAdamState",
    "StackedSgdState": "torchfn.optim.StackedSgdState",
    "stacked_adam": "torchfn.optim.stacked_adam",
    "stacked_sgd": "torchfn.optim.stacked_sgd",
}


__getattr__ = _moved_getattr(__name__, _MOVED)
