"""A numpy model of csrc/cuda/tap_spectrum.cu's index arithmetic (docs/math.md §3.5): one
"thread" per column and depth bin b_d <= M_d / 2, its plane of depth sums, per b_h the k'w
values over k_h, and per b_w the four real sums of products that give W(b_d, b_h, b_w) and,
the taps being real, W(-b_d, -b_h, b_w). Checked against numpy's FFT of the taps zero-padded
to the grid M = 2k' - 1, in the [bins, G, 2, C] layout the kernel writes.

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


def reference(taps, groups):
    kd, kh, kw, cols = taps.shape
    padded = np.pad(taps, ((0, kd - 1), (0, kh - 1), (0, kw - 1), (0, 0)))
    spectrum = np.fft.fftn(padded, axes=(0, 1, 2))[:, :, :kw].reshape(-1, groups, cols // groups)
    return np.stack([spectrum.real, spectrum.imag], axis=2)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    worst = 0.0
    for shape, groups in [((5, 5, 5, 6), 1), ((3, 2, 4, 8), 2), ((1, 3, 1, 4), 1), ((2, 1, 8, 3), 3)]:
        taps = rng.standard_normal(shape)
        model = kernel_model(taps, groups)
        assert not np.isnan(model).any(), f"{shape}: a bin the model never wrote"
        error = np.abs(model - reference(taps, groups)).max()
        print(f"taps {shape}, groups {groups}: largest difference {error:.1e}")
        worst = max(worst, error)
    assert worst < 1e-12, worst
