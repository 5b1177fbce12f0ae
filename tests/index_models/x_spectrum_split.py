"""A numpy model of csrc/x_spectrum/cuda/x_spectrum_dft.cu's arithmetic (its tables as build_tables
lays them out, the W stage's split by 2 of a real row, the H stage's split by a radix of 4,
2 or 1 with split_outputs' butterflies, its flat indexing of the plane spectrum, the transposed
H table and t,
the D stage's radix 2), checked against numpy's rfftn on small shapes, including H not a
multiple of the radix. It checks the index algebra of the kernels' tables, not the kernels:
only the CUDA tests on a GPU do that.

    (run by tests/test_index_models.py)
"""
import numpy as np


def dft_matrix(size, rows, step, cols):
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return np.exp(-2j * np.pi * ((r * c * step) % size) / size)


def axis(grid, inputs, most):
    radix = 4 if most >= 4 and grid % 4 == 0 else 2 if most >= 2 and grid % 2 == 0 else 1
    return radix, grid // radix, (inputs + radix - 1) // radix


def split_outputs(radix, z, twiddles, rows, j):
    y = [z[0]] + [twiddles[(c - 1) * rows + j] * z[c] for c in range(1, radix)]
    if radix == 1:
        return [y[0]]
    if radix == 2:
        return [y[0] + y[1], y[0] - y[1]]
    s02, d02, s13, d13 = y[0] + y[2], y[0] - y[2], y[1] + y[3], y[1] - y[3]
    return [s02 + s13, d02 - 1j * d13, s02 - s13, d02 + 1j * d13]


def w_stage(rows, lw):
    """plane_dft's W stage: the real DFT of each row to Lw / 2 + 1 bins; split by 2 where Lw is
    even, only the bins k <= L2 / 2 (L2 = Lw / 2) of the sums E (even w) and O (odd w), each k
    giving X(k) = E + t^k O and X(L2 - k) = conj(E - t^k O)."""
    w = rows.shape[1]
    lwf = lw // 2 + 1
    radix, l2, cols = axis(lw, w, 2)
    if radix == 1:
        return rows @ dft_matrix(lw, w, 1, lwf)
    bins = l2 // 2 + 1
    padded = np.zeros((rows.shape[0], cols * radix))
    padded[:, :w] = rows  # the kernel's zero pad column for odd W
    table = dft_matrix(lw, cols, radix, bins)
    e, o = padded[:, 0::2] @ table, (padded[:, 1::2] @ table) * dft_matrix(lw, 2, 1, bins)[1]
    out = np.zeros((rows.shape[0], lwf), complex)
    for k in range(bins):
        out[:, k] = e[:, k] + o[:, k]
        out[:, l2 - k] = np.conj(e[:, k] - o[:, k])
    return out


def spectrum(x, grid):
    d, h, w = x.shape
    ld, lh, lw = grid
    lwf = lw // 2 + 1
    plane = w_stage(x.reshape(d * h, w), lw).reshape(d, h, lwf)
    radix, rows, cols = axis(lh, h, 4)
    table = dft_matrix(lh, rows, radix, cols)
    twiddles = dft_matrix(lh, radix, 1, rows)[1:].reshape(-1)
    padded = np.zeros((d, cols * radix, lwf), complex)
    padded[:, :h] = plane
    t = np.zeros((d, lh, lwf), complex)
    for j in range(rows):
        z = [np.einsum("c,dcf->df", table[j], padded[:, c::radix]) for c in range(radix)]
        for m, out in enumerate(split_outputs(radix, z, twiddles, rows, j)):
            t[:, j + m * rows] = out
    radix_d, rows_d, cols_d = axis(ld, d, 2)
    table_d = dft_matrix(ld, rows_d, radix_d, cols_d)
    t_padded = np.zeros((cols_d * radix_d, lh, lwf), complex)
    t_padded[:d] = t
    out = np.zeros((ld, lh, lwf), complex)
    for j in range(rows_d):
        z = [np.einsum("c,chf->hf", table_d[j], t_padded[c::radix_d]) for c in range(radix_d)]
        tw = np.exp(-2j * np.pi * np.arange(1, radix_d)[:, None] * np.arange(rows_d)[None, :] / ld).reshape(-1)
        for m, o in enumerate(split_outputs(radix_d, z, tw, rows_d, j)):
            out[j + m * rows_d] = o
    return out


