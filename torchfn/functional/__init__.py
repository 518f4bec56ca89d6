"""Functional core: stateless models, pytree helpers, transforms, train step, checkpoints.

Transform-safe layers: :class:`BatchNorm` and the recurrent layers :class:`RNN` (tanh/relu),
:class:`GRU`, :class:`LSTM` are written from elementary ops with torch's parameter names and
numbers; :func:`make_functional` swaps torch's ``nn.BatchNorm*`` / ``nn.RNN`` / ``nn.GRU`` /
``nn.LSTM`` for them in its private copy (``replace_batchnorm=True``, ``replace_recurrent=True``),
so per-sample gradients, DP-SGD, ensembles and MAML run on recurrent nets.
``replace_recurrent`` / ``restore_recurrent`` convert a whole module by hand.
"""

from torchfn._checks import _moved_getattr
from torchfn.functional._batchnorm import BatchNorm as BatchNorm
from torchfn.functional._batchnorm import functional_batch_norm as functional_batch_norm
from torchfn.functional._batchnorm import replace_batchnorm as replace_batchnorm
from torchfn.functional._checkpoint import CheckpointError as CheckpointError
from torchfn.functional._checkpoint import load_checkpoint as load_checkpoint
from torchfn.functional._checkpoint import save_checkpoint as save_checkpoint
from torchfn.functional._core import StepOptions as StepOptions
from torchfn.functional._core import apply_gradients as apply_gradients
from torchfn.functional._core import check_optimizer as check_optimizer
from torchfn.functional._core import split_batch as split_batch
from torchfn.functional._pytree import tree_add as tree_add
from torchfn.functional._pytree import tree_add_scaled as tree_add_scaled
from torchfn.functional._pytree import tree_dot as tree_dot
from torchfn.functional._pytree import tree_global_norm as tree_global_norm
from torchfn.functional._pytree import tree_map as tree_map
from torchfn.functional._pytree import tree_numel as tree_numel
from torchfn.functional._pytree import tree_ones_like as tree_ones_like
from torchfn.functional._pytree import tree_ravel as tree_ravel
from torchfn.functional._pytree import tree_scalar_mul as tree_scalar_mul
from torchfn.functional._pytree import tree_sub as tree_sub
from torchfn.functional._pytree import tree_zeros_like as tree_zeros_like
from torchfn.functional._recurrent import GRU as GRU
from torchfn.functional._recurrent import LSTM as LSTM
from torchfn.functional._recurrent import RNN as RNN
from torchfn.functional._recurrent import recurrent_forward as recurrent_forward
from torchfn.functional._recurrent import replace_recurrent as replace_recurrent
from torchfn.functional._recurrent import restore_recurrent as restore_recurrent
from torchfn.functional._remat import checkpoint as checkpoint
from torchfn.functional._stateless import FunctionalModel as FunctionalModel
from torchfn.functional._stateless import make_functional as make_functional
from torchfn.functional._train_step import DynamicLossScaler as DynamicLossScaler
from torchfn.functional._train_step import LossScaleState as LossScaleState
from torchfn.functional._train_step import TrainState as TrainState
from torchfn.functional._train_step import init_train_state as init_train_state
from torchfn.functional._train_step import make_train_step as make_train_step
from torchfn.functional._train_step import step_rng as step_rng
from torchfn.functional._transforms import empirical_ntk as empirical_ntk
from torchfn.functional._transforms import hessian_diagonal as hessian_diagonal
from torchfn.functional._transforms import hessian_matrix as hessian_matrix
from torchfn.functional._transforms import hvp as hvp
from torchfn.functional._transforms import per_sample_grad_norms as per_sample_grad_norms
from torchfn.functional._transforms import per_sample_grads as per_sample_grads
from torchfn.functional._transforms import single_sample_fn as single_sample_fn

__all__ = [
    "GRU",
    "LSTM",
    "RNN",
    "BatchNorm",
    "CheckpointError",
    "DynamicLossScaler",
    "FunctionalModel",
    "LossScaleState",
    "StepOptions",
    "TrainState",
    "apply_gradients",
    "check_optimizer",
    "checkpoint",
    "empirical_ntk",
    "functional_batch_norm",
    "hessian_diagonal",
    "hessian_matrix",
    "hvp",
    "init_train_state",
    "load_checkpoint",
    "make_functional",
    "make_train_step",
    "per_sample_grad_norms",
    "per_sample_grads",
    "recurrent_forward",
    "replace_batchnorm",
    "replace_recurrent",
    "restore_recurrent",
    "save_checkpoint",
    "single_sample_fn",
    "split_batch",
    "step_rng",
    "tree_add",
    "tree_add_scaled",
    "tree_dot",
    "tree_global_norm",
    "tree_map",
    "tree_numel",
    "tree_ones_like",
    "tree_ravel",
    "tree_scalar_mul",
    "tree_sub",
    "tree_zeros_like",
]


# Names that moved to another package: a clear error instead of a silent alias.
_MOVED = {
    "DEFAULT_RDP_ORDERS": "torchfn.persample.DEFAULT_RDP_ORDERS",
    "RDPAccountant": "torchfn.persample.RDPAccountant",
    "compute_rdp": "torchfn.persample.compute_rdp",
    "noise_multiplier_for_epsilon": "torchfn.persample.noise_multiplier_for_epsilon",
    "rdp_to_epsilon": "torchfn.persample.rdp_to_epsilon",
    "PoissonSampler": "torchfn.persample.PoissonSampler",
    "ClippedSum": "torchfn.persample.ClippedSum",
    "DPState": "torchfn.persample.DPState",
    "DPTrainStep": "torchfn.persample.DPTrainStep",
    "init_dp_state": "torchfn.persample.init_dp_state",
    "make_dp_train_step": "torchfn.persample.make_dp_train_step",
    "GhostGrads": "torchfn.persample.GhostGrads",
    "GhostResult": "torchfn.persample.GhostResult",
    "GhostLayerError": "torchfn.persample.GhostLayerError",
    "GhostModel": "torchfn.persample.GhostModel",
    "check_ghost_coverage": "torchfn.persample.check_ghost_coverage",
    "ghost_grad_norms": "torchfn.persample.ghost_grad_norms",
    "make_ghost_model": "torchfn.persample.make_ghost_model",
    "GradStats": "torchfn.persample.GradStats",
    "NoiseScaleState": "torchfn.persample.NoiseScaleState",
    "NormHistory": "torchfn.persample.NormHistory",
    "grad_stats": "torchfn.persample.grad_stats",
    "init_noise_scale": "torchfn.persample.init_noise_scale",
    "init_norm_history": "torchfn.persample.init_norm_history",
    "two_batch_estimates": "torchfn.persample.two_batch_estimates",
    "update_noise_scale": "torchfn.persample.update_noise_scale",
    "update_norm_history": "torchfn.persample.update_norm_history",
    "adam": "torchfn.optim.adam",
    "adamw": "torchfn.optim.adamw",
    "scale_by_adam": "torchfn.optim.scale_by_adam",
    "make_graphed_step": "torchfn.compile.make_graphed_step",
    "GraphedStep": "torchfn.compile (internal now: torchfn.compile.make_graphed_step returns it)",
}


__getattr__ = _moved_getattr(__name__, _MOVED)
