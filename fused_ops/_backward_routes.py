"""The route of training mode's backward: the dispatch rule of docs/dispatch.md ("The backward
in training mode"), and the testing hook that forces a route."""
from torch import Tensor

from . import _gram_backward, _spectral_backward

# What each conv-free route covers, for the error of a route forced elsewhere.
_COVERS = {"spectral": ("stride 1, padding 0 and output_padding 0", _spectral_backward.supported),
           "gram": ("padding 0 and one tap per output position (dilation (k - 1) < stride)",
                    _gram_backward.supported)}
# "kept": the forward keeps the convolution output (_kept_output.py); it can only be chosen
# there, before the op runs.
ROUTES = ("aten", "kept", *_COVERS)
# fused_ops.testing.route(backward=...): "auto", or one of ROUTES forced.
ROUTE = "auto"


def chosen(conv: dict, weight: Tensor, can_keep: bool = False) -> str:
    """"aten" (the recomputed convolution, docs/math.md §6.2), "kept" (the forward's, §6.2.4),
    "spectral" (§6.2.2) or "gram" (§6.2.3) for a backward of this geometry; "kept" only where
    the forward `can_keep` the output (``_kept_output.can_keep``, and a caller that keeps it)."""
    if ROUTE != "auto":
        if ROUTE in _COVERS and not _COVERS[ROUTE][1](conv, weight):
            raise RuntimeError(f"fused_ops.testing.route(backward={ROUTE!r}): the route needs "
                               f"{_COVERS[ROUTE][0]}")
        if ROUTE == "kept" and not can_keep:
            raise RuntimeError("fused_ops.testing.route(backward='kept'): the route needs the "
                               "forward to keep the convolution output: algo 'auto', a "
                               "non-empty batch, a process's own batch statistics, and no "
                               "create_graph (a double backward recomputes it)")
        return ROUTE
    if weight.is_cuda:
        # "gram" and "spectral" await a measurement there ("spectral" also fails under
        # torch.cuda.graph capture, undiagnosed), and the op's own statistics cost far less
        # than the convolution "kept" would add to the forward.
        return "aten"
    # The CPU: the forward's statistics cost a convolution there, so keeping its output
    # spares the backward's; "gram" beats that where x's Gram matrix is small against the
    # convolution, and "spectral" (thousands of tiny GEMMs per call) nowhere.
    if _gram_backward.supported(conv, weight) and _gram_backward.cheaper(weight, conv["groups"]):
        return "gram"
    return "kept" if can_keep else "aten"


def keeps(conv: dict, weight: Tensor) -> bool:
    """Whether a forward that can keep the convolution output should, for the route its
    backward will take: the rule of :func:`chosen`, checked by it again in the backward."""
    if ROUTE != "auto":
        return ROUTE == "kept"
    return chosen(conv, weight, can_keep=True) == "kept"
