"""Functional core: stateless models, pytree helpers, transforms, train step, checkpoints."""

from torchfn.functional._batchnorm import BatchNorm as BatchNorm
from torchfn.functional._batchnorm import functional_batch_norm as functional_batch_norm
from torchfn.functional._batchnorm import replace_batchnorm as replace_batchnorm
from torchfn.functional._stateless import FunctionalModel as FunctionalModel
from torchfn.functional._stateless import make_functional as make_functional

__all__ = [
    "BatchNorm",
    "FunctionalModel",
    "functional_batch_norm",
    "make_functional",
    "replace_batchnorm",
]
