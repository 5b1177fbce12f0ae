"""A numpy model of csrc/cuda/tap_spectrum.cu's index arithmetic (docs/math.md §3.5): one
"thread" per column and depth bin b_d <= M_d / 2, its plane of depth sums, per b_h the k'w
values over k_h, and per b_w the four real sums of products that give W(b_d, b_h, b_w) and,
the taps being real, W(-b_d, -b_h, b_w). Checked against numpy's FFT of the taps zero-padded
to the grid M = 2k' - 1, in the [bins, G, 2, C] layout the kernel writes. The taps come as
WeightTaps stages them: a chunk of output channels of a weight [Ci, Co, k'd, k'h, k'w], each
warp's columns' taps of one k_h by its lanes' turns (staged_taps).

    python scripts/tap_spectrum_check.py
"""
import numpy as np


def dft(size, bins, taps):
    """[bins, taps]: exp(-2 pi i ((b k) mod size) / size), as tap_dft builds it."""
    turns = (np.arange(bins)[:, None] * np.arange(taps)[None, :]) % size
    return np.exp(-2j * np.pi * turns / size)


def kernel_model(taps, groups):
    kd, kh, kw, cols = taps.shape
    md, mh, mw = 2 * kd - 1, 2 * kh - 1, 2 * kw - 1
    bw_count = mw // 2 + 1
    e_d, e_h, e_w = dft(md, md, kd), dft(mh, mh, kh), dft(mw, bw_count, kw)
    group_cols = cols // groups
    out = np.full((md * mh * bw_count, groups, 2, group_cols), np.nan)
    flat = taps.reshape(kd, kh * kw, cols)

    def store(bin_, re, im):
        out[bin_, :, 0, :] = re.reshape(groups, group_cols)
        out[bin_, :, 1, :] = im.reshape(groups, group_cols)

    for bd in range(kd):  # the depth bins b_d <= M_d / 2
        plane = np.einsum("k,ktc->tc", e_d[bd], flat)  # [(k_h, k_w), cols]
        for bh in range(mh):
            row = np.einsum("h,hwc->wc", e_h[bh], plane.reshape(kh, kw, cols))
            mirror = ((md - bd) * mh + (mh - bh) % mh) * bw_count
            for bw in range(bw_count):
                e = e_w[bw][:, None]  # e = a + ib, row = c + id
                ac = (e.real * row.real).sum(0)
                bd_ = (e.imag * row.imag).sum(0)
                ad = (e.real * row.imag).sum(0)
                bc = (e.imag * row.real).sum(0)
                store((bd * mh + bh) * bw_count + bw, ac - bd_, ad + bc)
                if bd != 0:
                    store(mirror + bw, ac + bd_, bc - ad)
    return out


def staged_taps(weight, c0, n):
    """[kd, kh, kw, Ci n]: the taps of output channels c0 .. c0 + n - 1 as WeightTaps's lanes
    stage them, each (j, e) stepped by 32 and read at its column's offset as the kernel forms it."""
    ci, co, kd, kh, kw = weight.shape
    flat, cols = weight.reshape(-1), ci * n
    values, plane_taps, stride = kd * kw, kh * kw, (kd * kw) | 1
    # the column's first tap: r row_stride + c col_stride from the chunk's first value
    start = [c0 * kd * kh * kw + col // n * co * kd * kh * kw + col % n * kd * kh * kw for col in range(cols)]
    taps = np.full((kd, kh, kw, cols), np.nan)
    for warp0 in range(0, cols, 32):
        columns = min(32, cols - warp0)
        for h in range(kh):
            rows = np.full(32 * stride, np.nan)
            for lane in range(32):
                j, e = lane // values, lane % values
                for _ in range(values):
                    if j < columns:
                        rows[j * stride + e] = flat[start[warp0 + j] + h * kw + e // kw * (plane_taps - kw) + e]
                    j, e = j + 32 // values, e + 32 % values
                    if e >= values:
                        j, e = j + 1, e - values
            for lane in range(columns):
                taps[:, h, :, warp0 + lane] = rows[lane * stride:lane * stride + values].reshape(kd, kw)
    return taps


def reference(taps, groups):
    kd, kh, kw, cols = taps.shape
    padded = np.pad(taps, ((0, kd - 1), (0, kh - 1), (0, kw - 1), (0, 0)))
    spectrum = np.fft.fftn(padded, axes=(0, 1, 2))[:, :, :kw].reshape(-1, groups, cols // groups)
    return np.stack([spectrum.real, spectrum.imag], axis=2)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    worst = 0.0
    # (weight shape, groups, the chunk's first output channel and count): 65 columns (a last
    # warp of one column), kd kw = 25, 12, 1 and 16 values per column (a turn of 32 steps j by
    # 1, 2, 32 and 2), chunks from channel 0 and past it
    for shape, groups, c0, n in [((13, 5, 5, 5, 5), 1, 0, 5), ((4, 7, 3, 2, 4), 2, 2, 4), ((8, 3, 1, 3, 1), 1, 0, 3),
                                 ((6, 2, 2, 1, 8), 3, 1, 1)]:
        weight = rng.standard_normal(shape)
        taps = staged_taps(weight, c0, n)
        expected = weight[:, c0:c0 + n].transpose(2, 3, 4, 0, 1).reshape(taps.shape)
        assert np.array_equal(taps, expected), f"{shape}: staged taps differ from the weight's"
        model = kernel_model(taps, groups)
        assert not np.isnan(model).any(), f"{shape}: a bin the model never wrote"
        error = np.abs(model - reference(taps, groups)).max()
        print(f"weight {shape}, channels {c0}..{c0 + n - 1}, groups {groups}: largest difference {error:.1e}")
        worst = max(worst, error)
    assert worst < 1e-12, worst
