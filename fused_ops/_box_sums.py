"""The separable tap masks of a transposed convolution and the two contractions of x's grid
with them (docs/math.md §2.2, §6.1), in ATen ops only so that AOTAutograd traces them.

Input position i reaches the output through tap k, along one dimension, iff
``0 <= i s - p + k d < n_out``; the 3-d reach is the product of the three dimensions' masks.
Both contractions apply one mask at a time, so their work is about x's size times a kernel
extent, and no tensor of the convolution output's size is made.

Dtypes: the contractions along W and H, whose operands hold x's planes, run in x's dtype (the
0/1 masks are exact in any dtype), so that no copy of x is made in a wider one; the one along
D and the tap-sized results are in the caller's compute dtype.
"""
import torch
from torch import Tensor


def tap_masks(x: Tensor, weight: Tensor, out_size, conv: dict, dtype: torch.dtype) -> list:
    """[M_D, M_H, M_W], M[k, i] = 1 where x's position i reaches the output through tap k and
    0 elsewhere, in `dtype` on x's device. `conv` holds stride, padding and dilation;
    `out_size` ([Do, Ho, Wo]) carries the output padding, which enters only there."""
    masks = []
    for d in range(3):
        taps = torch.arange(weight.shape[2 + d], device=x.device).unsqueeze(1)
        inputs = torch.arange(x.shape[2 + d], device=x.device)
        at = inputs * conv["stride"][d] - conv["padding"][d] + taps * conv["dilation"][d]
        masks.append(((at >= 0) & (at < out_size[d])).to(dtype))
    return masks


def box_sums(x: Tensor, masks: list, dtype: torch.dtype) -> Tensor:
    """T[b, ci, kd, kh, kw] = sum_{i, j, l} x[b, ci, i, j, l] M_D[kd, i] M_H[kh, j] M_W[kw, l],
    in `dtype`."""
    mask_d, mask_h, mask_w = masks
    t = torch.matmul(x, mask_w.to(x.dtype).t())  # [B, Ci, D, H, kW]
    t = torch.einsum("bcdhw,kh->bcdkw", t, mask_h.to(x.dtype))
    return torch.einsum("bcdhw,kd->bckhw", t.to(dtype), mask_d)


def spread(taps: Tensor, masks: list, dtype: torch.dtype) -> Tensor:
    """box_sums' transpose: out[b, ci, i, j, l] = sum_k taps[b, ci, kd, kh, kw] M_D[kd, i]
    M_H[kh, j] M_W[kw, l], on x's grid, in `dtype` (x's)."""
    mask_d, mask_h, mask_w = masks
    t = torch.einsum("bckhw,kd->bcdhw", taps, mask_d).to(dtype)  # [B, Ci, D, kH, kW]
    t = torch.einsum("bcdkw,kh->bcdhw", t, mask_h.to(dtype))
    return torch.matmul(t, mask_w.to(dtype))
