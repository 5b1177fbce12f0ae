"""Training mode's backward without the convolution output (docs/math.md §6.2.2), for stride
1 without padding or output padding (any dilation, groups).

The gradient wrt the convolution output y is affine in y per channel,
``dL/dy[b, c, o] = A[b, c] + K_c (y[b, c, o] - mean_c)``. The A part is a field constant over
a sample's positions: with padding 0 its gradients are products of x's and the weight's sums
(``_autograd.py``). The K part needs y, but only through linear maps of it: on a frequency
grid as large as the full output (where the transposed convolution is a product and nothing
wraps), ``Y = W X`` per frequency, the x gradient is ``conj(W) K Y`` and the weight gradient
is x's cross-spectrum with ``K Y`` read back at the kernel's taps. y is never formed in
space; the grid is walked in slabs of its first dimension, so that neither the weight's
spectrum nor Y is ever whole, and x's gradient spectrum is written over x's as the slabs are
done. y's statistics and per-sample sums (float64) are those the forward kept
(``_kept_output.forward_statistics``), or ``ct_bn_pool_stats``'s where it kept none (a forced
algorithm, synchronized statistics).

ATen ops only (AOTAutograd traces them). Complex in the compute dtype (float32 for float16,
bfloat16 and float32 inputs; float64 for float64).
"""
import math

import torch
from torch import Tensor


# Bytes of one slab's tensors (the weight's spectrum, Y and its products) aimed at: fewer
# slabs issue fewer ops (each slab is about 25), larger ones hold more memory.
SLAB_BYTES = 256 << 20


def supported(conv: dict, weight: Tensor = None) -> bool:
    """Stride 1, no padding, no output padding: the output is x's full transposed
    convolution, which a product of spectra gives exactly (any weight)."""
    return (all(s == 1 for s in conv["stride"]) and not any(conv["padding"])
            and not any(conv["output_padding"]))


def _full_size(x: Tensor, weight: Tensor, dilation) -> list:
    return [x.shape[2 + d] + dilation[d] * (weight.shape[2 + d] - 1) for d in range(3)]


