"""Training mode's backward without the convolution output (docs/math.md §6.2.2), for stride
1 without padding or output padding (any dilation, groups).

The gradient wrt the convolution output y is affine in y per channel,
``dL/dy[b, c, o] = A[b, c] + K_c (y[b, c, o] - mean_c)``. The A part is a field constant over
a sample's positions: with padding 0 its gradients are products of x's and the weight's sums
(``_autograd.py``). The K part needs y only through two small kernels over the lags d
(|d| < k per dim, in units of the dilation):

- the weight's gradient is x's channel cross-correlation R at those lags correlated with the
  weight, ``k_c sum_{j, u} R[j, i, u - t] w[j, c, u]`` plus a term of the sums: R^ as the
  forward's ``cross_spectrum`` path makes it (``_ct_bn_pool_lag_spectrum``, §3.5) times the
  weight's spectrum on the lags' grid 2k - 1, where neither wraps;
- x's gradient is ``conj(W) K (Y - mean)`` per frequency of the full output's grid (where the
  transposed convolution is a product and nothing wraps), Y = W X: either through W itself
  (two products per bin, B Cig Cog each) or through the weight's Gram kernel
  ``M[i, j, d] = sum_c k_c sum_u w[i, c, u] w[j, c, u + d]`` on the lags, whose spectrum
  ``W K W^H`` takes X to x's gradient in one product of B Cig^2 (cheaper where Cig is small
  against Cog). The zero-frequency bin, where the mean cancels, is set from y's centred sums.

y is never formed in space. x's spectrum is the one R^ is made from (the op returns both: one
pass over x, whose temporaries are a slice of the batch's). The grid is walked in slabs of its
first dimension, so that the operator's spectrum (W's or M's) is never whole, and x's gradient
spectrum is written over x's as the slabs are done. y's statistics and per-sample sums
(float64) are those the forward kept (``_kept_output.forward_statistics``), or
``ct_bn_pool_stats``'s where it kept none (a forced algorithm, synchronized statistics).

ATen ops and the library's ops only (AOTAutograd traces them). x's spectrum is complex in the
compute dtype (float32 for float16, bfloat16 and float32 inputs; float64 for float64); the
lags' grid, small, in float64.
"""
import math

import torch
from torch import Tensor

# Bytes of one slab's tensors (the operator's spectrum and the products) aimed at: fewer
# slabs issue fewer ops (each slab is about 15), larger ones hold more memory.
SLAB_BYTES = 256 << 20
# x's gradient through "gram" (M) or "weight" (W); "auto": the one of fewer multiply-adds
# (_x_by_gram). A testing knob (the tests run both).
X_OPERATOR = "auto"
_LAG_DIMS = (0, 1, 2)


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


def _x_costs(batch: int, in_group: int, out_group: int, kernel) -> tuple:
    """x's gradient's complex multiply-adds per bin of the full grid and group, through M and
    through W: M's spectrum (2k_w - 1 lags in the last stage of its DFT) and one product,
    ``(2 k_w - 1 + B) Cig^2``, against W's (k_w taps) and two, ``(k_w + 2 B) Cig Cog``."""
    return ((2 * kernel[2] - 1 + batch) * in_group * in_group,
            (kernel[2] + 2 * batch) * in_group * out_group)


def _x_by_gram(batch: int, in_group: int, out_group: int, kernel) -> bool:
    if X_OPERATOR != "auto":
        return X_OPERATOR == "gram"
    by_gram, by_weight = _x_costs(batch, in_group, out_group, kernel)
    return by_gram <= by_weight


def products_per_bin(x: Tensor, weight: Tensor, groups: int) -> int:
    """The route's complex multiply-adds per bin of the full grid: x's gradient's (the cheaper
    operator) and R^'s cross-spectrum (§3.5: ``(B + k_h) Cig^2``), over the groups."""
    batch, cig, cog = x.shape[0], x.shape[1] // groups, weight.shape[1]
    return groups * (min(_x_costs(batch, cig, cog, weight.shape[2:]))
                     + (batch + weight.shape[3]) * cig * cig)


