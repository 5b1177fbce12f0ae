"""fused_ops: ``AdaptiveAvgPool3d(1)(BatchNorm3d(scale * ConvTranspose3d(x)))`` as one operator.

``torch.ops.fused_ops.ct_bn_pool`` computes the pooled output without forming the
convolution output; see ``docs/math.md`` for the algebra. This package offers the
functional :func:`ct_bn_pool`, the drop-in module :class:`ConvTransposeBNPool3d` and
:func:`fuse`, which rewrites the pattern in users' models.
"""
import importlib.util
import json

import torch

_REBUILD = ("rebuild it against the torch you run: `python -m pip install --no-build-isolation "
            "--force-reinstall --no-deps .` from the fused_ops source tree (README, Install)")

if importlib.util.find_spec(__name__ + "._C") is None:  # a source tree that was never built
    raise ImportError(
        f"fused_ops: {__path__[0]} has no compiled extension (fused_ops._C). Install it with "
        "`python -m pip install --no-build-isolation -e .` from the source tree, or run from outside "
        "the source tree so that the installed fused_ops is imported (README, Install).")
try:
    from . import _C  # noqa: F401  (loads the kernels; registers torch.ops.fused_ops)
except ImportError as e:  # an undefined symbol: built against another torch, most likely
    raise ImportError(
        f"fused_ops: the compiled extension fused_ops._C does not load under torch {torch.__version__} "
        f"({e}). It is built against one torch version and loads only under that one; {_REBUILD}."
    ) from e


def _check_built_torch() -> None:
    built = json.loads(torch.ops.fused_ops.build_info())["torch"]
    if built != torch.__version__:
        raise ImportError(f"fused_ops: the compiled extension was built against torch {built}, "
                          f"but torch {torch.__version__} is imported; {_REBUILD}.")


_check_built_torch()

from . import _fake  # noqa: E402,F401  (fake kernel for torch.compile / export)
from . import _autograd  # noqa: F401  (ct_bn_pool's backward; docs/math.md §6)
from . import _autocast  # noqa: F401  (the ops under torch.autocast)
from .functional import ct_bn_pool
from .fusion import FuseReport, fuse
from .modules import ConvTransposeBNPool3d

__all__ = ["ct_bn_pool", "ConvTransposeBNPool3d", "fuse", "FuseReport", "build_info"]
__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled extension was built with: torch version, CUDA toolkit, CUDA archs."""
    return json.loads(torch.ops.fused_ops.build_info())
