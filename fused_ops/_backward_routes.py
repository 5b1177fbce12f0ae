"""The route of training mode's backward: the dispatch rule of docs/dispatch.md ("The backward
in training mode"), and the testing hook that forces a route."""
from torch import Tensor

from . import _gram_backward, _spectral_backward

# What each conv-free route covers, for the error of a route forced elsewhere.
_COVERS = {"spectral": ("stride 1, padding 0 and output_padding 0", _spectral_backward.supported),
           "gram": ("padding 0 and one tap per output position (dilation (k - 1) < stride)",
                    _gram_backward.supported)}
ROUTES = ("aten", *_COVERS)
# fused_ops.testing.route(backward=...): "auto", or one of ROUTES forced.
ROUTE = "auto"


def chosen(conv: dict, weight: Tensor) -> str:
    """"aten" (the recomputed convolution, docs/math.md §6.2), "spectral" (§6.2.2) or "gram"
    (§6.2.3) for a backward of this geometry."""
    if ROUTE != "auto":
        if ROUTE in _COVERS and not _COVERS[ROUTE][1](conv, weight):
            raise RuntimeError(f"fused_ops.testing.route(backward={ROUTE!r}): the route needs "
                               f"{_COVERS[ROUTE][0]}")
        return ROUTE
    # Measured on the CPU only: there "gram" wins where it is cheaper, and "spectral" (thousands
    # of tiny GEMMs per call) loses to oneDNN's convolutions. On CUDA both await a measurement
    # (and "spectral" fails under torch.cuda.graph capture, undiagnosed): ATen's there.
    if (not weight.is_cuda and _gram_backward.supported(conv, weight)
            and _gram_backward.cheaper(weight, conv["groups"])):
        return "gram"
    return "aten"
