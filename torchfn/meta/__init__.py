"""Meta-learning: MAML, first-order MAML, ANIL, Meta-SGD, Reptile; tasks batched with vmap."""

from torchfn.meta._conv_layout import (
    channels_last_grouped_convs as channels_last_grouped_convs,
)
from torchfn.meta._conv_layout import (
    channels_last_pays as channels_last_pays,
)
from torchfn.meta._conv_pass import (
    GroupedConvDoubleBackwardPass as GroupedConvDoubleBackwardPass,
)
from torchfn.meta._conv_pass import (
    fuse_grouped_conv_double_backward as fuse_grouped_conv_double_backward,
)
from torchfn.meta._conv_pass import inductor_options as inductor_options
from torchfn.meta._maml import LR_PREFIX as LR_PREFIX
from torchfn.meta._maml import MetaLearner as MetaLearner
from torchfn.meta._maml import anil as anil
from torchfn.meta._maml import fomaml as fomaml
from torchfn.meta._maml import maml as maml
from torchfn.meta._maml import meta_sgd as meta_sgd
from torchfn.meta._maml import reptile as reptile
from torchfn.meta._step import init_meta_state as init_meta_state
from torchfn.meta._step import make_meta_train_step as make_meta_train_step
from torchfn.meta._tasks import Task as Task
from torchfn.meta._tasks import sinusoid_tasks as sinusoid_tasks
from torchfn.meta._tasks import stack_episodes as stack_episodes
from torchfn.meta._unfold_conv import UnfoldConv2d as UnfoldConv2d
from torchfn.meta._unfold_conv import unfold_convs as unfold_convs

__all__ = [
    "LR_PREFIX",
    "GroupedConvDoubleBackwardPass",
    "MetaLearner",
    "Task",
    "UnfoldConv2d",
    "anil",
    "channels_last_grouped_convs",
    "channels_last_pays",
    "fomaml",
    "fuse_grouped_conv_double_backward",
    "inductor_options",
    "init_meta_state",
    "make_meta_train_step",
    "maml",
    "meta_sgd",
    "reptile",
    "sinusoid_tasks",
    "stack_episodes",
    "unfold_convs",
]
