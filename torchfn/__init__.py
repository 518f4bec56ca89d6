"""torchfn: a functional-programming research toolkit on ``torch.func``.

Subpackages (import from these, never from private ``_x`` modules):

- :mod:`torchfn.functional` -- stateless models, pytree helpers, transforms, train step, checkpoints
- :mod:`torchfn.ensembles`  -- N models as one vmapped program
- :mod:`torchfn.meta`       -- MAML and its family
- :mod:`torchfn.data`       -- streaming datasets over shards and samplers
- :mod:`torchfn.ops`        -- C++/CUDA custom ops with pure-PyTorch twins
"""

from torchfn import data as data
from torchfn import ensembles as ensembles
from torchfn import functional as functional
from torchfn import meta as meta
from torchfn import ops as ops

__version__ = "0.1.0"

__all__ = ["__version__", "data", "ensembles", "functional", "meta", "ops"]
