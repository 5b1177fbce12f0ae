"""The route of training mode's backward: the dispatch rule of docs/dispatch.md ("The backward
in training mode"), and the testing hook that forces a route."""
import torch
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


# CUDA's thresholds for "spectral" (docs/dispatch.md): ATen's multiply-adds per complex
# multiply-add of the spectral route's products, and ATen's multiply-adds (recomputed convolution
# and convolution_backward) below which the spectral route's fixed cost (dozens of ops per
# call) weighs more.
SPECTRAL_MIN_RATIO = 24
SPECTRAL_MIN_ATEN_WORK = 1e11


def _spectral_pays(conv: dict, weight: Tensor, x: Tensor) -> bool:
    """ATen's 3 B Ci Co taps multiply-adds per input position against the spectral route's
    complex ones per bin of the full output's half spectrum (docs/math.md §6.2.2:
    ``_spectral_backward.products_per_bin``), a complex multiply-add counted as four."""
    taps = weight.shape[2] * weight.shape[3] * weight.shape[4]
    positions = x.shape[2] * x.shape[3] * x.shape[4]
    aten = 3 * x.shape[0] * x.shape[1] * weight.shape[1] * taps * positions
    bins = _spectral_backward.half_spectrum_bins(x, weight, conv["dilation"])
    route = 4 * bins * _spectral_backward.products_per_bin(x, weight, conv["groups"])
    return aten >= SPECTRAL_MIN_RATIO * route and aten >= SPECTRAL_MIN_ATEN_WORK


def chosen(conv: dict, weight: Tensor, x: Tensor, can_keep: bool = False,
           has_statistics=None, create_graph: bool = False) -> str:
    """"aten" (the recomputed convolution, docs/math.md §6.2), "kept" (the forward's, §6.2.4),
    "spectral" (§6.2.2) or "gram" (§6.2.3) for a backward of this geometry and input x;
    "kept" only where the forward `can_keep` the output (``_kept_output.can_keep``, and a
    caller that keeps it); "gram" by the measurements of its C++ route where the forward's
    statistics are at hand (`has_statistics`, by default `can_keep`), on CUDA only there.
    A backward that is differentiated itself (`create_graph`) takes "aten": the conv-free
    routes read the batch statistics from ``ct_bn_pool_stats``, which has no derivative."""
    if has_statistics is None:
        has_statistics = can_keep
    if ROUTE != "auto":
        if ROUTE in _COVERS and not _COVERS[ROUTE][1](conv, weight):
            raise RuntimeError(f"fused_ops.testing.route(backward={ROUTE!r}): the route needs "
                               f"{_COVERS[ROUTE][0]}")
        if ROUTE in _COVERS and create_graph:
            raise RuntimeError(f"fused_ops.testing.route(backward={ROUTE!r}): the route has no "
                               "double backward (create_graph): it reads the batch statistics "
                               "from ct_bn_pool_stats, which has no derivative; 'aten' has one")
        if ROUTE == "kept" and not can_keep:
            raise RuntimeError("fused_ops.testing.route(backward='kept'): the route needs the "
                               "forward to keep the convolution output: algo 'auto', a "
                               "non-empty batch, a process's own batch statistics, and no "
                               "create_graph (a double backward recomputes it)")
        return ROUTE
    if create_graph:
        return "aten"
    if weight.is_cuda:
        # With padding the op's own statistics (border, direct, sliced_conv) cost more than
        # the convolution that "kept" adds to the forward and spares the backward; without,
        # they cost a fraction of it.
        if any(conv["padding"]) and can_keep:
            return "kept"
        if _spectral_backward.supported(conv, weight) and _spectral_pays(conv, weight, x):
            return "spectral"
        if (has_statistics and _gram_backward.supported(conv, weight)
                and _gram_backward.pays(weight, x, conv["groups"])):
            return "gram"
        return "aten"
    # The CPU: the forward's statistics cost a convolution there, so keeping its output
    # spares the backward's; "gram" beats that where its work is small against the
    # convolution's (measured from the statistics the forward keeps, and without them);
    # "spectral" nowhere (measured against "kept": it lost on every CPU problem measured).
    if _gram_backward.supported(conv, weight) and (
            _gram_backward.pays(weight, x, conv["groups"]) if has_statistics
            else _gram_backward.cheaper(weight, conv["groups"])):
        return "gram"
    return "kept" if can_keep else "aten"


def keeps(conv: dict, weight: Tensor, x: Tensor):
    """What a forward that can keep something for its backward should keep, for the route the
    backward will take (the rule of :func:`chosen`, checked by it again in the backward):
    "output" (y, for "kept"), "statistics" (the batch's sums and statistics, which the
    conv-free routes read) or None ("aten" recomputes y and its statistics together)."""
    route = ROUTE if ROUTE != "auto" else chosen(conv, weight, x, can_keep=True)
    if route == "kept":
        return "output"
    return "statistics" if route in _COVERS else None