def half_spectrum_bins(x: Tensor, weight: Tensor, dilation) -> int:
    """The frequencies the products run over: the full output's grid, the last dimension's
    half spectrum."""
    full = _full_size(x, weight, dilation)
    return full[0] * full[1] * (full[2] // 2 + 1)


def _bases(full, weight: Tensor, dilation, complex_dtype, device) -> list:
    """E_d[f, t] = exp(-2 pi i f t dil_d / n_d) for each frequency f of dimension d (the last
    dimension's half spectrum) and tap t. Angles from integer phases, exact modulo n_d."""
    bases = []
    for d in range(3):
        count = full[d] // 2 + 1 if d == 2 else full[d]
        f = torch.arange(count, device=device, dtype=torch.int64).unsqueeze(1)
        t = torch.arange(weight.shape[2 + d], device=device, dtype=torch.int64) * dilation[d]
        phase = torch.remainder(f * t, full[d]).to(torch.float64) * (-2 * math.pi) / full[d]
        bases.append(torch.polar(torch.ones_like(phase), phase).to(complex_dtype))
    return bases


def _half_weights(full_last: int, device, dtype) -> Tensor:
    """Each half-spectrum bin's count in the full spectrum: 1 for 0 (and n/2 for even n), 2
    for the rest, whose mirror images are their conjugates."""
    # From an arange on the device: an indexed store of a Python number copies a host tensor,
    # which torch.cuda.graph capture refuses.
    bins = torch.arange(full_last // 2 + 1, device=device)
    single = (bins == 0) | (2 * bins == full_last)
    return torch.where(single, 1.0, 2.0).to(dtype)


class Grid:
    """The frequency grid and the operands every slab reads. Layouts are frequency-major,
    ``[G, F, rows, cols]`` contiguous, so that each product is one batched GEMM."""

    def __init__(self, x: Tensor, weight: Tensor, conv: dict, compute: torch.dtype):
        self.groups = conv["groups"]
        self.full = _full_size(x, weight, conv["dilation"])
        self.positions = self.full[0] * self.full[1] * self.full[2]
        self.complex = torch.complex128 if compute == torch.float64 else torch.complex64
        self.bases = _bases(self.full, weight, conv["dilation"], self.complex, x.device)
        self.plane = self.bases[1].shape[0] * self.bases[2].shape[0]  # bins per row
        # The inverse DFT's bases [taps, bins]; the last dimension's also counts each bin of
        # the half spectrum as often as the full spectrum holds it (here, not in a pass over
        # each slab).
        e0, e1, e2 = (b.conj().t() for b in self.bases)
        self.inverse = (e0, e1, e2 * _half_weights(self.full[2], x.device, compute))
        spectrum = torch.fft.rfftn(x.to(compute), s=self.full, dim=(2, 3, 4))
        # [G, n0 * n1 * (n2/2+1), B, Ci/G]
        self.x_spectrum = spectrum.unflatten(1, (self.groups, -1)).permute(
            1, 3, 4, 5, 0, 2).flatten(1, 3).contiguous()
        self.batch, self.in_group = x.shape[0], x.shape[1] // self.groups
        self.out_group = weight.shape[1]
        self.kernel = tuple(weight.shape[2:])
        # The taps first, each output-channel column after: [kD, kH, kW, G * Ci/G * Co/G].
        self.weight = weight.to(compute).unflatten(0, (self.groups, -1)).permute(
            3, 4, 5, 0, 1, 2).flatten(3).to(self.complex)
        per_row = self.plane * spectrum.element_size() * (
            self.groups * self.in_group * self.out_group
            + self.batch * (self.in_group + 2 * self.out_group) * self.groups)
        self.rows = max(1, min(self.full[0], SLAB_BYTES // max(per_row, 1)))

    def slabs(self):
        for start in range(0, self.full[0], self.rows):
            yield start, min(start + self.rows, self.full[0])

    def weight_spectrum(self, start: int, stop: int) -> Tensor:
        """W[g, f, i, o] on the slab's frequencies (flattened): [G, F, Ci/G, Co/G]. One
        dimension at a time, the slab's rows first (the fewest)."""
        e0, e1, e2 = self.bases
        kd, kh, kw = self.kernel
        w = torch.matmul(e0[start:stop], self.weight.flatten(1))  # [s, kh kw M]
        w = torch.matmul(e1, w.unflatten(1, (kh, -1)))  # [s, n1, kw M]
        w = torch.matmul(e2, w.unflatten(2, (kw, -1)))  # [s, n1, n2h, M]
        w = w.unflatten(3, (self.groups, self.in_group, self.out_group))
        return w.permute(3, 0, 1, 2, 4, 5).flatten(1, 3).contiguous()

    def x_slab(self, start: int, stop: int) -> Tensor:
        """X[g, f, b, i] on the slab's frequencies: [G, F, B, Ci/G]."""
        return self.x_spectrum[:, start * self.plane:stop * self.plane]

    def taps(self, spectrum: Tensor, start: int, stop: int) -> Tensor:
        """The inverse DFT of a Hermitian spectrum's slab ``[G, F, I, O]`` at the kernel's taps
        only, times the grid size and before its real part: ``[G, kD, kH, kW, I, O]``."""
        e0, e1, e2 = self.inverse  # [taps, bins]
        rows, n1 = stop - start, e1.shape[1]
        s = spectrum.flatten(2)  # [G, F, I O]
        s = torch.matmul(e2, s.unflatten(1, (rows * n1, -1)))  # [G, s n1, kw, I O]
        s = torch.matmul(e1, s.unflatten(1, (rows, n1)).flatten(3))  # [G, s, kh, kw I O]
        s = torch.matmul(e0[:, start:stop], s.flatten(2))  # [G, kd, kh kw I O]
        return s.unflatten(2, (*self.kernel[1:], self.in_group, self.out_group))

    def product(self, start: int, stop: int):
        """(X, W, Y = X W) on the slab: [G, F, B, I], [G, F, I, O], [G, F, B, O]."""
        xs, ws = self.x_slab(start, stop), self.weight_spectrum(start, stop)
        return xs, ws, torch.matmul(xs, ws)


def _centered_dc(y: Tensor, dc: Tensor) -> Tensor:
    """The first slab of y [G, F, B, O] with its zero-frequency bin replaced by `dc`
    ([G, B, O]): the spectrum of y minus its batch mean, computed exactly from the sums
    rather than as a difference of two large bins."""
    return torch.cat([dc.unsqueeze(1).to(y.dtype), y[:, 1:]], dim=1)


def k_part(grid: Grid, k: Tensor, centered_sums: Tensor, x_size, need_x: bool,
           need_weight: bool):
    """The gradients of K_c (y - mean_c): (x's [B, Ci, *x_size] or None, the weight's or
    None). ``k``: [C]; ``centered_sums``: sum_o (y - mean) per sample, [B, C]."""
    groups = grid.groups
    k = k.to(grid.complex).view(groups, 1, 1, -1)  # on y's [G, F, B, O]
    dc = centered_sums.view(-1, groups, grid.out_group).transpose(0, 1)  # [G, B, O]
    # x's gradient spectrum, [G, F, B, I], is written over x's slab by slab: once a slab is done
    # its part of x's spectrum is read no more (one spectrum-sized tensor instead of two). No
    # double backward differentiates this (the route rule takes "aten" there).
    w_grad = None
    for start, stop in grid.slabs():
        xs, ws, y = grid.product(start, stop)
        if start == 0:
            y = _centered_dc(y, dc)
        ky = y * k
        if need_weight:
            taps = grid.taps(torch.matmul(xs.mH, ky), start, stop)
            w_grad = taps if w_grad is None else w_grad + taps
        if need_x:
            xs.copy_(torch.matmul(ky, ws.mH))
    x_grad = None
    if need_x:
        spectrum = grid.x_spectrum.unflatten(1, (*grid.full[:2], -1))
        spectrum = spectrum.permute(4, 0, 5, 1, 2, 3).flatten(1, 2)  # [B, Ci, n0, n1, n2h]
        full = torch.fft.irfftn(spectrum, s=grid.full, dim=(2, 3, 4))
        x_grad = full[:, :, :x_size[0], :x_size[1], :x_size[2]]
    if need_weight:
        # [G, kD, kH, kW, I, O] -> the weight's [G I, O, kD, kH, kW]
        w_grad = (w_grad.real / grid.positions).permute(0, 4, 5, 1, 2, 3).flatten(0, 1)
    return x_grad, w_grad
