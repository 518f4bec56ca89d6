"""Beyond one GPU: data parallel, meta, ensemble and DP-SGD steps on ``torch.distributed``.

NCCL on GPUs, gloo on CPUs, launched by ``torchrun``; no communication layer of torchfn's
own. Collectives are functional (``torch.distributed._functional_collectives``), so every
distributed step also compiles with ``torch.compile(fullgraph=True)``.
"""

from torchfn.distributed._checkpoint import save_checkpoint_once as save_checkpoint_once
from torchfn.distributed._data_parallel import (
    make_data_parallel_train_step as make_data_parallel_train_step,
)
from torchfn.distributed._dpsgd import DistributedDPStep as DistributedDPStep
from torchfn.distributed._dpsgd import all_reduce_clipped_sum as all_reduce_clipped_sum
from torchfn.distributed._dpsgd import shard_poisson_sample as shard_poisson_sample
from torchfn.distributed._ensembles import gather_members as gather_members
from torchfn.distributed._ensembles import load_ensemble_shard as load_ensemble_shard
from torchfn.distributed._ensembles import member_range as member_range
from torchfn.distributed._ensembles import save_ensemble_gathered as save_ensemble_gathered
from torchfn.distributed._ensembles import shard_members as shard_members
from torchfn.distributed._ensembles import sharded_ensemble_apply as sharded_ensemble_apply
from torchfn.distributed._env import DistInfo as DistInfo
from torchfn.distributed._env import init_from_env as init_from_env
from torchfn.distributed._env import world_info as world_info
from torchfn.distributed._meta import (
    make_distributed_meta_train_step as make_distributed_meta_train_step,
)
from torchfn.distributed._meta import shard_tasks as shard_tasks
from torchfn.distributed._reduce import all_gather_tree as all_gather_tree
from torchfn.distributed._reduce import all_reduce_tree as all_reduce_tree
from torchfn.distributed._reduce import make_grad_reducer as make_grad_reducer
from torchfn.distributed._sharded import ShardLayout as ShardLayout
from torchfn.distributed._sharded import gather_sharded_state as gather_sharded_state
from torchfn.distributed._sharded import init_sharded_state as init_sharded_state
from torchfn.distributed._sharded import load_sharded_checkpoint as load_sharded_checkpoint
from torchfn.distributed._sharded import make_sharded_train_step as make_sharded_train_step
from torchfn.distributed._sharded import save_sharded_checkpoint as save_sharded_checkpoint
from torchfn.distributed._sharded_dp import ShardedDPStep as ShardedDPStep
from torchfn.distributed._sharded_dp import init_sharded_dp_state as init_sharded_dp_state
from torchfn.distributed._sharded_dp import (
    make_sharded_dp_train_step as make_sharded_dp_train_step,
)

__all__ = [
    "DistInfo",
    "DistributedDPStep",
    "ShardLayout",
    "ShardedDPStep",
    "all_gather_tree",
    "all_reduce_clipped_sum",
    "all_reduce_tree",
    "gather_members",
    "gather_sharded_state",
    "init_from_env",
    "init_sharded_dp_state",
    "init_sharded_state",
    "load_ensemble_shard",
    "load_sharded_checkpoint",
    "make_data_parallel_train_step",
    "make_distributed_meta_train_step",
    "make_grad_reducer",
    "make_sharded_dp_train_step",
    "make_sharded_train_step",
    "member_range",
    "save_checkpoint_once",
    "save_ensemble_gathered",
    "save_sharded_checkpoint",
    "shard_members",
    "shard_poisson_sample",
    "shard_tasks",
    "sharded_ensemble_apply",
    "world_info",
]
