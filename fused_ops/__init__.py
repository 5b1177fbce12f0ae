"""fused_ops: ``AdaptiveAvgPool3d(1)(BatchNorm3d(scale * ConvTranspose3d(x)))`` as one operator.

``torch.ops.fused_ops.ct_bn_pool`` computes the pooled output without forming the
convolution output; see ``docs/math.md`` for the algebra. This package offers the
functional :func:`ct_bn_pool`, the drop-in module :class:`ConvTransposeBNPool3d` and
:func:`fuse`, which rewrites the pattern in users' models.
"""
import json

import torch

from . import _C  # noqa: F401  (loads the kernels; registers torch.ops.fused_ops)
from . import _fake  # noqa: F401  (fake kernel for torch.compile / export)
from . import _autograd  # noqa: F401  (ct_bn_pool's backward; docs/math.md §6)
from .functional import ct_bn_pool
from .fusion import fuse
from .modules import ConvTransposeBNPool3d

__all__ = ["ct_bn_pool", "ConvTransposeBNPool3d", "fuse", "build_info"]
__version__ = "0.1.0"


def build_info() -> dict:
    """What the compiled extension was built with: torch version, CUDA toolkit, CUDA archs."""
    return json.loads(torch.ops.fused_ops.build_info())
