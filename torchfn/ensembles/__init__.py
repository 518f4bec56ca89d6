"""Ensembles: N models as one vmapped, compiled program (stacked params, per-member hyperparameters)."""

from torchfn._checks import _moved_getattr
from torchfn.ensembles._build import Ensemble as Ensemble
from torchfn.ensembles._build import ensemble_apply as ensemble_apply
from torchfn.ensembles._build import n_members as n_members
from torchfn.ensembles._io import load_ensemble as load_ensemble
from torchfn.ensembles._io import save_ensemble as save_ensemble
from torchfn.ensembles._metrics import ensemble_metrics as ensemble_metrics
from torchfn.ensembles._metrics import ensemble_probs as ensemble_probs
from torchfn.ensembles._metrics import expected_calibration_error as expected_calibration_error
from torchfn.ensembles._metrics import member_disagreement as member_disagreement
from torchfn.ensembles._metrics import negative_log_likelihood as negative_log_likelihood
from torchfn.ensembles._metrics import predictive_variance as predictive_variance
from torchfn.ensembles._train import init_ensemble_state as init_ensemble_state
from torchfn.ensembles._train import make_ensemble_train_step as make_ensemble_train_step
from torchfn.ensembles._train import member_batches as member_batches
from torchfn.ensembles._train import member_orders as member_orders

__all__ = [
    "Ensemble",
    "ensemble_apply",
    "ensemble_metrics",
    "ensemble_probs",
    "expected_calibration_error",
    "init_ensemble_state",
    "load_ensemble",
    "make_ensemble_train_step",
    "member_batches",
    "member_disagreement",
    "member_orders",
    "n_members",
    "negative_log_likelihood",
    "predictive_variance",
    "save_ensemble",
]


# Names that moved to another package: a clear error instead of a silent alias.
_MOVED = {
    "per_member_adam": "torchfn.optim.per_member_adam",
    "per_member_sgd": "torchfn.optim.per_member_sgd",
    "per_member_optimizer": "torchfn.optim.per_member_optimizer",
}


__getattr__ = _moved_getattr(__name__, _MOVED)
