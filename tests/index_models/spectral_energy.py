"""A numpy model of csrc/fft/cuda/fft_spectral_energy.cu's small-problem kernel
(small_spectral_energy_kernel, docs/math.md §3.3) and of the host rule that picks it
(small_plan there, small_kernel_pays in csrc/fft/cuda/fft.cpp): the block and thread
index arithmetic, the copies of x and of the taps (piece by piece, 16- or 4-byte), the W2
each block builds from the taps, the depth DFT and products of each thread over its slice
of the input channels, the sum of the slices' parts through shared memory, and the final
sums. Shared memory is modelled as arrays filled with NaN, so a read of anything not
written shows up; the layout's regions are checked for overlap and alignment.

Checked against sum_f |X_f W_f|^2 (DC bin out, rfft bins weighted) with numpy's FFTs of x
and of the dilated weight, and against the centred energy of torch's conv_transpose3d in
float64 where torch is installed. Run in float64 (index arithmetic: <= 1e-12) and in
float32 (the kernel's precision, no FMA here: <= 1e-6).

    (run by tests/test_index_models.py)
"""
import math
from dataclasses import dataclass

import numpy as np

SMS = 132                   # H200
SMEM_LIMIT = 160 << 10      # csrc/fft/cuda/fft.cpp kMaxSmemBytes (the H200's opt-in is larger)
TILE_B, MAX_THREADS, MAX_KD = 8, 384, 8
TAP_BUFFER = 32 << 10
MAX_REREAD = 48 << 20


def up16(v):
    return (v + 15) // 16 * 16


@dataclass
class Case:
    name: str
    batch: int
    ci: int
    co: int
    size: tuple
    kernel: tuple
    groups: int = 1
    dilation: tuple = (1, 1, 1)

    def grid(self):
        return tuple(self.size[d] + self.dilation[d] * (self.kernel[d] - 1) for d in range(3))


