"""The meta device as the checks use it: modules built without data, and cheaply.

Every config check that builds modules (the shape preflight, param-group matching, the
loss probe, the driver's parameter accounting) builds them on ``torch.device("meta")``.
Random initialisation there (``nn.init.*`` -> ``Tensor.normal_``) fills nothing, yet runs
through torch's Python reference decompositions, which import ``torch._dynamo`` on first
use (about 1.4 s, more than the rest of a validation). :func:`meta_device` returns a
random fill of a meta tensor unchanged instead, so building a module (its keys, shapes
and dtypes: enough for the pretrained-file checks) never pays that import. Running a
module forward on meta still does (torch's meta kernels of elementwise ops are the same
references): only the shape check pays it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
_RANDOM_FILLS = frozenset(
    {_T.normal_, _T.uniform_, _T.random_, _T.exponential_, _T.bernoulli_, _T.cauchy_, _T.log_normal_, _T.geometric_}
)


class _NoRandomFill(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _RANDOM_FILLS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]  # a CPU tensor a user factory made is still filled
        return func(*args, **(kwargs or {}))


@contextmanager
def meta_device() -> Iterator[None]:
    """``torch.device("meta")`` for checks: random fills of meta tensors are skipped (see the module doc)."""
    with torch.device("meta"), _NoRandomFill():
        yield