def spec_offset(radix, h, fw, lwf):
    """plane_dft's plane spectrum layout: the H stage's radix inputs h = R g + c adjacent."""
    return (h // radix * lwf + fw) * radix + h % radix


def h_stage_flat(plane, lh, ci, freq_tile=3):
    """plane_dft's H stage on flat buffers as the kernel indexes them: the plane spectrum at
    spec_offset, the H table transposed [cols, rows] then its twiddles, then whatever follows
    in shared memory (read for rows past the last, never stored), and t's entries at
    out + i t_freq + k t_bin + m t_split. Returns t [lh, lwf] of one channel of ci."""
    h, lwf = plane.shape
    radix, rows, cols = axis(lh, h, 4)
    spec = np.full(cols * radix * lwf + 2, np.nan, complex)
    for hh in range(cols * radix):
        for fw in range(lwf):
            spec[spec_offset(radix, hh, fw, lwf)] = plane[hh, fw] if hh < h else 0
    table = np.concatenate([dft_matrix(lh, rows, radix, cols).T.reshape(-1),
                            dft_matrix(lh, radix, 1, rows)[1:].reshape(-1), np.full(3, np.nan)])
    twiddles = table[rows * cols:]
    half = (lwf + 1) // 2
    t_freq, t_bin = lwf * ci, half * ci
    t_split = rows * t_freq
    t = np.full(lh * lwf * ci, np.nan, complex)
    plane_ci = ci - 1  # the channel's place in t
    for j0 in range(0, rows, freq_tile):
        for fw_a in range(half):
            fw_b = min(fw_a + half, lwf - 1)
            z = np.zeros((2, freq_tile, radix), complex)
            for col in range(cols):
                for k, fw in enumerate((fw_a, fw_b)):
                    base = col * radix * lwf + fw * radix
                    v = spec[base:base + radix]
                    f = table[col * rows + j0:col * rows + j0 + freq_tile]
                    with np.errstate(invalid="ignore"):
                        z[k] += f[:, None] * v[None, :]
            out = j0 * t_freq + fw_a * ci + plane_ci
            for i in range(freq_tile):
                if j0 + i >= rows:
                    continue
                for k in range(2):
                    if k == 1 and fw_a + half >= lwf:
                        continue
                    y = split_outputs(radix, list(z[k, i]), twiddles, rows, j0 + i)
                    for m in range(radix):
                        t[out + i * t_freq + k * t_bin + m * t_split] = y[m]
    return t.reshape(lh, lwf, ci)[:, :, plane_ci]


H_STAGE_CASES = [(32, 36, 19), (7, 8, 4), (9, 12, 5), (5, 9, 7), (6, 10, 6), (3, 4, 3), (1, 4, 2),
                 (13, 16, 9)]
SPECTRUM_CASES = [((4, 7, 6), (6, 8, 8)), ((5, 9, 13), (6, 12, 16)), ((3, 5, 4), (5, 9, 7)),
                  ((2, 6, 5), (4, 10, 9)), ((3, 3, 3), (4, 4, 5)), ((2, 1, 3), (3, 4, 4)),
                  ((16, 32, 32), (20, 36, 36)), ((2, 3, 7), (3, 4, 12)), ((2, 3, 6), (3, 4, 6)),
                  ((2, 3, 1), (3, 4, 2)), ((2, 3, 16), (3, 4, 20))]


def run_h_stage(case, seed=1):
    """The H stage over flat buffers against numpy's FFT of a plane."""
    h, lh, lwf = case
    rng = np.random.default_rng(seed)
    plane = rng.standard_normal((h, lwf)) + 1j * rng.standard_normal((h, lwf))
    ref = np.fft.fft(plane, n=lh, axis=0)
    err = np.abs(h_stage_flat(plane, lh, ci=3) - ref).max()
    assert err < 1e-9, (case, err)


def run_spectrum(case, seed=1):
    """The three stages against numpy's rfftn of x on its grid."""
    shape, grid = case
    x = np.random.default_rng(seed).standard_normal(shape)
    err = np.abs(spectrum(x, grid) - np.fft.rfftn(x, s=grid, axes=(0, 1, 2))).max()
    assert err < 1e-9, (case, err)
