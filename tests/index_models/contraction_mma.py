"""A numpy model of csrc/cross_spectrum/cuda/cross_spectrum_quad_form_mma.cu (docs/math.md §3.5, the fused contraction): its
blocks (bin, group, row tile, column tile), the pieces each thread stages per chunk (R^'s
complex values, 16 bytes each, and W's rows; cp.async's zeros past Cig, R and C; shared memory
never staged is NaN, so reading it shows), the chunks from the last down to the block's own rows
with the sums doubled before the diagonal tile, mma.m16n8k8's fragment layouts (mma_f64.cuh)
with each thread's A elements taken from the staged complex values (its component and sign by
the parities of lane/4 and lane%4) and the banks those loads hit, the epilogue's weights from
the last two chunks staged, the shuffles over lane/4 and the two halves' sum, and the grid's
order (pair-major, then the last pairs' blocks, two waves' worth, by row tile). Checked against
the complex formula sum_g mirror[g_w] Re(W_c^H R^ W_c), W_c the complex values of W's
interleaved rows (Re, Im of channel 0, Re, Im of channel 1, ...), on random Hermitian R^ for
several R = 2 Cig, C, groups, chunks of columns (phase_energies' calls) and wave sizes (no tail,
part, all), and each partial sum written once.

    (run by tests/test_index_models.py)
"""
import numpy as np

TILE, CHUNK, WARP_TILE, THREADS, MMA_K = 64, 32, 32, 128, 8
H200_WAVE = 132 * 3  # SMs times blocks per SM (kBlocksPerSm)
PITCH_B, PITCH_W = CHUNK + 4, TILE + 4
LANE = np.arange(32)
G, T4 = LANE // 4, LANE % 4


def tiles(n):
    return (n + TILE - 1) // TILE