def plan(c):
    """small_plan: the kernel's arguments (no pointers), or None where it does not apply."""
    if c.batch > TILE_B or c.kernel[0] > MAX_KD:
        return None
    L = c.grid()
    a = dict(batch=c.batch, ci=c.ci, cig=c.ci // c.groups, cog=c.co // c.groups,
             Ld=L[0], Lh=L[1], Lw=L[2], Lwf=L[2] // 2 + 1, kd=c.kernel[0], kh=c.kernel[1],
             kw=c.kernel[2], dd=c.dilation[0], dh=c.dilation[1], dw=c.dilation[2])
    pairs = a["Lh"] * a["Lwf"]
    taps = math.prod(c.kernel)

    def blocks(tile):
        return pairs * c.groups * ((a["cog"] + tile - 1) // tile)

    tile = 4
    while tile < 32 and tile < a["cog"]:
        tile *= 2
    while tile > 8 and blocks(tile // 2) <= SMS:
        tile //= 2
    per_slice = a["Ld"] * (tile // 4)
    if per_slice > MAX_THREADS:
        return None
    a["tile_co"], a["co_tiles"] = tile, c.groups * ((a["cog"] + tile - 1) // tile)
    slices = TILE_B
    while slices > 1 and (per_slice * slices > MAX_THREADS or slices > a["cig"]):
        slices //= 2
    a["slices"] = slices
    ci_bytes = tile * taps * 4
    piece = a["cig"]
    if a["cig"] * ci_bytes > 2 * TAP_BUFFER:
        most = max(1, TAP_BUFFER // ci_bytes)
        count = (a["cig"] + most - 1) // most
        piece = (a["cig"] + count - 1) // count
    a["piece_ci"], a["pieces"] = piece, (a["cig"] + piece - 1) // piece
    a["vec_taps"] = a["cog"] * taps % 4 == 0
    a["taps"] = taps
    a["quads"] = tile // 4
    a["threads"] = a["Ld"] * a["quads"] * slices
    a["blocks"] = pairs * a["co_tiles"]
    return a


def layout(a):
    """SmallLayout, offsets in bytes; checks that the regions used together do not overlap."""
    x_row = a["cig"] * TILE_B + 2
    piece_floats = a["piece_ci"] * a["tile_co"] * a["taps"]
    tw_d = 0
    tw_h = tw_d + a["Ld"] * a["kd"] * 8
    tw_w = tw_h + a["kh"] * 8
    w2 = up16(tw_w + a["kw"] * 8)
    xs = up16(w2 + a["kd"] * a["cig"] * a["tile_co"] * 8)
    taps = up16(xs + a["Ld"] * x_row * 8)
    data_end = taps + (2 if a["pieces"] > 1 else 1) * piece_floats * 4
    red = w2
    esum = up16(red + TILE_B * 4 * a["threads"] * 8)
    sums_end = esum + a["threads"] * 4 * 8
    lay = dict(tw_d=tw_d, tw_h=tw_h, tw_w=tw_w, w2=w2, xs=xs, taps=taps, red=red, esum=esum,
               x_row=x_row, piece_floats=piece_floats, bytes=max(data_end, sums_end))
    phase1 = [(tw_d, tw_h), (tw_h, tw_w), (tw_w, tw_w + a["kw"] * 8),
              (w2, w2 + a["kd"] * a["cig"] * a["tile_co"] * 8), (xs, xs + a["Ld"] * x_row * 8),
              (taps, data_end)]
    for (s0, e0), (s1, e1) in zip(phase1, phase1[1:]):
        assert e0 <= s1, (phase1, "phase-1 regions overlap")
    # After phase 2: red and esum (both past the twiddles, which are not read any more).
    assert red >= tw_w + a["kw"] * 8 and red + TILE_B * 4 * a["threads"] * 8 <= esum
    assert max(data_end, sums_end) <= lay["bytes"]
    # float4 reads: W2 rows (tile_co float2, a multiple of 4) and x rows.
    assert w2 % 16 == 0 and xs % 16 == 0 and (x_row * 8) % 16 == 0 and a["tile_co"] % 4 == 0
    assert taps % 16 == 0 and (piece_floats * 4) % 16 == 0  # 16-byte cp.async destinations
    return lay


def uses_small_kernel(c):
    """small_kernel_pays (csrc/fft/cuda/fft.cpp) for a stride-1 problem."""
    a = plan(c)
    if a is None:
        return False, None
    lay = layout(a)
    rereads = a["Lh"] * a["Lwf"] * c.ci * a["cog"] * a["taps"] * 4
    return lay["bytes"] <= SMEM_LIMIT and rereads <= MAX_REREAD, (a, lay, rereads)


def twiddle(f, t, L, cdt):
    """csrc/common/cuda/complex.cuh twiddle: exp(-2 pi i ((f t) mod L) / L)."""
    m = (np.asarray(f) * np.asarray(t)) % L
    return np.exp(-2j * np.pi * m / L).astype(cdt)


def cfma(acc, a, b):
    return acc + a * b


def column_sum(v, rows, stride):
    """column_sum: four chains of rows r = q (mod 4), then (p0 + p1) + (p2 + p3)."""
    part, full = [0.0] * 4, rows // 4 * 4
    for r in range(full):
        part[r % 4] += v[r * stride]
    for r in range(full, rows):
        part[0] += v[r * stride]
    return (part[0] + part[1]) + (part[2] + part[3])


def kernel_model(x_spec, weight, a, lay, cdt):
    """energy [Co, Lh * Lwf] as the kernel writes it."""
    fdt = np.float32 if cdt == np.complex64 else np.float64
    B, Ci, cig, cog, Ld, Lh, Lwf, Lw = (a[k] for k in ("batch", "ci", "cig", "cog", "Ld", "Lh",
                                                        "Lwf", "Lw"))
    kd_n, kh_n, kw_n, taps, tile, Q, S, T = (a[k] for k in ("kd", "kh", "kw", "taps", "tile_co",
                                                            "quads", "slices", "threads"))
    x_flat, w_flat = x_spec.reshape(-1), weight.reshape(-1).astype(fdt)
    groups = Ci // cig
    energy = np.full((groups * cog, Lh * Lwf), np.nan)
    inv_size = 1.0 / (Ld * Lh * Lw)
    x_row = lay["x_row"]
    t = np.arange(T)
    fd_t, quad_t, slice_t = t % Ld, (t // Ld) % Q, t // (Ld * Q)  # SmallThread
    for block in range(a["blocks"]):
        per_group = (cog + tile - 1) // tile  # SmallBlock
        tile_i, pair = block % a["co_tiles"], block // a["co_tiles"]
        group, co0 = tile_i // per_group, (tile_i % per_group) * tile
        fh, fw = pair // Lwf, pair % Lwf
        i = np.arange(Ld * kd_n)
        tw_d = twiddle(i // kd_n, (i % kd_n) * a["dd"], Ld, cdt)
        tw_h = twiddle(fh, np.arange(kh_n) * a["dh"], Lh, cdt)
        tw_w = twiddle(fw, np.arange(kw_n) * a["dw"], Lw, cdt)
        # stage_x_small
        xs = np.full(Ld * x_row, np.nan, dtype=cdt)
        i = np.arange(Ld * cig * TILE_B)
        b, ci, fd = i % TILE_B, (i // TILE_B) % cig, i // (TILE_B * cig)
        fd_stride = Lh * Lwf * B * Ci
        ok = b < B
        src = (fh * Lwf + fw) * B * Ci + fd * fd_stride + b * Ci + group * cig + ci
        xs[fd * x_row + ci * TILE_B + b] = np.where(ok, x_flat[np.where(ok, src, 0)], 0)
        # phase 1: stage_taps and build_w2, piece by piece
        w2 = np.full(kd_n * cig * tile, np.nan, dtype=cdt)
        bufs = [np.full(lay["piece_floats"], np.nan, dtype=fdt) for _ in range(2)]
        run, valid = tile * taps, min(tile, cog - co0) * taps
        step = 4 if a["vec_taps"] else 1
        for p in range(a["pieces"]):
            c0 = p * a["piece_ci"]
            buf = bufs[p & 1]
            i = np.arange(0, a["piece_ci"] * run, step)
            k, o = i // run, i % run
            ok = (c0 + k < cig) & (o < valid)
            first = ((group * cig + c0) * cog + co0) * taps
            for v in range(step):  # the floats of one copy
                src = first + k * cog * taps + o + v
                buf[i + v] = np.where(ok, w_flat[np.where(ok, src, 0)], 0)
            count = min(cig - c0, a["piece_ci"]) * kd_n * tile
            r = np.arange(count)
            co, kd, k = r % tile, (r // tile) % kd_n, r // (tile * kd_n)
            base = (k * tile + co) * taps + kd * kh_n * kw_n
            acc = np.zeros(count, dtype=cdt)
            for kh in range(kh_n):
                row = np.zeros(count, dtype=cdt)
                for kw in range(kw_n):
                    row = row + buf[base + kh * kw_n + kw] * tw_w[kw]
                acc = cfma(acc, row, tw_h[kh])
            w2[(kd * cig + c0 + k) * tile + co] = acc
        # phase 2: multiply_small, all threads at once
        acc = np.zeros((T, 8, 4), dtype=cdt)
        for m in range((cig + S - 1) // S):
            ci = slice_t + m * S
            live = ci < cig
            ci = np.where(live, ci, 0)
            wv = np.zeros((T, 4), dtype=cdt)
            for kd in range(kd_n):
                tw = tw_d[fd_t * kd_n + kd]
                rows = (kd * cig + ci) * tile + quad_t * 4
                wv = cfma(wv, w2[rows[:, None] + np.arange(4)], tw[:, None])
            xv = xs[(fd_t * x_row + ci * TILE_B)[:, None] + np.arange(8)]
            acc = np.where(live[:, None, None], cfma(acc, xv[:, :, None], wv[:, None, :]), acc)
        # square_slices
        red = np.full(32 * T, np.nan, dtype=cdt)
        for ii in range(8):
            for j in range(4):
                red[(ii * 4 + j) * T + t] = acc[:, ii, j]
        share, slice_stride = TILE_B // S, Ld * Q
        first = fd_t + Ld * quad_t
        weight_w = 1.0 if fw == 0 or 2 * fw == Lw else 2.0
        keep = ~((fd_t == 0) & (fh == 0) & (fw == 0))
        e = np.zeros((T, 4))
        for j in range(4):
            sq = np.zeros(T, dtype=fdt)
            for bb in range(share):
                b = slice_t * share + bb
                y = red[(b * 4 + j) * T + first]
                for s in range(1, S):
                    y = y + red[(b * 4 + j) * T + first + s * slice_stride]
                sq = sq + (y.real * y.real + y.imag * y.imag)
            e[:, j] = np.where(keep, (fdt(weight_w) * sq).astype(np.float64), 0.0)
        esum = np.full(Ld * S * tile, np.nan)
        row = fd_t + Ld * slice_t
        for j in range(4):
            esum[row * tile + quad_t * 4 + j] = e[:, j]
        for c in range(min(tile, cog - co0)):
            energy[group * cog + co0 + c, fh * Lwf + fw] = column_sum(esum[c:], Ld * S,
                                                                      tile) * inv_size
    return energy


def spectra(x, w, c):
    """x's spectrum [Ld, Lh, Lwf, B, Ci] and the weight's [Ld, Lh, Lwf, Ci, Cog] (numpy FFTs)."""
    L = c.grid()
    x_spec = np.fft.rfftn(x, s=L, axes=(2, 3, 4)).transpose(2, 3, 4, 0, 1)
    dil = np.zeros(w.shape[:2] + L)
    d = c.dilation
    dil[:, :, :d[0] * (c.kernel[0] - 1) + 1:d[0], :d[1] * (c.kernel[1] - 1) + 1:d[1],
        :d[2] * (c.kernel[2] - 1) + 1:d[2]] = w
    w_spec = np.fft.fftn(dil, axes=(2, 3, 4))[..., :L[2] // 2 + 1].transpose(2, 3, 4, 0, 1)
    return x_spec, w_spec


def reference(x_spec, w_spec, c):
    """[Co, Lh * Lwf]: sum_fd sum_b weight |sum_ci X W|^2 / N, DC bin out."""
    L, g = c.grid(), c.groups
    cig, cog = c.ci // g, c.co // g
    xs = x_spec.reshape(*x_spec.shape[:4], g, cig)
    ws = w_spec.reshape(*w_spec.shape[:3], g, cig, cog)
    y = np.einsum("dhwbgi,dhwgio->dhwbgo", xs, ws)
    power = np.abs(y) ** 2
    power[0, 0, 0] = 0
    lw = L[2]
    weight = np.where((np.arange(lw // 2 + 1) == 0) | (2 * np.arange(lw // 2 + 1) == lw), 1.0, 2.0)
    e = (power * weight[None, None, :, None, None, None]).sum((0, 3)) / math.prod(L)
    return e.reshape(L[1] * (lw // 2 + 1), c.co).T


def conv_energy(x, w, c):
    """Centred energy of conv_transpose3d (torch, float64), summed over b, per channel."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    y = F.conv_transpose3d(torch.from_numpy(x), torch.from_numpy(w), groups=c.groups,
                           dilation=c.dilation)
    return (y - y.mean((2, 3, 4), keepdim=True)).square().sum((0, 2, 3, 4)).numpy()


CASES = [
    Case("t8c32", 8, 32, 32, (8, 8, 8), (3, 3, 3)),
    Case("t8c64", 8, 64, 64, (8, 8, 8), (3, 3, 3)),
    Case("t8k5", 8, 32, 32, (8, 8, 8), (5, 5, 5)),
    Case("batch 3, Ci 5", 3, 5, 32, (8, 8, 8), (3, 3, 3)),
    Case("batch 5, odd Ci 7, Co 9", 5, 7, 9, (5, 6, 7), (3, 2, 4)),
    Case("groups 2, Cog 33", 2, 12, 66, (3, 4, 6), (2, 2, 3), groups=2),
    Case("groups 2, t8 k5", 3, 64, 32, (8, 8, 8), (5, 5, 5), groups=2),
    Case("dilation 2", 4, 6, 10, (5, 6, 7), (3, 3, 3), dilation=(2, 2, 2)),
    Case("dilation (2, 1, 3)", 2, 4, 6, (3, 4, 5), (2, 3, 2), dilation=(2, 1, 3)),
    Case("4-byte taps, 3 pieces", 3, 24, 9, (4, 5, 6), (5, 5, 5)),
    Case("partial tile, uneven pieces", 2, 50, 36, (8, 8, 8), (3, 3, 3)),
    Case("Ld 32", 2, 5, 9, (30, 3, 4), (3, 2, 2)),
    Case("batch 1, kernel 1", 1, 3, 4, (2, 3, 4), (1, 1, 1)),
]

def run(case, seed=0):
    """The model against numpy's FFTs (and the convolution's centred energy) for one case, in
    float64 (index arithmetic) and float32 (the kernel's precision)."""
    rng = np.random.default_rng(seed)
    a = plan(case)
    assert a is not None, case.name
    lay = layout(a)
    x = rng.standard_normal((case.batch, case.ci) + case.size) + 0.5
    w = rng.standard_normal((case.ci, case.co // case.groups) + case.kernel)
    x_spec, w_spec = spectra(x, w, case)
    want = reference(x_spec, w_spec, case)
    conv = conv_energy(x, w, case)
    if conv is not None:
        assert np.abs(want.sum(1) - conv).max() <= 1e-9 * np.abs(conv).max(), case.name
    for cdt, bound in ((np.complex128, 1e-12), (np.complex64, 1e-6)):
        got = kernel_model(x_spec.astype(cdt), w, a, lay, cdt)
        assert not np.isnan(got).any(), f"{case.name}: an entry not written or a NaN read"
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        err_sum = np.abs(got.sum(1) - want.sum(1)).max() / np.abs(want.sum(1)).max()
        assert max(err, err_sum) <= bound, (case.name, cdt, err, err_sum)
