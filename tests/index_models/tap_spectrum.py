"""A numpy model of csrc/cross_spectrum/cuda/cross_spectrum_tap_spectrum.cu's index arithmetic (docs/math.md §3.5). A block
takes a tile of 32 columns (a lane each) and one depth bin b_d <= M_d / 2: WeightTaps stages
the tile's taps in shared memory (a column's values at an odd stride), each warp forms the
depth sums of its rows k_h of the plane, and then each warp takes a pair of h bins
(p, M_h - p): the sums over k_h with the real and imaginary parts of row p of the h table
(A, B), the rows A + iB and A - iB, and per b_w the four real sums of products of each row
that give W at (b_d, +-p, b_w) and, the taps being real, at (-b_d, -+p, b_w). Stores go
through two row offsets per thread, stepped by one bin per b_w (the imaginary part w_cols
further), a row's mirror at the other row's offset plus one shift per b_d. Checked against
numpy's FFT of the taps zero-padded to the grid M = 2k' - 1, in the [bins, rows, 2, C / rows]
layout the kernel writes (rows: the complex rows of W, G Cig on the path, each a row of real
parts and one of imaginary parts), with the taps read as WeightTaps
reads them (a chunk of output channels of a weight [Ci, Co, k'd, k'h, k'w]: a tile within one
row of the weight with an odd k'd k'h k'w as one run split among the warps, else a column at a
time) and as StackTaps does (the float64 stack [k'd, k'h, k'w, C]).

    (run by tests/test_index_models.py)
"""
import numpy as np

TILE, MAX_WARPS = 32, 8


def dft(size, bins, taps):
    """[bins, taps]: exp(-2 pi i ((b k) mod size) / size), as tap_dft builds it."""
    turns = (np.arange(bins)[:, None] * np.arange(taps)[None, :]) % size
    return np.exp(-2j * np.pi * turns / size)


