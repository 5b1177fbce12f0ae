"""Training mode's backward without the convolution output where each output position is
reached by at most one tap: padding 0 and ``dilation (k - 1) < stride`` in every dimension,
kernel = stride upsampling among them (docs/math.md §6.2.3). Where the forward kept the
batch's statistics the route runs in C++ (``_ct_bn_pool_kept_backward`` without y,
``csrc/gram/gram.cpp``); ``k_part`` here is the same algebra in ATen ops, for a forward that
kept no statistics (a forced algorithm) and for synchronized statistics.

There a tap t and an input position i name one output position, so
``y[b, c, (i, t)] = sum_ci x[b, ci, i] W_t[ci, c]`` and the gradients of
``K_c (y - mean_c)`` are products with x's channel Gram matrix ``R = sum_{b, i} x x^T``
(``Cig x Cig`` per group) or with ``M = sum_t W_t diag(K) W_t^T``: no tensor of the
convolution output's size, two GEMMs of x's size. In float64: R carries x's mean, which the
difference with ``mean_c`` cancels.
"""
import torch
from torch import Tensor


def supported(conv: dict, weight: Tensor) -> bool:
    kernel = weight.shape[2:]
    return not any(conv["padding"]) and all(
        d * (k - 1) < s for d, k, s in zip(conv["dilation"], kernel, conv["stride"]))


def cheaper(weight: Tensor, groups: int) -> bool:
    """Whether it beats the "kept" route on the CPU where the forward kept no statistics (the
    route computes them again, in Python): its float64 GEMMs' ``2 Cig^2`` multiply-adds per
    input position against oneDNN's convolution and ``convolution_backward``,
    ``3 Cig Cog taps``, float64 costing about twice per multiply-add; the threshold is
    docs/dispatch.md's measured crossing."""
    taps = weight.shape[2] * weight.shape[3] * weight.shape[4]
    return 6 * (weight.shape[0] // groups) < weight.shape[1] * taps


# docs/dispatch.md: ATen's multiply-adds per float64 multiply-add of the route from which
# "gram" from the forward's statistics (the C++ route) wins, on CUDA and on the CPU, and the
# ATen multiply-adds under which CUDA's launches decide instead.
MIN_RATIO = 2
CUDA_MIN_ATEN_WORK = 1e9


def pays(weight: Tensor, x: Tensor, groups: int) -> bool:
    """ATen's ``3 B P Ci Cog T`` multiply-adds (the convolution and ``convolution_backward``)
    against the route's float64 ``2 B P Ci Cig`` (R and M x) plus ``2 Ci Cig Cog T`` (M and
    R W), which on deep layers (Ci 512) or small grids weigh as much as x's."""
    taps = weight.shape[2] * weight.shape[3] * weight.shape[4]
    positions = x.shape[2] * x.shape[3] * x.shape[4]
    ci, cog = x.shape[1], weight.shape[1]
    cig = ci // groups
    aten = 3 * x.shape[0] * positions * ci * cog * taps
    gram = 2 * x.shape[0] * positions * ci * cig + 2 * ci * cig * cog * taps
    return aten >= MIN_RATIO * gram and (not weight.is_cuda or aten >= CUDA_MIN_ATEN_WORK)


def k_part(x: Tensor, weight: Tensor, k: Tensor, mean: Tensor, groups: int, need_x: bool,
           need_weight: bool):
    """The gradients of K_c (y - mean_c) (``k``, ``mean``: [C]): (x's or None, the weight's
    or None), float64."""
    xs = x.to(torch.float64).flatten(2).unflatten(1, (groups, -1))  # [B, G, I, P]
    w = weight.to(torch.float64).flatten(2).unflatten(0, (groups, -1))  # [G, I, O, T]
    k = k.to(torch.float64).view(groups, -1)
    mean = mean.to(torch.float64).view(groups, -1)
    x_grad, w_grad = None, None
    if need_x:
        m = torch.einsum("giot,go,gjot->gij", w, k, w)
        shift = torch.einsum("giot,go->gi", w, k * mean)
        x_grad = (torch.matmul(m, xs) - shift.unsqueeze(-1)).flatten(1, 2).view(x.shape)
    if need_weight:
        gram = torch.einsum("bgip,bgjp->gij", xs, xs)
        sums = xs.sum((0, 3))  # [G, I]
        w_grad = k.unsqueeze(1).unsqueeze(-1) * (
            torch.einsum("gij,gjot->giot", gram, w)
            - mean.unsqueeze(1).unsqueeze(-1) * sums.unsqueeze(-1).unsqueeze(-1))
        w_grad = w_grad.flatten(0, 1).view(weight.shape)
    return x_grad, w_grad