def _bases(full, taps, positions, dilation, complex_dtype, device) -> list:
    """E_d[f, t] = exp(-2 pi i f p_d(t) dil_d / n_d) for each frequency f of dimension d (the
    last dimension's half spectrum) and index t of a kernel at positions ``p_d(t) = t`` below
    ``positions[d]`` and ``t - (its size)`` from it (lags wrapped on their grid). Angles from
    integer phases, exact modulo n_d."""
    bases = []
    for d in range(3):
        count = full[d] // 2 + 1 if d == 2 else full[d]
        f = torch.arange(count, device=device, dtype=torch.int64).unsqueeze(1)
        t = torch.arange(taps[d], device=device, dtype=torch.int64)
        if positions[d] < taps[d]:
            t = torch.where(t < positions[d], t, t - taps[d])
        t = t * dilation[d]
        phase = torch.remainder(f * t, full[d]).to(torch.float64) * (-2 * math.pi) / full[d]
        bases.append(torch.polar(torch.ones_like(phase), phase).to(complex_dtype))
    return bases


# The bases by geometry, dtype and device: a dozen ATen ops per dimension to build, the same for
# every call of a geometry. Kept as the C++ table cache keeps its tables
# (csrc/common/table_cache.h): at most _MAX_BASES geometries (past them a call builds its own),
# built complete before they are kept (so that any stream may read them) and never kept while a
# CUDA graph is being captured (whose memory pool would own them) or a graph traced (fake and
# functional tensors, subclasses of Tensor): then the call builds them for itself.
_BASES = {}
_MAX_BASES = 64


def _kept_bases(full, taps, positions, dilation, like: Tensor) -> list:
    """``_bases`` for x's spectrum ``like`` (its dtype and device)."""
    key = (tuple(full), tuple(taps), tuple(positions), tuple(dilation), like.dtype, like.device)
    plain = type(like) is Tensor
    if plain and key in _BASES:
        return _BASES[key]
    bases = _bases(full, taps, positions, dilation, like.dtype, like.device)
    if not plain or len(_BASES) >= _MAX_BASES:
        return bases
    if like.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return bases
        torch.cuda.current_stream(like.device).synchronize()
    _BASES[key] = bases
    return bases


