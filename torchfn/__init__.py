"""torchfn: a functional-programming research toolkit on ``torch.func``.

Subpackages (import from these, never from private ``_x`` modules):

- :mod:`torchfn.ops`         -- C++/CUDA custom ops with pure-PyTorch twins
- :mod:`torchfn.optim`       -- optimizers: compile-safe Adam/AdamW, stacked and per-member ones
- :mod:`torchfn.functional`  -- stateless models, pytree helpers, transforms, train step, checkpoints
- :mod:`torchfn.compile`     -- CUDA-graphed steps, Inductor options and conv rewrites
- :mod:`torchfn.persample`   -- ghost norms, DP-SGD, sampling, accountants, gradient statistics
- :mod:`torchfn.ensembles`   -- N models as one vmapped program
- :mod:`torchfn.meta`        -- MAML and its family
- :mod:`torchfn.data`        -- streaming datasets over shards and samplers
- :mod:`torchfn.distributed` -- the same steps on ``torch.distributed``
"""

from torchfn import compile as compile
from torchfn import data as data
from torchfn import ensembles as ensembles
from torchfn import functional as functional
from torchfn import meta as meta
from torchfn import ops as ops
from torchfn import optim as optim
from torchfn import persample as persample

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # torchfn.distributed is imported on first use: it decorates functions with
    # torch.compiler.disable, which imports torch._dynamo (seconds) -- a cost a program that
    # never compiles or distributes (or a data-loader worker) need not pay at ``import torchfn``
    if name == "distributed":
        import importlib

        return importlib.import_module("torchfn.distributed")
    raise AttributeError(f"module 'torchfn' has no attribute {name!r}")

__all__ = [
    "__version__",
    "compile",
    "data",
    "distributed",
    "ensembles",
    "functional",
    "meta",
    "ops",
    "optim",
    "persample",
]
