"""Per-sample gradients at scale: ghost norms, DP-SGD, Poisson sampling, privacy accounting,
gradient statistics, data attribution and influence functions (the per-sample transforms
themselves are in :mod:`torchfn.functional`)."""

from torchfn.persample._accountant import DEFAULT_RDP_ORDERS as DEFAULT_RDP_ORDERS
from torchfn.persample._accountant import RDPAccountant as RDPAccountant
from torchfn.persample._accountant import compute_rdp as compute_rdp
from torchfn.persample._accountant import (
    noise_multiplier_for_epsilon as noise_multiplier_for_epsilon,
)
from torchfn.persample._accountant import rdp_to_epsilon as rdp_to_epsilon
from torchfn.persample._accountant_pld import PLDAccountant as PLDAccountant
from torchfn.persample._accountant_pld import pld_epsilon as pld_epsilon
from torchfn.persample._accountant_prv import PRVAccountant as PRVAccountant
from torchfn.persample._accountant_prv import PRVEpsilon as PRVEpsilon
from torchfn.persample._accountant_prv import prv_epsilon as prv_epsilon
from torchfn.persample._attribution import grad_inner_products as grad_inner_products
from torchfn.persample._attribution import project_grads as project_grads
from torchfn.persample._attribution import projected_scores as projected_scores
from torchfn.persample._attribution import tracin_scores as tracin_scores
from torchfn.persample._dp_clipping import AdaptiveClipping as AdaptiveClipping
from torchfn.persample._dp_clipping import (
    adaptive_grad_noise_multiplier as adaptive_grad_noise_multiplier,
)
from torchfn.persample._dp_sampling import PoissonSampler as PoissonSampler
from torchfn.persample._dp_secure import secure_key as secure_key
from torchfn.persample._dpsgd import ClippedSum as ClippedSum
from torchfn.persample._dpsgd import DPState as DPState
from torchfn.persample._dpsgd import DPTrainStep as DPTrainStep
from torchfn.persample._dpsgd import init_dp_state as init_dp_state
from torchfn.persample._dpsgd import make_dp_train_step as make_dp_train_step
from torchfn.persample._dpsgd import run_chunks as run_chunks
from torchfn.persample._ekfac import EKFAC as EKFAC
from torchfn.persample._ekfac import EKFACLayer as EKFACLayer
from torchfn.persample._ekfac import ekfac_inverse_hvp as ekfac_inverse_hvp
from torchfn.persample._ekfac import fit_ekfac as fit_ekfac
from torchfn.persample._ghost_grads import GhostGrads as GhostGrads
from torchfn.persample._ghost_grads import GhostResult as GhostResult
from torchfn.persample._ghost_layers import GhostLayerError as GhostLayerError
from torchfn.persample._ghost_norms import GhostModel as GhostModel
from torchfn.persample._ghost_norms import check_ghost_coverage as check_ghost_coverage
from torchfn.persample._ghost_norms import ghost_grad_norms as ghost_grad_norms
from torchfn.persample._ghost_norms import make_ghost_model as make_ghost_model
from torchfn.persample._ghost_stats import GradStats as GradStats
from torchfn.persample._ghost_stats import NoiseScaleState as NoiseScaleState
from torchfn.persample._ghost_stats import NormHistory as NormHistory
from torchfn.persample._ghost_stats import grad_stats as grad_stats
from torchfn.persample._ghost_stats import init_noise_scale as init_noise_scale
from torchfn.persample._ghost_stats import init_norm_history as init_norm_history
from torchfn.persample._ghost_stats import two_batch_estimates as two_batch_estimates
from torchfn.persample._ghost_stats import update_noise_scale as update_noise_scale
from torchfn.persample._ghost_stats import update_norm_history as update_norm_history
from torchfn.persample._ihvp import IHVPResult as IHVPResult
from torchfn.persample._ihvp import inverse_hvp as inverse_hvp
from torchfn.persample._influence import influence_scores as influence_scores
from torchfn.persample._influence import self_influence as self_influence
from torchfn.persample._projection import ProjectedGrads as ProjectedGrads
from torchfn.persample._projection import Projection as Projection

__all__ = [
    "DEFAULT_RDP_ORDERS",
    "EKFAC",
    "AdaptiveClipping",
    "ClippedSum",
    "DPState",
    "DPTrainStep",
    "EKFACLayer",
    "GhostGrads",
    "GhostLayerError",
    "GhostModel",
    "GhostResult",
    "GradStats",
    "IHVPResult",
    "NoiseScaleState",
    "NormHistory",
    "PLDAccountant",
    "PRVAccountant",
    "PRVEpsilon",
    "PoissonSampler",
    "ProjectedGrads",
    "Projection",
    "RDPAccountant",
    "adaptive_grad_noise_multiplier",
    "check_ghost_coverage",
    "compute_rdp",
    "ekfac_inverse_hvp",
    "fit_ekfac",
    "ghost_grad_norms",
    "grad_inner_products",
    "grad_stats",
    "influence_scores",
    "init_dp_state",
    "init_noise_scale",
    "init_norm_history",
    "inverse_hvp",
    "make_dp_train_step",
    "make_ghost_model",
    "noise_multiplier_for_epsilon",
    "pld_epsilon",
    "project_grads",
    "projected_scores",
    "prv_epsilon",
    "rdp_to_epsilon",
    "run_chunks",
    "secure_key",
    "self_influence",
    "tracin_scores",
    "two_batch_estimates",
    "update_noise_scale",
    "update_norm_history",
]