class Grid:
    """x's spectrum on the full output's grid, and an operator's (a kernel of taps, or of lags
    wrapped on their grid, ``_bases``) on the same frequencies, slab by slab. Layouts are
    frequency-major, so that each product is one batched GEMM: the operator's
    ``[G, F, rows, cols]`` contiguous, x's a view ``[G, F, B, Ci/G]`` of its spectrum."""

    def __init__(self, x_spectrum: Tensor, full, conv: dict, operator: Tensor, positions,
                 extra_columns: int):
        """x_spectrum: [n0, n1, n2/2 + 1, B, Ci] on the grid ``full`` (the op's, complex in the
        compute dtype); operator: [G, I, O, *taps] real, its positions as ``_bases`` takes
        them; extra_columns: the slab's product columns per frequency besides the operator's
        and x's (for the memory of a slab)."""
        self.groups, self.full = conv["groups"], full
        self.complex = x_spectrum.dtype
        self.x_spectrum = x_spectrum
        taps = operator.shape[3:]
        self.bases = _kept_bases(full, taps, positions, conv["dilation"], x_spectrum)
        self.plane = x_spectrum.shape[1] * x_spectrum.shape[2]  # bins per row
        self.columns = operator.shape[1:3]
        self.taps = tuple(taps)
        # The taps first, each column after: [t0, t1, t2, G * I * O].
        self.real = torch.float64 if self.complex == torch.complex128 else torch.float32
        self.operator = operator.to(self.real).permute(3, 4, 5, 0, 1, 2).flatten(3).to(self.complex)
        batch, channels = x_spectrum.shape[3:]
        per_row = self.plane * x_spectrum.element_size() * self.groups * (
            self.columns[0] * self.columns[1] + batch * channels // self.groups + extra_columns)
        self.rows = max(1, min(full[0], SLAB_BYTES // max(per_row, 1)))

    def slabs(self):
        for start in range(0, self.full[0], self.rows):
            yield start, min(start + self.rows, self.full[0])

    def operator_spectrum(self, start: int, stop: int) -> Tensor:
        """The operator on the slab's frequencies (flattened): [G, F, I, O]. One dimension at
        a time, the slab's rows first (the fewest)."""
        e0, e1, e2 = self.bases
        _, t1, t2 = self.taps
        w = torch.matmul(e0[start:stop], self.operator.flatten(1))  # [s, t1 t2 M]
        w = torch.matmul(e1, w.unflatten(1, (t1, -1)))  # [s, n1, t2 M]
        w = torch.matmul(e2, w.unflatten(2, (t2, -1)))  # [s, n1, n2h, M]
        w = w.unflatten(3, (self.groups, *self.columns))
        return w.permute(3, 0, 1, 2, 4, 5).flatten(1, 3).contiguous()

    def x_slab(self, start: int, stop: int) -> Tensor:
        """X[g, f, b, i] on the slab's frequencies: [G, F, B, Ci/G], a view of x's spectrum
        (with one group, of contiguous matrices)."""
        rows = self.x_spectrum[start:stop].flatten(0, 2)  # [F, B, Ci]
        return rows.unflatten(2, (self.groups, -1)).permute(2, 0, 1, 3)

    def x_gradient(self, x_size) -> Tensor:
        """x's gradient from its spectrum (written over x's): [B, Ci, *x_size], contiguous. By
        slices of the batch, so that the inverse FFT's copy of its input and its output on the
        full grid are a slice's, not two more spectrum-sized tensors."""
        batch, channels = self.x_spectrum.shape[3:]
        out = self.x_spectrum.new_empty((batch, channels, *x_size), dtype=self.real)
        # Per sample: the input's copy (complex) and the output (real, the full grid's).
        per_sample = channels * self.full[0] * self.plane * self.x_spectrum.element_size() * 2
        step = max(1, min(batch, SLAB_BYTES // max(per_sample, 1)))
        for b0 in range(0, batch, step):
            spectrum = self.x_spectrum[:, :, :, b0:b0 + step].permute(3, 4, 0, 1, 2)
            full = torch.fft.irfftn(spectrum, s=self.full, dim=(2, 3, 4))
            out[b0:b0 + step] = full[:, :, :x_size[0], :x_size[1], :x_size[2]]
        return out


def _lag_spectrum(weight: Tensor, groups: int) -> Tensor:
    """The weight's DFT on the lags' grid 2k - 1 (float64): [Md, Mh, Mw/2 + 1, G, Cig, Cog],
    the layout of ``_ct_bn_pool_lag_spectrum``."""
    lags = [2 * n - 1 for n in weight.shape[2:]]
    w = weight.to(torch.float64).unflatten(0, (groups, -1))  # [G, Cig, Cog, *k]
    # Contiguous: batched products over a permuted view loop over the batch on the CPU.
    return torch.fft.rfftn(w, s=lags, dim=(3, 4, 5)).permute(3, 4, 5, 0, 1, 2).contiguous()


def _gram_kernel(w_hat: Tensor, k: Tensor, kernel) -> Tensor:
    """M^T on the lags' grid: [G, Cig (j), Cig (i), *lags] float64, lag d at index
    d mod (2k - 1): 0 .. k - 1, then -(k - 1) .. -1."""
    lags = [2 * n - 1 for n in kernel]
    # W K W^H per bin of the lags' grid: M's spectrum there, exact (no lag wraps).
    m_hat = torch.matmul(w_hat * k.view(w_hat.shape[3], 1, -1), w_hat.mH)  # [.., G, j, i]
    return torch.fft.irfftn(m_hat, s=lags, dim=_LAG_DIMS).permute(3, 4, 5, 0, 1, 2)


def _weight_k_part(x: Tensor, weight: Tensor, r_hat: Tensor, w_hat: Tensor, k: Tensor,
                   dc: Tensor, conv: dict) -> Tensor:
    """The weight's gradient of K_c (y - mean_c), float64: k_c times x's R at the lags
    correlated with the weight, ``(R^ W)`` per bin of the lags' grid taken back to the taps,
    plus the sums' term of R that R^ leaves out (§3.5: R^ is the centred R'). ``dc``:
    y's centred sums [B, G, Cog]."""
    groups, kernel = conv["groups"], weight.shape[2:]
    lags = [2 * n - 1 for n in kernel]
    taps = torch.fft.irfftn(torch.matmul(r_hat, w_hat), s=lags, dim=_LAG_DIMS)
    taps = taps[:kernel[0], :kernel[1], :kernel[2]]  # [k0, k1, k2, G, Cig, Cog]
    x_sums = x.sum((2, 3, 4), dtype=torch.float64).unflatten(1, (groups, -1))  # [B, G, Cig]
    full = _full_size(x, weight, conv["dilation"])
    taps = taps + torch.einsum("bgi,bgo->gio", x_sums, dc) / math.prod(full)
    k = k.to(torch.float64).view(groups, 1, -1)
    return (taps * k).permute(3, 4, 5, 0, 1, 2).flatten(0, 1)


def _x_by_gram_kernel(grid: Grid, weight: Tensor, k64: Tensor, dc: Tensor, x_size) -> Tensor:
    """x's gradient of K_c (y - mean_c) by M's spectrum per bin (``grid``'s operator: the Gram
    kernel). ``dc``: y's centred sums [B, G, Cog]."""
    # The zero frequency: sum_c W_ic(0) k_c (Y_c(0) - mean_c |L|), from the centred sums.
    w_sums = weight.to(torch.float64).sum((2, 3, 4)).unflatten(0, (grid.groups, -1))
    dc_x = torch.einsum("gic,bgc->gbi", w_sums * k64.unsqueeze(1), dc).to(grid.complex)
    for start, stop in grid.slabs():
        xs = grid.x_slab(start, stop)
        g = torch.matmul(xs, grid.operator_spectrum(start, stop))
        if start == 0:
            g[:, 0] = dc_x
        xs.copy_(g)
    return grid.x_gradient(x_size)


def _x_by_weight(grid: Grid, k: Tensor, dc: Tensor, x_size) -> Tensor:
    """x's gradient of K_c (y - mean_c) by W's spectrum per bin (``grid``'s operator), twice:
    Y = W X, then W^H K Y. ``dc``: y's centred sums [B, G, Cog]."""
    kc = k.to(grid.complex).view(grid.groups, 1, 1, -1)  # on y's [G, F, B, O]
    for start, stop in grid.slabs():
        xs, ws = grid.x_slab(start, stop), grid.operator_spectrum(start, stop)
        y = torch.matmul(xs, ws)
        if start == 0:  # y's batch mean taken out of its zero frequency exactly
            y[:, 0] = dc.transpose(0, 1)
        # x's gradient spectrum is written over x's slab: once a slab is done its part of
        # x's spectrum is read no more (one spectrum-sized tensor instead of two).
        xs.copy_(torch.matmul(y.mul_(kc), ws.mH))
    return grid.x_gradient(x_size)


def k_part(x: Tensor, weight: Tensor, k: Tensor, centered_sums: Tensor, conv: dict,
           compute: torch.dtype, need_x: bool, need_weight: bool):
    """The gradients of K_c (y - mean_c): (x's [B, Ci, *x_size] or None, the weight's or
    None), in ``compute``. ``k``: [C]; ``centered_sums``: sum_o (y - mean) per sample, [B, C].
    x's spectrum and R^ come from one op, R^ made whether the weight's gradient is asked for
    or not (x's alone is the rare case of a frozen weight under a trained layer). x's
    gradient goes last, through M or W (the cheaper, ``_x_by_gram``), each tensor dropped
    once it is read no more. No double backward differentiates this (the route rule takes
    "aten" there)."""
    groups, kernel = conv["groups"], weight.shape[2:]
    w_hat = _lag_spectrum(weight, groups)
    dc = centered_sums.to(torch.float64).unflatten(1, (groups, -1))  # [B, G, Cog]
    r_hat, x_spectrum = torch.ops.fused_ops._ct_bn_pool_lag_spectrum(
        x, weight, dilation=conv["dilation"], groups=groups)  # [.., G, Cig, Cig], [.., B, Ci]
    w_grad = (_weight_k_part(x, weight, r_hat, w_hat, k, dc, conv).to(compute) if need_weight
              else None)
    del r_hat
    if not need_x:
        return None, w_grad
    batch, cig, cog = x.shape[0], x.shape[1] // groups, weight.shape[1]
    full = _full_size(x, weight, conv["dilation"])
    k64 = k.to(torch.float64).view(groups, -1)
    if _x_by_gram(batch, cig, cog, kernel):
        grid = Grid(x_spectrum, full, conv, _gram_kernel(w_hat, k64, kernel), kernel, cig)
        del w_hat, x_spectrum
        return _x_by_gram_kernel(grid, weight, k64, dc, x.shape[2:]), w_grad
    del w_hat
    grid = Grid(x_spectrum, full, conv, weight.unflatten(0, (groups, -1)), kernel, 2 * cog)
    del x_spectrum
    return _x_by_weight(grid, k, dc, x.shape[2:]), w_grad
