"""Optimizers as torchopt ``GradientTransformation``s: compile-safe Adam/AdamW and SGD (whose
state holds everything, so runs resume exactly), fused stacked
SGD/Adam over ensemble members, and per-member optimizers whose every hyperparameter is ``(N,)``."""

from torchfn.optim._adam import adam as adam
from torchfn.optim._adam import adamw as adamw
from torchfn.optim._adam import scale_by_adam as scale_by_adam
from torchfn.optim._per_member import per_member_adam as per_member_adam
from torchfn.optim._per_member import per_member_optimizer as per_member_optimizer
from torchfn.optim._per_member import per_member_sgd as per_member_sgd
from torchfn.optim._sgd import TraceState as TraceState
from torchfn.optim._sgd import sgd as sgd
from torchfn.optim._sgd import trace as trace
from torchfn.optim._stacked import StackedAdamState as StackedAdamState
from torchfn.optim._stacked import StackedSgdState as StackedSgdState
from torchfn.optim._stacked import stacked_adam as stacked_adam
from torchfn.optim._stacked import stacked_sgd as stacked_sgd

__all__ = [
    "StackedAdamState",
    "StackedSgdState",
    "TraceState",
    "adam",
    "adamw",
    "per_member_adam",
    "per_member_optimizer",
    "per_member_sgd",
    "scale_by_adam",
    "sgd",
    "stacked_adam",
    "stacked_sgd",
    "trace",
]