class WeightTaps:
    """The weight's chunk of output channels c0 .. c0 + n - 1, read in place: column col is
    (col // n, col % n) of the weight's channel dims, its k'd k'h k'w taps together."""

    def __init__(self, weight, c0, n):
        self.flat = weight.reshape(-1)
        ci, co, kd, kh, kw = weight.shape
        self.values = kd * kh * kw
        self.row_cols, self.row_stride, self.col_stride = n, co * self.values, self.values
        self.start = c0 * self.values
        self.cols = ci * n
        self.runs = 0  # tiles staged as one run

    def column(self, col):
        return self.start + col // self.row_cols * self.row_stride + col % self.row_cols * self.col_stride

    def stage(self, col0, warps):
        """The tile's staged values as the warps copy them: [32 stride], a column's at j stride."""
        stride = self.values | 1
        staged = np.full(TILE * stride, np.nan)
        tile_cols = min(TILE, self.cols - col0)
        one_run = (stride == self.values and self.col_stride == self.values
                   and col0 // self.row_cols == (col0 + tile_cols - 1) // self.row_cols)
        if one_run:  # the tile's values one run, a part per warp, the lanes over it
            count = tile_cols * self.values
            part = -(-count // (warps * 32)) * 32
            first = self.column(col0)
            for warp in range(warps):
                for e in range(warp * part, min(count, (warp + 1) * part)):
                    staged[e] = self.flat[first + e]
        else:  # each warp a column at a time, the lanes over its values
            for j in range(tile_cols):
                src = self.column(col0 + j)
                for e in range(self.values):
                    staged[j * stride + e] = self.flat[src + e]
        self.runs += one_run
        return lambda lane, e: staged[lane * stride + e]


class StackTaps:
    """The float64 stack [k'd, k'h, k'w, cols], read where it lies: tap e of column col at e cols + col."""

    def __init__(self, stack):
        self.flat = stack.reshape(-1)
        self.cols = stack.shape[3]

    def stage(self, col0, warps):
        return lambda lane, e: self.flat[e * self.cols + col0 + lane]


def kernel_model(taps, shape, rows):
    kd, kh, kw = shape
    cols = taps.cols
    md, mh = 2 * kd - 1, 2 * kh - 1
    e_d, e_h, e_w = dft(md, md, kd), dft(mh, mh, kh), dft(2 * kw - 1, kw, kw)
    w_cols = cols // rows
    bins = md * mh * kw
    out = np.full(bins * 2 * cols, np.nan)  # [bins, G, 2, group_cols], flat
    warps = min(kh, MAX_WARPS)
    plane_taps = kh * kw
    bin_stride = 2 * cols
    for col0 in range(0, cols, TILE):
        tap = taps.stage(col0, warps)
        lanes = range(min(TILE, cols - col0))
        for bd in range(kd):  # blockIdx.y
            plane = np.full((plane_taps, TILE), np.nan, dtype=complex)
            for warp in range(warps):  # the depth sums of rows warp, warp + warps, ...
                for h in range(warp, kh, warps):
                    for lane in lanes:
                        for w in range(kw):
                            plane[h * kw + w, lane] = sum(e_d[bd, d] * tap(lane, d * plane_taps + h * kw + w)
                                                          for d in range(kd))
            # (b_d, b_h, 0) at column + bin_stride (b_d M_h + b_h) k'w; (M_d - b_d, b_h, 0) mirror further
            row_stride = mh * kw * bin_stride
            mirror = ((md - bd) % md - bd) * row_stride
            for warp in range(warps):  # the pairs of h bins (p, M_h - p)
                for p in range(warp, kh, warps):
                    for lane in lanes:
                        col = col0 + lane
                        first = col + col // w_cols * w_cols + bd * row_stride
                        q = plane[:, lane].reshape(kh, kw)
                        if p == 0:  # one row, complex products; its own mirror row
                            row_sums = [e_h[0] @ q]
                            bins_ = [first, first]
                        else:
                            a = e_h[p].real @ q
                            b = e_h[p].imag @ q
                            row_sums = [a + 1j * b, a - 1j * b]
                            bins_ = [first + p * kw * bin_stride, first + (mh - p) * kw * bin_stride]
                        for bw in range(kw):
                            e = e_w[bw]
                            for r, row in enumerate(row_sums):
                                rr = (e.real * row.real).sum()
                                ii = (e.imag * row.imag).sum()
                                ri = (e.real * row.imag).sum()
                                ir = (e.imag * row.real).sum()
                                at = bins_[r]
                                out[at], out[at + w_cols] = rr - ii, ri + ir  # e row
                                if bd != 0:  # e conj(row): the other row's bin, shifted by mirror
                                    at = bins_[1 - r] + mirror
                                    out[at], out[at + w_cols] = rr + ii, ir - ri
                            bins_ = [at_ + bin_stride for at_ in bins_]
    return out.reshape(bins, rows, 2, w_cols)


def reference(taps, rows):
    kd, kh, kw, cols = taps.shape
    padded = np.pad(taps, ((0, kd - 1), (0, kh - 1), (0, kw - 1), (0, 0)))
    spectrum = np.fft.fftn(padded, axes=(0, 1, 2))[:, :, :kw].reshape(-1, rows, cols // rows)
    return np.stack([spectrum.real, spectrum.imag], axis=2)


# (weight shape, rows, the chunk's first output channel and count): 65 columns (a last tile
# of one column); k'd k'h k'w = 125 (odd), 24 and 16 (even: a padded stride), 3 and 1; k'h of
# 1, 5 and 10 (two pairs of h bins on warp 0 and 1: more pairs than warps); chunks from
# channel 0 and past it (tiles across the weight's rows); tiles within one row of odd k'd k'h
# k'w (one run: 2 of the second last weight's 3 tiles, all 6 of the last's); complex rows of 1
# to 3 (several channels' columns a row, as P n with P phases), and each case again with a
# row per channel (Ci: G Cig, the path's with one phase).
CASES = [((13, 5, 5, 5, 5), 1, 0, 5), ((4, 7, 3, 2, 4), 2, 2, 4), ((8, 3, 1, 3, 1), 1, 0, 3),
         ((6, 2, 2, 1, 8), 3, 1, 1), ((3, 24, 1, 10, 1), 3, 0, 24), ((40, 1, 1, 2, 8), 2, 0, 1),
         ((2, 50, 2, 2, 4), 1, 3, 40), ((2, 40, 3, 3, 3), 1, 0, 40), ((3, 64, 1, 3, 5), 2, 0, 64)]


def run(case, seed=0):
    """The model against numpy's FFT for one case, both taps sources, both row counts."""
    shape, some_rows, c0, n = case
    weight = np.random.default_rng(seed).standard_normal(shape)
    stack = weight[:, c0:c0 + n].transpose(2, 3, 4, 0, 1).reshape(*shape[2:], -1)  # [k'd, k'h, k'w, Ci n]
    for rows in (some_rows, shape[0]):
        expected = reference(stack, rows)
        for name, taps in [("WeightTaps", WeightTaps(weight, c0, n)), ("StackTaps", StackTaps(stack))]:
            model = kernel_model(taps, shape[2:], rows)
            assert not np.isnan(model).any(), f"{shape} {name}: a bin the model never wrote"
            error = np.abs(model - expected).max()
            assert error < 1e-12, (shape, rows, name, error)