def grid_order(pairs, row_tiles, col_tiles, wave):
    """quad_forms_mma_cuda's tail_pairs and head_blocks, and Item: block x's (pair, row tile, col tile)."""
    per_pair = row_tiles * col_tiles
    tail_pairs = min(pairs, (2 * wave + per_pair - 1) // per_pair)
    head_blocks = (pairs - tail_pairs) * per_pair
    order = []
    for x in range(pairs * per_pair):
        if x < head_blocks:
            order.append((x // col_tiles // row_tiles, x // col_tiles % row_tiles, x % col_tiles))
        else:
            y, per_row_tile = x - head_blocks, tail_pairs * col_tiles
            order.append((pairs - tail_pairs + y % per_row_tile // col_tiles, y // per_row_tile,
                          y % per_row_tile % col_tiles))
    assert sorted(order) == [(p, r, c) for p in range(pairs) for r in range(row_tiles) for c in range(col_tiles)]
    return order


def stage_chunk(b, w, rows, cols, row0, col0, k0, width, smem_b, smem_w):
    """Pieces and stage_chunk: R^'s complex rows of the block (b: [Cig, 2 Cig] doubles, a
    complex value's real and imaginary parts adjacent) and W's rows k0.. into one buffer."""
    tid = np.arange(THREADS)
    r, k = tid // (CHUNK // 2), 2 * (tid % (CHUNK // 2))  # a complex row, a complex value's doubles
    for n in range(TILE // 2 * CHUNK // 2 // THREADS):
        step = THREADS // (CHUNK // 2)
        for t in tid:
            valid = k[t] < rows - k0 and n * step < rows // 2 - row0 // 2 - r[t]
            to = r[t] * PITCH_B + k[t] + n * step * PITCH_B
            smem_b[to:to + 2] = b[row0 // 2 + r[t] + n * step, k0 + k[t]:k0 + k[t] + 2] if valid else 0
    w_row, c = tid // (TILE // width), width * (tid % (TILE // width))
    step = THREADS // (TILE // width)
    for n in range(CHUNK * TILE // width // THREADS):
        for t in tid:
            valid = col0 + c[t] < cols and n * step < rows - k0 - w_row[t]
            to = w_row[t] * PITCH_W + c[t] + n * step * PITCH_W
            row = k0 + w_row[t] + n * step
            smem_w[to:to + width] = w[row, col0 + c[t]:col0 + c[t] + width] if valid else 0


def mma(d, a, b):
    """d[e][lane] += the 16 x 8 by 8 x 8 product of the fragments a[v][lane], b[v][lane]."""
    am, bm, dm = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
    for v in range(4):
        am[G + 8 * (v % 2), T4 + 4 * (v // 2)] = a[v]
        dm[G + 8 * (v // 2), 2 * T4 + v % 2] = d[v]
    for v in range(2):
        bm[T4 + 4 * v, G] = b[v]
    dm = dm + am @ bm
    for e in range(4):
        d[e] = dm[G + 8 * (e // 2), 2 * T4 + e % 2]


def fragment_source():
    """multiply_chunk's A elements from the staged complex values: real row 2i + a, column 2k + b
    of R^'s real form is Re R^[i, k] (a = b), -Im (a = 0, b = 1) or Im (a = 1, b = 0); a
    thread's a and b are the parities of lane/4 and lane%4 for all its elements. Its first
    element's offset in a buffer (complex row lane/8 of the warp's, the double of lane%4's
    complex column and of its component) and its sign."""
    offset = G // 2 * PITCH_B + (T4 & 2) + ((G ^ T4) & 1)
    sign = np.where((G % 2 == 0) & (T4 % 2 == 1), -1.0, 1.0)
    # A warp's load of one element: 16 distinct doubles (each read by two lanes), in 16
    # distinct pairs of 4-byte banks: one wavefront.
    assert len(set(offset)) == 16 and len(set(offset % 16)) == 16
    return offset, sign


def block(b, w, rows, cols, row_tile, col_tile, width):
    """One block's 64 column sums (before mirror), and its DMMA count."""
    row0, col0 = TILE * row_tile, TILE * col_tile
    chunks = (rows - row0 + CHUNK - 1) // CHUNK
    offset, sign = fragment_source()
    smem_b = np.full((2, TILE // 2 * PITCH_B), np.nan)
    smem_w = np.full((2, CHUNK * PITCH_W), np.nan)
    acc = np.zeros((4, 2, 4, 4, 32))  # [warp][m][n][e][lane]
    warps = [(warp // 2, WARP_TILE * (warp // 2), WARP_TILE * (warp % 2)) for warp in range(4)]
    active = [row0 + wr < rows and col0 + wc < cols for _, wr, wc in warps]
    dmma = 0
    stage_chunk(b, w, rows, cols, row0, col0, row0 + (chunks - 1) * CHUNK, width, smem_b[0], smem_w[0])
    for t in range(chunks - 1, -1, -1):
        buf = (chunks - 1 - t) & 1
        if t > 0:
            stage_chunk(b, w, rows, cols, row0, col0, row0 + (t - 1) * CHUNK, width, smem_b[buf ^ 1], smem_w[buf ^ 1])
        if t == TILE // CHUNK - 1:
            acc *= 2
        for warp, (_, wr, wc) in enumerate(warps):
            if not active[warp]:
                continue
            bs = wr // 2 * PITCH_B + offset
            ws = T4 * PITCH_W + wc + G
            for k in range(0, CHUNK, MMA_K):
                af = [[sign * smem_b[buf][bs + (8 * m + 4 * (v % 2)) * PITCH_B + k + 4 * (v // 2)] for v in range(4)]
                      for m in range(2)]
                bf = [[smem_w[buf][ws + (k + 4 * v) * PITCH_W + 8 * n] for v in range(2)] for n in range(4)]
                for m in range(2):
                    for n in range(4):
                        mma(acc[warp, m, n], af[m], bf[n])
                        dmma += 1
    column_sums = np.full((2, TILE), np.nan)
    for warp, (half, _, wc) in enumerate(warps):
        sums = np.zeros((4, 2, 32))
        if active[warp]:
            wv = G * PITCH_W + wc + 2 * T4
            buf = (chunks - 1 - half) & 1
            for m in range(2):
                for h in range(2):
                    for n in range(4):
                        at = wv + (16 * m + 8 * h) * PITCH_W + 8 * n
                        sums[n, 0] += acc[warp, m, n, 2 * h] * smem_w[buf][at]
                        sums[n, 1] += acc[warp, m, n, 2 * h + 1] * smem_w[buf][at + 1]
        for s in (4, 8, 16):
            sums = sums + sums[:, :, LANE ^ s]
        for lane in range(4):  # g == 0
            for n in range(4):
                for j in range(2):
                    column_sums[half, wc + 8 * n + 2 * lane + j] = sums[n, j, lane]
    return column_sums[0] + column_sums[1], dmma


def kernel(b, w, mirror, wave):
    """quad_forms_mma_cuda: b [bins, G, Cig, Cig] complex, w [bins, G, R, C] -> partial [bins row_tiles, G, C]."""
    bins, groups, rows, cols = w.shape
    row_tiles, col_tiles = tiles(rows), tiles(cols)
    width = 2 if cols % 2 == 0 else 1
    partial = np.full((bins * row_tiles, groups, cols), np.nan)
    written = np.zeros(partial.shape, int)
    dmma = 0
    for pair, row_tile, col_tile in grid_order(bins * groups, row_tiles, col_tiles, wave):
        bin_, group = pair // groups, pair % groups
        b_doubles = b[bin_, group].view(np.float64)  # [Cig, 2 Cig]: as the kernel reads it
        sums, count = block(b_doubles, w[bin_, group], rows, cols, row_tile, col_tile, width)
        dmma += count
        for c in range(TILE):
            if TILE * col_tile + c < cols:
                at = (bin_ * row_tiles + row_tile, group, TILE * col_tile + c)
                partial[at] = mirror[bin_ % len(mirror)] * sums[c]
                written[at] += 1
    assert (written == 1).all()
    return partial, dmma


def random_spectrum(rng, bins, groups, cig):
    """R^ of Hermitian matrices, complex128 [bins, G, Cig, Cig] (correlation_blocks')."""
    z = rng.standard_normal((bins, groups, cig, cig)) + 1j * rng.standard_normal((bins, groups, cig, cig))
    return np.ascontiguousarray(z + np.conj(np.swapaxes(z, -1, -2)))


def check(rng, grid, groups, cig, cols, chunk, wave):
    mw = grid[2]
    bins = grid[0] * grid[1] * grid[2]
    b = random_spectrum(rng, bins, groups, cig)
    w = rng.standard_normal((bins, groups, 2 * cig, cols))
    mirror = rng.uniform(0.5, 2.0, mw)
    wc = w[:, :, 0::2] + 1j * w[:, :, 1::2]  # row 2k: Re W_k, row 2k + 1: Im W_k
    direct = np.einsum("g,gakc,gakc->ac", mirror[np.arange(bins) % mw], np.conj(wc), b @ wc).real
    got = np.empty_like(direct)
    for c0 in range(0, cols, chunk):  # phase_energies' chunks of columns, a call each
        partial, _ = kernel(b, np.ascontiguousarray(w[..., c0:c0 + chunk]), mirror, wave)
        assert not np.isnan(partial).any()
        got[:, c0:c0 + chunk] = partial.sum(0)
    err = np.abs(got - direct).max() / np.abs(direct).max()
    print(f"R {2 * cig:4d}, C {cols:4d} in chunks of {chunk:4d}, groups {groups}, bins {bins}, wave {wave:3d}: "
          f"rel. error {err:.1e}")
    assert err < 1e-12, err


CASES = [  # (cig, cols, groups, grid, chunk), wave
    ((64, 128, 1, (3, 1, 2), 128), H200_WAVE), ((64, 37, 3, (1, 2, 2), 37), 5),
    ((64, 200, 1, (1, 1, 2), 80), 1), ((5, 128, 3, (3, 1, 2), 50), 4),
    ((5, 37, 1, (3, 3, 2), 37), 2), ((5, 200, 3, (1, 1, 2), 200), H200_WAVE),
    ((36, 128, 3, (1, 1, 2), 128), 3), ((36, 37, 1, (3, 1, 2), 20), 6),
    ((36, 200, 1, (1, 3, 2), 200), 1)]


def run(case, seed=7):
    (cig, cols, groups, grid, chunk), wave = case
    check(np.random.default_rng(seed), grid, groups, cig, cols, chunk, wave)
