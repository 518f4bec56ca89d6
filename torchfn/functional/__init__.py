"""Functional core: stateless models, pytree helpers, transforms, train step, checkpoints."""

from torchfn.functional._accountant import DEFAULT_RDP_ORDERS as DEFAULT_RDP_ORDERS
from torchfn.functional._accountant import RDPAccountant as RDPAccountant
from torchfn.functional._accountant import compute_rdp as compute_rdp
from torchfn.functional._accountant import (
    noise_multiplier_for_epsilon as noise_multiplier_for_epsilon,
)
from torchfn.functional._accountant import rdp_to_epsilon as rdp_to_epsilon
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
from torchfn.functional._dp_sampling import PoissonSampler as PoissonSampler
from torchfn.functional._dpsgd import ClippedSum as ClippedSum
from torchfn.functional._dpsgd import DPState as DPState
from torchfn.functional._dpsgd import DPTrainStep as DPTrainStep
from torchfn.functional._dpsgd import init_dp_state as init_dp_state
from torchfn.functional._dpsgd import make_dp_train_step as make_dp_train_step
from torchfn.functional._ghost_grads import GhostGrads as GhostGrads
from torchfn.functional._ghost_grads import GhostResult as GhostResult
from torchfn.functional._ghost_layers import GhostLayerError as GhostLayerError
from torchfn.functional._ghost_norms import GhostModel as GhostModel
from torchfn.functional._ghost_norms import check_ghost_coverage as check_ghost_coverage
from torchfn.functional._ghost_norms import ghost_grad_norms as ghost_grad_norms
from torchfn.functional._ghost_norms import make_ghost_model as make_ghost_model
from torchfn.functional._ghost_stats import GradStats as GradStats
from torchfn.functional._ghost_stats import NoiseScaleState as NoiseScaleState
from torchfn.functional._ghost_stats import NormHistory as NormHistory
from torchfn.functional._ghost_stats import grad_stats as grad_stats
from torchfn.functional._ghost_stats import init_noise_scale as init_noise_scale
from torchfn.functional._ghost_stats import init_norm_history as init_norm_history
from torchfn.functional._ghost_stats import two_batch_estimates as two_batch_estimates
from torchfn.functional._ghost_stats import update_noise_scale as update_noise_scale
from torchfn.functional._ghost_stats import update_norm_history as update_norm_history
from torchfn.functional._graphed import GraphedStep as GraphedStep
from torchfn.functional._graphed import make_graphed_step as make_graphed_step
from torchfn.functional._optim import adam as adam
from torchfn.functional._optim import adamw as adamw
from torchfn.functional._optim import scale_by_adam as scale_by_adam
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
    "DEFAULT_RDP_ORDERS",
    "BatchNorm",
    "CheckpointError",
    "ClippedSum",
    "DPState",
    "DPTrainStep",
    "DynamicLossScaler",
    "FunctionalModel",
    "GhostGrads",
    "GhostLayerError",
    "GhostModel",
    "GhostResult",
    "GradStats",
    "GraphedStep",
    "LossScaleState",
    "NoiseScaleState",
    "NormHistory",
    "PoissonSampler",
    "RDPAccountant",
    "StepOptions",
    "TrainState",
    "adam",
    "adamw",
    "apply_gradients",
    "check_ghost_coverage",
    "check_optimizer",
    "compute_rdp",
    "empirical_ntk",
    "functional_batch_norm",
    "ghost_grad_norms",
    "grad_stats",
    "hessian_diagonal",
    "hessian_matrix",
    "hvp",
    "init_dp_state",
    "init_noise_scale",
    "init_norm_history",
    "init_train_state",
    "load_checkpoint",
    "make_dp_train_step",
    "make_functional",
    "make_ghost_model",
    "make_graphed_step",
    "make_train_step",
    "noise_multiplier_for_epsilon",
    "per_sample_grad_norms",
    "per_sample_grads",
    "rdp_to_epsilon",
    "replace_batchnorm",
    "save_checkpoint",
    "scale_by_adam",
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
    "two_batch_estimates",
    "update_noise_scale",
    "update_norm_history",
]
