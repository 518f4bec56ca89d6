"""Meta-learning: MAML, first-order MAML, ANIL, Meta-SGD, Reptile, MAML++, iMAML, ProtoNets
and matching nets; tasks batched with vmap."""

from torchfn._checks import _moved_getattr
from torchfn.meta._imaml import ImplicitMetaLearner as ImplicitMetaLearner
from torchfn.meta._imaml import imaml as imaml
from torchfn.meta._maml import LR_PREFIX as LR_PREFIX
from torchfn.meta._maml import MetaLearner as MetaLearner
from torchfn.meta._maml import anil as anil
from torchfn.meta._maml import fomaml as fomaml
from torchfn.meta._maml import maml as maml
from torchfn.meta._maml import meta_sgd as meta_sgd
from torchfn.meta._maml import reptile as reptile
from torchfn.meta._mamlpp import LSLR_PREFIX as LSLR_PREFIX
from torchfn.meta._mamlpp import STEP_KEY as STEP_KEY
from torchfn.meta._mamlpp import MamlPlusPlus as MamlPlusPlus
from torchfn.meta._mamlpp import batchnorm_names as batchnorm_names
from torchfn.meta._mamlpp import maml_plus_plus as maml_plus_plus
from torchfn.meta._mamlpp import msl_weights as msl_weights
from torchfn.meta._protonet import MetricLearner as MetricLearner
from torchfn.meta._protonet import matching_net as matching_net
from torchfn.meta._protonet import protonet as protonet
from torchfn.meta._step import init_meta_state as init_meta_state
from torchfn.meta._step import make_meta_train_step as make_meta_train_step
from torchfn.meta._tasks import Task as Task
from torchfn.meta._tasks import sinusoid_tasks as sinusoid_tasks
from torchfn.meta._tasks import stack_episodes as stack_episodes

__all__ = [
    "LR_PREFIX",
    "LSLR_PREFIX",
    "STEP_KEY",
    "ImplicitMetaLearner",
    "MamlPlusPlus",
    "MetaLearner",
    "MetricLearner",
    "Task",
    "anil",
    "batchnorm_names",
    "fomaml",
    "imaml",
    "init_meta_state",
    "make_meta_train_step",
    "maml",
    "maml_plus_plus",
    "matching_net",
    "meta_sgd",
    "msl_weights",
    "protonet",
    "reptile",
    "sinusoid_tasks",
    "stack_episodes",
]


# Names that moved to another package: a clear error instead of a silent alias.
_MOVED = {
    "inductor_options": "torchfn.compile.inductor_options",
    "unfold_convs": "torchfn.compile.unfold_convs",
    "UnfoldConv2d": "torchfn.compile (internal now; use torchfn.compile.unfold_convs)",
    "GroupedConvDoubleBackwardPass": "torchfn.compile (internal now; use torchfn.compile.inductor_options)",
    "fuse_grouped_conv_double_backward": "torchfn.compile (internal now; use torchfn.compile.inductor_options)",
    "channels_last_grouped_convs": "torchfn.compile (internal now; use torchfn.compile.inductor_options)",
    "channels_last_pays": "torchfn.compile (internal now; use torchfn.compile.inductor_options)",
}


__getattr__ = _moved_getattr(__name__, _MOVED)
